"""Device mesh, logical-axis rules and the shardings of everything a step reads or writes.

Parameters and activations carry logical axis names ('embed', 'heads', ...); one table maps
those names to the mesh axes ('data', 'fsdp', 'tensor'). Changing the parallelism layout is
therefore a config change (`config.mesh`), never a model change, and XLA's SPMD partitioner
inserts every collective.
"""

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable, Iterator, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from memjax.runtime.mesh import MESH_AXES, MeshConfig
from memjax.errors import ConfigError
from memjax import model as model_lib

DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    # fsdp is data parallelism for activations: the streams split over both data axes.
    ('batch', ('data', 'fsdp')),
    ('activation_batch', ('data', 'fsdp')),
    # ZeRO-3: every weight's d_model dimension is split over fsdp and all-gathered just before use.
    ('embed', 'fsdp'),
    # Megatron-style tensor parallelism: heads, feed-forward units and vocabulary entries are
    # independent columns, so each device computes its own slice without communication.
    ('heads', 'tensor'),
    ('mlp', 'tensor'),
    ('vocab', 'tensor'),
    ('activation_heads', 'tensor'),
    ('activation_mlp', 'tensor'),
    ('activation_vocab', 'tensor'),
    # d_head is small and contracted in every attention einsum: splitting it only adds reductions.
    ('kv', None),
    ('activation_kv', None),
    # Layer inputs (and hence the memory) stay full-width: the tensor-parallel projections need
    # them whole, so sharding them would add an all-gather in front of every layer.
    ('activation_embed', None),
    # Attention mixes every position of a segment with the memory: no sequence parallelism.
    ('length', None),
    ('activation_length', None),
    # Splitting the nn.scan axis would make each layer iteration fetch weights from other devices.
    ('layers', None),
    # LayerNorm scales and biases are too small to be worth splitting.
    ('norm', None),
)


def logical_rules(overrides: Sequence[Sequence[Any]] = ()) -> tuple[tuple[str, Any], ...]:
    """DEFAULT_RULES with the entries named in `overrides` (config.mesh.rules) replaced."""
    known = dict(DEFAULT_RULES)
    replaced = {}
    for name, axes in overrides:
        if name not in known:
            raise ConfigError(
                f'config.mesh.rules names unknown logical axis {name!r}; known axes: '
                f'{sorted(known)}.')
        replaced[name] = tuple(axes) if isinstance(axes, list) else axes
    return tuple((name, replaced.get(name, axes)) for name, axes in DEFAULT_RULES)


def make_mesh(mesh_cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """The ('data', 'fsdp', 'tensor') mesh over `devices` (default: all devices of all processes)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_cfg.shape(len(devices))
    shape = tuple(sizes[name] for name in MESH_AXES)
    if math.prod(shape) != len(devices):
        raise ConfigError(
            f'config.mesh {sizes} needs {math.prod(shape)} devices but {len(devices)} are present.')
    # Auto axes: the SPMD partitioner propagates shardings between the annotated arrays.
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    mesh = jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
    ordered = process_ordered(mesh.devices)
    return mesh if ordered is mesh.devices else Mesh(ordered, MESH_AXES, axis_types=axis_types)


def process_ordered(devices: np.ndarray) -> np.ndarray:
    """`devices` (a mesh's array, the batch axes leading) with each process's devices in one block,
    the processes in order, each block in the given (physical) order; `devices` itself where they
    are so already.

    Process p reads streams [p B / P, (p + 1) B / P) of the batch, and
    `make_array_from_process_local_data` puts them in the global rows its devices hold: those rows
    must be that block, or a checkpoint's memory, saved by global row, would meet other streams
    on a resume with another mesh or process count. `jax.make_mesh` orders TPU devices by their
    physical layout, which can interleave the hosts along the batch (a v4-32's z axis)."""
    flat = devices.reshape(-1)
    order = sorted(range(flat.size), key=lambda i: (flat[i].process_index, i))
    return devices if order == list(range(flat.size)) else flat[order].reshape(devices.shape)


def _spec_leaf(x: Any) -> bool:
    return isinstance(x, P)


@dataclasses.dataclass(frozen=True)
class Partitioner:
    """A mesh plus the logical rules: turns logical names into shardings and jits steps."""
    mesh: Mesh
    rules: tuple[tuple[str, Any], ...]

    @classmethod
    def from_config(cls, mesh_cfg: MeshConfig, devices: Optional[Sequence[jax.Device]] = None) -> 'Partitioner':
        return cls(make_mesh(mesh_cfg, devices), logical_rules(mesh_cfg.rules))

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Mesh and rules in scope, so the model's nn.with_logical_constraint calls take effect."""
        with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
            yield

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    @property
    def batch(self) -> NamedSharding:
        """Sharding of every [S, B, ...] input array: streams split over the batch axes."""
        return self.shardings(P(None, 'batch'))

    def shardings(self, logical: Any) -> Any:
        """A tree of logical PartitionSpecs as NamedShardings on this mesh."""
        return nn.logical_to_mesh_sharding(logical, self.mesh, self.rules)

    def _checked(self, what: str, abstract: Any, logical: Any) -> Any:
        """Shardings of `abstract` (same tree as `logical`), refusing splits that do not divide."""
        shardings = self.shardings(logical)
        problems = []
        flat_logical = jax.tree_util.tree_leaves(logical, is_leaf=_spec_leaf)
        flat_abstract = jax.tree_util.tree_leaves_with_path(abstract)
        flat_shardings = jax.tree_util.tree_leaves(shardings)
        for (path, leaf), names, sharding in zip(flat_abstract, flat_logical, flat_shardings):
            for dim, name, axes in zip(leaf.shape, names, sharding.spec):
                size = math.prod(self.mesh.shape[a] for a in
                                 ((axes,) if isinstance(axes, str) else axes or ()))
                if dim % size:
                    problems.append(f'{what}{jax.tree_util.keystr(path)}: dimension {dim} '
                                    f'({name!r} -> {axes}) is not divisible by {size}')
        if problems:
            raise ConfigError(
                'these arrays cannot be split as config.mesh / config.mesh.rules ask:\n  '
                + '\n  '.join(problems) + '\nChange the mesh sizes, or map the logical axis to '
                'None in config.mesh.rules, e.g. (("vocab", None),).')
        return shardings

    def params(self, mcfg: model_lib.ModelConfig) -> Any:
        return self._checked('params', model_lib.abstract_params(mcfg), model_lib.param_logical_axes(mcfg))

    def memory(self, mcfg: model_lib.ModelConfig, batch_size: int) -> Any:
        """Shardings of the global memory of `batch_size` streams."""
        abstract = jax.eval_shape(lambda: model_lib.init_memory(mcfg, batch_size))
        return self._checked('memory', abstract, model_lib.memory_logical_axes(mcfg))

    def params_and_optimizer(self, mcfg: model_lib.ModelConfig, tx: optax.GradientTransformation) -> tuple[Any, Any]:
        """Shardings of the params and of `tx`'s state: moments are sharded exactly like their params."""
        params = self.params(mcfg)
        opt_state = optax.tree_map_params(
            tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, model_lib.abstract_params(mcfg)),
            params,
            transform_non_params=lambda _: self.replicated)
        return params, opt_state

    def jit(self, fn: Callable, in_shardings: Any, out_shardings: Any,
            donate_argnums: tuple[int, ...] = ()) -> 'MeshJitted':
        """`jax.jit` with explicit shardings, traced (and run) inside `context()`."""
        return MeshJitted(self, jax.jit(fn, in_shardings=in_shardings, out_shardings=out_shardings,
                                        donate_argnums=donate_argnums))

    def init_memory(self, mcfg: model_lib.ModelConfig, batch_size: int) -> Any:
        """A fresh memory for `batch_size` global streams, created directly in its shards."""
        return _memory_initializer(self, mcfg, batch_size)()

    def global_batch(self, local: dict) -> dict:
        """Global [S, B, ...] arrays from this process's [S, B / process_count, ...] share."""
        out = {}
        for key in local:
            value = np.asarray(local[key])
            shape = (value.shape[0], value.shape[1] * jax.process_count()) + value.shape[2:]
            out[key] = jax.make_array_from_process_local_data(self.batch, value, shape)
        return out


@dataclasses.dataclass(frozen=True)
class MeshJitted:
    """A jitted function that traces and runs under its partitioner's mesh and rules."""
    partitioner: Partitioner
    jitted: Any

    def __call__(self, *args):
        with self.partitioner.context():
            return self.jitted(*args)

    def lower(self, *args) -> Any:
        """The program for arguments of these shapes (arrays or ShapeDtypeStructs), to inspect."""
        with self.partitioner.context():
            return self.jitted.lower(*args)


@functools.lru_cache(maxsize=None)
def _memory_initializer(partitioner: Partitioner, mcfg: model_lib.ModelConfig, batch_size: int) -> Callable:
    # Cached: every validation pass starts from a fresh memory and should not recompile.
    return jax.jit(lambda: model_lib.init_memory(mcfg, batch_size),
                   out_shardings=partitioner.memory(mcfg, batch_size))
