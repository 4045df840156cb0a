"""What every memjax command line does around its job."""

import sys
from typing import Any, Callable

from absl import flags

from memjax import distributed
from memjax import host_memory
from memjax import metrics as metrics_lib

_HOST_MEMORY = flags.DEFINE_enum(
    'host_memory', 'auto', host_memory.MODES,
    'How XLA:CPU step buffers avoid being page-faulted in 4 KiB at a time every step (see '
    'memjax/host_memory.py): on = transparent huge pages (a glibc tunable, set by re-executing the '
    'command once), auto = on when JAX runs on the CPU, reuse = one malloc heap that keeps them '
    'mapped (fastest for large steps, slower for small fast ones), off = glibc defaults.')


def prepare_host_memory() -> bool:
    """Applies --host_memory; must run before JAX first touches a device."""
    return host_memory.keep_host_buffers(_HOST_MEMORY.value)


def run(job: Callable[[], Any], expected_errors: tuple[type[Exception], ...], prefix: str = '') -> Any:
    """Sets up host memory and joins the distributed run before anything touches a device, quiets
    library logs, runs `job` so that a dead peer ends it, and turns an expected error into a
    one-line exit."""
    prepare_host_memory()
    try:
        distributed.initialize_from_flags()
    except distributed.DistributedSetupError as error:
        sys.exit(f'Distributed setup error: {error}')
    distributed.set_log_verbosity()
    metrics_lib.quiet_library_logs()
    try:
        with distributed.peer_failures_end_the_run():
            return job()
    except expected_errors as error:
        sys.exit(f'{prefix}{error}')
