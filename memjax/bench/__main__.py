"""Command line: `python -m memjax.bench <suite> [<suite> ...] [--config=configs/X.py] [--size=tiny|full] [--out=F.json]`.

Prints each suite's table (Markdown) on stdout, progress on stderr, and writes the full
report (machine, versions, config, every figure) as JSON to --out; several suites run one after
the other in one process (JAX and the kernels start once), each to its own file: `{suite}` in
--out names it. `--list` names the suites.
Needs nothing beyond memjax, but `peer` (and `accel`'s peer part), which times PyTorch: the
`parity` extra (pip install -e '.[parity]').
"""

from memjax.runtime import host_memory

if __name__ == '__main__':  # The command: importing this module must not re-execute a process.
    host_memory.keep_host_buffers_first()  # Before the imports below: it may re-execute the command.

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import json
import sys

from absl import flags
from ml_collections import config_flags

from memjax import cli
from memjax import errors
from memjax.bench import harness
from memjax.runtime import storage
from memjax.training import workdir as workdir_lib
from memjax import path_flags

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Optional configs/*.py file; suites take the model fields they do not vary '
    'from it (default: each suite\'s own base config).', lock_config=True)
_SIZE = flags.DEFINE_enum('size', 'full', harness.SIZES,
                          'tiny: seconds-long shapes (CI); full: the real measurement.')
_OUT = path_flags.define('out', None, 'Write the JSON report here; {suite} in it is the suite\'s name '
                           '(needed with several suites: --out=reports/{suite}.json).')
_WARMUP = flags.DEFINE_integer('warmup', None, 'Untimed runs before timing (default 2; tiny: 1).')
_REPEATS = flags.DEFINE_integer('repeats', None, 'Timed runs; the median is reported '
                                '(default 5; tiny: 2).')
flags.adopt_module_key_flags(cli)  # --host_memory, --verbose in --help.
_LIST = flags.DEFINE_boolean('list', False, 'Print the available suites and exit.')
_PARTS = flags.DEFINE_list('parts', [], 'Only these parts of a suite that has parts (accel: profile, peak, peer, '
                           'train, roofline, eval, methods, attention, fused, choices, probe); default: the suite\'s own.')
_PEAK_FROM = path_flags.define('peak_from', None, 'accel: the --out report of an earlier run on this '
                                 'machine whose peak rows are this run\'s roofline (not measured again).')


def _check_replaceable(path: str) -> None:
    """Refuses an --out that holds a file other than a bench report, which a new report would replace
    (a report is replaced by the next run of its suite)."""
    text = storage.read_text(path)
    if text is None:
        return
    try:
        report = json.loads(text)
    except ValueError:
        report = None
    if not (isinstance(report, dict) and {'suite', 'machine', 'rows'} <= set(report)):
        raise errors.WorkdirError(f'--out={path} holds a file that is not a memjax bench report, which the report '
                                  'would replace: name another file, or move that one away.')


def main(argv):
    if _LIST.value:
        print('\n'.join(harness.available_suites()))
        return
    suites = argv[1:]
    if not suites:
        raise errors.UsageError(f'name a suite (one of {harness.available_suites()}).')
    if len(suites) > 1 and _OUT.value and '{suite}' not in _OUT.value:
        raise errors.UsageError(f'--out={_OUT.value} would hold {len(suites)} reports: put {{suite}} in it, '
                                'e.g. --out=reports/{suite}.json.')
    outs = {suite: _OUT.value.replace('{suite}', suite) if _OUT.value else None for suite in suites}
    for suite in suites:  # Unknown names and unwritable reports before anything is measured.
        harness.prepare_environment(suite)
        if outs[suite]:
            workdir_lib.check_writable_file(outs[suite])
            _check_replaceable(outs[suite])
    cli.prepare_host_memory()
    tiny = _SIZE.value == 'tiny'
    command = ['python', '-m', 'memjax.bench'] + sys.argv[1:]
    ctx = harness.Context(
        size=_SIZE.value, config=cli.load_run(_CONFIG),
        warmup=_WARMUP.value if _WARMUP.value is not None else (1 if tiny else 2),
        repeats=_REPEATS.value if _REPEATS.value is not None else (2 if tiny else 5), parts=tuple(_PARTS.value),
        peak_from=_PEAK_FROM.value)
    for suite in suites:
        out = outs[suite]
        suite_ctx = ctx if not out else dataclasses.replace(ctx, out=out, on_rows=lambda rows, suite=suite, out=out: (
            harness.write_json(out, harness.partial_report(suite, ctx, rows, command))))
        report = harness.run_suite(suite, suite_ctx, command=command)
        print(harness.report_text(report), flush=True)
        if out:
            harness.write_json(out, report)
            print(f'[bench] wrote {out}', file=sys.stderr)


if __name__ == '__main__':
    cli.main(main)
