"""Stops XLA:CPU from page-faulting its big per-step host buffers in 4 KiB at a time (glibc malloc).

Why: XLA's CPU runtime allocates every execution's temporaries (hundreds of MB for a training
step) with posix_memalign on one of its worker threads. glibc serves a block that large only as a
fresh mmap and unmaps it on free, so every step page-faults all of it in again, 4 KiB at a time:
at the enwik8-base shape that was ~120,000 page faults and ~18% of the CPU time of each step
(docs/perf-notes.md).

Two remedies, chosen with `mode`:
- 'auto' / 'on': glibc's `hugetlb=1` tunable, which maps such blocks with transparent huge pages
  (512x fewer faults). glibc reads tunables only when a process starts, so this re-executes the
  command line once with GLIBC_TUNABLES set; call it before the program does anything worth
  keeping (the command lines do it first thing). Clearly faster for small and mid-sized steps;
  for the largest measured, steps alternate between fast and slow (the kernel still zeroes the
  pages), so 'reuse' is the choice there.
- 'reuse': every thread allocates from the main heap with mmap and trimming off, so the block is
  reused from step to step and nothing is faulted or zeroed again. Faster still when a step's
  temporaries are large, but the one shared malloc arena slows small, fast steps such as the
  quickstart's (figures in docs/perf-notes.md), and freed memory stays with the process. Only threads that have not allocated yet
  are affected, so it too must run before JAX starts.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import platform
import sys
from typing import Mapping, Optional, Sequence

MODES = ('auto', 'on', 'reuse', 'off')
TUNABLE = 'glibc.malloc.hugetlb=1'
_REEXECUTED = 'MEMJAX_HOST_MEMORY_REEXECUTED'  # Set across the re-exec, so it happens at most once.
# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_NEVER_TRIM = 2 ** 31 - 1  # mallopt takes an int: keep up to 2 GiB of free heap top.


def _accelerator_expected(environ: Mapping[str, str]) -> bool:
    """True when JAX may pick a GPU or TPU, whose device memory does not come from malloc."""
    platforms = environ.get('JAX_PLATFORMS', '') or environ.get('JAX_PLATFORM_NAME', '')
    if platforms:
        return platforms.split(',')[0].strip().lower() != 'cpu'
    return bool(importlib.metadata.entry_points(group='jax_plugins')) or \
        importlib.util.find_spec('libtpu') is not None


def keep_host_buffers(mode: str = 'auto') -> bool:
    """Applies the remedy `mode` names (see above); returns whether one is in effect.

    'auto' applies huge pages on Linux/glibc when JAX will run on the CPU, 'on' whenever glibc
    is there, 'reuse' the main-heap settings, 'off' nothing. Huge pages mean re-executing this
    process (`os.execve` of its own command line), so the call returns once they are in effect.
    """
    if mode not in MODES:
        raise ValueError(f'host memory mode {mode!r} is not one of {MODES}.')
    if mode == 'off' or not sys.platform.startswith('linux') or platform.libc_ver()[0] != 'glibc':
        return False
    if mode == 'reuse':
        libc = ctypes.CDLL('libc.so.6')
        return all(libc.mallopt(param, value) == 1 for param, value in (
            (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM)))
    if TUNABLE in os.environ.get('GLIBC_TUNABLES', '').split(':'):
        return True
    env = reexecuted_environment(mode, os.environ)
    if env is None:
        return False
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
    return True  # Not reached: execve replaces this process.


def reexecuted_environment(mode: str, environ: Mapping[str, str]) -> Optional[dict]:
    """The environment `keep_host_buffers(mode)` re-executes a process started with `environ` in,
    for huge pages; None where it does not re-execute (a mode without huge pages, no glibc, huge
    pages in effect or tried once already, an accelerator expected under 'auto')."""
    if mode not in ('auto', 'on') or not sys.platform.startswith('linux') or platform.libc_ver()[0] != 'glibc':
        return None
    tunables = environ.get('GLIBC_TUNABLES', '')
    if (TUNABLE in tunables.split(':') or environ.get(_REEXECUTED)
            or (mode == 'auto' and _accelerator_expected(environ))):
        return None
    return dict(environ, GLIBC_TUNABLES=':'.join(filter(None, [tunables, TUNABLE])), **{_REEXECUTED: '1'})


def command_line_mode(args: Sequence[str]) -> Optional[str]:
    """The mode a command line's --host_memory gives (default 'auto'), read before its flags are
    parsed; None for a value that is no mode, or a --flagfile (left to the parsed flags: `cli.run`
    applies them)."""
    mode = 'auto'
    for i, arg in enumerate(args):
        name, equals, value = arg.lstrip('-').partition('=')
        if not arg.startswith('-'):
            continue
        if name == 'flagfile':
            return None
        if name == 'host_memory':
            mode = value if equals else (args[i + 1] if i + 1 < len(args) else '')
    return mode if mode in MODES else None


def keep_host_buffers_first() -> None:
    """`keep_host_buffers` for the command line's --host_memory (default 'auto'), as a command's
    first statement. Re-executed there, the process has not yet imported JAX and the libraries,
    which re-executing once the flags are parsed pays for twice (about a second: 2 cores of an AMD
    EPYC). A value that is no mode, or a --flagfile, is left to the parsed flags (`cli.run`
    applies them; once huge pages are in effect, applying them again changes nothing)."""
    mode = command_line_mode(sys.argv[1:])
    if mode:
        keep_host_buffers(mode)
