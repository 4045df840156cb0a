"""Runs that live in Cloud Storage: `--workdir=gs://bucket/run`, against a Cloud Storage server on
127.0.0.1 (tests/gcs_emulator.py), by the real command line where a user would use it.

A run killed with SIGKILL resumes exactly from gs://; a changed config is refused without touching
an object; of runs racing for one gs:// workdir exactly one trains; a truncated object in the
newest checkpoint falls back to the previous one and is kept aside (copied, verified, then
removed); evaluation and generation read the workdir as they read a local one.
"""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

import cli_fixtures
import gcs_emulator
import training_fixtures
from memjax import errors
from memjax.generation import Sampling
from memjax.runtime import storage
from memjax.training import metrics as metrics_lib
from memjax.training import workdir as workdir_lib
from memjax.training import run_lock

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec('gcp_storage_emulator') is None or importlib.util.find_spec('gcsfs') is None,
    reason='needs gcp-storage-emulator and gcsfs (pip install -e ".[test]"; CI installs them)')

ROOT = f'gs://{gcs_emulator.BUCKET}'
STEPS = ('--config.train.num_steps=24', '--config.train.eval_every=0')


@pytest.fixture(scope='module')
def gcs():
    try:
        started = gcs_emulator.start()
        url = started.__enter__()
    except OSError as error:  # No loopback port to serve on, say.
        pytest.skip(f'cannot start the Cloud Storage emulator on 127.0.0.1: {error}')
    try:
        yield url
    finally:
        started.__exit__(None, None, None)


@pytest.fixture(scope='module')
def env(gcs):
    del gcs  # The environment it sets is what the training processes inherit.
    return cli_fixtures.cpu_env(1)


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp('tfds'))


def command(workdir, corpus, data_dir, *extra, module='memjax.train'):
    return cli_fixtures.tiny_command(workdir, corpus, data_dir, '--host_memory=off', *STEPS, *extra,
                                     module=module)


def start(args, env, tmp_path, name):
    # A gs:// run logs to a local file it uploads; a killed run's stays behind, here in the test's folder.
    return cli_fixtures.Run(args, {**env, 'TMPDIR': str(tmp_path)}, str(tmp_path / f'{name}.log'))


@pytest.fixture(scope='module')
def runs(corpus, env, data_dir, tmp_path_factory):
    """(local baseline workdir, gs:// workdir of the same run killed with SIGKILL at step 12 and
    resumed, the log of the resumed run)."""
    logs = tmp_path_factory.mktemp('logs')
    baseline = str(tmp_path_factory.mktemp('baseline') / 'w')
    cli_fixtures.checked(start(command(baseline, corpus, data_dir), env, logs, 'baseline'))
    workdir = f'{ROOT}/killed'
    killed = start(command(workdir, corpus, data_dir), env, logs, 'killed')
    killed.wait_for_text('step 12/24')
    killed.process.send_signal(signal.SIGKILL)
    assert killed.wait() == -signal.SIGKILL
    assert storage.read_text(f'{workdir}/train_summary.json') is None  # Killed before the end.
    resumed = cli_fixtures.checked(start(command(workdir, corpus, data_dir), env, logs, 'resumed'))
    return baseline, workdir, resumed


def test_a_run_killed_with_sigkill_resumes_exactly_from_gs(runs):
    baseline, workdir, resumed = runs
    assert 'Taking over the stale lock' in resumed and 'Resumed from gs://' in resumed
    expected, got = metrics_lib.read_scalars(baseline), metrics_lib.read_scalars(workdir)
    assert sorted(got['train/loss']) == sorted(expected['train/loss']) == list(range(2, 25, 2))
    for step, loss in expected['train/loss'].items():
        assert got['train/loss'][step] == pytest.approx(loss, abs=1e-6), step
    summary = json.loads(storage.read_text(f'{workdir}/train_summary.json'))
    with open(os.path.join(baseline, 'train_summary.json')) as f:
        assert summary['valid_loss'] == pytest.approx(json.load(f)['valid_loss'], abs=1e-6)
    names = gcs_emulator.objects('killed')
    assert {'config.json', 'tokenizer.json', 'train_summary.json'} <= set(names)
    assert workdir_lib.LOCK_FILE not in names  # Released by the run that finished.
    logs = [name for name in names if name.startswith('memjax.') and name.endswith('.log')]
    assert any('Done:' in storage.read_text(f'{workdir}/{name}') for name in logs)  # Each run its own.


def test_evaluation_and_generation_read_a_gs_workdir(runs, corpus, data_dir):
    from memjax import evaluate  # pylint: disable=g-import-not-at-top
    from memjax.generation import text as generation  # pylint: disable=g-import-not-at-top
    baseline, workdir, _ = runs
    config = training_fixtures.tiny_config(corpus, data__data_dir=data_dir)
    result = evaluate.evaluate_checkpoint(config, workdir)
    summary = json.loads(storage.read_text(f'{workdir}/train_summary.json'))
    assert result['step'] == 24 and result['loss'] == pytest.approx(summary['valid_loss'], abs=1e-6)
    assert json.loads(storage.read_text(f'{workdir}/eval_validation.json'))['loss'] == result['loss']
    greedy = dict(text='alpha beta gamma', max_new_tokens=24, settings=Sampling(temperature=0.0),
                  out=open(os.devnull, 'w'))
    from_gs = generation.generate(None, workdir, **greedy)
    assert from_gs == generation.generate(None, baseline, **greedy) and from_gs[0]


def test_a_new_run_starts_from_a_gs_workdir_with_its_tokenizer(runs, corpus, env, data_dir, tmp_path):
    _, source, _ = runs
    workdir = f'{ROOT}/finetuned'
    log = cli_fixtures.checked(start(command(workdir, corpus, data_dir, f'--config.train.init_from={source}',
                                             '--config.train.num_steps=4'), env, tmp_path, 'init_from'))
    assert f'Started from parameters of {source}/checkpoints/24' in log
    assert storage.read_text(f'{workdir}/tokenizer.json') == storage.read_text(f'{source}/tokenizer.json')
    assert f'Took the tokenizer of {source}' in log


def test_a_changed_config_is_refused_and_leaves_every_object_as_it_was(runs, corpus, env, data_dir, tmp_path):
    _, workdir, _ = runs
    before = {name: info['generation'] for name, info in gcs_emulator.objects('killed').items()}
    run = start(command(workdir, corpus, data_dir, '--config.model.d_inner=128'), env, tmp_path, 'changed')
    log = cli_fixtures.checked(run, errors.EXIT_USAGE)
    assert 'model.d_inner 64 -> 128' in log
    after = {name: info['generation'] for name, info in gcs_emulator.objects('killed').items()}
    assert {name: after.get(name) for name in before} == before
    new = set(after) - set(before)  # Only the refused run's own log.
    assert len(new) == 1 and new.pop().startswith('memjax.')


def test_of_runs_racing_for_one_gs_workdir_exactly_one_wins(gcs, corpus, env, data_dir, tmp_path, monkeypatch):
    del gcs
    workdir = f'{ROOT}/race'

    def race(count):
        barrier, won, refused = threading.Barrier(count), [], []

        def take():
            lock = run_lock.RunLock(workdir)
            barrier.wait()
            try:
                won.append(lock.acquire())
            except errors.WorkdirError as error:
                refused.append(str(error))
        threads = [threading.Thread(target=take) for _ in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return won, refused

    won, refused = race(6)
    assert len(won) == 1 and len(refused) == 5
    assert all(f'process {os.getpid()}' in message for message in refused)
    # The heartbeat rewrites the object under "still mine": a new generation, a fresh age.
    monkeypatch.setattr(run_lock, 'HEARTBEAT_S', 0.05)
    won[0].release()
    assert workdir_lib.LOCK_FILE not in gcs_emulator.objects('race')
    with run_lock.RunLock(workdir) as held:
        first = gcs_emulator.objects('race')[workdir_lib.LOCK_FILE]['generation']
        time.sleep(0.5)
        assert gcs_emulator.objects('race')[workdir_lib.LOCK_FILE]['generation'] != first
        assert json.loads(storage.read_text(held.path))['pid'] == os.getpid()

    # A lock whose heartbeat stopped (a lost host) is taken over once it is old.
    storage.write_text(f'{workdir}/{workdir_lib.LOCK_FILE}',
                       json.dumps({'host': 'lost-host', 'pid': 1, 'started': 'then'}))
    monkeypatch.setattr(run_lock, 'STALE_AFTER_S', 0.3)
    with pytest.raises(errors.WorkdirError, match='lost-host'):
        run_lock.RunLock(workdir).acquire()
    time.sleep(0.6)
    with run_lock.RunLock(workdir):
        pass
    monkeypatch.setattr(run_lock, 'STALE_AFTER_S', 600.0)
    # The lock of a process of this host that is gone: taken over by exactly one of the racers.
    dead = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'], capture_output=True,
                          text=True, check=True)
    storage.write_text(f'{workdir}/{workdir_lib.LOCK_FILE}', json.dumps(
        {'host': socket.gethostname(), 'pid': int(dead.stdout), 'started': 'then'}))
    won, refused = race(6)
    assert len(won) == 1 and len(refused) == 5
    won[0].release()

    # Two training runs started together: one trains, the other stops with one line.
    args = command(workdir, corpus, data_dir, '--config.train.num_steps=4000')
    both = [start(args, env, tmp_path, f'run{i}') for i in range(2)]
    refusal, deadline = None, time.time() + cli_fixtures.RUN_TIMEOUT_S
    while refusal is None:
        for i, run in enumerate(both):
            if run.process.poll() is not None:
                refusal, winner = run, both[1 - i]
        if refusal is None and time.time() > deadline:
            for run in both:
                run.process.kill()
            raise AssertionError('neither of two runs on one workdir stopped:\n' + both[0].log()[-2000:])
        time.sleep(0.1)
    assert refusal.wait() == errors.EXIT_RUNTIME, refusal.log()[-3000:]
    assert 'is in use by another training run' in refusal.log()
    winner.wait_for_text('step 2/4000')
    winner.process.send_signal(signal.SIGTERM)  # Preempted: checkpoints, releases the lock.
    assert winner.wait() == 0, winner.log()[-3000:]
    assert workdir_lib.LOCK_FILE not in gcs_emulator.objects('race')


def test_a_truncated_object_in_the_newest_checkpoint_falls_back_and_is_kept_aside(
        runs, corpus, env, data_dir, tmp_path):
    import fsspec  # pylint: disable=g-import-not-at-top
    baseline, source, _ = runs
    fs = fsspec.filesystem('gcs')
    workdir = f'{ROOT}/damaged'
    for name in gcs_emulator.objects('killed'):
        fs.copy(f'{gcs_emulator.BUCKET}/killed/{name}', f'{gcs_emulator.BUCKET}/damaged/{name}')
    fs.rm(f'{gcs_emulator.BUCKET}/damaged/train_summary.json')
    step = gcs_emulator.objects('damaged/checkpoints/24/arrays')
    biggest = max(step, key=lambda name: step[name]['size'])
    target = f'{gcs_emulator.BUCKET}/damaged/checkpoints/24/arrays/{biggest}'
    fs.pipe(target, fs.cat(target)[:step[biggest]['size'] // 2])
    damaged = {name: (info['size'], info['crc32c']) for name, info in
               gcs_emulator.objects('damaged/checkpoints/24').items()}
    log = cli_fixtures.checked(start(command(workdir, corpus, data_dir), env, tmp_path, 'resume'))
    assert 'checkpoints/24 is damaged or incomplete' in log and 'Resumed from gs://' in log
    assert 'checkpoints/20 (step 20)' in log
    kept = {name: (info['size'], info['crc32c']) for name, info in
            gcs_emulator.objects('damaged/checkpoints_damaged/24').items()}
    assert kept == damaged  # The damaged step whole, as it was.
    summary = json.loads(storage.read_text(f'{workdir}/train_summary.json'))
    with open(os.path.join(baseline, 'train_summary.json')) as f:
        assert summary['valid_loss'] == pytest.approx(json.load(f)['valid_loss'], abs=1e-6)
    assert source != workdir


def test_what_cannot_live_in_cloud_storage_is_refused_in_one_line(gcs, monkeypatch):
    del gcs
    with pytest.raises(errors.WorkdirError, match='the bucket gs://no-such-bucket does not exist'):
        workdir_lib.check('gs://no-such-bucket/run', create=True)
    with pytest.raises(errors.WorkdirError, match='holds nothing'):
        workdir_lib.check(f'{ROOT}/never-trained', create=False)
    with pytest.raises(errors.UsageError, match='local paths and gs:// URLs'):
        workdir_lib.check('s3://bucket/run', create=True)
    from memjax.data.config import DataConfig  # pylint: disable=g-import-not-at-top
    problems = DataConfig(data_dir=f'{ROOT}/tfds', cache_dir=f'{ROOT}/cache').problems()
    assert len(problems) == 2 and all('Cloud Storage FUSE' in line for line in problems)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec',
                        lambda name, *args: None if name == 'gcsfs' else real_find_spec(name, *args))
    with pytest.raises(errors.UsageError, match=r"pip install -e '\.\[gcs\]'"):
        workdir_lib.check(f'{ROOT}/run', create=True)


def test_move_tree_moves_a_local_folder_whole(tmp_path):
    (tmp_path / 'a' / 'b').mkdir(parents=True)
    (tmp_path / 'a' / 'b' / 'f').write_text('x')
    storage.move_tree(str(tmp_path / 'a'), str(tmp_path / 'c'))
    assert not (tmp_path / 'a').exists() and (tmp_path / 'c' / 'b' / 'f').read_text() == 'x'


def one_error_line(log: str) -> list[str]:
    return [line for line in log.splitlines()
            if line.strip() and not (line[:1] in 'IWE' and line[1:5].isdigit()) and 'dataset' not in line.lower()]


def test_without_credentials_a_gs_run_is_one_line_naming_the_login(corpus, data_dir, tmp_path):
    env = {k: v for k, v in cli_fixtures.cpu_env(1).items()
           if k not in gcs_emulator.ENV_KEYS and k != 'GOOGLE_APPLICATION_CREDENTIALS'}
    env.update(HOME=str(tmp_path), NO_GCE_CHECK='true', CLOUDSDK_CONFIG=str(tmp_path / 'gcloud'))
    log = cli_fixtures.checked(start(command(f'{ROOT}/no_credentials', corpus, data_dir), env, tmp_path, 'run'),
                               errors.EXIT_RUNTIME)
    lines = one_error_line(log)
    assert len(lines) == 1 and 'gcloud auth application-default login' in lines[0] and 'Traceback' not in log, log


def test_an_endpoint_that_does_not_answer_is_one_line_after_the_bounded_retry(corpus, data_dir, env, tmp_path):
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]  # Nothing listens there once it is closed.
    env = {**env, 'STORAGE_EMULATOR_HOST': f'http://127.0.0.1:{port}', 'MEMJAX_GCS_TIMEOUT_S': '3'}
    began = time.time()
    log = cli_fixtures.checked(start(command(f'{ROOT}/down', corpus, data_dir), env, tmp_path, 'run'),
                               errors.EXIT_RUNTIME)
    lines = one_error_line(log)
    assert len(lines) == 1 and 'did not answer within 3s' in lines[0] and 'MEMJAX_GCS_TIMEOUT_S' in lines[0], log
    assert 'Traceback' not in log and time.time() - began < 60  # The client's own retry alone is 120 s.


def test_a_bucket_lost_mid_run_stops_the_run_within_the_bound(corpus, data_dir, tmp_path):
    """The probe: the endpoint stops answering while the run trains (this test's own server)."""
    with gcs_emulator.start():
        env = {**cli_fixtures.cpu_env(1), 'MEMJAX_GCS_TIMEOUT_S': '3'}
        run = start(command(f'{ROOT}/lost', corpus, data_dir, '--config.train.num_steps=100000',
                            '--config.train.checkpoint_every=4'), env, tmp_path, 'run')
        run.wait_for_text('step 8/')
        stopped_at = time.time()
    # The server is gone; the run must notice and end, not retry for minutes.
    log = cli_fixtures.checked(run, errors.EXIT_RUNTIME)
    assert time.time() - stopped_at < 60, log[-2000:]
    lines = one_error_line(log)
    assert len(lines) == 1 and 'Cloud Storage has not answered' in lines[0] and 'resumes from the newest' in lines[0], log


def test_a_lost_bucket_is_said_to_be_silent_since_the_first_unanswered_request(monkeypatch):
    """A refresh answered at t=60, the endpoint gone at t=100, the next request sent at t=120 and
    failing after its 60 s of retries: the bucket has not answered for 60 s (not 120, since the last
    answer). A clock that moves only when the lock waits or a request hangs."""
    clock = [0.0]
    calls = []

    class Stop:
        def wait(self, seconds):
            clock[0] += seconds
            return False

        def is_set(self):
            return False

    class Bucket(run_lock._LockObject):  # pylint: disable=protected-access
        def touch(self, version, text):
            calls.append(clock[0])
            if len(calls) == 1:
                return version
            clock[0] += 60.0  # The client's bounded retries, then its error.
            raise ConnectionError('endpoint gone')

    class Lost(Exception):
        pass

    def lost_after(seconds, error):
        raise Lost(seconds, error)

    monkeypatch.setattr(run_lock.time, 'time', lambda: clock[0])
    monkeypatch.setattr(run_lock, 'HEARTBEAT_S', 60.0)
    monkeypatch.setattr(storage, 'gcs_timeout_s', lambda: 60.0)
    lock = run_lock.RunLock('gs://bucket/run')
    lock._store, lock._stop = Bucket('gs://bucket/run/.memjax.lock'), Stop()  # pylint: disable=protected-access
    monkeypatch.setattr(lock, '_lost', lost_after)
    with pytest.raises(Lost) as lost:
        lock._heartbeat()  # pylint: disable=protected-access
    assert calls == [60.0, 120.0] and lost.value.args[0] == 60.0
