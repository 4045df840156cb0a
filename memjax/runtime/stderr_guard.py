"""One line, not JAX's abort, when the process hosting the coordination service is lost.

JAX's coordination service runs inside process 0. When that process is lost (kill -9, its host
gone), JAX's client in every other process notices at once and aborts it from a C++ thread: a few
warnings, a fatal-error line that blames "the leader task", a stack dump and exit status 134
(SIGABRT). Nothing of Python runs in between, and JAX 0.10 cannot be told otherwise (the
`missed_heartbeat_callback` of its client cannot take a Python function: the status it passes has
no Python type). So in processes 1..N-1 memjax's standard error passes through this guard, a small
process of its own, which outlives the abort by construction: it forwards what it reads as it
comes, and when JAX's fatal line says the coordination service cannot be reached, it writes
memjax's line in its place and leaves out JAX's warnings just before (held for `HOLD_S`) and the
dump after (the process still ends as JAX ends it, by a signal: SIGABRT, exit status 134 in a shell,
or SIGSEGV when the abort meets another thread on the way out). Any other
output, another fatal error included, passes through unchanged. A guard that dies gives standard
error back to the process.

The guard forwards what it reads as it comes, so a process's last lines may reach the terminal just
after the process has ended; a process ending by `errors.exit_now` or Python's own exit first waits
(at most `_SYNC_S`) until the guard has written everything before that point.
"""

import atexit
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

# JAX's fatal line when the client cannot reach the service, and what it says of the cause.
FATAL = 'Terminating process because the JAX distributed service detected fatal errors'
UNREACHABLE = 'Failed to send RPC to coordination service'
# The lines JAX writes when the service goes away, before its fatal line: held this long, dropped
# if the fatal line follows, else forwarded.
HOLD_S = 5.0
_NOISE = re.compile(r'^[WE]\d{4} [\d:.]+\s+\d+ (preemption_sync_manager|coordination_service_agent|client)\.|'
                    r'^Additional GRPC error information|^:UNKNOWN:Error received from peer')
# Written by the guarded process at its exit, answered on the guard's standard output once every
# line before it is out: its output is complete before it exits, and JAX's own exit (which can abort
# when process 0 has gone first) still passes through the guard.
SYNC = b'\0memjax-stderr-guard-sync\0'
# The first characters of a line that may be JAX's (a log line's severity, its gRPC details) or SYNC.
_MAY_BE_JAX = tuple(b'IWEFA:\0')
# How long an exiting process waits for the guard to have written what came before.
_SYNC_S = 5.0


def lost_coordinator_line(process_id: int, num_processes: int) -> str:
    return (f'memjax: process 0 of {num_processes}, which hosts the coordination service, has ended or cannot '
            'be reached (its log says which: an error of its own, or nothing if it was killed or its host is '
            f'gone); process {process_id} stops too (JAX aborts it). Start every process again with the same '
            'command to resume from the newest complete checkpoint.')


class Filter:
    """The guard's decisions, apart from its input and output: `feed(data, now)` and `tick(now)`
    return the bytes to write now; after the coordinator's loss nothing more is written."""

    def __init__(self, process_id: int, num_processes: int):
        self._line = (lost_coordinator_line(process_id, num_processes) + '\n').encode()
        self._partial = b''
        self._held: list[tuple[float, bytes]] = []
        self.lost = False
        self.syncs = 0  # SYNC lines read.

    def feed(self, data: bytes, now: float) -> bytes:
        if self.lost:
            return b''
        out = [self.tick(now)]
        lines = (self._partial + data).split(b'\n')
        self._partial = lines.pop()
        for line in lines:
            text = line.decode('utf-8', 'replace')
            if FATAL in text and UNREACHABLE in text:
                self.lost, self._held, self._partial = True, [], b''
                out.append(self._line)
                return b''.join(out)
            if line.endswith(SYNC):  # The process exits: nothing is held back any longer.
                self.syncs += 1
                out += [held for _, held in self._held] + [line[:-len(SYNC)]]
                self._held = []
            elif _NOISE.search(text):
                self._held.append((now, line + b'\n'))
            else:
                out += [held for _, held in self._held] + [line + b'\n']
                self._held = []
        # Text without its newline yet (a progress bar's carriage returns) goes out at once, unless
        # it may be the start of one of JAX's lines.
        if self._partial and not self._held and self._partial[0] not in _MAY_BE_JAX:
            out.append(self._partial)
            self._partial = b''
        return b''.join(out)

    def tick(self, now: float) -> bytes:
        """The held lines once `HOLD_S` has passed without the fatal line."""
        if self.lost or not self._held or now - self._held[0][0] < HOLD_S:
            return b''
        out, self._held = b''.join(held for _, held in self._held), []
        return out

    def close(self) -> bytes:
        """What is still held when the input ends without the coordinator's loss."""
        if self.lost:
            return b''
        out = b''.join(held for _, held in self._held) + self._partial
        self._held, self._partial = [], b''
        return out


def _guard(process_id: int, num_processes: int) -> None:
    """The guard process: standard input to standard error, through `Filter`."""
    # A Ctrl-C or a scheduler's SIGTERM reaches the whole process group: the guard stays to
    # forward the run's last lines and ends with its input.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lines, answered = Filter(process_id, num_processes), 0
    while True:
        ready, _, _ = select.select([0], [], [], HOLD_S / 4)
        data = os.read(0, 1 << 16) if ready else None
        if data == b'':
            _write(2, lines.close())
            return
        _write(2, lines.feed(data, time.monotonic()) if data else lines.tick(time.monotonic()))
        for _ in range(lines.syncs - answered):
            _write(1, b'.')
        answered = lines.syncs


def _write(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except OSError:  # Where it went is gone or full: nothing better to do with it.
            return


class _Guarded:
    """This process's side: the guard, standard error as it was, and the guard's answers."""

    def __init__(self, process_id: int, num_processes: int):
        self.guard = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(process_id),
                                       str(num_processes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.original = os.dup(2)
        self.answered = threading.Semaphore(0)
        self.alive = True
        threading.Thread(target=self._answers, name='memjax-stderr-guard', daemon=True).start()
        os.dup2(self.guard.stdin.fileno(), 2)

    def _answers(self) -> None:
        """Counts the guard's answers; if it ends (killed, say), gives standard error back."""
        while os.read(self.guard.stdout.fileno(), 1):
            self.answered.release()
        self.alive = False
        os.dup2(self.original, 2)
        self.answered.release()

    def sync(self) -> None:
        sys.stderr.flush()
        if not self.alive:
            return
        try:
            os.write(2, SYNC + b'\n')
        except OSError:
            return
        self.answered.acquire(timeout=_SYNC_S)


_guarded: Optional[_Guarded] = None


def start(process_id: int, num_processes: int) -> None:
    """From now on this process's standard error goes through a guard (processes 1..N-1 of a
    multi-process run, once it has joined)."""
    from memjax import errors  # pylint: disable=g-import-not-at-top  (the guard, run as a file, needs none)
    global _guarded  # pylint: disable=global-statement
    if _guarded is not None or process_id == 0:
        return
    sys.stderr.flush()
    _guarded = _Guarded(process_id, num_processes)
    atexit.register(sync)
    errors.before_exit(sync)


def sync() -> None:
    """Waits (at most `_SYNC_S`) until the guard has written everything this process wrote to
    standard error so far: before the process ends."""
    if _guarded is not None:
        _guarded.sync()


if __name__ == '__main__':
    _guard(int(sys.argv[1]), int(sys.argv[2]))
