"""Building blocks every memory kind shares: initialisers, LayerNorm, projections, dropout.

Logical axis names are given here once; memjax.runtime.sharding maps them onto mesh axes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from memjax.kernels import cpu as cpu_kernels
from memjax.model.config import ModelConfig, add_check

BTE = ('activation_batch', 'activation_length', 'activation_embed')
BTHK = ('activation_batch', 'activation_length', 'activation_heads', 'activation_kv')


@dataclasses.dataclass(frozen=True)
class BlockStyle:
    """What a block style (config.model.block) changes in the shared layer code."""

    activation: Callable  # of the feed-forward's inner layer
    bias: bool  # the attention's query/key/value/output maps have biases
    final_norm: bool  # a LayerNorm after the last layer (pre-LN models need one)
    embed_scale: bool  # token embeddings multiplied by sqrt(d_model)


# config.model.block -> its style. 'gpt2' is GPT-2's block (with pre_lnorm=True): biased maps,
# GELU in its tanh form (HF's gelu_new), a final LayerNorm, unscaled embeddings.
BLOCKS = {
    'xl': BlockStyle(nn.relu, bias=False, final_norm=False, embed_scale=True),
    'gpt2': BlockStyle(functools.partial(nn.gelu, approximate=True), bias=True, final_norm=True,
                       embed_scale=False),
}


@add_check
def _known_block(cfg: ModelConfig) -> list[str]:
    if cfg.block not in BLOCKS:
        return [f'block={cfg.block!r} must be one of {tuple(BLOCKS)}.']
    if BLOCKS[cfg.block].final_norm and not cfg.pre_lnorm:
        return [f'block={cfg.block!r} normalises before each sub-block: set pre_lnorm=True.']
    return []


def normal(std: float, axes: tuple):
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


def param(module: nn.Module, name: str, init: Callable, shape: tuple, *init_args) -> jax.Array:
    """`module.param(name, init, shape, *init_args)`, checking a given parameter's shape against
    `shape` itself.

    Flax checks a parameter that the caller gave (every `apply`) by tracing its initializer again
    under `jax.eval_shape`: a Threefry draw per parameter, about a tenth of the time JAX takes to
    trace and lower a small model's train and eval steps, paid again in every compilation. The shape
    is all it compares, and here it is known. Initialising goes through Flax's own `param`."""
    if not module.has_variable('params', name):
        return nn.Module.param(module, name, init, shape, *init_args)
    value = nn.meta.unbox(module.get_variable('params', name))
    if np.shape(value) != tuple(shape):
        raise flax.errors.ScopeParamShapeError(name, module.scope.path_text, np.shape(value), tuple(shape))
    return value


class LayerNorm(nn.LayerNorm):
    """Flax's LayerNorm, its scale and bias declared through `param` above: Flax's LayerNorm would
    trace its gain's initializer (a Threefry draw) again at every apply."""

    @nn.nowrap
    def param(self, name: str, init_fn: Callable, *init_args) -> jax.Array:
        return param(self, name, init_fn, *init_args)


def layer_norm(cfg: ModelConfig, name: str) -> LayerNorm:
    # The reference initialises the LayerNorm gain from N(1, init_std), not to exactly 1.
    def gain_init(key, shape, dtype=jnp.float32):
        return 1.0 + cfg.init_std * jax.random.normal(key, shape, dtype)

    # dtype is the output's only: flax takes the mean and variance, and normalises, in float32 (a
    # bf16 variance of activations near each other cancels to zero), then rounds the result. Under
    # such a lower compute dtype, those float32 intermediates ([tokens, d_model] each) are recomputed
    # in the backward pass from the input, which is in the compute dtype, rather than kept for it.
    # (No CSE barrier inside a scanned stack: the scan keeps the recomputation apart already.)
    norm = LayerNorm if cfg.dtype == jnp.float32 else nn.remat(LayerNorm, prevent_cse=not cfg.scan_layers)
    return norm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, name=name,
                scale_init=nn.with_logical_partitioning(gain_init, ('norm',)),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('norm',)))


class Projection(nn.Module):
    """Linear map over the last `in_dims` axes into `features` (bias-free unless `bias`).

    The kernel is created in its unflattened [in..., out...] shape (not flattened to 2-D), so
    its logical axis names (one per kernel axis) stay valid when the model is traced under a mesh.
    """

    features: tuple
    axes: tuple
    config: ModelConfig
    in_dims: int = 1
    bias: bool = False

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        shape = x.shape[x.ndim - self.in_dims:] + tuple(self.features)
        kernel = param(self, 'kernel', normal(cfg.init_std, self.axes), shape)
        out = cpu_kernels.linear(x.astype(cfg.dtype), kernel.astype(cfg.dtype), self.in_dims)
        if self.bias:
            bias_init = nn.with_logical_partitioning(nn.initializers.zeros, self.axes[self.in_dims:])
            out = out + param(self, 'bias', bias_init, tuple(self.features)).astype(cfg.dtype)
        return out


def projection(cfg: ModelConfig, features, name: str, axes: tuple, in_dims: int = 1,
               bias: bool = False) -> Projection:
    features = features if isinstance(features, tuple) else (features,)
    return Projection(features, axes, cfg, in_dims, bias, name=name)


class Dropout(nn.Module):
    """nn.Dropout with its random bits drawn by XLA's RngBitGenerator (Threefry) instead of jax.random.

    Same distribution: each element is kept with probability 1 - rate (to 2^-32) and scaled by
    1 / (1 - rate). Why: on CPU, jax.random's Threefry lowers to element-wise HLO that costs about
    three times XLA's native generator, and the masks were ~10% of a training step. The generator
    is seeded from the flax 'dropout' stream, so a step's masks still follow from its key (exact
    resumes); the bits differ from nn.Dropout's.
    """

    rate: float

    @nn.compact
    def __call__(self, x, deterministic: bool):
        if self.rate == 0.0 or deterministic:
            return x
        seed = jax.random.bits(self.make_rng('dropout'), (4,), jnp.uint32)
        _, bits = jax.lax.rng_bit_generator(seed, x.shape, jnp.uint32,
                                            algorithm=jax.lax.RandomAlgorithm.RNG_THREE_FRY)
        keep = bits >= np.uint32(min(round(self.rate * 2.0 ** 32), 2 ** 32 - 1))
        # Scaled in float32: 1 - rate rounded to bf16 (0.8 -> 0.80078) would shrink every kept value.
        return jnp.where(keep, (x.astype(jnp.float32) / np.float32(1.0 - self.rate)).astype(x.dtype), jnp.zeros_like(x))
