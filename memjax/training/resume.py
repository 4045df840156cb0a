"""What may change between a run and the command that resumes (or evaluates) it.

Every checkpoint stores the config it was trained with. Before anything is restored or
compiled, the requested config is compared with it field by field:

- fields that only schedule, log, evaluate, place or regularise the run may change and
  the change is logged (`RESUME_SAFE`);
- every other field shapes the saved state or the data stream (the model, the data and
  tokenizer, batch size, segment length, seed): a difference stops the command with one
  message listing the fields, old -> new, and the ways forward.

Evaluation only needs the parameters to fit, so it compares the fields that shape them.
"""

import json
from typing import Any, Iterable

from absl import logging
import ml_collections

from memjax import errors
from memjax.model import memories
from memjax.model.config import TRAINING_FIELDS

# Field (or section prefix) -> why it may change when a run resumes.
RESUME_SAFE = {
    'train.num_steps': 'training length',
    'train.log_every': 'logging',
    'train.eval_every': 'validation schedule',
    'train.eval_batches': 'validation size',
    'train.final_eval_batches': 'validation size',
    'train.checkpoint_every': 'checkpoint schedule',
    'train.keep_checkpoints': 'checkpoint retention',
    'train.init_from': 'only read when a workdir has no checkpoint',
    'train.init_from_state': 'only read when a workdir has no checkpoint',
    'train.learning_rate': 'optimizer schedule',
    'train.warmup_steps': 'optimizer schedule',
    'train.min_lr_ratio': 'optimizer schedule',
    'train.b1': 'optimizer hyper-parameter',
    'train.b2': 'optimizer hyper-parameter',
    'train.eps': 'optimizer hyper-parameter',
    'train.grad_accum_steps': 'the same update, computed in more or fewer chunks',
    'train.diverged_loss': 'a stopping rule',
    'model.dropout': 'regularisation',
    'model.dropatt': 'regularisation',
    'model.remat': 'recomputation in the backward pass',
    'model.attention_impl': "the attention's path: the same values",
    'model.init_std': 'only read when parameters are initialised',
    'model.proj_init_std': 'only read when parameters are initialised',
    'data.data_dir': 'location of the prepared data, not its content',
    'data.manual_dir': 'location of the raw files, not their content',
    'data.cache_dir': 'location of the token cache',
    'data.accept_changed_data': 'only read when the training data changed',
    'eval': 'evaluation settings',
    'mesh': 'device layout: checkpoints restore onto any mesh',
}
# Optimizer terms that are in the optimizer state only when they are on (> 0): their value may
# change, switching them on or off may not.
ON_OFF = ('train.clip_norm', 'train.weight_decay')
# Model fields that change what the model computes but not its parameters (the run-time ones among
# them evaluation may override: config.eval.model), or only how they start.
NOT_PARAMS = ('model.dropout', 'model.dropatt', 'model.compute_dtype', 'model.remat', 'model.segment_len',
              'model.init_std', 'model.proj_init_std') + tuple(
    'model.' + name for name in memories.run_time_fields() + TRAINING_FIELDS)
# Fields whose default computes something else than memjax did before they existed: a saved run of
# that memory kind without the field ran with this value.
ADDED_WITH_NEW_DEFAULT = {'model.ltm_padding': ('infinity', 'even')}
TOKENIZER = ('data.tokenizer', 'data.vocab_path', 'data.sp_vocab_size', 'data.word_min_freq',
             'data.word_max_size', 'data.drop_bytes')


def to_plain(config: Any) -> dict:
    """The config as JSON would store it (tuples become lists), for comparison and saving."""
    if isinstance(config, ml_collections.ConfigDict):
        config = config.to_dict()
    return json.loads(json.dumps(config))


def _flatten(tree: dict, prefix: str = '') -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        name = f'{prefix}{key}'
        if isinstance(value, dict):
            flat.update(_flatten(value, f'{name}.'))
        else:
            flat[name] = value
    return flat


def differences(saved: dict, requested: dict) -> list[tuple[str, Any, Any]]:
    """(field, saved value, requested value) for every field both configs have and that differ.

    Fields new to this memjax version (absent from the saved config) and fields it no longer
    has are left out: neither run asked for a value, except where the saved run computed
    something the new default does not (ADDED_WITH_NEW_DEFAULT). `model.vocab_size = -1` means
    "from the tokenizer", `model.segment_len = -1` "from the data's tgt_len" (compared in its own
    field), which a saved config (an imported model's) may hold resolved.
    """
    old, new = _flatten(to_plain(saved)), _flatten(to_plain(requested))
    for name, (memory, value) in ADDED_WITH_NEW_DEFAULT.items():
        if name not in old and old.get('model.memory') == memory:
            old[name] = value
    changed = []
    for name in sorted(set(old) & set(new)):
        if name in ('model.vocab_size', 'model.segment_len') and new[name] == -1:
            continue
        if old[name] != new[name]:
            changed.append((name, old[name], new[name]))
    return changed


def _matches(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + '.') for p in prefixes)


def _safe_on_resume(name: str, old: Any, new: Any) -> bool:
    if name in ON_OFF:
        return (old > 0) == (new > 0)
    return _matches(name, RESUME_SAFE)


def shapes_params(name: str) -> bool:
    """Whether field `name` can change the parameters' shapes or meaning."""
    return (name.startswith('model.') and not _matches(name, NOT_PARAMS)) or name in TOKENIZER


def _describe(changes: list[tuple[str, Any, Any]]) -> str:
    return ', '.join(f'{name} {old!r} -> {new!r}' for name, old, new in changes)


def check_resume(saved: dict, requested: Any, workdir: str, source: str) -> None:
    """Raises ConfigError when `requested` cannot continue the run saved with `saved`.

    Allowed changes are logged. `source` names the checkpoint the saved config comes from.
    """
    changes = differences(saved, requested)
    blocking = [c for c in changes if not _safe_on_resume(*c)]
    if blocking:
        raise errors.ConfigError(
            f'{workdir} holds a run trained with another config ({source}), and these fields '
            f'shape its saved state or data stream: {_describe(blocking)}. Either go back to the '
            'saved values, or use a new --workdir: to start it from this run\'s parameters add '
            f'--config.train.init_from={workdir} (with --config.train.init_from_state='
            'params_and_optimizer to keep the optimizer state and step); see docs/failures.md.')
    for name, old, new in changes:
        logging.warning('Resuming with %s changed: %r -> %r (%s).', name, old, new,
                        RESUME_SAFE.get(name) or RESUME_SAFE.get(name.split('.')[0], 'allowed'))


def check_same_params(saved: dict, requested: Any, source: str, purpose: str) -> None:
    """Raises ConfigError when `requested` makes parameters of other shapes than `saved`.

    `purpose` is 'Evaluation' or 'config.train.init_from'.
    """
    blocking = [c for c in differences(saved, requested) if shapes_params(c[0])]
    if purpose == 'Evaluation':  # It reads the parameters in either layer layout (restore.newest_params).
        blocking = [c for c in blocking if c[0] != 'model.scan_layers']
    old, new = next(((old, new) for name, old, new in blocking if name == 'model.memory'), (None, None))
    if purpose == 'Evaluation' and new in memories.names() and old in memories.kind_class(new).runs_on:
        raise errors.ConfigError(
            f'{source} was trained as memory={old!r}; memory={new!r} runs on its parameters at evaluation: '
            f'keep config.model.memory={old!r} and add --config.eval.model.memory={new}.')
    if blocking:
        raise errors.ConfigError(
            f'{purpose} needs the parameters of {source}, which was trained with other model or '
            f'tokenizer settings: {_describe(blocking)}. Use its values (its config.json); only '
            'fields that do not shape the parameters may differ ('
            + ('set run-time fields such as mem_len in config.eval.model).' if purpose == 'Evaluation'
               else 'data, batch and segment sizes, mem_len, dropout, the optimizer).'))

