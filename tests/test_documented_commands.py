"""Every `python -m memjax...` command the README, BENCHMARKS, docs/, the notebooks and the configs'
docstrings print is one its module takes: known flags, a config that loads with its arguments and
overrides and resolves, suites and sweeps that exist (tests/command_check.py, one process for all).
The README's own commands also run, in tests/test_readme.py."""

import ast
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from memjax import config_lib

import cli_fixtures
import training_fixtures

REPO = training_fixtures.REPO
DOCUMENTS = ['README.md', 'BENCHMARKS.md', *sorted(os.path.relpath(p, REPO) for p in glob.glob(f'{REPO}/docs/*.md')),
             *sorted(os.path.relpath(p, REPO) for p in glob.glob(f'{REPO}/notebooks/*.ipynb')),
             *sorted(os.path.relpath(p, REPO) for p in glob.glob(f'{REPO}/configs/*.py')),
             # What --help prints: the commands' docstrings.
             *sorted(os.path.relpath(p, REPO) for p in glob.glob(f'{REPO}/memjax/**/*.py', recursive=True)
                     if 'python -m memjax' in (ast.get_docstring(ast.parse(open(p, encoding='utf-8').read())) or ''))]
COMMAND = re.compile(r'python3? -m (memjax[\w.]*)(.*)')


def _shell_lines(text: str) -> list[str]:
    """The lines of fenced shell blocks (```bash, ```sh, ```), continuations joined, the variables
    they set (`COMMON="--config=..."`) expanded; a loop's (`$LEN`) stays, a placeholder."""
    lines, fence = [], None
    for line in text.splitlines():
        opening = re.match(r'\s*```(\w*)', line)
        if opening:
            fence = None if fence is not None else opening.group(1)
            continue
        if fence in ('', 'bash', 'sh', 'shell', 'console'):
            lines.append(line)
    expanded, variables = [], {}
    for line in '\n'.join(lines).replace('\\\n', ' ').splitlines():
        line = re.sub(r'\$\{?(\w+)\}?', lambda m: variables.get(m.group(1), m.group(0)), line)
        assignment = re.fullmatch(r'\s*(\w+)=(?:"([^"]*)"|\'([^\']*)\'|(\S*))\s*', line)
        if assignment:
            variables[assignment.group(1)] = next(v for v in assignment.groups()[1:] if v is not None)
        else:
            expanded.append(line)
    return expanded


def _prose(text: str) -> str:
    return re.sub(r'^\s*```.*?^\s*```', '', text, flags=re.S | re.M)


def texts(document: str) -> tuple[list[str], str]:
    """(shell lines, prose with inline code) of a document: a notebook's cells, a config's docstring."""
    path = os.path.join(REPO, document)
    with open(path, encoding='utf-8') as f:
        text = f.read()
    if document.endswith('.ipynb'):
        cells = json.loads(text)['cells']
        text = '\n'.join(''.join(c['source']) for c in cells if c['cell_type'] == 'markdown')
        code = [line.lstrip('!') for c in cells if c['cell_type'] == 'code' for line in ''.join(c['source']).splitlines()]
        return [line for line in code if COMMAND.search(line)], text
    if document.endswith('.py'):  # A docstring: commands indented (a config opens with them) or quoted.
        doc = (ast.get_docstring(ast.parse(text)) or '').replace('\\\n', ' ')
        # A note after the command: `--workdir=gs://... (GPUs/TPUs)`.
        return [re.sub(r'\s+\(.*\)$', '', line) for line in doc.splitlines() if line.startswith('  python')], doc
    return _shell_lines(text), _prose(text)


def commands(document: str) -> list[str]:
    """Every memjax command of the document, as one line: `module arg ...` (comments dropped,
    `[--optional]` brackets opened)."""
    shell, prose = texts(document)
    found = []
    for line in shell:
        for step in line.split(' #')[0].split('&&'):
            found += [m.group(0) for m in [COMMAND.search(step)] if m]
    found += re.findall(r'`(python3? -m memjax[^`]*)`', prose)
    found = [re.sub(r'<[^>]*>', lambda m: '_'.join(m.group(0).split()), c) for c in found]  # <same config>: one word.
    return [' '.join(c.replace('[', ' ').replace(']', ' ').split()) for c in found]


def argv(command: str) -> list[str]:
    module, rest = COMMAND.match(command).groups()
    module = 'memjax.bench.__main__' if module == 'memjax.bench' else module
    return [module, *shlex.split(rest)]


# The checker is no rubber stamp: each of these is refused by the command it names...
WRONG = ['memjax.evaluate --workdir=runs/x --config.eval.model.mem_lenn=256',
         'memjax.evaluate --workdir=runs/x --config.eval.model.mem_len=many',
         'memjax.train --config=configs/quickstart.py',  # No --workdir.
         'memjax.train --config=configs/lamemo_wt103.py:smok --workdir=w',
         'memjax.train --config=configs/quickstart.py --workdir=w --config.train.num_steps=7',  # Not a multiple.
         'memjax.bench.__main__ trainn',
         'memjax.sweep tram --workdir=runs/x',
         'memjax.generate --workdir=runs/x --prompt=a --top=3',
         'memjax.convert.hf_gpt2 --checkpoint=GPT2 --outt=imported/']
# ... and each of these taken (a workdir's own config with overrides on top).
RIGHT = ['memjax.evaluate --workdir=runs/x --config.eval.model.mem_len=256 --config.eval.model.clamp_len=-2',
         'memjax.sweep trams --workdir=runs/x', 'memjax.generate --workdir=... --prompt=a --noecho']


@pytest.fixture(scope='module')
def results(tmp_path_factory):
    """({document: [(command, problem)]}, the probes' problems) from one checking process."""
    # As the documented runs/quickstart: commands that read a workdir without --config take its config.
    workdir = tmp_path_factory.mktemp('runs_quickstart')
    quickstart = config_lib.load_config_file(os.path.join(REPO, 'configs', 'quickstart.py'))
    (workdir / 'config.json').write_text(json.dumps(quickstart.to_dict()))
    every = [(document, command) for document in DOCUMENTS for command in commands(document)]
    probes = [shlex.split(c) for c in WRONG + RIGHT]
    env = cli_fixtures.cpu_env(1)
    env['PYTHONPATH'] = os.pathsep.join([REPO, os.path.join(REPO, 'tests')])
    done = subprocess.run([sys.executable, os.path.join(REPO, 'tests', 'command_check.py'), str(workdir)],
                          input=json.dumps([argv(c) for _, c in every] + probes), cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=cli_fixtures.RUN_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    problems = json.loads(done.stdout.splitlines()[-1])
    by_document: dict[str, list[tuple[str, str]]] = {document: [] for document in DOCUMENTS}
    for (document, command), problem in zip(every, problems):
        if problem:
            by_document[document].append((command, problem))
    return by_document, problems[len(every):]


def test_the_documents_print_commands_of_every_kind():
    """The extraction finds what the pages hold (a regex that found nothing would pass below)."""
    found = {argv(c)[0] for d in DOCUMENTS for c in commands(d)}
    assert {'memjax.train', 'memjax.evaluate', 'memjax.generate', 'memjax.sweep', 'memjax.compare',
            'memjax.bench.__main__', 'memjax.convert.hf_transfo_xl', 'memjax.import_transfo_xl'} <= found
    assert 'memjax.evaluate --workdir=... --config.eval.model.mem_len=256 --config.eval.model.clamp_len=-2' in [
        c.split(' -m ')[1] for c in commands('notebooks/getting_started.ipynb')]


@pytest.mark.parametrize('document', DOCUMENTS)
def test_every_documented_command_is_one_its_module_takes(document, results):
    problems = results[0][document]
    assert not problems, '\n'.join(f'{c}\n    {p}' for c, p in problems)


def test_the_checker_refuses_what_the_commands_refuse_and_takes_what_they_take(results):
    probes = results[1]
    assert all(probes[:len(WRONG)]), list(zip(WRONG, probes))
    assert not any(probes[len(WRONG):]), list(zip(RIGHT, probes[len(WRONG):]))
