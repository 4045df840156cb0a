"""The one evaluation loop, used by periodic validation and by `memjax.evaluate`.

A split is read as parallel streams in order, carrying the memory from segment to
segment, and every real target token is scored exactly once; the reported loss is the
exact sum of NLL over those tokens divided by their count (no per-batch averaging).
"""

from typing import Any, Callable, NamedTuple, Optional

import jax
import numpy as np

from memjax import config_lib
from memjax import model as model_lib
from memjax.data import factory as data_factory
from memjax.data import pipeline


class EvalResult(NamedTuple):
    nll_sum: float  # nats, summed in float64 over all scored tokens.
    num_tokens: int
    num_correct: Optional[int] = None  # With config.eval.accuracy: argmax predictions that are right.

    @property
    def accuracy(self) -> Optional[float]:
        return None if self.num_correct is None else self.num_correct / max(self.num_tokens, 1)

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / max(self.num_tokens, 1)


def eval_streams(run: config_lib.RunConfig, tokenizer: Any, split: str) -> pipeline.LMStreams:
    return data_factory.make_streams(
        run.data, split, tokenizer, seed=run.seed, batch_size=run.eval.batch_size, tgt_len=run.eval.tgt_len,
        segments_per_batch=run.train.segments_per_step, repeat=False,
        process_index=jax.process_index(), process_count=jax.process_count())


def eval_key(run: config_lib.RunConfig) -> jax.Array:
    """The key of a memory kind's random streams at evaluation: from the seed, the same for
    every evaluation of the run."""
    return jax.random.fold_in(jax.random.PRNGKey(run.seed), 1)


def local_eval_batch(run: config_lib.RunConfig) -> int:
    return run.eval.batch_size // jax.process_count()


def evaluate_streams(eval_step: Callable, params: Any, eval_mcfg: model_lib.ModelConfig,
                     streams: pipeline.LMStreams, local_batch: int,
                     max_batches: int = -1, partitioner: Optional[Any] = None,
                     key: Optional[jax.Array] = None) -> EvalResult:
    """Scores `streams` from their start with a fresh memory (`max_batches` -1: all).

    `key` feeds a memory kind that samples at evaluation; batch i draws from `fold_in(key, i)`,
    so a repeated evaluation scores the same.

    With a `sharding.Partitioner`, `eval_step` runs on global arrays assembled from every
    process's share of the streams; without one, on this process's numpy batches.
    """
    if partitioner is None:
        memory = model_lib.init_memory(eval_mcfg, local_batch)
    else:
        memory = partitioner.init_memory(eval_mcfg, streams.batch_size)
    key = jax.random.PRNGKey(0) if key is None else key
    parts = []
    for index, batch in enumerate(streams.iterator()):
        if 0 <= max_batches <= index:
            break
        if partitioner is not None:
            batch = partitioner.global_batch(batch)
        memory, metrics = eval_step(params, memory, batch, jax.random.fold_in(key, index))
        parts.append(metrics)  # Left on device: no host sync per batch.
    # Replicated outputs of a jitted step: every process reads the same global sums.
    host = jax.device_get(parts)
    nll_sum = sum(float(np.sum(np.asarray(p['nll_sum'], np.float64))) for p in host)
    num_tokens = sum(int(np.sum(p['num_tokens'])) for p in host)
    num_correct = sum(int(np.sum(p['num_correct'])) for p in host) if host and 'num_correct' in host[0] else None
    return EvalResult(nll_sum, num_tokens, num_correct)
