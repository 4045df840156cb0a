"""Benchmark harness: suite registry, timing, machine description, tables and JSON.

A suite is a function `run(ctx: Context) -> SuiteResult` registered with `@register('name')`
in its own module `memjax/bench/suites/<name with - as _>.py`. Suites are imported lazily by
name, so a suite that needs an optional dependency (torch) costs nothing to the others, and
adding a suite means adding one file.

Timings are medians over several runs after warm-up, with `jax.block_until_ready` on every
result; compilation is timed separately (`lower` + `compile`) so it never leaks into a
throughput. Every ratio a suite reports is computed from figures measured in the same
invocation, because this machine is shared and absolute numbers drift between runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import json
import math
import os
import pkgutil
import platform
import statistics
import sys
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
import ml_collections

from memjax import config_lib
from memjax.bench import hlo
from memjax.kernels import cpu as cpu_kernels
from memjax.errors import BenchError, failed  # BenchError: re-exported for the suites

SIZES = ('tiny', 'full')
MIB, GIB = 2.0 ** 20, 2.0 ** 30
_SUITES: dict[str, Callable[['Context'], 'SuiteResult']] = {}
# The fingerprints of the programs `compile_fn` compiled since the running suite started, in order
# (None: no suite running): its report lists them, so two reports show whether they timed the same
# programs.
_programs: Optional[list[str]] = None


def register(name: str) -> Callable:
    """Decorator: `@register('train')` on `run(ctx) -> SuiteResult`."""

    def wrap(fn: Callable[['Context'], 'SuiteResult']) -> Callable[['Context'], 'SuiteResult']:
        if name in _SUITES and _SUITES[name] is not fn:
            raise BenchError(f'benchmark suite {name!r} is registered twice.')
        _SUITES[name] = fn
        return fn

    return wrap


def _module_name(suite: str) -> str:
    return 'memjax.bench.suites.' + suite.replace('-', '_')


def available_suites() -> list[str]:
    """Suite names from the module files, without importing them."""
    from memjax.bench import suites  # Local import: the package imports this module.
    return sorted(m.name.replace('_', '-') for m in pkgutil.iter_modules(suites.__path__)
                  if not m.name.startswith('_'))


def get_suite(name: str) -> Callable[['Context'], 'SuiteResult']:
    """The registered suite `name`, importing its module on first use."""
    if name not in _SUITES:
        if name not in available_suites():
            raise BenchError(f'unknown benchmark suite {name!r}; available: {available_suites()}.')
        importlib.import_module(_module_name(name))
    if name not in _SUITES:
        raise BenchError(f'module {_module_name(name)} does not register a suite named {name!r} '
                         f'(expected @register({name!r})).')
    return _SUITES[name]


def prepare_environment(name: str) -> None:
    """Adds the XLA flags suite `name` declares (its module's XLA_FLAGS) and the environment
    variables it sets unless the user did (ENVIRONMENT); call it before JAX starts its backend,
    which reads them once."""
    get_suite(name)
    module = importlib.import_module(_module_name(name))
    present = os.environ.get('XLA_FLAGS', '')
    missing = [flag for flag in getattr(module, 'XLA_FLAGS', ()) if flag not in present.split()]
    if missing:
        os.environ['XLA_FLAGS'] = ' '.join([present, *missing]).strip()
    for variable, value in getattr(module, 'ENVIRONMENT', {}).items():
        os.environ.setdefault(variable, value)


@dataclasses.dataclass(frozen=True)
class Context:
    """What a suite may read: the size to run, the experiment config and timing settings."""
    size: str = 'full'  # 'tiny': seconds-long shapes for CI; 'full': the real measurement.
    config: Optional[config_lib.RunConfig] = None  # --config resolved; None: the suite's default.
    warmup: int = 2
    repeats: int = 5
    parts: tuple[str, ...] = ()  # --parts: which parts of a suite that has them (its PARTS); (): its default.
    peak_from: Optional[str] = None  # --peak_from: a report whose peak rows are the roofline (accel).
    # Called with the rows measured so far by a suite that reports rows as it goes (--out keeps
    # them on disk, for a run stopped at a deadline); None: nobody listens.
    on_rows: Optional[Callable[[list], None]] = None
    out: Optional[str] = None  # --out: the report's path, beside which a suite may keep files (traces).

    def __post_init__(self):
        if self.size not in SIZES:
            raise BenchError(f'--size={self.size!r} must be one of {SIZES}.')
        problems = failed((self.warmup >= 0, f'--warmup={self.warmup} must be >= 0.'),
                          (self.repeats >= 1, f'--repeats={self.repeats} must be >= 1.'))
        if problems:
            raise BenchError(' '.join(problems))

    @property
    def tiny(self) -> bool:
        return self.size == 'tiny'

    def log(self, message: str) -> None:
        """Progress on stderr, so stdout holds only the table."""
        print(f'[bench] {message}', file=sys.stderr, flush=True)


@dataclasses.dataclass
class SuiteResult:
    """A suite's measurements: one row per measured case plus headline figures.

    rows: list of flat dicts (one table row each); columns: their display order.
    figures: the headline numbers others quote (e.g. {'peak_gflops': ...}).
    config: the settings measured (shapes, dtypes, batch); notes: caveats, in sentences.
    """
    rows: list[dict[str, Any]]
    columns: Sequence[str]
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of each timed run (after warm-up); `median_s` is the figure to quote."""
    times_s: tuple[float, ...]
    warmup: int

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def min_s(self) -> float:
        return min(self.times_s)

    @property
    def max_s(self) -> float:
        return max(self.times_s)

    def as_dict(self) -> dict[str, Any]:
        return {'median_s': self.median_s, 'min_s': self.min_s, 'max_s': self.max_s,
                'runs': len(self.times_s), 'warmup': self.warmup, 'times_s': list(self.times_s)}


def time_fn(fn: Callable, *args, warmup: int = 2, repeats: int = 5,
            clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Times `fn(*args)` `repeats` times after `warmup` untimed calls.

    Each call's result is waited for with `jax.block_until_ready`: JAX dispatches
    asynchronously, so without it we would time the dispatch, not the computation.
    """
    return time_interleaved({'fn': lambda: fn(*args)}, warmup=warmup, repeats=repeats, clock=clock)['fn']


def time_interleaved(fns: dict[str, Callable[[], Any]], warmup: int = 2, repeats: int = 5,
                     clock: Callable[[], float] = time.perf_counter, settle: int = 0) -> dict[str, Timing]:
    """Times several functions round-robin: one timed call of each per round, `repeats` rounds,
    each after `settle` untimed calls of its own.

    Why: implementations compared in one invocation should meet the same machine. Timed one
    after the other, a burst of load from another process can land on one of them only;
    interleaved, it lands on all of them. `settle` times a step as it runs in a loop of its own
    steps (as in training or evaluation), not right after another implementation: memjax's first
    evaluation step after a PyTorch step takes 16 % longer than the next ones, PyTorch's the same
    (docs/perf-notes.md).
    """
    if repeats < 1:
        raise BenchError(f'repeats={repeats} must be >= 1.')
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            for _ in range(settle):
                jax.block_until_ready(fn())
            start = clock()
            jax.block_until_ready(fn())
            times[name].append(clock() - start)
    timings = {name: Timing(tuple(t), warmup) for name, t in times.items()}
    # Each figure as soon as it exists: a suite killed at a deadline (a GPU job's time limit) still
    # leaves what it measured in its progress log, although its table prints only at the end.
    print('[bench] timed ' + ', '.join(f'{name}: {t.median_s * 1e3:.3f} ms' for name, t in timings.items()),
          file=sys.stderr, flush=True)
    return timings


@dataclasses.dataclass(frozen=True)
class Compiled:
    """An AOT-compiled function with the seconds spent tracing+lowering and compiling it."""
    executable: Any  # jax.stages.Compiled: call it with the same argument shapes.
    lower_s: float
    compile_s: float

    @property
    def total_s(self) -> float:
        """Tracing and lowering plus XLA's compile."""
        return self.lower_s + self.compile_s

    @property
    def flops(self) -> Optional[float]:
        """XLA's cost-analysis FLOP count of one call plus the products of memjax's CPU kernels in
        it, which that analysis cannot see (None where the backend gives no count)."""
        analysis = self.executable.cost_analysis()
        if isinstance(analysis, (list, tuple)):  # Older jax: one dict per program.
            analysis = analysis[0] if analysis else None
        value = (analysis or {}).get('flops')
        return None if value is None or value < 0 else float(value) + hlo.kernel_flops(self.executable.as_text())

    def memory(self) -> dict[str, int]:
        """Byte sizes from XLA's memory analysis of the compiled program."""
        stats = self.executable.memory_analysis()
        names = ('argument_size_in_bytes', 'output_size_in_bytes', 'alias_size_in_bytes',
                 'temp_size_in_bytes', 'generated_code_size_in_bytes')
        return {name.replace('_in_bytes', '_bytes'): int(getattr(stats, name)) for name in names}

    @property
    def live_bytes(self) -> int:
        """Bytes a call holds at its peak by XLA's buffer assignment, if every temporary were alive at
        once (an upper bound where the backend reports no finer peak, as XLA's CPU client does): its
        arguments, its temporaries and the outputs that do not reuse a donated argument."""
        m = self.memory()
        return m['argument_size_bytes'] + m['output_size_bytes'] - m['alias_size_bytes'] + m['temp_size_bytes']


def compile_fn(fn: Callable, *args, clock: Callable[[], float] = time.perf_counter,
               **jit_kwargs) -> Compiled:
    """`jax.jit(fn, **jit_kwargs).lower(*args).compile()`, timing the two stages."""
    start = clock()
    lowered = jax.jit(fn, **jit_kwargs).lower(*args)
    lowered_at = clock()
    executable = lowered.compile()
    compiled = Compiled(executable, lowered_at - start, clock() - lowered_at)
    if _programs is not None:
        _programs.append(hlo.fingerprint(hlo.program_text(executable)))
    print(f'[bench] compiled in {compiled.lower_s:.1f} s + {compiled.compile_s:.1f} s', file=sys.stderr,
          flush=True)
    return compiled


@contextlib.contextmanager
def recording_programs() -> Iterator[list[str]]:
    """The list that collects the fingerprints (`hlo.fingerprint`) of what `compile_fn` compiles
    inside the block (a suite, or a suite's worker process)."""
    global _programs  # pylint: disable=global-statement
    _programs = []
    try:
        yield _programs
    finally:
        _programs = None


def add_compiled_programs(fingerprints: Sequence[str]) -> None:
    """Counts programs a suite's worker process compiled as the suite's own."""
    if _programs is not None:
        _programs.extend(fingerprints)


def compile_and_time(fn: Callable, *args, ctx: 'Context') -> tuple[Compiled, Timing]:
    """`fn` compiled for `args` (`compile_fn`), then its calls on them timed (`time_fn`, the
    context's warm-up and repeats): for a function without state to carry."""
    compiled = compile_fn(fn, *args)
    return compiled, time_fn(compiled.executable, *args, warmup=ctx.warmup, repeats=ctx.repeats)


# (vendor_id, cpu family) -> [(first model, last model, microarchitecture)]: a VM often reports a
# bare "AMD EPYC" or "Intel Xeon Processor", and speed figures hold for one microarchitecture only.
_MICROARCHITECTURES = {
    ('AuthenticAMD', 23): [(0x00, 0x2f, 'Zen / Zen+'), (0x30, 0xff, 'Zen 2')],
    ('AuthenticAMD', 25): [(0x00, 0x0f, 'Zen 3'), (0x10, 0x1f, 'Zen 4'), (0x20, 0x5f, 'Zen 3'),
                           (0x60, 0x7f, 'Zen 4'), (0xa0, 0xaf, 'Zen 4c')],
    ('AuthenticAMD', 26): [(0x00, 0xff, 'Zen 5')],
    ('GenuineIntel', 6): [(0x3f, 0x3f, 'Haswell-EP'), (0x4f, 0x4f, 'Broadwell-EP'),
                          (0x55, 0x55, 'Skylake-SP / Cascade Lake'), (0x6a, 0x6c, 'Ice Lake-SP'),
                          (0x8f, 0x8f, 'Sapphire Rapids'), (0xcf, 0xcf, 'Emerald Rapids'),
                          (0xad, 0xae, 'Granite Rapids')],
}


def cpu_model(cpuinfo: str) -> str:
    """The first processor of a /proc/cpuinfo text as 'name (family F model M: microarchitecture)'."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(':')
        fields.setdefault(key.strip(), value.strip())
    name = fields.get('model name') or platform.processor() or platform.machine()
    if not (fields.get('cpu family', '').isdigit() and fields.get('model', '').isdigit()):
        return name
    family, model = int(fields['cpu family']), int(fields['model'])
    known = [arch for first, last, arch in _MICROARCHITECTURES.get((fields.get('vendor_id'), family), [])
             if first <= model <= last]
    return f'{name} (family {family} model {model}' + (f': {known[0]})' if known else ')')


def _cpu_model() -> str:
    try:
        with open('/proc/cpuinfo', encoding='utf-8') as f:
            return cpu_model(f.read())
    except OSError:
        return platform.processor() or platform.machine()


def _version(package: str) -> Optional[str]:
    try:
        return importlib.import_module(package).__version__
    except (ImportError, AttributeError):
        return None


# /proc/cpuinfo flags that decide XLA:CPU's matmul speed, in the words a reader compares.
_VECTOR_FLAGS = (('avx512f', 'AVX-512'), ('avx2', 'AVX2'), ('avx512_bf16', 'AVX-512 BF16'),
                 ('amx_bf16', 'AMX BF16'), ('asimd', 'NEON'), ('sve', 'SVE'))


def _vector_isa() -> str:
    """The CPU's vector extensions that matter here, e.g. 'AVX2 (no AVX-512, no BF16)'."""
    flags: set[str] = set()
    try:
        with open('/proc/cpuinfo', encoding='utf-8') as f:
            for line in f:
                if line.startswith(('flags', 'Features')):
                    flags = set(line.split(':', 1)[1].split())
                    break
    except OSError:
        return 'unknown'
    have = [name for flag, name in _VECTOR_FLAGS if flag in flags]
    missing = [name for flag, name in _VECTOR_FLAGS[:3] if flag not in flags and 'avx2' in flags]
    return ', '.join(have) + (f' (no {", no ".join(missing)})' if missing else '') if have else 'none known'


def _kernel_isa() -> str:
    """Which form of memjax's CPU kernels runs (they are built for the host unless told otherwise)."""
    if jax.default_backend() != 'cpu' or os.environ.get(cpu_kernels.SWITCH, 'on') == 'off':
        return 'memjax CPU kernels off'
    lanes = cpu_kernels.vector_lanes()
    target = os.environ.get(cpu_kernels.ARCH, 'native')
    return f'memjax CPU kernels: {lanes}-float vectors (-march={target})' if lanes else 'memjax CPU kernels not built'


def machine_info() -> dict[str, Any]:
    """Where and with what a figure was measured (goes into every JSON)."""
    devices = jax.devices()
    try:
        usable_cores = len(os.sched_getaffinity(0))
    except AttributeError:
        usable_cores = os.cpu_count()
    return {
        'cpu_model': _cpu_model(),
        'vector_isa': _vector_isa(),
        'kernel_isa': _kernel_isa(),
        'cpu_count': os.cpu_count(),
        'usable_cores': usable_cores,
        'load_average_1m_5m_15m': list(os.getloadavg()) if hasattr(os, 'getloadavg') else None,
        'platform': platform.platform(),
        'python': platform.python_version(),
        'versions': {name: _version(name) for name in ('jax', 'jaxlib', 'flax', 'optax', 'numpy')},
        'backend': jax.default_backend(),
        'device_kind': devices[0].device_kind,
        'device_count': len(devices),
        'devices': [str(d) for d in devices],
        'xla_flags': os.environ.get('XLA_FLAGS', ''),
    }


def format_value(value: Any) -> str:
    """A figure as the tables print it."""
    if isinstance(value, float):
        if math.isnan(value):
            return 'n/a'
        if value != 0 and (abs(value) >= 1e5 or abs(value) < 1e-3):
            return f'{value:.3e}'
        return f'{value:.4g}'
    return '-' if value is None else str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A Markdown table (pastes straight into BENCHMARKS.md and the bench notes)."""
    cells = [[format_value(row.get(c)) for c in columns] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(values):
        return '| ' + ' | '.join(v.ljust(w) for v, w in zip(values, widths)) + ' |'

    return '\n'.join([line(columns), line(['-' * w for w in widths])] + [line(r) for r in cells])


def _jsonable(value: Any) -> Any:
    if isinstance(value, ml_collections.ConfigDict):
        return _jsonable(value.to_dict())
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN / inf.
    if hasattr(value, 'item') and getattr(value, 'ndim', None) == 0:  # numpy / jax scalars.
        return _jsonable(value.item())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def run_suite(name: str, ctx: Context, command: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Runs suite `name` and returns the JSON-ready report (machine, config, rows, figures)."""
    suite = get_suite(name)
    if ctx.parts and not hasattr(importlib.import_module(_module_name(name)), 'PARTS'):
        raise BenchError(f'the {name} suite has no parts; leave out --parts.')
    started = datetime.datetime.now(datetime.timezone.utc)
    start = time.perf_counter()
    with recording_programs() as compiled_programs:
        result = suite(ctx)
    return _jsonable({
        'suite': name,
        'size': ctx.size,
        'command': ' '.join(command if command is not None else sys.argv),
        'started_utc': started.isoformat(timespec='seconds'),
        'wall_s': time.perf_counter() - start,
        'machine': machine_info(),
        'timing': {'warmup': ctx.warmup, 'repeats': ctx.repeats, 'statistic': 'median'},
        'experiment_config': ctx.config.source if ctx.config is not None else None,
        'config': result.config,
        'figures': result.figures,
        'columns': list(result.columns),
        'rows': result.rows,
        'notes': result.notes,
        'programs': compiled_programs,
    })


def partial_report(name: str, ctx: Context, rows: list[dict[str, Any]], command: Sequence[str]) -> dict[str, Any]:
    """The JSON of a suite still running: its rows so far, with the machine and command."""
    return _jsonable({'suite': name, 'size': ctx.size, 'command': ' '.join(command), 'partial': True,
                      'machine': machine_info(), 'rows': rows})


def report_text(report: dict[str, Any]) -> str:
    """The printed form of a report: table, headline figures, notes."""
    lines = [f"## {report['suite']} ({report['size']})", '',
             format_table(report['rows'], report['columns']), '']
    lines += [f'- {key}: {format_value(value)}' for key, value in report['figures'].items()]
    lines += [f'- note: {note}' for note in report['notes']]
    machine = report['machine']
    lines.append(f"- machine: {machine['cpu_model']}; {machine.get('vector_isa', 'vector ISA not recorded')}; "
                 f"{machine.get('kernel_isa', 'kernels not recorded')}; "
                 f"{machine['usable_cores']} usable cores, "
                 f"{machine['device_count']} x {machine['device_kind']}, jax {machine['versions']['jax']}, "
                 f"load {machine['load_average_1m_5m_15m']}")
    return '\n'.join(lines)


def write_json(path: str, report: dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:
        json.dump(report, f, indent=2, sort_keys=False)
        f.write('\n')
