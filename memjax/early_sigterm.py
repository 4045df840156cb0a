"""SIGTERM and Ctrl-C end `memjax.train` cleanly at any moment: nothing lost.

A scheduler stops a job with SIGTERM whenever it likes and reads the exit status: 0 means "run
the same command again to continue". Inside the training loop the run saves a checkpoint at the
next step boundary first (memjax/training/preemption.py diverts the signal there). Before the loop
(imports, data preparation, compilation) there is nothing new to save, and the process exits 0 at
once; after it, once the final checkpoint is written. Ctrl-C (SIGINT) does the same and exits 130,
the status a shell gives an interrupted command, so that a script does not go on as if training
had finished; a second Ctrl-C stops at once, without waiting for the checkpoint (the newest
complete one stays the one a rerun resumes from).

A Python signal handler cannot promise this: it runs only when the main thread next executes
Python, which may be a minute away inside an XLA compilation, and the exception it raises lands
in whatever callback runs then (a crash in a compile thread, an ignored exception and a run that
goes on training: Python's own KeyboardInterrupt was lost so). So `install()` blocks both signals
in the main thread before any other thread exists (every later thread inherits the block, an
exec'd process too, with a pending signal) and one thread waits for them with sigwait and acts at
once; `errors.exit_now` (os._exit) skips the interpreter teardown that other threads would trip over. In a
multi-process run `hand_over()` gives them back before `jax.distributed.initialize`, whose
preemption service must own SIGTERM there.
"""

import contextlib
import signal
import sys
import threading
from typing import Callable, Iterator, Optional

from memjax import errors

INTERRUPTED = 130  # A shell's status for a command stopped by Ctrl-C.
_reactions: list[Callable[[], None]] = []  # The innermost diversion answers.
_cleanups: list[Callable[[], None]] = []  # Run before the default stop (a workdir lock).
_state = {'installed': False, 'signal': None, 'signals': set(), 'sigint_before': None}


def install() -> None:
    """Blocks SIGTERM and SIGINT and starts the thread that answers them; call before anything
    else starts threads (memjax.train does, before its imports)."""
    if _state['installed'] or threading.current_thread() is not threading.main_thread():
        return
    # A process started to ignore Ctrl-C (a shell's background job, nohup ... &) goes on ignoring it.
    _state['sigint_before'] = signal.getsignal(signal.SIGINT)
    ignored = _state['sigint_before'] is signal.SIG_IGN
    _state['signals'] = {signal.SIGTERM} if ignored else {signal.SIGTERM, signal.SIGINT}
    # A thread started before this call (an import that starts one) still takes a signal: its
    # Python handler then answers in the main thread, the way it always could.
    for signum in _state['signals']:
        signal.signal(signum, lambda signum, frame: _react(signum))
    signal.pthread_sigmask(signal.SIG_BLOCK, _state['signals'])
    threading.Thread(target=_answer, daemon=True, name='memjax-sigterm').start()
    _state['installed'] = True


def installed() -> bool:
    return _state['installed']


def interrupted() -> bool:
    """Whether Ctrl-C (SIGINT) asked this process to stop."""
    return _state['signal'] == signal.SIGINT


def name() -> str:
    """The signal that asked this process to stop, as a user knows it."""
    return 'Ctrl-C' if interrupted() else 'SIGTERM'


def status() -> int:
    """The exit status of a process stopped at the signal's request, once nothing is lost."""
    return INTERRUPTED if interrupted() else 0


def _answer() -> None:
    while True:
        _react(signal.sigwait(_state['signals']))


def _react(signum: int) -> None:
    if signum == signal.SIGINT and interrupted():  # Asked twice: not waiting for the checkpoint.
        stop('Stopped by a second Ctrl-C: the newest complete checkpoint is kept; run the same command '
             'again to continue from it.', INTERRUPTED)
    if _state['signal'] is None or signum == signal.SIGINT:
        _state['signal'] = signum
    (_reactions[-1] if _reactions else stop)()


def stop(message: str = '', exit_code: Optional[int] = None) -> None:
    """Runs the registered cleanups, prints `message` and ends the process now (by default: the
    signal's words and status, for a stop before the training loop)."""
    message = message or (f'Stopped by {name()} outside the training loop: nothing new to save; run the '
                          'same command again to continue.')
    exit_code = status() if exit_code is None else exit_code
    for cleanup in reversed(_cleanups):
        try:
            cleanup()
        except Exception:  # pylint: disable=broad-except  (stopping matters more)
            pass
    print(message, file=sys.stderr, flush=True)
    errors.exit_now(exit_code)


@contextlib.contextmanager
def _pushed(stack: list, item: Callable[[], None]) -> Iterator[None]:
    stack.append(item)
    try:
        yield
    finally:
        stack.remove(item)


def diverted(reaction: Callable[[], None]):
    """Within the block SIGTERM or a first Ctrl-C calls `reaction()` (in the signal thread) instead
    of stopping."""
    return _pushed(_reactions, reaction)


def cleanup_on_stop(cleanup: Callable[[], None]):
    """Within the block a stop by a signal runs `cleanup()` first."""
    return _pushed(_cleanups, cleanup)


def hand_over() -> None:
    """Gives SIGTERM back to whoever installs a handler next (JAX's preemption service), and
    SIGINT the handler it had before `install()`; until then they stop the process as before."""
    if not _state['installed']:
        return
    signal.signal(signal.SIGINT, _state['sigint_before'])
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _state['signals'])
    _state['installed'] = False
