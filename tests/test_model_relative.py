"""Relative attention over key blocks against a naive per-pair computation, and the masks
against explicit rules; both distance rules (contiguous rel_shift, explicit gather)."""

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax.model import ModelConfig
from memjax.model.attention import Attended, AttentionContext, KeyBlock, RelativeAttention, _scores_and_mask
from memjax.model.positions import (key_distances, position_scores, rel_shift, relative_sinusoid_table,
                                    sinusoid_encoding)


# Compiled: op by op, each of its operations would compile a program of its own for each shape.
_sinusoid_table = jax.jit(relative_sinusoid_table, static_argnums=(0, 1, 2))


def jitted_init(module):
    """(key, h, blocks, ctx, u, v) -> the module's unboxed parameters, initialised under jit
    (deterministic)."""
    return jax.jit(lambda key, *inputs: nn.meta.unbox(module.init(key, *inputs, True)['params']))


def jitted_apply(module, **options):
    """(params, h, blocks, ctx, u, v) -> module.apply(..., deterministic=True, **options), under jit;
    `options` (e.g. a hook) are closed over."""
    return jax.jit(lambda params, *inputs: module.apply({'params': params}, *inputs, True, **options))


def naive_sinusoid(distance, d_model):
    inv_freq = [1.0 / 10000 ** (k / d_model) for k in range(0, d_model, 2)]
    return np.array([np.sin(distance * f) for f in inv_freq] + [np.cos(distance * f) for f in inv_freq])


def test_sinusoid_matches_formula():
    distances = np.array([7.0, 3.0, 0.0])
    got = np.asarray(jax.jit(sinusoid_encoding, static_argnums=1)(distances.astype(np.float32), 10))
    want = np.stack([naive_sinusoid(d, 10) for d in distances])
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.parametrize('mlen,qlen', [(0, 4), (3, 4), (6, 2), (5, 5)])
def test_rel_shift_aligns_distances(mlen, qlen):
    klen = mlen + qlen
    rows = np.random.default_rng(0).normal(size=(2, qlen, klen))  # [.., query, distance row]
    shifted = np.asarray(jax.jit(rel_shift)(rows.astype(np.float32)))
    for i, j in itertools.product(range(qlen), range(klen)):
        if j <= mlen + i:  # entries beyond are masked; rel_shift leaves garbage there
            row_of_distance = klen - 1 - (mlen + i - j)
            np.testing.assert_allclose(shifted[:, i, j], rows[:, i, row_of_distance])


def test_key_distances_clamp():
    np.testing.assert_array_equal(key_distances(6, -1), [5, 4, 3, 2, 1, 0])
    np.testing.assert_array_equal(key_distances(6, 3), [3, 3, 3, 2, 1, 0])


def contiguous_mask(valid, qlen, same_length, window):
    """The attention's mask [B, T, K] for one contiguous memory block of validity `valid`."""
    batch, mlen = valid.shape
    query_v = np.zeros((batch, qlen, 1, 1), np.float32)
    pos_key = np.zeros((mlen + qlen, 1, 1), np.float32)
    block = KeyBlock(rows=np.zeros((batch, mlen, 1), np.float32), valid=valid[:, None, None, :])
    scores_and_mask = jax.jit(functools.partial(_scores_and_mask, qlen=qlen, same_length=same_length, window=window))
    _, mask = scores_and_mask(query_v, pos_key, [block])
    return np.asarray(mask)[:, 0]


@pytest.mark.parametrize('same_length,window', [(False, 0), (True, 3), (True, 6)])
def test_attention_mask_rules(same_length, window):
    mlen, qlen = 4, 3
    valid = np.array([[True] * 4, [False, False, True, True]])
    got = contiguous_mask(valid, qlen, same_length, window)
    for b, i, j in itertools.product(range(2), range(qlen), range(mlen + qlen)):
        query_pos = mlen + i
        want = j <= query_pos and (j >= mlen or valid[b, j])
        if same_length:
            want = want and query_pos - j < window
        assert got[b, i, j] == want, (b, i, j)
    if same_length:  # with a full memory every query sees `window` keys, or all it has if fewer
        np.testing.assert_array_equal(got[0].sum(-1), [min(window, mlen + i + 1) for i in range(qlen)])


def naive_attention(params, cfg, h, mem, valid, u, v, mem_distance=None):
    """Per (batch, head, query, key) loop, with the positional term built per pair.

    mem_distance(i, j): query i's distance to memory row j (default: the contiguous M + i - j).
    """
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
            distance = mlen + i - j if mem_distance is None or j >= mlen else mem_distance(i, j)
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


def run_attention(cfg, h, block, rows, u, v):
    ctx = AttentionContext(_sinusoid_table(rows, cfg.d_model, cfg.clamp_len), u, v, window=cfg.mem_len)
    module = RelativeAttention(cfg)
    params = jitted_init(module)(jax.random.key(0), h, [block], ctx, u, v)
    rng = np.random.default_rng(2)
    params = jax.tree.map(lambda x: np.asarray(x) + np.float32(0.1) * rng.standard_normal(x.shape, np.float32), params)
    return params, jitted_apply(module)(params, h, [block], ctx, u, v)[0]


def attention_inputs(mlen, clamp_len):
    cfg = ModelConfig(vocab_size=11, d_model=8, n_head=2, d_head=3, n_layer=1, d_inner=8,
                      mem_len=mlen, clamp_len=clamp_len, dropout=0.0)
    rng = np.random.default_rng(1)
    bsz, qlen = 2, 4
    h = rng.normal(size=(bsz, qlen, 8)).astype(np.float32)
    mem = rng.normal(size=(bsz, mlen, 8)).astype(np.float32)
    valid = np.ones((bsz, mlen), bool)
    if mlen:
        valid[1, :2] = False
    u, v = (rng.normal(size=(2, 3)).astype(np.float32) for _ in range(2))
    return cfg, h, mem, valid, u, v


@pytest.mark.parametrize('mlen,clamp_len', [(0, -1), (5, -1), (5, 3)])
def test_relative_attention_equals_naive_per_pair(mlen, clamp_len):
    cfg, h, mem, valid, u, v = attention_inputs(mlen, clamp_len)
    block = KeyBlock(rows=mem, valid=valid[:, None, None, :])
    params, got = run_attention(cfg, h, block, mlen + h.shape[1], u, v)
    want = naive_attention(params, cfg, h, mem, valid, u, v)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


@pytest.mark.parametrize('clamp_len', [-1, 4])
def test_explicit_distances_equal_naive_per_pair(clamp_len):
    """Memory rows kept every other position (distances with gaps), read through the gather path."""
    mlen = 5
    cfg, h, mem, valid, u, v = attention_inputs(mlen, clamp_len)
    qlen = h.shape[1]
    mem_distance = lambda i, j: 2 * (mlen - j) + i  # row j kept from 2 (M - j) positions back
    distances = np.array([[mem_distance(i, j) for j in range(mlen)] for i in range(qlen)], np.int32)
    block = KeyBlock(rows=mem, valid=valid[:, None, None, :], distances=distances[None, None])
    params, got = run_attention(cfg, h, block, int(distances.max()) + 1, u, v)
    want = naive_attention(params, cfg, h, mem, valid, u, v, mem_distance)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5)


def test_per_head_mask_hides_keys_from_one_head_only():
    """A block mask with a head axis: head 0 sees the memory, head 1 none of it. With the other
    head's output kernel zeroed, each head's output equals the run where every head has its mask."""
    cfg, h, mem, _, u, v = attention_inputs(5, -1)
    module = RelativeAttention(cfg)
    ctx = AttentionContext(_sinusoid_table(9, 8, -1), u, v, window=5)
    seen, hidden = np.ones((2, 1, 1, 5), bool), np.zeros((2, 1, 1, 5), bool)
    per_head = seen & np.array([True, False])[None, :, None, None]
    params = jitted_init(module)(jax.random.key(0), h, [KeyBlock(mem, seen)], ctx, u, v)
    apply = jitted_apply(module)
    for head, alike in ((0, seen), (1, hidden)):
        kernel = np.array(params['out']['kernel'])
        kernel[1 - head] = 0.0
        solo = {**params, 'out': {'kernel': kernel}}
        run = lambda mask: apply(solo, h, [KeyBlock(mem, mask)], ctx, u, v)[0]
        np.testing.assert_allclose(run(per_head), run(alike), atol=1e-6)
        assert not np.allclose(run(seen), run(hidden), atol=1e-4)  # The mask matters at all.


def value_and_vjp(f, cotangent, *args):
    """f(*args) and the vjp of `cotangent` through it, as NumPy arrays, computed under jit."""
    def run(cotangent, *args):
        value, vjp = jax.vjp(f, *args)
        return value, vjp(cotangent)
    return jax.device_get(jax.jit(run)(cotangent, *args))


@pytest.mark.parametrize('dtype,tol', [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
def test_position_scores_value_and_gradient_match_the_plain_einsum(dtype, tol):
    rng = np.random.default_rng(3)
    query = rng.standard_normal((2, 5, 3, 4), np.float32)
    pos_key = rng.standard_normal((9, 3, 4), np.float32)
    cotangent = rng.standard_normal((2, 3, 5, 9), np.float32)
    plain = lambda q, r: jnp.einsum('bthd,khd->bhtk', q, r)  # float32 reference
    expected, plain_grads = value_and_vjp(plain, cotangent, query, pos_key)
    got, grads = value_and_vjp(position_scores, cotangent, query.astype(dtype), pos_key.astype(dtype))
    assert got.dtype == jnp.float32
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, atol=tol * scale)
    for g, e in zip(grads, plain_grads):
        assert g.dtype == dtype
        np.testing.assert_allclose(g.astype(np.float32), e, atol=tol * float(np.abs(e).max()))


def test_attend_hook_sees_the_layer_projections_and_adds_to_the_attention_output():
    """A memory kind's `attend` gets the layer's own maps (for extra queries, e.g. memory rows,
    and the output projection) and its extra output is added to the attention's: with pre-LN the
    layer output moves by exactly extra @ W_out when the hook projects with the layer's map."""
    cfg, h, mem, valid, u, v = attention_inputs(5, -1)
    cfg = cfg.replace(pre_lnorm=True)
    block = KeyBlock(rows=mem, valid=valid[:, None, None, :])
    ctx = AttentionContext(_sinusoid_table(9, 8, -1), u, v, window=5)
    module = RelativeAttention(cfg)
    params = jitted_init(module)(jax.random.key(0), h, [block], ctx, u, v)
    extra = np.random.default_rng(5).standard_normal((2, 4, 2, 3), np.float32)

    def attend(view):
        return Attended(view.maps.output(extra), notes=(view.maps.query(mem), view.key))

    plain, _ = jitted_apply(module)(params, h, [block], ctx, u, v)
    moved, (memory_queries, keys) = jitted_apply(module, attend=attend)(params, h, [block], ctx, u, v)
    p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    np.testing.assert_allclose(np.asarray(moved) - np.asarray(plain),
                               np.einsum('bthd,hde->bte', extra, p['out']['kernel']), atol=1e-5)
    ln, mem = p['layer_norm'], mem.astype(np.float64)
    normed = (mem - mem.mean(-1, keepdims=True)) / np.sqrt(mem.var(-1, keepdims=True) + cfg.layer_norm_epsilon)
    normed = normed * ln['scale'] + ln['bias']
    np.testing.assert_allclose(memory_queries, np.einsum('bnd,dhe->bnhe', normed, p['query']['kernel']),
                               atol=1e-5)
    assert keys.shape == (2, 5 + 4, 2, 3)  # Every block's keys, then the segment's.
