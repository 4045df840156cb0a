"""One training run at a time holds its workdir.

Two training runs writing checkpoints into one workdir would rotate each other's steps
out and resume from each other's state. The first run holds a lock (a file, or on Cloud
Storage an object); a second is refused with a message naming the holder. A lock whose
holder is gone (a `kill -9`, a lost node) is stale and taken over: the holder's process no
longer exists on this host, or its heartbeat (the lock touched or rewritten every minute) is
older than `STALE_AFTER_S`, which also covers holders on other hosts.

Taking a lock and taking over a stale one are atomic on both stores: a local file is created
with O_EXCL and set aside by rename before it is removed; a Cloud Storage object is created
under the precondition "no live generation" and deleted under "this generation", so of two
runs racing for one workdir exactly one wins.
"""

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
from typing import Any, Iterator, NamedTuple, Optional

from absl import logging

from memjax import errors
from memjax.runtime import storage
from memjax.training import workdir as workdir_lib

HEARTBEAT_S = 60.0
STALE_AFTER_S = 600.0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # Another user's process.
        return True
    return True


class _Seen(NamedTuple):
    text: str
    age_s: float  # Since the last heartbeat.
    version: Any  # What `remove_if` compares: the content (file) or the generation (object).


class _LockFile:
    """The lock as a file on a local or shared filesystem."""

    def __init__(self, path: str):
        self.path = path

    def create(self, text: str) -> Optional[Any]:
        """Writes `text` unless a lock exists: its version, or None."""
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return None
        except OSError as error:
            raise errors.WorkdirError(f'cannot write the lock {self.path} ({error.strerror}): make its folder '
                                      'writable, or use another --workdir.') from None
        try:
            with os.fdopen(fd, 'w') as f:
                f.write(text)
        except OSError as error:  # A full disk: no half-written lock is left to refuse the next run.
            os.remove(self.path)
            raise errors.WorkdirError(f'cannot write the lock {self.path} ({error.strerror}): free some space, '
                                      'or use another --workdir.') from None
        return text

    def read(self) -> Optional[_Seen]:
        try:
            with open(self.path) as f:
                text = f.read()
            return _Seen(text, time.time() - os.path.getmtime(self.path), text)
        except FileNotFoundError:
            return None

    def remove_if(self, version: Any) -> bool:
        """Removes the lock if it still is `version`. Renamed aside first: of two runs taking
        over at once, the second must not delete the lock the first has just created."""
        aside = f'{self.path}.stale.{os.getpid()}'
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        with open(aside) as f:
            taken = f.read()
        if taken != version:  # Someone else's fresh lock: put it back, unless a third run took the name.
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
            os.remove(aside)
            return False
        os.remove(aside)
        return True

    def touch(self, version: Any, text: str) -> Any:
        del text
        os.utime(self.path)
        return version


class _LockObject:
    """The lock as a Cloud Storage object; its generation number is its version."""

    def __init__(self, url: str):
        self.path = url
        self._bucket, _, self._name = url[len('gs://'):].partition('/')

    def _blob(self):
        return workdir_lib.gcs_client().bucket(self._bucket).blob(self._name)

    @contextlib.contextmanager
    def _refusal_is_one_line(self) -> Iterator[None]:
        """Other answers than the expected ones (a missing permission, say) as a WorkdirError."""
        from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
        try:
            yield
        except exceptions.GoogleAPICallError as error:
            raise errors.WorkdirError(
                f'cannot use the lock {self.path}: Cloud Storage refused ({type(error).__name__}: {error}); '
                'the account needs storage.objects.create, get, list and delete on the bucket '
                '(roles/storage.objectUser).') from None

    def create(self, text: str) -> Optional[Any]:
        from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
        blob = self._blob()
        with self._refusal_is_one_line():
            try:
                blob.upload_from_string(text, if_generation_match=0)
            except exceptions.PreconditionFailed:
                return None
        return blob.generation

    def read(self) -> Optional[_Seen]:
        """The lock's text with the generation that holds it: read under that generation, so that a
        stale holder's text is never paired with the generation of a lock taken since."""
        from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
        with self._refusal_is_one_line():
            for _ in range(5):  # Rewritten between the two requests (a heartbeat): read again.
                blob = self._blob()
                try:
                    blob.reload()
                    text = blob.download_as_bytes(if_generation_match=blob.generation).decode('utf-8', 'replace')
                except exceptions.NotFound:
                    return None
                except exceptions.PreconditionFailed:
                    continue
                updated = blob.updated or datetime.datetime.now(datetime.timezone.utc)
                return _Seen(text, time.time() - updated.timestamp(), blob.generation)
        return None

    def remove_if(self, version: Any) -> bool:
        from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
        with self._refusal_is_one_line():
            try:
                self._blob().delete(if_generation_match=version)
            except (exceptions.PreconditionFailed, exceptions.NotFound):
                return False
        return True

    def touch(self, version: Any, text: str) -> Any:
        """Rewrites the lock if it still is `version` (raises otherwise): its new generation."""
        blob = self._blob()
        blob.upload_from_string(text, if_generation_match=version, **workdir_lib.gcs_bounded())
        return blob.generation


class RunLock:
    """Holds `<workdir>/.memjax.lock` from `acquire()` to `release()` (a context manager)."""

    def __init__(self, workdir: str, user: str = 'training run'):
        self.path = storage.join(workdir, workdir_lib.LOCK_FILE)
        self.user = user  # What holds such a lock, in a refusal: 'training run', 'comparison'.
        self._store = _LockObject(self.path) if storage.is_remote(workdir) else _LockFile(self.path)
        self._owner = {'host': socket.gethostname(), 'pid': os.getpid(),
                       'started': time.strftime('%Y-%m-%d %H:%M:%S')}
        self._text = json.dumps(self._owner)
        self._version: Any = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _stale_reason(self, seen: _Seen, holder: dict) -> Optional[str]:
        if seen.age_s > STALE_AFTER_S:
            return f'its heartbeat is {seen.age_s:.0f}s old'
        if holder and holder['host'] == self._owner['host'] and not _pid_alive(holder['pid']):
            return f'process {holder["pid"]} no longer exists'
        return None

    @staticmethod
    def _holder(seen: Optional[_Seen]) -> dict:
        """The holder's {'host', 'pid', 'started'}, or {} when the lock does not say (half-written
        by a holder that has just started or died right away, or not memjax's): its age decides."""
        try:
            holder = json.loads(seen.text) if seen else {}
        except ValueError:
            return {}
        if not (isinstance(holder, dict) and isinstance(holder.get('host'), str)
                and type(holder.get('pid')) is int and holder['pid'] > 0):
            return {}
        return holder

    def _refusal(self, holder: dict) -> errors.WorkdirError:
        workdir = self.path[:-len(workdir_lib.LOCK_FILE) - 1]
        if holder:
            return errors.WorkdirError(
                f'{workdir} is in use by another {self.user} (process {holder["pid"]} on '
                f'{holder["host"]}, since {holder.get("started", "?")}): wait for it, stop it, or '
                f'use another --workdir. If that run is gone, delete {self.path}.')
        return errors.WorkdirError(
            f'{workdir} is locked by {self.path}, which does not name its holder (a {self.user} starting '
            f'this moment writes it, or the file is not memjax\'s): if no {self.user} uses this workdir, '
            f'delete the file; otherwise it is taken over once its heartbeat is '
            f'{STALE_AFTER_S:.0f}s old.')

    def acquire(self) -> 'RunLock':
        for _ in range(2):  # A second try after taking a stale lock over.
            self._version = self._store.create(self._text)
            if self._version is None:
                seen = self._store.read()
                if seen is None:
                    continue  # Released between the two calls.
                holder = self._holder(seen)
                reason = self._stale_reason(seen, holder)
                if reason is None:
                    raise self._refusal(holder)
                logging.warning('Taking over the stale lock %s of %s (%s).', self.path, holder,
                                reason)
                self._store.remove_if(seen.version)
                continue
            self._thread = threading.Thread(target=self._heartbeat, daemon=True,
                                            name='memjax-workdir-lock')
            self._thread.start()
            return self
        raise errors.WorkdirError(f'could not take the lock {self.path}: another run took it at '
                                  'the same moment.')

    def _heartbeat(self) -> None:
        remote = isinstance(self._store, _LockObject)
        # On Cloud Storage it also watches the bucket: every MEMJAX_GCS_TIMEOUT_S at most.
        period = min(HEARTBEAT_S, storage.gcs_timeout_s()) if remote else HEARTBEAT_S
        answered = time.time()
        unanswered_since = None  # When the first request still without an answer was sent.
        while not self._stop.wait(period):
            sent = time.time()
            try:
                self._version = self._store.touch(self._version, self._text)
                answered, unanswered_since = time.time(), None
            except Exception as error:  # pylint: disable=broad-except
                # A filesystem or network hiccup: try again. On Cloud Storage a failed precondition
                # means another run took the lock over (this run's heartbeat stopped for 10 minutes).
                logging.warning('Could not refresh the lock %s (%s: %s).', self.path,
                                type(error).__name__, error)
                unanswered_since = sent if unanswered_since is None else unanswered_since
                if remote and time.time() - answered > storage.gcs_timeout_s() and not self._stop.is_set():
                    # Not since the last answer: the bucket may have answered until just before the request.
                    self._lost(time.time() - unanswered_since, error)

    def _lost(self, seconds: float, error: Exception) -> None:
        """The bucket stopped answering: whatever the run waits on (a checkpoint's upload, a read)
        retries for minutes, so the run ends here. Its newest complete checkpoint stays the one a
        rerun resumes from; the lock is left to go stale (nothing can remove it now)."""
        print(f'Workdir error: Cloud Storage has not answered for {seconds:.0f}s ({type(error).__name__}; '
              f'{storage.GCS_TIMEOUT_VARIABLE}={storage.gcs_timeout_s():.0f}): the run stops; run the same command '
              'again once the bucket answers, which resumes from the newest complete checkpoint.',
              file=sys.stderr, flush=True)
        errors.exit_now(errors.EXIT_RUNTIME)

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            seen = self._store.read()
            if seen is not None and self._holder(seen) == self._owner:
                self._store.remove_if(seen.version)

    def __enter__(self) -> 'RunLock':
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
