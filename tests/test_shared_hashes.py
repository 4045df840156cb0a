"""Draws that share their Threefry hashes give JAX's own values, bit for bit, with fewer hashes."""

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
import numpy as np
import pytest

from memjax.model import ModelConfig, lm
from memjax.model import shared_hashes

BASE = dict(vocab_size=50, d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32)


def draws(key, table_key):
    """Every case the merging meets: folds of folds, 8- to 32-bit draws, normal and uniform values,
    a draw too large to share, key arrays, a scanned draw, a jitted helper, a non-Threefry key."""
    k1, k2 = jax.random.fold_in(key, 1), jax.random.fold_in(key, 2**31 + 5)
    k3 = jax.random.fold_in(k1, 7)
    big = (shared_hashes.SHARED_DRAW_MAX_SIZE + 3,)
    # The scanned body also gives a constant (a literal among its outputs).
    scanned = jax.lax.scan(lambda k, i: (k, (jax.random.normal(jax.random.fold_in(k, i), (3,)), 1.0)),
                           k2, jnp.arange(4))[1]
    return dict(
        normal=jax.random.normal(k1, (5, 7)), uniform=jax.random.uniform(k2, (4,)),
        bits8=jax.random.bits(k3, (9,), jnp.uint8), bits16=jax.random.bits(k3, (2, 3), jnp.uint16),
        truncated=jax.jit(lambda k: jax.random.truncated_normal(k, -2.0, 2.0, (6,)))(k3),
        big=jax.random.bits(k2, big), split=jax.random.normal(jax.random.split(k3, 3)[1], (2,)),
        vmapped=jax.vmap(lambda k: jax.random.normal(k, (2,)))(jax.random.split(k1, 3)),
        scanned=scanned, other_impl=jax.random.normal(jax.random.fold_in(table_key, 3), (4,)),
        deterministic=jnp.arange(3.0) * 2)


def _equal(a, b):
    return jax.tree.all(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b))


@pytest.mark.parametrize('partitionable', [True, False], ids=['partitionable', 'original_threefry'])
def test_every_kind_of_draw_gives_jax_s_own_bits(partitionable):
    """Also under the original, non-partitionable Threefry bits, which are drawn as JAX draws them."""
    key, table_key = jax.random.PRNGKey(3), jax.random.key(4, impl='rbg')
    with jax.threefry_partitionable(partitionable):
        merged = jax.jit(shared_hashes.with_shared_hashes(draws))
        assert _equal(merged(key, table_key), jax.jit(draws)(key, table_key))


def _hashes(fn, *args) -> int:
    """Threefry hashes in fn's trace: JAX's draws and folds (one hash each) and merged hashes."""
    def count(jaxpr):
        return (sum(eqn.primitive.name in ('random_bits', 'random_fold_in', 'threefry2x32') for eqn in jaxpr.eqns)
                + sum(count(sub) for sub in jex_core.subjaxprs(jaxpr)))
    return count(jax.make_jaxpr(fn)(*args).jaxpr)


def test_independent_draws_share_one_hash_per_round():
    def init(key):
        keys = [jax.random.fold_in(key, i) for i in range(6)]
        return [jax.random.normal(k, (3, i + 1)) for i, k in enumerate(keys)]

    key = jax.random.PRNGKey(0)
    merged = shared_hashes.with_shared_hashes(init)
    assert _equal(jax.jit(merged)(key), jax.jit(init)(key))
    # JAX: 12 hashes (a fold and a draw per value); merged: one for the folds, one for the draws.
    assert (_hashes(init, key), _hashes(merged, key)) == (12, 2)


@pytest.mark.parametrize('overrides', [
    dict(memory='xl', mem_len=4),
    dict(memory='lamemo', mem_len=4),
    dict(memory='infinity', mem_len=4, segment_len=4, ltm_basis=8),
    dict(memory='trams', mem_len=4, trams_select=2, trams_remain=1),
    dict(memory='none', mem_len=0, vocab_size=300, cutoffs=(20, 100), div_val=2, tie_projs=(False, True, False)),
    # Its scanned init's body gives a constant among its outputs (at six layers, not at two).
    dict(memory='xl', mem_len=4, scan_layers=True, skip_rule='linear', sch_beta=0.1, n_layer=6, dropout=0.0, dropatt=0.0),
    dict(memory='none', mem_len=0, block='gpt2', pre_lnorm=True, positions='learned_absolute'),
], ids=lambda o: '-'.join(f'{k}={v}' for k, v in o.items()))
def test_init_params_equal_flax_s_own_draws(overrides):
    cfg = ModelConfig(**{**BASE, **overrides})
    key = jax.random.PRNGKey(11)
    assert _equal(lm.init_params(cfg, key), lm.init_params(cfg, key, share_hashes=False))
