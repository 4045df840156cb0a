"""The one evaluation loop, used by periodic validation and by `memjax.evaluate`.

A split is read as parallel streams in order, carrying the memory from segment to
segment, and every real target token is scored exactly once; the reported loss is the
exact sum of NLL over those tokens divided by their count (no per-batch averaging).
"""

import time
from typing import Any, Callable, NamedTuple, Optional

from absl import logging
import jax
import numpy as np

from memjax import config_lib
from memjax import model as model_lib
from memjax.data import factory as data_factory
from memjax.data import pipeline
from memjax.runtime import distributed
from memjax.training import metrics as metrics_lib

# A whole-split evaluation can take many minutes: a progress line this often.
PROGRESS_EVERY_S = 30.0


class EvalResult(NamedTuple):
    nll_sum: float  # nats, summed in float64 over all scored tokens.
    num_tokens: int
    num_correct: Optional[int] = None  # With config.eval.accuracy: argmax predictions that are right.
    # Scored tokens per second after the first batch, which compiles; None with one batch.
    tokens_per_s: Optional[float] = None
    # With a per-token step (`eval_step_fn(per_token=True)`): each scored target's loss in reading
    # order (batch, segment, stream, position), the same order for every run that reads the split
    # with the same tokenizer, batch size and segment length.
    token_nll: Optional[np.ndarray] = None

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


def same_on_every_process(streams: Any, split: str) -> None:
    """Stops every process when they read different token ids: each lays out the split from its own
    copy of the files, and a global batch takes rows from all of them, so a host whose copy differs
    (a file missing, a partial copy) would score tokens twice or never. Call it on every process,
    outside `primary_first`."""
    if streams.fingerprint:  # None for the generated sorting task, the same everywhere by its seed.
        distributed.assert_same_on_all_processes(
            streams.fingerprint['tokens'], f'the {split} split (its token ids)',
            'data files (config.data: data_dir, text_path or manual_dir), or one shared copy')


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
    total = streams.num_batches if max_batches < 0 else min(max_batches, streams.num_batches)
    parts = []
    timed_from = logged = 0.0
    for index, batch in enumerate(streams.iterator()):
        if index >= total:
            break
        if partitioner is not None:
            batch = partitioner.global_batch(batch)
        memory, metrics = eval_step(params, memory, batch, jax.random.fold_in(key, index))
        parts.append(metrics)  # Left on device: the host waits only for the first batch and progress lines.
        if index == 0:
            jax.block_until_ready(metrics)  # The first batch includes the compilation: timed from its end.
            timed_from = logged = time.time()
        elif time.time() - logged >= PROGRESS_EVERY_S:
            jax.block_until_ready(metrics)
            logged = time.time()
            per_batch = (logged - timed_from) / index
            logging.info('evaluating %s: batch %d/%d | eta %s', streams.split, index + 1, total,
                         metrics_lib.format_duration(per_batch * (total - index - 1)))
    # Replicated outputs of a jitted step: every process reads the same global sums.
    host = jax.device_get(parts)
    seconds = time.time() - timed_from
    nll_sum = sum(float(np.sum(np.asarray(p['nll_sum'], np.float64))) for p in host)
    num_tokens = sum(int(np.sum(p['num_tokens'])) for p in host)
    num_correct = sum(int(np.sum(p['num_correct'])) for p in host) if host and 'num_correct' in host[0] else None
    timed_tokens = num_tokens - (int(np.sum(host[0]['num_tokens'])) if host else 0)
    token_nll = None
    if host and 'token_nll' in host[0]:
        flat = np.concatenate([np.asarray(p['token_nll'], np.float64).reshape(-1) for p in host])
        token_nll = flat[~np.isnan(flat)]
    return EvalResult(nll_sum, num_tokens, num_correct,
                      timed_tokens / seconds if len(host) > 1 and seconds > 0 else None, token_nll)
