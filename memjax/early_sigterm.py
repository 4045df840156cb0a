"""SIGTERM outside the training loop ends `memjax.train` with exit status 0.

A scheduler stops a job with SIGTERM whenever it likes; inside the loop the run saves a
checkpoint first (memjax/training/preemption.py), and before it (imports, data preparation,
compilation) or after it there is nothing new to save. Exiting 0 in both cases tells the
scheduler the same thing: run the same command again to continue. `memjax.train` calls
`install()` before its heavy imports, so start-up is covered from the first second. In a
multi-process run `jax.distributed.initialize` replaces the handler with JAX's preemption
service, which must own SIGTERM there.
"""

import signal
import sys
import threading


def _stop(signum, frame):
    del signum, frame
    print('Stopped by SIGTERM outside the training loop: nothing new to save; run the same '
          'command again to continue.', file=sys.stderr)
    sys.exit(0)


def install() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)
