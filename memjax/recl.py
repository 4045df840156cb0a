"""Command line: the relative effective context length (RECL) of a group of trained runs.

Needs trained workdirs that read the same data with the same tokenizer (and one evaluation batch
and segment length), of any memory kind; `WORKDIR@trams` scores an XL run's parameters as TRAMS.
The figure needs the `plot` extra.

  python -m memjax.recl --workdirs=runs/none,runs/xl,runs/xl@trams --contexts=16,32,48,64 --out=runs/recl_group \
      [--r=0.1,0.5,1.0] [--clamp_len=-2]

Every member scores the split (`--split`, its first `--max_batches` batches) at each context length
c, every token attending c positions (`memjax.analysis.recl.context_settings`: the attention for
Transformer-XL and LaMemo, the short-term memory for the infinity-former, the attended rows for
TRAMS, a window of c for a Transformer without memory); the per-token losses give each member's
RECL at each r as the Transformer-XL paper's appendix C defines it, against the group's best member
at each context. `--out` receives recl.md (the table), recl.json and recl.png (the paper's figure 3
at the first r), and the per-token losses, which a stopped command reads back when run again.
"""

from memjax.runtime import host_memory

if __name__ == '__main__':  # The command: importing this module must not re-execute a process.
    host_memory.keep_host_buffers_first()  # Before the imports below: it may re-execute the command.

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import json

from absl import flags

from memjax import cli
from memjax import errors
from memjax.analysis import recl as recl_lib
from memjax.runtime import storage
from memjax import path_flags

_WORKDIRS = path_flags.define_list('workdirs', None, 'The group: trained workdirs, comma-separated; WORKDIR@trams scores '
                              'an XL run as TRAMS.')
_CONTEXTS = flags.DEFINE_list('contexts', None, 'Context lengths in tokens, increasing by a step Delta.')
_R = flags.DEFINE_list('r', ['0.1', '0.5', '1.0'], 'Shares of the hardest tokens (by the group\'s baseline) scored.')
_OUT = path_flags.define('out', None, 'Folder for the table, the figure and the per-token losses.')
_SPLIT = flags.DEFINE_string('split', 'validation', 'The split scored.')
_MAX_BATCHES = flags.DEFINE_integer('max_batches', -1, 'Evaluation batches of the split scored; -1: all of it.')
_CLAMP_LEN = flags.DEFINE_integer('clamp_len', None, 'Relative distances beyond it scored as it, for every run; -2: '
                                  'the longest each run was trained on; default: each run\'s config.eval.model.')
flags.mark_flags_as_required(['workdirs', 'contexts', 'out'])
flags.adopt_module_key_flags(cli)


def _numbers(values, kind, name):
    try:
        return [kind(v) for v in values]
    except ValueError:
        raise errors.UsageError(f'--{name}={",".join(values)}: give numbers, comma-separated.') from None


def main(argv):
    if len(argv) > 1:
        raise errors.UsageError(f'unexpected arguments: {argv[1:]}')
    contexts, rs = _numbers(_CONTEXTS.value, int, 'contexts'), _numbers(_R.value, float, 'r')
    if len(contexts) < 2 or contexts != sorted(set(contexts)) or contexts[0] < 1:
        raise errors.UsageError(f'--contexts={",".join(_CONTEXTS.value)}: give at least two increasing lengths >= 1 '
                                '(RECL steps from one to the next).')
    if not rs or not all(0 < r <= 1 for r in rs):
        raise errors.UsageError(f'--r={",".join(_R.value)}: give shares in (0, 1], comma-separated.')
    result = cli.run(lambda: recl_lib.group_recl(_WORKDIRS.value, contexts, rs, _OUT.value, _SPLIT.value,
                                                 _MAX_BATCHES.value, _CLAMP_LEN.value))
    text = recl_lib.table(result)
    storage.write_result(storage.join(_OUT.value, 'recl.md'), text + '\n')
    record = {**{k: v for k, v in dataclasses.asdict(result).items() if k not in ('recl', 'gains')},
              'recl': [{str(r): dataclasses.asdict(found) for r, found in runs.items()} for runs in result.recl],
              'gains_at_first_r': result.gains.tolist()}
    storage.write_result(storage.join(_OUT.value, 'recl.json'), json.dumps(record, indent=1, allow_nan=True))
    if not recl_lib.plot(result, storage.join(_OUT.value, 'recl.png')):
        text += '\n\n(no recl.png: the figure needs matplotlib, pip install -e \'.[plot]\')'
    print(text)


if __name__ == '__main__':
    cli.main(main)
