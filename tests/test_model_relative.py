"""Relative attention against a naive per-pair computation, and the masks against explicit rules."""

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax.model import ModelConfig
from memjax.model.layers import RelativeAttention
from memjax.model.relative import (attention_mask, key_distances, position_scores, rel_shift,
                                   sinusoid_encoding)


def naive_sinusoid(distance, d_model):
    inv_freq = [1.0 / 10000 ** (k / d_model) for k in range(0, d_model, 2)]
    return np.array([np.sin(distance * f) for f in inv_freq] + [np.cos(distance * f) for f in inv_freq])


def test_sinusoid_matches_formula():
    distances = np.array([7.0, 3.0, 0.0])
    got = np.asarray(sinusoid_encoding(jnp.asarray(distances), 10))
    want = np.stack([naive_sinusoid(d, 10) for d in distances])
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize('mlen,qlen', [(0, 4), (3, 4), (6, 2), (5, 5)])
def test_rel_shift_aligns_distances(mlen, qlen):
    klen = mlen + qlen
    rows = np.random.default_rng(0).normal(size=(2, qlen, klen))  # [.., query, distance row]
    shifted = np.asarray(rel_shift(jnp.asarray(rows)))
    for i, j in itertools.product(range(qlen), range(klen)):
        if j <= mlen + i:  # entries beyond are masked; rel_shift leaves garbage there
            row_of_distance = klen - 1 - (mlen + i - j)
            np.testing.assert_allclose(shifted[:, i, j], rows[:, i, row_of_distance])


def test_key_distances_clamp():
    np.testing.assert_array_equal(key_distances(6, -1), [5, 4, 3, 2, 1, 0])
    np.testing.assert_array_equal(key_distances(6, 3), [3, 3, 3, 2, 1, 0])


@pytest.mark.parametrize('same_length,window', [(False, 0), (True, 3), (True, 6)])
def test_attention_mask_rules(same_length, window):
    mlen, qlen = 4, 3
    valid = np.array([[True] * 4, [False, False, True, True]])
    got = np.asarray(attention_mask(jnp.asarray(valid), qlen, same_length, window))
    for b, i, j in itertools.product(range(2), range(qlen), range(mlen + qlen)):
        query_pos = mlen + i
        want = j <= query_pos and (j >= mlen or valid[b, j])
        if same_length:
            want = want and query_pos - j < window
        assert got[b, i, j] == want, (b, i, j)
    if same_length:  # with a full memory every query sees `window` keys, or all it has if fewer
        np.testing.assert_array_equal(got[0].sum(-1), [min(window, mlen + i + 1) for i in range(qlen)])


def naive_attention(params, cfg, h, mem, valid, u, v):
    """Per (batch, head, query, key) loop, with the positional term built per pair."""
    h, mem = np.asarray(h, np.float64), np.asarray(mem, np.float64)
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    context = np.concatenate([mem, h], axis=1)
    bsz, mlen, qlen = h.shape[0], mem.shape[1], h.shape[1]
    klen = mlen + qlen
    q = np.einsum('btd,dhe->bthe', h, p['query']['kernel'])
    k = np.einsum('bkd,dhe->bkhe', context, p['key']['kernel'])
    val = np.einsum('bkd,dhe->bkhe', context, p['value']['kernel'])
    out = np.zeros((bsz, qlen, cfg.n_head, cfg.d_head))
    for b, n, i in itertools.product(range(bsz), range(cfg.n_head), range(qlen)):
        scores = np.full(klen, -np.inf)
        for j in range(klen):
            if j > mlen + i or (j < mlen and not valid[b, j]):
                continue
            distance = mlen + i - j
            if cfg.clamp_len > 0:
                distance = min(distance, cfg.clamp_len)
            r = naive_sinusoid(distance, cfg.d_model) @ p['pos']['kernel'][:, n]  # W_r R_{i-j}
            scores[j] = ((q[b, i, n] + u[n]) @ k[b, j, n] + (q[b, i, n] + v[n]) @ r) / np.sqrt(cfg.d_head)
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        out[b, i, n] = probs @ val[b, :, n]
    x = h + np.einsum('bthe,hed->btd', out, p['out']['kernel'])
    ln = p['layer_norm']
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + cfg.layer_norm_epsilon) * ln['scale'] + ln['bias']


@pytest.mark.parametrize('mlen,clamp_len', [(0, -1), (5, -1), (5, 3)])
def test_relative_attention_equals_naive_per_pair(mlen, clamp_len):
    cfg = ModelConfig(vocab_size=11, d_model=8, n_head=2, d_head=3, n_layer=1, d_inner=8,
                      mem_len=mlen, clamp_len=clamp_len, dropout=0.0)
    rng = np.random.default_rng(1)
    bsz, qlen = 2, 4
    h = jnp.asarray(rng.normal(size=(bsz, qlen, 8)), jnp.float32)
    mem = jnp.asarray(rng.normal(size=(bsz, mlen, 8)), jnp.float32)
    valid = np.ones((bsz, mlen), bool)
    if mlen:
        valid[1, :2] = False
    u, v = (jnp.asarray(rng.normal(size=(2, 3)), jnp.float32) for _ in range(2))
    pos_enc = sinusoid_encoding(key_distances(mlen + qlen, clamp_len), 8)
    mask = attention_mask(jnp.asarray(valid), qlen, False, mlen)
    module = RelativeAttention(cfg)
    params = nn.meta.unbox(module.init(jax.random.key(0), h, mem, mask, pos_enc, u, v, True)['params'])
    params = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape), params)
    got = module.apply({'params': params}, h, mem, mask, pos_enc, u, v, True)
    want = naive_attention(params, cfg, h, mem, valid, np.asarray(u), np.asarray(v))
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


@pytest.mark.parametrize('dtype,tol', [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_position_scores_value_and_gradient_match_the_plain_einsum(dtype, tol):
    kq, kr, kg = jax.random.split(jax.random.PRNGKey(3), 3)
    query = jax.random.normal(kq, (2, 5, 3, 4))
    pos_key = jax.random.normal(kr, (9, 3, 4))
    cotangent = jax.random.normal(kg, (2, 3, 5, 9))
    plain = lambda q, r: jnp.einsum('bthd,khd->bhtk', q, r)  # float32 reference
    expected, plain_vjp = jax.vjp(plain, query, pos_key)
    got, vjp = jax.vjp(position_scores, query.astype(dtype), pos_key.astype(dtype))
    assert got.dtype == jnp.float32
    scale = float(jnp.abs(expected).max())
    np.testing.assert_allclose(got, expected, atol=tol * scale)
    for g, e in zip(vjp(cotangent), plain_vjp(cotangent)):
        assert g.dtype == dtype
        np.testing.assert_allclose(g.astype(jnp.float32), e, atol=tol * float(jnp.abs(e).max()))
