"""Learning-rate schedule and optimizer of the Transformer-XL recipe."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import optax


def learning_rate_schedule(train_cfg: ml_collections.ConfigDict) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then cosine decay to `min_lr_ratio * learning_rate`.

    `step` counts updates already applied, so the first update uses lr / warmup_steps rather
    than a wasted zero; the decay spans the remaining `num_steps - warmup_steps` updates.
    """
    peak = train_cfg.learning_rate
    warmup = train_cfg.warmup_steps
    decay_steps = max(1, train_cfg.num_steps - warmup)
    floor = train_cfg.min_lr_ratio

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * (step + 1.0) / max(1, warmup)
        progress = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        cosine = peak * (floor + (1.0 - floor) * 0.5 * (1.0 + jnp.cos(math.pi * progress)))
        return jnp.where(step < warmup, warm, cosine)

    return schedule


def _decay_mask(params):
    # Biases, LayerNorm scales and the attention biases u, v are vectors: no decay for them.
    return jax.tree_util.tree_map(lambda p: p.ndim > 1, params)


def make_optimizer(train_cfg: ml_collections.ConfigDict) -> optax.GradientTransformation:
    """Global-norm clipping, Adam, optional decoupled weight decay, scheduled step size."""
    parts = []
    if train_cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(train_cfg.clip_norm))
    parts.append(optax.scale_by_adam(b1=train_cfg.b1, b2=train_cfg.b2, eps=train_cfg.eps))
    if train_cfg.weight_decay > 0:
        parts.append(optax.add_decayed_weights(train_cfg.weight_decay, mask=_decay_mask))
    parts.append(optax.scale_by_learning_rate(learning_rate_schedule(train_cfg)))
    return optax.chain(*parts)
