"""tests/command_server.py: a command forked from the worker's command server behaves as the same
command started in a new interpreter."""

import os
import signal
import subprocess
import sys
import time

import pytest

from memjax import errors
import cli_fixtures
import command_server
import training_fixtures

TINY = training_fixtures.TINY


def test_a_served_command_gives_what_a_new_interpreter_gives(tmp_path):
    env = cli_fixtures.cpu_env(1)
    for command in ([sys.executable, '-m', 'memjax.train', f'--config={TINY}', f'--workdir={tmp_path}',
                     '--config.model.no_such_field=1'],
                    [sys.executable, '-m', 'memjax.train', '--help']):
        fresh, served = (command_server.run(command, env=env, capture_output=True, text=True, timeout=120, fresh=f)
                         for f in (True, False))
        assert (served.returncode, served.stdout, served.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
        assert served.returncode != 0 and (served.stdout or served.stderr)


def test_a_packages_server_imports_what_its_main_module_imports():
    """`python -m memjax.bench` runs memjax/bench/__main__.py: its server has imported what that
    file imports (JAX's library mapped before any fork), not only the package's __init__.py, so
    that the command starts in milliseconds, as memjax.train's does."""
    env = cli_fixtures.cpu_env(1)
    result = command_server.run([sys.executable, '-m', 'memjax.bench', 'no-such-suite'], env=env,
                                capture_output=True, text=True, timeout=120)
    assert result.returncode == errors.EXIT_USAGE and "unknown benchmark suite 'no-such-suite'" in result.stderr
    server = next(s for s in command_server._servers.values() if s.process.args[3] == 'memjax.bench')  # pylint: disable=protected-access
    with open(f'/proc/{server.process.pid}/maps') as f:
        assert 'libjax_common' in f.read()


def test_a_served_command_runs_in_the_callers_folder(tmp_path):
    """A relative config path is found from `cwd` or not at all."""
    env = cli_fixtures.cpu_env(1)
    command = [sys.executable, '-m', 'memjax.train', '--config=configs/tiny.py', f'--workdir={tmp_path}/w',
               '--config.model.no_such_field=1']
    found, missing = (command_server.run(command, env=env, capture_output=True, text=True, cwd=cwd)
                      for cwd in (training_fixtures.REPO, str(tmp_path)))
    assert 'no_such_field' in found.stderr and 'no_such_field' not in missing.stderr
    assert found.returncode != 0 and missing.returncode != 0
    flagfile = tmp_path / 'flags'
    flagfile.write_text('--help\n')
    # A --flagfile is left to a new interpreter (the server cannot know what it holds).
    assert command_server.Popen([sys.executable, '-m', 'memjax.train', f'--flagfile={flagfile}'],
                                env=env, stdout=subprocess.DEVNULL)._served is None


def test_a_served_command_is_signalled_and_waited_for_as_a_child(corpus, tmp_path):
    run = cli_fixtures.Run(cli_fixtures.tiny_command(str(tmp_path / 'w'), corpus, str(tmp_path / 'data'),
                                                     '--config.train.num_steps=100000', '--host_memory=off'),
                           cli_fixtures.cpu_env(1), str(tmp_path / 'log'))
    assert run.process._served is not None  # pylint: disable=protected-access
    run.wait_for_text('step ')
    assert run.process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        run.process.wait(0.1)
    run.process.send_signal(signal.SIGKILL)
    assert run.wait() == -signal.SIGKILL
    assert not os.path.exists(f'/proc/{run.process.pid}')  # Reaped, not a zombie.


def test_the_least_recently_used_server_stops_for_a_new_one(monkeypatch, tmp_path):
    monkeypatch.setattr(command_server, 'MAX_SERVERS', 1)
    env = {**cli_fixtures.cpu_env(1), 'MEMJAX_COMMAND_SERVER_PROBE': str(tmp_path)}  # Servers of its own.

    def start(module):
        return command_server.Popen([sys.executable, '-m', module, '--help'], env=env,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    train = start('memjax.train')
    train_server = command_server._servers[command_server._key('memjax.train', train._served[2])]  # pylint: disable=protected-access
    assert train.wait(120) == 1  # absl's --help exit status.
    assert start('memjax.evaluate').wait(120) == 1
    assert train_server.process.poll() is not None and len(command_server._servers) == 1  # pylint: disable=protected-access


def test_a_served_command_in_a_new_session_has_a_process_group_of_its_own(corpus, tmp_path):
    """jupyter_client starts kernels with `start_new_session` and stops them by signalling their
    process group: a served child's group must hold the child alone, not its server (or this worker)."""
    env = {**cli_fixtures.cpu_env(1), 'MEMJAX_COMMAND_SERVER_PROBE': str(tmp_path)}  # A server of its own.
    started = []

    def start(name, new_session):
        log = tmp_path / f'{name}.log'
        with open(log, 'w') as out:
            started.append(command_server.Popen(
                cli_fixtures.tiny_command(str(tmp_path / name), corpus, str(tmp_path / 'data'),
                                          '--config.train.num_steps=100000', '--host_memory=off'),
                env=env, start_new_session=new_session, stdout=out, stderr=subprocess.STDOUT,
                cwd=training_fixtures.REPO, preexec_fn=cli_fixtures.interruptible))
        while 'step ' not in log.read_text():  # Training: alive until killed.
            assert started[-1].poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        return started[-1]

    try:
        own = start('own', True)
        server = command_server._servers[command_server._key('memjax.train', own._served[2])]  # pylint: disable=protected-access
        assert os.getpgid(own.pid) == own.pid != os.getpgid(server.process.pid) == os.getpgrp()
        os.killpg(own.pid, signal.SIGKILL)
        assert own.wait(60) == -signal.SIGKILL and server.process.poll() is None
        # The server serves on, and without the option its children stay in the caller's group.
        shared = start('shared', False)
        assert os.getpgid(shared.pid) == os.getpgrp()
    finally:  # Runs of 100,000 steps: none outlives the test.
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait(60)
