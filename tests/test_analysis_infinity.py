"""memjax.analysis.infinity against naive computations: the memory space per token (closed form
without sticky memories, a per-token loop over the sticky draws), the regression error against a
direct least-squares ridge solve, and the trace of a tiny sticky model against applying it step by
step (its densities, draws, the text its LTM holds and the attention histogram of eq. 16)."""

import math

import jax
import numpy as np
import pytest

from memjax import model as model_lib
from memjax.analysis import Segment, infinity
from memjax.model import ModelConfig
from memjax.model.memories.infinity import sticky_positions

SEG = 8


@pytest.mark.parametrize('segment_len, tau, samples, updates', [(4, 0.5, 16, 3), (5, 0.75, 7, 5), (3, 0.3, 2, 4)])
def test_without_sticky_memories_every_token_is_contracted_by_tau_per_update(segment_len, tau, samples, updates):
    spaces = infinity.memory_spaces(segment_len, tau, [infinity.even_positions(samples)] * updates)
    # The first segment filled [0, 1]; segment i >= 1 came in on (1 - tau) of it; each update since: x tau.
    closed = [tau ** updates / segment_len] + [(1 - tau) * tau ** (updates - i) / segment_len
                                               for i in range(1, updates + 1)]
    np.testing.assert_allclose(spaces, np.repeat(closed, segment_len), rtol=1e-12)
    np.testing.assert_allclose(infinity.segment_edges(spaces, segment_len), tau ** np.arange(updates, 0, -1),
                               rtol=1e-12)


def naive_spaces(segment_len, tau, draws):
    """Token by token: each stretch between consecutive samples (from 0) becomes tau / M of the new
    signal, shared among the tokens by their overlap with it; a repeated sample (no stretch) goes
    whole to the token its position lies in."""
    lengths = [1.0 / segment_len] * segment_len
    for samples in draws:
        edges = np.concatenate([[0.0], np.cumsum(lengths)])
        tokens = list(zip(edges[:-1], edges[1:]))
        new = [0.0] * len(tokens)
        q = [0.0] + sorted(samples)
        for lo, hi in zip(q[:-1], q[1:]):
            for i, (a, b) in enumerate(tokens):
                if hi > lo:
                    new[i] += tau / len(samples) * max(0.0, min(b, hi) - max(a, lo)) / (hi - lo)
                elif a <= lo < b:
                    new[i] += tau / len(samples)
        lengths = new + [(1 - tau) / segment_len] * segment_len
    return np.asarray(lengths)


@pytest.mark.parametrize('within_bin', ['uniform', 'left_edge'])
def test_with_sticky_draws_each_token_holds_the_stretches_sampled_in_it(within_bin):
    # 16 bins and segments of 4: bin edges fall on token edges, and left-edge draws repeat.
    segment_len, tau, samples, bins = 4, 0.5, 12, 16
    rng = np.random.RandomState(0)
    histogram = rng.dirichlet(np.full(bins, 0.3), size=4).astype(np.float32)
    # Jitted: op by op, the draw would compile each of its operations.
    draws = np.asarray(jax.jit(sticky_positions, static_argnums=(2, 3))(jax.random.key(1), histogram, samples,
                                                                        within_bin), np.float64)
    spaces = infinity.memory_spaces(segment_len, tau, draws)
    np.testing.assert_allclose(spaces, naive_spaces(segment_len, tau, draws), rtol=1e-9, atol=1e-12)
    assert np.all(spaces >= 0) and math.isclose(spaces.sum(), 1.0, rel_tol=1e-12)
    # One update: a token's new room is tau / M per sample in it, give or take one sample's.
    before = infinity.memory_spaces(segment_len, tau, draws[:3])
    edges = np.concatenate([[0.0], np.cumsum(before)])
    counts = np.array([np.sum((draws[3] >= a) & (draws[3] < b)) for a, b in zip(edges[:-1], edges[1:])])
    after = infinity.memory_spaces(segment_len, tau, draws[:4])[:len(before)]
    assert np.all(np.abs(after - tau * counts / samples) <= tau / samples + 1e-12)
    assert np.abs(after - tau * before).max() > tau / samples / 2  # Not the even contraction.


def test_regression_error_is_the_direct_ridge_solve():
    """Zero-padded beside [0, 1] at the rows' spacing, min ||F B - X||^2 + lambda ||B||^2 solved as
    the least squares of the system stacked with sqrt(lambda) I."""
    length, ridge, widths = 40, 0.5, (0.02, 0.1)
    cfg = ModelConfig(vocab_size=23, memory='infinity', d_model=16, n_layer=1, n_head=2, d_head=8, d_inner=32,
                      segment_len=SEG, ltm_basis=8, ltm_widths=widths, ltm_ridge=ridge)
    t = (np.arange(length) + 0.5) / length
    rng = np.random.RandomState(0)
    signal = np.stack([np.sin(5 * t), np.cos(11 * t) + 0.3 * rng.randn(length), t ** 2], axis=1)
    n_basis = (4, 8, 16, 32, 64)
    got = infinity.regression_errors(signal, cfg, n_basis)
    pads = -(np.arange(length // 2) + 0.5) / length
    every = np.concatenate([pads[::-1], t, 1 - pads])
    target = np.concatenate([np.zeros((len(pads), 3)), signal, np.zeros((len(pads), 3))])
    for n, error in zip(n_basis, got):
        centres = np.repeat(np.linspace(0, 1, n // 2), 2)
        sigmas = np.tile(widths, n // 2)
        psi = lambda x: np.exp(-0.5 * ((x[:, None] - centres) / sigmas) ** 2) / (sigmas * np.sqrt(2 * np.pi))
        system = np.concatenate([psi(every), np.sqrt(ridge) * np.eye(n)])
        coefficients = np.linalg.lstsq(system, np.concatenate([target, np.zeros((n, 3))]), rcond=None)[0]
        np.testing.assert_allclose(error, np.mean((psi(t) @ coefficients - signal) ** 2), rtol=2e-4)
    assert got[-1] < got[0] / 4


def _traced(mem_len: int):
    """A tiny sticky model over 10 segments of 2 streams, stream 1 starting a document at step 5;
    the LTM restarts after 4 segments."""
    cfg = ModelConfig(vocab_size=23, memory='infinity', d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32,
                      mem_len=mem_len, segment_len=SEG, ltm_basis=16, ltm_widths=(0.05, 0.1), ltm_tau=0.5, dropout=0.0,
                      ltm_sticky=True, ltm_sticky_bins=8, ltm_reset_tokens=4 * SEG)
    model, params = model_lib.build_model(cfg), jax.jit(lambda k: model_lib.init_params(cfg, k))(jax.random.key(0))
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (10, 2, SEG), dtype=np.int32)
    resets = np.zeros((10, 2), bool)
    resets[5, 1] = True
    segments = [Segment(tokens[s], tokens[s], np.ones_like(tokens[s]), resets[s]) for s in range(10)]
    key = jax.random.key(7)
    return model, params, segments, key, infinity.trace(model, params, segments, key, layers=(1, 0), keep_rows=True)


@pytest.fixture(scope='module')
def traced():
    return _traced(SEG)


def _check_step_by_step(model, params, segments, key, tr):
    """The trace's densities, draws and used steps against the model's own memory, step by step."""
    apply = jax.jit(lambda x, m, r, k: model.apply({'params': params}, x, m, reset=r, rngs={'sticky': k},
                                                   mutable='intermediates'))
    memory = model_lib.init_memory(model.config, 2)
    previous_mu = np.array(memory.layers['mu'])
    for s, segment in enumerate(segments):
        (_, memory), sown = apply(segment.inputs, memory, segment.reset, jax.random.fold_in(key, s))
        mu = np.array(memory.layers['mu'])
        np.testing.assert_array_equal(tr.mu[s], mu[[1, 0]])
        np.testing.assert_array_equal(tr.sigma2[s], np.asarray(memory.layers['sigma2'])[[1, 0]])
        drawn = [sown['intermediates'][f'layer_{i}']['memory']['sticky_positions'][0] for i in (1, 0)]
        np.testing.assert_array_equal(tr.positions[s], np.stack(drawn))
        # The memory keeps the densities it read and only those (a document start: the init's).
        previous_mu[:, segment.reset] = 0.0
        np.testing.assert_array_equal(tr.used[s], np.any(mu != previous_mu, axis=(0, 2, 3)))
        previous_mu = mu


def test_the_trace_records_what_the_model_does_step_by_step(traced):
    _check_step_by_step(*traced)
    tr = traced[-1]
    # The LTM takes its first rows at step 2 (after segment + STM), stream 1 again at 7.
    assert tr.used[:, 0].tolist() == [False] * 2 + [True] * 8
    assert tr.used[:, 1].tolist() == [False] * 2 + [True] * 3 + [False] * 2 + [True] * 3
    assert tr.ltm_tokens[:, 0].tolist() == [0, 0, 8, 16, 24, 32, 8, 16, 24, 32]


def test_with_a_memory_of_part_segments_the_steps_that_read_the_ltm_are_marked_used():
    """mem_len = 1.5 segments: the first block that waits for the LTM after a stream's (or a
    document's) start is part-filled, its oldest rows empty; the model reads the LTM it starts (its
    newest row says so), and so must the trace."""
    model, params, segments, key, tr = _traced(12)
    _check_step_by_step(model, params, segments, key, tr)
    assert tr.used[:, 0].tolist() == [False] * 2 + [True] * 8
    assert tr.used[:, 1].tolist() == [False] * 2 + [True] * 3 + [False] * 2 + [True] * 3
    assert tr.ltm_tokens[:, 1].tolist() == [0, 0, 4, 12, 20, 0, 0, 4, 12, 20]  # 4 of the first block's 8 rows.
    # A lifetime starts with a whole block (the part-filled one reaches before the stream): after the
    # restart at step 7, the text of the rows its updates fitted.
    life = infinity.lifetime(tr, stream=0, updates=2, layer=1)
    assert life.first_step == 7
    fitted = tr.rows[6:9, tr.index(0), 0].reshape(-1, model.config.d_model)
    embed = jax.jit(lambda x: model.apply({'params': params}, x, method=lambda m, x: m.io.embed(x)))
    np.testing.assert_allclose(fitted, embed(np.asarray(life.tokens, np.int32)), rtol=1e-6)


def test_a_lifetime_holds_the_text_whose_rows_the_ltm_fitted(traced):
    model, params, segments, _, tr = traced
    life = infinity.lifetime(tr, stream=0, updates=3, layer=1)
    assert life.first_step == 2
    np.testing.assert_array_equal(life.positions, tr.positions[3:6, 0, 0])
    # Layer 0's rows are the embeddings; those each step's update fitted waited from the step before.
    fitted = tr.rows[life.first_step - 1:life.first_step + 3, tr.index(0), 0].reshape(-1, model.config.d_model)
    # Jitted: op by op, the embedding would compile each of its operations.
    embed = jax.jit(lambda x: model.apply({'params': params}, x, method=lambda m, x: m.io.embed(x)))
    embedded = embed(np.asarray(life.tokens, np.int32))
    np.testing.assert_allclose(fitted, embedded, rtol=1e-6)
    # The whole stream's rows, in text order (mem_len = S: from position 0).
    rows = infinity.layer_rows(tr, layer=0, stream=0)
    text = np.concatenate([segment.inputs[0] for segment in segments])[:len(rows)]
    assert len(rows) == 9 * SEG
    np.testing.assert_allclose(rows, embed(np.asarray(text, np.int32)), rtol=1e-6)
    with pytest.raises(ValueError, match='no fresh LTM followed by 4 updates'):
        infinity.lifetime(tr, stream=0, updates=4, layer=1)
    with pytest.raises(ValueError, match='was not traced'):
        infinity.attention_density(tr, layer=2, bins=4)


def test_attention_density_is_eq_16_averaged_over_the_used_steps(traced):
    *_, tr = traced
    bins = 5
    phi = lambda x, m, s2: 0.5 * (1 + math.erf((x - m) / math.sqrt(2 * s2)))
    rows = []
    for s in range(tr.mu.shape[0]):
        for b in range(2):
            if tr.used[s, b]:
                mu, sigma2 = tr.mu[s, 0, b].ravel(), tr.sigma2[s, 0, b].ravel()
                mass = np.array([sum(phi((k + 1) / bins, m, v) - phi(k / bins, m, v) for m, v in zip(mu, sigma2))
                                 for k in range(bins)])
                rows.append(mass / mass.sum())
    got = infinity.attention_density(tr, layer=1, bins=bins)
    np.testing.assert_allclose(got, np.mean(rows, axis=0), rtol=1e-5)
    assert math.isclose(got.sum(), 1.0, rel_tol=1e-6)
