"""The run a workdir holds, against a new start: the config and the data it was saved with."""

from typing import Optional

from absl import logging
import ml_collections

from memjax import config_lib
from memjax import errors
from memjax.runtime import storage
from memjax.training import checkpoints as checkpointing
from memjax.training import resume
from memjax.training import run_files
from memjax.training import workdir as workdir_lib


def check_saved_config(run: config_lib.RunConfig, workdir: str, training: bool) -> None:
    """Compares `run` with the one the workdir's newest readable checkpoint was saved with.

    Training refuses changes to fields that shape the saved state or the data stream;
    evaluation refuses changes that shape the parameters (memjax/training/resume.py). Runs before
    the tokenizer is built, anything is restored or compiled.
    """
    directory = run_files.checkpoint_dir(workdir)
    if not checkpointing.has_checkpoints(directory):
        return
    ckpt = checkpointing.Checkpointer(directory, keep=1, read_only=True)
    try:
        step, saved = saved_with(ckpt)
    finally:
        ckpt.close()
    if saved is None:
        return
    if training:
        resume.check_resume(saved, run.source, workdir, source=ckpt.step_dir(step))
    else:
        resume.check_same_params(saved, run.source, ckpt.step_dir(step), 'Evaluation')


def saved_with(ckpt: checkpointing.Checkpointer, step: Optional[int] = None) -> tuple[Optional[int], Optional[dict]]:
    """(step, the config saved with it) of `step`, else of the newest checkpoint whose JSON item
    reads back; (None, None) when there is none. Checkpoints written before configs were
    stored in them fall back to their workdir's config.json."""
    read = lambda s: (s, ckpt.meta(s))
    found = read(step) if step is not None else ckpt.latest_intact(read)
    if found is None:
        return None, None
    step, meta = found
    return step, meta.get('config') or run_files.read_json(
        storage.join(ckpt.directory.rpartition('/')[0], run_files.CONFIG_FILE))


def training_command(workdir: str) -> str:
    """The command that trains `workdir`, as the errors for a workdir without a checkpoint give it."""
    return f'python -m memjax.train --config=... --workdir={workdir}'


def saved_config(workdir: str, config_flag: bool = True) -> ml_collections.ConfigDict:
    """The config the workdir's newest readable checkpoint was saved with. `config_flag`: whether
    the calling command takes a --config instead, which the error for a workdir without one offers."""
    workdir_lib.check(workdir, create=False)
    directory = run_files.checkpoint_dir(workdir)
    saved = None
    if checkpointing.has_checkpoints(directory):
        ckpt = checkpointing.Checkpointer(directory, keep=1, read_only=True)
        try:
            saved = saved_with(ckpt)[1]
        finally:
            ckpt.close()
    if saved is None:
        otherwise = ', or pass --config' if config_flag else ''
        raise errors.CheckpointError(f'no readable checkpoint with its config in {directory}: train first with '
                                     f'{training_command(workdir)}{otherwise}.')
    return config_lib.from_saved(saved)


def check_same_data(saved: Optional[dict], now: Optional[dict], source: str, accept_changed_data: bool) -> None:
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
