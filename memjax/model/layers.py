"""One memory-transformer layer: relative multi-head attention over [memory, segment] + feed-forward.

Every memory method in memjax is this layer with a different memory or attention policy; the
pieces here (projections, the four-term relative score, LayerNorm placement) exist only once.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from memjax.model.config import ModelConfig
from memjax.model.relative import position_scores, rel_shift


# Logical axis names; memjax.sharding maps them onto mesh axes.
BTE = ('activation_batch', 'activation_length', 'activation_embed')
BTHK = ('activation_batch', 'activation_length', 'activation_heads', 'activation_kv')


def normal(std: float, axes: tuple):
    return nn.with_logical_partitioning(nn.initializers.normal(std), axes)


def layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
    # The reference initialises the LayerNorm gain from N(1, init_std), not to exactly 1.
    def gain_init(key, shape, dtype=jnp.float32):
        return 1.0 + cfg.init_std * jax.random.normal(key, shape, dtype)

    return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, dtype=cfg.dtype, name=name,
                        scale_init=nn.with_logical_partitioning(gain_init, ('norm',)),
                        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('norm',)))


class Projection(nn.Module):
    """Bias-free linear map over the last `in_dims` axes into `features`.

    Unlike nn.DenseGeneral, the kernel is created in its unflattened [in..., out...] shape, so its
    logical axis names (one per kernel axis) stay valid when the model is traced under a mesh.
    """

    features: tuple
    axes: tuple
    config: ModelConfig
    in_dims: int = 1

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        shape = x.shape[x.ndim - self.in_dims:] + tuple(self.features)
        kernel = self.param('kernel', normal(cfg.init_std, self.axes), shape)
        return jnp.tensordot(x.astype(cfg.dtype), kernel.astype(cfg.dtype), axes=self.in_dims)


def _projection(cfg: ModelConfig, features, name: str, axes: tuple, in_dims: int = 1) -> Projection:
    features = features if isinstance(features, tuple) else (features,)
    return Projection(features, axes, cfg, in_dims, name=name)


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
        return jnp.where(keep, x / jnp.asarray(1.0 - self.rate, x.dtype), jnp.zeros_like(x))


def _dropout_residual_norm(cfg: ModelConfig, h, branch, deterministic: bool):
    """Closes a sub-block: dropout on the branch, residual add, LayerNorm when post-LN."""
    out = h + Dropout(cfg.dropout)(branch, deterministic=deterministic)
    return out if cfg.pre_lnorm else layer_norm(cfg, 'layer_norm')(out)


class RelativeAttention(nn.Module):
    """Transformer-XL attention: scores (a)+(c) = (q + u).k and (b)+(d) = rel_shift((q + v).W_r R).

    The positional term is computed once per distance row (K rows), never per query-key pair.
    """

    config: ModelConfig

    @nn.compact
    def __call__(self, h, mem, mask, pos_enc, u_bias, v_bias, deterministic: bool):
        cfg = self.config
        heads = (cfg.n_head, cfg.d_head)
        in_axes = ('embed', 'heads', 'kv')
        constrain = lambda x: nn.with_logical_constraint(x, BTHK)
        norm = layer_norm(cfg, 'layer_norm') if cfg.pre_lnorm else (lambda x: x)
        memory, segment = norm(mem.astype(h.dtype)), norm(h)
        query = constrain(_projection(cfg, heads, 'query', in_axes)(segment))  # [B, T, H, Dh]
        # Memory rows are projected apart from the segment's: they carry no gradient, and one
        # projection of [memory; segment] makes the backward compute (and then drop) their input
        # gradient, ~4% of a step's matmul FLOPs.
        key_proj = _projection(cfg, heads, 'key', in_axes)
        value_proj = _projection(cfg, heads, 'value', in_axes)
        key = constrain(jnp.concatenate([key_proj(memory), key_proj(segment)], axis=1))  # [B, K, H, Dh]
        value = constrain(jnp.concatenate([value_proj(memory), value_proj(segment)], axis=1))
        pos_key = _projection(cfg, heads, 'pos', in_axes)(pos_enc.astype(cfg.dtype))  # [K, H, Dh]

        content = jnp.einsum('bthd,bkhd->bhtk', query + u_bias.astype(cfg.dtype), key,
                             preferred_element_type=jnp.float32)
        position = position_scores(query + v_bias.astype(cfg.dtype), pos_key)
        scores = (content + rel_shift(position)) * (cfg.d_head ** -0.5)
        scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = Dropout(cfg.dropatt)(probs, deterministic=deterministic).astype(cfg.dtype)
        attended = jnp.einsum('bhtk,bkhd->bthd', probs, value)
        out = _projection(cfg, cfg.d_model, 'out', ('heads', 'kv', 'embed'), in_dims=2)(attended)
        return _dropout_residual_norm(cfg, h, out, deterministic)


class FeedForward(nn.Module):
    """Linear -> ReLU -> dropout -> Linear -> dropout, with a residual and LayerNorm (pre or post)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, h, deterministic: bool):
        cfg = self.config
        def dense(features, name, axes):
            return nn.Dense(features, dtype=cfg.dtype, name=name, kernel_init=normal(cfg.init_std, axes),
                            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]))

        x = layer_norm(cfg, 'layer_norm')(h) if cfg.pre_lnorm else h
        x = nn.relu(dense(cfg.d_inner, 'inner', ('embed', 'mlp'))(x))
        x = nn.with_logical_constraint(x, ('activation_batch', 'activation_length', 'activation_mlp'))
        x = Dropout(cfg.dropout)(x, deterministic=deterministic)
        return _dropout_residual_norm(cfg, h, dense(cfg.d_model, 'outer', ('mlp', 'embed'))(x), deterministic)


class DecoderLayer(nn.Module):
    """Attention then feed-forward. Returns (output, memory entry): what this layer's memory keeps
    of the segment (here its input), so the layer stack can be a plain loop or an nn.scan."""

    config: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, h, mem, mask, pos_enc, u_bias, v_bias):
        cfg = self.config
        if cfg.untie_r:
            u_bias = self.param('u_bias', normal(cfg.init_std, ('heads', 'kv')), (cfg.n_head, cfg.d_head))
            v_bias = self.param('v_bias', normal(cfg.init_std, ('heads', 'kv')), (cfg.n_head, cfg.d_head))
        out = RelativeAttention(cfg, name='attention')(h, mem, mask, pos_enc, u_bias, v_bias, self.deterministic)
        out = FeedForward(cfg, name='feed_forward')(out, self.deterministic)
        return nn.with_logical_constraint(out, BTE), h


_REMAT_POLICIES = {'full': None, 'dots_saveable': jax.checkpoint_policies.dots_saveable}


def layer_stack(cfg: ModelConfig, deterministic: bool):
    """The n_layer decoder layers as one callable `(h, memories, mask, pos_enc, u, v) -> (h, inputs)`.

    memories / inputs are stacked over layers [n_layer, ...]. With `scan_layers` the layers are one
    nn.scan (params stacked under 'layers'); otherwise a Python loop over 'layer_{i}'.
    """
    layer_cls = DecoderLayer
    if cfg.remat != 'none':
        layer_cls = nn.remat(DecoderLayer, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
        scanned = nn.scan(layer_cls, variable_axes={'params': 0}, split_rngs={'params': True, 'dropout': True},
                          in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                          length=cfg.n_layer, metadata_params={nn.PARTITION_NAME: 'layers'})
        return scanned(cfg, deterministic, name='layers')
    layers = [layer_cls(cfg, deterministic, name=f'layer_{i}') for i in range(cfg.n_layer)]

    def loop(h, memories, mask, pos_enc, u_bias, v_bias):
        inputs = []
        for i, layer in enumerate(layers):
            h, entry = layer(h, memories[i], mask, pos_enc, u_bias, v_bias)
            inputs.append(entry)
        return h, jnp.stack(inputs)

    return loop
