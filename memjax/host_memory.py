"""Backs XLA:CPU's big per-step host buffers with transparent huge pages (a glibc malloc tunable).

Why: XLA's CPU runtime allocates every execution's temporaries (hundreds of MB for a training
step) with posix_memalign on one of its worker threads. glibc serves a block that large only as a
fresh mmap and unmaps it on free, so every step page-faults all of it in again, 4 KiB at a time:
at the enwik8-base shape that was ~120,000 page faults and ~18% of the CPU time of each step
(BENCHMARKS.md). With glibc's `hugetlb=1` tunable such blocks are mapped with transparent huge
pages, 512 times fewer faults.

glibc reads tunables only when a process starts, so `keep_host_buffers` re-executes the command
line once with GLIBC_TUNABLES set; call it before the program does anything worth keeping (the
command lines do it first thing). Where the kernel has transparent huge pages off, the tunable
changes nothing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import sys

MODES = ('auto', 'on', 'off')
TUNABLE = 'glibc.malloc.hugetlb=1'
_REEXECUTED = 'MEMJAX_HOST_MEMORY_REEXECUTED'  # Set across the re-exec, so it happens at most once.


def _accelerator_expected() -> bool:
    """True when JAX may pick a GPU or TPU, whose device memory does not come from malloc."""
    platforms = os.environ.get('JAX_PLATFORMS', '') or os.environ.get('JAX_PLATFORM_NAME', '')
    if platforms:
        return platforms.split(',')[0].strip().lower() != 'cpu'
    return bool(importlib.metadata.entry_points(group='jax_plugins')) or \
        importlib.util.find_spec('libtpu') is not None


def keep_host_buffers(mode: str = 'auto') -> bool:
    """Makes sure this process runs with the tunable; returns whether it does.

    mode 'auto' applies it on Linux/glibc when JAX will run on the CPU, 'on' whenever glibc is
    there, 'off' never. Applying it means re-executing this process (`os.execve` of its own
    command line), so the call only returns once the tunable is in effect.
    """
    if mode not in MODES:
        raise ValueError(f'host memory mode {mode!r} is not one of {MODES}.')
    if mode == 'off' or not sys.platform.startswith('linux') or platform.libc_ver()[0] != 'glibc':
        return False
    tunables = os.environ.get('GLIBC_TUNABLES', '')
    if TUNABLE in tunables.split(':'):
        return True
    if os.environ.get(_REEXECUTED) or (mode == 'auto' and _accelerator_expected()):
        return False
    env = dict(os.environ, GLIBC_TUNABLES=':'.join(filter(None, [tunables, TUNABLE])), **{_REEXECUTED: '1'})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
    return True  # Not reached: execve replaces this process.
