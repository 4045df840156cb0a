"""Segment memory as explicit state: fixed-shape buffers plus a validity mask.

Fixed shapes keep one compiled step for every segment, including the first: an empty memory is a
buffer whose positions are all marked invalid (and therefore masked out of attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from memjax.model.config import ModelConfig


@struct.dataclass
class Memory:
    """Per-layer hidden states of the last `mem_len` positions.

    hidden: [n_layer, batch, mem_len, d_model], the *inputs* of each layer (layer 0: embeddings).
    valid:  [batch, mem_len] bool; False positions are never attended.
    """

    hidden: jax.Array
    valid: jax.Array

    @property
    def length(self) -> int:
        return self.hidden.shape[2]

    def reset(self, rows: jax.Array, start_valid: bool) -> Memory:
        """Clears the memory of the batch rows where `rows` [batch] is True (a new document)."""
        hidden = jnp.where(rows[None, :, None, None], jnp.zeros_like(self.hidden), self.hidden)
        valid = jnp.where(rows[:, None], start_valid, self.valid)
        return Memory(hidden=hidden, valid=valid)

    def push(self, layer_inputs: jax.Array) -> Memory:
        """FIFO update: appends this segment's layer inputs [n_layer, batch, T, d] and keeps the last
        `mem_len` positions. Gradients never flow into the past segment."""
        m = self.length
        if m == 0:
            return self
        seg_len = layer_inputs.shape[2]
        hidden = jnp.concatenate([self.hidden, layer_inputs.astype(self.hidden.dtype)], axis=2)[:, :, -m:]
        valid = jnp.concatenate([self.valid, jnp.ones(self.valid.shape[:1] + (seg_len,), bool)], axis=1)
        return Memory(hidden=jax.lax.stop_gradient(hidden), valid=valid[:, -m:])


def init_memory(config: ModelConfig, batch_size: int) -> Memory:
    """The memory before the first segment: empty (masked) or HF-style zeros (attended)."""
    shape = (config.n_layer, batch_size, config.mem_len, config.d_model)
    return Memory(
        hidden=jnp.zeros(shape, config.dtype),
        valid=jnp.full((batch_size, config.mem_len), config.memory_start == 'zeros'),
    )
