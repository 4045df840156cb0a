"""XL evaluation's key-value pool (memory='xl_cached'): equal to re-projecting XL's memory, chosen by
evaluation for 'xl' parameters. TRAMS (memory='trams'), which selects from that pool: against Transformer-XL, a naive numpy selection of both metrics read off
the paper's and the released code's formulas, per-head attention over each head's own rows at naive
distances, causality, and an XL workdir evaluated with --config.eval.model.memory=trams."""

import itertools
import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from memjax import config_lib
from memjax import errors
from memjax import evaluate
from memjax import sweep
from memjax import model as model_lib
from memjax.model.attention import Attended, AttentionContext, KeyBlock, RelativeAttention
from memjax.model import memories
from memjax.model.memories import trams
from memjax.model.positions import relative_sinusoid_table
from memjax.training import checkpoints as checkpointing
from memjax.training import loop as trainer
from memjax.training import experiment
from memjax.training import run_files
import training_fixtures

VOCAB, BATCH, SEG, SEGMENTS = 40, 2, 4, 6
XL = model_lib.ModelConfig(vocab_size=VOCAB, d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32,
                           dropout=0.0, mem_len=12)
TRAMS = XL.replace(memory='trams', trams_select=6, trams_remain=2)


@pytest.fixture(scope='module')
def params():
    return model_lib.init_params(XL, jax.random.key(0))


@pytest.fixture(scope='module')
def tokens():
    return np.random.default_rng(1).integers(0, VOCAB, (SEGMENTS, BATCH, SEG), dtype=np.int32)


def run(cfg, params, tokens, collect=False, targets=None, resets=None):
    """[segments, B, T] target log-probs of a segment loop carrying the memory (and, with `collect`,
    the sown selections per segment); segment s predicts segment s + 1 of `targets` (`tokens`)."""
    targets = tokens if targets is None else targets
    model = model_lib.build_model(cfg)

    @jax.jit
    def step(x, y, memory, reset):
        (out, memory), sown = model.apply({'params': params}, x, memory, targets=y, reset=reset,
                                          mutable=['intermediates'])
        return out.target_logprobs, memory, sown

    memory = model_lib.init_memory(cfg, tokens.shape[1])
    logprobs, selected = [], []
    for s in range(tokens.shape[0] - 1):
        reset = None if resets is None else resets[s]
        lp, memory, sown = step(tokens[s], targets[s + 1], memory, reset)
        logprobs.append(lp)
        selected.append(sown.get('intermediates', {}))
    return (np.stack(logprobs), selected) if collect else np.stack(logprobs)


@pytest.mark.parametrize('model', [dict(), dict(memory_start='zeros'), dict(same_length=True, clamp_len=5),
                                   dict(scan_layers=True), dict(mem_len=3), dict(mem_len=0),
                                   # Biased maps after a LayerNorm: a zero row's key is not zero.
                                   dict(block='gpt2', pre_lnorm=True, memory_start='zeros')])
def test_the_pool_scores_as_xl_reprojecting_its_memory(model):
    """Keys and values kept as projected give XL's log-probs, whatever the memory length (shorter
    than a segment, none), the start, the window, the layer layout, the block; rows reset by a new
    document start afresh in both."""
    xl = XL.replace(**model)
    params = model_lib.init_params(xl, jax.random.key(3))
    tokens = np.random.default_rng(4).integers(0, VOCAB, (SEGMENTS, BATCH, SEG), dtype=np.int32)
    resets = np.zeros((SEGMENTS, BATCH), bool)
    resets[3, 0] = True
    np.testing.assert_allclose(run(xl.replace(memory='xl_cached'), params, tokens, resets=resets),
                               run(xl, params, tokens, resets=resets), atol=1e-6, rtol=0)


def test_evaluation_runs_the_pool_for_xl_parameters_unless_told_otherwise():
    assert memories.evaluation_config(XL, {}).memory == 'xl_cached'
    assert memories.evaluation_config(XL, {'memory': 'xl'}).memory == 'xl'
    assert memories.evaluation_config(XL, {'mem_len': 20}).replace(memory='xl') == XL.replace(mem_len=20)
    infinity = XL.replace(memory='infinity', mem_len=0, segment_len=SEG)  # A subclass of 'xl' keeps its own.
    assert memories.evaluation_config(infinity, {}).memory == 'infinity'


@pytest.mark.parametrize('run_time', [dict(), dict(memory_start='zeros'), dict(same_length=True, clamp_len=5),
                                      dict(scan_layers=True)])
@pytest.mark.parametrize('positions', trams.POSITIONS)
def test_selecting_the_whole_pool_is_transformer_xl(params, tokens, run_time, positions):
    layout = lambda p: model_lib.convert_layer_layout(p, run_time.get('scan_layers', False))
    xl = run(XL.replace(**run_time), layout(params), tokens)
    whole = TRAMS.replace(trams_select=XL.mem_len, trams_positions=positions, **run_time)
    np.testing.assert_allclose(run(whole, layout(params), tokens), xl, atol=1e-6, rtol=0)


def test_keeping_only_the_newest_is_transformer_xl_with_that_memory(params, tokens):
    """remain = select: nothing is ranked, the newest `select` rows are read."""
    xl = run(XL.replace(mem_len=TRAMS.trams_select), params, tokens)
    newest = run(TRAMS.replace(trams_remain=TRAMS.trams_select), params, tokens)
    np.testing.assert_allclose(newest, xl, atol=1e-6, rtol=0)


def test_layers_left_out_of_trams_layers_read_the_newest_rows(params, tokens):
    every = run(TRAMS, params, tokens)
    np.testing.assert_array_equal(run(TRAMS.replace(trams_layers=(0, 1)), params, tokens), every)
    _, sown = run(TRAMS.replace(trams_layers=(1,)), params, tokens, collect=True)
    picks, candidates = TRAMS.trams_select - TRAMS.trams_remain, TRAMS.mem_len - TRAMS.trams_remain
    newest = np.arange(candidates - picks, candidates)
    full = TRAMS.mem_len // SEG  # Segments before the pool is full (emptier pools pick empty rows too).
    chosen = [[np.asarray(s[f'layer_{i}']['memory']['selected'][0]) for s in sown[full:]] for i in range(2)]
    assert all((c == newest).all() for c in chosen[0])
    assert any((c != newest).any() for c in chosen[1])


def naive_metric(rows, w_key, w_query, metric):
    """[N, d_model] layer inputs -> [N, H]: K' = x W_K W_Q^T per head, and the paper's
    cos(K', 1) ||K'|| or the released code's ||K'|| |sum K'| as written."""
    d_model, heads, _ = w_query.shape
    out = np.zeros((rows.shape[0], heads))
    for n in range(rows.shape[0]):
        for h in range(heads):
            k_prime = (rows[n] @ w_key[:, h, :]) @ w_query[:, h, :].T  # [d_model]
            norm = np.linalg.norm(k_prime)
            if metric == 'paper':
                out[n, h] = (k_prime @ np.ones(d_model)) / (norm * np.sqrt(d_model)) * norm
            else:
                out[n, h] = norm * abs(k_prime.sum())
    return out


def naive_selection(score, valid, remain, picks):
    """[N, H] scores of one batch row -> [H, picks] pool indices: the best valid candidates (all but
    the newest `remain`), in time order."""
    candidates = score.shape[0] - remain
    chosen = []
    for h in range(score.shape[1]):
        order = sorted((n for n in range(candidates) if valid[n]), key=lambda n: -score[n, h])
        order += [n for n in range(candidates) if not valid[n]]  # Masked anyway; fill the count.
        chosen.append(sorted(order[:picks]))
    return np.array(chosen)


class _Layer(nn.Module):
    """One layer's attention returning its per-head output before the output map; its key blocks
    are TRAMS's over the layer inputs `pool`, or `blocks` when given."""
    cfg: model_lib.ModelConfig

    def setup(self):
        cfg = self.cfg
        self.memory = trams.TramsLayerMemory(cfg)
        self.attention = RelativeAttention(cfg)
        self.u = self.param('u', nn.initializers.normal(0.5), (cfg.n_head, cfg.d_head))
        self.v = self.param('v', nn.initializers.normal(0.5), (cfg.n_head, cfg.d_head))

    def __call__(self, h, pool, valid, ctx, blocks=None):
        def trams_blocks(maps):
            keys, values = maps.key(pool), maps.value(pool)
            state = {'keys': keys, 'values': values,
                     'rank': trams.key_metric(keys, maps.query_kernel, self.cfg.trams_metric)}
            return self.memory.blocks(state, {'valid': valid, 'fresh': jnp.zeros(valid.shape, bool)}, h, maps)

        return self.attention(h, blocks or trams_blocks, ctx, self.u, self.v, True,
                              attend=lambda view: Attended(notes=view.attended))[1]


@pytest.mark.parametrize('metric', trams.METRICS)
@pytest.mark.parametrize('positions', trams.POSITIONS)
def test_each_head_attends_its_naive_selection_at_naive_distances(metric, positions):
    """TRAMS's per-head gathered attention = for each head, plain attention over the rows a numpy
    ranking picked for it (the released code's placement: contiguous before the kept window; the
    true one: distance pool - p + i), read off that head's output before the output map."""
    cfg = XL.replace(memory='trams', trams_select=5, trams_remain=2, trams_metric=metric,
                     trams_positions=positions, mem_len=10)
    pool_len, seg = cfg.mem_len, 3
    rng = np.random.default_rng(0)
    pool = rng.normal(size=(BATCH, pool_len, cfg.d_model)).astype(np.float32)
    h = rng.normal(size=(BATCH, seg, cfg.d_model)).astype(np.float32)
    valid = np.ones((BATCH, pool_len), bool)
    valid[1, :4] = False  # A stream whose pool is not yet full: its empty rows are never chosen.
    rows = pool_len + seg
    ctx = AttentionContext(relative_sinusoid_table(rows, cfg.d_model, -1), None, None, window=cfg.trams_select)
    layer = _Layer(cfg)
    variables = jax.jit(lambda *x: layer.init(jax.random.key(3), *x, ctx))(h, pool, valid)
    got = np.asarray(jax.jit(lambda *x: layer.apply(variables, *x, ctx))(h, pool, valid))  # [B, T, H, Dh]
    # The naive side: one head's plain attention over given key blocks (one program per block layout).
    over = jax.jit(lambda h, blocks: layer.apply(variables, h, None, None, ctx, blocks=blocks))
    kernels = variables['params']['attention']
    w_key, w_query = (np.asarray(nn.meta.unbox(kernels[n]['kernel'])) for n in ('key', 'query'))
    picks, remain = cfg.trams_select - cfg.trams_remain, cfg.trams_remain
    for b in range(BATCH):
        chosen = naive_selection(naive_metric(np.asarray(pool[b]), w_key, w_query, metric), valid[b], remain, picks)
        for head in range(cfg.n_head):
            index = np.concatenate([chosen[head], np.arange(pool_len - remain, pool_len)])
            if positions == 'contiguous':
                block = KeyBlock(pool[b:b + 1, index], valid[b:b + 1, index][:, None, None, :])
            else:
                distances = pool_len - index[None, :] + np.arange(seg)[:, None]
                block = KeyBlock(pool[b:b + 1, index], valid[b:b + 1, index][:, None, None, :],
                                 distances.astype(np.int32)[None, None])
            want = over(h[b:b + 1], [block])
            np.testing.assert_allclose(got[b, :, head], np.asarray(want)[0, :, head], atol=2e-5, rtol=1e-5)
        if positions == 'true':  # The cheaper path is masked attention over the whole pool, per head.
            mask = np.zeros((1, cfg.n_head, 1, pool_len), bool)
            for head in range(cfg.n_head):
                mask[0, head, 0, chosen[head]] = True
            mask[..., pool_len - remain:] = True
            masked = over(h[b:b + 1], [KeyBlock(pool[b:b + 1], mask & valid[b][None, None, None])])
            np.testing.assert_allclose(got[b], np.asarray(masked)[0], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize('metric', trams.METRICS)
def test_selection_and_its_order_equal_a_naive_ranking(metric):
    rng = np.random.default_rng(1)
    d_model, heads, d_head, pool, remain, picks = 12, 3, 4, 9, 2, 4
    rows = rng.normal(size=(BATCH, pool, d_model))
    w_key, w_query = rng.normal(size=(2, d_model, heads, d_head))
    valid = np.ones((BATCH, pool), bool)
    valid[0, :3] = False
    keys = jnp.einsum('bnd,dhk->bnhk', rows, w_key)
    rank = trams.key_metric(keys, jnp.asarray(w_query), metric)
    np.testing.assert_allclose(rank, np.stack([naive_metric(r, w_key, w_query, metric) for r in rows]), rtol=1e-4,
                               atol=1e-4)
    got = np.asarray(trams.select(rank[:, :pool - remain], jnp.asarray(valid[:, :pool - remain]), picks))
    for b in range(BATCH):
        want = naive_selection(naive_metric(rows[b], w_key, w_query, metric), valid[b], remain, picks)
        np.testing.assert_array_equal(got[b], want)


def test_no_future_position_is_ever_read(params, tokens):
    """An input token changed at segment s, position t leaves every earlier prediction as it was."""
    base = run(TRAMS, params, tokens)
    for s, t in ((1, 2), (3, 0)):
        changed = tokens.copy()
        changed[s, :, t] = (changed[s, :, t] + 1) % VOCAB
        out = run(TRAMS, params, changed, targets=tokens)
        np.testing.assert_array_equal(out[:s], base[:s])
        np.testing.assert_array_equal(out[s, :, :t], base[s, :, :t])
        assert not np.allclose(out[s, :, t:], base[s, :, t:])


def test_an_empty_pool_reads_nothing(params, tokens):
    first = run(TRAMS, params, tokens[:2])[0]
    np.testing.assert_allclose(first, run(XL.replace(mem_len=0, memory='none'), params, tokens[:2])[0],
                               atol=1e-6, rtol=0)


@pytest.fixture(scope='module')
def xl_workdir(tmp_path_factory):
    corpus = training_fixtures.write_text_corpus(str(tmp_path_factory.mktemp('corpus')))
    workdir = str(tmp_path_factory.mktemp('xl'))
    config = training_fixtures.tiny_config(corpus, train__num_steps=2, train__eval_every=0)
    trainer.train_and_evaluate(config, workdir)
    return corpus, workdir


def restored_params(exp, workdir):
    ckpt = checkpointing.Checkpointer(run_files.checkpoint_dir(workdir), keep=1, read_only=True)
    try:
        step = max(ckpt.all_steps())
        return ckpt.restore_part(step, {'state': {'params': experiment.abstract_state(exp)[0].params}})['state']['params']
    finally:
        ckpt.close()


def naive_longest_distance(mem_len, seg, select, remain, same_length, true_positions):
    """The longest query-key distance over every choice of ranked rows, from the keys' slots: the
    selection (pool rows p in time order, the newest `remain` always among them), then the segment.
    A key's distance is mem_len - p + i at its true position, select - slot + i contiguously; causal;
    with same_length query i sees only the `select` slots ending at its own."""
    longest = 0
    for ranked in itertools.combinations(range(mem_len - remain), select - remain):
        rows = list(ranked) + list(range(mem_len - remain, mem_len))
        for i in range(seg):
            for slot in range(select + i + 1):
                if same_length and slot <= i:
                    continue
                if slot < select:
                    longest = max(longest, (mem_len - rows[slot] if true_positions else select - slot) + i)
                else:
                    longest = max(longest, i - (slot - select))
    return longest


@pytest.mark.parametrize('select, remain', [(5, 2), (4, 4), (5, 0), (1, 0)])
@pytest.mark.parametrize('same_length', [False, True])
@pytest.mark.parametrize('positions', ['true', 'contiguous'])
def test_the_longest_distance_is_the_longest_any_selection_scores(select, remain, same_length, positions):
    """What the unseen-distance warning and clamp_len=-2 read: the longest distance the attention can
    score, over every selection (same_length included, which keeps the oldest rows in reach)."""
    mem_len, seg = 10, 3
    cfg = TRAMS.replace(mem_len=mem_len, trams_select=select, trams_remain=remain, same_length=same_length,
                        trams_positions=positions)
    assert trams.TramsMemory(cfg).longest_distance(seg) == naive_longest_distance(
        mem_len, seg, select, remain, same_length, positions == 'true')


def test_an_xl_workdir_evaluated_with_trams(xl_workdir):
    """memjax.evaluate on an XL checkpoint with --config.eval.model.memory=trams scores the split as
    a hand-carried TRAMS loop does; selecting the whole pool scores as XL does, and XL's evaluation
    (its key-value pool unless told 'xl') as XL re-projecting its memory."""
    corpus, workdir = xl_workdir
    pool = dict(eval__batch_size=1, eval__model__mem_len=16)
    config = training_fixtures.tiny_config(corpus, eval__model__memory='trams', eval__model__trams_select=6,
                                           eval__model__trams_remain=2, **pool)
    summary = evaluate.evaluate_checkpoint(config, workdir)
    assert summary['settings']['memory'] == 'trams' and summary['settings']['trams_select'] == 6
    exp = experiment.setup(config, workdir, training=False)
    mcfg, params = exp.eval_mcfg, restored_params(exp, workdir)
    model = model_lib.build_model(mcfg)
    apply = jax.jit(lambda x, m, y: model.apply({'params': params}, x, m, targets=y))
    with open(f'{corpus}/valid.txt', 'rb') as f:
        text = np.frombuffer(f.read(), np.uint8).astype(np.int32)
    memory, total, seg = model_lib.init_memory(mcfg, 1), 0.0, config.train.tgt_len
    for start in range(0, len(text) - 1, seg):
        targets = text[start + 1:start + 1 + seg]
        out, memory = apply(text[None, start:start + len(targets)], memory, targets[None])
        total -= float(np.sum(np.asarray(out.target_logprobs, np.float64)))
    assert summary['num_tokens'] == len(text) - 1
    assert summary['loss'] == pytest.approx(total / (len(text) - 1), rel=1e-5)
    whole = evaluate.evaluate_checkpoint(training_fixtures.tiny_config(
        corpus, eval__model__memory='trams', eval__model__trams_select=16, eval__model__trams_remain=2, **pool),
        workdir)
    xl = evaluate.evaluate_checkpoint(training_fixtures.tiny_config(corpus, **pool), workdir)
    reprojected = evaluate.evaluate_checkpoint(training_fixtures.tiny_config(corpus, eval__model__memory='xl', **pool),
                                               workdir)
    assert (xl['settings']['memory'], reprojected['settings']['memory']) == ('xl_cached', 'xl')
    assert xl['loss'] == pytest.approx(reprojected['loss'], rel=1e-6)
    assert whole['loss'] == pytest.approx(xl['loss'], rel=1e-6)
    assert summary['loss'] != pytest.approx(xl['loss'], rel=1e-6)


@pytest.mark.parametrize('fields,message', [
    (dict(model__memory='trams'), "is training-free: set config.model.memory to the kind that was trained ('xl')"),
    (dict(eval__model__trams_select=4), "fields of memory='trams': add --config.eval.model.memory=trams"),
    (dict(eval__model__trams_select=4), "cannot differ at evaluation for memory='xl' (evaluated as 'xl_cached')"),
    (dict(eval__model__memory='lamemo'), "memory='lamemo' cannot run on parameters trained as memory='xl'"),
    (dict(eval__model__memory='trams', eval__model__mem_len=4),
     'trams_select=200 exceeds the pool (mem_len=4)'),
])
def test_misused_trams_is_one_line_before_anything_runs(xl_workdir, fields, message):
    corpus, workdir = xl_workdir
    with pytest.raises(errors.ConfigError, match=re.escape(message)):
        config_lib.validate_config(training_fixtures.tiny_config(corpus, **fields))


def test_a_misspelt_evaluation_field_is_told_as_no_field_with_the_near_one():
    trained = model_lib.ModelConfig(vocab_size=50, d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32, mem_len=8,
                                    segment_len=8)
    with pytest.raises(ValueError, match=r"\['mem_lenn'\] are no model fields; did you mean 'mem_len' for 'mem_lenn'\?"):
        memories.evaluation_config(trained, {'mem_lenn': 32})


def test_a_sweep_point_that_cannot_run_stops_the_sweep_before_any_is_evaluated(xl_workdir, tmp_path, monkeypatch):
    corpus, workdir = xl_workdir
    monkeypatch.setattr(evaluate, 'evaluate_checkpoint', lambda *a, **k: pytest.fail('evaluated'))
    grid = sweep.TramsGrid(pools=(32, 8), selects=(16,), segments=(8,), pool=32, select=16, segment=8,
                           segment_pool=32)
    listing = lambda: sorted(os.listdir(workdir)) + sorted(os.listdir(os.path.join(workdir, 'sweep_trams')))
    os.makedirs(os.path.join(workdir, 'sweep_trams'), exist_ok=True)
    before = listing()
    with pytest.raises(errors.ConfigError, match=r'the point pool M = 8 \(trams\) cannot be evaluated, so nothing '
                                                 r'was: .*trams_select=16 exceeds the pool \(mem_len=8\)'):
        sweep.run_sweep('trams', training_fixtures.tiny_config(corpus), workdir, grid)
    assert listing() == before


def test_the_sweep_scores_every_point_as_memjax_evaluate_and_plots_it(xl_workdir):
    """`python -m memjax.sweep trams` in miniature: every point's score is memjax.evaluate's for its
    settings; the table and the plot are written."""
    corpus, workdir = xl_workdir
    grid = sweep.TramsGrid(pools=(8, 16), selects=(4, 8), segments=(4, 8), pool=16, select=8, segment=8,
                           segment_pool=12)
    config = training_fixtures.tiny_config(corpus, eval__batch_size=2)
    panels, points = sweep.run_sweep('trams', config, workdir, grid)
    assert [p['value'] for p in points if p['evaluator'] == 'trams'] == [8, 16, 4, 8, 4, 8]
    point = next(p for p in points if p['panel'] == 'segment' and p['value'] == 4 and p['evaluator'] == 'trams')
    assert point['settings']['mem_len'] == 12 and point['settings']['trams_remain'] == 6
    direct = evaluate.evaluate_checkpoint(training_fixtures.tiny_config(
        corpus, eval__batch_size=2, eval__tgt_len=4, eval__model__memory='trams', eval__model__mem_len=12,
        eval__model__trams_select=8, eval__model__trams_remain=6), workdir)
    assert point['bpc'] == pytest.approx(direct['bpc'], rel=1e-9)
    xl = [p['bpc'] for p in points if p['panel'] == 'pool' and p['evaluator'] == 'xl']
    assert xl[0] == xl[1]  # XL does not read the pool.
    out = f'{workdir}/sweep_trams'
    with open(f'{out}/results.md') as f:
        assert f.read() == sweep.table(panels, points)
    with open(f'{out}/results.png', 'rb') as f:
        assert f.read(8) == b'\x89PNG\r\n\x1a\n'
