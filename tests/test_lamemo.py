"""LaMemo's look-ahead memory against the paper's equations and naive computations.

Appendix A (the interpolated memory is attention over the keys of both sides), the look-ahead
distances and v- against a naive score per entry, Transformer-XL recovered without look-ahead
(also with a longer evaluation memory), no target leaks across segments, bf16 log-denominators
under large logits, a per-layer cost linear in the memory, and an exact resume through the trainer.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax import model as model_lib
from memjax.analysis import lamemo as analysis_lamemo
from memjax.kernels import cpu as cpu_kernels
from memjax.model import ModelConfig
from memjax.model.memories import lamemo
from memjax.model.positions import relative_sinusoid_table, sinusoid_encoding
import training_fixtures

SEG = 4


def scaled(params, factor):
    """`params` times `factor`, as NumPy arrays: eager JAX would compile a multiply per leaf shape."""
    return jax.tree.map(lambda x: np.asarray(x) * np.float32(factor), params)


# Compiled once per length: op by op, each of its operations would compile for each shape.
_sinusoid_encoding = jax.jit(sinusoid_encoding, static_argnums=1)


def encodings(distances, d_model):
    """sinusoid_encoding of `distances` [n] as float64 NumPy [n, d_model], for naive references."""
    return np.asarray(_sinusoid_encoding(np.asarray(distances), d_model), np.float64)


def tiny(**changes) -> ModelConfig:
    fields = dict(vocab_size=13, d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32, dropout=0.0,
                  mem_len=6, memory='lamemo')
    return ModelConfig(**{**fields, **changes})


@pytest.fixture(scope='module')
def forward():
    """Jitted evaluation forwards, compiled once per config: (params, tokens, targets, memory) ->
    (target log-probs, memory)."""
    compiled = {}

    def run(cfg, params, tokens, targets, memory):
        if cfg not in compiled:
            def fn(p, x, y, m):
                out, m = model_lib.build_model(cfg).apply({'params': p}, x, m, targets=y)
                return out.target_logprobs, m
            compiled[cfg] = jax.jit(fn)
        return compiled[cfg](params, tokens, targets, memory)

    return run


def run_segments(forward, cfg, params, tokens, targets=None):
    """Log-probs [B, S * SEG] over consecutive segments, and every memory state after them."""
    targets = tokens if targets is None else targets
    memory = model_lib.init_memory(cfg, tokens.shape[0])
    logprobs, states = [], []
    for start in range(0, tokens.shape[1], SEG):
        lp, memory = forward(cfg, params, tokens[:, start:start + SEG], targets[:, start:start + SEG], memory)
        logprobs.append(lp)
        states.append(memory)
    return np.concatenate(logprobs, axis=1), states


@pytest.mark.parametrize('mem_len,seg_len', [(6, 4), (8, 4), (3, 5), (7, 7), (10, 3)])
def test_look_ahead_positions_are_r_of_j_minus_i_with_v_minus(mem_len, seg_len):
    """Each memory row i gets (q_i + v-) . W_r R_(j-i) at every window key j = M-W+1 ... M with
    j > i (a naive product per entry); entries with j <= i are never attended."""
    d_model, heads, d_head = 8, 2, 3
    w = lamemo.look_ahead_window(mem_len, seg_len)
    distances = lamemo.look_ahead_distances(mem_len, seg_len)
    window_keys = mem_len - w + 1 + np.arange(w)
    np.testing.assert_array_equal(distances, window_keys[None, :] - np.arange(mem_len)[:, None])
    assert window_keys[-1] == mem_len  # The first current token is a key, never a target.
    assert np.all((distances >= 1).sum(1) >= 1)
    rng = np.random.default_rng(0)
    query = rng.standard_normal((2, mem_len, heads, d_head), np.float32)
    kernel = rng.standard_normal((d_model, heads, d_head), np.float32)
    project = lambda x: jnp.einsum('rd,dhk->rhk', x, kernel)

    @jax.jit
    def scores(query):
        table = relative_sinusoid_table(mem_len + seg_len, d_model, -1)
        return lamemo.look_ahead_position_scores(query, table, project, seg_len)

    got = np.asarray(scores(query))
    # W_r R_d for every distance d, and the products per entry, in float64 NumPy.
    r = np.einsum('nd,dhk->nhk', encodings(np.arange(mem_len + seg_len), d_model), kernel.astype(np.float64))
    for i in range(mem_len):
        for k in range(w):
            if distances[i, k] >= 1:
                np.testing.assert_allclose(got[:, :, i, k], np.einsum('bhd,hd->bh', query[:, i], r[distances[i, k]]),
                                           rtol=1e-5, atol=1e-5)


def test_a_memory_no_longer_than_the_segment_refreshes_as_a_longer_one(forward):
    """Two layers, so that the refreshed rows feed the next layer's keys. In the second segment a
    memory of 8 rows holds the first segment's 4 behind 4 empty ones, a memory of 4 holds the same
    4: the look-ahead sees the same keys at the same distances, computed by the older-rows path
    (M > T) and by the reversed causal span (M <= T, memjax's CPU kernel where it applies), and
    the log-probs agree."""
    params = scaled(model_lib.init_params(tiny(n_layer=2, mem_len=8), jax.random.key(3)), 4.0)
    tokens = training_fixtures.random_tokens(4, (2, 2 * SEG), tiny().vocab_size)
    logprobs = {m: run_segments(forward, tiny(n_layer=2, mem_len=m), params, tokens)[0] for m in (8, SEG)}
    np.testing.assert_allclose(logprobs[SEG], logprobs[8], rtol=1e-5, atol=1e-5)


def naive_bidirectional_memory(params, cfg, embedded, t_rows, n_keys):
    """Appendix A: sum_j beta_j v_j for the rows t_rows over keys 0 ... n_keys-1 of a one-layer
    model, with the causal scores for j <= t (R_(t-j), v+) and look-ahead ones for j > t (R_(j-t),
    v-; with the XL encoding R_(t-j) and v as for the causal ones), one softmax over both; and
    alpha, the weight of the keys j <= t ([B, H, rows] each). In float64 NumPy."""
    disentangled = cfg.lamemo_encoding == 'disentangled'
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    embedded = np.asarray(embedded, np.float64)
    layer = params['layer_0']['attention']
    proj = lambda name, x: np.einsum('bnd,dhk->bnhk', x, layer[name]['kernel'])
    q, k, v = proj('query', embedded), proj('key', embedded), proj('value', embedded)
    out, alpha = [], []
    for t in t_rows:
        j = np.arange(n_keys)
        distance = np.abs(t - j) if disentangled else t - j
        r = np.einsum('nd,dhk->nhk', encodings(distance, cfg.d_model), layer['pos']['kernel'])
        ahead_bias = params['v_ahead_bias'] if disentangled else params['v_bias']
        bias = np.where((j <= t)[:, None, None], params['v_bias'], ahead_bias)  # [n, H, Dh]
        scores = (np.einsum('bhd,bnhd->bhn', q[:, t] + params['u_bias'], k[:, :n_keys])
                  + np.einsum('bhd,nhd->bhn', q[:, t], r) + np.einsum('nhd,nhd->hn', bias, r)[None])
        scores = scores * cfg.d_head ** -0.5
        beta = np.exp(scores - scores.max(-1, keepdims=True))
        beta /= beta.sum(-1, keepdims=True)
        out.append(np.einsum('bhn,bnhd->bhd', beta, v[:, :n_keys]))
        alpha.append(beta[..., :t + 1].sum(-1))
    return np.stack(out, axis=1), np.stack(alpha, axis=-1)


@pytest.mark.parametrize('encoding', ['disentangled', 'xl'])
def test_interpolated_memory_is_attention_over_both_sides_appendix_a(forward, encoding):
    """One layer, fixed projections, three segments: the memory rows of segment 2 (positions 4-7),
    attended causally then, refreshed by the look-ahead in segment 3 and interpolated, equal one
    softmax over all keys 0-8 (their past as computed before, and the new keys on their right),
    with either relative encoding."""
    cfg = tiny(n_layer=1, mem_len=8, lamemo_encoding=encoding)
    params = model_lib.init_params(cfg, jax.random.key(0))
    params = scaled(params, 4.0)  # Peaked attention: a wrong weight shows.
    tokens = training_fixtures.random_tokens(1, (2, 3 * SEG), cfg.vocab_size)
    _, states = run_segments(forward, cfg, params, tokens)
    embedded = np.concatenate([states[1].shared['embedded'], np.asarray(states[2].shared['embedded'])[:, 4:]], axis=1)
    expected, _ = naive_bidirectional_memory(params, cfg, embedded, range(4, 8), n_keys=9)
    got = np.asarray(states[2].layers['context'])[0][:, :4]  # Rows 4-7 of the memory that segment 3 refreshed.
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    # Without interpolation (alpha = 0) the same rows forget their past: look-ahead only.
    cut = cfg.replace(lamemo_interpolate=False)
    _, states = run_segments(forward, cut, params, tokens)
    assert np.abs(np.asarray(states[2].layers['context'])[0][:, :4] - expected).max() > 1e-3


@pytest.mark.parametrize('scan_layers,mem_len', [(False, 8), (True, 8), (False, SEG)])
def test_memorizing_coefficients_are_the_past_share_of_the_bidirectional_attention(scan_layers, mem_len):
    """alpha (eq. 11), extracted for analysis, is the weight the appendix A attention gives the
    keys left of each memory row, per layer (scan_layers: the same values, stacked by nn.scan;
    a memory no longer than the segment: the look-ahead as a reversed causal span, memjax's CPU
    kernel where it applies)."""
    cfg = tiny(n_layer=1, mem_len=mem_len)
    params = scaled(model_lib.init_params(cfg, jax.random.key(0)), 4.0)
    tokens = training_fixtures.random_tokens(1, (2, 3 * SEG), cfg.vocab_size)
    if scan_layers:  # Two layers with the same weights: the first sees what the one-layer model sees.
        cfg = cfg.replace(n_layer=2, scan_layers=True)
        layer = params.pop('layer_0')
        params['layers'] = jax.tree.map(lambda x: np.stack([x, x]), layer)
    model = model_lib.build_model(cfg)
    extract = jax.jit(functools.partial(analysis_lamemo.memorizing_coefficients, model))
    memory = model_lib.init_memory(cfg, 2)
    alphas, embedded = [], []
    for start in range(0, 3 * SEG, SEG):
        alpha, memory = extract(params, tokens[:, start:start + SEG], memory)
        embedded.append(np.asarray(memory.shared['embedded'])[:, -SEG:])  # The segment's layer inputs.
        alphas.append(np.asarray(alpha))
    embedded = np.concatenate(embedded, axis=1)
    assert alphas[0].shape == (cfg.n_layer, 2, cfg.n_head, cfg.mem_len)
    np.testing.assert_array_equal(alphas[0], 0.0)  # Nothing attended before: no past to keep.
    _, expected = naive_bidirectional_memory(params if not scan_layers else {
        **params, 'layer_0': layer}, cfg.replace(n_layer=1), embedded, range(4, 8), n_keys=9)
    # Rows 4-7 of the memory (0-7, or 4-7) that segment 3 refreshed.
    np.testing.assert_allclose(alphas[2][0, ..., mem_len - 4:], expected, rtol=1e-4, atol=1e-5)
    # Raised while tracing, as under the jit its docstring asks for: no forward runs op by op.
    no_alpha = jax.jit(functools.partial(analysis_lamemo.memorizing_coefficients,
                                         model_lib.build_model(cfg.replace(lamemo_interpolate=False))))
    with pytest.raises(ValueError, match='lamemo_interpolate=True'):
        no_alpha(params, tokens[:, :SEG], model_lib.init_memory(cfg, 2))


def xl_params(params):
    return {k: v for k, v in params.items() if k != 'v_ahead_bias'}


@pytest.mark.parametrize('eval_mem_len', [6, 12])
def test_without_look_ahead_the_recomputed_memory_is_transformer_xl(forward, eval_mem_len):
    """alpha = 1 and no look-ahead: every layer's memory rows, recomputed from the embeddings and
    the carried attention outputs, are what Transformer-XL kept; also with an evaluation memory
    twice the training one (the carried state grows with mem_len)."""
    cfg = tiny(lamemo_look_ahead=False, mem_len=eval_mem_len)
    params = scaled(model_lib.init_params(tiny(), jax.random.key(2)), 6.0)
    tokens = training_fixtures.random_tokens(3, (2, 4 * SEG), cfg.vocab_size)
    got, states = run_segments(forward, cfg, params, tokens)
    assert states[-1].layers['context'].shape[2] == eval_mem_len
    expected, _ = run_segments(forward, cfg.replace(memory='xl', lamemo_look_ahead=True), xl_params(params), tokens)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    refreshed, _ = run_segments(forward, cfg.replace(lamemo_look_ahead=True), params, tokens)
    assert np.abs(refreshed - expected)[:, SEG:].max() > 1e-4  # The look-ahead does change them.


def test_no_target_leaks_across_segments(forward):
    """Changing the input at position p changes no log-prob before p, in any later segment, while
    the memory rows look ahead at every segment's first token."""
    cfg = tiny()
    params = scaled(model_lib.init_params(cfg, jax.random.key(4)), 3.0)
    tokens = training_fixtures.random_tokens(5, (2, 4 * SEG + 1), cfg.vocab_size)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    base, _ = run_segments(forward, cfg, params, inputs, targets)
    for p in (SEG, SEG + 2, 2 * SEG + 3, 3 * SEG):
        changed_inputs = inputs.copy()
        changed_inputs[:, p] = (inputs[:, p] + 5) % cfg.vocab_size
        changed, _ = run_segments(forward, cfg, params, changed_inputs, targets)
        np.testing.assert_array_equal(changed[:, :p], base[:, :p])
        assert np.abs(changed[:, p:] - base[:, p:]).max() > 1e-4


def test_bf16_log_denominators_stay_finite_under_large_logits(forward):
    """Logits in the hundreds overflow any exp(); the float32 log-denominators carried across
    segments stay finite and bf16 log-probs follow float32's."""
    cfg = tiny()
    params = model_lib.init_params(cfg, jax.random.key(6))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: scaled(x, 100.0) if any(n in str(path) for n in ("'query'", "'key'")) else x, params)
    tokens = training_fixtures.random_tokens(7, (2, 5 * SEG), cfg.vocab_size)
    full, states32 = run_segments(forward, cfg, params, tokens)
    half, states16 = run_segments(forward, cfg.replace(compute_dtype='bfloat16'), params, tokens)
    log_norm = np.asarray(states16[-1].layers['log_norm'])
    assert log_norm.dtype == np.float32 and np.all(np.isfinite(log_norm))
    assert float(np.asarray(states32[-1].layers['log_norm']).max()) > 100.0  # exp() of it overflows float32.
    assert np.all(np.isfinite(half))
    np.testing.assert_allclose(half, full, atol=0.01)  # Seen: 7e-4 (log-probs about -2.3).


def test_attention_cost_is_linear_in_the_memory_length(monkeypatch):
    """One layer scores N (M + N) + M N entries (the segment's causal scores and the memory rows'
    look-ahead, counted from the shapes whose softmax denominators the layer takes), and XLA's
    FLOP count grows linearly with M (positional look-ahead scores 2 M N): no M^2 term, unlike
    scoring every memory row against every distance. XLA's own products throughout (the CPU
    kernels off): a custom call's FLOPs are not counted, nor its scores normalised in Python."""
    monkeypatch.setenv(cpu_kernels.SWITCH, 'off')
    normalised = []
    logsumexp = jax.nn.logsumexp
    monkeypatch.setattr(jax.nn, 'logsumexp', lambda x, *a, **k: normalised.append(x.shape) or logsumexp(x, *a, **k))

    def flops_and_entries(mem_len):
        cfg = tiny(n_layer=1, mem_len=mem_len, vocab_size=5, d_model=8, d_inner=8, n_head=1)
        params = model_lib.init_params(cfg, jax.random.key(0))
        fn = jax.jit(lambda p, x, m: model_lib.build_model(cfg).apply({'params': p}, x, m)[1])
        tokens = np.zeros((1, SEG), np.int32)
        normalised.clear()
        flops = fn.lower(params, tokens, model_lib.init_memory(cfg, 1)).cost_analysis()['flops']
        assert all(shape[:2] == (1, 1) for shape in normalised)  # [B, H, rows, keys]
        return flops, sum(rows * keys for _, _, rows, keys in normalised)

    memories = (16, 32, 48)
    f, entries = zip(*(flops_and_entries(m) for m in memories))
    assert list(entries) == [SEG * (m + SEG) + m * SEG for m in memories]
    steps = np.diff(f)
    assert steps[0] > 0
    np.testing.assert_allclose(steps, steps[0], rtol=0.02)


def test_tiny_lamemo_resumes_exactly_and_evaluates_with_a_longer_memory(tmp_path):
    corpus = training_fixtures.write_text_corpus(str(tmp_path / 'corpus'))
    config = training_fixtures.tiny_config(
        corpus, model__memory='lamemo', model__n_layer=2, model__mem_len=8, train__num_steps=8,
        model__dropatt=0.1, eval__model__mem_len=16)
    training_fixtures.assert_resumes_exactly(config, tmp_path)
