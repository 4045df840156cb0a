"""Skip-Retain training and Stochastic Cross-Head attention (memjax/model/stochastic.py): against plain
Transformer-XL, the paper's equations (1)-(6) and (8)-(10), naive computations, binomial bounds on
the random decisions, and exact resumes across the phase boundary."""

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax import config_lib
from memjax import model as model_lib
from memjax import analysis
from memjax.model import memories
from memjax.model import stochastic
from memjax.model.attention import AttentionContext, KeyBlock, RelativeAttention
from memjax.model.positions import relative_sinusoid_table
import training_fixtures

VOCAB, BATCH, SEG, MEM = 40, 2, 4, 6
XL = model_lib.ModelConfig(vocab_size=VOCAB, d_model=16, n_layer=3, n_head=4, d_head=4, d_inner=32, dropout=0.0,
                           mem_len=MEM)


@pytest.fixture(scope='module')
def params():
    return model_lib.init_params(XL, jax.random.key(0))


@pytest.fixture(scope='module')
def tokens():
    return np.random.default_rng(1).integers(0, VOCAB, (5, BATCH, SEG), dtype=np.int32)


def run(cfg, params, tokens, skips=None, training=True, key=0):
    """Target log-probs [segments, B, T], the last memory and what was sown, over a segment loop in
    training mode (dropout is 0; the switches' streams draw from `key`)."""
    model = model_lib.build_model(cfg)

    @jax.jit  # One program for the segments: op by op, every operation would compile for its shapes.
    def segment(params, x, y, memory, s, skip):
        rngs = {name: jax.random.fold_in(jax.random.key(key), 7 * s + i) for i, name in
                enumerate(('dropout',) + tuple(model.kind.streams))}
        return model.apply({'params': params}, x, memory, targets=y, deterministic=not training, rngs=rngs,
                           skip=skip, mutable=['intermediates'])

    memory, logprobs, sown = model_lib.init_memory(cfg, tokens.shape[1]), [], []
    for s in range(tokens.shape[0] - 1):
        (out, memory), variables = segment(params, tokens[s], tokens[s + 1], memory, s,
                                           None if skips is None else np.asarray(skips[s]))
        logprobs.append(out.target_logprobs)
        sown.append(variables.get('intermediates', {}))
    return np.stack(logprobs), memory, sown


# ----------------------------------------------------------------------------------------------
# Skip-Retain


def test_p_skip_zero_and_beta_zero_are_plain_transformer_xl_bit_for_bit(params, tokens):
    xl, xl_memory, _ = run(XL, params, tokens)
    off, off_memory, _ = run(XL.replace(skip_rule='uniform', skip_p=0.0, sch_beta=0.0), params, tokens)
    np.testing.assert_array_equal(off, xl)
    assert jax.tree.structure(off_memory) == jax.tree.structure(xl_memory)
    # The skipping machinery itself (per-layer validity and age, lagging blocks) with nothing
    # skipped: the same function.
    none_skipped, memory, _ = run(XL.replace(skip_rule='linear'), params, tokens, skips=[[False] * 3] * 4)
    np.testing.assert_allclose(none_skipped, xl, atol=2e-6, rtol=0)
    np.testing.assert_array_equal(memory.layers['age'], [0, 0, 0])


def test_a_skipped_layer_is_the_identity_and_its_memory_ages(params, tokens):
    cfg = XL.replace(skip_rule='linear')
    pattern = [[False] * 3, [False, True, False], [False, True, False], [False] * 3]
    _, before, _ = run(cfg, params, tokens[:2], skips=pattern[:1])
    _, after, _ = run(cfg, params, tokens[:4], skips=pattern[:3])
    np.testing.assert_array_equal(after.layers['age'], [0, 2 * SEG, 0])
    # Layer 1 kept what it held after the first segment; the others moved on.
    _, one_more, _ = run(cfg, params, tokens[:3], skips=pattern[:2])
    np.testing.assert_array_equal(one_more.layers['hidden'][1], before.layers['hidden'][1])
    np.testing.assert_array_equal(one_more.layers['valid'][1], before.layers['valid'][1])
    assert not np.array_equal(one_more.layers['hidden'][0], before.layers['hidden'][0])
    _, ran, _ = run(cfg, params, tokens, skips=pattern)
    np.testing.assert_array_equal(ran.layers['age'], [0, 0, 0])
    # A one-layer model with its layer skipped returns the embeddings.
    one = XL.replace(n_layer=1, skip_rule='uniform', skip_p=0.5)
    one_params = model_lib.init_params(one, jax.random.key(2))
    model = model_lib.build_model(one)
    out, memory = model.apply({'params': one_params}, tokens[0], model_lib.init_memory(one, BATCH),
                              skip=jnp.ones(1, bool))
    embedded = model.apply({'params': one_params}, tokens[0], method=lambda m, x: m.io.embed(x))
    np.testing.assert_allclose(out.hidden, embedded, atol=1e-6)
    np.testing.assert_array_equal(memory.layers['age'], [SEG])


def test_rows_from_before_a_skip_are_masked_once_the_layer_runs_again(params, tokens):
    """MEM = 6 > SEG = 4: when layer 1 runs after a skip, its memory keeps 2 rows from before the
    skipped segment, SEG positions further back than the rows the segment writes: one offset cannot
    place both, so those 2 are not attended (attending them at distance 0-lag was the bug)."""
    cfg = XL.replace(skip_rule='linear')
    _, memory, _ = run(cfg, params, tokens[:4], skips=[[False] * 3, [False, True, False], [False] * 3])
    np.testing.assert_array_equal(memory.layers['age'], [0, 0, 0])
    np.testing.assert_array_equal(memory.layers['valid'][1], [[False] * 2 + [True] * SEG] * BATCH)
    np.testing.assert_array_equal(memory.layers['valid'][0], [[True] * MEM] * BATCH)  # It never skipped.
    # Layer 1's queries of the next segment give those rows no weight; layer 0's attend all of its.
    _, _, sown = analysis.apply_sown(model_lib.build_model(cfg), params, tokens[3], memory)
    probs = np.asarray(analysis.per_layer(sown, 'attention')['probs'])  # [layer, B, H, T, MEM + SEG]
    assert (probs[1, ..., :2] == 0).all() and (probs[0, ..., :2] > 0).all()


@pytest.mark.parametrize('clamp_len', [-1, 18])  # 18: some of the aged distances 13-21 clamped.
def test_a_lagging_memory_is_scored_at_its_aged_distances(clamp_len):
    """A block `offset` positions behind the segment is scored as keys at explicit distances
    (M - j) + i + offset (the explicit path is checked per pair in test_model_relative)."""
    cfg = XL.replace(clamp_len=clamp_len)
    rng = np.random.default_rng(0)
    mem = jnp.asarray(rng.normal(size=(BATCH, MEM, cfg.d_model)), jnp.float32)
    h = jnp.asarray(rng.normal(size=(BATCH, SEG, cfg.d_model)), jnp.float32)
    valid = jnp.asarray(rng.random((BATCH, MEM)) < 0.8)[:, None, None, :]
    offset = 3 * SEG
    ctx = AttentionContext(relative_sinusoid_table(MEM + SEG + offset, cfg.d_model, clamp_len),
                           *[jnp.asarray(rng.normal(size=(cfg.n_head, cfg.d_head)), jnp.float32)] * 2)
    module = RelativeAttention(cfg)
    lagging = [KeyBlock(mem, valid, offset=jnp.int32(offset))]
    variables = module.init(jax.random.key(0), h, lagging, ctx, ctx.u_bias, ctx.v_bias, True)
    distances = (MEM - np.arange(MEM))[None, :] + np.arange(SEG)[:, None] + offset
    explicit = [KeyBlock(mem, valid, jnp.asarray(distances, jnp.int32)[None, None])]
    got = module.apply(variables, h, lagging, ctx, ctx.u_bias, ctx.v_bias, True)[0]
    want = module.apply(variables, h, explicit, ctx, ctx.u_bias, ctx.v_bias, True)[0]
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-6)


def test_skip_rules_are_the_papers_equations():
    n = 15
    i = np.arange(1, n + 1)  # The paper's 1-based layers.
    p = 0.1
    want = {
        'linear': np.where(i != n, 0.5 * (i - 1) / n, 0.0),  # eq. (1)
        'uniform': np.full(n, p),  # eq. (2)
        'keep_first': np.where(i == 1, 0.0, p),  # eq. (3)
        'keep_last': np.where(i == n, 0.0, p),  # eq. (4)
        'keep_ends': np.where((i == 1) | (i == n), 0.0, p),  # eq. (5)
    }
    assert set(want) == set(stochastic.SKIP_RULES)
    for rule, probs in want.items():
        np.testing.assert_allclose(stochastic.skip_probabilities(rule, n, p), probs)


@pytest.mark.parametrize('rule', ['linear', 'keep_ends'])
def test_skip_frequencies_match_p_skip_within_a_binomial_bound(rule):
    cfg = XL.replace(n_layer=8, skip_rule=rule, skip_p=0.3)
    kind = memories.get(cfg)
    steps = 4000
    draws = np.asarray(jax.vmap(lambda k: kind.skip_layers(k, 0))(jax.random.split(jax.random.key(5), steps)))
    probs = stochastic.skip_probabilities(rule, 8, 0.3)
    bound = 4 * np.sqrt(probs * (1 - probs) / steps) + 1e-12
    assert np.all(np.abs(draws.mean(0) - probs) <= bound), (draws.mean(0), probs)
    assert kind.skip_layers(jax.random.key(0), 1) is None  # Phase 2 never skips.


def test_eq6_expected_context_is_reproduced_by_simulation():
    """E[m~] = sum_l p_skip(l) 2M (eq. 6, ~ M (N - 3) / 2), from skips drawn as training draws them
    and the context a step's layers then hold: 2M for a skipped layer (it kept the previous
    segment's memory; M = L), counted per layer as the paper does."""
    n, m, steps = 15, 512, 20000
    probs = stochastic.skip_probabilities('linear', n, 0.0)
    skipped = np.asarray(jax.vmap(lambda k: stochastic.draw_skips(k, probs))(
        jax.random.split(jax.random.key(6), steps)))
    simulated = (skipped * 2 * m).sum(1)
    exact = stochastic.expected_context(probs, m)
    assert exact == pytest.approx(m * (n - 1) * (n - 2) / (2 * n))
    assert exact == pytest.approx(m * (n - 3) / 2, abs=m / n + 1e-9)  # The paper's approximation.
    assert abs(simulated.mean() - exact) <= 4 * simulated.std() / math.sqrt(steps)


def test_cross_head_is_refused_where_a_head_reads_keys_it_does_not_permute():
    """LaMemo's look-ahead scores the permuted keys with its own, unpermuted positional keys, and the
    infinity-former's long-term memory has keys and values of its own: refused in one line, as is a
    single head, which has no other to read."""
    for memory in ('lamemo', 'infinity'):
        with pytest.raises(ValueError, match=rf"Cross-Head attention is built for memory 'xl' and 'none' .*not "
                                             rf"memory='{memory}'"):
            XL.replace(memory=memory, sch_beta=0.1)
    with pytest.raises(ValueError, match='sch_beta=0.1 with n_head=1: one head has no other to read; set sch_beta=0'):
        XL.replace(sch_beta=0.1, n_head=1)
    XL.replace(memory='none', mem_len=0, sch_beta=0.1)


def test_skip_retain_is_refused_where_it_is_not_built():
    with pytest.raises(ValueError, match="Skip-Retain is built for memory 'xl' and 'none'"):
        XL.replace(memory='lamemo', skip_rule='linear')
    with pytest.raises(ValueError, match="skip_rule='eq1' must be 'none' or one of"):
        XL.replace(skip_rule='eq1')
    XL.replace(memory='none', mem_len=0, skip_rule='linear')  # Skipping without a memory to age.


def test_evaluation_never_skips_nor_permutes(params, tokens, tmp_path):
    cfg = XL.replace(skip_rule='uniform', skip_p=0.9, sch_beta=1.0)
    evaluated, _, sown = run(cfg, params, tokens, training=False)
    plain, _, _ = run(XL, params, tokens, training=False)
    np.testing.assert_allclose(evaluated, plain, atol=2e-6, rtol=0)  # Nine skips in ten would show.
    for sown_step in sown:  # No permutation drawn.
        with pytest.raises(ValueError, match="no layer sowed 'cross_head'"):
            analysis.per_layer(sown_step, 'cross_head')
    corpus = training_fixtures.write_text_corpus(str(tmp_path))
    config = training_fixtures.tiny_config(corpus, model__skip_rule='linear', model__sch_beta=0.1)
    eval_mcfg = config_lib.resolve(config).eval_model
    assert (eval_mcfg.skip_rule, eval_mcfg.sch_beta) == ('none', 0.0)


def test_both_phases_resume_exactly_across_the_boundary(tmp_path, caplog):
    """Phase 1 until step 4 of 8 (the resume is at step 4: the first step of phase 2) with dropout
    and cross-head attention on: every random stream is part of what must resume. Each run says
    before each phase's first update that it compiles (the switch is not silent)."""
    corpus = training_fixtures.write_text_corpus(str(tmp_path / 'corpus'))
    config = training_fixtures.tiny_config(corpus, train__num_steps=8, model__n_layer=3, model__skip_rule='uniform',
                                           model__skip_p=0.5, model__skip_until=4, model__sch_beta=0.5)
    with caplog.at_level(logging.INFO):
        training_fixtures.assert_resumes_exactly(config, tmp_path / 'runs')
    compiles = [r.getMessage() for r in caplog.records if 'compiling its training step' in r.getMessage()
                or r.getMessage().startswith('Compiling the training step')]
    # The whole run, the run stopped at step 4's checkpoint, the run resumed there (in phase 2).
    assert [m.split(':')[0] for m in compiles] == [
        'Compiling the training step of phase 1', 'Step 4 starts training phase 2 (config.model.skip_until',
        'Compiling the training step of phase 1', 'Compiling the training step of phase 2'], compiles


# ----------------------------------------------------------------------------------------------
# Stochastic Cross-Head attention


def permuted_params(params, perms):
    """Each layer's key, value and positional kernels with their heads reordered by its
    permutation: plain attention with these is attention where head h reads head perm[h]."""
    params = jax.tree.map(lambda x: x, params)
    for layer, perm in perms.items():
        attention = dict(params[layer]['attention'])
        for name in ('key', 'value', 'pos'):
            attention[name] = {'kernel': attention[name]['kernel'][:, perm]}
        params[layer] = dict(params[layer], attention=attention)
    return params


def test_beta_one_is_attention_with_every_layers_heads_permuted(tokens):
    # Larger weights than the 0.02 initialisation, so that each score term shows in the output.
    params = model_lib.init_params(XL.replace(init_std=0.3), jax.random.key(4))
    cfg = XL.replace(sch_beta=1.0)
    got, _, sown = run(cfg, params, tokens[:2], key=3)
    perms = {f'layer_{i}': np.asarray(sown[0][f'layer_{i}']['attention']['cross_head'][0]) for i in range(3)}
    assert all(sorted(p) == list(range(XL.n_head)) for p in perms.values())
    assert len({tuple(p) for p in perms.values()}) > 1  # Each layer draws its own.
    want, _, _ = run(XL, permuted_params(params, perms), tokens[:2])
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-6)
    beta_zero, _, _ = run(XL.replace(sch_beta=0.0), params, tokens)
    np.testing.assert_array_equal(beta_zero, run(XL, params, tokens)[0])


def test_cross_head_frequency_matches_beta_within_a_binomial_bound():
    steps, beta = 4000, 0.1
    applied, perms = jax.vmap(lambda k: stochastic.cross_head_permutation(k, beta, 8))(
        jax.random.split(jax.random.key(9), steps))
    applied, perms = np.asarray(applied), np.asarray(perms)
    assert abs(applied.mean() - beta) <= 4 * math.sqrt(beta * (1 - beta) / steps)
    np.testing.assert_array_equal(perms[~applied], np.broadcast_to(np.arange(8), perms[~applied].shape))
    assert all(sorted(p) == list(range(8)) for p in perms[applied])
    assert (perms[applied] != np.arange(8)).any(axis=1).mean() > 0.99  # Really permuted.


def test_cross_head_is_one_permutation_per_step_in_every_accumulation_chunk(tmp_path):
    """The stream is shared between chunks: with accumulation the update equals the one-chunk update."""
    corpus = training_fixtures.write_text_corpus(str(tmp_path))
    from memjax.training import experiment  # pylint: disable=import-outside-toplevel
    exp = experiment.setup(training_fixtures.tiny_config(corpus, model__sch_beta=1.0, model__dropout=0.0),
                        str(tmp_path / 'w'))
    state, memory = experiment.init_state(exp)
    batch = training_fixtures.random_batch(exp, seed=4)
    model = model_lib.build_model(exp.mcfg)
    one = training_fixtures.jit_train_step(model, exp, 1)(state, memory, batch)
    two = training_fixtures.jit_train_step(model, exp, 2)(state, memory, batch)
    np.testing.assert_allclose(two[2]['nll_sum'], one[2]['nll_sum'], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(one[0].params), jax.tree.leaves(two[0].params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_phase_two_may_start_from_a_phase_one_workdir_but_a_resume_keeps_the_switches(tmp_path):
    """train.init_from (and evaluation) take a phase-1 run's parameters with the switches off;
    resuming the same workdir with them changed is refused (its memory holds the layers' ages)."""
    from memjax.training import resume  # pylint: disable=import-outside-toplevel
    corpus = training_fixtures.write_text_corpus(str(tmp_path))
    phase1 = training_fixtures.tiny_config(corpus, model__skip_rule='linear', model__sch_beta=0.1)
    phase2 = training_fixtures.tiny_config(corpus)
    saved = resume.to_plain(phase1)
    resume.check_same_params(saved, phase2, 'runs/phase1', 'config.train.init_from')
    with pytest.raises(config_lib.ConfigError, match="model.skip_rule 'linear' -> 'none'"):
        resume.check_resume(saved, phase2, 'runs/phase1', 'its newest checkpoint')
    with pytest.raises(config_lib.ConfigError, match='model.d_model 32 -> 48'):
        resume.check_same_params(saved, training_fixtures.tiny_config(corpus, model__d_model=48), 'runs/phase1',
                                 'config.train.init_from')
