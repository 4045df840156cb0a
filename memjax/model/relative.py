"""Relative-position machinery of Transformer-XL, shared by every memory variant.

Keys are ordered [memory (M positions), current segment (T positions)], K = M + T. Query i (a current
position) sits at key index M + i, so its distance to key j is (M + i) - j.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sinusoid_encoding(distances: jax.Array, d_model: int) -> jax.Array:
    """[K] distances -> [K, d_model]: sin half then cos half (concatenated, not interleaved)."""
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, d_model, 2, dtype=jnp.float32) / d_model))
    angles = distances.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def key_distances(klen: int, clamp_len: int) -> jax.Array:
    """Distances K-1, ..., 0, one per relative-position row; clamped at clamp_len when it is > 0."""
    distances = jnp.arange(klen - 1, -1, -1, dtype=jnp.float32)
    if clamp_len > 0:
        distances = jnp.minimum(distances, float(clamp_len))
    return distances


def _broadcast_position_scores(query: jax.Array, pos_key: jax.Array) -> jax.Array:
    batch, _, heads, _ = query.shape
    rows = jnp.broadcast_to(pos_key.transpose(1, 0, 2)[None], (batch, heads) + pos_key.shape[::2])
    return jnp.einsum('bhtd,bhkd->bhtk', query.transpose(0, 2, 1, 3), rows,
                      preferred_element_type=jnp.float32)


@jax.custom_vjp
def position_scores(query: jax.Array, pos_key: jax.Array) -> jax.Array:
    """[B, T, H, Dh] queries x [K, H, Dh] distance rows -> [B, H, T, K] float32 scores.

    Same value and gradient as `einsum('bthd,khd->bhtk')`. Why not that einsum: XLA:CPU computes
    it as one [H, B*T, K] product and then transposes the whole score tensor, which cost more
    than the product (BENCHMARKS.md). Broadcasting the distance rows over the batch makes the
    product come out in [B, H, T, K]; the backward keeps the shared-rows form, which XLA lays out
    well, instead of differentiating through the broadcast.
    """
    return _broadcast_position_scores(query, pos_key)


def _position_scores_fwd(query, pos_key):
    return _broadcast_position_scores(query, pos_key), (query, pos_key)


def _position_scores_bwd(residuals, grad):
    query, pos_key = residuals
    grad_query = jnp.einsum('bhtk,khd->bthd', grad.astype(pos_key.dtype), pos_key,
                            preferred_element_type=jnp.float32)
    grad_pos_key = jnp.einsum('bhtk,bthd->khd', grad.astype(query.dtype), query,
                              preferred_element_type=jnp.float32)
    return grad_query.astype(query.dtype), grad_pos_key.astype(pos_key.dtype)


position_scores.defvjp(_position_scores_fwd, _position_scores_bwd)


def rel_shift(scores: jax.Array) -> jax.Array:
    """Aligns position scores to key positions at linear cost (Transformer-XL, appendix B).

    `scores[..., i, p]` is query i's score against distance row p (distance K-1-p). Afterwards
    `out[..., i, j]` is its score for distance (K - T + i) - j. Entries with j > K - T + i are left
    over from the shift and must be masked by the caller.
    """
    *lead, qlen, klen = scores.shape
    padded = jnp.pad(scores, [(0, 0)] * len(lead) + [(0, 0), (1, 0)])
    shifted = padded.reshape(*lead, klen + 1, qlen)[..., 1:, :]
    return shifted.reshape(*lead, qlen, klen)


def attention_mask(mem_valid: jax.Array, qlen: int, same_length: bool, window: int) -> jax.Array:
    """[B, T, K] bool, True where query i may attend key j.

    Causal with memory: j <= M + i. `same_length` further hides keys more than `window` positions
    back so that every query sees exactly `window` keys including itself (the PyTorch/HF choice).
    Invalid memory positions (an empty or reset memory) are hidden from every query.
    """
    mlen = mem_valid.shape[1]
    i = jnp.arange(qlen)[:, None]
    j = jnp.arange(mlen + qlen)[None, :]
    visible = j <= mlen + i
    if same_length:
        visible &= j > mlen + i - window
    key_valid = jnp.concatenate([mem_valid, jnp.ones((mem_valid.shape[0], qlen), bool)], axis=1)
    return visible[None] & key_valid[:, None, :]
