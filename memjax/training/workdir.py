"""The workdir: checked before anything runs, and held by one training run at a time.

Two training runs writing checkpoints into one workdir would rotate each other's steps
out and resume from each other's state. The first run holds a lock file; a second is
refused with a message naming the holder. A lock whose holder is gone (a `kill -9`, a
lost node) is stale and taken over: the holder's process no longer exists on this host,
or its heartbeat (the file's modification time, refreshed every minute) is older than
`STALE_AFTER_S`, which also covers holders on other hosts of a shared filesystem.
"""

import json
import os
import socket
import threading
import time
from typing import Optional

from absl import logging

from memjax import errors

LOCK_FILE = '.memjax.lock'
HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0


def check(workdir: str, create: bool) -> None:
    """Raises WorkdirError unless `workdir` is (or, with `create`, can become) a writable folder.

    Without `create` (evaluation) a missing workdir is an error and nothing is created.
    """
    if '://' in workdir:
        raise errors.WorkdirError(
            f'--workdir={workdir}: memjax writes its workdir with file-system calls and does not '
            'speak to object stores by URL yet; give a path every process sees (an NFS share such '
            'as Filestore, or the bucket mounted with Cloud Storage FUSE).')
    if os.path.exists(workdir) and not os.path.isdir(workdir):
        raise errors.WorkdirError(f'--workdir={workdir} is a file, not a folder: name a folder.')
    if not os.path.exists(workdir):
        if not create:
            raise errors.WorkdirError(f'--workdir={workdir} does not exist: name the workdir of a '
                                      'training run (python -m memjax.train --workdir=...).')
        try:
            os.makedirs(workdir, exist_ok=True)
        except OSError as error:
            raise errors.WorkdirError(f'cannot create --workdir={workdir} ({error.strerror}): '
                                      'choose a folder you can write to.') from error
    if not os.access(workdir, os.W_OK | os.X_OK):
        raise errors.WorkdirError(f'--workdir={workdir} is not writable: fix its permissions or '
                                  'choose another folder.')


def check_writable_file(path: str) -> None:
    """Raises WorkdirError unless `path` can be (over)written as a file."""
    if os.path.isdir(path):
        raise errors.WorkdirError(f'{path} is a folder, so the result cannot be written there: '
                                  'move it away.')
    target = path if os.path.exists(path) else os.path.dirname(path) or '.'
    if not os.access(target, os.W_OK):
        raise errors.WorkdirError(f'cannot write {path}: fix the permissions of {target}.')


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # Another user's process.
        return True
    return True


class RunLock:
    """Holds `<workdir>/.memjax.lock` from `acquire()` to `release()` (a context manager)."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, LOCK_FILE)
        self._owner = {'host': socket.gethostname(), 'pid': os.getpid(),
                       'started': time.strftime('%Y-%m-%d %H:%M:%S')}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _stale_reason(self, holder: dict) -> Optional[str]:
        try:
            age = time.time() - os.path.getmtime(self.path)
        except FileNotFoundError:
            return 'it was just released'
        if age > STALE_AFTER_S:
            return f'its heartbeat is {age:.0f}s old'
        if holder and holder['host'] == self._owner['host'] and not _pid_alive(holder['pid']):
            return f'process {holder["pid"]} no longer exists'
        return None

    def _read_holder(self) -> dict:
        """The holder's {'host', 'pid', 'started'}, or {} when the file does not say (half-written
        by a holder that has just started or died right away, or not memjax's): its age decides."""
        try:
            with open(self.path) as f:
                holder = json.load(f)
        except (OSError, ValueError):
            return {}
        if not (isinstance(holder, dict) and isinstance(holder.get('host'), str)
                and type(holder.get('pid')) is int and holder['pid'] > 0):
            return {}
        return holder

    def _refusal(self, holder: dict) -> errors.WorkdirError:
        workdir = os.path.dirname(self.path)
        if holder:
            return errors.WorkdirError(
                f'{workdir} is in use by another training run (process {holder["pid"]} on '
                f'{holder["host"]}, since {holder.get("started", "?")}): wait for it, stop it, or '
                f'use another --workdir. If that run is gone, delete {self.path}.')
        return errors.WorkdirError(
            f'{workdir} is locked by {self.path}, which does not name its holder (a run starting '
            f'this moment writes it, or the file is not memjax\'s): if no run uses this workdir, '
            f'delete the file; otherwise it is taken over once its heartbeat is '
            f'{STALE_AFTER_S:.0f}s old.')

    def acquire(self) -> 'RunLock':
        for _ in range(2):  # A second try after taking a stale lock over.
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read_holder()
                reason = self._stale_reason(holder)
                if reason is None:
                    raise self._refusal(holder) from None
                logging.warning('Taking over the stale lock %s of %s (%s).', self.path, holder,
                                reason)
                # Renamed, not removed: of two runs taking over at once, the second must not
                # delete the lock the first has just created.
                aside = f'{self.path}.stale.{os.getpid()}'
                try:
                    os.rename(self.path, aside)
                except FileNotFoundError:
                    continue
                with open(aside) as f:
                    taken = f.read()
                if holder and taken != json.dumps(holder):
                    # Someone else's fresh lock: put it back, unless a third run took the name.
                    try:
                        os.link(aside, self.path)
                    except FileExistsError:
                        pass
                    os.remove(aside)
                    continue
                os.remove(aside)
                continue
            with os.fdopen(fd, 'w') as f:
                json.dump(self._owner, f)
            self._thread = threading.Thread(target=self._heartbeat, daemon=True,
                                            name='memjax-workdir-lock')
            self._thread.start()
            return self
        raise errors.WorkdirError(f'could not take the lock {self.path}: another run took it at '
                                  'the same moment.')

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # A filesystem hiccup, or the file briefly set aside: try again.
                continue

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            if self._read_holder() == self._owner:
                os.remove(self.path)

    def __enter__(self) -> 'RunLock':
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
