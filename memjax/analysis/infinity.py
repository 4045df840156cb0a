"""The infinity-former's long-term memory (Martins et al., 2022) seen from outside: where the
queries' attention densities go over [0, 1] (fig. 7), how much of the signal each past token holds
after the memory's updates with and without sticky memories (figs. 10-11, section 3.3), and how well
N basis functions fit a sequence of rows (fig. 3 right).

  tr = infinity.trace(run.model, run.params, analysis.text_batches(run, 'validation', 40), layers=(0, 15))
  density = infinity.attention_density(tr, layer=15, bins=50)          # [50], sums to 1
  life = infinity.lifetime(tr, stream=0, updates=5, layer=15)          # sticky draws of 5 updates
  spaces = infinity.memory_spaces(S, tau, life.positions)              # [6 S], sums to 1

A token's space follows its interval of [0, 1] through the updates: the first segment fills [0, 1]
evenly, each update samples the old signal at M positions, places sample m (from 1) at m tau / M
and the new segment evenly in [tau, 1] (`InfinityMemory.update_matrices`). The stretch of the old
signal between two consecutive samples becomes the tau / M between their new places, spread evenly
over it; what lies past the last sample is dropped. Evenly spaced samples make this the contraction
x -> tau x; sticky draws give the regions sampled often more room (the paper's footnote 12 places
each word at a point and takes its Voronoi cell: the same room up to where the cell borders fall).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from memjax import model as model_lib
from memjax.analysis.run import Segment, apply_sown, per_layer
from memjax.model import ModelConfig
from memjax.model.memories.infinity import InfinityMemory, basis_values, sticky_histogram


@dataclasses.dataclass(frozen=True)
class Trace:
    """The LTMs of `layers` over consecutive segments of B streams; axis 0 of every array is the step.

    mu, sigma2 [steps, layers, B, H, T]: the densities the queries of the step put over the LTM;
    used [steps, B]: the LTM held something at that step (its densities were read);
    ltm_tokens [steps, B]: tokens the LTM holds after the step (segment_len: it started afresh);
    positions [steps, layers, B, M]: the sticky draws the step sampled the old signal at (None
    without sticky memories); rows [steps, layers, B, segment_len, d_model]: the layer inputs that
    wait for the next step's update, before the gate (None unless kept); inputs [steps, B, T].
    """

    config: ModelConfig
    layers: tuple[int, ...]
    mu: np.ndarray
    sigma2: np.ndarray
    used: np.ndarray
    ltm_tokens: np.ndarray
    positions: Optional[np.ndarray]
    rows: Optional[np.ndarray]
    inputs: np.ndarray

    def index(self, layer: int) -> int:
        if layer not in self.layers:
            raise ValueError(f'layer {layer} was not traced (traced: {self.layers}).')
        return self.layers.index(layer)


def _sown_only(sown: dict, name: str) -> dict:
    """The part of `sown` under `name`: a jitted step returns only that (every layer's attention
    probabilities are sown too)."""
    flat = traverse_util.flatten_dict(sown, is_leaf=lambda _, x: isinstance(x, tuple))
    return traverse_util.unflatten_dict({path: value for path, value in flat.items() if path[-1] == name})


def trace(model: model_lib.MemoryLM, params, segments: Iterable[Segment], key: Optional[jax.Array] = None,
          layers: Optional[Sequence[int]] = None, keep_rows: bool = False) -> Trace:
    """Runs `model` (an infinity-former) over `segments` from a fresh memory, recording its LTMs.

    Segment s draws its sticky positions from `fold_in(key, s)`, as evaluation does. `layers`:
    all by default; `keep_rows` also keeps the rows each update fits ([segment_len, d_model] per
    layer, stream and step: the heavy part)."""
    cfg = model.config
    if cfg.memory != 'infinity':
        raise ValueError(f"trace reads the infinity-former's memory; this model has memory={cfg.memory!r}.")
    layers = tuple(range(cfg.n_layer)) if layers is None else tuple(layers)
    key = jax.random.key(0) if key is None else key
    picked = jnp.asarray(layers)

    @jax.jit
    def step(params, inputs, memory, reset, key):
        _, memory, sown = apply_sown(model, params, inputs, memory, reset=reset, rngs={'sticky': key})
        record = {name: memory.layers[name][picked] for name in ('mu', 'sigma2')}
        record['ltm_tokens'] = memory.shared['ltm_tokens']
        if keep_rows:
            record['rows'] = memory.layers['hidden'][picked, :, :cfg.segment_len]
        return memory, record, _sown_only(sown, 'sticky_positions')

    records, memory, waiting = [], None, InfinityMemory(cfg)
    for index, segment in enumerate(segments):
        if memory is None:
            memory = model_lib.init_memory(cfg, segment.inputs.shape[0])
        # Read before the step, as the model reads it: where the block waiting for the LTM holds a
        # token (after any reset).
        reset = np.asarray(segment.reset, bool)
        used = ~reset & np.asarray(waiting.waiting_used(memory.shared))
        memory, record, sown = step(params, segment.inputs, memory, reset, jax.random.fold_in(key, index))
        record = jax.device_get(record)
        record.update(used=used, inputs=segment.inputs)
        if cfg.ltm_sticky:
            record['positions'] = np.asarray(per_layer(sown, 'sticky_positions'))[np.asarray(layers)]
        records.append(record)
    if not records:
        raise ValueError('trace needs at least one segment.')
    stacked = {name: np.stack([r[name] for r in records]) for name in records[0]}
    return Trace(cfg, layers, stacked['mu'], stacked['sigma2'], stacked['used'], stacked['ltm_tokens'],
                 stacked.get('positions'), stacked.get('rows'), stacked['inputs'])


def attention_density(tr: Trace, layer: int, bins: int) -> np.ndarray:
    """[bins] share of the attention the queries of `layer` gave each bin of [0, 1] (fig. 7):
    eq. 16's histogram of every step and stream whose LTM was used, averaged."""
    i = tr.index(layer)
    mu, sigma2 = tr.mu[:, i], tr.sigma2[:, i]
    rows = mu.shape[:2]
    per_row = np.asarray(sticky_histogram(jnp.asarray(mu.reshape((-1,) + mu.shape[2:])),
                                          jnp.asarray(sigma2.reshape((-1,) + mu.shape[2:])), bins))
    weights = tr.used.reshape(-1).astype(np.float64)
    if not weights.sum():
        raise ValueError(f'the LTM was never used over these {rows[0]} segments: trace more of them.')
    return weights @ per_row / weights.sum()


@dataclasses.dataclass(frozen=True)
class Lifetime:
    """One stretch of a stream's LTM from a fresh start through `updates` updates.

    first_step: the step that started it afresh; positions [updates, M]: where each update sampled
    the old signal (the sticky draws; None for a model without sticky memories); tokens
    [segment_len (updates + 1)]: the text the LTM holds after the last update, oldest first."""

    first_step: int
    positions: Optional[np.ndarray]
    tokens: np.ndarray


def lifetime(tr: Trace, stream: int, updates: int, layer: int) -> Lifetime:
    """The first stretch of `stream` in `tr` where the LTM starts afresh and is updated `updates`
    times in a row; its sample positions are `layer`'s."""
    cfg, s = tr.config, tr.config.segment_len
    held = tr.ltm_tokens[:, stream]
    # The rows the LTM takes at step f left the STM the step before: stream positions
    # [f S - S - mem_len, f S - mem_len); before 0 they were the zeros of memory_start='zeros'.
    start = lambda f: f * s - s - cfg.mem_len
    for first in range(len(held) - updates):
        if start(first) >= 0 and np.array_equal(held[first:first + updates + 1], s * np.arange(1, updates + 2)):
            break
    else:
        raise ValueError(f'stream {stream} has no fresh LTM followed by {updates} updates in these {len(held)} '
                         f'segments (ltm_reset_tokens={cfg.ltm_reset_tokens}): trace more segments or ask fewer.')
    text = tr.inputs[:, stream].reshape(-1)
    positions = None if tr.positions is None else tr.positions[first + 1:first + updates + 1, tr.index(layer), stream]
    return Lifetime(first, positions, text[start(first):start(first) + s * (updates + 1)])


def layer_rows(tr: Trace, layer: int, stream: int) -> np.ndarray:
    """[L, d_model] the rows `layer`'s LTM was given over the traced text of `stream` (its inputs,
    before the gate), in text order from stream position ceil(mem_len / S) S - mem_len (0 when
    mem_len is a multiple of the segment S); needs `trace(..., keep_rows=True)`. The rows still in
    the STM when a document starts are never given to it: zeros here."""
    if tr.rows is None:
        raise ValueError('the trace kept no rows: trace(..., keep_rows=True).')
    s = tr.config.segment_len
    # Rows kept after step f wait for step f + 1: stream positions [f S - mem_len, (f + 1) S - mem_len).
    first = -(-tr.config.mem_len // s)
    rows = tr.rows[first:, tr.index(layer), stream]
    return rows.reshape((-1,) + rows.shape[2:])


def even_positions(samples: int) -> np.ndarray:
    """[M] the evenly spaced positions k / M (k from 1) the model samples the old signal at
    without sticky memories (`InfinityMemory.even_resample_matrix`)."""
    return np.arange(1, samples + 1) / samples


def _placed(x: np.ndarray, samples: np.ndarray, tau: float) -> np.ndarray:
    """Where points x of the old signal land in the new one: sample k (from 1) at k tau / M, the
    stretch between two samples evenly between their places, beyond the last at tau. Left-limit at
    a sample drawn several times (a bin's left edge): the repeats belong to what follows it."""
    m = len(samples)
    before = np.searchsorted(samples, x, side='left')  # Samples strictly before x.
    start = np.concatenate([[0.0], samples])[before]
    end = np.concatenate([samples, [1.0]])[before]
    gap = end - start
    within = np.where((before < m) & (gap > 0), (x - start) / np.where(gap > 0, gap, 1.0), 0.0)
    return tau * (before + within) / m


def memory_spaces(segment_len: int, tau: float, positions: Sequence[np.ndarray]) -> np.ndarray:
    """[segment_len (len(positions) + 1)] the length of [0, 1] each token holds after the updates
    (figs. 10-11), oldest first; `positions[u]` [M]: where update u sampled the old signal
    (`even_positions`, or a `Lifetime`'s sticky draws). They sum to 1."""
    edges = np.linspace(0.0, 1.0, segment_len + 1)
    new = tau + (1.0 - tau) * np.arange(1, segment_len + 1) / segment_len
    for samples in positions:
        edges = np.concatenate([_placed(edges, np.sort(np.asarray(samples, np.float64)), tau), new])
    return np.diff(edges)


def segment_edges(spaces: np.ndarray, segment_len: int) -> np.ndarray:
    """Where each segment's tokens end in [0, 1] (the last segment's end, 1, left out): the
    dashed lines of figs. 7, 10 and 11; tau^k, ..., tau without sticky memories."""
    return np.cumsum(spaces)[segment_len - 1:-1:segment_len]


def regression_errors(signal: np.ndarray, config: ModelConfig, n_basis: Sequence[int]) -> np.ndarray:
    """[len(n_basis)] mean squared error of `signal` [L, D] refitted with N basis functions, per N
    (fig. 3 right): the rows at (k + 1/2) / L, fitted as the model fits a fresh memory
    (`fresh_matrix`, with `config`'s widths and ridge), the signal rebuilt at those positions."""
    signal = np.asarray(signal, np.float64)
    length = signal.shape[0]
    t = (np.arange(length) + 0.5) / length
    errors = []
    for n in n_basis:
        kind = InfinityMemory(config.replace(segment_len=length, ltm_basis=n))
        coefficients = kind.fresh_matrix().astype(np.float64).T @ signal  # B = G^T X: [N, D].
        errors.append(np.mean((basis_values(t, *kind.basis) @ coefficients - signal) ** 2))
    return np.asarray(errors)
