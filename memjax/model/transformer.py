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
import numpy as np
from flax import struct
from jax.sharding import PartitionSpec as P

from memjax.model.adaptive import AdaptiveIO
from memjax.model.config import ModelConfig
from memjax.model.layers import BTE, Dropout, layer_stack, normal
from memjax.model.memory import Memory, init_memory
from memjax.model.relative import attention_mask, key_distances, sinusoid_encoding


@struct.dataclass
class ModelOutput:
    hidden: jax.Array  # [B, T, d_model] final hidden states, input of the softmax.
    target_logprobs: Optional[jax.Array] = None  # [B, T] float32 log p(target); None without targets.


def ids_in_range(ids: jax.Array, vocab_size: int) -> jax.Array:
    return (ids >= 0) & (ids < vocab_size)


def check_ids(ids: jax.Array, vocab_size: int, name: str) -> None:
    """Raises ValueError for ids outside [0, vocab_size) when they are concrete (eager calls).

    Under `jit` the ids are abstract: there, an out-of-range input makes the hidden states
    NaN and an out-of-range target its log-prob NaN (gathers would clamp them into a finite,
    wrong answer), so a training loop's non-finite check stops on them.
    """
    if isinstance(ids, jax.core.Tracer):
        return
    ids = np.asarray(ids)
    bad = ids[~((ids >= 0) & (ids < vocab_size))]
    if bad.size:
        raise ValueError(f'{bad.size} {name} ids lie outside [0, {vocab_size}) (e.g. '
                         f'{sorted(set(bad.tolist()))[:5]}): the ids come from another tokenizer '
                         'than the one config.vocab_size was set for.')


class TransformerXL(nn.Module):
    config: ModelConfig

    def setup(self):
        cfg = self.config
        self.io = AdaptiveIO(cfg)
        if not cfg.untie_r:
            self.u_bias = self.param('u_bias', normal(cfg.init_std, ('heads', 'kv')), (cfg.n_head, cfg.d_head))
            self.v_bias = self.param('v_bias', normal(cfg.init_std, ('heads', 'kv')), (cfg.n_head, cfg.d_head))
        self.dropout = Dropout(cfg.dropout)

    @nn.compact
    def __call__(self, tokens: jax.Array, memory: Memory, targets: Optional[jax.Array] = None,
                 reset: Optional[jax.Array] = None, deterministic: bool = True):
        """tokens, targets: [B, T] int32; reset: [B] bool, clears those rows' memory first."""
        cfg = self.config
        if memory.length != cfg.mem_len:
            raise ValueError(f'memory holds {memory.length} positions but config.mem_len={cfg.mem_len}; '
                             'build it with init_memory(config, batch_size).')
        if reset is not None:
            memory = memory.reset(reset, start_valid=cfg.memory_start == 'zeros')
        check_ids(tokens, cfg.vocab_size, 'tokens')
        qlen = tokens.shape[1]
        h = self.io.embed(tokens)
        h = jnp.where(ids_in_range(tokens, cfg.vocab_size)[..., None], h, jnp.nan)
        h = self.dropout(h, deterministic=deterministic)
        h = nn.with_logical_constraint(h, BTE)
        pos_enc = sinusoid_encoding(key_distances(memory.length + qlen, cfg.clamp_len), cfg.d_model)
        pos_enc = self.dropout(pos_enc, deterministic=deterministic)
        mask = attention_mask(memory.valid, qlen, cfg.same_length, cfg.mem_len)
        u_bias, v_bias = (None, None) if cfg.untie_r else (self.u_bias, self.v_bias)

        h, layer_inputs = layer_stack(cfg, deterministic)(h, memory.hidden, mask, pos_enc, u_bias, v_bias)
        h = self.dropout(h, deterministic=deterministic)

        new_memory = memory.push(layer_inputs)
        logprobs = None
        if targets is not None:
            check_ids(targets, cfg.vocab_size, 'targets')
            logprobs = jnp.where(ids_in_range(targets, cfg.vocab_size),
                                 self.io.target_logprobs(h, targets), jnp.nan)
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


def _abstract_variables(config: ModelConfig):
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: TransformerXL(config).init(jax.random.key(0), tokens, init_memory(config, 1)))


def init_params(config: ModelConfig, key: jax.Array) -> dict:
    """Float32 parameters as plain arrays (the logical-axis boxes stripped; see param_logical_axes)."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    variables = TransformerXL(config).init({'params': key}, tokens, init_memory(config, 1))
    return nn.meta.unbox(variables['params'])


def param_logical_axes(config: ModelConfig) -> dict:
    """PartitionSpecs of logical axis names ('embed', 'heads', ...) mirroring init_params' tree."""
    return nn.get_partition_spec(_abstract_variables(config))['params']


def memory_logical_axes(config: ModelConfig) -> Memory:
    """Logical axis names of the Memory pytree: batch-major like the activations it holds."""
    return Memory(hidden=P(None, 'activation_batch', 'activation_length', 'activation_embed'),
                  valid=P('activation_batch', 'activation_length'))


def convert_layer_layout(params: dict, scan_layers: bool) -> dict:
    """Re-lays parameters for `scan_layers`: 'layer_{i}' subtrees <-> one 'layers' subtree stacked
    on a leading axis. Parameters already in the requested layout come back unchanged."""
    params = dict(params)
    if scan_layers and 'layers' not in params:
        names = sorted((k for k in params if k.startswith('layer_')), key=lambda k: int(k[len('layer_'):]))
        params['layers'] = jax.tree.map(lambda *xs: jnp.stack(xs), *[params.pop(k) for k in names])
    elif not scan_layers and 'layers' in params:
        stacked = params.pop('layers')
        n_layer = jax.tree.leaves(stacked)[0].shape[0]
        for i in range(n_layer):
            params[f'layer_{i}'] = jax.tree.map(lambda x: x[i], stacked)
    return params
