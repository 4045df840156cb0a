"""bfloat16 compute (`model.compute_dtype='bfloat16'`) against float32, for every memory kind.

What mixed precision promises (docs/mixed_precision.md): parameters, optimizer state and
gradients stay float32; the matrix products and the carried rows run in bfloat16; softmaxes,
log-denominators, LayerNorm statistics, the loss and the kinds' numerically delicate parts stay
float32. So a bf16 step must give the float32 step's loss and gradients to bf16 accuracy (8
significant bits: ~0.4 % per rounding, a few roundings deep), a bf16 run must learn as a float32
run does, and LaMemo's log-space accumulation must not overflow however long the memory.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxprs
import training_fixtures
from memjax import model as model_lib
from memjax.kernels import softmax
from memjax.model import ModelConfig, attention, memories

SEG, SEGMENTS, VOCAB = 8, 3, 40
BASE = dict(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=2, d_head=16, d_inner=64, dropout=0.0, mem_len=SEG)
LTM = dict(memory='infinity', mem_len=0, segment_len=SEG, ltm_basis=16, ltm_widths=(0.05, 0.1))
TRAINED_KINDS = {
    'none': dict(memory='none', mem_len=0),
    'xl': dict(),
    'xl_adaptive_pre_lnorm': dict(cutoffs=(10, 25), div_val=2, pre_lnorm=True),
    'lamemo': dict(memory='lamemo'),
    'infinity': LTM,
    'infinity_sticky': dict(LTM, ltm_sticky=True),
    'skip_retain_cross_head': dict(skip_rule='uniform', skip_p=0.5, sch_beta=0.5),
}


def tokens(seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (2, SEGMENTS * SEG + 1), dtype=np.int32)


def last_segment_loss_and_grads(cfg: ModelConfig, params, seq: jax.Array):
    """Loss of the last of SEGMENTS training segments (memory carried from the earlier ones, so the
    carried rows' dtype matters) and its gradients; every random stream keyed as in training."""
    model = model_lib.build_model(cfg)
    kind = model.kind

    def loss(p):
        memory = model_lib.init_memory(cfg, seq.shape[0])
        for s in range(SEGMENTS):
            key = jax.random.key(10 + s)
            streams = {name: jax.random.fold_in(key, i + 1) for i, name in enumerate(kind.streams)}
            segment = seq[:, s * SEG:(s + 1) * SEG + 1]
            out, memory = model.apply({'params': p}, segment[:, :-1], memory, targets=segment[:, 1:],
                                      deterministic=False, rngs={'dropout': key, **streams})
        total = model_lib.lm_loss(out.target_logprobs)
        if out.losses:
            total += sum(kind.loss_weights[n] * v for n, v in out.losses.items()) / out.target_logprobs.size
        return total, memory

    (value, memory), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return value, grads, memory


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize('kind', sorted(TRAINED_KINDS))
def test_bf16_step_gives_float32_loss_and_gradients_to_bf16_accuracy(kind):
    cfg = ModelConfig(**{**BASE, **TRAINED_KINDS[kind]})
    params = training_fixtures.perturbed_params(cfg)
    loss32, grads32, _ = last_segment_loss_and_grads(cfg, params, tokens())
    bf16 = cfg.replace(compute_dtype='bfloat16')
    loss16, grads16, memory16 = last_segment_loss_and_grads(bf16, params, tokens())

    # Seen: loss within 1.3e-4 relative, the whole gradient within 1.2 %, every leaf within 9 %
    # (the smallest ones: a few roundings of values near zero); a bf16 softmax or loss would not be.
    assert loss16 == pytest.approx(float(loss32), rel=2e-3)
    assert loss16 != loss32  # The bf16 path did run in bf16.
    grads16, grads32 = jax.device_get((grads16, grads32))
    flat = lambda tree: np.concatenate([x.ravel() for x in jax.tree.leaves(tree)])
    assert relative_error(flat(grads16), flat(grads32)) < 0.03
    for (path, g32), g16 in zip(jax.tree_util.tree_leaves_with_path(grads32), jax.tree.leaves(grads16)):
        assert g16.dtype == np.float32, path  # Gradients of float32 parameters are float32.
        if float(np.linalg.norm(g32)) > 1e-6:
            assert relative_error(g16, g32) < 0.2, jax.tree_util.keystr(path)

    # The carried rows are bf16 (half the traffic); what accumulates across segments is float32.
    wide = {'log_norm', 'coefficients', 'mu', 'sigma2', 'rank'}
    for path, leaf in jax.tree_util.tree_leaves_with_path(memory16):
        name = jax.tree_util.keystr(path[-1:]).strip("[]'.")
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == (jnp.float32 if name in wide else jnp.bfloat16), jax.tree_util.keystr(path)


@pytest.mark.parametrize('evaluated', [dict(memory='xl_cached'), dict(memory='trams', trams_select=6, trams_remain=2)])
def test_bf16_evaluation_kinds_follow_float32(evaluated):
    """The evaluation-only kinds on float32-trained XL parameters: log-probs over segments (the
    pool and its TRAMS ranking carried) agree to bf16 accuracy."""
    trained = ModelConfig(**{**BASE, 'mem_len': 12})
    params = training_fixtures.perturbed_params(trained)
    seq = tokens(seed=4)
    results = {}
    for dtype in ('float32', 'bfloat16'):
        # compute_dtype is an evaluation override: float32-trained parameters, evaluated in bf16.
        cfg = memories.evaluation_config(trained, {**evaluated, 'compute_dtype': dtype}, segment_len=SEG)
        assert cfg.compute_dtype == dtype
        apply = jax.jit(model_lib.build_model(cfg).apply)
        memory, logprobs = model_lib.init_memory(cfg, seq.shape[0]), []
        for s in range(SEGMENTS):
            segment = seq[:, s * SEG:(s + 1) * SEG + 1]
            out, memory = apply({'params': params}, segment[:, :-1], memory, targets=segment[:, 1:])
            logprobs.append(out.target_logprobs)
        results[dtype] = np.concatenate(jax.device_get(logprobs), axis=1)
    assert results['bfloat16'].dtype == np.float32
    np.testing.assert_allclose(results['bfloat16'], results['float32'], atol=0.03)  # Seen: < 0.01 (ln 40 = 3.7).
    assert not np.array_equal(results['bfloat16'], results['float32'])


def test_lamemo_bf16_accumulation_does_not_overflow_or_drift_at_a_long_memory():
    """A memory of 1024 rows refreshed over 40 segments: the float32 log-denominators grow with the
    rows attended (log of a sum over up to 1024 + 8 keys) and stay finite, and the bf16 log-probs'
    distance from float32's does not grow with the segments (each interpolation is rounded to bf16
    once; alpha < 1 contracts the older roundings instead of adding them up)."""
    cfg = ModelConfig(**{**BASE, 'memory': 'lamemo', 'mem_len': 1024, 'd_model': 16, 'd_head': 8, 'd_inner': 32})
    params = jax.tree.map(lambda x: 4.0 * x, training_fixtures.perturbed_params(cfg))  # Larger logits: a harder test.
    seq = np.random.default_rng(5).integers(0, VOCAB, (1, 40 * SEG + 1), dtype=np.int32)

    def run(dtype):
        c = cfg.replace(compute_dtype=dtype)
        model = model_lib.build_model(c)

        def step(memory, segment):
            out, memory = model.apply({'params': params}, segment[:, :-1], memory, targets=segment[:, 1:])
            return memory, out.target_logprobs

        segments = np.stack([seq[:, s * SEG:(s + 1) * SEG + 1] for s in range(40)])
        memory, logprobs = jax.jit(lambda m: jax.lax.scan(step, m, segments))(model_lib.init_memory(c, 1))
        return jax.device_get((memory, logprobs))  # logprobs [segments, 1, SEG]

    memory32, full = run('float32')
    memory16, half = run('bfloat16')
    log_norm = memory16.layers['log_norm']
    assert log_norm.dtype == np.float32 and np.isfinite(log_norm).all()
    assert np.isfinite(half).all() and np.isfinite(memory16.layers['context'].astype(np.float32)).all()
    np.testing.assert_allclose(log_norm, memory32.layers['log_norm'], rtol=0.03)  # Logits to bf16 accuracy.
    error = np.abs(half - full).max(axis=(1, 2))  # Per segment.
    # Seen: at most 0.21 against log-probs down to -21 (1 %), the last ten segments' mean error
    # 0.06 against the first ten's 0.09.
    assert float(error.max()) < 0.02 * float(np.abs(full).max())
    assert float(error[-10:].mean()) < 1.5 * float(error[:10].mean())  # No drift with time.


def test_bf16_training_tracks_the_float32_loss_curve(tmp_path):
    """200 updates of configs/tiny.py through the trainer in each dtype (same data, same dropout
    draws): the bf16 curve learns as far as float32's and stays close to it all the way."""
    corpus = training_fixtures.write_text_corpus(str(tmp_path / 'corpus'))
    curves = {}
    for dtype in ('float32', 'bfloat16'):
        config = training_fixtures.tiny_config(
            corpus, model__compute_dtype=dtype, train__num_steps=200, train__log_every=10,
            train__eval_every=0, train__checkpoint_every=200)
        recorded, _ = training_fixtures.run_recording(config, str(tmp_path / dtype))
        curves[dtype] = np.array([loss for (prefix, _), loss in sorted(recorded.items(), key=lambda kv: kv[0][1])
                                  if prefix == 'train'])
    full, half = curves['float32'], curves['bfloat16']
    assert len(full) == len(half) == 20
    assert full[-1] < full[0] - 1.0  # The curve has something to track: it fell by over a nat.
    np.testing.assert_allclose(half, full, atol=0.05)
    assert abs(half[-5:].mean() - full[-5:].mean()) < 0.02


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_attention_softmax_keeps_only_its_rounded_weights_for_the_backward_pass(dtype):
    """The softmax's gradient (through the weights and the log-denominator) is autodiff's of the
    float32 formulas, and what it keeps for the backward pass is the weights in the compute dtype
    alone: no float32 copy of a [B, H, T, K] array beside them."""
    rng = np.random.default_rng(0)
    scores = 3.0 * rng.standard_normal((2, 3, 5, 7), np.float32)
    scores[..., -2:] = np.finfo(np.float32).min  # Masked keys, as the attention writes them.
    weights, norm_weights = rng.standard_normal(scores.shape, np.float32), rng.standard_normal(scores.shape[:-1], np.float32)

    def loss(fn, s):
        probs, log_norm = fn(s)
        return jnp.sum(probs.astype(jnp.float32) * weights) + jnp.sum(log_norm * norm_weights)

    ours = functools.partial(softmax.softmax_with_log_norm, dtype=jnp.dtype(dtype))
    reference = lambda s: (jax.nn.softmax(s, axis=-1), jax.nn.logsumexp(s, axis=-1))
    got, want = (np.asarray(jax.jit(jax.grad(functools.partial(loss, fn)))(scores)) for fn in (ours, reference))
    np.testing.assert_allclose(got, want, **({'atol': 1e-6} if dtype == 'float32' else {'atol': 0.02}))
    assert float(np.abs(got[..., -2:]).max()) == 0.0  # Nothing flows to masked keys.

    _, backward = jax.vjp(ours, scores)
    kept = [x for x in jax.tree.leaves(backward) if hasattr(x, 'shape') and x.shape == scores.shape]
    assert [x.dtype for x in kept] == [jnp.dtype(dtype)]


def test_bf16_scores_gradient_reaches_its_shift_and_products_in_bf16():
    """Under bf16 the masked scores are float32 (their softmax is), but their gradient is rounded
    to bf16 once and shifted and multiplied in bf16: every product of the backward that reads a
    [B, H, T, K] array reads bf16. The gradients agree with autodiff's of the float32 scores to
    bf16 accuracy."""
    rng = np.random.default_rng(1)
    batch, qlen, klen, heads, dim = 2, 5, 9, 3, 8
    operands = [rng.standard_normal(shape, np.float32) for shape in
                ((batch, qlen, heads, dim), (batch, klen, heads, dim), (batch, qlen, heads, dim), (klen, heads, dim))]
    valid = np.ones((batch, klen), bool)
    weights = rng.standard_normal((batch, heads, qlen, klen), np.float32)

    def loss(*xs):
        scores = attention.span_scores_masked(dim ** -0.5, *xs, valid)
        return jnp.sum(jnp.where(scores > -1e30, scores, 0.0) * weights)

    half = [jnp.asarray(x, jnp.bfloat16) for x in operands]
    assert attention.span_scores_masked(dim ** -0.5, *half, valid).dtype == jnp.float32
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2, 3)))(*half)
    backward_products = [eqn for eqn in jaxprs.equations(jaxpr.jaxpr) if eqn.primitive.name == 'dot_general'
                         and any(v.aval.shape[-1:] == (klen,) and v.aval.ndim == 4 for v in eqn.invars)]
    assert len(backward_products) == 4  # The content and positional terms' query and key gradients.
    for eqn in backward_products:
        assert [v.aval.dtype for v in eqn.invars] == [jnp.bfloat16] * 2, eqn
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*half)
    want = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*[x.astype(jnp.float32) for x in half])
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        assert relative_error(g, w) < 0.02  # Seen: ~0.3 %, a rounding or two of bf16.
