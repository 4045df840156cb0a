"""Evaluating with a longer memory than trained: the distances training never scored are named in
one log line, and clamp_len=-2 clamps them at the longest distance the run being evaluated trained."""

import logging

import pytest

from memjax import config_lib
from memjax import errors
from memjax.model import memories
from memjax.training import experiment
import training_fixtures


def resolved(train_tgt=24, train_mem=40, **fields):
    """The run's (training, evaluation) model configs: `model__x` / `eval__x` / `eval__model__x`."""
    config = config_lib.base_config()
    config.model.update(vocab_size=256, d_model=32, n_layer=2, n_head=2, d_head=16, d_inner=64, mem_len=train_mem)
    config.train.update(batch_size=4, tgt_len=train_tgt)
    run = config_lib.resolve(training_fixtures.override(config, **fields))
    return run.model, run.eval_model


@pytest.mark.parametrize('fields, trained_max', [
    # Transformer-XL's memory: the last query reaches back over the segment and the whole memory.
    ({}, 40 + 24 - 1),
    ({'model__memory': 'lamemo'}, 40 + 24 - 1),
    ({'model__memory': 'infinity'}, 40 + 24 - 1),
    # No memory: segments longer than trained are the only way to reach further.
    ({'model__mem_len': 0, 'model__memory': 'none', 'eval__tgt_len': 30, 'eval__model__mem_len': None}, 24 - 1),
    # TRAMS over an XL run clamps at what the XL run trained, whatever its own pool.
    ({'eval__model__memory': 'trams', 'eval__model__trams_select': 30, 'eval__model__trams_remain': 20}, 40 + 24 - 1),
    # Training with same_length: every query saw exactly mem_len keys, itself the newest.
    ({'model__same_length': True}, 40 - 1),
    # Training that clamped: nothing longer than its clamp was ever scored.
    ({'model__clamp_len': 30}, 30),
])
def test_the_trained_maximum_is_the_longest_distance_the_run_trained(fields, trained_max):
    trained, evaluated = resolved(**{'eval__tgt_len': 10, 'eval__model__mem_len': 400, **fields},
                                  eval__model__clamp_len=-2)
    assert evaluated.clamp_len == trained_max
    assert memories.trained_distance(trained) == trained_max
    # The evaluation itself reaches further (400 + 10 - 1; 30 - 1) and is clamped to the trained range.
    assert memories.scored_distance(evaluated) == trained_max


def test_a_clamp_len_set_in_training_as_the_trained_maximum_clamps_nothing_there_and_resolves_at_evaluation():
    trained, evaluated = resolved(model__clamp_len=-2, eval__model__mem_len=100)
    assert memories.scored_distance(trained) == 40 + 24 - 1
    assert evaluated.clamp_len == 40 + 24 - 1


def test_a_clamp_len_below_the_trained_maximum_is_refused_in_one_line():
    with pytest.raises(errors.ConfigError, match=r'clamp_len=-3 must be > 0 .* -1 \(no clamping\) or -2'):
        resolved(eval__model__clamp_len=-3)


def setup_warnings(corpus, workdir, caplog, **fields):
    """The warnings experiment.setup logs for configs/tiny.py (tgt 8, mem 8: distances 0-15 trained)."""
    config = training_fixtures.tiny_config(corpus, **fields)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        experiment.setup(config, str(workdir))
    return [r.getMessage() for r in caplog.records if 'relative distances' in r.getMessage()]


@pytest.mark.parametrize('fields, longest', [
    ({}, None),  # As trained.
    ({'eval__model__mem_len': 9}, 16),  # One distance more than trained.
    ({'eval__model__mem_len': 9, 'eval__model__clamp_len': -2}, None),
    ({'eval__model__mem_len': 9, 'eval__model__clamp_len': 15}, None),
    ({'eval__model__mem_len': 9, 'eval__model__clamp_len': 16}, 16),
    ({'eval__tgt_len': 4, 'eval__model__mem_len': 12}, None),  # 12 + 4 - 1 = 15: the trained range.
    ({'eval__tgt_len': 4, 'eval__model__mem_len': 13}, 16),
    ({'eval__model__mem_len': 64, 'eval__model__same_length': True}, 63),
    ({'eval__model__mem_len': 16, 'eval__model__same_length': True}, None),  # 15 back: the trained range.
    ({'eval__model__memory': 'trams', 'eval__model__mem_len': 16, 'eval__model__trams_select': 8,
      'eval__model__trams_remain': 4}, 23),  # Selected keys are scored at their true distances.
    ({'eval__model__memory': 'trams', 'eval__model__mem_len': 16, 'eval__model__trams_select': 8,
      'eval__model__trams_remain': 4, 'eval__model__trams_positions': 'contiguous'}, None),
])
def test_the_warning_is_logged_exactly_when_evaluation_scores_an_untrained_distance(corpus, tmp_path, caplog,
                                                                                  fields, longest):
    warned = setup_warnings(corpus, tmp_path, caplog, **fields)
    if longest is None:
        assert warned == []
    else:
        assert len(warned) == 1 and '\n' not in warned[0]
        assert f'up to {longest} ' in warned[0] and 'at most 15' in warned[0]
        assert '--config.eval.model.clamp_len=-2 clamps them' in warned[0]
