"""Every config that reproduces a paper or its authors' code holds, field by field, the values
docs/paper_configs.md gives with their sources."""

import ast
import glob
import os
import re

import pytest

from memjax import config_lib

ROOT = os.path.join(os.path.dirname(__file__), '..')
DOC = os.path.join(ROOT, 'docs', 'paper_configs.md')
# Configs of memjax's own making; every other one names a paper or the released code it follows.
OWN = {'compare_kjv.py', 'quickstart.py', 'tiny.py'}
SECTION = re.compile(r'^### `configs/(?P<file>\w+\.py)(?::(?P<arg>[\w,]+))?`\s*$')
ROW = re.compile(r'^\| `(?P<field>\w+\.\w+)` \| `(?P<value>[^`]*)` \| (?P<source>.*\S) \|\s*$')


def documented() -> dict[tuple[str, str], list[tuple[str, str, str]]]:
    """(config file, argument) -> its rows (field, value, source), in the document's order."""
    sections: dict[tuple[str, str], list] = {}
    current = None
    with open(DOC) as f:
        for line in f:
            heading = SECTION.match(line)
            if heading:
                current = sections.setdefault((heading['file'], heading['arg'] or ''), [])
            elif line.startswith('#'):
                current = None
            elif current is not None and ROW.match(line):
                row = ROW.match(line)
                current.append((row['field'], row['value'], row['source']))
    return sections


SECTIONS = documented()


def resolved_value(run: config_lib.RunConfig, field: str):
    """`model.x`, `eval_model.x` (the model evaluation runs), `train.x`, `eval.x`, `data.x`."""
    section, name = field.split('.')
    return getattr(getattr(run, section), name)


def test_every_paper_config_is_documented():
    files = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, 'configs', '*.py'))} - OWN
    assert files <= {file for file, _ in SECTIONS}, sorted(files - {file for file, _ in SECTIONS})
    for (file, arg), rows in SECTIONS.items():
        assert len(rows) >= 5, f'{file}:{arg} lists {len(rows)} fields'


@pytest.mark.parametrize('file, arg', sorted(SECTIONS), ids=lambda x: x or 'default')
def test_the_config_holds_the_documented_values(file, arg):
    config = config_lib.load_config_module(os.path.join(ROOT, 'configs', file)).get_config(*([arg] if arg else []))
    run = config_lib.resolve(config)
    for field, text, source in SECTIONS[(file, arg)]:
        want = ast.literal_eval(text)
        got = resolved_value(run, field)
        if isinstance(want, float) or isinstance(got, float):
            assert got == pytest.approx(want, rel=1e-12), f'{file}:{arg} {field} = {got!r}, documented {text} ({source})'
        else:
            assert got == want, f'{file}:{arg} {field} = {got!r}, documented {text} ({source})'
