"""The training loop: restore or initialise, then step, report, validate, checkpoint and stop.

The rooms it calls: `experiment` (the run resolved, sized and compiled), `restore` (where the state
comes from), `progress` (what the run reports), `run_lock` (one run per workdir), `checkpoints`,
`preemption` and `run_files` (config.json and the summary)."""

import json
import math
import time
from typing import Optional

from absl import logging
import jax
import ml_collections
import numpy as np

from memjax import config_lib
from memjax import early_sigterm
from memjax import errors
from memjax.data import factory as data_factory
from memjax.data import pipeline
from memjax.runtime import distributed
from memjax.runtime import logs
from memjax.runtime import peer_watch
from memjax.runtime import storage
from memjax.training import checkpoints as checkpointing
from memjax.training import evaluation
from memjax.training import experiment
from memjax.training import metrics as metrics_lib
from memjax.training import preemption
from memjax.training import progress as progress_lib
from memjax.training import restore
from memjax.training import run_files
from memjax.training import run_lock
from memjax.training import workdir as workdir_lib


def train_and_evaluate(config: ml_collections.ConfigDict | config_lib.RunConfig, workdir: str) -> dict:
    """Trains (resuming from the newest intact checkpoint in workdir) and validates.

    Returns the final summary (also written to `<workdir>/train_summary.json`). On a
    preemption (SIGTERM, or JAX's preemption sync point) it checkpoints the next step
    boundary and returns `{'step', 'preempted': True, 'checkpoint', 'wall_seconds'}`
    without the final validation, which the resumed run does.
    """
    # A refused config leaves no trace: checked before the workdir is created.
    run = experiment.resolved(config, jax.device_count())
    workdir_lib.check(workdir, create=True)
    with logs.log_to_workdir(workdir, jax.process_index()):
        return _train_locked(run, workdir)


def _train_locked(run: config_lib.RunConfig, workdir: str) -> dict:
    # One training run per workdir: process 0 holds the lock for all processes of a run, and
    # all of them stop when it cannot (the others would wait for it at the next barrier).
    lock = run_lock.RunLock(workdir) if jax.process_index() == 0 else None
    refused = None
    if lock is not None:
        try:
            lock.acquire()
        except errors.WorkdirError as error:
            refused, lock = error, None
        except OSError as error:
            refused, lock = errors.WorkdirError(
                f'cannot take the lock {storage.join(workdir, workdir_lib.LOCK_FILE)} '
                f'({error}): check the workdir\'s filesystem.'), None
    release = lock.release if lock is not None else (lambda: None)
    # A run stopped by SIGTERM before or after the loop, or by a lost peer, leaves the workdir
    # free for its restart.
    forget = peer_watch.on_loss(release)
    with early_sigterm.cleanup_on_stop(release):
        try:
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
                if not multihost_utils.broadcast_one_to_all(np.int32(refused is None)) and not refused:
                    refused = errors.WorkdirError(f'process 0 could not take the lock of {workdir}: '
                                                  'see its log.')
            if refused is not None:
                raise refused
            restore.start_tokenizer(run, workdir)
            return _train(run, workdir)
        finally:
            forget()
            release()


def _train(run: config_lib.RunConfig, workdir: str) -> dict:
    """The run from its setup to its summary: restore or initialise, then step, report, validate,
    checkpoint and stop, each a call into the room that holds it."""
    wall_start = time.time()
    exp = experiment.setup(run, workdir)
    tcfg = exp.run.train
    run_files.write_json(storage.join(workdir, run_files.CONFIG_FILE), exp.run.source)
    abstract = experiment.abstract_state(exp)  # Traced once: the summary's count and the restore's shapes.
    progress_lib.log_start(exp, workdir, abstract[0].params)
    train_streams, valid_streams = _streams(exp)
    iterator = train_streams.iterator()

    ckpt = checkpointing.Checkpointer(run_files.checkpoint_dir(workdir), tcfg.keep_checkpoints)
    state, memory, last_checkpoint = restore.restore_or_init(exp, ckpt, iterator, train_streams.fingerprint, abstract)
    step, best_loss = int(state.step), ckpt.best()[1]
    train_step = _PhasedTrainStep(exp)
    eval_step = metrics_lib.announced(experiment.make_eval_step(exp),
                                      'Compiling the evaluation step: the first validation batch includes it.')
    writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0)
    progress = progress_lib.Progress(exp, writer, step)
    watch, preempted = preemption.PreemptionWatch(), False
    try:
        while step < tcfg.num_steps:
            compiles = train_step.compiles(step)
            progress.before_update(compiles, memory)
            state, memory, step_metrics = train_step(step, state, memory,
                                                     exp.partitioner.global_batch(next(iterator)))
            previous_step, step = step, step + tcfg.segments_per_step
            progress.after_update(step_metrics, step, compiles)

            preempted = watch.reached(previous_step, step)
            due = lambda every: every > 0 and step % every == 0
            save = due(tcfg.checkpoint_every) or step == tcfg.num_steps or preempted
            validate = due(tcfg.eval_every) and not (step == tcfg.num_steps or preempted)
            if not (due(tcfg.log_every) or save or validate):
                continue
            progress.report(step, last_checkpoint)  # Before any save: a NaN state is never saved.
            valid_loss = None
            if validate:
                valid_loss = progress.validate(eval_step, state.params, valid_streams, tcfg.eval_batches, step)['loss']
                save = _keep_best(exp, ckpt, step, valid_loss, best_loss, last_checkpoint) or save
                best_loss = valid_loss if best_loss is None else min(best_loss, valid_loss)
            if save:
                with progress.aside():
                    ckpt.save(step, state, memory, iterator.get_state(), exp.run.source, valid_loss,
                              train_streams.fingerprint)
                last_checkpoint = ckpt.step_dir(step)
            if preempted:
                break
            progress.next_interval(step)
        if not preempted:
            train_seconds = progress.train_seconds()
            with preemption.stop_once_written(ckpt.wait):
                final = progress_lib.validate(exp, eval_step, state.params, valid_streams, tcfg.final_eval_batches,
                                              step, writer)
            _check_validation(exp, step, final['loss'], last_checkpoint)
    finally:
        watch.close()
        writer.close()
        try:
            ckpt.wait()  # Raises CheckpointError if the last write failed.
        finally:
            ckpt.close()
    if preempted:
        logging.warning('%s: saved %s; run the same command again to resume.',
                        'Interrupted by Ctrl-C' if early_sigterm.interrupted() else 'Preempted', last_checkpoint)
        return {'step': step, 'preempted': True, 'checkpoint': last_checkpoint,
                'wall_seconds': time.time() - wall_start}
    return _write_summary(exp, workdir, step, final, progress.tokens_per_s(train_seconds), wall_start)


def _streams(exp: experiment.Experiment) -> tuple[pipeline.LMStreams, pipeline.LMStreams]:
    """The training streams (repeating) and the validation streams."""
    tcfg = exp.run.train
    with distributed.primary_first('token streams'):  # Prepared data and token caches.
        train_streams = data_factory.make_streams(
            exp.run.data, 'train', exp.tokenizer, seed=exp.run.seed, batch_size=tcfg.batch_size,
            tgt_len=tcfg.tgt_len, segments_per_batch=tcfg.segments_per_step, repeat=True,
            process_index=jax.process_index(), process_count=jax.process_count())
        valid_streams = evaluation.eval_streams(exp.run, exp.tokenizer, 'validation')
    evaluation.same_on_every_process(train_streams, 'train')
    evaluation.same_on_every_process(valid_streams, 'validation')
    return train_streams, valid_streams


def _check_validation(exp: experiment.Experiment, step: int, valid_loss: float, last_checkpoint: Optional[str]) -> None:
    """Raises on a validation loss that is not finite (which would also rank above every later one as
    the best) or above config.train.diverged_loss, before the step is saved."""
    if not math.isfinite(valid_loss):
        raise errors.NonFiniteLossError(
            f'non-finite validation loss ({valid_loss}) at step {step}, where the training loss was finite: '
            'the evaluation model (config.eval.model: its memory, compute dtype or kind) does not compute on '
            'these parameters. Nothing after it was saved; the last checkpoint is '
            f'{last_checkpoint or "none (no checkpoint yet)"}: evaluate it or resume with other config.eval settings.')
    if valid_loss > exp.run.train.diverged_loss:
        raise progress_lib.diverged(f'validation loss {valid_loss:.4g}', step, exp.run.train.diverged_loss,
                                    last_checkpoint)


def _keep_best(exp: experiment.Experiment, ckpt: checkpointing.Checkpointer, step: int, valid_loss: float,
               best_loss: Optional[float], last_checkpoint: Optional[str]) -> bool:
    """Whether this step is saved as the best validated state (also between checkpoint steps, unless
    the run asked for its final checkpoint only); raises on a diverged validation loss."""
    tcfg = exp.run.train
    _check_validation(exp, step, valid_loss, last_checkpoint)
    if tcfg.checkpoint_every <= 0 or not (best_loss is None or valid_loss < best_loss):
        return False
    logging.info('Checkpoint %s is the best so far (validation loss %.4f); it is kept beside the newest %d.',
                 ckpt.step_dir(step), valid_loss, tcfg.keep_checkpoints)
    return True


def _write_summary(exp: experiment.Experiment, workdir: str, step: int, final: dict,
                   tokens_per_s: Optional[float], wall_start: float) -> dict:
    """The finished run's summary, in train_summary.json and the log. Without a throughput of its
    own (`tokens_per_s` None) the one measured before stays (None if none was)."""
    metric = metrics_lib.metric_name(exp.unit)
    path = storage.join(workdir, 'train_summary.json')
    summary = {
        'step': step,
        'valid_loss': final['loss'],
        f'valid_{metric}': final[metric],
        'valid_tokens': final['num_tokens'],
        **({'valid_accuracy': final['accuracy']} if 'accuracy' in final else {}),
        'train_tokens_per_s': (tokens_per_s if tokens_per_s is not None
                               else (run_files.read_json(path) or {}).get('train_tokens_per_s')),
        'wall_seconds': time.time() - wall_start,
    }
    run_files.write_result(path, summary)
    logging.info('Done: %s', json.dumps(summary))
    return summary


class _PhasedTrainStep:
    """Calls the train step of the phase the memory kind gives the current step; each phase's
    step compiles on first use (a kind without phases has one)."""

    def __init__(self, exp: experiment.Experiment):
        self.exp, self.steps = exp, {}

    def compiles(self, step: int) -> bool:
        """Whether the update from `step` compiles (its phase's first), announced in one line."""
        phase = self.exp.model.kind.phase(step)
        if phase in self.steps:
            return False
        count = self.exp.run.train.segments_per_step
        updates = progress_lib.first_updates(count)
        verb, them = ('includes', 'it') if count == 1 else ('include', 'them')
        if self.steps:  # Skip-Retain's phase 2.
            logging.info('Step %d starts training phase %d (config.model.skip_until: no layer skipped from here): '
                         'compiling its training step; %s of the phase %s it, and speeds count from after %s.',
                         step, phase + 1, updates, verb, them)
        else:
            logging.info('Compiling the training step%s: %s %s it.',
                         f' of phase {phase + 1}' if self.exp.model.kind.phase_starts else '', updates, verb)
        return True

    def __call__(self, step: int, *args):
        phase = self.exp.model.kind.phase(step)
        if phase not in self.steps:
            self.steps[phase] = experiment.make_train_step(self.exp, phase)
        return self.steps[phase](*args)
