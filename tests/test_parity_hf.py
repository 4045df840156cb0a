"""Numerical parity with Hugging Face's TransfoXLLMHeadModel (transformers 4.37.2), and the importer.

Random small HF models are perturbed beyond their init (so zero-initialised biases and unit
LayerNorm gains matter), imported, and run over three consecutive segments with memory carried on
both sides; memjax's per-token target log-probs, final hidden states and memories must match HF's.
"""

import functools

import numpy as np
import pytest

torch = pytest.importorskip('torch', reason="HF parity tests need torch: pip install -e '.[parity]'")
transformers = pytest.importorskip(
    'transformers', reason="HF parity tests need transformers 4.37.2: pip install -e '.[parity]'")

import jax  # pylint: disable=g-import-not-at-top,g-bad-import-order
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import safetensors.numpy  # pylint: disable=g-import-not-at-top

from memjax import convert  # pylint: disable=g-import-not-at-top
from memjax.convert import hf_transfo_xl  # pylint: disable=g-import-not-at-top
from memjax.model import build_model, init_memory  # pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning', 'ignore::FutureWarning',
                                        'ignore::UserWarning')

BATCH, TGT_LEN, SEGMENTS = 3, 8, 3
TOLERANCE = 1e-4

# Each case changes the parameter set (ties, projections, untie_r, div_val) or the numerics
# (pre_lnorm, same_length, clamp_len); dropout is on in the config to check that eval turns it off.
CASES = {
    'plain_tied_post_ln': dict(
        vocab_size=120, cutoffs=[], d_model=32, d_embed=32, n_head=2, d_head=16, d_inner=64,
        div_val=1, n_layer=2, mem_len=8, clamp_len=-1, same_length=False, pre_lnorm=False,
        untie_r=False, tie_word_embeddings=True),
    'plain_projected_untied_pre_ln': dict(
        vocab_size=150, cutoffs=[], d_model=32, d_embed=48, n_head=4, d_head=8, d_inner=48,
        div_val=1, n_layer=2, mem_len=12, clamp_len=-1, same_length=False, pre_lnorm=True,
        untie_r=True, tie_word_embeddings=False, tie_projs=[True]),
    'adaptive_div1_same_length_clamped': dict(
        vocab_size=250, cutoffs=[40, 120], d_model=48, d_embed=64, n_head=3, d_head=12, d_inner=80,
        div_val=1, n_layer=2, mem_len=12, clamp_len=6, same_length=True, pre_lnorm=True,
        untie_r=True, tie_word_embeddings=True, tie_projs=[False, True, False]),
    'adaptive_div2_untied_weights': dict(
        vocab_size=300, cutoffs=[50, 150], d_model=64, d_embed=64, n_head=4, d_head=16, d_inner=96,
        div_val=2, n_layer=3, mem_len=16, clamp_len=10, same_length=True, pre_lnorm=False,
        untie_r=False, tie_word_embeddings=False, tie_projs=[False, False, True]),
}


def make_hf_model(case: str, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.TransfoXLConfig(dropout=0.3, dropatt=0.2, **CASES[case])
    model = transformers.TransfoXLLMHeadModel(config).eval()
    # Per-token losses in position order; by default HF groups them by softmax cluster.
    model.crit.keep_order = True
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for param in model.parameters():  # Shared (tied) tensors come once, so ties survive.
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model


def run_hf(model, tokens):
    """HF over consecutive segments: -losses[t] is log p(inputs[t + 1]) (labels shift inside HF)."""
    mems, results = None, []
    with torch.no_grad():
        for s in range(SEGMENTS):
            inputs = torch.as_tensor(tokens[:, s * TGT_LEN:(s + 1) * TGT_LEN])
            out = model(inputs, mems=mems, labels=inputs, output_hidden_states=True)
            mems = out.mems
            results.append((-out.losses.numpy(), out.hidden_states[-1].numpy(),
                            np.stack([m.numpy().transpose(1, 0, 2) for m in mems])))
    return results


def run_memjax(config, params, tokens):
    apply = jax.jit(functools.partial(build_model(config).apply, deterministic=True))
    memory, results = init_memory(config, BATCH), []
    for s in range(SEGMENTS):
        inputs = tokens[:, s * TGT_LEN:(s + 1) * TGT_LEN]
        targets = tokens[:, s * TGT_LEN + 1:(s + 1) * TGT_LEN + 1]
        out, memory = apply({'params': params}, jnp.asarray(inputs), memory,
                            targets=jnp.asarray(targets))
        results.append((np.asarray(out.target_logprobs), np.asarray(out.hidden),
                        np.asarray(memory.layers['hidden'])))
    return results


@pytest.mark.parametrize('attention_impl', ['reference', 'fused'])  # fused: the Pallas kernel, interpreted.
@pytest.mark.parametrize('case', sorted(CASES))
def test_target_logprobs_match_hf_over_three_segments(case, attention_impl):
    hf_model = make_hf_model(case)
    config = convert.model_config_from_hf(hf_model.config).replace(attention_impl=attention_impl)
    params = convert.params_from_hf_state_dict(hf_model.state_dict(), config)
    vocab = CASES[case]['vocab_size']
    tokens = np.random.RandomState(1).randint(0, vocab, (BATCH, SEGMENTS * TGT_LEN + 1))
    # Every softmax cluster must be scored, or a wrong tail mapping could go unnoticed.
    bounds = config.cluster_bounds
    scored = np.concatenate([tokens[:, s * TGT_LEN + 1:(s + 1) * TGT_LEN] for s in range(SEGMENTS)])
    assert len(np.unique(np.searchsorted(bounds, scored, side='right'))) == len(bounds) - 1

    diffs = []
    for s, (hf, mj) in enumerate(zip(run_hf(hf_model, tokens), run_memjax(config, params, tokens))):
        (hf_lp, hf_hidden, hf_mem), (mj_lp, mj_hidden, mj_mem) = hf, mj
        # HF scores positions 0..T-2 of each segment (its label shift); memjax scores all T.
        np.testing.assert_allclose(mj_lp[:, :-1], hf_lp, atol=TOLERANCE, rtol=0, err_msg=f'segment {s}')
        np.testing.assert_allclose(mj_hidden, hf_hidden, atol=TOLERANCE, rtol=0, err_msg=f'segment {s}')
        np.testing.assert_allclose(mj_mem, hf_mem, atol=TOLERANCE, rtol=0, err_msg=f'segment {s}')
        diffs.append(np.abs(mj_lp[:, :-1] - hf_lp).max())
    print(f'{case}: max |log p diff| per segment {["%.2e" % d for d in diffs]}')


@pytest.mark.parametrize('safe_serialization, shard_size, weights_file', [
    (True, '5GB', 'model.safetensors'),
    (False, '5GB', 'pytorch_model.bin'),
    (True, '40KB', 'model.safetensors.index.json'),
], ids=['safetensors', 'pytorch_bin', 'sharded_safetensors'])
def test_save_pretrained_directory_round_trip(tmp_path, safe_serialization, shard_size, weights_file):
    hf_model = make_hf_model('adaptive_div1_same_length_clamped', seed=3)
    hf_dir, out_dir = str(tmp_path / 'hf'), str(tmp_path / 'memjax')
    hf_model.save_pretrained(hf_dir, safe_serialization=safe_serialization, max_shard_size=shard_size)
    assert (tmp_path / 'hf' / weights_file).exists()
    if weights_file == 'model.safetensors':  # The case this test is for: tied duplicates are dropped.
        saved = safetensors.numpy.load_file(f'{hf_dir}/model.safetensors')
        assert 'crit.out_layers.0.weight' not in saved and 'crit.out_projs.1' not in saved

    hf_transfo_xl.main(['--checkpoint', hf_dir, '--out', out_dir])
    config, params = convert.load_imported(out_dir)

    assert config == convert.model_config_from_hf(hf_model.config)
    # save_pretrained drops tied duplicates from safetensors; the import must not depend on that.
    direct = convert.params_from_hf_state_dict(hf_model.state_dict(), config)
    leaves = jax.tree_util.tree_leaves_with_path(direct)
    loaded = dict(jax.tree_util.tree_leaves_with_path(params))
    assert len(loaded) == len(leaves)
    for path, value in leaves:
        np.testing.assert_array_equal(loaded[path], value, err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope='module')
def small_checkpoint():
    hf_model = make_hf_model('plain_tied_post_ln', seed=5)
    state = {k: v.numpy().copy() for k, v in hf_model.state_dict().items()}
    return hf_model.config.to_dict(), state


def write_single_file(tmp_path, state) -> str:
    path = str(tmp_path / 'weights.safetensors')
    safetensors.numpy.save_file(state, path)
    return path


@pytest.mark.parametrize('edit, message', [
    (lambda s: s.pop('transformer.layers.1.pos_ff.CoreNet.3.bias'),
     r"missing keys \['transformer.layers.1.pos_ff.CoreNet.3.bias'\]"),
    (lambda s: s.update({'transformer.layers.0.dec_attn.qkv_net.weight':
                         s['transformer.layers.0.dec_attn.qkv_net.weight'].T.copy()}),
     r"'transformer.layers.0.dec_attn.qkv_net.weight' has shape \[32, 96\], expected \[96, 32\]"),
    (lambda s: s.update({'transformer.layers.2.dec_attn.r_net.weight': np.zeros((32, 32), np.float32)}),
     r"unexpected keys \['transformer.layers.2.dec_attn.r_net.weight'\]"),
    (lambda s: s.update({'transformer.layers.1.dec_attn.r_w_bias': np.ones((2, 16), np.float32)}),
     r"'transformer.layers.1.dec_attn.r_w_bias' differs from 'transformer.r_w_bias'.*untie_r"),
], ids=['missing', 'wrong_shape', 'unknown', 'broken_tie'])
def test_malformed_checkpoint_names_the_key(tmp_path, small_checkpoint, edit, message):
    hf_config, state = small_checkpoint
    state = dict(state)
    edit(state)
    with pytest.raises(convert.CheckpointError, match=message):
        convert.load_hf_checkpoint(write_single_file(tmp_path, state), hf_config)


def test_wrong_shape_is_reported_with_both_shapes(tmp_path, small_checkpoint):
    hf_config, state = small_checkpoint
    state = dict(state, **{'crit.out_layers.0.bias': np.zeros((119,), np.float32)})
    with pytest.raises(convert.CheckpointError, match=r"'crit.out_layers.0.bias' has shape \[119\], "
                                                      r"expected \[120\]"):
        convert.load_hf_checkpoint(write_single_file(tmp_path, state), hf_config)


def test_single_file_without_config_asks_for_one(tmp_path, small_checkpoint):
    _, state = small_checkpoint
    with pytest.raises(convert.CheckpointError, match='pass the HF config'):
        convert.load_hf_checkpoint(write_single_file(tmp_path, state))


@pytest.mark.parametrize('change, message', [
    ({'sample_softmax': 8}, 'sample_softmax=8'),
    ({'attn_type': 1}, 'attn_type=1'),
    ({'tie_projs': [False, True]}, 'tie_projs'),
    ({'model_type': 'gpt2'}, 'model_type'),
    ({'d_inner': None}, r"lacks the fields \['d_inner'\]"),
], ids=['sample_softmax', 'attn_type', 'tie_projs', 'model_type', 'missing_field'])
def test_unsupported_config_names_the_option(small_checkpoint, change, message):
    hf_config = dict(small_checkpoint[0], **change)
    hf_config = {k: v for k, v in hf_config.items() if v is not None}
    with pytest.raises(convert.CheckpointError, match=message):
        convert.model_config_from_hf(hf_config)


@pytest.mark.parametrize('hf_clamp_len, clamp_len', [(6, 6), (0, -1), (-1, -1), (-2, -1), (-7, -1)])
def test_a_clamp_len_hf_does_not_apply_imports_as_none(small_checkpoint, hf_clamp_len, clamp_len):
    """HF (`if self.clamp_len > 0`) and the original code clamp only at a positive clamp_len; memjax's
    -2 would clamp at the longest distance trained, and below it is refused."""
    hf_config = dict(small_checkpoint[0], clamp_len=hf_clamp_len)
    assert convert.model_config_from_hf(hf_config).clamp_len == clamp_len


def test_saving_params_that_do_not_fit_the_model_fails(tmp_path, small_checkpoint):
    hf_config, state = small_checkpoint
    config = convert.model_config_from_hf(hf_config)
    params = convert.params_from_hf_state_dict(state, config)
    del params['layer_1']['feed_forward']['outer']['bias']
    with pytest.raises(convert.CheckpointError, match='missing layer_1/feed_forward/outer/bias'):
        convert.save_imported(str(tmp_path), config, params)


def test_import_into_a_scan_layers_config_stacks_the_layers(small_checkpoint):
    hf_config, state = small_checkpoint
    config = convert.model_config_from_hf(hf_config)
    separate = convert.params_from_hf_state_dict(state, config)
    stacked = convert.params_from_hf_state_dict(state, config.replace(scan_layers=True))
    assert 'layers' in stacked and 'layer_0' not in stacked
    kernels = stacked['layers']['attention']['query']['kernel']
    for i in range(config.n_layer):
        np.testing.assert_array_equal(kernels[i], separate[f'layer_{i}']['attention']['query']['kernel'])
