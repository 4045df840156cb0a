"""The memory-transformer language model every memory kind shares.

`apply(variables, tokens, memory, ...) -> (ModelOutput, new_memory)`: the memory goes in and comes
back out as an explicit pytree, so a sequence of segments is a `jax.lax.scan` with the memory as
carry. config.model.memory picks what the memory is (memjax/model/memories/); 'none' is the
Transformer + relative-position baseline.
"""

from __future__ import annotations

import functools
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from memjax.errors import failed
from memjax.model import memories
from memjax.model import shared_hashes
from memjax.model.adaptive import AdaptiveIO
from memjax.model.attention import AttentionContext
from memjax.model.config import ModelConfig
from memjax.model.positions import POSITIONS
from memjax.model.primitives import BLOCKS, BTE, Dropout, layer_norm, normal, param
from memjax.model.stack import layer_stack


@struct.dataclass
class ModelOutput:
    hidden: jax.Array  # [B, T, d_model] final hidden states, input of the softmax.
    target_logprobs: Optional[jax.Array] = None  # [B, T] float32 log p(target); None without targets.
    # The memory kind's auxiliary losses, summed over layers, batch rows and positions.
    losses: dict = struct.field(default_factory=dict)


def ids_in_range(ids: jax.Array, vocab_size: int) -> jax.Array:
    return (ids >= 0) & (ids < vocab_size)


def check_ids(ids: jax.Array, vocab_size: int, name: str) -> None:
    """Raises ValueError for ids outside [0, vocab_size) when they are concrete (eager calls).

    Under `jit` the ids are abstract: there, an out-of-range input makes the hidden states
    NaN and an out-of-range target its log-prob NaN (gathers would clamp them into a finite,
    wrong answer), so a training loop's non-finite check stops on them.
    """
    if isinstance(ids, jax.core.Tracer):
        return
    ids = np.asarray(ids)
    bad = ids[~((ids >= 0) & (ids < vocab_size))]
    if bad.size:
        raise ValueError(f'{bad.size} {name} ids lie outside [0, {vocab_size}) (e.g. '
                         f'{sorted(set(bad.tolist()))[:5]}): the ids come from another tokenizer '
                         'than the one config.vocab_size was set for.')


def _check_layer_layout(module: nn.Module, cfg: ModelConfig) -> None:
    """One line instead of flax's ScopeCollectionNotFound for parameters in the other layout."""
    if module.is_initializing():
        return
    names = module.variables.get('params', {})
    have_scanned, want_scanned = 'layers' in names, cfg.scan_layers
    if cfg.n_layer and ('layer_0' in names or have_scanned) and have_scanned != want_scanned:
        layout = "one stacked 'layers'" if have_scanned else "separate 'layer_{i}'"
        raise ValueError(f'the parameters hold {layout} subtrees but config.scan_layers={want_scanned}: '
                         f'convert them with memjax.model.convert_layer_layout(params, scan_layers={want_scanned}).')


def _check_memory(kind: memories.MemoryKind, memory: memories.MemoryState, batch_size: int) -> None:
    """One line instead of a shape error deep in the stack for a memory built for another
    config (mem_len, kind) or batch size; checked while tracing, free at run time."""
    want = jax.eval_shape(lambda: kind.init(batch_size))
    shapes = lambda tree: jax.tree.map(lambda x: (tuple(x.shape), str(x.dtype)), tree)
    if jax.tree.structure(memory) != jax.tree.structure(want) or shapes(memory) != shapes(want):
        raise ValueError(f'the memory does not fit memory={kind.config.memory!r} with these settings '
                         f'(mem_len={kind.config.mem_len}, batch {batch_size}): build it with '
                         'init_memory(config, batch_size) for the config you apply.')


def _check_inputs(tokens: jax.Array, targets: Optional[jax.Array], reset: Optional[jax.Array],
                  skip: Optional[jax.Array], n_layer: int) -> None:
    """One line naming the input for tokens, targets, reset or skip of the wrong shape (checked
    while tracing): deep in the stack they would broadcast, or fail in a kernel that names none."""
    shape = tuple(tokens.shape)
    wrong = failed(
        (len(shape) == 2, f'tokens {list(shape)} must be [batch, segment] int ids'),
        (targets is None or tuple(targets.shape) == shape, f'targets {list(np.shape(targets))} must match tokens '
                                                           f'{list(shape)}'),
        (reset is None or tuple(np.shape(reset)) == shape[:1],
         f'reset {list(np.shape(reset))} must be {list(shape[:1])} (one flag per batch row)'),
        (skip is None or tuple(np.shape(skip)) == (n_layer,),
         f'skip {list(np.shape(skip))} must be [{n_layer}] (one flag per layer)'))
    if wrong:
        raise ValueError('; '.join(wrong) + '.')


class MemoryLM(nn.Module):
    """Embeddings -> the layer stack over the memory kind's state -> adaptive softmax."""

    config: ModelConfig
    # Static training phase for kinds that train in phases (MemoryKind.phase_starts); one
    # compiled step per phase.
    phase: int = 0

    @property
    def kind(self) -> memories.MemoryKind:
        return memories.get(self.config)

    def setup(self):
        cfg = self.config
        self.io = AdaptiveIO(cfg)
        if self.relative and not cfg.untie_r:
            bias = lambda name: param(self, name, normal(cfg.init_std, ('heads', 'kv')), (cfg.n_head, cfg.d_head))
            self.u_bias, self.v_bias = bias('u_bias'), bias('v_bias')
            self.kind_biases = {name: bias(name) for name in self.kind.bias_names}
        if not self.relative:
            self.position_table = param(self, 'position_embedding', normal(cfg.init_std, (None, 'embed')),
                                        (cfg.n_positions, cfg.d_model))
        if BLOCKS[cfg.block].final_norm:
            self.final_norm = layer_norm(cfg, 'final_norm')
        self.dropout = Dropout(cfg.dropout)

    @property
    def relative(self) -> bool:
        return POSITIONS[self.config.positions] is not None

    @nn.compact
    def __call__(self, tokens: jax.Array, memory: memories.MemoryState, targets: Optional[jax.Array] = None,
                 reset: Optional[jax.Array] = None, deterministic: bool = True,
                 skip: Optional[jax.Array] = None, record: bool = False, caches=None, position=None):
        """tokens, targets: [B, T] int32; reset: [B] bool, starts those rows' memory afresh first;
        skip: [n_layer] bool, layers not run this step (default in training: the kind's
        `skip_layers`; evaluation never skips).

        Decoding token by token (memjax/generation): `record=True` also returns every layer's
        `LayerCache` of the segment (`layer_stack`'s layout); given those `caches`, `tokens` [B, 1]
        is the token at segment `position` (int32 scalar): it attends the caches, the memory is
        returned unchanged and the caches hold its keys. Both return `(output, memory, caches)`.
        """
        cfg, kind = self.config, self.kind
        _check_layer_layout(self, cfg)
        _check_inputs(tokens, targets, reset, skip, cfg.n_layer)
        _check_memory(kind, memory, tokens.shape[0])
        if reset is not None:
            memory = kind.reset(memory, reset)
        check_ids(tokens, cfg.vocab_size, 'tokens')
        stepping = caches is not None
        qlen = tokens.shape[1]
        h = self.io.embed(tokens)
        if not self.relative:
            if qlen > cfg.n_positions:
                raise ValueError(f'segments of {qlen} tokens but the learned position table has '
                                 f'n_positions={cfg.n_positions} rows: shorten tgt_len or raise n_positions.')
            table = self.position_table.astype(h.dtype)
            h = h + (jax.lax.dynamic_slice_in_dim(table, position, 1) if stepping else table[:qlen])
        h = jnp.where(ids_in_range(tokens, cfg.vocab_size)[..., None], h, jnp.nan)
        h = self.dropout(h, deterministic=deterministic)
        h = nn.with_logical_constraint(h, BTE)
        embedded = h
        positions = u_bias = v_bias = None
        biases = {}
        if self.relative:
            if not stepping:  # A token step has the positional keys in its caches.
                positions = POSITIONS[cfg.positions](kind.position_rows(qlen), cfg.d_model, cfg.clamp_len)
                positions = self.dropout(positions, deterministic=deterministic)
            if not cfg.untie_r:
                u_bias, v_bias, biases = self.u_bias, self.v_bias, self.kind_biases
        ctx = AttentionContext(positions, u_bias, v_bias, window=kind.window, biases=biases)
        if skip is None and 'skip' in kind.streams and not deterministic and not self.is_initializing():
            skip = kind.skip_layers(self.make_rng('skip'), self.phase)

        decoding = 'step' if stepping else 'record' if record else None
        h, layers, losses, *caches = layer_stack(cfg, kind, deterministic, decoding)(
            h, memory.layers, memory.shared, ctx, skip, caches, position)
        # GPT-2 closes with a LayerNorm; Transformer-XL with dropout before the softmax.
        h = self.final_norm(h) if BLOCKS[cfg.block].final_norm else self.dropout(h, deterministic=deterministic)

        if stepping:
            return ModelOutput(hidden=h), memory, caches[0]
        new_memory = memories.MemoryState(layers=layers, shared=kind.advance(memory.shared, embedded))
        logprobs = None
        if targets is not None:
            check_ids(targets, cfg.vocab_size, 'targets')
            logprobs = jnp.where(ids_in_range(targets, cfg.vocab_size),
                                 self.io.target_logprobs(h, targets, evaluation=deterministic), jnp.nan)
        output = ModelOutput(hidden=h, target_logprobs=logprobs, losses=losses)
        return (output, new_memory, caches[0]) if record else (output, new_memory)

    def logprobs(self, hidden: jax.Array) -> jax.Array:
        """Full-vocabulary log-probabilities from `ModelOutput.hidden`; use with `method=`."""
        return self.io.logprobs(hidden)

    def cluster_logprobs(self, hidden: jax.Array, cluster: int) -> jax.Array:
        """One adaptive-softmax cluster's log-probabilities (`AdaptiveIO.cluster_logprobs`), so a
        sampler scores only the clusters it needs; use with `method=`."""
        return self.io.cluster_logprobs(hidden, cluster)


def build_model(config: ModelConfig, phase: int = 0) -> MemoryLM:
    """The model `config` describes (its memory kind, positions and block style)."""
    if config.vocab_size == -1:
        raise ValueError('vocab_size=-1: the vocabulary size is not known yet; build the model from a '
                         'config with the tokenizer\'s (RunConfig.with_vocab_size, or set vocab_size).')
    return MemoryLM(config, phase)


def init_memory(config: ModelConfig, batch_size: int) -> memories.MemoryState:
    """The memory state before the first segment of `batch_size` streams."""
    return memories.get(config).init(batch_size)


def lm_loss(target_logprobs: jax.Array, mask: Optional[jax.Array] = None) -> jax.Array:
    """Mean negative log-likelihood in nats over the positions where mask is 1."""
    # float32: a mean over 10^5 tokens of values near ln V would keep 3 significant digits in bf16.
    nll = -target_logprobs.astype(jnp.float32)
    if mask is None:
        return nll.mean()
    mask = mask.astype(jnp.float32)
    return (nll * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def _init_variables(config: ModelConfig, key: jax.Array):
    tokens = jnp.zeros((1, 1), jnp.int32)
    rngs = {'params': key, **{name: key for name in memories.get(config).streams}}
    return build_model(config).init(rngs, tokens, init_memory(config, 1))


@functools.partial(jax.jit, static_argnums=0, static_argnames='share_hashes')
def init_params(config: ModelConfig, key: jax.Array, share_hashes: bool = True) -> dict:
    """Float32 parameters as plain arrays (the logical-axis boxes stripped; see param_logical_axes).

    Compiled: init runs the model on one token, and XLA drops that forward from the program
    (only the initialisers reach the parameters), where op by op every one of its operations
    would run, each compiled for its shape. Also the numbers training's own jitted init gives.
    The draws share their Threefry hashes (memjax/model/shared_hashes.py): the values Flax's init
    gives, bit for bit, compiled in under half the time; share_hashes=False draws as
    Flax does, one hash per draw (the compile suite of memjax.bench times both).
    """
    init = lambda key: nn.meta.unbox(_init_variables(config, key)['params'])
    return (shared_hashes.with_shared_hashes(init) if share_hashes else init)(key)


@functools.lru_cache(maxsize=32)
def _abstract_variables(config: ModelConfig) -> dict:
    """init's variables as shapes, dtypes and logical-axis boxes, traced once per config: a run
    asks for them several times (shardings, restore targets, the memory check), and each trace of
    the model's init costs as much as a tenth of a small run's start-up."""
    return jax.eval_shape(lambda: _init_variables(config, jax.random.key(0)))


def abstract_params(config: ModelConfig) -> dict:
    """init_params' tree as jax.ShapeDtypeStructs."""
    return nn.meta.unbox(_abstract_variables(config)['params'])


def param_logical_axes(config: ModelConfig) -> dict:
    """PartitionSpecs of logical axis names ('embed', 'heads', ...) mirroring init_params' tree."""
    return nn.get_partition_spec(_abstract_variables(config))['params']


def memory_logical_axes(config: ModelConfig) -> memories.MemoryState:
    return memories.get(config).logical_axes()


def convert_layer_layout(params: dict, scan_layers: bool) -> dict:
    """Re-lays parameters for `scan_layers`: 'layer_{i}' subtrees <-> one 'layers' subtree stacked
    on a leading axis. Parameters already in the requested layout come back unchanged."""
    params = dict(params)
    if scan_layers and 'layers' not in params:
        names = sorted((k for k in params if k.startswith('layer_')), key=lambda k: int(k[len('layer_'):]))
        params['layers'] = jax.tree.map(lambda *xs: jnp.stack(xs), *[params.pop(k) for k in names])
    elif not scan_layers and 'layers' in params:
        stacked = params.pop('layers')
        n_layer = jax.tree.leaves(stacked)[0].shape[0]
        for i in range(n_layer):
            params[f'layer_{i}'] = jax.tree.map(lambda x: x[i], stacked)
    return params
