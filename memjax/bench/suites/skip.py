"""`skip`: training-step time as more layers are skipped for the step.

The skip decision is an argument of one compiled step ([n_layer] bool), run under `lax.cond`
by the layer stack: a skipped layer's forward and backward are not computed, so the step time
should fall about linearly with the layers skipped, down to embeddings, softmax and Adam.
"""

from __future__ import annotations

import jax.numpy as jnp

from memjax.bench import harness
from memjax.bench import workload
from memjax.bench.suites import train

FULL = train.FULL_SIZES[1]  # 8 x 384, batch 4, tgt = mem = 256.
TINY = ('2x32', dict(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64), 2, 8)


@harness.register('skip')
def run(ctx: harness.Context) -> harness.SuiteResult:
    name, shape, batch, seq = TINY if ctx.tiny else FULL
    mcfg = workload.model_config(ctx.config, mem_len=seq, **shape)
    work = workload.build(mcfg, batch, seq, ctx.config)
    layers = mcfg.n_layer
    counts = sorted({0, layers // 4, layers // 2, 3 * layers // 4, layers})
    work.batch['skip'] = jnp.zeros(layers, bool)
    compiled = workload.compile_step(work)
    rows = []
    for skipped in counts:
        ctx.log(f'skip: {name}, {skipped} of {layers} layers skipped')
        run_work = workload.copy_state(work)
        run_work.batch = dict(work.batch, skip=jnp.arange(layers) < skipped)
        timing = harness.time_fn(workload.StepLoop(compiled.executable, run_work),
                                 warmup=ctx.warmup, repeats=ctx.repeats)
        rows.append({'size': name, 'layers_skipped': skipped, 'n_layer': layers,
                     'step_ms': timing.median_s * 1e3, 'timing': timing.as_dict()})
    for row in rows:
        row['time_vs_none_skipped'] = row['step_ms'] / rows[0]['step_ms']
    return harness.SuiteResult(
        rows=rows, columns=('size', 'n_layer', 'layers_skipped', 'step_ms', 'time_vs_none_skipped'),
        figures={'all_skipped_vs_none': rows[-1]['time_vs_none_skipped'], 'compile_s': compiled.compile_s},
        config={'batch': batch, 'tgt_len': seq, 'mem_len': seq, 'model': shape,
                'step': 'memjax.bench.workload train step, skip pattern an argument of one executable'})
