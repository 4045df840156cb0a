"""LaMemo's memory refresh, measured: the memorizing coefficient alpha (the paper's figure 6)."""

from __future__ import annotations

from memjax.analysis.run import apply_sown, per_layer


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
