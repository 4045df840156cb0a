"""What the GPU machines' image makes of the on-chip checks and the accel suite that
launch/accel_bench.sh runs there: its jaxlib is newer than setup.cfg's (XLA ends a process at
start-up on a flag it does not know, and it has dropped one of the suite's), and memjax's data
pipeline and a few other dependencies are neither among its packages nor carried by the script."""

import os
import subprocess
import sys

import conftest

TESTS = os.path.dirname(os.path.abspath(__file__))
# memjax's dependencies outside the image's known packages (JAX, Flax, optax, orbax, torch,
# transformers) and accel_bench.sh's wheels (its WHEEL_PINS).
ABSENT_THERE = ('grain', 'tensorflow_datasets', 'array_record', 'tensorboardX', 'sentencepiece')


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


def test_the_on_chip_check_and_the_accel_suite_import_nothing_the_image_lacks():
    code = f"""
import importlib.abc, sys
sys.path.insert(0, {TESTS!r})
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in {set(ABSENT_THERE)!r}:
            raise ModuleNotFoundError(f'No module named {{name!r}}', name=name)
sys.meta_path.insert(0, Absent())
try:
    import memjax.training.loop
    raise SystemExit('the training loop imported without its data pipeline: nothing was left out')
except ModuleNotFoundError:
    pass
import conftest, test_fused_attention
import memjax.bench.__main__, memjax.bench.suites
"""
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
