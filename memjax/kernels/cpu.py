"""A batched matrix product, Transformer-XL's span attention weights and the attention's weighted
values for XLA:CPU, built for this CPU on first use and called as FFI targets.

Why: XLA:CPU runs the attention's small batched products (the scores, the weighted values) at
about half the CPU's peak (half MKL's rate on a Zen 3; on a Zen 5 XLA 198-214 GFLOP/s, this
kernel 396-470), and they are a quarter of an evaluation step (BENCHMARKS.md, ops).
`batched_matmul.cc` is a register-blocked product compiled with `-march=native`; the attention
calls it through `product`, for the forward and the gradient's products, through
`relative_softmax` for one contiguous span's scores and softmax in one pass, and through `attend`
for the weighted values with the heads in place; evaluation goes from scores to weighted values
in one pass (`span_attention`); every linear map of a layer (`linear`) has its weight gradient
from it, where XLA:CPU transposes the output gradient first; the adaptive softmax's clusters score
their targets without forming their logits (`cluster_logprobs`). It keeps XLA's own einsums on
other platforms and wherever the kernel does not apply.

It applies to float32 operands on a single-device CPU process (a custom call has no sharding
rule, so meshes of several devices keep XLA's products), when a C++ compiler (`$CXX`, else g++)
and jaxlib's FFI headers are there, and unless `MEMJAX_CPU_KERNELS=off`. `MEMJAX_CPU_KERNEL_ARCH`
(default `native`) is the `-march` it is built for: `x86-64-v3` builds the AVX2 form an AVX-512
machine would otherwise never run, to test it there. The library is cached under
`$XDG_CACHE_HOME/memjax/kernels` (default ~/.cache), keyed by the source, the compiler, the target,
the CPU's flags and jax's version; a failed build logs one line and memjax goes on with XLA's
products.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import pathlib
import shutil
import subprocess
import tempfile
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from memjax.kernels import softmax as softmax_lib

SOURCE = pathlib.Path(__file__).with_name('batched_matmul.cc')
TARGET = 'memjax_batched_matmul'
SOFTMAX_TARGET = 'memjax_relative_softmax'
SOFTMAX_GRADIENT_TARGET = 'memjax_relative_softmax_gradient'
ATTEND_TARGET = 'memjax_attend'
ATTEND_GRADIENT_TARGET = 'memjax_attend_gradient'
SPAN_ATTENTION_TARGET = 'memjax_span_attention'
CLUSTER_TARGET = 'memjax_cluster_logsumexp'
CLUSTER_GRADIENT_TARGET = 'memjax_cluster_logsumexp_gradient'
SWITCH = 'MEMJAX_CPU_KERNELS'  # 'off' keeps XLA's own products everywhere.
# Where the weight gradients take the kernel (measured on a Zen 5, docs/perf-notes.md): XLA:CPU's x^T g,
# its copy of g included, ran at 198-341 GFLOP/s where a side of the map is 256 wide (the kernel
# 313-456), at 359-439 where the narrower side is 410 or 768 (the kernel 370-431); a table's
# gradient over a tail cluster's chunk of 64 rows was slower from the kernel (WikiText-103's
# 160k-row table, 25 wide: its training step 17 % slower).
NARROW = 256  # A linear map's narrower side at most this.
LONG = 128  # A table's gradient summed over at least this many rows.
ARCH = 'MEMJAX_CPU_KERNEL_ARCH'  # The compiler's -march; default native.


def _cpu_flags() -> str:
    try:
        with open('/proc/cpuinfo', encoding='utf-8') as f:
            return next((line for line in f if line.startswith(('flags', 'Features'))), '')
    except OSError:
        return ''


def _cache_dir() -> pathlib.Path:
    root = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return pathlib.Path(root) / 'memjax' / 'kernels'


def _build(compiler: str) -> pathlib.Path:
    """The shared library for this CPU, compiled once (concurrent builders race to the same file)."""
    version = subprocess.run([compiler, '--version'], capture_output=True, text=True, check=True).stdout
    arch = os.environ.get(ARCH, 'native')
    key = hashlib.sha256('\0'.join([SOURCE.read_text(), version, arch, _cpu_flags(), jax.__version__]).encode())
    library = _cache_dir() / f'batched_matmul-{key.hexdigest()[:16]}.so'
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    logging.info('Building memjax\'s CPU attention kernel for this CPU with %s, once (about 10 s; kept in %s).',
                 compiler, library.parent)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        built = pathlib.Path(scratch) / library.name
        subprocess.run([compiler, '-O3', f'-march={arch}', '-std=c++17', '-shared', '-fPIC',
                        f'-I{jax.ffi.include_dir()}', str(SOURCE), '-o', str(built)],
                       capture_output=True, text=True, check=True)
        os.replace(built, library)  # Atomic: another process sees the whole file or none.
    return library


def register(compiler: Optional[str]) -> int:
    """Builds the kernel with `compiler`, loads it and registers its FFI targets; returns the
    floats per vector it was built for (16 with AVX-512, 8 with AVX2), or 0, with one log line
    saying why, if it cannot."""
    if compiler is None:
        logging.warning('memjax: no C++ compiler (set CXX, or install g++): the attention uses XLA\'s '
                        'batched products on CPU, about half as fast.')
        return 0
    try:
        library = ctypes.cdll.LoadLibrary(str(_build(compiler)))
        for target in (TARGET, SOFTMAX_TARGET, SOFTMAX_GRADIENT_TARGET, ATTEND_TARGET, ATTEND_GRADIENT_TARGET,
                       SPAN_ATTENTION_TARGET, CLUSTER_TARGET, CLUSTER_GRADIENT_TARGET):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)), platform='cpu')
        library.memjax_vector_lanes.restype = ctypes.c_int64
        return library.memjax_vector_lanes()
    except (OSError, subprocess.CalledProcessError, AttributeError) as error:
        detail = (getattr(error, 'stderr', None) or str(error)).strip().splitlines()
        logging.warning('memjax: the CPU kernel did not build with %s (%s): the attention uses XLA\'s '
                        'batched products.', compiler, detail[-1] if detail else type(error).__name__)
        return 0


@functools.cache
def vector_lanes() -> int:
    """The floats per vector of this process's kernel (built on first call), 0 where none is."""
    return register(shutil.which(os.environ.get('CXX', 'g++')))


def applies(*operands) -> bool:
    """Whether the kernels run for these operands (decided while tracing; anything with a `dtype`)."""
    return (os.environ.get(SWITCH, 'on') != 'off' and jax.device_count() == 1
            and jax.devices()[0].platform == 'cpu' and all(x.dtype == jnp.float32 for x in operands)
            and vector_lanes() > 0)


def _kernel(lhs: jax.Array, rhs: jax.Array, transpose_lhs: bool = False) -> jax.Array:
    rows = lhs.shape[-1] if transpose_lhs else lhs.shape[-2]
    out = jax.ShapeDtypeStruct(lhs.shape[:-2] + (rows, rhs.shape[-1]), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out, vmap_method='broadcast_all')(lhs, rhs, transpose_lhs=transpose_lhs)


def product(reference: Callable, lhs: jax.Array, rhs: jax.Array, transpose_rhs: bool = False) -> jax.Array:
    """`reference(lhs, rhs)`, a batched einsum whose output is `lhs @ rhs` (`lhs @ rhs^T` with
    `transpose_rhs`) over the leading axes, computed by the kernel where it applies, its gradient's
    two products too (`g @ rhs^T`-like and `lhs^T @ g`-like, the transposed lhs read in place)."""
    if not applies(lhs, rhs):
        return reference(lhs, rhs)
    swap = lambda x: jnp.swapaxes(x, -1, -2)

    def forward(a, b):
        return _kernel(a, swap(b) if transpose_rhs else b)

    def gradients(a, b, grad):
        grad_a = _kernel(grad, b if transpose_rhs else swap(b))
        grad_b = _kernel(grad, a, transpose_lhs=True) if transpose_rhs else _kernel(a, grad, transpose_lhs=True)
        return grad_a, grad_b

    return _on_cpu(reference, forward, gradients, lhs, rhs)


def linear(x: jax.Array, kernel: jax.Array, in_dims: int = 1) -> jax.Array:
    """`x`'s last `in_dims` axes contracted with `kernel`'s first (a layer's linear map); where a
    side of the map is at most NARROW wide, its weight gradient `x^T g` by the kernel over the rows,
    `x` read transposed in place: XLA:CPU copies `g` into a transposed layout for it, and its
    product of that shape runs at about half the peak."""
    reference = functools.partial(jnp.tensordot, axes=in_dims)
    if not applies(x, kernel) or min(math.prod(kernel.shape[:in_dims]), math.prod(kernel.shape[in_dims:])) > NARROW:
        return reference(x, kernel)
    n_out = kernel.ndim - in_dims

    def gradients(x, kernel, grad):
        grad_x = jnp.tensordot(grad, kernel, axes=(tuple(range(grad.ndim - n_out, grad.ndim)),
                                                   tuple(range(in_dims, kernel.ndim))))
        return grad_x, _kernel(_rows(x, in_dims), _rows(grad, n_out), transpose_lhs=True).reshape(kernel.shape)

    return _on_cpu(reference, reference, gradients, x, kernel)


def linear_transposed(x: jax.Array, table: jax.Array) -> jax.Array:
    """Float32 `x [..., d] @ table^T` for a `table` [V, d] stored a row per output (a vocabulary's
    embeddings scoring hidden states); over at least LONG rows of `x`, the table's gradient `g^T x`
    by the kernel, `g` read transposed in place, as `linear`'s."""
    def reference(x, table):
        return jnp.einsum('...d,vd->...v', x, table, preferred_element_type=jnp.float32)

    if not applies(x, table) or math.prod(x.shape[:-1]) < LONG:
        return reference(x, table)

    def gradients(x, table, grad):
        return grad @ table, _kernel(_rows(grad), _rows(x), transpose_lhs=True)

    return _on_cpu(reference, reference, gradients, x, table)


def _rows(a: jax.Array, dims: int = 1) -> jax.Array:
    """`a` as a matrix of rows: its last `dims` axes flattened into columns, the others into rows."""
    return a.reshape(-1, math.prod(a.shape[a.ndim - dims:]))


def _on_cpu(reference: Callable, forward: Callable, gradients: Optional[Callable], *operands):
    """`reference(*operands)` computed by `forward`, its gradient by `gradients(*operands, grad)`.
    Without `gradients` (a kernel that only evaluates) the gradient is the reference's, its forward
    pass computed again where it needs one (XLA drops what it does not need). Called where `applies`
    holds: the program runs on this CPU, so only the kernel's side is traced."""
    def reference_gradients(*operands_and_grad):
        return jax.vjp(reference, *operands_and_grad[:-1])[1](operands_and_grad[-1])

    @jax.custom_vjp
    def run(*xs):
        return forward(*xs)

    def run_forward(*xs):
        return run(*xs), xs

    def run_backward(xs, grad):
        grad = jax.tree.map(lambda g: g.astype(jnp.float32), grad)
        return (gradients or reference_gradients)(*xs, grad)

    run.defvjp(run_forward, run_backward)
    return run(*operands)


def relative_softmax(reference: Callable, content_query: jax.Array, key: jax.Array, position_query: jax.Array,
                     pos_key: jax.Array, valid: jax.Array, scale: float,
                     dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """(probs [B, H, T, K], log_norm [B, H, T]): the softmax over keys of Transformer-XL's masked
    scores `reference(content_query, key, position_query, pos_key, valid)` and its log-denominator
    (the scores' logsumexp), for a contiguous span of K keys, the segment's T queries last (queries
    [B, T, H, D], keys [B, K, H, D], distance rows [K, H, D], key validity [B, K]). The kernel, where
    it applies, forms each head's content and positional products, then takes each query's row in
    cache from scores (positional scores at their rel-shift offsets, scaled, masked) to softmax; its
    gradient, from the probabilities, forms each head's scores gradient in cache and its four
    products, written in place. Elsewhere XLA runs the reference and the same formulas
    (`softmax.softmax_with_log_norm`), the probabilities in `dtype` (the kernel's: float32).
    """
    def softmax(*operands, dtype=jnp.float32):
        return softmax_lib.softmax_with_log_norm(reference(*operands), dtype)

    if not applies(content_query, key, position_query, pos_key):
        return softmax(content_query, key, position_query, pos_key, valid, dtype=dtype)

    def forward(cq, k, pq, r, ok):
        shape = (cq.shape[0], cq.shape[2], cq.shape[1], k.shape[1])
        out = (jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape[:-1], jnp.float32))
        return tuple(jax.ffi.ffi_call(SOFTMAX_TARGET, out)(cq, k, pq, r, ok, scale=np.float32(scale)))

    @jax.custom_vjp
    def run(cq, k, pq, r, ok):
        return forward(cq, k, pq, r, ok)

    def run_forward(cq, k, pq, r, ok):
        probs, log_norm = run(cq, k, pq, r, ok)
        return (probs, log_norm), ((cq, k, pq, r, ok), probs)

    def kernel_gradients(cq, k, pq, r, ok, probs, grad_probs, grad_log_norm):
        out = tuple(jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (cq, k, pq, r))
        return tuple(jax.ffi.ffi_call(SOFTMAX_GRADIENT_TARGET, out)(probs, grad_probs, grad_log_norm, cq, k, pq, r,
                                                                    ok, scale=np.float32(scale)))

    def run_backward(residuals, grads):
        operands, probs = residuals
        return (*kernel_gradients(*operands, probs, *grads), None)

    run.defvjp(run_forward, run_backward)
    probs, log_norm = run(content_query, key, position_query, pos_key, valid)
    return probs.astype(dtype), log_norm


def attend(probs: jax.Array, value: jax.Array, causal: bool = False) -> jax.Array:
    """The attention's weighted values [B, T, H, D] from weights [B, H, T, K] and values [B, K, H, D].
    The kernel, where it applies, reads each head of the values and writes each head of the output
    in place (XLA transposed both whole arrays around its product); its gradient too.

    `causal`: the weights are over a causal span whose last T keys are the queries', zero where key
    j lies after query i (j > K - T + i): the kernel skips those terms and leaves the weights'
    gradient zero there, where the softmax that made the zeros passes nothing back.
    """
    def reference(p, v):
        return jnp.einsum('bhtk,bkhd->bthd', p, v)

    if not applies(probs, value):
        return reference(probs, value)

    def forward(p, v):
        out = jax.ShapeDtypeStruct((p.shape[0], p.shape[2], p.shape[1], v.shape[-1]), jnp.float32)
        return jax.ffi.ffi_call(ATTEND_TARGET, out)(p, v, causal=causal)

    def gradients(p, v, grad):
        out = (jax.ShapeDtypeStruct(p.shape, jnp.float32), jax.ShapeDtypeStruct(v.shape, jnp.float32))
        return tuple(jax.ffi.ffi_call(ATTEND_GRADIENT_TARGET, out)(p, v, grad, causal=causal))

    return _on_cpu(reference, forward, gradients, probs, value)


def span_attention(reference: Callable, content_query: jax.Array, memory_key: jax.Array, segment_key: jax.Array,
                   position_query: jax.Array, pos_key: jax.Array, valid: jax.Array, memory_value: jax.Array,
                   segment_value: jax.Array, scale: float) -> tuple[jax.Array, jax.Array]:
    """(attended [B, T, H, D], log_norm [B, H, T]): `reference(*operands)`, the attention over one
    contiguous span whose keys and values come as two blocks, the memory's [B, M, H, D] (M may be 0)
    and the segment's [B, T, H, D], the segment's T queries last: `relative_softmax`'s weights and
    `attend`'s weighted values of the blocks concatenated. Evaluation's form: the kernel, where it
    applies, takes each head from scores to weighted values in one pass, the weights in cache, and
    concatenates nothing. Its gradient is the reference's (the weights computed again): training
    keeps `relative_softmax` and `attend`, which keep the weights for the backward pass.
    """
    operands = (content_query, memory_key, segment_key, position_query, pos_key, valid, memory_value, segment_value)
    if not applies(content_query, memory_key, segment_key, position_query, pos_key, memory_value, segment_value):
        return reference(*operands)

    def forward(cq, mk, sk, pq, r, ok, mv, sv):
        out = (jax.ShapeDtypeStruct(cq.shape, jnp.float32),
               jax.ShapeDtypeStruct((cq.shape[0], cq.shape[2], cq.shape[1]), jnp.float32))
        return tuple(jax.ffi.ffi_call(SPAN_ATTENTION_TARGET, out)(cq, mk, sk, pq, r, ok, mv, sv,
                                                                  scale=np.float32(scale)))

    return _on_cpu(reference, forward, None, *operands)


def cluster_logprobs(reference: Callable, x: jax.Array, table: jax.Array, bias: jax.Array, index: jax.Array,
                     rows: jax.Array) -> jax.Array:
    """[N] log-softmax of a cluster's logits `x [N, D] @ table [V, D]^T + bias [V]` at `index` [N]
    (in [0, V)) on the selected `rows` [N] (bool), 0 on the others: `reference(x, table, bias,
    index, rows)`. The kernel, where it applies, takes each selected row's logsumexp and logit
    with no [N, V] logits in memory; its gradient computes the logits again, a chunk of the table
    at a time, and from them the three products of dx, dtable and dbias."""
    if not applies(x, table, bias):
        return reference(x, table, bias, index, rows)
    index = index.astype(jnp.int32)

    def forward(x, table, bias, index, rows):
        out = (jax.ShapeDtypeStruct(x.shape[:1], jnp.float32),) * 2
        lse, picked = jax.ffi.ffi_call(CLUSTER_TARGET, out)(x, table, bias, index, rows)
        return picked - lse, lse

    @jax.custom_vjp
    def run(*xs):
        return forward(*xs)[0]

    def run_forward(*xs):
        out, lse = forward(*xs)
        return out, (xs, lse)

    def kernel_gradients(x, table, bias, index, rows, lse, grad):
        out = tuple(jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in (x, table, bias))
        return tuple(jax.ffi.ffi_call(CLUSTER_GRADIENT_TARGET, out)(x, table, bias, index, rows, lse, grad))

    def run_backward(residuals, grad):
        xs, lse = residuals
        grads = kernel_gradients(*xs, lse, grad.astype(jnp.float32))
        return (*grads, None, None)

    run.defvjp(run_forward, run_backward)
    return run(x, table, bias, index, rows)
