"""Ordered LM batches for recurrent-memory models (Transformer-XL style).

A split's token ids are laid out as B parallel streams, each read left to
right in segments of T tokens, so a stream's memory always holds the text
right before its current segment. The layout is a small table per (stream,
segment): where the segment starts in the token array, how many of its
positions are real targets, and whether the stream's memory resets there.
Batches are gathered from that table on demand, which makes the iterator
state a single batch index (exact, JSON-serialisable) and lets every process
slice the same global layout.
"""

import dataclasses
import hashlib
import heapq
import os
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from absl import logging
import numpy as np

from memjax import errors
from memjax.data import builders
from memjax.data import prepared
from memjax.data.config import DataConfig, data_folder
from memjax.data.streams import BatchedStreams
from memjax.data.tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True)
class Layout:
    """Per stream and segment: start index, real targets, memory reset.

    Segment k of stream b reads inputs tokens[start[b, k] + j] and targets
    tokens[start[b, k] + j + 1] for j < num_valid[b, k]; the rest is padding.
    """
    start: np.ndarray      # int64 [B, K]
    num_valid: np.ndarray  # int32 [B, K], in [0, T]
    reset: np.ndarray      # bool [B, K]


def _segments(start: int, num_targets: int, tgt_len: int
              ) -> Tuple[np.ndarray, np.ndarray]:
    """Cuts `num_targets` targets from `start` into segments of tgt_len."""
    offsets = np.arange(0, num_targets, tgt_len, dtype=np.int64)
    return start + offsets, np.minimum(num_targets - offsets, tgt_len)


def _stack(streams: List[List[Tuple[np.ndarray, np.ndarray, np.ndarray]]]
           ) -> Layout:
    """Pads per-stream segment lists to a common length K."""
    parts = [tuple(np.concatenate(x) for x in zip(*stream)) for stream in
             streams]
    k = max(len(p[0]) for p in parts)
    layout = Layout(np.zeros([len(parts), k], np.int64),
                    np.zeros([len(parts), k], np.int32),
                    np.zeros([len(parts), k], bool))
    for b, (start, valid, reset) in enumerate(parts):
        layout.start[b, :len(start)] = start
        layout.num_valid[b, :len(valid)] = valid
        layout.reset[b, :len(reset)] = reset
    return layout


def contiguous_layout(num_tokens: int, batch_size: int,
                      tgt_len: int) -> Layout:
    """B contiguous streams over one token sequence (Transformer-XL).

    Targets are tokens 1..N-1, split into B runs whose lengths differ by at
    most one; stream b also reads the token before its first target, so every
    target is scored exactly once. Only the first segment resets memory.
    """
    num_targets = num_tokens - 1
    lengths = np.full(batch_size, num_targets // batch_size, np.int64)
    lengths[:num_targets % batch_size] += 1
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    streams = []
    for start, length in zip(starts, lengths):
        seg_start, seg_valid = _segments(int(start), int(length), tgt_len)
        reset = np.zeros(len(seg_start), bool)
        reset[0] = True
        streams.append([(seg_start, seg_valid, reset)])
    return _stack(streams)


def document_layout(doc_offsets: np.ndarray, batch_size: int,
                    tgt_len: int) -> Layout:
    """Whole documents per stream, each starting a fresh segment and memory.

    Documents (in corpus order) go to the stream with the fewest segments so
    far (lowest index on ties), which balances stream lengths while keeping
    each stream in corpus order. A document of n tokens gives n - 1 targets;
    its last segment is padded, and one-token documents have nothing to score.
    """
    streams = [[] for _ in range(batch_size)]
    heap = [(0, b) for b in range(batch_size)]
    for begin, end in zip(doc_offsets[:-1], doc_offsets[1:]):
        if end - begin < 2:
            continue
        seg_start, seg_valid = _segments(int(begin), int(end - begin - 1),
                                         tgt_len)
        reset = np.zeros(len(seg_start), bool)
        reset[0] = True
        filled, b = heapq.heappop(heap)
        streams[b].append((seg_start, seg_valid, reset))
        heapq.heappush(heap, (filled + len(seg_start), b))
    return _stack(streams)


def _cache_paths(data_cfg: DataConfig, builder, split: str, tokenizer: Tokenizer,
                 cache_dir: Optional[os.PathLike]) -> Tuple[Path, Path]:
    limit = prepared.train_documents(data_cfg, split)
    subset = f'\0first{limit}' if limit else ''  # Whole splits keep the keys they always had.
    key = hashlib.sha256(
        (prepared.dataset_fingerprint(builder, split) + tokenizer.fingerprint + subset
         ).encode()).hexdigest()[:24]
    folder = Path(cache_dir or data_cfg.cache_dir
                  or data_folder(data_cfg) / 'memjax_token_cache')
    stem = folder.expanduser() / f'{builder.name}-{split}-{key}'
    return Path(f'{stem}.tokens.npy'), Path(f'{stem}.docs.npy')


def _save_npy(path: Path, array: np.ndarray) -> None:
    # Write then rename, so a killed run never leaves a truncated cache file.
    tmp = path.with_name(f'{path.name}.{os.getpid()}.tmp')
    with open(tmp, 'wb') as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def _load_cache(tokens_path: Path, docs_path: Path, vocab_size: int
                ) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """The cached ids and offsets, or None when missing or damaged.

    A cache is derived data: one cut short or garbled (a full disk, a copy
    interrupted by hand) is rebuilt rather than trusted.
    """
    if not (tokens_path.exists() and docs_path.exists()):
        return None
    try:
        tokens = np.load(tokens_path, mmap_mode='r', allow_pickle=False)
        offsets = np.load(docs_path, allow_pickle=False)
        ok = (tokens.dtype == np.int32 and tokens.ndim == 1 and offsets.ndim == 1
              and offsets.size >= 1 and offsets[0] == 0
              and offsets[-1] == tokens.size and np.all(np.diff(offsets) >= 0)
              and (tokens.size == 0 or 0 <= tokens.min() <= tokens.max() < vocab_size))
    except (ValueError, OSError, EOFError) as e:
        ok, reason = False, f'{type(e).__name__}: {e}'
    else:
        reason = f'ids outside [0, {vocab_size}) or offsets that do not fit the ids'
    if not ok:
        logging.warning('Token cache %s is damaged (%s); building it again.',
                        tokens_path, reason)
        return None
    return tokens, offsets


def data_fingerprint(data_cfg: DataConfig, split: str, tokens: np.ndarray,
                     doc_offsets: np.ndarray) -> Dict[str, str]:
    """{'source': the prepared dataset's name (for data.name='text' it changes with the files' sizes
    and times) and the documents read, 'tokens': SHA-256 of the token ids and document offsets}."""
    digest = hashlib.sha256(np.ascontiguousarray(tokens).data)
    digest.update(np.ascontiguousarray(doc_offsets).data)
    limit = prepared.train_documents(data_cfg, split)
    return {'source': builders.make_builder(data_cfg).info.full_name + (f' (first {limit} documents)' if limit else ''),
            'tokens': digest.hexdigest()[:16]}


def load_token_ids(data_cfg: DataConfig, split: str, tokenizer: Tokenizer,
                   cache_dir: Optional[os.PathLike] = None
                   ) -> Tuple[np.ndarray, np.ndarray]:
    """Token ids of a split (documents concatenated) and document offsets.

    Tokenised once, then read from .npy files keyed by the prepared dataset,
    split and tokenizer (memory-mapped, so large splits stay on disk).

    Returns:
      tokens: int32 [N]; doc_offsets: int64 [num_docs + 1], document i is
      tokens[doc_offsets[i]:doc_offsets[i + 1]].
    """
    split = builders.canonical_split(split)
    builder = prepared.prepare(data_cfg)
    tokens_path, docs_path = _cache_paths(data_cfg, builder, split, tokenizer,
                                          cache_dir)
    cached = _load_cache(tokens_path, docs_path, tokenizer.vocab_size)
    if cached is None:
        logging.info('Tokenising the %s split of %s with the %s tokenizer, once (cached in %s).', split,
                     builder.info.full_name, tokenizer.kind, tokens_path.parent)
        start = time.time()
        encoded = [tokenizer.encode(doc) for doc in
                   prepared.run_documents(data_cfg, builder, split)]
        logging.info('Tokenised %s document%s into %s tokens in %.1f s.', f'{len(encoded):,}', 's' * (len(encoded) != 1),
                     f'{sum(len(x) for x in encoded):,}', time.time() - start)
        offsets = np.cumsum([0] + [len(x) for x in encoded], dtype=np.int64)
        prepared.make_folder(tokens_path.parent, 'cache_dir' if cache_dir or data_cfg.cache_dir else 'data_dir')
        _save_npy(docs_path, offsets)
        _save_npy(tokens_path, np.concatenate(encoded).astype(np.int32))
        cached = _load_cache(tokens_path, docs_path, tokenizer.vocab_size)
        if cached is None:
            ids = np.concatenate(encoded) if encoded else np.zeros(0, np.int64)
            if ids.size and (ids.min() < 0 or ids.max() >= tokenizer.vocab_size):
                raise errors.DataError(
                    f'Split {split!r} of {builder.info.full_name} has token ids in '
                    f'[{ids.min()}, {ids.max()}] but the tokenizer has vocab_size '
                    f'{tokenizer.vocab_size}: the tokenizer file is inconsistent; delete the '
                    "run's tokenizer.json to build it again, or fix data.vocab_path.")
            raise errors.DataError(
                f'the token cache {tokens_path} does not read back as written: check the '
                'free space there, or set data.cache_dir to another folder.')
    return cached


class LMStreams(BatchedStreams):
    """Batches of B streams x S consecutive segments of T tokens for a split.

    Arrays per batch: inputs / targets int32 [S, B_local, T], mask float32
    [S, B_local, T] (1 = real target), reset bool [S, B_local] (clear that
    stream's memory before the segment). With reset_at_doc_boundary each
    document starts on a fresh segment with a reset; otherwise the split is
    one text and only the first segment of a pass resets. Each pass scores
    every target exactly once (partial segments are padded, never dropped);
    repeat=True loops over passes forever in the same order.

    Process p of P gets global streams [p*B/P, (p+1)*B/P): the global layout
    never depends on P.
    """

    def __init__(self, data_cfg: DataConfig, split: str, tokenizer: Tokenizer, *,
                 batch_size: int, tgt_len: int, segments_per_batch: int = 1,
                 repeat: bool = False, process_index: int = 0,
                 process_count: int = 1,
                 cache_dir: Optional[os.PathLike] = None):
        for name, value in (('batch_size', batch_size), ('tgt_len', tgt_len),
                            ('segments_per_batch', segments_per_batch),
                            ('process_count', process_count)):
            if int(value) < 1:
                raise errors.DataError(f'{name} must be >= 1, got {value}.')
        if batch_size % process_count:
            raise errors.DataError(
                f'batch_size {batch_size} is not divisible by the process '
                f'count {process_count}; use a multiple of {process_count}.')
        if not 0 <= process_index < process_count:
            raise errors.DataError(f'process_index {process_index} is outside '
                                   f'[0, {process_count}).')
        self.split = builders.canonical_split(split)
        self.batch_size, self.tgt_len = batch_size, tgt_len
        self.segments_per_batch, self.repeat = segments_per_batch, repeat
        self.reset_at_doc_boundary = data_cfg.reset_at_doc_boundary
        self.tokens, self.doc_offsets = load_token_ids(
            data_cfg, self.split, tokenizer, cache_dir)
        self._check_length(data_cfg.name)
        self.fingerprint = data_fingerprint(data_cfg, self.split, self.tokens, self.doc_offsets)
        if self.reset_at_doc_boundary:
            layout = document_layout(self.doc_offsets, batch_size, tgt_len)
        else:
            layout = contiguous_layout(len(self.tokens), batch_size, tgt_len)
        self.num_target_tokens = int(layout.num_valid.sum())
        local = slice(process_index * batch_size // process_count,
                      (process_index + 1) * batch_size // process_count)
        self.num_local_target_tokens = int(layout.num_valid[local].sum())
        # Whole batches only: pad K to a multiple of S with empty segments.
        k = layout.start.shape[1]
        self.num_batches = -(-k // segments_per_batch)
        pad = [(0, 0), (0, self.num_batches * segments_per_batch - k)]
        self._start = np.pad(layout.start[local], pad)
        self._num_valid = np.pad(layout.num_valid[local], pad)
        self._reset = np.pad(layout.reset[local], pad)

    def _check_length(self, name: str) -> None:
        where = f'Split {self.split!r} of data.name={name!r}'
        b, t = self.batch_size, self.tgt_len
        if self.reset_at_doc_boundary:
            lengths = np.diff(self.doc_offsets)
            usable = int((lengths >= 2).sum())
            if usable < b:
                raise errors.DataError(
                    f'{where} has {usable} documents with at least 2 tokens, '
                    f'fewer than batch_size={b} streams; lower the batch '
                    'size or set data.reset_at_doc_boundary=False.')
        elif len(self.tokens) - 1 < b * t:
            raise errors.DataError(
                f'{where} has {len(self.tokens)} tokens, too few for '
                f'{b} streams of at least one {t}-token segment (needs '
                f'{b * t + 1}); lower batch_size or tgt_len.')

    def batch(self, index: int) -> Dict[str, np.ndarray]:
        """Batch `index` (0 <= index < num_batches) of a pass."""
        ks = slice(index * self.segments_per_batch,
                   (index + 1) * self.segments_per_batch)
        start = self._start[:, ks].T            # [S, B_local]
        num_valid = self._num_valid[:, ks].T
        pos = np.arange(self.tgt_len)
        valid = pos < num_valid[..., None]      # [S, B_local, T]
        idx = np.where(valid, start[..., None] + pos, 0)
        return {
            'inputs': np.where(valid, self.tokens[idx], 0).astype(np.int32),
            'targets': np.where(valid, self.tokens[idx + 1], 0
                                ).astype(np.int32),
            'mask': valid.astype(np.float32),
            'reset': self._reset[:, ks].T.copy(),
        }
