"""The infinity-former's sorting task (paper section 4.1), generated on the fly.

A sequence of `length` symbols from a vocabulary of 20 is drawn from a distribution that drifts
over time, p_t = (1 - r) p0 + r p1 with r = (t + 1) / length and p0, p1 random (integer weights
1..9, normalised); then comes the separator and the answer: the 20 symbols by descending count in
the sequence. Ties, absent symbols included, are broken by the smaller symbol id, so symbols that
never occur close the answer in increasing order. A model must remember counts over the whole
sequence, and the drift punishes one that only looks at the recent past.

Each sequence is one document: it is left-padded so that its answer ends its last segment, its
first segment resets the memory, and only the 20 answer predictions are scored (mask 1): the
loss and accuracy are the answer's; earlier segments only build memory. Sequence i of a split
is a pure function of (seed, split, i), so every pass, process and resume sees the same data.
"""

from __future__ import annotations

import os
from typing import Dict, Iterable

import numpy as np

from memjax import errors
from memjax.data.config import DataConfig
from memjax.data.streams import BatchedStreams
from memjax.data.tokenizers import Tokenizer

SYMBOLS = 20
SEP, PAD = SYMBOLS, SYMBOLS + 1
VOCAB_SIZE = SYMBOLS + 2
_SPLIT_IDS = {'train': 0, 'validation': 1, 'test': 2}


def sorted_by_count(symbols: np.ndarray) -> np.ndarray:
    """The answer: every symbol by descending count, ties by increasing id."""
    counts = np.bincount(symbols, minlength=SYMBOLS)
    return np.lexsort((np.arange(SYMBOLS), -counts)).astype(np.int32)


def make_sequence(rng: np.random.Generator, length: int) -> tuple[np.ndarray, np.ndarray]:
    """(symbols [length], answer [20]) drawn from the drifting mixture."""
    p0, p1 = (w / w.sum() for w in rng.integers(1, 10, (2, SYMBOLS)).astype(np.float64))
    r = (np.arange(length) + 1.0) / length
    cdf = np.cumsum((1 - r)[:, None] * p0 + r[:, None] * p1, axis=1)
    symbols = np.minimum((rng.random(length)[:, None] > cdf).sum(1), SYMBOLS - 1).astype(np.int32)
    return symbols, sorted_by_count(symbols)


def _check_fits_in_memory(length: int, streams: int) -> None:
    """Refuses, before anything is allocated, a length whose batch would not fit in host memory:
    drawing a sequence holds its [length, 20] float64 CDF and the comparison with it (about 200
    bytes a symbol), and a batch its streams' inputs, targets and mask (12 bytes a symbol each)."""
    if length < 1:
        raise errors.DataError(f'data.sort_length={length} must be >= 1.')
    need = length * (200 + 12 * streams)
    have = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    if need > have // 2:
        raise errors.DataError(
            f'data.sort_length={length:,}: a batch of these sequences needs about {need / 2**30:,.0f} GiB '
            f'of host memory, more than half of this machine\'s {have / 2**30:,.0f} GiB; lower it (the '
            'paper uses 4,000 to 16,000).')


class SortingTokenizer(Tokenizer):
    """Symbols '0'..'19', '<sep>', '<pad>' as space-separated text (for generation and reading)."""

    kind = 'sorting'
    unit = 'symbol'
    _NAMES = [str(i) for i in range(SYMBOLS)] + ['<sep>', '<pad>']

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    def encode(self, text: str) -> np.ndarray:
        try:
            return np.asarray([self._NAMES.index(t) for t in text.split()], np.int32)
        except ValueError as e:
            raise errors.DataError(f'sorting text holds symbols 0..19, <sep> and <pad>: {e}') from None

    def decode(self, ids: Iterable[int]) -> str:
        return ' '.join(self._NAMES[i] for i in self._check_ids(ids))

    def to_json(self) -> dict:
        return {'kind': self.kind}


class SortingStreams(BatchedStreams):
    """LMStreams' interface over generated sorting sequences: batches of inputs / targets / mask
    [S, B_local, T] and reset [S, B_local]; B streams each read whole sequences of K segments."""

    def __init__(self, data_cfg: DataConfig, split: str, *, batch_size: int, tgt_len: int,
                 segments_per_batch: int = 1, repeat: bool = False, process_index: int = 0,
                 process_count: int = 1, seed: int = 0):
        if split not in _SPLIT_IDS:
            raise errors.DataError(f'sorting has splits {sorted(_SPLIT_IDS)}, not {split!r}.')
        self.split, self.batch_size, self.tgt_len = split, batch_size, tgt_len
        self.segments_per_batch, self.repeat, self.seed = segments_per_batch, repeat, seed
        self.length = data_cfg.sort_length
        _check_fits_in_memory(self.length, -(-batch_size // process_count))
        sequences = {'train': data_cfg.sort_train_sequences, 'validation': data_cfg.sort_validation_sequences,
                     'test': data_cfg.sort_test_sequences}[split]
        if sequences < batch_size:
            raise errors.DataError(f'sorting {split}: {sequences} sequences for {batch_size} streams; '
                                   f'raise data.sort_{split}_sequences or lower the batch size.')
        # Training drops a pass's last sequences that would not fill every stream, as a pass of
        # whole batches does; evaluation scores every sequence once, streams past the last reading
        # empty segments.
        self.sequences = sequences - sequences % batch_size if repeat else sequences
        self.groups = -(-self.sequences // batch_size)  # Sequences per stream in a pass.
        self.segments = -(-(self.length + SYMBOLS + 1) // tgt_len)  # K: inputs are length + 20 tokens.
        self.num_batches = -(-self.groups * self.segments // segments_per_batch)
        self._local = range(process_index * batch_size // process_count,
                            (process_index + 1) * batch_size // process_count)
        self.num_target_tokens = self.sequences * SYMBOLS
        self.num_local_target_tokens = SYMBOLS * sum(
            group * batch_size + stream < self.sequences for group in range(self.groups) for stream in self._local)

    def document(self, index: int) -> Dict[str, np.ndarray]:
        """Sequence `index` laid out over K segments: inputs, targets, mask [K * T]."""
        rng = np.random.default_rng([self.seed, _SPLIT_IDS[self.split], index])
        symbols, answer = make_sequence(rng, self.length)
        tokens = np.concatenate([symbols, [SEP], answer]).astype(np.int32)
        pad = self.segments * self.tgt_len - (len(tokens) - 1)
        mask = np.zeros(len(tokens) - 1, np.float32)
        mask[-SYMBOLS:] = 1.0  # Targets tokens[length + 1:], the answer.
        return {'inputs': np.pad(tokens[:-1], (pad, 0), constant_values=PAD),
                'targets': np.pad(tokens[1:], (pad, 0), constant_values=PAD),
                'mask': np.pad(mask, (pad, 0))}

    def batch(self, index: int) -> Dict[str, np.ndarray]:
        out = {'inputs': [], 'targets': [], 'mask': [], 'reset': []}
        documents = {}  # A sequence spans K segments: generate it once per batch.
        for g in range(index * self.segments_per_batch, (index + 1) * self.segments_per_batch):
            group, k = divmod(g, self.segments)
            rows = {name: [] for name in out}
            for stream in self._local:
                number = group * self.batch_size + stream
                if number < self.sequences:
                    if number not in documents:
                        documents[number] = self.document(number)
                    doc = documents[number]
                    for name in ('inputs', 'targets', 'mask'):
                        rows[name].append(doc[name][k * self.tgt_len:(k + 1) * self.tgt_len])
                else:  # Past the last sequence of the pass: an empty segment.
                    rows['inputs'].append(np.full(self.tgt_len, PAD, np.int32))
                    rows['targets'].append(np.full(self.tgt_len, PAD, np.int32))
                    rows['mask'].append(np.zeros(self.tgt_len, np.float32))
                rows['reset'].append(k == 0)
            for name in out:
                out[name].append(np.stack(rows[name]))
        return {name: np.stack(value) for name, value in out.items()}
