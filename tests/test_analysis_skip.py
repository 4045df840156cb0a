"""memjax/analysis/skip.py: Skip-Retain's skips and memory lags as the model records them in training,
against binomial bounds, a naive simulation of the same draws, a Monte Carlo of the expectations,
and the bench's phase-1 step against the eq. (1) patterns it is fed. Nothing here is timed."""

import jax
import numpy as np
import pytest

from memjax import model as model_lib
from memjax.analysis import skip
from memjax.bench import workload
from memjax.bench.suites import skip as skip_suite
from memjax.model import stochastic
from memjax.training import step as train_step_lib

# The bench test's phase-1 shape (3 layers): its parameters' initialisation and its compiled steps
# are in the suite's compilation cache.
_, SHAPE, BATCH, SEQ = skip_suite.PHASE1['tiny']
SEG, MEM = 2, 3  # M != T: a skip ages the memory by T; a retained memory reaches M + age.
P = 0.4
CFG = workload.model_config(None, mem_len=MEM, **SHAPE).replace(skip_rule='uniform', skip_p=P)
STEPS = 800


@pytest.fixture(scope='module')
def recorded():
    params = model_lib.init_params(CFG, jax.random.key(0))
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (STEPS, 1, SEG), 0, CFG.vocab_size))
    return skip.record_skips(model_lib.build_model(CFG), params, tokens, jax.random.key(7))


def naive_ages(skipped: np.ndarray, seg_len: int) -> np.ndarray:
    """[S, n_layer]: a skipped layer's memory lags one more segment, a layer that runs catches up."""
    ages, age = [], np.zeros(skipped.shape[1], int)
    for row in skipped:
        age = np.where(row, age + seg_len, 0)
        ages.append(age)
    return np.array(ages)


def test_measured_skip_frequencies_agree_with_p_skip_within_a_binomial_bound(recorded):
    bound = 4 * np.sqrt(P * (1 - P) / STEPS)
    assert np.all(np.abs(recorded.skip_frequency - P) <= bound), recorded.skip_frequency
    np.testing.assert_allclose(recorded.skip_frequency_stderr, np.sqrt(P * (1 - P) / STEPS), rtol=0.1)


def test_ages_are_a_naive_simulation_of_the_draws_training_makes(recorded):
    """Step s's draws: the model's own skip decision under the streams the training step derives
    from its key fold_in(key, s) (memjax.training.step.stream_keys)."""
    model = model_lib.build_model(CFG)

    def draws(s):
        rngs = train_step_lib.stream_keys(jax.random.fold_in(jax.random.key(7), s), model.kind, 0)
        return model.apply({}, rngs=rngs, method=lambda m: m.kind.skip_layers(m.make_rng('skip'), m.phase))

    skipped = np.asarray(jax.jit(jax.vmap(draws))(np.arange(STEPS)))
    assert skipped.mean() == pytest.approx(P, abs=0.05)
    ages = naive_ages(skipped, SEG)
    np.testing.assert_array_equal(recorded.ages, ages)
    assert recorded.max_lag.min() >= 3 * SEG  # Runs of skips occur: the memory then lags several segments.
    np.testing.assert_allclose(recorded.mean_lag, ages.mean(0))
    reach = [[MEM + a if a else 0 for a in row] for row in ages]
    np.testing.assert_allclose(recorded.retained_reach, np.mean(reach, axis=0))


def test_expectations_match_a_long_simulation_and_eq6():
    """Eq. 6's term p 2M counts one segment of lag; the exact expectations count runs of skips."""
    cfg = CFG.replace(n_layer=6, skip_rule='linear', mem_len=SEG)  # M = T, as eq. 6 assumes.
    want = skip.expected(cfg, SEG)
    probs = 0.5 * np.arange(6) / 6  # Eq. (1) with 1-based i: 0.5 (i - 1) / N, the top layer never.
    probs[-1] = 0
    np.testing.assert_allclose(want.p_skip, probs)
    np.testing.assert_allclose(want.paper_context, 2 * SEG * probs)
    assert want.paper_context.sum() == pytest.approx(stochastic.expected_context(probs, SEG))
    ages = naive_ages(np.random.default_rng(0).random((200_000, 6)) < probs, SEG)
    np.testing.assert_allclose(want.lag, ages.mean(0), atol=0.02 * SEG)
    np.testing.assert_allclose(want.retained_reach, np.where(ages > 0, SEG + ages, 0).mean(0), atol=0.02 * SEG)
    # With M = T the exact reach exceeds eq. 6's term by the second and later skips of a run.
    assert np.all(want.retained_reach[1:-1] > want.paper_context[1:-1])


def test_record_skips_refuses_a_memory_without_ages():
    xl = CFG.replace(skip_rule='none')
    with pytest.raises(ValueError, match='keeps no age'):
        skip.record_skips(model_lib.build_model(xl), None, [np.zeros((1, SEG), np.int32)], jax.random.key(0))


def test_the_timed_patterns_follow_eq1_within_a_binomial_bound():
    n, count = 8, 20_000
    drawn = skip_suite.eq1_patterns(n, count, seed=3)
    probs = np.where(np.arange(1, n + 1) != n, 0.5 * np.arange(n) / n, 0.0)
    assert np.all(np.abs(drawn.mean(0) - probs) <= 4 * np.sqrt(probs * (1 - probs) / count))


def test_the_timed_phase1_step_skips_the_drawn_patterns_one_per_call():
    """What the bench times as phase 1 is Skip-Retain's step with a new eq. (1) pattern per call (its
    memory ages by exactly those skips)."""
    patterns, calls = 8, 12
    steps, drawn = skip.phase1_steps(SHAPE, BATCH, SEQ, patterns=patterns, seed=3)
    assert drawn.any()
    fed = drawn[np.arange(calls) % patterns]
    ages = [np.asarray(steps['phase 1']()[2].layers['age']) for _ in range(calls)]
    np.testing.assert_array_equal(ages, naive_ages(fed, SEQ))
