"""Relative effective context length (RECL), Transformer-XL paper, section 4.3 and appendix C.

RECL belongs to a group of models scored on the same tokens: at each context length c, the
baseline of a token is the lowest loss any model of the group reaches on it with context c, so
that every model's longer context must beat the same, best short-context model. For a short
context c and a longer c', model i's relative loss over the top-r hardest tokens T (those of the
highest baseline at c) is

    f_i(c, c') = mean over t in T of min(b(c, t), l_i(c', t)),   b(c, t) = min_j l_j(c, t),

and its relative gain g_i(c, c') = (exp f_i(c, c) - exp f_i(c, c')) / exp f_i(c, c). Starting from the
shortest context, c steps to the next while the gain is at least the threshold (1 %); RECL is the
c where it stops.

The losses arrive as one array [contexts, models, tokens] of per-token negative log-likelihoods
(nats), token t the same text position for every model and context: `token_losses` scores a run
so, with the evaluation settings it was loaded with (`analysis.run.load(workdir, mem_len=...)`);
which setting a context length is for each memory kind is the caller's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import numpy as np

from memjax.analysis.run import LoadedRun
from memjax.training import evaluation
from memjax.training import step as train_step_lib

THRESHOLD = 0.01  # The paper's: a context step that gains less than 1 % ends the search.


def hard_tokens(baseline: np.ndarray, r: float) -> np.ndarray:
    """Indices of the top-r share of tokens by `baseline` (at least one); equal baselines are taken
    in text order, so that the set does not depend on the sort's tie-breaking."""
    if not 0.0 < r <= 1.0:
        raise ValueError(f'r={r} must be in (0, 1].')
    count = max(1, math.ceil(r * baseline.size - 1e-9))
    # A stable sort of the negated baseline: the largest first, ties in token order.
    return np.argsort(-baseline, kind='stable')[:count]


def relative_losses(short: np.ndarray, long: np.ndarray, r: float) -> np.ndarray:
    """[models] f_i(c, c') from the group's per-token losses at c (`short`) and at c' (`long`),
    each [models, tokens]."""
    baseline = short.min(axis=0)
    tokens = hard_tokens(baseline, r)
    return np.minimum(baseline[tokens], long[:, tokens]).mean(axis=1)


def relative_gains(short: np.ndarray, long: np.ndarray, r: float) -> np.ndarray:
    """[models] g_i(c, c'): the relative perplexity reduction over the shared short-context baseline."""
    base = np.exp(relative_losses(short, short, r))
    return (base - np.exp(relative_losses(short, long, r))) / base


def gain_table(losses: np.ndarray, r: float) -> np.ndarray:
    """[models, contexts, contexts]: exp f_i(c, c) - exp f_i(c, c') for every pair c <= c' (NaN below
    the diagonal), the unnormalised relative perplexity gains the paper's figure 3 draws."""
    contexts = losses.shape[0]
    table = np.full((losses.shape[1], contexts, contexts), np.nan)
    for a in range(contexts):
        base = np.exp(relative_losses(losses[a], losses[a], r))
        for b in range(a, contexts):
            table[:, a, b] = base - np.exp(relative_losses(losses[a], losses[b], r))
    return table


@dataclasses.dataclass(frozen=True)
class Recl:
    """One model's RECL at one r: `context`, and whether the search stopped below the threshold
    (False: it gained at every step up to the longest context evaluated, a lower bound)."""
    context: int
    converged: bool


def recl(losses: np.ndarray, contexts: Sequence[int], r: float, threshold: float = THRESHOLD) -> list[Recl]:
    """Each model's RECL over `contexts` (increasing; the paper steps by a fixed Delta) from the
    per-token losses [contexts, models, tokens]."""
    if list(contexts) != sorted(set(contexts)) or len(contexts) != losses.shape[0]:
        raise ValueError(f'contexts {list(contexts)} must increase and give each of the {losses.shape[0]} '
                         'context rows of the losses its length.')
    # gains[k, i]: model i's relative gain from contexts[k] to contexts[k + 1].
    gains = np.array([relative_gains(losses[k], losses[k + 1], r) for k in range(len(contexts) - 1)])
    found = []
    for model in range(losses.shape[1]):
        at = 0
        while at + 1 < len(contexts) and gains[at, model] >= threshold:
            at += 1
        found.append(Recl(int(contexts[at]), converged=at + 1 < len(contexts)))
    return found


def token_losses(run: LoadedRun, split: str = 'validation', max_batches: int = -1) -> np.ndarray:
    """Each scored target's loss (nats) as `memjax.evaluate` scores `split` with the run's evaluation
    settings (its first `max_batches` batches; -1: all), in reading order: the same tokens in the
    same order for every run read with the same tokenizer, eval batch size and segment length."""
    exp = run.exp
    step = jax.jit(train_step_lib.eval_step_fn(exp.eval_model, per_token=True))
    streams = evaluation.eval_streams(exp.run, exp.tokenizer, split)
    return evaluation.evaluate_streams(step, run.params, exp.eval_mcfg, streams, evaluation.local_eval_batch(exp.run),
                                       max_batches, key=evaluation.eval_key(exp.run)).token_nll
