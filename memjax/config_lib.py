"""The experiment config: its defaults, and its resolution into typed sections at the entry.

Every `configs/*.py` starts from `base_config()` and only states what differs. The commands
(`memjax.train`, `memjax.evaluate`, `memjax.bench`, `memjax.sweep`) hand the ml_collections
config to `resolve` once: every field is checked before anything is built or compiled (a typo in
a length or a batch size costs a second, not a compilation), -1 placeholders are filled, and the
result is a frozen `RunConfig` of sections. Below the entry each package takes its own section:
the model a `ModelConfig`, the data a `DataConfig`, the mesh a `MeshConfig`, training the run.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import typing
from typing import Any, Mapping, Optional

import ml_collections
from ml_collections import config_dict

from memjax.data.config import SPLITS, DataConfig
from memjax.errors import ConfigError, failed  # ConfigError re-exported: config_lib.ConfigError is public
from memjax.model import memories
from memjax.model.config import ModelConfig
from memjax.runtime.mesh import MeshConfig

INIT_FROM_STATES = ('params', 'params_and_optimizer')
SECTIONS = ('model', 'data', 'train', 'eval', 'mesh')
DECAYS = ('cosine', 'linear')


def _from_mapping(cls: type, section: str, fields: Mapping[str, Any]) -> Any:
    """`cls` from config.<section>, refusing fields it does not have (a typo is not ignored)."""
    values = dict(fields)
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f'config.{section} has unknown fields {unknown}; known fields: {known}.')
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """config.train. Reference optimisation: Adam, lr 2.5e-4, linear warmup, cosine decay, clip 0.25."""

    batch_size: int = 16
    tgt_len: int = 64
    segments_per_step: int = 1
    grad_accum_steps: int = 1
    num_steps: int = 1000
    learning_rate: float = 2.5e-4
    # > 0: the peak learning rate of the memory kind's own parameters (the LTM's); -1: as above.
    memory_learning_rate: float = -1.0
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    # After the warmup, from learning_rate to min_lr_ratio x learning_rate at num_steps: 'cosine'
    # (Transformer-XL's) or 'linear' (the HF Trainer's default, the infinity-former's GPT-2 runs).
    decay: str = 'cosine'
    clip_norm: float = 0.25  # <= 0: no clipping.
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    log_every: int = 100
    eval_every: int = 1000  # 0: only the final validation.
    eval_batches: int = -1  # -1: the whole validation split.
    # The validation at the end of a run, whose numbers the run reports: -1 the whole split; N its
    # first N batches (a notebook's minute-long run, a very large split).
    final_eval_batches: int = -1
    checkpoint_every: int = 1000  # 0: only the final checkpoint.
    keep_checkpoints: int = 3  # The newest N; the best validated checkpoint is kept beside them.
    # A run whose training or validation loss (nats per scored token) exceeds this has diverged:
    # it stops with exit 3 before that state is saved. -1: 3 ln(vocab_size), three times the
    # loss of a uniform guess; 0: only a NaN or inf loss stops it.
    diverged_loss: float = -1.0
    # A workdir, its checkpoints/ folder or one step's folder to start a new run from (read
    # only while this workdir has no checkpoint); init_from_state = 'params' (fresh optimizer,
    # step 0) or 'params_and_optimizer' (Adam moments and step carried over).
    init_from: str = ''
    init_from_state: str = 'params'

    def diverged_limit(self, vocab_size: int) -> float:
        """The loss above which the run has diverged (`diverged_loss` resolved); inf: off."""
        if self.diverged_loss == -1:
            return 3.0 * math.log(vocab_size)
        return self.diverged_loss if self.diverged_loss > 0 else math.inf

    def problems(self, process_count: int) -> list[str]:
        found = [f'config.train.{name}={getattr(self, name)} must be >= 1.'
                 for name in ('batch_size', 'tgt_len', 'segments_per_step', 'grad_accum_steps', 'num_steps',
                              'keep_checkpoints') if getattr(self, name) < 1]
        steps = self.segments_per_step
        for name in ('log_every', 'eval_every', 'checkpoint_every'):
            value = getattr(self, name)
            # The host only sees the state between dispatches of segments_per_step updates.
            found += failed((value >= 0, f'config.train.{name}={value} must be >= 0.'),
                            (value <= 0 or steps < 1 or value % steps == 0,
                             f'config.train.{name}={value} must be a multiple of '
                             f'config.train.segments_per_step={steps} (or 0).'))
        per_process = self.grad_accum_steps * process_count
        return found + failed(
            (steps < 1 or self.num_steps % steps == 0,
             f'config.train.num_steps={self.num_steps} must be a multiple of config.train.segments_per_step={steps}.'),
            (self.grad_accum_steps < 1 or self.batch_size < 1 or self.batch_size % per_process == 0,
             f'config.train.batch_size={self.batch_size} must be divisible by config.train.grad_accum_steps '
             f'({self.grad_accum_steps}) x process count ({process_count}) = {per_process}: use a multiple '
             f'of {per_process}.'),
            (self.learning_rate > 0, f'config.train.learning_rate={self.learning_rate} must be > 0.'),
            (0 <= self.warmup_steps <= self.num_steps,
             f'config.train.warmup_steps={self.warmup_steps} must lie in [0, num_steps={self.num_steps}].'),
            (0.0 <= self.min_lr_ratio <= 1.0, f'config.train.min_lr_ratio={self.min_lr_ratio} must lie in [0, 1].'),
            (self.decay in DECAYS, f'config.train.decay={self.decay!r} must be one of {DECAYS}.'),
            (0.0 <= self.b1 < 1.0, f'config.train.b1={self.b1} must lie in [0, 1).'),
            (0.0 <= self.b2 < 1.0, f'config.train.b2={self.b2} must lie in [0, 1).'),
            (self.eps > 0, f'config.train.eps={self.eps} must be > 0.'),
            (self.weight_decay >= 0, f'config.train.weight_decay={self.weight_decay} must be >= 0.'),
            (self.init_from_state in INIT_FROM_STATES,
             f'config.train.init_from_state={self.init_from_state!r} must be one of {INIT_FROM_STATES}.'),
            (self.eval_batches == -1 or self.eval_batches >= 1,
             f'config.train.eval_batches={self.eval_batches} must be -1 (whole split) or >= 1.'),
            (self.final_eval_batches == -1 or self.final_eval_batches >= 1,
             f'config.train.final_eval_batches={self.final_eval_batches} must be -1 (whole split) or >= 1.'),
            (self.diverged_loss in (-1, 0) or self.diverged_loss > 0,
             f'config.train.diverged_loss={self.diverged_loss} must be > 0, -1 (3 ln(vocab_size)) or 0 (off).'))


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """config.eval. batch_size, tgt_len -1: as in training (filled in by `resolve`). The model
    evaluation runs (config.eval.model merged over config.model) is `RunConfig.eval_model`."""

    split: str = 'validation'
    # Also report the accuracy of the argmax prediction on the scored tokens (the sorting task).
    accuracy: bool = False
    batch_size: int = -1
    tgt_len: int = -1

    def problems(self, process_count: int) -> list[str]:
        return failed(
            (self.split in SPLITS, f'config.eval.split={self.split!r} must be one of {SPLITS}.'),
            (self.batch_size == -1 or (self.batch_size >= 1 and self.batch_size % process_count == 0),
             f'config.eval.batch_size={self.batch_size} must be -1 (as in training) or a positive '
             f'multiple of the process count ({process_count}).'),
            (self.tgt_len == -1 or self.tgt_len >= 1,
             f'config.eval.tgt_len={self.tgt_len} must be -1 (as in training) or >= 1.'))


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A resolved experiment: typed sections, every default and -1 placeholder filled, except
    those that wait for the tokenizer's vocabulary size (`with_vocab_size`: the model's, and the
    divergence limit)."""

    seed: int
    model: ModelConfig
    eval_model: ModelConfig  # config.eval.model merged over `model`: what evaluation runs.
    data: DataConfig
    train: TrainConfig
    eval: EvalConfig
    mesh: MeshConfig
    # The config as plain nested dicts: what the workdir saves and a resumed run is compared with.
    source: dict = dataclasses.field(compare=False, hash=False)

    def with_vocab_size(self, vocab_size: int) -> RunConfig:
        """The run with the tokenizer's vocabulary size."""
        if self.model.vocab_size not in (-1, vocab_size):
            raise ConfigError(f'invalid config.model: config.model.vocab_size={self.model.vocab_size} but the '
                              f'tokenizer has {vocab_size} tokens; set config.model.vocab_size=-1 to take it '
                              'from the tokenizer.')
        try:
            model, eval_model = (m.replace(vocab_size=vocab_size) for m in (self.model, self.eval_model))
        except ValueError as error:
            raise ConfigError(f'invalid config.model: {error}') from None
        source = {**self.source, 'model': {**self.source['model'], 'vocab_size': vocab_size}}
        train = dataclasses.replace(self.train, diverged_loss=self.train.diverged_limit(vocab_size))
        return dataclasses.replace(self, model=model, eval_model=eval_model, train=train, source=source)

    def as_config_dict(self) -> ml_collections.ConfigDict:
        return ml_collections.ConfigDict(self.source)


def base_config() -> ml_collections.ConfigDict:
    """Defaults shared by all experiments (a small byte-level Transformer-XL): each section's
    fields and defaults are its dataclass's."""
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.model = ml_collections.ConfigDict(model_defaults())
    config.model.update(d_model=128, n_layer=4, n_head=4, d_head=32, d_inner=512, mem_len=64)
    config.data = ml_collections.ConfigDict(dataclasses.asdict(DataConfig()))
    config.train = ml_collections.ConfigDict(dataclasses.asdict(TrainConfig()))
    config.eval = ml_collections.ConfigDict(dataclasses.asdict(EvalConfig()))
    # Only fields that shape no parameter may be set (unset: as in training).
    config.eval.model = eval_model_placeholders()
    config.mesh = ml_collections.ConfigDict(dataclasses.asdict(MeshConfig()))
    return config


def from_saved(saved: Mapping[str, Any]) -> ml_collections.ConfigDict:
    """A config as a workdir saved it (plain JSON) on base_config(): its fields keep their types
    (tuples, typed placeholders of unset fields), so `--config.a.b=v` parses as it does on a config
    file's; sections base_config() lacks (a comparison's) come as saved."""
    config = base_config()
    config.update(saved)
    return config


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
        {name: config_dict.placeholder(type(defaults[name])) for name in ('memory',) + memories.run_time_fields()})


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
    config.eval.batch_size = -1
    return config


def shrink_to_notebook(config: ml_collections.ConfigDict, **model: Any) -> ml_collections.ConfigDict:
    """A paper config's `:notebook` variant: the method at the quickstart's size (4 x 128, segments
    and memory of 64) in bytes of a text file of the user's (`--config.data.text_path`; docs/notebooks.md
    uses the King James Bible), 8,000 updates of 16 x 64 bytes. The notebooks in notebooks/ load such
    a run to show their paper's effects, which a model trained for seconds does not show; `model`
    sets the method's own fields."""
    config.data.update(name='text', tokenizer='byte', heldout_size=1000)
    config.model.update(d_model=128, n_layer=4, n_head=4, d_head=32, d_inner=512, dropout=0.0, dropatt=0.0,
                        cutoffs=(), tie_projs=(), mem_len=64, **model)
    config.train.update(batch_size=16, tgt_len=64, segments_per_step=10, num_steps=8000, learning_rate=1e-3,
                        warmup_steps=100, min_lr_ratio=0.1, clip_norm=1.0, log_every=200, eval_every=2000,
                        eval_batches=20, checkpoint_every=2000)
    evaluate_as_trained(config)
    config.eval.batch_size = 16
    return config


def resolve(config: ml_collections.ConfigDict, process_count: int = 1,
            device_count: Optional[int] = None) -> RunConfig:
    """The config checked and resolved into a RunConfig; ConfigError lists every problem found.

    The mesh is checked against `device_count` when it is given; the vocabulary size, when the
    config takes it from the tokenizer, once that is built (`RunConfig.with_vocab_size`).
    """
    missing = [s for s in ('seed',) + SECTIONS if s not in config]
    if missing:
        raise ConfigError(f'config lacks section(s) {missing}: start from '
                          'memjax.config_lib.base_config().')
    data = _from_mapping(DataConfig, 'data', config.data)
    train = _from_mapping(TrainConfig, 'train', config.train)
    evaluation = _from_mapping(EvalConfig, 'eval', {k: v for k, v in config.eval.items() if k != 'model'})
    mesh = _from_mapping(MeshConfig, 'mesh', config.mesh)
    errors = failed((isinstance(config.seed, int) and 0 <= config.seed < 2**32,
                     f'config.seed={config.seed!r} must be an int in [0, 2**32).'))
    errors += data.problems() + train.problems(process_count) + evaluation.problems(process_count)
    evaluation = dataclasses.replace(
        evaluation, batch_size=train.batch_size if evaluation.batch_size == -1 else evaluation.batch_size,
        tgt_len=train.tgt_len if evaluation.tgt_len == -1 else evaluation.tgt_len)
    mesh_problems = mesh.problems()
    errors += mesh_problems
    # The batch checks divide by the sizes: only once those are known to be >= 1.
    if not mesh_problems and train.grad_accum_steps >= 1 and device_count is not None:
        errors += mesh.device_problems(device_count) or _mesh_fits_batches(mesh, train, evaluation, process_count,
                                                                           device_count)
    model, eval_model = _resolve_models(config, train, evaluation, errors)
    if errors:
        raise ConfigError('invalid config:\n  ' + '\n  '.join(errors))
    return RunConfig(seed=config.seed, model=model, eval_model=eval_model, data=data, train=train,
                     eval=evaluation, mesh=mesh, source=config.to_dict())


def validate_config(config: ml_collections.ConfigDict, process_count: int = 1,
                    device_count: Optional[int] = None) -> None:
    """Raises ConfigError listing every problem found in the config (`resolve` without its result)."""
    resolve(config, process_count, device_count)


def _mesh_fits_batches(mesh: MeshConfig, train: TrainConfig, evaluation: EvalConfig, process_count: int,
                       device_count: int) -> list[str]:
    # Streams are split over data x fsdp; each process feeds whole, distinct blocks of them.
    shape = mesh.shape(device_count)
    data_parallel = shape['data'] * shape['fsdp']
    per_update = data_parallel * train.grad_accum_steps
    return failed(
        (train.batch_size % per_update == 0,
         f'config.train.batch_size={train.batch_size} must be divisible by config.mesh data x fsdp '
         f'({data_parallel}) x config.train.grad_accum_steps ({train.grad_accum_steps}) = {per_update}.'),
        (evaluation.batch_size % data_parallel == 0,
         f'evaluation batch size {evaluation.batch_size} (config.eval.batch_size, -1 = train) must be '
         f'divisible by config.mesh data x fsdp ({data_parallel}).'),
        (data_parallel % process_count == 0,
         f'config.mesh data x fsdp ({data_parallel}) must be a multiple of the process count '
         f'({process_count}): every process reads its own share of the streams.'))


def _resolve_models(config: ml_collections.ConfigDict, train: TrainConfig, evaluation: EvalConfig,
                    errors: list[str]) -> tuple[Optional[ModelConfig], Optional[ModelConfig]]:
    """(training, evaluation) model configs; their problems are added to `errors`."""
    memory = config.model.memory
    if memory in memories.names() and not memories.kind_class(memory).trainable:
        runs_on = memories.kind_class(memory).runs_on
        errors.append(f'config.model.memory={memory!r} is training-free: set config.model.memory to '
                      f'the kind that was trained ({" or ".join(map(repr, runs_on))}) and evaluate with '
                      f'--config.eval.model.memory={memory}.')
        return None, None
    segment_len = config.model.get('segment_len', -1)
    if segment_len not in (-1, train.tgt_len):
        errors.append(f'config.model.segment_len={segment_len} differs from config.train.tgt_len={train.tgt_len}, '
                      'the length of the training segments: set config.model.segment_len=-1 (it then follows '
                      'tgt_len) or the same value in both.')
        return None, None
    try:
        model = ModelConfig.from_config_dict(config.model, segment_len=train.tgt_len)
    except ValueError as error:
        errors.append(f'config.model: {error}')
        return None, None
    try:
        # Evaluation's segments are config.eval.tgt_len long whatever training's were.
        eval_model = memories.evaluation_config(model, eval_model_overrides(config), evaluation.tgt_len)
    except ValueError as error:
        errors.append(f'config.eval.model: {error}')
        return model, None
    # A dispatch runs segments_per_step updates in one compiled step, so with one phase.
    steps = train.segments_per_step
    late = [s for s in memories.get(model).phase_starts if steps >= 1 and s % steps]
    errors.extend(failed((not late, f'memory={model.memory!r} changes its training phase at steps {late}: '
                                    f'config.train.segments_per_step={steps} must divide them.')))
    return model, eval_model
