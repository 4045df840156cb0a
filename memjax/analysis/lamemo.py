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
    averages 100). Streams whose memory starts afresh at a segment do not count for it: their
    rows hold no past yet."""
    total, rows = 0.0, 0
    for segment, _, alpha in sown_over_text(run, 'alpha', num_segments, split):
        carried = ~segment.reset
        total = total + alpha[:, carried].mean(axis=2).sum(axis=1)
        rows += int(carried.sum())
    if not rows:
        raise ValueError(f'{num_segments} segments of {split!r}: every one starts afresh; read more segments.')
    return total / rows
