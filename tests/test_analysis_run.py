"""The analysis reads a run's text as evaluation does, and its LaMemo and attention summaries are
the averages of the per-segment values."""

import functools

import jax
import numpy as np
import pytest

from memjax import analysis, evaluate
from memjax import model as model_lib
from memjax.analysis import attention, lamemo
from memjax.data.tokenizers import ByteTokenizer
from memjax.model import ModelConfig
from memjax.training import restore
from memjax.training import saved_run


def _imported(tmp_path_factory, memory):
    """A workdir holding random parameters (large, so attention is far from uniform) as step 0,
    and the config that reads it in segments of 8 bytes, 2 segments per batch."""
    cfg = ModelConfig(vocab_size=256, d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32, mem_len=8, segment_len=8,
                      memory=memory, init_std=0.3)
    workdir = str(tmp_path_factory.mktemp(memory) / 'run')
    restore.write_imported(cfg, model_lib.init_params(cfg, jax.random.key(0)), ByteTokenizer(), workdir, 'embedded')
    config = saved_run.saved_config(workdir)
    config.train.update(batch_size=2, tgt_len=8, segments_per_step=2)
    return config, workdir


@pytest.fixture(scope='module')
def lamemo_run(tmp_path_factory):
    config, workdir = _imported(tmp_path_factory, 'lamemo')
    return config, workdir, analysis.load(workdir, config)


def _segments(run, count):
    """The text's first segments with the memory each starts from, carried and reset by hand (each
    step jitted: op by op, the model would compile each of its operations)."""
    reset = jax.jit(run.model.kind.reset)
    advance = jax.jit(lambda params, inputs, memory: run.model.apply({'params': params}, inputs, memory)[1])
    memory = model_lib.init_memory(run.config, 2)
    for segment in analysis.text_batches(run, 'validation', count):
        memory = reset(memory, segment.reset)
        yield segment, memory
        memory = advance(run.params, segment.inputs, memory)


def test_the_text_is_read_as_evaluation_reads_it(lamemo_run, tmp_path):
    config, workdir, run = lamemo_run
    nll = count = 0.0
    for segment, output, _ in analysis.sown_over_text(run, 'alpha', num_segments=4):
        nll -= float((np.asarray(output.target_logprobs) * segment.mask).sum())
        count += float(segment.mask.sum())
    # Two batches of segments_per_step = 2 segments: the evaluation's first two.
    scored = evaluate.evaluate_checkpoint(config, workdir, out_path=str(tmp_path / 'eval.json'), max_batches=2)
    assert scored['num_tokens'] == count
    np.testing.assert_allclose(nll / count, scored['loss'], rtol=1e-5)


def test_mean_memorizing_coefficients_average_the_carried_segments(lamemo_run):
    _, _, run = lamemo_run
    alphas = []
    coefficients = jax.jit(functools.partial(lamemo.memorizing_coefficients, run.model))
    for segment, memory in _segments(run, 5):
        alpha, _ = coefficients(run.params, segment.inputs, memory)
        alphas += [np.asarray(alpha)[:, b].mean(axis=1) for b in range(2) if not segment.reset[b]]
    np.testing.assert_allclose(lamemo.mean_memorizing_coefficients(run, 5), np.mean(alphas, axis=0), rtol=1e-5)


def test_text_profiles_average_the_segments_profiles(tmp_path_factory):
    config, workdir = _imported(tmp_path_factory, 'xl')
    run = analysis.load(workdir, config)
    profiles = []

    @jax.jit
    def attention_sown(params, inputs, memory):
        _, _, sown = analysis.apply_sown(run.model, params, inputs, memory)
        return analysis.per_layer(sown, 'attention')

    for segment, memory in _segments(run, 4):
        sown = jax.tree.map(np.asarray, attention_sown(run.params, segment.inputs, memory))
        profiles.append(attention.mean_by_distance(sown['probs'], sown['mask'], 8, bin_width=2, within_bin='max'))
    got = attention.text_profiles(run, 4, bin_width=2, within_bin='max')['attention']
    np.testing.assert_allclose(got, np.nanmean(profiles, axis=0), rtol=1e-5)
    with pytest.raises(ValueError, match=r"terms='abx': \['x'\] are not score terms"):
        attention.text_profiles(run, 4, terms='abx')
