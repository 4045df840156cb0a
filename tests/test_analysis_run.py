"""The analysis reads a run's text as evaluation does, and its LaMemo and attention summaries are
the averages of the per-segment values."""

import functools

import jax
import numpy as np
import pytest

from memjax import analysis, errors, evaluate
from memjax import model as model_lib
from memjax.analysis import attention, lamemo
from memjax.data.tokenizers import ByteTokenizer
from memjax.model import ModelConfig
from memjax.training import restore
from memjax.training import saved_run


def _imported(tmp_path_factory, memory, mem_len=8):
    """A workdir holding random parameters (large, so attention is far from uniform) as step 0,
    and the config that reads it in segments of 8 bytes, 2 segments per batch."""
    cfg = ModelConfig(vocab_size=256, d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32, mem_len=mem_len,
                      segment_len=8,
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


def test_a_run_is_read_in_one_process(lamemo_run, monkeypatch):
    """Each process would read only its streams of the text (and size the memory for all of them)."""
    _, workdir, _ = lamemo_run
    monkeypatch.setattr(analysis.run.jax, 'process_count', lambda: 2)
    with pytest.raises(errors.UsageError, match='reads a run in one process, not 2'):
        analysis.load(workdir)


def test_memorizing_coefficients_count_only_the_rows_that_hold_past(tmp_path_factory):
    """A memory of two segments: after a fresh start the first segment fills its newest 8 rows, the
    next the oldest 8; rows still empty (no past) are not averaged."""
    config, workdir = _imported(tmp_path_factory, 'lamemo', mem_len=16)
    run = analysis.load(workdir, config)
    coefficients = jax.jit(functools.partial(lamemo.memorizing_coefficients, run.model))
    per_row, read = [[] for _ in range(16)], np.zeros(2, int)
    for segment, memory in _segments(run, 5):
        read[segment.reset] = 0
        alpha = np.asarray(coefficients(run.params, segment.inputs, memory)[0]).mean(axis=2)  # [L, B, M]
        for b in range(2):
            for row in range(16 - min(16, read[b]), 16):
                per_row[row].append(alpha[:, b, row])
        read += 8
    assert [len(found) for found in per_row] == [6] * 8 + [8] * 8  # Streams 2 x segments 2-4 or 1-4.
    expected = np.stack([np.mean(found, axis=0) for found in per_row], axis=1)
    got = lamemo.mean_memorizing_coefficients(run, 5)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert not np.allclose(got[:, :8], expected[:, 8:])  # The old rows' own average, not the newest ones'.


def test_attention_profiles_leave_out_the_queries_of_padding(tmp_path_factory, monkeypatch):
    """A document ending inside a segment (its last 3 positions padded, the next segment a reset) and
    a segment of padding alone after it: their padded queries attend keys but are no text."""
    config, workdir = _imported(tmp_path_factory, 'xl')
    run = analysis.load(workdir, config)
    segments = list(analysis.text_batches(run, 'validation', 4))
    segments[1].mask[1, 5:] = 0
    segments[2].reset[1] = True
    segments.append(analysis.Segment(segments[3].inputs, segments[3].targets, np.zeros_like(segments[3].mask),
                                     np.zeros_like(segments[3].reset)))
    monkeypatch.setattr(analysis.run, 'text_batches', lambda *args: iter(segments))

    @jax.jit
    def attention_sown(params, inputs, memory):
        _, _, sown = analysis.apply_sown(run.model, params, inputs, memory)
        return analysis.per_layer(sown, 'attention')

    reset, advance = jax.jit(run.model.kind.reset), jax.jit(lambda p, x, m: run.model.apply({'params': p}, x, m)[1])
    memory, profiles, unmasked, far, reaching = model_lib.init_memory(run.config, 2), [], [], 0.0, 0
    for segment in segments:
        memory = reset(memory, segment.reset)
        sown = jax.tree.map(np.asarray, attention_sown(run.params, segment.inputs, memory))
        scored = sown['mask'] & (segment.mask > 0)[None, :, None, :, None]
        unmasked.append(attention.mean_by_distance(sown['probs'], sown['mask'], 8))
        if scored.any():
            profiles.append(attention.mean_by_distance(sown['probs'], scored, 8))
            mass, queries = attention.mass_beyond(sown['probs'], scored, 8, 4)
            far, reaching = far + mass, reaching + queries
        memory = advance(run.params, segment.inputs, memory)
    got = attention.text_profiles(run, -1)['attention']
    np.testing.assert_allclose(got, np.nanmean(profiles, axis=0), rtol=1e-5)
    assert not np.allclose(got, np.nanmean(unmasked, axis=0), rtol=1e-3)
    np.testing.assert_allclose(attention.share_beyond(run, 4, -1), far / reaching, rtol=1e-5)


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
