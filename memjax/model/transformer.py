"""The Transformer-XL language model: embeddings, a stack of memory layers, adaptive softmax.

`apply(variables, tokens, memory, ...) -> (ModelOutput, new_memory)`: the memory goes in and comes
back out as an explicit pytree, so a sequence of segments is a `jax.lax.scan` with the memory as
carry. With `mem_len = 0` this is the Transformer + relative-position baseline.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from memjax.model.adaptive import AdaptiveIO
from memjax.model.config import ModelConfig
from memjax.model.layers import DecoderLayer
from memjax.model.memory import Memory
from memjax.model.relative import attention_mask, key_distances, sinusoid_encoding


@struct.dataclass
class ModelOutput:
    hidden: jax.Array  # [B, T, d_model] final hidden states, input of the softmax.
    target_logprobs: Optional[jax.Array] = None  # [B, T] float32 log p(target); None without targets.


class TransformerXL(nn.Module):
    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.io = AdaptiveIO(cfg)
        if not cfg.untie_r:
            init = nn.initializers.normal(cfg.init_std)
            self.u_bias = self.param('u_bias', init, (cfg.n_head, cfg.d_head))
            self.v_bias = self.param('v_bias', init, (cfg.n_head, cfg.d_head))
        self.layers = [DecoderLayer(cfg, name=f'layer_{i}') for i in range(cfg.n_layer)]
        self.dropout = nn.Dropout(cfg.dropout)

    def __call__(self, tokens: jax.Array, memory: Memory, targets: Optional[jax.Array] = None,
                 reset: Optional[jax.Array] = None, deterministic: bool = True):
        """tokens, targets: [B, T] int32; reset: [B] bool, clears those rows' memory first."""
        cfg = self.config
        if memory.length != cfg.mem_len:
            raise ValueError(f'memory holds {memory.length} positions but config.mem_len={cfg.mem_len}; '
                             'build it with init_memory(config, batch_size).')
        if reset is not None:
            memory = memory.reset(reset, start_valid=cfg.memory_start == 'zeros')
        qlen = tokens.shape[1]
        h = self.dropout(self.io.embed(tokens), deterministic=deterministic)
        pos_enc = sinusoid_encoding(key_distances(memory.length + qlen, cfg.clamp_len), cfg.d_model)
        pos_enc = self.dropout(pos_enc, deterministic=deterministic)
        mask = attention_mask(memory.valid, qlen, cfg.same_length, cfg.mem_len)
        u_bias = v_bias = None
        if not cfg.untie_r:
            u_bias, v_bias = self.u_bias, self.v_bias

        layer_inputs = []
        for i, layer in enumerate(self.layers):
            layer_inputs.append(h)
            h = layer(h, memory.hidden[i], mask, pos_enc, u_bias, v_bias, deterministic)
        h = self.dropout(h, deterministic=deterministic)

        new_memory = memory.push(jnp.stack(layer_inputs))
        logprobs = None if targets is None else self.io.target_logprobs(h, targets)
        return ModelOutput(hidden=h, target_logprobs=logprobs), new_memory

    def logprobs(self, hidden: jax.Array) -> jax.Array:
        """Full-vocabulary log-probabilities from `ModelOutput.hidden`; use with `method=`."""
        return self.io.logprobs(hidden)


def lm_loss(target_logprobs: jax.Array, mask: Optional[jax.Array] = None) -> jax.Array:
    """Mean negative log-likelihood in nats over the positions where mask is 1."""
    nll = -target_logprobs.astype(jnp.float32)
    if mask is None:
        return nll.mean()
    mask = mask.astype(jnp.float32)
    return (nll * mask).sum() / jnp.maximum(mask.sum(), 1.0)
