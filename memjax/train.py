"""Command line: `python -m memjax.train --config=configs/X.py --workdir=DIR [--config.a.b=v]`.

Re-running with the same workdir resumes from its newest intact checkpoint; a run
stopped by SIGTERM checkpoints first and exits 0. Multi-process runs add
`--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (or nothing on a
Cloud TPU VM): see memjax/distributed.py.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from memjax import cli
from memjax import config_lib
from memjax import trainer

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a configs/*.py file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Directory for checkpoints, logs and metrics.')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f'unexpected arguments: {argv[1:]}')
    cli.run(lambda: trainer.train_and_evaluate(_CONFIG.value, _WORKDIR.value), (config_lib.ConfigError,),
            prefix='Config error: ')


if __name__ == '__main__':
    app.run(main)
