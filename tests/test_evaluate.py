"""Evaluation: every target of a split scored once, equal to a naive segment loop."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from memjax import errors
from memjax import evaluate
from memjax.training import evaluation
from memjax import model as model_lib
from memjax.training import step as train_step_lib
from memjax.training import loop as trainer
from memjax.training import experiment as experiment_lib
from memjax.training import run_files
import cli_fixtures
import training_fixtures

EVAL_TGT_LEN, EVAL_MEM_LEN, EVAL_CLAMP_LEN = 5, 6, 4


def split_bytes(corpus, split):
    with open(os.path.join(corpus, {'validation': 'valid.txt', 'test': 'test.txt'}[split]),
              'rb') as f:
        return f.read()


@pytest.fixture(scope='module')
def experiment(corpus, tmp_path_factory):
    """Eval overrides differ from training (tgt 8, mem 8, no clamp, no same_length)."""
    config = training_fixtures.tiny_config(
        corpus, eval__tgt_len=EVAL_TGT_LEN, eval__model__mem_len=EVAL_MEM_LEN,
        eval__model__clamp_len=EVAL_CLAMP_LEN, eval__model__same_length=True)
    exp = experiment_lib.setup(config, str(tmp_path_factory.mktemp('workdir')))
    state, _ = experiment_lib.init_state(exp)
    return exp, state.params, jax.jit(train_step_lib.eval_step_fn(exp.eval_model))


def naive_nll(exp, params, tokens):
    """One stream, one segment at a time, unpadded last segment, memory carried by hand: (nll sum,
    targets, targets that are the most probable token)."""
    mcfg = exp.mcfg.replace(mem_len=EVAL_MEM_LEN, clamp_len=EVAL_CLAMP_LEN, same_length=True)
    model = model_lib.build_model(mcfg)
    apply = jax.jit(lambda p, x, m, y, r: model.apply({'params': p}, x, m, targets=y, reset=r))
    logprobs = jax.jit(lambda p, h: model.apply({'params': p}, h, method=model.logprobs))
    memory = model_lib.init_memory(mcfg, 1)
    total, count, correct = 0.0, 0, 0
    for start in range(0, len(tokens) - 1, EVAL_TGT_LEN):
        targets = tokens[start + 1:start + 1 + EVAL_TGT_LEN]
        inputs = tokens[start:start + len(targets)]
        out, memory = apply(params, inputs[None], memory, targets[None], np.array([start == 0]))
        total -= float(np.sum(np.asarray(out.target_logprobs, np.float64)))
        count += len(targets)
        correct += int(np.sum(np.argmax(np.asarray(logprobs(params, out.hidden))[0], axis=-1) == targets))
    return total, count, correct


@pytest.mark.parametrize('batch_size', [1, 3])
def test_every_target_of_the_split_is_scored_once(corpus, experiment, batch_size):
    exp, params, eval_step = experiment
    config = exp.config.copy_and_resolve_references()
    config.eval.batch_size = batch_size
    streams = evaluation.eval_streams(config, exp.tokenizer, 'validation')
    result = evaluation.evaluate_streams(eval_step, params, exp.eval_mcfg, streams, batch_size)
    expected = len(split_bytes(corpus, 'validation')) - 1  # Byte tokens; the first is no target.
    assert result.num_tokens == expected == streams.num_target_tokens


def test_single_stream_equals_naive_segment_loop_with_accuracy(corpus, experiment):
    exp, params, _ = experiment
    config = exp.config.copy_and_resolve_references()
    config.eval.batch_size = 1
    streams = evaluation.eval_streams(config, exp.tokenizer, 'validation')
    eval_step = jax.jit(train_step_lib.eval_step_fn(exp.eval_model, accuracy=True))  # config.eval.accuracy
    result = evaluation.evaluate_streams(eval_step, params, exp.eval_mcfg, streams, 1)
    tokens = np.frombuffer(split_bytes(corpus, 'validation'), np.uint8).astype(np.int32)
    total, count, correct = naive_nll(exp, params, tokens)
    assert result.num_tokens == count
    assert result.nll_sum == pytest.approx(total, rel=1e-5)
    assert result.num_correct == correct > 0 and result.accuracy == correct / count


def test_max_batches_limits_the_pass(experiment):
    exp, params, eval_step = experiment
    streams = evaluation.eval_streams(exp.run, exp.tokenizer, 'validation')
    local_batch = evaluation.local_eval_batch(exp.run)
    first = evaluation.evaluate_streams(eval_step, params, exp.eval_mcfg, streams, local_batch,
                                        max_batches=1)
    batch = next(iter(streams.iterator()))
    assert first.num_tokens == int(batch['mask'].sum())
    full = evaluation.evaluate_streams(eval_step, params, exp.eval_mcfg, streams, local_batch)
    assert full.num_tokens > first.num_tokens


def test_progress_lines_and_throughput_after_the_compiling_batch(experiment, monkeypatch):
    """A long evaluation says how far it is; its tokens/s leave out the first batch, which compiles."""
    exp, params, eval_step = experiment
    config = exp.config.copy_and_resolve_references()
    config.eval.batch_size = 1
    streams = evaluation.eval_streams(config, exp.tokenizer, 'validation')
    assert streams.num_batches > 3
    calls = []
    timed = lambda *args: calls.append(args) or eval_step(*args)
    lines = []
    monkeypatch.setattr(evaluation.logging, 'info', lambda message, *args: lines.append(message % args))
    monkeypatch.setattr(evaluation, 'PROGRESS_EVERY_S', 0.0)
    result = evaluation.evaluate_streams(timed, params, exp.eval_mcfg, streams, 1, max_batches=3)
    assert len(calls) == 3
    assert lines[0].startswith('evaluating validation: batch 2/3 | eta ') and lines[1].startswith(
        'evaluating validation: batch 3/3 | eta 0m00s')
    assert result.tokens_per_s > 0
    one = evaluation.evaluate_streams(eval_step, params, exp.eval_mcfg, streams, 1, max_batches=1)
    assert one.tokens_per_s is None  # Only the compiling batch: no throughput to report.


def test_evaluate_command_scores_test_split_from_checkpoint(corpus, tmp_path):
    workdir = str(tmp_path)
    config = training_fixtures.tiny_config(corpus, train__num_steps=2, train__eval_every=0,
                                           train__final_eval_batches=1, eval__split='test')
    with pytest.raises(errors.CheckpointError, match='no readable checkpoint'):
        evaluate.evaluate_checkpoint(config, workdir)
    trained = trainer.train_and_evaluate(config, workdir)
    # The final validation read its first batch only: what evaluating that many batches scores.
    first = evaluate.evaluate_checkpoint(training_fixtures.tiny_config(corpus, train__num_steps=2), workdir,
                                         out_path=str(tmp_path / 'first.json'), max_batches=1)
    assert first['num_tokens'] == trained['valid_tokens'] < len(split_bytes(corpus, 'validation')) - 1
    assert first['loss'] == pytest.approx(trained['valid_loss'], abs=1e-6)
    summary = evaluate.evaluate_checkpoint(config, workdir)
    assert summary['step'] == 2
    assert summary['num_tokens'] == len(split_bytes(corpus, 'test')) - 1
    assert summary['bpc'] == pytest.approx(summary['loss'] / np.log(2))
    with open(os.path.join(workdir, 'eval_test.json')) as f:
        assert json.load(f)['num_tokens'] == summary['num_tokens']
    # Evaluated again with another memory: the file holds the newest result, the history both, and
    # the training summary before them.
    other = evaluate.evaluate_checkpoint(training_fixtures.tiny_config(
        corpus, train__num_steps=2, eval__split='test', eval__model__mem_len=4), workdir)
    with open(os.path.join(workdir, 'eval_test.json')) as f:
        assert json.load(f)['settings']['mem_len'] == 4
    with open(os.path.join(workdir, run_files.HISTORY_FILE)) as f:
        history = [json.loads(line) for line in f]
    assert [(h['file'], h.get('loss', h.get('valid_loss'))) for h in history] == [
        ('train_summary.json', trained['valid_loss']), ('first.json', first['loss']),
        ('eval_test.json', summary['loss']), ('eval_test.json', other['loss'])]
    assert history[2]['settings']['mem_len'] == 8 and other['loss'] != summary['loss']
    # The command without --config: the workdir's own config (its split, test), the override on top.
    done = subprocess.run([sys.executable, '-m', 'memjax.evaluate', f'--workdir={workdir}',
                           '--config.eval.model.mem_len=4'], env=cli_fixtures.cpu_env(1), capture_output=True,
                          text=True, timeout=cli_fixtures.RUN_TIMEOUT_S, cwd=training_fixtures.REPO, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    printed = json.loads(done.stdout)  # Its stdout is the result alone (no library's notes).
    assert (printed['split'], printed['settings']['mem_len'], printed['num_tokens']) == ('test', 4, other['num_tokens'])
    assert printed['loss'] == pytest.approx(other['loss'], abs=1e-6)
    # What it is about to do, then what the first seconds go to, then the result; no TFDS notes.
    said = [line.split('] ', 1)[-1] for line in done.stderr.splitlines()]
    starts = [next(i for i, line in enumerate(said) if line.startswith(text)) for text in (
        f'Evaluating step 2 of {workdir} on the test split: {other["num_tokens"]:,} target tokens',
        'Compiling the evaluation step', 'eval test at step 2')]
    assert starts == sorted(starts) and 'dataset_info.py' not in done.stderr


def test_evaluation_reads_the_parameters_in_either_layer_layout(corpus, tmp_path):
    """A run trained with its layers scanned (configs/*_large.py) evaluates under a config without
    the scan and the other way round: the layout is compilation's choice, the model the same."""
    scores = {}
    for trained_scanned in (True, False):
        workdir = str(tmp_path / f'scanned_{trained_scanned}')
        config = training_fixtures.tiny_config(corpus, train__num_steps=2, train__eval_every=0,
                                               train__final_eval_batches=1, model__scan_layers=trained_scanned)
        trainer.train_and_evaluate(config, workdir)
        for evaluated_scanned in (True, False):
            scores[trained_scanned, evaluated_scanned] = evaluate.evaluate_checkpoint(
                training_fixtures.tiny_config(corpus, train__num_steps=2, model__scan_layers=evaluated_scanned),
                workdir, out_path=str(tmp_path / f'{trained_scanned}_{evaluated_scanned}.json'))['loss']
    for trained_scanned in (True, False):
        assert scores[trained_scanned, not trained_scanned] == pytest.approx(scores[trained_scanned, trained_scanned],
                                                                             rel=1e-6)
