"""Checkpoints: exact resume, and fallback past a damaged newest checkpoint."""

import logging
import os
import shutil

import numpy as np
import pytest

from memjax import checkpointing
from memjax import metrics as metrics_lib
from memjax import trainer
import training_fixtures

# Checkpoints at steps 4 and 8; losses logged every 2 updates (one dispatch of S=2).
NUM_STEPS = 8


class Interrupted(Exception):
    pass


def run_recording(config, workdir, interrupt_at_step=None):
    """Trains; returns {(prefix, step): loss} of everything written to TensorBoard.

    With `interrupt_at_step`, the run dies right after the checkpoint of that step was
    requested, like a preempted job.
    """
    recorded = {}
    original_write = metrics_lib.MetricWriter.write_scalars
    original_save = checkpointing.Checkpointer.save

    def write_scalars(self, step, prefix, scalars):
        recorded[(prefix, step)] = scalars['loss']
        original_write(self, step, prefix, scalars)

    def save(self, step, *args, **kwargs):
        original_save(self, step, *args, **kwargs)
        if step == interrupt_at_step:
            raise Interrupted()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metrics_lib.MetricWriter, 'write_scalars', write_scalars)
        patch.setattr(checkpointing.Checkpointer, 'save', save)
        try:
            summary = trainer.train_and_evaluate(config, workdir)
        except Interrupted:
            summary = None
    return recorded, summary


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    return training_fixtures.write_text_corpus(str(tmp_path_factory.mktemp('corpus')))


@pytest.fixture(scope='module')
def config(corpus):
    return training_fixtures.tiny_config(corpus, train__num_steps=NUM_STEPS)


@pytest.fixture(scope='module')
def baseline(config, tmp_path_factory):
    """An uninterrupted run (dropout on, so the PRNG stream is part of what must resume)."""
    workdir = str(tmp_path_factory.mktemp('baseline'))
    recorded, summary = run_recording(config, workdir)
    return workdir, recorded, summary


def assert_same_run(recorded, summary, baseline_recorded, baseline_summary, steps):
    for step in steps:
        assert recorded[('train', step)] == pytest.approx(
            baseline_recorded[('train', step)], abs=1e-6), step
    assert summary['valid_loss'] == pytest.approx(baseline_summary['valid_loss'], abs=1e-6)
    assert summary['valid_tokens'] == baseline_summary['valid_tokens']


def test_resume_after_interruption_is_exact(config, baseline, tmp_path):
    _, baseline_recorded, baseline_summary = baseline
    workdir = str(tmp_path)
    first, summary = run_recording(config, workdir, interrupt_at_step=4)
    assert summary is None and ('train', 6) not in first
    assert first[('train', 4)] == baseline_recorded[('train', 4)]
    recorded, summary = run_recording(config, workdir)
    assert min(step for _, step in recorded) == 6  # Resumed at 4, not from scratch.
    assert_same_run(recorded, summary, baseline_recorded, baseline_summary, steps=(6, 8))


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
    directory = trainer.checkpoint_dir(workdir)
    exp = trainer.setup(config, workdir)
    abstract = trainer.abstract_state(exp)
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
    truncate_array_files(os.path.join(trainer.checkpoint_dir(workdir), '8'))
    recorded, summary = run_recording(config, workdir)
    # Redoes steps 5-8 from checkpoint 4 and ends exactly where the undamaged run ended.
    assert min(step for _, step in recorded) == 6
    assert_same_run(recorded, summary, baseline_recorded, baseline_summary, steps=(6, 8))
    assert os.path.isdir(trainer.checkpoint_dir(workdir) + '_damaged/8')
    ckpt = checkpointing.Checkpointer(trainer.checkpoint_dir(workdir), keep=3, read_only=True)
    restored = ckpt.restore_latest(*trainer.abstract_state(trainer.setup(config, workdir)))
    assert restored.step == 8


def test_fingerprint_sees_every_byte():
    tree = {'a': np.arange(6, dtype=np.float32), 'b': np.zeros((2, 2), np.int32)}
    changed = {'a': tree['a'].copy(), 'b': tree['b']}
    changed['a'][3] = np.nextafter(np.float32(3), np.float32(4))
    reshaped = {'a': tree['a'].reshape(2, 3), 'b': tree['b']}
    assert checkpointing.fingerprint(tree) == checkpointing.fingerprint(
        {k: v.copy() for k, v in tree.items()})
    assert checkpointing.fingerprint(tree) != checkpointing.fingerprint(changed)
    assert checkpointing.fingerprint(tree) != checkpointing.fingerprint(reshaped)
