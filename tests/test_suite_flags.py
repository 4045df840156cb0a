"""The suite's XLA:CPU flags (tests/conftest.py) on the jaxlib that runs it: XLA ends a process at
start-up on a flag it does not know, and the GPU machines run the on-chip checks on a newer jaxlib
than setup.cfg's, which has dropped one of them."""

import os
import subprocess
import sys

import conftest


def test_a_dropped_flag_is_given_only_to_the_jaxlibs_that_know_it():
    dropped = '--xla_cpu_use_fusion_emitters=false'
    # 0.11.0's libjax_common.so has the option's setter; 0.11.1's and 0.11.2's have none.
    for version, known in (('0.10.2', True), ('0.11.0', True), ('0.11.1', False), ('0.11.2', False),
                           ('0.12.0.dev20261201', False), ('1.0', False)):
        flags = conftest.fast_compile_flags(version)
        assert (dropped in flags) == known, version
        assert [f for f in conftest.FAST_COMPILE_FLAGS if f != dropped] == [f for f in flags if f != dropped]


def test_the_installed_jaxlib_starts_with_every_flag_the_suite_gives_it():
    flags = conftest.with_fast_compile('--xla_force_host_platform_device_count=2')
    done = subprocess.run([sys.executable, '-c', 'import jax; print(jax.device_count())'], capture_output=True,
                          text=True, check=False, env={**os.environ, 'XLA_FLAGS': flags})
    assert done.returncode == 0 and done.stdout.split() == ['2'], done.stderr[-2000:]
