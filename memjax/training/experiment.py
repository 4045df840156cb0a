"""An experiment: the resolved run with its tokenizer, models, optimizer and mesh, sized against
the devices before anything compiles; its state's shapes and its jitted steps."""

import dataclasses
import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from memjax import config_lib
from memjax import errors
from memjax import model as model_lib
from memjax.data import factory as data_factory
from memjax.model import memories
from memjax.runtime import distributed
from memjax.runtime import sharding
from memjax.training import optim
from memjax.training import saved_run
from memjax.training import step as train_step_lib
from memjax.training import workdir as workdir_lib


@dataclasses.dataclass
class Experiment:
    """Everything derived from the resolved run before any compilation."""
    run: config_lib.RunConfig  # With the tokenizer's vocabulary size.
    tokenizer: Any
    model: model_lib.MemoryLM  # Phase 0; make_train_step builds the others.
    eval_model: model_lib.MemoryLM  # Same parameters, run with run.eval_model.
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    local_batch: int
    partitioner: sharding.Partitioner
    state_sharding: Any  # TrainState of NamedShardings.
    memory_sharding: Any  # Of the global training memory.

    @property
    def mcfg(self) -> model_lib.ModelConfig:
        return self.run.model

    @property
    def eval_mcfg(self) -> model_lib.ModelConfig:
        return self.run.eval_model

    @property
    def config(self) -> ml_collections.ConfigDict:
        """The run's config as the workdir saves it (vocabulary size filled in)."""
        return self.run.as_config_dict()

    @property
    def unit(self) -> str:
        return self.tokenizer.unit


def resolved(config: ml_collections.ConfigDict | config_lib.RunConfig, device_count: int) -> config_lib.RunConfig:
    """A library caller's config resolved here (the commands resolve theirs at the entry)."""
    if isinstance(config, config_lib.RunConfig):
        return config
    return config_lib.resolve(config, jax.process_count(), device_count)


def setup(config: ml_collections.ConfigDict | config_lib.RunConfig, workdir: str,
          devices: Optional[list[jax.Device]] = None, training: bool = True,
          clamp_setting: str = memories.EVAL_CLAMP_SETTING) -> Experiment:
    """Checks the run against the workdir's saved one, builds (or loads) the tokenizer and the
    model; compiles nothing.

    The mesh spans `devices` (default: every device of every process). For evaluation
    (`training=False`) the workdir must exist and nothing is written into it. `clamp_setting`: how
    the calling command clamps evaluation at the trained distances, named by the warning that
    evaluation scores distances training never did.
    """
    devices = jax.devices() if devices is None else devices
    run = resolved(config, len(devices))
    unseen = memories.unseen_distances(run.model, run.eval_model, clamp_setting)
    if unseen:
        logging.warning(unseen)
    workdir_lib.check(workdir, create=training)
    saved_run.check_saved_config(run, workdir, training)
    with distributed.primary_first('tokenizer'):
        tokenizer = data_factory.build_tokenizer(run.data, workdir, save=training)
    distributed.assert_same_on_all_processes(tokenizer.fingerprint, 'the tokenizer',
                                              'files, e.g. a shared workdir or data.vocab_path')
    run = run.with_vocab_size(tokenizer.vocab_size)
    tx = optim.make_optimizer(run.train)
    # Built once; deriving the shardings here rejects splits that do not divide before compiling.
    partitioner = sharding.Partitioner.from_config(run.mesh, devices)
    exp = Experiment(
        run=run, tokenizer=tokenizer,
        model=model_lib.build_model(run.model), eval_model=model_lib.build_model(run.eval_model),
        tx=tx, schedule=optim.learning_rate_schedule(run.train),
        local_batch=run.train.batch_size // jax.process_count(), partitioner=partitioner,
        state_sharding=train_step_lib.state_shardings(partitioner, run.model, tx),
        memory_sharding=partitioner.memory(run.model, run.train.batch_size))
    check_fits(exp, training, devices)
    return exp


def _bytes_per_device(tree: Any) -> int:
    """The largest shard of each leaf summed: what one device holds of `tree` (abstract arrays
    with shardings)."""
    shard = lambda leaf: leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    return sum(int(np.prod(shard(leaf))) * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(tree))


def device_memory_bytes(device: jax.Device) -> int:
    """What one device may hold: its allocator's limit, or on the CPU the host's memory shared by
    its CPU devices."""
    limit = (device.memory_stats() or {}).get('bytes_limit')
    if limit:
        return int(limit)
    host = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    return host // max(1, len([d for d in jax.local_devices() if d.platform == device.platform]))


def state_bytes(exp: Experiment, training: bool, batch: Optional[int] = None) -> dict[str, int]:
    """Bytes one device holds of the state: training's parameters, optimizer state and memory, or
    evaluation's parameters and memory (config.eval's memory; its batch, or `batch` rows held on
    one device, as generation's samples are)."""
    state, memory = abstract_state(exp)
    if not training and batch is not None:
        memory = jax.eval_shape(lambda: model_lib.init_memory(exp.eval_mcfg, batch))
    elif not training:
        shapes = jax.eval_shape(lambda: model_lib.init_memory(exp.eval_mcfg, exp.run.eval.batch_size))
        memory = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                                        exp.partitioner.memory(exp.eval_mcfg, exp.run.eval.batch_size))
    held = {'parameters': state.params, 'optimizer state': state.opt_state if training else (), 'memory': memory}
    return {name: _bytes_per_device(tree) for name, tree in held.items()}


def check_fits(exp: Experiment, training: bool, devices: list[jax.Device], batch: Optional[int] = None,
               extra: Optional[dict[str, int]] = None, batch_setting: str = 'the batch size') -> None:
    """Raises OutOfMemoryError before anything is built when the state alone exceeds a device's
    memory: a mem_len or batch off by orders of magnitude, found in a second instead of at the
    first allocation. `batch` and `extra` (name -> bytes): generation's samples and buffers, its
    batch set by `batch_setting`."""
    need = {**state_bytes(exp, training, batch), **(extra or {})}
    # One of this process's own: another process's device cannot be asked (GPU, TPU).
    have = device_memory_bytes(next(d for d in devices if d.process_index == jax.process_index()))
    if sum(need.values()) > have:
        gib = lambda n: f'{n / 2**30:,.1f} GiB' if n >= 2**30 else f'{n / 2**20:,.1f} MiB'
        parts = ', '.join(f'{name} {gib(n)}' for name, n in need.items() if n)
        mcfg = exp.mcfg if training else exp.eval_mcfg
        batch = batch or (exp.run.train.batch_size if training else exp.run.eval.batch_size)
        raise errors.OutOfMemoryError(
            f'the {"training" if training else "evaluation"} state needs {gib(sum(need.values()))} per device '
            f'({parts}; mem_len={mcfg.mem_len}, batch {batch}), more than a device\'s {gib(have)}: lower '
            f'mem_len or {batch_setting}, shrink the model, or shard it over more devices (config.mesh).')


def init_state(exp: Experiment, params: Any = None) -> tuple[train_step_lib.TrainState, Any]:
    """Step 0 with fresh (or the given) float32 parameters, fresh optimizer state and an empty
    memory, created in their shards."""

    def create(params):
        init_key, dropout_key = jax.random.split(jax.random.PRNGKey(exp.run.seed))
        if params is None:
            params = model_lib.init_params(exp.mcfg, init_key)
        return train_step_lib.TrainState(
            step=jnp.zeros((), jnp.int32), params=params, opt_state=exp.tx.init(params),
            rng=dropout_key)

    state = jax.jit(create, out_shardings=exp.state_sharding)(params)
    memory = exp.partitioner.init_memory(exp.mcfg, exp.run.train.batch_size)
    # bf16 compute must not leak into the master weights or Adam's moments.
    wrong = [leaf.dtype for leaf in jax.tree_util.tree_leaves((state.params, state.opt_state))
             if jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.dtype != jnp.float32]
    if wrong:
        raise TypeError(f'parameters/optimizer state must be float32, found {set(wrong)}')
    return state, memory


def abstract_state(exp: Experiment) -> tuple[Any, Any]:
    """Shapes, dtypes and current-mesh shardings of the train state and memory.

    Restoring into these re-shards a checkpoint saved on any other mesh onto this one.
    """
    shapes = jax.eval_shape(lambda params: init_state(exp, params), model_lib.abstract_params(exp.mcfg))
    shardings = (exp.state_sharding, exp.memory_sharding)
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)


def make_train_step(exp: Experiment, phase: int = 0) -> Callable:
    """The train step of training phase `phase`, jitted over the mesh with explicit shardings.

    It donates the state and the memory: orbax's save copies every array to the host before it
    returns, so the asynchronous write never reads a donated buffer.
    """
    p = exp.partitioner
    return p.jit(
        train_step_lib.train_step_fn(model_lib.build_model(exp.mcfg, phase), exp.tx, exp.schedule,
                                     train_step_lib.memory_batch_axes(exp.mcfg),
                                     exp.run.train.grad_accum_steps),
        in_shardings=(exp.state_sharding, exp.memory_sharding, p.batch),
        out_shardings=(exp.state_sharding, exp.memory_sharding, p.replicated),
        donate_argnums=(0, 1))


def make_eval_step(exp: Experiment) -> Callable:
    """`(params, memory, batch, key) -> (memory, metrics)` jitted over the mesh."""
    p = exp.partitioner
    eval_memory = p.memory(exp.eval_mcfg, exp.run.eval.batch_size)
    return p.jit(
        train_step_lib.eval_step_fn(exp.eval_model, accuracy=exp.run.eval.accuracy),
        in_shardings=(exp.state_sharding.params, eval_memory, p.batch, p.replicated),
        out_shardings=(eval_memory, p.replicated), donate_argnums=(1,))
