"""Transformer-XL's span attention as tiled Pallas kernels: the scores and weights never exist whole.

Why: every score of these models has a positional term, the query against the encoding of the
query-to-key distance, aligned by the relative shift. Stock fused attention kernels take no such
term (or only as a precomputed [B, H, T, K] bias), so the reference path writes the whole score
matrix to device memory, reads it back for the softmax and keeps the weights for the backward pass:
at the papers' evaluation settings (mem 1600) that matrix dominates time and memory. (On a GPU one
[B, H, T, K] float32 array does exist here, the positional term P below, 4 bytes a score once, and
its gradient in the backward pass; the reference's path keeps several times that per score.)

Here a query tile walks the key tiles with a running maximum and sum (flash attention). The
backward pass recomputes the scores tile by tile from the forward's log-normaliser: one kernel walks
key tiles per query tile (the queries' gradients), one walks query tiles per key tile (the keys' and
values'). Attention dropout draws its mask from a counter-based hash of (seed, batch, head, query,
key), so the backward pass redraws exactly the forward's mask.

The positional term has one form per lowering:

- 'gather' (Triton, and interpret mode): the positional scores P = (q + v) . R, [B, H, T, K]
  float32 and unshifted, are one XLA product outside the kernels (formed again in the backward
  pass, not kept), which read each tile's entries at their shifted addresses: query i against key j
  is P[i, j - i + T - 1] (`_distance_rows`), a gathered load of an input. The query-gradient kernel
  scatters the scores' gradient back to those addresses in a dP of P's shape (each element written
  at most once: masked pairs, padded queries among them, are not stored; the rest stays zeros from
  an aliased input), and XLA's products take dP . R and
  dP^T . (q + v). No value a kernel writes inside its loop is read back inside it, which Triton's
  software pipelining requires: it issues a loop's loads ahead of the stores before them (a shift
  through a scratch block read back in the same iteration gave NaN gradients on an H200).
- 'roll' (TPU): for query tile [i0, i0 + bq) and key tile [j0, j0 + bk) the distance rows needed
  form one window of bq + bk rows of the table, so the positional scores are one product
  [bq, D] x [D, bq + bk] whose row a a strided lane rotation (TPU's XLU) moves left by bq - 1 - a
  (`_skew`); the backward rotates back (`_unskew`) and sums the table's gradient in the kernel.

Both run in Pallas's interpret mode on a CPU, where the tests check them against the reference
attention; each also lowers there for its chip (tests/test_fused_attention.py exports the Triton
form for CUDA and the TPU form for Mosaic).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


MIN = float(jnp.finfo(jnp.float32).min)
SKEWS = ('gather', 'roll')


@dataclasses.dataclass(frozen=True)
class Spec:
    """Static shape and options of one fused call (hashable: a custom_vjp's non-differentiable
    argument). `queries`, `keys`: the true T and K; the arrays are padded to whole tiles."""

    queries: int
    keys: int
    window: int  # same_length: a query sees the newest `window` keys; 0 = off.
    scale: float
    rate: float  # Attention dropout; 0 in evaluation.
    block_q: int
    block_k: int
    skew: str
    interpret: bool

    @property
    def width(self) -> int:
        """'roll': distance rows one tile pair reads: bq + bk - 1 are needed, rounded up to a power
        of two (the extra rows' scores are never read)."""
        return 1 << (self.block_q + self.block_k - 1).bit_length()

    @property
    def front(self) -> int:
        """'roll': zero rows before the table: every tile's window starts at row >= 0, and at a
        multiple of 16 (TPU's sublane tiling for bf16), since j0 - i0 is one."""
        return self.block_q + (-self.queries) % 16


def dropout_keep(seed, batch, head, query, key, rate: float):
    """Whether attention dropout keeps score (query, key) of (batch, head): a murmur3-style hash of
    the indices and the seed, compared with `rate` * 2^32. A pure function of its arguments, so
    forward and backward draw the same mask; `query` and `key` broadcast ([bq, 1] and [1, bk])."""
    u = lambda x: jnp.asarray(x).astype(jnp.uint32)

    def mix(x):
        x = x ^ (x >> 16)
        x = x * jnp.uint32(0x85EBCA6B)
        x = x ^ (x >> 13)
        x = x * jnp.uint32(0xC2B2AE35)
        return x ^ (x >> 16)

    lane = mix(u(seed) ^ (u(batch) * jnp.uint32(0x9E3779B1)) ^ (u(head) * jnp.uint32(0x7FEB352D)))
    x = mix(lane ^ (u(query) * jnp.uint32(0x846CA68B)))
    x = mix(x ^ (u(key) * jnp.uint32(0x27D4EB2F)))
    return x >= jnp.uint32(min(int(rate * 2.0 ** 32), 2 ** 32 - 1))


def _iota(shape, axis):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def _skew(spec: Spec, window_scores):
    """'roll': [bq, bq + bk] scores of the window's distance rows -> [bq, bk] scores of the key
    tile: out[a, c] = window_scores[a, c + bq - 1 - a]."""
    from jax.experimental.pallas import tpu as pltpu
    bq, bk, w = spec.block_q, spec.block_k, spec.width
    return pltpu.roll(window_scores, w - bq + 1, 1, stride=1, stride_axis=0)[:, :bk]


def _unskew(spec: Spec, tile):
    """'roll': the inverse placement, [bq, bk] -> [bq, bq + bk] with out[a, c + bq - 1 - a] =
    tile[a, c] and zeros elsewhere (the scores' gradient, back on the window's distance rows)."""
    from jax.experimental.pallas import tpu as pltpu
    bq, bk, w = spec.block_q, spec.block_k, spec.width
    padded = jnp.concatenate([tile, jnp.zeros((bq, w - bk), tile.dtype)], axis=1)
    # Row a moves right by bq - 1 - a: a shift of bq - 1 and a stride of w - 1 (= -1 mod w).
    return pltpu.roll(padded, bq - 1, 1, stride=w - 1, stride_axis=0)


def _distance_rows(spec: Spec, query, key_index):
    """'gather': the column of the unshifted positional scores P holding (query, key)'s term: its
    distance row, T - 1 - query + key; clipped where the pair is masked (a future or padded key,
    a padded query), whose score is never used."""
    return jnp.clip(key_index - query + spec.queries - 1, 0, spec.keys - 1)


def _dot(a, b, trans_a=False, trans_b=False):
    """A 2-D product in float32, either operand transposed (contracted on its other axis)."""
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _window(spec: Spec, i0, j0, table_ref):
    """'roll': the distance rows query tile i0 and key tile j0 need, and where they start."""
    first_row = j0 + spec.queries - i0 - spec.block_q + spec.front
    return table_ref[pl.ds(first_row, spec.width), :], first_row


def _scores(spec: Spec, i0, j0, content_query, key, valid, position):
    """Scaled, masked scores [bq, bk] of query tile i0 against key tile j0, where they are visible
    (causal, valid keys, the same_length window), and the tile's query and key indices.
    `position(query, key_index)`: the tile's positional scores, shifted."""
    t, k, bq, bk = spec.queries, spec.keys, spec.block_q, spec.block_k
    query = i0 + _iota((bq, bk), 0)
    key_index = j0 + _iota((bq, bk), 1)
    scores = _dot(content_query, key, trans_b=True) + position(query, key_index)
    newest = k - t + query  # The query's own key.
    visible = (key_index <= newest) & (valid != 0) & (query < t)  # valid: [1, bk]; padded queries see nothing.
    if spec.window:
        visible &= key_index > newest - spec.window
    return jnp.where(visible, scores * spec.scale, MIN), visible, query, key_index


def _positions(spec: Spec, i0, j0, source, table_ref, rows_from: int = 0):
    """The positional scores of query tile i0 and key tile j0 as `_scores` takes them: 'gather'
    reads P (`source`, a ref of its rows from query `rows_from` on) at the shifted addresses;
    'roll' multiplies the tile's position queries (`source`, loaded) by the table's window and
    rotates."""
    if spec.skew == 'gather':
        return lambda query, key_index: source[query - rows_from, _distance_rows(spec, query, key_index)]
    table, _ = _window(spec, i0, j0, table_ref)
    return lambda *_: _skew(spec, _dot(source, table, trans_b=True))


def _grad_scores(spec: Spec, scores, visible, lse, grad_out, value, bias, seed, b, h, query, key_index):
    """(the weights, the scores' gradient) of a tile from its scores, the forward's log-normaliser
    and the output's gradient; `bias`: d(lse) - <dO, O> per query [bq, 1]."""
    probs = jnp.where(visible, jnp.exp(scores - lse), 0.0)
    grad_probs = _dropped(spec, _dot(grad_out, value, trans_b=True), seed, b, h, query, key_index)
    return probs, probs * (grad_probs + bias) * spec.scale


def _key_tiles(spec: Spec, i0, n_key_tiles):
    """Key tiles query tile i0 can see: up to its newest query's key, from the window's oldest."""
    newest = spec.keys - spec.queries + i0 + spec.block_q - 1
    hi = jnp.minimum(n_key_tiles, newest // spec.block_k + 1)
    lo = 0
    if spec.window:
        lo = jnp.maximum(0, (spec.keys - spec.queries + i0 - spec.window + 1) // spec.block_k)
    return lo, hi


def _query_tiles(spec: Spec, j0, n_query_tiles):
    """Query tiles that see key tile j0 (the inverse of `_key_tiles`)."""
    lag = spec.keys - spec.queries
    lo = jnp.maximum(0, (j0 - lag) // spec.block_q)
    hi = n_query_tiles
    if spec.window:
        hi = jnp.clip((j0 + spec.block_k - 2 - lag + spec.window) // spec.block_q + 1, 0, n_query_tiles)
    return lo, hi


def _dropped(spec: Spec, x, seed, b, h, query, key_index):
    if not spec.rate:
        return x
    keep = dropout_keep(seed, b, h, query, key_index, spec.rate)
    return jnp.where(keep, x * (1.0 / (1.0 - spec.rate)), 0.0)


def _forward_kernel(spec: Spec, seed_ref, cq_ref, pos_ref, k_ref, v_ref, *refs):
    """Per (batch, head, query tile). `pos_ref`: 'gather', the tile's rows of P; 'roll', its
    position queries, the table following it in `refs`."""
    table_ref, (valid_ref, o_ref, lse_ref) = (refs[0], refs[1:]) if spec.skew == 'roll' else (None, refs)
    b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = spec.block_q, spec.block_k
    i0 = qi * bq
    content_query = cq_ref[...]
    positions = pos_ref if table_ref is None else pos_ref[...]  # 'roll': the queries, loaded once.
    seed = seed_ref[0]
    lo, hi = _key_tiles(spec, i0, k_ref.shape[0] // bk)

    def step(kt, carry):
        m, l, acc = carry
        j0 = kt * bk
        key, value = k_ref[pl.ds(j0, bk), :], v_ref[pl.ds(j0, bk), :]
        scores, _, query, key_index = _scores(spec, i0, j0, content_query, key, valid_ref[:, pl.ds(j0, bk)],
                                              _positions(spec, i0, j0, positions, table_ref, rows_from=i0))
        m_new = jnp.maximum(m, scores.max(axis=1))
        probs = jnp.exp(scores - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        l = l * alpha + probs.sum(axis=1)
        probs = _dropped(spec, probs, seed, b, h, query, key_index)
        acc = acc * alpha[:, None] + _dot(probs.astype(value.dtype), value)
        return m_new, l, acc

    init = (jnp.full((bq,), MIN, jnp.float32), jnp.zeros((bq,), jnp.float32),
            jnp.zeros((bq, o_ref.shape[-1]), jnp.float32))
    m, l, acc = jax.lax.fori_loop(lo, hi, step, init)
    l = jnp.where(l == 0.0, 1.0, l)  # Padded queries that see no tile: finite, and never read.
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = (m + jnp.log(l))[:, None]


def _query_grad_gather_kernel(spec: Spec, seed_ref, cq_ref, p_ref, k_ref, v_ref, valid_ref, do_ref, lse_ref,
                              delta_ref, glse_ref, _, dcq_ref, dp_ref):
    """'gather', per (batch, head, query tile): the content queries' gradient, and the scores'
    gradient scattered to P's addresses in `dp_ref` (aliased to zeros: entries no visible pair
    maps to stay zero; one column more than P's, where masked pairs point). Only stores: nothing
    written here is read back."""
    from jax.experimental.pallas import triton as plgpu
    b, h, qi = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = spec.block_q, spec.block_k
    i0 = qi * bq
    seed = seed_ref[0]
    lo, hi = _key_tiles(spec, i0, k_ref.shape[0] // bk)
    content_query, grad_out, lse = cq_ref[...], do_ref[...], lse_ref[...]
    bias = glse_ref[...] - delta_ref[...]  # [bq, 1]: d(lse) - <dO, O> per query.

    def step(kt, dcq):
        j0 = kt * bk
        key, value = k_ref[pl.ds(j0, bk), :], v_ref[pl.ds(j0, bk), :]
        scores, visible, query, key_index = _scores(spec, i0, j0, content_query, key, valid_ref[:, pl.ds(j0, bk)],
                                                    _positions(spec, i0, j0, p_ref, None, rows_from=i0))
        _, grad_scores = _grad_scores(spec, scores, visible, lse, grad_out, value, bias, seed, b, h, query, key_index)
        # A visible pair's distance row is unique within its query's row: each entry once. Masked
        # pairs are not stored, and point past P's columns: a clipped row would share a visible
        # pair's address, and a store that emulates the mask (interpret mode) rewrites its value.
        columns = jnp.where(visible, _distance_rows(spec, query, key_index), spec.keys)
        plgpu.store(dp_ref.at[query - i0, columns], grad_scores.astype(dp_ref.dtype), mask=visible)
        return dcq + _dot(grad_scores.astype(key.dtype), key)

    dcq = jax.lax.fori_loop(lo, hi, step, jnp.zeros((bq, dcq_ref.shape[-1]), jnp.float32))
    dcq_ref[...] = dcq.astype(dcq_ref.dtype)


def _query_grad_roll_kernel(spec: Spec, seed_ref, cq_ref, pq_ref, k_ref, v_ref, table_ref, valid_ref, do_ref,
                            lse_ref, delta_ref, glse_ref, dcq_ref, dpq_ref, dtable_ref):
    """'roll', per (head, query tile, batch row): the queries' gradients, and this query tile's
    share of the distance rows' gradient (`dtable_ref`, all rows; the shares are summed after)."""
    h, qi, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk, w = spec.block_q, spec.block_k, spec.width
    i0 = qi * bq
    seed = seed_ref[0]
    lo, hi = _key_tiles(spec, i0, k_ref.shape[0] // bk)
    dims = dcq_ref.shape[-1]

    def clear(chunk, _):
        dtable_ref[pl.ds(chunk * w, w), :] = jnp.zeros((w, dims), jnp.float32)
        return 0

    jax.lax.fori_loop(0, dtable_ref.shape[0] // w, clear, 0)
    content_query, position_query = cq_ref[...], pq_ref[...]
    grad_out, lse = do_ref[...], lse_ref[...]
    bias = glse_ref[...] - delta_ref[...]

    def step(kt, carry):
        dcq, dpq = carry
        j0 = kt * bk
        key, value = k_ref[pl.ds(j0, bk), :], v_ref[pl.ds(j0, bk), :]
        table, first_row = _window(spec, i0, j0, table_ref)
        scores, visible, query, key_index = _scores(
            spec, i0, j0, content_query, key, valid_ref[:, pl.ds(j0, bk)],
            lambda *_: _skew(spec, _dot(position_query, table, trans_b=True)))
        _, grad_scores = _grad_scores(spec, scores, visible, lse, grad_out, value, bias, seed, b, h, query, key_index)
        dcq = dcq + _dot(grad_scores.astype(key.dtype), key)
        grad_window = _unskew(spec, grad_scores)
        dpq = dpq + _dot(grad_window.astype(table.dtype), table)
        rows = pl.ds(first_row, w)
        dtable_ref[rows, :] = dtable_ref[rows, :] + _dot(grad_window.astype(position_query.dtype), position_query,
                                                         trans_a=True)
        return dcq, dpq

    zeros = jnp.zeros((bq, dims), jnp.float32)
    dcq, dpq = jax.lax.fori_loop(lo, hi, step, (zeros, zeros))
    dcq_ref[...] = dcq.astype(dcq_ref.dtype)
    dpq_ref[...] = dpq.astype(dpq_ref.dtype)


def _key_grad_kernel(spec: Spec, seed_ref, cq_ref, pos_ref, k_ref, v_ref, *refs):
    """Per (batch, head, key tile): the keys' and values' gradients over the query tiles that see it.
    `pos_ref`: 'gather', P's rows of every query; 'roll', the position queries, the table next."""
    table_ref, refs = (refs[0], refs[1:]) if spec.skew == 'roll' else (None, refs)
    valid_ref, do_ref, lse_ref, delta_ref, glse_ref, dk_ref, dv_ref = refs
    b, h, kt = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bq, bk = spec.block_q, spec.block_k
    j0 = kt * bk
    seed = seed_ref[0]
    key, value = k_ref[...], v_ref[...]
    valid = valid_ref[:, pl.ds(j0, bk)]
    lo, hi = _query_tiles(spec, j0, cq_ref.shape[0] // bq)

    def step(qt, carry):
        dk, dv = carry
        i0 = qt * bq
        rows = pl.ds(i0, bq)
        content_query, grad_out, lse = cq_ref[rows, :], do_ref[rows, :], lse_ref[rows, :]
        positions = pos_ref if table_ref is None else pos_ref[rows, :]
        scores, visible, query, key_index = _scores(spec, i0, j0, content_query, key, valid,
                                                    _positions(spec, i0, j0, positions, table_ref))
        probs, grad_scores = _grad_scores(spec, scores, visible, lse, grad_out, value,
                                          glse_ref[rows, :] - delta_ref[rows, :], seed, b, h, query, key_index)
        dv = dv + _dot(_dropped(spec, probs, seed, b, h, query, key_index).astype(grad_out.dtype), grad_out,
                       trans_a=True)
        dk = dk + _dot(grad_scores.astype(content_query.dtype), content_query, trans_a=True)
        return dk, dv

    zeros = jnp.zeros((bk, dk_ref.shape[-1]), jnp.float32)
    dk, dv = jax.lax.fori_loop(lo, hi, step, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _compiler_params(spec: Spec):
    if spec.interpret or spec.skew != 'gather':
        return None
    from jax.experimental.pallas import triton as plgpu
    # Software pipelining on (two stages): the kernels' loop loads only inputs (P at computed
    # addresses among them) and stores only what it never reads back.
    return plgpu.CompilerParams(num_warps=4, num_stages=2)


def _call(spec: Spec, kernel, grid, in_specs, out_shapes, out_specs, *args, aliases=None):
    return pl.pallas_call(functools.partial(kernel, spec), grid=grid, in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shapes, interpret=spec.interpret, input_output_aliases=aliases or {},
                          compiler_params=_compiler_params(spec))(*args)


def _seed_spec(spec: Spec):
    """The dropout seed: a scalar in TPU's scalar memory, a one-element block for Triton."""
    if spec.skew == 'roll':
        from jax.experimental.pallas import tpu as pltpu
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec((1,), lambda *_: (0,))


def _position_scores(pq, table):
    """'gather': P [B, H, T, K] float32, unshifted: every position query against every distance row."""
    return jnp.einsum('bhtd,hkd->bhtk', pq, table, preferred_element_type=jnp.float32)


def _position_inputs(spec: Spec, pq, table, by, positions=None):
    """The position inputs of a kernel and their block specs: 'gather', P (`positions`, formed here
    if None; its rows `by`: 'query' tile or 'all'); 'roll', the position queries (likewise) and the
    table. Grids are (b, h, tile)."""
    t_pad, dims = pq.shape[2:]
    if spec.skew == 'gather':
        length = spec.block_q if by == 'query' else t_pad
        positions = _position_scores(pq, table) if positions is None else positions
        block = pl.BlockSpec((None, None, length, positions.shape[-1]),
                             (lambda b, h, q: (b, h, q, 0)) if by == 'query' else (lambda b, h, j: (b, h, 0, 0)))
        return [positions], [block]
    length = spec.block_q if by == 'query' else t_pad
    queries = pl.BlockSpec((None, None, length, dims),
                           (lambda b, h, q: (b, h, q, 0)) if by == 'query' else (lambda b, h, j: (b, h, 0, 0)))
    return [pq, table], [queries, pl.BlockSpec((None,) + table.shape[1:], lambda b, h, _: (h, 0, 0))]


def _forward(spec: Spec, seed, cq, pq, k, v, table, valid):
    batch, heads, t_pad, dims = cq.shape
    k_pad = k.shape[2]
    per_query = pl.BlockSpec((None, None, spec.block_q, dims), lambda b, h, q: (b, h, q, 0))
    per_head_keys = pl.BlockSpec((None, None, k_pad, dims), lambda b, h, q: (b, h, 0, 0))
    positions, position_specs = _position_inputs(spec, pq, table, 'query')
    # Per-key validity [B, 1, K] and per-query log-normalisers [B, H, T, 1]: a row vector and a
    # column, the shapes TPU's (sublane, lane) tiling takes whole.
    in_specs = [_seed_spec(spec), per_query, position_specs[0], per_head_keys, per_head_keys, *position_specs[1:],
                pl.BlockSpec((None, 1, k_pad), lambda b, h, q: (b, 0, 0))]
    out_shapes = [jax.ShapeDtypeStruct(cq.shape, v.dtype),
                  jax.ShapeDtypeStruct((batch, heads, t_pad, 1), jnp.float32)]
    out_specs = [per_query, pl.BlockSpec((None, None, spec.block_q, 1), lambda b, h, q: (b, h, q, 0))]
    return _call(spec, _forward_kernel, (batch, heads, t_pad // spec.block_q), in_specs, out_shapes, out_specs,
                 seed, cq, positions[0], k, v, *positions[1:], valid)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(spec: Spec, seed, cq, pq, k, v, table, valid):
    return tuple(_forward(spec, seed, cq, pq, k, v, table, valid))


def _attention_forward(spec, seed, cq, pq, k, v, table, valid):
    out, lse = _forward(spec, seed, cq, pq, k, v, table, valid)
    return (out, lse), (seed, cq, pq, k, v, table, valid, out, lse)


def _query_gradients(spec: Spec, seed, cq, pq, k, v, table, valid, grad_out, lse, delta, grad_lse, positions):
    """(the content queries', the position queries' and the table's gradients); `positions`: P
    ('gather')."""
    batch, heads, t_pad, dims = cq.shape
    k_pad = k.shape[2]
    n_q = t_pad // spec.block_q
    if spec.skew == 'gather':
        by_query = pl.BlockSpec((None, None, spec.block_q, dims), lambda b, h, q: (b, h, q, 0))
        by_query_row = pl.BlockSpec((None, None, spec.block_q, 1), lambda b, h, q: (b, h, q, 0))
        keys_of_head = pl.BlockSpec((None, None, k_pad, dims), lambda b, h, q: (b, h, 0, 0))
        _, (position_spec,) = _position_inputs(spec, pq, table, 'query', positions)
        # dP in float32, as P: in bf16 its products from the interpreted kernel's output meet an
        # XLA:CPU dot that takes no bf16 operands; on a chip, whether bf16 pays is the accel suite's.
        zeros = jnp.zeros(positions.shape[:-1] + (spec.keys + 1,), jnp.float32)
        grad_spec = pl.BlockSpec((None, None, spec.block_q, spec.keys + 1), lambda b, h, q: (b, h, q, 0))
        in_specs = [_seed_spec(spec), by_query, position_spec, keys_of_head, keys_of_head,
                    pl.BlockSpec((None, 1, k_pad), lambda b, h, q: (b, 0, 0)),
                    by_query, by_query_row, by_query_row, by_query_row, grad_spec]
        out_shapes = [jax.ShapeDtypeStruct(cq.shape, cq.dtype), jax.ShapeDtypeStruct(zeros.shape, zeros.dtype)]
        dcq, grad_positions = _call(spec, _query_grad_gather_kernel, (batch, heads, n_q), in_specs, out_shapes,
                                    [by_query, grad_spec], seed, cq, positions, k, v, valid, grad_out, lse,
                                    delta, grad_lse, zeros, aliases={10: 1})
        grad_positions = grad_positions[..., :spec.keys]
        # The positional products, by XLA: dP . R and dP^T . (q + v) summed over the batch.
        dpq = jnp.einsum('bhtk,hkd->bhtd', grad_positions, table, preferred_element_type=jnp.float32)
        dtable = jnp.einsum('bhtk,bhtd->hkd', grad_positions, pq, preferred_element_type=jnp.float32)
        return dcq, dpq.astype(pq.dtype), dtable
    # 'roll' (TPU): one batch row per program, so that a program's keys and values fit its vector memory.
    by_query = pl.BlockSpec((None, None, spec.block_q, dims), lambda h, q, b: (b, h, q, 0))
    by_query_row = pl.BlockSpec((None, None, spec.block_q, 1), lambda h, q, b: (b, h, q, 0))
    keys_of_head = pl.BlockSpec((None, None, k_pad, dims), lambda h, q, b: (b, h, 0, 0))
    rows = table.shape[1]
    in_specs = [_seed_spec(spec), by_query, by_query, keys_of_head, keys_of_head,
                pl.BlockSpec((None, rows, dims), lambda h, q, b: (h, 0, 0)),
                pl.BlockSpec((None, 1, k_pad), lambda h, q, b: (b, 0, 0)),
                by_query, by_query_row, by_query_row, by_query_row]
    out_shapes = [jax.ShapeDtypeStruct(cq.shape, cq.dtype), jax.ShapeDtypeStruct(pq.shape, pq.dtype),
                  jax.ShapeDtypeStruct((batch * n_q, heads, rows, dims), jnp.float32)]
    out_specs = [by_query, by_query, pl.BlockSpec((None, None, rows, dims), lambda h, q, b: (b * n_q + q, h, 0, 0))]
    dcq, dpq, dtable = _call(spec, _query_grad_roll_kernel, (heads, n_q, batch), in_specs, out_shapes, out_specs,
                             seed, cq, pq, k, v, table, valid, grad_out, lse, delta, grad_lse)
    return dcq, dpq, dtable.sum(axis=0)


def _attention_backward(spec, residuals, grads):
    seed, cq, pq, k, v, table, valid, out, lse = residuals
    grad_out, grad_lse = grads
    batch, heads, t_pad, dims = cq.shape
    k_pad = k.shape[2]
    delta = jnp.sum(grad_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    grad_out = grad_out.astype(v.dtype)
    grad_lse = grad_lse.astype(jnp.float32)  # [B, H, T, 1], as the forward's log-normaliser.
    # P formed once for both gradient kernels (the forward's is not kept: B x H x T x K floats).
    positions = _position_scores(pq, table) if spec.skew == 'gather' else None
    dcq, dpq, dtable = _query_gradients(spec, seed, cq, pq, k, v, table, valid, grad_out, lse, delta, grad_lse,
                                        positions)

    per_key = pl.BlockSpec((None, None, spec.block_k, dims), lambda b, h, j: (b, h, j, 0))
    queries_of_head = pl.BlockSpec((None, None, t_pad, dims), lambda b, h, j: (b, h, 0, 0))
    rows_of_head = pl.BlockSpec((None, None, t_pad, 1), lambda b, h, j: (b, h, 0, 0))
    positions, position_specs = _position_inputs(spec, pq, table, 'all', positions)
    in_specs = [_seed_spec(spec), queries_of_head, position_specs[0], per_key, per_key, *position_specs[1:],
                pl.BlockSpec((None, 1, k_pad), lambda b, h, j: (b, 0, 0)),
                queries_of_head, rows_of_head, rows_of_head, rows_of_head]
    out_shapes = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    dk, dv = _call(spec, _key_grad_kernel, (batch, heads, k_pad // spec.block_k), in_specs, out_shapes,
                   [per_key, per_key], seed, cq, positions[0], k, v, *positions[1:], valid, grad_out, lse, delta,
                   grad_lse)
    return (None, dcq, dpq, dk, dv, dtable.astype(table.dtype), None)


_attention.defvjp(_attention_forward, _attention_backward)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_head_dim(head_dim: int, skew: str) -> int:
    """Triton's blocks are powers of two (16 at least, for its products); TPU's lanes are 128 wide."""
    if skew == 'roll':
        return _round_up(head_dim, 128)
    return max(16, 1 << (head_dim - 1).bit_length())


def span_attention(content_query, position_query, key, value, pos_key, key_valid, *, scale: float,
                   window: int = 0, dropout_rate: float = 0.0, dropout_seed=None, block_q: int = 64,
                   block_k: int = 64, skew: str = 'gather', interpret: bool = False):
    """Attention over one contiguous span of K keys whose last T are the segment's queries' own:
    (attended [B, T, H, D] in the values' dtype, log_norm [B, H, T] float32), as the reference's
    softmax over (content_query . key + rel_shift(position_query . pos_key)) * scale.

    content_query, position_query: [B, T, H, D] (the queries plus u, plus v); key, value
    [B, K, H, D]; pos_key [K, H, D], row p the encoding of distance K - 1 - p (clamped by the table);
    key_valid [B, K] bool. `window` > 0: same_length. `dropout_rate` > 0 drops attention weights
    with the mask `dropout_keep(dropout_seed, ...)`; `dropout_seed` an int32 scalar.
    """
    if skew not in SKEWS:
        raise ValueError(f'skew={skew!r} must be one of {SKEWS}.')
    batch, t, heads, dims = content_query.shape
    k = key.shape[1]
    if pos_key.shape[0] != k:
        raise ValueError(f'{pos_key.shape[0]} distance rows for a span of {k} keys.')
    if block_q & (block_q - 1) or block_k & (block_k - 1):
        raise ValueError(f'tiles of {block_q} x {block_k}: both must be powers of two.')
    # Tiles no longer than the padded lengths need: a short segment takes one small tile.
    block_q = min(block_q, max(16, 1 << (t - 1).bit_length()))
    block_k = min(block_k, max(16, 1 << (k - 1).bit_length()))
    spec = Spec(queries=t, keys=k, window=int(window), scale=float(scale), rate=float(dropout_rate),
                block_q=block_q, block_k=block_k, skew=skew, interpret=interpret)
    dims_pad = padded_head_dim(dims, skew)
    t_pad, k_pad = _round_up(t, block_q), _round_up(k, block_k)
    if skew == 'roll':
        # The last tile pair's window ends at row front + k_pad + t + (width - bq - bk) - 1.
        front = spec.front
        rows = _round_up(front + k_pad + t + spec.width - block_q - block_k, spec.width)
    else:
        front, rows = 0, k  # P's columns: one per distance row.

    def head_major(x, length):  # [B, N, H, D] -> [B, H, N_pad, D_pad]
        x = x.transpose(0, 2, 1, 3)
        return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, dims_pad - dims)))

    table = jnp.pad(pos_key.transpose(1, 0, 2), ((0, 0), (front, rows - front - k), (0, dims_pad - dims)))
    valid = jnp.pad(key_valid.astype(jnp.int32), ((0, 0), (0, k_pad - k)))[:, None, :]
    seed = jnp.zeros((1,), jnp.int32) if dropout_seed is None else jnp.reshape(dropout_seed, (1,)).astype(jnp.int32)
    out, lse = _attention(spec, seed, head_major(content_query, t_pad), head_major(position_query, t_pad),
                          head_major(key, k_pad), head_major(value, k_pad), table.astype(pos_key.dtype), valid)
    return out[:, :, :t, :dims].transpose(0, 2, 1, 3), lse[:, :, :t, 0]


def tiles_for(head_dim: int) -> tuple[int, int]:
    """(block_q, block_k): 64 x 64 keeps a tile's operands in registers and shared memory at head
    dims up to 128; wider heads halve the key tile."""
    return (64, 64) if head_dim <= 128 else (64, 32)
