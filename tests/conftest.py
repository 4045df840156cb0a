"""Suite-wide settings: one persistent JAX compilation cache for the whole run.

Many tests compile the same small programs (the tiny config's train and eval steps, in this
process, in the other pytest-xdist worker and in the command-line subprocesses): the first
compilation is written to the cache and the others load it. The folder is made once per run by
the first process that imports this file and handed to the others through the environment, so
it never outlives the run nor leaks compiled code between runs.
"""

import os
import shutil
import tempfile

# Most of a small program's XLA:CPU compile time is LLVM optimising the generated code, and the
# suite checks results, not speed (numerics are the same: no fast-math either way). Set before
# JAX starts its backend; subprocesses inherit it (notebooks, which train for minutes, drop it).
FAST_COMPILE_FLAG = '--xla_backend_optimization_level=0'
if FAST_COMPILE_FLAG not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAG}".strip()

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest

import training_fixtures

CACHE_VARIABLE = 'MEMJAX_TEST_COMPILATION_CACHE'
_MADE_HERE = CACHE_VARIABLE not in os.environ
COMPILATION_CACHE = os.environ.setdefault(CACHE_VARIABLE, tempfile.mkdtemp(prefix='memjax-test-jax-cache-'))

jax.config.update('jax_compilation_cache_dir', COMPILATION_CACHE)
# Every program, however small or fast to compile: the suite's are all small.
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


def pytest_unconfigure(config):  # pylint: disable=unused-argument
    if _MADE_HERE:  # The process that made the folder ends last (pytest-xdist's controller).
        shutil.rmtree(COMPILATION_CACHE, ignore_errors=True)


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    """A generated train/valid/test text corpus (`training_fixtures.write_text_corpus`), one per
    test module."""
    return training_fixtures.write_text_corpus(str(tmp_path_factory.mktemp('corpus')))

