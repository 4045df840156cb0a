"""Correctness (not speed) of the peer, eval-speed and scaling benchmark suites at tiny size."""

import importlib.util
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax import model as model_lib
from memjax.bench import flops
from memjax.bench import harness
from memjax.bench.suites import eval_speed
from memjax.bench.suites import ops
from memjax.bench.suites import peer  # Imports torch only when a peer model is built.
from memjax.bench.suites import scaling
from memjax.kernels import cpu as cpu_kernels
from memjax.model import memories

HAVE_TORCH = all(importlib.util.find_spec(m) is not None for m in ('torch', 'transformers'))
needs_torch = pytest.mark.skipif(
    not HAVE_TORCH, reason="the peer suite needs torch and transformers: pip install -e '.[parity]'")
pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning', 'ignore::FutureWarning',
                                        'ignore::UserWarning')
TINY = harness.Context(size='tiny', warmup=0, repeats=1)


def run_and_reload(name, tmp_path_factory):
    """Runs a suite at tiny size and reads back the JSON it writes."""
    path = tmp_path_factory.mktemp(name) / f'{name}.json'
    harness.write_json(str(path), harness.run_suite(name, TINY, command=['test']))
    with open(path, encoding='utf-8') as f:
        return json.load(f)


@pytest.fixture(scope='module')
def peer_report(tmp_path_factory):
    return run_and_reload('peer', tmp_path_factory)


# ----------------------------------------------------------------------------------------------
# peer: both sides are the same model.


@needs_torch
@pytest.mark.parametrize('vocab', [v.name for v in peer.VOCABS['tiny']])
def test_peer_models_have_same_parameters_and_logprobs(vocab):
    shape = peer.SHAPES['tiny']
    hf_model, mcfg, params = peer.build_pair(shape, next(v for v in peer.VOCABS['tiny'] if v.name == vocab))
    assert peer.hf_param_count(hf_model) == peer.memjax_param_count(params)
    tokens = peer.random_tokens(mcfg.vocab_size, shape.batch_size, 3 * shape.tgt_len + 1, seed=5)
    assert peer.max_logprob_difference(hf_model, mcfg, params, tokens, shape.tgt_len) < 1e-4


@needs_torch
def test_hf_param_count_counts_tied_tensors_once():
    hf_model, _, _ = peer.build_pair(peer.SHAPES['tiny'], peer.VOCABS['tiny'][1])  # Adaptive, tied.
    by_storage = {p.data_ptr(): p.numel() for p in hf_model.state_dict().values() if p.is_floating_point()}
    inv_freq = hf_model.transformer.pos_emb.inv_freq
    expected = sum(by_storage.values()) - inv_freq.numel()  # A buffer, not a parameter.
    with_repeats = sum(p.numel() for _, p in hf_model.named_parameters(remove_duplicate=False))
    assert peer.hf_param_count(hf_model) == expected < with_repeats


@needs_torch
def test_peer_check_refuses_different_weights():
    shape = peer.SHAPES['tiny']
    hf_model, mcfg, params = peer.build_pair(shape, peer.VOCABS['tiny'][0])
    params = dict(params, layer_0=jax.tree_util.tree_map(lambda x: x * 1.5, params['layer_0']))
    with pytest.raises(AssertionError, match='log-probs differ'):
        peer.check_same_model(hf_model, mcfg, params, shape)


@needs_torch
def test_peer_suite_json(peer_report):
    rows = peer_report['rows']
    for vocab in peer.VOCABS['tiny']:
        for mode in ('train', 'eval'):
            ours, theirs = (next(r for r in rows if (r['vocab'], r['mode'], r['impl']) == (vocab.name, mode, impl))
                            for impl in ('memjax', 'hf_eager'))
            tokens = peer.SHAPES['tiny'].batch_size * peer.SHAPES['tiny'].tgt_len
            assert theirs['tokens_per_s'] == pytest.approx(tokens / theirs['timing']['median_s'])
            ratio = ours['tokens_per_s'] / theirs['tokens_per_s']
            assert peer_report['figures'][f'memjax_over_hf_eager_{mode}_{vocab.name}'] == pytest.approx(ratio)
        assert peer_report['figures'][f'max_abs_logprob_diff_{vocab.name}'] < peer.LOGPROB_TOLERANCE
    assert peer_report['figures']['torch_threads'] == peer_report['machine']['usable_cores']
    assert peer_report['config']['shape'] == {**peer.SHAPES['tiny'].__dict__}


# ----------------------------------------------------------------------------------------------
# ops: every matrix product of a step profiled, once per execution.


@needs_torch
def test_ops_suite_profiles_every_matrix_product_of_both_steps(tmp_path):
    """The matrix FLOPs of the profiled XLA ops, per step over two steps, are the model's analytic
    FLOPs (the adaptive tail's recomputation included): no dot missed, none counted twice, and the
    op names of the profile are those of the optimized HLO. Op shares add up to the step."""
    out = tmp_path / 'ops.json'
    proc = subprocess.run([sys.executable, '-m', 'memjax.bench', 'ops', '--size=tiny', '--warmup=0', '--repeats=2',
                           '--host_memory=off', f'--out={out}'], cwd=os.path.dirname(os.path.dirname(__file__)),
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    figures, shape = report['figures'], peer.SHAPES['tiny']
    for vocab in peer.VOCABS['tiny']:
        for mode in ('train', 'eval'):
            # Each step's table is printed as soon as it is measured: a run stopped at a deadline keeps it.
            rows = [r for r in report['rows'] if (r['vocab'], r['mode']) == (vocab.name, mode)]
            assert f'ops: {vocab.name} {mode} by op:\n{harness.format_table(rows, ops.COLUMNS)}\n' in proc.stderr
        _, mcfg, _ = peer.build_pair(shape, vocab)
        b, t = shape.batch_size, shape.tgt_len
        # Evaluation as memjax.evaluate runs it: the memory's keys and values as projected.
        expected = {'eval': sum(flops.forward_flops(memories.evaluation_config(mcfg, {}), b, t).values()),
                    'train': flops.train_step_flops(mcfg, b, t) + flops.tail_recompute_flops(mcfg, b, t)}
        for mode, model_flops in expected.items():
            assert figures[f'memjax_{mode}_{vocab.name}_matmul_gflop_per_step'] * 1e9 == pytest.approx(model_flops)
            for impl in ('memjax', 'hf_eager'):
                rows = [r for r in report['rows'] if (r['vocab'], r['mode'], r['impl']) == (vocab.name, mode, impl)]
                assert sum(r['share'] for r in rows) == pytest.approx(1.0)
                assert sum(r['ms_per_step'] for r in rows) == pytest.approx(figures[f'{impl}_{mode}_{vocab.name}_op_ms_per_step'])
                # Products were found and rated (which ops make the top rows depends on timing).
                assert figures[f'{impl}_{mode}_{vocab.name}_share_matmul'] > 0
                assert figures[f'{impl}_{mode}_{vocab.name}_matmul_gflops_per_s'] > 0
            # The roofline: the step's matrix products at the peak, against its measured time.
            prefix = f'roofline_{mode}_{vocab.name}_'
            bound = {k[len(prefix):]: v for k, v in figures.items() if k.startswith(prefix)}
            assert bound['floor_ms'] == pytest.approx(model_flops / 1e6 / figures['matmul_peak_gflops_per_s'])
            assert bound['memjax_of_peak'] == pytest.approx(bound['floor_ms'] / bound['memjax_ms'])
            assert bound['needed_of_peak'] == pytest.approx(bound['floor_ms'] * 1.5 / bound['rival_ms'])
            # The rival with its own products (from its profile) at the peak, its other ops as profiled.
            rival = f"{bound['rival']}_{mode}_{vocab.name}_"
            assert bound['rival_at_peak_ms'] == pytest.approx(
                bound['rival_ms'] * (1 - figures[rival + 'share_matmul'])
                + figures[rival + 'matmul_gflop_per_step'] * 1e3 / figures['matmul_peak_gflops_per_s'])
    # Each layer's products timed alone under XLA, the kernel and torch: the attention's are the
    # model's own (their FLOPs over the layers are the analytic count), and the peak is the best rate.
    products = {r['matmul'].split()[0]: r for r in report['config']['matmul_peak_rows']}
    layer_flops = lambda r: 2.0 * r['batch'] * r['m'] * r['k'] * r['n'] * mcfg.n_layer
    model_flops = flops.forward_flops(mcfg, shape.batch_size, shape.tgt_len)
    assert layer_flops(products['scores']) == model_flops['content_scores']
    assert layer_flops(products['attend']) == model_flops['attend_values']
    rates = {k: v for k, v in figures.items() if re.fullmatch(r'matmul_[a-z_]+_(xla|kernel|torch|torch_onednn)_gflops_per_s', k)}
    assert figures['matmul_peak_gflops_per_s'] == max(rates.values())
    product, impl = figures['matmul_peak_by'].split()
    assert rates[f'matmul_{product}_{impl}_gflops_per_s'] == figures['matmul_peak_gflops_per_s']
    assert all(figures[f'matmul_{p}_torch_gflops_per_s'] > 0 for p in products)
    # memjax's CPU kernel is timed on the same products wherever the model's steps would run it.
    assert all((f'matmul_{p}_kernel_gflops_per_s' in figures) == cpu_kernels.applies(jnp.zeros(1)) for p in products)
    # The attention's kernels alone: their rate over the terms the causal mask leaves (query i of T
    # sees K - T + i + 1 of K keys) and over the dense products, from one timing.
    if cpu_kernels.applies(jnp.zeros(1)):
        t, k = shape.tgt_len, shape.tgt_len + shape.mem_len
        visible_share = sum(k - t + i + 1 for i in range(t)) / (t * k)
        for name in ('forward', 'gradient'):
            useful, dense = (figures[f'attention_kernels_{name}_{kind}gflops_per_s'] for kind in ('', 'dense_'))
            assert useful == pytest.approx(dense * visible_share)
            assert figures[f'attention_kernels_{name}_of_matmul_peak'] == pytest.approx(
                useful / figures['matmul_peak_gflops_per_s'])
    else:
        assert not any(k.startswith('attention_kernels_') for k in figures)
    assert report['machine']['cpu_model'] and report['machine']['vector_isa']


# ----------------------------------------------------------------------------------------------
# eval-speed: the vanilla baseline computes what XL computes where their contexts coincide.


def tiny_model(**changes):
    fields = dict(vocab_size=40, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=48, dropout=0.0,
                  dropatt=0.0, memory_start='empty')
    fields.update(changes)
    mcfg = model_lib.ModelConfig(**fields)
    return mcfg, model_lib.init_params(mcfg, jax.random.PRNGKey(3))


def test_sliding_window_equals_xl_while_memory_holds_the_whole_history():
    """At the start of a stream both see every earlier token, recomputed or cached: same log-probs."""
    mcfg, params = tiny_model(n_layer=2, mem_len=8)
    tokens = np.random.RandomState(0).randint(0, mcfg.vocab_size, (2, 6))
    xl = eval_speed.xl_logprobs(mcfg, params, tokens, tgt_len=3)
    vanilla = eval_speed.sliding_window_logprobs(mcfg, params, tokens, window=8)
    np.testing.assert_allclose(vanilla, xl, atol=2e-5, rtol=0)


def test_sliding_window_equals_same_length_xl_for_one_layer():
    """One layer caches only embeddings (context-free), so XL attending exactly `window` keys
    (same_length, mem_len = window) equals recomputing the window, past the first window too."""
    window = 3
    mcfg, params = tiny_model(n_layer=1)
    tokens = np.random.RandomState(1).randint(0, mcfg.vocab_size, (2, 11))
    xl = eval_speed.xl_logprobs(eval_speed.xl_config(mcfg, window), params, tokens, tgt_len=4)
    vanilla = eval_speed.sliding_window_logprobs(mcfg, params, tokens, window=window)
    np.testing.assert_allclose(vanilla, xl, atol=2e-5, rtol=0)
    # The comparison is sensitive: a window one token shorter changes the later log-probs.
    shorter = eval_speed.sliding_window_logprobs(mcfg, params, tokens, window=window - 1)
    assert np.abs(shorter[:, window:] - xl[:, window:]).min() > 1e-6


def test_vanilla_step_scores_the_last_position_only():
    mcfg, params = tiny_model(n_layer=1)
    windows = np.random.RandomState(2).randint(0, mcfg.vocab_size, (3, 7)).astype(np.int32)
    targets = np.asarray([1, 5, 9], np.int32)
    vanilla = eval_speed.vanilla_step_fn(mcfg)(params, windows, targets)
    full_targets = np.concatenate([windows[:, 1:], targets[:, None]], axis=1)
    vmcfg = eval_speed.vanilla_config(mcfg)
    # Jitted: op by op, each of the model's operations would compile.
    out, _ = jax.jit(model_lib.build_model(vmcfg).apply)({'params': params}, windows, model_lib.init_memory(vmcfg, 3),
                                                           targets=full_targets)
    np.testing.assert_allclose(vanilla, np.asarray(out.target_logprobs)[:, -1], atol=1e-5, rtol=0)


def test_eval_speed_suite_json(tmp_path_factory):
    report = run_and_reload('eval-speed', tmp_path_factory)
    setup = eval_speed.SETUPS['tiny']
    assert [r['attn_len'] for r in report['rows']] == list(setup.attn_lens)
    for row in report['rows']:
        xl = row['xl_timing']['median_s'] / (setup.batch_size * setup.tgt_len)
        vanilla = row['vanilla_timing']['median_s'] / setup.batch_size
        assert row['speedup'] == pytest.approx(vanilla / xl)
        assert report['figures'][f'speedup_at_{row["attn_len"]}'] == pytest.approx(row['speedup'])


# ----------------------------------------------------------------------------------------------
# scaling.


def test_scaling_suite_json(tmp_path_factory):
    report = run_and_reload('scaling', tmp_path_factory)
    setup = scaling.SETUPS['tiny']
    rows = report['rows']
    for sweep, field, modes in scaling.SWEEPS:
        for mode in modes:
            sub = [r for r in rows if r['sweep'] == sweep and r['mode'] == mode]
            assert [r[sweep] for r in sub] == list(getattr(setup, field))
            for r in sub:
                tokens = r['batch_size'] * r['tgt_len']
                assert r['us_per_token'] == pytest.approx(r['timing']['median_s'] / tokens * 1e6)
                assert r['attn_keys'] == r['mem_len'] + r['tgt_len']
    # The memory buffer alone grows with mem_len: [n_layer, B, mem_len, d_model] float32, in and out.
    train = {r['mem_len']: r['live_mib'] for r in rows if r['sweep'] == 'mem_len' and r['mode'] == 'train'}
    small, large = setup.mem_lens[0], setup.mem_lens[-1]
    model = scaling.SETUPS['tiny'].model
    buffer_growth = (large - small) * model['n_layer'] * setup.batch_size * model['d_model'] * 4 / harness.MIB
    assert train[large] - train[small] >= buffer_growth
    assert 'train_mem_len_us_per_token_vs_keys_slope' in report['figures']


# ----------------------------------------------------------------------------------------------
# generate: incremental generation, the re-run baseline and HF's generate on the same weights.


@needs_torch  # HF's generate on the same weights is one of the suite's three implementations.
def test_generate_suite_json(tmp_path_factory):
    """The suite itself refuses to time implementations that chose different tokens (incremental vs
    re-run, GPT-2 vs HF); here its report is checked for what it claims."""
    from memjax.bench.suites import generate  # pylint: disable=g-import-not-at-top
    report = run_and_reload('generate', tmp_path_factory)
    setup = generate.SETUPS['tiny']
    for row in report['rows']:
        assert row['tokens_per_s'] == pytest.approx(row['batch'] * setup.new_tokens / row['timing']['median_s'])
        if row['model'] == 'gpt2':
            assert row['agree_with_hf'] == 1.0
    for model in ('transformer_xl', 'gpt2'):
        for batch in setup.batches:
            rows = {r['impl']: r for r in report['rows'] if (r['model'], r['batch']) == (model, batch)}
            assert set(rows) == {'memjax', 'memjax_rerun', 'hf'}
            assert report['figures'][f'memjax_over_hf_{model}_batch{batch}'] == pytest.approx(
                rows['memjax']['tokens_per_s'] / rows['hf']['tokens_per_s'])
