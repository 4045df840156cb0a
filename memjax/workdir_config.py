"""A config file whose `get_config(workdir)` is the config the workdir's run was trained with.

The commands that read a trained workdir (evaluate, generate, sweep) take it as their `--config`
when none is given (`memjax.cli.with_workdir_config`), so `--config.eval.model.mem_len=256`
applies on top of the run's own settings.
"""

import ml_collections

from memjax import config_lib
from memjax import errors
from memjax.runtime import storage
from memjax.training import run_files


def get_config(workdir: str) -> ml_collections.ConfigDict:
    saved = run_files.read_json(storage.join(workdir, run_files.CONFIG_FILE))
    if not isinstance(saved, dict):
        raise errors.WorkdirError(
            f'--workdir={workdir} holds no readable {run_files.CONFIG_FILE} (the config memjax.train and the imports '
            'write there): name the workdir of a training run, or give its config with --config=configs/X.py.')
    return config_lib.from_saved(saved)
