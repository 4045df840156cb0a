"""Where a run's state comes from: its newest checkpoint, another run's or GPT-2's parameters
(config.train.init_from), imported weights, or a fresh start."""

import os
from typing import Any, Optional

from absl import logging
import jax
import ml_collections

from memjax import config_lib
from memjax import errors
from memjax import model as model_lib
from memjax.convert import hf_gpt2
from memjax.data import factory as data_factory
from memjax.data import tokenizers
from memjax.runtime import distributed
from memjax.runtime import storage
from memjax.training import checkpoints as checkpointing
from memjax.training import experiment
from memjax.training import resume
from memjax.training import run_files
from memjax.training import run_lock
from memjax.training import saved_run
from memjax.training import step as train_step_lib
from memjax.training import workdir as workdir_lib


def newest_params(exp: experiment.Experiment, workdir: str) -> tuple[int, Any]:
    """(step, parameters) of the workdir's newest intact checkpoint, placed on the current mesh.

    Only the parameters: the memory and optimizer state may have other shapes here (another batch
    size or mem_len for evaluation) and are not needed.
    """
    directory = run_files.checkpoint_dir(workdir)
    found = None
    if checkpointing.has_checkpoints(directory):
        wanted = experiment.abstract_state(exp)[0].params
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
                                     f'{saved_run.training_command(workdir)}.')
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


def write_imported(model: model_lib.ModelConfig, params: Any, tokenizer: tokenizers.Tokenizer, workdir: str,
                   data_name: str) -> None:
    """A new workdir holding imported parameters as its step 0, with their tokenizer: evaluate and
    generate read it as any other; training with config.train.init_from=<it> fine-tunes them.

    Its config is the base config with this model, the tokenizer's kind, the model's segment
    length and the data it was trained on (`data_name`: 'text' for a corpus memjax does not
    prepare, whose files an evaluation then has to name); evaluation settings are given when
    evaluating.
    """
    if storage.listdir(workdir):
        raise errors.WorkdirError(f'{workdir} is not empty: import into a new workdir (nothing there is changed).')
    config = config_lib.base_config()
    config.model.update(model.as_dict())
    config.data.update(name=data_name, tokenizer=tokenizer.kind)
    config.train.tgt_len = model.segment_len
    workdir_lib.check(workdir, create=True)
    try:
        _write_imported(config, params, tokenizer, workdir)
    except (errors.UserError, OSError) as error:  # A full disk: a half-written workdir resumes nothing.
        storage.path(workdir).rmtree(missing_ok=True)
        raise errors.CheckpointError(f'importing into {workdir} failed ({errors.brief(error)}); the '
                                     'half-written workdir was removed: free some space or fix the permissions '
                                     'there, and run the import again.') from error


def _write_imported(config: ml_collections.ConfigDict, params: Any, tokenizer: tokenizers.Tokenizer,
                    workdir: str) -> None:
    tokenizer.save(workdir)  # Adopted by experiment.setup as the run's own.
    with run_lock.RunLock(workdir):
        # Nothing here reads the data: a corpus of the user's ('text') is named when the run is evaluated.
        placed = config.copy_and_resolve_references()
        if placed.data.name == 'text' and not placed.data.text_path:
            placed.data.name = 'embedded'
        exp = experiment.setup(placed, workdir)
        state, memory = experiment.init_state(exp, model_lib.convert_layer_layout(params, exp.mcfg.scan_layers))
        source = {**exp.run.source, 'data': resume.to_plain(config.data)}
        run_files.write_json(storage.join(workdir, run_files.CONFIG_FILE), source)
        ckpt = checkpointing.Checkpointer(run_files.checkpoint_dir(workdir), keep=1)
        try:
            ckpt.save(0, state, memory, None, source)
            ckpt.wait()
        finally:
            ckpt.close()


def restore_or_init(exp: experiment.Experiment, ckpt: checkpointing.Checkpointer, iterator: Any, data: Optional[dict],
                     abstract: Optional[tuple[Any, Any]] = None
                     ) -> tuple[train_step_lib.TrainState, Any, Optional[str]]:
    """State, memory and data position of the newest intact checkpoint, else a start from
    config.train.init_from, else fresh ones. `data`: the training data's fingerprint now;
    `abstract`: experiment.abstract_state(exp), when the caller has it."""
    restored = ckpt.restore_latest(*(abstract or experiment.abstract_state(exp)), quarantine=True)
    if restored is None:
        _refuse_to_start_over(ckpt)
        if exp.run.train.init_from:
            return *init_from(exp), None
        logging.info('Starting at step 0: compiling the initialiser of the parameters and optimizer state.')
        return *experiment.init_state(exp), None
    saved_run.check_same_data(restored.data, data, ckpt.step_dir(restored.step), exp.run.data.accept_changed_data)
    iterator.set_state(restored.data_state)
    logging.info('Resumed from %s (step %d).', ckpt.step_dir(restored.step), restored.step)
    return restored.state, restored.memory, ckpt.step_dir(restored.step)


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


def init_from(exp: experiment.Experiment) -> tuple[train_step_lib.TrainState, Any]:
    """A fresh start from the parameters (and optionally optimizer state and step) of
    `config.train.init_from`: a workdir, its checkpoints/ folder or one step's folder.

    The data stream and the memory start afresh, so the batch size, the segment length, the
    data or the memory length may differ from the source run; the parameters must fit.
    """
    tcfg = exp.run.train
    if hf_gpt2.is_checkpoint_dir(tcfg.init_from):
        return _from_gpt2(exp)
    source, step = _init_from_checkpoints(tcfg.init_from)
    ckpt = checkpointing.Checkpointer(source, keep=1, read_only=True)
    try:
        if step is not None and step not in ckpt.all_steps():
            raise errors.CheckpointError(f'config.train.init_from={tcfg.init_from}: {source} has '
                                         f'no step {step} (it has {ckpt.all_steps()}).')
        named = step
        try:
            step, source_config = saved_run.saved_with(ckpt, named)
        except Exception as error:  # pylint: disable=broad-except  (orbax raises many types for damaged files)
            raise _damaged_source(ckpt, named, tcfg.init_from, error) from None
        if step is None:
            raise errors.CheckpointError(f'config.train.init_from={tcfg.init_from}: no readable '
                                         'checkpoint there.')
        if source_config is not None:
            resume.check_same_params(source_config, exp.run.source, ckpt.step_dir(step),
                                     'config.train.init_from')
        keep_optimizer = tcfg.init_from_state == 'params_and_optimizer'
        abstract = experiment.abstract_state(exp)[0]
        try:
            part = ckpt.restore_part(step, {'state': abstract if keep_optimizer else {'params': abstract.params}})
        except checkpointing.CheckpointMismatchError:
            raise
        except Exception as error:  # pylint: disable=broad-except
            raise _damaged_source(ckpt, step, tcfg.init_from, error) from None
    finally:
        ckpt.close()
    state = part['state'] if keep_optimizer else experiment.init_state(exp, part['state']['params'])[0]
    logging.info('Started from %s of %s (%s); fresh data stream and memory.',
                 'parameters and optimizer state' if keep_optimizer else 'parameters',
                 ckpt.step_dir(step), f'step {int(state.step)}')
    return state, exp.partitioner.init_memory(exp.mcfg, tcfg.batch_size)


def _damaged_source(ckpt: checkpointing.Checkpointer, step: int, init_from: str,
                    error: Exception) -> errors.CheckpointError:
    """The one line for an init_from step that is damaged, naming an earlier step to start from."""
    why = (str(error) if isinstance(error, checkpointing.DamagedCheckpointError) else
           f'{ckpt.step_dir(step)} does not read ({type(error).__name__}: {errors.brief(error, 200)})')
    earlier = [s for s in ckpt.all_steps() if s < step]
    return errors.CheckpointError(
        f'config.train.init_from={init_from}: {why}. Name '
        + (f'an earlier step\'s folder, e.g. {ckpt.step_dir(earlier[-1])}.' if earlier
           else 'another run: it has no earlier step.'))


def _from_gpt2(exp: experiment.Experiment) -> tuple[train_step_lib.TrainState, Any]:
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
    return experiment.init_state(exp, params)[0], exp.partitioner.init_memory(exp.mcfg, exp.run.train.batch_size)


def _init_from_checkpoints(init_from: str) -> tuple[str, Optional[int]]:
    """`init_from_dir`, refused in one line when no checkpoint is there."""
    source, step = init_from_dir(init_from)
    if not checkpointing.has_checkpoints(source):
        raise errors.CheckpointError(
            f'config.train.init_from={init_from}: no checkpoints there; name a training '
            'workdir, its checkpoints/ folder or one of its step folders.')
    return source, step


def init_from_dir(init_from: str) -> tuple[str, Optional[int]]:
    """(checkpoints folder, step or None) named by config.train.init_from."""
    source = str(storage.path(init_from)).rstrip('/')
    if storage.listdir(run_files.checkpoint_dir(source)):
        return run_files.checkpoint_dir(source), None
    head, _, name = source.rpartition('/')
    if name.isdigit():
        return head, int(name)
    return source, None


def start_tokenizer(run: config_lib.RunConfig, workdir: str) -> None:
    """Gives a training start whose workdir holds no checkpoint the tokenizer it trains with,
    before anything else is prepared (data_factory.start_tokenizer: config.train.init_from's, else
    config.data's; never one an earlier start left behind). A bad init_from stops it here, before
    anything is written. A resumed run keeps its own."""
    if checkpointing.has_checkpoints(run_files.checkpoint_dir(workdir)):
        return  # Before init_from is looked at: a resumed run never reads it.
    source_run = None
    if run.train.init_from and not hf_gpt2.is_checkpoint_dir(run.train.init_from):
        source_run = _init_from_checkpoints(run.train.init_from)[0].rpartition('/')[0]
    with distributed.primary_first('the tokenizer of a start'):
        if distributed.is_primary():  # The others read what it wrote (experiment.setup).
            data_factory.start_tokenizer(run.data, workdir, source_run)
