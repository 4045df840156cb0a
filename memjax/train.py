"""Command line: `python -m memjax.train --config=configs/X.py --workdir=DIR [--config.a.b=v]`.

Needs the data the config names (docs/data.md; the embedded corpus needs nothing, a text file
`--config.data.text_path`); a `gs://` workdir needs the `gcs` extra (pip install -e '.[gcs]').

Re-running with the same workdir resumes from its newest intact checkpoint, provided the
config still fits it (see memjax/training/resume.py); a run stopped by SIGTERM checkpoints first
and exits 0, by Ctrl-C checkpoints first and exits 130 (a second Ctrl-C stops at once).
Multi-process runs add `--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (or
nothing on a Cloud TPU VM): see memjax/runtime/distributed.py.
"""

from memjax import early_sigterm
from memjax.runtime import host_memory

early_sigterm.install()  # Before the imports below, which take seconds.
if __name__ == '__main__':  # The command: importing this module must not re-execute a process.
    host_memory.keep_host_buffers_first()  # Before the imports below: it may re-execute the command.

# pylint: disable=g-import-not-at-top,wrong-import-position
import sys

from absl import flags
from ml_collections import config_flags

from memjax import cli
from memjax.runtime import distributed
from memjax import errors
from memjax.training import loop as trainer
from memjax import path_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a configs/*.py file.',
                                          lock_config=True)
_WORKDIR = path_flags.define('workdir', None, 'Directory for checkpoints, logs and metrics.')
flags.mark_flags_as_required(['config', 'workdir'])
# --help lists what users set on this command, not only the two flags above.
flags.adopt_module_key_flags(cli)
flags.adopt_module_key_flags(distributed)


def main(argv):
    if len(argv) > 1:
        raise errors.UsageError(f'unexpected arguments: {argv[1:]}')
    cli.run(lambda: trainer.train_and_evaluate(cli.load_run(_CONFIG), _WORKDIR.value))
    if early_sigterm.interrupted():  # Saved, but not finished: a script must not go on as if it were.
        sys.exit(early_sigterm.INTERRUPTED)


if __name__ == '__main__':
    cli.main(main)
