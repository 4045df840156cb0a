"""Which config changes a resumed run or an evaluation accepts (memjax/training/resume.py), and the lock
that keeps two training runs out of one workdir (memjax/training/run_lock.py)."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from memjax import config_lib
from memjax import errors
from memjax.training import resume
from memjax.training import workdir as workdir_lib
from memjax.training import run_lock
import training_fixtures


def saved_and_requested(**changes):
    """The base config as a checkpoint stores it (vocab resolved) and a requested copy with
    `changes` like train__batch_size=8 applied."""
    saved = resume.to_plain(config_lib.base_config())
    saved['model']['vocab_size'] = 256
    return saved, training_fixtures.override(config_lib.base_config(), **changes)


@pytest.mark.parametrize('changes', [
    dict(train__num_steps=5000, train__learning_rate=1e-3, train__warmup_steps=10),
    dict(eval__model__mem_len=640, eval__model__same_length=True, eval__split="test"),
    dict(mesh__data=2, mesh__tensor=4, train__grad_accum_steps=2),
    dict(model__dropout=0.3, model__remat='full', model__attention_impl='reference'),
    dict(model__init_std=0.005, model__proj_init_std=0.02),  # Read when parameters are initialised.
    dict(train__keep_checkpoints=10, train__log_every=1, data__data_dir='/elsewhere'),
    dict(train__clip_norm=1.0, train__weight_decay=0.0),  # Clipping stays on, decay stays off.
])
def test_schedule_logging_evaluation_and_placement_may_change_on_resume(changes, caplog):
    saved, requested = saved_and_requested(**changes)
    resume.check_resume(saved, requested, '/run', 'checkpoints/8')
    logged = ' '.join(r.getMessage() for r in caplog.records)
    for key in changes:
        name = key.replace('__', '.')
        if name not in ('train.clip_norm', 'train.weight_decay') or changes[key] != 0.0:
            assert name in logged


@pytest.mark.parametrize('changes, fields', [
    (dict(model__d_model=64), ['model.d_model 128 -> 64']),
    (dict(train__batch_size=32, train__tgt_len=128),
     ['train.batch_size 16 -> 32', 'train.tgt_len 64 -> 128']),
    (dict(model__mem_len=0), ['model.mem_len 64 -> 0']),
    (dict(data__tokenizer='char'), ["data.tokenizer 'byte' -> 'char'"]),
    (dict(seed=1), ['seed 0 -> 1']),
    (dict(model__compute_dtype='bfloat16'), ["model.compute_dtype 'float32' -> 'bfloat16'"]),  # Memory dtype.
    # Switching an optimizer term on or off changes the optimizer state's structure.
    (dict(train__clip_norm=0.0), ['train.clip_norm 0.25 -> 0.0']),
    (dict(train__weight_decay=0.1), ['train.weight_decay 0.0 -> 0.1']),
])
def test_state_shaping_changes_are_refused_with_every_field_and_the_ways_forward(changes, fields):
    saved, requested = saved_and_requested(**changes)
    with pytest.raises(errors.ConfigError) as error:
        resume.check_resume(saved, requested, '/run', '/run/checkpoints/8')
    message = str(error.value)
    for field in fields:
        assert field in message
    assert '--config.train.init_from=/run' in message and '\n' not in message


def test_vocab_size_from_the_tokenizer_and_fields_unknown_to_one_side_are_not_changes():
    saved, requested = saved_and_requested()
    del saved['train']['init_from']  # A checkpoint written before the field existed.
    saved['model']['retired_field'] = 1
    assert requested.model.vocab_size == -1 and saved['model']['vocab_size'] == 256
    assert resume.differences(saved, requested) == []


def test_an_infinity_run_saved_before_ltm_padding_existed_ran_with_even_padding():
    """The field's default changed what the LTM computes: such a run resumes only with the value it
    had ('even'); runs of other kinds never read it; evaluation may use either."""
    saved, requested = saved_and_requested(model__memory='infinity', model__mem_len=0)
    saved['model']['memory'] = 'infinity'
    saved['model']['mem_len'] = 0
    del saved['model']['ltm_padding']
    with pytest.raises(errors.ConfigError, match=r"model\.ltm_padding 'even' -> 'released'.*--config\.train"):
        resume.check_resume(saved, requested, '/run', '/run/checkpoints/8')
    requested.model.ltm_padding = 'even'
    resume.check_resume(saved, requested, '/run', '/run/checkpoints/8')
    resume.check_same_params(saved, training_fixtures.override(requested, model__ltm_padding='released'),
                             'ckpt/8', 'Evaluation')
    saved, requested = saved_and_requested()
    del saved['model']['ltm_padding']
    assert resume.differences(saved, requested) == []


def test_evaluation_compares_only_what_shapes_the_parameters():
    saved, requested = saved_and_requested(model__mem_len=640, model__same_length=True,
                                           model__dropout=0.0, train__batch_size=1,
                                           data__name='text')
    resume.check_same_params(saved, requested, 'ckpt/8', 'Evaluation')
    saved, requested = saved_and_requested(model__n_layer=2, data__sp_vocab_size=100)
    with pytest.raises(errors.ConfigError, match=r'data\.sp_vocab_size 8000 -> 100, model\.n_layer 4 -> 2'):
        resume.check_same_params(saved, requested, 'ckpt/8', 'Evaluation')


@pytest.mark.parametrize('purpose', ['Evaluation', 'config.train.init_from'])
def test_an_imported_model_is_read_with_a_config_file_of_its_shape(purpose):
    """An imported workdir's config holds its segment length resolved (memjax.import_transfo_xl);
    a config file leaves it to the data (-1) and may initialise otherwise: neither shapes a
    parameter. Another segment length given is not a parameter either; another width is."""
    saved, requested = saved_and_requested(model__init_std=0.005, model__proj_init_std=0.02)
    saved['model']['segment_len'] = saved['train']['tgt_len'] = 6
    resume.check_same_params(saved, requested, 'imported/checkpoints/0', purpose)
    resume.check_same_params(saved, training_fixtures.override(requested, model__segment_len=12),
                             'imported/checkpoints/0', purpose)
    with pytest.raises(errors.ConfigError, match=r'model\.d_model 128 -> 64'):
        resume.check_same_params(saved, training_fixtures.override(requested, model__d_model=64),
                                 'imported/checkpoints/0', purpose)


def test_second_run_on_a_workdir_is_refused_while_the_first_holds_it(tmp_path):
    first = run_lock.RunLock(str(tmp_path)).acquire()
    try:
        with pytest.raises(errors.WorkdirError, match=f'process {os.getpid()}'):
            run_lock.RunLock(str(tmp_path)).acquire()
    finally:
        first.release()
    assert not os.path.exists(first.path)
    with run_lock.RunLock(str(tmp_path)):  # Free again.
        pass


def test_lock_of_a_dead_process_or_with_an_old_heartbeat_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'],
                          capture_output=True, text=True, check=True)
    lock = run_lock.RunLock(str(tmp_path))
    with open(lock.path, 'w') as f:
        json.dump({'host': lock._owner['host'], 'pid': int(dead.stdout), 'started': 'then'}, f)
    with lock:
        assert json.load(open(lock.path))['pid'] == os.getpid()
    # A live holder on another host whose heartbeat stopped long ago (a lost node).
    with open(lock.path, 'w') as f:
        json.dump({'host': 'other-host', 'pid': os.getpid(), 'started': 'then'}, f)
    with pytest.raises(errors.WorkdirError, match='other-host'):
        run_lock.RunLock(str(tmp_path)).acquire()
    old = time.time() - run_lock.STALE_AFTER_S - 5
    os.utime(lock.path, (old, old))
    with run_lock.RunLock(str(tmp_path)):
        pass


def test_workdir_that_is_a_file_a_url_or_missing_for_evaluation_is_an_error(tmp_path, monkeypatch):
    a_file = tmp_path / 'file'
    a_file.write_text('x')
    with pytest.raises(errors.WorkdirError, match='is a file'):
        workdir_lib.check(str(a_file), create=True)
    with pytest.raises(errors.WorkdirError, match='cannot create'):
        workdir_lib.check(str(a_file / 'run'), create=True)
    with pytest.raises(errors.WorkdirError, match='does not exist'):
        workdir_lib.check(str(tmp_path / 'missing'), create=False)
    assert not os.path.exists(tmp_path / 'missing')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(errors.UsageError, match='local paths and gs:// URLs'):
        workdir_lib.check('s3://bucket/run', create=True)
    assert not os.path.exists(tmp_path / 's3:')  # No local look-alike folder.


def test_a_folder_no_memjax_run_wrote_is_refused_and_its_files_are_left_as_they_were(tmp_path):
    theirs = tmp_path / 'theirs'
    theirs.mkdir()
    (theirs / 'config.json').write_text('their own')
    with pytest.raises(errors.WorkdirError, match=r'no memjax run wrote \(config.json\).*--workdir=.*theirs/run'):
        workdir_lib.check(str(theirs), create=True)
    assert (theirs / 'config.json').read_text() == 'their own'
    workdir_lib.check(str(theirs), create=False)  # Evaluation writes only where it is told.
    # A run's folder, at any stage, is accepted: the log of process 0, of another process (which
    # may come first in a multi-process run), a gs:// run's stamped log, the lock, checkpoints.
    for marker in ('memjax.log', 'memjax.process_3.log', 'memjax.20261127-052400.host.123.log',
                   workdir_lib.LOCK_FILE, 'checkpoints'):
        run = tmp_path / f'run_{marker}'
        (run / marker).mkdir(parents=True)
        (run / 'config.json').write_text('{}')
        workdir_lib.check(str(run), create=True)
    workdir_lib.check(str(tmp_path / 'new'), create=True)
    workdir_lib.check(str(tmp_path / 'new'), create=True)  # Created empty: still fine.


def test_a_runs_checkpoints_folder_or_step_named_as_workdir_points_at_the_run(tmp_path):
    (tmp_path / 'memjax.log').write_text('')
    (tmp_path / 'checkpoints' / '12').mkdir(parents=True)
    for inside in ('checkpoints', 'checkpoints/12', 'checkpoints/', 'checkpoints/new'):
        for create in (True, False):
            with pytest.raises(errors.WorkdirError, match=f'name the run.s own folder, --workdir={tmp_path}\\.'):
                workdir_lib.check(str(tmp_path / inside) + ('/' if inside.endswith('/') else ''), create=create)
    assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['12']
    assert not os.path.exists(tmp_path / 'checkpoints' / 'new')  # Refused before anything is created.
    other = tmp_path / 'data' / 'checkpoints'  # A folder of that name outside a run is any folder,
    other.mkdir(parents=True)
    (other.parent / 'config.json').write_text('{}')  # even beside someone's config.json.
    workdir_lib.check(str(other / 'run1'), create=True)
    imported = tmp_path / 'imported'  # An imported workdir has no log: its config and tokenizer.
    (imported / 'checkpoints' / '0').mkdir(parents=True)
    for name in ('config.json', 'tokenizer.json'):
        (imported / name).write_text('{}')
    with pytest.raises(errors.WorkdirError, match='inside the checkpoints of the run'):
        workdir_lib.check(str(imported / 'checkpoints'), create=False)


@pytest.mark.skipif(os.geteuid() == 0, reason='root may write into read-only folders')
def test_read_only_workdir_is_an_error(tmp_path):
    os.chmod(tmp_path, 0o555)
    try:
        with pytest.raises(errors.WorkdirError, match='not writable'):
            workdir_lib.check(str(tmp_path), create=True)
    finally:
        os.chmod(tmp_path, 0o755)


SAVED_BEFORE_TYPED_CONFIG = os.path.join(os.path.dirname(__file__), 'data', 'workdir_604f53f')


def test_a_workdir_saved_before_the_typed_config_resumes_and_evaluates(tmp_path):
    """tests/data/workdir_604f53f was written by memjax at commit 604f53f (configs/tiny.py on the
    embedded corpus, 4 steps), when every memory kind's fields were ModelConfig's and config.data
    had no sorting fields: its config and its checkpoint still load as they are."""
    import jax  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    from memjax import model as model_lib  # pylint: disable=import-outside-toplevel
    from memjax.training import checkpoints as checkpointing  # pylint: disable=import-outside-toplevel
    from memjax.training import experiment  # pylint: disable=import-outside-toplevel
    from memjax.training import run_files  # pylint: disable=import-outside-toplevel
    from memjax.training import saved_run  # pylint: disable=import-outside-toplevel

    workdir = str(shutil.copytree(SAVED_BEFORE_TYPED_CONFIG, tmp_path / 'run'))
    config = training_fixtures.override(config_lib.load_config_file(training_fixtures.TINY),
                                        data__data_dir=str(tmp_path / 'data'), train__num_steps=8,
                                        train__keep_checkpoints=1)
    exp = experiment.setup(config, workdir)  # Compares with the saved config: refuses what may not change.
    with open(os.path.join(workdir, 'config.json')) as f:
        saved = json.load(f)
    assert exp.mcfg == model_lib.ModelConfig.from_config_dict(saved['model'], segment_len=config.train.tgt_len)
    ckpt = checkpointing.Checkpointer(run_files.checkpoint_dir(workdir), 1, read_only=True)
    try:
        restored = ckpt.restore_latest(*experiment.abstract_state(exp))
    finally:
        ckpt.close()
    assert restored.step == 4 and int(restored.state.step) == 4
    fresh = experiment.init_state(exp)[0].params
    trained = jax.tree.leaves(restored.state.params)
    assert all(np.isfinite(np.asarray(x)).all() for x in trained)
    assert any(not np.array_equal(a, b) for a, b in zip(trained, jax.tree.leaves(fresh)))
    # Evaluation with another memory length is accepted, another width refused, as for any workdir.
    saved_run.check_saved_config(config_lib.resolve(training_fixtures.override(
        config.copy_and_resolve_references(), eval__model__mem_len=16)), workdir, training=False)
    with pytest.raises(errors.ConfigError, match='model.d_model 32 -> 48'):
        saved_run.check_saved_config(config_lib.resolve(training_fixtures.override(
            config.copy_and_resolve_references(), model__d_model=48)), workdir, training=False)
