"""`compile`: compile time of the train step as depth grows, with and without the layer scan.

Without `scan_layers` XLA sees n_layer copies of the layer, so tracing, lowering and
compiling grow with depth; with it, one loop body. The model is narrow on purpose: this is
about compile time, not step time. Each figure is the median over fresh compilations
(`jax.clear_caches()` before each, so no cached executable is reused).

The deepest stack without the scan is compiled once more with Python's own garbage-collector
settings, in place of those memjax's commands set (memjax/runtime/collector.py): what the
collector costs tracing and lowering, side by side.

Then the parameters' init of the deepest stack, with and without the scan: with the draws' Threefry
hashes shared (memjax/model/shared_hashes.py, what memjax runs) and with a hash per draw, as Flax
draws them. Both give the same values; every run and test compiles an init once per model.
"""

from __future__ import annotations

import contextlib
import statistics

import jax

from memjax.bench import harness
from memjax.bench import workload
from memjax.model import lm
from memjax.runtime import collector

FULL = dict(layers=(2, 8, 16), shape=dict(d_model=128, n_head=4, d_head=32, d_inner=512),
            batch=2, seq=64)
TINY = dict(layers=(1, 2), shape=dict(d_model=16, n_head=2, d_head=8, d_inner=32), batch=2, seq=8)


@harness.register('compile')
def run(ctx: harness.Context) -> harness.SuiteResult:
    setting = TINY if ctx.tiny else FULL
    # Compilations are slow and not noisy in the way step times are: at most 3 per case.
    repeats = min(ctx.repeats, 3)
    deepest = max(setting['layers'])
    cases = [(n_layer, scan, 'memjax') for n_layer in setting['layers'] for scan in (False, True)]
    rows = []
    for n_layer, scan, collector_setting in cases + [(deepest, False, 'python')]:
        mcfg = workload.model_config(ctx.config, n_layer=n_layer, scan_layers=scan,
                                     mem_len=setting['seq'], **setting['shape'])
        work = workload.build(mcfg, setting['batch'], setting['seq'], ctx.config)
        runs = []
        with collector.python_defaults() if collector_setting == 'python' else contextlib.nullcontext():
            for _ in range(repeats):
                jax.clear_caches()
                runs.append(workload.compile_step(work))
        ctx.log(f'compile: {n_layer} layers, scan={scan}, collector {collector_setting}: {runs[-1].compile_s:.1f}s')
        rows.append(_row('train step', n_layer, scan, collector_setting, runs))
    for scan in (False, True):
        mcfg = workload.model_config(ctx.config, n_layer=deepest, scan_layers=scan, mem_len=setting['seq'],
                                     **setting['shape'])
        for share in (True, False):
            runs = []
            for _ in range(repeats):
                jax.clear_caches()
                runs.append(harness.compile_fn(lambda key: lm.init_params(mcfg, key, share_hashes=share),
                                               jax.random.PRNGKey(0)))
            program = 'init, ' + ('shared hashes' if share else 'a hash per draw')
            ctx.log(f'compile: {program}, {deepest} layers, scan={scan}: {runs[-1].compile_s:.1f}s')
            rows.append(_row(program, deepest, scan, 'memjax', runs))
    init = {(r['scan_layers'], r['program']): r['total_s'] for r in rows if r['program'] != 'train step'}
    by_case = {(r['n_layer'], r['scan_layers'], r['collector']): r for r in rows if r['program'] == 'train step'}
    total = {case[:2]: by_case[case]['total_s'] for case in cases}
    return harness.SuiteResult(
        rows=rows,
        columns=('program', 'n_layer', 'scan_layers', 'collector', 'lower_s', 'compile_s', 'total_s', 'runs'),
        figures={f'loop_over_scan_total_{n}_layers': total[(n, False)] / total[(n, True)]
                 for n in setting['layers']} | {
                     'scan_growth_over_depth': total[(deepest, True)] / total[(min(setting['layers']), True)],
                     'loop_growth_over_depth': total[(deepest, False)] / total[(min(setting['layers']), False)],
                     'python_collector_over_memjax_lower': (by_case[(deepest, False, 'python')]['lower_s']
                                                            / by_case[(deepest, False, 'memjax')]['lower_s'])} | {
                     f'init_hash_per_draw_over_shared_{"scan" if scan else "loop"}':
                         init[(scan, 'init, a hash per draw')] / init[(scan, 'init, shared hashes')]
                     for scan in (False, True)},
        config={'model': setting['shape'], 'batch': setting['batch'], 'tgt_len': setting['seq'],
                'mem_len': setting['seq'], 'dtype': workload.model_config(ctx.config).compute_dtype,
                'timed': 'lower_s = trace + lower to StableHLO; compile_s = XLA compile; '
                         'median of fresh compilations after jax.clear_caches()'},
        notes=['*_growth_over_depth: total compile time at the deepest over the shallowest stack.',
               "python_collector_over_memjax_lower: trace + lower time of the deepest stack without the scan "
               "with Python's default garbage-collector settings over memjax's (memjax/runtime/collector.py).",
               'init_hash_per_draw_over_shared_*: total compile time of the deepest init with a Threefry hash per '
               'draw over that with the hashes shared (the same values), the layers looped or scanned.'])


def _row(program: str, n_layer: int, scan: bool, collector_setting: str, runs: list[harness.Compiled]) -> dict:
    lower = statistics.median(r.lower_s for r in runs)
    compile_s = statistics.median(r.compile_s for r in runs)
    return {'program': program, 'n_layer': n_layer, 'scan_layers': scan, 'collector': collector_setting,
            'lower_s': lower, 'compile_s': compile_s, 'total_s': lower + compile_s, 'runs': len(runs),
            'lower_runs_s': [r.lower_s for r in runs], 'compile_runs_s': [r.compile_s for r in runs]}
