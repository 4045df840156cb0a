"""memjax.compare: every method at one budget, resumable, failures reported, parameters matched."""

import os
import types

import numpy as np
import pytest

from memjax import compare
from memjax import config_lib
from memjax import errors
import training_fixtures


def tiny_comparison(corpus: str, methods=('none', 'xl', 'trams')):
    config = training_fixtures.tiny_config(corpus, train__num_steps=4, train__eval_every=0,
                                           train__checkpoint_every=0, model__mem_len=8)
    config.compare = {'methods': methods, 'seeds': 1, 'eval_mem_lens': (8, 16), 'match_params': True}
    return config


@pytest.fixture(scope='module')
def compared(corpus, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp('compare'))
    return workdir, compare.run_comparison(tiny_comparison(corpus), workdir)


def test_every_method_is_scored_at_every_memory_and_trams_runs_on_the_xl_run(compared):
    workdir, report = compared
    assert not report['failures']
    rows = {(r['method'], r['eval_mem_len']): r for r in report['rows']}
    assert set(rows) == {(m, n) for m in ('none', 'xl', 'trams') for n in (8, 16)}
    assert rows[('none', 8)]['loss'] == rows[('none', 16)]['loss']  # Nothing to remember.
    assert rows[('xl', 16)]['loss'] != rows[('xl', 8)]['loss']
    # TRAMS trains nothing: it evaluates the XL run, whose parameters and training figures it shares.
    assert not os.path.exists(os.path.join(workdir, 'trams'))
    assert os.path.exists(os.path.join(workdir, 'xl', 'seed0', 'compare_eval_trams_mem16.json'))
    for key in ('train_tokens_per_s', 'params', 'step_memory_bytes'):
        assert rows[('trams', 8)][key] == rows[('xl', 8)][key]
    assert rows[('xl', 8)]['step_memory_bytes'] > 0 and rows[('xl', 8)]['params'] > 0


def test_the_table_gives_each_methods_mean_and_half_range(compared):
    workdir, report = compared
    with open(os.path.join(workdir, 'comparison.md')) as f:
        text = f.read()
    row = next(r for r in report['rows'] if (r['method'], r['eval_mem_len']) == ('xl', 16))
    assert f'| xl | 16 | {row["loss"]:.4f} ± 0.0000 (1) | {row["metric"]:.4f} |' in text
    assert (np.array([r['loss'] for r in report['rows']]) > 0).all()


def test_a_second_run_reads_everything_back(compared, corpus):
    workdir, report = compared
    checkpoints = os.path.join(workdir, 'xl', 'seed0', 'checkpoints')
    before = {name: os.stat(os.path.join(checkpoints, name)).st_mtime_ns for name in os.listdir(checkpoints)}
    again = compare.run_comparison(tiny_comparison(corpus), workdir)
    assert again['rows'] == report['rows']
    assert before == {name: os.stat(os.path.join(checkpoints, name)).st_mtime_ns for name in os.listdir(checkpoints)}


def test_a_failing_method_is_reported_the_others_go_on_and_the_command_fails(corpus, tmp_path, monkeypatch):
    monkeypatch.setitem(compare.METHODS, 'broken', compare.Method(model=lambda c: {'memory': 'lamemo'}))
    train_one = compare.train_one

    def failing(config, workdir):
        if '/broken/' in workdir:
            raise RuntimeError('the disk is full')
        return train_one(config, workdir)

    monkeypatch.setattr(compare, 'train_one', failing)
    report = compare.run_comparison(tiny_comparison(corpus, methods=('broken', 'none')), str(tmp_path))
    assert set(report['failures']) == {'broken/seed0'} and 'disk is full' in report['failures']['broken/seed0']
    assert {r['method'] for r in report['rows']} == {'none'}
    # The command reports the holes with a failing status, for scripts and schedulers.
    monkeypatch.setattr(compare.cli, 'load_config', lambda flag: tiny_comparison(corpus, methods=('none',)))
    monkeypatch.setattr(compare.cli, 'run', lambda job: report)
    monkeypatch.setattr(compare.evaluate, 'WORKDIR', types.SimpleNamespace(value=str(tmp_path)))
    with pytest.raises(SystemExit) as stopped:
        compare.main(['compare'])
    assert stopped.value.code == errors.EXIT_RUNTIME


@pytest.mark.parametrize('compare_fields, message', [
    ({'eval_mem_lens': (-5,)}, 'xl at eval memory -5: invalid config'),
    ({'eval_mem_lens': ()}, 'compare.eval_mem_lens is empty'),
    ({'methods': ()}, 'compare.methods is empty'),
    ({'methods': ('xl', 'lstm')}, "compare.methods has unknown ['lstm']"),
    ({'methods': ('trams',)}, "compare.methods needs ['xl']"),
])
def test_a_bad_comparison_is_refused_before_anything_trains(corpus, tmp_path, compare_fields, message):
    config = tiny_comparison(corpus, methods=('xl',))
    config.compare.update(compare_fields)
    with pytest.raises(errors.ConfigError) as refused:
        compare.run_comparison(config, str(tmp_path))
    assert message in str(refused.value)
    assert not os.listdir(tmp_path)


def test_a_methods_own_bad_field_is_refused_before_anything_trains(corpus, tmp_path, monkeypatch):
    broken = compare.Method(model=lambda c: {'memory': 'lamemo', 'lamemo_eps': -1.0})
    monkeypatch.setitem(compare.METHODS, 'broken', broken)
    with pytest.raises(errors.ConfigError, match='compare: broken at eval memory 8: .*lamemo_eps'):
        compare.run_comparison(tiny_comparison(corpus, methods=('none', 'broken')), str(tmp_path))
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize('method', ['lamemo', 'infinity', 'cross_head'])
def test_matched_models_have_transformer_xls_parameter_count(method):
    config = config_lib.base_config()
    config.model.update(vocab_size=256, d_model=64, n_layer=2, n_head=4, d_head=16, d_inner=512, mem_len=16,
                        ltm_basis=16, ltm_samples=16)
    config.compare = {'methods': ('xl', method), 'seeds': 1, 'eval_mem_lens': (-1,), 'match_params': True}
    target = compare.parameter_count(compare.run_config(config, 'xl', 0))
    run = compare.run_config(config, method, 0)
    run.model.d_inner = compare.matched_d_inner(run, target)
    assert abs(compare.parameter_count(run) - target) / target < 0.01
