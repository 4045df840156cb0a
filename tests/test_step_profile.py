"""memjax/bench/step_profile.py: which model code an op computes, and the sweep that turns a trace's
op events into a step's time by category, adding up to the traced span (the whole trace on a CPU:
tests/test_bench_accel.py)."""

import pytest

from memjax.bench import hlo as hlo_lib
from memjax.bench import step_profile
from memjax.bench import workload
from memjax.bench.suites import accel

LAYER = 'jit(step)/transpose(jvp(MemoryLM))/while/body/closed_call/layers/layers.compute'


@pytest.mark.parametrize('op_name, multiplies, expected', [
    (f'{LAYER}/attention/dot_general', True, step_profile.ATTENTION),  # Scores or weighted values.
    (f'{LAYER}/attention/exp', False, step_profile.ATTENTION),
    (f'{LAYER}/attention/Dropout_0/select_n', False, step_profile.ATTENTION),
    (f'{LAYER}/attention/query/dot_general', True, step_profile.DENSE),
    (f'{LAYER}/attention/pos/dot_general', True, step_profile.DENSE),
    (f'{LAYER}/attention/layer_norm/mul', False, step_profile.ELEMENTWISE),
    (f'{LAYER}/feed_forward/inner/dot_general', True, step_profile.DENSE),
    (f'{LAYER}/feed_forward/inner/add', False, step_profile.ELEMENTWISE),
    ('jit(step)/jvp(MemoryLM)/io.target_logprobs/io._tail_logprobs/while/body/exp', False, step_profile.SOFTMAX),
    ('jit(step)/transpose(jvp(MemoryLM))/io.embed/dot_general', True, step_profile.SOFTMAX),
    ('jit(step)/div', False, step_profile.OPTIMIZER),  # Adam's update, outside the model.
    (None, False, step_profile.UNATTRIBUTED),  # A layout copy XLA made.
])
def test_an_op_is_counted_by_the_model_code_it_computes(op_name, multiplies, expected):
    assert step_profile.category(op_name, multiplies) == expected


def test_a_training_steps_ops_fall_in_every_category_of_the_model():
    step = accel.SETUPS['tiny']['profile'][0]
    mcfg = workload.model_config(None, mem_len=step.tgt_len, dropout=0.1, dropatt=0.1, scan_layers=True, **step.model)
    case = workload.train_case(workload.build(mcfg, step.batch, step.tgt_len))
    found = set(step_profile.op_categories(case.compiled.executable.as_text()).values())
    assert found == {step_profile.ATTENTION, step_profile.DENSE, step_profile.SOFTMAX, step_profile.ELEMENTWISE,
                     step_profile.OPTIMIZER, step_profile.UNATTRIBUTED}


def test_the_sweep_splits_overlaps_evenly_and_counts_gaps_as_idle():
    event = step_profile.Event
    seconds, span = step_profile.sweep([
        event(100, 110, step_profile.ATTENTION), event(105, 115, step_profile.DENSE),
        event(105, 115, step_profile.DENSE), event(120, 130, step_profile.OPTIMIZER),
        event(130, 134, step_profile.COPIES)])
    assert span == pytest.approx(34e-9)
    # 100-105 attention alone; 105-110 attention and two dense ops (a third each); 110-115 dense.
    assert seconds[step_profile.ATTENTION] == pytest.approx((5 + 5 / 3) * 1e-9)
    assert seconds[step_profile.DENSE] == pytest.approx((10 / 3 + 5) * 1e-9)
    assert seconds[step_profile.IDLE] == pytest.approx(5e-9)  # 115-120.
    assert seconds[step_profile.OPTIMIZER] == pytest.approx(10e-9)
    assert seconds[step_profile.COPIES] == pytest.approx(4e-9)
    assert sum(seconds.values()) == pytest.approx(span)
    assert set(seconds) == set(step_profile.CATEGORIES)


def test_products_are_found_however_a_chip_lowers_them():
    """A CPU's dots, a GPU's cuBLAS calls, a TPU's convolutions: each counts as a product."""
    hlo = """
  %a = f32[4,16]{1,0} parameter(0)
  %b = f32[16,8]{1,0} parameter(1)
  %dot.1 = f32[4,8]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %custom-call.2 = (bf16[4,8]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"
  %convolution.3 = bf16[4,8]{1,0} convolution(%a, %b), dim_labels=bf_io->bf
  %custom-call.4 = f32[4,16]{1,0} custom-call(%a), custom_call_target="Sharding"
  %add.5 = f32[4,8]{1,0} add(%dot.1, %dot.1)
"""
    assert hlo_lib.matmul_ops(hlo) == {'dot.1', 'custom-call.2', 'convolution.3'}


def test_layer_norm_under_remat_is_elementwise_not_attention():
    assert step_profile.category(f'{LAYER}/attention/checkpoint/rematted_computation/layer_norm/mul', False) == (
        step_profile.ELEMENTWISE)
    assert step_profile.category(f'{LAYER}/attention/checkpoint/query/dot_general', True) == step_profile.DENSE
