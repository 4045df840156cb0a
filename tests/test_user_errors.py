"""Every user error of the command lines is one line on stderr with a distinct exit status,
before anything is compiled; the traceback only comes with --verbose."""

import io
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest

from memjax import errors
from memjax.generation import Sampling
from memjax.generation import text as generation_text
from memjax.training import loop as trainer
from memjax.training import experiment
from memjax.training import run_files
from memjax.training import run_lock
import cli_fixtures
import command_server
import disks
import training_fixtures

# Start-up failures come within seconds; this only bounds a run that would hang.
TIMEOUT_S = 120


@pytest.fixture(scope='module')
def trained(corpus, tmp_path_factory):
    """A finished tiny run: (workdir, data_dir)."""
    workdir = str(tmp_path_factory.mktemp('trained'))
    trainer.train_and_evaluate(training_fixtures.tiny_config(corpus, train__eval_every=0), workdir)
    return workdir, os.path.join(corpus, 'tfds')


@pytest.fixture(scope='module')
def env():
    return cli_fixtures.cpu_env(1)


def run(command, env, **kwargs):
    result = command_server.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                                cwd=training_fixtures.REPO, **kwargs)
    return result.returncode, result.stderr


def error_lines(stderr):
    """stderr without the log lines (absl's 'I1123 ...' prefix) and TFDS's progress."""
    return [line for line in stderr.splitlines()
            if line.strip() and not (line[:1] in 'IWE' and line[1:5].isdigit())]


def assert_one_line(code, stderr, expected_code, *fragments):
    lines = error_lines(stderr)
    assert code == expected_code, stderr[-3000:]
    assert len(lines) == 1, stderr[-3000:]
    assert 'Traceback' not in stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_a_quoted_library_error_is_one_line_and_says_where_it_was_cut():
    assert errors.brief(ValueError('spec:\n  {"a": 1}')) == 'spec: {"a": 1}'
    cut = errors.brief(ValueError('x' * 500), 40)
    assert cut == 'x' * 36 + ' ...' and len(cut) == 40


def test_unknown_field_unloadable_config_and_bad_flag_value(env):
    train = [sys.executable, '-m', 'memjax.train', '--workdir=/nonexistent/never-created']
    code, stderr = run(train + [f'--config={training_fixtures.TINY}',
                                '--config.train.lerning_rate=1e-3'], env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, 'config.train.lerning_rate',
                    'Did you mean "learning_rate"')
    code, stderr = run(train + ['--config=configs/no_such_config.py'], env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, 'configs/no_such_config.py does not load')
    code, stderr = run(train + [f'--config={training_fixtures.TINY}',
                                '--config.train.batch_size=four'], env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, 'Usage error', 'batch_size')
    code, stderr = run([sys.executable, '-m', 'memjax.bench', 'no-such-suite'], env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, "unknown benchmark suite 'no-such-suite'")
    code, stderr = run(train + [f'--config={training_fixtures.TINY}', '--num_steps=3'], env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, "Unknown command line flag 'num_steps'",
                    'set as --config.train.num_steps=...')
    code, stderr = run(train + [f'--config={training_fixtures.TINY}:extra'], env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, 'takes 0 positional arguments', 'drop it')
    assert not os.path.exists('/nonexistent/never-created')


def test_a_bench_report_that_cannot_be_written_is_refused_before_measuring(env, tmp_path):
    a_file = tmp_path / 'a_file'
    a_file.write_text('x')
    bench = [sys.executable, '-m', 'memjax.bench', 'ops', '--size=tiny']
    code, stderr = run(bench + [f'--out={a_file}/report.json'], env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, f'{a_file} is a file, not a folder')
    code, stderr = run(bench + [f'--out={tmp_path}'], env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, f'{tmp_path} is a folder')
    code, stderr = run(bench + ['peak', f'--out={tmp_path}/report.json'], env)  # Two suites, one file.
    assert_one_line(code, stderr, errors.EXIT_USAGE, 'would hold 2 reports', '{suite}')
    theirs = tmp_path / 'keep.json'
    theirs.write_text('{"my": "numbers"}')
    code, stderr = run(bench + [f'--out={theirs}'], env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, f'--out={theirs} holds a file that is not a memjax bench report')
    assert theirs.read_text() == '{"my": "numbers"}'
    assert '[bench]' not in stderr  # Nothing measured.


@pytest.mark.parametrize('source, fragments, traced', [
    ('def get_config(:\n  pass\n', ('does not load: SyntaxError: invalid syntax', 'line 1'), True),
    ('def get_config():\n  return undefined_name\n', ("NameError: name 'undefined_name' is not defined",), True),
    ('X = 1\n', ('it defines no get_config()',), False),  # Raised by ml_collections, not by the file.
])
def test_a_config_file_that_does_not_load_is_one_line_and_verbose_shows_its_traceback(env, tmp_path, source,
                                                                                       fragments, traced):
    config = tmp_path / 'mine.py'
    config.write_text(source)
    command = [sys.executable, '-m', 'memjax.train', f'--config={config}', f'--workdir={tmp_path / "w"}']
    code, stderr = run(command, env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, f'--config={config}', *fragments)
    code, stderr = run(command + ['--verbose'], env)
    assert code == errors.EXIT_USAGE and 'Traceback (most recent call last)' in stderr
    assert ('mine.py", line' in stderr) == traced  # The file's own line, where it has one.
    assert not os.path.exists(tmp_path / 'w')


def test_a_workdir_written_with_a_tilde_is_one_folder_in_the_home_for_every_module(trained, corpus, env, tmp_path):
    """`--workdir=~/run` reaches the command as typed (no shell expands a `~` inside a word): it is
    the home's folder for the lock as for the checkpoints, so a run there is refused while another
    holds it, and evaluation reads the home's folder too; nothing named `~` is made."""
    home = tmp_path / 'home'
    (home / 'run').mkdir(parents=True)
    env = {**env, 'HOME': str(home)}
    with run_lock.RunLock(str(home / 'run')):
        code, stderr = run(cli_fixtures.tiny_command('~/run', corpus, trained[1]), env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, f'{home}/run', f'process {os.getpid()}')
    code, stderr = run([sys.executable, '-m', 'memjax.evaluate', '--workdir=~/elsewhere'], env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, f'--workdir={home}/elsewhere does not exist')
    assert not os.path.exists(os.path.join(training_fixtures.REPO, '~'))


def test_training_into_a_folder_memjax_did_not_write_changes_nothing_there(corpus, env, tmp_path):
    theirs = tmp_path / 'theirs'
    theirs.mkdir()
    for name in ('config.json', 'train_summary.json'):
        (theirs / name).write_text('their own')
    code, stderr = run(cli_fixtures.tiny_command(str(theirs), corpus, str(tmp_path / 'tfds')), env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'holds files no memjax run wrote', f'--workdir={theirs}/run')
    assert sorted(os.listdir(theirs)) == ['config.json', 'train_summary.json']
    assert {(theirs / name).read_text() for name in os.listdir(theirs)} == {'their own'}


def test_every_model_and_train_problem_is_reported_in_one_round(corpus, env, tmp_path):
    command = cli_fixtures.tiny_command(str(tmp_path / 'w'), corpus, str(tmp_path / 'tfds'),
                                        '--config.model.d_model=33', '--config.model.dropout=1.5',
                                        '--config.train.batch_size=0', f'--config.seed={2**64}')
    code, stderr = run(command, env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, 'd_model=33', 'dropout=1.5', 'batch_size=0',
                    f'config.seed={2**64} must be an int in [0, 2**32)')


def test_resume_with_another_batch_size_is_refused_and_verbose_adds_the_traceback(trained, corpus,
                                                                                  env):
    workdir, data_dir = trained
    before = sorted(os.listdir(run_files.checkpoint_dir(workdir)))
    command = cli_fixtures.tiny_command(workdir, corpus, data_dir, '--config.train.batch_size=8')
    code, stderr = run(command, env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, 'train.batch_size 4 -> 8',
                    f'--config.train.init_from={workdir}')
    assert sorted(os.listdir(run_files.checkpoint_dir(workdir))) == before
    code, stderr = run(command + ['--verbose'], env)
    assert code == errors.EXIT_USAGE and 'Traceback (most recent call last)' in stderr


def test_evaluate_refuses_other_parameters_and_never_creates_a_workdir(trained, corpus, env,
                                                                       tmp_path):
    workdir, data_dir = trained
    evaluate = lambda w, *extra: cli_fixtures.tiny_command(w, corpus, data_dir, *extra,
                                                           module='memjax.evaluate')
    code, stderr = run(evaluate(workdir, '--config.model.d_model=64'), env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, 'model.d_model 32 -> 64')
    missing = str(tmp_path / 'typo')
    code, stderr = run(evaluate(missing), env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'does not exist')
    assert not os.path.exists(missing)
    os.makedirs(os.path.join(workdir, 'eval_test.json'))  # Where the result would go.
    try:
        code, stderr = run(evaluate(workdir, '--config.eval.split=test'), env)
        assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'eval_test.json')
        assert 'tokens scored' not in stderr  # Refused before evaluating.
    finally:
        os.rmdir(os.path.join(workdir, 'eval_test.json'))


def test_bad_data_and_tokenizer_files_are_one_line(corpus, env, tmp_path):
    binary = tmp_path / 'binary'
    binary.mkdir()
    for name in ('valid.txt', 'test.txt'):
        (binary / name).write_bytes(open(os.path.join(corpus, name), 'rb').read())
    (binary / 'train.txt').write_bytes(bytes(range(128, 256)) * 40)
    code, stderr = run(cli_fixtures.tiny_command(str(tmp_path / 'w1'), str(binary),
                                                 str(tmp_path / 'tfds')), env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'not valid UTF-8', 'iconv')
    garbage = tmp_path / 'tokenizer.json'
    garbage.write_bytes(b'\x00\xff not json')
    code, stderr = run(cli_fixtures.tiny_command(
        str(tmp_path / 'w2'), corpus, str(tmp_path / 'tfds'),
        f'--config.data.vocab_path={garbage}'), env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'is not a memjax tokenizer file')
    model = tmp_path / 'garbage.model'
    model.write_bytes(b'not a sentencepiece model')
    code, stderr = run(cli_fixtures.tiny_command(
        str(tmp_path / 'w3'), corpus, str(tmp_path / 'tfds'), '--config.data.tokenizer=sentencepiece',
        f'--config.data.vocab_path={model}'), env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'is not a sentencepiece model')
    a_file = tmp_path / 'a_file'
    a_file.write_text('x')
    code, stderr = run(cli_fixtures.tiny_command(str(tmp_path / 'w4'), corpus, str(a_file / 'tfds')), env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, f'config.data.data_dir: {a_file}/tfds cannot be created')
    code, stderr = run(cli_fixtures.tiny_command(str(tmp_path / 'w5'), corpus, str(tmp_path / 'tfds'),
                                                 f'--config.data.cache_dir={a_file}/cache'), env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, f'config.data.cache_dir: {a_file}/cache cannot be created')


def patched_train(patch: str) -> list[str]:
    """`python -c` running memjax.train after `patch` (Python source) faked a fault or a pause.
    SIGTERM is taken over first, as memjax.train does before its imports: threads that the patch's
    imports start must inherit the block, or a SIGTERM sent to one of them waits for the main
    thread's sleep to end."""
    script = 'from memjax import early_sigterm\nearly_sigterm.install()\n' + textwrap.dedent(patch) + textwrap.dedent('''
        import runpy, sys
        sys.argv = ['memjax.train'] + sys.argv[1:]
        runpy.run_module('memjax.train', run_name='__main__', alter_sys=True)
    ''')
    return [sys.executable, '-c', script]


# orbax's array writer fails, as a full disk would make it fail.
_FAILING_SAVE = '''
    from orbax.checkpoint._src.serialization import jax_array_handlers
    def refuse(*args, **kwargs):
        raise OSError(28, 'No space left on device')
    jax_array_handlers.check_array_values = refuse
'''


def test_failed_save_ends_the_process_with_a_message(corpus, env, tmp_path):
    command = cli_fixtures.tiny_command(str(tmp_path / 'w'), corpus, str(tmp_path / 'tfds'),
                                        '--host_memory=off')
    code, stderr = run(patched_train(_FAILING_SAVE) + command[3:], env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'saving step 4', 'No space left',
                    'resume from the start')


# A pause before the train step is built, to stop the run there.
_PAUSED_START = '''
    import time
    from memjax.training import experiment
    def pause(*args):
        print('PAUSED', flush=True)
        time.sleep(600)
    experiment.make_eval_step = pause
'''


@pytest.mark.parametrize('signum, code, name', [(signal.SIGTERM, 0, 'SIGTERM'), (signal.SIGINT, 130, 'Ctrl-C')])
def test_a_signal_during_start_up_stops_at_once(corpus, env, tmp_path, signum, code, name):
    command = cli_fixtures.tiny_command(str(tmp_path / 'w'), corpus, str(tmp_path / 'tfds'),
                                        '--host_memory=off')
    process = subprocess.Popen(patched_train(_PAUSED_START) + command[3:], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd=training_fixtures.REPO, preexec_fn=cli_fixtures.interruptible)
    for line in process.stdout:  # TFDS prints its progress on stdout first.
        if line.strip() == 'PAUSED':
            break
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == code, stderr[-3000:]
    assert f'Stopped by {name} outside the training loop: nothing new to save' in stderr
    assert 'Traceback' not in stderr
    assert not os.listdir(run_files.checkpoint_dir(str(tmp_path / 'w')))


def test_converter_errors_are_one_line(env, tmp_path):
    code, stderr = run([sys.executable, '-m', 'memjax.convert.hf_transfo_xl',
                        f'--checkpoint={tmp_path / "missing"}', f'--out={tmp_path / "out"}'], env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'does not exist')


def test_an_unknown_sweep_is_one_line(env, tmp_path):
    code, stderr = run([sys.executable, '-m', 'memjax.sweep', 'tram', '--config=configs/tiny.py',
                        f'--workdir={tmp_path}'], env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, "name exactly one sweep (one of ['trams'])")
    for flag in ('--pools=-4,8', '--fixed=pool=0'):  # Named by the flag, not by the mem_len it becomes.
        code, stderr = run([sys.executable, '-m', 'memjax.sweep', 'trams', '--config=configs/tiny.py',
                            f'--workdir={tmp_path}', flag], env)
        assert_one_line(code, stderr, errors.EXIT_USAGE, f'{flag} must be comma-separated positive integers')


@pytest.mark.parametrize('flags, message', [
    (['--contexts=16,16'], '--contexts=16,16: give at least two increasing lengths >= 1'),
    (['--contexts=32,16'], '--contexts=32,16: give at least two increasing lengths >= 1'),
    (['--contexts=0,16'], '--contexts=0,16: give at least two increasing lengths >= 1'),
    (['--contexts=16,32', '--r='], '--r=: give shares in (0, 1], comma-separated'),
    (['--contexts=16,32', '--r=0.1,2'], '--r=0.1,2: give shares in (0, 1], comma-separated'),
])
def test_recl_refuses_contexts_and_shares_it_cannot_step_before_reading_a_run(env, tmp_path, flags, message):
    """Before any workdir is read (these do not exist): a repeated context would leave one length and
    no step, an empty --r no share to score."""
    code, stderr = run([sys.executable, '-m', 'memjax.recl', f'--workdirs={tmp_path / "a"},{tmp_path / "b"}',
                        f'--out={tmp_path / "out"}', *flags], env)
    assert_one_line(code, stderr, errors.EXIT_USAGE, message)
    assert not (tmp_path / 'out').exists()


def test_help_lists_the_flags_users_set(env):
    for module in ('memjax.train', 'memjax.evaluate', 'memjax.sweep'):
        result = command_server.run([sys.executable, '-m', module, '--help'], env=env,
                                    capture_output=True, text=True, timeout=TIMEOUT_S)
        for flag in ('config', 'workdir', 'host_memory', 'verbose', 'coordinator_address',
                     'num_processes', 'process_id'):
            assert f'--{flag}:' in result.stdout or f'--[no]{flag}:' in result.stdout, (module, flag)


def test_generate_errors_are_one_line(trained, env, tmp_path):
    workdir, _ = trained
    empty = command_server.run([sys.executable, '-m', 'memjax.generate', f'--workdir={workdir}', '--prompt='], env=env,
                               capture_output=True, text=True, timeout=TIMEOUT_S, cwd=training_fixtures.REPO)
    assert_one_line(empty.returncode, empty.stderr, errors.EXIT_USAGE, 'the prompt is empty')
    assert empty.stdout == ''  # Nothing echoed of a prompt the model does not read.
    refused = command_server.run([sys.executable, '-m', 'memjax.generate', f'--workdir={workdir}', '--prompt=a prompt',
                                  '--temperature=-1', '--top_k=-1'], env=env, capture_output=True, text=True,
                                 timeout=TIMEOUT_S, cwd=training_fixtures.REPO)
    assert_one_line(refused.returncode, refused.stderr, errors.EXIT_USAGE, 'temperature=-1.0 must be a finite number',
                    'top_k=-1 must be >= 0')
    assert refused.stdout == ''  # Refused before the prompt is echoed.
    code, stderr = run([sys.executable, '-m', 'memjax.generate', f'--workdir={tmp_path}', '--prompt=a'], env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'holds no readable config.json')


def test_generate_echoes_the_prompt_unless_told_not_to_and_reports_its_speed(trained, env):
    workdir, _ = trained
    command = [sys.executable, '-m', 'memjax.generate', f'--workdir={workdir}', '--prompt=the memory',
               '--max_new_tokens=6', '--temperature=0']
    shown, hidden = (command_server.run(command + extra, env=env, capture_output=True, text=True, timeout=TIMEOUT_S,
                                        cwd=training_fixtures.REPO) for extra in ([], ['--noecho']))
    assert shown.returncode == hidden.returncode == 0, shown.stderr[-2000:] + hidden.stderr[-2000:]
    continuation = generation_text.generate(None, workdir, 'the memory', 6, Sampling(temperature=0), out=io.StringIO())[0]
    assert shown.stdout.rstrip('\n') == 'the memory' + continuation and hidden.stdout.rstrip('\n') == continuation
    assert re.search(r'6 tokens in [0-9.]+ s, [0-9,.]+ tokens/s', shown.stderr)


def test_a_state_too_large_for_the_device_is_refused_before_anything_is_built(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(experiment, 'make_train_step', lambda *a, **k: pytest.fail('compiled'))
    monkeypatch.setattr(experiment, 'device_memory_bytes', lambda device: 16 * 2**30)
    # An XL memory position: 2 layers x batch 4 x d_model 32 float32 hidden states and 4 validity
    # bytes (configs/tiny.py), 1028 bytes: 2**30 positions hold 1028 GiB.
    config = training_fixtures.tiny_config(corpus, model__mem_len=2**30)
    with pytest.raises(errors.OutOfMemoryError, match=r'needs 1,028.0 GiB per device .*memory 1,028.0 GiB; '
                                                      r"mem_len=1073741824, batch 4\), more than a device's 16.0 GiB"):
        trainer.train_and_evaluate(config, str(tmp_path / 'w'))
    assert not os.path.exists(run_files.checkpoint_dir(str(tmp_path / 'w')))


def test_a_step_out_of_device_memory_is_one_line_with_the_ways_out(env):
    script = ('import jax\nfrom memjax import cli\n\ndef job(argv):\n'
              "    raise jax.errors.JaxRuntimeError(\n"
              "        'RESOURCE_EXHAUSTED: Out of memory allocating 307200000000 bytes.')\n\n"
              'cli.main(job)\n')
    code, stderr = run([sys.executable, '-c', script], env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'Out of memory: a step did not fit',
                    '(Out of memory allocating 307200000000 bytes)', 'grad_accum_steps', 'remat=full')
    # XLA:CPU's words for the same (a generation's prompt pass over a segment far too long).
    code, stderr = run([sys.executable, '-c', script.replace(
        'RESOURCE_EXHAUSTED:', 'INTERNAL: Error dispatching computation:')], env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'Out of memory: a step did not fit',
                    '(Out of memory allocating 307200000000 bytes)')
    code, stderr = run([sys.executable, '-c', script.replace(
        'RESOURCE_EXHAUSTED: Out of memory allocating', 'INTERNAL: Failed to allocate a buffer table of')], env)
    assert code == 1 and 'Traceback' in stderr  # Not a memory problem: a bug, with its traceback.


def test_generation_refuses_non_finite_settings_and_counts_its_samples_in_the_memory_check(trained, env):
    workdir, _ = trained
    for flag in ('--temperature=nan', '--temperature=inf'):
        code, stderr = run([sys.executable, '-m', 'memjax.generate', f'--workdir={workdir}', '--prompt=a', flag], env)
        assert_one_line(code, stderr, errors.EXIT_USAGE, 'must be a finite number >= 0')
    code, stderr = run([sys.executable, '-m', 'memjax.generate', f'--workdir={workdir}', '--prompt=a',
                        '--num_samples=1000000000'], env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'Out of memory', 'samples', 'batch 1000000000',
                    'lower mem_len or --num_samples')


def test_sweep_on_a_workdir_that_does_not_exist_creates_nothing(env, tmp_path):
    missing = tmp_path / 'missing'
    code, stderr = run([sys.executable, '-m', 'memjax.sweep', 'trams', '--config=configs/tiny.py',
                        f'--workdir={missing}'], env)
    assert_one_line(code, stderr, errors.EXIT_RUNTIME, 'does not exist')
    assert not missing.exists()


def test_a_read_only_workdir_is_read_by_generate_and_refused_in_one_line_by_sweep(trained, env, tmp_path):
    """An archived run on a read-only disk (a tmpfs remounted read-only; skipped where this machine
    cannot mount one)."""
    workdir, _ = trained
    with disks.small_disk(tmp_path / 'disk', 64 * 1024, read_only=True, holding=workdir) as disk:
        result = command_server.run([sys.executable, '-m', 'memjax.generate', f'--workdir={disk}', '--prompt=a',
                                     '--max_new_tokens=4', '--temperature=0'], env=env, capture_output=True, text=True,
                                    timeout=TIMEOUT_S, cwd=training_fixtures.REPO)
        assert result.returncode == 0 and len(result.stdout) > 0, result.stderr[-3000:]
        code, stderr = run([sys.executable, '-m', 'memjax.sweep', 'trams', f'--config={training_fixtures.TINY}',
                            f'--workdir={disk}'], env)
        assert_one_line(code, stderr, errors.EXIT_RUNTIME, f'cannot write {disk}/sweep_trams/results.json')
