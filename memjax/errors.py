"""The errors a user can cause and fix, each printed by the command lines as one line.

Anything else that escapes a command is a bug in memjax and keeps its traceback. The
exit status tells a scheduler or a script which kind of problem ended the run: a
usage error will fail again on a retry, a runtime error may not.
"""

import os
import re
import sys
from typing import Callable, NoReturn

# Called by `exit_now` before the process ends, each briefly (the standard-error guard's sync).
_before_exit: list[Callable[[], None]] = []


def failed(*checks: tuple[bool, str]) -> list[str]:
    """The messages of the (ok, message) checks that fail: a config section lists them all at once."""
    return [message for ok, message in checks if not ok]


def brief(error: BaseException, limit: int = 300) -> str:
    """`error`'s message on one line, at most `limit` characters ('...' where it was cut): a
    library's error can hold a whole spec (TensorStore's JSON), which one line of ours quotes."""
    text = ' '.join(str(error).split())
    return text if len(text) <= limit else text[:limit - 4] + ' ...'


EXIT_USAGE = 2  # The command line or the config: fix it and run again.
EXIT_RUNTIME = 3  # Data, workdir, checkpoints, diverged training: the message says what to do.


def is_out_of_memory(message: str) -> bool:
    """Whether an error's message is a device or host allocation that failed."""
    # Accelerators say RESOURCE_EXHAUSTED; XLA:CPU an INTERNAL error that names the allocation.
    return 'RESOURCE_EXHAUSTED' in message or bool(re.search(r'Out of memory (allocating|while trying)', message))


def exit_now(exit_code: int) -> NoReturn:
    """Exits without waiting for other threads: after a failed save orbax's signalling threads
    wait forever, a lost peer leaves the main thread inside a collective, and a process that
    never exits holds its cluster allocation."""
    sys.stdout.flush()
    sys.stderr.flush()
    for hook in _before_exit:
        hook()
    os._exit(exit_code)  # pylint: disable=protected-access


def before_exit(hook: Callable[[], None]) -> None:
    """`hook()` runs when `exit_now` ends the process (it must return within seconds)."""
    _before_exit.append(hook)


class UserError(Exception):
    """Base of the errors whose message names the problem and the fix."""
    exit_code = EXIT_RUNTIME
    label = 'Error'


class UsageError(UserError):
    """The command line itself is wrong: a flag, a missing or extra argument."""
    exit_code = EXIT_USAGE
    label = 'Usage error'


class ConfigError(UserError, ValueError):
    """A config field has an unusable value, or the config differs from the run it resumes."""
    exit_code = EXIT_USAGE
    label = 'Config error'


class DataError(UserError, ValueError):
    """Input text, a tokenizer file or a token cache is unusable."""
    label = 'Data error'


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder the config names does not exist."""
    label = 'Missing file'


class WorkdirError(UserError):
    """The workdir cannot be used: not a folder, not writable, or in use by another run."""
    label = 'Workdir error'


class CheckpointError(UserError, ValueError):
    """A checkpoint cannot be used for what was asked (wrong shapes, nothing to restore)."""
    label = 'Checkpoint error'


class NonFiniteLossError(UserError, FloatingPointError):
    """Training produced a NaN/inf loss or gradient; nothing after the last good step is saved."""
    label = 'Training stopped'


class DivergedError(UserError):
    """The loss exceeded config.train.diverged_loss; nothing after the last good step is saved."""
    label = 'Training stopped'


class OutOfMemoryError(UserError, MemoryError):
    """The run's state or a step does not fit the devices' memory."""
    label = 'Out of memory'


class BenchError(UserError, ValueError):
    """A benchmark suite cannot run as asked (unknown suite, missing peer package)."""
    exit_code = EXIT_USAGE
    label = 'Benchmark error'
