"""`lamemo`: LaMemo's training step against Transformer-XL's at the paper's two shapes.

The paper's FLOPs ratio is 191M / 157M = 1.22 (table 1, WikiText-103); the memory rows' look-ahead,
output map and feed-forward are the extra work. Each shape is timed for both memories round-robin in
one invocation, with MFU from `memjax.bench.flops` (which counts the memory rows' matmuls) over the
matmul peak measured in the same run. enwik8-base runs at the paper's tgt = mem = 512 with batch 2,
wt103-base at tgt = mem = 150 with its adaptive softmax over 267,735 words, batch 4 (CPU-sized
batches; the ratio does not depend on the batch).
"""

from __future__ import annotations

from memjax.bench import flops
from memjax.bench import harness
from memjax.bench import workload
from memjax.bench.suites import peak

ENWIK8 = dict(n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048, vocab_size=256)
WT103 = dict(n_layer=16, d_model=410, n_head=10, d_head=41, d_inner=2100, vocab_size=267735,
             cutoffs=(20000, 40000, 200000), div_val=1, tie_projs=(False, True, True, True))
FULL = (('enwik8-base', ENWIK8, 2, 512), ('wt103-base', WT103, 4, 150))
TINY = (('1x32', dict(n_layer=1, d_model=32, n_head=2, d_head=16, d_inner=64, vocab_size=64), 2, 16),
        ('2x32 adaptive', dict(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, vocab_size=300,
                               cutoffs=(100, 200), div_val=1, tie_projs=(False, True, True)), 2, 12))
MEMORIES = ('xl', 'lamemo')


@harness.register('lamemo')
def run(ctx: harness.Context) -> harness.SuiteResult:
    measured_peak = peak.measure_peak(ctx)
    roofline = measured_peak['peak_gflops_per_s']
    rows, figures = [], {}
    for name, shape, batch, seq in TINY if ctx.tiny else FULL:
        cases = {}
        for memory in MEMORIES:
            mcfg = workload.model_config(ctx.config, memory=memory, mem_len=seq, **shape)
            ctx.log(f'lamemo: {name}, memory={memory} ({mcfg.compute_dtype}, batch {batch}, tgt = mem = {seq})')
            cases[memory] = workload.train_case(workload.build(mcfg, batch, seq, ctx.config))
        timings = workload.time_together(cases, ctx)
        for memory, case in cases.items():
            mcfg, step_s = case.work.mcfg, timings[memory].median_s
            model_flops = flops.train_step_flops(mcfg, batch, seq)
            rows.append({
                'size': name, 'memory': memory, 'dtype': mcfg.compute_dtype, 'batch': batch, 'tgt_len': seq,
                'mem_len': seq, 'params_M': case.work.num_params / 1e6, 'compile_s': case.compiled.compile_s,
                **case.figures(timings[memory]), 'gflop_per_step': model_flops / 1e9,
                'xla_over_analytic': case.compiled.flops / model_flops if case.compiled.flops else float('nan'),
                **peak.mfu_percents(model_flops / step_s / 1e9, mcfg.compute_dtype, measured_peak),
                'forward_flops_by_part': flops.forward_flops(mcfg, batch, seq), 'model': shape})
        xl, lamemo = rows[-2], rows[-1]
        for r in (xl, lamemo):
            r['time_vs_xl'] = r['step_ms'] / xl['step_ms']
            r['flops_vs_xl'] = r['gflop_per_step'] / xl['gflop_per_step']
        figures[f'{name} time_vs_xl'] = lamemo['time_vs_xl']
        figures[f'{name} flops_vs_xl'] = lamemo['flops_vs_xl']
        figures[f'{name} mfu_percent xl / lamemo'] = f"{xl['mfu_percent']:.1f} / {lamemo['mfu_percent']:.1f}"
    figures['peak_gflops_per_s_float32'] = roofline['float32']
    return harness.SuiteResult(
        rows=rows,
        columns=('size', 'memory', 'dtype', 'batch', 'tgt_len', 'mem_len', 'params_M', 'compile_s', 'step_ms',
                 'tokens_per_s', 'gflop_per_step', 'xla_over_analytic', 'mfu_percent', 'time_vs_xl',
                 'flops_vs_xl'),
        figures=figures,
        config={'step': 'memjax.bench.workload train step (forward, backward, clip + Adam), state donated; '
                        'XL and LaMemo timed round-robin', 'dropout': workload.model_config(ctx.config).dropout,
                'flops': 'memjax.bench.flops, LaMemo memory rows included',
                'mfu_denominator': 'peak suite, best matmul GFLOP/s of the compute dtype, same run'},
        notes=['The paper counts 191M / 157M FLOPs per predicted token at the wt103 shape: multiply-adds '
               'with a full softmax over the vocabulary; flops_vs_xl here counts the adaptive softmax memjax runs.'])
