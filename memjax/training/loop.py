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

from memjax.training import checkpoints as checkpointing
from memjax import config_lib
from memjax.runtime import distributed
from memjax import early_sigterm
from memjax import errors
from memjax.training import resume
from memjax.training import workdir as workdir_lib
from memjax.training import evaluation
from memjax.training import metrics as metrics_lib
from memjax import model as model_lib
from memjax.model import memories
from memjax.training import optim
from memjax.training import preemption
from memjax.runtime import sharding
from memjax.runtime import logs
from memjax.runtime import peer_watch
from memjax.runtime import storage
from memjax.training import step as train_step_lib
from memjax.data import factory as data_factory
from memjax.data import pipeline
from memjax.data import tokenizers
from memjax.convert import hf_gpt2


@dataclasses.dataclass
class Experiment:
    """Everything derived from the resolved run before any compilation."""
    run: config_lib.RunConfig  # With the tokenizer's vocabulary size.
    tokenizer: Any
    model: model_lib.MemoryLM  # Phase 0; make_train_step builds the others.
    eval_model: model_lib.MemoryLM  # Same parameters, run with run.eval_model.
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    local_batch: int
    partitioner: sharding.Partitioner
    state_sharding: Any  # TrainState of NamedShardings.
    memory_sharding: Any  # Of the global training memory.

    @property
    def mcfg(self) -> model_lib.ModelConfig:
        return self.run.model

    @property
    def eval_mcfg(self) -> model_lib.ModelConfig:
        return self.run.eval_model

    @property
    def config(self) -> ml_collections.ConfigDict:
        """The run's config as the workdir saves it (vocabulary size filled in)."""
        return self.run.as_config_dict()

    @property
    def unit(self) -> str:
        return self.tokenizer.unit


def resolved(config: ml_collections.ConfigDict | config_lib.RunConfig, device_count: int) -> config_lib.RunConfig:
    """A library caller's config resolved here (the commands resolve theirs at the entry)."""
    if isinstance(config, config_lib.RunConfig):
        return config
    return config_lib.resolve(config, jax.process_count(), device_count)


def check_saved_config(run: config_lib.RunConfig, workdir: str, training: bool) -> None:
    """Compares `run` with the one the workdir's newest readable checkpoint was saved with.

    Training refuses changes to fields that shape the saved state or the data stream;
    evaluation refuses changes that shape the parameters (memjax/training/resume.py). Runs before
    the tokenizer is built, anything is restored or compiled.
    """
    directory = checkpoint_dir(workdir)
    if not checkpointing.has_checkpoints(directory):
        return
    ckpt = checkpointing.Checkpointer(directory, keep=1, read_only=True)
    try:
        step, saved = _saved_config(ckpt)
    finally:
        ckpt.close()
    if saved is None:
        return
    if training:
        resume.check_resume(saved, run.source, workdir, source=ckpt.step_dir(step))
    else:
        resume.check_same_params(saved, run.source, ckpt.step_dir(step), 'Evaluation')


def _saved_config(ckpt: checkpointing.Checkpointer,
                  step: Optional[int] = None) -> tuple[Optional[int], Optional[dict]]:
    """(step, the config saved with it) of `step`, else of the newest checkpoint whose JSON item
    reads back; (None, None) when there is none. Checkpoints written before configs were
    stored in them fall back to their workdir's config.json."""
    read = lambda s: (s, ckpt.meta(s))
    found = read(step) if step is not None else ckpt.latest_intact(read)
    if found is None:
        return None, None
    step, meta = found
    return step, meta.get('config') or read_json(
        storage.join(ckpt.directory.rpartition('/')[0], CONFIG_FILE))


def setup(config: ml_collections.ConfigDict | config_lib.RunConfig, workdir: str,
          devices: Optional[list[jax.Device]] = None, training: bool = True) -> Experiment:
    """Checks the run against the workdir's saved one, builds (or loads) the tokenizer and the
    model; compiles nothing.

    The mesh spans `devices` (default: every device of every process). For evaluation
    (`training=False`) the workdir must exist and nothing is written into it.
    """
    devices = jax.devices() if devices is None else devices
    run = resolved(config, len(devices))
    unseen = memories.unseen_distances(run.model, run.eval_model)
    if unseen:
        logging.warning(unseen)
    workdir_lib.check(workdir, create=training)
    check_saved_config(run, workdir, training)
    with distributed.primary_first('tokenizer'):
        tokenizer = data_factory.build_tokenizer(run.data, workdir, save=training)
    distributed.assert_same_on_all_processes(tokenizer.fingerprint, 'the tokenizer')
    run = run.with_vocab_size(tokenizer.vocab_size)
    tx = optim.make_optimizer(run.train)
    # Built once; deriving the shardings here rejects splits that do not divide before compiling.
    partitioner = sharding.Partitioner.from_config(run.mesh, devices)
    exp = Experiment(
        run=run, tokenizer=tokenizer,
        model=model_lib.build_model(run.model), eval_model=model_lib.build_model(run.eval_model),
        tx=tx, schedule=optim.learning_rate_schedule(run.train),
        local_batch=run.train.batch_size // jax.process_count(), partitioner=partitioner,
        state_sharding=train_step_lib.state_shardings(partitioner, run.model, tx),
        memory_sharding=partitioner.memory(run.model, run.train.batch_size))
    check_fits(exp, training, devices)
    return exp


def _bytes_per_device(tree: Any) -> int:
    """The largest shard of each leaf summed: what one device holds of `tree` (abstract arrays
    with shardings)."""
    shard = lambda leaf: leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    return sum(int(np.prod(shard(leaf))) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


def device_memory_bytes(device: jax.Device) -> int:
    """What one device may hold: its allocator's limit, or on the CPU the host's memory shared by
    its CPU devices."""
    limit = (device.memory_stats() or {}).get('bytes_limit')
    if limit:
        return int(limit)
    host = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    return host // max(1, len([d for d in jax.local_devices() if d.platform == device.platform]))


def state_bytes(exp: Experiment, training: bool, batch: Optional[int] = None) -> dict[str, int]:
    """Bytes one device holds of the state: training's parameters, optimizer state and memory, or
    evaluation's parameters and memory (config.eval's memory; its batch, or `batch` rows held on
    one device, as generation's samples are)."""
    state, memory = abstract_state(exp)
    if not training and batch is not None:
        memory = jax.eval_shape(lambda: model_lib.init_memory(exp.eval_mcfg, batch))
    elif not training:
        shapes = jax.eval_shape(lambda: model_lib.init_memory(exp.eval_mcfg, exp.run.eval.batch_size))
        memory = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                                        exp.partitioner.memory(exp.eval_mcfg, exp.run.eval.batch_size))
    held = {'parameters': state.params, 'optimizer state': state.opt_state if training else (), 'memory': memory}
    return {name: _bytes_per_device(tree) for name, tree in held.items()}


def check_fits(exp: Experiment, training: bool, devices: list[jax.Device], batch: Optional[int] = None,
               extra: Optional[dict[str, int]] = None) -> None:
    """Raises OutOfMemoryError before anything is built when the state alone exceeds a device's
    memory: a mem_len or batch off by orders of magnitude, found in a second instead of at the
    first allocation. `batch` and `extra` (name -> bytes): generation's samples and buffers."""
    need = {**state_bytes(exp, training, batch), **(extra or {})}
    # One of this process's own: another process's device cannot be asked (GPU, TPU).
    have = device_memory_bytes(next(d for d in devices if d.process_index == jax.process_index()))
    if sum(need.values()) > have:
        gib = lambda n: f'{n / 2**30:,.1f} GiB' if n >= 2**30 else f'{n / 2**20:,.1f} MiB'
        parts = ', '.join(f'{name} {gib(n)}' for name, n in need.items() if n)
        mcfg = exp.mcfg if training else exp.eval_mcfg
        batch = batch or (exp.run.train.batch_size if training else exp.run.eval.batch_size)
        raise errors.OutOfMemoryError(
            f'the {"training" if training else "evaluation"} state needs {gib(sum(need.values()))} per device '
            f'({parts}; mem_len={mcfg.mem_len}, batch {batch}), more than a device\'s {gib(have)}: lower '
            'mem_len or the batch size, shrink the model, or shard it over more devices (config.mesh).')


def init_state(exp: Experiment, params: Any = None) -> tuple[train_step_lib.TrainState, Any]:
    """Step 0 with fresh (or the given) float32 parameters, fresh optimizer state and an empty
    memory, created in their shards."""

    def create(params):
        init_key, dropout_key = jax.random.split(jax.random.PRNGKey(exp.run.seed))
        if params is None:
            params = model_lib.init_params(exp.mcfg, init_key)
        return train_step_lib.TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=exp.tx.init(params),
            rng=dropout_key)

    state = jax.jit(create, out_shardings=exp.state_sharding)(params)
    memory = exp.partitioner.init_memory(exp.mcfg, exp.run.train.batch_size)
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
    shapes = jax.eval_shape(lambda params: init_state(exp, params), model_lib.abstract_params(exp.mcfg))
    shardings = (exp.state_sharding, exp.memory_sharding)
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def newest_params(exp: Experiment, workdir: str) -> tuple[int, Any]:
    """(step, parameters) of the workdir's newest intact checkpoint, placed on the current mesh.

    Only the parameters: the memory and optimizer state may have other shapes here (another batch
    size or mem_len for evaluation) and are not needed.
    """
    directory = checkpoint_dir(workdir)
    found = None
    if checkpointing.has_checkpoints(directory):
        wanted = abstract_state(exp)[0].params
        ckpt = checkpointing.Checkpointer(directory, keep=1, read_only=True)
        try:
            found = ckpt.latest_intact(lambda step: (step, _params_in_layout(ckpt, step, wanted, exp.mcfg.scan_layers)))
        finally:
            ckpt.close()
    if found is None:
        why = ('every step there failed to restore (the log names each)' if checkpointing.has_checkpoints(directory)
               else 'there is none')
        damaged = f'{directory}_damaged'
        aside = f'; {damaged} holds the damaged steps a training start set aside' if storage.listdir(damaged) else ''
        raise errors.CheckpointError(f'no readable checkpoint in {directory}: {why}{aside}. Train first with '
                                     f'python -m memjax.train --workdir={workdir} ...')
    return found


def _params_in_layout(ckpt: checkpointing.Checkpointer, step: int, wanted: Any, scan_layers: bool) -> Any:
    """The step's parameters as `wanted` lays them out, saved with the layers stacked or not: the
    layout is a choice of compilation (configs/*_large.py scan their layers), so a run evaluates
    with either, e.g. an imported original model (one subtree per layer) with a large config."""
    saved_scanned = any(name.startswith('state.params.layers.') for name in ckpt.saved_shapes(step))
    if saved_scanned == scan_layers:
        return ckpt.restore_part(step, {'state': {'params': wanted}})['state']['params']
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), wanted)
    saved = jax.eval_shape(lambda p: model_lib.convert_layer_layout(p, saved_scanned), shapes)
    params = ckpt.restore_part(step, {'state': {'params': saved}})['state']['params']
    shardings = jax.tree.map(lambda x: x.sharding, wanted)
    return jax.device_put(model_lib.convert_layer_layout(params, scan_layers), shardings)


def saved_config(workdir: str) -> ml_collections.ConfigDict:
    """The config the workdir's newest readable checkpoint was saved with."""
    workdir_lib.check(workdir, create=False)
    directory = checkpoint_dir(workdir)
    saved = None
    if checkpointing.has_checkpoints(directory):
        ckpt = checkpointing.Checkpointer(directory, keep=1, read_only=True)
        try:
            saved = _saved_config(ckpt)[1]
        finally:
            ckpt.close()
    if saved is None:
        raise errors.CheckpointError(f'no readable checkpoint with its config in {directory}: train first with '
                                     f'python -m memjax.train --workdir={workdir} ..., or pass --config.')
    return config_lib.from_saved(saved)


def write_imported(model: model_lib.ModelConfig, params: Any, tokenizer: tokenizers.Tokenizer, workdir: str) -> None:
    """A new workdir holding imported parameters as its step 0, with their tokenizer: evaluate and
    generate read it as any other; training with config.train.init_from=<it> fine-tunes them.

    Its config is the base config with this model, the tokenizer's kind and the model's segment
    length; evaluation settings and data are given when evaluating.
    """
    if storage.listdir(workdir):
        raise errors.WorkdirError(f'{workdir} is not empty: import into a new workdir (nothing there is changed).')
    config = config_lib.base_config()
    config.model.update(model.as_dict())
    config.data.tokenizer = tokenizer.kind
    config.train.tgt_len = model.segment_len
    workdir_lib.check(workdir, create=True)
    try:
        _write_imported(config, params, tokenizer, workdir)
    except (errors.UserError, OSError) as error:  # A full disk: a half-written workdir resumes nothing.
        storage.path(workdir).rmtree(missing_ok=True)
        raise errors.CheckpointError(f'importing into {workdir} failed ({" ".join(str(error).split())[:300]}); the '
                                     'half-written workdir was removed: free some space or fix the permissions '
                                     'there, and run the import again.') from error


def _write_imported(config: ml_collections.ConfigDict, params: Any, tokenizer: tokenizers.Tokenizer,
                    workdir: str) -> None:
    tokenizer.save(workdir)  # Adopted by setup as the run's own.
    with workdir_lib.RunLock(workdir):
        exp = setup(config, workdir)
        state, memory = init_state(exp, model_lib.convert_layer_layout(params, exp.mcfg.scan_layers))
        write_json(storage.join(workdir, CONFIG_FILE), exp.run.source)
        ckpt = checkpointing.Checkpointer(checkpoint_dir(workdir), keep=1)
        try:
            ckpt.save(0, state, memory, None, exp.run.source)
            ckpt.wait()
        finally:
            ckpt.close()


def make_train_step(exp: Experiment, phase: int = 0) -> Callable:
    """The train step of training phase `phase`, jitted over the mesh with explicit shardings.

    It donates the state and the memory: orbax's save copies every array to the host before it
    returns, so the asynchronous write never reads a donated buffer.
    """
    p = exp.partitioner
    return p.jit(
        train_step_lib.train_step_fn(model_lib.build_model(exp.mcfg, phase), exp.tx, exp.schedule,
                                     train_step_lib.memory_batch_axes(exp.mcfg),
                                     exp.run.train.grad_accum_steps),
        in_shardings=(exp.state_sharding, exp.memory_sharding, p.batch),
        out_shardings=(exp.state_sharding, exp.memory_sharding, p.replicated),
        donate_argnums=(0, 1))


def make_eval_step(exp: Experiment) -> Callable:
    """`(params, memory, batch, key) -> (memory, metrics)` jitted over the mesh."""
    p = exp.partitioner
    eval_memory = p.memory(exp.eval_mcfg, exp.run.eval.batch_size)
    return p.jit(
        train_step_lib.eval_step_fn(exp.eval_model, accuracy=exp.run.eval.accuracy),
        in_shardings=(exp.state_sharding.params, eval_memory, p.batch, p.replicated),
        out_shardings=(eval_memory, p.replicated), donate_argnums=(1,))


def first_updates(count: int) -> str:
    return 'the first update' if count == 1 else f'the first {count} updates'


class _PhasedTrainStep:
    """Calls the train step of the phase the memory kind gives the current step; each phase's
    step compiles on first use (a kind without phases has one)."""

    def __init__(self, exp: Experiment):
        self.exp, self.steps = exp, {}

    def compiles(self, step: int) -> bool:
        """Whether the update from `step` compiles (its phase's first), announced in one line."""
        phase = self.exp.model.kind.phase(step)
        if phase in self.steps:
            return False
        updates = first_updates(self.exp.run.train.segments_per_step)
        if self.steps:  # Skip-Retain's phase 2.
            logging.info('Step %d starts training phase %d (config.model.skip_until: no layer skipped from here): '
                         'compiling its training step; %s of the phase include it, and speeds count from after '
                         'them.', step, phase + 1, updates)
        else:
            logging.info('Compiling the training step%s: %s include it.',
                         f' of phase {phase + 1}' if self.exp.model.kind.phase_starts else '', updates)
        return True

    def __call__(self, step: int, *args):
        phase = self.exp.model.kind.phase(step)
        if phase not in self.steps:
            self.steps[phase] = make_train_step(self.exp, phase)
        return self.steps[phase](*args)


CONFIG_FILE = 'config.json'


def checkpoint_dir(workdir: str) -> str:
    return storage.join(workdir, 'checkpoints')


def write_json(path: str, payload: Any) -> None:
    """Process 0 replaces `path` (a file or gs:// object) whole."""
    if jax.process_index() == 0:
        storage.write_text(path, json.dumps(payload, indent=2, sort_keys=True))


HISTORY_FILE = 'results_history.jsonl'


def write_result(path: str, payload: dict, history: bool = True) -> None:
    """Writes `path`, the latest result of its kind (a run's summary, an evaluation), and appends it
    as one line to results_history.jsonl beside it (`history`): a rerun with other settings replaces
    the file, never the record of the results before it. A failed write loses nothing: the result
    goes to stdout and a kept copy (storage.write_result) before the one-line error."""
    if jax.process_index() != 0:
        return
    storage.write_result(path, json.dumps(payload, indent=2, sort_keys=True))
    if history:
        folder, name = path.rpartition('/')[0], path.rpartition('/')[2]
        record = storage.join(folder, HISTORY_FILE) if folder else HISTORY_FILE
        line = json.dumps({'file': name, 'written': time.strftime('%Y-%m-%d %H:%M:%S'), **payload}, sort_keys=True)
        try:
            storage.append_text(record, line + '\n')
        except (OSError, ValueError) as error:  # The result itself is written; its record is not worth a run.
            logging.warning('Could not add the result to %s (%s: %s).', record, type(error).__name__, error)


def read_json(path: str) -> Optional[Any]:
    """The JSON in `path`, or None when it is missing or unreadable."""
    text = storage.read_text(path)
    try:
        return None if text is None else json.loads(text)
    except ValueError:
        return None


class _Interval:
    """Per-update metrics since the last report, kept on device until they are needed."""

    def __init__(self, first_step: int):
        self.first_step = first_step
        self.parts = []
        self.start_time = time.time()
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
                raise _diverged(f'training loss {loss[index]:.4g}', self.first_step + index + 1,
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


def _diverged(what: str, step: int, limit: float, last_checkpoint: Optional[str]) -> errors.DivergedError:
    return errors.DivergedError(
        f'the run diverged: {what} at step {step} exceeds config.train.diverged_loss ({limit:.4g} '
        f'nats; -1 is 3 ln(vocab_size)). Nothing after it was saved; the last good checkpoint is '
        f'{last_checkpoint or "none (no checkpoint yet)"}. Lower config.train.learning_rate or '
        'config.train.clip_norm and resume, or raise the limit (0: off) if this loss is expected.')


def _log_interval(exp: Experiment, interval: _Interval, values: dict, step: int,
                  writer: metrics_lib.MetricWriter) -> float:
    """Writes the interval's train scalars and the progress line; returns its token count."""
    tcfg = exp.run.train
    seconds = max(time.time() - interval.start_time, 1e-9)
    tokens = float(values['num_tokens'].sum())  # Global: summed over the sharded batch.
    timed = step > interval.first_step  # Not an interval of the compiling dispatch alone.
    mean_nll = float(values['nll_sum'].sum() / max(values['num_tokens'].sum(), 1.0))
    scalars = {
        'loss': mean_nll,
        metrics_lib.metric_name(exp.unit): metrics_lib.metric_value(mean_nll, exp.unit),
        **({'tokens_per_s': (tokens - interval.untimed_tokens) / seconds} if timed else {}),
        'learning_rate': float(values['learning_rate'][-1]),
        'grad_norm': float(values['grad_norm'].mean()),
        # The memory kind's auxiliary losses, per scored token like the loss.
        **{'aux/' + k[len(train_step_lib.AUX_PREFIX):]: float(v.sum() / max(values['num_tokens'].sum(), 1.0))
           for k, v in values.items() if k.startswith(train_step_lib.AUX_PREFIX)},
    }
    writer.write_scalars(step, 'train', scalars)
    eta = (tcfg.num_steps - step) * seconds / (step - interval.first_step) if timed else None
    logging.info(metrics_lib.progress_line(step, tcfg.num_steps, scalars, exp.unit, eta))
    return tokens


def _validate(exp: Experiment, eval_step: Callable, params: Any, streams: pipeline.LMStreams,
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


def _init_from(exp: Experiment) -> tuple[train_step_lib.TrainState, Any]:
    """A fresh start from the parameters (and optionally optimizer state and step) of
    `config.train.init_from`: a workdir, its checkpoints/ folder or one step's folder.

    The data stream and the memory start afresh, so the batch size, the segment length, the
    data or the memory length may differ from the source run; the parameters must fit.
    """
    tcfg = exp.run.train
    if hf_gpt2.is_checkpoint_dir(tcfg.init_from):
        return _init_from_gpt2(exp)
    source, step = _init_from_dir(tcfg.init_from)
    if not checkpointing.has_checkpoints(source):
        raise errors.CheckpointError(
            f'config.train.init_from={tcfg.init_from}: no checkpoints there; name a training '
            'workdir, its checkpoints/ folder or one of its step folders.')
    ckpt = checkpointing.Checkpointer(source, keep=1, read_only=True)
    try:
        if step is not None and step not in ckpt.all_steps():
            raise errors.CheckpointError(f'config.train.init_from={tcfg.init_from}: {source} has '
                                         f'no step {step} (it has {ckpt.all_steps()}).')
        step, saved = _saved_config(ckpt, step)
        if step is None:
            raise errors.CheckpointError(f'config.train.init_from={tcfg.init_from}: no readable '
                                         'checkpoint there.')
        if saved is not None:
            resume.check_same_params(saved, exp.run.source, ckpt.step_dir(step),
                                     'config.train.init_from')
        keep_optimizer = tcfg.init_from_state == 'params_and_optimizer'
        abstract = abstract_state(exp)[0]
        if keep_optimizer:
            state = ckpt.restore_part(step, {'state': abstract})['state']
        else:
            params = ckpt.restore_part(step, {'state': {'params': abstract.params}})
            state, _ = init_state(exp, params['state']['params'])
    finally:
        ckpt.close()
    logging.info('Started from %s of %s (%s); fresh data stream and memory.',
                 'parameters and optimizer state' if keep_optimizer else 'parameters',
                 ckpt.step_dir(step), f'step {int(state.step)}')
    return state, exp.partitioner.init_memory(exp.mcfg, tcfg.batch_size)


def _init_from_gpt2(exp: Experiment) -> tuple[train_step_lib.TrainState, Any]:
    """A fresh start from pretrained HF GPT-2 weights: every parameter GPT-2 has is taken from it,
    the memory kind's own (the infinity-former's LTM) start from their initialisation."""
    path = exp.run.train.init_from
    try:
        gpt2_config, pretrained = hf_gpt2.load_hf_checkpoint(os.path.expanduser(path))
    except hf_gpt2.CheckpointError as error:
        raise errors.CheckpointError(f'config.train.init_from={path}: {error}') from None
    differ = [f'{name}={getattr(gpt2_config, name)} (config: {getattr(exp.mcfg, name)})'
              for name in ('vocab_size', 'd_model', 'n_layer', 'n_head', 'd_head', 'd_inner', 'n_positions',
                           'block', 'positions', 'pre_lnorm')
              if getattr(gpt2_config, name) != getattr(exp.mcfg, name)]
    if differ:
        raise errors.CheckpointError(f'config.train.init_from={path} is a GPT-2 with {", ".join(differ)}: '
                                     'set config.model to match it.')
    fresh = model_lib.init_params(exp.mcfg, jax.random.split(jax.random.PRNGKey(exp.run.seed))[0])
    pretrained = model_lib.convert_layer_layout(
        model_lib.convert_layer_layout(pretrained, scan_layers=False), exp.mcfg.scan_layers)
    params = hf_gpt2.extend(fresh, pretrained)
    logging.info('Started from the GPT-2 weights in %s; the memory\'s own parameters are new.', path)
    return init_state(exp, params)[0], exp.partitioner.init_memory(exp.mcfg, exp.run.train.batch_size)


def _log_start(exp: Experiment, workdir: str, params: Any) -> None:
    """What the run is (`params`: their shapes), before the data and the parameters are prepared,
    which can take a while."""
    mcfg, tcfg, devices = exp.mcfg, exp.run.train, jax.devices()
    logging.info('Model: %s, %s parameters; %d %s device(s); batches of %d x %d tokens, %d steps.',
                 memories.describe(mcfg), f'{sum(x.size for x in jax.tree_util.tree_leaves(params)):,}', len(devices),
                 devices[0].platform.upper(), tcfg.batch_size, tcfg.tgt_len, tcfg.num_steps)
    logging.info('Mesh %s; Adam at %g, %d warmup steps, %s decay to %g x, clip %g; validation every %s, '
                 'checkpoints every %s in %s, TensorBoard in %s.',
                 ' x '.join(f'{name} {size}' for name, size in exp.run.mesh.shape(len(devices)).items()),
                 tcfg.learning_rate, tcfg.warmup_steps, tcfg.decay, tcfg.min_lr_ratio, tcfg.clip_norm,
                 f'{tcfg.eval_every} steps' if tcfg.eval_every else 'run (at the end)',
                 f'{tcfg.checkpoint_every} steps' if tcfg.checkpoint_every else 'run (at the end)',
                 checkpoint_dir(workdir), storage.join(workdir, 'tensorboard'))


def _restore_or_init(exp: Experiment, ckpt: checkpointing.Checkpointer, iterator: Any, data: Optional[dict],
                     abstract: Optional[tuple[Any, Any]] = None
                     ) -> tuple[train_step_lib.TrainState, Any, Optional[str]]:
    """State, memory and data position of the newest intact checkpoint, else a start from
    config.train.init_from, else fresh ones. `data`: the training data's fingerprint now;
    `abstract`: abstract_state(exp), when the caller has it."""
    restored = ckpt.restore_latest(*(abstract or abstract_state(exp)), quarantine=True)
    if restored is None:
        _refuse_to_start_over(ckpt)
        if exp.run.train.init_from:
            return *_init_from(exp), None
        logging.info('Starting at step 0: compiling the initialiser of the parameters and optimizer state.')
        return *init_state(exp), None
    _check_same_data(restored.data, data, ckpt.step_dir(restored.step), exp.run.data.accept_changed_data)
    iterator.set_state(restored.data_state)
    logging.info('Resumed from %s (step %d).', ckpt.step_dir(restored.step), restored.step)
    return restored.state, restored.memory, ckpt.step_dir(restored.step)


def _check_same_data(saved: Optional[dict], now: Optional[dict], source: str, accept_changed_data: bool) -> None:
    """A resumed run reads the data it was trained on: other token ids are refused like another
    config (its data position and memory belong to the old text), unless
    config.data.accept_changed_data says the change is intended."""
    if saved is None or now is None:
        return  # Saved before memjax kept the fingerprint, or generated data (the config says all).
    if saved['tokens'] == now['tokens']:
        if saved['source'] != now['source']:
            logging.info('The training data was prepared again (%s -> %s) and reads as the same token ids.',
                         saved['source'], now['source'])
        return
    change = (f'its training data changed since {source} was saved ({saved["source"]}, tokens '
              f'{saved["tokens"]} -> {now["source"]}, tokens {now["tokens"]})')
    if accept_changed_data:
        logging.warning('Resuming although %s: config.data.accept_changed_data=True; the run continues '
                        'at its position in the new data.', change)
        return
    raise errors.DataError(
        f'this run cannot resume on other data: {change}. Put back the data it was trained on, or, '
        'if the change is intended, add --config.data.accept_changed_data=True (the run continues '
        'at its position in the new data), or start a new --workdir.')


def _refuse_to_start_over(ckpt: checkpointing.Checkpointer) -> None:
    """A workdir whose every checkpoint is damaged holds a run's work: starting it over from step 0
    must be the user's decision, so the run stops (this time and every next time) until the
    damaged steps are moved away."""
    folder = ckpt.quarantine_dir
    moved = sorted(storage.listdir(folder), key=lambda n: [int(p) for p in n.split('.') if p.isdigit()])
    if not moved:
        return
    what = (f'steps {", ".join(map(str, sorted(ckpt.damaged)))} are damaged (the warnings above say how) and '
            f'were moved to {folder}' if ckpt.damaged else
            f'{folder} holds the damaged steps {", ".join(moved)} an earlier start moved there')
    raise errors.CheckpointError(
        f'{ckpt.directory} has no intact checkpoint: {what}. Nothing was started over them. To '
        f'start this run afresh on purpose, move {folder} away (or use another --workdir) and run '
        'the same command again.')


def train_and_evaluate(config: ml_collections.ConfigDict | config_lib.RunConfig, workdir: str) -> dict:
    """Trains (resuming from the newest intact checkpoint in workdir) and validates.

    Returns the final summary (also written to `<workdir>/train_summary.json`). On a
    preemption (SIGTERM, or JAX's preemption sync point) it checkpoints the next step
    boundary and returns `{'step', 'preempted': True, 'checkpoint', 'wall_seconds'}`
    without the final validation, which the resumed run does.
    """
    # A refused config leaves no trace: checked before the workdir is created.
    run = resolved(config, jax.device_count())
    workdir_lib.check(workdir, create=True)
    with logs.log_to_workdir(workdir, jax.process_index()):
        return _train_locked(run, workdir)


def _train_locked(run: config_lib.RunConfig, workdir: str) -> dict:
    # One training run per workdir: process 0 holds the lock for all processes of a run, and
    # all of them stop when it cannot (the others would wait for it at the next barrier).
    lock = workdir_lib.RunLock(workdir) if jax.process_index() == 0 else None
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
            _adopt_tokenizer(run.train.init_from, workdir)
            return _train(run, workdir)
        finally:
            forget()
            release()


def _init_from_dir(init_from: str) -> tuple[str, Optional[int]]:
    """(checkpoints folder, step or None) named by config.train.init_from."""
    source = str(storage.path(init_from)).rstrip('/')
    if storage.listdir(checkpoint_dir(source)):
        return checkpoint_dir(source), None
    head, _, name = source.rpartition('/')
    if name.isdigit():
        return head, int(name)
    return source, None


def _adopt_tokenizer(init_from: str, workdir: str) -> None:
    """A run started with init_from takes the source run's tokenizer: a tokenizer built afresh
    could give the same vocabulary size with other ids, and the parameters would still load."""
    if not init_from or hf_gpt2.is_checkpoint_dir(init_from):
        return  # The same on every process: the barrier below is reached by all or by none.
    source = _init_from_dir(init_from)[0].rpartition('/')[0]
    if (jax.process_index() == 0 and not checkpointing.has_checkpoints(checkpoint_dir(workdir))
            and not storage.path(workdir).joinpath(tokenizers.TOKENIZER_FILE).exists()
            and storage.path(source).joinpath(tokenizers.TOKENIZER_FILE).exists()):
        # tokenizer.model (sentencepiece) before tokenizer.json, each replaced whole, so that an
        # interrupted copy never leaves a tokenizer.json without its model.
        names = sorted((n for n in storage.listdir(source) if n.startswith('tokenizer.')),
                       key=lambda n: n == tokenizers.TOKENIZER_FILE)
        for name in names:
            storage.write_bytes(storage.join(workdir, name), storage.path(source).joinpath(name).read_bytes())
        logging.info('Took the tokenizer of %s (config.train.init_from).', source)
    distributed.barrier('init_from tokenizer')


def _train(run: config_lib.RunConfig, workdir: str) -> dict:
    wall_start = time.time()
    exp = setup(run, workdir)
    tcfg = exp.run.train
    saved_config = exp.run.source
    write_json(storage.join(workdir, CONFIG_FILE), saved_config)
    abstract = abstract_state(exp)  # Traced once: the summary's count and the restore's shapes.
    _log_start(exp, workdir, abstract[0].params)

    with distributed.primary_first('token streams'):  # Prepared data and token caches.
        train_streams = data_factory.make_streams(
            exp.run.data, 'train', exp.tokenizer, seed=exp.run.seed, batch_size=tcfg.batch_size,
            tgt_len=tcfg.tgt_len, segments_per_batch=tcfg.segments_per_step, repeat=True,
            process_index=jax.process_index(), process_count=jax.process_count())
        valid_streams = evaluation.eval_streams(exp.run, exp.tokenizer, 'validation')
    iterator = train_streams.iterator()

    ckpt = checkpointing.Checkpointer(checkpoint_dir(workdir), tcfg.keep_checkpoints)
    state, memory, last_checkpoint = _restore_or_init(exp, ckpt, iterator, train_streams.fingerprint, abstract)
    step = int(state.step)
    best_loss = ckpt.best()[1]

    train_step = _PhasedTrainStep(exp)
    eval_step = metrics_lib.announced(make_eval_step(exp),
                                      'Compiling the evaluation step: the first validation batch includes it.')
    writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0)
    metric = metrics_lib.metric_name(exp.unit)
    interval = _Interval(step)
    # Throughput counts neither the dispatches that compile (the first, a new phase's) nor validation.
    logged_tokens, compile_tokens, steady_start, eval_seconds, compile_seconds = 0.0, 0.0, None, 0.0, 0.0
    diverged_loss = tcfg.diverged_loss  # Resolved with the vocabulary size: inf when off.
    watch, preempted = preemption.PreemptionWatch(), False
    try:
        while step < tcfg.num_steps:
            compiles = train_step.compiles(step)
            if compiles:  # Timed alone: the updates before it have finished.
                jax.block_until_ready(memory)
                dispatch_start = time.time()
            state, memory, step_metrics = train_step(
                step, state, memory, exp.partitioner.global_batch(next(iterator)))
            previous_step, step = step, step + tcfg.segments_per_step
            interval.add(step_metrics)
            if compiles:
                jax.block_until_ready(step_metrics)
                now = time.time()
                logging.info('%s, with compilation, took %.1fs.', first_updates(tcfg.segments_per_step).capitalize(),
                             now - dispatch_start)
                if steady_start is None:
                    steady_start = now
                else:
                    compile_seconds += now - dispatch_start
                compile_tokens += float(np.sum(step_metrics['num_tokens']))
                # Speeds and the ETA count from here: a first line of "8 tok/s, eta 107h" says nothing.
                interval.start_time, interval.first_step = now, step
                interval.untimed_tokens = float(sum(np.sum(part['num_tokens']) for part in interval.parts))

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
                interval.check_healthy(values, last_checkpoint, diverged_loss)
                logged_tokens += _log_interval(exp, interval, values, step, writer)
            valid_loss = None
            if evaluate:
                eval_start = time.time()
                valid_loss = _validate(exp, eval_step, state.params, valid_streams,
                                       tcfg.eval_batches, step, writer)['loss']
                eval_seconds += time.time() - eval_start
                if valid_loss > diverged_loss:
                    raise _diverged(f'validation loss {valid_loss:.4g}', step, diverged_loss, last_checkpoint)
                # The best validated state is kept, also between checkpoint steps (unless the
                # run asked for its final checkpoint only).
                is_best = best_loss is None or valid_loss < best_loss
                save = save or (tcfg.checkpoint_every > 0 and is_best)
                if is_best and save:
                    logging.info('Checkpoint %s is the best so far (validation loss %.4f); it '
                                 'is kept beside the newest %d.', ckpt.step_dir(step), valid_loss,
                                 tcfg.keep_checkpoints)
                best_loss = valid_loss if best_loss is None else min(best_loss, valid_loss)
            if save:
                ckpt.save(step, state, memory, iterator.get_state(), saved_config, valid_loss,
                          train_streams.fingerprint)
                last_checkpoint = ckpt.step_dir(step)
            if preempted:
                break
            interval = _Interval(step)
        if not preempted:
            train_seconds = (time.time() - steady_start - eval_seconds - compile_seconds) if steady_start else 0.0
            with preemption.stop_once_written(ckpt.wait):
                final = _validate(exp, eval_step, state.params, valid_streams, tcfg.final_eval_batches, step,
                                  writer)
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

    summary_path = storage.join(workdir, 'train_summary.json')
    summary = {
        'step': step,
        'valid_loss': final['loss'],
        f'valid_{metric}': final[metric],
        'valid_tokens': final['num_tokens'],
        **({'valid_accuracy': final['accuracy']} if 'accuracy' in final else {}),
        # A finished run started again trains nothing, and a run of one dispatch times only its
        # compilation: the throughput stays the one measured before (None if none was).
        'train_tokens_per_s': ((logged_tokens - compile_tokens) / train_seconds
                               if train_seconds > 0 and logged_tokens > compile_tokens
                               else (read_json(summary_path) or {}).get('train_tokens_per_s')),
        'wall_seconds': time.time() - wall_start,
    }
    write_result(summary_path, summary)
    logging.info('Done: %s', json.dumps(summary))
    return summary
