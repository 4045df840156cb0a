"""Suite-wide settings: XLA:CPU compiling for speed of compilation, and one persistent JAX
compilation cache for the whole run.

Many tests compile the same small programs (the tiny config's train and eval steps, in this
process, in the other pytest-xdist worker and in the command-line subprocesses): the first
compilation is written to the cache and the others load it. The folder is made once per run by
the first process that imports this file and handed to every other process (workers, commands,
notebook kernels) through JAX's own environment variables, so it never outlives the run nor
leaks compiled code between runs.
"""

import importlib.metadata
import os
import shutil
import tempfile

from packaging import version as versions

# The suite's programs are small and run for milliseconds: most of their time is XLA:CPU
# compiling them, and it checks results, not speed (no flag here allows fast-math: the values
# are IEEE's either way). `bench compile --size=tiny`: 0.40-0.65x the compile time of
# `--xla_backend_optimization_level=0` alone (BENCHMARKS.md). Set before JAX starts its backend; subprocesses
# inherit them (commands, notebook kernels).
FAST_COMPILE_FLAGS = (
    '--xla_backend_optimization_level=0',  # LLVM's optimisation passes.
    '--xla_llvm_disable_expensive_passes=true',
    '--xla_cpu_use_fusion_emitters=false',  # The elemental emitters: no MLIR pipeline per fusion.
    '--xla_cpu_use_xnnpack=false',  # No XNNPACK graph to build per dot.
    '--xla_cpu_parallel_codegen_split_count=1',  # Two cores are busy with two workers already.
)
# XLA ends the process at start-up on a flag it does not know, and the GPU machines' images carry
# a newer jaxlib than setup.cfg's (their on-chip check runs these tests): a flag that jaxlib dropped
# is given only to the versions before the first without it.
DROPPED_IN = {'--xla_cpu_use_fusion_emitters=false': (0, 11, 1)}


def fast_compile_flags(jaxlib_version: str) -> list[str]:
    """FAST_COMPILE_FLAGS that jaxlib `jaxlib_version` knows."""
    release = versions.Version(jaxlib_version).release
    return [flag for flag in FAST_COMPILE_FLAGS if flag not in DROPPED_IN or release < DROPPED_IN[flag]]


def with_fast_compile(flags: str) -> str:
    """`flags` (an XLA_FLAGS value) with the installed jaxlib's FAST_COMPILE_FLAGS added where missing."""
    present = flags.split()
    known = fast_compile_flags(importlib.metadata.version('jaxlib'))
    return ' '.join(present + [flag for flag in known if flag not in present])


os.environ['XLA_FLAGS'] = with_fast_compile(os.environ.get('XLA_FLAGS', ''))

CACHE_VARIABLE = 'MEMJAX_TEST_COMPILATION_CACHE'
_MADE_HERE = CACHE_VARIABLE not in os.environ
if _MADE_HERE:
    os.environ[CACHE_VARIABLE] = tempfile.mkdtemp(prefix='memjax-test-jax-cache-')
COMPILATION_CACHE = os.environ[CACHE_VARIABLE]


def cache_environment(folder: str) -> dict:
    """JAX's variables for a persistent compilation cache in `folder` that keeps every program,
    however small or fast to compile: the suite's are all small."""
    return {'JAX_COMPILATION_CACHE_DIR': folder, 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
            'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0'}


# JAX reads them when it is imported, here and in every process started from the tests.
os.environ.update(cache_environment(COMPILATION_CACHE))

import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position


# JAX, memjax and the fixtures' helpers are imported by the test modules, in the pytest-xdist
# workers: the controller, which runs no test, starts the workers without spending 2 s importing them.
def pytest_collection_finish(session):  # pylint: disable=unused-argument
    import jax  # pylint: disable=g-import-not-at-top
    from memjax.runtime import collector  # pylint: disable=g-import-not-at-top
    assert jax.config.jax_compilation_cache_dir == COMPILATION_CACHE, 'JAX was imported before tests/conftest.py'
    # The test modules are imported: the collector set as memjax's commands set it.
    collector.tune()


def pytest_unconfigure(config):  # pylint: disable=unused-argument
    if _MADE_HERE:  # The process that made the folder ends last (pytest-xdist's controller).
        shutil.rmtree(COMPILATION_CACHE, ignore_errors=True)


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    """A generated train/valid/test text corpus (`training_fixtures.write_text_corpus`), one per
    test module."""
    import training_fixtures  # pylint: disable=g-import-not-at-top
    return training_fixtures.write_text_corpus(str(tmp_path_factory.mktemp('corpus')))
