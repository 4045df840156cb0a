"""Transformer-XL's memory as evaluation keeps it: each layer's keys and values, as projected.

An XL memory holds each layer's inputs and projects all `mem_len` of them with the layer's key
and value maps again every segment. In evaluation the weights do not change, so a memory
position's key and value are the ones its layer computed when the position was the segment:
this kind keeps those instead (a pool), and no memory row is projected again. The scores are
the same numbers as 'xl' (tested); at the peer shape (tgt = mem = 128) an evaluation step is
4-7 % faster (docs/perf-notes.md), for a state of 2 x n_head x d_head floats per position and
layer instead of d_model.

Evaluation runs it for parameters trained as 'xl' unless `config.eval.model.memory` names
another kind ('xl' re-projects, as training does). Training cannot use it: there the weights
change every step and the memory's keys carry W_K's and W_V's gradient. TRAMS selects from the
same pool (memories/trams.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from memjax.model.attention import Attended, KeyBlock
from memjax.model.memories import LayerMemory, MemoryKind, MemoryState, register
from memjax.model.primitives import BLOCKS


class CachedLayerMemory(LayerMemory):
    """Offers the pool's keys and values as one block right before the segment; keeps the
    segment's, as the attention projected them, for the next one."""

    def zero_row(self, maps) -> dict:
        """Each pool leaf's value for a zero input row: [1, 1, ...] per leaf."""
        zero = jnp.zeros((1, 1, self.config.d_model), self.config.dtype)
        return {'keys': maps.key(zero), 'values': maps.value(zero)}

    def pool(self, state, shared, maps) -> dict:
        """The layer's pool, rows never written replaced by a zero input's (`zero_row`) when the
        memory starts as zeros (XL attends mem_len zero vectors before the first segment).

        Maps without biases and without a LayerNorm before them take a zero row to zeros, what the
        pool starts as (TRAMS's rank of a zero key too): then nothing is replaced, and no step
        copies the pool to find out (2 % of an evaluation step at the peer shape)."""
        cfg = self.config
        if cfg.memory_start != 'zeros' or not (cfg.pre_lnorm or BLOCKS[cfg.block].bias):
            return state
        fresh, zero = shared['fresh'], self.zero_row(maps)  # fresh [B, M]; leaves [B, M, ...]
        at_fresh = lambda leaf: fresh.reshape(fresh.shape + (1,) * (leaf.ndim - 2))
        return {name: jnp.where(at_fresh(leaf), zero[name].astype(leaf.dtype), leaf) for name, leaf in state.items()}

    def blocks(self, state, shared, layer_input, maps):
        pool = self.pool(state, shared, maps)
        return [KeyBlock(None, shared['valid'][:, None, None, :], keys=pool['keys'], values=pool['values'])]

    def attend(self, state, shared, view):
        seg_len = view.query.shape[1]
        return Attended(notes={'keys': view.key[:, -seg_len:], 'values': view.value[:, -seg_len:]})

    def write(self, state, shared, layer_input, notes):
        pool = state['keys'].shape[1]
        if pool == 0:
            return state, {}
        written = {name: jnp.concatenate([state[name], notes[name].astype(state[name].dtype)], axis=1)[:, -pool:]
                   for name in state}
        return jax.lax.stop_gradient(written), {}


@register
class CachedXLMemory(MemoryKind):
    """layers.keys, .values [n_layer, B, mem_len, H, d_head]: the memory as each layer projected it.
    shared.valid [B, mem_len]: positions that may be attended; shared.fresh [B, mem_len]: never
    written (zero rows with memory_start='zeros')."""

    name = 'xl_cached'
    layer = CachedLayerMemory
    run_time_fields = ('mem_len', 'memory_start')
    runs_on = ('xl',)
    trainable = False

    @classmethod
    def validate(cls, config):
        return []

    def init(self, batch_size):
        cfg = self.config
        rows = (cfg.n_layer, batch_size, cfg.mem_len, cfg.n_head, cfg.d_head)
        return MemoryState(
            layers={'keys': jnp.zeros(rows, cfg.dtype), 'values': jnp.zeros(rows, cfg.dtype)},
            shared={'valid': jnp.full((batch_size, cfg.mem_len), cfg.memory_start == 'zeros'),
                    'fresh': jnp.ones((batch_size, cfg.mem_len), bool)})

    def logical_axes(self):
        rows = P(None, 'activation_batch', 'activation_length', 'activation_heads', 'activation_kv')
        return MemoryState(layers={'keys': rows, 'values': rows},
                           shared={name: P('activation_batch', 'activation_length') for name in ('valid', 'fresh')})

    def advance(self, shared, embedded):
        batch, seg_len = embedded.shape[:2]
        pool = shared['valid'].shape[1]
        if pool == 0:
            return shared
        shift = lambda x, new: jnp.concatenate([x, jnp.full((batch, seg_len), new)], axis=1)[:, -pool:]
        return {'valid': shift(shared['valid'], True), 'fresh': shift(shared['fresh'], False)}

    def position_rows(self, seg_len):
        return self.config.mem_len + seg_len
