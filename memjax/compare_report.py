"""What a comparison shows (memjax.compare): the table with its notes (methods not learned, gaps
inside the seeds' spread, the RECL column), the learning curves and the figure."""

from absl import logging
import numpy as np

from memjax.runtime import storage
from memjax.training import metrics as metrics_lib


def metric_name(summary: dict) -> str:
    """The name of the evaluation summary's metric (bpc or ppl)."""
    return next(name for name in ('bpc', 'ppl') if name in summary)


def curve(run_dir: str) -> dict[str, list]:
    """Training and validation loss against step, from the run's TensorBoard events. The validation
    points are those that scored as many tokens as the first: the periodic validations read
    config.train.eval_batches, the final one may read the whole split, and a line joining them
    would draw the change of text as a change of the model."""
    scalars = metrics_lib.read_scalars(run_dir)
    pick = lambda name: sorted(scalars.get(name, {}).items())
    amounts = scalars.get('valid/num_tokens', {})
    first = amounts[min(amounts)] if amounts else None
    return {'train': pick('train/loss'),
            'valid': [(step, loss) for step, loss in pick('valid/loss') if amounts.get(step) == first]}


def clamp_label(row: dict) -> str:
    """The table's clamp cell: what was asked (compare.clamp_lens) and the clamp_len it set."""
    asked = {-1: 'none', -2: 'trained'}.get(row['clamp'], str(row['clamp']))
    if row['clamp'] == -1:
        return asked
    return f'{asked}: {row["clamp_in_effect"]}' if row['clamp_in_effect'] > 0 else f'{asked}: not reached'


def _groups(report: dict) -> dict[tuple, list]:
    """Rows by (method, evaluation memory, clamp asked), in the order they were scored."""
    groups: dict[tuple, list] = {}
    for row in report['rows']:
        groups.setdefault((row['method'], row['eval_mem_len'], row['clamp']), []).append(row)
    return groups


def recl_cell(record: dict, method: str, r: float) -> str:
    """The table's RECL cell of `method` at `r`: each seed's, in tokens (`>=`: still gaining at the
    longest context scored), or n/a."""
    seeds = record['methods'].get(method, {})
    found = [seeds[seed][str(r)] for seed in sorted(seeds)]
    return ' / '.join(f'{"" if x["converged"] else ">= "}{x["context"]}' for x in found) or 'n/a'


def table(report: dict, seeds: int) -> str:
    """Markdown: one row per method, evaluation memory and clamp, mean ± spread (half the range) over
    seeds."""
    metric = report['rows'][0]['metric_name'] if report['rows'] else 'metric'
    recl = report.get('recl')
    rs = recl['rs'] if recl else []
    lines = [f'| method | eval memory | clamp_len | loss (mean ± half-range, {seeds} seed{"s" * (seeds != 1)}) | {metric} | '
             'train tokens/s | eval tokens/s | parameters | train step memory (MB) | train wall s |'
             + ''.join(f' RECL r = {r:g} |' for r in rs),
             '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |' + ' --- |' * len(rs)]
    for (method, mem_len, _), rows in _groups(report).items():
        loss = np.array([r['loss'] for r in rows])
        mean = lambda key: float(np.mean([r[key] for r in rows]))
        # A run resumed after its last logged interval has no throughput of its own.
        speed = lambda key: (f'{np.mean(known):,.0f}' if (known := [r[key] for r in rows if r[key] is not None])
                             else 'n/a')
        lines.append(f'| {method} | {mem_len} | {clamp_label(rows[0])} | {loss.mean():.4f} ± '
                     f'{(loss.max() - loss.min()) / 2:.4f} ({len(rows)}) | {mean("metric"):.4f} | '
                     f'{speed("train_tokens_per_s")} | {speed("eval_tokens_per_s")} | '
                     f'{int(mean("params")):,} | {mean("step_memory_bytes") / 2**20:.1f} | {mean("wall_seconds"):.0f} |'
                     + ''.join(f' {recl_cell(recl, method, r) if rows[0]["clamp"] == recl["clamp_len"] else ""} |'
                               for r in rs))
    lines.append('\nclamp_len: relative distances beyond it are scored as it. `trained`: the longest distance '
                 'training scored (mem_len + tgt_len - 1), where the evaluation reaches beyond it; `not reached`: '
                 'the evaluation scores no longer distance, so nothing is clamped.')
    if recl:
        lines.append(f'\nRECL (memjax.recl): the relative effective context length in tokens, each seed\'s (`>=`: still '
                     f'gaining at the longest context), every method of a seed in one group on '
                     f'{recl["num_tokens"] or 0:,} tokens of the {recl["split"]} split (those with the longest '
                     'context\'s tokens of their stream before them), contexts '
                     f'{", ".join(map(str, recl["contexts"]))}, clamp_len {recl["clamp_len"]} (the rows of that clamp); '
                     'the groups\' tables and figures are in recl/seed<k>/.')
    lines.append('\nThroughputs exclude compilation (a run resumed after its last logged interval has none); '
                 'they are comparable only between runs that had the machine to themselves.')
    lines += ['\n' + note for note in notes(report, seeds)]
    for name, why in report['failures'].items():
        lines.append(f'\nFailed: {name}: {why}')
    return '\n'.join(lines) + '\n'


def notes(report: dict, seeds: int) -> list[str]:
    """What the table cannot show: methods that have not learned (at or above the unigram loss),
    and gaps no larger than the seeds' spread."""
    notes = []
    unigram = report.get('unigram_loss')
    groups = _groups(report)
    if unigram is not None:
        behind = sorted({method for (method, _, _), rows in groups.items()
                         if np.mean([r['loss'] for r in rows]) >= unigram})
        if behind:
            notes.append(f'Not learned: {", ".join(behind)} (loss at or above {unigram:.4f} nats, a unigram model\'s '
                         'on this split): train longer or larger before reading their gaps.')
    if seeds < 2:
        notes.append('One seed per method: no gap in this table can be told from seed noise (compare.seeds >= 2 '
                     'measures the spread).')
        return notes
    by_setting: dict[tuple, list] = {}
    for (method, mem_len, clamp), rows in groups.items():
        losses = [r['loss'] for r in rows]
        by_setting.setdefault((mem_len, clamp), []).append((float(np.mean(losses)), min(losses), max(losses), method))
    for (mem_len, clamp), entries in by_setting.items():
        entries.sort()
        # Neighbours in the ranking whose seed ranges overlap: their order is not established.
        ties = [f'{a[3]} and {b[3]}' for a, b in zip(entries, entries[1:]) if b[1] <= a[2]]
        if ties:
            label = clamp_label({'clamp': clamp, 'clamp_in_effect': -1}).partition(':')[0]
            notes.append(f'Within the seeds\' spread at eval memory {mem_len}, clamp_len {label}: '
                         f'{"; ".join(ties)} (their seed ranges overlap).')
    return notes


def plot(report: dict, path: str) -> None:
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    except ImportError:
        logging.warning("compare: matplotlib is not installed (pip install -e '.[plot]'); %s not drawn.", path)
        return
    # One panel per clamp: a collapse without it would flatten the differences with it.
    clamps = sorted({row['clamp'] for row in report['rows']}, key=lambda c: (c > 0, -c))
    fig, axes = plt.subplots(1, 1 + len(clamps), figsize=(6 * (1 + len(clamps)), 4.5), squeeze=False)
    curves = axes[0][0]
    # A colour per method, in every panel; a line style per seed.
    methods = list(dict.fromkeys([*(name.split('/')[0] for name in report['curves']),
                                  *(row['method'] for row in report['rows'])]))
    colour = {m: plt.get_cmap('tab10')(i % 10) for i, m in enumerate(methods)}
    for name, curve in report['curves'].items():
        if curve['valid']:
            method, seed = name.split('/')
            steps, values = zip(*curve['valid'])
            curves.plot(steps, values, label=name, color=colour[method],
                        linestyle=('-', '--', ':', '-.')[int(seed[len('seed'):]) % 4])
    curves.set(xlabel='training step', ylabel='validation loss (nats)', title='Learning curves')
    if curves.get_legend_handles_labels()[0]:  # A comparison whose runs all failed has no curve.
        curves.legend(fontsize=7)
    for clamp, memory in zip(clamps, axes[0][1:]):
        rows = [row for row in report['rows'] if row['clamp'] == clamp]
        series: dict[str, dict[int, list]] = {}
        for row in rows:
            series.setdefault(row['method'], {}).setdefault(row['eval_mem_len'], []).append(row['metric'])
        for method, points in series.items():
            lens = sorted(points)
            values = [np.array(points[m]) for m in lens]
            # The bars span the seeds' range.
            memory.errorbar(lens, [x.mean() for x in values], yerr=[(x.max() - x.min()) / 2 for x in values],
                            marker='o', capsize=3, label=method, color=colour[method])
        asked = clamp_label({'clamp': clamp, 'clamp_in_effect': -1}).partition(':')[0]
        memory.set(xlabel='evaluation memory length', ylabel=rows[0]['metric_name'],
                   title=f'Against evaluation memory, clamp_len {asked}')
        memory.legend(fontsize=7)
    fig.tight_layout()
    storage.save_figure(fig, path)
    plt.close(fig)
