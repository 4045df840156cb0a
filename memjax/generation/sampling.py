"""Choosing the next token: greedy, temperature, top-k and top-p (nucleus) sampling.

The warpers apply in the usual order (temperature, then top-k, then top-p, as in HF `generate`);
tokens tied with the last one kept by top-k or top-p are kept too. With an adaptive softmax the
head is scored first and a tail cluster only when it can matter:

- plain sampling (temperature 1, no top-k or top-p): draw from the head (its tokens and one entry
  per tail cluster), then, for the rows that drew a cluster, inside that cluster only;
- greedy and top-k: a tail cluster is scored only when its total probability reaches the k-th best
  head token's (every token in it is at most that likely; with k above the head's size, always);
- top-p alone: a cluster is scored only when it is at least as likely as the least likely head
  token of the head's own nucleus; the nucleus is then cut by the model's own probabilities,
  which the clusters left out keep their share of;
- temperature other than 1 reshapes the whole distribution, so every cluster is scored.
Each function returns the chosen tokens and their log-probabilities under the model itself (not
the warped distribution).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

from memjax.model.config import ModelConfig

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. temperature 0: greedy (the most probable token)."""

    temperature: float = 1.0
    top_k: int = 0  # Keep the k most probable tokens; 0: all.
    top_p: float = 1.0  # Keep the fewest most probable tokens whose probability reaches top_p (and ties); 1: all.

    def problems(self) -> list[str]:
        found = []
        if not 0 <= self.temperature < math.inf:  # NaN too: it would sample NUL bytes.
            found.append(f'temperature={self.temperature} must be a finite number >= 0 (0: greedy).')
        if self.top_k < 0:
            found.append(f'top_k={self.top_k} must be >= 0 (0: no top-k).')
        if not 0 < self.top_p <= 1:
            found.append(f'top_p={self.top_p} must be in (0, 1] (1: no nucleus).')
        return found

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain(self) -> bool:
        """Sampling from the model's own distribution."""
        return self.temperature == 1 and self.top_k == 0 and self.top_p == 1


def warp(logprobs: jax.Array, settings: Sampling) -> jax.Array:
    """Log-weights [B, N] of the sampling distribution over candidates with model log-probs
    `logprobs` [B, N] (-inf: never chosen), after temperature, top-k and top-p.

    Until temperature or top-k reshape it, the nucleus is cut by the model's own probabilities:
    candidates left out at -inf (an adaptive softmax's clusters not scored) keep their mass.
    """
    x = logprobs / settings.temperature
    reshaped = settings.temperature != 1
    if settings.top_k and settings.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, settings.top_k)[0][:, -1:]
        x = jnp.where(x >= kth, x, _NEG_INF)
        reshaped = True
    if settings.top_p < 1:
        ordered = jnp.sort(x, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1) if reshaped else jnp.exp(ordered)
        before = jnp.cumsum(probs, axis=-1) - probs  # Mass of the more probable candidates.
        # The least likely candidate still needed to reach top_p (the most likely is always kept).
        threshold = jnp.min(jnp.where(before < settings.top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x >= threshold, x, _NEG_INF)
    return x


def _pick(logprobs: jax.Array, key: jax.Array, settings: Sampling) -> jax.Array:
    """Index [B] of the candidate chosen from `logprobs` [B, N]."""
    if settings.greedy:
        return jnp.argmax(logprobs, axis=-1)
    return jax.random.categorical(key, warp(logprobs, settings), axis=-1)


def choose(cluster_logprobs: Callable[[jax.Array, int], jax.Array], config: ModelConfig, hidden: jax.Array,
           key: jax.Array, settings: Sampling) -> tuple[jax.Array, jax.Array]:
    """(tokens [B] int32, their model log-probs [B]) for final hidden states `hidden` [B, d_model].

    `cluster_logprobs(hidden, i)` is `MemoryLM.cluster_logprobs` (bound to the parameters).
    """
    bounds = config.cluster_bounds
    shortlist, tails = bounds[1], range(1, len(bounds) - 1)
    head = cluster_logprobs(hidden, 0)
    if not tails:
        token = _pick(head, key, settings)
        return token.astype(jnp.int32), jnp.take_along_axis(head, token[:, None], axis=-1)[:, 0]
    cluster_mass = {i: head[:, shortlist + i - 1] for i in tails}  # log p(cluster i) [B]
    draw_key, inner_key = jax.random.split(key)

    def scored_if(needed, i, scored, otherwise):
        """`scored(log p(token | cluster i))` where some row needs cluster i, else `otherwise`."""
        return jax.lax.cond(jnp.any(needed), lambda: scored(cluster_logprobs(hidden, i)), lambda: otherwise)

    if settings.plain:
        drawn = jax.random.categorical(draw_key, head, axis=-1)
        token, logprob = drawn, jnp.take_along_axis(head, drawn[:, None], axis=-1)[:, 0]
        for i in tails:
            inside = drawn == shortlist + i - 1
            key_i = jax.random.fold_in(inner_key, i)

            def draw(tail, key_i=key_i):
                local = jax.random.categorical(key_i, tail, axis=-1)
                return local, jnp.take_along_axis(tail, local[:, None], axis=-1)[:, 0]

            local, tail_lp = scored_if(inside, i, draw, (jnp.zeros_like(drawn), jnp.zeros_like(logprob)))
            token = jnp.where(inside, bounds[i] + local, token)
            logprob = jnp.where(inside, logprob + tail_lp, logprob)
        return token.astype(jnp.int32), logprob

    if settings.greedy or settings.top_k:
        k = 1 if settings.greedy else settings.top_k
        kth = (jax.lax.top_k(head[:, :shortlist], k)[0][:, -1] if k <= shortlist
               else jnp.full(head.shape[:1], _NEG_INF))
        needed = {i: cluster_mass[i] >= kth for i in tails}
    elif settings.temperature == 1:  # top-p alone: the nucleus's head tokens bound the clusters.
        # The nucleus of the head's tokens alone ends at `least`; more tokens only raise where
        # the true nucleus ends, so a cluster less likely than `least` holds none of it.
        ordered = jnp.sort(head[:, :shortlist], axis=-1)[:, ::-1]
        before = jnp.cumsum(jnp.exp(ordered), axis=-1) - jnp.exp(ordered)
        least = jnp.min(jnp.where(before < settings.top_p, ordered, jnp.inf), axis=-1)
        # With less than top_p in the head, the nucleus may reach any cluster.
        short = jax.nn.logsumexp(head[:, :shortlist], axis=-1) < jnp.log(settings.top_p)
        needed = {i: short | (cluster_mass[i] >= least) for i in tails}
    else:
        needed = {i: jnp.ones_like(cluster_mass[i], bool) for i in tails}
    values = [head[:, :shortlist]]
    for i in tails:
        full = jnp.full((head.shape[0], bounds[i + 1] - bounds[i]), _NEG_INF)
        values.append(scored_if(needed[i], i, lambda tail, i=i: cluster_mass[i][:, None] + tail, full))
    values = jnp.concatenate(values, axis=-1)  # Every token's model log-prob, -inf where not scored.
    token = _pick(values, draw_key, settings)
    return token.astype(jnp.int32), jnp.take_along_axis(values, token[:, None], axis=-1)[:, 0]
