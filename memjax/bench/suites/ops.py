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
import functools
import os
import re
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from memjax.bench import harness
from memjax.bench import hlo as hlo_lib
from memjax.bench import step_profile
from memjax.bench.suites import peak as peak_suite
from memjax.bench.suites import peer
from memjax.kernels import cpu as cpu_kernels
from memjax.model.attention import span_scores_masked

# XLA:CPU names its ops in the profile only with this flag, which must be set before JAX starts
# its CPU client (`python -m memjax.bench ops` sets it; see memjax/bench/__main__.py).
XLA_FLAGS = ('--xla_cpu_enable_xprof_traceme=true',)
TOP = 10  # Ops listed per step; the rest are summed in one row.
COLUMNS = ('vocab', 'mode', 'impl', 'op', 'kind', 'ms_per_step', 'share', 'gflops_per_s', 'of_matmul_peak')
TARGET = 1.5  # The speed-up over torch.compile that issue 29 asks for, which the roofline weighs.
IMPLS = ('xla', 'kernel', 'torch', 'torch_onednn')  # Who multiplies the model-shaped products.

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
    return {name: _source(op_name) if op_name else 'XLA: ' + re.sub(r'\.\d+$', '', name)
            for name, op_name in hlo_lib.op_names(hlo).items()}


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
    with step_profile.traced(loop, steps) as trace:
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
    ours = peer.memjax_cases(mcfg, params, tokens, shape, reprojecting=False)
    forwards = {'hf_eager': hf_model, **({'hf_compiled': torch.compile(hf_model)} if try_compile else {})}
    theirs = {impl: peer.hf_loops(hf_model, forward, tokens, shape) for impl, forward in forwards.items()}
    rows, figures = [], {}
    for mode in ('train', 'eval'):
        loop, hlo = ours[mode].loop, ours[mode].compiled.executable.as_text()
        ctx.log(f'ops: {vocab.name} memjax {mode}: profiling {ctx.repeats} steps')
        sources = hlo_op_sources(hlo)
        profiles = {'memjax': tuple(by_source(values, sources)
                                    for values in profile_xla(loop, ctx.repeats, hlo))}
        for impl in theirs:
            ctx.log(f'ops: {vocab.name} {impl} {mode}: profiling {ctx.repeats} steps')
            profiles[impl] = profile_torch(theirs[impl][mode], ctx.repeats)
        mode_rows = []
        for impl, (seconds, flops) in profiles.items():
            impl_rows, totals = op_rows(seconds, flops, peak, {'vocab': vocab.name, 'mode': mode, 'impl': impl})
            mode_rows += impl_rows
            figures.update({f'{impl}_{mode}_{vocab.name}_{k}': v for k, v in totals.items()})
        rows += mode_rows
        # Printed now as well: a run stopped at a deadline (a job's time limit) keeps what it measured.
        ctx.log(f'ops: {vocab.name} {mode} by op:\n' + harness.format_table(mode_rows, COLUMNS))
        rival = 'hf_compiled' if 'hf_compiled' in theirs else 'hf_eager'
        ctx.log(f'ops: {vocab.name} {mode}: timing memjax and {rival} (no profiler) for the roofline')
        timings = harness.time_interleaved({'memjax': loop, rival: theirs[rival][mode]}, warmup=ctx.warmup,
                                           repeats=ctx.repeats, settle=1)
        gflop = figures[f'memjax_{mode}_{vocab.name}_matmul_gflop_per_step']
        rival_profile = {k[len(f'{rival}_{mode}_{vocab.name}_'):]: v for k, v in figures.items()
                         if k.startswith(f'{rival}_{mode}_{vocab.name}_')}
        bound = roofline(gflop, peak, timings['memjax'].median_s, timings[rival].median_s, rival_profile)
        figures.update({f'roofline_{mode}_{vocab.name}_{k}': v for k, v in {'rival': rival, **bound}.items()})
        ctx.log(f'ops: {vocab.name} {mode} roofline: ' + ', '.join(
            f'{k} {harness.format_value(v)}' for k, v in bound.items()))
    return rows, figures


def roofline(gflop: float, peak: float, memjax_s: float, rival_s: float,
             rival_profile: dict[str, float]) -> dict[str, float]:
    """What the matmul peak allows a step of `gflop` GFLOP of matrix products: at least `floor_ms`
    even if everything ran at the peak and nothing else took time. `memjax_of_peak` is the share of
    the peak the whole measured step sustains; `needed_of_peak` the share it would need to be
    TARGET times faster than the rival's measured step.

    `rival_at_peak_ms`: the rival's step had its matrix products run at the peak, the rest of it
    as profiled (`rival_profile`, its op totals, scaled to its measured step). On an AMD CPU MKL,
    PyTorch's float32 GEMM, takes a path that reaches about half the AVX-512 peak (BENCHMARKS.md);
    this is the rival with GEMMs as fast as any measured here, as on an Intel CPU."""
    floor_s = gflop / peak
    matmul_share = rival_profile.get('share_matmul', 0.0)
    rival_at_peak_s = rival_s * (1 - matmul_share) + rival_profile['matmul_gflop_per_step'] / peak
    return {'floor_ms': floor_s * 1e3, 'memjax_ms': memjax_s * 1e3, 'rival_ms': rival_s * 1e3,
            'speedup': rival_s / memjax_s, 'memjax_of_peak': floor_s / memjax_s,
            'needed_of_peak': floor_s / (rival_s / TARGET), 'rival_at_peak_ms': rival_at_peak_s * 1e3,
            'speedup_over_rival_at_peak': rival_at_peak_s / memjax_s}


# A model-shaped product takes about a millisecond: this many rounds per --repeats keep its median
# steady on a shared VM (five rounds read 144-405 GFLOP/s for XLA's products in one invocation).
PRODUCT_ROUNDS = 10
# Untimed calls before each timed one. A product timed right after a torch call ran at half speed
# (one core): PyTorch's OpenMP threads spin for milliseconds after a call, and a pool's threads
# that slept are slow to wake on this VM; ten calls (3-13 ms) reach the steady state.
PRODUCT_SETTLE = 10


def matmul_rates(shape: tuple[int, int, int, int], ctx: harness.Context) -> dict[str, float]:
    """GFLOP/s of the (batch, m, k, n) float32 product by XLA's einsum, memjax's CPU kernel (where it
    applies: memjax/kernels/cpu.py), torch.matmul (MKL through aten, as the peer's steps run) and,
    for an unbatched product, PyTorch's oneDNN linear (weights in its own layout, inference only),
    timed round-robin in the same rounds: whose kernel is faster on the same shape, under the same
    load."""
    torch, _ = peer.import_torch()
    batch, m, k, n = shape
    lhs_key, rhs_key = jax.random.split(jax.random.PRNGKey(0))
    lhs, rhs = jax.random.normal(lhs_key, (batch, m, k)), jax.random.normal(rhs_key, (batch, k, n))
    reference = lambda a, b: jnp.einsum('bmk,bkn->bmn', a, b, preferred_element_type=jnp.float32)
    products = {'xla': functools.partial(jax.jit(reference), lhs, rhs)}
    if cpu_kernels.applies(lhs, rhs):
        products['kernel'] = functools.partial(jax.jit(functools.partial(cpu_kernels.product, reference)), lhs, rhs)
    torch_lhs, torch_rhs = torch.from_numpy(np.asarray(lhs)), torch.from_numpy(np.asarray(rhs))
    products['torch'] = lambda: torch.matmul(torch_lhs, torch_rhs)
    if batch == 1 and torch.backends.mkldnn.is_available():
        rows, weight = torch_lhs[0].to_mkldnn(), torch_rhs[0].T.contiguous().to_mkldnn()
        bias = torch.zeros(n).to_mkldnn()
        products['torch_onednn'] = lambda: torch._C._nn.mkldnn_linear(rows, weight, bias)
    with torch.no_grad():
        timings = harness.time_interleaved(products, warmup=ctx.warmup, repeats=ctx.repeats * PRODUCT_ROUNDS,
                                           settle=PRODUCT_SETTLE)
    return {impl: 2.0 * batch * m * k * n / timing.median_s / 1e9 for impl, timing in timings.items()}


def attention_kernel_rates(shape: peer.Shape, ctx: harness.Context) -> dict[str, float]:
    """GFLOP/s of memjax's attention kernels alone at one layer's shapes (memjax/kernels/cpu.py): the
    forward (the span's scores and softmax, then the weighted values) and its gradient, timed
    round-robin; {} where the kernels do not apply. In a step's profile XLA runs other ops beside
    them on the other cores, so their op time there is not their rate.

    The rates count the products' terms the causal mask leaves (a query's visible keys): what the
    kernels must compute, not the dense [T, K] products a masked einsum multiplies out
    (`dense_*`, the FLOPs the profile's rows and the roofline count)."""
    b, t, k, h, d = shape.batch_size, shape.tgt_len, shape.tgt_len + shape.mem_len, shape.n_head, shape.d_head
    keys = jax.random.split(jax.random.PRNGKey(0), 9)
    content_query, position_query = (jax.random.normal(keys[i], (b, t, h, d)) for i in (0, 1))
    key, value = (jax.random.normal(keys[i], (b, k, h, d)) for i in (2, 3))
    pos_key = jax.random.normal(keys[4], (k, h, d))
    if not cpu_kernels.applies(content_query, key, value):
        return {}
    valid = jnp.ones((b, k), bool)
    scale = d ** -0.5

    def attention(cq, key, pq, r, value):
        probs, log_norm = cpu_kernels.relative_softmax(functools.partial(span_scores_masked, scale), cq, key, pq, r,
                                                       valid, scale)
        return cpu_kernels.attend(probs, value, causal=True), log_norm

    operands = (content_query, key, position_query, pos_key, value)
    outputs, backward = jax.vjp(attention, *operands)
    cotangents = tuple(jax.random.normal(keys[5 + i], x.shape) for i, x in enumerate(outputs))
    forward, gradient = jax.jit(attention), jax.jit(backward)
    timings = harness.time_interleaved({'forward': functools.partial(forward, *operands),
                                        'gradient': functools.partial(gradient, cotangents)},
                                       warmup=ctx.warmup, repeats=ctx.repeats * PRODUCT_ROUNDS,
                                       settle=PRODUCT_SETTLE)
    visible = b * h * (t * (k - t) + t * (t + 1) // 2)  # Query i sees keys j <= K - T + i.
    products = {'forward': 3, 'gradient': 6}  # Content, positional, values; each one's two.
    rates = {}
    for name, timing in timings.items():
        rates[f'{name}_gflops_per_s'] = products[name] * 2.0 * visible * d / timing.median_s / 1e9
        rates[f'{name}_dense_gflops_per_s'] = products[name] * 2.0 * b * h * t * k * d / timing.median_s / 1e9
        rates[f'{name}_ms'] = timing.median_s * 1e3
    return rates


@harness.register('ops')
def run(ctx: harness.Context) -> harness.SuiteResult:
    shape, try_compile = peer.SHAPES[ctx.size], not ctx.tiny
    with peer.torch_on_jax_cores() as (torch, transformers, threads):
        peak_rows = []
        for name, matmul in peak_suite.matmul_shapes(shape.batch_size, shape.tgt_len, shape.mem_len, shape.d_model,
                                                     shape.n_head, shape.d_head, shape.d_inner):
            ctx.log(f'ops: model-shaped matmul {name}: XLA, memjax\'s CPU kernel, torch, round-robin')
            peak_rows.append({'matmul': name, **dict(zip(('batch', 'm', 'k', 'n'), matmul)),
                              **matmul_rates(matmul, ctx)})
        # The best rate any of them reaches on the model's shapes: what this machine is shown to do.
        peak, peak_impl, peak_product = max((r[impl], impl, r['matmul'].split()[0])
                                            for r in peak_rows for impl in IMPLS if impl in r)
        rows, figures = [], {'matmul_peak_gflops_per_s': peak, 'matmul_peak_by': f'{peak_product} {peak_impl}',
                             'torch_threads': threads}
        for r in peak_rows:
            for impl in IMPLS:
                if impl in r:
                    figures[f'matmul_{r["matmul"].split()[0]}_{impl}_gflops_per_s'] = r[impl]
        ctx.log('ops: memjax\'s attention kernels alone at one layer\'s shapes, forward and gradient')
        attention_rates = attention_kernel_rates(shape, ctx)
        figures.update({f'attention_kernels_{k}': v for k, v in attention_rates.items()})
        for name in ('forward', 'gradient') if attention_rates else ():
            figures[f'attention_kernels_{name}_of_matmul_peak'] = attention_rates[f'{name}_gflops_per_s'] / peak
        for vocab in peer.VOCABS[ctx.size]:
            vocab_rows, vocab_figures = measure_vocab(vocab, shape, ctx, peak, try_compile)
            rows += vocab_rows
            figures.update(vocab_figures)
    return harness.SuiteResult(
        rows=rows,
        columns=COLUMNS,
        figures=figures,
        config={'shape': shape.__dict__, 'vocabs': [v.__dict__ for v in peer.VOCABS[ctx.size]],
                'profiled_steps': ctx.repeats, 'dtype': 'float32', 'torch_threads': threads,
                'matmul_peak_rows': peak_rows, 'product_rounds': ctx.repeats * PRODUCT_ROUNDS},
        notes=[
            f'torch {torch.__version__}, transformers {transformers.__version__}; the peer suite\'s model, '
            'weights and tokens (checked to agree before profiling); float32; memjax: jax.profiler over the '
            f'compiled steps (XLA op names of the optimized HLO), torch: torch.profiler self CPU time per aten op.',
            'ms_per_step: the op\'s time per step summed over the threads that ran it; share: of the step\'s '
            'op time (independent XLA ops run side by side, so op time can exceed the wall time).',
            'gflops_per_s: ops that multiply matrices (memjax: 2 x output x contracted size of every dot, '
            'fusions included; torch: its profiler\'s FLOP count); of_matmul_peak: against the best '
            f'GFLOP/s of this model\'s float32 matmul shapes measured in this invocation ({peak:.1f}, '
            f'{figures["matmul_peak_by"]}).',
            'matmul_<product>_{xla,kernel,torch,torch_onednn}_gflops_per_s: each model-shaped float32 product '
            '(one layer\'s, config matmul_peak_rows) timed alone as one jitted XLA einsum, with memjax\'s CPU '
            'kernel (memjax/kernels; absent where it does not apply), as torch.matmul (MKL, the peer\'s GEMM) '
            'and, unbatched, as PyTorch\'s oneDNN linear, round-robin in the same rounds (config '
            'product_rounds, each after untimed calls of its own): whose kernel is faster on the same shape. '
            'The peak is the best of them.',
            'attention_kernels_{forward,gradient}_*: memjax\'s attention kernels timed alone at one layer\'s '
            'shapes (the span\'s scores, softmax and weighted values; their gradient); gflops_per_s counts '
            'the terms the causal mask leaves, dense_gflops_per_s the dense products (as the profile\'s rows '
            'and the roofline do). In a step XLA runs other ops beside them, so the profile\'s rate for them '
            'is not theirs.',
            'roofline_*: memjax and torch.compile (hf_eager at --size=tiny) timed round-robin without the '
            'profiler; floor_ms = memjax\'s matrix-product GFLOP per step / the peak; memjax_of_peak = floor / '
            f'memjax\'s step; needed_of_peak = floor / (the rival\'s step / {TARGET}): the share of the peak a '
            f'whole step must sustain to be {TARGET}x faster (above 1: impossible with these FLOPs); '
            'rival_at_peak_ms: the rival\'s step had its matrix products run at the peak (its other ops as '
            'profiled, scaled to its measured step), speedup_over_rival_at_peak memjax against that.',
            *(['torch.compile not profiled at --size=tiny (it compiles for minutes).'] if not try_compile else []),
        ])
