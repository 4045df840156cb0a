"""`train`: Transformer-XL training-step throughput and MFU at three sizes.

MFU = (analytic model FLOPs per step / median step time) / measured matmul peak, the peak
measured by the `peak` suite in the same invocation (so load from other processes hits
both). XLA's own FLOP count of the compiled step is reported beside the analytic one: it also
counts element-wise work (dropout RNG, softmax, Adam), so it is a check, not the numerator.
"""

from __future__ import annotations

from memjax.bench import flops
from memjax.bench import harness
from memjax.bench import workload
from memjax.bench.suites import peak

# (name, model shape, batch, tgt_len = mem_len). The largest is the enwik8-base model of
# the paper (12 x 512, 8 heads x 64, d_inner 2048); the paper trains at tgt = mem = 512 with
# batch 22, which on 2 CPU cores takes minutes per step, so we run tgt = mem = 256, batch 4.
FULL_SIZES = (
    ('4x256', dict(n_layer=4, d_model=256, n_head=4, d_head=64, d_inner=1024), 4, 256),
    ('8x384', dict(n_layer=8, d_model=384, n_head=6, d_head=64, d_inner=1536), 4, 256),
    ('enwik8-base 12x512', dict(n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048), 4, 256),
)
TINY_SIZES = (
    ('1x16', dict(n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32), 2, 8),
    ('1x32', dict(n_layer=1, d_model=32, n_head=2, d_head=16, d_inner=64), 2, 8),
    ('1x64', dict(n_layer=1, d_model=64, n_head=2, d_head=32, d_inner=128), 2, 16),
)


@harness.register('train')
def run(ctx: harness.Context) -> harness.SuiteResult:
    measured_peak = peak.measure_peak(ctx)
    roofline = measured_peak['peak_gflops_per_s']
    rows = []
    for name, shape, batch, seq in TINY_SIZES if ctx.tiny else FULL_SIZES:
        mcfg = workload.model_config(ctx.config, mem_len=seq, **shape)
        ctx.log(f'train: {name} ({mcfg.compute_dtype}, batch {batch}, tgt = mem = {seq})')
        work = workload.build(mcfg, batch, seq, ctx.config)
        num_params = work.num_params
        measured = workload.measure(work, ctx)
        model_flops = flops.train_step_flops(mcfg, batch, seq)
        achieved = model_flops / measured['step_s']
        peak_gflops = roofline[mcfg.compute_dtype]
        rows.append({
            'size': name, 'params_M': num_params / 1e6, 'dtype': mcfg.compute_dtype,
            'scan_layers': mcfg.scan_layers, 'batch': batch, 'tgt_len': seq, 'mem_len': seq,
            'compile_s': measured['compile_s'], 'step_ms': measured['step_s'] * 1e3,
            'tokens_per_s': measured['tokens_per_s'],
            'mflop_per_token': model_flops / work.tokens_per_step / 1e6,
            'xla_over_analytic': (measured['xla_flops'] / model_flops
                                  if measured['xla_flops'] else float('nan')),
            'achieved_gflops_per_s': achieved / 1e9,
            **peak.mfu_percents(achieved / 1e9, mcfg.compute_dtype, measured_peak),
            'model_flops_per_step': model_flops, 'xla_flops_per_step': measured['xla_flops'],
            'forward_flops_by_part': flops.forward_flops(mcfg, batch, seq),
            'peak_gflops_per_s': peak_gflops, 'timing': measured['timing'],
            'model': shape,
        })
    largest = rows[-1]
    return harness.SuiteResult(
        rows=rows,
        columns=('size', 'params_M', 'dtype', 'batch', 'tgt_len', 'mem_len', 'compile_s', 'step_ms',
                 'tokens_per_s', 'mflop_per_token', 'xla_over_analytic', 'achieved_gflops_per_s',
                 'mfu_percent', 'mfu_datasheet_percent'),
        figures={
            'largest': largest['size'],
            'largest_tokens_per_s': largest['tokens_per_s'],
            'largest_mfu_percent': largest['mfu_percent'],
            'peak_gflops_per_s_float32': roofline['float32'],
            'peak_gflops_per_s_bfloat16': roofline['bfloat16'],
        },
        config={'step': 'one segment: forward, backward, clip + Adam (memjax.training.optim), params/opt '
                        'state/memory donated', 'dropout': workload.model_config(ctx.config).dropout,
                'flops': 'memjax.bench.flops: matmuls of the forward pass x 3, less the input '
                         'gradients that never run',
                'mfu_denominator': 'peak suite, best matmul GFLOP/s of the compute dtype, same run; '
                                   'mfu_datasheet_percent: the chip\'s datasheet rate (memjax.bench.chips)'},
        notes=['xla_over_analytic > 1 is expected: XLA also counts element-wise work (dropout random '
               'bits, softmax, LayerNorm, Adam); with scan_layers its count covers one layer only.'])
