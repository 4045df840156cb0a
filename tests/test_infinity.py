"""The infinity-former's memory against the paper's equations and naive computations.

Ridge regression (eq. 5), the closed-form continuous attention (eq. 11) against numerical
integration and finite differences, sticky-memory histograms (eq. 16-17) and sampling, the
contraction of the old signal (eq. 13-15), the KL term (eq. 20), a per-step cost independent of the
context, per-layer sampling streams, bf16 gradients and an exact resume through the trainer.
"""

import logging
import math

import flax.linen as nn
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


def changed_first_segment(tokens, vocab_size=23):
    """A NumPy copy of `tokens` with its first segment's ids shifted by one."""
    other = tokens.copy()
    other[:, :SEG] = (tokens[:, :SEG] + 1) % vocab_size
    return other


def test_ridge_regression_reconstructs_a_smooth_signal_better_with_more_basis_functions():
    length = 128
    t = (np.arange(length) + 0.5) / length
    errors = []
    for n_basis in (8, 16, 32, 64):
        g = inf.ridge_matrix(tuple(t), tuple(inf.even_padding(length)), n_basis, (0.01, 0.05), 1.0)
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
    # Jitted: op by op, every evaluation of check_grads would compile each operation.
    closed = jax.jit(inf.expected_basis, static_argnums=(2, 3))(np.float32(mu), np.float32(sigma2), 6, (0.05, 0.1))
    np.testing.assert_allclose(closed, numeric, rtol=1e-4, atol=1e-5)
    weights = np.arange(1.0, 7.0, dtype=np.float32)
    check_grads(jax.jit(lambda m, s: jnp.dot(inf.expected_basis(m, s, 6, (0.05, 0.1)), weights)),
                (np.float32(mu), np.float32(sigma2)), order=1, modes=['rev'], eps=1e-3, atol=2e-2, rtol=2e-2)
    # The written-out gradient against autodiff of the density written naively, over many queries
    # and three widths.
    centres, widths = inf.gaussian_basis(24, (0.005, 0.01, 0.05))
    rng = np.random.default_rng(0)
    mu, sigma2 = rng.random((3, 5), np.float32), rng.uniform(1e-4, 0.05, (3, 5)).astype(np.float32)
    weights = rng.standard_normal((3, 5, 24), np.float32)
    naive = lambda m, s: jnp.sum(weights * jnp.exp(-0.5 * (m[..., None] - centres) ** 2 / (s[..., None] + widths ** 2))
                                 / jnp.sqrt(2 * np.pi * (s[..., None] + widths ** 2)))
    written = lambda m, s: jnp.sum(weights * inf.expected_basis(m, s, 24, (0.005, 0.01, 0.05)))
    gradients = [jax.jit(jax.grad(fn, (0, 1)))(mu, sigma2) for fn in (written, naive)]
    for got, expected in zip(*gradients):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * float(np.abs(expected).max()))


def test_sticky_histogram_is_the_erf_mass_per_bin_and_sums_to_one():
    rng = np.random.RandomState(0)
    mu, sigma2 = rng.uniform(0, 1, (2, 3, 4)), rng.uniform(1e-3, 0.1, (2, 3, 4))
    bins = 5
    histogram = jax.jit(inf.sticky_histogram, static_argnums=2)
    got = np.asarray(histogram(mu.astype(np.float32), sigma2.astype(np.float32), bins))
    phi = lambda x, m, s2: 0.5 * (1 + math.erf((x - m) / math.sqrt(2 * s2)))
    for b in range(2):
        mass = [sum(phi((k + 1) / bins, m, s) - phi(k / bins, m, s) for m, s in zip(mu[b].ravel(), sigma2[b].ravel()))
                for k in range(bins)]
        np.testing.assert_allclose(got[b], np.asarray(mass) / sum(mass), rtol=1e-5)
    np.testing.assert_allclose(got.sum(-1), 1.0, rtol=1e-6)


def test_sticky_positions_follow_the_histogram():
    histogram = np.asarray([[0.05, 0.4, 0.05, 0.1, 0.0, 0.2, 0.1, 0.1]], np.float32)
    positions = np.asarray(jax.jit(inf.sticky_positions, static_argnums=2)(jax.random.key(0), histogram, 20_000))[0]
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


def test_kl_term_is_the_kl_divergence_of_eq_20_with_and_without_the_mean_term():
    """Unset mu0: the prior is centred on mu (variance only); mu0 = -1 as the released GPT-2 runs."""
    grid = np.linspace(-2.0, 2.0, 400_001)
    sigma0 = 0.05
    density = lambda m, s2: np.exp(-0.5 * (grid - m) ** 2 / s2) / np.sqrt(2 * np.pi * s2)
    for mu, mu0 in ((0.3, None), (0.3, 0.25), (0.1, -0.1), (0.8, -1.0)):
        for sigma2 in (0.0004, 0.0025, 0.04):
            p, q = density(mu, sigma2), density(mu if mu0 is None else mu0, sigma0 ** 2)
            numeric = np.trapezoid(p * (np.log(p + 1e-300) - np.log(q + 1e-300)), grid)
            if mu0 == -1.0:  # The prior's mass is far outside the grid: the closed form of eq. 20.
                numeric = 0.5 * (sigma2 / sigma0 ** 2 - np.log(sigma2 / sigma0 ** 2) - 1 + (mu + 1) ** 2 / sigma0 ** 2)
            got = float(inf.kl_to_prior(jnp.float32(mu), jnp.float32(sigma2), sigma0, mu0))
            np.testing.assert_allclose(got, numeric, rtol=1e-3, atol=1e-6)


def code_ridge(positions, n_basis, widths, ridge):
    """The released code's G (finetune_gpt2 LongTermAttention.compute_G), re-derived naively in
    float64: F [N, n] over every position, G = F^T (F F^T + lambda I)^-1, then floor(n_real / 2)
    rows cut from each end (n_real: the positions that are not padding)."""
    centres = np.repeat(np.linspace(0, 1, n_basis // len(widths)), len(widths))
    sigmas = np.tile(widths, n_basis // len(widths))
    f = np.exp(-0.5 * ((positions[None, :] - centres[:, None]) / sigmas[:, None]) ** 2) / (
        sigmas[:, None] * np.sqrt(2 * np.pi))
    g = f.T @ np.linalg.inv(f @ f.T + ridge * np.eye(n_basis))
    cut = (len(positions) - len(positions) // 2) // 2  # n_real = len - (pads), pads = 2 floor(n_real / 2).
    return g[cut:len(positions) - cut]


def code_g_fresh(length, n_basis, widths, ridge):
    """G_L: the code's linspace, odd and even lengths taking their own branch."""
    if length % 2:
        positions = np.linspace(-0.5 + 1 / length, 1.5 - 1 / length, 2 * length - 1)
    else:
        positions = np.linspace(-0.5 + 1 / (2 * length), 1.5 - 1 / (2 * length), 2 * length)
    return code_ridge(positions, n_basis, widths, ridge)


def code_g_inf(length, samples, tau, n_basis, widths, ridge):
    """G_inf: old samples at k tau / M, new rows at tau + (1 - tau) k / L, between the pads of a
    grid shifted by 1 / (2L + M) (the code's even-L branch; memjax uses it for odd L too)."""
    real = np.concatenate([np.arange(1, samples + 1) * tau / samples,
                           tau + (1 - tau) * np.arange(1, length + 1) / length])
    shift = 1 / (2 * length + samples)
    grid = np.linspace(-0.5 + shift, 1.5 - shift, 2 * (length + samples))
    return code_ridge(np.concatenate([grid[grid < 0], real, grid[grid > 1]]), n_basis, widths, ridge)


@pytest.mark.parametrize('length, samples, n_basis, widths, tau, ridge', [
    (8, 12, 16, (0.05, 0.1), 0.5, 0.5),  # Even L, M != L, L + M even.
    (7, 10, 12, (0.01, 0.05), 0.75, 1.0),  # Odd L, M != L, L + M odd.
])
def test_regression_matrices_are_the_released_codes(length, samples, n_basis, widths, tau, ridge):
    kind = inf.InfinityMemory(tiny(segment_len=length, ltm_samples=samples, ltm_basis=n_basis, ltm_widths=widths,
                                   ltm_tau=tau, ltm_ridge=ridge))
    expected_inf = code_g_inf(length, samples, tau, n_basis, np.asarray(widths), ridge)
    assert expected_inf.shape == (samples + length, n_basis)
    np.testing.assert_allclose(np.concatenate(kind.update_matrices()), expected_inf, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kind.fresh_matrix(), code_g_fresh(length, n_basis, np.asarray(widths), ridge),
                               rtol=1e-5, atol=1e-6)
    # The named alternative pads at the rows' spacing, and it is another matrix.
    even = inf.InfinityMemory(kind.config.replace(ltm_padding='even'))
    np.testing.assert_allclose(even.fresh_matrix(), kind.fresh_matrix())
    assert np.abs(np.concatenate(even.update_matrices()) - expected_inf).max() > 1e-3


def test_the_released_code_options_refuse_unknown_values_in_one_round():
    with pytest.raises(ValueError) as error:
        tiny(ltm_padding='code', ltm_sticky_within_bin='centre', ltm_kl_mu0=float('nan'), ltm_tau=1.0)
    for field in ("ltm_padding='code' must be one of ('released', 'even')",
                  "ltm_sticky_within_bin='centre' must be one of ('uniform', 'left_edge')",
                  'ltm_kl_mu0=nan must be a finite number', 'ltm_tau=1.0'):
        assert field in str(error.value)


def naive_gate(params, x):
    """x * sigmoid(Conv1d(x)), width 3, zero-padded, as torch's Conv1d(e, e, 3, padding=1)."""
    padded = np.pad(x, ((0, 0), (1, 1), (0, 0)))
    conv = sum(padded[:, k:k + x.shape[1]] @ params['kernel'][k] for k in range(3)) + params['bias']
    return x / (1 + np.exp(-conv))


@pytest.mark.parametrize('sticky', [False, True])
def test_carried_coefficients_follow_the_released_update_three_times(sticky):
    """The coefficients after a fresh fit and three updates, against the code's update written
    naively: B = x G_L, then B = [B^T psi(t_k), x] G_inf with t_k = k / M (or the sticky draws, at
    their bins' left edges as the code places them)."""
    seg, samples, n_basis, widths, tau = 6, 10, 12, (0.05, 0.1), 0.5
    cfg = tiny(n_layer=1, segment_len=seg, ltm_samples=samples, ltm_basis=n_basis, ltm_widths=widths, ltm_tau=tau,
               ltm_ridge=0.5, ltm_sticky=sticky, ltm_sticky_bins=8, ltm_sticky_within_bin='left_edge')
    layer = inf.InfinityLayerMemory(cfg)
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((4, 2, seg, cfg.d_model), np.float32)
    shared = lambda tokens: {'valid': np.ones((2, seg), bool), 'ltm_tokens': np.full((2,), tokens, np.int32)}
    state = {'hidden': rows[0], 'coefficients': np.zeros((2, n_basis, cfg.d_model), np.float32),
             'mu': rng.random((2, cfg.n_head, seg), np.float32),
             'sigma2': np.full((2, cfg.n_head, seg), 0.01, np.float32)}
    refit = lambda m, st, sh: m._refit(st, sh)
    # Jitted: op by op, the refit would compile each of its operations.
    params = nn.unbox(jax.jit(lambda keys, st, sh: layer.init(keys, st, sh, method=refit))(
        {'params': jax.random.key(2), 'sticky': jax.random.key(3)}, state, shared(0))['params'])
    apply = jax.jit(lambda p, st, sh, key: layer.apply({'params': p}, st, sh, method=refit, rngs={'sticky': key},
                                                       mutable='intermediates'))
    gate = jax.tree.map(np.asarray, params['gate'])
    centres, sigmas = inf.gaussian_basis(n_basis, widths)
    expected = np.einsum('bsd,sn->bnd', naive_gate(gate, rows[0]),
                         code_g_fresh(seg, n_basis, np.asarray(widths), 0.5))
    g_inf = code_g_inf(seg, samples, tau, n_basis, np.asarray(widths), 0.5)
    for step in range(4):
        got, sown = apply(params, {**state, 'hidden': rows[step]}, shared(step * seg), jax.random.key(10 + step))
        if step:
            if sticky:
                t = np.asarray(sown['intermediates']['sticky_positions'][0])
                assert np.allclose(t * 8, np.round(t * 8)), 'left bin edges'
                psi = inf.basis_values(t, centres, sigmas)  # [B, M, N]
            else:
                psi = np.broadcast_to(inf.basis_values(np.arange(1, samples + 1) / samples, centres, sigmas),
                                      (2, samples, n_basis))
            signal = np.concatenate([np.einsum('bmn,bnd->bmd', psi, expected),
                                     naive_gate(gate, rows[step])], axis=1)
            expected = np.einsum('bsd,sn->bnd', signal, g_inf)
        np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-5 * np.abs(expected).max())
        state = {**state, 'coefficients': got}


def test_a_memory_of_part_of_a_segment_passes_every_token_of_a_document_to_the_ltm():
    """mem_len = 8 with segments of 6: once per document the waiting block's oldest 2 rows precede
    the document. That block starts the LTM from its 4 rows alone (the code's G_L for 4 rows, the gate
    zero-padded at the document's start), where an aligned row fits all 6; the LTM counts 4 tokens."""
    seg, mem, n_basis, widths = 6, 8, 12, (0.05, 0.1)
    cfg = tiny(n_layer=1, segment_len=seg, mem_len=mem, ltm_basis=n_basis, ltm_widths=widths, ltm_ridge=0.5)
    kind, layer = inf.InfinityMemory(cfg), inf.InfinityLayerMemory(cfg)
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((2, seg + mem, cfg.d_model), np.float32)
    valid = np.ones((2, seg + mem), bool)
    valid[0, :2] = False  # Row 0: the document started 4 rows into the waiting block; row 1: long before.
    shared = {'valid': valid, 'ltm_tokens': np.zeros((2,), np.int32)}
    state = {'hidden': hidden, 'coefficients': np.zeros((2, n_basis, cfg.d_model), np.float32),
             'mu': np.zeros((2, cfg.n_head, seg), np.float32), 'sigma2': np.full((2, cfg.n_head, seg), 0.01, np.float32)}
    refit = lambda m, st, sh: m._refit(st, sh)
    params = nn.unbox(jax.jit(lambda key: layer.init(key, state, shared, method=refit))(jax.random.key(2))['params'])
    got = np.asarray(jax.jit(lambda p: layer.apply({'params': p}, state, shared, method=refit))(params))
    gate = jax.tree.map(np.asarray, params['gate'])
    for row, first in ((0, 2), (1, 0)):
        rows = hidden[row:row + 1, first:seg]
        expected = np.einsum('bsd,sn->bnd', naive_gate(gate, rows),
                             code_g_fresh(seg - first, n_basis, np.asarray(widths), 0.5))[0]
        np.testing.assert_allclose(got[row], expected, rtol=2e-4, atol=2e-5 * np.abs(expected).max())
    assert np.asarray(kind.waiting_used(shared)).tolist() == [True, True]
    advanced = kind.advance(shared, np.zeros((2, seg, cfg.d_model), np.float32))
    assert np.asarray(advanced['ltm_tokens']).tolist() == [4, 6]


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
    tokens = training_fixtures.random_tokens(1, (2, 60 * SEG), cfg.vocab_size)
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
        lambda path, x: np.asarray(x) * np.float32(100) if 'memory' in str(path) and 'out' in str(path) else x, params)
    (_, memory), _ = forward(cfg, params, tokens[:, :SEG], model_lib.init_memory(cfg, 2))
    reference = model_lib.init_memory(cfg, 2)
    for step in range(5):
        (out, reference), _ = forward(cfg, params, tokens[:, step * SEG:(step + 1) * SEG], reference)
    logprobs[4] = np.asarray(out.target_logprobs)
    other = changed_first_segment(tokens, cfg.vocab_size)
    memory = model_lib.init_memory(cfg, 2)
    for step in range(5):
        (out, memory), _ = forward(cfg, params, other[:, step * SEG:(step + 1) * SEG], memory)
    assert np.abs(np.asarray(out.target_logprobs) - logprobs[4]).max() > 1e-5


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
        return np.asarray(memory.layers['coefficients'])[0]

    a = training_fixtures.random_tokens(4, (2, 5 * SEG), tiny().vocab_size)
    b = changed_first_segment(a)
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


def test_the_models_kl_loss_is_eq_20_over_its_queries_with_the_released_prior_mean(forward):
    """The reported 'kl' is the head-mean, query- and row-sum of KL(N(mu, sigma2) || N(-1, s0^2))
    over the densities the layer used (those the memory carries on), summed over layers."""
    cfg = tiny(ltm_kl_mu0=-1.0)
    params = model_lib.init_params(cfg, jax.random.key(0))
    tokens = training_fixtures.random_tokens(5, (2, SEG), cfg.vocab_size)
    (_, memory), _ = forward(cfg, params, tokens, model_lib.init_memory(cfg, 2))
    (out, memory), _ = forward(cfg, params, tokens, memory)
    mu, sigma2 = np.asarray(memory.layers['mu'], np.float64), np.asarray(memory.layers['sigma2'], np.float64)
    ratio = sigma2 / 0.05 ** 2
    naive = 0.5 * (ratio - np.log(ratio) - 1 + (mu + 1) ** 2 / 0.05 ** 2)
    np.testing.assert_allclose(float(out.losses['kl']), naive.mean(axis=2).sum(), rtol=1e-5)
    assert float(out.losses['kl']) > 1.01 * (0.5 * (ratio - np.log(ratio) - 1)).mean(axis=2).sum()


def test_layers_draw_their_own_sticky_positions(forward):
    cfg = tiny(ltm_sticky=True, ltm_sticky_bins=8)
    params = model_lib.init_params(cfg, jax.random.key(0))
    tokens = training_fixtures.random_tokens(2, (2, SEG), cfg.vocab_size)
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
    tokens = training_fixtures.random_tokens(3, (2, SEG), cfg.vocab_size)

    def loss(p, memory):
        out, memory = model.apply({'params': p}, tokens, memory, targets=tokens, rngs={'sticky': jax.random.key(1)})
        return -out.target_logprobs.sum() + 1e-5 * out.losses['kl'], (memory, out.losses['kl'])

    grad = jax.jit(jax.grad(loss, has_aux=True))
    memory = model_lib.init_memory(cfg, 2)
    for _ in range(3):
        grads, (memory, kl) = grad(params, memory)
    assert float(kl) > 0
    grads = jax.device_get(grads)  # Checked in NumPy: eager JAX would compile a check per leaf shape.
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert float(np.abs(grads['layer_0']['memory']['gate']['kernel']).sum()) > 0  # The gate learns.


def test_tiny_infinity_former_resumes_exactly(tmp_path, caplog):
    corpus = training_fixtures.write_text_corpus(str(tmp_path / 'corpus'))
    config = training_fixtures.tiny_config(
        corpus, model__memory='infinity', model__n_layer=1, model__mem_len=8, model__ltm_basis=16, model__ltm_widths=(0.05, 0.1),
        model__ltm_sticky=True, model__ltm_reset_tokens=48, train__num_steps=8, train__memory_learning_rate=1e-3)
    with caplog.at_level(logging.INFO):
        training_fixtures.assert_resumes_exactly(config, tmp_path)
    # The start-up line names both memories (its short-term one alone read "memory 8").
    assert "Model: memory 'infinity', 1 layer x 32, long-term memory of 16 basis functions (sticky) and 8 recent " \
        'tokens' in caplog.text
