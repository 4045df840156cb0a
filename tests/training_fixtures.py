"""Helpers shared by the training, checkpoint and evaluation tests (not a test module).

A generated text corpus keeps these tests independent of any downloaded data and small
enough that a full validation pass takes a fraction of a second.
"""

import functools
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from memjax.training import checkpoints as checkpointing
from memjax import config_lib
from memjax import model as model_lib
from memjax.training import metrics as metrics_lib
from memjax.training import loop as trainer
from memjax.training import step as train_step_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, 'configs', 'tiny.py')


@functools.lru_cache(maxsize=None)
def random_tokens(seed: int, shape, vocab_size: int) -> np.ndarray:
    """Uniform int32 token ids in [0, vocab_size), drawn by NumPy (jax.random compiles a draw for
    each shape)."""
    return np.random.default_rng(seed).integers(0, vocab_size, shape, dtype=np.int32)


def perturbed_params(cfg, scale: float = 0.05):
    """A ModelConfig's random parameters with the zero-initialised ones perturbed (normal noise
    times `scale`), so that every term of the model carries signal. NumPy draws the perturbations:
    JAX would compile a draw for each shape."""
    params = model_lib.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(1)
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x) + scale * rng.standard_normal(x.shape, np.float32), x.dtype),
                        params)


def write_text_corpus(folder: str, seed: int = 0) -> str:
    """train/valid/test.txt of random sentences over a small vocabulary; returns folder."""
    rng = np.random.RandomState(seed)
    words = ['alpha', 'beta', 'gamma', 'delta', 'memory', 'segment', 'token', 'jax', 'the', 'of']
    sizes = {'train.txt': 3000, 'valid.txt': 120, 'test.txt': 90}  # In words.
    os.makedirs(folder, exist_ok=True)
    for name, count in sizes.items():
        chosen = rng.choice(words, size=count)
        lines = [' '.join(chosen[i:i + 12]) + '.' for i in range(0, count, 12)]
        with open(os.path.join(folder, name), 'w') as f:
            f.write('\n'.join(lines) + '\n')
    return folder


def tiny_config(corpus: str, **overrides) -> ml_collections.ConfigDict:
    """configs/tiny.py on the generated corpus; overrides like `train__num_steps=4` or
    `eval__model__mem_len=16`."""
    config = config_lib.load_config_file(TINY)
    config.data.update(name='text', text_path=corpus, data_dir=os.path.join(corpus, 'tfds'))
    return override(config, **overrides)


def override(config: ml_collections.ConfigDict, **overrides) -> ml_collections.ConfigDict:
    """Sets `section__field=value` (any depth, `seed=1` at the top) in `config`; returns it."""
    for key, value in overrides.items():
        *sections, field = key.split('__')
        node = config
        for section in sections:
            node = node[section]
        node[field] = value
    return config


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


def assert_same_run(recorded, summary, baseline_recorded, baseline_summary, steps):
    for step in steps:
        assert recorded[('train', step)] == pytest.approx(
            baseline_recorded[('train', step)], abs=1e-6), step
    assert summary['valid_loss'] == pytest.approx(baseline_summary['valid_loss'], abs=1e-6)
    assert summary['valid_tokens'] == baseline_summary['valid_tokens']


def assert_resumes_exactly(config, tmp_path, kill_at_step=4, compare_steps=(6, 8)):
    """Trains `config` uninterrupted and killed after the checkpoint of `kill_at_step`, then resumed:
    the losses after the resume and the final validation equal the uninterrupted run's. The
    uninterrupted run must learn (validation below a uniform guess over bytes)."""
    baseline, summary = run_recording(config, str(tmp_path / 'baseline'))
    assert ('train', compare_steps[-1]) in baseline and summary['valid_loss'] < np.log(256)
    workdir = str(tmp_path / 'resumed')
    first, interrupted = run_recording(config, workdir, interrupt_at_step=kill_at_step)
    assert interrupted is None and first[('train', kill_at_step)] == baseline[('train', kill_at_step)]
    recorded, summary_resumed = run_recording(config, workdir)
    assert min(step for _, step in recorded) > kill_at_step
    assert_same_run(recorded, summary_resumed, baseline, summary, steps=compare_steps)


def random_batch(exp, seed):
    """One segment [1, B=4, T] of random ids, some positions unscored, rows 0 and 2 reset."""
    rng = np.random.RandomState(seed)
    shape = (1, exp.local_batch, exp.config.train.tgt_len)
    mask = (rng.rand(*shape) > 0.2).astype(np.float32)  # Some padding, unevenly per stream.
    return {
        'inputs': rng.randint(0, exp.mcfg.vocab_size, shape).astype(np.int32),
        'targets': rng.randint(0, exp.mcfg.vocab_size, shape).astype(np.int32),
        'mask': mask,
        'reset': np.array([[True, False, True, False]]),
    }


def jit_train_step(model, exp, chunks):
    """The train step of `model` with the experiment's optimizer, jitted for one device."""
    return jax.jit(train_step_lib.train_step_fn(model, exp.tx, exp.schedule,
                                                train_step_lib.memory_batch_axes(exp.mcfg), chunks))
