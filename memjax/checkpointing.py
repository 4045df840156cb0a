"""Orbax checkpoints of the whole training state, with fallback past damaged ones.

A checkpoint holds the train state (params, optimizer state, step, PRNG key), the
recurrent memory and the data iterator's JSON state, so a resumed run continues the
exact same token streams with the exact same memory. A fingerprint of the arrays is
stored with the JSON item: orbax notices truncated files but not flipped bytes, and a
silently wrong restore is worse than falling back one checkpoint.
"""

import hashlib
import os
import shutil
from typing import Any, NamedTuple, Optional

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp


class Restored(NamedTuple):
    step: int
    state: Any
    memory: Any
    data_state: Any


# Odd multipliers: a flipped bit changes a weighted sum by 2^k * odd, never 0 mod 2^32.
_WEIGHT_A, _WEIGHT_B, _OFFSET_B = 0x9E3779B1, 0x85EBCA77, 0x5BD1E995
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


@jax.jit
def _checksums(leaves: list) -> list:
    """Two position-weighted wrapping sums of each leaf's bits.

    Integer sums mod 2^32 are exact in any order, so the result is the same for every
    sharding, mesh and process count; it is computed where the shards live, so no
    process has to gather arrays that span other hosts.
    """
    def one(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.uint8)
        bits = jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize])
        bits = bits.astype(jnp.uint32).reshape(-1)
        index = jnp.arange(bits.size, dtype=jnp.uint32)
        weight_a = index * jnp.uint32(_WEIGHT_A) | jnp.uint32(1)
        weight_b = (index + jnp.uint32(_OFFSET_B)) * jnp.uint32(_WEIGHT_B) | jnp.uint32(1)
        return jnp.stack([jnp.sum(bits * weight_a, dtype=jnp.uint32),
                          jnp.sum(bits * weight_b, dtype=jnp.uint32)])

    return [one(x) for x in leaves]


def fingerprint(tree: Any) -> str:
    """SHA-256 over the dtypes, shapes and bit checksums of every leaf, in tree order."""
    leaves = jax.tree_util.tree_leaves(tree)
    digest = hashlib.sha256()
    for leaf, sums in zip(leaves, jax.device_get(_checksums(leaves))):
        digest.update(f'{leaf.dtype}{tuple(leaf.shape)}'.encode())
        digest.update(np.asarray(sums, np.uint32).tobytes())
    return digest.hexdigest()


class _Manager(ocp.CheckpointManager):
    """An orbax CheckpointManager that leaves preemption to `memjax.preemption`.

    Orbax asks JAX's preemption sync point about the steps it saves, one of them from
    its background finalize thread; the sync manager takes every query as the
    process's current step, so a stale one could set the agreed stopping step behind
    the training loop, which would then never reach it.
    """

    def reached_preemption(self, step: int) -> bool:
        del step
        return False


class Checkpointer:
    """Saves asynchronously, keeps the newest `keep` checkpoints, restores the newest intact one.

    In a multi-process run every process calls every method (orbax writes each array's
    shards from the process that holds them and the JSON item from process 0).
    """

    def __init__(self, directory: str, keep: int, read_only: bool = False):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=not read_only, read_only=read_only,
            enable_async_checkpointing=True)
        self._manager = _Manager(self.directory, options=options)

    def save(self, step: int, state: Any, memory: Any, data_state: Any) -> None:
        arrays = {'state': state, 'memory': memory}
        meta = {'step': int(step), 'data_state': data_state, 'fingerprint': fingerprint(arrays)}
        self._manager.save(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)))

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _restore_step(self, step: int, abstract: Any) -> Restored:
        restored = self._manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        arrays, meta = restored['arrays'], restored['meta']
        if meta.get('fingerprint') != fingerprint(arrays):
            raise ValueError('array fingerprint differs from the one saved with the checkpoint')
        return Restored(int(meta['step']), arrays['state'], arrays['memory'], meta['data_state'])

    def restore_latest(self, abstract_state: Any, abstract_memory: Any,
                       quarantine: bool = False) -> Optional[Restored]:
        """The newest checkpoint that reads back intact, or None when there is none.

        Damaged checkpoints are reported; with `quarantine` they are moved to
        `<directory>_damaged/` so that the resumed run can save those steps again.
        """
        abstract = {'state': abstract_state, 'memory': abstract_memory}
        damaged = []
        result = None
        for step in reversed(self.all_steps()):
            try:
                result = self._restore_step(step, abstract)
                break
            except Exception as error:  # Orbax raises many types for damaged files.
                logging.warning('Checkpoint %s is damaged or incomplete (%s: %s); falling back to '
                                'the previous one.', self.step_dir(step), type(error).__name__,
                                str(error)[:300])
                damaged.append(step)
        if quarantine and damaged:
            self._quarantine(damaged)
        return result

    def _quarantine(self, steps: list[int]) -> None:
        target_root = self.directory + '_damaged'
        os.makedirs(target_root, exist_ok=True)
        for step in steps:
            target = os.path.join(target_root, str(step))
            shutil.rmtree(target, ignore_errors=True)
            shutil.move(self.step_dir(step), target)
            logging.warning('Moved damaged checkpoint %s to %s.', self.step_dir(step), target)
        self._manager.reload()

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()
