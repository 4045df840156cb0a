"""Python's garbage collector set for a process that traces and compiles models.

Tracing a model for `jax.jit` allocates hundreds of thousands of short-lived Python objects. With
Python's default thresholds the collector runs every 700 allocations, and its older generations
walk the objects the imports left behind (JAX, Flax, Orbax, TFDS: some 170,000) again and
again, though those live as long as the process. On a 2-layer model that was a tenth or more of a
command's time after its imports (`python -m memjax.bench compile`, BENCHMARKS.md). `tune` moves
what exists now out of the collector's reach (`gc.freeze`) and lets the youngest generation grow
to 10,000 objects: cycles are still collected within one step's worth of allocations, so memory
held by a cycle (a jax.Array in a traceback) is not kept noticeably longer.

The command lines call `tune` once their modules are imported (memjax/cli.py); a library user's
own process is left as it is.
"""

import contextlib
import gc
from typing import Iterator

YOUNGEST_THRESHOLD = 10_000  # Python's default: 700.


def tune() -> None:
    """Freezes the objects that exist now and raises the youngest generation's threshold."""
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNGEST_THRESHOLD, middle, oldest)


@contextlib.contextmanager
def python_defaults() -> Iterator[None]:
    """Python's own collector settings inside the block (for measuring what `tune` saves); after
    it, the thresholds of before again, and frozen objects (if there were) frozen again."""
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    gc.unfreeze()
    gc.set_threshold(700, 10, 10)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if frozen:
            gc.freeze()
