"""Decoding a memory model token by token, segment by segment, as it was trained.

A segment of T tokens is decoded in three compiled programs, whatever the memory kind:

- `record`: the segment's first token, run as the whole segment would be (the rest padded, which
  causality hides from it), keeping every layer's keys (`LayerCache`: the memory kind's blocks
  and stack rows, then T slots for the segment);
- `step`: each later token alone against those caches (one query per layer, its key written into
  its slot); the memory does not change;
- `advance`: once the segment is full, the whole segment from the memory it started with, which
  gives the next memory exactly as training's segment boundary does.

Memory, caches and the segment buffer have fixed shapes, so nothing recompiles per position, and
no token re-runs the segment. A prompt's whole segments go straight through `advance`.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import numpy as np

from memjax.model import lm
from memjax.training.step import stream_keys


def _advance(model: lm.MemoryLM, params, tokens, memory, key):
    out, memory = model.apply({'params': params}, tokens, memory, rngs=stream_keys(key, model.kind, 0))
    return out.hidden, memory


def _record(model: lm.MemoryLM, params, tokens, count, memory, key):
    """The segment `tokens` [B, T] whose first `count` are real, run whole: (the hidden state of the
    last real one, the caches). Causality hides the rest from them; their keys in the caches are
    overwritten as the tokens arrive."""
    out, _, caches = model.apply({'params': params}, tokens, memory, record=True,
                                 rngs=stream_keys(key, model.kind, 0))
    return jax.lax.dynamic_index_in_dim(out.hidden, count - 1, axis=1, keepdims=False), caches


def _step(model: lm.MemoryLM, params, token, position, memory, caches):
    out, _, caches = model.apply({'params': params}, token, memory, caches=caches, position=position)
    return out.hidden[:, 0], caches


@functools.lru_cache(maxsize=8)
def _programs(model: lm.MemoryLM):
    """The jitted advance, record and step of `model` (modules compare by value): decoders of one
    model share their compiled programs. A step's caches are donated: it writes one slot of them."""
    return (jax.jit(functools.partial(_advance, model)), jax.jit(functools.partial(_record, model)),
            jax.jit(functools.partial(_step, model), donate_argnums=(4,)))


class Decoder:
    """Feeds tokens to `model` one segment or one token at a time and returns the final hidden
    state of the last one fed (the input of the output distribution for the next token).

    `key` feeds the memory kind's random streams (a kind that samples at evaluation, such as the
    infinity-former's sticky memories): segment s draws from `fold_in(key, s)`, as evaluation does.
    """

    def __init__(self, model: lm.MemoryLM, params, batch_size: int, segment_len: Optional[int] = None,
                 key: Optional[jax.Array] = None):
        cfg = model.config
        self.segment_len = segment_len or cfg.segment_len
        if self.segment_len < 1:
            raise ValueError(f'segment_len={self.segment_len}: decoding needs the length of the segments the '
                             'model reads: give sample(..., segment_len=N), or set config.model.segment_len (a '
                             'trained run\'s config has it from its tgt_len).')
        self.params = params
        self.batch_size = batch_size
        self.key = jax.random.key(0) if key is None else key
        self.memory = lm.init_memory(cfg, batch_size)
        self.tokens = np.zeros((batch_size, self.segment_len), np.int32)  # The current segment's.
        self.position = 0  # Tokens of the current segment fed so far.
        self.segments = 0  # Segments completed.
        self.caches = None
        self._advance_fn, self._record_fn, self._step_fn = _programs(model)

    def _segment_key(self) -> jax.Array:
        return jax.random.fold_in(self.key, self.segments)

    def feed(self, tokens) -> jax.Array:
        """tokens [B, n], n >= 1 -> hidden [B, d_model] after the last. At a segment boundary whole
        segments run at once, and the start of a segment in one `record`; the rest token by token."""
        tokens = np.asarray(tokens, np.int32)
        if tokens.ndim != 2 or tokens.shape[0] != self.batch_size or tokens.shape[1] == 0:
            raise ValueError(f'feed takes token ids [{self.batch_size}, n >= 1], not {tokens.shape}.')
        start, hidden = 0, None
        while start < tokens.shape[1]:
            count = min(tokens.shape[1] - start, self.segment_len - self.position)
            if self.position == 0 and count == self.segment_len:
                out, self.memory = self._advance_fn(self.params, tokens[:, start:start + count], self.memory,
                                                    self._segment_key())
                hidden = out[:, -1]
                self.segments += 1
            elif self.position == 0:
                self.tokens[:, :count] = tokens[:, start:start + count]
                hidden, self.caches = self._record_fn(self.params, self.tokens.copy(), np.int32(count), self.memory,
                                                      self._segment_key())
                self._moved(count)
            else:
                hidden, count = self.feed_token(tokens[:, start]), 1
            start += count
        return hidden

    def feed_token(self, token) -> jax.Array:
        """token [B] -> hidden [B, d_model]: one token at the current position."""
        if self.position == 0:
            return self.feed(np.asarray(token).reshape(self.batch_size, 1))
        token = np.asarray(token, np.int32).reshape(self.batch_size, 1)
        hidden, self.caches = self._step_fn(self.params, token, np.int32(self.position), self.memory, self.caches)
        self.tokens[:, self.position] = token[:, 0]
        self._moved(1)
        return hidden

    def _moved(self, count: int) -> None:
        self.position += count
        if self.position == self.segment_len:  # The segment becomes memory, as in training.
            _, self.memory = self._advance_fn(self.params, self.tokens.copy(), self.memory, self._segment_key())
            self.segments += 1
            self.position, self.caches = 0, None
