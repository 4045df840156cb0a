"""The workdir: checked before anything runs (a folder or gs:// location that can hold a run, not
another run's checkpoints folder, with room for a result). One training run at a time holds it:
memjax/training/run_lock.py."""

import os
import shutil

from memjax import errors
from memjax.runtime import storage

LOCK_FILE = '.memjax.lock'  # Held by the run (memjax/training/run_lock.py).


def is_marker(name: str) -> bool:
    """Whether `name` is one only memjax writes into a workdir: a log of any process (on gs://
    each run's own, stamped), the lock, the checkpoints. A folder holding none is not memjax's."""
    return name in (LOCK_FILE, 'checkpoints') or (name.startswith('memjax') and name.endswith('.log'))


def check(workdir: str, create: bool, run: bool = True) -> None:
    """Raises WorkdirError unless `workdir` is (or, with `create`, can become) a writable folder
    or a gs:// location in an existing bucket, and is not a run's checkpoints folder.

    Without `create` (evaluation) a missing workdir is an error and nothing is created. With it, a
    folder that exists must be empty or a memjax workdir when it is for a `run`: a run writes
    config.json and train_summary.json there, which would replace files of those names that are
    someone else's (a comparison keeps its runs in subfolders and its own files by name).
    """
    storage.require_support(workdir, '--workdir')
    if storage.is_remote(workdir):
        _check_remote(workdir, create)  # First: the bucket answers (credentials) before it is listed.
        _check_not_checkpoints(workdir)
    else:
        _check_not_checkpoints(workdir)  # First: nothing is created inside a run's checkpoints.
        _check_local(workdir, create)
    if create and run:
        _check_ours(workdir)


def _check_local(workdir: str, create: bool) -> None:
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
    # Evaluating, generating and analysing read a workdir (a result written elsewhere is checked
    # on its own): a read-only one, an archived run, is theirs to read.
    if create and not os.access(workdir, os.W_OK | os.X_OK):
        raise errors.WorkdirError(f'--workdir={workdir} is not writable: fix its permissions or '
                                  'choose another folder.')


def _names(folder: str) -> list[str]:
    try:
        return storage.listdir(folder)
    except OSError as error:
        raise errors.WorkdirError(f'cannot list {folder} ({error.strerror or error}): fix its permissions or '
                                  'choose another folder.') from None


def _check_ours(workdir: str) -> None:
    names = _names(workdir)
    if names and not any(is_marker(name) for name in names):
        shown = ', '.join(names[:3]) + (', ...' if len(names) > 3 else '')
        raise errors.WorkdirError(
            f'--workdir={workdir} holds files no memjax run wrote ({shown}): a run would write its '
            f'config.json and train_summary.json among them. Name a new or empty folder, e.g. '
            f'--workdir={storage.join(workdir, "run")}.')


def _is_run(names: list[str]) -> bool:
    """A run's folder: a log or the lock, or what an import writes (memjax.import_transfo_xl)."""
    return any(is_marker(name) and name != 'checkpoints' for name in names) or {
        'config.json', 'tokenizer.json'} <= set(names)


def _check_not_checkpoints(workdir: str) -> None:
    """A run's checkpoints folder, or a step in it, named as a workdir: its parent is meant."""
    path = workdir.rstrip('/')
    for _ in range(2):  # The folder itself, or a step folder inside it.
        parent, _, name = path.rpartition('/')
        if name in ('checkpoints', 'checkpoints_damaged') and parent and _is_run(_names(parent)):
            raise errors.WorkdirError(f'--workdir={workdir} is inside the checkpoints of the run in {parent}: '
                                      f'name the run\'s own folder, --workdir={parent}.')
        path = parent
        if not path:
            return


def gcs_client():
    from google.auth import exceptions as auth  # pylint: disable=g-import-not-at-top
    from google.cloud import storage as gcs  # pylint: disable=g-import-not-at-top
    try:
        return gcs.Client()
    except auth.DefaultCredentialsError:
        raise errors.WorkdirError(
            'a gs:// workdir needs Cloud Storage credentials and none were found: run `gcloud auth '
            'application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a service account\'s key '
            'file (on a TPU or GCE VM its service account is used without either).') from None


def gcs_bounded():
    """Keywords bounding a request's retries by MEMJAX_GCS_TIMEOUT_S (the client's default is 120 s)."""
    from google.cloud.storage import retry  # pylint: disable=g-import-not-at-top
    seconds = storage.gcs_timeout_s()
    return {'timeout': seconds, 'retry': retry.DEFAULT_RETRY.with_timeout(seconds)}


def _unreachable(workdir: str, error: Exception) -> errors.WorkdirError:
    endpoint = os.environ.get('STORAGE_EMULATOR_HOST', 'https://storage.googleapis.com')
    return errors.WorkdirError(
        f'--workdir={workdir}: Cloud Storage at {endpoint} did not answer within {storage.gcs_timeout_s():.0f}s '
        f'({type(error).__name__}): check the network and the endpoint; {storage.GCS_TIMEOUT_VARIABLE} sets how '
        'long memjax retries.')


def _check_remote(workdir: str, create: bool) -> None:
    """A gs:// workdir: its bucket must exist and answer; an evaluation needs a run there.
    Folders are name prefixes on Cloud Storage: nothing needs creating."""
    from google.api_core import exceptions  # pylint: disable=g-import-not-at-top
    from google.auth import exceptions as auth  # pylint: disable=g-import-not-at-top
    import requests  # pylint: disable=g-import-not-at-top
    bucket = workdir[len('gs://'):].split('/')[0]
    try:
        found = gcs_client().bucket(bucket).exists(**gcs_bounded())
    except (exceptions.RetryError, requests.exceptions.ConnectionError, requests.exceptions.Timeout,
            auth.TransportError) as error:
        raise _unreachable(workdir, error) from None
    except exceptions.GoogleAPICallError as error:
        raise errors.WorkdirError(
            f'--workdir={workdir}: Cloud Storage refused ({type(error).__name__}: {error}); check the '
            'credentials and the bucket\'s permissions (storage.objects.create, get, list, '
            'delete).') from None
    if not found:
        raise errors.WorkdirError(f'--workdir={workdir}: the bucket gs://{bucket} does not exist (or '
                                  'this account cannot see it): create it in your TPUs\' region, or '
                                  'fix the name.')
    if not create and not storage.listdir(workdir):
        raise errors.WorkdirError(f'--workdir={workdir} holds nothing: name the workdir of a '
                                  'training run (python -m memjax.train --workdir=...).')


# What one result file with its history line takes, with room to spare: an evaluation's summary is
# about 1 KB.
RESULT_BYTES = 64 * 1024


def check_writable_file(path: str, size: int = RESULT_BYTES) -> None:
    """Raises WorkdirError unless `path` can be (over)written as a file of about `size` bytes: checked
    before a result is computed, so that a full disk is found before the work, not after."""
    if storage.is_remote(path):
        return  # An object is never a folder; a bucket's permissions show at the write.
    if os.path.isdir(path):
        raise errors.WorkdirError(f'{path} is a folder, so the result cannot be written there: '
                                  'name a file, or move the folder away.')
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.exists(existing):  # The folders still to be made: the first that exists decides.
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise errors.WorkdirError(f'cannot write {path}: {existing} is a file, not a folder.')
    target = path if os.path.exists(path) else existing
    if not os.access(target, os.W_OK):
        raise errors.WorkdirError(f'cannot write {path}: fix the permissions of {target}.')
    free = shutil.disk_usage(existing).free
    if free < size:
        raise errors.WorkdirError(f'cannot write {path}: {existing} has {free:,} bytes free and the result needs '
                                  f'about {size:,}; free some space or write it elsewhere.')
