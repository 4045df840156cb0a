"""The steps the benchmark suites time, and the `Case` each timed thing is.

The training step: one segment, forward, backward, Adam. It is deliberately the plain step of
the recipe (no segment scan, no gradient accumulation, no metrics) so that its FLOPs are exactly
those `memjax.bench.flops` counts; the optimizer is the project's own (`memjax.training.optim`).
The evaluation step is the project's own (`train_step.eval_step_fn`), one segment per call.
One implementation of each for every suite, so that their figures describe the same computation.

A suite builds a `Case` per thing it measures (`train_case`, `eval_case`: the step compiled for
its shapes, with the loop that calls it and feeds its donated state back) and times the cases'
loops with `memjax.bench.harness`: one at a time, or round-robin when their ratio is the figure.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from memjax import config_lib
from memjax import model as model_lib
from memjax.training import optim
from memjax.training import step as train_step_lib
from memjax.bench import harness

BYTE_VOCAB = 256  # Used when the config takes its vocabulary from a tokenizer (vocab_size=-1).


def run_config(run: Optional[config_lib.RunConfig]) -> config_lib.RunConfig:
    """The bench's --config resolved, or base_config's."""
    return run if run is not None else config_lib.resolve(config_lib.base_config())


def model_config(run: Optional[config_lib.RunConfig], **overrides: Any) -> model_lib.ModelConfig:
    """config.model of the run (default: base_config's) with `overrides`, from the fields as the
    config gives them (-1: derived from the overrides); a tokenizer-sized vocabulary -> bytes."""
    fields = {**run_config(run).source['model'], **overrides}
    if fields.get('vocab_size', -1) in (-1, None):
        fields['vocab_size'] = BYTE_VOCAB
    return model_lib.ModelConfig.from_config_dict(fields)


def train_step_fn(model: model_lib.MemoryLM, tx: optax.GradientTransformation) -> Callable:
    """`(params, opt_state, memory, batch, key) -> (params, opt_state, memory, loss)`, unjitted.

    batch['skip'] ([n_layer] bool), when present, is the layers skipped (an argument, so one
    executable serves every pattern). A memory kind's random streams and weighted auxiliary
    losses (the infinity-former's sampling and KL term) are part of the step, as in training.
    """
    kind = model.kind

    def loss_fn(params, memory, batch, key):
        streams = {name: jax.random.fold_in(key, i + 1) for i, name in enumerate(kind.streams)}
        out, new_memory = model.apply({'params': params}, batch['inputs'], memory,
                                      targets=batch['targets'], deterministic=False,
                                      rngs={'dropout': key, **streams}, skip=batch.get('skip'))
        loss = model_lib.lm_loss(out.target_logprobs)
        if out.losses:
            loss += sum(kind.loss_weights[n] * v for n, v in out.losses.items()) / out.target_logprobs.size
        return loss, new_memory

    def step(params, opt_state, memory, batch, key):
        (loss, new_memory), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, memory, batch, key)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_memory, loss

    return step


@dataclasses.dataclass
class TrainWorkload:
    """A model, its optimizer state, a memory and one random batch, ready to step."""
    mcfg: model_lib.ModelConfig
    batch_size: int
    tgt_len: int
    tx: optax.GradientTransformation
    step: Callable  # train_step_fn(...)
    params: Any
    opt_state: Any
    memory: Any
    batch: dict[str, jax.Array]
    key: jax.Array

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.tgt_len

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree_util.tree_leaves(self.params))

    def args(self) -> tuple:
        return (self.params, self.opt_state, self.memory, self.batch, self.key)


def build(mcfg: model_lib.ModelConfig, batch_size: int, tgt_len: int,
          run: Optional[config_lib.RunConfig] = None, seed: int = 0) -> TrainWorkload:
    """Initialises parameters, Adam state, an empty memory and a random token batch."""
    params_key, data_key, dropout_key = jax.random.split(jax.random.PRNGKey(seed), 3)
    model = model_lib.build_model(mcfg)
    tx = optim.make_optimizer(run_config(run).train)
    params = model_lib.init_params(mcfg, params_key)
    tokens = jax.random.randint(data_key, (batch_size, tgt_len + 1), 0, mcfg.vocab_size, jnp.int32)
    return TrainWorkload(
        mcfg=mcfg, batch_size=batch_size, tgt_len=tgt_len, tx=tx, step=train_step_fn(model, tx),
        params=params, opt_state=tx.init(params), memory=model_lib.init_memory(mcfg, batch_size),
        batch={'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}, key=dropout_key)


# params, opt_state and memory are replaced by every step, as in training: donating them lets
# XLA update them in place, so the memory figures are those of a real training loop.
DONATE = (0, 1, 2)


def compile_step(work: TrainWorkload, donate: bool = True, **jit_kwargs: Any) -> harness.Compiled:
    """AOT-compiles the step for the workload's shapes (compile time measured by the harness)."""
    return harness.compile_fn(work.step, *work.args(), donate_argnums=DONATE if donate else (),
                              **jit_kwargs)


class StepLoop:
    """Calls a compiled step repeatedly, feeding its state back in (needed with donation)."""

    def __init__(self, executable: Callable, work: TrainWorkload):
        self._executable = executable
        self._state = (work.params, work.opt_state, work.memory)
        self._batch = work.batch
        self.key = work.key  # The step's random key; a caller may change it between calls.

    def __call__(self) -> tuple:
        out = self._executable(*self._state, self._batch, self.key)
        self._state = out[:3]
        return out


def copy_tree(tree: Any) -> Any:
    return jax.tree_util.tree_map(jnp.copy, tree)


def copy_state(work: TrainWorkload) -> TrainWorkload:
    """A workload whose state arrays are fresh copies (a donating loop consumes the originals)."""
    return dataclasses.replace(work, params=copy_tree(work.params), opt_state=copy_tree(work.opt_state),
                               memory=copy_tree(work.memory))


# ----------------------------------------------------------------------------------------------
# The evaluation step, one segment per call.


def eval_batch(inputs: jax.Array, targets: jax.Array) -> dict[str, jax.Array]:
    """One segment as `train_step.eval_step_fn` takes it: [segments=1, B, T], nothing masked."""
    return {'inputs': inputs[None], 'targets': targets[None],
            'mask': jnp.ones(inputs.shape, jnp.float32)[None],
            'reset': jnp.zeros((1, inputs.shape[0]), bool)}


class EvalLoop:
    """Calls a compiled evaluation step per segment, feeding its (donated) memory back in
    (`memory`: the current one)."""

    def __init__(self, executable: Callable, params, memory, batch, key):
        self._executable = executable
        self._params = params
        self.memory = memory
        self._batch = batch
        self._key = key

    def __call__(self):
        self.memory, metrics = self._executable(self._params, self.memory, self._batch, self._key)
        return metrics

    def starting_from(self, memory) -> 'EvalLoop':
        """The same step's loop from `memory` (which it consumes)."""
        return EvalLoop(self._executable, self._params, memory, self._batch, self._key)


# ----------------------------------------------------------------------------------------------
# Cases: what a suite times.


@dataclasses.dataclass
class Case:
    """A compiled step and the loop that calls it: one thing a suite times.

    `loop()` runs one step on the case's own state (a training step's parameters, optimizer state
    and memory, an evaluation's memory), which it feeds back; `tokens` is what a call processes
    (batch x segment), `work` the training workload (None for an evaluation). Once the loop has run,
    the workload's state arrays are consumed (donated): its other fields, the model config and
    shapes, are still there to read."""
    compiled: harness.Compiled
    loop: Callable[[], Any]
    tokens: int
    work: Optional[TrainWorkload] = None

    def on(self, work: TrainWorkload) -> 'Case':
        """The same compiled training step, its loop on `work`'s state and batch (same shapes)."""
        return Case(self.compiled, StepLoop(self.compiled.executable, work), work.tokens_per_step, work)

    def fill(self, context: int, tgt_len: int) -> 'Case':
        """Runs the steps that fill the memory with `context` tokens of the segment (rounded up),
        so that what is timed attends real keys, as in a long evaluation."""
        for _ in range(-(-context // tgt_len)):
            self.loop()
        return self

    def time_alone(self, ctx: harness.Context) -> harness.Timing:
        """The loop's calls timed after the context's warm-up (`harness.time_fn`); cases compared
        with each other are timed together instead (`time_together`)."""
        return harness.time_fn(self.loop, warmup=ctx.warmup, repeats=ctx.repeats)

    def figures(self, timing: harness.Timing) -> dict[str, Any]:
        """A timed row's common figures: the median call in ms, tokens/s and every timed call."""
        return {'step_ms': timing.median_s * 1e3, 'tokens_per_s': self.tokens / timing.median_s,
                'timing': timing.as_dict()}


def train_case(work: TrainWorkload, donate: bool = True, **jit_kwargs: Any) -> Case:
    """The workload's training step compiled (`compile_step`) and its loop on the workload's state
    (consumed by the loop when donated: `copy_state` first to reuse the workload)."""
    compiled = compile_step(work, donate=donate, **jit_kwargs)
    return Case(compiled, StepLoop(compiled.executable, work), work.tokens_per_step, work)


def eval_case(mcfg: model_lib.ModelConfig, params, inputs: jax.Array, targets: jax.Array) -> Case:
    """`train_step.eval_step_fn` compiled for one [B, T] segment with the memory donated, its loop
    starting from an empty memory."""
    batch = eval_batch(inputs, targets)
    memory = model_lib.init_memory(mcfg, inputs.shape[0])
    key = jax.random.PRNGKey(0)
    compiled = harness.compile_fn(train_step_lib.eval_step_fn(model_lib.build_model(mcfg)), params,
                                  memory, batch, key, donate_argnums=(1,))
    return Case(compiled, EvalLoop(compiled.executable, params, memory, batch, key), inputs.size)


def random_eval_case(mcfg: model_lib.ModelConfig, batch_size: int, tgt_len: int,
                     trained: Optional[model_lib.ModelConfig] = None) -> Case:
    """`eval_case` on fresh parameters of `trained` (default: `mcfg`, which may be its evaluation
    config) and a random segment."""
    trained = mcfg if trained is None else trained
    params = model_lib.init_params(trained, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch_size, tgt_len + 1), 0, trained.vocab_size, jnp.int32)
    return eval_case(mcfg, params, tokens[:, :-1], tokens[:, 1:])


def time_together(cases: dict[str, Case], ctx: harness.Context) -> dict[str, harness.Timing]:
    """The cases' loops timed round-robin (`harness.time_interleaved`): for cases whose ratios are
    the figures, so that the machine's drift falls on all of them alike."""
    return harness.time_interleaved({label: case.loop for label, case in cases.items()},
                                    warmup=ctx.warmup, repeats=ctx.repeats)


def measure(work: TrainWorkload, ctx: harness.Context, **jit_kwargs: Any) -> dict[str, Any]:
    """Compiles the step, then times it in a donating loop (consumes the workload's state).

    Returns compile times, the median step time, tokens/s and XLA's FLOP count of one step.
    """
    case = train_case(work, **jit_kwargs)
    timing = case.time_alone(ctx)
    return {'lower_s': case.compiled.lower_s, 'compile_s': case.compiled.compile_s, 'step_s': timing.median_s,
            'tokens_per_s': work.tokens_per_step / timing.median_s, 'xla_flops': case.compiled.flops,
            'timing': timing.as_dict()}
