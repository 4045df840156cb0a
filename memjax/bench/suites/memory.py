"""`memory`: peak memory of a training step with remat none / full / dots_saveable.

Figures come from XLA's memory analysis of the compiled step (no run needed), the buffer
sizes XLA plans for: arguments (params, Adam state, memory, batch), outputs, the part of the
outputs aliased onto donated arguments, and temporaries (activations kept for the backward
pass plus workspace, the part remat shrinks). The reported peak is
argument + output - alias + temp: what the step holds at once when its state is donated.
"""

from __future__ import annotations

from memjax.bench import harness
from memjax.bench import workload

POLICIES = ('none', 'full', 'dots_saveable')
FULL = dict(shape=dict(n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048), batch=4, seq=256)
TINY = dict(shape=dict(n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32), batch=2, seq=8)


@harness.register('memory')
def run(ctx: harness.Context) -> harness.SuiteResult:
    setting = TINY if ctx.tiny else FULL
    rows = []
    for scan in (False, True):
        for remat in POLICIES:
            mcfg = workload.model_config(ctx.config, remat=remat, scan_layers=scan,
                                         mem_len=setting['seq'], **setting['shape'])
            ctx.log(f'memory: remat={remat}, scan={scan}')
            compiled = workload.compile_step(workload.build(mcfg, setting['batch'], setting['seq'], ctx.config))
            sizes = compiled.memory()
            rows.append({'remat': remat, 'scan_layers': scan,
                         **{f'{part}_mib': sizes[f'{part}_size_bytes'] / harness.MIB
                            for part in ('argument', 'output', 'alias', 'temp')},
                         'peak_mib': compiled.live_bytes / harness.MIB,
                         'compile_s': compiled.compile_s, 'bytes': sizes})
    temp = {(r['remat'], r['scan_layers']): r['temp_mib'] for r in rows}
    return harness.SuiteResult(
        rows=rows,
        columns=('remat', 'scan_layers', 'argument_mib', 'output_mib', 'alias_mib', 'temp_mib',
                 'peak_mib', 'compile_s'),
        figures={f'temp_{remat}_over_none{"_scan" if scan else ""}': temp[(remat, scan)] / temp[('none', scan)]
                 for scan in (False, True) for remat in POLICIES[1:]},
        config={'model': setting['shape'], 'batch': setting['batch'], 'tgt_len': setting['seq'],
                'mem_len': setting['seq'], 'dtype': workload.model_config(ctx.config).compute_dtype,
                'reported': 'compiled.memory_analysis(): peak_mib = argument + output - alias + temp; '
                            'temp_mib is what rematerialisation changes'},
        notes=['XLA CPU plans buffers statically, so these are planned sizes, not a measured RSS.'])
