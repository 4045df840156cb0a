"""`devices`: training throughput on 8 simulated CPU devices relative to 1, same global batch.

The device count of the CPU backend is fixed when jax is imported
(`XLA_FLAGS=--xla_force_host_platform_device_count=N`), so each count is measured in its own
subprocess (`python -m memjax.bench.suites.devices '<json>'`), both launched by the same suite
invocation. The step is the shared workload's, data-parallel over a ('data', 'fsdp', 'tensor')
= (N, 1, 1) mesh from `memjax.runtime.sharding`: the batch's streams are split over the devices,
parameters and Adam state replicated, gradients all-reduced by XLA's SPMD partitioner.
On a 2-core CPU the 8 "devices" share the same 2 cores, so the ratio is expected below 1: it
measures partitioning and collective overhead, the baseline for real multi-device hardware.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

FULL = dict(shape=dict(n_layer=4, d_model=256, n_head=4, d_head=64, d_inner=1024), batch=8, seq=128)
TINY = dict(shape=dict(n_layer=1, d_model=16, n_head=2, d_head=8, d_inner=32), batch=8, seq=8)
DEVICE_COUNTS = (1, 8)
_RESULT_PREFIX = 'DEVICES_RESULT '


def measure_on_all_devices(request: dict[str, Any]) -> dict[str, Any]:
    """Runs in the worker: the sharded step over every device jax sees."""
    import jax
    import ml_collections
    from jax.sharding import PartitionSpec as P

    from memjax import config_lib
    from memjax.runtime import sharding
    from memjax.bench import harness
    from memjax.bench import workload

    config = ml_collections.ConfigDict(request['config'])
    config.mesh.update(data=-1, fsdp=1, tensor=1)  # Pure data parallelism over all devices.
    run = config_lib.resolve(config)
    ctx = harness.Context(size=request['size'], warmup=request['warmup'], repeats=request['repeats'])
    mcfg = workload.model_config(run, mem_len=request['seq'], **request['shape'])
    work = workload.build(mcfg, request['batch'], request['seq'], run)
    partitioner = sharding.Partitioner.from_config(run.mesh)
    params, opt_state = partitioner.params_and_optimizer(mcfg, work.tx)
    memory = partitioner.memory(mcfg, work.batch_size)
    batch = {k: partitioner.shardings(P('batch', None)) for k in work.batch}
    in_shardings = (params, opt_state, memory, batch, partitioner.replicated)
    placed = jax.device_put(work.args(), in_shardings)
    work = workload.TrainWorkload(**{**work.__dict__, **dict(zip(
        ('params', 'opt_state', 'memory', 'batch', 'key'), placed))})
    shard_rows = work.batch['inputs'].addressable_shards[0].data.shape[0]
    # The model's activation constraints apply during tracing.
    with partitioner.context(), harness.recording_programs() as programs:
        measured = workload.measure(work, ctx, in_shardings=in_shardings,
                                    out_shardings=in_shardings[:3] + (partitioner.replicated,))
    return {'device_count': jax.device_count(), 'mesh': dict(partitioner.mesh.shape),
            'batch_rows_per_device': shard_rows,
            'xla_flags': os.environ.get('XLA_FLAGS', ''), 'programs': programs, **measured}


def _run_worker(device_count: int, request: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    flags = [f for f in env.get('XLA_FLAGS', '').split() if 'force_host_platform_device_count' not in f]
    env['XLA_FLAGS'] = ' '.join(flags + [f'--xla_force_host_platform_device_count={device_count}'])
    env['JAX_PLATFORMS'] = 'cpu'
    proc = subprocess.run([sys.executable, '-m', 'memjax.bench.suites.devices', json.dumps(request)],
                          env=env, capture_output=True, text=True, check=False)
    lines = [l for l in proc.stdout.splitlines() if l.startswith(_RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f'devices worker with {device_count} devices failed (exit {proc.returncode}):\n'
                           f'{proc.stderr[-4000:]}')
    return json.loads(lines[-1][len(_RESULT_PREFIX):])


def _suite():
    # Imported here, not at module top: the worker must not import jax before its XLA_FLAGS apply
    # (it is a fresh process, but keeping the module import-light makes that hold by design).
    from memjax.bench import harness
    from memjax.bench import workload

    @harness.register('devices')
    def run(ctx: harness.Context) -> harness.SuiteResult:
        setting = TINY if ctx.tiny else FULL
        request = {'config': workload.run_config(ctx.config).source, 'size': ctx.size,
                   'warmup': ctx.warmup, 'repeats': ctx.repeats, **setting}
        rows = []
        for count in DEVICE_COUNTS:
            ctx.log(f'devices: {count} simulated device(s), global batch {setting["batch"]}')
            result = _run_worker(count, request)
            harness.add_compiled_programs(result['programs'])
            rows.append({'devices': result['device_count'], 'mesh': result['mesh'],
                         'global_batch': setting['batch'], 'per_device_batch': result['batch_rows_per_device'],
                         'tgt_len': setting['seq'], 'compile_s': result['compile_s'],
                         'step_ms': result['step_s'] * 1e3, 'tokens_per_s': result['tokens_per_s'],
                         'xla_flags': result['xla_flags'], 'timing': result['timing']})
        ratio = rows[-1]['tokens_per_s'] / rows[0]['tokens_per_s']
        return harness.SuiteResult(
            rows=rows,
            columns=('devices', 'global_batch', 'per_device_batch', 'tgt_len', 'compile_s', 'step_ms',
                     'tokens_per_s'),
            figures={'throughput_8_over_1': ratio},
            config={'model': setting['shape'], 'batch': setting['batch'], 'tgt_len': setting['seq'],
                    'mem_len': setting['seq'], 'mesh': "memjax.runtime.sharding Partitioner, data=N, fsdp=1, tensor=1",
                    'usable_cores': len(os.sched_getaffinity(0))},
            notes=['Simulated devices share this machine\'s cores: a ratio below 1 is partitioning and '
                   'all-reduce overhead, not a property of real accelerators.'])

    return run


if __name__ == '__main__':
    print(_RESULT_PREFIX + json.dumps(measure_on_all_devices(json.loads(sys.argv[1]))), flush=True)
else:
    run = _suite()
