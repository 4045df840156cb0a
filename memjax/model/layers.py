"""One memory-transformer layer: relative multi-head attention over [memory, segment] + feed-forward.

Every memory method in memjax is this layer with a different memory or attention policy; the
pieces here (projections, the four-term relative score, LayerNorm placement) exist only once.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from memjax.model.config import ModelConfig
from memjax.model.relative import rel_shift


def layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
    # The reference initialises the LayerNorm gain from N(1, init_std), not to exactly 1.
    def gain_init(key, shape, dtype=jnp.float32):
        return 1.0 + cfg.init_std * jax.random.normal(key, shape, dtype)

    return nn.LayerNorm(epsilon=cfg.layer_norm_epsilon, scale_init=gain_init, dtype=cfg.dtype, name=name)


def _projection(cfg: ModelConfig, features, name: str, axis=-1) -> nn.DenseGeneral:
    return nn.DenseGeneral(features, axis=axis, use_bias=False, dtype=cfg.dtype,
                           kernel_init=nn.initializers.normal(cfg.init_std), name=name)


def _dropout_residual_norm(cfg: ModelConfig, h, branch, deterministic: bool):
    """Closes a sub-block: dropout on the branch, residual add, LayerNorm when post-LN."""
    out = h + nn.Dropout(cfg.dropout)(branch, deterministic=deterministic)
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
        context = jnp.concatenate([mem.astype(h.dtype), h], axis=1)  # [B, K, D]
        if cfg.pre_lnorm:
            context = layer_norm(cfg, 'layer_norm')(context)
        query = _projection(cfg, heads, 'query')(context[:, mem.shape[1]:])  # [B, T, H, Dh]
        key = _projection(cfg, heads, 'key')(context)  # [B, K, H, Dh]
        value = _projection(cfg, heads, 'value')(context)
        pos_key = _projection(cfg, heads, 'pos')(pos_enc.astype(cfg.dtype))  # [K, H, Dh]

        content = jnp.einsum('bthd,bkhd->bhtk', query + u_bias.astype(cfg.dtype), key,
                             preferred_element_type=jnp.float32)
        position = jnp.einsum('bthd,khd->bhtk', query + v_bias.astype(cfg.dtype), pos_key,
                              preferred_element_type=jnp.float32)
        scores = (content + rel_shift(position)) * (cfg.d_head ** -0.5)
        scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = nn.Dropout(cfg.dropatt)(probs, deterministic=deterministic).astype(cfg.dtype)
        attended = jnp.einsum('bhtk,bkhd->bthd', probs, value)
        out = _projection(cfg, cfg.d_model, 'out', axis=(-2, -1))(attended)
        return _dropout_residual_norm(cfg, h, out, deterministic)


class FeedForward(nn.Module):
    """Linear -> ReLU -> dropout -> Linear -> dropout, with a residual and LayerNorm (pre or post)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, h, deterministic: bool):
        cfg = self.config
        dense = lambda features, name: nn.Dense(features, dtype=cfg.dtype, name=name,
                                                kernel_init=nn.initializers.normal(cfg.init_std))
        x = layer_norm(cfg, 'layer_norm')(h) if cfg.pre_lnorm else h
        x = nn.relu(dense(cfg.d_inner, 'inner')(x))
        x = nn.Dropout(cfg.dropout)(x, deterministic=deterministic)
        return _dropout_residual_norm(cfg, h, dense(cfg.d_model, 'outer')(x), deterministic)


class DecoderLayer(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, h, mem, mask, pos_enc, u_bias, v_bias, deterministic: bool):
        cfg = self.config
        if cfg.untie_r:
            init = nn.initializers.normal(cfg.init_std)
            u_bias = self.param('u_bias', init, (cfg.n_head, cfg.d_head))
            v_bias = self.param('v_bias', init, (cfg.n_head, cfg.d_head))
        h = RelativeAttention(cfg, name='attention')(h, mem, mask, pos_enc, u_bias, v_bias, deterministic)
        return FeedForward(cfg, name='feed_forward')(h, deterministic)
