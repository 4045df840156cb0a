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

import argparse
import dataclasses
import functools
import json
import os
import sys
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import flax.serialization
import jax
import numpy as np
from flax import traverse_util

from memjax import errors
from memjax.model import ModelConfig, convert_layer_layout, init_params

CONFIG_FILE = 'config.json'
PARAMS_FILE = 'params.msgpack'
_FORMAT = 'memjax-params/1'
_INV_FREQ = 'transformer.pos_emb.inv_freq'  # A buffer: checked, not imported.
# Checkpoint file names written by `save_pretrained`, in the order they are looked for.
_HF_WEIGHT_FILES = ('model.safetensors', 'model.safetensors.index.json',
                    'pytorch_model.bin', 'pytorch_model.bin.index.json')
# HF config fields that change the parameters or the numerics; config.json always holds them.
_REQUIRED_HF_FIELDS = ('vocab_size', 'd_model', 'd_embed', 'n_head', 'd_head', 'd_inner', 'n_layer',
                       'cutoffs', 'div_val', 'pre_lnorm', 'untie_r', 'same_length', 'clamp_len',
                       'mem_len', 'layer_norm_epsilon', 'dropout', 'dropatt')

HFConfig = Union[str, os.PathLike, Mapping[str, Any], Any]  # config.json path, dict, TransfoXLConfig.


class CheckpointError(errors.CheckpointError):
    """A checkpoint or config that cannot be imported; the message names the key or option."""
    label = 'Import error'


# ----------------------------------------------------------------------------------------------
# Config.


def _hf_config_dict(hf_config: HFConfig) -> dict[str, Any]:
    if isinstance(hf_config, (str, os.PathLike)):
        with open(hf_config) as f:
            return json.load(f)
    if hasattr(hf_config, 'to_dict'):
        return hf_config.to_dict()
    return dict(hf_config)


def model_config_from_hf(hf_config: HFConfig) -> ModelConfig:
    """The memjax ModelConfig computing what HF's `TransfoXLLMHeadModel` with this config computes.

    Args:
      hf_config: a `TransfoXLConfig`, its `to_dict()`, or the path of its config.json.
    """
    fields = _hf_config_dict(hf_config)
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
            mem_len=int(fields['mem_len']), clamp_len=int(fields['clamp_len']),
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


def _same(w: np.ndarray) -> np.ndarray:
    return w


def _transpose(w: np.ndarray) -> np.ndarray:
    return w.T


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


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """One HF tensor: the keys that may hold it (several when HF ties them by sharing), its HF shape,
    and the memjax parameters ('a/b/c' paths) computed from it."""

    keys: tuple[str, ...]
    shape: tuple[int, ...]
    targets: tuple[tuple[str, Callable[[np.ndarray], np.ndarray]], ...]
    tied_by: str = ''  # The HF config field that makes `keys` one tensor.


def _hf_layout(cfg: ModelConfig) -> list[_Tensor]:
    """Every tensor of an HF TransfoXLLMHeadModel with this config and where it goes in memjax."""
    layout = []

    def add(keys, shape, *targets, tied_by=''):
        keys = (keys,) if isinstance(keys, str) else tuple(keys)
        layout.append(_Tensor(keys, tuple(shape), tuple(targets), tied_by))

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
            add((emb, out), shape, (f'io/emb_table_{t}', _same), tied_by='tie_word_embeddings')
        else:
            add(emb, shape, (f'io/emb_table_{t}', _same))
            add(out, shape, (f'io/out_table_{t}', _same))
        if has_projs:
            tied_outs = [f'crit.out_projs.{i}' for i in range(n_clusters)
                         if cfg.tie_projs[i] and (single_table or i == t)]
            add((f'transformer.word_emb.emb_projs.{t}', *tied_outs), (d_model, cfg.cluster_dim(t)),
                (f'io/emb_proj_{t}', _transpose), tied_by='tie_projs')
    for i in range(n_clusters):
        if has_projs and not cfg.tie_projs[i]:
            add(f'crit.out_projs.{i}', (d_model, cfg.cluster_dim(0 if single_table else i)),
                (f'io/out_proj_{i}', _transpose))
        if not single_table:
            add(f'crit.out_layers.{i}.bias', (bounds[i + 1] - bounds[i],), (f'io/out_bias_{i}', _same))
    if single_table:
        add('crit.out_layers.0.bias', (cfg.vocab_size,),
            *((f'io/out_bias_{i}', functools.partial(_rows, lo=bounds[i], hi=bounds[i + 1]))
              for i in range(n_clusters)))
    if n_clusters > 1:
        add('crit.cluster_weight', (n_clusters - 1, cfg.d_embed), ('io/cluster_kernel', _transpose))
        add('crit.cluster_bias', (n_clusters - 1,), ('io/cluster_bias', _same))

    # Position biases: one pair for the model, shared by every layer, unless untie_r.
    for hf_name, name in (('r_w_bias', 'u_bias'), ('r_r_bias', 'v_bias')):
        layer_keys = [f'transformer.layers.{l}.dec_attn.{hf_name}' for l in range(cfg.n_layer)]
        if cfg.untie_r:
            for l, key in enumerate(layer_keys):
                add(key, (n_head, d_head), (f'layer_{l}/{name}', _same))
        else:
            add((f'transformer.{hf_name}', *layer_keys), (n_head, d_head), (name, _same), tied_by='untie_r')

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
            add(f'{hf}{hf_block}.layer_norm.weight', (d_model,), (f'{mj}{mj_block}/layer_norm/scale', _same))
            add(f'{hf}{hf_block}.layer_norm.bias', (d_model,), (f'{mj}{mj_block}/layer_norm/bias', _same))
        for index, name, shape in ((0, 'inner', (cfg.d_inner, d_model)), (3, 'outer', (d_model, cfg.d_inner))):
            add(f'{hf}pos_ff.CoreNet.{index}.weight', shape, (f'{mj}feed_forward/{name}/kernel', _transpose))
            add(f'{hf}pos_ff.CoreNet.{index}.bias', shape[:1], (f'{mj}feed_forward/{name}/bias', _same))
    return layout


def _to_float32(value: Any) -> np.ndarray:
    if hasattr(value, 'detach'):  # A torch tensor (bfloat16 included).
        value = value.detach().cpu().float().numpy()
    return np.asarray(value).astype(np.float32)


def _config_summary(cfg: ModelConfig) -> str:
    names = ('vocab_size', 'd_model', 'd_embed', 'n_layer', 'n_head', 'd_head', 'd_inner', 'cutoffs',
             'div_val', 'tie_weight', 'tie_projs', 'untie_r')
    return ', '.join(f'{name}={getattr(cfg, name)}' for name in names)


def expected_params(config: ModelConfig) -> Any:
    """Shapes and dtypes of `init_params(config, key)`, computed without running it."""
    return jax.eval_shape(lambda: init_params(config, jax.random.key(0)))


def check_params(config: ModelConfig, params: Mapping[str, Any], source: str) -> None:
    """Raises CheckpointError unless `params` has exactly the model's tree, shapes and float32."""
    want = traverse_util.flatten_dict(expected_params(config), sep='/')
    have = traverse_util.flatten_dict(dict(params), sep='/')
    problems = [f'missing {path}' for path in sorted(set(want) - set(have))]
    problems += [f'unexpected {path}' for path in sorted(set(have) - set(want))]
    for path in sorted(set(want) & set(have)):
        shape, dtype = tuple(np.shape(have[path])), np.asarray(have[path]).dtype
        if shape != want[path].shape or dtype != np.float32:
            problems.append(f'{path} is {dtype}{list(shape)}, the model needs float32{list(want[path].shape)}')
    if problems:
        raise CheckpointError(f'{source}: parameters do not fit the model ({_config_summary(config)}): '
                              + '; '.join(problems))


def params_from_hf_state_dict(state_dict: Mapping[str, Any], config: ModelConfig,
                              source: str = 'state dict') -> dict[str, Any]:
    """Converts an HF TransfoXLLMHeadModel state dict into memjax params (nested dict, float32 numpy).

    Args:
      state_dict: key -> tensor (torch or numpy); tied tensors may appear under one key or several.
      config: the memjax config, from `model_config_from_hf`.
      source: names the checkpoint in error messages.
    """
    arrays = {key: _to_float32(value) for key, value in state_dict.items()}
    layout = _hf_layout(config)
    known = {key for tensor in layout for key in tensor.keys} | {_INV_FREQ}
    problems = []
    unknown = sorted(set(arrays) - known)
    if unknown:
        problems.append(f'unexpected keys {unknown}')
    missing = [' or '.join(t.keys) for t in layout if not any(key in arrays for key in t.keys)]
    if missing:
        problems.append(f'missing keys {missing}')
    for tensor in layout:
        for key in tensor.keys:
            if key in arrays and arrays[key].shape != tensor.shape:
                problems.append(f'key {key!r} has shape {list(arrays[key].shape)}, expected {list(tensor.shape)}')
    if _INV_FREQ in arrays and arrays[_INV_FREQ].shape != (config.d_model // 2,):
        problems.append(f'key {_INV_FREQ!r} has shape {list(arrays[_INV_FREQ].shape)}, '
                        f'expected {[config.d_model // 2]}')
    if problems:
        raise CheckpointError(f'{source} does not match an HF TransfoXLLMHeadModel with '
                              f'{_config_summary(config)}: ' + '; '.join(problems)
                              + '. Check that the config.json belongs to these weights.')

    if _INV_FREQ in arrays:  # Not imported (memjax recomputes it); a mismatch means other positions.
        inv_freq = 1.0 / (10000.0 ** (np.arange(0, config.d_model, 2, dtype=np.float32) / config.d_model))
        if not np.allclose(arrays[_INV_FREQ], inv_freq, rtol=1e-2):  # Loose: bf16 checkpoints round it.
            raise CheckpointError(f'{source}: {_INV_FREQ!r} differs from the Transformer-XL sinusoid '
                                  'frequencies 1 / 10000**(2i / d_model); memjax cannot reproduce it.')
    flat = {}
    for tensor in layout:
        present = [key for key in tensor.keys if key in arrays]
        value = arrays[present[0]]
        for other in present[1:]:
            if not np.array_equal(arrays[other], value):
                raise CheckpointError(f'{source}: {other!r} differs from {present[0]!r}, but the config '
                                      f'({tensor.tied_by}) makes them one tensor; fix {tensor.tied_by} in '
                                      'config.json or re-save the checkpoint.')
        for path, convert in tensor.targets:
            flat[tuple(path.split('/'))] = np.ascontiguousarray(convert(value), dtype=np.float32)
    # HF's layers are separate tensors ('layer_{i}'); a scan_layers config stacks them.
    params = convert_layer_layout(traverse_util.unflatten_dict(flat), config.scan_layers)
    check_params(config, params, source)
    return params


# ----------------------------------------------------------------------------------------------
# Reading HF checkpoints (never by unpickling: safetensors, or torch's weights_only loader).


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    import safetensors.numpy  # pylint: disable=g-import-not-at-top  (only needed here)
    return safetensors.numpy.load_file(path)  # bfloat16 works: jax registers ml_dtypes with numpy.


def _read_torch_bin(path: str) -> Mapping[str, Any]:
    try:
        import torch  # pylint: disable=g-import-not-at-top  (optional dependency)
    except ImportError as e:
        raise CheckpointError(f'{path} is a PyTorch file and reading it needs torch: '
                              "pip install -e '.[parity]', or re-save the model as safetensors.") from e
    state = torch.load(path, map_location='cpu', weights_only=True)
    if not isinstance(state, Mapping):
        raise CheckpointError(f'{path} holds a {type(state).__name__}, not a state dict (key -> tensor).')
    return state


def _read_weights_file(path: str) -> Mapping[str, Any]:
    if path.endswith('.index.json'):  # A sharded checkpoint: weight_map names the shard of each key.
        with open(path) as f:
            shards = sorted(set(json.load(f)['weight_map'].values()))
        state = {}
        for shard in shards:
            if os.path.basename(shard) != shard:
                raise CheckpointError(f'{path} names shard {shard!r} outside its directory.')
            state.update(_read_weights_file(os.path.join(os.path.dirname(path), shard)))
        return state
    if path.endswith('.safetensors'):
        return _read_safetensors(path)
    if path.endswith(('.bin', '.pt', '.pth')):
        return _read_torch_bin(path)
    raise CheckpointError(f'{path}: unsupported weights file; give a save_pretrained directory, a '
                          '.safetensors file or a PyTorch state-dict file (.bin).')


def read_hf_checkpoint(path: str) -> tuple[Mapping[str, Any], Optional[str]]:
    """Reads the weights of a save_pretrained directory or a single weights file.

    Returns:
      (state dict, path of the config.json in that directory or beside that file, or None).
    """
    if os.path.isdir(path):
        for name in _HF_WEIGHT_FILES:
            if os.path.exists(os.path.join(path, name)):
                weights = os.path.join(path, name)
                break
        else:
            raise CheckpointError(f'{path} holds none of {list(_HF_WEIGHT_FILES)}; is it a '
                                  f'save_pretrained directory? It holds {sorted(os.listdir(path))}.')
        folder = path
    elif os.path.isfile(path):
        weights, folder = path, os.path.dirname(path)
    else:
        raise CheckpointError(f'checkpoint {path} does not exist.')
    config_path = os.path.join(folder, CONFIG_FILE)
    return _read_weights_file(weights), config_path if os.path.isfile(config_path) else None


def load_hf_checkpoint(path: str, hf_config: Optional[HFConfig] = None) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) from an HF checkpoint; the config defaults to the config.json beside it."""
    state, found_config = read_hf_checkpoint(path)
    if hf_config is None:
        if found_config is None:
            raise CheckpointError(f'no {CONFIG_FILE} next to {path}; pass the HF config (--config).')
        hf_config = found_config
    config = model_config_from_hf(hf_config)
    return config, params_from_hf_state_dict(state, config, source=path)


# ----------------------------------------------------------------------------------------------
# memjax's own format for imported parameters: config JSON + flax msgpack (no pickle). Nothing in
# it is HF-specific, so importers from other families can save through it too.


def save_imported(out_dir: str, config: ModelConfig, params: Mapping[str, Any]) -> None:
    """Writes `out_dir/config.json` (the ModelConfig) and `out_dir/params.msgpack`."""
    check_params(config, params, 'params to save')
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CONFIG_FILE), 'w') as f:
        json.dump({'format': _FORMAT, 'model': dataclasses.asdict(config)}, f, indent=2)
    with open(os.path.join(out_dir, PARAMS_FILE), 'wb') as f:
        f.write(flax.serialization.msgpack_serialize(jax.tree_util.tree_map(np.asarray, dict(params))))


def load_imported(directory: str) -> tuple[ModelConfig, dict]:
    """Reads what `save_imported` wrote: (ModelConfig, params as a nested dict of numpy arrays).

    Use as `build_model(config).apply({'params': params}, ...)`; run-time fields (mem_len,
    clamp_len, same_length, memory_start) can be changed with `config.replace`.
    """
    config_path = os.path.join(directory, CONFIG_FILE)
    params_path = os.path.join(directory, PARAMS_FILE)
    for path in (config_path, params_path):
        if not os.path.isfile(path):
            raise CheckpointError(f'{path} is missing; write the directory with save_imported or '
                                  'python -m memjax.convert.hf_transfo_xl.')
    with open(config_path) as f:
        saved = json.load(f)
    if saved.get('format') != _FORMAT:
        raise CheckpointError(f'{config_path} has format {saved.get("format")!r}, expected {_FORMAT!r}.')
    config = ModelConfig(**saved['model'])
    with open(params_path, 'rb') as f:
        params = flax.serialization.msgpack_restore(f.read())
    check_params(config, params, params_path)
    return config, params


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog='python -m memjax.convert.hf_transfo_xl',
        description='Import HF TransfoXLLMHeadModel weights into memjax (config.json + params.msgpack).')
    parser.add_argument('--checkpoint', required=True,
                        help='save_pretrained directory, or a .safetensors / .bin state-dict file')
    parser.add_argument('--config', default=None,
                        help=f'HF {CONFIG_FILE}; default: the one in or next to --checkpoint')
    parser.add_argument('--out', required=True, help='directory to write the memjax parameters into')
    args = parser.parse_args(argv)
    try:
        config, params = load_hf_checkpoint(args.checkpoint, args.config)
        save_imported(args.out, config, params)
    except (CheckpointError, OSError) as e:  # OSError: --out not writable, say.
        print(f'{CheckpointError.label}: {e}', file=sys.stderr)
        sys.exit(errors.EXIT_RUNTIME)
    count = sum(np.size(leaf) for leaf in jax.tree_util.tree_leaves(params))
    print(f'Imported {count:,} parameters into {args.out} ({_config_summary(config)}, '
          f'memory_start={config.memory_start!r}).')


if __name__ == '__main__':
    main()
