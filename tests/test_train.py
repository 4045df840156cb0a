"""Training: schedule, gradient accumulation, NaN detection, and learning on real text."""

import json
import logging
import math
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax.training import checkpoints as checkpointing
from memjax import config_lib
from memjax import errors
from memjax import model as model_lib
from memjax.training import optim
from memjax.training import step as train_step_lib
from memjax.training import loop as trainer
from memjax.training import experiment
from memjax.training import run_files
from memjax.training import progress
from memjax.training import metrics as metrics_lib
from memjax.training import run_lock
from memjax.data import embedded_corpus
import training_fixtures


def test_schedule_matches_hand_formula():
    config = training_fixtures.tiny_config('unused', train__num_steps=20, train__warmup_steps=5,
                                           train__learning_rate=1e-3, train__min_lr_ratio=0.1)
    schedule = optim.learning_rate_schedule(config.train)
    for step in range(0, 21):
        if step < 5:
            expected = 1e-3 * (step + 1) / 5
        else:
            progress = (step - 5) / 15
            expected = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-6), step
    assert float(schedule(20)) == pytest.approx(1e-4, rel=1e-6)  # Ends at min_lr_ratio * lr.


def test_linear_decay_is_the_hf_trainers_default_schedule():
    """transformers' get_linear_schedule_with_warmup: lr * (T - s) / (T - W) after W warmup updates
    (floor 0), which the infinity-former's GPT-2 runs use."""
    config = training_fixtures.tiny_config('unused', train__num_steps=20, train__warmup_steps=5,
                                           train__learning_rate=1e-3, train__decay='linear')
    schedule = optim.learning_rate_schedule(config.train)
    for step in range(5, 21):
        assert float(schedule(step)) == pytest.approx(1e-3 * (20 - step) / 15, rel=1e-6, abs=1e-12), step


def test_first_adam_update_moves_each_weight_by_the_learning_rate():
    """Adam's first step is lr * g / (|g| + eps): the schedule and the chain are wired in."""
    config = training_fixtures.tiny_config('unused', train__warmup_steps=4,
                                           train__learning_rate=1e-2, train__clip_norm=0.0)
    tx = optim.make_optimizer(config.train)
    params = {'w': jnp.array([1.0, -2.0, 3.0])}
    grads = {'w': jnp.array([0.5, -4.0, 1e-3])}
    updates, _ = tx.update(grads, tx.init(params), params)
    lr0 = 1e-2 / 4
    expected = -lr0 * np.asarray(grads['w']) / (np.abs(np.asarray(grads['w'])) + 1e-8)
    np.testing.assert_allclose(np.asarray(updates['w']), expected, rtol=1e-5)


def test_memory_parameters_take_the_memory_learning_rate_on_the_same_schedule():
    """The infinity-former's fine-tuning: GPT-2 at learning_rate, the LTM (every 'memory' module)
    at memory_learning_rate, both warmed up alike; Adam's first step moves each by its rate."""
    config = training_fixtures.tiny_config('unused', train__warmup_steps=4, train__learning_rate=1e-3,
                                           train__memory_learning_rate=2e-2, train__clip_norm=0.0)
    params = {'layer_0': {'attention': {'w': jnp.ones(3)}, 'memory': {'gate': {'w': jnp.ones(3)}}},
              'io': {'b': jnp.ones(2)}}
    grads = jax.tree.map(lambda p: -jnp.ones_like(p), params)
    tx = optim.make_optimizer(config.train)
    updates, _ = tx.update(grads, tx.init(params), params)
    moved = {jax.tree_util.keystr(path): np.asarray(u) for path, u in jax.tree_util.tree_leaves_with_path(updates)}
    expected = {"['io']['b']": 1e-3 / 4, "['layer_0']['attention']['w']": 1e-3 / 4,
                "['layer_0']['memory']['gate']['w']": 2e-2 / 4}
    assert moved.keys() == expected.keys()
    for name, step in expected.items():
        np.testing.assert_allclose(moved[name], step, rtol=1e-5, err_msg=name)


def test_weight_decay_reaches_the_matrices_alone_in_either_layer_layout():
    """With zero gradients an update is the decay alone: it moves every matrix (embedding, kernels)
    and no bias, LayerNorm scale or u / v bias, with the layers stored apart or scanned."""
    decayed = {}
    for scan in (False, True):
        config = training_fixtures.tiny_config('unused', model__scan_layers=scan, model__memory='lamemo',
                                               train__weight_decay=0.1, train__clip_norm=0.0)
        run = config_lib.resolve(config, 1, 1).with_vocab_size(256)
        params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), model_lib.abstract_params(run.model))
        tx = optim.make_optimizer(run.train)
        updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
        moved, expected = {}, {}
        for path, u in jax.tree_util.tree_leaves_with_path(updates):
            name = jax.tree_util.keystr(path)
            if 'layer_1' in name:
                continue
            name = name.replace("['layers']", "['layer_0']")
            moved[name] = bool(np.abs(u).max() > 0)
            # A matrix: two axes of its own (a scanned stack's leading one is the layers'), not a bias.
            own_axes = u.ndim - (scan and "['layer_0']" in name)
            expected[name] = own_axes > 1 and not re.search(r"(bias|scale)[^\]]*\]$", name)
        assert moved == expected, sorted(p for p in moved if moved[p] != expected[p])
        decayed[scan] = moved
    assert decayed[False] == decayed[True] and any(decayed[True].values()) and not all(decayed[True].values())


def test_a_non_finite_or_diverged_validation_loss_stops_the_run_before_its_step_is_saved():
    """A NaN validation loss (the evaluation model failing where training did not) would otherwise be
    saved as the best, and rank above every later one (nothing is below NaN)."""
    exp = types.SimpleNamespace(run=types.SimpleNamespace(train=config_lib.TrainConfig(diverged_loss=10.0)))
    for loss in (float('nan'), float('inf')):
        with pytest.raises(errors.NonFiniteLossError, match=rf'non-finite validation loss \({loss}\) at step 12, .*'
                                                            r'last checkpoint is /w/checkpoints/8: evaluate it or resume'):
            trainer._keep_best(exp, None, 12, loss, None, '/w/checkpoints/8')
    with pytest.raises(errors.DivergedError, match='validation loss 11 at step 12 exceeds'):
        trainer._keep_best(exp, None, 12, 11.0, 3.0, '/w/checkpoints/8')
    trainer._check_validation(exp, 12, 9.0, None)  # Finite, below the limit.


@pytest.fixture(scope='module')
def tiny_experiment(corpus, tmp_path_factory):
    config = training_fixtures.tiny_config(corpus, model__dropout=0.0)
    exp = experiment.setup(config, str(tmp_path_factory.mktemp('workdir')))
    state, memory = experiment.init_state(exp)
    return exp, state, memory


@pytest.fixture(scope='module')
def naive_update(tiny_experiment):
    """One full-batch update computed directly from the model, without the train step."""
    exp, state, memory = tiny_experiment
    # A memory that already holds something, so every chunk must get its own rows of it.
    warm = training_fixtures.random_batch(exp, seed=1)
    apply = jax.jit(exp.model.apply, static_argnames='deterministic')
    _, memory = apply({'params': state.params}, warm['inputs'][0], memory,
                      targets=warm['targets'][0], reset=warm['reset'][0])
    batch = training_fixtures.random_batch(exp, seed=2)

    def loss_fn(params):
        out, new_memory = exp.model.apply(
            {'params': params}, batch['inputs'][0], memory, targets=batch['targets'][0],
            reset=batch['reset'][0], deterministic=False, rngs={'dropout': jax.random.PRNGKey(0)})
        return model_lib.lm_loss(out.target_logprobs, batch['mask'][0]), new_memory

    @jax.jit  # One program: op by op, the optimizer's update compiles each operation per shape.
    def update(params, opt_state):
        (loss, new_memory), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, _ = exp.tx.update(grads, opt_state, params)
        grad_norm = jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree_util.tree_leaves(grads)))
        return loss, grad_norm, jax.tree_util.tree_map(jnp.add, params, updates), new_memory

    loss, grad_norm, params, new_memory = update(state.params, state.opt_state)
    return memory, batch, float(loss), float(grad_norm), params, new_memory


@pytest.mark.parametrize('chunks', [1, 2, 4])
def test_gradient_accumulation_equals_one_full_batch_update(tiny_experiment, naive_update,
                                                            chunks):
    exp, state, _ = tiny_experiment
    memory, batch, loss, grad_norm, naive_params, naive_memory = naive_update
    step = training_fixtures.jit_train_step(exp.model, exp, chunks)
    new_state, new_memory, metrics = step(state, memory, batch)
    assert int(new_state.step) == 1
    mean_nll = float(metrics['nll_sum'][0] / metrics['num_tokens'][0])
    assert mean_nll == pytest.approx(loss, rel=1e-5)
    assert float(metrics['grad_norm'][0]) == pytest.approx(grad_norm, rel=1e-4)
    for got, want in zip(jax.tree_util.tree_leaves(new_state.params),
                         jax.tree_util.tree_leaves(naive_params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    for got, want in zip(jax.tree_util.tree_leaves(new_memory),
                         jax.tree_util.tree_leaves(naive_memory)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_parameters_and_optimizer_state_stay_float32_under_bf16(corpus, tmp_path):
    config = training_fixtures.tiny_config(corpus, model__compute_dtype='bfloat16')
    exp = experiment.setup(config, str(tmp_path))
    state, memory = experiment.init_state(exp)
    step = training_fixtures.jit_train_step(exp.model, exp, 2)
    state, _, metrics = step(state, memory, training_fixtures.random_batch(exp, seed=3))
    assert np.isfinite(np.asarray(metrics['nll_sum'])).all()
    floats = [leaf.dtype for leaf in jax.tree_util.tree_leaves((state.params, state.opt_state))
              if jnp.issubdtype(leaf.dtype, jnp.floating)]
    assert floats and all(dtype == jnp.float32 for dtype in floats)


def test_non_finite_loss_stops_with_step_and_keeps_last_good_checkpoint(corpus, tmp_path):
    workdir = str(tmp_path)
    good = training_fixtures.tiny_config(corpus, train__num_steps=4, train__eval_every=0)
    trainer.train_and_evaluate(good, workdir)
    # Resume with an absurd learning rate: the parameters blow up within a few updates.
    bad = training_fixtures.tiny_config(corpus, train__learning_rate=1e30, train__eval_every=0)
    with pytest.raises(errors.NonFiniteLossError) as error:
        trainer.train_and_evaluate(bad, workdir)
    message = str(error.value)
    step = int(re.search(r'at step (\d+)', message).group(1))
    assert 5 <= step <= 8
    assert os.path.join(run_files.checkpoint_dir(workdir), '4') in message
    ckpt = checkpointing.Checkpointer(run_files.checkpoint_dir(workdir), keep=3, read_only=True)
    assert ckpt.all_steps() == [4]


def unigram_entropy_bits(data: bytes) -> float:
    counts = np.bincount(np.frombuffer(data, np.uint8), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def test_short_training_beats_unigram_entropy_of_embedded_corpus(tmp_path):
    """A few hundred updates of a small byte model learn more than byte frequencies."""
    config = training_fixtures.tiny_config('unused')
    config.data.update(name='embedded', text_path='', data_dir=str(tmp_path / 'tfds'))
    config.model.update(d_model=64, n_layer=2, n_head=4, d_head=16, d_inner=256, mem_len=32,
                        dropout=0.0)
    config.train.update(batch_size=8, tgt_len=32, segments_per_step=20, num_steps=300,
                        learning_rate=2e-3, warmup_steps=20, clip_norm=1.0, log_every=100,
                        eval_every=0, checkpoint_every=0)
    config.eval.update(batch_size=64, tgt_len=128)
    summary = trainer.train_and_evaluate(config, str(tmp_path / 'run'))
    entropy = unigram_entropy_bits(embedded_corpus.read_split_text('validation').encode('utf-8'))
    assert 4.0 < entropy < 6.5  # Sanity: source code bytes.
    assert summary['valid_bpc'] < entropy - 1.0, (summary, entropy)


def test_more_training_steps_compile_nothing_more(corpus, tmp_path):
    # A step that recompiles (a changing shape, dtype or Python value reaching jit) would make the
    # number of XLA compilations grow with the number of steps.
    compiles = []

    def on_duration(event, duration_secs, **kwargs):
        if event == '/jax/core/compile/backend_compile_duration':
            compiles.append(duration_secs)

    counts = []
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        for steps in (2, 6):
            jax.clear_caches()  # Both runs compile from scratch.
            compiles.clear()
            config = training_fixtures.tiny_config(corpus, train__num_steps=steps, train__eval_every=2,
                                                   train__checkpoint_every=2)
            trainer.train_and_evaluate(config, str(tmp_path / f'run_{steps}'))
            counts.append(len(compiles))
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
    assert counts[0] > 0 and counts[1] == counts[0], counts


def test_non_finite_loss_from_out_of_range_ids_names_them():
    values = {'nll_sum': np.array([3.0, np.nan]), 'grad_norm': np.array([1.0, np.nan]),
              'learning_rate': np.array([1e-3, 1e-3]), 'out_of_range_ids': np.array([0, 5]),
              'num_tokens': np.array([8.0, 8.0])}
    with pytest.raises(errors.NonFiniteLossError, match=r'step 12: its batch holds 5 token ids '
                       r'outside \[0, config.model.vocab_size\)'):
        progress.Interval(10).check_healthy(values, '/run/checkpoints/10', 100.0)
    values['out_of_range_ids'] = np.array([0, 0])
    with pytest.raises(errors.NonFiniteLossError, match='Lower config.train.learning_rate'):
        progress.Interval(10).check_healthy(values, '/run/checkpoints/10', 100.0)


def test_a_finite_loss_above_the_divergence_limit_stops_the_interval_at_its_step():
    values = {'nll_sum': np.array([16.0, 80.0, 8e7]), 'grad_norm': np.ones(3), 'num_tokens': np.full(3, 8.0),
              'learning_rate': np.full(3, 1e3), 'out_of_range_ids': np.zeros(3)}
    progress.Interval(10).check_healthy(values, None, 1e7 + 1)  # Per token: 2, 10, 1e7.
    with pytest.raises(errors.DivergedError, match=r'training loss 1e\+07 at step 13 exceeds .*diverged_loss '
                       r'\(16\.64 nats.*last good checkpoint is /run/checkpoints/10'):
        progress.Interval(10).check_healthy(values, '/run/checkpoints/10',
                                            config_lib.TrainConfig().diverged_limit(256))
    off = config_lib.TrainConfig(diverged_loss=0.0)
    progress.Interval(10).check_healthy(values, None, off.diverged_limit(256))


def test_a_bad_update_after_the_compiling_dispatch_is_named_by_its_own_step():
    """The first interval holds the compiling dispatch's updates (here steps 1-2) as well as the later
    ones; its speed counts from after them, but its updates are numbered from its start."""
    train = config_lib.TrainConfig(segments_per_step=2, diverged_loss=100.0)
    report = progress.Progress(types.SimpleNamespace(run=types.SimpleNamespace(train=train)), None, 0)
    update = lambda nll: {'nll_sum': np.array(nll), 'grad_norm': np.ones(2), 'num_tokens': np.full(2, 8.0),
                          'learning_rate': np.full(2, 1e-3), 'out_of_range_ids': np.zeros(2)}
    report.before_update(True, np.zeros(1))
    report.after_update(update([16.0, 16.0]), 2, compiles=True)
    report.after_update(update([16.0, np.nan]), 4, compiles=False)
    with pytest.raises(errors.NonFiniteLossError, match='non-finite loss or gradient at step 4 '):
        report.report(4, None)


def test_saves_are_kept_out_of_the_runs_throughput(corpus, tmp_path, monkeypatch):
    """Each save here takes 1,000 s by the run's clock: train_tokens_per_s counts the updates' time
    alone (the tiny run's updates take seconds, so 1,000 s more would drag it below tokens / 1,000)."""
    clock = {'offset': 0.0}
    real = progress.time.time
    monkeypatch.setattr(progress, 'time', types.SimpleNamespace(time=lambda: real() + clock['offset']))
    save = checkpointing.Checkpointer.save

    def slow_save(*args, **kwargs):
        clock['offset'] += 1000.0
        return save(*args, **kwargs)

    monkeypatch.setattr(checkpointing.Checkpointer, 'save', slow_save)
    config = training_fixtures.tiny_config(corpus, train__num_steps=6, train__checkpoint_every=2, train__eval_every=0)
    summary = trainer.train_and_evaluate(config, str(tmp_path))
    assert clock['offset'] == 3000.0
    tokens = (config.train.num_steps - config.train.segments_per_step) * config.train.batch_size * config.train.tgt_len
    assert summary['train_tokens_per_s'] > tokens / 1000.0


def test_train_step_counts_out_of_range_ids_of_inputs_and_scored_targets():
    segment = {'inputs': np.array([[0, 5, 9], [3, -1, 2]]),
               'targets': np.array([[5, 9, 10], [11, 2, 2]]),
               'mask': np.array([[1, 1, 1], [0, 1, 1]], np.float32)}
    # Inputs: -1. Targets: 10 (scored), 11 is padding (mask 0) and does not count.
    assert int(train_step_lib.out_of_range_ids(segment, vocab_size=10)) == 2


def test_second_training_run_on_a_workdir_is_refused(corpus, tmp_path):
    with run_lock.RunLock(str(tmp_path)):
        with pytest.raises(errors.WorkdirError, match='in use by another training run'):
            trainer.train_and_evaluate(training_fixtures.tiny_config(corpus), str(tmp_path))


def test_speeds_and_the_eta_leave_the_compiling_dispatch_out(corpus, tmp_path, caplog):
    """The first report covers only the compiling dispatch: no speed, no ETA ("8 tok/s, eta 107h"
    said nothing); the next ones are timed from its end."""
    config = training_fixtures.tiny_config(corpus, train__num_steps=8, train__log_every=2, train__eval_every=0,
                                           train__checkpoint_every=0)
    with caplog.at_level(logging.INFO):
        trainer.train_and_evaluate(config, str(tmp_path))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith('step ')]
    assert lines[0].startswith('step 2/8') and '| ? tok/s |' in lines[0] and lines[0].endswith('eta ?')
    assert all('| ? tok/s |' not in line and not line.endswith('eta ?') for line in lines[1:]), lines
    scalars = metrics_lib.read_scalars(str(tmp_path))['train/tokens_per_s']
    assert 2 not in scalars and sorted(scalars) == [4, 6, 8]
    assert any(re.search(r'[\d,]+ parameters; \d+ CPU device', r.getMessage()) for r in caplog.records)
    # Where the run's outputs go, and the mesh the devices form.
    outputs = next(r.getMessage() for r in caplog.records if r.getMessage().startswith('Mesh '))
    assert outputs.startswith(f'Mesh data {jax.device_count()} x fsdp 1 x tensor 1;') and outputs.endswith(
        f'validation at the end, checkpoints at the end in {tmp_path}/checkpoints, TensorBoard in {tmp_path}/tensorboard.')


_WRITE_SCALARS = '''
import json, sys
from memjax.training import metrics
writer = metrics.MetricWriter(sys.argv[1])
writer.write_scalars(3, 'train', {'loss': 1.5})
writer.close()
print(json.dumps({'torch': 'torch' in sys.modules, 'scalars': metrics.read_scalars(sys.argv[1])}))
'''


def test_tensorboard_scalars_are_written_without_importing_torch(tmp_path):
    """tensorboardX imports torch where it is installed (the parity extra): seconds of every run's
    start-up for nothing, since memjax writes floats. In a fresh process, as a run's."""
    out = subprocess.run([sys.executable, '-c', _WRITE_SCALARS, str(tmp_path)], capture_output=True,
                         text=True, check=True, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
    written = json.loads(out.stdout.splitlines()[-1])
    assert written == {'torch': False, 'scalars': {'train/loss': {'3': 1.5}}}
