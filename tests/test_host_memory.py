"""memjax.runtime.host_memory: with it, repeated executions no longer page-fault their temporaries in 4 KiB at a time."""

import json
import os
import platform
import subprocess
import sys

import pytest

from memjax.runtime import host_memory

# Runs a jitted function whose 64 MiB intermediate (a 4096 x 4096 float32 product) is an XLA
# temporary, and reports the minor page faults of its last executions.
_PROBE = '''
import json, resource, sys
from memjax.runtime import host_memory
applied = host_memory.keep_host_buffers(sys.argv[1])
import jax, jax.numpy as jnp
f = jax.jit(lambda x: (jnp.dot(x, x.T) ** 2 @ x).sum())
x = jnp.ones((4096, 64), jnp.float32)
for _ in range(3):
    f(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    f(x).block_until_ready()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
print(json.dumps({'applied': applied, 'faults_per_run': faults}))
'''
_TEMPORARY_PAGES = 4096 * 4096 * 4 // 4096


def _probe(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ('GLIBC_TUNABLES', host_memory._REEXECUTED)}
    out = subprocess.run([sys.executable, '-c', _PROBE, mode], check=True, capture_output=True,
                         text=True, env={**env, 'JAX_PLATFORMS': 'cpu'})
    return json.loads(out.stdout.strip().splitlines()[-1])


def _huge_pages_off() -> bool:
    try:
        with open('/sys/kernel/mm/transparent_hugepage/enabled', encoding='utf-8') as f:
            return '[never]' in f.read()
    except OSError:
        return True


@pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason='the tunable is a glibc malloc option')
@pytest.mark.skipif(_huge_pages_off(), reason='the kernel has transparent huge pages off')
def test_buffers_are_faulted_in_huge_pages():
    default, kept = _probe('off'), _probe('auto')  # 'auto' re-executes the probe once
    assert not default['applied'] and kept['applied']
    # By default every run maps its temporary afresh and faults all of it in, page by page.
    assert default['faults_per_run'] > 0.9 * _TEMPORARY_PAGES, default
    assert kept['faults_per_run'] < 0.05 * _TEMPORARY_PAGES, kept


@pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason='the settings are glibc malloc options')
def test_reused_buffers_are_not_faulted_in_again():
    reused = _probe('reuse')
    assert reused['applied'] and reused['faults_per_run'] < 0.01 * _TEMPORARY_PAGES, reused


def test_auto_stays_off_when_an_accelerator_is_requested(monkeypatch):
    monkeypatch.delenv('GLIBC_TUNABLES', raising=False)
    monkeypatch.delenv(host_memory._REEXECUTED, raising=False)
    monkeypatch.setenv('JAX_PLATFORMS', 'tpu')
    assert not host_memory.keep_host_buffers('auto')


@pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason='the tunable is a glibc malloc option')
def test_the_re_executed_environment_adds_the_tunable_once_and_only_where_huge_pages_are_asked_for():
    cpu = {'JAX_PLATFORMS': 'cpu', 'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'}
    env = host_memory.reexecuted_environment('auto', cpu)
    assert env == {**cpu, 'GLIBC_TUNABLES': f'glibc.malloc.arena_max=2:{host_memory.TUNABLE}',
                   host_memory._REEXECUTED: '1'}
    assert host_memory.reexecuted_environment('auto', env) is None  # Once.
    assert host_memory.reexecuted_environment('auto', {'JAX_PLATFORMS': 'tpu'}) is None
    assert host_memory.reexecuted_environment('on', {'JAX_PLATFORMS': 'tpu'}) is not None
    assert host_memory.reexecuted_environment('off', cpu) is host_memory.reexecuted_environment('reuse', cpu) is None


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match='not one of'):
        host_memory.keep_host_buffers('always')


@pytest.mark.skipif(platform.libc_ver()[0] != 'glibc', reason='the tunable is a glibc malloc option')
@pytest.mark.parametrize('host_flag,reexecuted', [([], True), (['--host_memory=off'], False),
                                                   (['--host_memory', 'reuse'], False)])
def test_a_command_re_executes_before_it_imports_jax(tmp_path, host_flag, reexecuted):
    """The re-execution for huge pages is a command's first statement, so JAX and the libraries
    are imported once (after it), not twice; a run that asks for no huge pages is not re-executed."""
    env = {k: v for k, v in os.environ.items() if k not in ('GLIBC_TUNABLES', host_memory._REEXECUTED)}
    proc = subprocess.run(
        [sys.executable, '-X', 'importtime', '-m', 'memjax.evaluate', '--config=configs/tiny.py',
         f'--workdir={tmp_path}/missing', *host_flag], capture_output=True, text=True,
        env={**env, 'JAX_PLATFORMS': 'cpu'}, cwd=os.path.join(os.path.dirname(__file__), '..'))
    lines = proc.stderr.splitlines()
    # -X importtime prints a line per module a process imports: the first process imports site
    # and host_memory only, then the re-executed one everything.
    imported = [line.split('|')[-1].strip() for line in lines if line.startswith('import time:')]
    assert imported.count('site') == (2 if reexecuted else 1), proc.stderr[-2000:]
    assert imported.count('jax') == 1, proc.stderr[-2000:]
    assert 'missing does not exist' in lines[-1] and proc.returncode != 0, proc.stderr[-2000:]


def test_the_mode_is_read_from_the_command_line_before_the_flags_are_parsed(monkeypatch):
    modes = []
    monkeypatch.setattr(host_memory, 'keep_host_buffers', modes.append)
    for argv, mode in [([], 'auto'), (['--host_memory=off'], 'off'), (['-host_memory=reuse'], 'reuse'),
                       (['--workdir=w', '--host_memory', 'on', 'x'], 'on'), (['--host_memory=always'], None),
                       (['--host_memory'], None), (['--flagfile=f', '--host_memory=off'], None)]:
        modes.clear()
        monkeypatch.setattr(sys, 'argv', ['memjax.train', *argv])
        host_memory.keep_host_buffers_first()
        assert modes == ([mode] if mode else []), argv
