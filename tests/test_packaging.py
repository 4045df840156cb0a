"""What a plain `pip install .` (not editable) gets: a wheel built from the source.

The tests run memjax from the checkout, where every file is at hand whatever setup.cfg
declares. A wheel holds only the modules and the package data setup.cfg names, so a file that
memjax reads at run time and setup.cfg forgets (the CPU kernel's C++ source, compiled on first
use; the embedded corpus) is missing only for the users who install it that way.
"""

import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

from packaging import version as versions
import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
# setuptools builds wheels without the `wheel` package from 70.1 on: offline, with no build
# environment to download.
OFFLINE_BUILDS_FROM = (70, 1)


def _setuptools_release() -> tuple:
    try:
        return versions.Version(importlib.metadata.version('setuptools')).release
    except importlib.metadata.PackageNotFoundError:
        return ()


def _package_files(root: pathlib.Path) -> set[str]:
    """Every file under root/memjax but Python's bytecode, as paths in a wheel."""
    return {path.relative_to(root).as_posix() for path in (root / 'memjax').rglob('*')
            if path.is_file() and '__pycache__' not in path.parts and path.suffix != '.pyc'}


@pytest.mark.skipif(_setuptools_release() < OFFLINE_BUILDS_FROM,
                    reason="needs setuptools >= 70.1 (the test extra's) to build memjax's wheel offline")
def test_a_wheel_holds_every_file_of_the_package(tmp_path):
    # A copy: the build writes build/ and memjax.egg-info beside the sources.
    source = tmp_path / 'source'
    shutil.copytree(REPO / 'memjax', source / 'memjax', ignore=shutil.ignore_patterns('__pycache__', '*.pyc'))
    for name in ('setup.cfg', 'pyproject.toml', 'README.md'):
        shutil.copy(REPO / name, source / name)
    build = subprocess.run(
        [sys.executable, '-c', 'import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))',
         str(tmp_path / 'dist')], cwd=source, capture_output=True, text=True, check=False,
        env={**os.environ, 'PYTHONDONTWRITEBYTECODE': '1'})
    assert build.returncode == 0, build.stderr[-3000:]
    # setup.cfg leaves no folder of the package to setuptools' guess (a data-only folder outside
    # `packages` is still copied today, with this warning that it will not be).
    assert 'absent from the `packages` configuration' not in build.stderr
    with zipfile.ZipFile(tmp_path / 'dist' / build.stdout.split()[-1]) as wheel:
        installed = {name for name in wheel.namelist() if name.startswith('memjax/')}
    expected = _package_files(source)
    assert {'memjax/kernels/batched_matmul.cc', 'memjax/data/corpus/train.txt.xz'} <= expected
    assert installed == expected
