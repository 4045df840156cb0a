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


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match='not one of'):
        host_memory.keep_host_buffers('always')
