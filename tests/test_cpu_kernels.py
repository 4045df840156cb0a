"""memjax's batched product for XLA:CPU (memjax/kernels/cpu.py) against XLA's einsum."""

import logging
import os
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax.kernels import cpu
import training_fixtures

needs_kernel = pytest.mark.skipif(not cpu.applies(jnp.zeros(1)), reason=(
    'memjax\'s CPU kernel does not apply in this process: no C++ compiler (g++ or $CXX), a build '
    'failure (logged), MEMJAX_CPU_KERNELS=off, or more than one device.'))


# Tests of a whole model's step on the kernels, left out of the AVX2 re-run.
MODEL_LEVEL = ('test_evaluation_runs_the_one_pass_attention_and_scores_as_training_does',
               'test_evaluation_scores_targets_by_the_cluster_kernel_as_training_does')


def _nt(a, b):
    return jnp.einsum('...md,...nd->...mn', a, b, preferred_element_type=jnp.float32)


def _nn(a, b):
    return jnp.einsum('...mk,...kn->...mn', a, b)


def _hlo(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def _normal(seed: int, *shapes) -> list:
    """float32 standard normal operands of `shapes`, drawn by numpy: jax.random would compile a
    program for every shape. The references below run jitted for the same reason (op by op, each of
    their operations compiles for its shapes): both checks read only the values."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape, np.float32) for shape in shapes]


@needs_kernel
@pytest.mark.parametrize('lead,m,k,n', [((2, 3), 7, 5, 37), ((4,), 13, 64, 32), ((1, 2), 6, 3, 3), ((), 1, 1, 1)])
@pytest.mark.parametrize('transpose_rhs', [False, True])
def test_product_equals_the_einsum_for_tails_and_leading_axes(lead, m, k, n, transpose_rhs):
    """Rows beyond the 6-row blocks, columns beyond the 32-wide blocks, any leading axes; the
    program really calls the kernel."""
    lhs, rhs = _normal(0, lead + (m, k), lead + ((n, k) if transpose_rhs else (k, n)))
    reference = _nt if transpose_rhs else _nn
    fn = lambda a, b: cpu.product(reference, a, b, transpose_rhs=transpose_rhs)
    np.testing.assert_allclose(jax.jit(fn)(lhs, rhs), jax.jit(reference)(lhs, rhs), rtol=1e-5, atol=1e-5)
    assert f'custom_call_target="{cpu.TARGET}"' in _hlo(fn, lhs, rhs)


@needs_kernel
def test_product_gradient_is_the_einsums_and_it_vmaps():
    """Both layouts of rhs; rows of 9 and columns of 40 leave tails in the gradient's products."""
    lhs, rhs, weight = _normal(1, *3 * [(3, 2, 9, 40)])
    loss = lambda product: lambda a, b: jnp.sum(product(a, b) * weight[..., :9])
    for reference, transpose_rhs, b in ((_nt, True, rhs), (_nn, False, np.swapaxes(rhs, -1, -2))):
        fn = lambda x, y: cpu.product(reference, x, y, transpose_rhs=transpose_rhs)
        got = jax.jit(jax.grad(loss(fn), (0, 1)))(lhs, b)
        expected = jax.jit(jax.grad(loss(reference), (0, 1)))(lhs, b)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
        # The gradient's two products run the kernel too (the loss is linear: no forward is left),
        # one of them reading its lhs transposed.
        hlo = _hlo(jax.grad(loss(fn), (0, 1)), lhs, b)
        assert hlo.count(f'custom_call_target="{cpu.TARGET}"') == 2 and 'transpose_lhs = true' in hlo
    batched = jax.jit(jax.vmap(lambda a, b: cpu.product(_nn, a, b)))(lhs, np.swapaxes(rhs, -1, -2))
    np.testing.assert_allclose(batched, np.einsum('...mk,...kn->...mn', lhs, np.swapaxes(rhs, -1, -2)),
                               rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize('lead,m,k,n', [((), 37, 300, 70), ((), 9, 129, 33), ((1,), 40, 256, 31), ((), 8, 1, 96),
                                        ((), 5, 0, 7)])
def test_a_long_contraction_of_few_products_is_the_einsum(lead, m, k, n):
    """Fewer products than threads (a weight gradient): columns split over the threads; a
    contraction past one chunk (128 terms) summed chunk by chunk, a partial last chunk and column
    tails included, an empty contraction all zeros; the lhs read transposed, as a weight gradient's x^T g."""
    lhs, rhs = _normal(5, lead + (k, m), lead + (k, n))
    expected = np.einsum('...km,...kn->...mn', lhs.astype(np.float64), rhs)
    got = jax.jit(lambda a, b: cpu._kernel(a, b, transpose_lhs=True))(lhs, rhs)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    got = jax.jit(cpu._kernel)(np.swapaxes(lhs, -1, -2), rhs)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize('x_shape,kernel_shape,in_dims', [((2, 5, 16), (16, 3, 8), 1), ((7, 2, 8), (2, 8, 12), 2),
                                                           ((300, 16), (16, 40), 1)])
def test_linear_and_its_gradient_are_the_tensordots(x_shape, kernel_shape, in_dims):
    """A layer's linear map: the value and both gradients are XLA's tensordot's, the weight
    gradient computed by the kernel (x read transposed, no transpose of the output gradient)."""
    x, kernel, weight = _normal(6, x_shape, kernel_shape, x_shape[:len(x_shape) - in_dims] + kernel_shape[in_dims:])
    loss = lambda fn: lambda a, b: jnp.sum(fn(a, b) * weight)
    linear = lambda a, b: cpu.linear(a, b, in_dims)
    reference = lambda a, b: jnp.tensordot(a, b, axes=in_dims, precision='highest')
    np.testing.assert_allclose(jax.jit(linear)(x, kernel), jax.jit(reference)(x, kernel), rtol=1e-5, atol=1e-5)
    for got, expected in zip(jax.jit(jax.grad(loss(linear), (0, 1)))(x, kernel),
                             jax.jit(jax.grad(loss(reference), (0, 1)))(x, kernel)):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    hlo = _hlo(jax.grad(loss(linear), (0, 1)), x, kernel)
    assert hlo.count(f'custom_call_target="{cpu.TARGET}"') == 1 and 'transpose_lhs = true' in hlo


@needs_kernel
def test_linear_transposed_and_its_gradient_are_the_einsums():
    """Scores against a table stored a row per output ([V, d], a vocabulary's): value and both
    gradients are the einsum's, the table's gradient from the kernel without transposing g."""
    x, table, weight = _normal(7, (3, 50, 24), (37, 24), (3, 50, 37))
    reference = lambda a, b: jnp.einsum('...d,vd->...v', a, b, precision='highest')
    loss = lambda fn: lambda a, b: jnp.sum(fn(a, b) * weight)
    np.testing.assert_allclose(jax.jit(cpu.linear_transposed)(x, table), jax.jit(reference)(x, table),
                               rtol=1e-5, atol=1e-5)
    for got, expected in zip(jax.jit(jax.grad(loss(cpu.linear_transposed), (0, 1)))(x, table),
                             jax.jit(jax.grad(loss(reference), (0, 1)))(x, table)):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    hlo = _hlo(jax.grad(loss(cpu.linear_transposed), (0, 1)), x, table)
    assert hlo.count(f'custom_call_target="{cpu.TARGET}"') == 1 and 'transpose_lhs = true' in hlo


@needs_kernel
def test_wide_maps_and_short_tables_keep_xlas_weight_gradient():
    """Where the kernel gains nothing (both sides of a map wider than NARROW, a table's gradient
    over fewer than LONG rows) the gradient is XLA's own."""
    wide = jnp.ones((cpu.NARROW + 1, cpu.NARROW + 1))
    grad = jax.grad(lambda a, b: cpu.linear(a, b).sum(), (0, 1))
    assert cpu.TARGET not in _hlo(grad, jnp.ones((8, cpu.NARROW + 1)), wide)
    assert cpu.TARGET in _hlo(grad, jnp.ones((8, cpu.NARROW + 1)), wide[:, :cpu.NARROW])
    table_grad = jax.grad(lambda a, b: cpu.linear_transposed(a, b).sum(), (0, 1))
    assert cpu.TARGET not in _hlo(table_grad, jnp.ones((cpu.LONG - 1, 16)), jnp.ones((40, 16)))
    assert cpu.TARGET in _hlo(table_grad, jnp.ones((cpu.LONG, 16)), jnp.ones((40, 16)))


@needs_kernel
@pytest.mark.parametrize('t,k,d', [(45, 83, 16), (70, 70, 41), (1, 35, 8), (9, 20, 33)])
@pytest.mark.parametrize('causal', [False, True])
def test_attend_is_the_einsum_and_its_gradient(t, k, d, causal):
    """Weighted values with both heads' layouts read and written in place, against the einsum: rows,
    head sizes and keys beyond the register blocks. Causal weights (zero after each query's own key):
    the kernel skips the zeros' terms; the weights' gradient is the einsum's inside the span and zero
    beyond it, which is what the softmax that made the zeros passes back."""
    inside = np.arange(k)[None, :] <= (k - t) + np.arange(t)[:, None] if causal else np.ones((t, k), bool)
    weights = np.where(inside, np.random.default_rng(7).random((2, 3, t, k), np.float32), np.float32(0))
    values, grad = _normal(7, (2, k, 3, d), (2, t, 3, d))
    reference = lambda p, v: jnp.einsum('bhtk,bkhd->bthd', p, v)
    fn = lambda p, v: cpu.attend(p, v, causal=causal)
    out, vjp = jax.vjp(jax.jit(fn), weights, values)
    np.testing.assert_allclose(out, jax.jit(reference)(weights, values), rtol=1e-5, atol=1e-5)
    expected = jax.jit(lambda p, v, g: jax.vjp(reference, p, v)[1](g))(weights, values, grad)
    got = vjp(grad)
    np.testing.assert_allclose(got[0], np.where(inside, expected[0], 0.0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(got[0])[..., ~inside], 0.0)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-5)
    hlo = _hlo(jax.grad(lambda p, v: jnp.sum(fn(p, v) * grad), (0, 1)), weights, values)
    assert f'custom_call_target="{cpu.ATTEND_GRADIENT_TARGET}"' in hlo


def test_xla_products_where_the_kernel_does_not_apply(monkeypatch):
    """Switched off, or in bfloat16, the product is the einsum itself, bit for bit."""
    a, b = _normal(2, (2, 4, 8), (2, 8, 4))
    monkeypatch.setenv(cpu.SWITCH, 'off')
    assert not cpu.applies(a, b)
    fn = lambda x, y: cpu.product(_nn, x, y)
    assert cpu.TARGET not in _hlo(fn, a, b)
    np.testing.assert_array_equal(jax.jit(fn)(a, b), jax.jit(_nn)(a, b))
    monkeypatch.setenv(cpu.SWITCH, 'on')
    assert not cpu.applies(jnp.asarray(a, jnp.bfloat16), b)


def test_a_failed_build_is_one_log_line_and_no_kernel(caplog, tmp_path, monkeypatch):
    monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert not cpu.register('/bin/false')
        assert not cpu.register(None)
    assert [r.getMessage().count('\n') for r in caplog.records] == [0, 0]
    assert 'did not build with /bin/false' in caplog.records[0].getMessage()
    assert 'no C++ compiler' in caplog.records[1].getMessage()


@needs_kernel
def test_the_kernel_is_built_for_its_target():
    """The register layout that runs is the one the build targets: 16-float vectors where the
    target has AVX-512, 8 where it has AVX2 only (x86-64-v3, which the last test of this file builds)."""
    avx512 = 'avx512f' in cpu._cpu_flags().split() and os.environ.get(cpu.ARCH, 'native') == 'native'
    assert cpu.vector_lanes() == (16 if avx512 else 8)


def _naive_span_scores(cq, k, pq, r, valid, scale):
    """Each score from its definition: query i sits at key K - T + i; against key j at distance
    d = K - T + i - j it adds the positional key of distance d (table row K - 1 - d); keys in the
    query's future or not valid get the float32 minimum."""
    cq, k, pq, r, valid = map(np.asarray, (cq, k, pq, r, valid))
    (batch, qlen, heads, _), klen = cq.shape, k.shape[1]
    out = np.full((batch, heads, qlen, klen), np.finfo(np.float32).min, np.float32)
    for i in range(qlen):
        for j in range(klen):
            distance = klen - qlen + i - j
            if distance >= 0:
                score = np.einsum('bhd,bhd->bh', cq[:, i], k[:, j]) + np.einsum('bhd,hd->bh', pq[:, i], r[klen - 1 - distance])
                out[:, :, i, j] = np.where(valid[:, j, None], score * scale, out[:, :, i, j])
    return out


def _span_operands(batch, qlen, klen, heads, dim, seed=4):
    cq, pq, k, r = _normal(seed, *2 * [(batch, qlen, heads, dim)], (batch, klen, heads, dim), (klen, heads, dim))
    valid = np.random.default_rng(seed).random((batch, klen)) < 0.8
    valid[:, klen - qlen:] = True
    return cq, k, pq, r, valid


def _naive_softmax(scores):
    """Softmax and logsumexp over the last axis in float64 (masked scores, at the float32 minimum,
    weigh nothing unless a row has nothing else: then it is uniform)."""
    scores = scores.astype(np.float64)
    top = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - top)
    total = weights.sum(axis=-1, keepdims=True)
    return weights / total, (top + np.log(total))[..., 0]


@needs_kernel
@pytest.mark.parametrize('batch,qlen,klen,heads,dim,spread', [
    (2, 7, 19, 3, 5, 1.0), (1, 16, 16, 2, 8, 1.0), (2, 9, 41, 1, 64, 1.0), (1, 1, 33, 2, 4, 1.0),
    (2, 5, 37, 2, 16, 30.0), (1, 45, 83, 2, 16, 1.0)])
def test_span_softmax_equals_its_definition(batch, qlen, klen, heads, dim, spread):
    """The fused weights (content + rel-shifted positions, scaled, masked, softmax) and their
    log-denominator against a per-score naive computation: memory longer than, or absent from, the
    span; rows and columns beyond the register blocks and vector lanes; invalid memory keys; scores
    spread over hundreds (exponents far into float32's range, probabilities that underflow); rows
    and column blocks the causal mask lets the kernel skip, whole or in part. The reference they
    fall back to agrees too."""
    from memjax.model import attention  # pylint: disable=g-import-not-at-top
    cq, k, pq, r, valid = _span_operands(batch, qlen, klen, heads, dim)
    operands = (cq * spread, k, pq * spread, r, valid)
    reference = lambda *x: attention.span_scores_masked(0.3, *x)
    fn = lambda *x: cpu.relative_softmax(reference, *x, 0.3)
    probs, log_norm = _naive_softmax(_naive_span_scores(*operands, 0.3))
    # A probability's relative error is its float32 score's absolute error, which grows with the
    # scores' size (about 1e-7 of the largest terms summed into them).
    rtol = 1e-5 * spread
    for got in (jax.jit(fn)(*operands), jax.jit(lambda *x: _softmax_of(reference(*x)))(*operands)):
        np.testing.assert_allclose(got[0], probs, rtol=rtol, atol=1e-7)
        np.testing.assert_allclose(got[1], log_norm, rtol=1e-5, atol=1e-5)
    assert f'custom_call_target="{cpu.SOFTMAX_TARGET}"' in _hlo(fn, *operands)


def _softmax_of(scores):
    return jax.nn.softmax(scores, axis=-1), jax.nn.logsumexp(scores, axis=-1)


@needs_kernel
def test_span_softmax_of_a_row_with_no_visible_key_is_uniform_as_xlas():
    """A batch row whose keys are all invalid (no real caller has one: the segment's own keys are
    always valid) gets XLA's softmax of equal scores, every key 1 / K, not NaNs, and no gradient."""
    from memjax.model import attention  # pylint: disable=g-import-not-at-top
    cq, k, pq, r, valid = _span_operands(2, 4, 11, 2, 8)
    valid[0] = False
    operands = (cq, k, pq, r, valid)
    reference = lambda *x: attention.span_scores_masked(0.3, *x)
    got = jax.device_get(jax.jit(lambda *x: cpu.relative_softmax(reference, *x, 0.3))(*operands))
    expected = jax.device_get(jax.jit(lambda *x: _softmax_of(reference(*x)))(*operands))
    np.testing.assert_allclose(got[0][0], np.full((2, 4, 11), 1 / 11), rtol=1e-6)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(got[1][0], expected[1][0])
    loss = lambda weights: lambda *x: jnp.sum(weights(*x)[0] * jnp.arange(11.0))
    fused = jax.grad(loss(lambda *x: cpu.relative_softmax(reference, *x, 0.3)), (0, 1, 2, 3))
    unfused = jax.grad(loss(lambda *x: _softmax_of(reference(*x))), (0, 1, 2, 3))
    for g, e in zip(jax.jit(fused)(*operands), jax.jit(unfused)(*operands)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize('batch,qlen,klen,heads,dim', [(2, 9, 20, 2, 6), (3, 16, 16, 2, 41), (1, 1, 35, 3, 32),
                                                        (2, 45, 83, 2, 16), (1, 70, 70, 1, 40)])
def test_span_softmax_gradient_is_the_references(batch, qlen, klen, heads, dim):
    """Both outputs carry gradient (LaMemo's memory update reads the log-denominator); the kernel's
    gradient, with rows and head sizes beyond its register blocks, invalid memory keys, and row
    blocks whose terms the causal mask leaves out in part, equals XLA's of the reference."""
    from memjax.model import attention  # pylint: disable=g-import-not-at-top
    operands = _span_operands(batch, qlen, klen, heads, dim, seed=5)
    reference = lambda *x: attention.span_scores_masked(0.3, *x)
    weight, norm_weight = _normal(6, (batch, heads, qlen, klen), (batch, heads, qlen))
    loss = lambda weights: lambda *x: jnp.sum(weights(*x)[0] * weight) + jnp.sum(weights(*x)[1] * norm_weight)
    fused = jax.grad(loss(lambda *x: cpu.relative_softmax(reference, *x, 0.3)), (0, 1, 2, 3))
    got = jax.jit(fused)(*operands)
    unfused = jax.grad(loss(lambda *x: _softmax_of(reference(*x))), (0, 1, 2, 3))
    for g, e in zip(got, jax.jit(unfused)(*operands)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    assert f'custom_call_target="{cpu.SOFTMAX_GRADIENT_TARGET}"' in _hlo(fused, *operands)


@needs_kernel
@pytest.mark.parametrize('batch,qlen,mlen,heads,dim', [(2, 7, 12, 3, 5), (1, 16, 0, 2, 8), (2, 9, 32, 1, 64),
                                                        (1, 1, 32, 2, 4), (1, 45, 38, 2, 16), (2, 20, 3, 2, 41)])
def test_evaluation_attention_equals_its_definition_and_its_gradient(batch, qlen, mlen, heads, dim):
    """Evaluation's one pass (weights to weighted values, memory and segment as two blocks)
    against the weights from their definition times the values concatenated: memory absent, shorter
    or longer than the segment; rows, heads and key counts beyond the register blocks and lanes;
    invalid memory keys. Its gradient, for a caller that differentiates it anyway, is the training
    path's, and it runs the one-pass kernel."""
    from memjax.model import attention  # pylint: disable=g-import-not-at-top
    cq, k, pq, r, valid = _span_operands(batch, qlen, mlen + qlen, heads, dim, seed=7)
    v, = _normal(8, k.shape)
    blocks = lambda x: (x[:, :mlen], x[:, mlen:])
    operands = (cq, *blocks(k), pq, r, valid, *blocks(v))
    reference = lambda *x: attention.span_attention(0.3, *x)
    fn = lambda *x: cpu.span_attention(reference, *x, 0.3)
    probs, log_norm = _naive_softmax(_naive_span_scores(cq, k, pq, r, valid, 0.3))
    attended = np.einsum('bhtk,bkhd->bthd', probs, np.asarray(v, np.float64))
    for got in (jax.jit(fn)(*operands), jax.jit(reference)(*operands)):
        np.testing.assert_allclose(got[0], attended, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got[1], log_norm, rtol=1e-5, atol=1e-5)
    assert f'custom_call_target="{cpu.SPAN_ATTENTION_TARGET}"' in _hlo(fn, *operands)
    weight, = _normal(9, (batch, qlen, heads, dim))
    loss = lambda attention_of: lambda *x: jnp.sum(attention_of(*x)[0] * weight) + jnp.sum(attention_of(*x)[1])
    wrt = (0, 1, 2, 3, 4, 6, 7)
    for g, e in zip(jax.jit(jax.grad(loss(fn), wrt))(*operands), jax.jit(jax.grad(loss(reference), wrt))(*operands)):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize('overrides', [dict(mem_len=6), dict(mem_len=0), dict(mem_len=6, pre_lnorm=True, block='gpt2'),
                                       dict(mem_len=8, memory='lamemo')])
def test_evaluation_runs_the_one_pass_attention_and_scores_as_training_does(overrides):
    """A model's evaluation (deterministic, no weights collected) runs the one-pass attention and
    no weights kernel (LaMemo's look-ahead too); training, and an evaluation that collects the
    attention's parts for analysis, keep the weights. All three give the same log-probabilities,
    segment after segment (the memory carried, its first segment's zero rows included)."""
    from memjax.model import ModelConfig, build_model, init_memory  # pylint: disable=g-import-not-at-top
    cfg = ModelConfig(vocab_size=40, d_model=32, n_layer=2, n_head=2, d_head=16, d_inner=48, dropout=0.0, **overrides)
    model, params = build_model(cfg), training_fixtures.perturbed_params(cfg)
    tokens = np.random.default_rng(2).integers(0, 40, (2, 3, 8), dtype=np.int32)

    def scores(deterministic, mutable=False):
        def run(tokens):
            memory, out = init_memory(cfg, 2), []
            for seg in range(tokens.shape[1]):
                result = model.apply({'params': params}, tokens[:, seg], memory, targets=tokens[:, seg],
                                     deterministic=deterministic, mutable=['intermediates'] if mutable else False)
                (lm_out, memory) = result[0] if mutable else result
                out.append(lm_out.target_logprobs)
            return jnp.stack(out)
        return run

    evaluation, training, analysis = scores(True), scores(False), scores(True, mutable=True)
    programs = {name: _hlo(fn, tokens) for name, fn in
                (('evaluation', evaluation), ('training', training), ('analysis', analysis))}
    assert f'custom_call_target="{cpu.SPAN_ATTENTION_TARGET}"' in programs['evaluation']
    assert f'custom_call_target="{cpu.SOFTMAX_TARGET}"' not in programs['evaluation']
    for name in ('training', 'analysis'):
        assert f'custom_call_target="{cpu.SPAN_ATTENTION_TARGET}"' not in programs[name]
        assert f'custom_call_target="{cpu.SOFTMAX_TARGET}"' in programs[name]
    expected = jax.jit(training)(tokens)
    for fn in (evaluation, analysis):
        np.testing.assert_allclose(jax.jit(fn)(tokens), expected, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize('rows,dim,vocab,selected', [(50, 24, 37, 0.6), (300, 64, 300, 1.0), (7, 5, 1, 1.0),
                                                     (40, 16, 129, 0.0), (700, 8, 600, 0.3),
                                                     (20, 4, 9000, 0.5)])
def test_cluster_logprobs_and_gradient_are_the_log_softmax_at_the_index(rows, dim, vocab, selected):
    """Each selected row's log-softmax at its index against float64 numpy, and the gradient of a
    weighted sum of them against XLA's of the dense definition: vocabularies shorter and longer
    than the kernel's chunks of the table and a task's share of them, rows that fill groups only
    in part, widths beyond the register blocks, spread logits, none selected. The other rows are 0
    and get no gradient."""
    from memjax.model import adaptive  # pylint: disable=g-import-not-at-top
    x, table, bias, weight = _normal(10, (rows, dim), (vocab, dim), (vocab,), (rows,))
    x *= 3
    rng = np.random.default_rng(11)
    index, chosen = rng.integers(0, vocab, rows, dtype=np.int32), rng.random(rows) < selected
    reference = adaptive._dense_picked_logprobs  # pylint: disable=protected-access
    fn = lambda x, table, bias: cpu.cluster_logprobs(reference, x, table, bias, index, chosen)
    logits = np.asarray(x, np.float64) @ np.asarray(table, np.float64).T + np.asarray(bias, np.float64)
    top = logits.max(axis=1)
    expected = logits[np.arange(rows), np.asarray(index)] - top - np.log(np.exp(logits - top[:, None]).sum(axis=1))
    np.testing.assert_allclose(jax.jit(fn)(x, table, bias), np.where(chosen, expected, 0.0), rtol=1e-5, atol=1e-5)
    # d/dlogits of sum_n w_n logp_n: w_n (onehot - softmax) on the selected rows.
    probs = np.exp(logits - top[:, None])
    dlogits = -probs / probs.sum(axis=1, keepdims=True)
    dlogits[np.arange(rows), np.asarray(index)] += 1
    dlogits *= np.where(chosen, np.asarray(weight, np.float64), 0.0)[:, None]
    expected = (dlogits @ np.asarray(table, np.float64), dlogits.T @ np.asarray(x, np.float64), dlogits.sum(axis=0))
    loss = lambda f: lambda *a: jnp.sum(f(*a) * weight)
    for grads in (jax.jit(jax.grad(loss(fn), (0, 1, 2)))(x, table, bias),
                  jax.jit(jax.grad(loss(lambda *a: reference(*a, index, chosen)), (0, 1, 2)))(x, table, bias)):
        for g, e in zip(grads, expected):
            # float32 sums of up to 700 terms of logits spread over tens: XLA's own error is 3e-6 of the largest.
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(e).max()))
    assert f'custom_call_target="{cpu.CLUSTER_GRADIENT_TARGET}"' in _hlo(jax.grad(loss(fn), (0, 1, 2)), x, table, bias)


@needs_kernel
@pytest.mark.parametrize('overrides', [dict(cutoffs=(20, 45), div_val=2), dict(cutoffs=(30,), div_val=1, d_embed=24),
                                       dict()])
def test_evaluation_scores_targets_by_the_cluster_kernel_as_training_does(overrides):
    """Evaluation's log-probabilities (head and tail clusters by the kernel, no logits in memory)
    equal training's (XLA's logits, log-softmax, the sorted tail), with targets in every cluster;
    their gradient, for a caller that differentiates an evaluation, is training's. Evaluation runs
    the kernel for every cluster; training for the tail clusters only (the head's logits, which XLA
    keeps for the backward pass, cost less than computing them again)."""
    from memjax.model import ModelConfig, build_model, init_memory  # pylint: disable=g-import-not-at-top
    cfg = ModelConfig(vocab_size=60, d_model=32, n_layer=1, n_head=2, d_head=16, d_inner=48, dropout=0.0, mem_len=4,
                      **overrides)
    model, params = build_model(cfg), training_fixtures.perturbed_params(cfg, 0.3)
    tokens = np.random.default_rng(2).integers(0, 60, (3, 8), dtype=np.int32)

    def logprobs(deterministic):
        return lambda params: model.apply({'params': params}, tokens, init_memory(cfg, 3), targets=tokens,
                                          deterministic=deterministic)[0].target_logprobs

    evaluation, training = logprobs(True), logprobs(False)
    calls = lambda fn: _hlo(fn, params).count(f'custom_call_target="{cpu.CLUSTER_TARGET}"')
    clusters = len(cfg.cutoffs) + 1
    assert (calls(evaluation), calls(training)) == (clusters, clusters - 1)
    np.testing.assert_allclose(jax.jit(evaluation)(params), jax.jit(training)(params), rtol=1e-5, atol=1e-5)
    weight, = _normal(3, tokens.shape)
    grads = [jax.jit(jax.grad(lambda p, f=f: jnp.sum(f(p) * weight)))(params) for f in (evaluation, training)]
    for got, expected in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


# Last in the file: by the time it runs, the workers have compiled the other tests' programs into
# the run's compilation cache, and the child loads them (the kernel is found by name at run time).
@needs_kernel
@pytest.mark.skipif(platform.machine() != 'x86_64' or 'avx2' not in cpu._cpu_flags().split() or
                    os.environ.get(cpu.ARCH, 'native') != 'native',
                    reason='builds the AVX2 form of the kernel: needs an x86-64 CPU with AVX2 (and a native build here)')
@pytest.mark.skipif(cpu.vector_lanes() == 8,
                    reason='this CPU has no AVX-512: its native kernel is the AVX2 form, which the tests above ran')
def test_the_avx2_form_passes_these_tests(tmp_path):
    """An AVX-512 machine never runs the kernel's AVX2 form (8-float vectors, 6-row blocks), which
    AVX2-only machines do: this file's kernel tests, in a process whose kernel is built for
    x86-64-v3. The model-level tests (which path a model's step takes, its log-probabilities) call
    the same kernels at shapes the kernel tests cover, so the child leaves them out."""
    env = {**os.environ, cpu.ARCH: 'x86-64-v3', 'XDG_CACHE_HOME': str(tmp_path)}
    child = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', __file__,
                            '-k', ' and '.join(f'not {name}' for name in MODEL_LEVEL)],
                           env=env, capture_output=True, text=True, check=False)
    summary = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else child.stderr[-2000:]
    assert child.returncode == 0 and 'failed' not in summary, child.stdout[-4000:]
    # Every kernel test ran: the only skip is this one, in the child.
    assert summary.startswith(tuple(f'{n} passed, 1 skipped, 7 deselected' for n in range(10, 100))), summary
