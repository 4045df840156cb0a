"""`skip`: training-step time when layers are skipped, and Skip-Retain's phase 1 against Transformer-XL.

Rows 'k of N': one compiled step of Transformer-XL with the skip decision an argument ([n_layer]
bool, the first k layers skipped), run under `lax.cond` by the layer stack: a skipped layer's
forward and backward are not computed, so the step time should fall about linearly with the
layers skipped, down to embeddings, softmax and Adam.

Rows 'phase 1': the paper's comparison (its table 5: 535 / 607 ms = 0.88) at its depth, 15 layers,
scaled in width to this CPU. Five steps timed round-robin: plain Transformer-XL; the same with the
skip argument and nothing skipped (what the conditional costs); Skip-Retain's step (per-layer
validity and age, the lagging memory block) with nothing skipped; that step with skips drawn
from eq. (1), a new pattern every call; and XL with Stochastic Cross-Head attention at beta = 0.1
(a new key every call, so one step in ten permutes). The target is the expected fraction of layers
run, 1 - mean p_skip, plus 5 %.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from memjax.bench import harness
from memjax.bench import workload
from memjax.bench.suites import train
from memjax.model import stochastic

FULL = train.FULL_SIZES[1]  # 8 x 384, batch 4, tgt = mem = 256.
TINY = ('2x32', dict(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64), 2, 8)
PHASE1 = {'full': ('15x256', dict(n_layer=15, d_model=256, n_head=4, d_head=64, d_inner=1024), 4, 128),
          'tiny': ('3x32', dict(n_layer=3, d_model=32, n_head=2, d_head=16, d_inner=64), 2, 8)}


class Varying:
    """A step loop whose skip pattern (when `patterns`) and random key change at every call, as
    in training, the same sequence for every repeat count."""

    def __init__(self, executable, work, patterns=None):
        self._loop = workload.StepLoop(executable, work)
        self._work, self._patterns, self._calls = work, patterns, 0

    def __call__(self):
        if self._patterns:
            self._work.batch['skip'] = self._patterns[self._calls % len(self._patterns)]
        self._loop.key = jax.random.fold_in(self._work.key, self._calls)
        self._calls += 1
        return self._loop()


def eq1_patterns(n_layer: int, count: int, seed: int = 0) -> np.ndarray:
    """[count, n_layer] bool: skip patterns drawn from eq. (1), a new one for every timed step."""
    probs = stochastic.skip_probabilities('linear', n_layer, 0.0)
    return np.random.default_rng(seed).random((count, n_layer)) < probs


def _skipped_k(ctx, name, shape, batch, seq) -> list[dict]:
    mcfg = workload.model_config(ctx.config, mem_len=seq, **shape)
    work = workload.build(mcfg, batch, seq, ctx.config)
    layers = mcfg.n_layer
    work.batch['skip'] = jnp.zeros(layers, bool)
    case = workload.train_case(work)  # One executable: the pattern is an argument.
    rows = []
    for skipped in sorted({0, layers // 4, layers // 2, 3 * layers // 4, layers}):
        ctx.log(f'skip: {name}, {skipped} of {layers} layers skipped')
        run_work = workload.copy_state(work)
        run_work.batch = dict(work.batch, skip=jnp.arange(layers) < skipped)
        timing = case.on(run_work).time_alone(ctx)
        rows.append({'row': 'k of N', 'size': name, 'layers_skipped': skipped, 'n_layer': layers,
                     'step_ms': timing.median_s * 1e3})
    for row in rows:
        row['time_vs_none_skipped'] = row['step_ms'] / rows[0]['step_ms']
    return rows


def _phase1(ctx, name, shape, batch, seq) -> tuple[list[dict], dict]:
    plain = workload.model_config(ctx.config, mem_len=seq, **shape)
    retain = plain.replace(skip_rule='linear')
    probs = stochastic.skip_probabilities('linear', plain.n_layer, 0.0)
    patterns = [jnp.asarray(p) for p in eq1_patterns(plain.n_layer, 64)]
    loops, fraction_run = {}, 1.0 - float(probs.mean())
    for label, mcfg, skip in (('xl', plain, None), ('xl, conditional, none skipped', plain, False),
                              ('skip-retain, none skipped', retain, False), ('skip-retain, eq. (1)', retain, True),
                              ('xl + cross-head, beta 0.1', plain.replace(sch_beta=0.1), None)):
        ctx.log(f'skip: {name}, {label}')
        work = workload.build(mcfg, batch, seq, ctx.config)
        if skip is not None:
            work.batch['skip'] = jnp.zeros(mcfg.n_layer, bool)
        executable = workload.compile_step(work).executable
        loops[label] = Varying(executable, work, patterns if skip else None)
    timings = harness.time_interleaved(loops, warmup=ctx.warmup, repeats=max(ctx.repeats, 3 if ctx.tiny else 15))
    base = timings['xl'].median_s
    rows = [{'row': 'phase 1', 'size': name, 'step': label, 'n_layer': plain.n_layer, 'step_ms': t.median_s * 1e3,
             'mean_step_ms': float(np.mean(t.times_s)) * 1e3,
             'time_vs_xl': t.median_s / base} for label, t in timings.items()]
    drawn = next(r for r in rows if r['step'] == 'skip-retain, eq. (1)')
    xl_mean = next(r for r in rows if r['step'] == 'xl')['mean_step_ms']
    figures = {'phase1_mean_vs_xl_mean': drawn['mean_step_ms'] / xl_mean,
               'expected_fraction_of_layers_run': fraction_run,
               'conditional_none_skipped_vs_xl': next(r for r in rows if r['step'].startswith('xl, cond'))['time_vs_xl'],
               'skip_retain_none_skipped_vs_xl': next(r for r in rows if r['step'] == 'skip-retain, none skipped')['time_vs_xl'],
               'cross_head_mean_vs_xl_mean': next(r for r in rows if r['step'].startswith('xl + cross'))['mean_step_ms'] / xl_mean}
    return rows, figures


@harness.register('skip')
def run(ctx: harness.Context) -> harness.SuiteResult:
    name, shape, batch, seq = TINY if ctx.tiny else FULL
    rows = _skipped_k(ctx, name, shape, batch, seq)
    phase_rows, figures = _phase1(ctx, *PHASE1['tiny' if ctx.tiny else 'full'])
    figures['all_skipped_vs_none'] = rows[-1]['time_vs_none_skipped']
    columns = ('row', 'size', 'n_layer', 'layers_skipped', 'step', 'step_ms', 'mean_step_ms', 'time_vs_none_skipped',
               'time_vs_xl')
    return harness.SuiteResult(
        rows=[{**dict.fromkeys(columns), **r} for r in rows + phase_rows], columns=columns,
        figures=figures,
        config={'batch': batch, 'tgt_len': seq, 'mem_len': seq, 'model': shape,
                'phase1': {k: v for k, v in zip(('size', 'model', 'batch', 'tgt_len'),
                                                PHASE1['tiny' if ctx.tiny else 'full'])},
                'step': 'memjax.bench.workload train step, skip pattern an argument of one executable'})
