"""The `accel` suite at --size=tiny on CPU (the code a GPU job runs), the datasheet table and the
MFU arithmetic: every figure is recomputed here from what the row says it measured."""

import importlib.util
import json
import os
import subprocess
import sys

import jax
import pytest

from memjax import config_lib
from memjax.bench import chips
from memjax.bench import flops
from memjax.bench import harness
from memjax.bench import step_profile
from memjax.bench import workload
from memjax.bench.suites import accel
from memjax.bench.suites import peak
from memjax.bench.suites import peer as peer_lib
from memjax.model import memories

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ('torch', 'transformers'))
pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning', 'ignore::FutureWarning',
                                        'ignore::UserWarning')


# The profile part names XLA:CPU's ops only with a flag set before JAX starts: it runs from the
# command line (test_the_profile_adds_up_to_the_traced_step_and_keeps_its_trace).
IN_PROCESS = tuple(p for p in accel.DEFAULT_PARTS if p != 'profile' and (HAVE_TORCH or p != 'peer'))


@pytest.fixture(scope='module')
def report():
    parts = IN_PROCESS
    cache = jax.config.jax_enable_compilation_cache
    result = harness.run_suite('accel', harness.Context(size='tiny', warmup=0, repeats=1, parts=parts),
                               command=['test'])
    assert jax.config.jax_enable_compilation_cache == cache  # Turned off for the suite only.
    return result


def rows(report, part):
    return [r for r in report['rows'] if r['part'] == part]


def test_every_part_runs_and_reports_its_rows(report):
    assert {r['part'] for r in report['rows']} == set(IN_PROCESS)
    assert not [r for r in report['rows'] if 'error' in r]
    assert report['figures']['persistent_compilation_cache'] == 'off'


def test_throughput_rows_are_their_own_arithmetic(report):
    """tokens/s, TFLOP/s and MFU follow from each row's step time, FLOPs and the peak part's best
    product of the same dtype; no datasheet MFU on a CPU."""
    best = {dtype: max(r['tflops_per_s'] for r in rows(report, 'peak') if r['dtype'] == dtype)
            for dtype in peak.DTYPES}
    assert best['float32'] * 1e3 == pytest.approx(report['figures']['peak_tflops_per_s_float32'] * 1e3)
    timed = [r for r in report['rows'] if r['part'] not in ('peak', 'roofline')]
    assert timed
    for r in timed:
        step_s = r['step_ms'] / 1e3
        assert r['tokens_per_s'] == pytest.approx(r['batch'] * r['tgt_len'] / step_s)
        assert r['tflops_per_s'] == pytest.approx(r['model_flops_per_step'] / step_s / 1e12)
        assert r['mfu_percent'] == pytest.approx(100 * r['tflops_per_s'] / best[r['dtype']])
        assert r['mfu_datasheet_percent'] is None
    for r in rows(report, 'train') + rows(report, 'eval') + rows(report, 'methods') + rows(report, 'choices'):
        assert r['step_memory_gib'] > 0 and r['compile_s'] > 0


def test_train_rows_count_the_model_flops_of_both_dtypes(report):
    train = rows(report, 'train')
    assert {r['dtype'] for r in train} == {'bfloat16', 'float32'}
    for r in train:
        mcfg = workload.model_config(None, **r['model'])
        assert mcfg.scan_layers and mcfg.mem_len == r['tgt_len']
        assert r['model_flops_per_step'] == flops.train_step_flops(mcfg, r['batch'], r['tgt_len'])


def test_each_training_step_is_timed_without_dropout_in_both_dtypes_and_with_its_configs_in_bf16(report):
    for step in accel.SETUPS['tiny']['train']:
        timed = {(r['dtype'], r['model']['dropout'], r['model']['dropatt']) for r in rows(report, 'train')
                 if r['case'].startswith(step.name)}
        assert step.dropout != (0.0, 0.0)
        assert timed == {('bfloat16', 0.0, 0.0), ('float32', 0.0, 0.0), ('bfloat16', *step.dropout)}


def test_the_roofline_times_every_product_shape_of_the_training_rows_and_weighs_them_by_count(report):
    best = max(r['tflops_per_s'] for r in rows(report, 'peak') if r['dtype'] == 'bfloat16')
    by_shape = {}
    for r in rows(report, 'roofline'):
        if not r['case'].endswith('every product'):
            batch, m, k, n = map(int, r['case'].split()[-1].split('x'))
            by_shape[batch, m, k, n] = r
            assert r['tflops_per_s'] == pytest.approx(2 * batch * m * k * n / (r['step_ms'] / 1e3) / 1e12)
            assert r['mfu_percent'] == pytest.approx(100 * r['tflops_per_s'] / best)
    for step in accel.SETUPS['tiny']['train']:
        products = flops.training_products(workload.model_config(None, mem_len=step.tgt_len, **step.model),
                                           step.batch, step.tgt_len)
        assert {p.shape for p in products} <= set(by_shape)
        total = next(r for r in rows(report, 'roofline') if r['case'] == f'{step.name} every product')
        assert total['step_ms'] == pytest.approx(sum(by_shape[p.shape]['step_ms'] * p.count for p in products))
        train = next(r for r in rows(report, 'train') if r['case'] == step.name and r['dtype'] == 'bfloat16')
        assert total['ratio'] == pytest.approx(total['step_ms'] / train['step_ms'] * train['batch'] / step.batch)


def test_the_products_of_a_training_step_are_its_model_flops():
    for setup in accel.SETUPS.values():
        for step in setup['train']:
            mcfg = workload.model_config(None, mem_len=step.tgt_len, **step.model)
            products = flops.training_products(mcfg, step.batch, step.tgt_len)
            assert sum(p.flops for p in products) == pytest.approx(flops.train_step_flops(mcfg, step.batch, step.tgt_len))


def test_eval_rows_run_the_papers_protocol_on_the_evaluation_model(report):
    setup = accel.SETUPS['tiny']
    for r in rows(report, 'eval'):
        mcfg = workload.model_config(None, **r['model'])
        assert (mcfg.memory, mcfg.mem_len, mcfg.clamp_len, mcfg.same_length) == (
            'xl_cached', setup['eval_model']['mem_len'], setup['eval_model']['clamp_len'], True)
        assert r['model_flops_per_step'] == sum(flops.forward_flops(mcfg, r['batch'], r['tgt_len']).values())


def test_methods_ratios_are_against_xl_at_the_same_shape(report):
    methods = {r['case'].split()[-1]: r for r in rows(report, 'methods')}
    assert set(methods) == {'xl', 'lamemo', 'infinity', f"d_head={accel.SETUPS['tiny']['aligned_d_head']}"}
    xl = methods['xl']
    for name in ('lamemo', 'infinity'):
        r = methods[name]
        assert workload.model_config(None, **r['model']).memory == name
        assert r['ratio'] == pytest.approx(r['step_ms'] / xl['step_ms'])
        assert r['flops_ratio'] == pytest.approx(r['model_flops_per_step'] / xl['model_flops_per_step'])
        assert r['flops_ratio'] > 1  # Both add work to XL's.


def test_attention_variants_compute_the_same_attention_before_their_timing(report):
    attention = {r['case']: r for r in rows(report, 'attention')}
    assert set(attention) == {'memjax relative', 'fused + position bias', 'fused plain (no position term)'}
    assert attention['memjax relative']['max_abs_diff_vs_memjax'] == 0.0
    # Transformer-XL's attention with its positional term as the fused kernel's bias: the same
    # outputs to bf16 rounding (values of size ~1); without the term, another attention.
    assert attention['fused + position bias']['max_abs_diff_vs_memjax'] < 0.05
    assert attention['fused plain (no position term)']['max_abs_diff_vs_memjax'] > 0.1
    for r in attention.values():
        assert r['ratio'] == pytest.approx(r['step_ms'] / attention['memjax relative']['step_ms'])


def test_fused_rows_compute_xlas_attention_and_compare_each_path_in_the_steps(report):
    fused = rows(report, 'fused')
    alone = [r for r in fused if r['case'].startswith(('xla ', 'fused '))]
    lengths = accel.SETUPS['tiny']['fused_lengths']
    assert len(alone) == 4 * len(lengths)
    by_case = {r['case']: r for r in alone}
    for length in lengths:
        for mode in ('forward', 'forward+backward'):
            xla, kernel = by_case[f'xla {mode} tgt = mem = {length}'], by_case[f'fused {mode} tgt = mem = {length}']
            assert kernel['max_abs_diff_vs_xla'] < 0.05  # bf16 rounding of outputs of size ~1.
            assert kernel['ratio'] == pytest.approx(kernel['step_ms'] / xla['step_ms'])
            assert kernel['memory_ratio'] == pytest.approx(kernel['step_memory_gib'] / xla['step_memory_gib'])
    steps = [r for r in fused if r not in alone]
    impls = [workload.model_config(None, **r['model']).attention_impl for r in steps]
    assert impls == ['reference', 'fused'] * (len(steps) // 2) and len(steps) == 4  # A train step, the evaluation.
    for reference, kernel in zip(steps[::2], steps[1::2]):
        assert kernel['ratio'] == pytest.approx(kernel['step_ms'] / reference['step_ms'])


def test_choices_are_per_token_ratios_against_the_train_row(report):
    base = next(r for r in rows(report, 'train') if r['dtype'] == 'bfloat16')
    choices = rows(report, 'choices')
    assert [(r['scan_layers'], r['donated'], r['remat']) for r in choices] == [
        (False, True, 'none'), (True, False, 'none'), (True, True, 'dots_saveable')]
    for r in choices:
        assert r['vs'] == base['case']
        assert r['ratio'] == pytest.approx(r['step_ms'] / r['batch'] / (base['step_ms'] / base['batch']))


@pytest.mark.skipif(not HAVE_TORCH, reason="the peer part needs torch and transformers: pip install -e '.[parity]'")
def test_peer_rows_check_the_same_model_then_time_it(report):
    peer = rows(report, 'peer')
    assert {tuple(r['case'].split()[-2:]) for r in peer} == {(m, i) for m in ('train', 'eval')
                                                             for i in ('memjax', 'hf_eager')}
    for r in peer:
        assert r['max_abs_logprob_diff'] < 1e-3 and r['hf_params'] == r['memjax_params']
        ours = next(o for o in peer if o['case'].split()[-2:] == [r['case'].split()[-2], 'memjax'])
        assert r['ratio'] == pytest.approx(r['step_ms'] / ours['step_ms'])
        assert r['dtype'] == 'bfloat16'
    # Model FLOPs of what memjax runs: evaluation the model memjax.evaluate runs (no memory row
    # projected again); the same for HF's rows, so the ratio of rates is that of times.
    setup = accel.SETUPS['tiny']
    _, mcfg, _ = peer_lib.build_pair(setup['peer'], setup['peer_vocab'])
    b, t = setup['peer'].batch_size, setup['peer'].tgt_len
    expected = {'train': flops.train_step_flops(mcfg, b, t),
                'eval': sum(flops.forward_flops(memories.evaluation_config(mcfg, {}), b, t).values())}
    for r in peer:
        assert r['model_flops_per_step'] == pytest.approx(expected[r['case'].split()[-2]])


def test_a_step_that_does_not_fit_halves_its_batch(monkeypatch):
    monkeypatch.setattr(accel, '_memory_limit', lambda: 1)  # No step fits in one byte.
    suite = accel.Suite(harness.Context(size='tiny', warmup=0, repeats=1))
    mcfg = workload.model_config(None, mem_len=4, **accel.TINY_MODEL)
    case = suite.compile_fitting(mcfg, batch=2, tgt_len=4)
    assert case.work.batch_size == 1 and case.compiled.live_bytes > 1


def test_parts_are_checked_in_one_line():
    with pytest.raises(harness.BenchError, match=r"--parts has \['speed'\]"):
        harness.run_suite('accel', harness.Context(size='tiny', parts=('speed',)))
    with pytest.raises(harness.BenchError, match='the peak suite has no parts'):
        harness.run_suite('peak', harness.Context(size='tiny', parts=('train',)))


def test_datasheet_names_the_chip_a_device_kind_is():
    assert chips.datasheet('NVIDIA H100 80GB HBM3').tflops('bfloat16') == 989.0
    assert chips.datasheet('NVIDIA H100 PCIe').tflops('float32') == 378.0
    assert chips.datasheet('NVIDIA H200').tflops('float32') == 494.0
    assert chips.datasheet('TPU v5 lite').tflops('float32') == 197.0
    assert chips.datasheet('TPU v5').name == 'TPU v5p'  # JAX's device_kind of a v5p.
    assert chips.datasheet('TPU v5e').name == 'TPU v5e'
    assert chips.datasheet('NVIDIA H100 NVL').tflops('bfloat16') == 835.0
    assert chips.datasheet('NVIDIA GH200 480GB').name == 'NVIDIA GH200'
    assert chips.datasheet('cpu') is None
    measured = {'peak_gflops_per_s': {'bfloat16': 800e3}, 'datasheet_gflops_per_s': {'bfloat16': 989e3}}
    assert peak.mfu_percents(400e3, 'bfloat16', measured) == {
        'mfu_percent': 50.0, 'mfu_datasheet_percent': pytest.approx(100 * 400 / 989)}


@pytest.mark.parametrize('name,file', [('ENWIK8_BASE', 'transformer_xl_enwik8_base.py'),
                                       ('WT103_BASE', 'transformer_xl_wt103_base.py'),
                                       ('WT103_LARGE', 'transformer_xl_wt103_large.py'),
                                       ('ENWIK8_LARGE', 'transformer_xl_enwik8_large.py')])
def test_the_suites_shapes_are_the_configs(name, file):
    model = config_lib.load_config_file(os.path.join(REPO, 'configs', file)).model
    shape = getattr(accel, name)
    for field, value in shape.items():
        if field != 'vocab_size':  # The configs take it from the tokenizer.
            got = tuple(model[field]) if isinstance(value, tuple) else model[field]
            assert got == value, field
    steps = [s for s in accel.SETUPS['full']['train'] if s.model is shape]
    train = config_lib.load_config_file(os.path.join(REPO, 'configs', file)).train
    for step in steps:
        assert step.tgt_len == train.tgt_len == model.mem_len
        assert step.dropout == (model.dropout, model.dropatt)
        assert train.batch_size % step.batch == 0  # A per-chip share of the paper's batch.


def test_rows_are_handed_on_as_they_are_measured(tmp_path):
    """A run stopped at a deadline keeps what it measured: every row reaches `on_rows` (which
    `--out` turns into a partial report on disk) as soon as it exists."""
    seen = []
    ctx = harness.Context(size='tiny', warmup=0, repeats=1, parts=('peak',), on_rows=lambda rows: seen.append(list(rows)))
    report = harness.run_suite('accel', ctx, command=['test'])
    assert [len(rows) for rows in seen] == list(range(1, len(report['rows']) + 1))
    partial = harness.partial_report('accel', ctx, seen[0], ['python', '-m', 'memjax.bench', 'accel'])
    harness.write_json(str(tmp_path / 'partial.json'), partial)
    assert partial['partial'] and partial['rows'][0]['case'] == report['rows'][0]['case']
    assert partial['machine']['backend'] == 'cpu'


def test_a_later_process_takes_the_peak_from_an_earlier_report(tmp_path, report):
    """`--peak_from`: the MFU of a later process's rows is against the earlier report's best
    product per dtype, not measured again; a report of another device kind or without peak rows
    is refused in one line."""
    path = str(tmp_path / 'accel.json')
    harness.write_json(path, harness.partial_report('accel', harness.Context(size='tiny'), report['rows'], ['test']))
    later = harness.run_suite('accel', harness.Context(size='tiny', warmup=0, repeats=1, parts=('eval',), peak_from=path),
                              command=['test'])
    assert not rows(later, 'peak')
    best = max(r['tflops_per_s'] for r in rows(report, 'peak') if r['dtype'] == 'bfloat16')
    for r in rows(later, 'eval'):
        if r['dtype'] == 'bfloat16':
            assert r['mfu_percent'] == pytest.approx(100 * r['tflops_per_s'] / best)
    harness.write_json(path, {'rows': [], 'machine': {'device_kind': jax.devices()[0].device_kind}})
    with pytest.raises(harness.BenchError, match='has no peak rows'):
        peak.from_report(path)
    other = harness.partial_report('accel', harness.Context(size='tiny'), report['rows'], ['test'])
    other['machine']['device_kind'] = 'NVIDIA H200'
    harness.write_json(path, other)
    with pytest.raises(harness.BenchError, match="measured on 'NVIDIA H200'"):
        peak.from_report(path)


def test_the_profile_adds_up_to_the_traced_step_and_keeps_its_trace(tmp_path):
    """The command sets XLA:CPU's op names in traces; each profiled step's categories add up to the
    traced step, the model's own categories all take time, and the trace file lies beside the
    report. The profiled step, timed without the profiler, is the train part's bf16 row."""
    out = tmp_path / 'accel.json'
    done = subprocess.run([sys.executable, '-m', 'memjax.bench', 'accel', '--parts=profile,train', '--size=tiny',
                           '--warmup=1', '--repeats=2', f'--out={out}'], cwd=REPO, capture_output=True, text=True,
                          check=False, env={**os.environ, 'TMPDIR': str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    profiled = rows(report, 'profile')
    assert [r['case'] for r in profiled] == [s.name for s in accel.SETUPS['tiny']['profile']]
    for r in profiled:
        times = {name: r[f'{name} ms'] for name in step_profile.CATEGORIES}
        assert sum(times.values()) == pytest.approx(r['profiled_step_ms'], rel=1e-9)
        assert all(t >= 0 for t in times.values())
        for name in (step_profile.ATTENTION, step_profile.DENSE, step_profile.SOFTMAX, step_profile.OPTIMIZER):
            assert times[name] > 0, name
        assert times[step_profile.COPIES] == 0  # A CPU's arrays are the host's.
        assert r['profiled_vs_timed'] == pytest.approx(r['profiled_step_ms'] / r['step_ms'])
        assert r['trace'] == str(tmp_path / f"accel_profile_{r['case'].replace(' ', '_')}.xplane.pb")
        assert os.path.getsize(r['trace']) > 0
        shares = [report['figures'][f"profile {r['case']} {name} share"] for name in step_profile.CATEGORIES]
        assert sum(shares) == pytest.approx(1.0)
        trained = [t for t in rows(report, 'train') if t['case'] == r['case'] and t['dtype'] == 'bfloat16']
        assert [(t['step_ms'], t['compile_s'], t['timed_by']) for t in trained] == [
            (r['step_ms'], r['compile_s'], 'profile')]
    assert {r['dtype'] for r in rows(report, 'train')} == {'bfloat16', 'float32'}


def test_the_profile_on_a_cpu_without_op_names_is_refused_before_compiling():
    with pytest.raises(harness.BenchError, match='--xla_cpu_enable_xprof_traceme=true'):
        harness.run_suite('accel', harness.Context(size='tiny', parts=('profile',)), command=['test'])
