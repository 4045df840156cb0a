"""The attention's softmax for any platform: float32 arithmetic, weights returned in the compute
dtype, and a backward pass that keeps only those weights.

Why: autodiff of `jax.nn.softmax(scores).astype(bf16)` keeps the float32 weights for the softmax's
backward and the bf16 copy for the weighted values' backward, 6 bytes per score where 2 carry the
information the products use; the [B, H, T, M + T] weights are the largest activations of a
Transformer-XL step (BENCHMARKS.md, accelerators: the bf16 step needed more memory than the float32
one before this). The backward here forms the scores' gradient from the rounded weights, in
float32: p (g - <p, g> + g'), whose error is that of the forward's rounding of p. In float32 it is
the gradient autodiff gives, from the float32 weights.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def softmax_with_log_norm(scores: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(softmax of float32 `scores` over the last axis, rounded to `dtype`; its float32 logsumexp,
    the log-denominator). Masked scores hold the float32 minimum (finite), not -inf."""
    return _forward(scores, dtype)[0]


def _forward(scores, dtype):
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    return (probs, jax.nn.logsumexp(scores, axis=-1)), probs


def _backward(dtype, probs, grads):
    del dtype
    grad_probs, grad_log_norm = grads
    p, g = probs.astype(jnp.float32), grad_probs.astype(jnp.float32)
    return (p * (g - jnp.sum(g * p, axis=-1, keepdims=True) + grad_log_norm[..., None]),)


softmax_with_log_norm.defvjp(_forward, _backward)
