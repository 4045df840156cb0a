"""Transformer-XL's memory: a FIFO of each layer's inputs over the last `mem_len` positions.

Fixed shapes keep one compiled step for every segment, including the first: an empty memory is a
buffer whose positions are all marked invalid (and therefore never attended).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from memjax.model import stochastic
from memjax.model.attention import KeyBlock
from memjax.model.memories import LayerMemory, MemoryKind, MemoryState, register


def _shift_in(valid: jax.Array, seg_len: int) -> jax.Array:
    """[B, M] validity after a segment of seg_len positions (all valid) arrived."""
    return jnp.concatenate([valid, jnp.ones((valid.shape[0], seg_len), bool)], axis=1)[:, seg_len:]


class XLLayerMemory(LayerMemory):
    """Offers the kept inputs as one block right before the segment; keeps the newest mem_len.

    With Skip-Retain the layer has its own validity and an age: the positions by which its memory
    lags the segment (one segment per step it was skipped), so its keys sit that much further back.
    """

    def blocks(self, state, shared, layer_input, maps):
        if 'age' in state:
            return [KeyBlock(rows=state['hidden'], valid=state['valid'][:, None, None, :], offset=state['age'])]
        return [KeyBlock(rows=state['hidden'], valid=shared['valid'][:, None, None, :])]

    def write(self, state, shared, layer_input, notes):
        keep = state['hidden'].shape[1]
        if keep == 0:
            return state, {}
        hidden = jnp.concatenate([state['hidden'], layer_input.astype(state['hidden'].dtype)], axis=1)
        # Gradients never flow into a past segment.
        written = {'hidden': jax.lax.stop_gradient(hidden[:, -keep:])}
        if 'age' in state:
            # After a skip the kept rows lag `age` positions behind the segment and the segment's own
            # rows do not; one offset describes one contiguous block, so rows from before the gap
            # (some survive when mem_len > the segment) are masked rather than put at the wrong distance.
            kept = state['valid'] & (state['age'] == 0)
            written.update(valid=_shift_in(kept, layer_input.shape[1]), age=jnp.zeros_like(state['age']))
        return written, {}

    def skipped(self, state, shared, layer_input):
        if 'age' not in state:
            return state
        return {**state, 'age': state['age'] + layer_input.shape[1]}


@register
class XLMemory(MemoryKind):
    """layers.hidden [n_layer, B, mem_len, d_model]: the inputs of each layer (layer 0: embeddings).
    shared.valid [B, mem_len]: False positions are never attended."""

    name = 'xl'
    layer = XLLayerMemory
    run_time_fields = ('mem_len', 'memory_start')
    skip_retain = True
    cross_head = True
    # Evaluation keeps the keys and values it projected instead of the inputs (memories/cached.py).
    evaluated_by = 'xl_cached'

    @classmethod
    def validate(cls, config):
        return []

    @property
    def ages(self) -> bool:
        """Whether layers may be skipped in training, so each keeps its own validity and age."""
        return type(self).skip_retain and stochastic.skipping(self.config) and self.config.mem_len > 0

    def init(self, batch_size):
        cfg = self.config
        # 'zeros' attends mem_len zero vectors before the first segment, as HF / TF
        # Transformer-XL do (numerical parity with them); 'empty' masks them.
        valid = jnp.full((batch_size, cfg.mem_len), cfg.memory_start == 'zeros')
        layers = {'hidden': jnp.zeros((cfg.n_layer, batch_size, cfg.mem_len, cfg.d_model), cfg.dtype)}
        if self.ages:
            layers.update(valid=jnp.broadcast_to(valid, (cfg.n_layer,) + valid.shape),
                          age=jnp.zeros((cfg.n_layer,), jnp.int32))
        return MemoryState(layers=layers, shared={'valid': valid})

    def logical_axes(self):
        # Batch-major like the activations the memory holds.
        layers = {'hidden': P(None, 'activation_batch', 'activation_length', 'activation_embed')}
        if self.ages:  # One age per layer: the skip decision is the same for every stream.
            layers.update(valid=P(None, 'activation_batch', 'activation_length'), age=P(None))
        return MemoryState(layers=layers, shared={'valid': P('activation_batch', 'activation_length')})

    def advance(self, shared, embedded):
        return {'valid': _shift_in(shared['valid'], embedded.shape[1])}

    def position_rows(self, seg_len):
        return self.config.mem_len + seg_len
