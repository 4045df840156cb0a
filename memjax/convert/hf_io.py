"""What every HF importer shares: reading checkpoints safely (safetensors, or torch's restricted
weights_only loader where an importer allows PyTorch files), mapping tensors by a layout, checking
the result against the model, and memjax's own saved-params format.

An importer (hf_transfo_xl, hf_gpt2) describes each HF tensor as a `Tensor`: the keys that may
hold it, its HF shape and the memjax parameters computed from it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from absl import flags
from absl import logging as absl_logging
import flax.serialization
import jax
import numpy as np
from flax import traverse_util

from memjax import errors
from memjax.runtime import logs
from memjax.model import ModelConfig, convert_layer_layout, init_params
from memjax import path_flags

CONFIG_FILE = 'config.json'
PARAMS_FILE = 'params.msgpack'
_FORMAT = 'memjax-params/1'
# Checkpoint file names written by `save_pretrained`, in the order they are looked for.
_HF_WEIGHT_FILES = ('model.safetensors', 'model.safetensors.index.json',
                    'pytorch_model.bin', 'pytorch_model.bin.index.json')

HFConfig = Union[str, os.PathLike, Mapping[str, Any], Any]  # config.json path, dict, PretrainedConfig.


class CheckpointError(errors.CheckpointError):
    """A checkpoint or config that cannot be imported; the message names the key or option."""
    label = 'Import error'


def hf_config_dict(hf_config: HFConfig) -> dict[str, Any]:
    if isinstance(hf_config, (str, os.PathLike)):
        with open(hf_config) as f:
            return json.load(f)
    if hasattr(hf_config, 'to_dict'):
        return hf_config.to_dict()
    return dict(hf_config)


def same(w: np.ndarray) -> np.ndarray:
    return w


def transpose(w: np.ndarray) -> np.ndarray:
    return w.T


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One HF tensor: the keys that may hold it (several when HF ties them by sharing), its HF shape,
    and the memjax parameters ('a/b/c' paths) computed from it."""

    keys: tuple[str, ...]
    shape: tuple[int, ...]
    targets: tuple[tuple[str, Callable[[np.ndarray], np.ndarray]], ...]
    tied_by: str = ''  # The HF config field that makes `keys` one tensor.


def to_float32(value: Any) -> np.ndarray:
    if hasattr(value, 'detach'):  # A torch tensor (bfloat16 included).
        value = value.detach().cpu().float().numpy()
    return np.asarray(value).astype(np.float32)


def config_summary(cfg: ModelConfig) -> str:
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
        raise CheckpointError(f'{source}: parameters do not fit the model ({config_summary(config)}): '
                              + '; '.join(problems))


def convert_tensors(state_dict: Mapping[str, Any], layout: list[Tensor], config: ModelConfig, source: str,
                    model_name: str, ignore: Callable[[str], bool] = lambda key: False) -> dict[str, Any]:
    """memjax params (nested dict, float32 numpy) from an HF state dict laid out as `layout`.

    Every key must be in the layout (or `ignore`d: buffers), every tensor present with its shape,
    tied copies equal; the result must fit `config` exactly.
    """
    arrays = {key: to_float32(value) for key, value in state_dict.items()}
    known = {key for tensor in layout for key in tensor.keys}
    problems = []
    unknown = sorted(key for key in set(arrays) - known if not ignore(key))
    if unknown:
        problems.append(f'unexpected keys {unknown}')
    missing = [' or '.join(t.keys) for t in layout if not any(key in arrays for key in t.keys)]
    if missing:
        problems.append(f'missing keys {missing}')
    for tensor in layout:
        for key in tensor.keys:
            if key in arrays and arrays[key].shape != tensor.shape:
                problems.append(f'key {key!r} has shape {list(arrays[key].shape)}, expected {list(tensor.shape)}')
    if problems:
        raise CheckpointError(f'{source} does not match an HF {model_name} with '
                              f'{config_summary(config)}: ' + '; '.join(problems)
                              + '. Check that the config.json belongs to these weights.')
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
# Reading HF checkpoints: safetensors, or torch's weights_only loader (tensors and plain containers,
# no code from the file) unless the importer takes safetensors only.


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    import safetensors.numpy  # pylint: disable=g-import-not-at-top  (only needed here)
    return safetensors.numpy.load_file(path)  # bfloat16 works: jax registers ml_dtypes with numpy.


def refusal(error: Exception) -> str:
    """Why torch's weights-only loader refused a file, in its own specific words (the line naming
    the global or opcode), without its advice to load the file unsafely."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    specific = next((line for line in lines if line.startswith('WeightsUnpickler error:')), None)
    if specific is not None:
        return specific.removeprefix('WeightsUnpickler error:').strip().split('. ')[0]  # Not its allowlisting advice.
    if lines and 'weights_only' not in lines[0]:
        return lines[0]
    return type(error).__name__


def damaged(error: Exception) -> bool:
    """Whether torch's loader failed on a file cut short or corrupted, rather than on what it holds:
    a truncated zip archive, a legacy file that ends early (the original Transformer-XL's)."""
    text = str(error)
    return isinstance(error, (OSError, EOFError)) or any(
        sign in text for sign in ('failed reading zip archive', 'unexpected EOF', 'corrupted', 'truncated'))


def _read_torch_bin(path: str) -> Mapping[str, Any]:
    try:
        import torch  # pylint: disable=g-import-not-at-top  (optional dependency)
    except ImportError as e:
        raise CheckpointError(f'{path} is a PyTorch file and reading it needs torch: '
                              "pip install -e '.[parity]', or re-save the model as safetensors.") from e
    try:
        state = torch.load(path, map_location='cpu', weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, EOFError, ValueError) as error:
        advice = ('the file is truncated or damaged, or not torch\'s: download it again' if damaged(error)
                  or not isinstance(error, pickle.UnpicklingError)
                  else 'memjax never runs code from a checkpoint: re-save the weights as safetensors from code you trust')
        raise CheckpointError(f'{path} is not a file of tensors this importer reads safely ({refusal(error)}); '
                              f'{advice}.') from error
    if not isinstance(state, Mapping):
        raise CheckpointError(f'{path} holds a {type(state).__name__}, not a state dict (key -> tensor).')
    return state


_SAFETENSORS_ONLY = ('reads only safetensors (never unpickling): HF downloads have model.safetensors, '
                     'or re-save with save_pretrained(..., safe_serialization=True).')


def _read_weights_file(path: str, safetensors_only: bool = False) -> Mapping[str, Any]:
    if path.endswith('.index.json'):  # A sharded checkpoint: weight_map names the shard of each key.
        with open(path) as f:
            shards = sorted(set(json.load(f)['weight_map'].values()))
        state = {}
        for shard in shards:
            if os.path.basename(shard) != shard:
                raise CheckpointError(f'{path} names shard {shard!r} outside its directory.')
            state.update(_read_weights_file(os.path.join(os.path.dirname(path), shard), safetensors_only))
        return state
    if path.endswith('.safetensors'):
        return _read_safetensors(path)
    if path.endswith(('.bin', '.pt', '.pth')):
        if safetensors_only:
            raise CheckpointError(f'{path} is a PyTorch pickle; this importer {_SAFETENSORS_ONLY}')
        return _read_torch_bin(path)
    raise CheckpointError(f'{path}: unsupported weights file; give a save_pretrained directory, a '
                          '.safetensors file or a PyTorch state-dict file (.bin).')


def read_hf_checkpoint(path: str, safetensors_only: bool = False) -> tuple[Mapping[str, Any], Optional[str]]:
    """Reads the weights of a save_pretrained directory or a single weights file (with
    `safetensors_only`, a PyTorch file is refused, never unpickled).

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
    return _read_weights_file(weights, safetensors_only), config_path if os.path.isfile(config_path) else None


# ----------------------------------------------------------------------------------------------
# memjax's own format for imported parameters: config JSON + flax msgpack (no pickle). Nothing in
# it is HF-specific, so importers from other families can save through it too.


def load_checkpoint(path: str, hf_config: Optional[HFConfig], config_from_hf: Callable[[HFConfig], ModelConfig],
                    params_from_state_dict: Callable[..., dict],
                    safetensors_only: bool = False) -> tuple[ModelConfig, dict]:
    """(ModelConfig, params) from an HF checkpoint through one family's importer; the HF config
    defaults to the config.json beside the weights."""
    state, found_config = read_hf_checkpoint(path, safetensors_only)
    if hf_config is None:
        if found_config is None:
            raise CheckpointError(f'no {CONFIG_FILE} next to {path}; pass the HF config (--config).')
        hf_config = found_config
    config = config_from_hf(hf_config)
    return config, params_from_state_dict(state, config, source=path)


def command_flags(argv: Optional[Sequence[str]], prog: str, about: str, required: Mapping[str, str],
                  optional: Mapping[str, str] = {}) -> flags.FlagValues:  # pylint: disable=dangerous-default-value
    """An import command's flags (`--name=value`), parsed by absl as every memjax command's, into a
    FlagValues of their own: the importers are also library modules, imported by commands whose
    flags (--config) would collide in absl's global ones. `--help` prints `about`, which names what
    the command needs, and the flags; a missing, unknown or extra argument is one line."""
    values = flags.FlagValues()
    for name, text in {**required, **optional}.items():
        path_flags.define(name, None, text, flag_values=values)  # Every flag of an import names a file.
    argv = sys.argv[1:] if argv is None else list(argv)
    if {'--help', '-h', '--helpfull'} & set(argv):
        listed = [f'  --{name}: {text}' for name, text in required.items()]
        print('\n'.join([f'python -m {prog}: {about}', '', *listed,
                         *[f'  --{name}: {text} (optional)' for name, text in optional.items()]]))
        sys.exit(0)

    def refuse(problem: str):
        print(f'{errors.UsageError.label}: {problem}; python -m {prog} --help lists its flags.', file=sys.stderr)
        sys.exit(errors.EXIT_USAGE)

    try:
        extra = values([prog, *argv])[1:]
    except flags.Error as error:
        refuse(' '.join(str(error).split()))
    missing = [f'--{name}' for name in required if values[name].value is None]
    if missing or extra:
        refuse(f'missing {", ".join(missing)}' if missing else f'unexpected arguments {extra}')
    return values


def run_import(job: Callable[[], str]) -> None:
    """An import command's body: `job()` reads, converts and writes, then names what it wrote; a
    user error (a refused file, a directory that cannot be written) ends the command in one line."""
    try:
        summary = job()
    except (errors.UserError, OSError) as error:
        label = error.label if isinstance(error, errors.UserError) else CheckpointError.label
        print(f'{label}: {" ".join(str(error).split())}', file=sys.stderr)
        sys.exit(getattr(error, 'exit_code', errors.EXIT_RUNTIME))
    print(summary)


def command_main(main: Callable[[], None]) -> None:
    """Runs an import command's `main` as the command line. A failed checkpoint write (a full disk)
    also fails orbax's threads: their tracebacks and torch's or absl's chatter go to the log
    details, not ahead of the one line that says what to do, and the process ends without waiting
    for those threads, which wait forever after a failed save."""
    absl_logging.use_absl_handler()  # No absl app here: its handler, with memjax's filters, must be the root's.
    logs.quiet_library_logs(verbose='--verbose' in sys.argv)
    try:
        main()
    except SystemExit as stop:
        if stop.code is not None and not isinstance(stop.code, int):
            print(stop.code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(stop.code if isinstance(stop.code, int) else int(stop.code is not None))  # pylint: disable=protected-access


def parameter_count(params: Any) -> int:
    return int(sum(np.size(leaf) for leaf in jax.tree_util.tree_leaves(params)))


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
                                  'a python -m memjax.convert importer.')
    with open(config_path) as f:
        saved = json.load(f)
    if saved.get('format') != _FORMAT:
        raise CheckpointError(f'{config_path} has format {saved.get("format")!r}, expected {_FORMAT!r}.')
    config = ModelConfig(**saved['model'])
    with open(params_path, 'rb') as f:
        params = flax.serialization.msgpack_restore(f.read())
    check_params(config, params, params_path)
    return config, params
