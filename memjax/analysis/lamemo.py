"""LaMemo's memory refresh, measured: the memorizing coefficient alpha (the paper's figure 6)."""

from __future__ import annotations

import numpy as np

from memjax.analysis.run import LoadedRun, apply_sown, per_layer, sown_over_text


def memorizing_coefficients(model, params, inputs, memory):
    """(alpha [n_layer, B, H, M], next memory) of one segment: the weight each memory row gives its
    past (eq. 11), row M-1 the newest. `model` is `build_model` of a LaMemo config that
    interpolates; jit it with `jax.jit(functools.partial(memorizing_coefficients, model))`."""
    _, new_memory, sown = apply_sown(model, params, inputs, memory)
    try:
        return per_layer(sown, 'alpha'), new_memory
    except ValueError:
        raise ValueError("memorizing_coefficients: the model computes no alpha; it needs memory='lamemo' "
                         'with lamemo_look_ahead=True and lamemo_interpolate=True.') from None


def mean_memorizing_coefficients(run: LoadedRun, num_segments: int, split: str = 'validation') -> np.ndarray:
    """[n_layer, M]: alpha per layer and memory row (row 0 the oldest), averaged over heads and over
    `num_segments` segments of the run's text read as evaluation reads it (the paper's figure 6
    averages 100). A row counts where it holds past: after a stream's memory starts afresh, only
    the newest rows the segments since then filled (a memory longer than a segment fills over
    several); NaN for a row that never did."""
    total, count, read = 0.0, 0, None  # read: each stream's tokens since its memory started afresh.
    for segment, _, alpha in sown_over_text(run, 'alpha', num_segments, split):
        rows = alpha.shape[-1]
        read = np.where(segment.reset, 0, 0 if read is None else read)
        holds = np.arange(rows) >= rows - np.minimum(read, rows)[:, None]  # [B, M]
        total = total + (alpha.mean(axis=2) * holds).sum(axis=1)
        count = count + holds.sum(axis=0)
        read = read + segment.inputs.shape[1]
    if not np.any(count):
        raise ValueError(f'{num_segments} segments of {split!r}: every one starts afresh; read more segments.')
    with np.errstate(invalid='ignore'):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)
