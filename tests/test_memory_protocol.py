"""The memory protocol, proved with a kind memjax does not know (tests/toy_memory.py).

It trains, evaluates, checkpoints and resumes exactly through the unchanged trainer; its
random streams are split per layer and, as each declares, shared or not between accumulation
chunks; its auxiliary loss is exact under accumulation; skipped layers are conditional branches
of the compiled step that really leave the layer out.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax import config_lib
from memjax import model as model_lib
from memjax.training import step as train_step_lib
from memjax.training import experiment as experiment_lib
import toy_memory  # noqa: F401  (registers the 'every_other' memory kind)
import training_fixtures

NUM_STEPS = 8


def toy_config(corpus, **overrides):
    return training_fixtures.tiny_config(corpus, model__memory='every_other', train__num_steps=NUM_STEPS,
                                         **overrides)


def test_a_phase_change_inside_a_dispatch_is_refused(corpus):
    config = toy_config(corpus, train__segments_per_step=4, train__log_every=4, train__eval_every=4)
    with pytest.raises(config_lib.ConfigError, match=r"phase at steps \[2\]: config.train.segments_per_step=4"):
        config_lib.validate_config(config)
    config_lib.validate_config(toy_config(corpus))  # segments_per_step=2 divides the start.


def test_toy_kind_trains_evaluates_and_resumes_exactly(corpus, tmp_path):
    """Both phases (skips start at step 2), validation and a resume at step 4 of 8 (dropout on:
    the random streams are part of what must resume)."""
    config = toy_config(corpus)
    training_fixtures.assert_resumes_exactly(config, tmp_path)


@pytest.fixture(scope='module')
def experiment(corpus, tmp_path_factory):
    exp = experiment_lib.setup(toy_config(corpus, model__dropout=0.0), str(tmp_path_factory.mktemp('w')))
    state, memory = experiment_lib.init_state(exp)
    batch = training_fixtures.random_batch(exp, seed=4)
    return exp, state, memory, batch


_STEPS = {}


def one_update(exp, state, memory, batch, chunks, phase=0):
    """One training update, its step compiled once per (chunks, phase) for the whole module."""
    key = (id(exp), chunks, phase)
    if key not in _STEPS:
        _STEPS[key] = training_fixtures.jit_train_step(model_lib.build_model(exp.mcfg, phase), exp, chunks)
    return _STEPS[key](state, memory, batch)


def test_auxiliary_loss_is_weighted_reported_and_exact_under_accumulation(experiment):
    exp, state, memory, batch = experiment
    one, _, one_metrics = one_update(exp, state, memory, batch, chunks=1)
    two, _, two_metrics = one_update(exp, state, memory, batch, chunks=2)
    aux = train_step_lib.AUX_PREFIX + 'square'
    np.testing.assert_allclose(two_metrics[aux], one_metrics[aux], rtol=1e-5)
    model = model_lib.build_model(exp.mcfg)
    segment = {k: v[0] for k, v in batch.items()}
    rngs = {name: jax.random.PRNGKey(0) for name in model.kind.streams}

    def naive_loss(params):  # (NLL + weight x aux) per scored token, straight from the model.
        out, _ = model.apply({'params': params}, segment['inputs'], memory, targets=segment['targets'],
                             reset=segment['reset'], deterministic=False, rngs=rngs)
        nll = -jnp.sum(jnp.where(segment['mask'] > 0, out.target_logprobs, 0.0))
        return (nll + toy_memory.SQUARE_WEIGHT * out.losses['square']) / jnp.sum(segment['mask'])

    @jax.jit
    def naive_update(params, opt_state):
        updates, _ = exp.tx.update(jax.grad(naive_loss)(params), opt_state, params)
        return jax.tree.map(jnp.add, params, updates)

    for a, b, c in zip(jax.tree.leaves(one.params), jax.tree.leaves(two.params),
                       jax.tree.leaves(naive_update(state.params, state.opt_state))):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(b, c, rtol=1e-5, atol=1e-6)
    # The reported sum is the naive one: every layer's input, squared, over all rows and
    # positions. Skipping layers l.. leaves the input of layer l as the output.
    hidden = jax.jit(lambda skip: model.apply({'params': state.params}, segment['inputs'], memory,
                                              reset=segment['reset'], rngs=rngs, skip=skip)[0].hidden)
    inputs = [hidden(np.arange(2) >= layer) for layer in range(2)]
    naive = sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in inputs) / exp.mcfg.d_model
    assert float(one_metrics[aux][0]) == pytest.approx(naive, rel=1e-5)


def chunk_rows(values, chunk, chunks=2):
    """The batch rows of accumulation chunk `chunk` (the split is strided)."""
    return np.asarray(values)[..., chunk::chunks]


def test_streams_differ_per_layer_and_are_shared_between_chunks_as_declared(experiment):
    exp, state, memory, batch = experiment
    _, new_memory, _ = one_update(exp, state, memory, batch, chunks=2)
    same, own = new_memory.layers['same_in_chunks'], new_memory.layers['own']  # [n_layer, B]
    for draws in (same, own):
        assert len(set(np.asarray(draws[:, 0]).tolist())) == exp.mcfg.n_layer  # One per layer.
    np.testing.assert_array_equal(chunk_rows(same, 0), chunk_rows(same, 1))
    assert not np.any(chunk_rows(own, 0) == chunk_rows(own, 1))
    # A step's draws differ from the next step's.
    _, later_memory, _ = one_update(exp, state.replace(step=state.step + 1), memory, batch, chunks=2)
    assert not np.any(np.asarray(later_memory.layers['same_in_chunks']) == np.asarray(same))


def test_skip_decisions_are_the_same_in_every_chunk_and_keep_the_layer_state(experiment):
    """Phase 1 draws a skip per layer and step; a skipped layer's state stays as it was, in
    every chunk of that step, and both outcomes occur over a few steps."""
    exp, state, memory, batch = experiment
    outcomes = set()
    for step in range(6):
        _, new_memory, _ = one_update(exp, state.replace(step=jnp.int32(step)), memory, batch,
                                      chunks=2, phase=exp.model.kind.phase(toy_memory.SKIP_FROM_STEP))
        for layer in range(exp.mcfg.n_layer):
            kept = [np.array_equal(chunk_rows(new_memory.layers['hidden'][layer].transpose(1, 2, 0), c),
                                   chunk_rows(memory.layers['hidden'][layer].transpose(1, 2, 0), c))
                    for c in range(2)]
            assert kept[0] == kept[1], (step, layer)
            outcomes.add(kept[0])
    assert outcomes == {True, False}


def test_a_skipped_layer_is_a_conditional_branch_that_leaves_the_layer_out(experiment):
    exp, state, memory, batch = experiment
    model = model_lib.build_model(exp.mcfg)
    segment = {k: v[0] for k, v in batch.items()}
    rngs = {name: jax.random.PRNGKey(0) for name in model.kind.streams}

    def forward(params, skip):
        return model.apply({'params': params}, segment['inputs'], memory, rngs=rngs, skip=skip)

    hlo = jax.jit(forward).lower(state.params, jnp.zeros(2, bool)).compile().as_text()
    assert hlo.count('conditional(') >= exp.mcfg.n_layer
    out, new_memory = jax.jit(forward)(state.params, jnp.ones(2, bool))
    embeddings = model.apply({'params': state.params}, segment['inputs'], method=lambda m, x: m.io.embed(x))
    np.testing.assert_allclose(out.hidden, embeddings, atol=1e-6)
    for layer in range(exp.mcfg.n_layer):
        np.testing.assert_array_equal(new_memory.layers['hidden'][layer], memory.layers['hidden'][layer])
