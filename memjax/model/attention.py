"""Relative multi-head attention over a list of key blocks (Transformer-XL's four-term score).

A memory kind offers each layer's attention the blocks of keys it keeps; the segment itself is
always the last block. Every block has a distance rule:

- contiguous (`distances=None`): the block sits right before the next one. The trailing run of
  contiguous blocks and the segment form one span of K keys; its positional scores come from one
  `rel_shift` over K distance rows (the fast path, with its custom backward).
- explicit (`distances` given): keys that were selected, thinned or have aged; their positional
  scores are computed once per distance row and gathered at each key's distance.

A block holds layer-input rows, which the attention projects with the layer's key and value maps,
or keys and values the kind projected itself (cached, or gathered per head: TRAMS's selection, so
that a head scores only the keys it selected). Masks are per block and may differ per head. The
kind builds its blocks with the layer's maps in hand (`LayerMaps`, before any score), can read what
the attention computed (`AttentionView`), add a second output to the attention's output, and bring
rows of its own that are keys for the segment and queries of their own (`rows`: LaMemo's
refreshed memory).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from memjax.kernels import cpu as cpu_kernels
from memjax.kernels import fused_choice
from memjax.kernels import relative_attention as fused_attention
from memjax.kernels import softmax as softmax_lib
from memjax.model.config import ModelConfig
from memjax.model import stochastic
from memjax.model.positions import POSITIONS, position_scores, rel_shift
from memjax.model.primitives import BLOCKS, BTHK, Dropout, layer_norm, projection


@struct.dataclass
class KeyBlock:
    """Keys offered to one layer's attention.

    rows:      [B, N, d_model] layer-input rows, projected by this layer's key and value maps
               (after its LayerNorm when pre-LN); None when `keys` and `values` are given.
    valid:     [B, H or 1, T or 1, N] bool: False keys are never attended (causality and
               `same_length` are applied on top).
    distances: None (contiguous) or int32 [B or 1, H or 1, T, N], each query's distance to each key;
               the attention needs `AttentionContext.positions` to have more rows than the largest.
    keys, values: [B, N, H, Dh] already projected by this layer's maps (`LayerMaps`), instead of
               `rows`; row n of head h may be another position than row n of head h' (per-head
               selection), with `valid` and `distances` per head to match.
    offset:    int32 scalar (may be traced), with `distances=None`: contiguous keys that lag
               `offset` positions behind the block that follows (a memory retained while its layer
               was skipped); scored over a distance table shifted by `offset`.
    """

    rows: Optional[jax.Array]
    valid: jax.Array
    distances: Optional[jax.Array] = None
    keys: Optional[jax.Array] = None
    values: Optional[jax.Array] = None
    offset: Optional[jax.Array] = None

    @property
    def contiguous(self) -> bool:
        return self.distances is None and self.offset is None

    @property
    def length(self) -> int:
        return (self.rows if self.rows is not None else self.keys).shape[1]


@struct.dataclass
class AttentionContext:
    """What every layer's attention shares: the distance table and the global biases.

    positions: [R, d_model] encodings of distances R-1, ..., 0 (dropout already applied), or
               None with absolute positions (then there are no biases either: content scores only).
    window:    with `same_length`, a query sees the newest `window` keys in attended order (itself
               included): for contiguous keys, those less than `window` positions back.
    """

    positions: Optional[jax.Array]
    u_bias: Optional[jax.Array]  # [H, Dh]; None when every layer has its own (untie_r).
    v_bias: Optional[jax.Array]
    window: int = struct.field(pytree_node=False, default=0)
    # The memory kind's own global biases (MemoryKind.bias_names) -> [H, Dh], shared by the layers
    # unless untie_r.
    biases: dict = struct.field(default_factory=dict)


@struct.dataclass
class LayerCache:
    """One layer's keys while a segment is decoded token by token (memjax/generation).

    Recorded when the segment's first token (or a prompt's first tokens) runs as the whole segment
    (`RelativeAttention(..., record=True)`): every key the segment's queries attend, the memory
    kind's blocks and stack rows first and then the segment's own T slots, which each token step
    fills at its position. Keys stay where they are while the queries advance, so a query at
    segment position p sees key k where `valid` holds, `distance + p` >= 0 (not in its future)
    and, with `same_length`, k is among the newest `window` keys before it, as in the whole segment.
    """

    # Head-major, so that a token's scores and output read each head's keys in one contiguous run.
    keys: jax.Array  # [B, H, K, Dh]
    values: jax.Array  # [B, H, K, Dh]
    valid: jax.Array  # [B, H, K] bool; the segment's slots hold.
    distance: jax.Array  # [B, H, K] int32: the distance from the segment's first query to each key.
    pos_key: Optional[jax.Array]  # [R, H, Dh] positional keys of the whole distance table; None: absolute.
    kind: Any = None  # What the memory kind's `attend` kept for its token steps (`Attended.cache`).
    segment_len: int = struct.field(pytree_node=False, default=0)  # T, the segment's slots (the last keys).

    @property
    def first_slot(self) -> int:
        """Index of the segment's first slot among the keys."""
        return self.keys.shape[2] - self.segment_len


@dataclasses.dataclass(frozen=True)
class LayerMaps:
    """One layer's attention maps, handed to its memory kind before any score is computed (`blocks`)
    and after the softmax (`AttentionView.maps`): extra queries, keys and values share the layer's
    parameters, and a kind may rank rows by the kernels themselves (TRAMS's K' = k W_Q^T)."""

    index: jax.Array  # int32 scalar: the layer's place in the stack, 0 first (traced under nn.scan).
    query: Callable[[jax.Array], jax.Array]  # [..., d_model] -> [..., H, Dh], after the pre-LN norm.
    key: Callable[[jax.Array], jax.Array]
    value: Callable[[jax.Array], jax.Array]
    output: Callable[[jax.Array], jax.Array]  # [..., H, Dh] -> [..., d_model]
    position: Optional[Callable[[jax.Array], jax.Array]]  # [R, d_model] -> [R, H, Dh] (W_r); None: absolute.
    query_kernel: jax.Array  # [d_model, H, Dh] W_Q (its bias, if the block has one, is not in it).
    key_kernel: jax.Array  # [d_model, H, Dh] W_K
    value_kernel: jax.Array  # [d_model, H, Dh] W_V
    output_kernel: jax.Array  # [H, Dh, d_model] W_O


@dataclasses.dataclass(frozen=True)
class AttentionView:
    """This layer's attention as a memory kind's `attend` hook sees it."""

    query: jax.Array  # [B, T, H, Dh] segment queries, before the u/v biases.
    key: jax.Array  # [B, K, H, Dh] every block's keys, segment last.
    value: jax.Array  # [B, K, H, Dh]
    maps: LayerMaps  # The layer's own maps.
    log_norm: jax.Array  # [B, H, T] float32: the softmax's log-denominator, the logsumexp over keys
    #                      of the segment's queries' scaled scores (masked keys: the float32 minimum).
    attended: jax.Array  # [B, T, H, Dh] the segment's attention output before the output map.
    positions: Optional[jax.Array]  # The context's distance table (rows for distances R-1 ... 0).
    u_bias: Optional[jax.Array]  # [H, Dh] this layer's content and position biases, and its kind's own.
    v_bias: Optional[jax.Array]
    biases: dict
    rows: Optional[jax.Array]  # [B, R, d_model] the kind's stack rows at this layer, or None.
    deterministic: bool  # No dropout (evaluation).
    # In a token step of decoding (memjax/generation): what this kind's `attend` kept in
    # `Attended.cache` when the segment was recorded; None otherwise.
    cached: Any = None


@dataclasses.dataclass(frozen=True)
class Attended:
    """What a memory kind's `attend` hook returns.

    extra: [B, T, d_model] added to the segment's output (after the output map), or None.
    rows:  [B, R, d_model] the output of the kind's own query rows (`rows` of the attention), after
           the output map; required when the attention has rows.
    notes: anything, handed to the kind's `write`.
    cache: what the kind's token steps need when the segment is decoded token by token and that
           depends only on the state (`AttentionView.cached` there), or None.
    """

    extra: Optional[jax.Array] = None
    rows: Optional[jax.Array] = None
    notes: Any = None
    cache: Any = None


def _kernel(proj: nn.Module) -> jax.Array:
    """A projection's kernel as a plain array, for products that do not go through the projection."""
    return nn.meta.unbox(proj.variables['params']['kernel'])


def _contiguous_tail(blocks: Sequence[KeyBlock]) -> int:
    """Index of the first block of the trailing contiguous run; checks nothing contiguous precedes
    an explicit or lagging block (its distances would be undefined)."""
    start = len(blocks)
    while start and blocks[start - 1].contiguous:
        start -= 1
    if any(b.contiguous for b in blocks[:start]):
        raise ValueError('a contiguous key block (distances=None) must not precede a block with '
                         'explicit distances or an offset: give it explicit distances or move it last.')
    return start


def _gather_rows(scores: jax.Array, distances: jax.Array) -> jax.Array:
    """scores [B, H, T, R] per distance row -> [B, H, T, N] at each key's distance (row R-1-d)."""
    rows = scores.shape[-1]
    index = jnp.clip(rows - 1 - distances, 0, rows - 1)
    index = jnp.broadcast_to(index, scores.shape[:3] + index.shape[-1:])
    return jnp.take_along_axis(scores, index, axis=-1)


def _last_rows(query_v, pos_key, every_row, width: int) -> jax.Array:
    """Scores [B, H, T, width] of the table's newest `width` distance rows: sliced from `every_row`
    when the explicit blocks had the whole table scored, so no row is scored twice."""
    if every_row is not None:
        return every_row[..., every_row.shape[-1] - width:]
    return position_scores(query_v, pos_key[pos_key.shape[0] - width:])


def _lagging_block(query_v, shifted_pos_key, block: KeyBlock, offset) -> jax.Array:
    """[B, H, T, N]: the block and the queries as one span over the table shifted by `offset`."""
    shifted = position_scores(query_v, shifted_pos_key(block.length + query_v.shape[1], offset))
    return rel_shift(shifted)[..., :block.length]


def _lagging_then_span(query_v, pos_key, shifted_pos_key, block: KeyBlock, span: int, every_row):
    """Positional scores [B, H, T, N + span] of a lagging block right before the contiguous span.

    Most steps it does not lag (Skip-Retain: its layer ran the step before), and then block and
    span are one span scored by one `rel_shift`, as without lagging; only when it lags is the block
    scored over the distance table shifted by its offset and the span over its own rows (a branch
    of `lax.cond`: the other is not computed)."""

    def lagging(offset):
        return jnp.concatenate([_lagging_block(query_v, shifted_pos_key, block, offset),
                                rel_shift(_last_rows(query_v, pos_key, every_row, span))], axis=-1)

    def together(_):
        return rel_shift(_last_rows(query_v, pos_key, every_row, block.length + span))

    if pos_key.shape[0] < block.length + span:
        return lagging(block.offset)
    return jax.lax.cond(block.offset == 0, together, lagging, block.offset)


def _explicit_scores(query_v, every_row, shifted_pos_key, block: KeyBlock) -> jax.Array:
    """Positional scores [B, H, T, N] of a block the span's `rel_shift` cannot align: explicit keys
    are gathered at their distances, a lagging block is scored over its shifted table."""
    if block.distances is not None:
        return _gather_rows(every_row, block.distances)
    return _lagging_block(query_v, shifted_pos_key, block, block.offset)


def _span_scores(query_v, pos_key, shifted_pos_key, adjacent_lag, span: int, every_row) -> jax.Array:
    """Positional scores [B, H, T, (N +) span] of the contiguous span, with the lagging block right
    before it (`adjacent_lag`, or None): one `rel_shift` in the steps it does not lag."""
    if adjacent_lag is not None:
        return _lagging_then_span(query_v, pos_key, shifted_pos_key, adjacent_lag, span, every_row)
    return rel_shift(_last_rows(query_v, pos_key, every_row, span))


def _in_window(keys, queries, window: int) -> jax.Array:
    """`same_length`: every query sees as many keys, the newest `window` in attended order."""
    return keys > queries - window


def _explicit_mask(block: KeyBlock, first: int, query, first_query: int, same_length: bool,
                   window: int) -> jax.Array:
    """[B, H or 1, T, N] keys a query sees in a block outside the span, its first key at `first`
    and query t (`query` [T, 1]) at `first_query + t` in attended order."""
    if block.distances is not None:
        visible = block.distances >= 0  # A negative distance: the key is in the query's future.
    else:
        visible = jnp.ones((query.shape[0], block.length), bool)  # Lagging: all in the past.
    if same_length:
        visible &= _in_window(first + jnp.arange(block.length)[None, :], first_query + query, window)
    return block.valid & visible


def _span_mask(contiguous: Sequence[KeyBlock], batch: int, query, span: int, same_length: bool,
               window: int) -> jax.Array:
    """[B, H or 1, T, span] keys a query sees in the span (the contiguous blocks, then the
    segment): causal, as query t (`query` [T, 1]) is its key span - T + t."""
    qlen = query.shape[0]
    keys = jnp.arange(span)[None, :]
    visible = keys <= span - qlen + query
    if same_length:
        visible &= _in_window(keys, span - qlen + query, window)
    valid = [b.valid for b in contiguous] + [jnp.ones((batch, 1, 1, qlen), bool)]
    return _side_by_side(valid) & visible


def _side_by_side(masks: Sequence[jax.Array]) -> jax.Array:
    """Masks of consecutive key blocks as one [B, H or 1, T or 1, K]: a block may mask per head
    or per query while another masks all alike, so each is broadcast to the largest."""
    lead = tuple(max(m.shape[axis] for m in masks) for axis in range(3))
    return jnp.concatenate([jnp.broadcast_to(m, lead + m.shape[-1:]) for m in masks], axis=-1)


def _scores_and_mask(query_v, pos_key, blocks, qlen, same_length, window, shifted_pos_key=None):
    """Positional scores [B, H, T, K] (None without a distance table) and the mask
    [B, H or 1, T, K] over every block + segment. `shifted_pos_key(rows, offset)` gives the
    [rows, H, Dh] positional keys of distances offset + rows-1 ... offset, for lagging blocks (a
    pure function: it may run inside `lax.cond`)."""
    tail = _contiguous_tail(blocks)
    explicit, contiguous = blocks[:tail], blocks[tail:]
    span = sum(b.length for b in contiguous) + qlen
    total = sum(b.length for b in blocks) + qlen
    relative = pos_key is not None
    if relative and pos_key.shape[0] < span:
        raise ValueError(f'{pos_key.shape[0]} distance rows for a contiguous span of {span} keys: '
                         'the memory kind must ask for at least that many (position_rows).')
    query = jnp.arange(qlen)[:, None]  # The segment's queries are the last keys attended.
    every_row = None  # Explicit distances may be any row of the table: it is scored once, whole.
    if relative and any(b.distances is not None for b in explicit):
        every_row = position_scores(query_v, pos_key)
    scores = None
    if relative:
        # A lagging block right before the span is scored with it: most steps it does not lag.
        adjacent_lag = explicit[-1] if explicit and explicit[-1].distances is None else None
        alone = explicit[:-1] if adjacent_lag is not None else explicit
        scores = jnp.concatenate(
            [_explicit_scores(query_v, every_row, shifted_pos_key, b) for b in alone]
            + [_span_scores(query_v, pos_key, shifted_pos_key, adjacent_lag, span, every_row)], axis=-1)
    masks, first = [], 0
    for b in explicit:
        masks.append(_explicit_mask(b, first, query, total - qlen, same_length, window))
        first += b.length
    masks.append(_span_mask(contiguous, query_v.shape[0], query, span, same_length, window))
    return scores, _side_by_side(masks)


def _recorded(blocks: Sequence[KeyBlock], key, value, pos_key, qlen: int, n_head: int, kind_cache) -> LayerCache:
    """The LayerCache of a segment run whole: its keys, and each key's validity and distance from
    the segment's first query."""
    tail = _contiguous_tail(blocks)
    lead = (key.shape[0], n_head)
    per_key = lambda x: jnp.broadcast_to(x, lead + x.shape[-1:])  # [B or 1, H or 1, N] -> [B, H, N]
    distances = []
    for b in blocks[:tail]:
        if b.distances is None:
            raise ValueError('a lagging key block (offset) cannot be decoded token by token: decode with the '
                             'evaluation model, whose layers are never skipped.')
        distances.append(per_key(b.distances[:, :, 0, :]))
    span = sum(b.length for b in blocks[tail:]) + qlen
    distances.append(per_key((span - qlen - jnp.arange(span, dtype=jnp.int32))[None, None, :]))
    if any(b.valid.shape[2] != 1 for b in blocks):
        raise ValueError('a key block whose validity differs per query cannot be decoded token by token.')
    valid = [per_key(b.valid[:, :, 0, :]) for b in blocks] + [jnp.ones(lead + (qlen,), bool)]
    head_major = lambda x: x.transpose(0, 2, 1, 3)
    return LayerCache(keys=head_major(key), values=head_major(value), valid=jnp.concatenate(valid, axis=-1),
                      distance=jnp.concatenate(distances, axis=-1), pos_key=pos_key, kind=kind_cache,
                      segment_len=qlen)


def _token_attention(cfg: ModelConfig, query, key, value, cache: LayerCache, position, u_bias, v_bias,
                     window: int):
    """One token at segment `position` against the segment's cache: (attended [B, 1, H, Dh], the
    scores' logsumexp [B, H, 1] as `AttentionView.log_norm`, the cache holding the token's key and value).
    The same scores as the whole segment's row `position`: positional ones are gathered at each
    key's distance instead of lined up by `rel_shift`."""
    slot = cache.first_slot + position
    written = lambda old, new: jax.lax.dynamic_update_slice_in_dim(old, new.transpose(0, 2, 1, 3).astype(old.dtype),
                                                                   slot, axis=2)
    keys, values = written(cache.keys, key), written(cache.values, value)
    distance = (cache.distance + position)[:, :, None, :]  # [B, H, 1, K]
    visible = cache.valid[:, :, None, :] & (distance >= 0)
    if cfg.same_length:
        visible &= _in_window(jnp.arange(keys.shape[2]), slot, window)
    content_query = position_query = query
    if cache.pos_key is not None:
        content_query, position_query = query + u_bias.astype(cfg.dtype), query + v_bias.astype(cfg.dtype)
    scores = jnp.einsum('bthd,bhkd->bhtk', content_query, keys, preferred_element_type=jnp.float32)
    if cache.pos_key is not None:
        # One query: the product comes out in the order `_gather_rows` reads (position_scores
        # swaps the batch and head axes afterwards, which pays off for a segment's queries).
        every_row = jnp.einsum('bthd,rhd->bhtr', position_query, cache.pos_key, preferred_element_type=jnp.float32)
        scores += _gather_rows(every_row, distance)
    scores = jnp.where(visible, scores * (cfg.d_head ** -0.5), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(cfg.dtype)
    return (jnp.einsum('bhtk,bhkd->bthd', probs, values), jax.nn.logsumexp(scores, axis=-1),
            cache.replace(keys=keys, values=values))


def _content_scores(query, key):
    """[B, T, H, D] queries x [B, K, H, D] keys -> [B, H, T, K] float32, with heads before positions
    (XLA:CPU runs the product faster so, and lays the key projection out for it: evaluation steps
    7-16 % faster at the peer shape, docs/perf-notes.md); on CPU memjax's kernel where it applies."""
    return cpu_kernels.product(_heads_first_scores, query.transpose(0, 2, 1, 3), key.transpose(0, 2, 1, 3),
                               transpose_rhs=True)


def _heads_first_scores(query, key):
    return jnp.einsum('bhtd,bhkd->bhtk', query, key, preferred_element_type=jnp.float32)


def _span_key_validity(blocks: Sequence[KeyBlock], batch: int, qlen: int) -> Optional[jax.Array]:
    """[B, K] validity of the keys of one contiguous span (the segment last), or None where the
    keys are not one span or a block's validity differs per head or query."""
    if not all(b.contiguous and b.valid.shape[1:3] == (1, 1) for b in blocks):
        return None
    return jnp.concatenate([jnp.broadcast_to(b.valid[:, 0, 0, :], (batch, b.length)) for b in blocks]
                           + [jnp.ones((batch, qlen), bool)], axis=-1)


def _content_and_position_scores(content_query, key, position_query, pos_key, dtype):
    """[B, H, T, K] content + rel-shifted position scores, the products' outputs in `dtype`."""
    content = jnp.einsum('bthd,bkhd->bhtk', content_query, key, preferred_element_type=dtype)
    position = jnp.einsum('bthd,khd->hbtk', position_query, pos_key, preferred_element_type=dtype)
    return content + rel_shift(position.transpose(1, 0, 2, 3))


@jax.custom_vjp
def _low_precision_span_scores(content_query, key, position_query, pos_key):
    """`_content_and_position_scores` in float32 from operands in a lower compute dtype, whose backward runs in that
    dtype: the scores' gradient is rounded to it once, then shifted back and multiplied by the
    operands in it. Autodiff would carry the float32 gradient, 4 bytes per score, through the
    shift and into four float32 products (the [B, H, T, K] gradient is the step's largest
    tensor); the softmax's own arithmetic, before, stays float32."""
    return _content_and_position_scores(content_query, key, position_query, pos_key, jnp.float32)


def _low_precision_span_scores_forward(*operands):
    return _low_precision_span_scores(*operands), operands


def _low_precision_span_scores_backward(operands, grad):
    dtype = operands[0].dtype
    _, vjp = jax.vjp(functools.partial(_content_and_position_scores, dtype=dtype), *operands)
    return vjp(grad.astype(dtype))


_low_precision_span_scores.defvjp(_low_precision_span_scores_forward, _low_precision_span_scores_backward)


def span_scores_masked(scale: float, content_query, key, position_query, pos_key, key_valid):
    """Masked scores [B, H, T, K] of one contiguous span of K keys (`pos_key`: its K distance rows),
    the segment's T queries last: (content + rel-shifted position scores) * scale, where each key
    is valid and not in the query's future; the float32 minimum elsewhere. Float32 scores in any
    compute dtype; when every operand is in a lower one, their gradient is in it too
    (`_low_precision_span_scores`)."""
    qlen, klen = content_query.shape[1], key.shape[1]
    if jnp.dtype(jnp.float32) in {x.dtype for x in (content_query, key, position_query, pos_key)}:
        scores = _content_scores(content_query, key) + rel_shift(position_scores(position_query, pos_key))
    else:
        scores = _low_precision_span_scores(content_query, key, position_query, pos_key)
    visible = (jnp.arange(klen)[None, :] <= klen - qlen + jnp.arange(qlen)[:, None]) & key_valid[:, None, None, :]
    return jnp.where(visible, scores * scale, jnp.finfo(jnp.float32).min)


def span_attention(scale: float, content_query, memory_key, segment_key, position_query, pos_key, key_valid,
                   memory_value, segment_value):
    """(attended [B, T, H, D], log_norm [B, H, T]) over one contiguous span whose keys and values
    come as the memory's block and the segment's: `span_scores_masked`'s softmax, then its
    weighted values (`cpu_kernels.span_attention` runs it in one pass where it can)."""
    key = jnp.concatenate([memory_key, segment_key], axis=1)
    value = jnp.concatenate([memory_value, segment_value], axis=1)
    probs, log_norm = cpu_kernels.relative_softmax(functools.partial(span_scores_masked, scale), content_query, key,
                                                   position_query, pos_key, key_valid, scale, value.dtype)
    return cpu_kernels.attend(probs, value, causal=True), log_norm


def _on_mesh(attention: Callable) -> Callable:
    """`attention(cq, pq, key, value, pos_key, key_valid, dropout_seed=)` run per shard of the mesh
    in scope, split as the activations are (batch and heads; a Pallas call has no sharding rule of
    its own, so XLA would otherwise gather its operands on every device). Each shard draws
    dropout from its own seed: the kernel's mask hashes local batch and head indices."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return lambda *xs: attention(*xs[:-1], dropout_seed=xs[-1])
    bthk = nn.logical_to_mesh_axes(BTHK)
    batch, _, heads, _ = bthk
    shard_axes = tuple(a for axes in (batch, heads) if axes for a in ((axes,) if isinstance(axes, str) else axes))

    def per_shard(*xs):
        seed = xs[-1]
        if shard_axes:
            seed = seed + jax.lax.axis_index(shard_axes).astype(jnp.int32) * jnp.int32(0x3C6EF35F)
        return attention(*xs[:-1], dropout_seed=seed)

    rows = jax.sharding.PartitionSpec(None, heads, None)
    in_specs = (bthk, bthk, bthk, bthk, rows, jax.sharding.PartitionSpec(batch, None), jax.sharding.PartitionSpec())
    out_specs = (bthk, jax.sharding.PartitionSpec(batch, heads, None))
    return jax.shard_map(per_shard, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _before_segment(blocks: Sequence[jax.Array], segment: jax.Array) -> jax.Array:
    """The blocks before the segment as one [B, N, H, D] (N = 0 without any)."""
    return jnp.concatenate(blocks, axis=1) if blocks else segment[:, :0]


def dropout_residual_norm(cfg: ModelConfig, h, branch, deterministic: bool):
    """Closes a sub-block: dropout on the branch, residual add, LayerNorm when post-LN."""
    out = h + Dropout(cfg.dropout)(branch, deterministic=deterministic)
    return out if cfg.pre_lnorm else layer_norm(cfg, 'layer_norm')(out)


class RelativeAttention(nn.Module):
    """Transformer-XL attention: scores (a)+(c) = (q + u).k and (b)+(d) = (q + v).W_r R(distance);
    with absolute positions (no distance table) the plain q.k.

    The positional term is computed once per distance row, never per query-key pair.
    `blocks` is the key blocks, or `maps -> key blocks` (a memory kind's `blocks` hook, given this
    layer's `LayerMaps` before any score). `attend(view) -> Attended` lets a memory kind add `extra`
    [B, T, d_model] to the output of the output projection (`view.maps.output` is that projection,
    for a kind whose extra output shares it); its notes are returned for the kind's write.

    `rows` (a KeyBlock, or None) are a kind's rows that travel up the stack with the segment: keys
    right before the segment, and queries whose output the kind's `attend` computes (`Attended.rows`).
    They share the residual and LayerNorm: the output is then [B, R + T, d_model], rows first.

    Decoding token by token (memjax/generation): `record=True` also returns the segment's
    `LayerCache`; given a `cache`, `h` [B, 1, d_model] is the token at segment `position`, which
    attends the cache (the kind's blocks are not asked again, `attend` sees `view.cached`), and
    the cache comes back with its key and value: `(out, notes, cache)` either way.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, h, blocks: Sequence[KeyBlock] | Callable[[LayerMaps], Sequence[KeyBlock]],
                 ctx: AttentionContext, u_bias, v_bias, deterministic: bool, attend: Optional[Callable] = None,
                 rows: Optional[KeyBlock] = None, biases: Optional[dict] = None, index=0,
                 record: bool = False, cache: Optional[LayerCache] = None, position=None):
        cfg = self.config
        qlen = h.shape[1]
        heads = (cfg.n_head, cfg.d_head)
        in_axes = ('embed', 'heads', 'kv')
        bias = BLOCKS[cfg.block].bias
        constrain = lambda x: nn.with_logical_constraint(x, BTHK)
        norm = layer_norm(cfg, 'layer_norm') if cfg.pre_lnorm else (lambda x: x)
        segment = norm(h)
        query_proj = projection(cfg, heads, 'query', in_axes, bias=bias)
        query = constrain(query_proj(segment))  # [B, T, H, Dh]
        key_proj = projection(cfg, heads, 'key', in_axes, bias=bias)
        value_proj = projection(cfg, heads, 'value', in_axes, bias=bias)
        segment_key, segment_value = key_proj(segment), value_proj(segment)
        out_proj = projection(cfg, cfg.d_model, 'out', ('heads', 'kv', 'embed'), in_dims=2, bias=bias)
        pos_proj = projection(cfg, heads, 'pos', in_axes) if ctx.positions is not None else None
        if self.is_initializing():
            # The output map is applied last, to the attention's output: its kernel is created now
            # so that the maps hold it before any score.
            out_proj(jnp.zeros(heads, cfg.dtype))

        def after_norm(proj):
            # A kind's rows are layer inputs, like the segment: normed first when pre-LN.
            return lambda x: proj(norm(x))

        maps = LayerMaps(
            index=jnp.asarray(index, jnp.int32),
            query=after_norm(query_proj), key=after_norm(key_proj), value=after_norm(value_proj),
            output=out_proj,
            position=None if pos_proj is None else lambda x: pos_proj(x.astype(cfg.dtype)),
            query_kernel=_kernel(query_proj), key_kernel=_kernel(key_proj),
            value_kernel=_kernel(value_proj), output_kernel=_kernel(out_proj))
        if cache is not None:  # A token step: every earlier key is in the cache.
            attended, log_norm, cache = _token_attention(cfg, query, segment_key, segment_value, cache, position,
                                                       u_bias, v_bias, ctx.window)
            out = out_proj(attended)
            if attend is not None:
                view = AttentionView(query=query, key=cache.keys.transpose(0, 2, 1, 3),
                                     value=cache.values.transpose(0, 2, 1, 3), maps=maps, log_norm=log_norm,
                                     attended=attended, positions=ctx.positions, u_bias=u_bias, v_bias=v_bias,
                                     biases=biases or {}, rows=None, deterministic=deterministic, cached=cache.kind)
                extra = attend(view).extra
                if extra is not None:
                    out = out + extra.astype(out.dtype)
            return dropout_residual_norm(cfg, h, out, deterministic), None, cache
        blocks = list(blocks(maps) if callable(blocks) else blocks) + ([rows] if rows is not None else [])

        def projected(given, block_rows, layer_map):
            # Memory rows are projected apart from the segment's: they carry no gradient, and one
            # projection of [memory; segment] makes the backward compute (and then drop) their
            # input gradient, ~4% of a step's matmul FLOPs.
            return given if block_rows is None else layer_map(block_rows.astype(h.dtype))

        block_keys = [projected(b.keys, b.rows, maps.key) for b in blocks]
        block_values = [projected(b.values, b.rows, maps.value) for b in blocks]
        key = constrain(jnp.concatenate(block_keys + [segment_key], axis=1))  # [B, K, H, Dh]
        value = constrain(jnp.concatenate(block_values + [segment_value], axis=1))

        # Stochastic Cross-Head attention (training): query head h reads head perm[h]'s keys,
        # positional keys and values; the u, v biases stay with the query head.
        permute = lambda x, axis: x
        if cfg.sch_beta > 0 and not deterministic:
            applied, perm = stochastic.cross_head_permutation(self.make_rng('cross_head'), cfg.sch_beta, cfg.n_head)
            self.sow('intermediates', 'cross_head', perm)  # For analysis and tests.
            # Gathered only in the steps that permute (beta of them), a branch of lax.cond.
            permute = lambda x, axis: jax.lax.cond(applied, lambda y: jnp.take(y, perm, axis=axis), lambda y: y, x)
            key, value = permute(key, 2), permute(value, 2)

        pos_key = shifted_pos_key = None
        if ctx.positions is not None:
            span_only = all(b.contiguous for b in blocks)
            positions = ctx.positions[ctx.positions.shape[0] - key.shape[1]:] if span_only else ctx.positions
            pos_key = permute(maps.position(positions), 1)  # [R, H, Dh]
            if any(b.offset is not None for b in blocks):
                # A pure function of the offset (it runs inside lax.cond): its dropout mask is
                # drawn here, for the largest table.
                table_rows = ctx.positions.shape[0]
                kept = Dropout(cfg.dropout)(jnp.ones((table_rows, cfg.d_model), cfg.dtype), deterministic)
                pos_kernel = _kernel(pos_proj).astype(cfg.dtype)

                def shifted_pos_key(rows, offset):
                    table = POSITIONS[cfg.positions](rows, cfg.d_model, cfg.clamp_len, offset).astype(cfg.dtype)
                    return permute(jnp.tensordot(table * kept[table_rows - rows:], pos_kernel, axes=1), 1)
            content_query, position_query = query + u_bias.astype(cfg.dtype), query + v_bias.astype(cfg.dtype)
        else:
            content_query = position_query = query
        # On CPU the scores and the weighted values run memjax's kernels where they apply
        # (memjax/kernels/cpu.py): one contiguous span's scores in one pass, other blocks term by term.
        position, mask = _scores_and_mask(position_query, pos_key, blocks, qlen, cfg.same_length,
                                          ctx.window, shifted_pos_key)
        span_valid = None  # [B, K]: the keys are one contiguous span whose validity is per key.
        if pos_key is not None and pos_key.shape[0] == key.shape[1]:
            span_valid = _span_key_validity(blocks, query.shape[0], qlen)
        key_valid = None if cfg.same_length else span_valid
        fused = fused_choice.path(cfg.attention_impl, cfg.d_head, cfg.dtype)
        attention_dropout = Dropout(cfg.dropatt)
        probs = None
        if fused is not None and span_valid is not None and not self.is_mutable_collection('intermediates'):
            # The tiled kernel: the scores and weights never exist whole; dropout's mask is redrawn
            # in the backward pass from the seed (nothing reads the weights here).
            rate, seed = 0.0, jnp.zeros((), jnp.int32)
            if cfg.dropatt > 0 and not deterministic:
                rate = cfg.dropatt
                seed = jax.random.randint(self.make_rng('dropout'), (), 0, jnp.iinfo(jnp.int32).max)
            block_q, block_k = fused_attention.tiles_for(cfg.d_head)
            attended, log_norm = _on_mesh(functools.partial(
                fused_attention.span_attention, scale=cfg.d_head ** -0.5, window=ctx.window if cfg.same_length else 0,
                dropout_rate=rate, block_q=block_q, block_k=block_k, **fused))(
                    content_query, position_query, key, value, pos_key, span_valid, seed)
        elif key_valid is not None and deterministic and not self.is_mutable_collection('intermediates'):
            # Evaluation, where nothing reads the weights: scores to weighted values in one pass
            # per head, the memory's keys and values not concatenated with the segment's.
            attended, log_norm = cpu_kernels.span_attention(
                functools.partial(span_attention, cfg.d_head ** -0.5), content_query,
                _before_segment(block_keys, segment_key), segment_key, position_query, pos_key, key_valid,
                _before_segment(block_values, segment_value), segment_value, cfg.d_head ** -0.5)
        elif key_valid is not None:  # One contiguous span: the rel-shift is a fixed offset per query.
            probs, log_norm = cpu_kernels.relative_softmax(
                functools.partial(span_scores_masked, cfg.d_head ** -0.5), content_query, key, position_query,
                pos_key, key_valid, cfg.d_head ** -0.5, cfg.dtype)
        else:
            scores = _content_scores(content_query, key)
            if position is not None:
                scores = scores + position
            scores = jnp.where(mask, scores * (cfg.d_head ** -0.5), jnp.finfo(jnp.float32).min)
            # Scores, softmax and log-denominator in float32 under any compute dtype: exp() turns
            # bf16's 0.4 % error in a score of 20 into 8 % in a weight; only the weights that
            # multiply the values are rounded to it (and kept for the backward pass).
            probs, log_norm = softmax_lib.softmax_with_log_norm(scores, cfg.dtype)
        # For analysis (memjax.analysis; a no-op unless applied with mutable=['intermediates']): what
        # the scores were made of, keys in attended order, the segment last.
        self.sow('intermediates', 'attention', {'probs': probs, 'mask': mask, 'query': query, 'key': key,
                                                'pos_key': pos_key, 'u_bias': u_bias, 'v_bias': v_bias})
        if probs is not None:
            probs = attention_dropout(probs, deterministic=deterministic)
            attended = cpu_kernels.attend(probs, value, causal=key_valid is not None)
        out = out_proj(attended)
        result = Attended()
        if attend is not None:
            view = AttentionView(query=query, key=key, value=value, maps=maps, log_norm=log_norm, attended=attended,
                                 positions=ctx.positions, u_bias=u_bias, v_bias=v_bias, biases=biases or {},
                                 rows=None if rows is None else rows.rows, deterministic=deterministic)
            result = attend(view)
            if result.extra is not None:
                out = out + result.extra.astype(out.dtype)
        if rows is not None:
            h = jnp.concatenate([rows.rows.astype(h.dtype), h], axis=1)
            out = jnp.concatenate([result.rows.astype(out.dtype), out], axis=1)
        out = dropout_residual_norm(cfg, h, out, deterministic)
        if record:
            table = None if ctx.positions is None else maps.position(ctx.positions)
            return out, result.notes, _recorded(blocks, key, value, table, qlen, cfg.n_head, result.cache)
        return out, result.notes
