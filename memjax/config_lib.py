"""Shared config defaults and up-front validation of a whole experiment config.

Every `configs/*.py` starts from `base_config()` and only states what differs, so a
field added here reaches all experiments. `validate_config` runs before anything is
built or compiled: a typo in a length or a batch size should cost a second, not a
compilation and a crash deep inside XLA.
"""

import dataclasses
import importlib.util
import math
import os
import typing
from typing import Any

import ml_collections
from ml_collections import config_dict

from memjax.errors import ConfigError  # re-exported: config_lib.ConfigError is public
from memjax.model import memories
from memjax.model.config import RUN_TIME_FIELDS, TRAINING_FIELDS, ModelConfig

DATA_NAMES = ('embedded', 'wikitext103', 'enwik8', 'text8', 'pg19', 'text', 'sorting')
TOKENIZERS = ('byte', 'char', 'word', 'sentencepiece', 'gpt2_bpe', 'sorting')
SPLITS = ('train', 'validation', 'valid', 'test')
MESH_AXES = ('data', 'fsdp', 'tensor')
INIT_FROM_STATES = ('params', 'params_and_optimizer')


def base_config() -> ml_collections.ConfigDict:
    """Defaults shared by all experiments (a small byte-level Transformer-XL)."""
    config = ml_collections.ConfigDict()
    config.seed = 0

    # ModelConfig holds the defaults; the base experiment is a small byte-level model.
    config.model = ml_collections.ConfigDict(model_defaults())
    config.model.update(d_model=128, n_layer=4, n_head=4, d_head=32, d_inner=512, mem_len=64)

    config.data = ml_collections.ConfigDict(dict(
        name='embedded',
        data_dir='~/tensorflow_datasets',
        manual_dir='',
        text_path='',
        tokenizer='byte',
        vocab_path='',
        sp_vocab_size=8000,
        word_min_freq=1,  # words seen fewer times in train become <unk>.
        word_max_size=0,  # 0: no cap on the word vocabulary (specials included).
        heldout_size=5_000_000,  # enwik8 / text8: bytes or characters of validation and of test.
        cache_dir='',  # '': <data_dir>/memjax_token_cache.
        reset_at_doc_boundary=False,
        # > 0: only the first N documents of the train split, in the prepared order (PG-19: by book
        # id); the infinity-former fine-tunes on PG-19's first 2,000 books.
        train_documents=0,
        # A resumed run whose training data reads as other token ids than it was trained on stops;
        # True: it continues on the new data, with a warning.
        accept_changed_data=False,
    ))

    # Reference optimisation: Adam, lr 2.5e-4, linear warmup, cosine decay, clip 0.25.
    config.train = ml_collections.ConfigDict(dict(
        batch_size=16,
        tgt_len=64,
        segments_per_step=1,
        grad_accum_steps=1,
        num_steps=1000,
        learning_rate=2.5e-4,
        # > 0: the peak learning rate of the memory kind's own parameters (the LTM's); -1: as above.
        memory_learning_rate=-1.0,
        warmup_steps=0,
        min_lr_ratio=0.0,
        clip_norm=0.25,  # <= 0: no clipping.
        b1=0.9,
        b2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        log_every=100,
        eval_every=1000,  # 0: only the final validation.
        eval_batches=-1,  # -1: the whole validation split.
        checkpoint_every=1000,  # 0: only the final checkpoint.
        keep_checkpoints=3,  # The newest N; the best validated checkpoint is kept beside them.
        # A run whose training or validation loss (nats per scored token) exceeds this has diverged:
        # it stops with exit 3 before that state is saved. -1: 3 ln(vocab_size), three times the
        # loss of a uniform guess; 0: only a NaN or inf loss stops it.
        diverged_loss=-1.0,
        # A workdir, its checkpoints/ folder or one step's folder to start a new run from (read
        # only while this workdir has no checkpoint); init_from_state = 'params' (fresh optimizer,
        # step 0) or 'params_and_optimizer' (Adam moments and step carried over).
        init_from='',
        init_from_state='params',
    ))

    # batch_size, tgt_len -1: as in training. model: fields merged over config.model for
    # evaluation (unset: as in training); only fields that shape no parameter may be set.
    config.eval = ml_collections.ConfigDict(dict(
        split='validation',
        # Also report the accuracy of the argmax prediction on the scored tokens (the sorting task).
        accuracy=False,
        batch_size=-1,
        tgt_len=-1,
        model=eval_model_placeholders(),
    ))

    # Device mesh ('data', 'fsdp', 'tensor'): one size may be -1 (all remaining devices).
    # rules: ((logical_name, mesh_axes), ...) replacing entries of memjax.runtime.sharding.DEFAULT_RULES,
    # e.g. (('vocab', None),) to replicate the vocabulary dimension.
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, rules=()))
    return config


def diverged_loss(train: Any, vocab_size: int) -> float:
    """The loss above which a run has diverged (config.train.diverged_loss resolved); inf: off."""
    if train.diverged_loss == -1:
        return 3.0 * math.log(vocab_size)
    return train.diverged_loss if train.diverged_loss > 0 else math.inf


def model_defaults() -> dict:
    """config.model's fields and defaults, read from ModelConfig (vocab_size -1: the tokenizer's).
    An optional field unset by default is a typed placeholder, so the command line can set it."""
    types = ModelConfig.field_types()
    return {name: default if default is not None else config_dict.placeholder(
        next(t for t in typing.get_args(types[name]) if t is not type(None)))
        for name, default in ModelConfig.defaults().items()}


def eval_model_placeholders() -> ml_collections.ConfigDict:
    """config.eval.model: an unset placeholder for every model field some memory kind lets
    evaluation change, so `--config.eval.model.mem_len=...` works from the command line."""
    defaults = model_defaults()
    # 'memory': a kind that runs on the trained kind's parameters (MemoryKind.runs_on), e.g. 'trams'.
    return ml_collections.ConfigDict(
        {name: config_dict.placeholder(type(defaults[name])) for name in ('memory',) + run_time_fields()})


def run_time_fields(memory: str | None = None) -> tuple[str, ...]:
    """Model fields evaluation may override: every kind's (`memory` None) or one kind's."""
    kinds = [memories.kind_class(memory)] if memory else [memories.kind_class(n) for n in memories.names()]
    return tuple(dict.fromkeys(RUN_TIME_FIELDS + sum((k.run_time_fields for k in kinds), ())))


def eval_model_overrides(config: ml_collections.ConfigDict) -> dict:
    """The config.eval.model fields that are set."""
    return {k: v for k, v in config.eval.model.to_dict().items() if v is not None}


def load_config_module(path: str) -> Any:
    """The configs file at `path` as a module (config files are not a package)."""
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(f'memjax_config_{name}', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """`get_config()` of the configs file at `path` (without command-line overrides)."""
    return load_config_module(path).get_config()


def sibling_module(this_file: str, name: str) -> Any:
    """Configs file `name` next to `this_file` as a module, to share its helpers."""
    return load_config_module(os.path.join(os.path.dirname(os.path.abspath(this_file)), name))


def sibling_config(this_file: str, name: str) -> ml_collections.ConfigDict:
    """`get_config()` of configs file `name` next to `this_file`.

    Config files are loaded by path, not as a package, so a derived config imports its
    parent this way and works from any working directory.
    """
    return load_config_file(os.path.join(os.path.dirname(os.path.abspath(this_file)), name))


def config_options(this_file: str, arg: str, allowed: tuple[str, ...]) -> set[str]:
    """The comma-separated options after `file.py:` of a config file, refusing unknown ones."""
    options = {a for a in arg.split(',') if a}
    if options - set(allowed):
        raise ValueError(f'configs/{os.path.basename(this_file)}: unknown arguments '
                         f'{sorted(options - set(allowed))}; use {", ".join(allowed)}.')
    return options


def evaluate_as_trained(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Drops a parent config's longer evaluation attention (Transformer-XL's): evaluation runs with
    the training segment, memory and clamp, as the memory papers report their main results."""
    config.eval.tgt_len = -1
    config.eval.model.update(mem_len=None, clamp_len=None, same_length=None)
    return config


def shrink_to_smoke(config: ml_collections.ConfigDict, **model: Any) -> ml_collections.ConfigDict:
    """A paper config's `:smoke` variant: the same model family at tiny size (2 x 64, 32-token
    segments, memory 32, full softmax) on the embedded corpus in bytes, about a minute on a CPU;
    `model` sets the method's own fields."""
    config.data.update(name='embedded', tokenizer='byte')
    config.model.update(d_model=64, n_layer=2, n_head=4, d_head=16, d_inner=256, dropout=0.0, cutoffs=(),
                        tie_projs=(), mem_len=32, **model)
    config.train.update(batch_size=8, tgt_len=32, num_steps=600, learning_rate=2e-3, warmup_steps=20,
                        min_lr_ratio=0.1, log_every=100, eval_every=0, checkpoint_every=0)
    return config


def cfg_get(cfg: Any, name: str, default: Any) -> Any:
    """Reads an optional config field (ConfigDict, dict or object); None counts as unset."""
    if isinstance(cfg, dict) or hasattr(cfg, 'get'):
        value = cfg.get(name, default)
    else:
        value = getattr(cfg, name, default)
    return default if value is None else value


def _check(errors: list[str], ok: bool, message: str) -> None:
    if not ok:
        errors.append(message)


def _validate_train(t: Any, process_count: int, errors: list[str]) -> None:
    for name in ('batch_size', 'tgt_len', 'segments_per_step', 'grad_accum_steps', 'num_steps',
                 'keep_checkpoints'):
        _check(errors, getattr(t, name) >= 1,
               f'config.train.{name}={getattr(t, name)} must be >= 1.')
    for name in ('log_every', 'eval_every', 'checkpoint_every'):
        value = getattr(t, name)
        _check(errors, value >= 0, f'config.train.{name}={value} must be >= 0.')
        # The host only sees the state between dispatches of segments_per_step updates.
        if value > 0 and t.segments_per_step >= 1:
            _check(errors, value % t.segments_per_step == 0,
                   f'config.train.{name}={value} must be a multiple of '
                   f'config.train.segments_per_step={t.segments_per_step} (or 0).')
    if t.segments_per_step >= 1:
        _check(errors, t.num_steps % t.segments_per_step == 0,
               f'config.train.num_steps={t.num_steps} must be a multiple of '
               f'config.train.segments_per_step={t.segments_per_step}.')
    if t.grad_accum_steps >= 1 and t.batch_size >= 1:
        per_process = t.grad_accum_steps * process_count
        _check(errors, t.batch_size % per_process == 0,
               f'config.train.batch_size={t.batch_size} must be divisible by '
               f'config.train.grad_accum_steps ({t.grad_accum_steps}) x process count '
               f'({process_count}) = {per_process}: use a multiple of {per_process}.')
    _check(errors, t.learning_rate > 0,
           f'config.train.learning_rate={t.learning_rate} must be > 0.')
    _check(errors, 0 <= t.warmup_steps <= t.num_steps,
           f'config.train.warmup_steps={t.warmup_steps} must lie in [0, num_steps={t.num_steps}].')
    _check(errors, 0.0 <= t.min_lr_ratio <= 1.0,
           f'config.train.min_lr_ratio={t.min_lr_ratio} must lie in [0, 1].')
    for name in ('b1', 'b2'):
        _check(errors, 0.0 <= getattr(t, name) < 1.0,
               f'config.train.{name}={getattr(t, name)} must lie in [0, 1).')
    _check(errors, t.eps > 0, f'config.train.eps={t.eps} must be > 0.')
    _check(errors, t.weight_decay >= 0, f'config.train.weight_decay={t.weight_decay} must be >= 0.')
    _check(errors, t.init_from_state in INIT_FROM_STATES,
           f'config.train.init_from_state={t.init_from_state!r} must be one of {INIT_FROM_STATES}.')
    _check(errors, t.eval_batches == -1 or t.eval_batches >= 1,
           f'config.train.eval_batches={t.eval_batches} must be -1 (whole split) or >= 1.')
    _check(errors, t.diverged_loss in (-1, 0) or t.diverged_loss > 0,
           f'config.train.diverged_loss={t.diverged_loss} must be > 0, -1 (3 ln(vocab_size)) or 0 (off).')


def _validate_eval(e: Any, process_count: int, errors: list[str]) -> None:
    _check(errors, e.split in SPLITS, f'config.eval.split={e.split!r} must be one of {SPLITS}.')
    _check(errors, e.batch_size == -1 or (e.batch_size >= 1 and e.batch_size % process_count == 0),
           f'config.eval.batch_size={e.batch_size} must be -1 (as in training) or a positive '
           f'multiple of the process count ({process_count}).')
    _check(errors, e.tgt_len == -1 or e.tgt_len >= 1,
           f'config.eval.tgt_len={e.tgt_len} must be -1 (as in training) or >= 1.')


def resolve_mesh_shape(mesh_cfg: Any, device_count: int) -> dict[str, int]:
    """Mesh axis sizes with the -1 entry (if any) filled so that they multiply to device_count."""
    sizes = {name: int(mesh_cfg[name]) for name in MESH_AXES}
    fixed = _fixed_mesh_size(sizes)
    return {name: device_count // fixed if size == -1 else size for name, size in sizes.items()}


def _fixed_mesh_size(sizes: dict[str, int]) -> int:
    return math.prod(size for size in sizes.values() if size != -1)


def _validate_mesh(config: Any, process_count: int, device_count: int | None,
                   errors: list[str]) -> None:
    m = config.mesh
    sizes = {name: m[name] for name in MESH_AXES}
    bad = [f'config.mesh.{n}={v}' for n, v in sizes.items()
           if not isinstance(v, int) or (v != -1 and v < 1)]
    _check(errors, not bad, f'{", ".join(bad)}: mesh sizes must be positive ints or -1.')
    _check(errors, list(sizes.values()).count(-1) <= 1,
           f'config.mesh {sizes}: at most one size may be -1 (the remaining devices).')
    for rule in m.rules:
        ok = (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
              and all(axis in MESH_AXES for axis in
                      ((rule[1],) if rule[1] is None or isinstance(rule[1], str) else rule[1])
                      if axis is not None))
        _check(errors, ok, f'config.mesh.rules entry {rule!r} must be (logical_name, mesh_axes) '
               f'with mesh_axes None, one of {MESH_AXES} or a tuple of them.')
    if bad or device_count is None or list(sizes.values()).count(-1) > 1:
        return
    fixed = _fixed_mesh_size(sizes)
    resolved = resolve_mesh_shape(m, device_count)
    shape = 'x'.join(f'{n}={resolved[n]}' for n in MESH_AXES)
    if -1 in sizes.values() and device_count % fixed:
        errors.append(f'config.mesh {sizes}: the fixed sizes multiply to {fixed}, which does not '
                      f'divide the {device_count} devices.')
        return
    if -1 not in sizes.values() and fixed != device_count:
        errors.append(f'config.mesh {shape} has {fixed} devices but {device_count} are present: '
                      'make the sizes multiply to the device count or set one of them to -1.')
        return
    # Streams are split over data x fsdp; each process feeds whole, distinct blocks of them.
    data_parallel = resolved['data'] * resolved['fsdp']
    t = config.train
    per_update = data_parallel * t.grad_accum_steps
    _check(errors, t.batch_size % per_update == 0,
           f'config.train.batch_size={t.batch_size} must be divisible by config.mesh data x fsdp '
           f'({data_parallel}) x config.train.grad_accum_steps ({t.grad_accum_steps}) = {per_update}.')
    eval_batch = eval_setting(config, 'batch_size')
    _check(errors, eval_batch % data_parallel == 0,
           f'evaluation batch size {eval_batch} (config.eval.batch_size, -1 = train) must be '
           f'divisible by config.mesh data x fsdp ({data_parallel}).')
    _check(errors, data_parallel % process_count == 0,
           f'config.mesh data x fsdp ({data_parallel}) must be a multiple of the process count '
           f'({process_count}): every process reads its own share of the streams.')


def _validate_model(config: Any, errors: list[str]) -> None:
    # The vocabulary size is known once the tokenizer is built; until then a stand-in that
    # fits the cutoffs lets every other model field be checked in the same round.
    model_cfg = config.model
    if model_cfg.memory in memories.names() and not memories.kind_class(model_cfg.memory).trainable:
        runs_on = memories.kind_class(model_cfg.memory).runs_on
        errors.append(f'config.model.memory={model_cfg.memory!r} is training-free: set config.model.memory to '
                      f'the kind that was trained ({" or ".join(map(repr, runs_on))}) and evaluate with '
                      f'--config.eval.model.memory={model_cfg.memory}.')
        return
    stand_in = max([int(c) for c in model_cfg.cutoffs] + [1]) + 1
    try:
        mcfg = ModelConfig.from_config_dict(
            model_cfg, vocab_size=None if model_cfg.vocab_size > 0 else stand_in,
            segment_len=config.train.tgt_len)
    except ValueError as error:
        errors.append(f'config.model: {error}')
        return
    try:
        eval_model_config(mcfg, config)
    except ValueError as error:
        errors.append(f'config.eval.model: {error}')
    # A dispatch runs segments_per_step updates in one compiled step, so with one phase.
    steps = config.train.segments_per_step
    late = [s for s in memories.get(mcfg).phase_starts if steps >= 1 and s % steps]
    _check(errors, not late, f'memory={mcfg.memory!r} changes its training phase at steps {late}: '
           f'config.train.segments_per_step={steps} must divide them.')


def eval_model_config(mcfg: ModelConfig, config: ml_collections.ConfigDict) -> ModelConfig:
    """The model config evaluation runs: config.eval.model's set fields over `mcfg`.

    Raises ValueError for a field that would change the parameters (not a run-time field of
    the memory kind) and for invalid values.
    """
    overrides = eval_model_overrides(config)
    memory = overrides.get('memory', mcfg.memory)
    if memory != mcfg.memory:
        runs_on = memories.kind_class(memory).runs_on if memory in memories.names() else ()
        if mcfg.memory not in runs_on:
            users = [n for n in memories.names() if mcfg.memory in memories.kind_class(n).runs_on]
            raise ValueError(f'memory={memory!r} cannot run on parameters trained as memory={mcfg.memory!r}; '
                             f'evaluation may switch to {users or "no other kind"} for them.')
    allowed = run_time_fields(memory)
    refused = sorted(set(overrides) - set(allowed) - {'memory'})
    if refused:
        hint = [n for n in memories.names() if mcfg.memory in memories.kind_class(n).runs_on
                and set(refused) <= set(run_time_fields(n))]
        raise ValueError(f'{refused} cannot differ at evaluation for memory={memory!r}: only {list(allowed)} '
                         'shape no parameter' + (f'; they are fields of memory={hint[0]!r}: add '
                                                 f'--config.eval.model.memory={hint[0]}.' if hint else '.'))
    if config.model.segment_len == -1:
        overrides['segment_len'] = eval_setting(config, 'tgt_len')
    # Evaluation never skips layers nor permutes heads.
    defaults = {name: ModelConfig.defaults()[name] for name in TRAINING_FIELDS}
    return mcfg.replace(**overrides, **defaults)


def validate_config(config: ml_collections.ConfigDict, process_count: int = 1,
                    device_count: int | None = None) -> None:
    """Raises ConfigError listing every problem found in the config, model fields included.

    The vocabulary size is checked again once the tokenizer is built
    (`trainer.resolve_model_configs`). The mesh is checked against `device_count` when it is
    given.
    """
    missing = [s for s in ('model', 'data', 'train', 'eval', 'mesh') if s not in config]
    if missing:
        raise ConfigError(f'config lacks section(s) {missing}: start from '
                          'memjax.config_lib.base_config().')
    errors: list[str] = []
    _check(errors, isinstance(config.seed, int), f'config.seed={config.seed!r} must be an int.')
    _check(errors, config.data.name in DATA_NAMES,
           f'config.data.name={config.data.name!r} must be one of {DATA_NAMES}.')
    _check(errors, config.data.tokenizer in TOKENIZERS,
           f'config.data.tokenizer={config.data.tokenizer!r} must be one of {TOKENIZERS}.')
    _check(errors, config.data.train_documents >= 0,
           f'config.data.train_documents={config.data.train_documents} must be >= 0 (0: every document).')
    _validate_train(config.train, process_count, errors)
    _validate_eval(config.eval, process_count, errors)
    _validate_mesh(config, process_count, device_count, errors)
    _validate_model(config, errors)
    if errors:
        raise ConfigError('invalid config:\n  ' + '\n  '.join(errors))


def eval_setting(config: ml_collections.ConfigDict, name: str) -> int:
    """Evaluation's 'batch_size' or 'tgt_len': config.eval's value, -1 meaning the training one."""
    override = config.eval[name]
    return config.train[name] if override == -1 else override
