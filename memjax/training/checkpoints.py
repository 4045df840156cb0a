"""Orbax checkpoints of the whole training state, with fallback past damaged ones.

A checkpoint holds the train state (params, optimizer state, step, PRNG key), the
recurrent memory, the data iterator's JSON state and the config it was trained with, so
a resumed run continues the exact same token streams with the exact same memory, and a
changed config is noticed before anything is restored (memjax/training/resume.py). A fingerprint
of the arrays is stored with the JSON item: orbax notices truncated files but not flipped
bytes, and a silently wrong restore is worse than falling back one checkpoint.

Only damage moves a checkpoint aside: arrays whose shapes differ from what the run
expects are a config mismatch (CheckpointMismatchError), never corruption, and nothing
is ever deleted except an older checkpoint rotated out by keep-last-N; the checkpoint
with the best periodic validation loss is kept beside those.
"""

import collections
import contextlib
import hashlib
import json
from typing import Any, Iterator, NamedTuple, Optional

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint.checkpoint_managers import preservation_policy

from memjax import errors
from memjax.model.memories import MemoryState
from memjax.runtime import logs
from memjax.runtime import storage


class Restored(NamedTuple):
    step: int
    state: Any
    memory: Any
    data_state: Any
    data: Optional[dict]  # The training data's fingerprint (None: saved before memjax kept it).


class CheckpointMismatchError(errors.CheckpointError):
    """The checkpoint is intact but holds arrays of other shapes than the run expects."""


class DamagedCheckpointError(errors.CheckpointError):
    """The checkpoint's arrays are not those that were saved (a flipped bit, a file overwritten)."""


# Odd multipliers: a flipped bit changes a weighted sum by 2^k * odd, never 0 mod 2^32.
_WEIGHT_A, _WEIGHT_B, _OFFSET_B = 0x9E3779B1, 0x85EBCA77, 0x5BD1E995
VALID_LOSS = 'valid_loss'
# Orbax's warnings on every manager opened read-only, as evaluations, analyses and the checks
# before a resume open theirs on purpose.
_READ_ONLY_NOTES = ('read only', 'read_only=True')
_UNSIGNED = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}


# Leaves up to this many values are checksummed together, those of about one size as the rows of
# one matrix: a program per leaf would compile slowly (one reduction each), and larger leaves,
# sharded in real runs, keep their own (each device sums the shards it holds).
_SHARED_CHECKSUM_MAX_SIZE = 2**16


@jax.jit
def _checksums(leaves: list) -> list:
    """Two position-weighted wrapping sums of each leaf's bits.

    Integer sums mod 2^32 are exact in any order, so the result is the same for every
    sharding, mesh and process count; it is computed where the shards live, so no
    process has to gather arrays that span other hosts. Zeros added at a leaf's end add
    nothing: small leaves are padded to a power of two and summed as the rows of one matrix.
    """
    bits = [_bits(x) for x in leaves]
    sums = [None] * len(bits)
    rows_of = collections.defaultdict(list)  # Padded length -> the small leaves of that length.
    for i, b in enumerate(bits):
        if b.size <= _SHARED_CHECKSUM_MAX_SIZE:
            rows_of[1 << max(b.size - 1, 0).bit_length()].append(i)
        else:
            sums[i] = _weighted_sums(b[None])[0]
    for length, members in rows_of.items():
        rows = jnp.stack([jnp.pad(bits[i], (0, length - bits[i].size)) for i in members])
        for i, s in zip(members, _weighted_sums(rows)):
            sums[i] = s
    return sums


def _bits(x: jax.Array) -> jax.Array:
    """x's bits as a flat uint32 vector (narrower types widened, 64-bit ones as two words each)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[x.dtype.itemsize]).astype(jnp.uint32).reshape(-1)


def _weighted_sums(rows: jax.Array) -> jax.Array:
    """[k, 2]: each row's two weighted sums, the weights set by the position within the row."""
    index = jnp.arange(rows.shape[1], dtype=jnp.uint32)
    weight_a = index * jnp.uint32(_WEIGHT_A) | jnp.uint32(1)
    weight_b = (index + jnp.uint32(_OFFSET_B)) * jnp.uint32(_WEIGHT_B) | jnp.uint32(1)
    return jnp.stack([jnp.sum(rows * weight_a, axis=1, dtype=jnp.uint32),
                      jnp.sum(rows * weight_b, axis=1, dtype=jnp.uint32)], axis=1)


def fingerprint(tree: Any) -> str:
    """SHA-256 over the dtypes, shapes and bit checksums of every leaf, in tree order."""
    return checksums(tree)[0]


def checksums(tree: Any) -> tuple[str, dict[str, list[int]]]:
    """(`fingerprint(tree)`, each leaf's two checksums by name): the fingerprint checks a whole
    restore, the named sums a part of the tree restored alone (the parameters that evaluation reads)."""
    named = jax.tree_util.tree_flatten_with_path(tree)[0]
    digest, by_name = hashlib.sha256(), {}
    for (path, leaf), sums in zip(named, jax.device_get(_checksums([leaf for _, leaf in named]))):
        sums = np.asarray(sums, np.uint32)
        digest.update(f'{leaf.dtype}{tuple(leaf.shape)}'.encode())
        digest.update(sums.tobytes())
        by_name[_path_name(path)] = sums.tolist()
    return digest.hexdigest(), by_name


# Errors of reading that say nothing about the files: the host's memory, the network, access.
_PASSING_ERRORS = (MemoryError, ConnectionError, TimeoutError, PermissionError)
_PASSING_CODES = ('UNAVAILABLE', 'DEADLINE_EXCEEDED', 'PERMISSION_DENIED', 'UNAUTHENTICATED')


def _is_damage(error: Exception) -> bool:
    """Whether a failed read may be the files' fault. One that is not (memory, the network, access)
    would fail on every step alike: moving intact steps aside for it would leave a resumed run none.
    """
    message = str(error)
    return not (isinstance(error, _PASSING_ERRORS) or errors.is_out_of_memory(message)
                or any(code in message for code in _PASSING_CODES))


class _Manager(ocp.CheckpointManager):
    """An orbax CheckpointManager that leaves preemption to `memjax.training.preemption`.

    Orbax asks JAX's preemption sync point about the steps it saves, one of them from
    its background finalize thread; the sync manager takes every query as the
    process's current step, so a stale one could set the agreed stopping step behind
    the training loop, which would then never reach it.
    """

    def reached_preemption(self, step: int) -> bool:
        del step
        return False

    def metrics(self, step: int) -> Optional[dict]:
        """The step's validation loss record; an unreadable one (a damaged checkpoint) would stop
        orbax from opening the folder at all, so it ranks as no record."""
        try:
            return super().metrics(step)
        except (ValueError, OSError) as error:
            _warn_once(f'{self.directory}/{step}/metrics', 'Checkpoint %s/%d: its validation-loss record '
                       'does not read (%s); it no longer competes as the best checkpoint.',
                       self.directory, step, type(error).__name__)
            return None


_WARNED: set[str] = set()


def _warn_once(key: str, *args) -> None:
    """Each reader of a folder (the resume check, the restore) meets its damage again: say it once."""
    if key not in _WARNED:
        _WARNED.add(key)
        logging.warning(*args)


def _check_orbax_metadata(directory: str) -> None:
    """Says in one line what orbax's own words (an error with the file's whole content) leave
    unsaid: a step whose _CHECKPOINT_METADATA does not parse is still used, because that file only
    holds timestamps and handler names, and the arrays are checked against memjax's fingerprint."""
    for name in storage.listdir(directory):
        path = storage.path(directory) / name / '_CHECKPOINT_METADATA'
        if not (name.isdigit() and path.is_file()):
            continue
        try:
            json.loads(path.read_bytes())
        except ValueError:
            _warn_once(str(path), 'Checkpoint %s: orbax\'s _CHECKPOINT_METADATA (timestamps and handler names) '
                       'does not parse; the checkpoint is still used, its arrays checked against memjax\'s '
                       'fingerprint.', storage.join(directory, name))


def _path_name(path: tuple) -> str:
    parts = []
    for key in path:
        for attr in ('key', 'name', 'idx'):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return '.'.join(parts)


def _shapes_by_name(tree: Any) -> dict[str, tuple]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, 'shape'))[0]
    return {_path_name(path): (tuple(leaf.shape), str(np.dtype(leaf.dtype))
                               if not jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
                               else 'key') for path, leaf in leaves if leaf is not None}


def _zero_size_to_none(tree: Any) -> Any:
    # Orbax refuses zero-size arrays (the memory of a mem_len = 0 model); they hold nothing.
    return jax.tree_util.tree_map(lambda x: None if x.size == 0 else x, tree)


def _refill_zero_size(restored: Any, abstract: Any) -> Any:
    def fill(x, like):
        if x is not None:
            return x
        return jax.jit(lambda: jnp.zeros(like.shape, like.dtype), out_shardings=like.sharding)()
    return jax.tree_util.tree_map(fill, restored, abstract, is_leaf=lambda x: x is None)


def _is_legacy_xl(saved: dict[str, tuple], abstract_memory: Any) -> bool:
    """Whether a checkpoint holds the XL memory as it was saved before memory kinds existed
    (memory.hidden, memory.valid) and this run's memory is the XL one."""
    return ('memory.valid' in saved and isinstance(abstract_memory, MemoryState)
            and set(abstract_memory.layers) == {'hidden'} and set(abstract_memory.shared) == {'valid'})


def mismatch_message(saved: dict[str, tuple], expected: dict[str, tuple], limit: int = 4) -> str:
    """'name: saved -> expected' for the first `limit` arrays that differ, missing or extra."""
    names = sorted(set(saved) | set(expected))
    def describe(entry):
        return 'absent' if entry is None else f'{entry[1]}{list(entry[0])}'

    lines = [f'{n}: {describe(saved.get(n))} -> {describe(expected.get(n))}'
             for n in names if saved.get(n) != expected.get(n)]
    more = f' and {len(lines) - limit} more' if len(lines) > limit else ''
    return '; '.join(lines[:limit]) + more


def has_checkpoints(directory: str) -> bool:
    """Whether `directory` holds step folders (intact or not), without creating anything."""
    return any(name.isdigit() for name in storage.listdir(directory))


class Checkpointer:
    """Saves asynchronously, keeps the newest `keep` checkpoints and the best validated one,
    restores the newest intact one.

    In a multi-process run every process calls every method (orbax writes each array's
    shards from the process that holds them and the JSON item from process 0).
    """

    def __init__(self, directory: str, keep: int, read_only: bool = False):
        self.directory = str(storage.path(directory))
        # Latest N, plus the lowest validation loss among the checkpoints that have one: a run
        # that diverges slowly can rotate its recent checkpoints out, never its best.
        policy = preservation_policy.AnyPreservationPolicy([
            preservation_policy.LatestN(n=keep),
            preservation_policy.BestN(get_metric_fn=lambda m: m[VALID_LOSS], reverse=True, n=1,
                                      keep_checkpoints_without_metrics=False)])
        # best_fn also makes orbax write each step's metrics to disk, so that a manager opened
        # by a resumed run still knows which checkpoint is the best.
        # Named handlers let orbax read an item's metadata before anything was saved or restored.
        handlers = {'arrays': ocp.StandardCheckpointHandler(), 'meta': ocp.JsonCheckpointHandler()}
        _check_orbax_metadata(self.directory)
        with logs.dropped(*_READ_ONLY_NOTES):
            options = ocp.CheckpointManagerOptions(
                preservation_policy=policy, best_fn=lambda m: m[VALID_LOSS], best_mode='min',
                create=not read_only, read_only=read_only, enable_async_checkpointing=True)
            self._manager = _Manager(self.directory, options=options, item_handlers=handlers)
        self._writing: Optional[int] = None  # The step whose asynchronous write may be in flight.
        self._failed = False  # A failed write was reported (as a CheckpointError) already.
        self._saved = False  # The first save compiles the checksums: said in a line, as every compilation is.
        self.damaged: list[int] = []  # Steps found damaged (and quarantined) by latest_intact.

    def save(self, step: int, state: Any, memory: Any, data_state: Any, config: dict,
             valid_loss: Optional[float] = None, data: Optional[dict] = None) -> None:
        """Starts writing `step`; `valid_loss` (this step's validation) ranks it for keep-best;
        `data` is the training data's fingerprint."""
        arrays = {'state': state, 'memory': memory}
        if not self._saved:
            logging.info('Compiling the checkpoints\' checksums: the first save includes it.')
            self._saved = True
        whole, leaves = checksums(arrays)
        meta = {'step': int(step), 'data_state': data_state, 'fingerprint': whole, 'leaf_checksums': leaves,
                'config': config, 'data': data}
        self.wait()  # A failed background write is the previous step's: named as such.
        self._writing = step
        # A save between validations has no loss to rank by, as keep-best expects.
        with self._failing_save_is_an_error(step), logs.dropped('did not provide metrics'):
            self._manager.save(step, args=ocp.args.Composite(
                arrays=ocp.args.StandardSave(_zero_size_to_none(arrays)),
                meta=ocp.args.JsonSave(meta)),
                metrics=None if valid_loss is None else {VALID_LOSS: float(valid_loss)})

    @contextlib.contextmanager
    def _failing_save_is_an_error(self, step: Optional[int]) -> Iterator[None]:
        try:
            yield
        except Exception as error:  # pylint: disable=broad-except  (disk full, permissions, ...)
            self._failed = True
            if isinstance(error, jax.errors.JaxRuntimeError) and jax.process_count() > 1:
                raise  # The save's collectives failed: a lost process, reported as such by the command.
            try:
                kept = [s for s in self.steps_on_disk() if s != step]
                resume_from = self.step_dir(kept[-1]) if kept else 'the start (no checkpoint yet)'
            except Exception:  # pylint: disable=broad-except  (the folder itself is out of reach)
                resume_from = 'its newest intact checkpoint'
            raise errors.CheckpointError(
                f'saving {"a checkpoint" if step is None else f"step {step}"} in '
                f'{self.directory} failed ({type(error).__name__}: {error}). Check the free space '
                f'and permissions there, then run the same command to resume from {resume_from}.'
            ) from error

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def steps_on_disk(self) -> list[int]:
        """The complete steps in the folder now. Orbax's own list leaves out the steps a save will
        rotate out as soon as the save starts, though they stay until it succeeds, and does not
        see what another process (a running training) saved or deleted since it was opened."""
        self._manager.reload()
        return self.all_steps()

    def step_dir(self, step: int) -> str:
        return storage.join(self.directory, str(step))

    def meta(self, step: int) -> dict:
        """The JSON item of `step` (config, data state, fingerprint); raises if unreadable."""
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']

    def saved_shapes(self, step: int) -> dict[str, tuple]:
        metadata = self._manager.item_metadata(step)['arrays']
        return _shapes_by_name(getattr(metadata, 'tree', metadata))

    def check_shapes(self, step: int, abstract: Any, part: bool = False) -> None:
        """Raises CheckpointMismatchError when `step` holds other arrays than `abstract` (with
        `part`: other arrays under the names `abstract` has)."""
        saved, expected = self.saved_shapes(step), _shapes_by_name(_zero_size_to_none(abstract))
        if part:
            saved = {name: shape for name, shape in saved.items() if name in expected}
        if saved != expected:
            raise CheckpointMismatchError(
                f'{self.step_dir(step)} holds arrays of other shapes than this config makes '
                f'({mismatch_message(saved, expected)})')

    def restore_step(self, step: int, abstract_state: Any, abstract_memory: Any) -> Restored:
        """Restores `step` into the given shapes and shardings, checking its fingerprint."""
        legacy = _is_legacy_xl(self.saved_shapes(step), abstract_memory)
        if legacy:
            abstract_memory = {'hidden': abstract_memory.layers['hidden'],
                               'valid': abstract_memory.shared['valid']}
        abstract = {'state': abstract_state, 'memory': abstract_memory}
        self.check_shapes(step, abstract)
        restored = self._manager.restore(step, args=ocp.args.Composite(
            arrays=ocp.args.StandardRestore(_zero_size_to_none(abstract)),
            meta=ocp.args.JsonRestore()))
        arrays = _refill_zero_size(restored['arrays'], abstract)
        meta = restored['meta']
        if meta.get('fingerprint') != fingerprint(arrays):
            raise ValueError('array fingerprint differs from the one saved with the checkpoint')
        memory = arrays['memory']
        if legacy:
            logging.info('%s stores the XL memory in the layout before memory kinds; read into '
                         'the per-layer layout (the next save writes that).', self.step_dir(step))
            memory = MemoryState(layers={'hidden': memory['hidden']}, shared={'valid': memory['valid']})
        return Restored(int(meta['step']), arrays['state'], memory, meta['data_state'], meta.get('data'))

    def restore_part(self, step: int, abstract: Any) -> Any:
        """Only the arrays of `abstract` (a subtree of {'state', 'memory'}), e.g. the parameters,
        each checked against the checksums saved with it; raises DamagedCheckpointError when one
        differs. (Checkpoints saved before memjax kept them are checked by orbax alone.)
        """
        self.check_shapes(step, abstract, part=True)
        saved = self.meta(step).get('leaf_checksums')
        # A partial restore needs orbax's PyTree handler, which the named handlers would refuse.
        with logs.dropped(*_READ_ONLY_NOTES):
            manager = ocp.CheckpointManager(self.directory, options=ocp.CheckpointManagerOptions(read_only=True))
        try:
            restored = manager.restore(step, args=ocp.args.Composite(arrays=ocp.args.PyTreeRestore(
                item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                partial_restore=True)))['arrays']
        finally:
            manager.close()
        if saved is not None:
            differ = sorted(name for name, sums in checksums(restored)[1].items() if saved.get(name, sums) != sums)
            if differ:
                raise DamagedCheckpointError(
                    f'{self.step_dir(step)} is damaged: {len(differ)} of its arrays ({", ".join(differ[:3])}'
                    f'{", ..." if len(differ) > 3 else ""}) differ from the checksums saved with them')
        return restored

    def latest_intact(self, read: Any, quarantine: bool = False) -> Any:
        """`read(step)` of the newest step it succeeds on, or None when there is none.

        A step whose `read` raises CheckpointMismatchError stops the search (a config problem,
        reported to the user), as does an error that says nothing about the files (`_is_damage`:
        raised as a CheckpointError that says so).
        A step that vanished while it was read was rotated out by the training run writing there:
        the search starts again from the newest step then. Any other error counts as damage: it is
        reported and, with `quarantine`, moved to `<directory>_damaged/` so that the resumed run
        can save that step again.
        """
        damaged, tried = [], set()
        result = None
        while untried := [s for s in self.steps_on_disk() if s not in tried]:
            step = untried[-1]
            tried.add(step)
            try:
                result = read(step)
                break
            except CheckpointMismatchError:
                raise
            except Exception as error:  # Orbax raises many types for damaged files.
                if step not in self.steps_on_disk():
                    logging.info('Checkpoint %s was rotated out while it was read; reading the newest '
                                 'one now.', self.step_dir(step))
                    continue
                if not _is_damage(error):
                    raise errors.CheckpointError(
                        f'reading {self.step_dir(step)} failed ({type(error).__name__}: {errors.brief(error)}), '
                        'which says nothing against the checkpoint: it is left in place. Free the host\'s '
                        'memory, or restore the connection or the access to the folder, then run the '
                        'same command again.') from error
                logging.warning('Checkpoint %s is damaged or incomplete (%s: %s); falling back to '
                                'the previous one.', self.step_dir(step), type(error).__name__,
                                errors.brief(error))
                damaged.append(step)
        if quarantine and damaged:
            self._quarantine(damaged)
        self.damaged += damaged
        return result

    def restore_latest(self, abstract_state: Any, abstract_memory: Any,
                       quarantine: bool = False) -> Optional[Restored]:
        """The newest checkpoint that reads back intact, or None when there is none."""
        return self.latest_intact(
            lambda step: self.restore_step(step, abstract_state, abstract_memory), quarantine)

    def best(self) -> tuple[Optional[int], Optional[float]]:
        """(step, validation loss) of the best validated checkpoint kept, or (None, None)."""
        step = self._manager.best_step()  # Among the steps saved with a validation loss.
        return (None, None) if step is None else (step, self._manager.metrics(step)[VALID_LOSS])

    @property
    def quarantine_dir(self) -> str:
        return self.directory + '_damaged'

    def _quarantine(self, steps: list[int]) -> None:
        """Moves damaged steps aside, never over an earlier quarantined copy of the same step (on
        Cloud Storage: copied, the copy verified, then the step deleted)."""
        if jax.process_index() == 0:
            target_root = self.quarantine_dir
            storage.path(target_root).mkdir(parents=True, exist_ok=True)
            taken = set(storage.listdir(target_root))
            for step in steps:
                target, suffix = str(step), 1
                while target in taken:
                    target, suffix = f'{step}.{suffix}', suffix + 1
                taken.add(target)
                target = storage.join(target_root, target)
                storage.move_tree(self.step_dir(step), target)
                logging.warning('Moved damaged checkpoint %s to %s.', self.step_dir(step), target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
            multihost_utils.sync_global_devices('memjax quarantine')
        self._manager.reload()

    def wait(self) -> None:
        """Waits for the write in flight; raises CheckpointError naming its step if it failed."""
        with self._failing_save_is_an_error(self._writing):
            self._manager.wait_until_finished()
        self._writing = None

    def close(self) -> None:
        """Closes orbax's manager. After a failed write its error is orbax's again (a full disk):
        logged, so that it does not replace the CheckpointError that named the step and the fix."""
        try:
            self._manager.close()
        except Exception as error:  # pylint: disable=broad-except
            if not self._failed:
                raise
            logging.warning('Closing the checkpoints after the failed write: %s: %s', type(error).__name__, error)
