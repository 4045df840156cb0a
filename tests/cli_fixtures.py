"""Running `python -m memjax.train` in subprocesses (not a test module).

Signals, process counts and device counts are per process, so these tests drive the
real command line instead of calling the trainer in the pytest process (forked from the worker's
command server, tests/command_server.py, unless a new interpreter is what is tested).
"""

import os
import subprocess
import sys
import time
from typing import Optional, Sequence

import command_server
from command_server import interruptible  # Also the preexec_fn of tests that start their own processes.
import conftest
import training_fixtures

# Generous: compilation on a loaded 2-core machine takes many times its usual seconds.
RUN_TIMEOUT_S = 240


def cpu_env(device_count: int, compilation_cache: Optional[str] = None) -> dict:
    """The environment of a CPU-only JAX process with `device_count` simulated devices.

    Runs given the same `compilation_cache` folder (default: the test run's, tests/conftest.py)
    reuse each other's compiled steps (a resumed run compiles exactly what the interrupted one did).
    """
    compilation_cache = compilation_cache or os.environ[conftest.CACHE_VARIABLE]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(('MEMJAX_', 'JAX_', 'SLURM_', 'OMPI_'))}
    env.update(JAX_PLATFORMS='cpu', PYTHONPATH=training_fixtures.REPO, PYTHONUNBUFFERED='1',
               XLA_FLAGS=conftest.with_fast_compile(f'--xla_force_host_platform_device_count={device_count}'),
               **conftest.cache_environment(compilation_cache))
    return env


def tiny_command(workdir: str, corpus: str, data_dir: str, *extra: str,
                  module: str = 'memjax.train') -> list[str]:
    """`python -m module` on configs/tiny.py with the generated text corpus in `corpus`.

    The dataset is prepared under `data_dir`; `module` is memjax.train or memjax.evaluate.
    """
    return [sys.executable, '-m', module, f'--config={training_fixtures.TINY}',
            f'--workdir={workdir}', '--config.data.name=text',
            f'--config.data.text_path={corpus}', f'--config.data.data_dir={data_dir}', *extra]


class Run:
    """A started command whose stdout and stderr go to `log_path`; `fresh`: in a new interpreter
    rather than forked from the test worker's command server (tests/command_server.py)."""

    def __init__(self, command: Sequence[str], env: dict, log_path: str, fresh: bool = False):
        self.log_path = log_path
        self._log = open(log_path, 'w')
        self.process = command_server.Popen(command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                            cwd=training_fixtures.REPO, preexec_fn=interruptible, fresh=fresh)

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        """Exit code; a run still going after `timeout` is killed and reported."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f'{self.log_path} still running after {timeout}s:\n'
                                 f'{self.log()[-3000:]}') from None
        finally:
            self._log.close()

    def wait_for_text(self, text: str, timeout: float = RUN_TIMEOUT_S) -> None:
        """Returns once `text` appears in the log; fails if the run ends or times out first."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if text in self.log():
                return
            if self.process.poll() is not None:
                raise AssertionError(f'run ended (exit {self.process.returncode}) before '
                                     f'printing {text!r}:\n{self.log()[-3000:]}')
            time.sleep(0.02)
        raise AssertionError(f'no {text!r} after {timeout}s:\n{self.log()[-3000:]}')


def checked(run: Run, expected_code: Optional[int] = 0) -> str:
    """Waits for `run`; returns its log after checking the exit code."""
    code = run.wait()
    log = run.log()
    assert code == expected_code, f'exit code {code}, expected {expected_code}:\n{log[-3000:]}'
    return log
