"""`python -m memjax.<command>` in a process forked from one that has imported the command's libraries.

Most tests of the command lines need a process boundary (exit statuses, `os._exit`, signals, one
line on stderr), not a fresh interpreter: about 1.5 s of each such process's start-up is importing
JAX, Flax, orbax, grain and TFDS before it parses its first flag. Here each pytest worker keeps one
server process per command and import-time environment; it imports what the command's module
imports at its top (the module itself stays unimported, as under `python -m`) and forks a child
per command line. The child takes the caller's stdin, stdout, stderr, working directory and
environment, runs the module as `__main__`, and exits as the interpreter would (non-daemon
threads joined, atexit handlers run); its exit status reaches the caller through the server.

The notebooks' Jupyter kernels (`python -m ipykernel_launcher`, started by jupyter_client) are
served the same way, from a server that has also imported the libraries the notebooks use
(`preload`): each kernel would otherwise start IPython and import JAX and memjax before its
first cell. A caller's `start_new_session` (jupyter_client's, which signals the
kernel's process group) gives the child a process group of its own.

`Popen` and `run` mirror `subprocess`'s; a command they cannot serve exactly (not `python -m
memjax.*` or a kernel, or a `preexec_fn` other than `interruptible`) starts afresh. Tests of the
interpreter's own start-up (a signal during the imports) pass `fresh=True`.

Run as a script, this file is the server: `command_server.py ADDRESS MODULE [PRELOAD ...]`.
"""

import ast
import atexit
import collections
import importlib.util
import itertools
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from typing import Optional

from memjax.runtime import host_memory

# Read while the interpreter starts or the libraries import: a server serves only requests whose
# values of these equal its own.
_IMPORT_TIME_ENV = ('JAX_', 'XLA_', 'TF_', 'PYTHON', 'GLIBC_', 'LD_', 'MEMJAX_', 'OMP_', 'MALLOC_')


def interruptible() -> None:
    """A child's Ctrl-C as a terminal's (a `preexec_fn`): a test runner started in the background
    (`cmd &` in a script) ignores SIGINT, and its children would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# --- The server -------------------------------------------------------------------------------


def source_run_by_dash_m(module: str) -> str:
    """The file `python -m module` runs: a package's `__main__.py` (memjax.bench), not its
    `__init__.py`."""
    spec = importlib.util.find_spec(module)
    if spec.submodule_search_locations is not None:
        spec = importlib.util.find_spec(f'{module}.__main__')
    return spec.origin


def _import_what_the_module_imports(module: str) -> None:
    """Runs the top-level import statements of the source `python -m module` runs (not the module)."""
    path = source_run_by_dash_m(module)
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
               and not (isinstance(node, ast.ImportFrom) and node.module == '__future__')]
    exec(compile(ast.Module(body=imports, type_ignores=[]), path, 'exec'), {})  # pylint: disable=exec-used


def _own_group(pid: int) -> None:
    """Puts process `pid` (this server's child, or 0: this process) in a process group of its own."""
    try:
        os.setpgid(pid, pid)
    except (PermissionError, ProcessLookupError):  # Done by the other side, or the child is gone.
        pass


def _run_child(request: dict, fds: list[int]) -> None:
    """In the forked child: becomes the command and exits with its status."""
    if request['new_group']:
        _own_group(0)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler if request['interruptible'] else signal.SIG_IGN)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request['cwd'])
    os.environ.clear()
    os.environ.update(request['env'])
    tempfile.tempdir = None  # Found again from the child's TMPDIR, as a new interpreter would.
    module, args = request['module'], request['args']
    sys.path[0] = request['cwd']  # As `python -m` puts its working directory first.
    sys.orig_argv = [sys.executable, '-m', module, *args]
    sys.argv = [module, *args]
    code, interrupted = 0, False
    try:
        runpy.run_module(module, run_name='__main__', alter_sys=True)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except SystemExit as error:
        if error.code is None:
            code = 0
        elif isinstance(error.code, int):
            code = error.code
        else:
            print(error.code, file=sys.stderr)
            code = 1
    except BaseException:  # pylint: disable=broad-except  (what the interpreter prints and exits with)
        traceback.print_exc()
        code = 1
    threading._shutdown()  # pylint: disable=protected-access  (the interpreter's exit joins them)
    atexit._run_exitfuncs()  # pylint: disable=protected-access
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # pylint: disable=broad-except
            pass
    if interrupted:  # The interpreter ends by SIGINT itself, so that its parent sees why.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)  # pylint: disable=protected-access


def serve(address: str, module: str, *preload: str) -> None:
    """Imports `module`'s libraries and the modules `preload` names, then forks one child per
    request; ends when its standard input does (closed by the pytest worker, or the worker is gone)."""
    sys.path[0] = os.getcwd()  # As `python -m` has it.
    _import_what_the_module_imports(module)
    for name in preload:
        importlib.import_module(name)
    # Forking is safe only while this process runs no other thread.
    assert threading.active_count() == 1, threading.enumerate()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind('\0' + address)  # Linux's abstract namespace: nothing on disk to remove.
    listener.listen(16)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    status_fds: dict[int, int] = {}  # Child pid: where its wait status goes.
    print('ready', flush=True)
    while True:
        readable, _, _ = select.select([listener, wake_read, sys.stdin], [], [])
        if wake_read in readable:
            os.read(wake_read, 4096)
            while status_fds:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if not pid:
                    break
                fd = status_fds.pop(pid, None)
                if fd is None:
                    continue
                try:
                    os.write(fd, str(status).encode())
                except OSError:  # The caller has gone without waiting for it.
                    pass
                os.close(fd)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 64):
            return
        if listener in readable:
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 4)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                for fd in (listener.fileno(), connection.fileno(), wake_read, wake_write, fds[3],
                           sys.stdin.fileno(), *status_fds.values()):
                    os.close(fd)
                _run_child(request, fds[:3])
            if request['new_group']:
                # Here as well as in the child, so that the group exists before the caller learns
                # the pid (it may signal the group at once); whichever runs second finds it made.
                _own_group(pid)
            for fd in fds[:3]:
                os.close(fd)
            status_fds[pid] = fds[3]
            connection.sendall(str(pid).encode())
            connection.close()


# --- The callers' side -------------------------------------------------------------------------


class _Server:
    """A started server, and how to reach it."""

    def __init__(self, module: str, env: dict, preload: tuple[str, ...] = ()):
        self.address = f'memjax-command-server-{os.getpid()}-{next(_started)}'
        # Its standard input stays open as long as this process lives: the server's lifeline.
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), self.address, module, *preload],
                                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self._ready = False

    def start(self, request: dict, fds: list[int]) -> int:
        """Sends `request` with the child's stdin, stdout, stderr and status fds; returns its pid."""
        if not self._ready:
            line = self.process.stdout.readline()
            assert line == b'ready\n', f'the command server did not start ({line!r})'
            self._ready = True
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect('\0' + self.address)
            socket.send_fds(connection, [json.dumps(request).encode()], fds)
            return int(connection.recv(64))

    def stop(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


# A server holds about 250 MB: a worker keeps the most recently used few.
MAX_SERVERS = 6
_servers: 'collections.OrderedDict[tuple, _Server]' = collections.OrderedDict()
_started = itertools.count()


@atexit.register
def _stop_servers() -> None:
    for server in _servers.values():
        server.stop()
    _servers.clear()


# What a server can run besides memjax's commands: the Jupyter kernel jupyter_client starts.
KERNEL = 'ipykernel_launcher'


def _served(args, env: Optional[dict], preexec_fn) -> Optional[tuple]:
    """(module, arguments, the child's environment) when the server can run `args`, else None."""
    args = list(args) if isinstance(args, (list, tuple)) else None
    if (not args or len(args) < 3 or args[0] != sys.executable or args[1] != '-m'
            or not (args[2].startswith('memjax.') or args[2] == KERNEL) or preexec_fn not in (None, interruptible)):
        return None
    module, arguments = args[2], [str(a) for a in args[3:]]
    env = dict(os.environ if env is None else env)
    if module == KERNEL:
        return module, arguments, env
    mode = host_memory.command_line_mode(arguments)
    if mode is None:  # A --flagfile (what it holds is read once the flags are parsed), or no mode.
        return None
    # A command that re-executes itself for huge pages (its first statement) starts as the re-executed one.
    return module, arguments, host_memory.reexecuted_environment(mode, env) or env


def _key(module: str, env: dict, preload: tuple[str, ...] = ()) -> tuple:
    return module, tuple(sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME_ENV))), preload


def _server_for(module: str, env: dict, preload: tuple[str, ...]) -> _Server:
    key = _key(module, env, preload)
    if key not in _servers:
        while len(_servers) >= MAX_SERVERS:
            _servers.popitem(last=False)[1].stop()
        _servers[key] = _Server(module, env, preload)
    _servers.move_to_end(key)
    return _servers[key]


class Popen(subprocess.Popen):
    """subprocess.Popen whose `python -m memjax.*` commands come from a command server."""

    def __init__(self, args, *rest, fresh: bool = False, preload: tuple[str, ...] = (), **kwargs):
        """`fresh`: in a new interpreter, not served; `preload`: modules the server imports too."""
        self._served = None if fresh else _served(args, kwargs.get('env'), kwargs.get('preexec_fn'))
        self._preload = tuple(preload)
        self._new_group = bool(kwargs.get('start_new_session'))
        self._status_fd = None
        super().__init__(args, *rest, **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                       *rest):
        if self._served is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                                          startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread,
                                          c2pwrite, errread, errwrite, *rest)
        module, arguments, child_env = self._served
        status_read, status_write = os.pipe()
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
               errwrite if errwrite != -1 else 2, status_write]
        request = dict(module=module, args=arguments, env=child_env, cwd=os.fspath(cwd or os.getcwd()),
                       interruptible=preexec_fn is not None or
                       signal.getsignal(signal.SIGINT) is not signal.SIG_IGN,
                       new_group=self._new_group)
        try:
            self.pid = _server_for(module, child_env, self._preload).start(request, fds)
        finally:
            os.close(status_write)
        self._status_fd = status_read
        self._child_created = True
        # The child's ends of the pipes this object made (not the caller's files), as Popen does.
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _status(self, timeout) -> bool:
        """Reads the child's wait status once it has ended (within `timeout`, None: no limit)."""
        if select.select([self._status_fd], [], [], timeout)[0]:
            status = os.read(self._status_fd, 64)
            os.close(self._status_fd)
            self._status_fd = None
            self.returncode = os.waitstatus_to_exitcode(int(status)) if status else -signal.SIGKILL
            return True
        return False

    def _internal_poll(self, *args, **kwargs):
        if self._served is None or self.returncode is not None:
            return super()._internal_poll(*args, **kwargs)
        self._status(0)
        return self.returncode

    def _wait(self, timeout):
        if self._served is None or self.returncode is not None:
            return super()._wait(timeout)
        if not self._status(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode


def run(args, *, input=None, capture_output=False, timeout=None, check=False, fresh=False,  # pylint: disable=redefined-builtin
        **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run through `Popen` above."""
    if input is not None:
        kwargs['stdin'] = subprocess.PIPE
    if capture_output:
        kwargs['stdout'] = kwargs['stderr'] = subprocess.PIPE
    with Popen(args, fresh=fresh, **kwargs) as process:
        try:
            stdout, stderr = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    if check:
        result.check_returncode()
    return result


if __name__ == '__main__':
    serve(*sys.argv[1:])
