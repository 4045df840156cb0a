"""The model's hyper-parameters, validated before anything is traced or compiled."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

_COMPUTE_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}
_MEMORY_STARTS = ('empty', 'zeros')
# Fields of every memory kind that shape no parameter: evaluation may override them
# (config.eval.model), together with the kind's own `run_time_fields`.
RUN_TIME_FIELDS = ('clamp_len', 'same_length')
# Fields that act in training only (Skip-Retain, cross-head attention): evaluation runs with their
# defaults, which switch them off.
TRAINING_FIELDS = ('skip_rule', 'skip_p', 'skip_until', 'sch_beta')


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


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of the memory-transformer language model; the one place their defaults live
    (config_lib.base_config starts from them).

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
    clamp_len: int = -1  # <= 0: relative distances are not clamped.
    same_length: bool = False
    pre_lnorm: bool = False
    untie_r: bool = False  # True: every layer has its own u, v biases.
    tie_weight: bool = True
    cutoffs: tuple[int, ...] = ()  # () : plain softmax over the whole vocabulary.
    div_val: int = 1
    tie_projs: tuple[bool, ...] = ()  # () : no projection is tied.
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

    # The infinity-former's continuous long-term memory (memory='infinity'; Martins et al. 2022).
    ltm_basis: int = 512  # N Gaussian basis functions: N / len(ltm_widths) centres x the widths.
    ltm_widths: tuple[float, ...] = (0.01, 0.05)
    ltm_ridge: float = 1.0  # lambda of the ridge regression.
    ltm_tau: float = 0.75  # The old signal is contracted into [0, tau].
    ltm_samples: int = -1  # M positions the old signal is sampled at; -1: ltm_basis.
    ltm_reset_tokens: int = 0  # Start the memory afresh after this many tokens; 0: only at documents.
    ltm_min_variance: float = 1e-6  # Floor of the attention density's variance.
    ltm_kl_weight: float = 1e-5  # lambda_KL; the KL term is also logged on its own (aux/kl).
    ltm_kl_sigma: float = 0.05  # sigma_0 of the KL prior.
    # mu_0 of the KL prior; None: centred on mu (variance term only). The released GPT-2 runs: -1.
    ltm_kl_mu0: float | None = None
    # Zero-padding of the refit after an update: 'released' (the authors' code) or 'even'.
    ltm_padding: str = 'released'
    ltm_sticky: bool = False  # Sticky memories: sample where last step attended, not evenly.
    ltm_sticky_bins: int = 128
    ltm_sticky_within_bin: str = 'uniform'  # Or 'left_edge', as the authors' code.

    # LaMemo's look-ahead memory (memory='lamemo'; Ji et al. 2022) and the paper's ablations.
    lamemo_look_ahead: bool = True  # False: the memory keeps its causal outputs (Transformer-XL).
    lamemo_interpolate: bool = True  # False: alpha = 0, the refreshed memory forgets its past.
    # 'disentangled': R_|i-j| with v+ / v- by direction (eq. 12); 'xl': R_(i-j) and one v (eq. 6).
    lamemo_encoding: str = 'disentangled'
    lamemo_eps: float = 1e-6  # epsilon of alpha's denominator (eq. 11).

    # TRAMS, training-free memory selection (memory='trams', run on an 'xl' model's parameters; Yu
    # et al. 2023): mem_len is the pool; each head attends trams_select of it, the newest
    # trams_remain and the best-ranked older rows.
    trams_select: int = 200
    trams_remain: int = 150
    trams_metric: str = 'paper'  # cos(K', 1) ||K'||; 'released': ||K'|| |sum K'| (the authors' code).
    trams_positions: str = 'true'  # Selected keys at their distances; 'contiguous': the authors' code.
    trams_layers: tuple[int, ...] = ()  # Layers that select (0-based); (): all. Others keep the newest.

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

    def __post_init__(self):
        if self.d_embed == -1:
            object.__setattr__(self, 'd_embed', self.d_model)
        for name, kind, example in (('cutoffs', int, '(20000, 40000)'), ('ltm_widths', float, '(0.01, 0.05)'),
                                    ('tie_projs', bool, '(False, True)'), ('trams_layers', int, '(12, 13, 14, 15)')):
            object.__setattr__(self, name, _tuple_of(name, getattr(self, name), kind, example))
        object.__setattr__(self, 'tie_projs', self.tie_projs or (False,) * (len(self.cutoffs) + 1))
        self.validate()

    @classmethod
    def from_config_dict(cls, cfg: Mapping[str, Any], vocab_size: int | None = None,
                         segment_len: int | None = None) -> ModelConfig:
        """Builds from an ml_collections ConfigDict (or dict); `vocab_size=-1` there takes
        `vocab_size`, `segment_len=-1` takes `segment_len` (the data's tgt_len)."""
        fields = dict(cfg.to_dict() if hasattr(cfg, 'to_dict') else cfg)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f'config.model has unknown fields {unknown}; known fields: {sorted(known)}.')
        if fields.get('vocab_size', -1) in (-1, None):
            if vocab_size is None:
                raise ValueError('config.model.vocab_size is -1 (take it from the tokenizer) but no '
                                 'tokenizer vocabulary size was given.')
            fields['vocab_size'] = vocab_size
        elif vocab_size is not None and fields['vocab_size'] != vocab_size:
            raise ValueError(f'config.model.vocab_size={fields["vocab_size"]} but the tokenizer has '
                             f'{vocab_size} tokens; set config.model.vocab_size=-1 to take it from the tokenizer.')
        if fields.get('segment_len', -1) == -1 and segment_len is not None:
            fields['segment_len'] = segment_len
        return cls(**fields)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

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

        for name in ('vocab_size', 'd_model', 'n_layer', 'n_head', 'd_head', 'd_inner', 'd_embed', 'div_val'):
            need(int(getattr(self, name)) >= 1, f'{name}={getattr(self, name)} must be a positive integer.')
        need(self.d_model % 2 == 0, f'd_model={self.d_model} must be even (sin and cos halves of the '
             'positional encoding).')
        for name in ('dropout', 'dropatt'):
            need(0.0 <= getattr(self, name) < 1.0, f'{name}={getattr(self, name)} must be in [0, 1).')
        need(self.mem_len >= 0, f'mem_len={self.mem_len} must be >= 0 (0 disables memory).')
        need(not (self.same_length and self.mem_len == 0),
             'same_length=True needs mem_len > 0: every query sees exactly mem_len keys.')
        need(self.memory_start in _MEMORY_STARTS,
             f'memory_start={self.memory_start!r} must be one of {_MEMORY_STARTS}.')
        need(self.compute_dtype in _COMPUTE_DTYPES,
             f'compute_dtype={self.compute_dtype!r} must be one of {tuple(_COMPUTE_DTYPES)}.')
        # Imported here: the registries' modules import this one.
        from memjax.model import memories, positions, primitives, stack  # pylint: disable=import-outside-toplevel
        need(self.remat in stack.REMAT_POLICIES, f'remat={self.remat!r} must be one of {tuple(stack.REMAT_POLICIES)}.')
        need(self.positions in positions.POSITIONS,
             f'positions={self.positions!r} must be one of {tuple(positions.POSITIONS)}.')
        need(self.block in primitives.BLOCKS, f'block={self.block!r} must be one of {tuple(primitives.BLOCKS)}.')
        if self.block in primitives.BLOCKS:
            need(self.pre_lnorm or not primitives.BLOCKS[self.block].final_norm,
                 f'block={self.block!r} normalises before each sub-block: set pre_lnorm=True.')
        need(self.n_positions >= 1, f'n_positions={self.n_positions} must be >= 1.')
        from memjax.model import stochastic  # pylint: disable=import-outside-toplevel
        need(self.skip_rule == 'none' or self.skip_rule in stochastic.SKIP_RULES,
             f"skip_rule={self.skip_rule!r} must be 'none' or one of {tuple(stochastic.SKIP_RULES)}.")
        need(0.0 <= self.skip_p < 1.0, f'skip_p={self.skip_p} must be in [0, 1).')
        need(self.skip_until >= -1, f'skip_until={self.skip_until} must be a training step, or -1 (skip all run).')
        need(0.0 <= self.sch_beta <= 1.0, f'sch_beta={self.sch_beta} must be in [0, 1].')
        if self.memory in memories.names():
            kind = memories.kind_class(self.memory)
            problems.extend(kind.validate(self))
            need(self.skip_rule == 'none' or kind.skip_retain,
                 f"skip_rule={self.skip_rule!r}: Skip-Retain is built for memory 'xl' and 'none' (a skipped layer "
                 f"keeps its memory and ages it), not memory={self.memory!r}.")
        else:
            need(False, f'memory={self.memory!r} must be one of {memories.names()}.')
        bounds = self.cluster_bounds
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
