"""`peak`: measured matmul throughput of this machine at the model's matrix sizes.

The best GFLOP/s over these shapes is the roofline the other suites divide by (MFU): a
measured peak, so the ratio says how far the model is from what XLA's matmuls achieve here;
on an accelerator every row also gives its share of the chip's datasheet rate
(`memjax.bench.chips`). bf16 runs use bf16 inputs with float32 accumulation
(`preferred_element_type`), as the model's mixed-precision path does.

A GPU or TPU is measured with squares of 4096^3 to 16384^3 as well: a 2048^3 product is over
before an H100's 132 SMs are busy (118 TFLOP/s bf16 measured on an H200 whose 8192^3 product
runs at ~790), so a peak taken from small shapes would flatter every MFU divided by it.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import jax.numpy as jnp

from memjax.bench import chips
from memjax.bench import harness

DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


def matmul_shapes(batch: int, tgt_len: int, mem_len: int, d_model: int, n_head: int, d_head: int,
                  d_inner: int) -> list[tuple[str, tuple[int, int, int, int]]]:
    """(name, (batch, m, k, n)) of the matmuls in one Transformer-XL layer (batch 1 = plain matmul)."""
    tokens = batch * tgt_len
    klen = tgt_len + mem_len
    return [
        ('ff_inner [BT,D]x[D,Di]', (1, tokens, d_model, d_inner)),
        ('ff_outer [BT,Di]x[Di,D]', (1, tokens, d_inner, d_model)),
        ('kv_proj [BK,D]x[D,H*Dh]', (1, batch * klen, d_model, n_head * d_head)),
        ('scores [BH,T,Dh]x[BH,Dh,K]', (batch * n_head, tgt_len, d_head, klen)),
        ('attend [BH,T,K]x[BH,K,Dh]', (batch * n_head, tgt_len, klen, d_head)),
    ]


def _square(n: int) -> tuple[str, tuple[int, int, int, int]]:
    return (f'square {n}^3', (1, n, n, n))


# FLOPs one timed call runs on an accelerator: a few ms, so that launching the call and waiting for
# it are a small part of what is timed (one 4096^3 product per call measured dispatch, not the chip).
CALL_FLOPS = 2.5e12


def measure(shape: tuple[int, int, int, int], dtype: str, ctx: harness.Context) -> dict[str, Any]:
    """Times one (batched) matmul with float32 accumulation, run `products_per_call` times in a loop
    inside one compiled program (two products on a CPU, enough on an accelerator for CALL_FLOPS);
    returns its row of the table, per product."""
    batch, m, k, n = shape
    flops = 2.0 * batch * m * k * n
    reps = 2 if ctx.tiny or jax.default_backend() == 'cpu' else int(min(1000, max(4, CALL_FLOPS // flops)))
    lhs_key, rhs_key = jax.random.split(jax.random.PRNGKey(0))
    # Two left operands, alternated: a product of loop-invariant operands would be hoisted out.
    lhs = jax.random.normal(lhs_key, (2, batch, m, k), jnp.float32).astype(DTYPES[dtype])
    rhs = jax.random.normal(rhs_key, (batch, k, n), jnp.float32).astype(DTYPES[dtype])

    def matmuls(a, b):
        one = lambda i, _: jnp.einsum('bmk,bkn->bmn', a[i % 2], b, preferred_element_type=jnp.float32)
        return jax.lax.fori_loop(0, reps, one, jnp.zeros((batch, m, n), jnp.float32))

    compiled, timing = harness.compile_and_time(matmuls, lhs, rhs, ctx=ctx)
    product_s = timing.median_s / reps
    chip = chips.datasheet(jax.devices()[0].device_kind)
    return {'dtype': dtype, 'batch': batch, 'm': m, 'k': k, 'n': n, 'gflop': flops / 1e9,
            'median_ms': product_s * 1e3, 'gflops_per_s': flops / product_s / 1e9,
            'datasheet_percent': 100.0 * flops / product_s / 1e12 / chip.tflops(dtype) if chip else None,
            'products_per_call': reps, 'compile_s': compiled.total_s, 'timing': timing.as_dict()}


def accelerator_sizes(ctx: harness.Context) -> bool:
    """Whether to measure at the sizes that fill an accelerator (not on CPUs, not at --size=tiny)."""
    return not ctx.tiny and jax.default_backend() != 'cpu'


def measure_peak(ctx: harness.Context) -> dict[str, Any]:
    """Rows and the best GFLOP/s per dtype; other suites call this to get their roofline."""
    if ctx.tiny:
        shapes = matmul_shapes(batch=2, tgt_len=16, mem_len=16, d_model=32, n_head=2, d_head=16,
                               d_inner=64)[:1] + [_square(64)]
    else:
        # The enwik8-base layer at the train suite's largest shape (batch 4, tgt = mem = 256),
        # plus squares to see where this CPU's matmul throughput saturates.
        shapes = matmul_shapes(batch=4, tgt_len=256, mem_len=256, d_model=512, n_head=8, d_head=64,
                               d_inner=2048) + [_square(1024), _square(2048)]
        if accelerator_sizes(ctx):
            shapes += [_square(4096), _square(8192), _square(16384)]
    rows = []
    for dtype in DTYPES:
        for name, shape in shapes:
            ctx.log(f'peak: {dtype} {name}')
            rows.append({'matmul': name, **measure(shape, dtype, ctx)})
    best = {dtype: max(r['gflops_per_s'] for r in rows if r['dtype'] == dtype) for dtype in DTYPES}
    chip = chips.datasheet(jax.devices()[0].device_kind)
    return {'rows': rows, 'peak_gflops_per_s': best,
            'datasheet_gflops_per_s': {dtype: chip.tflops(dtype) * 1e3 if chip else None for dtype in DTYPES},
            'chip': chip.name if chip else None}


def from_report(path: str) -> dict[str, Any]:
    """`measure_peak`'s roofline from the peak rows of an earlier accel report (`--out`) measured on
    this device kind: later processes of one allocation need not spend its time again."""
    try:
        with open(path, encoding='utf-8') as f:
            report = json.load(f)
    except (OSError, ValueError) as error:
        raise harness.BenchError(f'--peak_from={path} cannot be read ({error}): give the --out report of '
                                 'an accel run with its peak part.') from None
    rows = [r for r in report.get('rows', []) if r.get('part') == 'peak' and 'tflops_per_s' in r]
    missing = sorted(set(DTYPES) - {r.get('dtype') for r in rows})
    if missing:
        raise harness.BenchError(f'--peak_from={path} has no peak rows for {missing}: run --parts=peak first.')
    measured_on, here = report.get('machine', {}).get('device_kind'), jax.devices()[0].device_kind
    if measured_on != here:
        raise harness.BenchError(f'--peak_from={path} was measured on {measured_on!r}, not this {here!r}: '
                                 'measure the peak here (leave out --peak_from).')
    chip = chips.datasheet(here)
    return {'rows': [], 'chip': chip.name if chip else None,
            'peak_gflops_per_s': {d: 1e3 * max(r['tflops_per_s'] for r in rows if r['dtype'] == d) for d in DTYPES},
            'datasheet_gflops_per_s': {d: chip.tflops(d) * 1e3 if chip else None for d in DTYPES}}


def mfu_percents(achieved_gflops_per_s: float, dtype: str, peak: dict[str, Any]) -> dict[str, Any]:
    """MFU of a step against `measure_peak`'s measured peak and against the datasheet (None
    without one), for the compute dtype."""
    datasheet = peak['datasheet_gflops_per_s'][dtype]
    return {'mfu_percent': 100.0 * achieved_gflops_per_s / peak['peak_gflops_per_s'][dtype],
            'mfu_datasheet_percent': 100.0 * achieved_gflops_per_s / datasheet if datasheet else None}


@harness.register('peak')
def run(ctx: harness.Context) -> harness.SuiteResult:
    peak = measure_peak(ctx)
    return harness.SuiteResult(
        rows=peak['rows'],
        columns=('matmul', 'dtype', 'batch', 'm', 'k', 'n', 'gflop', 'median_ms', 'gflops_per_s',
                 'datasheet_percent'),
        figures={**{f'peak_gflops_per_s_{dtype}': value for dtype, value in peak['peak_gflops_per_s'].items()},
                 **{f'datasheet_gflops_per_s_{dtype}': value
                    for dtype, value in peak['datasheet_gflops_per_s'].items()}, 'chip': peak['chip']},
        config={'accumulation': 'float32 (preferred_element_type)', 'jit': 'one jitted einsum per shape',
                'flops_per_matmul': '2 * batch * m * k * n'},
        notes=['peak = the best median GFLOP/s over the shapes of that dtype; MFU elsewhere divides by '
               'the float32 peak measured in the same invocation.'])
