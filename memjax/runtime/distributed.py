"""Joining a multi-process JAX run (`jax.distributed`) from flags or the environment.

`initialize_from_flags()` must run before anything touches a JAX device: the runtime
fixes the global device set when the first backend starts. On a Cloud TPU VM JAX finds
the coordinator, process count and id itself; elsewhere they come from
`--coordinator_address/--num_processes/--process_id` or MEMJAX_COORDINATOR_ADDRESS,
MEMJAX_NUM_PROCESSES, MEMJAX_PROCESS_ID (SLURM and Open MPI are also detected by JAX
under `--distributed=on`).

Every wait is bounded: joining gives up after `--initialization_timeout` seconds with
an error that says which side is missing, and a peer not heard from for `--heartbeat_timeout`
seconds ends every other process with a line that names it (memjax/runtime/peer_watch.py). Process
0 hosts JAX's coordination service: when it is lost, JAX aborts the others at once, and their
standard error guard (memjax/runtime/stderr_guard.py) says so in one line.
"""

import contextlib
import dataclasses
import glob
import importlib.util
import os
import threading
from typing import Iterator, Mapping, Optional

from absl import flags
from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np

from memjax import early_sigterm
from memjax import errors
from memjax.runtime import peer_watch
from memjax.runtime import stderr_guard

MODES = ('auto', 'on', 'off')
ENV_COORDINATOR = 'MEMJAX_COORDINATOR_ADDRESS'
ENV_NUM_PROCESSES = 'MEMJAX_NUM_PROCESSES'
ENV_PROCESS_ID = 'MEMJAX_PROCESS_ID'
# JAX's own deadlines (joining, heartbeats) are set this much later than memjax's, so that
# memjax's line, which names the cause, comes before JAX's abort, which blames "another task".
_JAX_DEADLINE_GRACE_S = 15
# Environment of TPU VMs and GKE TPU pods that names the workers of a slice.
_TPU_ENV = ('TPU_WORKER_HOSTNAMES', 'TPU_PROCESS_ADDRESSES', 'MEGASCALE_COORDINATOR_ADDRESS')

_MODE = flags.DEFINE_enum(
    'distributed', 'auto', MODES,
    'auto: join a multi-process run when coordinator settings are given (flags or '
    f'{ENV_COORDINATOR}/...) or on a Cloud TPU VM, else run as a single process; on: always '
    'call jax.distributed.initialize (without settings JAX detects TPU, SLURM or Open MPI); '
    'off: single process.')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', None,
    f'HOST:PORT where process 0 serves the coordination service (env {ENV_COORDINATOR}).')
_NUM_PROCESSES = flags.DEFINE_integer(
    'num_processes', None, f'Number of processes of the run (env {ENV_NUM_PROCESSES}).')
_PROCESS_ID = flags.DEFINE_integer(
    'process_id', None, f'This process, in [0, num_processes) (env {ENV_PROCESS_ID}).')
_INIT_TIMEOUT = flags.DEFINE_integer(
    'initialization_timeout', 300,
    'Seconds to wait until every process has joined the coordinator; then the run fails.')
_HEARTBEAT_TIMEOUT = flags.DEFINE_integer(
    'heartbeat_timeout', 30,
    'Seconds of silence after which a process counts as lost: every other process then stops '
    'with a line naming it (memjax/runtime/peer_watch.py).')
_SHUTDOWN_TIMEOUT = flags.DEFINE_integer(
    'shutdown_timeout', 300,
    'Seconds a finishing process waits for the others to finish too.')


class DistributedSetupError(errors.UserError, ValueError):
    """The coordinator settings are incomplete or inconsistent; the message says which."""
    exit_code = errors.EXIT_USAGE
    label = 'Distributed setup error'


class PeerFailureError(errors.UserError):
    """Another process of the run died; this one stops too (exit status 3)."""
    label = 'memjax'


@dataclasses.dataclass(frozen=True)
class Settings:
    mode: str = 'auto'
    coordinator_address: Optional[str] = None
    num_processes: Optional[int] = None
    process_id: Optional[int] = None
    initialization_timeout: int = 300
    heartbeat_timeout: int = 30
    shutdown_timeout: int = 300

    @property
    def explicit(self) -> bool:
        return self.coordinator_address is not None


def _env_int(environ: Mapping[str, str], name: str) -> Optional[int]:
    value = environ.get(name, '').strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise DistributedSetupError(f'environment variable {name}={value!r} must be an '
                                    'integer.') from None


def _check_address(address: str) -> None:
    host, _, port = address.rpartition(':')
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedSetupError(
            f'coordinator address {address!r} must be HOST:PORT with a port in [1, 65535] '
            '(--coordinator_address or ' + ENV_COORDINATOR + '), e.g. 10.0.0.1:8476.')


def resolve_settings(mode: str = 'auto', coordinator_address: Optional[str] = None,
                     num_processes: Optional[int] = None, process_id: Optional[int] = None,
                     initialization_timeout: int = 300, heartbeat_timeout: int = 30,
                     shutdown_timeout: int = 300,
                     environ: Optional[Mapping[str, str]] = None) -> Settings:
    """Flag values, each falling back to its MEMJAX_* variable, checked for consistency.

    The three coordinator settings come together or not at all: a run with only some of
    them would hang waiting for processes that were never told where to connect.
    """
    environ = os.environ if environ is None else environ
    if mode not in MODES:
        raise DistributedSetupError(f'--distributed={mode!r} must be one of {MODES}.')
    address = coordinator_address or environ.get(ENV_COORDINATOR, '').strip() or None
    count = num_processes if num_processes is not None else _env_int(environ, ENV_NUM_PROCESSES)
    index = process_id if process_id is not None else _env_int(environ, ENV_PROCESS_ID)
    given = {'--coordinator_address': address, '--num_processes': count, '--process_id': index}
    missing = [name for name, value in given.items() if value is None]
    if 0 < len(missing) < len(given):
        raise DistributedSetupError(
            f'incomplete coordinator settings: {", ".join(missing)} missing (flags or '
            f'{ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}); give all three, or '
            'none to run a single process (or to let JAX detect a Cloud TPU VM).')
    if address is not None:
        _check_address(address)
        if count < 1:
            raise DistributedSetupError(f'--num_processes={count} must be >= 1.')
        if not 0 <= index < count:
            raise DistributedSetupError(
                f'--process_id={index} must lie in [0, {count}) for --num_processes={count}.')
        if mode == 'off':
            raise DistributedSetupError(
                f'--distributed=off contradicts the coordinator settings ({address}, '
                f'{count} processes): drop one or the other.')
    for name, value in (('initialization_timeout', initialization_timeout),
                        ('heartbeat_timeout', heartbeat_timeout),
                        ('shutdown_timeout', shutdown_timeout)):
        if value < 1:
            raise DistributedSetupError(f'--{name}={value} must be >= 1 second.')
    return Settings(mode, address, count, index, initialization_timeout, heartbeat_timeout,
                    shutdown_timeout)


def on_cloud_tpu(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this is a Cloud TPU host, where JAX finds the other workers itself."""
    environ = os.environ if environ is None else environ
    if any(environ.get(name) for name in _TPU_ENV):
        return True
    # A TPU VM: libtpu installed and TPU chips visible as devices.
    has_chips = bool(glob.glob('/dev/accel[0-9]*') or glob.glob('/dev/vfio/[0-9]*'))
    return has_chips and importlib.util.find_spec('libtpu') is not None


def _deadline_message(settings: Settings) -> str:
    what = (f'process {settings.process_id} of {settings.num_processes} could not join the '
            f'coordinator at {settings.coordinator_address}' if settings.explicit
            else 'this process could not join the auto-detected TPU/cluster coordinator')
    if settings.explicit and settings.process_id == 0:
        cause = ('not all other processes connected: start every process with the same '
                 '--coordinator_address and --num_processes, and distinct --process_id values')
    else:
        cause = ('the coordinator did not answer: check that process 0 is running and that '
                 'its host and port are reachable from here (address, firewall)')
    return (f'memjax.runtime.distributed: {what} within --initialization_timeout='
            f'{settings.initialization_timeout}s; {cause}.')


@contextlib.contextmanager
def _deadline(seconds: float, message: str) -> Iterator[None]:
    """Ends the process with `message` if the block is still running after `seconds`.

    jax.distributed.initialize blocks inside C++ and, on its own timeout, aborts with a
    message that blames another task; this exits earlier with one that names the cause.
    """
    def expire():
        logging.error(message)
        errors.exit_now(1)  # The main thread is stuck in C++; nothing else can stop it.

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def initialize(settings: Settings) -> bool:
    """Joins the multi-process run described by `settings`; returns whether it did.

    A no-op for single-process settings (and when already joined), so that the command
    line tools call it unconditionally.
    """
    if settings.mode == 'off':
        return False
    if settings.mode == 'auto' and not settings.explicit and not on_cloud_tpu():
        return False
    if jax.distributed.is_initialized():
        return True
    kwargs = dict(initialization_timeout=settings.initialization_timeout + _JAX_DEADLINE_GRACE_S,
                  heartbeat_timeout_seconds=settings.heartbeat_timeout + _JAX_DEADLINE_GRACE_S,
                  shutdown_timeout_seconds=settings.shutdown_timeout)
    if settings.explicit:
        kwargs.update(coordinator_address=settings.coordinator_address,
                      num_processes=settings.num_processes, process_id=settings.process_id)
        logging.info('Joining %s as process %d of %d (timeout %ds).',
                     settings.coordinator_address, settings.process_id,
                     settings.num_processes, settings.initialization_timeout)
    else:
        logging.info('Joining the auto-detected multi-process run (timeout %ds).',
                     settings.initialization_timeout)
    early_sigterm.hand_over()  # JAX's preemption service takes SIGTERM over.
    with _deadline(settings.initialization_timeout, _deadline_message(settings)):
        try:
            jax.distributed.initialize(**kwargs)
        except ValueError as error:
            if settings.explicit:
                raise
            # JAX found no cluster to take the settings from.
            raise DistributedSetupError(
                f'--distributed={settings.mode} but {error} No Cloud TPU, SLURM or Open MPI '
                'environment was detected: give --coordinator_address, --num_processes and '
                '--process_id, or use --distributed=auto.') from None
    logging.info('Process %d of %d; %d of %d devices are local.', jax.process_index(),
                 jax.process_count(), jax.local_device_count(), jax.device_count())
    stderr_guard.start(jax.process_index(), jax.process_count())
    _watch_peers(settings.heartbeat_timeout)
    return True


def _watch_peers(timeout: int) -> None:
    """Starts peer_watch on JAX's coordination client (its key-value store), which JAX keeps in
    a private module: a JAX that moved it runs without the watch, after a warning."""
    try:
        from jax._src import distributed as jax_distributed  # pylint: disable=g-import-not-at-top
        client = jax_distributed.global_state.client
    except (ImportError, AttributeError) as error:
        logging.warning('No watch on the other processes (%s): a lost process is noticed only by JAX, after '
                        '--heartbeat_timeout plus %ds.', error, _JAX_DEADLINE_GRACE_S)
        return
    peer_watch.start(client, jax.process_index(), jax.process_count(), timeout)


def settings_from_flags() -> Settings:
    return resolve_settings(_MODE.value, _COORDINATOR.value, _NUM_PROCESSES.value,
                            _PROCESS_ID.value, _INIT_TIMEOUT.value, _HEARTBEAT_TIMEOUT.value,
                            _SHUTDOWN_TIMEOUT.value)


def initialize_from_flags() -> bool:
    """`initialize(settings_from_flags())`; call first thing in a command's main()."""
    return initialize(settings_from_flags())


def set_log_verbosity() -> None:
    """INFO on process 0, warnings and errors only elsewhere, unless --verbosity is given.

    N processes printing the same progress lines bury the one that matters.
    """
    if not flags.FLAGS['verbosity'].present:
        logging.set_verbosity(logging.INFO if is_primary() else logging.WARNING)


def is_primary() -> bool:
    """Process 0 alone writes metrics, logs and summary files."""
    return jax.process_index() == 0


def barrier(name: str) -> None:
    """Waits until every process got here (no-op for a single process)."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def primary_first(name: str) -> Iterator[None]:
    """Runs the block on process 0, then on the other processes.

    For work that creates shared files (tokenizer, prepared dataset, token caches): on a
    shared filesystem the others then find them ready instead of racing to write them;
    on per-host disks they build their own copy the same deterministic way. Process 0
    releases the others even when the block fails, so that they fail with their own
    error rather than wait for a barrier that never comes.
    """
    primary = is_primary()
    if not primary:
        barrier(f'{name}: process 0 done')
    try:
        yield
    finally:
        if primary:
            barrier(f'{name}: process 0 done')


def assert_same_on_all_processes(fingerprint: str, what: str, same_files: str) -> None:
    """Fails on every process when the hex `fingerprint` of `what` differs between them;
    `same_files` names the files to give every process alike."""
    if jax.process_count() == 1:
        return
    words = np.frombuffer(bytes.fromhex(fingerprint[:32]), np.uint32)
    try:
        multihost_utils.assert_equal(words)
    except AssertionError:
        raise DistributedSetupError(
            f'{what} differs between processes (process {jax.process_index()} has '
            f'{fingerprint[:16]}...): give every process the same {same_files}.') from None


@contextlib.contextmanager
def peer_failures_end_the_run() -> Iterator[None]:
    """Turns a failed cross-process operation into an exit that names the likely cause.

    When a peer dies, the collectives of the survivors fail with a transport error (or
    JAX's heartbeat check stops them); the first is worded for runtime developers.
    """
    try:
        yield
    except jax.errors.JaxRuntimeError as error:
        if jax.process_count() == 1:
            raise
        peer_watch.wait_for_verdict()  # A lost peer: the watch's line names it and ends the process.
        raise PeerFailureError(
            f'process {jax.process_index()} of {jax.process_count()} stops: an operation across '
            f'processes failed ({str(error)[:500]}). Usually another process died or was '
            'stopped: see its log. Restart all processes with the same command to resume from '
            'the last checkpoint.') from error
