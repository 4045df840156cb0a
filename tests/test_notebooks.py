"""The notebooks run top to bottom, show their plots, and are stored without outputs."""

import glob
import os

import pytest

import conftest

nbformat = pytest.importorskip('nbformat', reason="the notebooks are run with nbclient: pip install -e '.[test]'")
nbclient = pytest.importorskip('nbclient', reason="the notebooks are run with nbclient: pip install -e '.[test]'")

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), '..', 'notebooks', '*.ipynb')))
# Per cell: a notebook trains a small model inside; a compile on a loaded 2-core machine is slow.
CELL_TIMEOUT_S = 600


def test_there_are_notebooks():
    assert [os.path.basename(p) for p in NOTEBOOKS] and 'getting_started.ipynb' in map(os.path.basename, NOTEBOOKS)


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == 'code':
            assert not cell.outputs and cell.execution_count is None, f'{path}: strip the outputs before committing'


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_and_shows_its_plots(path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name='python3',
                                     resources={'metadata': {'path': os.path.dirname(path)}})
    # The notebooks train for minutes, so their kernel compiles optimised code, as a user's would.
    env = dict(os.environ, XLA_FLAGS=conftest.without_fast_compile(os.environ.get('XLA_FLAGS', '')))
    client.execute(env=env)  # Raises CellExecutionError, with the cell and its traceback, on any error.
    images = [output for cell in notebook.cells if cell.cell_type == 'code' for output in cell.outputs
              if 'image/png' in output.get('data', {})]
    assert images, f'{path} drew no plot'
    # Libraries' notes on what memjax does on purpose (read-only checkpoints, its own text dataset)
    # stay out of a reader's way.
    printed = ''.join(output.get('text', '') for cell in notebook.cells if cell.cell_type == 'code'
                      for output in cell.outputs)
    for note in ('read only', 'read_only=True', 'Using custom data configuration', 'did not provide metrics'):
        assert note not in printed, f'{path} printed a library note: {note!r}'
