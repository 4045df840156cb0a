"""`scaling`: how the cost of a step grows with the work it is given.

Three sweeps around one base point, one knob at a time: `mem_len` (training and evaluation
step), batch size and `tgt_len` (training step). Per-token time should grow linearly with the
attention length K = mem_len + tgt_len (the matmuls per token are constant, the attention scores
per token grow with K), stay roughly flat in the batch, and memory should grow linearly with
what is held: the memory buffers (mem_len), activations (batch x tgt_len x K for the scores).

Memory is XLA's buffer assignment of the compiled executable (`memory_analysis()`):
live = arguments + outputs - aliased (donated) + temporaries, i.e. what the step holds at its
peak if every temporary were alive at once (an upper bound; XLA's CPU client reports no finer
peak). `temp` alone is the activation and workspace part.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from memjax import model as model_lib
from memjax.bench import harness
from memjax.bench import workload


@dataclasses.dataclass(frozen=True)
class Setup:
    batch_size: int
    tgt_len: int
    mem_len: int
    mem_lens: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    tgt_lens: tuple[int, ...]
    model: dict  # ModelConfig fields used when no --config is given.


SETUPS = {
    'full': Setup(batch_size=8, tgt_len=128, mem_len=128, mem_lens=(64, 128, 256, 512),
                  batch_sizes=(2, 4, 8, 16), tgt_lens=(32, 64, 128, 256),
                  model=dict(vocab_size=256, n_layer=6, d_model=256, n_head=4, d_head=64, d_inner=1024,
                             dropout=0.1, dropatt=0.0)),
    'tiny': Setup(batch_size=2, tgt_len=8, mem_len=8, mem_lens=(4, 8), batch_sizes=(1, 2), tgt_lens=(4, 8),
                  model=dict(vocab_size=64, n_layer=1, d_model=32, n_head=2, d_head=16, d_inner=64,
                             dropout=0.1, dropatt=0.0)),
}
# (sweep name, the Setup field it varies, the modes it is measured in)
SWEEPS = (('mem_len', 'mem_lens', ('train', 'eval')), ('batch_size', 'batch_sizes', ('train',)),
          ('tgt_len', 'tgt_lens', ('train',)))


def measure_point(mcfg: model_lib.ModelConfig, mode: str, batch_size: int, tgt_len: int,
                  ctx: harness.Context) -> dict[str, Any]:
    if mode == 'train':
        case = workload.train_case(workload.build(mcfg, batch_size, tgt_len, ctx.config))
    else:
        case = workload.random_eval_case(mcfg, batch_size, tgt_len)
    timing = case.time_alone(ctx)
    return {'mode': mode, 'mem_len': mcfg.mem_len, 'batch_size': batch_size, 'tgt_len': tgt_len,
            'attn_keys': mcfg.mem_len + tgt_len, 'us_per_token': timing.median_s / case.tokens * 1e6,
            'tokens_per_s': case.tokens / timing.median_s, 'live_mib': case.compiled.live_bytes / harness.MIB,
            'temp_mib': case.compiled.memory()['temp_size_bytes'] / harness.MIB,
            'compile_s': case.compiled.total_s, 'timing': timing.as_dict()}


def affine_fit(x: list[float], y: list[float]) -> dict[str, float]:
    """Least-squares y = a + b x and the worst relative residual (small = linear growth)."""
    x_arr, y_arr = np.asarray(x, float), np.asarray(y, float)
    slope, intercept = np.polyfit(x_arr, y_arr, 1)
    residual = np.abs(intercept + slope * x_arr - y_arr) / np.abs(y_arr)
    return {'intercept': float(intercept), 'slope': float(slope), 'max_rel_residual': float(residual.max())}


def base_model(ctx: harness.Context, setup: Setup) -> model_lib.ModelConfig:
    overrides = dict(setup.model) if ctx.config is None else {}
    return workload.model_config(ctx.config, **overrides, mem_len=setup.mem_len)


@harness.register('scaling')
def run(ctx: harness.Context) -> harness.SuiteResult:
    setup = SETUPS[ctx.size]
    mcfg = base_model(ctx, setup)
    rows, cache = [], {}
    for sweep, field, modes in SWEEPS:
        for value in getattr(setup, field):
            point = {'mem_len': setup.mem_len, 'batch_size': setup.batch_size, 'tgt_len': setup.tgt_len, sweep: value}
            for mode in modes:
                key = (mode, point['mem_len'], point['batch_size'], point['tgt_len'])
                if key not in cache:  # The base point belongs to every sweep: measure it once.
                    ctx.log(f'scaling: {mode} {point}')
                    cache[key] = measure_point(mcfg.replace(mem_len=point['mem_len']), mode,
                                               point['batch_size'], point['tgt_len'], ctx)
                rows.append({'sweep': sweep, **cache[key]})

    figures = {}
    for sweep, _, modes in SWEEPS:
        for mode in modes:
            sub = [r for r in rows if r['sweep'] == sweep and r['mode'] == mode]
            for r in sub:
                r['time_vs_first'] = r['us_per_token'] / sub[0]['us_per_token']
            if sweep in ('mem_len', 'tgt_len'):  # Both lengthen the attention: fit against K.
                fit = affine_fit([r['attn_keys'] for r in sub], [r['us_per_token'] for r in sub])
                figures.update({f'{mode}_{sweep}_us_per_token_vs_keys_{k}': v for k, v in fit.items()})
            if sweep == 'mem_len':
                fit = affine_fit([r['mem_len'] for r in sub], [r['live_mib'] for r in sub])
                figures.update({f'{mode}_mem_len_live_mib_vs_mem_len_{k}': v for k, v in fit.items()})
    return harness.SuiteResult(
        rows=rows,
        columns=('sweep', 'mode', 'mem_len', 'batch_size', 'tgt_len', 'attn_keys', 'us_per_token',
                 'time_vs_first', 'tokens_per_s', 'live_mib', 'temp_mib', 'compile_s'),
        figures=figures,
        config={'model': dataclasses.asdict(mcfg), 'base': {'batch_size': setup.batch_size, 'tgt_len': setup.tgt_len,
                                                            'mem_len': setup.mem_len},
                'sweeps': {sweep: list(getattr(setup, field)) for sweep, field, _ in SWEEPS}},
        notes=[
            'One knob at a time around the base point; train = workload.train_step_fn (forward, backward, '
            'the project optimizer, state donated), eval = train_step.eval_step_fn (memory donated), float32.',
            'live_mib = arguments + outputs - donated aliases + temporaries from the compiled executable\'s '
            'memory_analysis() (an upper bound of the peak); temp_mib = temporaries only.',
            'Fits: us_per_token = intercept + slope * attn_keys (attn_keys = mem_len + tgt_len); a small '
            'max_rel_residual means linear growth in the attention length.',
        ])
