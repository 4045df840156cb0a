"""Sharded training on 8 simulated CPU devices equals one device; params are really split.

The multi-device scenarios run in a subprocess (tests/sharding_driver.py), because the
simulated device count must be set before JAX is imported.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

from memjax import config_lib
from memjax import model as model_lib
from memjax.runtime import sharding
import conftest
import training_fixtures

SHARDED_MESHES = ('data8', 'data2_tensor4', 'fsdp4_tensor2')
# The default rules, restated: the logical axes that are split, and over which mesh axes.
SPLIT = {'vocab': ('tensor',), 'heads': ('tensor',), 'mlp': ('tensor',), 'embed': ('fsdp',)}
BATCH_AXES = ('data', 'fsdp')


@pytest.fixture(scope='module')
def driver(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp('sharding'))
    env = dict(os.environ, PYTHONPATH=training_fixtures.REPO)
    env['XLA_FLAGS'] = conftest.with_fast_compile('')  # The driver adds its 8 devices.
    script = os.path.join(training_fixtures.REPO, 'tests', 'sharding_driver.py')
    done = subprocess.run([sys.executable, script, workdir], env=env, capture_output=True,
                          text=True, timeout=600, cwd=training_fixtures.REPO)
    assert done.returncode == 0, done.stderr[-5000:]
    # TFDS prints progress to stdout; the results are the last line.
    return json.loads(done.stdout.strip().splitlines()[-1])


def expected_shard(shape, logical, mesh):
    """Local shard shape from SPLIT: each split dimension divided by its mesh axes' sizes."""
    shard = list(shape)
    for i, name in enumerate(logical or ()):
        for axis in SPLIT.get(name, ()):
            shard[i] //= mesh[axis]
    return shard


def test_driver_sees_eight_devices(driver):
    assert driver['device_count'] == 8


@pytest.mark.parametrize('mesh', SHARDED_MESHES)
def test_mesh_gives_one_device_losses_and_gradient_norms(driver, mesh):
    one, sharded = driver['meshes']['one_device'], driver['meshes'][mesh]
    assert len(sharded['loss']) == 4
    np.testing.assert_allclose(sharded['loss'], one['loss'], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sharded['grad_norm'], one['grad_norm'], rtol=1e-5, atol=1e-5)
    # Updates happened: the losses move from step to step.
    assert len(set(np.round(one['loss'], 4))) == 4


@pytest.mark.parametrize('memory', ['every_other', 'lamemo', 'skip_cross_head', 'fused_attention'])
def test_other_memory_kinds_shard_without_changing_losses(driver, memory):
    """tests/toy_memory.py, a kind memjax does not know (explicit distances, a leaf without a batch
    axis, layer skips under lax.cond), LaMemo (stack rows, float32 log-denominators), XL with
    Skip-Retain and cross-head attention (aging memories, head permutations across the tensor
    axis), and XL's attention as the fused kernel (run per shard of batch and heads) on data=2 x
    tensor=4 against one device."""
    runs = driver[memory]
    np.testing.assert_allclose(runs['data2_tensor4']['loss'], runs['one_device']['loss'], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(runs['data2_tensor4']['grad_norm'], runs['one_device']['grad_norm'],
                               rtol=1e-5, atol=1e-5)
    assert len(set(np.round(runs['one_device']['loss'], 4))) == 4


def test_trams_evaluation_shards_without_changing_its_score(driver):
    """TRAMS's per-head top-k and gathers under data=2 x tensor=4 (heads split) score as on one device."""
    one, sharded = driver['trams']['one_device'], driver['trams']['data2_tensor4']
    assert sharded['num_tokens'] == one['num_tokens'] > 0
    assert sharded['nll_sum'] == pytest.approx(one['nll_sum'], rel=1e-5)


@pytest.mark.parametrize('mesh', SHARDED_MESHES)
def test_validation_sums_are_global(driver, mesh):
    one, sharded = driver['meshes']['one_device']['validation'], driver['meshes'][mesh]['validation']
    assert sharded['num_tokens'] == one['num_tokens'] == 2 * 2 * 8 * 8  # batches x S x B x T.
    assert sharded['nll_sum'] == pytest.approx(one['nll_sum'], rel=1e-5)


@pytest.mark.parametrize('mesh', SHARDED_MESHES)
def test_params_and_adam_moments_are_split_as_the_rules_say(driver, mesh):
    layout = driver['meshes'][mesh]['layout']
    sizes = layout['mesh']
    split_params = 0
    for path, param in layout['params'].items():
        want = expected_shard(param['shape'], param['logical'], sizes)
        assert param['shard_shape'] == want, (path, param)
        assert layout['mu'][path]['shard_shape'] == want, path
        assert layout['mu'][path]['spec'] == param['spec'], path
        split_params += want != param['shape']
    heads = layout['params']["['layer_0']['attention']['query']['kernel']"]
    if sizes['tensor'] > 1:
        assert 'tensor' in heads['spec']
        assert heads['shard_shape'][1] == heads['shape'][1] // sizes['tensor']
        assert split_params >= 10
    hidden = layout['memory_hidden']  # [n_layer, B, mem_len, d_model]
    assert hidden['shard_shape'] == [2, 8 // (sizes['data'] * sizes['fsdp']), 8, 32]


@pytest.mark.parametrize('mesh', SHARDED_MESHES)
def test_the_state_size_check_counts_what_one_device_holds(driver, mesh):
    layout, sizes = driver['meshes'][mesh]['layout'], driver['meshes'][mesh]['layout']['mesh']
    counted = driver['meshes'][mesh]['state_bytes']
    float32 = lambda shapes: 4 * sum(int(np.prod(shape)) for shape in shapes)
    assert counted['train']['parameters'] == counted['eval']['parameters'] == float32(
        param['shard_shape'] for param in layout['params'].values())
    # Training's memory (hidden states) is split over the batch axes; evaluation's (the keys and
    # values as projected, 'xl_cached') over the batch axes and, by its heads, over 'tensor'.
    one = driver['meshes']['one_device']['state_bytes']
    split = sizes['data'] * sizes['fsdp']
    assert counted['train']['memory'] * split == pytest.approx(one['train']['memory'], rel=0.01)
    # Keys and values: 2 x [2 layers, batch 8, mem 8, 4 heads, 8] float32; 'valid' and 'fresh': 2 x [8, 8] bool.
    keys_values, masks = 2 * 2 * 8 * 8 * 4 * 8 * 4, 2 * 8 * 8
    assert one['eval']['memory'] == keys_values + masks
    assert counted['eval']['memory'] == keys_values // (split * sizes['tensor']) + masks // split
    assert counted['eval']['optimizer state'] == 0 < counted['train']['optimizer state']


def test_one_device_mesh_replicates(driver):
    layout = driver['meshes']['one_device']['layout']
    assert all(p['shard_shape'] == p['shape'] for p in layout['params'].values())


def test_checkpoint_from_data8_resumes_on_fsdp4_tensor2_with_same_losses(driver):
    resume, uninterrupted = driver['resume'], driver['meshes']['data8']
    assert resume['restored_step'] == 2
    assert resume['data_state'] == {'batches_read': 1}
    # The save's buffers were donated to the next step before the asynchronous write ended.
    assert resume['donated_after_save']
    np.testing.assert_allclose(resume['continued']['loss'], uninterrupted['loss'][2:],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(resume['continued']['grad_norm'],
                               uninterrupted['grad_norm'][2:], rtol=1e-5, atol=1e-5)
    # Restored straight into the new mesh's shards.
    target = driver['meshes']['fsdp4_tensor2']['layout']
    for path, param in resume['layout']['params'].items():
        assert param['spec'] == target['params'][path]['spec'], path
        assert param['shard_shape'] == target['params'][path]['shard_shape'], path
    assert resume['layout']['mesh'] == {'data': 1, 'fsdp': 4, 'tensor': 2}


def test_indivisible_split_is_refused_before_compiling(driver):
    error = driver['indivisible_error']
    assert error is not None
    assert "['attention']['query']['kernel']" in error
    assert "'heads'" in error and 'not divisible by 8' in error
    assert 'config.mesh.rules' in error


def abstract_partitioner(rules=(), data=2, fsdp=1, tensor=4):
    mesh = AbstractMesh((data, fsdp, tensor), sharding.MESH_AXES,
                        axis_types=(AxisType.Auto,) * 3)
    return sharding.Partitioner(mesh, sharding.logical_rules(rules))


def tiny_model_config():
    return model_lib.ModelConfig(vocab_size=256, d_model=32, n_layer=2, n_head=4, d_head=8,
                                 d_inner=64)


def test_rule_overrides_change_only_the_named_axis():
    default = abstract_partitioner().params(tiny_model_config())
    replicated_vocab = abstract_partitioner((('vocab', None),)).params(tiny_model_config())
    assert tuple(default['io']['emb_table_0'].spec) == ('tensor', 'fsdp')
    assert tuple(replicated_vocab['io']['emb_table_0'].spec) == (None, 'fsdp')
    query = ('layer_0', 'attention', 'query', 'kernel')
    pick = lambda tree: tree[query[0]][query[1]][query[2]][query[3]]
    assert pick(default).spec == pick(replicated_vocab).spec


def test_scanned_layers_shard_like_unrolled_ones():
    scanned = abstract_partitioner().params(tiny_model_config().replace(scan_layers=True))
    # The stacked [n_layer, ...] kernel keeps the layer axis whole and splits the rest.
    spec = tuple(scanned['layers']['attention']['query']['kernel'].spec)
    assert spec == (None, 'fsdp', 'tensor', None)


def test_unknown_rule_name_is_a_config_error():
    with pytest.raises(config_lib.ConfigError, match="unknown logical axis 'head'"):
        sharding.logical_rules((('head', 'tensor'),))


@pytest.mark.parametrize('mesh, train, device_count, message', [
    (dict(data=2, tensor=2), {}, 8, 'has 4 devices but 8 are present'),
    (dict(data=-1, tensor=3), {}, 8, 'do not divide|does not divide'),
    (dict(data=-1, fsdp=-1), {}, 8, 'at most one size may be -1'),
    (dict(data=0), {}, 8, 'must be positive ints or -1'),
    (dict(data=-1), dict(batch_size=12), 8, 'batch_size=12 must be divisible'),
    (dict(data=4, fsdp=1, tensor=2), dict(batch_size=8, grad_accum_steps=4), 8,
     r'data x fsdp \(4\) x config.train.grad_accum_steps \(4\) = 16'),
    (dict(data=-1, rules=(('vocab', 'model'),)), {}, 8, "mesh_axes None, one of"),
])
def test_bad_mesh_config_is_rejected(mesh, train, device_count, message):
    config = config_lib.base_config()
    config.mesh.update(mesh)
    config.train.update(train)
    with pytest.raises(config_lib.ConfigError, match=message):
        config_lib.validate_config(config, device_count=device_count)


def test_data_axes_must_cover_the_processes():
    config = config_lib.base_config()
    config.mesh.update(data=1, tensor=8)
    with pytest.raises(config_lib.ConfigError, match='multiple of the process count'):
        config_lib.validate_config(config, process_count=2, device_count=8)


def test_default_mesh_uses_every_device_for_data():
    config = config_lib.base_config()
    config_lib.validate_config(config, device_count=8)
    assert config_lib.resolve(config).mesh.shape(8) == {'data': 8, 'fsdp': 1, 'tensor': 1}


class _Device:
    """What `process_ordered` reads of a device: its process."""

    def __init__(self, name, process_index):
        self.name, self.process_index = name, process_index

    def __repr__(self):
        return self.name


@pytest.mark.parametrize('shape, processes', [((16, 1, 1), 4), ((4, 1, 2), 2), ((2, 2, 2), 2)],
                         ids=['data16_4_hosts', 'data4_tensor2_2_hosts', 'data2_fsdp2_tensor2_2_hosts'])
def test_each_process_holds_the_batch_rows_of_its_own_streams(shape, processes):
    """A physical layout that interleaves the hosts along the batch (a TPU v4-32's z axis varies
    fastest): reordered so that batch row block r (the flat position over data and fsdp, tensor
    innermost) belongs to the process reading streams r P / B, each host's devices in their own order."""
    count = int(np.prod(shape))
    physical = np.array([_Device(f'd{i}', i % processes) for i in range(count)]).reshape(shape)
    ordered = sharding.process_ordered(physical)
    rows = shape[0] * shape[1]
    owner = np.array([d.process_index for d in ordered.reshape(-1)]).reshape(rows, shape[2])
    assert (owner == (np.arange(rows) * processes // rows)[:, None]).all()
    for p in range(processes):
        mine = [d.name for d in physical.reshape(-1) if d.process_index == p]
        assert [d.name for d in ordered.reshape(-1) if d.process_index == p] == mine
    already = np.array([_Device(f'd{i}', i * processes // count) for i in range(count)]).reshape(shape)
    assert sharding.process_ordered(already) is already
