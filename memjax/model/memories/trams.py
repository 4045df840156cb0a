"""TRAMS: training-free memory selection over a Transformer-XL's memory (Yu et al., 2023).

Every layer keeps a pool of `mem_len` past positions. For each batch row and head it attends
`trams_select` of them: the newest `trams_remain` always, and the `trams_select - trams_remain`
older ones that a query-independent metric ranks highest, in time order, then the segment. The
metric reads the key in model space, `K' = k W_Q^T` (k = x W_K, one d_model vector per head):

- 'paper' (default): `cos(K', 1) ||K'||`, which is `sum_d K'_d / sqrt(d_model)`, i.e. the key
  against `W_Q^T 1`: linear in the key, H x d_head operations per row;
- 'released': `||K'|| |sum_d K'_d|`, the authors' code; `||K'||^2 = k (W_Q^T W_Q) k^T` per head.

The two do not rank alike (the second ignores the sign). The released code also puts the selected
keys at contiguous positions, right before the kept window, as if nothing between them had been
dropped; `trams_positions='true'` (default) scores them at their real distances instead.

Why this is cheaper than the memory it reads: the pool is 'xl_cached''s (memories/cached.py),
each position's keys and values as its layer projected them when it was the segment, with its
metric. A step ranks stored numbers, gathers `select` keys and values per head and scores those:
no pool row is projected again (an XL memory re-projects its whole memory every segment), and the
positional scores of selected keys cost one product over the pool's distance rows. TRAMS is
training-free: it evaluates parameters trained as 'xl' (`runs_on`), with
`--config.eval.model.memory=trams`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from memjax.model.attention import Attended, KeyBlock
from memjax.model.config import KindFields, example
from memjax.model.memories import Problems, register
from memjax.model.memories.cached import CachedLayerMemory, CachedXLMemory

METRICS = ('paper', 'released')
POSITIONS = ('true', 'contiguous')


def attending(length: int) -> dict:
    """config.model fields under which TRAMS attends `length` memory rows as the released
    configuration's proportions do (150 kept of 200 attended): the newest 3/4 kept, the rest the
    best-ranked of a pool twice as long. How memjax.compare and memjax.recl set TRAMS for a length."""
    return {'mem_len': 2 * length, 'trams_select': length, 'trams_remain': 3 * length // 4}


@dataclasses.dataclass(frozen=True)
class TramsFields(KindFields):
    """config.model.trams_*: mem_len is the pool; each head attends trams_select of it, the newest
    trams_remain and the best-ranked older rows."""

    trams_select: int = 200
    trams_remain: int = 150
    trams_metric: str = 'paper'  # cos(K', 1) ||K'||; 'released': ||K'|| |sum K'| (the authors' code).
    trams_positions: str = 'true'  # Selected keys at their distances; 'contiguous': the authors' code.
    # Layers that select (0-based); (): all. Others keep the newest.
    trams_layers: tuple[int, ...] = example((), '(12, 13, 14, 15)')


def key_metric(keys: jax.Array, query_kernel: jax.Array, metric: str) -> jax.Array:
    """[B, N, H, Dh] keys, W_Q [d_model, H, Dh] -> [B, N, H] float32 rank of each row per head."""
    # A ranking: near-ties decide which rows are kept, so it is float32 at full precision under any
    # compute dtype (GPUs' default float32 product is TF32, 10-bit; the authors' PyTorch's is not).
    keys, query_kernel = keys.astype(jnp.float32), query_kernel.astype(jnp.float32)
    einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
    total = einsum('bnhk,hk->bnh', keys, query_kernel.sum(axis=0))  # sum_d K'_d
    if metric == 'paper':
        return total / jnp.sqrt(jnp.float32(query_kernel.shape[0]))
    gram = einsum('dhk,dhl->hkl', query_kernel, query_kernel)  # W_Q^T W_Q per head
    norm = jnp.sqrt(jnp.maximum(einsum('bnhk,hkl,bnhl->bnh', keys, gram, keys), 0.0))
    return norm * jnp.abs(total)


def select(rank: jax.Array, valid: jax.Array, picks: int) -> jax.Array:
    """[B, H, picks] int32 indices of the `picks` highest-ranked valid candidates per head, in time
    order (ascending). rank [B, C, H], valid [B, C]; invalid rows rank below every valid one."""
    rank = jnp.where(valid[:, :, None], rank, -jnp.inf).transpose(0, 2, 1)
    _, top = jax.lax.top_k(rank, picks)
    return jnp.sort(top, axis=-1).astype(jnp.int32)


def _per_head(x: jax.Array, index: jax.Array) -> jax.Array:
    """x [B, C, H, ...] rows at index [B, H, K] of each head -> [B, K, H, ...]."""
    index = index.transpose(0, 2, 1).reshape(index.shape[0], index.shape[2], index.shape[1],
                                              *(1,) * (x.ndim - 3))
    return jnp.take_along_axis(x, index, axis=1)


class TramsLayerMemory(CachedLayerMemory):
    """Ranks the pool's older rows per head, offers the selected keys and the kept window, and
    stores the segment's keys, values and metric."""

    def zero_row(self, maps):
        row = super().zero_row(maps)  # A zero row's key ranks as that key does.
        return {**row, 'rank': key_metric(row['keys'], maps.query_kernel, self.config.trams_metric)}

    def blocks(self, state, shared, layer_input, maps):
        cfg = self.config
        pool = self.pool(state, shared, maps)
        keys, values, rank = pool['keys'], pool['values'], pool['rank']
        size, seg_len = keys.shape[1], layer_input.shape[1]
        candidates = size - cfg.trams_remain
        picks = cfg.trams_select - cfg.trams_remain
        valid = shared['valid']
        window = KeyBlock(None, valid[:, None, None, candidates:], keys=keys[:, candidates:],
                          values=values[:, candidates:])
        if picks == 0:
            return [window]
        rank = rank[:, :candidates]
        if cfg.trams_layers:  # A layer that does not select keeps the newest rows: XL's memory.
            selects = jnp.isin(maps.index, jnp.asarray(cfg.trams_layers, jnp.int32))
            rank = jnp.where(selects, rank, jnp.arange(candidates, dtype=rank.dtype)[None, :, None])
        chosen = select(rank, valid[:, :candidates], picks)  # [B, H, picks]
        # Which rows each head read (pool index, 0 the oldest): apply with mutable=['intermediates'].
        self.sow('intermediates', 'selected', chosen)
        chosen_valid = jnp.take_along_axis(valid[:, None, :candidates], chosen, axis=-1)[:, :, None, :]
        distances = None
        if cfg.trams_positions == 'true':  # Pool row p sits size - p + i back from query i.
            distances = (size - chosen)[:, :, None, :] + jnp.arange(seg_len, dtype=jnp.int32)[None, None, :, None]
        return [KeyBlock(None, chosen_valid, distances, keys=_per_head(keys, chosen),
                         values=_per_head(values, chosen)), window]

    def attend(self, state, shared, view):
        attended = super().attend(state, shared, view)
        keys = attended.notes['keys']
        return Attended(notes={**attended.notes,
                               'rank': key_metric(keys, view.maps.query_kernel, self.config.trams_metric)})


@register
class TramsMemory(CachedXLMemory):
    """The pool of 'xl_cached' (layers.keys, .values; shared.valid, .fresh) and layers.rank
    [n_layer, B, mem_len, H] float32: each pool row's metric."""

    fields = TramsFields

    name = 'trams'
    layer = TramsLayerMemory
    run_time_fields = ('mem_len', 'memory_start', 'trams_select', 'trams_remain', 'trams_metric',
                       'trams_positions', 'trams_layers')

    def holds(self) -> str:
        cfg = self.config
        return f'a pool of {cfg.mem_len} tokens, {cfg.trams_select} attended ({cfg.trams_remain} newest kept)'

    @classmethod
    def validate(cls, config):
        problems = Problems()
        need = problems.need

        need(config.trams_metric in METRICS, f'trams_metric={config.trams_metric!r} must be one of {METRICS}.')
        need(config.trams_positions in POSITIONS,
             f'trams_positions={config.trams_positions!r} must be one of {POSITIONS}.')
        need(0 <= config.trams_remain <= config.trams_select,
             f'trams_remain={config.trams_remain} must be in [0, trams_select={config.trams_select}].')
        need(config.trams_select <= config.mem_len,
             f'trams_select={config.trams_select} exceeds the pool (mem_len={config.mem_len}): raise mem_len '
             '(TRAMS selects from a larger memory than it attends) or lower trams_select.')
        need(config.trams_select >= 1, f'trams_select={config.trams_select} must be >= 1.')
        bad = [layer for layer in config.trams_layers if not 0 <= layer < config.n_layer]
        need(not bad, f'trams_layers {bad} are not layers of a {config.n_layer}-layer model (0-based).')
        return problems

    def init(self, batch_size):
        state = super().init(batch_size)
        cfg = self.config
        rank = jnp.zeros((cfg.n_layer, batch_size, cfg.mem_len, cfg.n_head), jnp.float32)
        return state.replace(layers={**state.layers, 'rank': rank})

    def logical_axes(self):
        axes = super().logical_axes()
        return axes.replace(layers={**axes.layers, 'rank': P(None, 'activation_batch', 'activation_length',
                                                             'activation_heads')})

    def position_rows(self, seg_len):
        cfg = self.config
        return (cfg.mem_len if cfg.trams_positions == 'true' else cfg.trams_select) + seg_len

    @property
    def window(self):
        return self.config.trams_select

    def longest_distance(self, seg_len):
        # A ranked key at its true distance may be any row of the pool: the oldest is mem_len + i
        # back from query i. With same_length, query i sees only the selection's slots after its
        # i-th, and slot j holds a pool row no older than row j: a second ranked slot (j = 1) still
        # reaches mem_len - 1 back, a single one is never in sight. Otherwise (nothing ranked, or
        # contiguous positions) the keys lie within the selection's window, as XL's memory of
        # trams_select rows.
        cfg = self.config
        ranked = cfg.trams_select - cfg.trams_remain
        if cfg.trams_positions == 'true' and ranked and not cfg.same_length:
            return cfg.mem_len + seg_len - 1
        if cfg.trams_positions == 'true' and ranked > 1:
            return cfg.mem_len - 1
        longest = cfg.trams_select + seg_len - 1
        return min(longest, cfg.trams_select - 1) if cfg.same_length else longest
