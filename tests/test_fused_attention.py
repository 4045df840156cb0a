"""The fused relative attention (memjax/kernels/relative_attention.py) in Pallas's interpret mode:
forward and gradients against a naive attention written from Transformer-XL's score (every
query-key pair's distance looked up directly, no shift, no tiles), and the model with the fused
path forced on against the reference path for every memory kind."""

import contextlib
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax import errors
from memjax.kernels import fused_choice
from memjax.kernels import relative_attention as fused
from memjax.model import ModelConfig, build_model, init_memory, init_params, lm_loss
from memjax.model.positions import relative_sinusoid_table
import jaxprs

# The training loop and training_fixtures are imported in the tests that train: they import the
# data pipeline (grain, TFDS), which is not among the GPU machines' image's packages, and
# launch/accel_bench.sh runs this file's on-chip check there (tests/test_gpu_image.py).


def naive_attention(cq, pq, k, v, pos_key, valid, scale, window=0, rate=0.0, seed=0):
    """Query i (key index K - T + i) against key j at distance d = K - T + i - j, whose encoding is
    row K - 1 - d of `pos_key`; masked where d < 0, the key is invalid or (same_length) d >= window."""
    batch, t, heads, _ = cq.shape
    k_len = k.shape[1]
    i, j = np.arange(t)[:, None], np.arange(k_len)[None, :]
    distance = k_len - t + i - j
    rows = np.clip(k_len - 1 - distance, 0, k_len - 1)
    scores = jnp.einsum('bthd,bkhd->bhtk', cq, k) + jnp.einsum('bthd,tkhd->bhtk', pq, pos_key[rows])
    visible = (distance >= 0)[None, None] & valid[:, None, None, :]
    if window:
        visible &= (distance < window)[None, None]
    scores = jnp.where(visible, scores * scale, -jnp.inf)
    log_norm = jax.nn.logsumexp(scores, axis=-1)
    probs = jnp.exp(scores - log_norm[..., None])
    if rate:
        keep = fused.dropout_keep(seed, np.arange(batch)[:, None, None, None], np.arange(heads)[None, :, None, None],
                                  i[None, None], j[None, None], rate)
        probs = jnp.where(keep, probs / (1 - rate), 0.0)
    return jnp.einsum('bhtk,bkhd->bthd', probs, v), log_norm


def inputs(batch, t, mem, heads, dims, dtype=jnp.float32, clamp_len=-1, masked=3):
    """Drawn by NumPy: JAX would compile each draw for each case's shapes."""
    k_len = mem + t
    rng = np.random.default_rng(t * 1000 + mem * 10 + dims)
    normal = lambda *shape: rng.standard_normal(shape, np.float32)
    cq, pq = normal(batch, t, heads, dims), normal(batch, t, heads, dims)
    k, v = normal(batch, k_len, heads, dims), normal(batch, k_len, heads, dims)
    # Positional keys from the model's own clamped table, through a random map per head.
    table = np.asarray(relative_sinusoid_table(k_len, 32, clamp_len))
    pos_key = np.einsum('re,ehd->rhd', table, normal(32, heads, dims))
    valid = np.ones((batch, k_len), bool)
    valid[0, :min(masked, mem)] = False  # An unfilled memory's rows.
    return (*(jnp.asarray(x, dtype) for x in (cq, pq, k, v, pos_key)), jnp.asarray(valid))


def check(batch, t, mem, heads, dims, *, window=0, rate=0.0, skew='gather', clamp_len=-1, tiles=(16, 16),
          dtype=jnp.float32, tolerance=1e-5, interpret=True):
    cq, pq, k, v, pos_key, valid = inputs(batch, t, mem, heads, dims, dtype, clamp_len)
    scale = dims ** -0.5
    run = functools.partial(fused.span_attention, scale=scale, window=window, dropout_rate=rate,
                            dropout_seed=jnp.int32(11), block_q=tiles[0], block_k=tiles[1], skew=skew,
                            interpret=interpret)
    upcast = lambda xs: [x.astype(jnp.float32) for x in xs]
    reference = lambda *xs: naive_attention(*upcast(xs), valid, scale, window, rate, 11)
    # A loss that weighs every output and the log-normaliser (the memory kinds read it).
    rng = np.random.default_rng(5)
    weights, norm_weights = rng.standard_normal(cq.shape, np.float32), rng.standard_normal((batch, heads, t), np.float32)
    loss = lambda f: lambda *xs: ((f(*xs)[0].astype(jnp.float32) * weights).sum() + (f(*xs)[1] * norm_weights).sum())
    # The outputs and gradients in one program per attention: compiled op by op, they would cost
    # the test many times its arithmetic.
    outputs_and_gradients = lambda f: jax.jit(lambda *xs: (f(*xs), jax.grad(loss(f), argnums=range(5))(*xs)))
    (out, log_norm), got = outputs_and_gradients(lambda *xs: run(*xs, valid))(cq, pq, k, v, pos_key)
    (want_out, want_log_norm), want = outputs_and_gradients(reference)(cq, pq, k, v, pos_key)
    out, got = np.asarray(out, np.float32), [np.asarray(g, np.float32) for g in got]
    np.testing.assert_allclose(out, want_out, atol=tolerance, rtol=tolerance)
    np.testing.assert_allclose(log_norm, want_log_norm, atol=tolerance, rtol=tolerance)
    for name, g, w in zip(('content query', 'position query', 'key', 'value', 'distance rows'), got, jax.device_get(want)):
        np.testing.assert_allclose(g, w, atol=tolerance * float(np.abs(w).max()), rtol=tolerance, err_msg=name)


@pytest.mark.parametrize('skew', fused.SKEWS)
@pytest.mark.parametrize('t,mem', [(20, 13), (16, 40)])
def test_both_lowerings_forms_of_the_shift_match_the_naive_attention(skew, t, mem):
    """A memory shorter and longer than the segment; lengths no tile divides; a head dim of 41."""
    check(2, t, mem, 2, 41, skew=skew)


@pytest.mark.parametrize('t,mem,heads,dims', [(16, 16, 3, 64), (8, 24, 1, 128), (40, 0, 2, 8)])
def test_memory_equal_to_the_segment_wide_heads_and_no_memory(t, mem, heads, dims):
    check(2, t, mem, heads, dims)


@pytest.mark.parametrize('t,mem,tiles', [(24, 30, (32, 16)), (20, 13, (16, 64)), (1, 40, (16, 32))])
def test_unequal_tiles_and_a_single_query(t, mem, tiles):
    """A window of bq + bk - 1 rows rounded up to a power of two (wide heads take 64 x 32 tiles,
    short segments a smaller query tile); one query attending a long memory."""
    check(2, t, mem, 2, 8, tiles=tiles)


def test_same_length_and_clamped_distances():
    check(2, 16, 40, 2, 8, window=24, clamp_len=10)


def test_dropout_draws_one_mask_for_the_forward_and_the_backward_pass():
    """The gradients equal those of the naive attention with the same mask: the backward pass
    redraws exactly the forward's."""
    check(2, 12, 20, 2, 8, window=14, rate=0.3)


@pytest.mark.parametrize('skew', fused.SKEWS)
def test_the_distance_rows_gradient_sums_every_batch_row_each_with_its_dropout_mask(skew):
    """The table's gradient sums the batch: XLA's product over the scattered scores' gradient
    ('gather'), the kernel's per-row shares ('roll'); each row draws its own dropout mask."""
    check(4, 12, 20, 2, 8, rate=0.2, skew=skew)


def test_dropout_keeps_one_minus_rate_independently_per_batch_row_and_head():
    rate = 0.25
    i, j = np.arange(64)[:, None], np.arange(512)[None, :]
    masks = np.stack([np.asarray(fused.dropout_keep(3, b, h, i, j, rate)) for b in range(2) for h in range(2)])
    n = masks[0].size
    for mask in masks:  # Binomial count: 6 standard deviations.
        assert abs(mask.sum() - n * (1 - rate)) < 6 * np.sqrt(n * rate * (1 - rate))
    # Rows of different (batch, head) and different seeds agree only by chance: P = r^2 + (1-r)^2.
    chance = rate ** 2 + (1 - rate) ** 2
    other_seed = np.asarray(fused.dropout_keep(4, 0, 0, i, j, rate))
    for a, b in [(masks[0], masks[1]), (masks[0], masks[2]), (masks[0], other_seed)]:
        assert abs((a == b).mean() - chance) < 6 * np.sqrt(chance * (1 - chance) / n)


def test_bfloat16_within_bfloat16_tolerance():
    check(2, 16, 16, 2, 64, dtype=jnp.bfloat16, tolerance=3e-2)


_READS, _WRITES = {'get', 'load'}, {'swap', 'masked_swap', 'addupdate'}


def _ref_uses(jaxpr, refs: dict, uses: dict) -> None:
    """Adds to `uses` (kernel ref index -> {'read', 'write'}) how `jaxpr` uses the refs `refs` maps
    (its variables -> index), following them into loops, conditionals and calls."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _READS | _WRITES and eqn.invars and _ref(eqn.invars[0], refs):
            uses.setdefault(refs[eqn.invars[0]], set()).add('read' if name in _READS else 'write')
        inner_maps = []
        if name == 'while':
            c, b = eqn.params['cond_nconsts'], eqn.params['body_nconsts']
            inner_maps = [(eqn.params['body_jaxpr'].jaxpr, eqn.invars[c:]),
                          (eqn.params['cond_jaxpr'].jaxpr, eqn.invars[:c] + eqn.invars[c + b:])]
        elif name == 'cond':
            inner_maps = [(branch.jaxpr, eqn.invars[1:]) for branch in eqn.params['branches']]
        else:
            for value in eqn.params.values():
                inner = getattr(value, 'jaxpr', value)
                if hasattr(inner, 'eqns') and len(inner.invars) == len(eqn.invars):
                    inner_maps.append((inner, eqn.invars))
        for inner, outer in inner_maps:
            _ref_uses(inner, {i: refs[o] for i, o in zip(inner.invars, outer) if _ref(o, refs)}, uses)


def _ref(var, refs: dict) -> bool:
    return not hasattr(var, 'val') and var in refs  # Literals (constants) are not hashable.


def test_the_gpu_forms_kernels_read_back_nothing_they_write():
    """Triton's software pipelining issues a loop's loads ahead of the stores before them: a kernel
    that reads what it wrote (the former shift through a scratch block) reads it unwritten. Every
    ref each kernel of the 'gather' form (forward, both gradients, dropout and same_length on)
    writes, it never reads."""
    cq, pq, k, v, pos_key, valid = inputs(2, 20, 13, 2, 8)
    run = functools.partial(fused.span_attention, scale=0.3, window=16, dropout_rate=0.1, dropout_seed=jnp.int32(1),
                            block_q=16, block_k=16, skew='gather', interpret=True)
    jaxpr = jax.make_jaxpr(jax.grad(lambda *xs: run(*xs, valid)[0].sum(), argnums=range(5)))(cq, pq, k, v, pos_key)
    kernels = [eqn.params['jaxpr'] for eqn in jaxprs.equations(jaxpr.jaxpr) if eqn.primitive.name == 'pallas_call']
    assert len(kernels) == 3
    for kernel in kernels:
        uses = {}
        _ref_uses(kernel, {ref: i for i, ref in enumerate(kernel.invars)}, uses)
        written = [i for i, kinds in uses.items() if 'write' in kinds]
        assert written and not [i for i in written if 'read' in uses[i]], uses


def lowering_for(device_kind: str, platform: str, cores: int):
    """Lowering for a chip this machine lacks: jax 0.11 (the GPU machines' image has it) asks an
    abstract mesh's device which chip; jax 0.10 asks no chip for Triton, and the TPU test below
    names one through Pallas's TPU info."""
    if not hasattr(jax.sharding, 'AbstractDevice'):
        return contextlib.nullcontext()
    chip = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=cores, platform=platform)
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ('chip',), abstract_device=chip))


@pytest.mark.parametrize('t,mem,dims', [(384, 384, 41), (20, 13, 64), (128, 1600, 256)])
def test_the_triton_form_lowers_for_cuda_forward_and_backward(t, mem, dims):
    """Triton's rules (power-of-two blocks; gathers and scatters only as loads and stores at
    computed addresses) are checked where the kernel is lowered, which needs no GPU: a training step's attention at tgt = mem = 384 (bf16), a short
    segment (smaller query tiles) and heads of 256 (64 x 32 tiles) at the evaluation's memory."""
    cq = jax.ShapeDtypeStruct((3, t, 2, dims), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((3, t + mem, 2, dims), jnp.bfloat16)
    pos_key = jax.ShapeDtypeStruct((t + mem, 2, dims), jnp.bfloat16)
    valid = jax.ShapeDtypeStruct((3, t + mem), jnp.bool_)
    block_q, block_k = fused.tiles_for(dims)
    run = functools.partial(fused.span_attention, scale=0.125, window=500, dropout_rate=0.1,
                            dropout_seed=jnp.int32(1), skew='gather', block_q=block_q, block_k=block_k)
    loss = lambda *xs: run(*xs)[0].astype(jnp.float32).sum()
    step = jax.grad(loss, argnums=range(5))
    with lowering_for('NVIDIA H200', 'gpu', cores=132):
        exported = jax.export.export(jax.jit(step), platforms=['cuda'], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call('__gpu$xla.gpu.triton')])(cq, cq, k, k, pos_key, valid)
    text = exported.mlir_module()
    # One forward and two backward kernels, each a Triton call.
    assert text.count('__gpu$xla.gpu.triton') == 3


@pytest.mark.parametrize('t,mem,dims,window', [(384, 384, 64, 0), (100, 300, 41, 256)])
def test_the_tpu_form_lowers_to_mosaic_forward_and_backward(monkeypatch, t, mem, dims, window):
    """Pallas's TPU rules (block shapes tiled by 8 x 128 or whole, scalars in SMEM, no integer
    indexing of vectors) are checked where the kernel is lowered to Mosaic; lowering asks for the
    chip, which a CPU has not: a TPU v5e is named for it. Mosaic's compilation itself needs a TPU."""
    tpu_info = pytest.importorskip('jax._src.pallas.mosaic.tpu_info', reason='this jax has no Pallas TPU info')
    if not hasattr(tpu_info, 'get_device_kind'):
        pytest.skip('this jax asks the chip for Pallas TPU lowering otherwise: tpu_info.get_device_kind is gone')
    monkeypatch.setattr(tpu_info, 'get_device_kind', lambda: 'TPU v5e')
    monkeypatch.setattr(tpu_info, 'get_num_device_cores', lambda: 1)
    cq = jax.ShapeDtypeStruct((2, t, 4, dims), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, t + mem, 4, dims), jnp.bfloat16)
    pos_key = jax.ShapeDtypeStruct((t + mem, 4, dims), jnp.bfloat16)
    valid = jax.ShapeDtypeStruct((2, t + mem), jnp.bool_)
    run = functools.partial(fused.span_attention, scale=0.125, window=window, dropout_rate=0.1,
                            dropout_seed=jnp.int32(1), skew='roll', block_q=128, block_k=128)
    step = jax.grad(lambda *xs: run(*xs)[0].astype(jnp.float32).sum(), argnums=range(5))
    with lowering_for('TPU v5 lite', 'tpu', cores=1):
        text = jax.export.export(jax.jit(step), platforms=['tpu'])(cq, cq, k, k, pos_key, valid).mlir_module()
    assert text.count('tpu_custom_call') == 3


ON_A_GPU = pytest.mark.skipif(jax.default_backend() != 'gpu', reason=(
    'compiles the kernel with Triton: needs a GPU (run there: pytest tests/test_fused_attention.py -k on_a_gpu)'))


@ON_A_GPU
@pytest.mark.parametrize('t,mem,dims,window,clamp_len,rate,dtype,tolerance', [
    (128, 128, 64, 0, -1, 0.0, jnp.float32, 1e-5),  # Tiles that divide: the plain causal case.
    (100, 300, 41, 256, 90, 0.0, jnp.float32, 1e-5),  # same_length, clamp_len, tiles that do not divide.
    (100, 60, 41, 0, -1, 0.1, jnp.bfloat16, 3e-2),  # A memory shorter than the segment.
    (384, 384, 64, 500, 200, 0.1, jnp.bfloat16, 3e-2),  # A training step's shape, every option on.
    (384, 384, 128, 0, -1, 0.0, jnp.bfloat16, 3e-2),
    # Dropout, wide heads, last: float32 at the highest precision multiplies on CUDA cores, and
    # 64 x 128 float32 tiles of keys, values and their gradients are the most registers a
    # program asks for (the slowest compile, the one most likely to spill).
    (128, 256, 128, 0, -1, 0.2, jnp.float32, 1e-5)])
def test_on_a_gpu_the_compiled_kernel_matches_the_naive_attention(t, mem, dims, window, clamp_len, rate, dtype,
                                                                  tolerance):
    """What interpret mode cannot show: Triton's compilation, its software pipelining on (the
    kernels load P at shifted addresses and scatter its gradient, never reading back in a loop what
    they wrote). float32 at the highest matmul precision on both sides."""
    with jax.default_matmul_precision('highest'):
        check(2, t, mem, 2, dims, window=window, rate=rate, clamp_len=clamp_len, tiles=fused.tiles_for(dims),
              dtype=dtype, tolerance=tolerance, interpret=False)


# --- The model with the fused path forced on ---------------------------------------------------

TINY = dict(vocab_size=40, d_model=16, n_layer=1, n_head=2, d_head=8, d_inner=32, dropout=0.0, dropatt=0.0,
            segment_len=8)
KINDS = [dict(memory='none'), dict(memory='xl', mem_len=12), dict(memory='xl', mem_len=12, same_length=True, clamp_len=7),
         dict(memory='xl_cached', mem_len=12), dict(memory='lamemo', mem_len=12),
         dict(memory='infinity', mem_len=12, ltm_basis=8), dict(memory='trams', mem_len=12, trams_select=10, trams_remain=6)]


def segments_loss(cfg, params, tokens, deterministic=True, key=None):
    """Mean loss over the segments of 8 tokens, carrying the memory."""
    model = build_model(cfg)
    memory, losses = init_memory(cfg, tokens.shape[0]), []
    for n, start in enumerate(range(0, tokens.shape[1] - 1, 8)):
        rngs = None if key is None else {name: jax.random.fold_in(jax.random.fold_in(key, n), i)
                                         for i, name in enumerate(('dropout', 'cross_head', 'skip', 'sticky'))}
        out, memory = model.apply({'params': params}, tokens[:, start:start + 8], memory,
                                  targets=tokens[:, start + 1:start + 9], deterministic=deterministic, rngs=rngs)
        losses.append(lm_loss(out.target_logprobs))
    return jnp.mean(jnp.stack(losses))


TRAINING = [dict(memory='xl', mem_len=12, sch_beta=1.0), dict(memory='xl', mem_len=12, skip_rule='uniform', skip_p=0.5),
            dict(memory='infinity', mem_len=12, ltm_basis=8, ltm_sticky=True)]


@pytest.mark.parametrize('kind,training', [(k, False) for k in KINDS] + [(k, True) for k in TRAINING],
                         ids=lambda k: '-'.join(f'{v}' for v in k.values()) if isinstance(k, dict) else f'training={k}')
def test_every_kind_computes_the_same_loss_and_gradients_with_the_fused_path(kind, training):
    """In evaluation, and in training with the skeleton's random choices drawn from the same keys
    (cross-head permutations, skipped layers whose memory lags, sticky samples; dropout off)."""
    import training_fixtures  # pylint: disable=g-import-not-at-top  (the module's imports say why)
    reference = ModelConfig(**TINY, **kind, attention_impl='reference')
    forced = ModelConfig(**TINY, **kind, attention_impl='fused')
    params = training_fixtures.perturbed_params(reference)
    tokens = np.random.default_rng(2).integers(0, 40, (2, 17), dtype=np.int32)  # Two segments: the memory carried once.
    key = jax.random.key(3) if training else None
    loss_and_grads = lambda cfg: jax.jit(jax.value_and_grad(
        lambda p: segments_loss(cfg, p, tokens, deterministic=not training, key=key)))
    want, want_grads = loss_and_grads(reference)(params)
    got, grads = loss_and_grads(forced)(params)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(jax.device_get(grads)), jax.tree.leaves(jax.device_get(want_grads))):
        np.testing.assert_allclose(g, w, atol=1e-5 * max(1.0, float(np.abs(w).max())), rtol=1e-5)


def fused_calls(cfg, tokens):
    jaxpr = jax.make_jaxpr(lambda p: segments_loss(cfg, p, tokens))(init_params(cfg, jax.random.key(0)))
    return str(jaxpr).count('pallas_call')


def test_the_fused_path_runs_where_it_applies_and_the_config_can_refuse_it():
    """Every kind whose keys are one contiguous span takes the kernel (once per layer and segment);
    TRAMS's per-head selections keep XLA's path."""
    tokens = jnp.zeros((2, 17), jnp.int32)
    for kind in KINDS:
        calls = fused_calls(ModelConfig(**TINY, **kind, attention_impl='fused'), tokens)
        assert calls == (0 if kind['memory'] == 'trams' else 2), kind
    xl = dict(TINY, memory='xl', mem_len=12)
    assert fused_calls(ModelConfig(**xl, attention_impl='fused'), tokens) > 0
    assert fused_calls(ModelConfig(**xl, attention_impl='reference'), tokens) == 0
    assert fused_calls(ModelConfig(**xl, attention_impl='auto'), tokens) == 0  # A CPU: the reference.
    with pytest.raises(ValueError, match='attention_impl'):
        ModelConfig(**xl, attention_impl='flash')


def test_attention_dropout_in_training_varies_with_the_key_centres_on_the_clean_loss_and_has_gradients():
    """In training the fused path drops weights with its own mask: the loss averaged over dropout
    seeds approaches the loss without dropout, as the reference's does."""
    cfg = ModelConfig(**dict(TINY, dropatt=0.3), memory='xl', mem_len=12, attention_impl='fused')
    params = init_params(cfg, jax.random.key(0))
    tokens = np.random.default_rng(2).integers(0, 40, (2, 17), dtype=np.int32)
    loss = jax.jit(lambda key: segments_loss(cfg, params, tokens, deterministic=False, key=key))
    draws = np.array([loss(jax.random.key(n)) for n in range(12)])
    assert np.std(draws) > 0  # The masks differ between keys.
    clean = jax.jit(lambda: segments_loss(cfg, params, tokens))()
    assert abs(draws.mean() - clean) < 4 * draws.std() / np.sqrt(len(draws)) + 1e-3
    grads = jax.jit(jax.grad(lambda p: segments_loss(cfg, p, tokens, deterministic=False, key=jax.random.key(0))))(params)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


def test_a_kernel_that_does_not_compile_is_one_line_when_asked_for_and_xlas_attention_under_auto(
        monkeypatch, caplog, corpus, tmp_path):
    """Compiled for a chip instead of interpreted, the kernel does not lower on this CPU, as it would
    not on an untested chip: 'fused' is refused in one line naming the reason, from inside the
    training step's trace too, and 'auto' (where it would fuse) takes XLA's path with one warning."""
    import training_fixtures  # pylint: disable=g-import-not-at-top  (the module's imports say why)
    from memjax.training import loop as trainer  # pylint: disable=g-import-not-at-top
    assert fused_choice.compile_failure('gather', 16, 'float32') is not None
    assert fused_choice.compile_failure('gather', 16, 'float32', interpret=True) is None
    refusal = r"attention_impl='fused': the fused attention does not compile on this gpu for heads of 16 in float32 \(.+\); use"
    with pytest.raises(errors.ConfigError, match=refusal):
        fused_choice.path('fused', 16, jnp.float32, platform='gpu')
    monkeypatch.setattr(fused_choice, 'FUSED_BY_DEFAULT', ('gpu',))
    with caplog.at_level(logging.WARNING):
        assert [fused_choice.path('auto', 16, jnp.float32, platform='gpu') for _ in range(2)] == [None, None]
    warned = [r.getMessage() for r in caplog.records if 'does not compile' in r.getMessage()]
    assert len(warned) == 1 and '\n' not in warned[0] and "XLA's attention runs instead" in warned[0]
    monkeypatch.setattr(fused_choice, 'path', functools.partial(fused_choice.path, platform='gpu'))
    config = training_fixtures.tiny_config(corpus, model__attention_impl='fused', train__num_steps=2)
    with pytest.raises(errors.ConfigError, match="attention_impl='fused': the fused attention does not compile"):
        trainer.train_and_evaluate(config, str(tmp_path / 'run'))
