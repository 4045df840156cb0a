"""Attention by distance and Transformer-XL's four score terms, against naive loops and the
model's own attention."""

import jax
import numpy as np
import pytest

from memjax import analysis
from memjax import model as model_lib
from memjax.analysis import attention
from memjax.model import ModelConfig


def _naive_by_distance(values, mask, seg_len, width, reduce):
    """Loops over every query and key: the values at each distance, grouped `width` at a time."""
    layers, batch, heads, _, keys = values.shape
    bins = keys // width
    out = np.full((layers, heads, bins), np.nan)
    for l in range(layers):
        for h in range(heads):
            for b_ in range(bins):
                per_query = []
                for b in range(batch):
                    for t in range(seg_len):
                        got = [values[l, b, h, t, keys - seg_len + t - d] for d in range(b_ * width, (b_ + 1) * width)
                               if keys - seg_len + t - d >= 0 and mask[l, b, 0, t, keys - seg_len + t - d]]
                        if got:
                            per_query.append(reduce(got))
                if per_query:
                    out[l, h, b_] = np.mean(per_query)
    return out


@pytest.mark.parametrize('width, name, reduce', [(1, 'mean', np.mean), (3, 'max', np.max), (2, 'sum', np.sum)])
def test_mean_by_distance_is_the_naive_average_over_queries(width, name, reduce):
    rng = np.random.RandomState(0)
    values = rng.rand(2, 2, 3, 4, 10)
    mask = rng.rand(2, 2, 1, 4, 10) > 0.3
    got = attention.mean_by_distance(values, mask, seg_len=4, bin_width=width, within_bin=name)
    np.testing.assert_allclose(got, _naive_by_distance(values, mask, 4, width, reduce), rtol=1e-12)


@pytest.mark.parametrize('distance', [0, 3, 7, 12])
def test_mass_beyond_a_distance_is_the_naive_sum_per_query(distance):
    rng = np.random.RandomState(0)
    values = rng.rand(2, 2, 3, 4, 10)
    mask = rng.rand(2, 2, 1, 4, 10) > 0.3
    total, count = attention.mass_beyond(values, mask, seg_len=4, distance=distance)
    want_total, want_count = np.zeros((2, 3)), np.zeros((2, 3), int)
    for l, b, h, t in np.ndindex(2, 2, 3, 4):
        keys = [k for k in range(10) if 10 - 4 + t - k > distance and mask[l, b, 0, t, k]]
        if keys:
            want_total[l, h] += values[l, b, h, t, keys].sum()
            want_count[l, h] += 1
    np.testing.assert_allclose(total, want_total, rtol=1e-12)
    np.testing.assert_array_equal(count, want_count)


@pytest.fixture(scope='module')
def xl_attention():
    """A random Transformer-XL's sown attention on its third segment (the memory full of real rows)."""
    cfg = ModelConfig(vocab_size=40, d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32, mem_len=6,
                      untie_r=True, init_std=0.3)  # Large weights: scores far from uniform.
    model, params = model_lib.build_model(cfg), model_lib.init_params(cfg, jax.random.key(0))
    tokens = np.random.RandomState(1).randint(0, 40, (3, 2, 5)).astype(np.int32)

    @jax.jit  # Op by op, the model would compile each of its operations.
    def attention_sown(params, segment, memory):
        _, memory, sown = analysis.apply_sown(model, params, segment, memory)
        return memory, analysis.per_layer(sown, 'attention')

    memory = model_lib.init_memory(cfg, 2)
    for segment in tokens:
        memory, sown = attention_sown(params, segment, memory)
    return cfg, jax.tree.map(np.asarray, sown)


def test_the_four_terms_add_up_to_the_models_attention(xl_attention):
    cfg, sown = xl_attention
    terms = attention.score_terms(sown, cfg.d_head ** -0.5)
    total = sum(terms.values())
    np.testing.assert_allclose(attention.term_attention(total, sown['mask']), sown['probs'], atol=1e-5)
    # Leaving a term out changes the attention: each one is really in it.
    for name in 'abcd':
        rest = sum(v for k, v in terms.items() if k != name)
        assert np.abs(attention.term_attention(rest, sown['mask']) - sown['probs']).max() > 1e-3, name


def test_terms_follow_their_definitions_at_one_query_and_key(xl_attention):
    cfg, sown = xl_attention
    terms = attention.score_terms(sown, 1.0)
    l, b, h, t, k = 1, 0, 1, 3, 4
    keys, seg_len = sown['key'].shape[2], sown['query'].shape[2]
    distance = keys - seg_len + t - k
    q, key = sown['query'][l, b, t, h], sown['key'][l, b, k, h]
    r = sown['pos_key'][l, sown['pos_key'].shape[1] - 1 - distance, h]
    u, v = sown['u_bias'][l, h], sown['v_bias'][l, h]
    for name, want in {'a': q @ key, 'b': q @ r, 'c': u @ key, 'd': v @ r}.items():
        np.testing.assert_allclose(terms[name][l, b, h, t, k], want, rtol=1e-5, err_msg=name)


def test_attention_by_distance_of_the_model_sums_to_one_per_query(xl_attention):
    cfg, sown = xl_attention
    per_query = attention.by_distance(sown['probs'], sown['query'].shape[2])
    np.testing.assert_allclose(np.nansum(per_query, axis=-1), 1.0, atol=1e-5)


def test_the_models_whole_attention_lies_beyond_distance_minus_one_and_less_beyond_two(xl_attention):
    _, sown = xl_attention
    seg_len = sown['probs'].shape[3]
    total, count = attention.mass_beyond(sown['probs'], sown['mask'], seg_len, -1)
    np.testing.assert_allclose(total / count, 1.0, rtol=1e-5)  # Each query's weights sum to one.
    farther, _ = attention.mass_beyond(sown['probs'], sown['mask'], seg_len, 2)
    assert (farther < total).all()
