"""The training step the benchmark suites measure: one segment, forward, backward, Adam.

One implementation for every suite (train, compile, memory, devices, and the suites built on
them), so their figures describe the same computation. It is deliberately the plain step of
the recipe (no segment scan, no gradient accumulation, no metrics) so that its FLOPs are exactly
those `memjax.bench.flops` counts; the optimizer is the project's own (`memjax.training.optim`).
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


def copy_state(work: TrainWorkload) -> TrainWorkload:
    """A workload whose state arrays are fresh copies (a donating loop consumes the originals)."""
    copy = lambda tree: jax.tree_util.tree_map(jnp.copy, tree)
    return dataclasses.replace(work, params=copy(work.params), opt_state=copy(work.opt_state),
                               memory=copy(work.memory))


def measure(work: TrainWorkload, ctx: harness.Context, **jit_kwargs: Any) -> dict[str, Any]:
    """Compiles the step, then times it in a donating loop (consumes the workload's state).

    Returns compile times, the median step time, tokens/s and XLA's FLOP count of one step.
    """
    compiled = compile_step(work, **jit_kwargs)
    timing = harness.time_fn(StepLoop(compiled.executable, work), warmup=ctx.warmup, repeats=ctx.repeats)
    return {'lower_s': compiled.lower_s, 'compile_s': compiled.compile_s, 'step_s': timing.median_s,
            'tokens_per_s': work.tokens_per_step / timing.median_s, 'xla_flops': compiled.flops,
            'timing': timing.as_dict()}
