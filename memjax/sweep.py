"""Command line: evaluate one trained workdir over a grid of evaluation settings; a table and a plot.

Needs a trained workdir and the data its config names; the plot needs the `plot` extra.

  python -m memjax.sweep trams --config=configs/trams_wt103.py --workdir=runs/transformer_xl_wt103_base

A sweep is a list of panels. A panel varies one setting with the others fixed and scores every
value with each of its evaluators on the whole `config.eval.split`, through `memjax.evaluate`'s
own path (the newest intact checkpoint, the same streams and step). Results go to
`<workdir>/sweep_<name>/`: results.json (every point, with its settings), results.md (one table per
panel) and results.png (one plot per panel; needs matplotlib, the `plot` extra). Identical settings
are evaluated once.

`trams`: the TRAMS paper's ablations (its figures 4-6): the pool M at fixed attended m and segment
n, m at fixed M and n, and n at fixed M and m; each point scored with TRAMS (newest
`remain_ratio x m` kept, the rest ranked, the config's metric and position rule) and with
Transformer-XL attending the newest m (the table's baseline at the same attended memory).
"""

from __future__ import annotations

from memjax.runtime import host_memory

if __name__ == '__main__':  # The command: importing this module must not re-execute a process.
    host_memory.keep_host_buffers_first()  # Before the imports below: it may re-execute the command.

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import json
import os
from typing import Any, Callable, Sequence

from absl import flags
import jax
import ml_collections

from memjax import cli
from memjax import errors
from memjax import evaluate
from memjax.runtime import distributed
from memjax.runtime import storage
from memjax.training import experiment
from memjax.training import workdir as workdir_lib

_POOLS = flags.DEFINE_list('pools', None, 'trams: pool sizes M of the first panel (default: the paper\'s range).')
_SELECTS = flags.DEFINE_list('selects', None, 'trams: attended sizes m of the second panel.')
_SEGMENTS = flags.DEFINE_list('segments', None, 'trams: segment lengths n of the third panel.')
_FIXED = flags.DEFINE_list('fixed', None, 'trams: pool=M,select=m,segment=n,segment_pool=M where they are fixed '
                           '(default 600, 200, 64, 400: the paper\'s).')
flags.adopt_module_key_flags(evaluate)  # --config, --workdir and what they bring.
flags.adopt_module_key_flags(cli)
flags.adopt_module_key_flags(distributed)


# The results (a plot of about 100 KB, the tables, every point's summary), with room to spare.
SWEEP_RESULT_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Panel:
    """One plot: `axis` takes each of `values`; `settings(evaluator, value)` gives the evaluation
    overrides (config.eval fields, dotted) of every point."""
    name: str
    axis: str
    values: tuple[int, ...]
    evaluators: tuple[str, ...]
    settings: Callable[[str, int], dict]


@dataclasses.dataclass(frozen=True)
class TramsGrid:
    """The TRAMS sweep's values: each panel's range and the values held fixed elsewhere (the
    paper's figures 4-6: M at m = 200, n = 64; m at M = 600, n = 64; n at M = 400, m = 200)."""
    pools: tuple[int, ...] = (200, 300, 400, 500, 600, 800)
    selects: tuple[int, ...] = (50, 100, 150, 200, 300, 400)
    segments: tuple[int, ...] = (16, 32, 64, 128)
    pool: int = 600
    select: int = 200
    segment: int = 64
    segment_pool: int = 400
    remain_ratio: float = 0.75  # Newest rows kept, as a share of m (the released 150 of 200).


def _ints(name: str, values: Sequence[str]) -> tuple[int, ...]:
    try:
        ints = tuple(int(v) for v in values)
    except ValueError:
        ints = ()
    if not ints or min(ints) < 1:  # A size named by its flag, not by the model field it becomes.
        raise errors.UsageError(f'--{name}={",".join(values)} must be comma-separated positive integers.')
    return ints


def trams_grid_from_flags() -> TramsGrid:
    grid = {name: _ints(name, flag.value) for name, flag in
            (('pools', _POOLS), ('selects', _SELECTS), ('segments', _SEGMENTS)) if flag.value}
    for item in _FIXED.value or ():
        name, _, value = item.partition('=')
        if name not in ('pool', 'select', 'segment', 'segment_pool'):
            raise errors.UsageError(f'--fixed={item}: name one of pool, select, segment, segment_pool.')
        grid[name] = _ints(f'fixed={name}', [value])[0]
    return TramsGrid(**grid)


def trams_panels(config: ml_collections.ConfigDict, grid: TramsGrid) -> list[Panel]:
    """The TRAMS paper's figures 4-6 over `config`'s TRAMS evaluation (metric, positions, clamp)."""
    remain = lambda select: int(round(grid.remain_ratio * select))

    def settings(evaluator: str, pool: int, select: int, segment: int) -> dict:
        if evaluator == 'xl':
            return {'tgt_len': segment, 'model.memory': None, 'model.mem_len': select,
                    **{f'model.{k}': None for k in config.eval.model.keys() if k.startswith('trams_')}}
        return {'tgt_len': segment, 'model.memory': 'trams', 'model.mem_len': pool, 'model.trams_select': select,
                'model.trams_remain': remain(select)}

    fixed = dict(pool=grid.pool, select=grid.select, segment=grid.segment)
    evaluators = ('trams', 'xl')
    return [
        Panel('pool', 'pool M', grid.pools, evaluators, lambda e, v: settings(e, **{**fixed, 'pool': v})),
        Panel('select', 'attended m', grid.selects, evaluators, lambda e, v: settings(e, **{**fixed, 'select': v})),
        Panel('segment', 'segment n', grid.segments, evaluators,
              lambda e, v: settings(e, **{**fixed, 'pool': grid.segment_pool, 'segment': v})),
    ]


# name -> (its grid read from the command line, (config, grid) -> panels).
SWEEPS: dict[str, tuple[Callable[[], Any], Callable[[ml_collections.ConfigDict, Any], list[Panel]]]] = {
    'trams': (trams_grid_from_flags, trams_panels)}


def _with(config: ml_collections.ConfigDict, settings: dict) -> ml_collections.ConfigDict:
    config = config.copy_and_resolve_references()
    with config.unlocked():
        for dotted, value in settings.items():
            *path, field = dotted.split('.')
            node = config.eval
            for part in path:
                node = node[part]
            node[field] = value
    return config


def _checked_points(panels: list[Panel], config: ml_collections.ConfigDict) -> list[tuple]:
    """(panel, value, evaluator, its config.eval settings) of every point, each resolved as its
    evaluation will be: a point that cannot run stops the sweep, named, before any is evaluated."""
    points = []
    for panel in panels:
        for value in panel.values:
            for evaluator in panel.evaluators:
                settings = panel.settings(evaluator, value)
                try:
                    experiment.resolved(_with(config, settings), jax.device_count())
                except errors.ConfigError as error:
                    raise errors.ConfigError(f'the point {panel.axis} = {value} ({evaluator}) cannot be evaluated, '
                                             f'so nothing was: {errors.brief(error, 1000)}') from None
                points.append((panel, value, evaluator, settings))
    return points


def run_sweep(name: str, config: ml_collections.ConfigDict, workdir: str, grid: Any) -> tuple[list[Panel], list[dict]]:
    """Evaluates every point of sweep `name` over `grid`; writes results.{json,md,png}; returns the
    panels and the points."""
    panels = SWEEPS[name][1](config, grid)
    workdir_lib.check(workdir, create=False)  # A run's workdir: nothing is created where there is none.
    out = storage.join(workdir, f'sweep_{name}')
    # results.json, .md and .png, and a point's file each: checked before anything is evaluated.
    workdir_lib.check_writable_file(storage.join(out, 'results.json'), size=SWEEP_RESULT_BYTES)
    try:
        storage.path(out).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise errors.WorkdirError(f'cannot create {out} ({error.strerror}): make {workdir} writable.') from None
    done: dict[str, dict] = {}
    points = []
    for panel, value, evaluator, settings in _checked_points(panels, config):
        key = json.dumps(settings, sort_keys=True)
        if key not in done:
            done[key] = evaluate.evaluate_checkpoint(
                _with(config, settings), workdir, storage.join(out, f'point_{len(done)}.json'))
        summary = done[key]
        metric = 'bpc' if 'bpc' in summary else 'ppl'
        points.append({'panel': panel.name, 'axis': panel.axis, 'value': value, 'evaluator': evaluator,
                       'metric': metric, metric: summary[metric], 'loss': summary['loss'],
                       'settings': summary['settings']})
    if distributed.is_primary():
        storage.write_result(storage.join(out, 'results.json'), json.dumps(points, indent=1))
        storage.write_result(storage.join(out, 'results.md'), table(panels, points))
        plot(panels, points, storage.join(out, 'results.png'))
    return panels, points


def table(panels: list[Panel], points: list[dict]) -> str:
    """One Markdown table per panel: a row per value, a column per evaluator."""
    lines = []
    for panel in panels:
        rows = [p for p in points if p['panel'] == panel.name]
        metric = rows[0]['metric']
        lines += [f'### {panel.axis}', '', '| ' + ' | '.join([panel.axis] + [f'{e} {metric}' for e in panel.evaluators])
                  + ' |', '|' + ' --- |' * (1 + len(panel.evaluators))]
        for value in panel.values:
            cells = [next(p for p in rows if p['value'] == value and p['evaluator'] == e)[metric]
                     for e in panel.evaluators]
            lines.append('| ' + ' | '.join([str(value)] + [f'{c:.4f}' for c in cells]) + ' |')
        lines.append('')
    return '\n'.join(lines)


def plot(panels: list[Panel], points: list[dict], path: str) -> bool:
    """results.png, one axis per panel; False (and one line on stderr) without matplotlib."""
    try:
        import matplotlib  # pylint: disable=import-outside-toplevel
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    except ImportError:
        print(f'[sweep] no plot: matplotlib is not installed (pip install -e \'.[plot]\'); the table is in '
              f'{os.path.dirname(path)}/results.md', flush=True)
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        rows = [p for p in points if p['panel'] == panel.name]
        metric = rows[0]['metric']
        for evaluator in panel.evaluators:
            ax.plot(panel.values, [next(p for p in rows if p['value'] == v and p['evaluator'] == evaluator)[metric]
                                   for v in panel.values], marker='o', label=evaluator)
        ax.set_xlabel(panel.axis)
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    storage.save_figure(fig, path)
    plt.close(fig)
    return True


def main(argv):
    if len(argv) != 2 or argv[1] not in SWEEPS:
        raise errors.UsageError(f'name exactly one sweep (one of {sorted(SWEEPS)}); got {argv[1:]}.')
    name = argv[1]
    panels, points = cli.run(lambda: run_sweep(name, cli.load_config(evaluate.CONFIG), evaluate.WORKDIR.value,
                                                    SWEEPS[name][0]()))
    if distributed.is_primary():
        print(table(panels, points))


if __name__ == '__main__':
    cli.main(main, config_from_workdir=True)
