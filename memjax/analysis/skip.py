"""Skip-Retain, measured: how often phase 1 skips each layer and how far back the memory a skipped
layer retains reaches (Vishnu & Sekhar, section 2.1.2, eq. 6), and what a phase-1 training step
costs against Transformer-XL's (their table 5: 535 / 607 ms), through the bench's own measurement.

Eq. 6 counts, per layer, 2M for a skipped layer (its retained memory holds the positions 2M .. M+1
back) and nothing for one that runs: p_skip(l) 2M. That assumes M = T (memory length = segment
length) and one skip at a time. A layer skipped k steps in a row lags kT (memjax's memory 'age'),
so with independent draws the retained memory's expected reach per step is
p M + T p / (1 - p), above p 2M by M p^2 / (1 - p) when M = T. The age is the whole lag of what a
layer attends: with M > T, rows kept from before a skip are masked once the layer runs again
(memjax/model/memories/xl.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from memjax import model as model_lib
from memjax.bench import harness
from memjax.bench import workload
from memjax.bench.suites import skip as skip_suite
from memjax.model import memories, stochastic
from memjax.training import step as train_step_lib


@dataclasses.dataclass(frozen=True)
class SkipRecord:
    """What the memory recorded over S training steps: `ages` [S, n_layer], the positions by which
    each layer's memory lags the next segment after step s (0: the layer ran and wrote its input;
    kT: it was skipped in the last k steps)."""

    ages: np.ndarray
    seg_len: int
    mem_len: int

    @property
    def skipped(self) -> np.ndarray:
        """[S, n_layer] bool: a skip adds T > 0 to the age, a run resets it to 0."""
        return self.ages > 0

    @property
    def skip_frequency(self) -> np.ndarray:
        """[n_layer]: the fraction of steps each layer was skipped (beside p_skip)."""
        return self.skipped.mean(axis=0)

    @property
    def skip_frequency_stderr(self) -> np.ndarray:
        """[n_layer]: the binomial standard error of skip_frequency (the draws are independent)."""
        return np.sqrt(self.skip_frequency * (1 - self.skip_frequency) / len(self.ages))

    @property
    def mean_lag(self) -> np.ndarray:
        """[n_layer]: the mean positions the memory reaches beyond Transformer-XL's M (its age)."""
        return self.ages.mean(axis=0)

    @property
    def max_lag(self) -> np.ndarray:
        """[n_layer]: the furthest lag seen (the longest run of skips times T)."""
        return self.ages.max(axis=0)

    @property
    def retained_reach(self) -> np.ndarray:
        """[n_layer]: eq. 6's per-layer term measured: M + lag for a retained memory, 0 otherwise,
        averaged over the steps (beside p_skip 2M)."""
        return np.where(self.skipped, self.mem_len + self.ages, 0).mean(axis=0)


@dataclasses.dataclass(frozen=True)
class SkipExpectation:
    """Per layer: p_skip, eq. 6's term p_skip 2M, and the exact expectations of `SkipRecord`'s
    mean_lag and retained_reach for independent draws in a long run (consecutive skips counted)."""

    p_skip: np.ndarray
    paper_context: np.ndarray
    lag: np.ndarray
    retained_reach: np.ndarray


def expected(config: model_lib.ModelConfig, seg_len: int) -> SkipExpectation:
    """What phase 1 of `config` should show with segments of `seg_len`: the age after a step is kT
    with probability (1 - p) p^k, so its mean is T p / (1 - p)."""
    probs = stochastic.skip_probabilities(config.skip_rule, config.n_layer, config.skip_p)
    lag = seg_len * probs / (1 - probs)
    return SkipExpectation(p_skip=probs, paper_context=2 * config.mem_len * probs, lag=lag,
                           retained_reach=config.mem_len * probs + lag)


def training_rngs(key: jax.Array, kind: memories.MemoryKind) -> dict:
    """The random streams of one training step whose key is `key` (`fold_in(state.rng, step)`),
    derived as memjax.training.step derives them for a step without gradient accumulation."""
    return {'dropout': jax.random.fold_in(key, 0), **train_step_lib.stream_keys(key, kind, 0)}


def record_skips(model: model_lib.MemoryLM, params, segments: Iterable, key: jax.Array) -> SkipRecord:
    """Runs the training model (`exp.model`: its phase decides whether it skips) in training mode on
    `segments` ([B, T] inputs, one per step, the memory carried), step s drawing from
    `fold_in(key, s)` as training's step s draws from its state's rng; reads each layer's age."""
    kind = model.kind

    @jax.jit
    def step(params, memory, inputs, index):
        rngs = training_rngs(jax.random.fold_in(key, index), kind)
        return model.apply({'params': params}, inputs, memory, deterministic=False, rngs=rngs)[1]

    memory, ages, seg_len = None, [], 0
    for index, inputs in enumerate(segments):
        if memory is None:
            memory = model_lib.init_memory(model.config, inputs.shape[0])
            if 'age' not in memory.layers:
                raise ValueError("record_skips: this memory keeps no age; it needs memory='xl' with mem_len > 0 "
                                 "and a skip_rule that skips some layer.")
        memory = step(params, memory, inputs, index)
        ages.append(memory.layers['age'])
        seg_len = inputs.shape[1]
    if not ages:
        raise ValueError('record_skips: no segments.')
    return SkipRecord(np.asarray(jax.device_get(ages)), seg_len=seg_len, mem_len=model.config.mem_len)


@dataclasses.dataclass(frozen=True)
class StepTimes:
    """Median and mean training-step times (ms) of Transformer-XL ('xl') and Skip-Retain's phase 1
    ('phase 1'), measured round-robin in one process."""

    median_ms: dict[str, float]
    mean_ms: dict[str, float]
    # The fraction of layers the timed phase-1 steps ran: the mean-time ratio to expect if a layer
    # costs the same every step and nothing else costs anything.
    fraction_run: float

    @property
    def phase1_vs_xl(self) -> float:
        """The paper's table 5 figure (535 / 607 = 0.88 for 15 layers), from the mean step times."""
        return self.mean_ms['phase 1'] / self.mean_ms['xl']


SMALL = dict(n_layer=6, d_model=64, n_head=2, d_head=32, d_inner=256)  # Seconds to compile on a CPU.


def phase1_steps(shape: dict = SMALL, batch: int = 4, seq: int = 32, patterns: int = 64,
                 seed: int = 0) -> tuple[dict[str, Callable], np.ndarray]:
    """({'xl': step, 'phase 1': step}, skips [patterns, n_layer]): the bench's 'skip' suite training
    steps (memjax/bench/suites/skip.py) at this shape (model fields), tgt = mem = seq, each compiled
    at its first call; every call runs one step on the step's own state and returns (params,
    opt_state, memory, loss). The phase-1 step takes the next eq. 1 pattern at every call, as
    training draws anew."""
    plain = workload.model_config(None, mem_len=seq, **shape)
    retain = plain.replace(skip_rule='linear')
    drawn = skip_suite.eq1_patterns(plain.n_layer, patterns, seed)
    xl = workload.build(plain, batch, seq, seed=seed)
    # The same parameters, optimizer state and tokens (an eager initialisation costs seconds); the
    # skip pattern is an argument, so one executable serves every draw.
    phase1 = dataclasses.replace(workload.copy_state(xl), mcfg=retain,
                                 step=workload.train_step_fn(model_lib.build_model(retain), xl.tx),
                                 memory=model_lib.init_memory(retain, batch),
                                 batch=dict(xl.batch, skip=jnp.zeros(plain.n_layer, bool)))
    steps = {}
    for label, work, skips in (('xl', xl, None), ('phase 1', phase1, [jnp.asarray(s) for s in drawn])):
        executable = jax.jit(work.step, donate_argnums=workload.DONATE)
        steps[label] = skip_suite.Varying(executable, work, skips)
    return steps, drawn


def phase1_step_times(shape: dict = SMALL, batch: int = 4, seq: int = 32, warmup: int = 2, repeats: int = 10,
                      patterns: int = 64, seed: int = 0) -> StepTimes:
    """Transformer-XL's training step against phase 1's (`phase1_steps`), timed round-robin by the
    bench's harness after `warmup` (>= 1: the compile) calls of each; only these two steps, as each
    compile costs seconds on a CPU."""
    if warmup < 1:
        raise ValueError(f'warmup={warmup}: the first call of a step compiles it, so it must not be timed.')
    steps, drawn = phase1_steps(shape, batch, seq, patterns, seed)
    timings = harness.time_interleaved(steps, warmup=warmup, repeats=repeats)
    timed = drawn[np.arange(warmup, warmup + repeats) % patterns]
    return StepTimes(median_ms={k: t.median_s * 1e3 for k, t in timings.items()},
                     mean_ms={k: float(np.mean(t.times_s)) * 1e3 for k, t in timings.items()},
                     fraction_run=1.0 - float(timed.mean()))
