"""A computed result is never lost: a full disk is found before the work, a write that fails after
it prints the result and keeps a copy, a read-only folder is one line. The disks are real: a small
tmpfs mounted for the test (skipped where this machine cannot mount one)."""

import json
import os

import pytest

from memjax import errors
from memjax import evaluate
from memjax.runtime import storage
from memjax.training import evaluation
from memjax.training import loop as trainer
import training_fixtures
from disks import fill, small_disk


@pytest.fixture(scope='module')
def trained(corpus, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp('run'))
    config = training_fixtures.tiny_config(corpus, train__num_steps=2, train__eval_every=0, train__final_eval_batches=1)
    trainer.train_and_evaluate(config, workdir)
    return config, workdir


def test_a_full_disk_is_refused_before_the_evaluation_runs(trained, tmp_path, monkeypatch):
    config, workdir = trained
    monkeypatch.setattr(evaluation, 'evaluate_streams', lambda *a, **k: pytest.fail('evaluated onto a full disk'))
    with small_disk(tmp_path / 'disk', 64) as disk:
        fill(disk)
        with pytest.raises(errors.WorkdirError, match=r'has 0 bytes free and the result needs about'):
            evaluate.evaluate_checkpoint(config, workdir, out_path=os.path.join(disk, 'eval.json'), max_batches=1)


def test_a_write_that_fails_after_the_evaluation_prints_the_result_and_keeps_it(trained, tmp_path, monkeypatch,
                                                                                 capsys):
    config, workdir = trained
    run_streams = evaluation.evaluate_streams
    with small_disk(tmp_path / 'disk', 128) as disk:
        def fill_meanwhile(*args, **kwargs):  # Another writer takes the space while it runs.
            result = run_streams(*args, **kwargs)
            fill(disk)
            return result

        monkeypatch.setattr(evaluation, 'evaluate_streams', fill_meanwhile)
        target = os.path.join(disk, 'eval.json')
        with pytest.raises(errors.WorkdirError) as refused:
            evaluate.evaluate_checkpoint(config, workdir, out_path=target, max_batches=1)
        message = str(refused.value)
        assert f'could not write {target} (No space left on device)' in message and '\n' not in message
        out = capsys.readouterr().out
        printed = json.loads(out[out.index('{\n'):])  # After anything else the command printed.
        kept = message.split(' and kept in ')[1].split(';')[0]
        with open(kept) as f:  # Beside the target when the failed write freed room, else in /tmp.
            assert json.load(f) == printed and printed['num_tokens'] > 0 and printed['loss'] > 0
        assert {'eval.json', 'eval.json.tmp'} & {n[:13] for n in os.listdir(disk)} == set()  # No partial file.
        os.remove(kept)


def test_a_failed_write_leaves_the_previous_result_whole(tmp_path):
    with small_disk(tmp_path / 'disk', 64) as disk:
        target = os.path.join(disk, 'result.json')
        storage.write_result(target, '{"loss": 1.0}')
        fill(disk)
        new = json.dumps({'loss': 2.0, 'pad': 'x' * 8192})
        with pytest.raises(errors.WorkdirError) as refused:
            storage.write_result(target, new)
        with open(target) as f:
            assert json.load(f) == {'loss': 1.0}
        # No temporary part is left; the new result is kept whole where there was room for it.
        assert not [n for n in os.listdir(disk) if '.tmp' in n]
        kept = str(refused.value).split(' and kept in ')[1].split(';')[0]
        with open(kept) as f:
            assert f.read() == new
        # The copy that did not fit beside the target left nothing there (an empty file would pass for it).
        assert [n for n in os.listdir(disk) if n.endswith('.unsaved')] == (
            [os.path.basename(kept)] if os.path.dirname(kept) == disk else [])
        os.remove(kept)


def test_a_read_only_folder_is_one_line_before_the_evaluation(trained, tmp_path, monkeypatch):
    config, workdir = trained
    monkeypatch.setattr(evaluation, 'evaluate_streams', lambda *a, **k: pytest.fail('evaluated into a read-only folder'))
    with small_disk(tmp_path / 'disk', 64, read_only=True) as disk:
        with pytest.raises(errors.WorkdirError, match='cannot write .*eval.json: fix the permissions'):
            evaluate.evaluate_checkpoint(config, workdir, out_path=os.path.join(disk, 'eval.json'), max_batches=1)
