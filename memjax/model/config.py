"""The model's hyper-parameters, validated before anything is traced or compiled.

The skeleton's fields are declared here; each memory kind declares its own in its own file
(`KindFields`, prefixed with the kind's namespace: `ltm_`, `lamemo_`, `trams_`) and registers them
with `declare_fields`. Modules that own a registry the config names (block styles, positions,
remat policies, skip rules, memory kinds) add their check with `add_check`: they import this
module, never the other way round.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Callable, Mapping

import jax.numpy as jnp

_COMPUTE_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
_MEMORY_STARTS = ('empty', 'zeros')
ATTENTION_IMPLS = ('auto', 'reference', 'fused')
# config.eval.model.clamp_len=-2: clamp at the longest distance the trained model ever scored.
CLAMP_TRAINED = -2
# Fields of every memory kind that shape no parameter: evaluation may override them
# (config.eval.model), together with the kind's own `run_time_fields`.
# compute_dtype among them: a float32-trained run evaluates in bfloat16 (docs/mixed_precision.md).
RUN_TIME_FIELDS = ('clamp_len', 'same_length', 'compute_dtype', 'attention_impl')
# Fields that act in training only (Skip-Retain, cross-head attention): evaluation runs with their
# defaults, which switch them off.
TRAINING_FIELDS = ('skip_rule', 'skip_p', 'skip_until', 'sch_beta')


def example(default: tuple, text: str) -> Any:
    """A tuple field with the command-line example its error message shows."""
    return dataclasses.field(default=default, metadata={'example': text})


@dataclasses.dataclass(frozen=True)
class KindFields:
    """A memory kind's own hyper-parameters: subclass it as a frozen dataclass in the kind's file,
    every field named with the kind's prefix, and pass it to `declare_fields`. The config, the
    command line (`--config.model.<field>`) and `ModelConfig` then know them by name."""


_KIND_FIELDS: dict[str, type[KindFields]] = {}
_CHECKS: list[Callable[['ModelConfig'], list[str]]] = []


def declare_fields(kind: str, fields: type[KindFields]) -> None:
    """Makes `fields` part of every ModelConfig (memory kinds call it when they register)."""
    taken = set(_field_defaults()) - {f.name for f in dataclasses.fields(_KIND_FIELDS.get(kind, KindFields))}
    clash = sorted(taken & {f.name for f in dataclasses.fields(fields)})
    if clash:
        raise ValueError(f'memory kind {kind!r} declares fields {clash} that another part already has.')
    _KIND_FIELDS[kind] = fields


def add_check(check: Callable[['ModelConfig'], list[str]]) -> Callable[['ModelConfig'], list[str]]:
    """Decorator: `check(config)` returns one-line problems; ModelConfig runs it when built."""
    _CHECKS.append(check)
    return check


def _field_defaults() -> dict[str, dataclasses.Field]:
    """Every field a ModelConfig knows, the skeleton's and every declared kind's, by name."""
    return {f.name: f for group in (ModelConfig, *_KIND_FIELDS.values()) for f in dataclasses.fields(group)}


def _tuple_of(name: str, value: Any, kind: type, example: str) -> tuple:
    """`value` as a tuple of `kind`, or a ValueError naming the field (a command-line override
    such as --config.model.ltm_widths=abc arrives as a string)."""
    def one(item):
        if kind is bool:
            if item in (True, False):  # bool, 0, 1 (and numpy's)
                return bool(item)
            raise ValueError
        if isinstance(item, (str, bool)):
            raise ValueError
        converted = kind(item)
        if kind is int and converted != item:
            raise ValueError
        return converted

    try:
        if not isinstance(value, (tuple, list)):
            raise ValueError
        return tuple(one(item) for item in value)
    except (TypeError, ValueError):
        noun = {int: 'integers', float: 'numbers', bool: 'booleans'}[kind]
        raise ValueError(f'Invalid model config: {name}={value!r} must be a tuple of {noun}, '
                         f'e.g. --config.model.{name}=\'{example}\'.') from None


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class ModelConfig:
    """Hyper-parameters of the memory-transformer language model; the one place their defaults live
    (config_lib.base_config starts from them). Built from flat keywords, the skeleton's and every
    declared kind's (`ModelConfig(memory='infinity', ltm_basis=64)`); a kind's fields read as
    attributes (`config.ltm_basis`).

    Fields that only change how the model is *run* (RUN_TIME_FIELDS and the memory kind's
    `run_time_fields`) do not change its parameters, so evaluation can override them.
    """

    vocab_size: int = -1  # -1 in a config: take it from the tokenizer.
    # What the memory is: a name registered in memjax.model.memories ('none', 'xl', ...).
    memory: str = 'xl'
    # The positional scheme (memjax.model.positions.POSITIONS) and the block style
    # (memjax.model.primitives.BLOCKS), chosen independently of the memory.
    positions: str = 'relative_sinusoid'
    block: str = 'xl'
    n_positions: int = 1024  # Rows of a learned absolute position table: the longest segment.
    d_model: int = 512
    n_layer: int = 12
    n_head: int = 8
    d_head: int = 64
    d_inner: int = 2048
    d_embed: int = -1  # -1: same as d_model.
    dropout: float = 0.1
    dropatt: float = 0.0
    mem_len: int = 0
    # Relative distances longer than clamp_len are scored as clamp_len; -1 (or 0): not clamped.
    # CLAMP_TRAINED (-2): at the longest distance training scored (memories.trained_distance),
    # resolved when the evaluation model is built; in training it clamps nothing.
    clamp_len: int = -1
    same_length: bool = False
    pre_lnorm: bool = False
    untie_r: bool = False  # True: every layer has its own u, v biases.
    tie_weight: bool = True
    cutoffs: tuple[int, ...] = example((), '(20000, 40000)')  # () : plain softmax over the whole vocabulary.
    div_val: int = 1
    tie_projs: tuple[bool, ...] = example((), '(False, True)')  # () : no projection is tied.
    init_std: float = 0.02
    proj_init_std: float = 0.01
    # 'empty': the first segment sees no memory (masked). 'zeros': it sees mem_len zero vectors,
    # as HF / TF Transformer-XL do (needed for numerical parity with them).
    memory_start: str = 'empty'
    layer_norm_epsilon: float = 1e-5
    compute_dtype: str = 'float32'
    # Stack the layers with nn.scan: compile time stops growing with depth; params get a
    # leading [n_layer] axis under params['layers'] instead of params['layer_{i}'].
    scan_layers: bool = False
    # Tokens per segment. -1: config.train.tgt_len (config.eval.tgt_len in evaluation), filled in
    # when the config is resolved. Read by kinds whose state is sized by the segment.
    segment_len: int = -1

    # Training-time switches of the skeleton (memjax/model/stochastic.py; Vishnu & Sekhar).
    # Skip-Retain: phase 1 skips layer l per step with probability p_skip(l), given by `skip_rule`
    # ('none', 'linear': eq. 1, 'uniform': eq. 2, 'keep_first': 3, 'keep_last': 4, 'keep_ends': 5;
    # skip_p is the p of eqs. 2-5); a skipped layer's memory is retained and ages. Phase 2 trains
    # without skipping from step skip_until (-1: the whole run is phase 1).
    skip_rule: str = 'none'
    skip_p: float = 0.1
    skip_until: int = -1
    # Stochastic Cross-Head attention: per layer and step, with this probability, the heads' keys,
    # positional keys and values are permuted.
    sch_beta: float = 0.0

    # Rematerialise each layer in the backward pass: 'none', 'full' (keep only the layer
    # inputs) or 'dots_saveable' (keep matmul outputs, recompute the cheap element-wise ops).
    remat: str = 'none'
    # The attention's path (memjax/kernels/relative_attention.py): 'fused' runs the tiled kernel
    # wherever it applies (the keys are one contiguous span, validity per key; in Pallas's
    # interpret mode on a CPU); 'reference' never does (debugging, comparisons); 'auto' fuses on
    # the platforms where the kernel has been checked on the chip (none yet: memjax/kernels/fused_choice.py, FUSED_BY_DEFAULT).
    attention_impl: str = 'auto'

    def __init__(self, **values: Any):
        known = _field_defaults()
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise TypeError(f'ModelConfig got unknown fields {unknown}.')
        types = self.field_types()
        for name, f in known.items():
            value = values.get(name, f.default)
            args = typing.get_args(types[name])
            if typing.get_origin(types[name]) is tuple and args[1:] == (Ellipsis,):
                value = _tuple_of(name, value, args[0], f.metadata.get('example', '(1, 2)'))
            object.__setattr__(self, name, value)
        if self.d_embed == -1:
            object.__setattr__(self, 'd_embed', self.d_model)
        object.__setattr__(self, 'tie_projs', self.tie_projs or (False,) * (len(self.cutoffs) + 1))
        self.validate()

    # Equal, and hashed alike, when every field is: a static attribute of flax modules and jit.
    def __eq__(self, other: Any) -> bool:
        return type(other) is ModelConfig and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash(tuple(vars(self).items()))

    def __repr__(self) -> str:
        return f'ModelConfig({", ".join(f"{k}={v!r}" for k, v in vars(self).items())})'

    @staticmethod
    def defaults() -> dict[str, Any]:
        """Every field's default, the skeleton's and every declared kind's."""
        return {name: f.default for name, f in _field_defaults().items()}

    @staticmethod
    def field_types() -> dict[str, Any]:
        hints = {}
        for group in (ModelConfig, *_KIND_FIELDS.values()):
            hints.update(typing.get_type_hints(group))
        return {name: hints[name] for name in _field_defaults()}

    def as_dict(self) -> dict[str, Any]:
        """Every field by name (the flat form configs and checkpoints hold)."""
        return dict(vars(self))

    @classmethod
    def from_config_dict(cls, cfg: Mapping[str, Any], vocab_size: int | None = None,
                         segment_len: int | None = None) -> ModelConfig:
        """Builds from an ml_collections ConfigDict (or dict); `vocab_size=-1` there takes
        `vocab_size` (when given), `segment_len=-1` takes `segment_len` (the data's tgt_len)."""
        fields = dict(cfg.to_dict() if hasattr(cfg, 'to_dict') else cfg)
        known = set(_field_defaults())
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f'config.model has unknown fields {unknown}; known fields: {sorted(known)}.')
        if fields.get('vocab_size', -1) in (-1, None):
            fields['vocab_size'] = -1 if vocab_size is None else vocab_size
        elif vocab_size is not None and fields['vocab_size'] != vocab_size:
            raise ValueError(f'config.model.vocab_size={fields["vocab_size"]} but the tokenizer has '
                             f'{vocab_size} tokens; set config.model.vocab_size=-1 to take it from the tokenizer.')
        if fields.get('segment_len', -1) == -1 and segment_len is not None:
            fields['segment_len'] = segment_len
        return cls(**fields)

    def replace(self, **changes) -> ModelConfig:
        """A copy with `changes`. A field derived from another (d_embed from d_model, tie_projs
        from cutoffs) follows it when it held the derived value and is not changed itself."""
        fields = self.as_dict()
        if 'd_embed' not in changes and self.d_embed == self.d_model:
            fields['d_embed'] = -1
        if 'tie_projs' not in changes and not any(self.tie_projs):
            fields['tie_projs'] = ()
        return ModelConfig(**{**fields, **changes})

    @property
    def dtype(self):
        return _COMPUTE_DTYPES[self.compute_dtype]

    @property
    def cluster_bounds(self) -> tuple[int, ...]:
        """(0, cutoff_1, ..., vocab_size): cluster i holds token ids [bounds[i], bounds[i+1])."""
        return (0,) + self.cutoffs + (self.vocab_size,)

    def cluster_dim(self, i: int) -> int:
        return self.d_embed // (self.div_val ** i)

    def validate(self) -> None:
        """Raises ValueError naming every problem at once, so one round of fixes suffices."""
        problems = []

        def need(ok: bool, message: str):
            if not ok:
                problems.append(message)

        # vocab_size -1: the tokenizer's, not known yet (checked again once it is, by the caller).
        sized = self.vocab_size != -1
        for name in ('vocab_size',) * sized + ('d_model', 'n_layer', 'n_head', 'd_head', 'd_inner', 'd_embed', 'div_val'):
            need(int(getattr(self, name)) >= 1, f'{name}={getattr(self, name)} must be a positive integer.')
        need(self.d_model % 2 == 0, f'd_model={self.d_model} must be even (sin and cos halves of the '
             'positional encoding).')
        for name in ('dropout', 'dropatt'):
            need(0.0 <= getattr(self, name) < 1.0, f'{name}={getattr(self, name)} must be in [0, 1).')
        need(self.mem_len >= 0, f'mem_len={self.mem_len} must be >= 0 (0 disables memory).')
        need(self.clamp_len >= CLAMP_TRAINED, f'clamp_len={self.clamp_len} must be > 0 (the longest distance '
             f'scored), -1 (no clamping) or {CLAMP_TRAINED} (the longest distance training scored).')
        # Positions and distances are int32 indices.
        need(self.mem_len + max(self.segment_len, 0) < 2**31, f'mem_len={self.mem_len} must be below '
             f'2**31 - segment_len: positions are int32.')
        need(not (self.same_length and self.mem_len == 0),
             'same_length=True needs mem_len > 0: every query sees exactly mem_len keys.')
        need(self.memory_start in _MEMORY_STARTS,
             f'memory_start={self.memory_start!r} must be one of {_MEMORY_STARTS}.')
        need(self.compute_dtype in _COMPUTE_DTYPES,
             f'compute_dtype={self.compute_dtype!r} must be one of {tuple(_COMPUTE_DTYPES)}.')
        need(self.n_positions >= 1, f'n_positions={self.n_positions} must be >= 1.')
        need(self.attention_impl in ATTENTION_IMPLS,
             f'attention_impl={self.attention_impl!r} must be one of {ATTENTION_IMPLS}.')
        for check in _CHECKS:
            problems.extend(check(self))
        bounds = self.cluster_bounds if sized else (0,) + self.cutoffs
        need(all(a < b for a, b in zip(bounds, bounds[1:])),
             f'cutoffs={self.cutoffs} must be strictly increasing and below vocab_size={self.vocab_size}.')
        need(len(self.tie_projs) == len(self.cutoffs) + 1,
             f'tie_projs has {len(self.tie_projs)} entries; it needs one per cluster '
             f'(len(cutoffs) + 1 = {len(self.cutoffs) + 1}) or none.')
        need(self.div_val < 1 or self.cluster_dim(len(self.cutoffs)) >= 1,
             f'd_embed={self.d_embed} with div_val={self.div_val} leaves the last of '
             f'{len(self.cutoffs) + 1} clusters with no dimension; lower div_val or raise d_embed.')
        if problems:
            raise ValueError('Invalid model config: ' + ' '.join(problems))
