"""`ops`: where memjax's and PyTorch's Transformer-XL steps spend their time, op by op.

The `peer` suite says who is faster; this one says where. On the peer's model, weights and
tokens (the same pair, checked to agree before anything is timed), it profiles memjax's compiled
train and eval steps (jax.profiler: one event per executed XLA op, named as in the optimized
HLO) and the PyTorch peer's (torch.profiler, per aten op; eager, and torch.compile at --size=full),
and lists for each step its most expensive ops (memjax's XLA ops merged by the model code they
compute, over layers: `forward: attention/value/dot_general`): time per step, share of the step's op time,
GFLOP/s for ops that multiply matrices (FLOPs from the HLO's dot shapes; torch's own FLOP count)
and that rate against the model-shaped matmul peak measured in the same invocation.

Op times are summed over the threads that ran them: XLA:CPU runs independent ops side by side,
so the shares are of the step's op time, which can exceed its wall time. Control flow (a loop, a
conditional) is not an op of its own here: its event spans its body's ops, which are counted.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile
from typing import Any, Callable

import jax
import jax.numpy as jnp

from memjax.bench import harness
from memjax.bench import hlo as hlo_lib
from memjax.bench.suites import peak as peak_suite
from memjax.bench.suites import peer
from memjax.kernels import cpu as cpu_kernels

# XLA:CPU names its ops in the profile only with this flag, which must be set before JAX starts
# its CPU client (`python -m memjax.bench ops` sets it; see memjax/bench/__main__.py).
XLA_FLAGS = ('--xla_cpu_enable_xprof_traceme=true',)
TOP = 10  # Ops listed per step; the rest are summed in one row.
TARGET = 1.5  # The speed-up over torch.compile that issue 29 asks for, which the roofline weighs.

def _source(op_name: str) -> str:
    """What model code an XLA op comes from, the same for every layer: its metadata's op_name
    without the jit wrapper and the layer, marked forward or backward."""
    parts = op_name.split('/')
    parts = [p for p in parts[1:] if parts[0].startswith('jit(')] or parts
    # The layer (and the layer scan's loop) is dropped: one row per computation of every layer.
    parts = [p for p in parts if not re.fullmatch(r'layer_\d+(\.compute)?|while|body|closed_call', p)]
    if parts and parts[0].startswith('transpose('):
        return 'backward: ' + '/'.join(parts[1:])
    if parts and (parts[0].startswith('jvp(') or parts[0] == 'MemoryLM'):
        return 'forward: ' + '/'.join(parts[1:])
    return 'step: ' + '/'.join(parts)


def hlo_op_sources(hlo: str) -> dict[str, str]:
    """{op name of the optimized HLO: the model code it computes (`_source`)}; ops XLA made itself
    (layout copies) are named by their kind."""
    sources = {}
    for line in hlo.splitlines():
        instruction = hlo_lib.INSTRUCTION.match(line)
        if instruction is not None:
            name = instruction.group(1)
            found = re.search(r'op_name="([^"]*)"', line)
            sources[name] = _source(found.group(1)) if found else 'XLA: ' + re.sub(r'\.\d+$', '', name)
    return sources


def by_source(values: dict[str, float], sources: dict[str, str]) -> dict[str, float]:
    merged: dict[str, float] = collections.Counter()
    for op, value in values.items():
        merged[sources.get(op, 'XLA: ' + op)] += value
    return dict(merged)


def profile_xla(loop: Callable, steps: int, hlo: str) -> tuple[dict[str, float], dict[str, float]]:
    """({XLA op name: seconds per step}, {XLA op name: FLOPs per step}) over `steps` calls of `loop`
    (after one untimed call), `hlo` its optimized HLO; control flow is left out (its ops are in)."""
    op_flops, nesting = hlo_lib.op_flops(hlo), hlo_lib.control_flow_ops(hlo)
    if not all(flag in os.environ.get('XLA_FLAGS', '') for flag in XLA_FLAGS):
        raise harness.BenchError(f'the ops suite needs XLA_FLAGS={" ".join(XLA_FLAGS)} set before JAX '
                                 'starts; run it as python -m memjax.bench ops, which sets it.')
    from jax.profiler import ProfileData  # pylint: disable=g-import-not-at-top
    jax.block_until_ready(loop())
    with tempfile.TemporaryDirectory(prefix='memjax-ops-') as folder:
        with jax.profiler.trace(folder):
            for _ in range(steps):
                jax.block_until_ready(loop())
        trace = glob.glob(os.path.join(folder, '**', '*.xplane.pb'), recursive=True)[0]
        profile = ProfileData.from_file(trace)
    seconds: dict[str, float] = collections.Counter()
    flops: dict[str, float] = collections.Counter()
    for plane in profile.planes:
        for line in plane.lines:
            for event in line.events:
                op = dict(event.stats).get('hlo_op')
                if op is not None and op not in nesting:
                    seconds[op] += event.duration_ns * 1e-9 / steps
                    flops[op] += op_flops.get(op, 0.0) / steps
    return dict(seconds), dict(flops)


def profile_torch(loop: Callable, steps: int) -> tuple[dict[str, float], dict[str, float]]:
    """({aten op: self seconds per step}, {aten op: FLOPs per step}) over `steps` calls of `loop`."""
    torch, _ = peer.import_torch()
    loop()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
        for _ in range(steps):
            loop()
    seconds, flops = {}, {}
    for event in prof.key_averages():
        if event.self_cpu_time_total > 0:
            seconds[event.key] = event.self_cpu_time_total * 1e-6 / steps
            # Its counter also counts elementwise adds; the rates here are of matrix products.
            flops[event.key] = (event.flops or 0) / steps if event.key.endswith('mm') else 0.0
    return seconds, flops


def _kind(op: str, flops: float) -> str:
    if flops > 0:
        return 'matmul'
    name = op.lower()
    if 'copy' in name or 'transpose' in name or 'concatenate' in name or 'slice' in name:
        return 'copy/layout'
    if 'reduce' in name or 'softmax' in name or 'sum' in name or 'max' in name:
        return 'reduction'
    return 'elementwise/other'


def op_rows(seconds: dict[str, float], flops: dict[str, float], peak: float,
            labels: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """The TOP most expensive ops, one row for the rest, and the step's totals by kind."""
    total = sum(seconds.values())
    ranked = sorted(seconds, key=seconds.get, reverse=True)

    def row(op: str, kind: str, time_s: float, op_flops: float) -> dict[str, Any]:
        rate = op_flops / time_s / 1e9 if op_flops and time_s else None
        return {**labels, 'op': op, 'kind': kind, 'ms_per_step': time_s * 1e3, 'share': time_s / total,
                'gflops_per_s': rate, 'of_matmul_peak': rate / peak if rate else None}

    rows = [row(op, _kind(op, flops.get(op, 0.0)), seconds[op], flops.get(op, 0.0)) for op in ranked[:TOP]]
    rest = ranked[TOP:]
    if rest:
        rows.append(row(f'({len(rest)} other ops)', '', sum(seconds[o] for o in rest),
                        sum(flops.get(o, 0.0) for o in rest)))
    by_kind: dict[str, float] = collections.Counter()
    for op, time_s in seconds.items():
        by_kind[_kind(op, flops.get(op, 0.0))] += time_s
    matmul_s = by_kind.get('matmul', 0.0)
    matmul_flops = sum(flops.get(op, 0.0) for op in seconds)
    totals = {'op_ms_per_step': total * 1e3, 'matmul_gflop_per_step': matmul_flops / 1e9,
              **{f'share_{kind}': time_s / total for kind, time_s in by_kind.items()},
              'matmul_gflops_per_s': matmul_flops / matmul_s / 1e9 if matmul_s else None}
    return rows, totals


def measure_vocab(vocab: peer.Vocab, shape: peer.Shape, ctx: harness.Context, peak: float,
                  try_compile: bool) -> tuple[list[dict[str, Any]], dict[str, float]]:
    torch, _ = peer.import_torch()
    ctx.log(f'ops: {vocab.name} softmax: building the peer pair and checking it')
    hf_model, mcfg, params = peer.build_pair(shape, vocab)
    peer.check_same_model(hf_model, mcfg, params, shape)
    tokens = peer.random_tokens(vocab.vocab_size, shape.batch_size, shape.tgt_len + 1, seed=2)
    ours = peer.memjax_loops(mcfg, params, tokens, shape)
    forwards = {'hf_eager': hf_model, **({'hf_compiled': torch.compile(hf_model)} if try_compile else {})}
    theirs = {impl: peer.hf_loops(hf_model, forward, tokens, shape) for impl, forward in forwards.items()}
    rows, figures = [], {}
    for mode in ('train', 'eval'):
        loop, _, hlo = ours[mode]
        ctx.log(f'ops: {vocab.name} memjax {mode}: profiling {ctx.repeats} steps')
        sources = hlo_op_sources(hlo)
        profiles = {'memjax': tuple(by_source(values, sources)
                                    for values in profile_xla(loop, ctx.repeats, hlo))}
        for impl in theirs:
            ctx.log(f'ops: {vocab.name} {impl} {mode}: profiling {ctx.repeats} steps')
            profiles[impl] = profile_torch(theirs[impl][mode], ctx.repeats)
        for impl, (seconds, flops) in profiles.items():
            impl_rows, totals = op_rows(seconds, flops, peak, {'vocab': vocab.name, 'mode': mode, 'impl': impl})
            rows += impl_rows
            figures.update({f'{impl}_{mode}_{vocab.name}_{k}': v for k, v in totals.items()})
        rival = 'hf_compiled' if 'hf_compiled' in theirs else 'hf_eager'
        ctx.log(f'ops: {vocab.name} {mode}: timing memjax and {rival} (no profiler) for the roofline')
        timings = harness.time_interleaved({'memjax': loop, rival: theirs[rival][mode]}, warmup=ctx.warmup,
                                           repeats=ctx.repeats, settle=1)
        gflop = figures[f'memjax_{mode}_{vocab.name}_matmul_gflop_per_step']
        bound = roofline(gflop, peak, timings['memjax'].median_s, timings[rival].median_s)
        figures.update({f'roofline_{mode}_{vocab.name}_{k}': v for k, v in {'rival': rival, **bound}.items()})
    return rows, figures


def roofline(gflop: float, peak: float, memjax_s: float, rival_s: float) -> dict[str, float]:
    """What the matmul peak allows a step of `gflop` GFLOP of matrix products: at least `floor_ms`
    even if everything ran at the peak and nothing else took time. `memjax_of_peak` is the share of
    the peak the whole measured step sustains; `needed_of_peak` the share it would need to be
    TARGET x faster than the rival's measured step (above 1: impossible at these FLOPs)."""
    floor_s = gflop / peak
    return {'floor_ms': floor_s * 1e3, 'memjax_ms': memjax_s * 1e3, 'rival_ms': rival_s * 1e3,
            'speedup': rival_s / memjax_s, 'memjax_of_peak': floor_s / memjax_s,
            'needed_of_peak': floor_s / (rival_s / TARGET)}


def kernel_matmul_gflops(shape: tuple[int, int, int, int], ctx: harness.Context) -> float | None:
    """GFLOP/s of memjax's CPU kernel (memjax/kernels/cpu.py) on the (batch, m, k, n) float32 product,
    or None where it does not apply (then the model's steps use XLA's products)."""
    batch, m, k, n = shape
    lhs_key, rhs_key = jax.random.split(jax.random.PRNGKey(0))
    lhs = jax.random.normal(lhs_key, (batch, m, k))
    rhs = jax.random.normal(rhs_key, (batch, k, n))
    if not cpu_kernels.applies(lhs, rhs):
        return None
    reference = lambda a, b: jnp.einsum('bmk,bkn->bmn', a, b)
    product = jax.jit(lambda a, b: cpu_kernels.product(reference, a, b))
    timing = harness.time_fn(product, lhs, rhs, warmup=ctx.warmup, repeats=ctx.repeats)
    return 2.0 * batch * m * k * n / timing.median_s / 1e9


def torch_matmul_gflops(shape: tuple[int, int, int, int], ctx: harness.Context) -> float:
    """GFLOP/s of torch.matmul (MKL / oneDNN through aten) on the (batch, m, k, n) float32 product that
    `peak_suite.measure` times with XLA: the same shapes, so the two rates say whose kernel is faster."""
    torch, _ = peer.import_torch()
    batch, m, k, n = shape
    generator = torch.Generator().manual_seed(0)
    lhs = torch.randn(batch, m, k, generator=generator)
    rhs = torch.randn(batch, k, n, generator=generator)
    with torch.no_grad():
        timing = harness.time_interleaved({'torch': lambda: torch.matmul(lhs, rhs)}, warmup=ctx.warmup,
                                          repeats=ctx.repeats)['torch']
    return 2.0 * batch * m * k * n / timing.median_s / 1e9


@harness.register('ops')
def run(ctx: harness.Context) -> harness.SuiteResult:
    torch, transformers = peer.import_torch()
    shape = peer.SHAPES[ctx.size]
    threads = peer.jax_cpu_cores()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try_compile = not ctx.tiny
    peak_rows = []
    for name, matmul in peak_suite.matmul_shapes(shape.batch_size, shape.tgt_len, shape.mem_len, shape.d_model,
                                                 shape.n_head, shape.d_head, shape.d_inner):
        ctx.log(f'ops: model-shaped matmul {name}: XLA, memjax\'s CPU kernel, torch')
        peak_rows.append({'matmul': name, **peak_suite.measure(matmul, 'float32', ctx),
                          'kernel_gflops_per_s': kernel_matmul_gflops(matmul, ctx),
                          'torch_gflops_per_s': torch_matmul_gflops(matmul, ctx)})
    peak = max(r['gflops_per_s'] for r in peak_rows)
    rows, figures = [], {'matmul_peak_gflops_per_s': peak, 'torch_threads': threads}
    for r in peak_rows:
        product = r['matmul'].split()[0]
        figures[f'matmul_{product}_xla_gflops_per_s'] = r['gflops_per_s']
        figures[f'matmul_{product}_torch_gflops_per_s'] = r['torch_gflops_per_s']
        if r['kernel_gflops_per_s'] is not None:
            figures[f'matmul_{product}_kernel_gflops_per_s'] = r['kernel_gflops_per_s']
    try:
        for vocab in peer.VOCABS[ctx.size]:
            vocab_rows, vocab_figures = measure_vocab(vocab, shape, ctx, peak, try_compile)
            rows += vocab_rows
            figures.update(vocab_figures)
    finally:
        torch.set_num_threads(previous_threads)
    return harness.SuiteResult(
        rows=rows,
        columns=('vocab', 'mode', 'impl', 'op', 'kind', 'ms_per_step', 'share', 'gflops_per_s', 'of_matmul_peak'),
        figures=figures,
        config={'shape': shape.__dict__, 'vocabs': [v.__dict__ for v in peer.VOCABS[ctx.size]],
                'profiled_steps': ctx.repeats, 'dtype': 'float32', 'torch_threads': threads,
                'matmul_peak_rows': [{k: v for k, v in r.items() if k != 'timing'} for r in peak_rows]},
        notes=[
            f'torch {torch.__version__}, transformers {transformers.__version__}; the peer suite\'s model, '
            'weights and tokens (checked to agree before profiling); float32; memjax: jax.profiler over the '
            f'compiled steps (XLA op names of the optimized HLO), torch: torch.profiler self CPU time per aten op.',
            'ms_per_step: the op\'s time per step summed over the threads that ran it; share: of the step\'s '
            'op time (independent XLA ops run side by side, so op time can exceed the wall time).',
            'gflops_per_s: ops that multiply matrices (memjax: 2 x output x contracted size of every dot, '
            'fusions included; torch: its profiler\'s FLOP count); of_matmul_peak: against the best '
            f'GFLOP/s of this model\'s float32 matmul shapes measured in this invocation ({peak:.1f}).',
            'matmul_<product>_{xla,kernel,torch}_gflops_per_s: each model-shaped float32 product (one layer\'s, '
            'config matmul_peak_rows) timed alone, as one jitted XLA einsum, with memjax\'s CPU kernel '
            '(memjax/kernels; absent where it does not apply) and as torch.matmul: whose kernel is faster on '
            'the same shape.',
            'roofline_*: memjax and torch.compile (hf_eager at --size=tiny) timed round-robin without the '
            'profiler; floor_ms = memjax\'s matrix-product GFLOP per step / the peak; memjax_of_peak = floor / '
            f'memjax\'s step; needed_of_peak = floor / (the rival\'s step / {TARGET}): the share of the peak a '
            f'whole step must sustain to be {TARGET}x faster (above 1: impossible with these FLOPs).',
            *(['torch.compile not profiled at --size=tiny (it compiles for minutes).'] if not try_compile else []),
        ])
