"""Command line: `python -m memjax.train --config=configs/X.py --workdir=DIR [--config.a.b=v]`.

Re-running with the same workdir resumes from its newest intact checkpoint; a run
stopped by SIGTERM checkpoints first and exits 0. Multi-process runs add
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (or nothing on a
Cloud TPU VM): see memjax/distributed.py.
"""

import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from memjax import config_lib
from memjax import distributed
from memjax import metrics as metrics_lib
from memjax import trainer

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a configs/*.py file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, logs and metrics.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    try:
        distributed.initialize_from_flags()  # Before anything touches a device.
    except distributed.DistributedSetupError as error:
        sys.exit(f'Distributed setup error: {error}')
    distributed.set_log_verbosity()
    metrics_lib.quiet_library_logs()
    try:
        with distributed.peer_failures_end_the_run():
            trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except config_lib.ConfigError as error:
        sys.exit(f'Config error: {error}')


if __name__ == '__main__':
    app.run(main)
