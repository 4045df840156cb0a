"""Where a compiled step's time goes on its device, by what the model computes, from a trace.

`jax.profiler` records one event per op the device ran (a GPU kernel or copy, an XLA:CPU op when
`--xla_cpu_enable_xprof_traceme=true` was set before JAX started). Each op is put in a category by
the model code its optimized HLO says it computes (its `op_name` metadata), the traced steps' span
is swept once, and every instant of it goes to the ops running then (split evenly when several
run side by side, as XLA:CPU's threads and a GPU's streams do) or, when none runs, to `idle`: so
the categories add up to the traced step exactly, and `idle` is what the device spent waiting
(launches, host round trips, the host itself).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import os
import re
import shutil
import tempfile
from typing import Callable, Iterable, Iterator, Optional

import jax

from memjax.bench import hlo as hlo_lib

ATTENTION = 'attention'
DENSE = 'dense products'
SOFTMAX = 'adaptive softmax'
ELEMENTWISE = 'layer norm and elementwise'
OPTIMIZER = 'optimizer'
UNATTRIBUTED = 'unattributed'
COPIES = 'host-device copies'
IDLE = 'idle'
# In the order rows are printed; what each holds is `category`'s docstring.
CATEGORIES = (ATTENTION, DENSE, SOFTMAX, ELEMENTWISE, OPTIMIZER, UNATTRIBUTED, COPIES, IDLE)
# The attention modules' own linear maps (memjax.model.attention): products like the feed-forward's.
_PROJECTIONS = frozenset({'query', 'key', 'value', 'out', 'pos'})
_REMAT = frozenset({'checkpoint', 'rematted_computation'})  # Path parts remat adds.


def category(op_name: Optional[str], multiplies: bool) -> str:
    """The category of an op whose HLO metadata names `op_name` (None: XLA made it, a layout copy
    or a conversion, with no source); `multiplies`: it runs a matrix product.

    - attention: the scores, softmax, relative shift, weighted values and attention dropout, i.e.
      ops under an `attention` module other than its projections and LayerNorm (its residual add
      and dropout too, which op names do not tell apart);
    - dense products: the model's other matrix products (projections, feed-forward);
    - adaptive softmax: the embedding and the output head (`io`), products included;
    - layer norm and elementwise: the model's other ops (LayerNorm, residuals, dropout,
      activations, the memory's update);
    - optimizer: the step's ops outside the model (the loss's sum, gradient clipping, Adam).
    """
    if not op_name:
        return UNATTRIBUTED
    parts = op_name.split('/')
    if not any('MemoryLM' in part for part in parts):
        return OPTIMIZER
    if any(part.startswith('io.') or part == 'io' for part in parts):
        return SOFTMAX
    if 'layer_norm' in parts:  # Under remat: .../attention/checkpoint/.../layer_norm/...
        return ELEMENTWISE
    if 'attention' in parts:
        below = [p for p in parts[parts.index('attention') + 1:] if p not in _REMAT]
        if not (below and below[0] in _PROJECTIONS):
            return ATTENTION
    return DENSE if multiplies else ELEMENTWISE


def op_categories(hlo: str) -> dict[str, str]:
    """{op name of the optimized HLO `hlo`: its category}."""
    products = hlo_lib.matmul_ops(hlo)
    return {name: category(op_name, name in products) for name, op_name in hlo_lib.op_names(hlo).items()}


@dataclasses.dataclass(frozen=True)
class Event:
    start_ns: int
    end_ns: int
    category: str


def sweep(events: Iterable[Event]) -> tuple[dict[str, float], float]:
    """({category: seconds}, span in seconds) of `events`: each instant between the first start and
    the last end goes to the categories of the events running then, evenly, or to IDLE."""
    boundaries = []
    for event in events:
        boundaries.append((event.start_ns, 1, event.category))
        boundaries.append((event.end_ns, -1, event.category))
    if not boundaries:
        return {name: 0.0 for name in CATEGORIES}, 0.0
    boundaries.sort(key=lambda b: (b[0], b[1]))
    seconds: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    running: collections.Counter = collections.Counter()
    previous = boundaries[0][0]
    for time_ns, change, name in boundaries:
        width = (time_ns - previous) * 1e-9
        count = sum(running.values())
        if width > 0:
            if count:
                for running_name, n in running.items():
                    seconds[running_name] += width * n / count
            else:
                seconds[IDLE] += width
        running[name] += change
        if not running[name]:
            del running[name]
        previous = time_ns
    return seconds, (boundaries[-1][0] - boundaries[0][0]) * 1e-9


def _op_of(event, names: dict[str, str]) -> Optional[str]:
    stats = dict(event.stats)
    for candidate in re.split(r'[,;\s]+', str(stats.get('hlo_op', ''))) + [event.name]:
        if candidate in names:
            return candidate
    return None


def device_events(trace_path: str, categories: dict[str, str], skip: frozenset[str]) -> list[Event]:
    """The ops of the program whose ops are `categories` in the trace at `trace_path`: on an
    accelerator its device planes' kernels and copies (a kernel no HLO op claims is UNATTRIBUTED),
    on a CPU the host's op events; ops in `skip` (loops, conditionals: their events span their
    bodies' ops) are left out."""
    from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
    planes = list(ProfileData.from_file(trace_path).planes)
    accelerator = [p for p in planes if p.name.startswith('/device:') and 'CPU' not in p.name]
    events = []
    for plane in accelerator or planes:
        # A GPU's kernels are on its stream lines; a TPU's ops on 'XLA Ops'. Where both exist the
        # latter is derived from the former (and spans the gaps between an op's kernels).
        lines = [l for l in plane.lines if l.name.startswith('Stream')] or list(plane.lines)
        for line in lines:
            for event in line.events:
                op = _op_of(event, categories)
                if op in skip:
                    continue
                if op is not None:
                    name = categories[op]
                elif not accelerator:
                    continue  # The host's own work (Python, the runtime) is not a device op.
                elif 'memcpy' in event.name.lower() or 'memcpy_details' in dict(event.stats):
                    name = COPIES
                elif line.name.startswith('Stream') or 'XLA Ops' in line.name:
                    name = UNATTRIBUTED
                else:
                    continue  # Summary lines (modules, steps) that span the ops.
                events.append(Event(event.start_ns, event.end_ns, name))
    return events


@contextlib.contextmanager
def traced(loop: Callable, steps: int) -> Iterator[str]:
    """The path of a `jax.profiler` trace of `steps` calls of `loop`, valid inside the `with`; one
    untraced call first keeps compilation and first-run allocations out of it."""
    jax.block_until_ready(loop())
    with tempfile.TemporaryDirectory(prefix='memjax-profile-') as folder:
        with jax.profiler.trace(folder):
            for _ in range(steps):
                jax.block_until_ready(loop())
        yield glob.glob(os.path.join(folder, '**', '*.xplane.pb'), recursive=True)[0]


def profile(loop: Callable, steps: int, hlo: str, keep_as: Optional[str] = None) -> dict:
    """{'seconds': {category: per step}, 'step_s': the traced span per step, 'trace': the kept
    file}: `steps` calls of `loop` traced; `hlo` is its optimized HLO. `keep_as`: where to copy the
    trace file (None: not kept)."""
    categories, skip = op_categories(hlo), hlo_lib.control_flow_ops(hlo)
    with traced(loop, steps) as trace:
        seconds, span = sweep(device_events(trace, categories, skip))
        if keep_as:
            shutil.copyfile(trace, keep_as)
    return {'seconds': {name: s / steps for name, s in seconds.items()}, 'step_s': span / steps,
            'trace': keep_as}
