"""Noticing that a process of a multi-process run is gone, and stopping the others in bounded time.

A process killed without notice (kill -9, a host lost) leaves the others blocked inside a
collective, in C++, where no Python exception reaches them: they wait until JAX's
coordination service misses the dead one's heartbeats and aborts them with a dump of every
thread, and a pod's allocation is billed meanwhile. Here every process publishes a counter
in the coordination service's key-value store every `beat_period(timeout)` seconds and reads
the others'.
A second thread, which makes no call that could block, judges: a counter that has not moved
for `timeout` seconds, or a coordinator that has not answered for as long, ends this process
with one line that names the lost process (exit status 3). JAX's own heartbeat deadline is
set later (memjax/runtime/distributed.py), so that this line comes first.

A process that ends by itself says so first, with its exit status: a finished process is not
taken for a lost one, and a failed one stops the others after GRACE_S (time for them to meet
the same error themselves, a NaN loss say, and report it in their own words).
"""

import sys
import threading
import time
from typing import Callable, Optional

from absl import logging

from memjax import errors

PERIOD_S = 2.0  # The beat's period, unless the timeout asks for a shorter one (beat_period).
GRACE_S = 10.0
_PREFIX = 'memjax/peers/'
# How long the last words (this process's end, the lock's release) may take before exiting anyway.
_LAST_WORDS_S = 5.0
_THEIR_EXIT_S = 0.2

_watch: Optional['_Watch'] = None
_on_loss: list[Callable[[], None]] = []


def beat_period(timeout: float) -> float:
    """How often a process publishes its counter and reads the others': four beats per timeout at
    least, so that a live peer whose beat and read fall out of phase (a change seen up to two
    periods after the last) is never judged silent, whatever `--heartbeat_timeout` says."""
    return min(PERIOD_S, timeout / 4)


class _Watch:
    """The publishing thread and the judging thread of one process."""

    def __init__(self, client, process_id: int, num_processes: int, timeout: float):
        self._client, self._me, self._count, self.timeout = client, process_id, num_processes, timeout
        self.period = beat_period(timeout)
        now = time.monotonic()
        self._beats: dict[int, str] = {}
        self._moved = {p: now for p in range(num_processes) if p != process_id}  # Last change seen.
        self._ended: dict[int, tuple[int, float]] = {}  # Process: (exit status, when it was seen).
        self._answered = now  # The coordinator's last answer.
        self._stop = threading.Event()
        self._lock = threading.Lock()
        for target, name in ((self._publish, 'memjax-peer-publish'), (self._judge, 'memjax-peer-judge')):
            threading.Thread(target=target, name=name, daemon=True).start()

    def _publish(self) -> None:
        beat = 0
        while not self._stop.is_set():
            beat += 1
            try:
                self._client.key_value_set(f'{_PREFIX}beat/{self._me}', str(beat), allow_overwrite=True)
                entries = self._client.key_value_dir_get(_PREFIX)
            except Exception:  # pylint: disable=broad-except  (a coordinator that does not answer: judged)
                self._stop.wait(self.period)
                continue
            now = time.monotonic()
            with self._lock:
                self._answered = now
                for key, value in entries:
                    kind, _, process = key[len(_PREFIX):].rpartition('/')
                    if not process.isdigit() or int(process) == self._me:
                        continue
                    process = int(process)
                    if kind == 'beat' and self._beats.get(process) != value:
                        self._beats[process], self._moved[process] = value, now
                    elif kind == 'ended' and process not in self._ended:
                        self._ended[process] = (int(value), now)
            self._stop.wait(self.period)

    def _judge(self) -> None:
        while not self._stop.wait(self.period / 2):
            with self._lock:
                verdict = self._verdict(time.monotonic())
            if verdict and not self._stop.is_set():
                _stop_this_process(f'{verdict}; process {self._me} stops too')

    def _verdict(self, now: float) -> Optional[str]:
        return verdict(self._me, self._count, self.timeout, now, self._moved, self._answered, self._ended)

    def end(self, status: int) -> None:
        """This process ends by itself with `status`: no more judging, and the others are told.
        Process 0 hosts the coordination service, whose end aborts every other process's JAX
        client: it waits (at most _LAST_WORDS_S) until the others have said they end too, so that
        a process meeting the same error (data that differ, a NaN loss) exits with its own line
        and status rather than JAX's abort."""
        self._stop.set()
        _bounded(lambda: self._client.key_value_set(f'{_PREFIX}ended/{self._me}', str(status),
                                                    allow_overwrite=True))
        if self._me == 0:
            _bounded(self._until_the_others_end)

    def _until_the_others_end(self) -> None:
        while not all_ended(self._client.key_value_dir_get(f'{_PREFIX}ended/'), self._me, self._count):
            time.sleep(0.05)
        time.sleep(_THEIR_EXIT_S)  # Between a process's last word and its exit.


def all_ended(entries, me: int, count: int) -> bool:
    """Whether the key-value `entries` ((key, value) under _PREFIX) hold an end for every process
    but `me`."""
    said = {key[len(_PREFIX):] for key, _ in entries}
    return all(f'ended/{process}' in said for process in range(count) if process != me)


def verdict(me: int, count: int, timeout: float, now: float, moved: dict[int, float], answered: float,
            ended: dict[int, tuple[int, float]]) -> Optional[str]:
    """Why process `me` of `count` has to stop at `now`, or None. `moved`: when each other process's
    counter last changed; `answered`: the coordinator's last answer; `ended`: (exit status, when
    seen) of the processes that said they end."""
    of = f'of {count}'
    for process, (status, seen) in sorted(ended.items()):
        if status and now - seen > GRACE_S:
            return f'process {process} {of} ended with exit status {status} (its log says why)'
    if me != 0 and now - answered > timeout:
        return (f'process 0 {of}, the coordinator, has not answered for {now - answered:.0f}s '
                '(killed, or its host is gone)')
    for process, last in sorted(moved.items()):
        if process not in ended and now - last > timeout:
            return f'process {process} {of} has not been heard from for {now - last:.0f}s (killed, or its host is gone)'
    return None


def _bounded(fn: Callable[[], None]) -> None:
    """Runs `fn` for at most _LAST_WORDS_S: a coordinator or a bucket that is gone must not hold
    up an exit."""
    def guarded():
        try:
            fn()
        except Exception as error:  # pylint: disable=broad-except
            logging.warning('On the way out: %s: %s', type(error).__name__, error)

    thread = threading.Thread(target=guarded, daemon=True)
    thread.start()
    thread.join(_LAST_WORDS_S)


def _stop_this_process(reason: str) -> None:
    print(f'memjax: {reason} (exit {errors.EXIT_RUNTIME}). Start every process again with the same command '
          'to resume from the newest complete checkpoint.', file=sys.stderr, flush=True)
    for hook in list(_on_loss):
        _bounded(hook)
    sys.stdout.flush()
    errors.exit_now(errors.EXIT_RUNTIME)  # The main thread may be inside a collective.


def wait_for_verdict() -> None:
    """For a process whose collective just failed: if a peer is lost, the judge ends this process
    with the line naming it within the timeout; otherwise this returns after it."""
    if _watch is None:
        return
    deadline = time.monotonic() + _watch.timeout + 2 * _watch.period
    while time.monotonic() < deadline:
        time.sleep(_watch.period / 4)


def start(client, process_id: int, num_processes: int, timeout: float) -> None:
    """Starts watching the other processes (once per process)."""
    global _watch
    if _watch is None and num_processes > 1:
        _watch = _Watch(client, process_id, num_processes, timeout)


def ended(status: int) -> None:
    """Tells the other processes that this one ends with `status`; a no-op when not watching."""
    if _watch is not None:
        _watch.end(status)


def on_loss(hook: Callable[[], None]) -> Callable[[], None]:
    """Runs `hook` (releasing a lock, say) before a lost peer ends this process; returns its
    remover."""
    _on_loss.append(hook)
    return lambda: _on_loss.remove(hook) if hook in _on_loss else None
