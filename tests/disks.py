"""Real small disks for the fault tests (not a test module): a tmpfs mounted for the test, full or
read-only, where this machine lets the tests mount one (root); elsewhere the test is skipped with
the reason."""

import contextlib
import os
import subprocess
from typing import Iterator, Optional

import pytest


@contextlib.contextmanager
def small_disk(path, size_kib: int, read_only: bool = False, holding: Optional[str] = None) -> Iterator[str]:
    """A tmpfs of `size_kib` at `path`, holding a copy of the folder `holding` if given (copied
    before it is made read-only), unmounted afterwards."""
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size_kib}k', 'tmpfs', str(path)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f'cannot mount a small tmpfs here to make a full or read-only disk: {mounted.stderr.strip()}')
    try:
        if holding is not None:
            subprocess.run(['cp', '-a', f'{holding}/.', str(path)], check=True)
        if read_only:
            subprocess.run(['mount', '-o', 'remount,ro', str(path)], check=True)
        yield str(path)
    finally:
        subprocess.run(['umount', '-l', str(path)], check=False)


def fill(folder: str) -> None:
    """Takes every free byte of `folder`'s disk."""
    fd = os.open(os.path.join(folder, 'filler'), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for block in (4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b'\0' * block):
                    pass
    finally:
        os.close(fd)
