"""Where attention goes, by relative distance (Transformer-XL's figures 5 and 7, LaMemo's figure 1).

All functions take one layer stack's sown 'attention' (`per_layer(sown, 'attention')`) of a kind
whose keys are contiguous (none, xl, lamemo: the memory right before the segment, the segment
last), so query t of T sits at key K - T + t and sees key k at distance K - T + t - k.
"""

from __future__ import annotations

import warnings

import numpy as np

from memjax.analysis.run import LoadedRun, sown_over_text


def by_distance(values: np.ndarray, seg_len: int) -> np.ndarray:
    """[..., T, K] per query and key -> [..., T, K] per query and distance 0 .. K-1 (NaN where a
    query has no key at that distance: it would be in its future or before the first key)."""
    keys = values.shape[-1]
    t = np.arange(seg_len)[:, None]
    d = np.arange(keys)[None, :]
    k = keys - seg_len + t - d  # The key at distance d from query t.
    gathered = np.take_along_axis(values, np.broadcast_to(np.clip(k, 0, keys - 1), values.shape), axis=-1)
    return np.where(k >= 0, gathered, np.nan)


def mean_by_distance(values: np.ndarray, mask: np.ndarray, seg_len: int, bin_width: int = 1,
                     within_bin: str = 'mean') -> np.ndarray:
    """[n_layer, H, K // bin_width]: `values` [n_layer, B, H, T, K] averaged at each distance over
    the batch rows and the queries that see a key there (`mask` [n_layer, B, H|1, T, K]).

    With `bin_width` w, each query's distances are grouped w at a time first and reduced by
    `within_bin` ('mean', 'sum' or 'max': LaMemo's figure 1 takes a query's largest weight in each
    interval of 5 tokens) before the average over queries."""
    seen = by_distance(np.broadcast_to(mask, values.shape).astype(float), seg_len)
    per_query = np.where(seen == 1, by_distance(values.astype(np.float64), seg_len), np.nan)
    bins = per_query.shape[-1] // bin_width
    grouped = per_query[..., :bins * bin_width].reshape(per_query.shape[:-1] + (bins, bin_width))
    reduce = {'mean': np.nanmean, 'sum': np.nansum, 'max': np.nanmax}[within_bin]
    with warnings.catch_warnings():  # A distance no query sees is NaN: numpy warns of an empty mean.
        warnings.simplefilter('ignore', RuntimeWarning)
        binned = reduce(grouped, axis=-1)
        binned = np.where(np.isnan(grouped).all(-1), np.nan, binned)
        return np.nanmean(binned, axis=(1, 3))


def mass_beyond(values: np.ndarray, mask: np.ndarray, seg_len: int, distance: int) -> tuple[np.ndarray, np.ndarray]:
    """([n_layer, H] summed, [n_layer, H] count): each query's total of `values` [n_layer, B, H, T, K]
    on the keys it sees (`mask`) more than `distance` back, summed over the queries that see one,
    and how many do."""
    seen = by_distance(np.broadcast_to(mask, values.shape).astype(float), seg_len)[..., distance + 1:] == 1
    far = np.where(seen, by_distance(values.astype(np.float64), seg_len)[..., distance + 1:], 0.0).sum(-1)
    reaches = seen.any(-1)  # [n_layer, B, H, T]
    return np.where(reaches, far, 0.0).sum(axis=(1, 3)), reaches.sum(axis=(1, 3))


def scored_queries(mask: np.ndarray, segment) -> np.ndarray:
    """The attention `mask` [n_layer, B, H|1, T, K] of the queries whose target is scored: a
    document's padded end and the empty segments after a stream's last document are no text."""
    return mask & (np.asarray(segment.mask) > 0)[None, :, None, :, None]


def share_beyond(run: LoadedRun, distance: int, num_segments: int, split: str = 'validation') -> np.ndarray:
    """[n_layer, H]: the attention weight a query puts on keys more than `distance` back, averaged
    over the queries that see such a key (NaN where none does). With `distance` the longest one
    training scored (`memories.trained_distance`), how much a run evaluated with a longer memory
    leans on relative positions it never learned to weigh."""
    total, count = 0.0, 0
    for segment, _, sown in sown_over_text(run, 'attention', num_segments, split):
        mass, queries = mass_beyond(sown['probs'], scored_queries(sown['mask'], segment), segment.inputs.shape[1],
                                    distance)
        total, count = total + mass, count + queries
    with np.errstate(invalid='ignore'):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def score_terms(attention: dict, scale: float) -> dict[str, np.ndarray]:
    """The four terms of Transformer-XL's relative score (section 3.3), each [n_layer, B, H, T, K]:
    (a) q.k content, (b) q.W_r R_(i-j) content-dependent position, (c) u.k global content bias,
    (d) v.W_r R_(i-j) global position bias, times `scale` (the attention's d_head ** -0.5)."""
    query, key, pos_key = (np.asarray(attention[n], np.float64) for n in ('query', 'key', 'pos_key'))
    u_bias, v_bias = (np.asarray(attention[n], np.float64) for n in ('u_bias', 'v_bias'))
    seg_len, keys, rows = query.shape[2], key.shape[2], pos_key.shape[1]
    distance = keys - seg_len + np.arange(seg_len)[:, None] - np.arange(keys)[None, :]  # [T, K]
    row = np.clip(rows - 1 - distance, 0, rows - 1)  # Row R-1-d of the table holds distance d.
    positional = pos_key[:, row]  # [n_layer, T, K, H, Dh]
    return {
        'a': scale * np.einsum('lbthd,lbkhd->lbhtk', query, key),
        'b': scale * np.einsum('lbthd,ltkhd->lbhtk', query, positional),
        'c': scale * np.einsum('lhd,lbkhd->lbhk', u_bias, key)[:, :, :, None, :].repeat(seg_len, axis=3),
        'd': scale * np.einsum('lhd,ltkhd->lhtk', v_bias, positional)[:, None].repeat(query.shape[1], axis=1),
    }


def term_attention(term: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """One score term as an attention distribution: the softmax over the keys each query sees
    (Transformer-XL's figure 7 normalises every term on its own this way)."""
    masked = np.where(np.broadcast_to(mask, term.shape), term, -np.inf)
    masked = masked - masked.max(axis=-1, keepdims=True)
    weights = np.exp(masked)
    return weights / weights.sum(axis=-1, keepdims=True)



def text_profiles(run: LoadedRun, num_segments: int, split: str = 'validation', bin_width: int = 1,
                  within_bin: str = 'mean', terms: str = '') -> dict[str, np.ndarray]:
    """Attention by distance over `num_segments` segments of the run's text, read as evaluation
    reads it (the memory carried, reset at documents): {'attention': [n_layer, H, K // bin_width]}
    and, for each letter of `terms` ('abd' for the paper's figure 7), that score term alone as an
    attention distribution. Every segment counts alike, each over its queries of scored targets."""
    unknown = sorted(set(terms) - set('abcd'))
    if unknown:
        raise ValueError(f"terms={terms!r}: {unknown} are not score terms; give letters of 'abcd' (section 3.3's "
                         "(a)-(d); 'abd' for the paper's figure 7).")
    scale = run.config.d_head ** -0.5
    totals: dict[str, tuple] = {}  # name -> (sum of the segments' profiles, how many saw each entry)
    for segment, _, sown in sown_over_text(run, 'attention', num_segments, split):
        seg_len = segment.inputs.shape[1]
        found = {'attention': sown['probs']}
        parts = score_terms(sown, scale) if terms else {}
        found.update({name: term_attention(parts[name], sown['mask']) for name in terms})
        for name, values in found.items():
            profile = mean_by_distance(values, scored_queries(sown['mask'], segment), seg_len, bin_width, within_bin)
            # A segment after a reset sees no key far back: it counts only where it sees one.
            total, seen = totals.get(name, (0.0, 0))
            totals[name] = (total + np.nan_to_num(profile), seen + ~np.isnan(profile))
    if not totals:
        raise ValueError(f'the {split!r} split has no segment to read.')
    with np.errstate(invalid='ignore'):
        return {name: np.where(seen > 0, total / np.maximum(seen, 1), np.nan) for name, (total, seen) in totals.items()}
