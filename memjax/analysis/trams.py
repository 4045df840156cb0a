"""TRAMS' memory selection, measured: which tokens it keeps (the paper's table 3) and how well its
query-independent metric ranks the memory keys the queries attend to (its figure 3).

Both read a Transformer-XL run: `load(workdir, memory='trams', mem_len=pool, ...)` sows what each
layer and head selected ('selected', pool indices, 0 the oldest); `load(workdir, mem_len=pool)`
sows the attention over the whole pool, the ground truth the metric stands in for.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np
from scipy import stats

from memjax import model as model_lib
from memjax.analysis.attention import score_terms
from memjax.analysis.run import LoadedRun, sown_over_text
from memjax.data import pipeline
from memjax.model.memories.trams import key_metric

# Key rankings compared with the true scores: TRAMS' metric cos(K', 1) ||K'||, its two factors,
# the released code's ||K'|| |sum K'|, and the query-dependent angle cos(Q', K') (||Q'|| taken
# constant, as the paper's eq. 5 does) that the paper sets against the norm.
RANKINGS = ('paper', 'norm', 'angle', 'released', 'query_angle')


def query_kernels(params) -> np.ndarray:
    """W_Q of every layer, [n_layer, d_model, H, Dh] (either layer layout): what `key_metric` reads."""
    stacked = model_lib.convert_layer_layout(params, scan_layers=True)['layers']
    return np.asarray(stacked['attention']['query']['kernel'])


# Which tokens TRAMS keeps (table 3).


def kept_positions(selected: np.ndarray, start: int, pool: int, floor) -> np.ndarray:
    """Stream positions of the pool rows `selected` [..., B, H, picks] at a segment that starts at
    stream position `start`: row p holds position start - pool + p. -1 where the row holds no token
    of the stream: before its start or its newest memory reset (`floor` [B], a position)."""
    positions = start - pool + np.asarray(selected, np.int64)
    floor = np.asarray(floor).reshape((-1, 1, 1))
    return np.where(positions >= np.maximum(floor, 0), positions, -1)


def kept_counts(selected: np.ndarray, seg_len: int, pool: int, reset: np.ndarray | None = None) -> np.ndarray:
    """[n_layer, B, H, S * seg_len]: how many segments each layer and head attended each position
    of its stream, from `selected` [S, n_layer, B, H, picks] sown at the streams' first S segments
    (`reset` [S, B]: the memory restarted at that segment)."""
    num_segments, n_layer, batch, heads, _ = selected.shape
    reset = np.zeros((num_segments, batch), bool) if reset is None else np.asarray(reset, bool)
    counts = np.zeros((n_layer, batch, heads, num_segments * seg_len), np.int64)
    layer, row, head = np.ogrid[:n_layer, :batch, :heads]
    floor = np.zeros(batch, np.int64)
    for s in range(num_segments):
        floor = np.where(reset[s], s * seg_len, floor)
        positions = kept_positions(selected[s], s * seg_len, pool, floor)
        # Rows that hold no token add 0 (at position 0).
        np.add.at(counts, (layer[..., None], row[..., None], head[..., None], np.maximum(positions, 0)),
                  positions >= 0)
    return counts


@dataclasses.dataclass(frozen=True)
class Kept:
    """B streams of text and how often TRAMS attended each of their tokens."""

    tokens: np.ndarray  # [B, L] int32: each stream's first L tokens (the segments' inputs).
    real: np.ndarray  # [B, L] bool: a token of the text, not the padding of a document's last segment.
    counts: np.ndarray  # [n_layer, B, H, L]: segments in which each layer and head selected the token.


def kept_tokens(run: LoadedRun, num_segments: int, split: str = 'validation') -> Kept:
    """What a TRAMS run (`load(..., memory='trams', ...)`) selects on the first `num_segments`
    segments of the split's streams (layers left out of `trams_layers` select the newest rows)."""
    segments, selections = [], []
    for segment, _, selected in sown_over_text(run, 'selected', num_segments, split):
        segments.append(segment)
        selections.append(selected)
    counts = kept_counts(np.stack(selections), segments[0].inputs.shape[1], run.config.mem_len,
                         np.stack([s.reset for s in segments]))
    return Kept(np.concatenate([s.inputs for s in segments], axis=1),
                np.concatenate([s.mask for s in segments], axis=1).astype(bool), counts)


def kept_by_token(kept: Kept, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(rate [vocab], occurrences [vocab]): per token id, the segments in which a layer and head
    selected it, per occurrence and per layer and head (NaN for ids not in the text), and its
    occurrences in the text (real tokens only)."""
    n_layer, _, heads, _ = kept.counts.shape
    ids = kept.tokens[kept.real]
    times = np.bincount(ids, weights=kept.counts.sum(axis=(0, 2))[kept.real], minlength=vocab_size)
    occurrences = np.bincount(ids, minlength=vocab_size)
    with np.errstate(invalid='ignore', divide='ignore'):
        return times / (occurrences * n_layer * heads), occurrences


def token_counts(run: LoadedRun, split: str = 'train') -> np.ndarray:
    """[vocab]: occurrences of each token id in the split, as the run tokenised it: the paper
    finds the kept tokens rare in the training text."""
    tokens, _ = pipeline.load_token_ids(run.exp.run.data, split, run.tokenizer)
    return np.bincount(tokens, minlength=run.tokenizer.vocab_size)


def marked_text(tokenizer, kept: Kept, row: int, start: int = 0, stop: int | None = None, top: float = 0.1,
                marks: tuple[str, str] = ('[', ']')) -> str:
    """Stream `row`'s tokens [start, stop) as text, the `top` fraction that the layers and heads
    selected most often between `marks`, runs of them together (the paper's table 3 highlights
    them)."""
    tokens = [int(token) for token in kept.tokens[row, start:stop]]
    counts = kept.counts[:, row, :, start:stop].sum(axis=(0, 1))
    marked = (counts >= np.quantile(counts, 1 - top)) & (counts > 0)
    bounds = [0] + [i for i in range(1, len(tokens)) if marked[i] != marked[i - 1]] + [len(tokens)]
    pieces = []
    for begin, end in zip(bounds[:-1], bounds[1:]):
        # What the run adds to the text: a word tokenizer joins it with a space, left outside the marks.
        added = tokenizer.decode(tokens[:end])[len(tokenizer.decode(tokens[:begin])):]
        own = tokenizer.decode(tokens[begin:end])
        if marked[begin]:
            joint = added[:len(added) - len(own)] if own and added.endswith(own) else ''
            added = joint + marks[0] + added[len(joint):] + marks[1]
        pieces.append(added)
    return ''.join(pieces)


# How well the metric ranks the keys (figure 3).


def top_spearman(truth: np.ndarray, ranking: np.ndarray, fractions: Sequence[float]) -> np.ndarray:
    """[..., F]: Spearman's rank correlation between `truth` [N] and each `ranking` [..., N] (the
    same pairs) over the pairs in the top `fractions` of truth (ties share their mean rank): 1 when
    a ranking orders them as `truth` does, -1 when reversed; NaN when it ranks them all alike."""
    order = np.argsort(-truth, kind='stable')
    truth, ranking = truth[order], ranking[..., order]
    correlations = []
    for fraction in fractions:
        count = max(2, int(np.ceil(fraction * truth.size)))
        true_rank = stats.rankdata(truth[:count])
        true_rank -= true_rank.mean()
        rank = stats.rankdata(ranking[..., :count], axis=-1)
        rank -= rank.mean(axis=-1, keepdims=True)
        with np.errstate(invalid='ignore', divide='ignore'):  # A constant ranking: NaN.
            correlations.append(rank @ true_rank / (np.linalg.norm(rank, axis=-1) * np.linalg.norm(true_rank)))
    return np.stack(correlations, axis=-1)


def key_rankings(keys: np.ndarray, query_kernel: np.ndarray) -> dict[str, np.ndarray]:
    """{name: [B, N, H]} of keys [B, N, H, Dh] and their layer's W_Q [d_model, H, Dh]: TRAMS' metric
    ('paper'), ||K'|| ('norm'), cos(K', 1) ('angle') and the released code's ('released')."""
    model_space = np.einsum('bnhk,dhk->bnhd', keys.astype(np.float64), query_kernel.astype(np.float64))  # K'
    norm = np.linalg.norm(model_space, axis=-1)
    paper = np.asarray(key_metric(keys, query_kernel, 'paper'), np.float64)
    with np.errstate(invalid='ignore', divide='ignore'):
        angle = paper / norm  # cos(K', 1) ||K'|| / ||K'||.
    return {'paper': paper, 'norm': norm, 'angle': angle,
            'released': np.asarray(key_metric(keys, query_kernel, 'released'), np.float64)}


def metric_correlations(attention: dict, query_kernel: np.ndarray, fractions: Sequence[float],
                        positional: bool = False) -> dict[str, np.ndarray]:
    """{ranking: [n_layer, H, F]}: per layer and head, the Spearman correlation of each of
    `RANKINGS` with the true scores of every (query, memory key) pair a query sees, over the pairs
    in the top `fractions` of true scores, pooled over the batch rows.

    `attention` is `per_layer(sown, 'attention')` of a Transformer-XL (keys contiguous, the segment
    last) whose memory is the pool; `query_kernel` [n_layer, d_model, H, Dh] (`query_kernels`). The
    true score is the content score (q + u).k the metric stands in for; `positional` adds the
    relative-position terms, which no key ranking sees."""
    attention = {name: np.asarray(value, np.float64) if value is not None else None
                 for name, value in attention.items()}
    seg_len = attention['query'].shape[2]
    memory = attention['key'].shape[2] - seg_len
    terms = score_terms(attention, 1.0)
    truth = terms['a'] + terms['c'] + (terms['b'] + terms['d'] if positional else 0.0)
    truth = truth[..., :memory]  # [n_layer, B, H, T, M]
    seen = np.broadcast_to(np.asarray(attention['mask'], bool), terms['a'].shape)[..., :memory]
    n_layer, heads = truth.shape[0], truth.shape[2]
    result = {name: np.full((n_layer, heads, len(fractions)), np.nan) for name in RANKINGS}
    for layer in range(n_layer):
        per_key = key_rankings(attention['key'][layer, :, :memory], query_kernel[layer])
        pairs = {name: np.broadcast_to(value.transpose(0, 2, 1)[:, :, None, :], truth.shape[1:])
                 for name, value in per_key.items()}
        with np.errstate(invalid='ignore', divide='ignore'):  # q.K' / ||K'||, ||Q'|| a constant.
            pairs['query_angle'] = terms['a'][layer, ..., :memory] / pairs['norm']
        for head in range(heads):
            where = seen[layer, :, head]
            if where.sum() >= 2:
                rankings = np.stack([pairs[name][:, head][where] for name in RANKINGS])
                correlations = top_spearman(truth[layer, :, head][where], rankings, fractions)
                for name, value in zip(RANKINGS, correlations):
                    result[name][layer, head] = value
    return result


def text_correlations(run: LoadedRun, fractions: Sequence[float], num_segments: int, split: str = 'validation',
                      positional: bool = False) -> dict[str, np.ndarray]:
    """`metric_correlations` on segment `num_segments` of the split's streams (earlier ones fill
    the memory: `num_segments` >= mem_len / tgt_len + 1 attends a full pool) of a Transformer-XL
    run loaded with its memory the pool, `load(workdir, mem_len=pool)`."""
    _, _, attention = collections.deque(sown_over_text(run, 'attention', num_segments, split), maxlen=1)[0]
    return metric_correlations(attention, query_kernels(run.params), fractions, positional)
