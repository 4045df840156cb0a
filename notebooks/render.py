"""Runs notebooks on larger runs and saves their figures, so that readers see them without running.

  python notebooks/render.py --xl=runs/xl_notebook --lamemo=runs/lamemo_notebook \
      --infinity=runs/infinity_notebook --out=docs/notebooks

Each notebook reads its run from the environment (MEMJAX_XL_RUN, ...); a notebook whose runs are
all given is executed, its figures written as <out>/<notebook>-<n>.png and its printed output to
<out>/<notebook>.txt. docs/notebooks.md shows them with the commands that trained the runs. Needs the
`notebooks` extra.
"""

import base64
import os
import sys

from absl import app
from absl import flags
import nbclient
import nbformat

_RUNS = {  # flag: (environment variable, what it names)
    'quickstart': ('MEMJAX_QUICKSTART_RUN', 'the README quickstart workdir'),
    'xl': ('MEMJAX_XL_RUN', 'a Transformer-XL workdir'),
    'lamemo': ('MEMJAX_LAMEMO_RUN', 'a LaMemo workdir on the same data as --xl'),
    'infinity': ('MEMJAX_INFINITY_RUN', 'an infinity-former workdir'),
    'skip': ('MEMJAX_SKIP_RUN', 'a Skip-Retain workdir'),
}
_NEEDS = {
    'getting_started': ('quickstart',),
    'transformer_xl_attention': ('xl',),
    'lamemo_memory': ('lamemo', 'xl'),
    'trams_selection': ('xl',),
    'inftyformer_ltm': ('infinity',),
    'skip_retain': ('skip',),
}
_FLAGS = {name: flags.DEFINE_string(name, None, what) for name, (_, what) in _RUNS.items()}
_OUT = flags.DEFINE_string('out', 'docs/notebooks', 'Folder for the figures and printed outputs.')
_HERE = os.path.dirname(os.path.abspath(__file__))


def render(name: str, env: dict, out: str) -> None:
    path = os.path.join(_HERE, name + '.ipynb')
    notebook = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(notebook, timeout=3600, kernel_name='python3',
                            resources={'metadata': {'path': _HERE}}).execute(env=env)
    figures, text = 0, []
    for cell in notebook.cells:
        for output in cell.get('outputs', []):
            if 'image/png' in output.get('data', {}):
                figures += 1
                with open(os.path.join(out, f'{name}-{figures}.png'), 'wb') as f:
                    f.write(base64.b64decode(output['data']['image/png']))
            elif output.get('name') == 'stdout':
                text.append(output['text'])
    with open(os.path.join(out, f'{name}.txt'), 'w') as f:
        f.write(''.join(text))
    print(f'{name}: {figures} figures in {out}', file=sys.stderr)


def main(argv):
    del argv
    given = {name: os.path.abspath(flag.value) for name, flag in _FLAGS.items() if flag.value}
    missing = [path for path in given.values() if not os.path.isdir(path)]
    if missing:
        sys.exit(f'No workdir at {", ".join(missing)}: train it first (docs/notebooks.md has the commands).')
    names = [name for name, needs in _NEEDS.items() if set(needs) <= set(given)]
    if not names:
        sys.exit('Name at least one run: ' + ', '.join(f'--{name}' for name in _RUNS) + '.')
    os.makedirs(_OUT.value, exist_ok=True)
    env = dict(os.environ, **{_RUNS[name][0]: path for name, path in given.items()})
    for name in names:
        render(name, env, os.path.abspath(_OUT.value))


if __name__ == '__main__':
    app.run(main)
