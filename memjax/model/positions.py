"""Positional schemes: Transformer-XL's relative sinusoid, or GPT-2's learned absolute positions.

A relative scheme gives the attention a table of distance rows, row p for distance R-1-p (descending,
so that a contiguous key span of K keys ending at the query block uses the table's last K rows
as they are). Keys are ordered [earlier blocks, segment]; query i of a span of K keys sits at key
index K - T + i, so its distance to key j is (K - T + i) - j.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from memjax.model.config import ModelConfig, add_check


def sinusoid_encoding(distances: jax.Array, d_model: int) -> jax.Array:
    """[K] distances -> [K, d_model]: sin half then cos half (concatenated, not interleaved)."""
    inv_freq = 1.0 / (10000.0 ** (jnp.arange(0, d_model, 2, dtype=jnp.float32) / d_model))
    angles = distances.astype(jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def key_distances(klen: int, clamp_len: int, offset=0) -> jax.Array:
    """Distances offset + K-1, ..., offset, one per relative-position row; clamped at clamp_len when
    it is > 0. `offset` may be traced (an aged memory's lag)."""
    distances = jnp.arange(klen - 1, -1, -1, dtype=jnp.float32) + jnp.asarray(offset, jnp.float32)
    if clamp_len > 0:
        distances = jnp.minimum(distances, float(clamp_len))
    return distances


def relative_sinusoid_table(rows: int, d_model: int, clamp_len: int, offset=0) -> jax.Array:
    """[rows, d_model] encodings of distances offset + rows-1, ..., offset (clamped)."""
    return sinusoid_encoding(key_distances(rows, clamp_len, offset), d_model)


# config.model.positions -> (rows, d_model, clamp_len, offset=0) -> the descending distance table, or None
# for an absolute scheme: a learned [n_positions, d_model] table added to the token embeddings
# (MemoryLM), after which the attention scores content alone.
POSITIONS = {'relative_sinusoid': relative_sinusoid_table, 'learned_absolute': None}


@add_check
def _known_positions(cfg: ModelConfig) -> list[str]:
    if cfg.positions not in POSITIONS:
        return [f'positions={cfg.positions!r} must be one of {tuple(POSITIONS)}.']
    if POSITIONS[cfg.positions] is None and cfg.segment_len > cfg.n_positions:
        return [f'segments of {cfg.segment_len} tokens but the learned position table has n_positions='
                f'{cfg.n_positions} rows: shorten tgt_len or raise n_positions.']
    return []


def position_scores(query: jax.Array, pos_key: jax.Array) -> jax.Array:
    """[B, T, H, Dh] queries x [K, H, Dh] distance rows -> [B, H, T, K] float32 scores.

    The distance rows are shared by the batch, so each head's scores are one product over all
    B*T queries, [H, B*T, K]; the swap of the two leading axes is left to the consumer (the
    rel-shift and mask fuse it as a read of whole [T, K] blocks). Evaluation steps at the peer
    shape ran 10 % faster than with the rows broadcast over the batch for a batched product
    (docs/perf-notes.md); training unchanged.
    """
    scores = jnp.einsum('bthd,khd->hbtk', query, pos_key, preferred_element_type=jnp.float32)
    return scores.transpose(1, 0, 2, 3)


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
