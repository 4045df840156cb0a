"""SIGTERM ends `memjax.train` cleanly at any moment: exit 0, nothing lost.

A scheduler stops a job with SIGTERM whenever it likes and reads the exit status: 0 means "run
the same command again to continue". Inside the training loop the run saves a checkpoint at the
next step boundary first (memjax/training/preemption.py diverts the signal there). Before the loop
(imports, data preparation, compilation) there is nothing new to save, and the process exits 0 at
once; after it, once the final checkpoint is written.

A Python signal handler cannot promise this: it runs only when the main thread next executes
Python, which may be a minute away inside an XLA compilation, and the SystemExit it raises lands
in whatever callback runs then (a crash in a compile thread, an ignored exception and a run that
goes on training). So `install()` blocks SIGTERM in the main thread before any other thread
exists (every later thread inherits the block, an exec'd process too, with a pending signal) and
one thread waits for it with sigwait and acts at once; `os._exit` skips the interpreter teardown
that other threads would trip over. In a multi-process run `hand_over()` gives SIGTERM back before
`jax.distributed.initialize`, whose preemption service must own it there.
"""

import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Iterator

_SIGNALS = {signal.SIGTERM}
_MESSAGE = ('Stopped by SIGTERM outside the training loop: nothing new to save; run the same '
            'command again to continue.')
_reactions: list[Callable[[], None]] = []  # The innermost diversion answers.
_cleanups: list[Callable[[], None]] = []  # Run before the default stop (a workdir lock).
_state = {'installed': False}


def install() -> None:
    """Blocks SIGTERM and starts the thread that answers it; call before anything else starts
    threads (memjax.train does, before its imports)."""
    if _state['installed'] or threading.current_thread() is not threading.main_thread():
        return
    # A thread started before this call (an import that starts one) still takes the signal: its
    # Python handler then answers in the main thread, the way it always could.
    signal.signal(signal.SIGTERM, lambda signum, frame: _react())
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    threading.Thread(target=_answer, daemon=True, name='memjax-sigterm').start()
    _state['installed'] = True


def installed() -> bool:
    return _state['installed']


def _answer() -> None:
    while True:
        signal.sigwait(_SIGNALS)
        _react()


def _react() -> None:
    (_reactions[-1] if _reactions else stop)()


def stop(message: str = _MESSAGE, exit_code: int = 0) -> None:
    """Runs the registered cleanups, prints `message` and ends the process now."""
    for cleanup in reversed(_cleanups):
        try:
            cleanup()
        except Exception:  # pylint: disable=broad-except  (stopping matters more)
            pass
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(exit_code)  # pylint: disable=protected-access


@contextlib.contextmanager
def _pushed(stack: list, item: Callable[[], None]) -> Iterator[None]:
    stack.append(item)
    try:
        yield
    finally:
        stack.remove(item)


def diverted(reaction: Callable[[], None]):
    """Within the block SIGTERM calls `reaction()` (in the signal thread) instead of stopping."""
    return _pushed(_reactions, reaction)


def cleanup_on_stop(cleanup: Callable[[], None]):
    """Within the block a stop by SIGTERM runs `cleanup()` first."""
    return _pushed(_cleanups, cleanup)


def hand_over() -> None:
    """Gives SIGTERM back to whoever installs a handler next (JAX's preemption service); until
    then it stops the process as before."""
    if not _state['installed']:
        return
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
    _state['installed'] = False
