"""Training loop: setup, resume, jitted updates, logging, validation, checkpoints."""

import dataclasses
import json
import os
import time
from typing import Any, Callable, Optional

from absl import logging
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from memjax import checkpointing
from memjax import config_lib
from memjax import distributed
from memjax import evaluation
from memjax import metrics as metrics_lib
from memjax import model as model_lib
from memjax import optim
from memjax import preemption
from memjax import sharding
from memjax import train_step as train_step_lib
from memjax.data import pipeline
from memjax.data import tokenizers


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN/inf loss or gradient; nothing after the last good step is saved."""


@dataclasses.dataclass
class Experiment:
    """Everything derived from the config before any compilation."""
    config: ml_collections.ConfigDict  # With model.vocab_size resolved.
    tokenizer: Any
    mcfg: Any
    eval_mcfg: Any
    model: Any
    eval_model: Any  # Same parameters; evaluation's mem_len, clamp_len, same_length.
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    local_batch: int
    partitioner: sharding.Partitioner
    state_sharding: Any  # TrainState of NamedShardings.
    memory_sharding: Any  # Of the global training memory.

    @property
    def unit(self) -> str:
        return self.tokenizer.unit


def resolve_model_configs(config: ml_collections.ConfigDict, vocab_size: int) -> tuple[Any, Any]:
    """Training and evaluation model configs; model field errors become ConfigErrors."""
    try:
        mcfg = model_lib.ModelConfig.from_config_dict(config.model, vocab_size=vocab_size)
    except ValueError as error:
        raise config_lib.ConfigError(f'invalid config.model: {error}') from error
    try:
        eval_mcfg = evaluation.eval_model_config(mcfg, config)
    except ValueError as error:
        raise config_lib.ConfigError(f'invalid config.eval override: {error}') from error
    return mcfg, eval_mcfg


def setup(config: ml_collections.ConfigDict, workdir: str,
          devices: Optional[list[jax.Device]] = None) -> Experiment:
    """Validates the config, builds (or loads) the tokenizer and the model; compiles nothing.

    The mesh spans `devices` (default: every device of every process).
    """
    devices = jax.devices() if devices is None else devices
    config_lib.validate_config(config, jax.process_count(), len(devices))
    os.makedirs(workdir, exist_ok=True)
    with distributed.primary_first('tokenizer'):
        tokenizer = tokenizers.build_tokenizer(config.data, workdir)
    distributed.assert_same_on_all_processes(tokenizer.fingerprint, 'the tokenizer')
    mcfg, eval_mcfg = resolve_model_configs(config, tokenizer.vocab_size)
    config = ml_collections.ConfigDict(config.to_dict())
    config.model.vocab_size = mcfg.vocab_size
    tx = optim.make_optimizer(config.train)
    # Built once; deriving the shardings here rejects splits that do not divide before compiling.
    partitioner = sharding.Partitioner.from_config(config, devices)
    return Experiment(
        config=config, tokenizer=tokenizer, mcfg=mcfg, eval_mcfg=eval_mcfg,
        model=model_lib.TransformerXL(mcfg), eval_model=model_lib.TransformerXL(eval_mcfg),
        tx=tx, schedule=optim.learning_rate_schedule(config.train),
        local_batch=config.train.batch_size // jax.process_count(), partitioner=partitioner,
        state_sharding=partitioner.train_state(mcfg, tx),
        memory_sharding=partitioner.memory(mcfg, config.train.batch_size))


def init_state(exp: Experiment) -> tuple[train_step_lib.TrainState, Any]:
    """Fresh float32 parameters, optimizer state and an empty memory, created in their shards."""

    def create():
        init_key, dropout_key = jax.random.split(jax.random.PRNGKey(exp.config.seed))
        params = model_lib.init_params(exp.mcfg, init_key)
        return train_step_lib.TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=exp.tx.init(params),
            rng=dropout_key)

    # Outside the rules context: flax's DenseGeneral initialises a flattened kernel, which
    # the logical constraint of the unflattened kernel cannot annotate.
    state = jax.jit(create, out_shardings=exp.state_sharding)()
    memory = exp.partitioner.init_memory(exp.mcfg, exp.config.train.batch_size)
    # bf16 compute must not leak into the master weights or Adam's moments.
    wrong = [leaf.dtype for leaf in jax.tree_util.tree_leaves((state.params, state.opt_state))
             if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != jnp.float32]
    if wrong:
        raise TypeError(f'parameters/optimizer state must be float32, found {set(wrong)}')
    return state, memory


def abstract_state(exp: Experiment) -> tuple[Any, Any]:
    """Shapes, dtypes and current-mesh shardings of the train state and memory.

    Restoring into these re-shards a checkpoint saved on any other mesh onto this one.
    """
    shapes = jax.eval_shape(lambda: init_state(exp))
    shardings = (exp.state_sharding, exp.memory_sharding)
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def make_steps(exp: Experiment) -> tuple[Callable, Callable]:
    """Train and eval steps jitted over the mesh, with explicit shardings.

    The train step donates the state and the memory: orbax's save copies every array to the
    host before it returns, so the asynchronous write never reads a donated buffer.
    """
    p = exp.partitioner
    train_step = p.jit(
        train_step_lib.train_step_fn(exp.model, exp.tx, exp.schedule,
                                     train_step_lib.memory_batch_axes(exp.mcfg),
                                     exp.config.train.grad_accum_steps),
        in_shardings=(exp.state_sharding, exp.memory_sharding, p.batch),
        out_shardings=(exp.state_sharding, exp.memory_sharding, p.replicated),
        donate_argnums=(0, 1))
    eval_memory = p.memory(exp.eval_mcfg, config_lib.eval_setting(exp.config, 'batch_size'))
    eval_step = p.jit(
        train_step_lib.eval_step_fn(exp.eval_model),
        in_shardings=(exp.state_sharding.params, eval_memory, p.batch),
        out_shardings=(eval_memory, p.replicated), donate_argnums=(1,))
    return train_step, eval_step


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(workdir, 'checkpoints')


def write_json(path: str, payload: Any) -> None:
    if jax.process_index() == 0:
        with open(path, 'w') as f:
            json.dump(payload, f, indent=2, sort_keys=True)


class _Interval:
    """Per-update metrics since the last report, kept on device until they are needed."""

    def __init__(self, first_step: int):
        self.first_step = first_step
        self.parts = []
        self.start_time = time.time()

    def add(self, step_metrics: dict) -> None:
        self.parts.append(step_metrics)

    def collect(self) -> dict:
        return {k: np.concatenate([np.asarray(p[k], np.float64) for p in self.parts])
                for k in self.parts[0]}

    def check_finite(self, values: dict, last_checkpoint: Optional[str]) -> None:
        bad = ~(np.isfinite(values['nll_sum']) & np.isfinite(values['grad_norm']))
        if bad.any():
            index = int(np.argmax(bad))
            raise NonFiniteLossError(
                f'non-finite loss or gradient at step {self.first_step + index + 1} '
                f'(NLL sum {values["nll_sum"][index]}, gradient norm {values["grad_norm"][index]}, '
                f'learning rate {values["learning_rate"][index]:.3e}). Nothing after it was saved; '
                f'the last good checkpoint is {last_checkpoint or "none (no checkpoint yet)"}. '
                'Lower config.train.learning_rate or config.train.clip_norm, or use float32 '
                'compute (config.model.compute_dtype).')


def _log_interval(exp: Experiment, interval: _Interval, values: dict, step: int,
                  writer: metrics_lib.MetricWriter) -> float:
    """Writes the interval's train scalars and the progress line; returns its token count."""
    tcfg = exp.config.train
    seconds = max(time.time() - interval.start_time, 1e-9)
    tokens = float(values['num_tokens'].sum())  # Global: summed over the sharded batch.
    mean_nll = float(values['nll_sum'].sum() / max(values['num_tokens'].sum(), 1.0))
    scalars = {
        'loss': mean_nll,
        metrics_lib.metric_name(exp.unit): metrics_lib.metric_value(mean_nll, exp.unit),
        'tokens_per_s': tokens / seconds,
        'learning_rate': float(values['learning_rate'][-1]),
        'grad_norm': float(values['grad_norm'].mean()),
    }
    writer.write_scalars(step, 'train', scalars)
    eta = (tcfg.num_steps - step) * seconds / max(step - interval.first_step, 1)
    logging.info(metrics_lib.progress_line(step, tcfg.num_steps, scalars, exp.unit, eta))
    return tokens


def _validate(exp: Experiment, eval_step: Callable, params: Any, streams: pipeline.LMStreams,
              max_batches: int, step: int, writer: metrics_lib.MetricWriter) -> dict:
    """Scores the validation streams and reports them under the 'valid' prefix."""
    result = evaluation.evaluate_streams(eval_step, params, exp.eval_mcfg, streams,
                                         evaluation.local_eval_batch(exp.config), max_batches,
                                         exp.partitioner)
    name = metrics_lib.metric_name(exp.unit)
    scalars = {'loss': result.mean_nll, name: metrics_lib.metric_value(result.mean_nll, exp.unit),
               'num_tokens': result.num_tokens}
    writer.write_scalars(step, 'valid', scalars)
    metrics_lib.log_eval(step, 'validation', result.mean_nll, result.num_tokens, exp.unit)
    return scalars


def _restore_or_init(exp: Experiment, ckpt: checkpointing.Checkpointer,
                     iterator: Any) -> tuple[train_step_lib.TrainState, Any, Optional[str]]:
    """State, memory and data position of the newest intact checkpoint, else fresh ones."""
    restored = ckpt.restore_latest(*abstract_state(exp), quarantine=True)
    if restored is None:
        return *init_state(exp), None
    iterator.set_state(restored.data_state)
    logging.info('Resumed from %s (step %d).', ckpt.step_dir(restored.step), restored.step)
    return restored.state, restored.memory, ckpt.step_dir(restored.step)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains (resuming from the newest intact checkpoint in workdir) and validates.

    Returns the final summary (also written to `<workdir>/train_summary.json`). On a
    preemption (SIGTERM, or JAX's preemption sync point) it checkpoints the next step
    boundary and returns `{'step', 'preempted': True, 'checkpoint', 'wall_seconds'}`
    without the final validation, which the resumed run does.
    """
    wall_start = time.time()
    exp = setup(config, workdir)
    tcfg = exp.config.train
    write_json(os.path.join(workdir, 'config.json'), exp.config.to_dict())

    with distributed.primary_first('token streams'):  # Prepared data and token caches.
        train_streams = pipeline.LMStreams(
            exp.config.data, 'train', exp.tokenizer, batch_size=tcfg.batch_size,
            tgt_len=tcfg.tgt_len, segments_per_batch=tcfg.segments_per_step, repeat=True,
            process_index=jax.process_index(), process_count=jax.process_count())
        valid_streams = evaluation.eval_streams(exp.config, exp.tokenizer, 'validation')
    iterator = train_streams.iterator()

    ckpt = checkpointing.Checkpointer(checkpoint_dir(workdir), tcfg.keep_checkpoints)
    state, memory, last_checkpoint = _restore_or_init(exp, ckpt, iterator)
    step = int(state.step)

    train_step, eval_step = make_steps(exp)
    writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0)
    metric = metrics_lib.metric_name(exp.unit)
    interval = _Interval(step)
    # Throughput counts neither the compiling first dispatch nor periodic validation.
    logged_tokens, compile_tokens, steady_start, eval_seconds = 0.0, 0.0, None, 0.0
    watch, preempted = preemption.PreemptionWatch(), False
    try:
        while step < tcfg.num_steps:
            state, memory, step_metrics = train_step(
                state, memory, exp.partitioner.global_batch(next(iterator)))
            previous_step, step = step, step + tcfg.segments_per_step
            interval.add(step_metrics)
            if steady_start is None:
                # The first dispatch compiles: throughput is timed from its end.
                jax.block_until_ready(step_metrics)
                steady_start = time.time()
                compile_tokens = float(np.sum(step_metrics['num_tokens']))
                logging.info('First %d updates, with compilation, took %.1fs.',
                             tcfg.segments_per_step, steady_start - interval.start_time)

            is_last = step == tcfg.num_steps
            preempted = watch.reached(previous_step, step)
            due = lambda every: every > 0 and step % every == 0
            save = due(tcfg.checkpoint_every) or is_last or preempted
            evaluate = due(tcfg.eval_every) and not (is_last or preempted)
            if not (due(tcfg.log_every) or save or evaluate):
                continue
            if interval.parts:
                values = interval.collect()
                # Before any save: a NaN state must never become a checkpoint.
                interval.check_finite(values, last_checkpoint)
                logged_tokens += _log_interval(exp, interval, values, step, writer)
            if save:
                ckpt.save(step, state, memory, iterator.get_state())
                last_checkpoint = ckpt.step_dir(step)
            if preempted:
                break
            if evaluate:
                eval_start = time.time()
                _validate(exp, eval_step, state.params, valid_streams, tcfg.eval_batches, step,
                          writer)
                eval_seconds += time.time() - eval_start
            interval = _Interval(step)
        if not preempted:
            train_seconds = (time.time() - steady_start - eval_seconds) if steady_start else 0.0
            final = _validate(exp, eval_step, state.params, valid_streams, -1, step, writer)
    finally:
        watch.close()
        ckpt.wait()
        ckpt.close()
        writer.close()
    if preempted:
        logging.warning('Preempted: saved %s; run the same command again to resume.',
                        last_checkpoint)
        return {'step': step, 'preempted': True, 'checkpoint': last_checkpoint,
                'wall_seconds': time.time() - wall_start}

    summary = {
        'step': step,
        'valid_loss': final['loss'],
        f'valid_{metric}': final[metric],
        'valid_tokens': final['num_tokens'],
        'train_tokens_per_s': ((logged_tokens - compile_tokens) / train_seconds
                               if train_seconds > 0 else None),
        'wall_seconds': time.time() - wall_start,
    }
    write_json(os.path.join(workdir, 'train_summary.json'), summary)
    logging.info('Done: %s', json.dumps(summary))
    return summary
