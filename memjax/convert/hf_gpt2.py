"""Imports Hugging Face GPT-2 weights (`GPT2LMHeadModel` / `GPT2Model`) into memjax.

The infinity-former extends a pretrained GPT-2 with a long-term memory; this importer gives memjax
the same starting point. The imported model is memjax's `block='gpt2'`, `positions=
'learned_absolute'` with no memory (`memory='none'`): it computes what HF computes (within 1e-4,
tests/test_parity_hf_gpt2.py). `python -m memjax.train` starts from it when
`config.train.init_from` names the HF directory; the memory's own parameters start fresh.

Layout differences (HF's Conv1D weights are already [in, out]):
  c_attn [D, 3*H*Dh] (q, k, v side by side)  -> query/key/value kernels [D, H, Dh], biases [H, Dh]
  attn.c_proj [H*Dh, D]                      -> out kernel [H, Dh, D]
  ln_1, ln_2, ln_f                           -> attention/layer_norm, feed_forward/layer_norm, final_norm
  mlp.c_fc, mlp.c_proj                       -> feed_forward/inner, feed_forward/outer
  wte (tied lm_head), wpe                    -> io/emb_table_0, position_embedding
GPT-2's head has no bias: memjax's output bias is imported as zeros. Keys may carry the
'transformer.' prefix (GPT2LMHeadModel) or not (GPT2Model, the original hub files); the causal
mask buffers some files hold ('attn.bias', 'attn.masked_bias') are not weights and are skipped.

  python -m memjax.convert.hf_gpt2 --checkpoint=DIR_OR_FILE --out=DIR
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np
from flax import traverse_util

from memjax.convert import hf_io
from memjax.convert.hf_io import CheckpointError, HFConfig, Tensor, same
from memjax.model import ModelConfig

# HF activations that are GPT-2's tanh-approximated GELU.
_TANH_GELU = ('gelu_new', 'gelu_pytorch_tanh')


def model_config_from_hf(hf_config: HFConfig) -> ModelConfig:
    """The memjax ModelConfig computing what HF's GPT-2 with this config computes."""
    fields = hf_io.hf_config_dict(hf_config)
    if fields.get('model_type', 'gpt2') != 'gpt2':
        raise CheckpointError(f'HF config has model_type={fields["model_type"]!r}; this importer reads '
                              "GPT-2 ('gpt2'); Transformer-XL has python -m memjax.convert.hf_transfo_xl.")
    missing = [name for name in ('vocab_size', 'n_embd', 'n_layer', 'n_head', 'n_positions') if name not in fields]
    if missing:
        raise CheckpointError(f'HF config lacks the fields {missing}; pass the config.json that '
                              'save_pretrained wrote next to the weights.')
    activation = fields.get('activation_function', 'gelu_new')
    unsupported = [(activation not in _TANH_GELU, f'activation_function={activation!r} (memjax has {_TANH_GELU})'),
                   (not fields.get('scale_attn_weights', True), 'scale_attn_weights=False'),
                   (fields.get('scale_attn_by_inverse_layer_idx', False), 'scale_attn_by_inverse_layer_idx=True'),
                   (fields.get('add_cross_attention', False), 'add_cross_attention=True'),
                   (not fields.get('tie_word_embeddings', True), 'tie_word_embeddings=False')]
    unsupported = [what for bad, what in unsupported if bad]
    if unsupported:
        raise CheckpointError(f'HF config has {", ".join(unsupported)}: memjax\'s GPT-2 block cannot '
                              'compute that; use a standard GPT-2 checkpoint.')
    d_model, n_head = int(fields['n_embd']), int(fields['n_head'])
    try:
        return ModelConfig(
            vocab_size=int(fields['vocab_size']), memory='none', positions='learned_absolute', block='gpt2',
            n_positions=int(fields['n_positions']), d_model=d_model, n_layer=int(fields['n_layer']),
            n_head=n_head, d_head=d_model // n_head, d_inner=int(fields.get('n_inner') or 4 * d_model),
            dropout=float(fields.get('resid_pdrop', 0.1)), dropatt=float(fields.get('attn_pdrop', 0.1)),
            mem_len=0, pre_lnorm=True, tie_weight=True, init_std=float(fields.get('initializer_range', 0.02)),
            layer_norm_epsilon=float(fields.get('layer_norm_epsilon', 1e-5)))
    except ValueError as e:
        raise CheckpointError(f'HF config does not make a valid memjax model: {e}') from e


def _qkv_part(w: np.ndarray, part: int, n_head: int, d_head: int) -> np.ndarray:
    """c_attn weight [D, 3*H*Dh] or bias [3*H*Dh] -> that part's kernel [D, H, Dh] or bias [H, Dh]."""
    width = n_head * d_head
    return w[..., part * width:(part + 1) * width].reshape(w.shape[:-1] + (n_head, d_head))


def _heads_out(w: np.ndarray, n_head: int, d_head: int) -> np.ndarray:
    return w.reshape(n_head, d_head, -1)


def _zeros(w: np.ndarray) -> np.ndarray:
    return np.zeros(w.shape[:1], np.float32)


def _hf_layout(cfg: ModelConfig, prefix: str) -> list[Tensor]:
    """Every tensor of an HF GPT-2 with this config (keys under `prefix`) and where it goes."""
    layout = []

    def add(keys, shape, *targets, tied_by=''):
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
        layout.append(Tensor(keys, tuple(shape), tuple(targets), tied_by))

    d, heads = cfg.d_model, dict(n_head=cfg.n_head, d_head=cfg.d_head)
    add((prefix + 'wte.weight', 'lm_head.weight'), (cfg.vocab_size, d), ('io/emb_table_0', same),
        ('io/out_bias_0', _zeros), tied_by='tie_word_embeddings')
    add(prefix + 'wpe.weight', (cfg.n_positions, d), ('position_embedding', same))
    add(prefix + 'ln_f.weight', (d,), ('final_norm/scale', same))
    add(prefix + 'ln_f.bias', (d,), ('final_norm/bias', same))
    for l in range(cfg.n_layer):
        hf, mj = f'{prefix}h.{l}.', f'layer_{l}/'
        qkv = lambda part: functools.partial(_qkv_part, part=part, **heads)
        names = ('query', 'key', 'value')
        add(hf + 'attn.c_attn.weight', (d, 3 * d), *((f'{mj}attention/{n}/kernel', qkv(p)) for p, n in enumerate(names)))
        add(hf + 'attn.c_attn.bias', (3 * d,), *((f'{mj}attention/{n}/bias', qkv(p)) for p, n in enumerate(names)))
        add(hf + 'attn.c_proj.weight', (d, d), (mj + 'attention/out/kernel', functools.partial(_heads_out, **heads)))
        add(hf + 'attn.c_proj.bias', (d,), (mj + 'attention/out/bias', same))
        for hf_norm, block in (('ln_1', 'attention'), ('ln_2', 'feed_forward')):
            add(f'{hf}{hf_norm}.weight', (d,), (f'{mj}{block}/layer_norm/scale', same))
            add(f'{hf}{hf_norm}.bias', (d,), (f'{mj}{block}/layer_norm/bias', same))
        for hf_name, name, shape in (('c_fc', 'inner', (d, cfg.d_inner)), ('c_proj', 'outer', (cfg.d_inner, d))):
            add(f'{hf}mlp.{hf_name}.weight', shape, (f'{mj}feed_forward/{name}/kernel', same))
            add(f'{hf}mlp.{hf_name}.bias', shape[1:], (f'{mj}feed_forward/{name}/bias', same))
    return layout


def _is_buffer(key: str) -> bool:
    return key.endswith(('.attn.bias', '.attn.masked_bias'))


def params_from_hf_state_dict(state_dict: Mapping[str, Any], config: ModelConfig,
                              source: str = 'state dict') -> dict[str, Any]:
    """Converts an HF GPT-2 state dict (with or without the 'transformer.' prefix) into memjax params."""
    prefix = 'transformer.' if any(key.startswith('transformer.') for key in state_dict) else ''
    return hf_io.convert_tensors(state_dict, _hf_layout(config, prefix), config, source, 'GPT-2',
                                 ignore=_is_buffer)


def load_hf_checkpoint(path: str, hf_config: Optional[HFConfig] = None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) from an HF GPT-2 checkpoint (safetensors: GPT-2 is never unpickled); the
    config defaults to the config.json beside it."""
    return hf_io.load_checkpoint(path, hf_config, model_config_from_hf, params_from_hf_state_dict,
                                 safetensors_only=True)


def is_checkpoint_dir(path: str) -> bool:
    """Whether `path` is a folder holding an HF GPT-2 (its config.json says model_type 'gpt2')."""
    config = os.path.join(os.path.expanduser(path), hf_io.CONFIG_FILE)
    if not path or not os.path.isfile(config):
        return False
    try:
        with open(config) as f:
            return json.load(f).get('model_type') == 'gpt2'
    except (ValueError, OSError, AttributeError):
        return False


def extend(fresh: Mapping[str, Any], pretrained: Mapping[str, Any]) -> dict:
    """`fresh` parameters with every leaf GPT-2 has taken from `pretrained` (same tree layout):
    a model extending GPT-2 (a memory kind's parameters) keeps its own initialisation elsewhere."""
    flat_fresh = traverse_util.flatten_dict(dict(fresh))
    flat_pretrained = traverse_util.flatten_dict(dict(pretrained))
    missing = sorted('/'.join(k) for k in set(flat_pretrained) - set(flat_fresh))
    wrong = sorted('/'.join(k) for k in set(flat_pretrained) & set(flat_fresh)
                   if np.shape(flat_pretrained[k]) != np.shape(flat_fresh[k]))
    if missing or wrong:
        raise CheckpointError(f'the GPT-2 weights do not fit the model: not in the model {missing}, '
                              f'other shapes {wrong}; set config.model to the GPT-2\'s sizes.')
    return traverse_util.unflatten_dict({k: flat_pretrained.get(k, v) for k, v in flat_fresh.items()})


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = hf_io.command_flags(
        argv, 'memjax.convert.hf_gpt2',
        'import Hugging Face GPT-2 weights (safetensors) into memjax (config.json + params.msgpack).',
        required={'checkpoint': 'save_pretrained directory, or a .safetensors file',
                  'out': 'directory to write the memjax parameters into'},
        optional={'config': 'HF config.json; default: the one in or next to --checkpoint'})

    def job():
        config, params = load_hf_checkpoint(args.checkpoint, args.config)
        hf_io.save_imported(args.out, config, params)
        return f'Imported GPT-2 ({hf_io.config_summary(config)}) into {args.out}.'

    hf_io.run_import(job)


if __name__ == '__main__':
    hf_io.command_main(main)
