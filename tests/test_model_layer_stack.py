"""The layer-stack switches (nn.scan, rematerialisation) change how the model runs, not what it computes."""

import functools

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax.model import primitives
from memjax.model import (ModelConfig, build_model, convert_layer_layout, init_memory, init_params, lm_loss,
                          param_logical_axes)

BASE = dict(vocab_size=40, d_model=16, n_layer=3, n_head=2, d_head=8, d_inner=32, mem_len=4, dropout=0.2,
            dropatt=0.1, untie_r=True)


def loss_and_grads(cfg, params, tokens, deterministic):
    def loss(p):
        memory = init_memory(cfg, tokens.shape[0])
        for segment in jnp.split(tokens, 2, axis=1):  # two segments, memory carried
            out, memory = build_model(cfg).apply({'params': p}, segment, memory, targets=segment,
                                                   deterministic=deterministic,
                                                   rngs={'dropout': jax.random.key(3)})
        return lm_loss(out.target_logprobs), memory.layers['hidden']

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


@pytest.fixture(scope='module')
def reference():
    cfg = ModelConfig(**BASE)
    params = init_params(cfg, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 40)
    return cfg, params, tokens, loss_and_grads(cfg, params, tokens, deterministic=True)


@pytest.mark.parametrize('scan_layers,remat', [(True, 'none'), (False, 'full'), (True, 'dots_saveable')])
def test_scan_and_remat_give_the_same_loss_memory_and_gradients(reference, scan_layers, remat):
    cfg, params, tokens, ((want_loss, want_memory), want_grads) = reference
    variant = cfg.replace(scan_layers=scan_layers, remat=remat)
    (loss, memory), grads = loss_and_grads(variant, convert_layer_layout(params, scan_layers), tokens, True)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    np.testing.assert_allclose(memory, want_memory, atol=1e-6)
    grads = convert_layer_layout(grads, scan_layers=False)
    for path, want in jax.tree_util.tree_leaves_with_path(want_grads):
        got = dict(jax.tree_util.tree_leaves_with_path(grads))[path]
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_scan_init_stacks_independent_layers_and_keeps_dropout_active():
    cfg = ModelConfig(**BASE)
    scanned_cfg = cfg.replace(scan_layers=True)
    scanned = init_params(scanned_cfg, jax.random.key(0))
    assert jax.tree.leaves(scanned['layers'])[0].shape[0] == cfg.n_layer
    unstacked = convert_layer_layout(scanned, scan_layers=False)
    assert jax.tree.structure(unstacked) == jax.tree.structure(init_params(cfg, jax.random.key(0)))
    kernels = scanned['layers']['attention']['query']['kernel']
    assert not np.allclose(kernels[0], kernels[1])  # each layer initialised independently
    tokens = jax.random.randint(jax.random.key(1), (2, 8), 0, 40)
    (loss_a, _), _ = loss_and_grads(scanned_cfg, scanned, tokens, deterministic=False)
    (loss_b, _), _ = loss_and_grads(cfg, unstacked, tokens, deterministic=False)
    (loss_det, _), _ = loss_and_grads(cfg, unstacked, tokens, deterministic=True)
    assert np.isfinite(loss_a) and loss_a != loss_det and loss_b != loss_det


def test_every_parameter_has_logical_axis_names():
    for overrides in (dict(), dict(scan_layers=True, cutoffs=(10, 20), div_val=2, tie_weight=False)):
        cfg = ModelConfig(**{**BASE, **overrides})
        axes = param_logical_axes(cfg)
        params = init_params(cfg, jax.random.key(0))
        for (path, spec), leaf in zip(jax.tree_util.tree_leaves_with_path(axes), jax.tree.leaves(params)):
            assert len(spec) == leaf.ndim, jax.tree_util.keystr(path)
        flat = {jax.tree_util.keystr(p): tuple(s) for p, s in jax.tree_util.tree_leaves_with_path(axes)}
        query = [s for p, s in flat.items() if 'query' in p][0]
        assert query[-3:] == ('embed', 'heads', 'kv')
        if cfg.scan_layers:
            assert query[0] == 'layers'
        assert flat["['io']['emb_table_0']"] == ('vocab', 'embed')


def test_a_given_parameter_is_checked_by_its_shape_without_running_its_initializer_again():
    """memjax's parameters (primitives.param) are drawn as Flax's own `param` draws them; applying
    with given parameters calls no initializer (Flax's `param` traces it again at every apply to
    compare shapes), and a parameter of another shape is still refused by name, in the model too."""
    calls = []

    def init(key, shape):
        calls.append(shape)
        return jax.random.normal(key, shape)

    class Scaled(nn.Module):
        flax_param: bool = False

        @nn.compact
        def __call__(self, x):
            shape = (x.shape[-1],)
            declare = self.param if self.flax_param else functools.partial(primitives.param, self)
            return x * declare('scale', init, shape)

    x = jnp.arange(6.0).reshape(2, 3)
    variables = Scaled().init(jax.random.key(0), x)
    flax_drawn = Scaled(flax_param=True).init(jax.random.key(0), x)['params']['scale']
    np.testing.assert_array_equal(variables['params']['scale'], flax_drawn)
    calls.clear()
    np.testing.assert_array_equal(Scaled().apply(variables, x), x * variables['params']['scale'])
    assert calls == []
    Scaled(flax_param=True).apply(variables, x)
    assert calls == [(3,)]  # What the helper saves.
    with pytest.raises(flax.errors.ScopeParamShapeError, match=r'"scale" .* shape \(4,\), .* shape \(3,\)'):
        Scaled().apply(variables, jnp.ones((2, 4)))
    cfg = ModelConfig(**BASE)
    wider = init_params(cfg.replace(d_inner=48), jax.random.key(0))
    with pytest.raises(flax.errors.ScopeParamShapeError, match='kernel'):
        build_model(cfg).apply({'params': wider}, jnp.zeros((1, 4), jnp.int32), init_memory(cfg, 1))


@pytest.mark.parametrize('overrides', [{}, dict(pre_lnorm=True, block='gpt2'), dict(compute_dtype='bfloat16'),
                                       dict(scan_layers=True)])
def test_applying_a_model_sends_no_parameter_through_flax_s_param(overrides, monkeypatch):
    """Every parameter of the model, its LayerNorms' included (post- and pre-LN, the final norm, the
    rematerialised bf16 one, a scanned stack), is checked by shape at `apply`: none goes through
    Flax's own `param`, which would trace its initializer again."""
    declared = []
    flax_param = flax.core.scope.Scope.param

    def counted(scope, name, *args, **kwargs):
        declared.append(f'{scope.path_text}/{name}')
        return flax_param(scope, name, *args, **kwargs)

    monkeypatch.setattr(flax.core.scope.Scope, 'param', counted)
    cfg = ModelConfig(**BASE).replace(**overrides)
    model, tokens, memory = build_model(cfg), jnp.zeros((1, 4), jnp.int32), init_memory(cfg, 1)
    variables = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens, memory))
    assert any('norm' in name for name in declared)  # Init goes through it, the LayerNorms' too.
    declared.clear()
    jax.eval_shape(lambda v: model.apply(v, tokens, memory), variables)
    assert declared == []


@pytest.mark.parametrize('scan_layers', [False, True])
def test_parameters_in_the_other_layer_layout_are_refused_in_one_line(scan_layers):
    cfg = ModelConfig(**BASE, scan_layers=scan_layers)
    other = init_params(cfg.replace(scan_layers=not scan_layers), jax.random.key(0))
    tokens = jnp.zeros((1, 4), jnp.int32)
    with pytest.raises(ValueError, match=rf'convert_layer_layout\(params, scan_layers={scan_layers}\)'):
        build_model(cfg).apply({'params': other}, tokens, init_memory(cfg, 1))
