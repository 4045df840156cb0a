"""Memory kinds: what a memory-transformer carries from one segment to the next.

A memory kind is one class (registered under the name `config.model.memory` takes) that answers:

- `init(batch)`: the state before the first segment, a `MemoryState` of two pytrees: `layers`
  (every leaf has a leading [n_layer] axis; each layer sees its own slice) and `shared` (validity,
  counters: not per layer). `logical_axes()` names every axis of both.
- `reset(state, rows)`: the state of the batch rows where `rows` is True (a new document) starts
  afresh. The default takes those rows from `init`, found by their 'activation_batch' axis.
- `layer` (a flax module class, `LayerMemory`), run inside every layer: which `KeyBlock`s it offers
  the attention (`blocks`), what it adds to or reads from the attention (`attend`), and how the
  layer's input and notes become its next state (`write`, with any auxiliary losses).
- optionally `attend_token`: `attend` for one token when a segment is decoded token by token
  (a kind whose `attend` adds an output to the segment's).
- `advance(shared, embedded)`: the shared state after the whole stack (`embedded`: the segment as
  the first layer saw it).
- optionally `stack_rows(shared)`: rows that go up the stack with the segment, refreshed by every
  layer (LaMemo's memory), and `bias_names`: global attention biases of the kind's own.

Everything generic (the scan carry, checkpoints, gradient-accumulation splits, shardings,
evaluation overrides) walks these pytrees without knowing the kind; docs/architecture.md walks
through adding one.
"""

from __future__ import annotations

import difflib
from typing import Any, ClassVar, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from memjax.model.attention import Attended, AttentionView, KeyBlock, LayerMaps
from memjax.model import stochastic
from memjax.model.config import (CLAMP_TRAINED, RUN_TIME_FIELDS, TRAINING_FIELDS, KindFields, ModelConfig, add_check,
                                 declare_fields)
from memjax.model.positions import POSITIONS

BATCH_AXIS = 'activation_batch'


class Problems(list):
    """What a kind's `validate` found: `need(ok, message)` keeps the message where `ok` fails."""

    def need(self, ok: bool, message: str) -> None:
        if not ok:
            self.append(message)


@struct.dataclass
class MemoryState:
    layers: Any  # Leaves [n_layer, ...]: layer l reads and writes index l.
    shared: Any  # Leaves seen by every layer.


class LayerMemory(nn.Module):
    """A memory kind's part inside one layer (a module, so a kind may own parameters and draw from
    random streams). The defaults keep nothing."""

    config: ModelConfig

    def blocks(self, state: Any, shared: Any, layer_input: jax.Array, maps: LayerMaps) -> list[KeyBlock]:
        """Key blocks this layer attends besides the segment (`layer_input` [B, T, d_model]),
        oldest first. Called before any score, with the layer's own maps and kernels (`maps`): a
        kind may rank, select and project its rows here."""
        return []

    def attend(self, state: Any, shared: Any, view: AttentionView) -> Attended:
        """What the kind adds to the attention (an extra output, its rows' output) and notes for
        `write`; `view` is the layer's attention after its softmax."""
        return Attended()

    def attend_token(self, state: Any, shared: Any, view: AttentionView) -> Attended:
        """`attend` for one token of a segment decoded token by token (memjax/generation): only
        `extra` counts. `view.cached` holds what `attend` put in `Attended.cache` when the segment
        was recorded; the kind's blocks and stack rows are already among `view.key`. The default
        adds nothing."""
        return Attended()

    def write(self, state: Any, shared: Any, layer_input: jax.Array, notes: Any) -> tuple[Any, dict]:
        """(this layer's next state, {name: float32 scalar loss summed over batch rows and
        positions}) with one entry per name in the kind's `loss_weights`."""
        return state, {}

    def skipped(self, state: Any, shared: Any, layer_input: jax.Array) -> Any:
        """This layer's next state when the layer is skipped this step (`layer_input` [B, T,
        d_model] passes through it unchanged): kept as it was."""
        return state


class MemoryKind:
    """The base every memory kind extends; on its own it keeps nothing ('none', `NoMemory`)."""

    name: ClassVar[str] = 'none'
    layer: ClassVar[type[LayerMemory]] = LayerMemory
    # The kind's own hyper-parameters (a KindFields dataclass in the kind's file), or None.
    fields: ClassVar[Optional[type[KindFields]]] = None
    # ModelConfig fields this kind reads that shape no parameter: evaluation may override them
    # (config.eval.model), with the kind-independent RUN_TIME_FIELDS of ModelConfig.
    run_time_fields: ClassVar[tuple[str, ...]] = ()
    # Random streams the kind draws from, beyond 'dropout': name -> True when every
    # gradient-accumulation chunk of a step must see the same draw (a skip decision), False when
    # each chunk draws its own (sampling per batch row). Each layer always draws its own.
    streams: ClassVar[dict[str, bool]] = {}
    # Auxiliary losses the kind's layers report -> their weight in the training loss.
    loss_weights: ClassVar[dict[str, float]] = {}
    # Training steps at which the phase changes; the model is compiled once per phase.
    phase_starts: ClassVar[tuple[int, ...]] = ()
    # Global [n_head, d_head] attention biases of the kind's own beside u and v (shared by the
    # layers unless untie_r); the attend hook finds them in `view.biases`.
    bias_names: ClassVar[tuple[str, ...]] = ()
    # Kinds whose trained parameters this kind also runs on: evaluation may switch to it with
    # config.eval.model.memory (TRAMS evaluates an 'xl' model). Its run-time fields may then be set.
    runs_on: ClassVar[tuple[str, ...]] = ()
    # False for a training-free kind: it only evaluates parameters trained as one of `runs_on`.
    trainable: ClassVar[bool] = True
    # The kind evaluation runs for parameters trained as this one when config.eval.model.memory is
    # not set (one of the kinds that run on them, computing the same numbers faster), or ''.
    evaluated_by: ClassVar[str] = ''
    # True for a kind whose skipped layer may keep its state for a step (Skip-Retain): its memory
    # then ages (`LayerMemory.skipped`).
    skip_retain: ClassVar[bool] = False
    # True for a kind whose every key and value a head reads comes through the attention, which
    # permutes them under Stochastic Cross-Head attention (LaMemo's look-ahead reads positional keys
    # of its own, the infinity-former's long-term memory keys and values of its own).
    cross_head: ClassVar[bool] = False

    def __init__(self, config: ModelConfig):
        self.config = config
        # The skeleton's training switches (Skip-Retain, cross-head attention) add their streams,
        # and Skip-Retain's phase 2 a phase, to the kind's own.
        self.streams = {**type(self).streams, **stochastic.streams(config)}
        if stochastic.skipping(config) and config.skip_until >= 0 and not type(self).phase_starts:
            self.phase_starts = (config.skip_until,)

    def holds(self) -> str:
        """What the memory holds, for the start-up lines (`describe`)."""
        return f'memory of {self.config.mem_len} tokens' if self.config.mem_len else 'no memory'

    # Kinds are static attributes of flax modules and cache keys: equal when type and config are.
    def __eq__(self, other):
        return type(self) is type(other) and self.config == other.config

    def __hash__(self):
        return hash((type(self), self.config))

    @classmethod
    def validate(cls, config: ModelConfig) -> list[str]:
        """Problems with `config` for this kind, each one line."""
        return [] if config.mem_len == 0 else [
            f'memory={cls.name!r} keeps nothing but mem_len={config.mem_len}: set mem_len=0 or '
            'choose memory=\'xl\'.']

    def init(self, batch_size: int) -> MemoryState:
        return MemoryState(layers={}, shared={})

    def logical_axes(self) -> MemoryState:
        return MemoryState(layers={}, shared={})

    def reset(self, state: MemoryState, rows: jax.Array) -> MemoryState:
        fresh = self.init(rows.shape[0])

        def where(new, old, axes):
            axis = list(axes).index(BATCH_AXIS) if BATCH_AXIS in axes else None
            if axis is None:
                return old
            shape = [1] * old.ndim
            shape[axis] = rows.shape[0]
            return jnp.where(rows.reshape(shape), new.astype(old.dtype), old)

        return jax.tree.map(where, fresh, state, self.logical_axes(), is_leaf=lambda x: isinstance(x, P))

    def advance(self, shared: Any, embedded: jax.Array) -> Any:
        """The shared state after the segment; `embedded` [B, T, d_model] is the first layer's input."""
        return shared

    def stack_rows(self, shared: Any) -> Optional[KeyBlock]:
        """Rows that go up the layer stack with the segment, or None. Each layer offers them as keys
        right before the segment, computes their output with its `attend` hook (`Attended.rows`),
        runs them through its residual, LayerNorm and feed-forward with the segment, and hands them
        to the next layer; the top layer's are dropped. `rows` [B, R, d_model] is the first layer's
        input, `valid` [B, 1, 1, R] holds for every layer."""
        return None

    def position_rows(self, seg_len: int) -> int:
        """Distance rows the attention needs: one more than the largest query-key distance."""
        return seg_len

    @property
    def window(self) -> int:
        """Keys a query sees with `same_length` (itself included)."""
        return self.config.mem_len

    def longest_distance(self, seg_len: int) -> int:
        """The longest query-key distance the attention scores once the memory is full, before
        clamp_len. With `same_length` a query sees `window` keys back from itself."""
        longest = self.position_rows(seg_len) - 1
        return min(longest, self.window - 1) if self.config.same_length else longest

    def skip_layers(self, key: Optional[jax.Array], phase: int) -> Optional[jax.Array]:
        """[n_layer] bool: layers skipped this training step (None: none). Called only when the
        kind's streams hold 'skip' (shared between chunks: one decision per step); `key` is its
        draw for this step. The default is Skip-Retain's phase 1 (config.model.skip_rule)."""
        cfg = self.config
        if phase > 0 or not stochastic.skipping(cfg):
            return None
        return stochastic.draw_skips(key, stochastic.skip_probabilities(cfg.skip_rule, cfg.n_layer, cfg.skip_p))

    def phase(self, step: int) -> int:
        return sum(step >= s for s in self.phase_starts)


_KINDS: dict[str, type[MemoryKind]] = {}


def register(kind: type[MemoryKind]) -> type[MemoryKind]:
    """Class decorator: makes `kind` selectable as config.model.memory = kind.name, and its own
    `fields` part of the model config."""
    if kind.name in _KINDS and _KINDS[kind.name] is not kind:
        raise ValueError(f'memory kind {kind.name!r} is registered twice.')
    _KINDS[kind.name] = kind
    if 'fields' in vars(kind) and kind.fields is not None:
        declare_fields(kind.name, kind.fields)
    return kind


@add_check
def _valid_for_kind(config: ModelConfig) -> list[str]:
    if config.memory not in _KINDS:
        return [f'memory={config.memory!r} must be one of {names()}.']
    kind = _KINDS[config.memory]
    problems = list(kind.validate(config))
    if config.skip_rule != 'none' and not kind.skip_retain:
        problems.append(f"skip_rule={config.skip_rule!r}: Skip-Retain is built for memory 'xl' and 'none' (a "
                        f"skipped layer keeps its memory and ages it), not memory={config.memory!r}.")
    if config.sch_beta > 0 and not kind.cross_head:
        problems.append(f"sch_beta={config.sch_beta}: Stochastic Cross-Head attention is built for memory 'xl' and "
                        f"'none' (every key a head reads is permuted with it), not memory={config.memory!r}.")
    if config.sch_beta > 0 and config.n_head == 1:
        problems.append(f'sch_beta={config.sch_beta} with n_head=1: one head has no other to read; set sch_beta=0.')
    return problems


def names() -> tuple[str, ...]:
    return tuple(sorted(_KINDS))


def kind_class(name: str) -> type[MemoryKind]:
    if name not in _KINDS:
        raise ValueError(f'memory={name!r} is not a memory kind; choose one of {names()}.')
    return _KINDS[name]


def get(config: ModelConfig) -> MemoryKind:
    return kind_class(config.memory)(config)


def describe(config: ModelConfig) -> str:
    """The model in a phrase: "memory 'xl', 4 layers x 128, memory of 64 tokens"."""
    layers = f'{config.n_layer} layer{"s" if config.n_layer != 1 else ""}'
    return f'memory {config.memory!r}, {layers} x {config.d_model}, {get(config).holds()}'


def run_time_fields(memory: Optional[str] = None) -> tuple[str, ...]:
    """Model fields evaluation may override: every kind's (`memory` None) or one kind's."""
    kinds = [kind_class(memory)] if memory else [kind_class(n) for n in names()]
    return tuple(dict.fromkeys(RUN_TIME_FIELDS + sum((k.run_time_fields for k in kinds), ())))


def evaluation_config(trained: ModelConfig, overrides: dict[str, Any],
                      segment_len: Optional[int] = None) -> ModelConfig:
    """The model evaluation runs: `overrides` (config.eval.model's set fields) over the `trained`
    one, with segments of `segment_len` (None: as trained) and the training switches off; the
    memory kind is the trained kind's `evaluated_by` unless the overrides name one.

    Raises ValueError for a kind that cannot run on the trained parameters, for a field that would
    change them (not a run-time field of the kind), and for invalid values.
    """
    faster = kind_class(trained.memory).evaluated_by
    # A subclass inherits `evaluated_by`; only a kind that names the trained one runs on it.
    default = faster if faster and trained.memory in kind_class(faster).runs_on else trained.memory
    memory = overrides.get('memory', default)
    users = [n for n in names() if trained.memory in kind_class(n).runs_on]
    if memory != trained.memory and memory not in users:
        raise ValueError(f'memory={memory!r} cannot run on parameters trained as memory={trained.memory!r}; '
                         f'evaluation may switch to {users or "no other kind"} for them.')
    allowed = run_time_fields(memory)
    unknown = sorted(set(overrides) - set(ModelConfig.defaults()) - {'memory'})
    if unknown:
        close = {name: difflib.get_close_matches(name, allowed, n=1) for name in unknown}
        raise ValueError(f'{unknown} are no model fields' + ''.join(
            f'; did you mean {match[0]!r} for {name!r}?' for name, match in close.items() if match))
    refused = sorted(set(overrides) - set(allowed) - {'memory'})
    if refused:
        hint = [n for n in users if set(refused) <= set(run_time_fields(n))]
        kind = f'memory={memory!r}' if 'memory' in overrides or memory == trained.memory else (
            f'memory={trained.memory!r} (evaluated as {memory!r})')
        raise ValueError(f'{refused} cannot differ at evaluation for {kind}: only {list(allowed)} '
                         'shape no parameter' + (f'; they are fields of memory={hint[0]!r}: add '
                                                 f'--config.eval.model.memory={hint[0]}.' if hint else '.'))
    # Evaluation never skips layers nor permutes heads.
    switches_off = {name: ModelConfig.defaults()[name] for name in TRAINING_FIELDS}
    evaluated = trained.replace(**{**overrides, 'memory': memory}, **switches_off,
                                **({} if segment_len is None else {'segment_len': segment_len}))
    if evaluated.clamp_len == CLAMP_TRAINED:
        evaluated = evaluated.replace(clamp_len=trained_distance(trained))
    return evaluated


def scored_distance(config: ModelConfig) -> Optional[int]:
    """The longest distance whose positional encoding `config` scores on segments of
    `config.segment_len` once its memory is full (clamp_len applied); None for absolute positions.

    Skip-Retain's aged memories reach further in the training steps that skip a layer; those
    distances are not counted."""
    if POSITIONS[config.positions] is None:
        return None
    longest = get(config).longest_distance(config.segment_len)
    return min(longest, config.clamp_len) if config.clamp_len > 0 else longest


# How memjax.evaluate (and a config) clamps evaluation at the trained distances; commands with a flag
# of their own for it name theirs.
EVAL_CLAMP_SETTING = f'--config.eval.model.clamp_len={CLAMP_TRAINED}'


def trained_distance(trained: ModelConfig) -> int:
    """The longest distance training scored: mem_len + tgt_len - 1 for Transformer-XL's memory
    (less under a training clamp_len or same_length). What clamp_len=-2 resolves to."""
    return scored_distance(trained) or 0


def unseen_distances(trained: ModelConfig, evaluated: ModelConfig,
                     clamp_setting: str = EVAL_CLAMP_SETTING) -> Optional[str]:
    """One line when evaluation scores distances training never produced, else None; it names
    `clamp_setting`, how the command at hand clamps the evaluation's distances at the trained maximum.

    A relative position beyond the trained range is an input the model has not learned to weigh:
    LaMemo trained with segments and memory of 128 sends up to 0.92 of a lower layer's attention there
    at memory 640 (BENCHMARKS.md, \"Evaluating with a longer memory\")."""
    longest, trained_max = scored_distance(evaluated), scored_distance(trained)
    if longest is None or longest <= trained_max:
        return None
    return (f'evaluation scores relative distances up to {longest} (memory {evaluated.mem_len}, segments of '
            f'{evaluated.segment_len}, clamp_len={evaluated.clamp_len}) but training scored at most {trained_max}: '
            f'the longer ones are extrapolated; {clamp_setting} clamps them at '
            f'{trained_max}, the trained maximum.')


@register
class NoMemory(MemoryKind):
    """'none': the Transformer with relative positions and nothing carried. Skip-Retain only skips
    its layers (there is no memory to age)."""
    skip_retain = True
    cross_head = True
from memjax.model.memories import cached, infinity, lamemo, trams, xl  # noqa: E402,F401  pylint: disable=unused-import (register themselves)
