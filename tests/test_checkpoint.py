"""Checkpoints: exact resume, fallback past damage, what a changed config may do to a run."""

import contextlib
import logging
import os
import shutil
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax.training import checkpoints as checkpointing
from memjax import errors
from memjax.data import tokenizers
from memjax import evaluate
from memjax import model as model_lib
from memjax.training import loop as trainer
from memjax.training import experiment
from memjax.training import run_files
from memjax.training import restore
from memjax.runtime import logs
import disks
import training_fixtures

# Checkpoints at steps 4 and 8; losses logged every 2 updates (one dispatch of S=2).
NUM_STEPS = 8


@pytest.fixture(scope='module')
def config(corpus):
    return training_fixtures.tiny_config(corpus, train__num_steps=NUM_STEPS)


@pytest.fixture(scope='module')
def baseline(config, tmp_path_factory):
    """An uninterrupted run (dropout on, so the PRNG stream is part of what must resume)."""
    workdir = str(tmp_path_factory.mktemp('baseline'))
    recorded, summary = training_fixtures.run_recording(config, workdir)
    return workdir, recorded, summary


def test_resume_after_interruption_is_exact(config, baseline, tmp_path):
    _, baseline_recorded, baseline_summary = baseline
    workdir = str(tmp_path)
    first, summary = training_fixtures.run_recording(config, workdir, interrupt_at_step=4)
    assert summary is None and ('train', 6) not in first
    assert first[('train', 4)] == baseline_recorded[('train', 4)]
    recorded, summary = training_fixtures.run_recording(config, workdir)
    assert min(step for _, step in recorded) == 6  # Resumed at 4, not from scratch.
    training_fixtures.assert_same_run(recorded, summary, baseline_recorded, baseline_summary, steps=(6, 8))


def truncate_array_files(step_dir):
    for root, _, files in os.walk(os.path.join(step_dir, 'arrays')):
        for name in files:
            path = os.path.join(root, name)
            if os.path.getsize(path) > 64:
                with open(path, 'r+b') as f:
                    f.truncate(os.path.getsize(path) // 2)


def flip_byte_in_largest_array_file(step_dir):
    paths = [os.path.join(root, name)
             for root, _, files in os.walk(os.path.join(step_dir, 'arrays')) for name in files]
    path = max(paths, key=os.path.getsize)
    data = bytearray(open(path, 'rb').read())
    data[len(data) // 2] ^= 0x5A
    with open(path, 'wb') as f:
        f.write(bytes(data))


def truncate_metadata(step_dir):
    path = os.path.join(step_dir, 'meta', 'metadata')
    with open(path, 'r+b') as f:
        f.truncate(5)


@pytest.mark.parametrize('damage', [truncate_array_files, flip_byte_in_largest_array_file,
                                    truncate_metadata])
def test_damaged_newest_checkpoint_falls_back_to_previous(config, baseline, tmp_path, caplog,
                                                          damage):
    workdir = str(tmp_path / 'run')
    shutil.copytree(baseline[0], workdir)
    directory = run_files.checkpoint_dir(workdir)
    exp = experiment.setup(config, workdir)
    abstract = experiment.abstract_state(exp)
    ckpt = checkpointing.Checkpointer(directory, keep=3, read_only=True)
    assert ckpt.all_steps() == [4, 8]
    intact = ckpt.restore_latest(*abstract)
    damage(os.path.join(directory, '8'))

    with caplog.at_level(logging.WARNING):
        restored = ckpt.restore_latest(*abstract)
    assert restored.step == 4 and int(restored.state.step) == 4
    assert any(os.path.join(directory, '8') in record.getMessage() for record in caplog.records)
    assert restored.data_state != intact.data_state  # The step-4 iterator position, not step 8's.
    ckpt.close()


def test_training_resumes_from_previous_checkpoint_when_newest_is_damaged(config, baseline,
                                                                           tmp_path):
    baseline_workdir, baseline_recorded, baseline_summary = baseline
    workdir = str(tmp_path / 'run')
    shutil.copytree(baseline_workdir, workdir)
    truncate_array_files(os.path.join(run_files.checkpoint_dir(workdir), '8'))
    recorded, summary = training_fixtures.run_recording(config, workdir)
    # Redoes steps 5-8 from checkpoint 4 and ends exactly where the undamaged run ended.
    assert min(step for _, step in recorded) == 6
    training_fixtures.assert_same_run(recorded, summary, baseline_recorded, baseline_summary, steps=(6, 8))
    assert os.path.isdir(run_files.checkpoint_dir(workdir) + '_damaged/8')
    ckpt = checkpointing.Checkpointer(run_files.checkpoint_dir(workdir), keep=3, read_only=True)
    restored = ckpt.restore_latest(*experiment.abstract_state(experiment.setup(config, workdir)))
    assert restored.step == 8


def test_parameters_read_alone_are_checked_against_their_saved_checksums(config, baseline, tmp_path, caplog):
    """Evaluation and generation (restore.newest_params) and init_from read the parameters without
    the rest of the state, which the whole checkpoint's fingerprint needs: each array read is
    checked against the checksums saved with it. A damaged newest step is told and the previous one
    read; init_from naming it stops in one line that names an earlier step."""
    workdir = str(tmp_path / 'run')
    shutil.copytree(baseline[0], workdir)
    directory = run_files.checkpoint_dir(workdir)
    exp = experiment.setup(config, workdir, training=False)
    ckpt = checkpointing.Checkpointer(directory, keep=3, read_only=True)
    step_4 = ckpt.restore_step(4, *experiment.abstract_state(exp)).state.params
    ckpt.close()
    assert restore.newest_params(exp, workdir)[0] == 8
    # Arrays that read back whole but are not those saved with step 8's record: step 4's.
    shutil.rmtree(os.path.join(directory, '8', 'arrays'))
    shutil.copytree(os.path.join(directory, '4', 'arrays'), os.path.join(directory, '8', 'arrays'))
    with caplog.at_level(logging.WARNING):
        step, params = restore.newest_params(exp, workdir)
    assert step == 4 and all(np.array_equal(a, b) for a, b in zip(
        jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(step_4)))
    assert 'checkpoints/8 is damaged:' in caplog.text and 'differ from the checksums saved with them' in caplog.text
    new = training_fixtures.tiny_config(config.data.text_path, train__init_from=os.path.join(directory, '8'))
    with pytest.raises(errors.CheckpointError, match=r'init_from=\S+/8: \S+/8 is damaged: .* differ from the '
                                                     r'checksums saved with them\. Name an earlier step.s folder, '
                                                     r'e\.g\. \S+/checkpoints/4\.$'):
        restore.init_from(experiment.setup(new, str(tmp_path / 'new')))
    truncate_metadata(os.path.join(directory, '8'))  # Its record of the run does not read either.
    with pytest.raises(errors.CheckpointError, match=r'init_from=\S+/8: \S+/8 does not read \(\w+Error: .*\)\. '
                                                     r'Name an earlier step.s folder, e\.g\. \S+/checkpoints/4\.$'):
        restore.init_from(experiment.setup(new, str(tmp_path / 'newer')))


def test_fingerprint_sees_every_byte():
    tree = {'a': np.arange(6, dtype=np.float32), 'b': np.zeros((2, 2), np.int32)}
    changed = {'a': tree['a'].copy(), 'b': tree['b']}
    changed['a'][3] = np.nextafter(np.float32(3), np.float32(4))
    reshaped = {'a': tree['a'].reshape(2, 3), 'b': tree['b']}
    assert checkpointing.fingerprint(tree) == checkpointing.fingerprint(
        {k: v.copy() for k, v in tree.items()})
    assert checkpointing.fingerprint(tree) != checkpointing.fingerprint(changed)
    assert checkpointing.fingerprint(tree) != checkpointing.fingerprint(reshaped)


def test_checksums_are_each_leafs_position_weighted_sums_of_its_bits():
    """The sums a fingerprint hashes, from NumPy: small leaves are summed together (padded rows of
    one matrix) and large ones alone, and either way each leaf's two sums are its own, so the
    fingerprints of checkpoints already written still match."""
    big = checkpointing._SHARED_CHECKSUM_MAX_SIZE  # pylint: disable=protected-access
    rng = np.random.default_rng(0)
    leaves = [rng.standard_normal(n).astype(np.float32) for n in (0, 1, 3, 4, 5, 7, big, big + 1)]
    leaves += [rng.standard_normal((3, 5)).astype(jnp.bfloat16), rng.integers(-128, 128, 9).astype(np.int8),
               rng.integers(0, 2, 6).astype(bool), rng.integers(0, 2**16, 11).astype(np.uint16)]
    key = jax.random.key(5)  # A typed key: its two words are summed.

    def naive(x):
        x = x.astype(np.uint8) if x.dtype == bool else x
        bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).reshape(-1).astype(np.uint64)
        index = np.arange(bits.size, dtype=np.uint64)
        weight_a = (index * 0x9E3779B1 % 2**32) | 1
        weight_b = ((index + 0x5BD1E995) % 2**32 * 0x85EBCA77 % 2**32) | 1
        return [int((bits * weight_a % 2**32).sum() % 2**32), int((bits * weight_b % 2**32).sum() % 2**32)]

    got = jax.device_get(checkpointing._checksums([*map(jnp.asarray, leaves), key]))  # pylint: disable=protected-access
    want = [naive(x) for x in leaves] + [naive(np.asarray(jax.random.key_data(key)))]
    assert [list(map(int, sums)) for sums in got] == want


def tiny_tree(value):
    return {'w': np.full((2, 3), value, np.float32)}, {'m': np.zeros((2, 0), np.float32)}


def abstract_of(tree):
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def test_best_validated_checkpoint_outlives_keep_last_n(tmp_path):
    ckpt = checkpointing.Checkpointer(str(tmp_path), keep=2)
    losses = {2: 3.0, 4: 5.0, 6: 7.0}  # A run that validates at 2, 4, 6 and then diverges.
    for step in range(1, 8):
        state, memory = tiny_tree(step)
        ckpt.save(step, state, memory, {'pos': step}, {'seed': 0}, losses.get(step))
        ckpt.wait()
    assert ckpt.all_steps() == [2, 6, 7]  # The newest two and the best.
    assert ckpt.best() == (2, 3.0)
    ckpt.close()
    ckpt = checkpointing.Checkpointer(str(tmp_path), keep=2)  # A resumed run's manager.
    for step in (8, 9):
        ckpt.save(step, *tiny_tree(step), {'pos': step}, {'seed': 0})
        ckpt.wait()
    assert ckpt.all_steps() == [2, 8, 9]
    restored = ckpt.restore_latest(*map(abstract_of, tiny_tree(0)))
    assert restored.step == 9 and float(restored.state['w'][0, 0]) == 9.0
    assert restored.memory['m'].shape == (2, 0)  # Zero-size arrays round-trip (mem_len = 0).
    ckpt.close()


def test_xl_memory_saved_before_memory_kinds_is_read_into_the_per_layer_layout(tmp_path):
    """Checkpoints written before memory kinds hold memory.hidden and memory.valid."""
    state = {'w': np.ones((2, 3), np.float32)}
    hidden = np.arange(2 * 4 * 3 * 5, dtype=np.float32).reshape(2, 4, 3, 5)
    valid = np.array([[True, False, True]] * 4)
    ckpt = checkpointing.Checkpointer(str(tmp_path), keep=2)
    ckpt.save(1, state, {'hidden': hidden, 'valid': valid}, {'pos': 1}, {'seed': 0})
    ckpt.wait()
    memory = model_lib.MemoryState(layers={'hidden': hidden}, shared={'valid': valid})
    restored = ckpt.restore_step(1, abstract_of(state), abstract_of(memory))
    np.testing.assert_array_equal(restored.memory.layers['hidden'], hidden)
    np.testing.assert_array_equal(restored.memory.shared['valid'], valid)
    ckpt.close()


def test_quarantine_never_overwrites_an_earlier_damaged_copy(tmp_path):
    directory = str(tmp_path / 'checkpoints')
    abstract = list(map(abstract_of, tiny_tree(0)))
    for _ in range(2):
        ckpt = checkpointing.Checkpointer(directory, keep=3)
        for step in (1, 2):
            if step not in ckpt.all_steps():
                ckpt.save(step, *tiny_tree(step), {}, {})
                ckpt.wait()
        flip_byte_in_largest_array_file(os.path.join(directory, '2'))
        assert ckpt.restore_latest(*abstract, quarantine=True).step == 1
        ckpt.close()
    assert sorted(os.listdir(directory + '_damaged')) == ['2', '2.1']
    for name in ('2', '2.1'):
        assert os.path.isdir(os.path.join(directory + '_damaged', name, 'arrays')), name


def test_mismatched_shapes_are_reported_not_quarantined(tmp_path):
    ckpt = checkpointing.Checkpointer(str(tmp_path), keep=3)
    ckpt.save(1, *tiny_tree(1), {}, {})
    ckpt.wait()
    other = ({'w': jax.ShapeDtypeStruct((4, 3), np.float32)}, abstract_of(tiny_tree(0)[1]))
    with pytest.raises(checkpointing.CheckpointMismatchError, match=r'w: float32\[2, 3\] -> float32\[4, 3\]'):
        ckpt.restore_latest(*other, quarantine=True)
    assert ckpt.all_steps() == [1] and not os.path.exists(str(tmp_path) + '_damaged')
    ckpt.close()


def test_a_save_failing_on_a_full_disk_names_the_step_it_would_have_rotated_out(tmp_path):
    """keep=1: the save of step 2 would delete step 1 once written. Orbax stops listing step 1 as
    the save starts; the failure must name it, since it is what the run resumes from."""
    with disks.small_disk(tmp_path / 'disk', 1024) as disk:
        directory = os.path.join(disk, 'checkpoints')
        ckpt = checkpointing.Checkpointer(directory, keep=1)
        big = ({'w': np.ones((64, 1024), np.float32)}, tiny_tree(0)[1])  # 256 KiB: a step does not fit twice.
        ckpt.save(1, *big, {}, {})
        ckpt.wait()
        disks.fill(disk)
        with pytest.raises(errors.CheckpointError, match=rf'saving step 2 .*resume from {directory}/1\.$'):
            try:
                ckpt.save(2, *big, {}, {})
                ckpt.wait()
            finally:
                with contextlib.suppress(Exception):  # Closing raises the writer's failure again.
                    ckpt.close()
        os.remove(os.path.join(disk, 'filler'))
        reader = checkpointing.Checkpointer(directory, keep=1, read_only=True)
        assert reader.restore_latest(*map(abstract_of, big)).step == 1
        reader.close()


def test_a_step_rotated_out_while_an_evaluation_reads_it_is_not_taken_for_damage(tmp_path, caplog):
    """An evaluation of a running training (keep=1) reads step 1 while the training saves step 2 and
    deletes step 1: the reader goes on to step 2, reports no damage and moves nothing aside."""
    directory = str(tmp_path / 'checkpoints')
    training = checkpointing.Checkpointer(directory, keep=1)
    training.save(1, *tiny_tree(1), {}, {})
    training.wait()
    reader = checkpointing.Checkpointer(directory, keep=1, read_only=True)
    abstract = abstract_of(tiny_tree(0)[0])

    def read(step):
        if step == 1:
            training.save(2, *tiny_tree(2), {}, {})
            training.wait()
        return step, reader.restore_part(step, {'state': abstract})['state']['w']

    with caplog.at_level(logging.INFO):
        step, w = reader.latest_intact(read, quarantine=True)
    assert step == 2 and np.all(np.asarray(w) == 2)
    assert reader.damaged == [] and 'damaged' not in caplog.text and 'rotated out' in caplog.text
    assert not os.path.exists(directory + '_damaged')
    reader.close()
    training.close()


@pytest.mark.parametrize('failure', [MemoryError('std::bad_alloc'),
                                     ValueError('UNAVAILABLE: the bucket did not answer in time')],
                         ids=['host_memory', 'network'])
def test_a_read_failing_for_a_passing_reason_moves_no_checkpoint_aside(tmp_path, failure):
    """Running out of host memory or losing the network fails every step alike: the command stops
    in one line that says so, and every step stays where it is for the next try."""
    directory = str(tmp_path / 'checkpoints')
    ckpt = checkpointing.Checkpointer(directory, keep=3)
    for step in (4, 8):
        ckpt.save(step, *tiny_tree(step), {}, {})
        ckpt.wait()
    with mock.patch.object(ckpt._manager, 'restore', side_effect=failure):  # pylint: disable=protected-access
        with pytest.raises(errors.CheckpointError, match=rf'reading {directory}/8 failed \({type(failure).__name__}: '
                           r'.*nothing against the checkpoint: it is left in place\. Free'):
            ckpt.restore_latest(*map(abstract_of, tiny_tree(0)), quarantine=True)
    assert ckpt.all_steps() == [4, 8] and not os.path.exists(directory + '_damaged')
    assert ckpt.restore_latest(*map(abstract_of, tiny_tree(0)), quarantine=True).step == 8
    ckpt.close()


def listing(directory):
    return sorted((os.path.relpath(os.path.join(root, name), directory),
                   os.path.getsize(os.path.join(root, name)))
                  for root, _, files in os.walk(directory) for name in files)


def test_changed_model_or_batch_size_on_resume_stops_before_touching_checkpoints(
        config, baseline, tmp_path):
    workdir = str(tmp_path / 'run')
    shutil.copytree(baseline[0], workdir)
    before = listing(workdir)
    changed = training_fixtures.tiny_config(config.data.text_path, train__num_steps=12,
                                            train__batch_size=8, model__d_model=64)
    with pytest.raises(errors.ConfigError) as error:
        trainer.train_and_evaluate(changed, workdir)
    message = str(error.value)
    assert 'model.d_model 32 -> 64' in message and 'train.batch_size 4 -> 8' in message
    assert f'--config.train.init_from={workdir}' in message
    # Nothing moved, rewritten or deleted; only the run's log records the attempt.
    without_log = lambda files: [f for f in files if f[0] != logs.LOG_FILE]
    assert without_log(listing(workdir)) == without_log(before)
    assert not os.path.exists(run_files.checkpoint_dir(workdir) + '_damaged')
    # The original config (with more steps, a safe change) resumes from step 8.
    recorded, summary = training_fixtures.run_recording(
        training_fixtures.tiny_config(config.data.text_path, train__num_steps=12), workdir)
    assert min(step for _, step in recorded) == 10 and summary['step'] == 12


def test_evaluation_with_another_model_is_refused_before_computing(config, baseline, tmp_path):
    changed = training_fixtures.tiny_config(config.data.text_path, model__n_layer=3,
                                            model__mem_len=16)  # mem_len alone would be fine.
    with pytest.raises(errors.ConfigError, match=r'model\.n_layer 2 -> 3\. '):
        evaluate.evaluate_checkpoint(changed, baseline[0])
    # Fields that only shape the training state (its memory, its optimizer) do not matter.
    workdir = str(tmp_path / 'run')
    shutil.copytree(baseline[0], workdir)
    other_state = training_fixtures.tiny_config(config.data.text_path, train__batch_size=8,
                                                train__clip_norm=0.0)
    summary = evaluate.evaluate_checkpoint(other_state, workdir)
    # The same whole-split score as the training run's final validation.
    assert summary['step'] == NUM_STEPS
    assert summary['loss'] == pytest.approx(baseline[2]['valid_loss'], abs=1e-6)
    assert summary['num_tokens'] == baseline[2]['valid_tokens']


def source_params(workdir, step, exp):
    ckpt = checkpointing.Checkpointer(run_files.checkpoint_dir(workdir), keep=3, read_only=True)
    restored = ckpt.restore_step(step, *experiment.abstract_state(exp))
    ckpt.close()
    return restored.state


@pytest.mark.parametrize('keep', ['params', 'params_and_optimizer'])
def test_init_from_starts_a_new_batch_size_from_saved_parameters(config, baseline, tmp_path, keep):
    source = baseline[0]
    new = training_fixtures.tiny_config(config.data.text_path, train__batch_size=8,
                                        train__init_from=source, train__init_from_state=keep)
    exp = experiment.setup(new, str(tmp_path))
    state, memory = restore.init_from(exp)
    saved = source_params(source, 8, experiment.setup(config, str(tmp_path / 'old')))
    same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(
        jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))
    assert same(state.params, saved.params)
    assert memory.layers['hidden'].shape[1] == 8 and not np.asarray(memory.shared['valid']).any()
    if keep == 'params':
        assert int(state.step) == 0
        assert all(not np.asarray(x).any() for x in jax.tree_util.tree_leaves(state.opt_state))
    else:
        assert int(state.step) == 8 and same(state.opt_state, saved.opt_state)


def test_init_from_refuses_other_parameter_shapes(config, baseline, tmp_path):
    new = training_fixtures.tiny_config(config.data.text_path, model__d_inner=128,
                                        train__init_from=os.path.join(baseline[0], 'checkpoints'))
    with pytest.raises(errors.ConfigError, match=r'model\.d_inner 64 -> 128'):
        restore.init_from(experiment.setup(new, str(tmp_path)))


def test_transformer_without_memory_trains_checkpoints_and_resumes(config, tmp_path):
    """mem_len = 0 (the relative-position baseline): its empty memory is saved and restored."""
    no_memory = training_fixtures.tiny_config(config.data.text_path, train__num_steps=NUM_STEPS,
                                              model__mem_len=0)
    workdir = str(tmp_path)
    _, summary = training_fixtures.run_recording(no_memory, workdir, interrupt_at_step=4)
    assert summary is None
    # What the resumed run restores (the training loop around it is tested above).
    exp = experiment.setup(no_memory, workdir)
    ckpt = checkpointing.Checkpointer(run_files.checkpoint_dir(workdir), keep=3)
    state, memory, last = restore.restore_or_init(exp, ckpt, mock.Mock(), None)
    ckpt.close()
    assert last == os.path.join(run_files.checkpoint_dir(workdir), '4') and int(state.step) == 4
    assert memory.layers['hidden'].shape == (2, 4, 0, 32) and memory.shared['valid'].shape == (4, 0)


def test_init_from_takes_the_source_tokenizer_and_reads_numbered_workdirs(config, baseline,
                                                                         tmp_path):
    """Also over the tokenizer of an earlier start that saved nothing (here one of other byte ids,
    as an imported vocabulary has); a bad init_from stops the start before anything is written."""
    new = training_fixtures.tiny_config(config.data.text_path, train__init_from=baseline[0])
    workdir = str(tmp_path / 'new')
    tokenizers.ByteTokenizer(list(range(255, -1, -1))).save(workdir)
    restore.start_tokenizer(experiment.resolved(new, 1), workdir)
    with open(os.path.join(workdir, 'tokenizer.json')) as a, \
            open(os.path.join(baseline[0], 'tokenizer.json')) as b:
        assert a.read() == b.read()
    # A resumed run never reads init_from (its source may be gone): its tokenizer stays.
    resumed = str(tmp_path / 'resumed')
    shutil.copytree(baseline[0], resumed)
    before = (tmp_path / 'resumed' / 'tokenizer.json').read_bytes()
    restore.start_tokenizer(experiment.resolved(training_fixtures.override(
        new, train__init_from=str(tmp_path / 'gone')), 1), resumed)
    assert (tmp_path / 'resumed' / 'tokenizer.json').read_bytes() == before
    mistyped = training_fixtures.override(new, train__init_from=baseline[0] + 'x')
    with pytest.raises(errors.CheckpointError, match=r'init_from=\S+x: no checkpoints there'):
        trainer.train_and_evaluate(mistyped, str(tmp_path / 'other'))
    assert os.listdir(tmp_path / 'other') == ['memjax.log']  # Its log only: no tokenizer, no config.
    numbered = tmp_path / '2024'  # A workdir named like a step folder.
    (numbered / 'checkpoints' / '8').mkdir(parents=True)
    assert restore.init_from_dir(str(numbered)) == (str(numbered / 'checkpoints'), None)
    assert restore.init_from_dir(str(numbered / 'checkpoints' / '8')) == (
        str(numbered / 'checkpoints'), 8)


def test_a_failed_background_write_is_reported_as_such_even_when_closing_fails_too(tmp_path):
    """A full disk under an asynchronous save: the wait names the step and the fix, and orbax's own
    error from closing (it raises the writer's failure again) does not replace it."""
    ckpt = checkpointing.Checkpointer(str(tmp_path / 'checkpoints'), keep=1)
    ckpt.close()  # A real manager, closed; a stand-in then fails as a full disk's would.
    full = OSError(28, 'No space left on device')
    ckpt._manager = mock.Mock(wait_until_finished=mock.Mock(side_effect=full),  # pylint: disable=protected-access
                              close=mock.Mock(side_effect=full), all_steps=mock.Mock(return_value=[4]))
    ckpt._writing = 8  # pylint: disable=protected-access
    with pytest.raises(errors.CheckpointError, match='saving step 8 in .* failed .*No space left.* resume from .*4'):
        try:
            ckpt.wait()
        finally:
            ckpt.close()
    ckpt._failed = False  # pylint: disable=protected-access
    with pytest.raises(OSError):  # Without a failure reported first, closing's own error is not hidden.
        ckpt.close()
