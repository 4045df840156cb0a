"""The notebooks run top to bottom, show their plots, and are stored without outputs."""

import glob
import os

import pytest

nbformat = pytest.importorskip('nbformat', reason="the notebooks are run with nbclient: pip install -e '.[test]'")
nbclient = pytest.importorskip('nbclient', reason="the notebooks are run with nbclient: pip install -e '.[test]'")
from jupyter_client import launcher  # noqa: E402  (nbclient's dependency)

import command_server  # noqa: E402

NOTEBOOKS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), '..', 'notebooks', '*.ipynb')))
# Per cell: a compile on a loaded 2-core machine is slow.
CELL_TIMEOUT_S = 600


def test_there_are_notebooks():
    assert [os.path.basename(p) for p in NOTEBOOKS] and 'getting_started.ipynb' in map(os.path.basename, NOTEBOOKS)


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_stored_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == 'code':
            assert not cell.outputs and cell.execution_count is None, f'{path}: strip the outputs before committing'


# Each notebook's `parameters` cell set to the smallest sizes at which every cell runs and every
# plot is drawn (papermill's convention: the values go in a cell right after it); two layers where
# a notebook trains the quickstart model (each layer compiles on its own; the plots still compare
# layers). The code the notebooks run is the same at any size, and what this checks does not depend
# on it: that they run top to bottom and show their plots, not what the plots say
# (docs/notebooks.md, from larger runs).
SMALLEST = {
    'getting_started.ipynb': dict(STEPS=10, EVAL_BATCHES=1, NEW_TOKENS=16, LAYERS=2),
    'inftyformer_ltm.ipynb': dict(STEPS=3),
    'lamemo_memory.ipynb': dict(STEPS=10, SEGMENTS=3, LAYERS=2),
    'skip_retain.ipynb': dict(STEPS=2, SEGMENTS=20, TIMED_STEPS=2),
    'trams_selection.ipynb': dict(STEPS=4, SEGMENTS=6),
    'transformer_xl_attention.ipynb': dict(STEPS=10, SEGMENTS=2, EVAL_BATCHES=1, LAYERS=2),
}


def test_every_notebook_has_its_smallest_sizes():
    assert sorted(SMALLEST) == sorted(map(os.path.basename, NOTEBOOKS))


def set_parameters(notebook, values: dict) -> None:
    """A cell setting `values` after the cell tagged `parameters`, which must define each of them."""
    index, cell = next((i, c) for i, c in enumerate(notebook.cells) if 'parameters' in c.metadata.get('tags', ()))
    defined = {line.split('=')[0].strip() for line in cell.source.splitlines() if '=' in line}
    assert set(values) <= defined, f'the parameters cell defines no {sorted(set(values) - defined)}'
    notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(
        '\n'.join(f'{name} = {value!r}' for name, value in values.items())))


# What the notebooks import, imported once by the server their kernels are forked from
# (tests/command_server.py); matplotlib is not among them: its backend is the one the kernel sets.
PRELOADED = ('ipykernel.kernelapp', 'jax', 'memjax.analysis', 'memjax.evaluate', 'memjax.generation.text',
             'memjax.training.loop')


@pytest.mark.parametrize('path', NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs_and_shows_its_plots(path, tmp_path, monkeypatch):
    # The kernel inherits it: the runs a notebook trains in temporary folders go with the test's.
    monkeypatch.setenv('TMPDIR', str(tmp_path))
    kernels = []

    def served(*args, **kwargs):
        kernels.append(command_server.Popen(*args, preload=PRELOADED, **kwargs))
        return kernels[-1]

    monkeypatch.setattr(launcher, 'Popen', served)
    notebook = nbformat.read(path, as_version=4)
    set_parameters(notebook, SMALLEST[os.path.basename(path)])
    client = nbclient.NotebookClient(notebook, timeout=CELL_TIMEOUT_S, kernel_name='python3',
                                     resources={'metadata': {'path': os.path.dirname(path)}})
    client.execute()  # Raises CellExecutionError, with the cell and its traceback, on any error.
    assert len(kernels) == 1 and kernels[0]._served, 'the kernel was not forked from its server'  # pylint: disable=protected-access
    images = [output for cell in notebook.cells if cell.cell_type == 'code' for output in cell.outputs
              if 'image/png' in output.get('data', {})]
    shows = sum(cell.source.count('plt.show()') for cell in notebook.cells if cell.cell_type == 'code')
    assert shows and len(images) == shows, f'{path} drew {len(images)} of its {shows} plots'
    # Libraries' notes on what memjax does on purpose (read-only checkpoints, its own text dataset)
    # stay out of a reader's way.
    printed = ''.join(output.get('text', '') for cell in notebook.cells if cell.cell_type == 'code'
                      for output in cell.outputs)
    for note in ('read only', 'read_only=True', 'Using custom data configuration', 'did not provide metrics',
                 'Downloading and preparing dataset', 'dataset_info.py'):
        assert note not in printed, f'{path} printed a library note: {note!r}'
    # Streamed text (generation: 16 bytes here) is kept as a few outputs, not one per token.
    outputs = max(sum(o.output_type == 'stream' and o.name == 'stdout' for o in cell.outputs)
                  for cell in notebook.cells if cell.cell_type == 'code')
    assert outputs <= 8, f'{path} keeps {outputs} printed outputs of one cell'
