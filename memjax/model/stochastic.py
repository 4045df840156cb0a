"""The skeleton's training-time random switches (Vishnu & Sekhar, "Memory-efficient Stochastic
methods for Memory-based Transformers"): Skip-Retain's layer skips and Stochastic Cross-Head
attention. Both act in training only; evaluation never skips and never permutes.

Skip-Retain, phase 1: layer l (1-based in the paper, 0-based here) is skipped for a training step
with probability p_skip(l); a skipped layer is the identity for that segment and its memory is
retained, so it ages by one segment (its keys are then that much further back). Phase 2 trains
without skipping, from `skip_until` on. The rules are the paper's equations (1)-(5). The released
code measures every key's distance from the segment's last token, for all queries alike (it has
no relative shift), and ages those; memjax ages Transformer-XL's per-query distances R_{i-j}.

Stochastic Cross-Head attention: per layer and step, with probability `sch_beta`, one permutation
of the heads; query head h then scores and reads head perm[h]'s content keys, positional keys and
values (eqs. 8-10). The u and v biases stay with the query head, as in the released code.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from memjax.errors import failed
from memjax.model.config import ModelConfig, add_check


def _linear(n_layer: int, p: float) -> np.ndarray:
    """Eq. (1): 0.5 (i - 1) / N for i = 1 .. N - 1, the top layer never (p unused)."""
    probs = 0.5 * np.arange(n_layer) / n_layer
    probs[-1] = 0.0
    return probs


def _except(*ends: int) -> Callable[[int, float], np.ndarray]:
    def rule(n_layer: int, p: float) -> np.ndarray:
        probs = np.full(n_layer, p)
        probs[[e % n_layer for e in ends]] = 0.0
        return probs
    return rule


# config.model.skip_rule -> (n_layer, skip_p) -> p_skip per layer, 0-based.
SKIP_RULES: dict[str, Callable[[int, float], np.ndarray]] = {
    'linear': _linear,  # eq. (1), the paper's choice
    'uniform': _except(),  # eq. (2)
    'keep_first': _except(0),  # eq. (3)
    'keep_last': _except(-1),  # eq. (4)
    'keep_ends': _except(0, -1),  # eq. (5)
}


@add_check
def _valid_switches(cfg: ModelConfig) -> list[str]:
    return failed(
        (cfg.skip_rule == 'none' or cfg.skip_rule in SKIP_RULES,
         f"skip_rule={cfg.skip_rule!r} must be 'none' or one of {tuple(SKIP_RULES)}."),
        (0.0 <= cfg.skip_p < 1.0, f'skip_p={cfg.skip_p} must be in [0, 1).'),
        (cfg.skip_until >= -1, f'skip_until={cfg.skip_until} must be a training step, or -1 (skip all run).'),
        (0.0 <= cfg.sch_beta <= 1.0, f'sch_beta={cfg.sch_beta} must be in [0, 1].'))


def skip_probabilities(skip_rule: str, n_layer: int, skip_p: float) -> np.ndarray:
    """[n_layer] float64: p_skip of every layer; zeros for 'none'."""
    if skip_rule == 'none':
        return np.zeros(n_layer)
    return SKIP_RULES[skip_rule](n_layer, skip_p)


def skipping(config: ModelConfig) -> bool:
    """Whether some layer can be skipped in training (a rule whose probabilities are not all 0)."""
    return bool(skip_probabilities(config.skip_rule, config.n_layer, config.skip_p).any())


def draw_skips(key: jax.Array, probs: np.ndarray) -> jax.Array:
    """[n_layer] bool: the layers skipped this step, each with its own probability."""
    return jax.random.uniform(key, probs.shape) < jnp.asarray(probs, jnp.float32)


def expected_context(probs: np.ndarray, mem_len: int) -> float:
    """Eq. (6): E[m~] = sum_l p_skip(l) 2M, the paper's expected extra context of one step."""
    return float(2 * mem_len * probs.sum())


def cross_head_permutation(key: jax.Array, beta: float, n_head: int) -> tuple[jax.Array, jax.Array]:
    """(applied: bool, perm [n_head] int32): with probability beta a uniform permutation of the
    heads, else the identity."""
    use, order = jax.random.split(key)
    applied = jax.random.uniform(use) < beta
    perm = jnp.where(applied, jax.random.permutation(order, n_head), jnp.arange(n_head))
    return applied, perm.astype(jnp.int32)


def streams(config: ModelConfig) -> dict[str, bool]:
    """The random streams the switches draw from (name -> the same draw in every gradient
    accumulation chunk of a step: both are one decision per layer and step)."""
    out = {}
    if skipping(config):
        out['skip'] = True
    if config.sch_beta > 0:
        out['cross_head'] = True
    return out
