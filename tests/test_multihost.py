"""Multi-process runs: coordinator settings, bounded joins, and two processes training together."""

import json
import os
import re
import shutil
import signal
import time

import portpicker
import pytest

from memjax.runtime import distributed
from memjax.runtime import stderr_guard
from memjax.training import metrics as metrics_lib
import cli_fixtures

ENV = {distributed.ENV_COORDINATOR: '10.0.0.1:8476', distributed.ENV_NUM_PROCESSES: '4',
       distributed.ENV_PROCESS_ID: '3'}
# Short, so that a failing join is seen quickly; the runs have to end within JOIN_BOUND_S.
JOIN_TIMEOUT_S = 3
JOIN_BOUND_S = 90


def test_settings_come_from_flags_else_environment():
    from_env = distributed.resolve_settings(environ=ENV)
    assert (from_env.coordinator_address, from_env.num_processes, from_env.process_id) == (
        '10.0.0.1:8476', 4, 3)
    mixed = distributed.resolve_settings(coordinator_address='host-a:1234', process_id=0,
                                         environ=ENV)
    assert (mixed.coordinator_address, mixed.num_processes, mixed.process_id) == (
        'host-a:1234', 4, 0)
    assert not distributed.resolve_settings(environ={}).explicit


@pytest.mark.parametrize('kwargs, environ, message', [
    (dict(num_processes=2), {}, '--coordinator_address, --process_id missing'),
    (dict(coordinator_address='h:1', num_processes=2, process_id=2), {}, 'must lie in [0, 2)'),
    (dict(coordinator_address='h:1', num_processes=0, process_id=0), {}, 'must be >= 1'),
    (dict(coordinator_address='h', num_processes=2, process_id=0), {}, 'must be HOST:PORT'),
    (dict(coordinator_address='h:70000', num_processes=2, process_id=0), {}, 'HOST:PORT'),
    ({}, {distributed.ENV_NUM_PROCESSES: 'two'}, 'MEMJAX_NUM_PROCESSES'),
    (dict(mode='off'), ENV, '--distributed=off contradicts'),
    (dict(initialization_timeout=0), {}, '--initialization_timeout=0'),
])
def test_bad_settings_are_named(kwargs, environ, message):
    with pytest.raises(distributed.DistributedSetupError) as error:
        distributed.resolve_settings(environ=environ, **kwargs)
    assert message in str(error.value)


def test_tpu_worker_environment_means_cloud_tpu():
    assert distributed.on_cloud_tpu({'TPU_WORKER_HOSTNAMES': 'w-0,w-1'})


def test_joins_that_cannot_complete_fail_clearly_within_the_bound(corpus, tmp_path):
    """Process 1 with no coordinator, and a coordinator whose peer never comes."""
    address = f'127.0.0.1:{portpicker.pick_unused_port()}'
    lonely = f'127.0.0.1:{portpicker.pick_unused_port()}'
    env = cli_fixtures.cpu_env(1, str(tmp_path / 'jax_cache'))
    runs = {}
    start = time.time()
    for name, coordinator, process_id in (('no_coordinator', address, 1),
                                          ('no_peer', lonely, 0)):
        command = cli_fixtures.tiny_command(
            str(tmp_path / name), corpus, str(tmp_path / 'data'),
            f'--coordinator_address={coordinator}', '--num_processes=2',
            f'--process_id={process_id}', f'--initialization_timeout={JOIN_TIMEOUT_S}')
        runs[name] = cli_fixtures.Run(command, env, str(tmp_path / f'{name}.log'))
    logs = {name: cli_fixtures.checked(run, expected_code=1) for name, run in runs.items()}
    assert time.time() - start < JOIN_BOUND_S
    assert (f'process 1 of 2 could not join the coordinator at {address} within '
            f'--initialization_timeout={JOIN_TIMEOUT_S}s; the coordinator did not answer'
            in logs['no_coordinator'])
    assert (f'process 0 of 2 could not join the coordinator at {lonely} within '
            f'--initialization_timeout={JOIN_TIMEOUT_S}s; not all other processes connected'
            in logs['no_peer'])
    # Nothing was trained or written before the failure.
    assert not os.path.exists(tmp_path / 'no_peer' / 'checkpoints')


def test_processes_reading_different_copies_of_the_data_stop_before_training(corpus, tmp_path):
    """Each host lays out the split from its own copy of the files; process 1's copy lacks the last
    line of the validation text. A global batch would mix two layouts (tokens scored twice or never):
    both processes stop in one line naming the split, before any step or checkpoint."""
    partial = str(tmp_path / 'partial_copy')
    shutil.copytree(corpus, partial)
    with open(os.path.join(partial, 'valid.txt')) as f:
        lines = f.read().splitlines(keepends=True)
    with open(os.path.join(partial, 'valid.txt'), 'w') as f:
        f.writelines(lines[:-1])
    address = f'127.0.0.1:{portpicker.pick_unused_port()}'
    env = cli_fixtures.cpu_env(1, str(tmp_path / 'jax_cache'))
    runs = [cli_fixtures.Run(
        cli_fixtures.tiny_command(str(tmp_path / 'run'), copy, str(tmp_path / f'data{i}'), '--config.train.batch_size=2',
                                  '--config.eval.batch_size=2', f'--coordinator_address={address}', '--num_processes=2',
                                  f'--process_id={i}', f'--initialization_timeout={JOIN_BOUND_S}'),
        env, str(tmp_path / f'process{i}.log')) for i, copy in enumerate((corpus, partial))]
    for log in [cli_fixtures.checked(run, expected_code=2) for run in runs]:
        assert re.search(r'the validation split \(its token ids\) differs between processes \(process \d has \w+\.\.\.\): '
                         r'give every process the same data files', log), log[-2000:]
        assert 'Traceback' not in log and 'step 1/' not in log
    assert not os.path.exists(tmp_path / 'run' / 'checkpoints')


PROGRESS = re.compile(r'step (\d+)/\d+ \| loss (\S+) \| bpc \S+ \| .* \| lr (\S+) \| gnorm (\S+)')


def progress(log: str) -> dict:
    """{step: (loss, lr, gnorm)} as printed in the progress lines of a log."""
    return {int(m.group(1)): m.group(2, 3, 4) for m in PROGRESS.finditer(log)}


# The default mesh puts all 8 devices on 'data': 8 streams, one per device. Validation
# every 16 steps runs across processes too; checkpoints every 8 steps and at the preemption.
NUM_STEPS = 32
TRAIN = ('--config.train.batch_size=8', '--config.eval.batch_size=8',
         f'--config.train.num_steps={NUM_STEPS}', '--config.train.eval_every=16',
         '--config.train.checkpoint_every=8')
SIGNAL_AFTER = f'step 4/{NUM_STEPS}'
KILL_AFTER = f'step 20/{NUM_STEPS}'
# A lost process is noticed after HEARTBEAT_S without its heartbeat (four of its beats missed:
# peer_watch.beat_period); the survivor is gone within LOSS_BOUND_S of the kill (the watch's
# period, the lock's release and a loaded machine's slack).
HEARTBEAT_S = 6
LOSS_BOUND_S = HEARTBEAT_S + 20


def _appears(folder, name: str, run: cli_fixtures.Run) -> list[str]:
    """Waits (polling every 2 ms) until `folder` holds `name`; returns the listing then."""
    deadline = time.time() + cli_fixtures.RUN_TIMEOUT_S
    while time.time() < deadline and run.process.poll() is None:
        names = os.listdir(folder) if os.path.isdir(folder) else []
        if name in names:
            return names
        time.sleep(0.002)
    raise AssertionError(f'no {name} in {folder}:\n{run.log()[-3000:]}')


def _guarded_log(run: cli_fixtures.Run, line: str) -> str:
    """The log of an aborted process once its standard-error guard, which outlives it, has written
    `line` (memjax/runtime/stderr_guard.py), or after 10 s."""
    deadline = time.time() + 10
    while line not in run.log() and time.time() < deadline:
        time.sleep(0.05)
    return run.log()


@pytest.fixture(scope='module')
def two_process_run(corpus, tmp_path_factory):
    """configs/tiny.py on 2 processes x 4 CPU devices: preempted by a SIGTERM to process 1 and
    restarted; process 1 then killed with SIGKILL (a host lost) and restarted again; and
    uninterrupted on 1 process x 8 devices (running alongside)."""
    root = tmp_path_factory.mktemp('multihost')
    cache = str(root / 'jax_cache')
    single = cli_fixtures.Run(
        cli_fixtures.tiny_command(str(root / 'one'), corpus, str(root / 'data_one'), *TRAIN),
        cli_fixtures.cpu_env(8, cache), str(root / 'single.log'))

    def launch(phase, module='memjax.train'):
        # One workdir and data dir for both processes: process 0 prepares the data and the
        # tokenizer first; orbax writes each process's shards into the same checkpoint.
        address = f'127.0.0.1:{portpicker.pick_unused_port()}'
        return [cli_fixtures.Run(
            cli_fixtures.tiny_command(str(root / 'two'), corpus, str(root / 'data_two'), *TRAIN,
                                       f'--coordinator_address={address}', '--num_processes=2',
                                       f'--process_id={i}', '--verbosity=0', f'--heartbeat_timeout={HEARTBEAT_S}',
                                       module=module),
            cli_fixtures.cpu_env(4, cache), str(root / f'{phase}_process{i}.log'))
            for i in range(2)]

    first = launch('first')
    first[0].wait_for_text(SIGNAL_AFTER)
    first[1].process.send_signal(signal.SIGTERM)  # The notice reaches one process only.
    first_logs = [cli_fixtures.checked(run) for run in first]
    preempted_checkpoints = sorted(os.listdir(root / 'two' / 'checkpoints'), key=int)
    resumed = launch('resumed')
    resumed[0].wait_for_text(KILL_AFTER)
    resumed[1].process.kill()
    killed_at = time.time()
    survivor_log = cli_fixtures.checked(resumed[0], expected_code=3)
    survivor_s = time.time() - killed_at
    resumed[1].wait()
    before_restart = dict(checkpoints=sorted(os.listdir(root / 'two' / 'checkpoints')),
                          lock=os.path.exists(root / 'two' / '.memjax.lock'),
                          scalars=metrics_lib.read_scalars(str(root / 'two')))
    # Killed again while step 24's checkpoint is being written (orbax's temporary folder exists).
    restarted = launch('restarted')
    saving = _appears(root / 'two' / 'checkpoints', '24.orbax-checkpoint-tmp', restarted[0])
    restarted[1].process.kill()
    killed_at = time.time()
    saving_survivor_log = cli_fixtures.checked(restarted[0], expected_code=3)
    saving_survivor_s = time.time() - killed_at
    restarted[1].wait()
    mid_save = dict(seen=saving, checkpoints=sorted(os.listdir(root / 'two' / 'checkpoints')))
    restarted_logs = [cli_fixtures.checked(run) for run in launch('completed')]
    # An evaluation killed once it has restored the parameters and read the data (compiling or
    # scoring), this time in process 0, which hosts JAX's coordination service: JAX aborts process 1.
    evaluating = launch('evaluate_killed', module='memjax.evaluate')
    evaluating[0].wait_for_text('Evaluating step')
    evaluating[0].process.kill()
    killed_at = time.time()
    evaluating_survivor_code = evaluating[1].wait()
    evaluating_survivor_s = time.time() - killed_at
    evaluating_survivor_log = _guarded_log(evaluating[1], stderr_guard.lost_coordinator_line(1, 2))
    evaluating[0].wait()
    evaluation_left = os.path.exists(root / 'two' / 'eval_validation.json')
    for run in launch('evaluate', module='memjax.evaluate'):
        cli_fixtures.checked(run)
    cli_fixtures.checked(single)
    return dict(root=root, first_logs=first_logs, resumed_logs=[run.log() for run in resumed],
                restarted_logs=restarted_logs, survivor_log=survivor_log, survivor_s=survivor_s,
                saving_survivor_log=saving_survivor_log, saving_survivor_s=saving_survivor_s, mid_save=mid_save,
                evaluating_survivor_log=evaluating_survivor_log, evaluating_survivor_s=evaluating_survivor_s,
                evaluating_survivor_code=evaluating_survivor_code,
                evaluation_left=evaluation_left,
                before_restart=before_restart, preempted_checkpoints=preempted_checkpoints,
                two=metrics_lib.read_scalars(str(root / 'two')),
                one=metrics_lib.read_scalars(str(root / 'one')))


def test_sigterm_to_one_process_stops_both_at_the_same_checkpoint(two_process_run):
    name = two_process_run['preempted_checkpoints'][-1]
    step = int(name)
    assert 4 <= step < NUM_STEPS
    saved = two_process_run['root'] / 'two' / 'checkpoints' / name
    for first, resumed in zip(two_process_run['first_logs'], two_process_run['resumed_logs']):
        assert f'Preempted: saved {saved};' in first
        assert f'(step {step})' in resumed  # "Resumed from <dir> (step N)".


def test_a_process_killed_without_notice_stops_the_other_within_the_bound_and_a_restart_resumes_exactly(
        two_process_run):
    """SIGKILL to process 1 in the middle of training: process 0 is out of its collectives within
    LOSS_BOUND_S, with one line naming process 1 (exit 3), the workdir's lock released. Only complete
    checkpoints are left, and the restart continues from the newest one with the same numbers as the
    killed launch had."""
    assert_stopped_in_one_line(two_process_run['survivor_log'], two_process_run['survivor_s'])
    before = two_process_run['before_restart']
    assert not before['lock']
    assert all(name.isdigit() for name in before['checkpoints'])  # No half-written step among them.
    newest = max(map(int, before['checkpoints']))
    assert 16 <= newest < NUM_STEPS
    assert f'(step {newest})' in two_process_run['restarted_logs'][0]
    # The steps after the checkpoint that the killed launch logged, repeated by the restart: bit for bit.
    killed, final = before['scalars']['train/loss'], two_process_run['two']['train/loss']
    repeated = [step for step in killed if step > newest]
    assert repeated
    assert [killed[step] for step in repeated] == [final[step] for step in repeated]


def assert_stopped_in_one_line(log: str, seconds: float) -> None:
    assert seconds < LOSS_BOUND_S
    lines = [line for line in log.splitlines() if line.startswith('memjax: ')]
    assert len(lines) == 1, log[-3000:]
    assert re.fullmatch(r'memjax: process 1 of 2 has not been heard from for \d+s \(killed, or its host is gone\); '
                        r'process 0 stops too \(exit 3\)\. Start every process again with the same command to '
                        r'resume from the newest complete checkpoint\.', lines[0]), lines[0]
    assert 'Traceback' not in log and 'Fatal Python error' not in log and 'Checkpoint error' not in log


def test_a_process_killed_while_a_checkpoint_is_written_leaves_the_previous_one_newest(two_process_run):
    """The save's own collectives fail at once; the line is still the lost process's (not a disk's),
    and the half-written step stays orbax's temporary folder, which a restart passes over."""
    assert_stopped_in_one_line(two_process_run['saving_survivor_log'], two_process_run['saving_survivor_s'])
    mid_save = two_process_run['mid_save']
    assert '24' not in mid_save['seen'] and '24' not in mid_save['checkpoints']
    assert '(step 16)' in two_process_run['restarted_logs'][0]


def test_process_0_killed_during_an_evaluation_stops_the_other_at_once_in_one_line(two_process_run):
    """Process 0 hosts JAX's coordination service: without it JAX aborts process 1 at once, and the
    guard of process 1's standard error puts one line in place of JAX's warnings, fatal error and
    dump. Nothing is written as the evaluation's result; the evaluation run again afterwards (its
    lock's dead holder passed over) scores the split (test below)."""
    log, seconds = two_process_run['evaluating_survivor_log'], two_process_run['evaluating_survivor_s']
    assert seconds < LOSS_BOUND_S
    # Ended by JAX's abort: SIGABRT, or SIGSEGV where the abort meets another thread on the way out.
    assert two_process_run['evaluating_survivor_code'] in (-signal.SIGABRT, -signal.SIGSEGV), log[-3000:]
    lines = [line for line in log.splitlines() if line.startswith('memjax: ')]
    assert lines == [stderr_guard.lost_coordinator_line(1, 2)], log[-3000:]
    for jax_abort in ('Terminating process', 'Check failure stack trace', 'Polled an error', 'Socket closed',
                      'Traceback', 'Fatal Python error'):
        assert jax_abort not in log, log[-3000:]
    assert not two_process_run['evaluation_left']


def test_two_processes_agree_and_match_one_process(two_process_run):
    logs = [first + resumed + restarted for first, resumed, restarted in zip(
        two_process_run['first_logs'], two_process_run['resumed_logs'], two_process_run['restarted_logs'])]
    process0, process1 = (progress(log) for log in logs)
    assert sorted(process0) == list(range(2, NUM_STEPS + 1, 2))  # tiny logs every 2 steps.
    assert {step: process0[step] for step in process1} == process1  # Process 1's last lines may be lost to the kill.
    two, one = two_process_run['two'], two_process_run['one']
    for tag in ('train/loss', 'train/grad_norm', 'valid/loss'):
        assert sorted(two[tag]) == sorted(one[tag])
        for step, value in one[tag].items():
            assert two[tag][step] == pytest.approx(value, rel=1e-5), (tag, step)


def test_only_process_0_writes_files_but_both_write_the_checkpoints(two_process_run):
    workdir = two_process_run['root'] / 'two'
    kept = sorted(os.listdir(workdir / 'checkpoints'), key=int)
    assert kept[-1] == str(NUM_STEPS) and all(int(step) % 8 == 0 for step in kept[:-1])
    assert len(os.listdir(workdir / 'tensorboard')) == 4  # One event file per training launch.
    assert os.path.exists(workdir / 'config.json')


def test_two_process_evaluation_scores_the_whole_split_like_training(two_process_run):
    """`memjax.evaluate` on the final checkpoint repeats training's final validation."""
    workdir = two_process_run['root'] / 'two'
    with open(workdir / 'train_summary.json') as f:
        trained = json.load(f)
    with open(workdir / 'eval_validation.json') as f:
        evaluated = json.load(f)
    assert evaluated['step'] == NUM_STEPS
    assert evaluated['num_tokens'] == evaluated['num_target_tokens_of_split']
    assert evaluated['num_tokens'] == trained['valid_tokens']
    assert evaluated['loss'] == pytest.approx(trained['valid_loss'], rel=1e-6)
