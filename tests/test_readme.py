"""The README's commands run in the form it gives them (at tiny size, overrides appended), and the
front-page documents name no file outside the repository."""

import ast
import configparser
import glob
import importlib
import json
import os
import re
import shlex
import subprocess

import pytest

import cli_fixtures
import training_fixtures

REPO = training_fixtures.REPO
README = os.path.join(REPO, 'README.md')
# Appended to a README command: the same command at a size the test suite can afford.
TINY_MODEL = ('--config.model.n_layer=2', '--config.model.d_model=32', '--config.model.n_head=2',
              '--config.model.d_head=16', '--config.model.d_inner=64')


def commands(path: str) -> list[str]:
    """The commands of the file's ```bash blocks, one per line, continuation lines joined, comments
    dropped."""
    with open(path, encoding='utf-8') as f:
        blocks = re.findall(r'```bash\n(.*?)```', f.read(), re.S)
    joined = '\n'.join(blocks).replace('\\\n', ' ')
    return [' '.join(line.split('#')[0].split()) for line in joined.splitlines() if line.split('#')[0].strip()]


def python_part(command: str, module: str) -> list[str]:
    """The `python -m module ...` step of a `&&` chain, as argv."""
    step = next(part for part in command.split('&&') if f'python -m {module} ' in part + ' ')
    return shlex.split(step)


def extras(command: str) -> set[str]:
    return {name for group in re.findall(r"pip install -e '?\.\[([\w,]+)\]", command) for name in group.split(',')}


def run_in(cwd, argv: list[str]) -> subprocess.CompletedProcess:
    env = cli_fixtures.cpu_env(1)
    env['PYTHONPATH'] = REPO  # The checkout, as `pip install -e .` makes it importable.
    os.symlink(os.path.join(REPO, 'configs'), os.path.join(cwd, 'configs'))  # Paths relative to the root.
    argv = [cli_fixtures.sys.executable if argv[0].startswith('python') else argv[0], *argv[1:]]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=cli_fixtures.RUN_TIMEOUT_S)


def test_the_readme_opens_with_the_main_job_then_the_tests_with_extras_that_exist():
    first, second = commands(README)[:2]
    assert 'pip install -e .' in first and 'python -m memjax.train ' in first
    assert 'python -m pytest' in second and 'tests' in shlex.split(second)
    setup = configparser.ConfigParser()
    setup.read(os.path.join(REPO, 'setup.cfg'))
    declared = set(setup['options.extras_require'])
    named = set().union(*(extras(c) for c in commands(README)))
    with open(README, encoding='utf-8') as f:
        named |= set().union(*(extras(c) for c in re.findall(r'`([^`]*pip install[^`]*)`', f.read())))
    assert named and named <= declared, named - declared


def test_the_quickstart_command_trains_as_the_readme_gives_it(tmp_path):
    argv = python_part(commands(README)[0], 'memjax.train')
    done = run_in(tmp_path, argv + list(TINY_MODEL) + ['--config.train.num_steps=4', '--config.train.segments_per_step=2', '--config.train.warmup_steps=0',
                                                      '--config.train.log_every=2', '--config.train.final_eval_batches=1'])
    assert done.returncode == 0, done.stderr[-3000:]
    workdir = tmp_path / next(a.split('=', 1)[1] for a in argv if a.startswith('--workdir='))
    with open(workdir / 'train_summary.json') as f:
        summary = json.load(f)
    assert summary['step'] == 4 and os.path.isdir(workdir / 'checkpoints' / '4')
    # The start-up line names what runs, and the progress lines exclude compilation.
    assert 'parameters' in done.stderr and 'Compiling the training step' in done.stderr


def test_the_tours_comparison_runs_as_the_readme_gives_it(tmp_path):
    tour = next(c for c in commands(README) if 'memjax.compare' in c)
    argv = python_part(tour, 'memjax.compare')
    text_file = next(a.split('=', 1)[1] for a in argv if a.startswith('--config.data.text_path='))
    with open(training_fixtures.write_text_corpus(str(tmp_path / 'corpus')) + '/train.txt') as f:
        (tmp_path / text_file).write_text(f.read() * 2)
    done = run_in(tmp_path, argv + list(TINY_MODEL) + [
        "--config.compare.methods=('none','xl')", '--config.compare.seeds=1', '--config.compare.eval_mem_lens=(8,)',
        '--config.model.mem_len=8', '--config.train.tgt_len=8', '--config.train.batch_size=2',
        '--config.train.segments_per_step=1', '--config.train.num_steps=2', '--config.train.warmup_steps=0',
        '--config.train.eval_every=0', '--config.train.checkpoint_every=0', '--config.eval.batch_size=2'])
    assert done.returncode == 0, done.stderr[-3000:]
    workdir = tmp_path / next(a.split('=', 1)[1] for a in argv if a.startswith('--workdir='))
    with open(workdir / 'comparison.json') as f:
        report = json.load(f)
    assert {row['method'] for row in report['rows']} == {'none', 'xl'} and not report['failures']
    assert '| xl | 8 |' in done.stdout


DOCUMENTS = [README, os.path.join(REPO, 'BENCHMARKS.md'), *sorted(glob.glob(os.path.join(REPO, 'docs', '*.md')))]


@pytest.mark.parametrize('path', DOCUMENTS, ids=lambda p: os.path.relpath(p, REPO))
def test_documents_name_no_file_outside_the_repository(path):
    with open(path, encoding='utf-8') as f:
        text = f.read()
    for target in re.findall(r'\]\(([^)\s#]+)', text):
        if re.match(r'[a-z]+://', target):
            continue
        resolved = os.path.realpath(os.path.join(os.path.dirname(path), target))
        assert resolved.startswith(os.path.realpath(REPO) + os.sep) and os.path.exists(resolved), f'{path} links {target}'
    # Front pages: no paths into the machine they were written on, none above the checkout.
    if os.path.dirname(path) == REPO:
        outside = re.findall(r'(?<![\w.])(\.\./[\w./-]+|/(?:tmp|work|root|home|Users|mnt)/[\w./-]*)', text)
        assert not outside, f'{path} names {outside}'


COMMANDS = ('memjax.train', 'memjax.evaluate', 'memjax.generate', 'memjax.compare', 'memjax.sweep', 'memjax.recl',
            'memjax.bench.__main__')


@pytest.mark.parametrize('module', COMMANDS)
def test_every_commands_help_says_what_it_needs(module):
    """absl's --help prints the command module's docstring (read, not imported: each defines --config)."""
    path = os.path.join(REPO, *module.split('.')) + '.py'
    with open(path, encoding='utf-8') as f:
        assert 'Needs ' in ast.get_docstring(ast.parse(f.read()))


@pytest.mark.parametrize('module, needs', [('memjax.import_transfo_xl', 'Needs torch'),
                                           ('memjax.convert.hf_transfo_xl', '.bin files need torch'),
                                           ('memjax.convert.hf_gpt2', 'safetensors')])
def test_the_importers_take_absl_flags_and_say_what_they_need(module, needs, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as shown:
        main(['--help'])
    assert shown.value.code == 0 and needs in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        main(['--bogus=1'])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.count('\n') == 1 and "Unknown command line flag 'bogus'" in err
