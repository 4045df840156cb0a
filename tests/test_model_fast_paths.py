"""The model's faster code paths keep the computation they replace: dropout's distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax.model.primitives import Dropout


def apply_dropout(rate, x, key, deterministic=False):
    return Dropout(rate).apply({}, x, deterministic=deterministic, rngs={'dropout': key})


@pytest.mark.parametrize('rate', [0.1, 0.5])
def test_dropout_keeps_one_minus_rate_and_rescales(rate):
    x = jnp.asarray(np.random.default_rng(0).uniform(1.0, 2.0, size=(64, 1024)), jnp.float32)
    out = np.asarray(apply_dropout(rate, x, jax.random.key(0)))
    kept = out != 0
    # Binomial(n, 1 - rate) kept count: 6 standard deviations is a bound that a wrong rate fails.
    n = kept.size
    assert abs(kept.sum() - n * (1 - rate)) < 6 * np.sqrt(n * rate * (1 - rate))
    np.testing.assert_allclose(out[kept], np.asarray(x)[kept] / (1 - rate), rtol=1e-6)
    # Independent positions: the kept fraction of each row also follows the rate.
    assert abs(kept.mean(axis=1) - (1 - rate)).max() < 6 * np.sqrt(rate * (1 - rate) / x.shape[1])


def test_dropout_masks_follow_the_key():
    x = jnp.ones((8, 256))
    first = apply_dropout(0.3, x, jax.random.key(1))
    np.testing.assert_array_equal(first, apply_dropout(0.3, x, jax.random.key(1)))
    other = apply_dropout(0.3, x, jax.random.key(2))
    assert (np.asarray(first) != np.asarray(other)).mean() > 0.2  # ~2 * 0.3 * 0.7 differ


def test_dropout_off_returns_input():
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(apply_dropout(0.3, x, jax.random.key(0), deterministic=True), x)
    np.testing.assert_array_equal(apply_dropout(0.0, x, jax.random.key(0)), x)
