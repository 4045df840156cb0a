"""The standard-error guard of processes 1..N-1: JAX's abort on a lost coordinator becomes one line."""

import select
import signal
import subprocess
import sys

from memjax.runtime import stderr_guard

# What JAX 0.10's client wrote (process 1 of 2) when process 0 was killed: its warnings, the fatal
# line that blames the leader task, the dump (a few of its frames here).
JAX_ABORT = (
    'W1129 02:22:29.320449   12455 preemption_sync_manager.cc:147] Failed to retrieve preemption notice from '
    'coordination service: UNAVAILABLE: Socket closed\n'
    'Additional GRPC error information from remote target coordination_service while calling '
    '/xla.coordination.CoordinationService/GetKeyValue:\n'
    ':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}. This is only expected if '
    'one of the tasks is unhealthy. Check the logs for the actual root cause.\n'
    'E1129 02:22:29.320502   12455 preemption_sync_manager.cc:159] Failed to cancel preemption barrier: '
    'FAILED_PRECONDITION: Tried to cancel non-existent barrier PREEMPTION_SYNC_BARRIER.\n'
    'E1129 02:22:29.320576   12455 coordination_service_agent.cc:289] Polled an error from coordination service '
    '(this can be an error from this or another task).\n'
    'F1129 02:22:29.320582   12455 client.h:80] Terminating process because the JAX distributed service detected '
    'fatal errors. This most likely indicates that another task died; see the other task logs for more details. '
    'absl::Status: UNAVAILABLE: Failed to send RPC to coordination service. Either the leader task was '
    'preempted/died/restarted unexpectedly or this task is experiencing network issues.\n'
    'Additional GRPC error information from remote target coordination_service while calling '
    '/xla.coordination.CoordinationService/PollForError:\n'
    ':UNKNOWN:Error received from peer  {grpc_status:14, grpc_message:"Socket closed"}\n'
    '*** Check failure stack trace: ***\n'
    '    @     0x7fc467840634  absl::lts_20260107::log_internal::LogMessage::SendToLog()\n'
    '    @     0x7fc4639040ee  xla::CoordinationServiceAgent::SetError()\n')
LINE = stderr_guard.lost_coordinator_line(1, 2) + '\n'


def run(chunks, step_s=0.0):
    """What the filter writes for `chunks` fed `step_s` seconds apart, then the input's end."""
    lines, now, out = stderr_guard.Filter(1, 2), 0.0, b''
    for chunk in chunks:
        out += lines.feed(chunk.encode(), now)
        now += step_s
    return (out + lines.tick(now + stderr_guard.HOLD_S) + lines.close()).decode()


def test_the_abort_on_a_lost_coordinator_is_one_line_after_what_came_before():
    before = 'step 20/32 | loss 3.1\n'
    assert run([before + JAX_ABORT]) == before + LINE
    # However the pipe splits it, and whatever the process writes after (Python's fault handler).
    cut = [before + JAX_ABORT[:7], JAX_ABORT[7:400], JAX_ABORT[400:] + 'Fatal Python error: Aborted\n']
    assert run(cut) == before + LINE
    assert LINE.count('\n') == 1 and LINE.startswith('memjax: process 0 of 2, which hosts the coordination service')


def test_jax_warnings_without_the_abort_are_only_held_back():
    warnings = JAX_ABORT[:JAX_ABORT.index('F1129')]
    # Later output lets them out in order; so do HOLD_S seconds, or the end of the input.
    assert run([warnings, 'next line\n']) == warnings + 'next line\n'
    lines = stderr_guard.Filter(1, 2)
    assert lines.feed(warnings.encode(), 0.0) == b''
    assert lines.tick(stderr_guard.HOLD_S / 2) == b''
    assert lines.tick(stderr_guard.HOLD_S).decode() == warnings
    assert run([warnings]) == warnings


def test_other_output_and_other_fatal_errors_pass_unchanged():
    other_fatal = ('F1129 02:22:29.320582   12455 client.h:80] Terminating process because the JAX distributed '
                   'service detected fatal errors. absl::Status: INTERNAL: another task reported an error\n'
                   '*** Check failure stack trace: ***\n')
    text = 'Traceback (most recent call last):\n  File "x.py"\nValueError: no\n' + other_fatal
    assert run([text]) == text
    # Text without its newline yet (a progress bar) is not held, unless it may begin JAX's fatal line.
    lines = stderr_guard.Filter(1, 2)
    assert lines.feed(b'\rstep 3/10', 0.0) == b'\rstep 3/10'
    assert lines.feed(b'F1129 02:22', 0.0) == b''  # May begin JAX's line: out with its newline.
    assert lines.feed(b':29 other\n', 0.0) == b'F1129 02:22:29 other\n'


def test_an_exit_sync_lets_out_what_is_held_and_is_not_written():
    lines = stderr_guard.Filter(1, 2)
    warning = JAX_ABORT.splitlines(keepends=True)[0]
    assert lines.feed(warning.encode(), 0.0) == b''
    assert lines.feed(b'last\n' + stderr_guard.SYNC[:5], 0.0) == warning.encode() + b'last\n'
    assert lines.syncs == 0
    assert lines.feed(stderr_guard.SYNC[5:] + b'\n', 0.0) == b'' and lines.syncs == 1
    # After text without its newline (held when it may be JAX's): that text goes out, the sync does not.
    assert lines.feed(b'Almost' + stderr_guard.SYNC + b'\n', 0.0) == b'Almost' and lines.syncs == 2


def test_the_guard_process_forwards_its_input_answers_a_sync_and_outlives_a_ctrl_c():
    """The guard as memjax starts it: stdin to stderr through the filter, SIGINT ignored, each sync
    answered on its stdout once what came before it is out."""
    guard = subprocess.Popen([sys.executable, stderr_guard.__file__, '1', '2'],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    guard.stdin.write(b'a line\n' + stderr_guard.SYNC + b'\n')
    guard.stdin.flush()
    assert select.select([guard.stdout], [], [], 30)[0], 'no answer to the sync'
    assert guard.stdout.read(1) == b'.' and guard.stderr.readline() == b'a line\n'  # Running, signals set.
    guard.send_signal(signal.SIGINT)
    guard.stdin.write(('more\n' + JAX_ABORT).encode())
    guard.stdin.close()
    assert guard.wait(30) == 0
    assert guard.stderr.read().decode() == 'more\n' + LINE


def test_a_process_whose_guard_dies_gets_its_standard_error_back():
    script = ('import os, signal, sys, time\n'
              'from memjax.runtime import stderr_guard\n'
              'stderr_guard.start(1, 2)\n'
              'print("through the guard", file=sys.stderr, flush=True)\n'
              'stderr_guard.sync()\n'
              'os.kill(stderr_guard._guarded.guard.pid, signal.SIGKILL)\n'
              'deadline = time.time() + 30\n'
              'while stderr_guard._guarded.alive and time.time() < deadline:\n'
              '    time.sleep(0.01)\n'
              'print("after its end", file=sys.stderr, flush=True)\n')
    done = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stderr) == (0, 'through the guard\nafter its end\n')
