"""Command line: every method trained at one equal budget, evaluated at the same and at longer
memory, compared in a table and plots.

Needs the data the config names (configs/compare_kjv.py: a text file, --config.data.text_path;
`:smoke`: nothing); the plot needs the `plot` extra (pip install -e '.[plot]').

  python -m memjax.compare --config=configs/compare_kjv.py:smoke --workdir=runs/compare_smoke
  python -m memjax.compare --config=configs/compare_kjv.py --workdir=runs/compare_kjv \
      --config.data.text_path=kjv.txt

The config is one ordinary run config (data, model, train, eval: the shared budget) plus a
`compare` section: `methods`, `seeds`, `eval_mem_lens`, `clamp_lens` and `match_params`. Each
method changes only its own model fields (`METHODS`); with `match_params` each trained method's
`d_inner` is set so that its parameter count is the closest to Transformer-XL's. Every (method,
seed) trains in `<workdir>/<method>/seed<k>/` through `memjax.train`'s own path, then is scored on
`config.eval.split` through `memjax.evaluate`'s at every memory length (TRAMS: on the XL runs,
attending that many keys chosen from a pool twice as long) and every clamp_len of `clamp_lens`
(-2, the default: a memory longer than trained scores its longer distances as the longest one
trained, where a relative position beyond the trained range would be extrapolated). Runs and
evaluations already done are read back, so an interrupted comparison resumes; a method that fails
is reported and the rest go on. Results: `<workdir>/comparison.json`, `comparison.md` (mean and
spread over seeds) and `comparison.png` (learning curves; loss against evaluation memory, one line
per method and clamp, bars over the seeds' range; needs matplotlib).
"""

from __future__ import annotations

from memjax import early_sigterm
from memjax.runtime import host_memory

if __name__ == '__main__':  # The command, not a test that imports this module.
    early_sigterm.install()  # Before the imports below, which take seconds.
    host_memory.keep_host_buffers_first()  # Before them too: it may re-execute the command.

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import itertools
import json
import os
import sys
import traceback
from typing import Callable, Iterator

from absl import flags
from absl import logging
import jax
import ml_collections
import numpy as np

from memjax import cli
from memjax import compare_report as report_lib
from memjax import config_lib
from memjax import errors
from memjax import evaluate
from memjax import model as model_lib
from memjax.model import memories
from memjax.model.memories import trams
from memjax.analysis import recl as recl_lib
from memjax.bench.suites import programs
from memjax.data import factory as data_factory
from memjax.data import pipeline
from memjax.runtime import storage
from memjax.training import experiment
from memjax.training import loop as trainer
from memjax.training import resume
from memjax.training import run_files
from memjax.training import run_lock
from memjax.training import saved_run
from memjax.training import workdir as workdir_lib

flags.adopt_module_key_flags(evaluate)  # --config, --workdir.
flags.mark_flag_as_required('config')  # A comparison trains: its config is the user's.
flags.FLAGS['config'].help = ('Path to a config file with a compare section (configs/compare_kjv.py); '
                              '--config.a.b=v overrides apply to every run.')
flags.FLAGS['workdir'].help = 'The comparison\'s folder: a run per method and seed, the table and the figure.'
flags.adopt_module_key_flags(cli)


@dataclasses.dataclass(frozen=True)
class Method:
    """One method of the comparison: its model fields over the shared model (a function of the
    config, for fields that follow the budget), or the method whose runs it evaluates instead of
    training (`runs_on`) with its evaluation fields for an attended memory length L."""

    model: Callable[[ml_collections.ConfigDict], dict] = lambda config: {}
    runs_on: str = ''
    evaluation: Callable[[int], dict] = lambda mem_len: {'mem_len': mem_len}


METHODS = {
    'none': Method(model=lambda c: {'memory': 'none', 'mem_len': 0}, evaluation=lambda mem_len: {}),
    'xl': Method(),
    'lamemo': Method(model=lambda c: {'memory': 'lamemo'}),
    'infinity': Method(model=lambda c: {'memory': 'infinity'}),
    # Attends L keys like XL at L: the newest 3L/4 and the best-ranked rest of a pool of 2L.
    'trams': Method(runs_on='xl', evaluation=lambda mem_len: {'memory': 'trams', **trams.attending(mem_len)}),
    # Phase 1 (linear skips) for three quarters of the steps, as the paper's schedule.
    'skip_retain': Method(model=lambda c: {'skip_rule': 'linear', 'skip_until': 3 * c.train.num_steps // 4}),
    'cross_head': Method(model=lambda c: {'sch_beta': 0.1}),
}


def _check(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The compare section, and every run and evaluation it implies resolved as its command would
    resolve it: a bad value stops the comparison before anything trains."""
    if 'compare' not in config:
        raise errors.ConfigError('the config has no compare section: start from configs/compare_kjv.py.')
    section = config.compare
    unknown = [m for m in section.methods if m not in METHODS]
    known = [m for m in section.methods if m in METHODS]
    problems = errors.failed(
        (not unknown, f'compare.methods has unknown {unknown}; choose from {tuple(METHODS)}.'),
        (bool(section.methods), f'compare.methods is empty; name some of {tuple(METHODS)}.'),
        (bool(section.eval_mem_lens), 'compare.eval_mem_lens is empty; give memory lengths (-1: the model\'s).'),
        (section.seeds >= 1, f'compare.seeds={section.seeds} must be >= 1.'),
        (bool(section.get('clamp_lens')), 'compare.clamp_lens is empty; give clamp_len values (-2: the '
                                          'longest distance trained, -1: none).'))
    contexts, rs = list(section.get('recl_contexts', ())), list(section.get('recl_rs', (0.1,)))
    if contexts:
        problems += errors.failed(
            (len(contexts) >= 2 and contexts == sorted(set(contexts)) and contexts[0] >= 1,
             f'compare.recl_contexts={tuple(contexts)}: give at least two increasing lengths >= 1 (RECL steps '
             'from one to the next), or () for no RECL column.'),
            (bool(rs) and all(0 < r <= 1 for r in rs), f'compare.recl_rs={tuple(rs)}: each share must be in (0, 1].'),
            (section.get('recl_batches', -1) == -1 or section.get('recl_batches', -1) >= 1,
             f'compare.recl_batches={section.get("recl_batches")}: give -1 (the whole split) or a count >= 1.'),
            (jax.process_count() == 1,
             f'compare.recl_contexts: {recl_lib.ONE_PROCESS} Give () here on {jax.process_count()} processes.'))
    evaluating = [m for m in known if METHODS[m].runs_on]
    missing = sorted({METHODS[m].runs_on for m in evaluating} - set(section.methods))
    problems += [f'compare.methods needs {missing}, whose runs {evaluating} evaluate.'] if missing else []
    if problems:
        raise errors.ConfigError(' '.join(problems))
    for method in known:
        for mem_len in _mem_lens(config):
            for clamp_len in section.clamp_lens:
                try:
                    clamp_in_effect(run_config(config, METHODS[method].runs_on or method, 0),
                                    _overrides(METHODS[method], mem_len, clamp_len))
                except errors.ConfigError as error:
                    raise errors.ConfigError(f'compare: {method} at eval memory {mem_len}, clamp_len {clamp_len}: '
                                             f'{" ".join(str(error).split())}') from None
    return section


def _overrides(method: Method, mem_len: int, clamp_len: int) -> dict:
    return {**method.evaluation(mem_len), 'clamp_len': clamp_len}


def clamp_in_effect(run: ml_collections.ConfigDict, overrides: dict) -> int:
    """The clamp_len that evaluating `run` with `overrides` (config.eval.model) resolves to, or -1
    where it clamps no distance the evaluation scores (the same numbers as no clamp)."""
    run = run.copy_and_resolve_references()
    run.eval.model.update(overrides)
    evaluated = experiment.resolved(run, jax.device_count()).eval_model
    bites = memories.scored_distance(evaluated) != memories.scored_distance(evaluated.replace(clamp_len=-1))
    return evaluated.clamp_len if bites else -1


def _mem_lens(config: ml_collections.ConfigDict) -> list[int]:
    return [config.model.mem_len if m == -1 else int(m) for m in config.compare.eval_mem_lens]


def run_config(config: ml_collections.ConfigDict, method: str, seed: int) -> ml_collections.ConfigDict:
    """The run config of one trained method and seed: the shared config, the method's fields."""
    run = ml_collections.ConfigDict({k: v for k, v in config.to_dict().items() if k != 'compare'})
    run.model.update(METHODS[method].model(run))
    run.seed = int(config.seed) + seed
    return run


def parameter_count(config: ml_collections.ConfigDict) -> int:
    """Parameters of the config's model; before the tokenizer has fixed the vocabulary size, of the
    smallest one its adaptive softmax's cutoffs allow, or of 256 tokens (the embedding is the same
    for every method, so matching is unaffected)."""
    model = config_lib.resolve(config).model
    if model.vocab_size < 1:
        model = model.replace(vocab_size=max([256, *(c + 1 for c in model.cutoffs)]))
    shapes = jax.eval_shape(lambda: model_lib.init_params(model, jax.random.key(0)))
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes)))


def matched_d_inner(config: ml_collections.ConfigDict, target: int) -> int:
    """The d_inner whose parameter count is the closest to `target`: the config's own, or a multiple
    of 8 near the count's linear estimate (a method with XL's count keeps XL's d_inner)."""
    def count(d_inner):
        trial = config.copy_and_resolve_references()
        trial.model.d_inner = d_inner
        return parameter_count(trial)

    per_unit = (count(config.model.d_inner + 8) - count(config.model.d_inner)) / 8
    guess = config.model.d_inner + (target - count(config.model.d_inner)) / per_unit
    candidates = {config.model.d_inner} | {max(8, int(round(guess / 8)) * 8 + step) for step in (-8, 0, 8)}
    return min(candidates, key=lambda d: abs(count(d) - target))


class Stopped(Exception):
    """SIGTERM or Ctrl-C stopped a method's training after its checkpoint: the comparison stops."""


# What a finished run's and evaluation's files hold; anything less is not read as done.
TRAIN_FIELDS = ('train_tokens_per_s', 'wall_seconds', 'params', 'step_memory_bytes')
EVAL_FIELDS = ('loss', 'num_tokens', 'eval_tokens_per_s')


def read_done(path: str, fields: tuple[str, ...], what: str) -> dict | None:
    """The finished `what` recorded in `path`, None when there is none; a file that does not hold
    one (damaged, cut short, not compare's) is a one-line error naming it and the fix."""
    text = storage.read_text(path)
    if text is None:
        return None
    try:
        done = json.loads(text)
    except ValueError:
        done = None
    missing = [f for f in fields if f not in done] if isinstance(done, dict) else list(fields)
    if missing:
        raise errors.WorkdirError(
            f'{path} is damaged or not a finished {what} (no {", ".join(missing)}): delete it and run the same '
            f'command again, which {"resumes the run from its newest checkpoint" if what == "run" else "scores it again"}.')
    return done


def train_one(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains (or resumes) one run; its summary, with the train step's memory and the config it was
    trained with, is kept beside it. A record of another config is not this run's: the run resumes
    (training further, or only validating again), and a config it cannot resume with was refused
    before anything trained (`_check_saved_runs`)."""
    path = os.path.join(workdir, 'compare_train.json')
    done = read_done(path, TRAIN_FIELDS, 'run')
    if done is not None and done.get('config') == resume.to_plain(config):
        return done
    summary = trainer.train_and_evaluate(config, workdir)
    if summary.get('preempted'):  # Saved, not finished: nothing is recorded as done.
        raise Stopped(f'{workdir} saved step {summary["step"]}')
    memory = programs.lowered_steps(experiment.setup(config, workdir))['train'].compile().memory_analysis()
    summary['params'] = parameter_count(saved_run.saved_config(workdir))
    summary['step_memory_bytes'] = int(memory.argument_size_in_bytes + memory.output_size_in_bytes
                                       - memory.alias_size_in_bytes + memory.temp_size_in_bytes)
    summary['config'] = resume.to_plain(config)
    run_files.write_result(path, summary, history=False)  # Last: a run without it is trained (or resumed) again.
    return summary


def evaluate_one(config: ml_collections.ConfigDict, workdir: str, name: str, overrides: dict, step: int) -> dict:
    """Scores the run's newest checkpoint, `step`, with `overrides` on config.eval.model (resumable: a
    record of the same step and config is read back)."""
    path = os.path.join(workdir, f'compare_eval_{name}.json')
    config = config.copy_and_resolve_references()
    config.eval.model.update(overrides)
    done = read_done(path, EVAL_FIELDS, 'evaluation')
    if done is not None and done.get('step') == step and done.get('config') == resume.to_plain(config):
        return done
    summary = evaluate.evaluate_checkpoint(config, workdir, out_path=os.path.join(workdir, f'eval_{name}.json'))
    summary.update(eval_tokens_per_s=summary['tokens_per_s'], config=resume.to_plain(config))
    run_files.write_result(path, summary, history=False)  # Written once complete: a resumed comparison trusts it.
    return summary


def unigram_loss(config: ml_collections.ConfigDict, workdir: str) -> float:
    """The loss (nats per token) of scoring config.eval.split's tokens by their frequency in the
    training split, add-one smoothed: a model at or above it has learned nothing from the context,
    and its gap to another method means nothing."""
    run = config_lib.resolve(config)
    tokenizer = data_factory.build_tokenizer(run.data, workdir, save=False)
    train, _ = pipeline.load_token_ids(run.data, 'train', tokenizer)
    scored, _ = pipeline.load_token_ids(run.data, run.eval.split, tokenizer)
    counts = np.bincount(train, minlength=tokenizer.vocab_size) + 1.0
    return float(-np.mean(np.log(counts[scored] / counts.sum())))


def run_comparison(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains, evaluates and reports (resuming what is done), holding `<workdir>/.memjax.lock`: a second
    comparison on the same workdir is refused before it writes anything. Raises Stopped when a
    signal stopped a method's training."""
    section = _check(config)
    if jax.process_index() != 0:
        return _compare(config, section, workdir)
    workdir_lib.check(workdir, create=True, run=False)
    with run_lock.RunLock(workdir, user='comparison') as lock, early_sigterm.cleanup_on_stop(lock.release):
        return _compare(config, section, workdir)


def _trained_runs(config: ml_collections.ConfigDict, section: ml_collections.ConfigDict) -> Iterator[tuple]:
    """(method, seed, its run's config or the error that stopped making it) of every run trained."""
    xl_params = parameter_count(run_config(config, 'xl', 0)) if section.match_params else None
    for method in [m for m in section.methods if not METHODS[m].runs_on]:
        for seed in range(section.seeds):
            run = run_config(config, method, seed)
            try:
                if xl_params is not None and method != 'xl':
                    run.model.d_inner = matched_d_inner(run, xl_params)
            except Exception as error:  # pylint: disable=broad-except  (reported with the method's runs)
                run = error
            yield method, seed, run


def _check_saved_runs(runs: list[tuple], workdir: str) -> None:
    """Refuses, before anything trains, a comparison whose `runs` (`_trained_runs`) already hold
    checkpoints of a config they cannot resume with (another model, data or batch), as memjax.train
    refuses it."""
    for method, seed, run in runs:
        if not isinstance(run, Exception):
            saved_run.check_saved_config(experiment.resolved(run, jax.device_count()),
                                         os.path.join(workdir, method, f'seed{seed}'), training=True)


def _compare(config: ml_collections.ConfigDict, section: ml_collections.ConfigDict, workdir: str) -> dict:
    mem_lens = _mem_lens(config)
    runs = list(_trained_runs(config, section))
    _check_saved_runs(runs, workdir)
    results, failures = {}, {}
    for method, seed, run in runs:
        try:
            if isinstance(run, Exception):
                raise run
            logging.info('compare: training %s seed %d', method, seed)
            results[(method, seed)] = {'train': train_one(run, os.path.join(workdir, method, f'seed{seed}')),
                                       'config': run}
        except Stopped:
            raise
        except Exception as error:  # pylint: disable=broad-except  (reported; the others go on)
            failures[f'{method}/seed{seed}'] = _failure(error, f'{method} seed {seed}')
    rows = []
    for method in section.methods:
        spec = METHODS[method]
        for seed in range(section.seeds):
            source = results.get((spec.runs_on or method, seed))
            if source is None:
                failures.setdefault(f'{method}/seed{seed}', f'no {spec.runs_on or method} run to evaluate')
                continue
            run_dir = os.path.join(workdir, spec.runs_on or method, f'seed{seed}')
            for mem_len, clamp_len in itertools.product(mem_lens, section.clamp_lens):
                overrides = _overrides(spec, mem_len, clamp_len)
                where = f'{method}/seed{seed}/mem{mem_len}/clamp{clamp_len}'
                logging.info('compare: evaluating %s', where)
                try:
                    clamp = clamp_in_effect(source['config'], overrides)
                    # Scored once per setting that changes a number: a method whose evaluation does not
                    # depend on the memory once, a clamp that clamps nothing as no clamp.
                    name = (f'{method}_mem{mem_len}' if spec.evaluation(mem_len) else method) + (
                        f'_clamp{clamp}' if clamp > 0 else '')
                    found = evaluate_one(source['config'], run_dir, name, {**overrides, 'clamp_len': clamp},
                                         source['train']['step'])
                except Exception as error:  # pylint: disable=broad-except
                    failures[where] = _failure(error, where)
                    continue
                train = source['train']
                rows.append({'method': method, 'seed': seed, 'eval_mem_len': mem_len, 'clamp': clamp_len,
                             'clamp_in_effect': clamp, 'loss': found['loss'],
                             'metric_name': report_lib.metric_name(found), 'metric': found[report_lib.metric_name(found)],
                             'eval_tokens_per_s': found['eval_tokens_per_s'],
                             'train_tokens_per_s': train['train_tokens_per_s'], 'wall_seconds': train['wall_seconds'],
                             'params': train['params'], 'step_memory_bytes': train['step_memory_bytes']})
    unigram = None
    if results:
        method, seed = next(iter(results))
        unigram = unigram_loss(results[(method, seed)]['config'], os.path.join(workdir, method, f'seed{seed}'))
    report = {'config': config.to_dict(), 'rows': rows, 'failures': failures, 'unigram_loss': unigram,
              'curves': {f'{m}/seed{s}': report_lib.curve(os.path.join(workdir, m, f'seed{s}')) for m, s in results},
              'recl': _recl(config, section, workdir, results, failures) if section.get('recl_contexts') else None}
    run_files.write_result(os.path.join(workdir, 'comparison.json'), report, history=False)
    storage.write_result(os.path.join(workdir, 'comparison.md'), report_lib.table(report, section.seeds))
    report_lib.plot(report, os.path.join(workdir, 'comparison.png'))
    return report


def _recl(config: ml_collections.ConfigDict, section: ml_collections.ConfigDict, workdir: str, results: dict,
          failures: dict) -> dict:
    """Every method's RECL (memjax.recl), one group per seed: the methods share the budget and, as
    the Transformer-XL paper's groups do, the baseline. Each group's table, figure and per-token
    losses go to <workdir>/recl/seed<k>/ (a stopped comparison reads the losses back)."""
    contexts, rs = [int(c) for c in section.recl_contexts], [float(r) for r in section.get('recl_rs', (0.1,))]
    record = {'contexts': contexts, 'rs': rs, 'split': config.eval.split, 'clamp_len': section.clamp_lens[0],
              'num_tokens': None, 'methods': {}}
    for seed in range(section.seeds):
        methods = [m for m in section.methods if (METHODS[m].runs_on or m, seed) in results]
        members = []
        for method in methods:
            scored_as = METHODS[method].evaluation(1).get('memory')  # TRAMS: the XL run scored as TRAMS.
            members.append(os.path.join(workdir, METHODS[method].runs_on or method, f'seed{seed}')
                           + (f'@{scored_as}' if scored_as else ''))
        if not members:
            continue
        out = os.path.join(workdir, 'recl', f'seed{seed}')
        logging.info('compare: RECL of seed %d', seed)
        try:
            # With the comparison's first clamp: a context longer than trained is scored as its rows are.
            result = recl_lib.group_recl(members, contexts, rs, out, split=config.eval.split,
                                         max_batches=section.get('recl_batches', -1), clamp_len=section.clamp_lens[0],
                                         clamp_setting=f"--config.compare.clamp_lens='({memories.CLAMP_TRAINED}, ...)'")
        except Exception as error:  # pylint: disable=broad-except  (reported; the table goes on)
            failures[f'recl/seed{seed}'] = _failure(error, f'RECL of seed {seed}')
            continue
        storage.write_result(os.path.join(out, 'recl.md'), recl_lib.table(result) + '\n')
        recl_lib.plot(result, os.path.join(out, 'recl.png'))
        record['num_tokens'] = result.num_tokens
        for method, found in zip(methods, result.recl):
            record['methods'].setdefault(method, {})[seed] = {str(r): dataclasses.asdict(x) for r, x in found.items()}
    return record


def _failure(error: Exception, where: str) -> str:
    """The table's line for a failed run or evaluation; logged in one line for a user error (the
    message says what to do), with the traceback for anything else (a bug)."""
    text = f'{type(error).__name__}: {errors.brief(error, 280)}'
    if isinstance(error, errors.UserError):
        logging.error('compare: %s failed: %s', where, text)
    else:
        logging.error('compare: %s failed:\n%s', where, traceback.format_exc())
    return text


def main(argv):
    if len(argv) > 1:
        raise errors.UsageError(f'unexpected arguments: {argv[1:]}')
    config = cli.load_config(evaluate.CONFIG)
    # Checked inside the run: resolving asks JAX for its devices, which must wait for the
    # distributed run to be joined.
    try:
        report = cli.run(lambda: run_comparison(config, evaluate.WORKDIR.value))
    except Stopped as stopped:  # The run it trained is saved; nothing half-done is recorded as finished.
        print(f'Stopped by {early_sigterm.name()}: {stopped}; run the same command again to continue the '
              'comparison from there.', file=sys.stderr)
        sys.exit(early_sigterm.status())
    print(storage.read_text(os.path.join(evaluate.WORKDIR.value, 'comparison.md')))
    if report['failures']:  # A script or scheduler must not read a comparison with holes as done.
        print(f'{len(report["failures"])} failed: see comparison.md')
        sys.exit(errors.EXIT_RUNTIME)


if __name__ == '__main__':
    cli.main(main)
