"""Learning-rate schedule and optimizer of the Transformer-XL recipe."""

import math

import jax
import jax.numpy as jnp
import optax

from memjax import config_lib


def learning_rate_schedule(train_cfg: config_lib.TrainConfig, peak: float | None = None) -> optax.Schedule:
    """Linear warmup to `learning_rate`, then `decay` (cosine or linear) to `min_lr_ratio * learning_rate`.

    `step` counts updates already applied, so the first update uses lr / warmup_steps rather
    than a wasted zero; the decay spans the remaining `num_steps - warmup_steps` updates.
    """
    peak = train_cfg.learning_rate if peak is None else peak
    warmup = train_cfg.warmup_steps
    decay_steps = max(1, train_cfg.num_steps - warmup)
    floor = train_cfg.min_lr_ratio

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * (step + 1.0) / max(1, warmup)
        progress = jnp.clip((step - warmup) / decay_steps, 0.0, 1.0)
        remaining = 0.5 * (1.0 + jnp.cos(math.pi * progress)) if train_cfg.decay == 'cosine' else 1.0 - progress
        return jnp.where(step < warmup, warm, peak * (floor + (1.0 - floor) * remaining))

    return schedule


def _decay_mask(params):
    """Decoupled weight decay for the matrices only: not for biases and LayerNorm scales, nor the
    attention's u and v (`*_bias`, [n_head, d_head]), told by name; a layer stack scanned into
    params['layers'] adds a leading [n_layer] axis, which does not make a vector a matrix."""
    def decayed(path, p):
        names = [getattr(k, 'key', None) for k in path]
        if names[-1] in ('bias', 'scale') or str(names[-1]).endswith('_bias'):
            return False
        return p.ndim - ('layers' in names) > 1
    return jax.tree_util.tree_map_with_path(decayed, params)


def _memory_label(params):
    # A memory kind's own parameters live under a 'memory' module in every layer.
    return jax.tree_util.tree_map_with_path(
        lambda path, _: 'memory' if any(getattr(k, 'key', None) == 'memory' for k in path) else 'model', params)


def make_optimizer(train_cfg: config_lib.TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, Adam, optional decoupled weight decay, scheduled step size.

    `memory_learning_rate` > 0 gives the memory kind's own parameters (the infinity-former's LTM)
    their own peak on the same schedule, as the paper fine-tunes GPT-2 at 5e-5 and its LTM at 2.5e-4.
    """
    parts = []
    if train_cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(train_cfg.clip_norm))
    parts.append(optax.scale_by_adam(b1=train_cfg.b1, b2=train_cfg.b2, eps=train_cfg.eps))
    if train_cfg.weight_decay > 0:
        parts.append(optax.add_decayed_weights(train_cfg.weight_decay, mask=_decay_mask))
    step_size = optax.scale_by_learning_rate(learning_rate_schedule(train_cfg))
    memory_lr = train_cfg.memory_learning_rate
    if memory_lr > 0:
        step_size = optax.multi_transform(
            {'model': step_size,
             'memory': optax.scale_by_learning_rate(learning_rate_schedule(train_cfg, memory_lr))},
            _memory_label)
    parts.append(step_size)
    return optax.chain(*parts)
