"""Preemption: SIGTERM checkpoints a step boundary, exits 0, and the rerun resumes exactly."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from memjax import early_sigterm
from memjax.training import metrics as metrics_lib
from memjax.training import preemption
import cli_fixtures
import training_fixtures

# Long enough that the SIGTERM sent after the first logged steps lands mid-run; two
# updates per dispatch, every dispatch logged, so every boundary has a recorded loss.
NUM_STEPS = 600
SEGMENTS = 2
SIGNAL_AFTER = f'step {10 * SEGMENTS}/{NUM_STEPS}'
OVERRIDES = (f'--config.train.num_steps={NUM_STEPS}', f'--config.train.log_every={SEGMENTS}',
             '--config.train.eval_every=0', '--config.train.checkpoint_every=0')


def test_watch_turns_sigterm_into_a_stop_request_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    watch = preemption.PreemptionWatch()
    try:
        # Only with the handler in place may this process signal itself.
        assert signal.getsignal(signal.SIGTERM) is not before
        assert not watch.reached(0, 2)
        os.kill(os.getpid(), signal.SIGTERM)  # Handled at the next bytecode, in this thread.
        assert watch.reached(2, 4)
        assert watch.reached(4, 6)  # Stays requested until the loop acts on it.
    finally:
        watch.close()
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
    """An uninterrupted run, then a run sent SIGTERM mid-training, then its rerun.

    One after the other: the later runs load the first one's compiled steps from the
    compilation cache instead of compiling them again on the same two cores.
    """
    root = tmp_path_factory.mktemp('preemption')
    corpus = training_fixtures.write_text_corpus(str(root / 'corpus'))
    env = cli_fixtures.cpu_env(1, str(root / 'jax_cache'))

    def start(name):
        command = cli_fixtures.tiny_command(str(root / name), corpus, str(root / 'data'),
                                             *OVERRIDES)
        return command, cli_fixtures.Run(command, env, str(root / f'{name}.log'))

    _, baseline = start('baseline')
    cli_fixtures.checked(baseline)
    command, interrupted = start('interrupted')
    interrupted.wait_for_text(SIGNAL_AFTER)
    interrupted.process.send_signal(signal.SIGTERM)
    interrupted_log = cli_fixtures.checked(interrupted)
    checkpoints = sorted(os.listdir(root / 'interrupted' / 'checkpoints'))
    first_scalars = metrics_lib.read_scalars(str(root / 'interrupted'))
    first_summary = os.path.exists(root / 'interrupted' / 'train_summary.json')
    resumed_log = cli_fixtures.checked(cli_fixtures.Run(command, env, str(root / 'resumed.log')))
    return dict(root=root, corpus=corpus, env=env, interrupted_log=interrupted_log, resumed_log=resumed_log,
                checkpoints=checkpoints, first_scalars=first_scalars, first_summary=first_summary,
                resumed=metrics_lib.read_scalars(str(root / 'interrupted')),
                baseline=metrics_lib.read_scalars(str(root / 'baseline')))


def preempted_step(runs) -> int:
    (name,) = runs['checkpoints']  # checkpoint_every=0: only the preemption checkpoint.
    return int(name)


def test_sigterm_saves_a_complete_checkpoint_at_a_step_boundary_and_exits_0(runs):
    step = preempted_step(runs)  # A bare step number: orbax renamed its temporary dir.
    assert 10 * SEGMENTS <= step < NUM_STEPS and step % SEGMENTS == 0
    assert 'Preempted: saved' in runs['interrupted_log']
    # It stopped right there: the last logged loss is that boundary's, no final validation.
    assert max(runs['first_scalars']['train/loss']) == step
    assert 'valid/loss' not in runs['first_scalars']
    assert not runs['first_summary']


def test_rerun_resumes_exactly(runs):
    step = preempted_step(runs)
    assert f'(step {step})' in runs['resumed_log']  # "Resumed from <dir> (step N)".
    baseline, resumed = runs['baseline'], runs['resumed']
    expected = list(range(SEGMENTS, NUM_STEPS + 1, SEGMENTS))
    assert sorted(baseline['train/loss']) == expected
    assert sorted(resumed['train/loss']) == expected
    # Identical data position, memory, parameters, optimizer state and dropout keys give
    # the same losses after the interruption; before it they are the same run.
    for tag in ('train/loss', 'train/grad_norm', 'train/learning_rate'):
        for s in expected:
            assert resumed[tag][s] == pytest.approx(baseline[tag][s], rel=1e-6, abs=1e-7), (tag, s)
    assert resumed['valid/loss'][NUM_STEPS] == pytest.approx(baseline['valid/loss'][NUM_STEPS],
                                                             rel=1e-6)


def test_ctrl_c_saves_a_checkpoint_at_a_step_boundary_and_exits_130(runs):
    root = runs['root']
    command = cli_fixtures.tiny_command(str(root / 'ctrl_c'), runs['corpus'], str(root / 'data'), *OVERRIDES)
    run = cli_fixtures.Run(command, runs['env'], str(root / 'ctrl_c.log'))
    run.wait_for_text(SIGNAL_AFTER)
    run.process.send_signal(signal.SIGINT)
    log = cli_fixtures.checked(run, early_sigterm.INTERRUPTED)
    assert 'Interrupted by Ctrl-C: saved' in log and 'Traceback' not in log
    (name,) = os.listdir(root / 'ctrl_c' / 'checkpoints')
    assert 10 * SEGMENTS <= int(name) < NUM_STEPS and int(name) % SEGMENTS == 0


def test_a_second_ctrl_c_stops_at_once_with_130(monkeypatch):
    stops = []
    monkeypatch.setattr(early_sigterm, 'stop', lambda message='', exit_code=None: stops.append((message, exit_code)))
    monkeypatch.setitem(early_sigterm._state, 'signal', None)
    requests = []
    with early_sigterm.diverted(lambda: requests.append(early_sigterm.name())):
        early_sigterm._react(signal.SIGINT)  # The first: the loop saves at its next boundary.
        assert requests == ['Ctrl-C'] and not stops and early_sigterm.status() == early_sigterm.INTERRUPTED
        early_sigterm._react(signal.SIGINT)  # The second: at once.
    assert stops[0][1] == early_sigterm.INTERRUPTED and 'second Ctrl-C' in stops[0][0]
    monkeypatch.setitem(early_sigterm._state, 'signal', None)
    early_sigterm._react(signal.SIGTERM)  # Outside the loop: the default stop, exit 0.
    assert stops[-1] == ('', None) and early_sigterm.status() == 0 and early_sigterm.name() == 'SIGTERM'


@pytest.mark.parametrize('ignored', [False, True])
def test_ctrl_c_before_the_loop_stops_with_130_unless_the_process_was_started_to_ignore_it(ignored):
    script = textwrap.dedent(f'''
        import os, signal, time
        if {ignored}:  # As a shell starts a background job.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        from memjax import early_sigterm
        early_sigterm.install()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
        print('still running')
    ''')
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=60,
                          cwd=training_fixtures.REPO, preexec_fn=cli_fixtures.interruptible)
    if ignored:
        assert done.returncode == 0 and 'still running' in done.stdout
    else:
        assert done.returncode == early_sigterm.INTERRUPTED and 'still running' not in done.stdout
        assert 'Stopped by Ctrl-C outside the training loop: nothing new to save' in done.stderr
