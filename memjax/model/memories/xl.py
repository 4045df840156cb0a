"""Transformer-XL's memory: a FIFO of each layer's inputs over the last `mem_len` positions.

Fixed shapes keep one compiled step for every segment, including the first: an empty memory is a
buffer whose positions are all marked invalid (and therefore never attended).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from memjax.model.attention import KeyBlock
from memjax.model.memories import LayerMemory, MemoryKind, MemoryState, register


class XLLayerMemory(LayerMemory):
    """Offers the kept inputs as one block right before the segment; keeps the newest mem_len."""

    def blocks(self, state, shared, layer_input, maps):
        return [KeyBlock(rows=state['hidden'], valid=shared['valid'][:, None, None, :])]

    def write(self, state, shared, layer_input, notes):
        keep = state['hidden'].shape[1]
        if keep == 0:
            return state, {}
        hidden = jnp.concatenate([state['hidden'], layer_input.astype(state['hidden'].dtype)], axis=1)
        # Gradients never flow into a past segment.
        return {'hidden': jax.lax.stop_gradient(hidden[:, -keep:])}, {}


@register
class XLMemory(MemoryKind):
    """layers.hidden [n_layer, B, mem_len, d_model]: the inputs of each layer (layer 0: embeddings).
    shared.valid [B, mem_len]: False positions are never attended."""

    name = 'xl'
    layer = XLLayerMemory
    run_time_fields = ('mem_len', 'memory_start')

    @classmethod
    def validate(cls, config):
        return []

    def init(self, batch_size):
        cfg = self.config
        return MemoryState(
            layers={'hidden': jnp.zeros((cfg.n_layer, batch_size, cfg.mem_len, cfg.d_model), cfg.dtype)},
            # 'zeros' attends mem_len zero vectors before the first segment, as HF / TF
            # Transformer-XL do (numerical parity with them); 'empty' masks them.
            shared={'valid': jnp.full((batch_size, cfg.mem_len), cfg.memory_start == 'zeros')})

    def logical_axes(self):
        # Batch-major like the activations the memory holds.
        return MemoryState(
            layers={'hidden': P(None, 'activation_batch', 'activation_length', 'activation_embed')},
            shared={'valid': P('activation_batch', 'activation_length')})

    def advance(self, shared, embedded):
        seg_len = embedded.shape[1]
        valid = shared['valid']
        keep = valid.shape[1]
        valid = jnp.concatenate([valid, jnp.ones((valid.shape[0], seg_len), bool)], axis=1)
        return {'valid': valid[:, valid.shape[1] - keep:]}

    def position_rows(self, seg_len):
        return self.config.mem_len + seg_len
