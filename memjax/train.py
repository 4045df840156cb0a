"""Command line: `python -m memjax.train --config=configs/X.py --workdir=DIR [--config.a.b=v]`.

Re-running with the same workdir resumes from its newest intact checkpoint.
"""

import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from memjax import config_lib
from memjax import metrics as metrics_lib
from memjax import trainer

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a configs/*.py file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, logs and metrics.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    logging.set_verbosity(logging.INFO)
    metrics_lib.quiet_library_logs()
    try:
        trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except config_lib.ConfigError as error:
        sys.exit(f'Config error: {error}')


if __name__ == '__main__':
    app.run(main)
