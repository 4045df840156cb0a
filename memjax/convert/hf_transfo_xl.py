"""Imports Hugging Face `TransfoXLLMHeadModel` weights (transformers <= 4.37) into memjax.

HF's Transformer-XL is the reference we check numerics against (tests/test_parity_hf.py), and
importing its checkpoints lets memjax evaluate models trained elsewhere. The mapping is derived
from the memjax `ModelConfig` alone, so every HF option that changes the parameter set (ties,
`untie_r`, `div_val`, projections) must have a memjax counterpart; unsupported options are refused
up front rather than imported into a model that would compute something else.

Layout differences handled here (HF Linear weights are [out, in]; Flax kernels are [in, out]):
  qkv_net [3*H*Dh, D] (q, k, v stacked)   -> query/key/value kernels [D, H, Dh]
  r_net [H*Dh, D]                         -> pos kernel [D, H, Dh]
  o_net [D, H*Dh]                         -> out kernel [H, Dh, D]
  r_w_bias, r_r_bias [H, Dh]              -> u_bias, v_bias (per layer when untie_r)
  emb_projs / out_projs P [d_model, d_i]  -> emb_proj / out_proj P^T [d_i, d_model]
  cluster_weight [n_tail, d_embed]        -> cluster_kernel [d_embed, n_tail]
  out_layers bias [V] (div_val 1)         -> one out_bias per cluster
HF ties by sharing tensors, so a tied tensor may appear under several keys (or under one, after
`save_pretrained` drops duplicates); memjax ties by not having the output parameter at all.

Cluster logits: HF and memjax both place the tail-cluster logits after the shortlist in cluster
order. kimiyoung's PyTorch code (and LaMemo, infinity-former) reverses them, so an importer from
that family must reverse the rows of its cluster weight and bias.

HF starts the first segment with `mem_len` zero vectors that are attended, so the imported config
uses `memory_start='zeros'`; switch to 'empty' with `config.replace` for the masked start.

The imported parameters are saved as flax msgpack bytes plus the ModelConfig as JSON (no pickle):
  python -m memjax.convert.hf_transfo_xl --checkpoint=DIR_OR_FILE --out=DIR
  config, params = load_imported(DIR)
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from memjax.convert import hf_io
from memjax.convert.hf_io import (CheckpointError, HFConfig, Tensor, config_summary,
                                  same, save_imported, transpose)
from memjax.model import ModelConfig

_INV_FREQ = 'transformer.pos_emb.inv_freq'  # A buffer: checked, not imported.
# HF config fields that change the parameters or the numerics; config.json always holds them.
_REQUIRED_HF_FIELDS = ('vocab_size', 'd_model', 'd_embed', 'n_head', 'd_head', 'd_inner', 'n_layer',
                       'cutoffs', 'div_val', 'pre_lnorm', 'untie_r', 'same_length', 'clamp_len',
                       'mem_len', 'layer_norm_epsilon', 'dropout', 'dropatt')

# ----------------------------------------------------------------------------------------------
# Config.


def model_config_from_hf(hf_config: HFConfig) -> ModelConfig:
    """The memjax ModelConfig computing what HF's `TransfoXLLMHeadModel` with this config computes.

    Args:
      hf_config: a `TransfoXLConfig`, its `to_dict()`, or the path of its config.json.
    """
    fields = hf_io.hf_config_dict(hf_config)
    model_type = fields.get('model_type', 'transfo-xl')
    if model_type != 'transfo-xl':
        raise CheckpointError(f'HF config has model_type={model_type!r}; only Transformer-XL '
                              "('transfo-xl') checkpoints can be imported.")
    missing = [name for name in _REQUIRED_HF_FIELDS if name not in fields]
    if missing:
        raise CheckpointError(f'HF config lacks the fields {missing}; pass the config.json that '
                              'save_pretrained wrote next to the weights.')
    if fields.get('attn_type', 0) != 0:
        raise CheckpointError(f'HF config has attn_type={fields["attn_type"]}; only attn_type=0 '
                              '(Transformer-XL relative attention) is supported.')
    if fields.get('sample_softmax', -1) > 0:
        raise CheckpointError(f'HF config has sample_softmax={fields["sample_softmax"]}; sampled '
                              'softmax is not supported (HF itself refuses it): set sample_softmax=-1.')
    cutoffs = tuple(int(c) for c in fields['cutoffs'])
    tie_projs = fields.get('tie_projs')
    if tie_projs is None:  # A hand-written dict: derive it as TransfoXLConfig.__init__ does.
        tie_projs = [False] + [bool(fields.get('proj_share_all_but_first', True))] * len(cutoffs)
    if len(tie_projs) != len(cutoffs) + 1:
        raise CheckpointError(f'HF config has tie_projs={list(tie_projs)} but cutoffs={list(cutoffs)} '
                              f'make {len(cutoffs) + 1} clusters; tie_projs needs one entry per cluster.')
    optional = {name: fields[name] for name in ('init_std', 'proj_init_std') if name in fields}
    try:
        return ModelConfig(
            vocab_size=int(fields['vocab_size']), d_model=int(fields['d_model']),
            n_layer=int(fields['n_layer']), n_head=int(fields['n_head']), d_head=int(fields['d_head']),
            d_inner=int(fields['d_inner']), d_embed=int(fields['d_embed']),
            dropout=float(fields['dropout']), dropatt=float(fields['dropatt']),
            # HF and the original clamp only a positive clamp_len; memjax gives -2 a meaning of its own.
            mem_len=int(fields['mem_len']), clamp_len=int(fields['clamp_len']) if int(fields['clamp_len']) > 0 else -1,
            same_length=bool(fields['same_length']), pre_lnorm=bool(fields['pre_lnorm']),
            untie_r=bool(fields['untie_r']),
            # PretrainedConfig's default; config.json omits it unless it is False.
            tie_weight=bool(fields.get('tie_word_embeddings', True)),
            cutoffs=cutoffs, div_val=int(fields['div_val']), tie_projs=tuple(bool(t) for t in tie_projs),
            memory_start='zeros', layer_norm_epsilon=float(fields['layer_norm_epsilon']), **optional)
    except ValueError as e:
        raise CheckpointError(f'HF config does not make a valid memjax model: {e}') from e


# ----------------------------------------------------------------------------------------------
# Parameter mapping.


def _heads_in(w: np.ndarray, n_head: int, d_head: int) -> np.ndarray:
    """Linear [H*Dh, D] -> Projection kernel [D, H, Dh]."""
    return w.reshape(n_head, d_head, -1).transpose(2, 0, 1)


def _qkv_part(w: np.ndarray, part: int, n_head: int, d_head: int) -> np.ndarray:
    width = n_head * d_head
    return _heads_in(w[part * width:(part + 1) * width], n_head, d_head)


def _heads_out(w: np.ndarray, n_head: int, d_head: int) -> np.ndarray:
    """Linear [D, H*Dh] -> Projection kernel [H, Dh, D]."""
    return w.reshape(-1, n_head, d_head).transpose(1, 2, 0)


def _rows(w: np.ndarray, lo: int, hi: int) -> np.ndarray:
    return w[lo:hi]


def _hf_layout(cfg: ModelConfig) -> list[Tensor]:
    """Every tensor of an HF TransfoXLLMHeadModel with this config and where it goes in memjax."""
    layout = []

    def add(keys, shape, *targets, tied_by=''):
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
        layout.append(Tensor(keys, tuple(shape), tuple(targets), tied_by))

    d_model, n_head, d_head = cfg.d_model, cfg.n_head, cfg.d_head
    heads_in = functools.partial(_heads_in, n_head=n_head, d_head=d_head)
    bounds = cfg.cluster_bounds
    n_clusters = len(bounds) - 1
    single_table = cfg.div_val == 1
    n_tables = 1 if single_table else n_clusters
    has_projs = not single_table or cfg.d_embed != cfg.d_model

    # Adaptive embedding and softmax.
    for t in range(n_tables):
        shape = (cfg.vocab_size if single_table else bounds[t + 1] - bounds[t], cfg.cluster_dim(t))
        emb, out = f'transformer.word_emb.emb_layers.{t}.weight', f'crit.out_layers.{t}.weight'
        if cfg.tie_weight:
            add((emb, out), shape, (f'io/emb_table_{t}', same), tied_by='tie_word_embeddings')
        else:
            add(emb, shape, (f'io/emb_table_{t}', same))
            add(out, shape, (f'io/out_table_{t}', same))
        if has_projs:
            tied_outs = [f'crit.out_projs.{i}' for i in range(n_clusters)
                         if cfg.tie_projs[i] and (single_table or i == t)]
            add((f'transformer.word_emb.emb_projs.{t}', *tied_outs), (d_model, cfg.cluster_dim(t)),
                (f'io/emb_proj_{t}', transpose), tied_by='tie_projs')
    for i in range(n_clusters):
        if has_projs and not cfg.tie_projs[i]:
            add(f'crit.out_projs.{i}', (d_model, cfg.cluster_dim(0 if single_table else i)),
                (f'io/out_proj_{i}', transpose))
        if not single_table:
            add(f'crit.out_layers.{i}.bias', (bounds[i + 1] - bounds[i],), (f'io/out_bias_{i}', same))
    if single_table:
        add('crit.out_layers.0.bias', (cfg.vocab_size,),
            *((f'io/out_bias_{i}', functools.partial(_rows, lo=bounds[i], hi=bounds[i + 1]))
              for i in range(n_clusters)))
    if n_clusters > 1:
        add('crit.cluster_weight', (n_clusters - 1, cfg.d_embed), ('io/cluster_kernel', transpose))
        add('crit.cluster_bias', (n_clusters - 1,), ('io/cluster_bias', same))

    # Position biases: one pair for the model, shared by every layer, unless untie_r.
    for hf_name, name in (('r_w_bias', 'u_bias'), ('r_r_bias', 'v_bias')):
        layer_keys = [f'transformer.layers.{l}.dec_attn.{hf_name}' for l in range(cfg.n_layer)]
        if cfg.untie_r:
            for l, key in enumerate(layer_keys):
                add(key, (n_head, d_head), (f'layer_{l}/{name}', same))
        else:
            add((f'transformer.{hf_name}', *layer_keys), (n_head, d_head), (name, same), tied_by='untie_r')

    for l in range(cfg.n_layer):
        hf, mj = f'transformer.layers.{l}.', f'layer_{l}/'
        width = n_head * d_head
        add(hf + 'dec_attn.qkv_net.weight', (3 * width, d_model),
            *((f'{mj}attention/{name}/kernel',
               functools.partial(_qkv_part, part=part, n_head=n_head, d_head=d_head))
              for part, name in enumerate(('query', 'key', 'value'))))
        add(hf + 'dec_attn.r_net.weight', (width, d_model), (mj + 'attention/pos/kernel', heads_in))
        add(hf + 'dec_attn.o_net.weight', (d_model, width),
            (mj + 'attention/out/kernel', functools.partial(_heads_out, n_head=n_head, d_head=d_head)))
        for hf_block, mj_block in (('dec_attn', 'attention'), ('pos_ff', 'feed_forward')):
            add(f'{hf}{hf_block}.layer_norm.weight', (d_model,), (f'{mj}{mj_block}/layer_norm/scale', same))
            add(f'{hf}{hf_block}.layer_norm.bias', (d_model,), (f'{mj}{mj_block}/layer_norm/bias', same))
        for index, name, shape in ((0, 'inner', (cfg.d_inner, d_model)), (3, 'outer', (d_model, cfg.d_inner))):
            add(f'{hf}pos_ff.CoreNet.{index}.weight', shape, (f'{mj}feed_forward/{name}/kernel', transpose))
            add(f'{hf}pos_ff.CoreNet.{index}.bias', shape[:1], (f'{mj}feed_forward/{name}/bias', same))
    return layout


def params_from_hf_state_dict(state_dict: Mapping[str, Any], config: ModelConfig,
                              source: str = 'state dict') -> dict[str, Any]:
    """Converts an HF TransfoXLLMHeadModel state dict into memjax params (nested dict, float32 numpy).

    Args:
      state_dict: key -> tensor (torch or numpy); tied tensors may appear under one key or several.
      config: the memjax config, from `model_config_from_hf`.
      source: names the checkpoint in error messages.
    """
    inv_freq = state_dict.get(_INV_FREQ)
    params = hf_io.convert_tensors({k: v for k, v in state_dict.items() if k != _INV_FREQ}, _hf_layout(config),
                                   config, source, 'TransfoXLLMHeadModel')
    if inv_freq is not None:  # Not imported (memjax recomputes it); a mismatch means other positions.
        inv_freq = hf_io.to_float32(inv_freq)
        expected = 1.0 / (10000.0 ** (np.arange(0, config.d_model, 2, dtype=np.float32) / config.d_model))
        # Loose: bf16 checkpoints round it.
        if inv_freq.shape != expected.shape or not np.allclose(inv_freq, expected, rtol=1e-2):
            raise CheckpointError(f'{source}: {_INV_FREQ!r} differs from the Transformer-XL sinusoid '
                                  'frequencies 1 / 10000**(2i / d_model); memjax cannot reproduce it.')
    return params


def load_hf_checkpoint(path: str, hf_config: Optional[HFConfig] = None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) from an HF checkpoint; the config defaults to the config.json beside it."""
    return hf_io.load_checkpoint(path, hf_config, model_config_from_hf, params_from_hf_state_dict)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = hf_io.command_flags(
        argv, 'memjax.convert.hf_transfo_xl',
        'import Hugging Face TransfoXLLMHeadModel weights (transformers <= 4.37) into memjax (config.json + '
        'params.msgpack). safetensors files need no extra; .bin files need torch: pip install -e \'.[parity]\'.',
        required={'checkpoint': 'save_pretrained directory, or a .safetensors / .bin state-dict file',
                  'out': 'directory to write the memjax parameters into'},
        optional={'config': f'HF {hf_io.CONFIG_FILE}; default: the one in or next to --checkpoint'})

    def job():
        config, params = load_hf_checkpoint(args.checkpoint, args.config)
        save_imported(args.out, config, params)
        return (f'Imported {hf_io.parameter_count(params):,} parameters into {args.out} ({config_summary(config)}, '
                f'memory_start={config.memory_start!r}).')

    hf_io.run_import(job)


if __name__ == '__main__':
    hf_io.command_main(main)
