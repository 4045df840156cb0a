"""The infinity-former's memory against the paper's equations and naive computations.

Ridge regression (eq. 5), the closed-form continuous attention (eq. 11) against numerical
integration and finite differences, sticky-memory histograms (eq. 16-17) and sampling, the
contraction of the old signal (eq. 13-15), the KL term (eq. 20), a per-step cost independent of the
context, per-layer sampling streams, bf16 gradients and an exact resume through the trainer.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from memjax import model as model_lib
from memjax.model import ModelConfig
from memjax.model.memories import infinity as inf
import training_fixtures

SEG = 8


def smooth(t):
    return np.sin(2 * np.pi * t) + 0.5 * np.cos(6 * np.pi * t)


def test_ridge_regression_reconstructs_a_smooth_signal_better_with_more_basis_functions():
    length = 128
    t = (np.arange(length) + 0.5) / length
    errors = []
    for n_basis in (8, 16, 32, 64):
        g = inf.ridge_matrix(tuple(t), n_basis, (0.01, 0.05), 1.0)
        centres, widths = inf.gaussian_basis(n_basis, (0.01, 0.05))
        rebuilt = inf.basis_values(t, centres, widths) @ (smooth(t) @ g)
        errors.append(float(np.sqrt(np.mean((rebuilt - smooth(t)) ** 2))))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 0.05, errors  # The signal's RMS is 0.79.


def test_expected_basis_is_the_integral_and_its_gradient_matches_finite_differences_and_autodiff():
    centres, widths = inf.gaussian_basis(6, (0.05, 0.1))
    mu, sigma2 = 0.3, 0.02
    grid = np.linspace(-3.0, 4.0, 200_001)
    density = np.exp(-0.5 * (grid - mu) ** 2 / sigma2) / np.sqrt(2 * np.pi * sigma2)
    numeric = np.trapezoid(density[:, None] * inf.basis_values(grid, centres, widths), grid, axis=0)
    closed = inf.expected_basis(jnp.float32(mu), jnp.float32(sigma2), 6, (0.05, 0.1))
    np.testing.assert_allclose(closed, numeric, rtol=1e-4, atol=1e-5)
    weights = jnp.arange(1.0, 7.0)
    check_grads(lambda m, s: jnp.dot(inf.expected_basis(m, s, 6, (0.05, 0.1)), weights),
                (jnp.float32(mu), jnp.float32(sigma2)), order=1, modes=['rev'], eps=1e-3, atol=2e-2, rtol=2e-2)
    # The written-out gradient against autodiff of the density written naively, over many queries
    # and three widths.
    centres, widths = inf.gaussian_basis(24, (0.005, 0.01, 0.05))
    k_mu, k_s, k_w = jax.random.split(jax.random.key(0), 3)
    mu, sigma2 = jax.random.uniform(k_mu, (3, 5)), jax.random.uniform(k_s, (3, 5), minval=1e-4, maxval=0.05)
    weights = jax.random.normal(k_w, (3, 5, 24))
    naive = lambda m, s: jnp.sum(weights * jnp.exp(-0.5 * (m[..., None] - centres) ** 2 / (s[..., None] + widths ** 2))
                                 / jnp.sqrt(2 * np.pi * (s[..., None] + widths ** 2)))
    written = lambda m, s: jnp.sum(weights * inf.expected_basis(m, s, 24, (0.005, 0.01, 0.05)))
    for got, expected in zip(jax.grad(written, (0, 1))(mu, sigma2), jax.grad(naive, (0, 1))(mu, sigma2)):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * float(jnp.abs(expected).max()))


def test_sticky_histogram_is_the_erf_mass_per_bin_and_sums_to_one():
    rng = np.random.RandomState(0)
    mu, sigma2 = rng.uniform(0, 1, (2, 3, 4)), rng.uniform(1e-3, 0.1, (2, 3, 4))
    bins = 5
    got = np.asarray(inf.sticky_histogram(jnp.asarray(mu), jnp.asarray(sigma2), bins))
    phi = lambda x, m, s2: 0.5 * (1 + math.erf((x - m) / math.sqrt(2 * s2)))
    for b in range(2):
        mass = [sum(phi((k + 1) / bins, m, s) - phi(k / bins, m, s) for m, s in zip(mu[b].ravel(), sigma2[b].ravel()))
                for k in range(bins)]
        np.testing.assert_allclose(got[b], np.asarray(mass) / sum(mass), rtol=1e-5)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-6)


def test_sticky_positions_follow_the_histogram():
    histogram = jnp.asarray([[0.05, 0.4, 0.05, 0.1, 0.0, 0.2, 0.1, 0.1]])
    positions = np.asarray(inf.sticky_positions(jax.random.key(0), histogram, 20_000))[0]
    assert np.all(np.diff(positions) >= 0) and positions.min() >= 0 and positions.max() <= 1
    counts = np.histogram(positions, bins=8, range=(0, 1))[0]
    expected = 20_000 * np.asarray(histogram[0])
    seen = expected > 0
    assert counts[~seen].sum() == 0
    chi2 = float(np.sum((counts[seen] - expected[seen]) ** 2 / expected[seen]))
    assert chi2 < 22.5  # 6 degrees of freedom: p = 0.001.


def tiny(**changes) -> ModelConfig:
    fields = dict(vocab_size=23, memory='infinity', d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32,
                  mem_len=0, segment_len=SEG, ltm_basis=16, ltm_widths=(0.05, 0.1), ltm_tau=0.5, dropout=0.0)
    return ModelConfig(**{**fields, **changes})


def test_contraction_keeps_the_old_signal_in_the_first_tau():
    """After one update, the new signal on [0, tau] is the old one on [0, 1], squeezed (eq. 13),
    and on (tau, 1] the new rows."""
    seg = 64
    kind = inf.InfinityMemory(tiny(segment_len=seg, ltm_basis=64, ltm_widths=(0.01, 0.05), ltm_ridge=0.5))
    t = (np.arange(seg) + 0.5) / seg
    old = smooth(t) @ kind.fresh_matrix()
    _, new_rows = kind.update_matrices()
    new = kind.even_resample_matrix() @ old + np.cos(4 * np.pi * t) @ new_rows
    centres, widths = kind.basis
    u = np.linspace(0.05, 0.95, 19)
    tau = kind.config.ltm_tau
    squeezed = inf.basis_values(u * tau, centres, widths) @ new
    np.testing.assert_allclose(squeezed, inf.basis_values(u, centres, widths) @ old, atol=0.1)
    np.testing.assert_allclose(inf.basis_values(tau + (1 - tau) * u, centres, widths) @ new,
                               np.cos(4 * np.pi * u), atol=0.2)


def test_kl_term_is_the_kl_divergence_of_eq_20():
    grid = np.linspace(-2.0, 2.0, 400_001)
    sigma0 = 0.05
    for sigma2 in (0.0004, 0.0025, 0.04):
        p = np.exp(-0.5 * grid ** 2 / sigma2) / np.sqrt(2 * np.pi * sigma2)
        q = np.exp(-0.5 * grid ** 2 / sigma0 ** 2) / np.sqrt(2 * np.pi * sigma0 ** 2)
        numeric = np.trapezoid(p * (np.log(p + 1e-300) - np.log(q + 1e-300)), grid)
        np.testing.assert_allclose(float(inf.kl_to_prior(jnp.float32(sigma2), sigma0)), numeric, rtol=1e-3, atol=1e-6)


@pytest.fixture(scope='module')
def forward():
    """A jitted evaluation forward of the tiny model (compiled once per config)."""
    compiled = {}

    def run(cfg, params, tokens, memory, key=jax.random.key(0)):
        if cfg not in compiled:
            compiled[cfg] = jax.jit(lambda p, x, m, k: model_lib.build_model(cfg).apply(
                {'params': p}, x, m, targets=x, rngs={'sticky': k}, mutable='intermediates'))
        return compiled[cfg](params, tokens, memory, key)

    run.compiled = compiled
    return run


def test_per_step_cost_and_shapes_do_not_grow_with_the_context(forward):
    cfg = tiny(n_layer=1)
    params = model_lib.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 60 * SEG), 0, cfg.vocab_size)
    memory = after_one = model_lib.init_memory(cfg, 2)
    logprobs = []
    for step in range(60):
        (out, memory), _ = forward(cfg, params, tokens[:, step * SEG:(step + 1) * SEG], memory)
        logprobs.append(out.target_logprobs)
        if step == 0:
            after_one = memory
    assert jax.tree.map(jnp.shape, memory) == jax.tree.map(jnp.shape, after_one)
    np.testing.assert_array_equal(memory.shared['ltm_tokens'], 59 * SEG)  # Unbounded: no threshold.
    step_fn = forward.compiled[cfg]
    flops = [step_fn.lower(params, tokens[:, :SEG], m, jax.random.key(0)).cost_analysis()['flops']
             for m in (after_one, memory)]
    assert flops[0] == flops[1] > 0
    # The memory is used: another first segment changes the fifth segment's log-probs (the LTM's
    # output map scaled up from its small initialisation; identical computations otherwise, so any
    # difference comes from the memory).
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 100 if 'memory' in str(path) and 'out' in str(path) else x, params)
    (_, memory), _ = forward(cfg, params, tokens[:, :SEG], model_lib.init_memory(cfg, 2))
    reference = model_lib.init_memory(cfg, 2)
    for step in range(5):
        (out, reference), _ = forward(cfg, params, tokens[:, step * SEG:(step + 1) * SEG], reference)
    logprobs[4] = out.target_logprobs
    other = tokens.at[:, :SEG].set((tokens[:, :SEG] + 1) % cfg.vocab_size)
    memory = model_lib.init_memory(cfg, 2)
    for step in range(5):
        (out, memory), _ = forward(cfg, params, other[:, step * SEG:(step + 1) * SEG], memory)
    assert np.abs(out.target_logprobs - logprobs[4]).max() > 1e-5


def test_ltm_starts_afresh_after_the_token_threshold_and_at_a_document_start():
    # One layer, no STM: a layer's waiting rows are the previous segment's embeddings, so once the
    # LTM starts afresh its coefficients no longer depend on older text. Streams A and B differ
    # only in segment 0; the LTM first holds segment 0 at step 1, then 8 tokens, 16 at step 2.
    def coefficients(cfg, tokens, resets):
        model, params = model_lib.build_model(cfg), model_lib.init_params(cfg, jax.random.key(0))
        apply = jax.jit(lambda x, m, r: model.apply({'params': params}, x, m, reset=r)[1])
        memory = model_lib.init_memory(cfg, 2)
        for step, reset in enumerate(resets):
            memory = apply(tokens[:, step * SEG:(step + 1) * SEG], memory, jnp.asarray(reset))
        return np.asarray(memory.layers['coefficients'][0])

    a = jax.random.randint(jax.random.key(4), (2, 5 * SEG), 0, 23)
    b = a.at[:, :SEG].set((a[:, :SEG] + 1) % 23)
    keep = [[False, False]] * 4
    unbounded = tiny(n_layer=1)
    assert np.abs(coefficients(unbounded, a, keep) - coefficients(unbounded, b, keep)).max() > 1e-4
    # ltm_reset_tokens=16: at step 3 the LTM holds 16 tokens and is refitted from segment 2 alone.
    threshold = tiny(n_layer=1, ltm_reset_tokens=2 * SEG)
    np.testing.assert_allclose(coefficients(threshold, a, keep), coefficients(threshold, b, keep), atol=1e-6)
    # A document starting in row 0 at step 3: that row's LTM is empty there, then holds segment 3.
    doc = keep[:3] + [[True, False], [False, False]]
    with_a, with_b = coefficients(unbounded, a, doc), coefficients(unbounded, b, doc)
    np.testing.assert_allclose(with_a[0], with_b[0], atol=1e-6)
    assert np.abs(with_a[1] - with_b[1]).max() > 1e-4


def test_layers_draw_their_own_sticky_positions(forward):
    cfg = tiny(ltm_sticky=True, ltm_sticky_bins=8)
    params = model_lib.init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (2, SEG), 0, cfg.vocab_size)
    memory = model_lib.init_memory(cfg, 2)
    for _ in range(3):
        (_, memory), sown = forward(cfg, params, tokens, memory)
    drawn = [sown['intermediates'][f'layer_{i}']['memory']['sticky_positions'][0] for i in range(2)]
    assert drawn[0].shape == (2, cfg.ltm_basis) and np.all(np.diff(drawn[0], axis=-1) >= 0)
    assert not np.allclose(drawn[0], drawn[1])


def test_gradients_are_finite_with_bf16_compute():
    cfg = tiny(compute_dtype='bfloat16', ltm_sticky=True, n_layer=1)
    params = model_lib.init_params(cfg, jax.random.key(0))
    model = model_lib.build_model(cfg)
    tokens = jax.random.randint(jax.random.key(3), (2, SEG), 0, cfg.vocab_size)

    def loss(p, memory):
        out, memory = model.apply({'params': p}, tokens, memory, targets=tokens, rngs={'sticky': jax.random.key(1)})
        return -out.target_logprobs.sum() + 1e-5 * out.losses['kl'], (memory, out.losses['kl'])

    grad = jax.jit(jax.grad(loss, has_aux=True))
    memory = model_lib.init_memory(cfg, 2)
    for _ in range(3):
        grads, (memory, kl) = grad(params, memory)
    assert float(kl) > 0
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads['layer_0']['memory']['gate']['kernel']).sum()) > 0  # The gate learns.


def test_tiny_infinity_former_resumes_exactly(tmp_path):
    corpus = training_fixtures.write_text_corpus(str(tmp_path / 'corpus'))
    config = training_fixtures.tiny_config(
        corpus, model__memory='infinity', model__n_layer=1, model__mem_len=8, model__ltm_basis=16, model__ltm_widths=(0.05, 0.1),
        model__ltm_sticky=True, model__ltm_reset_tokens=48, train__num_steps=8, train__memory_learning_rate=1e-3)
    training_fixtures.assert_resumes_exactly(config, tmp_path)
