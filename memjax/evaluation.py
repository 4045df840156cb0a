"""The one evaluation loop, used by periodic validation and by `memjax.evaluate`.

A split is read as parallel streams in order, carrying the memory from segment to
segment, and every real target token is scored exactly once; the reported loss is the
exact sum of NLL over those tokens divided by their count (no per-batch averaging).
"""

from typing import Any, Callable, NamedTuple, Optional

import jax
import ml_collections
import numpy as np

from memjax import config_lib
from memjax import model as model_lib
from memjax.data import pipeline


class EvalResult(NamedTuple):
    nll_sum: float  # nats, summed in float64 over all scored tokens.
    num_tokens: int

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / max(self.num_tokens, 1)


def eval_model_config(mcfg: Any, config: ml_collections.ConfigDict) -> Any:
    """The model config with the evaluation memory/attention overrides applied."""
    return mcfg.replace(
        mem_len=config_lib.eval_setting(config, 'mem_len'),
        clamp_len=config_lib.eval_setting(config, 'clamp_len'),
        same_length=config_lib.eval_setting(config, 'same_length'))


def eval_streams(config: ml_collections.ConfigDict, tokenizer: Any,
                 split: str) -> pipeline.LMStreams:
    return pipeline.LMStreams(
        config.data, split, tokenizer,
        batch_size=config_lib.eval_setting(config, 'batch_size'),
        tgt_len=config_lib.eval_setting(config, 'tgt_len'),
        segments_per_batch=config.train.segments_per_step, repeat=False,
        process_index=jax.process_index(), process_count=jax.process_count())


def local_eval_batch(config: ml_collections.ConfigDict) -> int:
    return config_lib.eval_setting(config, 'batch_size') // jax.process_count()


def evaluate_streams(eval_step: Callable, params: Any, eval_mcfg: Any,
                     streams: pipeline.LMStreams, local_batch: int,
                     max_batches: int = -1, partitioner: Optional[Any] = None) -> EvalResult:
    """Scores `streams` from their start with a fresh memory (`max_batches` -1: all).

    With a `sharding.Partitioner`, `eval_step` runs on global arrays assembled from every
    process's share of the streams; without one, on this process's numpy batches.
    """
    if partitioner is None:
        memory = model_lib.init_memory(eval_mcfg, local_batch)
    else:
        memory = partitioner.init_memory(eval_mcfg, streams.batch_size)
    parts = []
    for index, batch in enumerate(streams.iterator()):
        if 0 <= max_batches <= index:
            break
        if partitioner is not None:
            batch = partitioner.global_batch(batch)
        memory, metrics = eval_step(params, memory, batch)
        parts.append(metrics)  # Left on device: no host sync per batch.
    # Replicated outputs of a jitted step: every process reads the same global sums.
    host = jax.device_get(parts)
    nll_sum = sum(float(np.sum(np.asarray(p['nll_sum'], np.float64))) for p in host)
    num_tokens = sum(int(np.sum(p['num_tokens'])) for p in host)
    return EvalResult(nll_sum, num_tokens)
