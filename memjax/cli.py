"""What every memjax command line does around its job."""

import sys
from typing import Any, Callable

from memjax import distributed
from memjax import metrics as metrics_lib


def run(job: Callable[[], Any], expected_errors: tuple[type[Exception], ...], prefix: str = '') -> Any:
    """Joins the distributed run before anything touches a device, quiets library logs, runs `job`
    so that a dead peer ends it, and turns an expected error into a one-line exit."""
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
