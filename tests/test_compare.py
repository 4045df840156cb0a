"""memjax.compare: every method at one budget, resumable, failures reported, parameters matched."""

import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import sys
import types

import ml_collections
import numpy as np
import pytest

from memjax import compare
from memjax import compare_report
from memjax import config_lib
from memjax import errors
from memjax.analysis import recl as recl_lib
from memjax.data import factory
from memjax.data import pipeline
from memjax.training import metrics
import cli_fixtures
import disks
import training_fixtures


def tiny_comparison(corpus: str, methods=('none', 'xl', 'trams')):
    config = training_fixtures.tiny_config(corpus, train__num_steps=4, train__eval_every=0,
                                           train__checkpoint_every=0, model__mem_len=8)
    config.compare = {'methods': methods, 'seeds': 1, 'eval_mem_lens': (8, 16), 'clamp_lens': (-1, -2),
                      'match_params': True}
    return config


@pytest.fixture(scope='module')
def compared(corpus, tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp('compare'))
    return workdir, compare.run_comparison(tiny_comparison(corpus), workdir)


def test_every_method_is_scored_at_every_memory_and_trams_runs_on_the_xl_run(compared):
    workdir, report = compared
    assert not report['failures']
    rows = {(r['method'], r['eval_mem_len'], r['clamp']): r for r in report['rows']}
    assert set(rows) == {(m, n, c) for m in ('none', 'xl', 'trams') for n in (8, 16) for c in (-1, -2)}
    assert rows[('none', 8, -1)]['loss'] == rows[('none', 16, -1)]['loss']  # Nothing to remember.
    assert rows[('xl', 16, -1)]['loss'] != rows[('xl', 8, -1)]['loss']
    # TRAMS trains nothing: it evaluates the XL run, whose parameters and training figures it shares.
    assert not os.path.exists(os.path.join(workdir, 'trams'))
    assert os.path.exists(os.path.join(workdir, 'xl', 'seed0', 'compare_eval_trams_mem16.json'))
    for key in ('train_tokens_per_s', 'params', 'step_memory_bytes'):
        assert rows[('trams', 8, -1)][key] == rows[('xl', 8, -1)][key]
    assert rows[('xl', 8, -1)]['step_memory_bytes'] > 0 and rows[('xl', 8, -1)]['params'] > 0


def test_longer_memory_rows_carry_the_clamp_at_the_trained_maximum(compared):
    """configs/tiny.py trains segments and memory of 8: distances 0-15."""
    workdir, report = compared
    rows = {(r['method'], r['eval_mem_len'], r['clamp']): r for r in report['rows']}
    for method in ('xl', 'trams'):
        longer = rows[(method, 16, -2)]
        assert longer['clamp_in_effect'] == 8 + 8 - 1
        with open(os.path.join(workdir, 'xl', 'seed0', f'compare_eval_{method}_mem16_clamp15.json')) as f:
            assert json.load(f)['settings']['clamp_len'] == 15  # What the evaluation ran with.
        assert longer['loss'] != rows[(method, 16, -1)]['loss']
    # XL at the trained memory clamps nothing: one evaluation serves both rows.
    assert rows[('xl', 8, -2)]['clamp_in_effect'] == -1
    assert rows[('xl', 8, -2)]['loss'] == rows[('xl', 8, -1)]['loss']
    assert not os.path.exists(os.path.join(workdir, 'xl', 'seed0', 'compare_eval_xl_mem8_clamp15.json'))
    # TRAMS attending 8 selects from a pool of 16, whose true distances reach 16 + 8 - 1.
    assert rows[('trams', 8, -2)]['clamp_in_effect'] == 15
    with open(os.path.join(workdir, 'comparison.md')) as f:
        text = f.read()
    assert f'| xl | 16 | trained: 15 | {rows[("xl", 16, -2)]["loss"]:.4f} ± 0.0000 (1) |' in text
    assert f'| xl | 8 | trained: not reached | {rows[("xl", 8, -1)]["loss"]:.4f} ± 0.0000 (1) |' in text


def test_the_table_gives_each_methods_mean_and_half_range(compared):
    workdir, report = compared
    with open(os.path.join(workdir, 'comparison.md')) as f:
        text = f.read()
    row = next(r for r in report['rows'] if (r['method'], r['eval_mem_len'], r['clamp']) == ('xl', 16, -1))
    assert f'| xl | 16 | none | {row["loss"]:.4f} ± 0.0000 (1) | {row["metric"]:.4f} |' in text
    assert (np.array([r['loss'] for r in report['rows']]) > 0).all()


def test_the_table_names_the_methods_that_have_not_learned(compared):
    """Four updates leave every model short of a unigram model: the table says so, and with one seed
    that no gap can be told from noise."""
    workdir, report = compared
    run = config_lib.resolve(ml_collections.ConfigDict({k: v for k, v in report['config'].items() if k != 'compare'}))
    tokenizer = factory.build_tokenizer(run.data, os.path.join(workdir, 'xl', 'seed0'), save=False)
    train = pipeline.load_token_ids(run.data, 'train', tokenizer)[0].tolist()
    scored = pipeline.load_token_ids(run.data, 'validation', tokenizer)[0].tolist()
    counts = {}
    for token in train:
        counts[token] = counts.get(token, 0) + 1
    total = len(train) + tokenizer.vocab_size
    naive = -sum(math.log((counts.get(token, 0) + 1) / total) for token in scored) / len(scored)
    assert report['unigram_loss'] == pytest.approx(naive, rel=1e-9)
    behind = sorted({r['method'] for r in report['rows'] if r['loss'] >= naive})
    assert behind == ['none', 'trams', 'xl']
    with open(os.path.join(workdir, 'comparison.md')) as f:
        text = f.read()
    assert f'Not learned: {", ".join(behind)} (loss at or above {naive:.4f} nats' in text
    assert 'One seed per method: no gap in this table can be told from seed noise' in text


def _row(method, seed, loss):
    return {'method': method, 'seed': seed, 'eval_mem_len': 64, 'clamp': -2, 'clamp_in_effect': -1, 'loss': loss}


def test_gaps_inside_the_seed_spread_are_named_and_learned_methods_are_not():
    report = {'unigram_loss': 3.0, 'rows': [_row('xl', 0, 1.30), _row('xl', 1, 1.34), _row('lamemo', 0, 1.33),
                                            _row('lamemo', 1, 1.35), _row('none', 0, 1.40), _row('none', 1, 1.41)]}
    notes = compare_report.notes(report, seeds=2)
    # xl [1.30, 1.34] and lamemo [1.33, 1.35] overlap; none [1.40, 1.41] stands apart.
    assert notes == ["Within the seeds' spread at eval memory 64, clamp_len trained: xl and lamemo "
                     '(their seed ranges overlap).']
    apart = dict(report, rows=[r for r in report['rows'] if r['method'] != 'lamemo'])
    assert compare_report.notes(apart, seeds=2) == []


def test_a_curve_joins_only_validations_of_the_same_amount(tmp_path):
    """The periodic validations read eval_batches; the final one may read the whole split."""
    writer = metrics.MetricWriter(str(tmp_path))
    for step, loss, tokens in ((10, 2.0, 640), (20, 1.75, 640), (30, 1.5, 640), (40, 1.25, 5000)):
        writer.write_scalars(step, 'valid', {'loss': loss, 'num_tokens': tokens})
    writer.close()
    assert compare_report.curve(str(tmp_path))['valid'] == [(10, 2.0), (20, 1.75), (30, 1.5)]


def test_a_second_run_reads_everything_back(compared, corpus):
    workdir, report = compared
    checkpoints = os.path.join(workdir, 'xl', 'seed0', 'checkpoints')
    before = {name: os.stat(os.path.join(checkpoints, name)).st_mtime_ns for name in os.listdir(checkpoints)}
    again = compare.run_comparison(tiny_comparison(corpus), workdir)
    assert again['rows'] == report['rows']
    assert before == {name: os.stat(os.path.join(checkpoints, name)).st_mtime_ns for name in os.listdir(checkpoints)}


def test_a_changed_model_is_refused_before_anything_trains_and_more_steps_train_on(compared, corpus, tmp_path):
    """The runs' records are read back for the config they were made with only: a model their
    checkpoints cannot resume with is refused in one line before anything trains or is written, as
    memjax.train refuses it; more steps resume the runs and score them again."""
    workdir = str(tmp_path / 'copy')
    shutil.copytree(compared[0], workdir)
    files = lambda: {os.path.join(root, name): open(os.path.join(root, name), 'rb').read()
                     for root, _, names in os.walk(workdir) for name in names if not name.startswith('memjax.')}
    before = files()
    wider = training_fixtures.override(tiny_comparison(corpus), model__d_model=64, model__d_inner=128)
    with pytest.raises(errors.ConfigError, match=r'model\.d_model \d+ -> 64'):
        compare.run_comparison(wider, workdir)
    assert files() == before
    longer = compare.run_comparison(training_fixtures.override(tiny_comparison(corpus), train__num_steps=6), workdir)
    assert not longer['failures']
    with open(os.path.join(workdir, 'xl', 'seed0', 'compare_train.json')) as f:
        assert json.load(f)['step'] == 6
    losses = lambda report: {(r['method'], r['eval_mem_len'], r['clamp']): r['loss'] for r in report['rows']}
    assert losses(longer).keys() == losses(compared[1]).keys()
    assert all(losses(longer)[key] != loss for key, loss in losses(compared[1]).items())


def test_asked_for_recl_the_table_gains_each_methods_recl_from_one_group(compared, corpus, tmp_path,
                                                                       caplog):
    """Run again with RECL contexts, a comparison trains and evaluates nothing again and adds the
    RECL of every method from one group per seed: the run without memory (scored by windows), the
    XL run, and the XL run scored as TRAMS."""
    workdir = str(tmp_path / 'copy')
    shutil.copytree(compared[0], workdir)
    config = tiny_comparison(corpus)
    config.compare.update({'recl_contexts': (4, 8), 'recl_rs': (0.5, 1.0), 'recl_batches': 1})
    with caplog.at_level(logging.WARNING):
        report = compare.run_comparison(config, workdir)
    assert report['rows'] == compared[1]['rows'] and not report['failures']
    # TRAMS at context 8 scores its chosen rows beyond the trained distances: the warning names the
    # comparison's own setting for the clamp its RECL uses.
    warned = [r.getMessage() for r in caplog.records if 'extrapolated' in r.getMessage()]
    assert warned and all("--config.compare.clamp_lens='(-2, ...)' clamps them" in m for m in warned), warned
    run = lambda method: os.path.join(workdir, method, 'seed0')
    group = recl_lib.group_recl([run('none'), run('xl'), run('xl') + '@trams'], [4, 8], [0.5, 1.0],
                                str(tmp_path / 'scored_again'), max_batches=1)
    assert group.kinds == ['none', 'xl', 'trams']
    for method, found in zip(('none', 'xl', 'trams'), group.recl):
        assert report['recl']['methods'][method] == {0: {str(r): dataclasses.asdict(x) for r, x in found.items()}}
    assert report['recl']['num_tokens'] == group.num_tokens
    with open(os.path.join(workdir, 'comparison.md')) as f:
        text = f.read()
    assert ' RECL r = 0.5 | RECL r = 1 |' in text and 'contexts 4, 8, clamp_len -1 (the rows of that clamp);' in text
    cell = lambda found: f'{"" if found.converged else ">= "}{found.context}'
    trams_row = next(line for line in text.splitlines() if line.startswith('| trams | 16 |'))
    assert trams_row.endswith(f' {cell(group.recl[2][0.5])} | {cell(group.recl[2][1.0])} |')
    with open(os.path.join(workdir, 'recl', 'seed0', 'recl.md')) as f:
        group_table = f.read()
    assert f'| {run("xl")}@trams | trams |' in group_table and f'| {run("none")} | none |' in group_table
    # Other clamps' rows leave the RECL cells empty: RECL was scored with the first clamp only.
    other_clamp = next(line for line in text.splitlines() if line.startswith('| xl | 16 | trained'))
    assert other_clamp.endswith(' |  |  |')


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
    ({'eval_mem_lens': (-5,)}, 'xl at eval memory -5, clamp_len -1: invalid config'),
    ({'eval_mem_lens': ()}, 'compare.eval_mem_lens is empty'),
    ({'methods': ()}, 'compare.methods is empty'),
    ({'methods': ('xl', 'lstm')}, "compare.methods has unknown ['lstm']"),
    ({'methods': ('trams',)}, "compare.methods needs ['xl']"),
    ({'clamp_lens': ()}, 'compare.clamp_lens is empty'),
    ({'clamp_lens': (-3,)}, 'xl at eval memory 8, clamp_len -3: invalid config'),
    ({'recl_contexts': (8,)}, 'compare.recl_contexts=(8,): give at least two increasing lengths'),
    ({'recl_contexts': (8, 4)}, 'compare.recl_contexts=(8, 4): give at least two increasing lengths'),
    ({'recl_contexts': (4, 8), 'recl_rs': (0.0,)}, 'compare.recl_rs=(0.0,): each share must be in (0, 1]'),
    ({'recl_contexts': (4, 8), 'recl_batches': 0}, 'compare.recl_batches=0: give -1'),
])
def test_a_bad_comparison_is_refused_before_anything_trains(corpus, tmp_path, compare_fields, message):
    config = tiny_comparison(corpus, methods=('xl',))
    config.compare.update(compare_fields)
    with pytest.raises(errors.ConfigError) as refused:
        compare.run_comparison(config, str(tmp_path))
    assert message in str(refused.value)
    assert not os.listdir(tmp_path)


def test_recl_on_several_processes_is_refused_before_anything_trains(corpus, tmp_path, monkeypatch):
    """Each process reads its own streams: its RECL would count its share of the tokens, and every
    process would write the same loss files. The command and the comparison refuse it up front."""
    monkeypatch.setattr(compare.jax, 'process_count', lambda: 2)
    config = tiny_comparison(corpus, methods=('xl',))
    config.compare.recl_contexts = (4, 8)
    with pytest.raises(errors.ConfigError, match=r'RECL is scored in one process.* Give \(\) here on 2 processes'):
        compare.run_comparison(config, str(tmp_path))
    with pytest.raises(errors.UsageError, match='RECL is scored in one process'):
        recl_lib.group_recl([str(tmp_path / 'a'), str(tmp_path / 'b')], [4, 8], [1.0], str(tmp_path / 'recl'))
    assert not os.listdir(tmp_path)


def test_a_methods_own_bad_field_is_refused_before_anything_trains(corpus, tmp_path, monkeypatch):
    broken = compare.Method(model=lambda c: {'memory': 'lamemo', 'lamemo_eps': -1.0})
    monkeypatch.setitem(compare.METHODS, 'broken', broken)
    with pytest.raises(errors.ConfigError, match='compare: broken at eval memory 8, clamp_len -1: .*lamemo_eps'):
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


def test_methods_with_transformer_xls_parameter_count_keep_its_d_inner():
    """A d_inner that is not a multiple of 8 (Transformer-XL base's 2100) stays for the methods whose
    model has XL's parameters, however d_inner is searched for the others."""
    config = config_lib.base_config()
    config.model.update(vocab_size=256, d_model=32, n_layer=2, n_head=2, d_head=16, d_inner=100, mem_len=8)
    config.compare = {'methods': ('xl', 'none', 'skip_retain', 'cross_head'), 'seeds': 1, 'eval_mem_lens': (-1,),
                      'match_params': True}
    target = compare.parameter_count(compare.run_config(config, 'xl', 0))
    for method in ('none', 'skip_retain', 'cross_head'):
        run = compare.run_config(config, method, 0)
        assert compare.parameter_count(run) == target, method
        assert compare.matched_d_inner(run, target) == 100, method


def test_a_preset_with_an_adaptive_softmax_matches_before_its_vocabulary_is_known():
    """:wt103's cutoffs reach past any stand-in vocabulary of 256 tokens: matching sizes its models
    with a vocabulary the cutoffs allow (the tokenizer has not counted the words yet)."""
    from configs import compare_kjv  # pylint: disable=import-outside-toplevel
    config = compare_kjv.get_config('wt103')
    config.model.n_layer = 2  # The depth does not change what is checked; it is quicker to trace.
    config.compare.methods = ('xl', 'lamemo')
    config.compare.seeds = 1
    assert config.model.vocab_size < 1 and config.model.cutoffs[-1] > 256
    runs = {method: run for method, _, run in compare._trained_runs(config, config.compare)}  # pylint: disable=protected-access
    assert not any(isinstance(run, Exception) for run in runs.values()), runs
    target = compare.parameter_count(runs['xl'])
    assert abs(compare.parameter_count(runs['lamemo']) - target) / target < 0.01


def test_a_damaged_or_partial_run_record_is_one_named_failure(compared, tmp_path, corpus):
    """A run's compare_train.json cut short, or a preempted run's summary as an older compare kept it,
    is not read as finished: one line names the file and the fix; the other methods go on."""
    workdir = str(tmp_path / 'copy')
    shutil.copytree(compared[0], workdir)
    record = os.path.join(workdir, 'xl', 'seed0', 'compare_train.json')
    for damage in ('{"train_tokens_per_s": 1', '{"preempted": true, "step": 101}'):
        with open(record, 'w') as f:
            f.write(damage)
        report = compare.run_comparison(tiny_comparison(corpus), workdir)
        why = report['failures']['xl/seed0']
        assert f'{record} is damaged or not a finished run' in why and 'delete it and run the same command' in why
        assert {r['method'] for r in report['rows']} == {'none'}  # TRAMS evaluates the XL run: reported too.
        assert 'trams/seed0' in report['failures']


def test_sigterm_stops_the_comparison_after_the_checkpoint_and_a_second_comparison_is_refused(tmp_path):
    """The probes: SIGTERM during a method's training; a second compare on the same workdir."""
    workdir, data = str(tmp_path / 'cmp'), str(tmp_path / 'data')
    command = [sys.executable, '-m', 'memjax.compare', '--config=configs/compare_kjv.py:smoke', f'--workdir={workdir}',
               f'--config.data.data_dir={data}', "--config.compare.methods=('none',)",
               '--config.compare.seeds=1', '--config.compare.eval_mem_lens=(16,)',
               '--config.model.n_layer=2']  # Quicker to compile and run; the depth changes nothing checked here.
    env = cli_fixtures.cpu_env(1)
    first = cli_fixtures.Run(command, env, str(tmp_path / 'first.log'))
    first.wait_for_text('step 20/60')
    # Held still meanwhile (its lock held), so that its training cannot end before the SIGTERM.
    first.process.send_signal(signal.SIGSTOP)
    second = cli_fixtures.checked(cli_fixtures.Run(command, env, str(tmp_path / 'second.log')), errors.EXIT_RUNTIME)
    assert 'in use by another comparison' in second and 'Traceback' not in second
    assert len([line for line in second.splitlines() if 'Workdir error' in line]) == 1
    first.process.send_signal(signal.SIGTERM)
    first.process.send_signal(signal.SIGCONT)
    log = cli_fixtures.checked(first, 0)
    assert 'Stopped by SIGTERM' in log and 'Traceback' not in log
    run = os.path.join(workdir, 'none', 'seed0')
    assert os.listdir(os.path.join(run, 'checkpoints'))  # Saved at the step boundary.
    # Not recorded as finished, and nothing after it (its evaluation, the report) was started or written.
    assert not os.path.exists(os.path.join(run, 'compare_train.json'))
    assert not [n for n in os.listdir(run) if n.startswith('compare_eval')]
    assert not os.path.exists(os.path.join(workdir, 'comparison.json'))
    again = cli_fixtures.checked(cli_fixtures.Run(command, env, str(tmp_path / 'again.log')), 0)
    assert 'Resumed from' in again
    with open(os.path.join(workdir, 'comparison.json')) as f:
        assert not json.load(f)['failures']


def test_a_finished_comparison_on_a_read_only_disk_is_one_line(compared, tmp_path, corpus):
    """The probe: the workdir of a finished comparison, then mounted read-only (a tmpfs; skipped
    where this machine cannot mount one)."""
    with disks.small_disk(tmp_path / 'disk', 64 * 1024, read_only=True, holding=compared[0]) as disk:
        with pytest.raises(errors.WorkdirError, match='is not writable: fix its permissions'):
            compare.run_comparison(tiny_comparison(corpus), disk)
