"""Keeps XLA:CPU's per-step host buffers mapped between steps (glibc malloc settings).

Why: XLA's CPU runtime allocates every execution's temporaries (hundreds of MB for a training
step) with posix_memalign on one of its worker threads. glibc serves a block that large from a
per-thread arena only as a fresh mmap and unmaps it on free, so every step page-faults and
zeroes all of it again: at the enwik8-base shape that was ~120,000 page faults and ~18% of the
CPU time of each step (BENCHMARKS.md). Serving every thread from the main heap, with mmap and
trimming off, keeps that memory mapped and reused from step to step.

The settings only take effect for threads that have not allocated yet, so call
`keep_host_buffers` before JAX creates its CPU client (the command lines do it first thing).
The cost: freed host memory stays with the process until it exits, and all threads share one
malloc arena; both are right for a process that runs one model until it is done.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import platform
import sys

MODES = ('auto', 'on', 'off')

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_NEVER_TRIM = 2 ** 31 - 1  # mallopt takes an int; 2 GiB of free heap top before giving any back.


def _accelerator_expected() -> bool:
    """True when JAX may pick a GPU or TPU, whose device memory does not come from malloc."""
    platforms = os.environ.get('JAX_PLATFORMS', '') or os.environ.get('JAX_PLATFORM_NAME', '')
    if platforms:
        return platforms.split(',')[0].strip().lower() != 'cpu'
    return bool(importlib.metadata.entry_points(group='jax_plugins')) or \
        importlib.util.find_spec('libtpu') is not None


def keep_host_buffers(mode: str = 'auto') -> bool:
    """Applies the malloc settings above; returns whether they were applied.

    mode 'auto' applies them on Linux/glibc when JAX will run on the CPU, 'on' whenever glibc is
    there, 'off' never.
    """
    if mode not in MODES:
        raise ValueError(f'host memory mode {mode!r} is not one of {MODES}.')
    if mode == 'off' or not sys.platform.startswith('linux') or platform.libc_ver()[0] != 'glibc':
        return False
    if mode == 'auto' and _accelerator_expected():
        return False
    libc = ctypes.CDLL('libc.so.6')
    return all(libc.mallopt(param, value) == 1 for param, value in (
        (_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER_TRIM)))
