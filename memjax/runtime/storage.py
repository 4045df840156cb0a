"""Paths that are local folders or Cloud Storage objects (`gs://bucket/...`), through etils epath.

A workdir on Cloud Storage outlives the VMs of a TPU pod and every host writes to it. Orbax
writes its checkpoints there itself (TensorStore); everything else memjax keeps in a workdir
(config, tokenizer, evaluation results, TensorBoard events, logs) goes through these helpers,
which differ from plain file calls in two ways object stores force: there is no rename (a
damaged checkpoint is copied, the copy verified, and only then the original deleted) and an
object is written whole (one upload replaces it atomically, so no temporary file is needed).
"""

import importlib.util
import io
import os
import tempfile
from typing import Optional

from etils import epath
import fsspec

from memjax import errors

_REMOTE = ('gs://',)
# Every process of a run writes into the workdir, and orbax writes past gcsfs: a cached listing
# would miss their objects (a checkpoint step, a quarantined copy).
for _protocol in ('gs', 'gcs'):
    fsspec.config.conf.setdefault(_protocol, {})['use_listings_cache'] = False


# How long a Cloud Storage request may keep retrying before memjax names the fault and stops; a run
# whose bucket stops answering ends within about four times this (the lock's heartbeat notices).
GCS_TIMEOUT_VARIABLE = 'MEMJAX_GCS_TIMEOUT_S'


def gcs_timeout_s() -> float:
    value = os.environ.get(GCS_TIMEOUT_VARIABLE, '60')
    try:
        return max(1.0, float(value))
    except ValueError:
        raise errors.UsageError(f'{GCS_TIMEOUT_VARIABLE}={value!r} must be a number of seconds.') from None


def is_remote(path: os.PathLike | str) -> bool:
    """Whether `path` names an object store (`gs://`) rather than a local or mounted folder."""
    return str(path).startswith(_REMOTE)


def require_support(path: os.PathLike | str, what: str) -> None:
    """Raises UsageError when `path` is a URL memjax cannot reach (a scheme other than gs://, or
    gs:// without the `gcs` extra installed)."""
    text = str(path)
    if '://' in text and not is_remote(text):
        raise errors.UsageError(f'{what}={text}: memjax reads and writes local paths and gs:// '
                                'URLs; give one of those.')
    if is_remote(text) and not all(importlib.util.find_spec(name) for name in ('gcsfs', 'google.cloud.storage')):
        raise errors.UsageError(f'{what}={text} needs Cloud Storage support: pip install -e '
                                '\'.[gcs]\' (gcsfs and google-cloud-storage).')


def path(p: os.PathLike | str) -> epath.Path:
    """`p` as an epath.Path: a `gs://` URL stays one, a local path has `~` expanded and is made
    absolute (so that it means the same after a change of directory)."""
    if is_remote(p):
        return epath.Path(str(p))
    return epath.Path(os.path.abspath(os.path.expanduser(str(p))))


def join(base: os.PathLike | str, *parts: str) -> str:
    """`base/part/...` as a string, for local paths and URLs alike."""
    return str(epath.Path(str(base)).joinpath(*parts)) if is_remote(base) else os.path.join(str(base), *parts)


def write_bytes(target: os.PathLike | str, data: bytes) -> None:
    """Replaces `target` whole: a reader sees the old content or the new, never a part."""
    target = path(target)
    if is_remote(target):
        target.write_bytes(data)  # One upload: an object is replaced atomically.
        return
    tmp = target.with_name(f'{target.name}.tmp.{os.getpid()}')
    try:
        tmp.write_bytes(data)
        os.replace(tmp, target)
    except BaseException:
        # A full disk or a signal mid-write: the previous content stays whole, no part beside it.
        tmp.unlink(missing_ok=True)
        raise


def write_result(target: os.PathLike | str, text: str) -> None:
    """write_text for a computed result, which must not be lost when the write fails (a full disk,
    a read-only folder, an unreachable bucket): `text` then goes to stdout and to a file kept
    beside `target` or, if that cannot be written either, in the system's temporary folder, and a
    one-line WorkdirError names the target, the cause and the copy."""
    try:
        write_text(target, text)
        return
    except Exception as error:  # pylint: disable=broad-except  (OSError locally, the client's on gs://)
        cause = getattr(error, 'strerror', None) or errors.brief(error, 200) or type(error).__name__
    kept = None
    for keep in (lambda: _keep_beside(target, text), lambda: _keep_in_temp(target, text)):
        try:
            kept = keep()
            break
        except Exception:  # pylint: disable=broad-except  (the next place, then stdout alone)
            continue
    print(text, flush=True)
    raise errors.WorkdirError(
        f'could not write {target} ({cause}): the result is printed above{f" and kept in {kept}" if kept else ""}; '
        'free some space or fix the permissions, and copy it there.')


def _keep_beside(target: os.PathLike | str, text: str) -> str:
    kept = path(target).with_name(f'{path(target).name}.unsaved')
    if kept.exists():  # An earlier failure's copy, not yet moved into place: never replaced.
        raise FileExistsError(str(kept))
    try:
        kept.write_text(text)
    except BaseException:
        kept.unlink(missing_ok=True)  # This call's own empty or partial copy would pass for the result.
        raise
    return str(kept)


def _keep_in_temp(target: os.PathLike | str, text: str) -> str:
    fd, kept = tempfile.mkstemp(prefix=f'{path(target).name}.', suffix='.unsaved')
    with os.fdopen(fd, 'w', encoding='utf-8') as f:
        f.write(text)
    return kept


def write_text(target: os.PathLike | str, text: str) -> None:
    """write_bytes of `text` in UTF-8."""
    write_bytes(target, text.encode('utf-8'))


def save_figure(figure, target: os.PathLike | str) -> None:
    """A matplotlib figure as a PNG at `target` (a file or gs:// object)."""
    buffer = io.BytesIO()
    figure.savefig(buffer, format='png', dpi=120)
    write_bytes(target, buffer.getvalue())


def append_text(target: os.PathLike | str, text: str) -> None:
    """Adds `text` at the end of `target`: a local file in append mode (concurrent writers'
    lines stay whole); an object, which cannot be appended to, rewritten with its content read
    first (an object that exists but cannot be read raises rather than be replaced)."""
    target = path(target)
    if not is_remote(target):
        with open(target, 'a', encoding='utf-8') as f:
            f.write(text)
        return
    try:
        before = target.read_text()
    except FileNotFoundError:
        before = ''
    write_text(target, before + text)


def read_text(source: os.PathLike | str) -> Optional[str]:
    """The text of `source`, or None when it does not exist or cannot be read."""
    try:
        return path(source).read_text()
    except (OSError, ValueError):
        return None


def listdir(folder: os.PathLike | str) -> list[str]:
    """Names in `folder` (an empty list when it does not exist)."""
    folder = path(folder)
    try:
        return sorted(child.name for child in folder.iterdir()) if folder.is_dir() else []
    except FileNotFoundError:
        return []


def _tree(folder: epath.Path) -> dict[str, tuple[int, Optional[str]]]:
    """{relative name: (size, crc32c)} of every object under a gs:// folder."""
    fs = fsspec.filesystem('gcs')
    root = str(folder)[len('gs://'):].rstrip('/')
    found = fs.find(root, detail=True)
    return {name[len(root) + 1:]: (int(info['size']), info.get('crc32c'))
            for name, info in found.items()}


def move_tree(source: os.PathLike | str, target: os.PathLike | str) -> None:
    """Moves folder `source` to `target` (which must not exist) without ever losing the only copy.

    Local: one rename. Cloud Storage has no rename: every object is copied, the copies are checked
    against the originals (names, sizes, CRC32C), and only then are the originals deleted; an
    error before that leaves the source whole.
    """
    source, target = path(source), path(target)
    if not is_remote(source):
        os.rename(source, target)
        return
    fs = fsspec.filesystem('gcs')
    originals = _tree(source)
    src, dst = str(source)[len('gs://'):].rstrip('/'), str(target)[len('gs://'):].rstrip('/')
    for name in originals:
        fs.copy(f'{src}/{name}', f'{dst}/{name}')
    copies = _tree(target)
    if copies != originals:
        raise OSError(f'the copy of {source} at {target} differs from it '
                      f'({len(copies)} objects copied of {len(originals)}); {source} is kept')
    fs.rm([f'{src}/{name}' for name in originals])
