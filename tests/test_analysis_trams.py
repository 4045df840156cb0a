"""TRAMS' kept tokens and its metric's rank correlation with the true scores, against naive loops
and the model's own selections."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from scipy import stats

from memjax import analysis
from memjax import model as model_lib
from memjax.analysis import trams
from memjax.data.tokenizers import ByteTokenizer, WordTokenizer
from memjax.model import ModelConfig


def _naive_counts(selected, seg_len, pool, reset):
    num_segments, n_layer, batch, heads, picks = selected.shape
    counts = np.zeros((n_layer, batch, heads, num_segments * seg_len), int)
    for s in range(num_segments):
        for b in range(batch):
            floor = max([r * seg_len for r in range(s + 1) if reset[r, b]], default=0)
            for l in range(n_layer):
                for h in range(heads):
                    for i in range(picks):
                        position = s * seg_len - pool + selected[s, l, b, h, i]
                        if position >= floor:
                            counts[l, b, h, position] += 1
    return counts


def test_kept_counts_is_the_naive_loop():
    rng = np.random.RandomState(0)
    selected = np.sort(rng.randint(0, 9, (6, 2, 3, 2, 4)), axis=-1)
    reset = rng.rand(6, 3) < 0.3
    reset[0] = True
    got = trams.kept_counts(selected, seg_len=3, pool=12, reset=reset)
    np.testing.assert_array_equal(got, _naive_counts(selected, 3, 12, reset))
    assert got.sum() > 0


# One small XL for the tests that run a model (building its parameters compiles for seconds).
XL = ModelConfig(vocab_size=30, d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32, mem_len=8, init_std=0.3)


@pytest.fixture(scope='module')
def xl_params():
    return model_lib.init_params(XL, jax.random.key(0))


def test_kept_positions_are_the_rows_the_model_attended(xl_params):
    """Every layer's pool row is the key that layer computed when the position was in the segment:
    the positions `kept_positions` names must hold exactly the keys each head attended, and the
    rows it drops (before a stream's start or its reset) must be the ones the model masked."""
    cfg = dataclasses.replace(XL, memory='trams', trams_select=5, trams_remain=2)  # TRAMS over the XL's parameters.
    model, params = model_lib.build_model(cfg), xl_params
    seg_len, batch, segments = 2, 2, 8
    tokens = np.random.RandomState(1).randint(0, 30, (segments, batch, seg_len))
    reset = np.zeros((segments, batch), bool)
    reset[0], reset[5, 1] = True, True  # Row 1 restarts its memory at segment 5.
    memory = model_lib.init_memory(cfg, batch)
    step = jax.jit(functools.partial(analysis.apply_sown, model))
    seg_keys, floor, checked = [], np.zeros(batch, int), 0
    for s in range(segments):
        _, memory, sown = step(params, tokens[s], memory, reset=reset[s])
        attention, selected = analysis.per_layer(sown, 'attention'), np.asarray(analysis.per_layer(sown, 'selected'))
        key = np.asarray(attention['key'])  # [n_layer, B, K, H, Dh]: each head's selected rows first.
        seg_keys.append(key[:, :, -seg_len:])
        by_position = np.concatenate(seg_keys, axis=2)  # [n_layer, B, (s + 1) * T, H, Dh]
        floor = np.where(reset[s], s * seg_len, floor)
        positions = trams.kept_positions(selected, s * seg_len, cfg.mem_len, floor)  # [n_layer, B, H, picks]
        attended = np.asarray(attention['mask'])[:, :, :, 0, :selected.shape[-1]]
        np.testing.assert_array_equal(positions >= 0, attended)
        for l, b, h, i in zip(*np.nonzero(positions >= 0)):
            np.testing.assert_allclose(key[l, b, i, h], by_position[l, b, positions[l, b, h, i], h], rtol=1e-6)
            checked += 1
    assert checked > 20 and not (positions >= 0).all()


def test_kept_by_token_is_the_naive_rate():
    rng = np.random.RandomState(2)
    tokens = rng.randint(0, 7, (2, 10))
    real = rng.rand(2, 10) > 0.2
    counts = rng.randint(0, 3, (3, 2, 4, 10))  # 3 layers, 4 heads.
    rate, seen = trams.kept_by_token(trams.Kept(tokens, real, counts), vocab_size=9)
    times, want_seen = np.zeros(9), np.zeros(9)
    for b in range(2):
        for t in range(10):
            if real[b, t]:
                want_seen[tokens[b, t]] += 1
                times[tokens[b, t]] += counts[:, b, :, t].sum()
    np.testing.assert_array_equal(seen, want_seen)
    present = want_seen > 0
    np.testing.assert_allclose(rate[present], times[present] / (want_seen[present] * 3 * 4))
    assert np.isnan(rate[~present]).all() and (~present).any()


def _kept_text(tokens, runs):
    counts = np.zeros((1, 1, 2, len(tokens)), int)
    for positions, times in runs:
        counts[0, 0, :, positions] = times
    return trams.Kept(np.asarray(tokens)[None], np.ones((1, len(tokens)), bool), counts)


def test_marked_text_brackets_the_most_kept_runs():
    tokenizer = ByteTokenizer()
    kept = _kept_text(tokenizer.encode('John met Ann'), [([0, 1, 2, 3, 9, 10, 11], 3), ([5], 1)])
    assert trams.marked_text(tokenizer, kept, 0, top=0.5) == '[John] met [Ann]'
    assert trams.marked_text(tokenizer, kept, 0, start=4, stop=10, top=0.1) == ' met [A]'  # 'm': below the top.


def test_marked_text_keeps_a_word_tokenizers_spaces_outside_the_marks():
    tokenizer = WordTokenizer(['<eos>', '<unk>', 'He', 'appeared', 'in', 'Judge', 'John', 'Deed'])
    kept = _kept_text(tokenizer.encode('He appeared in Judge John Deed\nHe'), [([2], 1), ([3, 4], 4)])
    assert trams.marked_text(tokenizer, kept, 0, top=0.2) == 'He appeared in [Judge John] Deed\nHe\n'


def test_top_spearman_is_one_for_the_truth_and_minus_one_reversed():
    truth = np.random.RandomState(3).randn(200)
    got = trams.top_spearman(truth, np.stack([np.exp(truth), -truth]), (0.05, 0.3, 1.0))
    np.testing.assert_allclose(got, [[1.0] * 3, [-1.0] * 3], rtol=1e-12)


def test_top_spearman_is_scipys_over_the_top_pairs():
    rng = np.random.RandomState(4)
    truth, ranking = rng.randn(300), np.round(rng.randn(300), 1)  # Ties in the ranking.
    fractions = (0.01, 0.1, 0.5, 1.0)
    got = trams.top_spearman(truth, ranking, fractions)
    for f, fraction in enumerate(fractions):
        top = sorted(range(truth.size), key=lambda i: -truth[i])[:max(2, int(np.ceil(fraction * truth.size)))]
        assert got[f] == pytest.approx(stats.spearmanr(truth[top], ranking[top]).statistic, abs=1e-12)


def _naive_correlations(attention, query_kernel, fractions, positional):
    """Every (query, memory key) pair with explicit dot products and K' = W_Q k per head."""
    n_layer, batch, seg_len, heads, _ = attention['query'].shape
    keys, rows, d_model = attention['key'].shape[2], attention['pos_key'].shape[1], query_kernel.shape[1]
    memory = keys - seg_len
    out = {name: np.zeros((n_layer, heads, len(fractions))) for name in trams.RANKINGS}
    for l in range(n_layer):
        for h in range(heads):
            truth, values = [], {name: [] for name in trams.RANKINGS}
            for b in range(batch):
                for t in range(seg_len):
                    q = attention['query'][l, b, t, h]
                    for j in range(memory):
                        if not attention['mask'][l, b, 0, t, j]:
                            continue
                        k = attention['key'][l, b, j, h]
                        score = (q + attention['u_bias'][l, h]) @ k
                        if positional:
                            r = attention['pos_key'][l, rows - 1 - (memory + t - j), h]
                            score += (q + attention['v_bias'][l, h]) @ r
                        truth.append(score)
                        model_space = query_kernel[l, :, h] @ k  # K' [d_model]
                        norm = np.sqrt(np.sum(model_space ** 2))
                        cos_ones = model_space.sum() / (norm * np.sqrt(d_model))
                        values['paper'].append(cos_ones * norm)
                        values['norm'].append(norm)
                        values['angle'].append(cos_ones)
                        values['released'].append(norm * abs(model_space.sum()))
                        values['query_angle'].append(q @ k / norm)
            truth = np.array(truth)
            for f, fraction in enumerate(fractions):
                top = np.argsort(-truth)[:max(2, int(np.ceil(fraction * truth.size)))]
                for name in trams.RANKINGS:
                    out[name][l, h, f] = stats.spearmanr(truth[top], np.array(values[name])[top]).statistic
    return out


@pytest.mark.parametrize('positional', [False, True])
def test_metric_correlations_are_the_naive_ones(positional):
    rng = np.random.RandomState(5)
    n_layer, batch, seg_len, memory, heads, d_head, d_model = 2, 2, 3, 7, 2, 4, 6
    keys = memory + seg_len
    mask = np.ones((n_layer, batch, 1, seg_len, keys), bool)
    mask[:, 0, :, :, :2] = False  # Row 0's two oldest rows hold nothing yet.
    attention = {'query': rng.randn(n_layer, batch, seg_len, heads, d_head),
                 'key': rng.randn(n_layer, batch, keys, heads, d_head),
                 'pos_key': rng.randn(n_layer, keys, heads, d_head),
                 'u_bias': rng.randn(n_layer, heads, d_head), 'v_bias': rng.randn(n_layer, heads, d_head),
                 'mask': mask}
    query_kernel = rng.randn(n_layer, d_model, heads, d_head)
    fractions = (0.1, 0.5, 1.0)
    got = trams.metric_correlations(attention, query_kernel, fractions, positional)
    want = _naive_correlations(attention, query_kernel, fractions, positional)
    for name in trams.RANKINGS:
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, err_msg=name)


def test_query_kernels_read_either_layer_layout(xl_params):
    scanned = model_lib.convert_layer_layout(xl_params, scan_layers=True)
    for layout in (xl_params, scanned):
        got = trams.query_kernels(layout)
        assert got.shape[0] == XL.n_layer
        for l in range(XL.n_layer):
            np.testing.assert_array_equal(got[l], xl_params[f'layer_{l}']['attention']['query']['kernel'])
