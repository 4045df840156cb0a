"""Command line: `python -m memjax.bench <suite> [--config=configs/X.py] [--size=tiny|full] [--out=F.json]`.

Prints the suite's table (Markdown) on stdout, progress on stderr, and writes the full
report (machine, versions, config, every figure) as JSON to --out. `--list` names the suites.
Needs nothing beyond memjax, but `peer` (and `accel`'s peer part), which times PyTorch: the
`parity` extra (pip install -e '.[parity]').
"""

import dataclasses
import sys

from absl import flags
from ml_collections import config_flags

from memjax import cli
from memjax import errors
from memjax.bench import harness
from memjax.training import workdir as workdir_lib

_CONFIG = config_flags.DEFINE_config_file(
    'config', None, 'Optional configs/*.py file; suites take the model fields they do not vary '
    'from it (default: each suite\'s own base config).', lock_config=True)
_SIZE = flags.DEFINE_enum('size', 'full', harness.SIZES,
                          'tiny: seconds-long shapes (CI); full: the real measurement.')
_OUT = flags.DEFINE_string('out', None, 'Write the JSON report here.')
_WARMUP = flags.DEFINE_integer('warmup', None, 'Untimed runs before timing (default 2; tiny: 1).')
_REPEATS = flags.DEFINE_integer('repeats', None, 'Timed runs; the median is reported '
                                '(default 5; tiny: 2).')
flags.adopt_module_key_flags(cli)  # --host_memory, --verbose in --help.
_LIST = flags.DEFINE_boolean('list', False, 'Print the available suites and exit.')
_PARTS = flags.DEFINE_list('parts', [], 'Only these parts of a suite that has parts (accel: peak, peer, train, '
                           'eval, methods, attention, fused, choices, probe); default: the suite\'s own.')
_PEAK_FROM = flags.DEFINE_string('peak_from', None, 'accel: the --out report of an earlier run on this '
                                 'machine whose peak rows are this run\'s roofline (not measured again).')


def main(argv):
    if _LIST.value:
        print('\n'.join(harness.available_suites()))
        return
    if len(argv) != 2:
        raise errors.UsageError(f'name exactly one suite (one of {harness.available_suites()}); '
                             f'got {argv[1:]}.')
    if _OUT.value:  # Before the measurement, which a bad path would otherwise throw away.
        workdir_lib.check_writable_file(_OUT.value)
    harness.prepare_environment(argv[1])
    cli.prepare_host_memory()
    tiny = _SIZE.value == 'tiny'
    command = ['python', '-m', 'memjax.bench'] + sys.argv[1:]
    ctx = harness.Context(
        size=_SIZE.value, config=cli.load_run(_CONFIG),
        warmup=_WARMUP.value if _WARMUP.value is not None else (1 if tiny else 2),
        repeats=_REPEATS.value if _REPEATS.value is not None else (2 if tiny else 5), parts=tuple(_PARTS.value),
        peak_from=_PEAK_FROM.value)
    if _OUT.value:
        ctx = dataclasses.replace(ctx, on_rows=lambda rows: harness.write_json(
            _OUT.value, harness.partial_report(argv[1], ctx, rows, command)))
    report = harness.run_suite(argv[1], ctx, command=command)
    print(harness.report_text(report))
    if _OUT.value:
        harness.write_json(_OUT.value, report)
        print(f'[bench] wrote {_OUT.value}', file=sys.stderr)


if __name__ == '__main__':
    cli.main(main)
