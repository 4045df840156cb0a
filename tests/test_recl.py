"""RECL's arithmetic (memjax/analysis/recl.py) against the Transformer-XL paper's appendix C written
out as plain loops, on hand-made loss tables (ties, r = 1, a gain that never falls below the
threshold) and on random ones; the per-token losses it reads against evaluation and a hand loop."""

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from memjax import errors
from memjax import model as model_lib
from memjax.analysis import recl as recl_lib
from memjax.analysis import run as analysis_run
from memjax.data import pipeline
from memjax.training import evaluation
from memjax.training import loop as trainer
from memjax.training import experiment
from memjax.training import step as train_step_lib
import cli_fixtures
import disks
import training_fixtures


def naive_recl(losses, contexts, r, threshold=0.01):
    """Appendix C token by token: losses[c][i][t]; the top-r tokens by baseline, ties in text order."""
    models, tokens = len(losses[0]), len(losses[0][0])

    def f(i, short, long):
        baseline = [min(losses[short][j][t] for j in range(models)) for t in range(tokens)]
        hardest = sorted(range(tokens), key=lambda t: (-baseline[t], t))[:max(1, math.ceil(r * tokens - 1e-9))]
        return sum(min(baseline[t], losses[long][i][t]) for t in hardest) / len(hardest)

    def g(i, short, long):
        return (math.exp(f(i, short, short)) - math.exp(f(i, short, long))) / math.exp(f(i, short, short))

    found = []
    for i in range(models):
        at = 0
        while at + 1 < len(contexts) and g(i, at, at + 1) >= threshold:
            at += 1
        found.append((contexts[at], at + 1 < len(contexts)))
    return found


def as_pairs(found):
    return [(x.context, x.converged) for x in found]


def test_a_model_that_keeps_gaining_reaches_further_than_one_that_stops():
    """Two models, three tokens, contexts 10, 20, 30 (r = 1). At 10 both lose 2 nats everywhere; A
    drops to 1.5 at 20 and 1.0 at 30, B to 1.98 at 20 (a 2 % gain) and stays: by hand, g_A(10, 20) =
    1 - e^-0.5, g_B(10, 20) = 1 - e^-0.02 >= 1 %, g_B(20, 30) = 0, g_A(20, 30) = 1 - e^-0.5."""
    a = [[2.0] * 3, [1.5] * 3, [1.0] * 3]
    b = [[2.0] * 3, [1.98] * 3, [1.98] * 3]
    losses = np.array([[a[c], b[c]] for c in range(3)])
    np.testing.assert_allclose(recl_lib.relative_gains(losses[0], losses[1], 1.0), [1 - math.exp(-0.5), 1 - math.exp(-0.02)])
    # From 20 the baseline is A's 1.5: B's 1.98 gains nothing over it, A's 1.0 gains 1 - e^-0.5.
    np.testing.assert_allclose(recl_lib.relative_gains(losses[1], losses[2], 1.0), [1 - math.exp(-0.5), 0.0])
    assert as_pairs(recl_lib.recl(losses, [10, 20, 30], 1.0)) == [(30, False), (20, True)]
    assert as_pairs(recl_lib.recl(losses, [10, 20, 30], 1.0)) == naive_recl(losses.tolist(), [10, 20, 30], 1.0)


def test_the_baseline_is_shared_so_a_model_gains_only_below_the_best_short_context_model():
    """A strong model at the short context caps what a weak one can gain: the weak one's own drop
    from 3 to 2.5 nats counts only below the strong one's 2.0."""
    strong = [[2.0, 2.0], [2.0, 2.0]]
    weak = [[3.0, 3.0], [2.5, 2.5]]
    losses = np.array([[strong[c], weak[c]] for c in range(2)])
    np.testing.assert_allclose(recl_lib.relative_gains(losses[0], losses[1], 1.0), [0.0, 0.0])
    assert as_pairs(recl_lib.recl(losses, [4, 8], 1.0)) == [(4, True), (4, True)]


def test_top_r_takes_the_hardest_tokens_with_ties_in_text_order():
    baseline = np.array([1.0, 3.0, 2.0, 3.0, 3.0, 0.5])
    np.testing.assert_array_equal(recl_lib.hard_tokens(baseline, 0.5), [1, 3, 4])
    np.testing.assert_array_equal(recl_lib.hard_tokens(baseline, 0.3), [1, 3])  # ceil(1.8) = 2: the first two of the tie.
    np.testing.assert_array_equal(recl_lib.hard_tokens(baseline, 0.01), [1])  # At least one token.
    np.testing.assert_array_equal(recl_lib.hard_tokens(baseline, 1.0), [1, 3, 4, 2, 0, 5])
    # r restricts the gain to the hard tokens: here the gain sits on the easy ones only.
    short = np.array([[5.0, 5.0, 1.0, 1.0]])
    long = np.array([[5.0, 5.0, 0.1, 0.1]])
    assert recl_lib.relative_gains(short, long, 0.5)[0] == 0.0
    assert recl_lib.relative_gains(short, long, 1.0)[0] == pytest.approx(1 - math.exp(-0.45))
    with pytest.raises(ValueError, match='r=0'):
        recl_lib.hard_tokens(baseline, 0.0)


def test_a_gain_that_never_falls_below_the_threshold_is_a_lower_bound():
    losses = np.array([[[3.0 - 0.1 * c] * 4] for c in range(5)])  # 10 % less perplexity at every step.
    assert as_pairs(recl_lib.recl(losses, [1, 2, 3, 4, 5], 0.1)) == [(5, False)]
    # Just under 1 %: the search stops at the first context.
    flat = np.array([[[3.0] * 4], [[3.0 + math.log(0.991)] * 4]])
    assert as_pairs(recl_lib.recl(flat, [64, 128], 1.0)) == [(64, True)]
    with pytest.raises(ValueError, match='must increase'):
        recl_lib.recl(flat, [128, 64], 1.0)


@pytest.mark.parametrize('seed', range(6))
@pytest.mark.parametrize('r', [0.1, 0.5, 1.0])
def test_random_groups_match_the_appendix_written_as_loops(seed, r):
    rng = np.random.default_rng(seed)
    contexts, models, tokens = 5, 3, 40
    # Losses falling with the context at rates of their own, with ties (values on a 0.05 grid).
    start = rng.uniform(1.0, 4.0, size=(models, tokens))
    drops = rng.uniform(0.0, 0.2, size=(contexts, models, 1)).cumsum(axis=0)
    losses = np.round((start[None] - drops + rng.normal(0, 0.05, (contexts, models, tokens))) * 20) / 20
    assert as_pairs(recl_lib.recl(losses, [8, 16, 24, 32, 40], r)) == naive_recl(losses.tolist(), [8, 16, 24, 32, 40], r)
    table = recl_lib.gain_table(losses, r)
    for i in range(models):
        for a in range(contexts):
            assert table[i, a, a] == pytest.approx(0.0, abs=1e-12)  # f_i(c, c) is the shared baseline.
            for b in range(a + 1, contexts):
                base = math.exp(recl_lib.relative_losses(losses[a], losses[a], r)[i])
                assert table[i, a, b] == pytest.approx(base * recl_lib.relative_gains(losses[a], losses[b], r)[i])
            assert np.isnan(table[i, a, :a]).all()


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
    """A tiny trained Transformer-XL run: (workdir, corpus)."""
    corpus = training_fixtures.write_text_corpus(str(tmp_path_factory.mktemp('corpus')))
    workdir = str(tmp_path_factory.mktemp('run'))
    trainer.train_and_evaluate(training_fixtures.tiny_config(corpus, train__num_steps=2, train__eval_every=0,
                                                             train__final_eval_batches=1), workdir)
    return workdir, corpus


def test_token_losses_are_what_evaluation_sums_and_a_one_stream_loop_scores(trained):
    workdir, corpus = trained
    # One stream (eval batch 1), context 6 for every token: the split's text in order.
    run = analysis_run.load(workdir, mem_len=6, same_length=True)
    run = analysis_run.LoadedRun(experiment.setup(training_fixtures.override(
        run.exp.run.as_config_dict(), eval__batch_size=1), workdir, training=False), run.params, run.step, workdir)
    losses = recl_lib.token_losses(run, max_batches=2)
    summed = evaluation.evaluate_streams(
        jax.jit(train_step_lib.eval_step_fn(run.exp.eval_model)), run.params, run.exp.eval_mcfg,
        evaluation.eval_streams(run.exp.run, run.tokenizer, 'validation'), 1, 2, key=evaluation.eval_key(run.exp.run))
    assert losses.size == summed.num_tokens and losses.sum() == pytest.approx(summed.nll_sum, rel=1e-6)
    # The same tokens scored segment by segment by hand, the memory carried.
    with open(os.path.join(corpus, 'valid.txt'), 'rb') as f:
        tokens = np.frombuffer(f.read(), np.uint8).astype(np.int32)
    model, tgt = run.model, run.exp.run.eval.tgt_len
    apply = jax.jit(lambda p, x, m, y, r: model.apply({'params': p}, x, m, targets=y, reset=r))
    memory, naive = model_lib.init_memory(run.config, 1), []
    for start in range(0, losses.size, tgt):
        inputs, targets = tokens[start:start + tgt], tokens[start + 1:start + 1 + tgt]
        out, memory = apply(run.params, inputs[None], memory, targets[None], np.array([start == 0]))
        naive.extend(-np.asarray(out.target_logprobs[0], np.float64))
    np.testing.assert_allclose(losses, naive[:losses.size], rtol=1e-5, atol=1e-6)
    # Another context scores the same tokens (aligned), to other losses.
    other = recl_lib.token_losses(analysis_run.with_eval_model(run, mem_len=2), max_batches=2)
    assert other.size == losses.size and not np.allclose(other, losses)


@pytest.fixture(scope='module')
def memoryless(trained, tmp_path_factory):
    """A tiny trained Transformer without memory on the same corpus: its workdir."""
    _, corpus = trained
    workdir = str(tmp_path_factory.mktemp('none'))
    trainer.train_and_evaluate(training_fixtures.tiny_config(corpus, model__memory='none', model__mem_len=0,
                                                             train__num_steps=2, train__eval_every=0,
                                                             train__final_eval_batches=1), workdir)
    return workdir


@pytest.mark.parametrize('positions_per_pass', [recl_lib.POSITIONS_PER_PASS, 9],
                         ids=['a_batch_a_pass', 'batches_split_into_passes'])
def test_a_memoryless_run_scores_each_token_from_its_window_alone(trained, memoryless, positions_per_pass,
                                                                   monkeypatch):
    """Against one pass per token over the stream's `context` inputs ending at it, by hand: two
    streams (eval batch 2), so each window stops at its own stream's start. Nothing further back
    reaches a token: the memory-less Transformer's RECL cannot exceed its attention length. Also
    with a batch's 32 windows split into passes (of 9 at context 1, the last one padded; of 8)."""
    monkeypatch.setattr(recl_lib, 'POSITIONS_PER_PASS', positions_per_pass)
    _, corpus = trained
    run = analysis_run.load(memoryless)
    tokens = np.frombuffer(open(os.path.join(corpus, 'valid.txt'), 'rb').read(), np.uint8).astype(np.int32)
    layout = pipeline.contiguous_layout(tokens.size, run.exp.run.eval.batch_size, run.exp.run.eval.tgt_len)
    segments = 2 * run.exp.run.train.segments_per_step  # Two evaluation batches.
    apply = jax.jit(lambda p, x, y: run.model.apply({'params': p}, x, model_lib.init_memory(run.config, 1),
                                                    targets=y)[0].target_logprobs)
    # Each target's history: its stream's inputs from the stream's first up to its own.
    history = [layout.start[b, k] + t - layout.start[b, 0] + 1 for k in range(segments)
               for b in range(layout.start.shape[0]) for t in range(layout.num_valid[b, k])]
    np.testing.assert_array_equal(recl_lib.stream_history(
        evaluation.eval_streams(run.exp.run, run.tokenizer, 'validation'), max_batches=2), history)
    for context in (1, 5, 12):
        losses = recl_lib.window_token_losses(run, context, max_batches=2)
        naive = []
        for k in range(segments):  # Reading order: segment, stream, position.
            for b in range(layout.start.shape[0]):
                for t in range(layout.num_valid[b, k]):
                    at = layout.start[b, k] + t
                    first = max(layout.start[b, 0], at - context + 1)
                    naive.append(-float(apply(run.params, tokens[None, first:at + 1], tokens[None, first + 1:at + 2])[0, -1]))
        np.testing.assert_allclose(losses, naive, rtol=2e-5, atol=2e-5)


def test_windows_and_histories_stop_at_each_documents_start_and_skip_padding(trained, memoryless, monkeypatch):
    """Streams of whole documents (config.data.reset_at_doc_boundary): a document starts a fresh
    segment with a reset, in the middle of a stream, after the padded end of the one before; a
    window never reaches back over it, nor a token's history (what RECL counts it by). Against one
    hand pass per token over its document's inputs."""
    _, corpus = trained
    run = analysis_run.load(memoryless)
    tokens = np.frombuffer(open(os.path.join(corpus, 'valid.txt'), 'rb').read(), np.uint8).astype(np.int32)
    offsets = np.array([0, 11, 12, 40, 53, 90, 131])  # A one-token document (11:12) has nothing to score.
    batch_size, tgt, per_batch = 2, 8, 2
    layout = pipeline.document_layout(offsets, batch_size, tgt)
    batches = -(-layout.start.shape[1] // per_batch)
    pad = [(0, 0), (0, batches * per_batch - layout.start.shape[1])]
    start, valid_count, reset = (np.pad(x, pad) for x in (layout.start, layout.num_valid, layout.reset))

    class Streams:  # The batches LMStreams gives for this layout.
        num_batches = batches

        def iterator(self):
            for i in range(batches):
                ks = slice(i * per_batch, (i + 1) * per_batch)
                valid = np.arange(tgt) < valid_count[:, ks].T[..., None]
                index = np.where(valid, start[:, ks].T[..., None] + np.arange(tgt), 0)
                yield {'inputs': np.where(valid, tokens[index], 0), 'targets': np.where(valid, tokens[index + 1], 0),
                       'mask': valid.astype(np.float32), 'reset': reset[:, ks].T}

    Streams.batch_size = batch_size
    monkeypatch.setattr(recl_lib.evaluation, 'eval_streams', lambda *args: Streams())
    apply = jax.jit(lambda p, x, y: run.model.apply({'params': p}, x, model_lib.init_memory(run.config, 1),
                                                    targets=y)[0].target_logprobs)
    history = [start[b, k] + t - offsets[offsets <= start[b, k] + t].max() + 1 for k in range(start.shape[1])
               for b in range(batch_size) for t in range(valid_count[b, k])]
    np.testing.assert_array_equal(recl_lib.stream_history(Streams()), history)
    for context in (3, 9):
        naive = []
        for k in range(start.shape[1]):
            for b in range(batch_size):
                for t in range(valid_count[b, k]):
                    at = start[b, k] + t
                    first = max(offsets[offsets <= at].max(), at - context + 1)
                    logprobs = apply(run.params, tokens[None, first:at + 1], tokens[None, first + 1:at + 2])
                    naive.append(-float(logprobs[0, -1]))
        assert len(naive) == sum(max(0, int(n) - 1) for n in np.diff(offsets))
        np.testing.assert_allclose(recl_lib.window_token_losses(run, context), naive, rtol=2e-5, atol=2e-5)


def test_the_command_scores_a_group_reports_its_recl_and_resumes_from_what_it_kept(trained, tmp_path, monkeypatch):
    workdir, corpus = trained
    other = str(tmp_path / 'other')  # A second run of the group: a longer training memory.
    trainer.train_and_evaluate(training_fixtures.tiny_config(corpus, model__mem_len=16, train__num_steps=2,
                                                             train__eval_every=0, train__final_eval_batches=1), other)
    out = tmp_path / 'recl'
    # The third member scores the first run's parameters as TRAMS.
    done = subprocess.run([sys.executable, '-m', 'memjax.recl', f'--workdirs={workdir},{other},{workdir}@trams',
                           '--contexts=4,8',
                           '--r=0.5,1', f'--out={out}', '--max_batches=1'], env=cli_fixtures.cpu_env(1),
                          capture_output=True, text=True, timeout=cli_fixtures.RUN_TIMEOUT_S,
                          cwd=training_fixtures.REPO, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert 'RECL: 6/6' in done.stderr and 'eta' in done.stderr
    # TRAMS at context 8 scores its chosen rows at their true distances, up to 23 (trained: 0-15): the
    # warning names this command's own flag for the clamp.
    assert 'training scored at most 15: the longer ones are extrapolated; --clamp_len=-2 clamps them' in done.stderr
    assert '--config.eval.model.clamp_len' not in done.stderr
    with open(out / 'recl.json') as f:
        record = json.load(f)
    # The kept losses are what token_losses scores, and the reported RECL is recl() of them.
    kept = {}
    for i, (run, kind) in enumerate(((workdir, 'xl'), (other, 'xl'), (workdir, 'trams'))):
        loaded = analysis_run.load(run)
        for c, context in enumerate((4, 8)):
            kept[c, i], read_back = recl_lib._scored(loaded, kind, context, 'validation', 1, str(out))
            assert read_back
    # Counted: the tokens with 8 of their stream's tokens before them; the rest are reported apart.
    first = analysis_run.load(workdir)
    history = recl_lib.stream_history(evaluation.eval_streams(first.exp.run, first.tokenizer, 'validation'), 1)
    counted = history >= 8
    assert kept[0, 0].size == history.size and record['num_tokens'] == counted.sum() > 0
    assert record['short_history'] == (~counted).sum() > 0
    assert f'Not counted: {(~counted).sum():,} tokens scored with fewer than 8 tokens' in done.stdout
    np.testing.assert_allclose(kept[1, 1], recl_lib.token_losses(analysis_run.load(other, mem_len=8, same_length=True),
                                                                 max_batches=1), rtol=1e-6)
    # TRAMS at context 8: 8 attended memory rows, the newest 6 kept and 2 chosen from a pool of 16.
    trams = analysis_run.load(workdir, memory='trams', mem_len=16, trams_select=8, trams_remain=6)
    np.testing.assert_allclose(kept[1, 2], recl_lib.token_losses(trams, max_batches=1), rtol=1e-6)
    # A clamp scores distances beyond it as it, and keeps those losses apart from the unclamped ones.
    clamped, read_back = recl_lib._scored(analysis_run.load(other), 'xl', 8, 'validation', 1, str(out), clamp_len=2)
    assert not read_back
    np.testing.assert_allclose(clamped, recl_lib.token_losses(
        analysis_run.load(other, mem_len=8, same_length=True, clamp_len=2), max_batches=1), rtol=1e-6)
    losses = np.array([[kept[c, i][counted] for i in range(3)] for c in range(2)])
    for r in (0.5, 1.0):
        expected = [dataclasses.asdict(x) for x in recl_lib.recl(losses, [4, 8], r)]
        assert [runs[str(r)] for runs in record['recl']] == expected
    assert f'| {other} | xl |' in done.stdout and f'| {workdir}@trams | trams |' in done.stdout
    assert (out / 'recl.png').exists()
    # Run again: every loss is read back, nothing is scored.
    monkeypatch.setattr(recl_lib, 'token_losses', lambda *a, **k: pytest.fail('scored again'))
    again = recl_lib.group_recl([workdir, other, f'{workdir}@trams'], [4, 8], [0.5, 1.0], str(out), max_batches=1)
    assert [[x.context for x in runs.values()] for runs in again.recl] == [
        [runs[str(r)]['context'] for r in (0.5, 1.0)] for runs in record['recl']]


def test_a_group_that_reads_the_split_otherwise_or_a_kind_without_a_context_is_refused(trained, memoryless,
                                                                                        tmp_path):
    workdir, corpus = trained
    other = str(tmp_path / 'other')
    trainer.train_and_evaluate(training_fixtures.tiny_config(corpus, eval__tgt_len=4, train__num_steps=2,
                                                             train__eval_every=0, train__final_eval_batches=1), other)
    with pytest.raises(errors.UsageError, match='reads the split otherwise'):
        recl_lib.group_recl([workdir, other], [4, 8], [1.0], str(tmp_path / 'recl'))
    with pytest.raises(errors.UsageError, match="a 'bogus' run has no context length"):
        recl_lib.group_recl([f'{workdir}@bogus'], [4, 8], [1.0], str(tmp_path / 'recl'))
    with pytest.raises(errors.UsageError, match="@trams: .*memory='trams' cannot run on parameters trained as "
                                                "memory='none'"):
        recl_lib.group_recl([f'{memoryless}@trams'], [4, 8], [1.0], str(tmp_path / 'recl'))
    with pytest.raises(errors.UsageError, match="@none: .*memory='none' cannot run on parameters trained as "
                                                "memory='xl'"):
        recl_lib.group_recl([f'{workdir}@none'], [4, 8], [1.0], str(tmp_path / 'recl'))
    with pytest.raises(errors.UsageError, match=r'none of the [\d,]+ tokens scored has 100000 tokens of its '
                                                r'evaluation stream before it \(at most \d+\): score more'):
        recl_lib.group_recl([workdir], [4, 100_000], [1.0], str(tmp_path / 'recl'))
    with pytest.raises(errors.UsageError, match='max_batches=0: give -1'):
        recl_lib.group_recl([workdir], [4, 8], [1.0], str(tmp_path / 'recl'), max_batches=0)
    # A workdir without a checkpoint: train it first (this command takes no --config to offer).
    (tmp_path / 'untrained').mkdir()
    with pytest.raises(errors.CheckpointError, match=r'no readable checkpoint .*: train first with '
                                                     r'python -m memjax\.train --config=\.\.\. --workdir=\S+\.$'):
        recl_lib.group_recl([str(tmp_path / 'untrained')], [4, 8], [1.0], str(tmp_path / 'recl'))
    # A path may hold '@': only a suffix without '/' names a kind.
    assert recl_lib.member('gs://b/user@host/run') == ('gs://b/user@host/run', '')
    assert recl_lib.member('runs/a@b/xl@trams') == ('runs/a@b/xl', 'trams')
    assert not (tmp_path / 'recl').exists()  # Refused before anything was scored or written.
    (tmp_path / 'a_file').write_text('')
    with pytest.raises(errors.WorkdirError, match='cannot create --out='):
        recl_lib.group_recl([workdir], [4, 8], [1.0], str(tmp_path / 'a_file' / 'recl'))


def test_an_out_folder_on_a_full_disk_is_refused_before_anything_is_scored(trained, tmp_path, monkeypatch):
    workdir, _ = trained
    monkeypatch.setattr(recl_lib, 'token_losses', lambda *a, **k: pytest.fail('scored'))
    with disks.small_disk(tmp_path / 'disk', 64) as disk:
        disks.fill(disk)
        with pytest.raises(errors.WorkdirError, match=r'cannot (write \S+/recl/recl\.json: \S+ has \d+ bytes free|'
                                                      r'create --out=)'):
            recl_lib.group_recl([workdir], [4, 8], [1.0], os.path.join(disk, 'recl'))


def write_planted_corpus(folder, distance, seed=0):
    """Text whose every symbol repeats one of the `distance` before it (chosen uniformly), else
    (1 in 10) is new: each further position of context up to `distance` helps, none beyond. Enough
    training text that the models do not learn it by heart: one that has is sensitive to every
    extra position, which RECL's clipped gains would count."""
    rng = np.random.default_rng(seed)
    letters = np.array(list('abcdefghijklmnop'))
    os.makedirs(folder, exist_ok=True)
    for name, size in (('train.txt', 400_000), ('valid.txt', 4_000), ('test.txt', 1_000)):
        text = list(rng.choice(letters, distance))
        while len(text) < size:
            text.append(text[-rng.integers(1, distance + 1)] if rng.random() < 0.9 else rng.choice(letters))
        with open(os.path.join(folder, name), 'w') as f:
            f.write(''.join(text))
    return folder


def test_recl_finds_a_planted_dependency_distance_within_one_step(tmp_path):
    """The paper's own group, Transformer-XL and the Transformer without memory, trained on text
    whose dependencies reach exactly 12 back: each one's RECL at every r is 12 within one step (4)
    of the contexts scored. XL: memory 16 over segments of 16; the Transformer: segments of 32,
    which give most of its training positions the whole planted distance, each token scored from
    its window of c alone. 800 steps of 512 tokens each; 600 found the same."""
    distance, step = 12, 4
    corpus = write_planted_corpus(str(tmp_path / 'corpus'), distance)
    group = {'xl': dict(model__mem_len=16, train__tgt_len=16),
             'none': dict(model__memory='none', model__mem_len=0, train__tgt_len=32, eval__tgt_len=16)}
    for memory, fields in group.items():
        trainer.train_and_evaluate(training_fixtures.tiny_config(
            corpus, model__d_model=64, model__n_head=4, model__d_inner=128, model__dropout=0.0,
            train__batch_size=512 // fields['train__tgt_len'], train__num_steps=800, train__warmup_steps=50,
            train__learning_rate=2e-3,
            train__log_every=600, train__eval_every=0, train__checkpoint_every=0, train__final_eval_batches=1,
            eval__batch_size=16, **fields), str(tmp_path / memory))
    result = recl_lib.group_recl([str(tmp_path / m) for m in group], [4, 8, 12, 16, 20], [0.1, 1.0],
                                 str(tmp_path / 'recl'))
    assert result.kinds == ['xl', 'none']
    for found, gains in zip(result.recl, result.gains):
        for r in (0.1, 1.0):
            assert found[r].converged and abs(found[r].context - distance) <= step, (r, found, gains)
