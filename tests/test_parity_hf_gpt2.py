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

import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,g-bad-import-order

from memjax.convert import hf_gpt2, hf_io  # pylint: disable=g-import-not-at-top
from memjax.model import build_model, init_memory  # pylint: disable=g-import-not-at-top

pytestmark = pytest.mark.filterwarnings('ignore::DeprecationWarning', 'ignore::FutureWarning',
                                        'ignore::UserWarning')

VOCAB, BATCH, LENGTH = 97, 2, 12


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
    out, _ = build_model(config).apply({'params': params}, jnp.asarray(tokens[:, :-1]), init_memory(config, BATCH),
                                       targets=jnp.asarray(tokens[:, 1:]))
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


def test_unsupported_gpt2_options_are_named():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=4, activation_function='relu')
    with pytest.raises(hf_io.CheckpointError, match="activation_function='relu'"):
        hf_gpt2.model_config_from_hf(config)
