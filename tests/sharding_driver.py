"""Runs the sharded-training scenarios of test_sharding.py on 8 simulated CPU devices.

`python tests/sharding_driver.py WORKDIR` prints one JSON object. It is a separate process
because the device count must be fixed before JAX is imported, which pytest workers that
already imported JAX cannot do.
"""

import os

# Compiling dominates at these tiny shapes: test_sharding.py starts the driver with the suite's
# fast-compiling flags (tests/conftest.py), to which it adds the devices.
os.environ['XLA_FLAGS'] = ' '.join([
    os.environ.get('XLA_FLAGS', ''), '--xla_force_host_platform_device_count=8']).strip()

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from memjax.training import checkpoints as checkpointing  # noqa: E402
from memjax import config_lib  # noqa: E402
from memjax.training import evaluation  # noqa: E402
from memjax import model as model_lib  # noqa: E402
from memjax.training import experiment  # noqa: E402
from memjax.data import pipeline  # noqa: E402
import toy_memory  # noqa: E402
import training_fixtures  # noqa: E402

# Global batch 8; heads, d_inner and the byte vocabulary divide by 4.
MESHES = {
    'one_device': dict(data=1),
    'data8': dict(data=8),
    'data2_tensor4': dict(data=2, tensor=4),
    'fsdp4_tensor2': dict(data=1, fsdp=4, tensor=2),
}
NUM_BATCHES = 2  # Of 2 segments each: 4 updates, the memory carried throughout.


def make_config(corpus: str, mesh: dict, **model):
    config = training_fixtures.tiny_config(corpus, train__batch_size=8, eval__batch_size=8)
    config.model.update(n_head=4, d_head=8, **model)
    config.mesh.update(dict(dict(data=1, fsdp=1, tensor=1), **mesh))
    return config


def setup(corpus: str, workdir: str, name: str, **model):
    """The experiment on mesh `name`, with its jitted steps (compiled once per experiment)."""
    devices = jax.devices()[:1] if name == 'one_device' else jax.devices()
    exp = experiment.setup(make_config(corpus, MESHES[name], **model),
                        os.path.join(workdir, name), devices)
    return exp, (experiment.make_train_step(exp), experiment.make_eval_step(exp))


def train_batches(exp):
    tcfg = exp.run.train
    iterator = pipeline.LMStreams(
        exp.run.data, 'train', exp.tokenizer, batch_size=tcfg.batch_size,
        tgt_len=tcfg.tgt_len, segments_per_batch=tcfg.segments_per_step).iterator()
    return [next(iterator) for _ in range(NUM_BATCHES)]


def metrics_lists(metrics: list) -> dict:
    host = jax.device_get(metrics)
    return {'loss': [float(x) for m in host for x in m['nll_sum'] / m['num_tokens']],
            'grad_norm': [float(x) for m in host for x in m['grad_norm']]}


def describe(array: jax.Array, logical=None) -> dict:
    return {'logical': list(logical) if logical is not None else None,
            'spec': [list(a) if isinstance(a, tuple) else a for a in array.sharding.spec],
            'shape': list(array.shape),
            'shard_shape': list(array.addressable_shards[0].data.shape)}


def layout(exp, state, memory) -> dict:
    """Logical names, mesh specs and local shard shapes of every parameter and Adam moment."""
    logical = model_lib.param_logical_axes(exp.mcfg)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)
    names = {jax.tree_util.keystr(p): v for p, v in
             jax.tree_util.tree_leaves_with_path(logical, is_leaf=is_spec)}
    params = {jax.tree_util.keystr(p): describe(v, names[jax.tree_util.keystr(p)])
              for p, v in jax.tree_util.tree_leaves_with_path(state.params)}
    adam = next(s for s in state.opt_state if hasattr(s, 'mu'))
    moments = {jax.tree_util.keystr(p): describe(v)
               for p, v in jax.tree_util.tree_leaves_with_path(adam.mu)}
    return {'params': params, 'mu': moments, 'memory_hidden': describe(memory.layers['hidden']),
            'mesh': dict(exp.partitioner.mesh.shape)}


def train(exp, steps, batches, state=None, memory=None):
    train_step, _ = steps
    if state is None:
        state, memory = experiment.init_state(exp)
    metrics = []
    for batch in batches:
        state, memory, step_metrics = train_step(state, memory,
                                                 exp.partitioner.global_batch(batch))
        metrics.append(step_metrics)
    return state, memory, metrics


def validation(exp, steps, params) -> dict:
    _, eval_step = steps
    streams = evaluation.eval_streams(exp.run, exp.tokenizer, 'validation')
    result = evaluation.evaluate_streams(eval_step, params, exp.eval_mcfg, streams,
                                         evaluation.local_eval_batch(exp.run), 2,
                                         exp.partitioner)
    return {'nll_sum': result.nll_sum, 'num_tokens': result.num_tokens}


def cross_mesh_resume(workdir: str, experiments: dict, batches: list) -> dict:
    """Checkpoint on data8 after one batch, resume on fsdp4_tensor2 for the second."""
    saver, saver_steps = experiments['data8']
    ckpt = checkpointing.Checkpointer(os.path.join(workdir, 'ckpt'), keep=2)
    state, memory, _ = train(saver, saver_steps, batches[:1])
    ckpt.save(int(state.step), state, memory, {'batches_read': 1}, saver.config.to_dict())
    saved_leaf = jax.tree_util.tree_leaves(state.params)[0]
    # The next step donates the buffers the asynchronous save was given.
    train(saver, saver_steps, batches[1:], state, memory)
    donated = saved_leaf.is_deleted()
    ckpt.wait()
    ckpt.close()

    loader, loader_steps = experiments['fsdp4_tensor2']
    restored = checkpointing.Checkpointer(os.path.join(workdir, 'ckpt'), keep=2).restore_latest(
        *experiment.abstract_state(loader))
    restored_layout = layout(loader, restored.state, restored.memory)
    _, _, metrics = train(loader, loader_steps, batches[1:], restored.state, restored.memory)
    return {'donated_after_save': donated, 'restored_step': restored.step,
            'data_state': restored.data_state, 'continued': metrics_lists(metrics),
            'layout': restored_layout}


# The test-only kind in its skipping phase, LaMemo, and XL with Skip-Retain (layers skipped at
# random, memories aging) and a head permutation in every layer and step (heads split over tensor).
MEMORY_KINDS = {'every_other': dict(memory='every_other'), 'lamemo': dict(memory='lamemo'),
                'skip_cross_head': dict(skip_rule='uniform', skip_p=0.5, sch_beta=1.0),
                'fused_attention': dict(attention_impl='fused')}


def memory_kind(corpus: str, workdir: str, batches: list, memory: str) -> dict:
    """Losses of a memory kind other than XL's (or of XL's with the training switches) on one
    device and on data x tensor."""
    losses = {}
    for name in ('one_device', 'data2_tensor4'):
        devices = jax.devices()[:1] if name == 'one_device' else jax.devices()
        exp = experiment.setup(make_config(corpus, MESHES[name], dropout=0.0, **MEMORY_KINDS[memory]),
                            os.path.join(workdir, f'{memory}_{name}'), devices)
        steps = (experiment.make_train_step(exp, phase=exp.model.kind.phase(toy_memory.SKIP_FROM_STEP)), None)
        _, _, metrics = train(exp, steps, batches)
        losses[name] = metrics_lists(metrics)
    return losses


def trams_validation(corpus: str, workdir: str) -> dict:
    """Validation sums of TRAMS (per-head selection, gathered keys) on one device and on
    data x tensor, from the same initial XL parameters."""
    sums = {}
    for name in ('one_device', 'data2_tensor4'):
        config = make_config(corpus, MESHES[name])
        config.eval.model.update(memory='trams', mem_len=16, trams_select=6, trams_remain=2)
        devices = jax.devices()[:1] if name == 'one_device' else jax.devices()
        exp = experiment.setup(config, os.path.join(workdir, f'trams_{name}'), devices)
        state, _ = experiment.init_state(exp)
        sums[name] = validation(exp, (None, experiment.make_eval_step(exp)), state.params)
    return sums


def main(workdir: str) -> None:
    corpus = training_fixtures.write_text_corpus(os.path.join(workdir, 'corpus'))
    results = {'device_count': jax.device_count(), 'meshes': {}, 'seconds': {}}
    experiments, batches = {}, None
    for name in MESHES:
        start = time.time()
        exp, steps = experiments[name] = setup(corpus, workdir, name)
        batches = batches or train_batches(exp)
        state, memory, metrics = train(exp, steps, batches)
        results['meshes'][name] = dict(metrics_lists(metrics), layout=layout(exp, state, memory),
                                       validation=validation(exp, steps, state.params),
                                       state_bytes={'train': experiment.state_bytes(exp, True),
                                                    'eval': experiment.state_bytes(exp, False)})
        results['seconds'][name] = time.time() - start
    for memory in MEMORY_KINDS:
        start = time.time()
        results[memory] = memory_kind(corpus, workdir, batches, memory)
        results['seconds'][memory] = time.time() - start
    start = time.time()
    results['trams'] = trams_validation(corpus, workdir)
    results['seconds']['trams'] = time.time() - start
    start = time.time()
    results['resume'] = cross_mesh_resume(workdir, experiments, batches)
    results['seconds']['resume'] = time.time() - start
    try:
        experiment.setup(make_config(corpus, dict(tensor=8)), os.path.join(workdir, 'bad'))
        results['indivisible_error'] = None
    except config_lib.ConfigError as error:
        results['indivisible_error'] = str(error)
    print(json.dumps(results))


if __name__ == '__main__':
    main(sys.argv[1])
