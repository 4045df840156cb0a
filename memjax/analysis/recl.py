"""Relative effective context length (RECL), Transformer-XL paper, section 4.3 and appendix C.

RECL belongs to a group of models scored on the same tokens: at each context length c, the
baseline of a token is the lowest loss any model of the group reaches on it with context c, so
that every model's longer context must beat the same, best short-context model. For a short
context c and a longer c', model i's relative loss over the top-r hardest tokens T (those of the
highest baseline at c) is

    f_i(c, c') = mean over t in T of min(b(c, t), l_i(c', t)),   b(c, t) = min_j l_j(c, t),

and its relative gain g_i(c, c') = (exp f_i(c, c) - exp f_i(c, c')) / exp f_i(c, c). Starting from the
shortest context, c steps to the next while the gain is at least the threshold (1 %); RECL is the
c where it stops.

The paper's l_i(c, t) conditions token t on the c tokens before it, so only the tokens that have
them at the longest context scored are counted: a token near the start of its evaluation stream
(or of a document, with resets) has the same few tokens before it at every longer context, cannot
gain, and would dilute every model's gains alike. Evaluation reads a split as `eval.batch_size`
streams, so a group scored on a few batches has such tokens at every stream's start.

The losses arrive as one array [contexts, models, tokens] of per-token negative log-likelihoods
(nats), token t the same text position for every model and context: `token_losses` scores a run
with a memory so, with the evaluation settings it was loaded with (`context_settings` gives those of
a context length for each memory kind), and `window_token_losses` a run without memory, each token
from its own window. `group_recl` does both for a group of workdirs, one pass of the split per run
and context (a memory of another length is another recurrence, so no pass serves two).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import math
import time
from typing import Optional, Sequence

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np

from memjax import errors
from memjax import model as model_lib
from memjax.analysis.run import LoadedRun, load, with_eval_model
from memjax.model import memories
from memjax.model.memories import trams
from memjax.runtime import storage
from memjax.training import evaluation
from memjax.training import experiment
from memjax.training import metrics as metrics_lib
from memjax.training import saved_run
from memjax.training import step as train_step_lib
from memjax.training import workdir as workdir_lib

THRESHOLD = 0.01  # The paper's: a context step that gains less than 1 % ends the search.
# Each process would score only its own streams' tokens and write the same loss files.
ONE_PROCESS = ('RECL is scored in one process, which reads every stream of the split: run python -m memjax.recl on '
               'one host after training.')
# memjax.recl's setting that clamps at the trained distances, named where a context reaches further.
CLAMP_SETTING = f'--clamp_len={memories.CLAMP_TRAINED}'


def hard_tokens(baseline: np.ndarray, r: float) -> np.ndarray:
    """Indices of the top-r share of tokens by `baseline` (at least one); equal baselines are taken
    in text order, so that the set does not depend on the sort's tie-breaking."""
    if not 0.0 < r <= 1.0:
        raise ValueError(f'r={r} must be in (0, 1].')
    count = max(1, math.ceil(r * baseline.size - 1e-9))
    # A stable sort of the negated baseline: the largest first, ties in token order.
    return np.argsort(-baseline, kind='stable')[:count]


def relative_losses(short: np.ndarray, long: np.ndarray, r: float) -> np.ndarray:
    """[models] f_i(c, c') from the group's per-token losses at c (`short`) and at c' (`long`),
    each [models, tokens]."""
    baseline = short.min(axis=0)
    tokens = hard_tokens(baseline, r)
    return np.minimum(baseline[tokens], long[:, tokens]).mean(axis=1)


def relative_gains(short: np.ndarray, long: np.ndarray, r: float) -> np.ndarray:
    """[models] g_i(c, c'): the relative perplexity reduction over the shared short-context baseline."""
    base = np.exp(relative_losses(short, short, r))
    return (base - np.exp(relative_losses(short, long, r))) / base


def gain_table(losses: np.ndarray, r: float) -> np.ndarray:
    """[models, contexts, contexts]: exp f_i(c, c) - exp f_i(c, c') for every pair c <= c' (NaN below
    the diagonal), the unnormalised relative perplexity gains the paper's figure 3 draws."""
    contexts = losses.shape[0]
    table = np.full((losses.shape[1], contexts, contexts), np.nan)
    for a in range(contexts):
        base = np.exp(relative_losses(losses[a], losses[a], r))
        for b in range(a, contexts):
            table[:, a, b] = base - np.exp(relative_losses(losses[a], losses[b], r))
    return table


@dataclasses.dataclass(frozen=True)
class Recl:
    """One model's RECL at one r: `context`, and whether the search stopped below the threshold
    (False: it gained at every step up to the longest context evaluated, a lower bound)."""
    context: int
    converged: bool


def recl(losses: np.ndarray, contexts: Sequence[int], r: float, threshold: float = THRESHOLD) -> list[Recl]:
    """Each model's RECL over `contexts` (increasing; the paper steps by a fixed Delta) from the
    per-token losses [contexts, models, tokens]."""
    if list(contexts) != sorted(set(contexts)) or len(contexts) != losses.shape[0]:
        raise ValueError(f'contexts {list(contexts)} must increase and give each of the {losses.shape[0]} '
                         'context rows of the losses its length.')
    # gains[k, i]: model i's relative gain from contexts[k] to contexts[k + 1].
    gains = np.array([relative_gains(losses[k], losses[k + 1], r) for k in range(len(contexts) - 1)])
    found = []
    for model in range(losses.shape[1]):
        at = 0
        while at + 1 < len(contexts) and gains[at, model] >= threshold:
            at += 1
        found.append(Recl(int(contexts[at]), converged=at + 1 < len(contexts)))
    return found


def token_losses(run: LoadedRun, split: str = 'validation', max_batches: int = -1) -> np.ndarray:
    """Each scored target's loss (nats) as `memjax.evaluate` scores `split` with the run's evaluation
    settings (its first `max_batches` batches; -1: all), in reading order: the same tokens in the
    same order for every run read with the same tokenizer, eval batch size and segment length."""
    exp = run.exp
    step = jax.jit(train_step_lib.eval_step_fn(exp.eval_model, per_token=True))
    streams = evaluation.eval_streams(exp.run, exp.tokenizer, split)
    return evaluation.evaluate_streams(step, run.params, exp.eval_mcfg, streams, evaluation.local_eval_batch(exp.run),
                                       max_batches, key=evaluation.eval_key(exp.run)).token_nll


def stream_history(streams, max_batches: int = -1) -> np.ndarray:
    """Each scored target's count of its stream's inputs up to its own (the tokens before it since the
    stream's start or last reset: the longest context it can have), in the reading order of
    `token_losses` (the first `max_batches` batches; -1: all)."""
    total = streams.num_batches if max_batches < 0 else min(max_batches, streams.num_batches)
    read = np.zeros(streams.batch_size, np.int64)  # Each stream's inputs before the segment.
    found = []
    for index, batch in enumerate(streams.iterator()):
        if index >= total:
            break
        mask, reset = np.asarray(batch['mask']) > 0, np.asarray(batch['reset'])
        for s in range(mask.shape[0]):
            read = np.where(reset[s], 0, read)
            found.append((read[:, None] + 1 + np.arange(mask.shape[2]))[mask[s]])
            read = read + mask[s].sum(axis=-1)
    return np.concatenate(found) if found else np.zeros(0, np.int64)


# Positions `window_token_losses` scores in one pass, at most: a batch of windows is split into passes
# of this size to bound the memory of a long context.
POSITIONS_PER_PASS = 2 ** 16


def window_token_losses(run: LoadedRun, context: int, split: str = 'validation', max_batches: int = -1) -> np.ndarray:
    """`token_losses` of a memory-less run with every target scored from the `context` newest
    inputs of its stream (itself included; fewer at a stream's start), each in a pass of its own:
    the sliding-window evaluation of a Transformer without memory, whose attention reaches exactly
    `context` positions and nothing before them. The same tokens, in the same order, as
    `token_losses` scores.

    A target's window is the stream's `context` inputs ending at it, or its first `context` when
    the stream has fewer before it; positions after the target do not reach it (the attention is
    causal), so the windows are all `context` long, right-padded past a stream's end."""
    exp = run.exp
    model, cfg = exp.eval_model, exp.eval_mcfg
    rngs = train_step_lib.stream_keys(evaluation.eval_key(exp.run), model.kind, 0)

    @jax.jit
    def score(params, windows, positions, targets):
        """[chunk, context] windows -> [chunk] loss of each target at its window position."""
        rows = jnp.arange(windows.shape[0])
        full = jnp.zeros_like(windows).at[rows, positions].set(targets)
        out, _ = model.apply({'params': params}, windows, model_lib.init_memory(cfg, windows.shape[0]),
                             targets=full, deterministic=True, rngs=rngs)
        return -out.target_logprobs[rows, positions].astype(jnp.float32)

    streams = evaluation.eval_streams(exp.run, exp.tokenizer, split)
    total = streams.num_batches if max_batches < 0 else min(max_batches, streams.num_batches)
    history = [np.zeros(0, np.int32)] * streams.batch_size  # Each stream's inputs, newest last.
    found = []
    started = logged = time.time()
    for index, batch in enumerate(streams.iterator()):
        if index >= total:
            break
        if index and time.time() - logged >= evaluation.PROGRESS_EVERY_S:  # A window per token: minutes per context.
            logged = time.time()
            logging.info('scoring windows of %d: batch %d/%d | eta %s', context, index + 1, total,
                         metrics_lib.format_duration((logged - started) / index * (total - index)))
        windows, positions, targets = [], [], []
        for s in range(batch['inputs'].shape[0]):
            for b in range(batch['inputs'].shape[1]):
                if batch['reset'][s, b]:
                    history[b] = history[b][:0]
                seq = np.concatenate([history[b], np.asarray(batch['inputs'][s, b], np.int32)])
                at = len(history[b]) + np.arange(batch['inputs'].shape[2])
                first = np.maximum(0, at - context + 1)
                windows.append(np.pad(seq, (0, context))[first[:, None] + np.arange(context)])
                positions.append(at - first)
                targets.append(np.asarray(batch['targets'][s, b], np.int32))
                read = seq[:len(history[b]) + int(np.sum(batch['mask'][s, b] > 0))]
                history[b] = read[max(0, len(read) - (context - 1)):]
        windows, positions, targets = np.concatenate(windows), np.concatenate(positions), np.concatenate(targets)
        # Windows per pass: about POSITIONS_PER_PASS, and no more than a batch holds (every batch holds
        # as many, so one shape is compiled): a pass padded past a small batch would be mostly padding.
        chunk = min(max(8, POSITIONS_PER_PASS // context), len(windows))
        losses = []
        for at in range(0, len(windows), chunk):
            part = [np.pad(x[at:at + chunk], [(0, max(0, at + chunk - len(x)))] + [(0, 0)] * (x.ndim - 1))
                    for x in (windows, positions, targets)]
            losses.append(score(run.params, *part))
        losses = np.concatenate(jax.device_get(losses))[:len(windows)].astype(np.float64)
        found.append(losses[np.asarray(batch['mask']).reshape(-1) > 0])
    return np.concatenate(found) if found else np.zeros(0)


# Kinds whose memory is a window of the most recent positions: with `same_length`, every scored
# token attends the newest `mem_len` of them, itself included.
WINDOW_KINDS = ('xl', 'xl_cached', 'lamemo', 'infinity')
KINDS = ('none', *WINDOW_KINDS, 'trams')


def context_settings(kind: str, context: int) -> dict:
    """The config.eval.model fields under which a run scored as memory kind `kind` has a context of
    `context` positions:

    - Transformer-XL and LaMemo: every token attends `context` positions, itself included
      (`mem_len=context, same_length=True`): the whole attention. The recurrence still carries
      older information through the memory's hidden states, which is what RECL can show beyond
      the attention length.
    - the infinity-former: the same short-term memory; its long-term memory keeps the whole past
      beside it.
    - TRAMS: `context` attended memory rows (`trams_select`) chosen from a pool of twice as many
      (`memories.trams.attending`), each token also attending its segment up to itself, as TRAMS
      does. (With `same_length` the newest keys would hide the chosen rows from most queries.)
    - 'none' (no memory): a window of `context` inputs per token (`window_token_losses`).
    """
    if kind not in KINDS:
        raise errors.UsageError(
            f'RECL takes runs scored as one of {", ".join(KINDS)}; a {kind!r} run has no context length to set '
            'at evaluation.')
    if context < 1:
        raise errors.UsageError(f'context {context} must be >= 1.')
    if kind == 'none':
        return {'memory': 'none'}
    if kind == 'trams':
        return {'memory': 'trams', **trams.attending(int(context))}
    return {'mem_len': int(context), 'same_length': True}


def member(spec: str) -> tuple[str, str]:
    """(workdir, memory kind it is scored as or '') of a group member `WORKDIR[@KIND]`: `runs/xl@trams`
    scores an XL run's parameters as TRAMS (a kind that runs on them). A path may hold '@' itself:
    only a suffix without '/' is read as a kind."""
    workdir, at, kind = spec.rpartition('@')
    return (workdir, kind) if at and workdir and '/' not in kind else (spec, '')


@dataclasses.dataclass(frozen=True)
class GroupResult:
    """RECL of a group: `recl[run][r]`, the contexts, the tokens each loss array scored."""
    runs: list[str]
    kinds: list[str]
    contexts: list[int]
    rs: list[float]
    recl: list[dict[float, Recl]]
    num_tokens: int  # Counted: those with the longest context's tokens before them.
    split: str
    gains: np.ndarray  # [runs, contexts, contexts]: gain_table at rs[0].
    short_history: int  # Scored but not counted: fewer tokens before them than the longest context.


def group_recl(members: Sequence[str], contexts: Sequence[int], rs: Sequence[float], out: str,
               split: str = 'validation', max_batches: int = -1, clamp_len: Optional[int] = None,
               clamp_setting: str = CLAMP_SETTING) -> GroupResult:
    """Scores every member of the group (`WORKDIR[@KIND]`, `member`) at every context (per-token
    losses kept in `out`, so that a stopped run resumes where it was) and computes RECL at each r.
    The runs must read the split alike: one tokenizer, one evaluation batch size and segment length.
    `clamp_len` (None: each run's own config.eval.model setting; -2: the longest distance it was
    trained on) bounds the relative distances of a context longer than training scored: unclamped,
    a model that extrapolates badly there (LaMemo) scatters its per-token losses, and the relative
    loss's minimum counts the lucky ones as gains. `clamp_setting`: how the caller clamps at the trained
    distances, named by the warning for a context longer than training scored."""
    contexts = sorted(set(int(c) for c in contexts))
    if jax.process_count() > 1:
        raise errors.UsageError(ONE_PROCESS)
    if max_batches == 0 or max_batches < -1:
        raise errors.UsageError(f'max_batches={max_batches}: give -1 (the whole split) or a count >= 1.')
    parsed, kinds, layout = [member(spec) for spec in members], [], None
    for spec, (workdir, scored_as) in zip(members, parsed):  # Every member checked before any is scored.
        exp = experiment.setup(saved_run.saved_config(workdir, config_flag=False), workdir, training=False,
                               clamp_setting=clamp_setting)
        # A run whose config evaluates it as another kind (TRAMS on XL) is scored as that; not as the
        # kind evaluation picks by default for speed (xl_cached for xl), which computes the same.
        trained, evaluated = exp.run.model.memory, exp.eval_mcfg.memory
        chosen = evaluated not in (trained, memories.kind_class(trained).evaluated_by)
        kinds.append(scored_as or (evaluated if chosen else trained))
        settings = _settings(kinds[-1], contexts[-1], clamp_len)  # Refuses a kind without a context.
        config = exp.run.as_config_dict()
        config.eval.model.update(settings)
        try:
            checked = experiment.setup(config, workdir, training=False, clamp_setting=clamp_setting).eval_mcfg
        except errors.UserError as error:
            raise errors.UsageError(f'{spec}: {" ".join(str(error).split())}') from None
        if kinds[-1] == 'none' and checked.positions == 'learned_absolute' and contexts[-1] > checked.n_positions:
            raise errors.UsageError(f'{spec}: a window of {contexts[-1]} tokens exceeds its learned position table '
                                    f'(n_positions={checked.n_positions}): give contexts up to {checked.n_positions}.')
        read_as = (exp.tokenizer.fingerprint, exp.run.eval.batch_size, exp.run.eval.tgt_len)
        if layout is not None and read_as != layout:
            raise errors.UsageError(
                f'{workdir} reads the split otherwise than {parsed[0][0]} (tokenizer, config.eval.batch_size, '
                'config.eval.tgt_len): a RECL group scores the same tokens; give the runs one evaluation batch and '
                'segment length (--config.eval.* in their configs) and one tokenizer.')
        if layout is None:
            history = stream_history(evaluation.eval_streams(exp.run, exp.tokenizer, split), max_batches)
        layout = read_as
    counted = history >= contexts[-1]
    if not counted.any():
        raise errors.UsageError(
            f'none of the {history.size:,} tokens scored has {contexts[-1]} tokens of its evaluation stream before it '
            f'(at most {history.max(initial=0)}): score more of the {split} split (max_batches) or give shorter '
            'contexts.')
    try:
        storage.path(out).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise errors.WorkdirError(f'cannot create --out={out} ({error.strerror or error}): choose a folder you can '
                                  'write to.') from None
    workdir_lib.check_writable_file(storage.join(out, 'recl.json'))  # Before anything is scored.
    rows: list[list[np.ndarray]] = [[None] * len(members) for _ in contexts]
    total, done, start = len(contexts) * len(members), 0, time.time()
    for i, ((workdir, _), kind) in enumerate(zip(parsed, kinds)):
        run = load(workdir)  # Its parameters once, for every context.
        for c, context in enumerate(contexts):
            rows[c][i], read_back = _scored(run, kind, context, split, max_batches, out, clamp_len, clamp_setting)
            done += 1
            elapsed = time.time() - start
            logging.info('RECL: %d/%d (%s, context %d%s) | eta %s', done, total, members[i], context,
                         ', read back' if read_back else '',
                         metrics_lib.format_duration(elapsed / done * (total - done)))
    sizes = {row.size for context_rows in rows for row in context_rows}
    if sizes != {history.size}:
        raise errors.UsageError(f'the runs scored different numbers of tokens ({sorted(sizes | {history.size})}): '
                                'they must read the same split alike.')
    losses = np.array([np.stack(context_rows) for context_rows in rows])[:, :, counted]
    return GroupResult(runs=list(members), kinds=kinds, contexts=contexts, rs=list(rs),
                       recl=[dict(zip(rs, found)) for found in zip(*(recl(losses, contexts, r) for r in rs))],
                       num_tokens=int(losses.shape[2]), split=split, gains=gain_table(losses, rs[0]),
                       short_history=int(history.size - losses.shape[2]))


def _settings(kind: str, context: int, clamp_len: Optional[int]) -> dict:
    """config.eval.model fields of scoring as `kind` at `context`, with the clamp when one is given."""
    return {**context_settings(kind, context), **({} if clamp_len is None else {'clamp_len': int(clamp_len)})}


def _scored(run: LoadedRun, kind: str, context: int, split: str, max_batches: int, out: str,
            clamp_len: Optional[int] = None, clamp_setting: str = CLAMP_SETTING) -> tuple[np.ndarray, bool]:
    """(the run's per-token losses scored as `kind` at `context`, whether they were read back): from
    `out` when an earlier run of the command scored them (the same checkpoint step, kind, split,
    batches and clamp), else scored and kept there."""
    workdir = run.workdir
    where = workdir if storage.is_remote(workdir) else storage.path(workdir).resolve().as_posix()
    settings = _settings(kind, context, clamp_len)
    # Everything that decides the losses: other settings for a kind are never read back as these.
    named = [where, run.step, kind, context, split, max_batches, sorted(settings.items())]
    key = hashlib.sha256(json.dumps(named).encode()).hexdigest()[:16]
    path = storage.join(out, f'losses_{key}.npy')
    if storage.path(path).exists():
        with storage.path(path).open('rb') as f:
            return np.load(f, allow_pickle=False), True
    scored = with_eval_model(run, clamp_setting=clamp_setting, **settings)
    if kind == 'none':
        losses = window_token_losses(scored, context, split, max_batches)
    else:
        losses = token_losses(scored, split, max_batches)
    buffer = io.BytesIO()
    np.save(buffer, losses, allow_pickle=False)
    try:
        storage.write_bytes(path, buffer.getvalue())
    except OSError as error:
        raise errors.WorkdirError(f'cannot keep the losses in {path} ({error.strerror or error}): free some space '
                                  'there or give another --out; the losses kept so far are read back.') from None
    return losses, False


def table(result: GroupResult) -> str:
    """RECL per run and r (`>=`: still gaining at the longest context scored), in tokens."""
    lines = [f'RECL in tokens on {result.num_tokens:,} tokens of the {result.split} split, contexts '
             f'{", ".join(map(str, result.contexts))}; the baseline is the group\'s best run at each context. '
             f'Not counted: {result.short_history:,} tokens scored with fewer than {result.contexts[-1]} tokens of their '
             'stream before them.', '',
             '| run | memory | ' + ' | '.join(f'r = {r:g}' for r in result.rs) + ' |',
             '| --- | --- | ' + ' | '.join('---' for _ in result.rs) + ' |']
    for run, kind, found in zip(result.runs, result.kinds, result.recl):
        cells = [f'{"" if found[r].converged else ">= "}{found[r].context}' for r in result.rs]
        lines.append(f'| {run} | {kind} | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def plot(result: GroupResult, path: str) -> bool:
    """The paper's figure 3: each run's unnormalised relative perplexity gain for the pairs (c, c') at
    rs[0]; False (nothing drawn) without matplotlib (the `plot` extra)."""
    try:
        import matplotlib  # pylint: disable=g-import-not-at-top
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(result.runs), figsize=(4 * len(result.runs), 3.6), squeeze=False)
    top = np.nanmax(result.gains) if np.isfinite(result.gains).any() else 1.0
    for ax, run, gains in zip(axes[0], result.runs, result.gains):
        image = ax.imshow(gains, origin='lower', vmin=0, vmax=max(top, 1e-9), cmap='viridis')
        ax.set_xticks(range(len(result.contexts)), result.contexts)
        ax.set_yticks(range(len(result.contexts)), result.contexts)
        # The run's last two path parts: a run of compare is <method>/seed<k>.
        ax.set(xlabel="long context c'", ylabel='short context c',
               title=f'{"/".join(run.rstrip("/").split("/")[-2:])} (r = {result.rs[0]:g})')
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.tight_layout()
    storage.save_figure(fig, path)
    plt.close(fig)
    return True
