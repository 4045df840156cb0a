"""The sorting task's generator and streams (paper section 4.1), checked by counting."""

import collections

import numpy as np

from memjax.data import sorting
from memjax.data.config import DataConfig


def test_answer_is_symbols_by_descending_count_ties_and_absent_by_id():
    symbols = np.asarray([3, 1, 3, 7, 1, 3, 5, 5, 0])  # 3 x3; 1, 5 x2; 0, 7 x1; the rest absent.
    expected = [3, 1, 5, 0, 7] + [s for s in range(20) if s not in (0, 1, 3, 5, 7)]
    np.testing.assert_array_equal(sorting.sorted_by_count(symbols), expected)


def test_generated_sequences_drift_and_carry_their_answer():
    symbols, answer = sorting.make_sequence(np.random.default_rng(0), 4000)
    counts = collections.Counter(symbols.tolist())
    assert sorted(answer.tolist()) == list(range(20))
    assert all(counts[a] >= counts[b] for a, b in zip(answer, answer[1:]))
    # The mixture drifts: the two halves have different symbol frequencies.
    first, second = (np.bincount(h, minlength=20) / len(h) for h in np.split(symbols, 2))
    assert np.abs(first - second).max() > 0.02


def test_streams_score_only_the_answer_which_ends_the_last_segment():
    streams = sorting.SortingStreams(DataConfig(sort_length=100, sort_train_sequences=6), 'train',
                                     batch_size=2, tgt_len=32, segments_per_batch=4)
    assert streams.segments == 4 and streams.num_batches == 3  # 121 tokens -> 4 x 32; 3 sequences per stream.
    batch = streams.batch(1)  # The second sequence of each stream.
    assert batch['inputs'].shape == (4, 2, 32)
    np.testing.assert_array_equal(batch['reset'][:, 0], [True, False, False, False])
    mask = batch['mask'].transpose(1, 0, 2).reshape(2, -1)
    assert np.all(mask[:, -20:] == 1) and mask[:, :-20].sum() == 0
    targets = batch['targets'].transpose(1, 0, 2).reshape(2, -1)
    inputs = batch['inputs'].transpose(1, 0, 2).reshape(2, -1)
    for row in range(2):
        doc = streams.document(1 * 2 + row)
        np.testing.assert_array_equal(targets[row], doc['targets'])
        symbols = inputs[row][inputs[row] < 20][:100]
        np.testing.assert_array_equal(targets[row, -20:], sorting.sorted_by_count(symbols))
        assert inputs[row, -20] == sorting.SEP and inputs[row, 0] == sorting.PAD  # SEP asks for answer[0].


def answers_scored(streams):
    """Every (sequence's answer) the streams score, found by matching the masked targets of each
    stream's segments against the sequences' own."""
    answers = []
    for index in range(streams.num_batches):
        batch = streams.batch(index)
        for row in range(batch['targets'].shape[1]):
            mask = batch['mask'][:, row].reshape(-1) > 0
            if mask.any():
                answers.append(tuple(batch['targets'][:, row].reshape(-1)[mask]))
    return answers


def test_evaluation_scores_every_sequence_once_when_the_batch_does_not_divide_them():
    """10 validation sequences in 4 streams (split over 2 processes): all 10 answers are scored, each
    once, and the token counts say so; training drops the 2 that would not fill every stream."""
    cfg = DataConfig(sort_length=30, sort_validation_sequences=10, sort_train_sequences=10)
    kwargs = dict(batch_size=4, tgt_len=16, segments_per_batch=2)
    whole = sorting.SortingStreams(cfg, 'validation', **kwargs)
    expected = [tuple(whole.document(i)['targets'][-20:]) for i in range(10)]
    assert len(set(expected)) == 10
    parts = [sorting.SortingStreams(cfg, 'validation', process_index=p, process_count=2, **kwargs) for p in range(2)]
    assert sorted(answers_scored(whole)) == sorted(answers_scored(parts[0]) + answers_scored(parts[1])) == sorted(expected)
    assert whole.num_target_tokens == 10 * 20 == sum(part.num_local_target_tokens for part in parts)
    training = sorting.SortingStreams(cfg, 'train', repeat=True, **kwargs)
    assert len(answers_scored(training)) == 8 and training.num_target_tokens == 8 * 20
