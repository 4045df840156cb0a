"""Properties of the whole model: causality, memory carry, normalisation, resets, config checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import special

from memjax.kernels import cpu as cpu_kernels
from memjax.model import ModelConfig, MemoryLM, build_model, adaptive, init_memory, lm_loss
import training_fixtures

VOCAB = 50
BASE = dict(vocab_size=VOCAB, d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32, dropout=0.0)


@functools.lru_cache(maxsize=None)
def setup(**overrides):
    """Random model with its zero-initialised parameters perturbed so that every term matters."""
    cfg = ModelConfig(**{**BASE, **overrides})
    return cfg, build_model(cfg), training_fixtures.perturbed_params(cfg)


@functools.lru_cache(maxsize=None)
def jitted_apply(model):
    """`model.apply` compiled (`method` static), shared by every test of an equal model: run op by
    op, each operation would compile a program of its own for each shape."""
    return jax.jit(model.apply, static_argnames='method')


def run_segments(cfg, model, params, tokens, seg_len, targets=None):
    """Scores `tokens` [B, L] segment by segment, carrying the memory; returns hidden, log-probs."""
    memory = init_memory(cfg, tokens.shape[0])
    apply = jitted_apply(model)
    hiddens, logprobs = [], []
    for start in range(0, tokens.shape[1], seg_len):
        seg_targets = None if targets is None else targets[:, start:start + seg_len]
        out, memory = apply({'params': params}, tokens[:, start:start + seg_len], memory, targets=seg_targets)
        hiddens.append(out.hidden)
        logprobs.append(out.target_logprobs)
    return np.concatenate(hiddens, 1), (None if targets is None else np.concatenate(logprobs, 1))


random_tokens = functools.partial(training_fixtures.random_tokens, vocab_size=VOCAB)


def with_changed(tokens, index, step=1):
    """A copy of `tokens` with the ids at `index` moved by `step` (mod VOCAB)."""
    changed = tokens.copy()
    changed[index] = (tokens[index] + step) % VOCAB
    return changed


@pytest.mark.parametrize('overrides', [dict(mem_len=8), dict(mem_len=8, pre_lnorm=True, untie_r=True),
                                       dict(mem_len=4, same_length=True, clamp_len=3),
                                       dict(mem_len=4, same_length=True, clamp_len=3, attention_impl='fused')])
def test_causality_within_and_across_segments(overrides):
    cfg, model, params = setup(**overrides)
    tokens = random_tokens(0, (2, 12))
    changed = with_changed(tokens, np.s_[:, 6:])  # change everything after t = 5
    h_orig, _ = run_segments(cfg, model, params, tokens, seg_len=4)
    h_changed, _ = run_segments(cfg, model, params, changed, seg_len=4)
    np.testing.assert_array_equal(h_orig[:, :6], h_changed[:, :6])
    assert not np.allclose(h_orig[:, 6:], h_changed[:, 6:])  # the change is visible downstream


@pytest.mark.parametrize('overrides', [dict(), dict(pre_lnorm=True), dict(cutoffs=(20, 35), div_val=2),
                                       dict(attention_impl='fused')])
def test_memory_carry_equals_one_long_pass(overrides):
    """A memory that holds everything seen makes segment-wise scoring equal to one long pass."""
    length, seg_len = 12, 4
    cfg, model, params = setup(mem_len=length - seg_len, **overrides)
    tokens, targets = random_tokens(2, (2, length)), random_tokens(3, (2, length))
    _, segmented = run_segments(cfg, model, params, tokens, seg_len, targets)
    _, whole = run_segments(cfg, model, params, tokens, length, targets)  # memory stays empty
    np.testing.assert_allclose(segmented, whole, atol=2e-5)


@pytest.mark.parametrize('attention_impl', ['reference', 'fused'])
def test_same_length_segments_equal_one_pass_with_the_same_window(attention_impl):
    """With same_length every query sees the last mem_len keys, whether they sit in memory or not."""
    cfg, model, params = setup(mem_len=5, same_length=True, clamp_len=4, attention_impl=attention_impl)
    tokens, targets = random_tokens(4, (2, 12)), random_tokens(5, (2, 12))
    _, segmented = run_segments(cfg, model, params, tokens, 3, targets)
    _, whole = run_segments(cfg, model, params, tokens, 12, targets)
    np.testing.assert_allclose(segmented, whole, atol=2e-5)


def test_short_memory_forgets():
    """Without enough memory the distant past is out of reach: a negative control for the above."""
    cfg, model, params = setup(mem_len=2)
    tokens = random_tokens(6, (2, 12))
    changed = with_changed(tokens, np.s_[:, 0])
    h_orig, _ = run_segments(cfg, model, params, tokens, 4)
    h_changed, _ = run_segments(cfg, model, params, changed, 4)
    # Layer-wise receptive field grows by mem_len per layer: position 0 cannot reach the last segment.
    np.testing.assert_array_equal(h_orig[:, 8:], h_changed[:, 8:])
    assert not np.allclose(h_orig[:, 1:4], h_changed[:, 1:4])


@pytest.mark.parametrize('overrides', [
    dict(), dict(tie_weight=False), dict(cutoffs=(10, 30), div_val=1, d_embed=12, tie_projs=(False, True, False)),
    dict(cutoffs=(10, 30), div_val=2), dict(cutoffs=(25,), div_val=4, tie_weight=False)])
def test_adaptive_softmax_normalises_and_matches_targets(overrides):
    cfg, model, params = setup(mem_len=4, **overrides)
    tokens = random_tokens(7, (2, 6))
    targets = np.concatenate([tokens[:, 1:], np.array([[0], [VOCAB - 1]], np.int32)], axis=1)
    apply = jitted_apply(model)
    out, _ = apply({'params': params}, tokens, init_memory(cfg, 2), targets=targets)
    full = np.asarray(apply({'params': params}, out.hidden, method=MemoryLM.logprobs))
    assert full.shape[-1] == VOCAB
    np.testing.assert_allclose(special.logsumexp(full.astype(np.float64), axis=-1), 0.0, atol=1e-5)
    np.testing.assert_allclose(out.target_logprobs, np.take_along_axis(full, targets[..., None], -1)[..., 0],
                               atol=1e-5)


@pytest.mark.parametrize('kernels', ['on', 'off'])
def test_tail_clusters_match_the_full_softmax_with_gradients(kernels, monkeypatch):
    """On one CPU device the kernel scores each tail cluster where its targets fall; elsewhere
    (kernels off, as on accelerators) XLA scores every position in chunks: here 7 positions, so
    that the 40 positions of cluster 1 (20 words) take 6 chunks, the last one padded. Cluster 1
    holds three targets in one row only, cluster 2 most of row 1."""
    monkeypatch.setenv(cpu_kernels.SWITCH, kernels)
    monkeypatch.setattr(adaptive, '_TAIL_CHUNK_LOGITS', 2 * 7 * 20)
    cfg, model, params = setup(mem_len=4, cutoffs=(10, 30), div_val=2)
    tokens = random_tokens(11, (2, 40))
    rng = np.random.RandomState(0)
    targets = rng.randint(0, 10, (2, 40))
    targets[0, [3, 17, 38]] = [12, 29, 10]
    targets[1, 2:37] = rng.randint(30, VOCAB, 35)
    targets = jnp.asarray(targets)

    def chunked_loss(p):
        out, _ = model.apply({'params': p}, tokens, init_memory(cfg, 2), targets=targets)
        return out.target_logprobs.sum(), out.target_logprobs

    def full_loss(p):
        out, _ = model.apply({'params': p}, tokens, init_memory(cfg, 2))
        full = model.apply({'params': p}, out.hidden, method=MemoryLM.logprobs)
        picked = jnp.take_along_axis(full, targets[..., None], -1)[..., 0]
        return picked.sum(), picked

    (_, got), got_grads = jax.jit(jax.value_and_grad(chunked_loss, has_aux=True))(params)
    (_, expected), expected_grads = jax.jit(jax.value_and_grad(full_loss, has_aux=True))(params)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    for g, e in zip(jax.tree.leaves(got_grads), jax.tree.leaves(expected_grads)):
        np.testing.assert_allclose(g, e, atol=1e-5)


def _tail_gradient(io, hidden, targets):
    """The jitted gradient of the summed target log-probs of `io` (an AdaptiveIO), and its params."""
    params = jax.jit(functools.partial(io.init, method=io.target_logprobs))(jax.random.key(0), hidden, targets)
    grad = jax.grad(lambda p, h: io.apply(p, h, targets, method=io.target_logprobs).sum(), argnums=(0, 1))
    return jax.jit(grad), params


def test_tail_backward_holds_the_cluster_weights_once_not_once_per_chunk(monkeypatch):
    # A 20k-word tail cluster of width 8 (640 KB of weights) dwarfs every activation here. Eight
    # times as many chunks (one position each) may add chunk inputs (2 KB), never another copy of
    # the weights: autodiff of the chunks' loop would keep them per chunk (19 GB at wt103-base).
    monkeypatch.setenv(cpu_kernels.SWITCH, 'off')
    monkeypatch.setattr(adaptive, '_TAIL_CHUNK_LOGITS', 20000)
    cfg = ModelConfig(**{**BASE, 'vocab_size': 20010, 'cutoffs': (10,), 'd_model': 8})
    io = adaptive.AdaptiveIO(cfg)
    table_bytes = 20000 * 8 * 4

    def temp_bytes(length):
        hidden = np.ones((1, length, 8), np.float32)
        grad, params = _tail_gradient(io, hidden, np.full((1, length), 20005, np.int32))
        return grad.lower(params, hidden).compile().memory_analysis().temp_size_in_bytes

    assert temp_bytes(64) - temp_bytes(8) < table_bytes


def test_off_the_cpu_kernel_the_softmax_has_no_branch_a_gpu_would_wait_on(monkeypatch):
    """A GPU copies a conditional's predicate to the host and waits for its stream: the tail
    clusters' chunks are all scored, so the softmax's forward and backward hold no conditional."""
    monkeypatch.setenv(cpu_kernels.SWITCH, 'off')
    monkeypatch.setattr(adaptive, '_TAIL_CHUNK_LOGITS', 2 * 3 * 20)  # Several chunks per cluster.
    cfg = ModelConfig(**{**BASE, 'cutoffs': (10, 30), 'div_val': 2})
    hidden = np.ones((2, 12, cfg.d_model), np.float32)
    grad, params = _tail_gradient(adaptive.AdaptiveIO(cfg), hidden, random_tokens(3, (2, 12)))
    text = grad.lower(params, hidden).as_text()
    assert 'stablehlo.while' in text and 'stablehlo.case' not in text


def test_plain_softmax_equals_tied_embedding_logits():
    cfg, model, params = setup(mem_len=0)
    tokens = random_tokens(8, (2, 5))
    apply = jitted_apply(model)
    out, _ = apply({'params': params}, tokens, init_memory(cfg, 2))
    io = jax.tree.map(lambda x: np.asarray(x, np.float64), params['io'])
    logits = np.asarray(out.hidden, np.float64) @ io['emb_table_0'].T + io['out_bias_0']
    full = apply({'params': params}, out.hidden, method=MemoryLM.logprobs)
    np.testing.assert_allclose(full, special.log_softmax(logits, axis=-1), atol=1e-5)


def test_empty_memory_start_equals_no_memory_and_zeros_start_differs():
    cfg, model, params = setup(mem_len=6)
    tokens = random_tokens(9, (2, 5))
    with_memory, _ = jitted_apply(model)({'params': params}, tokens, init_memory(cfg, 2))
    no_memory_cfg = cfg.replace(mem_len=0)
    without, _ = jitted_apply(build_model(no_memory_cfg))({'params': params}, tokens, init_memory(no_memory_cfg, 2))
    np.testing.assert_allclose(with_memory.hidden, without.hidden, atol=1e-6)
    zeros_cfg = cfg.replace(memory_start='zeros')
    zeros, _ = jitted_apply(build_model(zeros_cfg))({'params': params}, tokens, init_memory(zeros_cfg, 2))
    assert not np.allclose(zeros.hidden, without.hidden, atol=1e-3)


def test_reset_clears_only_the_flagged_rows():
    cfg, model, params = setup(mem_len=6)
    first, second = random_tokens(10, (2, 4)), random_tokens(11, (2, 4))
    apply = jitted_apply(model)
    _, memory = apply({'params': params}, first, init_memory(cfg, 2))
    reset_out, _ = apply({'params': params}, second, memory, reset=np.array([True, False]))
    fresh_out, _ = apply({'params': params}, second, init_memory(cfg, 2))
    carried_out, _ = apply({'params': params}, second, memory)
    reset_h, fresh_h, carried_h = (np.asarray(out.hidden) for out in (reset_out, fresh_out, carried_out))
    np.testing.assert_allclose(reset_h[0], fresh_h[0], atol=1e-6)
    np.testing.assert_allclose(reset_h[1], carried_h[1], atol=1e-6)
    assert not np.allclose(carried_h[0], fresh_h[0], atol=1e-4)


def test_memory_gets_no_gradient_from_the_next_segment():
    cfg, model, params = setup(mem_len=4)
    first, second = random_tokens(12, (2, 4)), random_tokens(13, (2, 4))

    def second_segment_loss(p_first):
        _, memory = model.apply({'params': p_first}, first, init_memory(cfg, 2))
        out, _ = model.apply({'params': params}, second, memory, targets=second)
        return lm_loss(out.target_logprobs)

    grads = jax.jit(jax.grad(second_segment_loss))(params)
    assert all(float(np.abs(np.asarray(g)).max()) == 0.0 for g in jax.tree.leaves(grads))


def test_lm_loss_ignores_masked_positions():
    logprobs = np.array([[-1.0, -2.0, -30.0]], np.float32)
    assert float(jax.jit(lm_loss)(logprobs, np.array([[1.0, 1.0, 0.0]], np.float32))) == pytest.approx(1.5)


@pytest.mark.parametrize('overrides,message', [
    (dict(d_model=15), 'd_model=15 must be even'),
    (dict(cutoffs=(30, 20)), 'strictly increasing'),
    (dict(cutoffs=(20, 60)), 'below vocab_size'),
    (dict(mem_len=0, same_length=True), 'same_length=True needs mem_len > 0'),
    (dict(tie_projs=(True,), cutoffs=(20,)), 'one per cluster'),
    (dict(div_val=64, d_embed=16, cutoffs=(10, 20)), 'no dimension'),
    (dict(memory_start='random'), 'memory_start'),
    (dict(dropout=1.0), 'dropout=1.0'),
])
def test_invalid_config_is_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**BASE, **overrides})


def test_replace_lets_derived_fields_follow_what_they_derive_from():
    cfg = ModelConfig(**BASE)
    wider = cfg.replace(d_model=2 * cfg.d_model, cutoffs=(10, 20))
    assert wider.d_embed == wider.d_model and wider.tie_projs == (False, False, False)
    assert cfg.replace(d_embed=4).replace(d_model=64).d_embed == 4  # Set on purpose: kept.
    tied = cfg.replace(cutoffs=(10,), tie_projs=(False, True))
    assert tied.replace(dropout=0.0).tie_projs == (False, True)


def test_config_dict_vocab_from_tokenizer_and_unknown_fields():
    assert ModelConfig.from_config_dict({**BASE, 'vocab_size': -1}, vocab_size=77).vocab_size == 77
    with pytest.raises(ValueError, match='unknown fields'):
        ModelConfig.from_config_dict({**BASE, 'n_layers': 3})
    with pytest.raises(ValueError, match='tokenizer has 77'):
        ModelConfig.from_config_dict(BASE, vocab_size=77)


def test_bfloat16_compute_tracks_float32_and_keeps_float32_gradients():
    cfg, model, params = setup(mem_len=4, cutoffs=(20, 35), div_val=2)
    bf16 = cfg.replace(compute_dtype='bfloat16')
    tokens, targets = random_tokens(14, (2, 6)), random_tokens(15, (2, 6))
    out32, _ = jitted_apply(model)({'params': params}, tokens, init_memory(cfg, 2), targets=targets)

    def loss(p):
        out, memory = build_model(bf16).apply({'params': p}, tokens, init_memory(bf16, 2), targets=targets)
        return lm_loss(out.target_logprobs), (out, memory)

    grads, (out16, memory) = jax.jit(jax.grad(loss, has_aux=True))(params)
    assert memory.layers['hidden'].dtype == jnp.bfloat16 and out16.target_logprobs.dtype == jnp.float32
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype('float32')}
    np.testing.assert_allclose(out16.target_logprobs, out32.target_logprobs, atol=0.05)
    assert not np.array_equal(out16.target_logprobs, out32.target_logprobs)


def test_out_of_range_ids_raise_eagerly_and_poison_under_jit():
    cfg, model, params = setup(mem_len=4)
    memory = init_memory(cfg, 2)
    tokens = random_tokens(0, (2, 4))
    bad_target, bad_input = tokens.copy(), tokens.copy()
    bad_target[1, 2] = VOCAB  # One past the vocabulary.
    bad_input[0, 1] = -1
    with pytest.raises(ValueError, match=rf'1 targets ids lie outside \[0, {VOCAB}\)'):
        model.apply({'params': params}, tokens, memory, targets=bad_target)
    with pytest.raises(ValueError, match='1 tokens ids'):
        model.apply({'params': params}, bad_input, memory, targets=tokens)
    apply = jitted_apply(model)
    out, _ = apply({'params': params}, tokens, memory, targets=bad_target)
    nan = np.isnan(np.asarray(out.target_logprobs))
    assert nan[1, 2] and nan.sum() == 1  # Only that target; gathers alone would clamp it.
    out, new_memory = apply({'params': params}, bad_input, memory, targets=tokens)
    assert np.isnan(np.asarray(jax.jit(lm_loss)(out.target_logprobs)))
    assert np.isfinite(np.asarray(out.hidden)[1]).all()  # The other stream is untouched.


@pytest.mark.parametrize('inputs, message', [
    (dict(targets=(2, 4)), r'targets \[2, 4\] must match tokens \[2, 5\]'),
    (dict(reset=(3,)), r'reset \[3\] must be \[2\] \(one flag per batch row\)'),
    (dict(skip=(1,)), r'skip \[1\] must be \[2\] \(one flag per layer\)'),  # It skipped every layer.
    (dict(skip=(3,)), r'skip \[3\] must be \[2\]'),
])
def test_inputs_of_the_wrong_shape_are_named_in_one_line(inputs, message):
    """Wrong-shaped inputs would broadcast (a one-flag skip skipped every layer) or fail deep in a
    kernel that names none of them."""
    cfg, model, params = setup(mem_len=6)
    tokens = random_tokens(3, (2, 5))
    given = {name: (random_tokens(4, shape) if name == 'targets' else jnp.ones(shape, bool))
             for name, shape in inputs.items()}
    with pytest.raises(ValueError, match=message):
        model.apply({'params': params}, tokens, init_memory(cfg, 2), **given)


@pytest.mark.parametrize('memory_of', [dict(mem_len=4), dict(mem_len=6, batch=3), dict(mem_len=0, memory='none')])
def test_a_memory_built_for_other_settings_is_refused_in_one_line(memory_of):
    """E.g. a training memory passed to a model run with the evaluation mem_len."""
    cfg, model, params = setup(mem_len=6)
    other = cfg.replace(mem_len=memory_of['mem_len'], memory=memory_of.get('memory', 'xl'))
    memory = init_memory(other, memory_of.get('batch', 2))
    with pytest.raises(ValueError, match=r"memory='xl'.*mem_len=6, batch 2\): build it with init_memory"):
        model.apply({'params': params}, random_tokens(3, (2, 5)), memory)
