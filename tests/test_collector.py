"""The garbage-collector settings of memjax's command lines (memjax/runtime/collector.py)."""

import gc

from memjax.runtime import collector


def test_tune_freezes_what_exists_and_python_defaults_undoes_it_for_its_block_only():
    before = gc.get_threshold()
    try:
        gc.unfreeze()
        existing = len(gc.get_objects())
        collector.tune()
        assert gc.get_freeze_count() >= existing  # Out of every later collection's walk.
        assert gc.get_threshold() == (collector.YOUNGEST_THRESHOLD,) + before[1:]
        tuned = gc.get_threshold()
        with collector.python_defaults():
            assert gc.get_threshold() == (700, 10, 10) and gc.get_freeze_count() == 0
        assert gc.get_threshold() == tuned and gc.get_freeze_count() >= existing
    finally:
        gc.set_threshold(*before)
