"""`infinity`: the infinity-former's cost against the context it holds, and its LTM overhead.

Context rows: per-token training and evaluation time once the memory holds C tokens of context
(C = 2k, 8k, 32k), for the infinity-former (short-term memory of one segment + a long-term memory
of N basis functions) and for a Transformer-XL whose memory covers the same C tokens (mem_len = C).
The infinity-former's step has the same shapes whatever it holds; it is timed after C / T real
memory updates anyway, so the row shows it, not assumes it. Overhead row: the paper's PG-19 shape
(GPT-2 small, 512-token segments, batch 1, N = 512): step time with the LTM over the same GPT-2
without it, the two timed round-robin.
"""

from __future__ import annotations

import dataclasses

from memjax.bench import harness
from memjax.bench import workload

SHAPES = {
    'full': dict(contexts=(2048, 8192, 32768), batch=1, tgt_len=256, model=dict(
        n_layer=4, d_model=256, n_head=4, d_head=64, d_inner=1024, ltm_basis=256, ltm_widths=(0.01, 0.05))),
    'tiny': dict(contexts=(16, 64), batch=1, tgt_len=8, model=dict(
        n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, ltm_basis=8, ltm_widths=(0.05, 0.1))),
}
GPT2_SMALL = dict(block='gpt2', positions='learned_absolute', pre_lnorm=True, vocab_size=50257, n_layer=12,
                  d_model=768, n_head=12, d_head=64, d_inner=3072, n_positions=1024, mem_len=0,
                  ltm_basis=512, ltm_widths=(0.005, 0.01), ltm_ridge=0.5, ltm_tau=0.5, ltm_reset_tokens=2048,
                  ltm_min_variance=1e-4, ltm_kl_weight=1e-6)
OVERHEAD = {'full': (GPT2_SMALL, 512), 'tiny': (dict(GPT2_SMALL, n_layer=1, d_model=32, n_head=2, d_head=16,
                                                      d_inner=64, vocab_size=64, ltm_basis=8), 8)}


def _per_token(timings, tokens: int) -> dict:
    return {name: t.median_s * 1e3 / tokens for name, t in timings.items()}


def _loops(ctx, mcfg, batch_size: int, tgt_len: int, contexts: tuple) -> dict:
    """{context: (train loop, eval loop)} of `mcfg` once its memory holds `context` tokens of random
    text (reached by real evaluation steps). One compiled train and eval step serve every context
    (the shapes do not change)."""
    work = workload.build(mcfg, batch_size, tgt_len, ctx.config)
    evaluation = workload.eval_case(mcfg, work.params, work.batch['inputs'], work.batch['targets'])
    memories, filled = {}, 0
    for context in sorted(contexts):
        memories[context] = workload.copy_tree(evaluation.fill(context - filled, tgt_len).loop.memory)
        filled = context
    training, copy = workload.train_case(work), workload.copy_tree
    return {c: (training.on(dataclasses.replace(workload.copy_state(work), memory=copy(m))).loop,
                evaluation.loop.starting_from(copy(m)))
            for c, m in memories.items()}


def _time(ctx, loops: dict, tokens: int) -> dict:
    """{label: (train, eval) ms per token} of {label: (train loop, eval loop)}, each phase timed
    round-robin over the labels, so that the machine's drift falls on all of them alike."""
    train, evaluation = (
        _per_token(harness.time_interleaved({label: pair[i] for label, pair in loops.items()},
                                            warmup=ctx.warmup, repeats=ctx.repeats), tokens) for i in (0, 1))
    return {label: {'train_ms_per_token': train[label], 'eval_ms_per_token': evaluation[label]} for label in loops}


@harness.register('infinity')
def run(ctx: harness.Context) -> harness.SuiteResult:
    shape = SHAPES['tiny' if ctx.tiny else 'full']
    seq, batch = shape['tgt_len'], shape['batch']
    rows = []
    contexts = shape['contexts']
    ctx.log(f'infinity: infinity-former, {contexts} tokens of context (one executable, interleaved)')
    mcfg = workload.model_config(ctx.config, memory='infinity', mem_len=seq, segment_len=seq, dropout=0.0,
                                 **shape['model'])
    for context, times in _time(ctx, _loops(ctx, mcfg, batch, seq, contexts), batch * seq).items():
        rows.append({'row': 'context', 'memory': 'infinity', 'context': context, 'mem_len': seq, **times})
    for context in contexts:  # XL: a memory of `context` rows, one executable per length.
        ctx.log(f'infinity: xl, mem_len {context}')
        mcfg = workload.model_config(ctx.config, memory='xl', mem_len=context, dropout=0.0, **shape['model'])
        rows.append({'row': 'context', 'memory': 'xl', 'context': context, 'mem_len': context,
                     **_time(ctx, _loops(ctx, mcfg, batch, seq, (0,)), batch * seq)[0]})
    model, seg = OVERHEAD['tiny' if ctx.tiny else 'full']
    ctx.log('infinity: overhead, GPT-2 shape, without and with the LTM (interleaved)')
    loops = {}
    for memory in ('none', 'infinity'):
        mcfg = workload.model_config(ctx.config, memory=memory, segment_len=seg, dropout=0.0, **model)
        # Filled with two segments: the LTM is in use (it is empty, and skipped, only at the start).
        loops[memory] = _loops(ctx, mcfg, 1, seg, (2 * seg,))[2 * seg]
    overhead = _time(ctx, loops, seg)
    for memory, times in overhead.items():
        rows.append({'row': 'overhead', 'memory': memory, 'context': 2 * seg, 'mem_len': 0, **times})
    # Context rows against the shortest context of the same memory; overhead rows against no LTM.
    for r in rows:
        base = overhead['none'] if r['row'] == 'overhead' else next(
            b for b in rows if b['row'] == 'context' and b['memory'] == r['memory'])
        for phase in ('train', 'eval'):
            r[f'{phase}_vs_base'] = r[f'{phase}_ms_per_token'] / base[f'{phase}_ms_per_token']
    longest = {m: next(r for r in reversed(rows) if r['memory'] == m and r['row'] == 'context') for m in ('infinity', 'xl')}
    figures = {
        'infinity_train_longest_vs_shortest': longest['infinity']['train_vs_base'],
        'infinity_eval_longest_vs_shortest': longest['infinity']['eval_vs_base'],
        'xl_train_longest_vs_shortest': longest['xl']['train_vs_base'],
        'xl_eval_longest_vs_shortest': longest['xl']['eval_vs_base'],
        'ltm_train_overhead': overhead['infinity']['train_ms_per_token'] / overhead['none']['train_ms_per_token'] - 1,
        'ltm_eval_overhead': overhead['infinity']['eval_ms_per_token'] / overhead['none']['eval_ms_per_token'] - 1,
    }
    return harness.SuiteResult(
        rows=rows, columns=('row', 'memory', 'context', 'mem_len', 'train_ms_per_token', 'eval_ms_per_token',
                            'train_vs_base', 'eval_vs_base'),
        figures=figures,
        config={'batch': batch, 'tgt_len': seq, 'model': shape['model'], 'overhead_model': model,
                'overhead_tgt_len': seg, 'step': 'memjax.bench.workload train step (aux losses, streams); '
                'eval = train_step.eval_step_fn, one segment per call, memory donated; float32'})
