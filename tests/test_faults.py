"""Never lose a run: faults and misuse met by the real command line, for every memory kind where
they apply. Each ends with exit 0 and nothing lost, or with one line (no traceback) naming the
problem and the way forward, and leaves good checkpoints where they were.

The tiny runs are shared: one trained workdir per module is copied for every fault, and all runs
use one compilation cache.
"""

import json
import logging
import os
import resource
import shutil
import signal
import sys
import time

import pytest

from memjax import errors
from memjax.training import run_files
from memjax.runtime import logs
from memjax.training import metrics as metrics_lib
from memjax.training import workdir as workdir_lib
from memjax.training import run_lock
import cli_fixtures
import command_server
import training_fixtures

TIMEOUT_S = 240
KINDS = {'xl': (), 'lamemo': ('--config.model.memory=lamemo',),
         'infinity': ('--config.model.memory=infinity', '--config.model.mem_len=0',
                      '--config.model.ltm_basis=8', '--config.model.ltm_widths=(0.05, 0.1)')}


@pytest.fixture(scope='module')
def env():
    return cli_fixtures.cpu_env(1)


@pytest.fixture(scope='module')
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp('tfds'))


@pytest.fixture(scope='module')
def trained(corpus, env, data_dir, tmp_path_factory):
    """A finished tiny XL run (checkpoints at steps 4 and 8); tests work on copies."""
    workdir = str(tmp_path_factory.mktemp('trained') / 'w')
    code, stderr = run(command(workdir, corpus, data_dir), env)
    assert code == 0, stderr[-3000:]
    return workdir


def command(workdir, corpus, data_dir, *extra, module='memjax.train'):
    return cli_fixtures.tiny_command(workdir, corpus, data_dir, '--host_memory=off', *extra, module=module)


def run(args, env, **kwargs):
    result = command_server.run(args, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                                cwd=training_fixtures.REPO, **kwargs)
    return result.returncode, result.stderr


def copy(workdir, tmp_path, name='w'):
    target = str(tmp_path / name)
    shutil.copytree(workdir, target)
    return target


def message_lines(stderr):
    """stderr without absl's log lines ('I1125 12:00:00.000 ...') and TFDS's progress."""
    return [line for line in stderr.splitlines() if line.strip() and not (
        line[:1] in 'IWE' and line[1:5].isdigit()) and not line.startswith(('Downloading and', 'Dataset '))]


def assert_one_line(code, stderr, expected_code, *fragments):
    lines = message_lines(stderr)
    assert code == expected_code, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]
    assert 'Traceback' not in stderr and 'Exception ignored' not in stderr, stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# --- 1. SIGTERM at any moment -----------------------------------------------------------------


def wait_until_sigterm_is_blocked(pid, timeout=60.0):
    """Until memjax.train's first statement has run (it blocks SIGTERM for its signal thread): the
    interpreter's own start-up before it, some tens of milliseconds, is beyond any program's reach
    and ends with the default action."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with open(f'/proc/{pid}/status') as f:
            blocked = next(int(line.split()[1], 16) for line in f if line.startswith('SigBlk:'))
        if blocked & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.001)
    raise AssertionError(f'process {pid} never blocked SIGTERM')



@pytest.mark.parametrize('kind', sorted(KINDS))
def test_sigterm_at_any_moment_of_start_up_compilation_or_training_exits_0_and_loses_nothing(
        kind, trained, corpus, env, data_dir, tmp_path):
    """Signalled from interpreter start to the training loop (the moments differ with the machine's
    speed; what must hold does not): exit 0, one line or the preemption checkpoint, no traceback,
    the lock released; the same command then finishes the run. (`trained` has prepared the data:
    the runs here only read it.)"""
    del trained
    # Seconds after memjax's first statement (wait_until_sigterm_is_blocked), and once the first
    # updates are done (compiled).
    moments = (0.0, 2.5, 'updates, with compilation')
    extra = KINDS[kind] + ('--config.train.num_steps=400', '--config.train.eval_every=0')
    runs = []
    for i, moment in enumerate(moments):  # Side by side: the three moments cost about one run.
        workdir = str(tmp_path / f'w{i}')
        # A new interpreter where the moment may fall in its imports; the training loop's moment
        # is the same in a command forked from the worker's server, which has imported them.
        runs.append((workdir, moment, cli_fixtures.Run(command(workdir, corpus, data_dir, *extra), env,
                                                       str(tmp_path / f'w{i}.log'), fresh=not isinstance(moment, str))))
    for _, _, started in runs:
        wait_until_sigterm_is_blocked(started.process.pid)
    start = time.time()
    for _, moment, started in runs:
        if isinstance(moment, str):
            started.wait_for_text(moment)
        else:
            time.sleep(max(0.0, start + moment - time.time()))
        started.process.send_signal(signal.SIGTERM)
    for workdir, moment, started in runs:
        code, stderr = started.wait(), started.log()
        assert code == 0, (moment, stderr[-3000:])
        assert 'Traceback' not in stderr and 'Exception ignored' not in stderr, (moment, stderr[-3000:])
        lines = message_lines(stderr)
        stopped_in_loop = not lines and ('Preempted: saved' in stderr or 'Done:' in stderr)
        stopped_outside = len(lines) == 1 and ('nothing new to save' in lines[0]
                                               or 'the final checkpoint is written' in lines[0])
        assert stopped_in_loop or stopped_outside, (moment, stderr[-3000:])
        assert not os.path.exists(os.path.join(workdir, workdir_lib.LOCK_FILE)), moment
    # The run stopped in the loop continues to the end.
    workdir = runs[-1][0]
    assert 'Preempted: saved' in runs[-1][2].log()
    code, stderr = run(command(workdir, corpus, data_dir, *KINDS[kind], '--config.train.num_steps=20',
                               '--config.train.eval_every=0'), env)
    assert code == 0, stderr[-3000:]
    assert json.load(open(os.path.join(workdir, 'train_summary.json')))['step'] >= 20


# --- 2, 3, 9. Damaged checkpoints ---------------------------------------------------------------


def test_every_checkpoint_damaged_stops_with_exit_3_until_the_user_starts_afresh(
        trained, corpus, env, data_dir, tmp_path):
    workdir = copy(trained, tmp_path)
    steps = sorted(os.listdir(run_files.checkpoint_dir(workdir)))
    for step in steps:
        for folder, _, files in os.walk(os.path.join(run_files.checkpoint_dir(workdir), step)):
            for name in files:
                path = os.path.join(folder, name)
                os.truncate(path, os.path.getsize(path) // 2)
    code, stderr = run(command(workdir, corpus, data_dir, '--config.train.num_steps=12'), env)
    line = assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'no intact checkpoint', 'steps 4, 8 are damaged',
                           'checkpoints_damaged', 'To start this run afresh on purpose')
    assert 'Details:' in line or '--verbose' in line or 'warnings above' in line
    assert sorted(os.listdir(run_files.checkpoint_dir(workdir) + '_damaged')) == steps
    # Not silently later either.
    code, stderr = run(command(workdir, corpus, data_dir, '--config.train.num_steps=12'), env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'holds the damaged steps 4, 8')
    # Evaluation says where they went, not only "train first".
    code, stderr = run(command(workdir, corpus, data_dir, module='memjax.evaluate'), env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'no readable checkpoint',
                    f'{run_files.checkpoint_dir(workdir)}_damaged holds the damaged steps')
    shutil.move(run_files.checkpoint_dir(workdir) + '_damaged', str(tmp_path / 'kept'))
    code, stderr = run(command(workdir, corpus, data_dir, '--config.train.num_steps=4'), env)
    assert code == 0, stderr[-3000:]


def test_damage_the_run_recovers_from_is_told_in_lines_of_its_own(trained, corpus, env, data_dir, tmp_path):
    """A truncated newest step (train and evaluate fall back to step 4); garbage in orbax's
    _CHECKPOINT_METADATA (the step is still used) and in a validation-loss record (the folder still
    opens): warnings, never a traceback or orbax's own dump of the file."""
    workdir = copy(trained, tmp_path)
    newest = os.path.join(run_files.checkpoint_dir(workdir), '8')
    for folder, _, files in os.walk(os.path.join(newest, 'arrays')):
        for name in files:
            path = os.path.join(folder, name)
            os.truncate(path, os.path.getsize(path) // 2)
    code, stderr = run(command(workdir, corpus, data_dir, module='memjax.evaluate'), env)
    assert code == 0 and 'Traceback' not in stderr and len(message_lines(stderr)) <= 1, stderr[-3000:]
    assert 'is damaged or incomplete' in stderr and 'eval validation at step 4' in stderr
    code, stderr = run(command(workdir, corpus, data_dir, '--config.train.num_steps=12'), env)
    assert code == 0 and 'Traceback' not in stderr and message_lines(stderr) == [], stderr[-3000:]
    assert 'Resumed from' in stderr and '(step 4)' in stderr
    # Garbage metadata beside intact arrays.
    workdir = copy(trained, tmp_path, 'garbled')
    with open(os.path.join(run_files.checkpoint_dir(workdir), '8', '_CHECKPOINT_METADATA'), 'w') as f:
        f.write('{"garbage": [')
    with open(os.path.join(run_files.checkpoint_dir(workdir), '4', 'metrics', 'metrics'), 'w') as f:
        f.write('{"valid_lo')
    code, stderr = run(command(workdir, corpus, data_dir, '--config.train.num_steps=12'), env)
    assert code == 0 and 'Traceback' not in stderr and message_lines(stderr) == [], stderr[-3000:]
    warnings = [line for line in stderr.splitlines() if line.startswith(('W', 'E')) and line[1:5].isdigit()]
    assert any("_CHECKPOINT_METADATA (timestamps and handler names) does not parse; the checkpoint is still used"
               in line for line in warnings), stderr[-3000:]
    assert any('validation-loss record does not read' in line for line in warnings), stderr[-3000:]
    assert not any('Failed to json parse' in line for line in warnings), stderr[-3000:]
    assert '(step 8)' in stderr


# A file-size limit makes every larger write fail (EFBIG) in orbax's and TensorStore's background
# threads, as a full disk does, without a disk to fill.
def _small_files():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (40_000, 40_000))


def test_failed_save_is_one_line_naming_the_step_that_failed_and_the_details_file(
        trained, corpus, env, data_dir, tmp_path):
    workdir = copy(trained, tmp_path)
    code, stderr = run(command(workdir, corpus, data_dir, '--config.train.num_steps=16'), env,
                       preexec_fn=_small_files)
    log = os.path.join(workdir, 'memjax.log')
    line = assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'saving step 12', 'resume from',
                           os.path.join(run_files.checkpoint_dir(workdir), '8'))
    # The details are kept off the terminal, in the log file unless it could not be written either.
    assert (line.endswith(f'Details: {log}.') and 'Traceback' in open(log).read()
            or line.endswith('--verbose shows the details.')), line
    assert sorted(n for n in os.listdir(run_files.checkpoint_dir(workdir)) if n.isdigit()) == ['4', '8']


def test_library_errors_and_tracebacks_are_held_off_the_terminal_unless_verbose():
    details = logs._LibraryDetails()
    record = lambda path, level, exc=None: logging.LogRecord(
        'absl', level, path, 1, 'message', None, exc)
    library = '/site-packages/orbax/checkpoint/future.py'
    own = os.path.join(os.path.dirname(metrics_lib.__file__), 'loop.py')
    failure = (OSError, OSError(28, 'No space left on device'), None)
    assert details.filter(record(own, logging.ERROR, failure))  # memjax's own lines stay.
    assert details.filter(record(library, logging.WARNING))  # A library's plain warning stays.
    assert not details.filter(record(library, logging.ERROR)) and not details.filter(
        record(library, logging.INFO, failure))
    hook = record(own, logging.ERROR, failure)
    hook.library = True  # An exception a library thread printed, logged by memjax's hook.
    assert not details.filter(hook) and details.held == 3
    details.verbose = True
    assert details.filter(record(library, logging.ERROR, failure))


# --- 4. The lock -----------------------------------------------------------------------------


def test_a_lock_file_that_does_not_name_its_holder_is_refused_in_one_line_then_taken_over_when_old(
        trained, corpus, env, data_dir, tmp_path):
    workdir = copy(trained, tmp_path)
    lock = os.path.join(workdir, workdir_lib.LOCK_FILE)
    for garbage in ('{"pid": "abc"}', '\x00\xff'):
        with open(lock, 'w') as f:
            f.write(garbage)
        code, stderr = run(command(workdir, corpus, data_dir), env)
        assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'does not name its holder', 'delete the file')
    old = time.time() - run_lock.STALE_AFTER_S - 60
    os.utime(lock, (old, old))
    code, stderr = run(command(workdir, corpus, data_dir), env)
    assert code == 0 and 'Taking over the stale lock' in stderr, stderr[-3000:]
    assert not os.path.exists(lock)


# --- 5. The data changed under the run ---------------------------------------------------------


def test_training_data_changed_under_a_run_is_refused_unless_accepted(trained, corpus, env, tmp_path):
    text = str(tmp_path / 'corpus')
    shutil.copytree(corpus, text)
    workdir, data = str(tmp_path / 'w'), str(tmp_path / 'tfds')
    code, stderr = run(command(workdir, text, data, '--config.train.num_steps=4'), env)
    assert code == 0, stderr[-3000:]
    os.utime(os.path.join(text, 'train.txt'))  # Touched: prepared again, the same tokens.
    code, stderr = run(command(workdir, text, data, '--config.train.num_steps=8'), env)
    assert code == 0 and 'reads as the same token ids' in stderr, stderr[-3000:]
    with open(os.path.join(text, 'train.txt'), 'a') as f:
        f.write('A line added while the run was stopped.\n')
    before = sorted(os.listdir(run_files.checkpoint_dir(workdir)))
    code, stderr = run(command(workdir, text, data, '--config.train.num_steps=12'), env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'cannot resume on other data', 'tokens',
                    '--config.data.accept_changed_data=True')
    assert sorted(os.listdir(run_files.checkpoint_dir(workdir))) == before
    code, stderr = run(command(workdir, text, data, '--config.train.num_steps=12',
                               '--config.data.accept_changed_data=True'), env)
    assert code == 0 and 'Resuming although its training data changed' in stderr, stderr[-3000:]


# --- 6. One clean line for each misuse ----------------------------------------------------------


def test_misuse_is_one_line_naming_the_field(corpus, env, data_dir, tmp_path):
    train = [sys.executable, '-m', 'memjax.train', f'--workdir={tmp_path / "never"}']
    configs = os.path.join(training_fixtures.REPO, 'configs')
    code, stderr = run(train + [f'--config={configs}/inftyformer_pg19.py:smok'], env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, "unknown arguments ['smok']; use smoke, sticky")
    code, stderr = run(train + [f'--config={configs}/inftyformer_sorting.py:abc'], env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, "the argument is LENGTH[,xl], got 'abc'")
    code, stderr = run(train + [f'--config={training_fixtures.TINY}', '--config.model.ltm_widths=abc'], env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, "ltm_widths=('abc',) must be a tuple of numbers")
    assert not os.path.exists(tmp_path / 'never')  # A refused config leaves no workdir behind.
    code, stderr = run(train[:3] + [f'--workdir={tmp_path / "sorting"}',
                                    f'--config={configs}/inftyformer_sorting.py:1000000000000'], env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'data.sort_length=1,000,000,000,000', 'GiB')
    manual = tmp_path / 'manual'
    (manual / 'enwik8').mkdir(parents=True)
    code, stderr = run(train[:3] + [f'--workdir={tmp_path / "enwik8"}', f'--config={configs}/transformer_xl_enwik8_base.py',
                                    f'--config.data.manual_dir={manual}', f'--config.data.data_dir={tmp_path / "tfds"}'],
                       env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, f'{manual / "enwik8"} is a folder, not a file')


# --- 7. Divergence -----------------------------------------------------------------------------


@pytest.mark.parametrize('kind', ['xl', 'lamemo'])
def test_an_exploded_finite_loss_stops_the_run_before_it_is_saved(kind, trained, corpus, env, data_dir,
                                                                   tmp_path):
    if kind == 'xl':  # Resumed at a learning rate of 1e3: the good checkpoints stay.
        workdir = copy(trained, tmp_path)
        before = sorted(os.listdir(run_files.checkpoint_dir(workdir)))
        last_good = os.path.join(run_files.checkpoint_dir(workdir), '8')
    else:
        workdir, before, last_good = str(tmp_path / 'w'), None, 'none (no checkpoint yet)'
    code, stderr = run(command(workdir, corpus, data_dir, *KINDS[kind], '--config.train.learning_rate=1e3',
                               '--config.train.num_steps=24'), env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'the run diverged', 'exceeds config.train.diverged_loss',
                    f'the last good checkpoint is {last_good}')
    if before:
        assert sorted(os.listdir(run_files.checkpoint_dir(workdir))) == before


# --- 8. Finished runs --------------------------------------------------------------------------


def test_a_finished_run_started_again_keeps_its_measured_throughput(trained, corpus, env, data_dir, tmp_path):
    workdir = copy(trained, tmp_path)
    summary = json.load(open(os.path.join(workdir, 'train_summary.json')))
    assert summary['train_tokens_per_s'] > 0
    code, stderr = run(command(workdir, corpus, data_dir), env)
    assert code == 0, stderr[-3000:]
    again = json.load(open(os.path.join(workdir, 'train_summary.json')))
    assert again['train_tokens_per_s'] == summary['train_tokens_per_s']
    assert again['valid_loss'] == pytest.approx(summary['valid_loss'])
