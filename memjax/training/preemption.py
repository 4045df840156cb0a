"""When to stop for a preemption: SIGTERM, or the JAX/orbax preemption sync point.

A preempted run saves a checkpoint at the next step boundary and exits 0, so that the
scheduler's restart of the same command resumes exactly. In a multi-process run every
process must save the same step, yet the notice may reach only one of them: JAX's
preemption sync manager (started by `jax.distributed.initialize`, which also takes
over SIGTERM) spreads the notice and names a common step. A single process without
`jax.distributed` has no such service and instead watches SIGTERM itself.
"""

import contextlib
import signal
import threading
from typing import Any, Callable, Optional

from absl import logging
import jax
from jax.experimental import multihost_utils

from memjax import early_sigterm
from memjax import errors


def _sync_service_running() -> bool:
    return jax.distributed.is_initialized() and jax.config.jax_enable_preemption_service


class PreemptionWatch:
    """Answers, at each step boundary, whether the run must checkpoint and stop there.

    Created right before the training loop and closed after it: the SIGTERM handler
    (which only sets a flag; the loop does the saving) is removed again by `close()`.
    """

    def __init__(self):
        self._requested = False
        self._previous_handler: Any = None
        self._installed = False
        self._diversion: Any = None
        self._use_sync_point = _sync_service_running()
        if self._use_sync_point:
            return
        if jax.process_count() > 1:
            logging.warning('The JAX preemption service is off (jax_enable_preemption_service): '
                            'processes cannot agree on a step, so SIGTERM is not handled.')
        elif early_sigterm.installed():  # The command line answers SIGTERM in its own thread.
            self._diversion = early_sigterm.diverted(self._on_request)
            self._diversion.__enter__()
        elif threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)
            self._installed = True
        else:
            logging.warning('Training outside the main thread: SIGTERM is not handled.')

    def close(self) -> None:
        if self._diversion is not None:
            self._diversion.__exit__(None, None, None)
            self._diversion = None
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._installed = False

    def _on_sigterm(self, signum: int, frame: Optional[Any]) -> None:
        del signum, frame
        self._on_request()

    def _on_request(self) -> None:
        self._requested = True

    def reached(self, previous_step: int, step: int) -> bool:
        """Whether to save and stop at `step`, the boundary after `previous_step`.

        Every process must call this at every boundary, with the same steps.
        """
        if not self._use_sync_point:
            return self._requested
        # The sync manager picks (highest step any process reported) + 1 as the common
        # step, so it has to see every step, not only the boundaries of multi-step
        # dispatches. Once a step matches, all processes stop at this boundary.
        return any(multihost_utils.reached_preemption_sync_point(s)
                   for s in range(previous_step + 1, step + 1))


def stop_once_written(wait: Callable[[], None]):
    """A context in which SIGTERM (outside the loop, e.g. during the final validation) stops the
    command only once `wait()` has seen the checkpoint in flight written: exit 0, or exit 3 with
    the error's line if the write failed."""
    if not early_sigterm.installed():
        return contextlib.nullcontext()

    def finish():
        try:
            wait()
        except errors.UserError as error:
            early_sigterm.stop(f'{error.label}: {error}', error.exit_code)
        early_sigterm.stop(f'Stopped by {early_sigterm.name()} after training: the final checkpoint is written; '
                           'the final validation runs when the same command is run again.')

    # Off the signal thread, which must stay free to answer a second Ctrl-C while this waits.
    return early_sigterm.diverted(
        lambda: threading.Thread(target=finish, daemon=True, name='memjax-final-save').start())
