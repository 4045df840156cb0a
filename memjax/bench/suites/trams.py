"""`trams`: TRAMS's evaluation time against Transformer-XL's, at the paper's shape.

One evaluation segment (n = 64 tokens x batch 10) of the WikiText-103 base architecture (16 x 410,
10 heads x 41, d_inner 2100; a byte vocabulary, so the softmax does not hide the attention) with
the same weights: XL attending m = 200 rows (re-projecting its memory every segment, as trained,
and keeping it as projected, 'xl_cached', as `memjax.evaluate` runs XL), XL attending the whole
pool of 600, and TRAMS selecting 200 of 600 (150 kept + 50 ranked) with each metric and each
position rule. Every memory is first filled by real segments, so TRAMS ranks a full pool. The
paper pays +49 % over XL at equal attended memory (its table 2, on a GPU).
"""

from __future__ import annotations

from memjax.bench import harness
from memjax.bench import workload

SHAPES = {
    'full': dict(batch=10, tgt_len=64, select=200, remain=150, pool=600, model=dict(
        n_layer=16, d_model=410, n_head=10, d_head=41, d_inner=2100)),
    'tiny': dict(batch=2, tgt_len=4, select=6, remain=4, pool=18, model=dict(
        n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64)),
}


def variants(shape: dict) -> dict:
    """label -> ModelConfig fields of each evaluator."""
    trams = dict(memory='trams', mem_len=shape['pool'], trams_select=shape['select'], trams_remain=shape['remain'])
    return {
        f"xl m={shape['select']}": dict(memory='xl', mem_len=shape['select']),
        f"xl_cached m={shape['select']}": dict(memory='xl_cached', mem_len=shape['select']),
        f"xl m={shape['pool']}": dict(memory='xl', mem_len=shape['pool']),
        'trams paper/true': dict(trams, trams_metric='paper', trams_positions='true'),
        'trams released/contiguous': dict(trams, trams_metric='released', trams_positions='contiguous'),
    }


@harness.register('trams')
def run(ctx: harness.Context) -> harness.SuiteResult:
    shape = SHAPES['tiny' if ctx.tiny else 'full']
    seg, batch = shape['tgt_len'], shape['batch']
    base = workload.model_config(ctx.config, memory='xl', mem_len=shape['select'], dropout=0.0, **shape['model'])
    work = workload.build(base, batch, seg, ctx.config)
    cases = {}
    for label, fields in variants(shape).items():
        ctx.log(f'trams: {label}')
        cases[label] = workload.eval_case(base.replace(**fields), work.params, work.batch['inputs'],
                                          work.batch['targets']).fill(shape['pool'], seg)  # Every pool row real.
    ctx.log('trams: timing (interleaved)')
    timings = workload.time_together(cases, ctx)
    equal, whole = (f"xl m={shape[k]}" for k in ('select', 'pool'))
    rows = []
    for label, fields in variants(shape).items():
        ms = timings[label].median_s * 1e3
        rows.append({'evaluator': label, 'memory': fields['memory'], 'pool': fields['mem_len'],
                     'attended': fields.get('trams_select', fields['mem_len']), 'step_ms': ms,
                     'ms_per_token': ms / (batch * seg),
                     'vs_xl_equal_attended': ms / (timings[equal].median_s * 1e3),
                     'vs_xl_whole_pool': ms / (timings[whole].median_s * 1e3)})
    figures = {f"{r['evaluator']} vs_xl_equal_attended": r['vs_xl_equal_attended'] for r in rows
               if r['memory'] != 'xl'}
    figures.update({f"{r['evaluator']} vs_xl_whole_pool": r['vs_xl_whole_pool'] for r in rows if r['memory'] == 'trams'})
    return harness.SuiteResult(
        rows=rows, columns=('evaluator', 'pool', 'attended', 'step_ms', 'ms_per_token', 'vs_xl_equal_attended',
                            'vs_xl_whole_pool'),
        figures=figures,
        config={'batch': batch, 'tgt_len': seg, 'model': shape['model'], 'select': shape['select'],
                'remain': shape['remain'], 'pool': shape['pool'],
                'step': 'train_step.eval_step_fn, one segment per call, memory donated; float32; same weights'})
