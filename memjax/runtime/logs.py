"""What reaches the terminal and what goes to a run's log file.

Library chatter (orbax's notes on every save, JAX's backend probing) is dropped; library errors
and tracebacks (hundreds of lines for one full disk) go to `<workdir>/memjax.log`, and to the
terminal only with --verbose, so that memjax's one line saying what happened and what to do stays
readable. Every command line quiets them (`quiet_library_logs`); a training run also logs to its
workdir (`log_to_workdir`).
"""

import contextlib
import logging as logging_std
import os
import socket
import sys
import tempfile
import threading
import time
import warnings
from typing import Iterator, Optional

from absl import logging

from memjax.runtime import storage


class _QuietLibraries(logging_std.Filter):
    """Drops INFO chatter of orbax (several lines per save), TFDS and JAX's backend probing, so that
    progress lines and one-line errors stay readable (orbax's warnings about what memjax does on
    purpose are dropped where memjax does it: `dropped`)."""

    def filter(self, record: logging_std.LogRecord) -> bool:
        # TFDS's too (each split written, each dataset_info read): memjax says what it prepares.
        if '/orbax/' in record.pathname or '/tensorflow_datasets/' in record.pathname:
            return record.levelno >= logging_std.WARNING
        return record.levelno >= logging_std.WARNING or 'xla_bridge' not in record.pathname


class _Dropped(logging_std.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging_std.LogRecord) -> bool:
        return not any(fragment in record.getMessage() for fragment in self.fragments)


@contextlib.contextmanager
def dropped(*fragments: str) -> Iterator[None]:
    """Drops, within the block, absl records (orbax's, TFDS's) that contain one of `fragments`:
    a library's warnings about what memjax does on purpose (opening a checkpoint read-only, a
    builder config of its own). The filter sits on absl's logger, not on a handler, so that it
    holds outside the command lines too: in notebooks and scripts absl has no handler of its own
    and its records reach Python's root logger."""
    absl_logger = logging_std.getLogger('absl')
    quiet = _Dropped(fragments)
    absl_logger.addFilter(quiet)
    try:
        yield
    finally:
        absl_logger.removeFilter(quiet)


_MEMJAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
LOG_FILE = 'memjax.log'


class _LibraryDetails(logging_std.Filter):
    """Keeps library errors and tracebacks off the terminal. Orbax and TensorStore log every failure
    their background threads see, each with its traceback (hundreds of lines for one full disk or
    damaged checkpoint), around memjax's one line that says what happened and what to do. They go
    to the run's log file (`log_to_workdir`), and to the terminal only with --verbose."""

    def __init__(self):
        super().__init__()
        self.verbose = False
        self.held = 0  # Records kept off the terminal.
        self.file: Optional[str] = None
        self.file_failed = False  # Some record could not be written there (a full disk).

    def filter(self, record: logging_std.LogRecord) -> bool:
        if self.verbose or (record.pathname.startswith(_MEMJAX_DIR) and not hasattr(record, 'library')):
            return True
        if record.levelno >= logging_std.ERROR or record.exc_info:
            self.held += 1
            return False
        return True


_DETAILS = _LibraryDetails()


def quiet_library_logs(verbose: bool = False) -> None:
    """Routes library chatter and tracebacks as `_QuietLibraries` and `_LibraryDetails` say,
    including exceptions that library threads print straight to stderr (TensorStore's callbacks
    into a closed event loop after a failed write; threads that die)."""
    handler = logging.get_absl_handler()
    handler.addFilter(_QuietLibraries())
    _DETAILS.verbose = verbose
    handler.addFilter(_DETAILS)

    def log_exception(kind, value, traceback, thread=None):
        logging.error('Exception in %s: %s', getattr(thread, 'name', 'a library callback'), value,
                      exc_info=(kind, value, traceback), extra={'library': True})

    # Python warnings (JAX's failed compilation-cache write on a full disk) as one log line each.
    warnings.formatwarning = lambda message, category, filename, lineno, line=None: (
        f'{category.__name__}: {message} ({filename}:{lineno})')
    logging_std.captureWarnings(True)
    sys.excepthook = log_exception
    threading.excepthook = lambda args: log_exception(args.exc_type, args.exc_value, args.exc_traceback,
                                                      args.thread)
    sys.unraisablehook = lambda args: log_exception(args.exc_type, args.exc_value, args.exc_traceback)


class _QuietFileHandler(logging_std.FileHandler):
    """A log file on a full or read-only disk stops logging; it must not print a traceback for
    every record (memjax's own message says what failed)."""

    def handleError(self, record: logging_std.LogRecord) -> None:
        del record
        _DETAILS.file_failed = True

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # The last flush failed like the writes before it.
            pass


class _Uploader:
    """Copies a local log file to its gs:// object every `every_s` and at `close`: an object
    cannot be appended to, so the whole file replaces it each time (a `kill -9` loses at most
    the last `every_s` of the log; the terminal has it all)."""

    def __init__(self, local: str, target: str, every_s: float = 15.0):
        self.local, self.target = local, target
        self._stop = threading.Event()
        self._sent = -1
        self._thread = threading.Thread(target=self._loop, args=(every_s,), daemon=True,
                                        name='memjax-log-upload')
        self._thread.start()

    def upload(self) -> None:
        size = os.path.getsize(self.local)
        if size != self._sent:
            with open(self.local, 'rb') as f:
                storage.write_bytes(self.target, f.read())
            self._sent = size

    def _loop(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.upload()
            except Exception:  # pylint: disable=broad-except  (a network hiccup: the next try)
                _DETAILS.file_failed = True

    def close(self) -> None:
        """The last upload; if it fails the local copy stays, and `Details:` lines name it."""
        self._stop.set()
        self._thread.join()
        try:
            self.upload()
        except Exception as error:  # pylint: disable=broad-except
            logging.warning('Could not upload the log to %s (%s); it is kept at %s.', self.target,
                            type(error).__name__, self.local)
            _DETAILS.file = self.local
            return
        os.remove(self.local)


@contextlib.contextmanager
def log_to_workdir(workdir: str, process_index: int) -> Iterator[None]:
    """Appends every log record of the block, library details included, to `<workdir>/memjax.log`
    (process i > 0: memjax.process_<i>.log). In a gs:// workdir each run writes its own object,
    memjax[.process_<i>].<start time>.<host>.<pid>.log, uploaded every 15 s and at the end."""
    name = LOG_FILE if process_index == 0 else f'memjax.process_{process_index}.log'
    uploader = None
    if storage.is_remote(workdir):
        stem, ext = os.path.splitext(name)
        target = storage.join(workdir, f'{stem}.{time.strftime("%Y%m%d-%H%M%S")}.{socket.gethostname()}.'
                                       f'{os.getpid()}{ext}')
        fd, local = tempfile.mkstemp(prefix='memjax-', suffix='.log')
        os.close(fd)
        handler = _QuietFileHandler(local)
        uploader = _Uploader(local, target)
    else:
        handler = _QuietFileHandler(os.path.join(workdir, name))
    handler.setFormatter(logging.PythonFormatter())
    root = logging_std.getLogger()
    root.addHandler(handler)
    _DETAILS.file = uploader.target if uploader else handler.baseFilename
    _DETAILS.file_failed = False
    try:
        yield
    finally:
        root.removeHandler(handler)
        handler.close()
        if uploader is not None:
            uploader.close()


def where_details_are() -> str:
    """' Details: <log file>.' or ' --verbose shows the details.' when library errors were kept off
    the terminal; '' otherwise."""
    if not _DETAILS.held or _DETAILS.verbose:
        return ''
    if _DETAILS.file and not _DETAILS.file_failed:
        return f' Details: {_DETAILS.file}.'
    return ' --verbose shows the details.'

