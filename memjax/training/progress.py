"""What a run reports as it steps: its start, each interval's scalars and progress line (with
the checks that stop a run before a bad state is saved), and validation."""

import contextlib
import time
from typing import Any, Callable, Iterator, Optional

from absl import logging
import jax
import numpy as np

from memjax import errors
from memjax.data import pipeline
from memjax.model import memories
from memjax.runtime import storage
from memjax.training import evaluation
from memjax.training import experiment
from memjax.training import metrics as metrics_lib
from memjax.training import run_files
from memjax.training import step as train_step_lib


def log_start(exp: experiment.Experiment, workdir: str, params: Any) -> None:
    """What the run is (`params`: their shapes), before the data and the parameters are prepared,
    which can take a while."""
    mcfg, tcfg, devices = exp.mcfg, exp.run.train, jax.devices()
    logging.info('Model: %s, %s parameters; %d %s device(s); batches of %d x %d tokens, %d steps.',
                 memories.describe(mcfg), f'{sum(x.size for x in jax.tree_util.tree_leaves(params)):,}', len(devices),
                 devices[0].platform.upper(), tcfg.batch_size, tcfg.tgt_len, tcfg.num_steps)
    every = lambda steps: f'every {steps} steps' if steps else 'at the end'
    logging.info('Mesh %s; Adam at %g, %d warmup steps, %s decay to %g x, clip %g; validation %s, '
                 'checkpoints %s in %s, TensorBoard in %s.',
                 ' x '.join(f'{name} {size}' for name, size in exp.run.mesh.shape(len(devices)).items()),
                 tcfg.learning_rate, tcfg.warmup_steps, tcfg.decay, tcfg.min_lr_ratio, tcfg.clip_norm,
                 every(tcfg.eval_every), every(tcfg.checkpoint_every),
                 run_files.checkpoint_dir(workdir), storage.join(workdir, 'tensorboard'))


def first_updates(count: int) -> str:
    return 'the first update' if count == 1 else f'the first {count} updates'


class Interval:
    """Per-update metrics since the last report, kept on device until they are needed."""

    def __init__(self, first_step: int):
        self.first_step = first_step  # The step before its first update: what its updates are numbered from.
        self.parts = []
        self.start_time = time.time()
        self.timed_from_step = first_step  # Its speed counts from here: after a compiling dispatch.
        self.untimed_tokens = 0.0  # The compiling first dispatch's: not in its throughput.

    def add(self, step_metrics: dict) -> None:
        self.parts.append(step_metrics)

    def collect(self) -> dict:
        return {k: np.concatenate([np.asarray(p[k], np.float64) for p in self.parts])
                for k in self.parts[0]}

    def check_healthy(self, values: dict, last_checkpoint: Optional[str], diverged_loss: float) -> None:
        """Raises before a NaN, inf or diverged state can become a checkpoint."""
        bad = ~(np.isfinite(values['nll_sum']) & np.isfinite(values['grad_norm']))
        if not bad.any():
            loss = values['nll_sum'] / np.maximum(values['num_tokens'], 1.0)
            if (loss > diverged_loss).any():
                index = int(np.argmax(loss > diverged_loss))
                raise diverged(f'training loss {loss[index]:.4g}', self.first_step + index + 1,
                                diverged_loss, last_checkpoint)
        if bad.any():
            index = int(np.argmax(bad))
            out_of_range = int(values['out_of_range_ids'][index])
            if out_of_range:
                raise errors.NonFiniteLossError(
                    f'non-finite loss at step {self.first_step + index + 1}: its batch holds '
                    f'{out_of_range} token ids outside [0, config.model.vocab_size). The data '
                    'was tokenized with another vocabulary: rebuild it with the run\'s tokenizer '
                    'or set config.model.vocab_size to match. Nothing after it was saved; the '
                    f'last good checkpoint is {last_checkpoint or "none (no checkpoint yet)"}.')
            raise errors.NonFiniteLossError(
                f'non-finite loss or gradient at step {self.first_step + index + 1} '
                f'(NLL sum {values["nll_sum"][index]}, gradient norm {values["grad_norm"][index]}, '
                f'learning rate {values["learning_rate"][index]:.3e}). Nothing after it was saved; '
                f'the last good checkpoint is {last_checkpoint or "none (no checkpoint yet)"}. '
                'Lower config.train.learning_rate or config.train.clip_norm, or use float32 '
                'compute (config.model.compute_dtype).')


def diverged(what: str, step: int, limit: float, last_checkpoint: Optional[str]) -> errors.DivergedError:
    return errors.DivergedError(
        f'the run diverged: {what} at step {step} exceeds config.train.diverged_loss ({limit:.4g} '
        f'nats; -1 is 3 ln(vocab_size)). Nothing after it was saved; the last good checkpoint is '
        f'{last_checkpoint or "none (no checkpoint yet)"}. Lower config.train.learning_rate or '
        'config.train.clip_norm and resume, or raise the limit (0: off) if this loss is expected.')


class Progress:
    """The run's reports as it steps: per interval (from one report to the next) the train scalars
    and a progress line; the throughput counts neither the dispatches that compile (the first, a
    new phase's) nor validation and saves."""

    def __init__(self, exp: experiment.Experiment, writer: metrics_lib.MetricWriter, step: int):
        self.exp, self.writer = exp, writer
        self.interval = Interval(step)
        self.logged_tokens = self.compile_tokens = 0.0
        self.steady_start: Optional[float] = None  # The end of the first compiling dispatch.
        self.aside_seconds = self.compile_seconds = 0.0  # Validation and saving; later compilations.
        self._dispatched = 0.0

    def before_update(self, compiles: bool, memory: Any) -> None:
        if compiles:  # Timed alone: the updates before it have finished.
            jax.block_until_ready(memory)
            self._dispatched = time.time()

    def after_update(self, step_metrics: dict, step: int, compiles: bool) -> None:
        self.interval.add(step_metrics)
        if not compiles:
            return
        jax.block_until_ready(step_metrics)
        now = time.time()
        logging.info('%s, with compilation, took %.1fs.',
                     first_updates(self.exp.run.train.segments_per_step).capitalize(), now - self._dispatched)
        if self.steady_start is None:
            self.steady_start = now
        else:
            self.compile_seconds += now - self._dispatched
        self.compile_tokens += float(np.sum(step_metrics['num_tokens']))
        # Speeds and the ETA count from here: a first line of "8 tok/s, eta 107h" says nothing.
        interval = self.interval
        interval.start_time, interval.timed_from_step = now, step
        interval.untimed_tokens = float(sum(np.sum(part['num_tokens']) for part in interval.parts))

    def report(self, step: int, last_checkpoint: Optional[str]) -> None:
        """The interval's scalars and progress line, after checking them: raises before a NaN or
        diverged state can become a checkpoint."""
        if not self.interval.parts:
            return
        values = self.interval.collect()
        self.interval.check_healthy(values, last_checkpoint, self.exp.run.train.diverged_loss)
        self.logged_tokens += self._log_interval(values, step)

    def validate(self, eval_step: Callable, params: Any, streams: pipeline.LMStreams, max_batches: int,
                 step: int) -> dict:
        """`validate`, its time kept out of the throughput."""
        with self.aside():
            return validate(self.exp, eval_step, params, streams, max_batches, step, self.writer)

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Time that is not training (validation, a checkpoint's save), kept out of the throughput."""
        start = time.time()
        try:
            yield
        finally:
            self.aside_seconds += time.time() - start

    def next_interval(self, step: int) -> None:
        self.interval = Interval(step)

    def train_seconds(self) -> float:
        """Seconds of steady updates so far: since the first compiling dispatch ended, less
        validation, saves and later compiling dispatches."""
        return (time.time() - self.steady_start - self.aside_seconds - self.compile_seconds
                if self.steady_start else 0.0)

    def tokens_per_s(self, seconds: float) -> Optional[float]:
        """Training tokens per second over `seconds` of steady updates; None when this start
        measured none (a finished run started again trains nothing, and a run of one dispatch
        times only its compilation)."""
        if seconds > 0 and self.logged_tokens > self.compile_tokens:
            return (self.logged_tokens - self.compile_tokens) / seconds
        return None

    def _log_interval(self, values: dict, step: int) -> float:
        """Writes the interval's train scalars and the progress line; returns its token count."""
        tcfg = self.exp.run.train
        seconds = max(time.time() - self.interval.start_time, 1e-9)
        tokens = float(values['num_tokens'].sum())  # Global: summed over the sharded batch.
        timed = step > self.interval.timed_from_step  # Not an interval of the compiling dispatch alone.
        mean_nll = float(values['nll_sum'].sum() / max(values['num_tokens'].sum(), 1.0))
        scalars = {
            'loss': mean_nll,
            metrics_lib.metric_name(self.exp.unit): metrics_lib.metric_value(mean_nll, self.exp.unit),
            **({'tokens_per_s': (tokens - self.interval.untimed_tokens) / seconds} if timed else {}),
            'learning_rate': float(values['learning_rate'][-1]),
            'grad_norm': float(values['grad_norm'].mean()),
            # The memory kind's auxiliary losses, per scored token like the loss.
            **{'aux/' + k[len(train_step_lib.AUX_PREFIX):]: float(v.sum() / max(values['num_tokens'].sum(), 1.0))
               for k, v in values.items() if k.startswith(train_step_lib.AUX_PREFIX)},
        }
        self.writer.write_scalars(step, 'train', scalars)
        eta = (tcfg.num_steps - step) * seconds / (step - self.interval.timed_from_step) if timed else None
        logging.info(metrics_lib.progress_line(step, tcfg.num_steps, scalars, self.exp.unit, eta))
        return tokens


def validate(exp: experiment.Experiment, eval_step: Callable, params: Any, streams: pipeline.LMStreams,
              max_batches: int, step: int, writer: metrics_lib.MetricWriter) -> dict:
    """Scores the validation streams and reports them under the 'valid' prefix."""
    result = evaluation.evaluate_streams(eval_step, params, exp.eval_mcfg, streams,
                                         evaluation.local_eval_batch(exp.run), max_batches,
                                         exp.partitioner, evaluation.eval_key(exp.run))
    name = metrics_lib.metric_name(exp.unit)
    scalars = {'loss': result.mean_nll, name: metrics_lib.metric_value(result.mean_nll, exp.unit),
               'num_tokens': result.num_tokens}
    if result.num_correct is not None:
        scalars['accuracy'] = result.accuracy
    writer.write_scalars(step, 'valid', scalars)
    metrics_lib.log_eval(step, 'validation', result.mean_nll, result.num_tokens, exp.unit, result.accuracy)
    return scalars
