"""Numerical parity with Hugging Face's GPT2LMHeadModel (transformers 4.37.2) through the importer.

A random small GPT-2, perturbed beyond its init (zero biases and unit LayerNorm gains would hide a
wrong mapping), is saved with save_pretrained (safetensors), imported by memjax.convert.hf_gpt2
and run on the same tokens: per-token log-probs must agree within 1e-4 (memory='none': the
infinity-former's GPT-2 with its long-term memory off).
"""

import numpy as np
import pytest

torch = pytest.importorskip('torch', reason="HF parity tests need torch: pip install -e '.[parity]'")
transformers = pytest.importorskip(
    'transformers', reason="HF parity tests need transformers 4.37.2: pip install -e '.[parity]'")

import jax  # pylint: disable=g-import-not-at-top,g-bad-import-order
from flax import traverse_util  # pylint: disable=g-import-not-at-top

from memjax import errors  # pylint: disable=g-import-not-at-top
from memjax import model as model_lib  # pylint: disable=g-import-not-at-top
from memjax.convert import hf_gpt2, hf_io  # pylint: disable=g-import-not-at-top
from memjax.model import build_model, init_memory  # pylint: disable=g-import-not-at-top
from memjax.training import experiment  # pylint: disable=g-import-not-at-top
from memjax.training import restore  # pylint: disable=g-import-not-at-top
import training_fixtures  # pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning', 'ignore::FutureWarning',
                                        'ignore::UserWarning')

VOCAB, BATCH, LENGTH = 256, 2, 12  # 256: the byte tokenizer's, for the training test.


@pytest.fixture(scope='module')
def hf_directory(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                     resid_pdrop=0.3, attn_pdrop=0.2, embd_pdrop=0.1)
    model = transformers.GPT2LMHeadModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    path = tmp_path_factory.mktemp('gpt2')
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


def test_imported_gpt2_matches_hf_log_probs(hf_directory):
    model, path = hf_directory
    config, params = hf_gpt2.load_hf_checkpoint(path)
    tokens = np.random.RandomState(2).randint(0, VOCAB, (BATCH, LENGTH + 1))
    with torch.no_grad():
        logits = model(torch.as_tensor(tokens[:, :-1])).logits.double()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(tokens[:, 1:])[..., None])[..., 0].numpy()
    # Jitted: op by op, the model would compile each of its operations.
    apply = jax.jit(lambda p, x, m, t: build_model(config).apply({'params': p}, x, m, targets=t))
    out, _ = apply(params, tokens[:, :-1].astype(np.int32), init_memory(config, BATCH),
                   tokens[:, 1:].astype(np.int32))
    np.testing.assert_allclose(np.asarray(out.target_logprobs), expected, atol=1e-4, rtol=0)


def test_import_without_prefix_and_with_mask_buffers(hf_directory):
    """The original hub files name keys without 'transformer.' and hold the causal-mask buffers."""
    model, _ = hf_directory
    config = hf_gpt2.model_config_from_hf(model.config)
    state = {k.removeprefix('transformer.'): v for k, v in model.state_dict().items() if k != 'lm_head.weight'}
    state['h.0.attn.bias'] = torch.ones(1, 1, 16, 16)
    params = hf_gpt2.params_from_hf_state_dict(state, config)
    reference = hf_gpt2.params_from_hf_state_dict(model.state_dict(), config)
    np.testing.assert_array_equal(params['layer_1']['attention']['query']['bias'],
                                  reference['layer_1']['attention']['query']['bias'])
    with pytest.raises(hf_io.CheckpointError, match=r"missing keys \['h.1.ln_2.weight'\]"):
        hf_gpt2.params_from_hf_state_dict({k: v for k, v in state.items() if k != 'h.1.ln_2.weight'}, config)


def test_gpt2_pickles_are_refused_never_unpickled(hf_directory, tmp_path, monkeypatch):
    model, _ = hf_directory
    model.save_pretrained(tmp_path, safe_serialization=False)  # pytorch_model.bin

    def forbidden(*args, **kwargs):
        raise AssertionError('torch.load was called on a GPT-2 checkpoint')

    monkeypatch.setattr(torch, 'load', forbidden)
    with pytest.raises(hf_io.CheckpointError, match=r'pytorch_model.bin is a PyTorch pickle.*safetensors'):
        hf_gpt2.load_hf_checkpoint(str(tmp_path))
    with pytest.raises(hf_io.CheckpointError, match='PyTorch pickle'):
        hf_gpt2.load_hf_checkpoint(str(tmp_path / 'pytorch_model.bin'))


@pytest.mark.parametrize('option, message', [
    ({'activation_function': 'relu'}, "activation_function='relu'"),
    ({'scale_attn_weights': False}, 'scale_attn_weights=False'),
    ({'scale_attn_by_inverse_layer_idx': True}, 'scale_attn_by_inverse_layer_idx=True'),
    ({'add_cross_attention': True}, 'add_cross_attention=True'),
    ({'tie_word_embeddings': False}, 'tie_word_embeddings=False'),
])
def test_unsupported_gpt2_options_are_named(option, message):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, **option)
    with pytest.raises(hf_io.CheckpointError, match=message):
        hf_gpt2.model_config_from_hf(config)


def test_the_layer_norm_epsilon_comes_from_the_config():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, layer_norm_epsilon=1e-3)
    assert hf_gpt2.model_config_from_hf(config).layer_norm_epsilon == 1e-3


def test_training_starts_from_the_gpt2_weights_with_a_fresh_memory(hf_directory, tmp_path):
    """config.train.init_from=<HF gpt2 folder>: every GPT-2 parameter is the checkpoint's, the LTM's
    are their initialisation; a GPT-2 of another size is refused naming the field."""
    _, path = hf_directory
    corpus = training_fixtures.write_text_corpus(str(tmp_path / 'corpus'))
    gpt2 = dict(memory='infinity', block='gpt2', positions='learned_absolute', pre_lnorm=True, d_model=32,
                n_layer=2, n_head=4, d_head=8, d_inner=128, n_positions=16, mem_len=0, ltm_basis=8,
                ltm_widths=(0.05, 0.1))
    config = training_fixtures.tiny_config(corpus, train__init_from=path,
                                           **{f'model__{k}': v for k, v in gpt2.items()})
    exp = experiment.setup(config, str(tmp_path / 'run'))
    state, _ = restore.init_from(exp)  # pylint: disable=protected-access
    started = traverse_util.flatten_dict(jax.device_get(state.params))
    imported = traverse_util.flatten_dict(hf_gpt2.load_hf_checkpoint(path)[1])
    fresh = traverse_util.flatten_dict(model_lib.init_params(exp.mcfg, jax.random.split(jax.random.PRNGKey(config.seed))[0]))
    assert set(imported) < set(started)
    for name, value in started.items():
        expected = imported.get(name, fresh[name])
        np.testing.assert_array_equal(value, expected, err_msg='/'.join(name))
    assert any('memory' in name for name in set(started) - set(imported))
    config.model.n_layer = 3
    with pytest.raises(errors.CheckpointError, match=r'n_layer=2 \(config: 3\)'):
        restore.init_from(experiment.setup(config, str(tmp_path / 'other')))  # pylint: disable=protected-access
