"""Which attention a model takes for config field `attention_impl`: the fused kernel
(memjax/kernels/relative_attention.py) with its platform options, or XLA's path.

On a chip the kernel is compiled once per head size and dtype before a model uses it, so that a
kernel that does not lower or compile there (an untested chip, a Pallas or Triton change) is a
one-line error when asked for, and a warning then XLA's path under 'auto'.
"""

import functools
from typing import Any, Optional

from absl import logging
import jax
import jax.numpy as jnp

from memjax import errors
from memjax.kernels.relative_attention import span_attention, tiles_for


# Platforms where `attention_impl='auto'` fuses: none until a GPU run has checked the kernel's
# forward and backward passes against the reference (docs/performance.md, "Status").
FUSED_BY_DEFAULT: tuple[str, ...] = ()


def path(impl: str, head_dim: int, dtype: Any, platform: Optional[str] = None) -> Optional[dict]:
    """`span_attention`'s platform options for config field `attention_impl`, or None where the
    reference path runs: 'fused' wherever asked, 'auto' on the platforms of FUSED_BY_DEFAULT.

    On a chip the kernel is compiled once per head size and dtype first (compile_failure): where it
    does not lower or compile (an untested chip, a Pallas or Triton change), 'fused' is a one-line
    ConfigError and 'auto' takes XLA's path with one warning. Interpret mode is plain JAX: nothing
    there depends on the chip.
    """
    platform = platform or jax.devices()[0].platform
    if impl == 'reference' or (impl == 'auto' and platform not in FUSED_BY_DEFAULT):
        return None
    options = {'skew': 'roll' if platform == 'tpu' else 'gather', 'interpret': platform not in ('gpu', 'tpu')}
    failure = None if options['interpret'] else compile_failure(options['skew'], head_dim, jnp.dtype(dtype).name)
    if failure is None:
        return options
    if impl == 'fused':
        raise errors.ConfigError(
            f"attention_impl='fused': the fused attention does not compile on this {platform} for heads of "
            f"{head_dim} in {jnp.dtype(dtype).name} ({failure}); use attention_impl='reference', or 'auto', which "
            "takes XLA's attention where the kernel does not compile.")
    _warn_once(platform, failure)
    return None


@functools.lru_cache(maxsize=None)
def _warn_once(platform: str, failure: str) -> None:
    logging.warning("attention_impl='auto': the fused attention does not compile on this %s (%s); XLA's attention "
                    'runs instead.', platform, failure)


@functools.lru_cache(maxsize=None)
def compile_failure(skew: str, head_dim: int, dtype: str, interpret: bool = False) -> Optional[str]:
    """Why the kernel's forward and backward (dropout and the log-normaliser's gradient included)
    do not lower and compile on the default device for heads of `head_dim` in `dtype`: its
    error's type and first line; None when they do."""
    block_q, block_k = tiles_for(head_dim)
    query = jax.ShapeDtypeStruct((1, block_q, 1, head_dim), jnp.dtype(dtype))
    keys = jax.ShapeDtypeStruct((1, block_q + block_k, 1, head_dim), jnp.dtype(dtype))
    rows = jax.ShapeDtypeStruct((block_q + block_k, 1, head_dim), jnp.dtype(dtype))
    valid = jax.ShapeDtypeStruct((1, block_q + block_k), jnp.bool_)

    def loss(*inputs):
        out, log_norm = span_attention(*inputs, scale=head_dim ** -0.5, dropout_rate=0.1,
                                       dropout_seed=jnp.int32(1), block_q=block_q, block_k=block_k, skew=skew,
                                       interpret=interpret)
        return out.astype(jnp.float32).sum() + log_norm.sum()

    try:
        jax.jit(jax.grad(loss, argnums=range(5))).lower(query, query, keys, keys, rows, valid).compile()
    except Exception as error:  # pylint: disable=broad-except  (lowering and compiling raise many kinds)
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        return f'{type(error).__name__}: {lines[0][:300]}' if lines else type(error).__name__
    return None
