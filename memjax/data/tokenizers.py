"""Tokenizers: byte (enwik8), char (text8), word (WikiText), sentencepiece and GPT-2's BPE.

All map text to np.int32 ids in [0, vocab_size). Vocabularies are saved as
JSON (sentencepiece: its own .model protobuf) next to the run, never pickled,
so evaluation and generation reuse exactly the training vocabulary. The sorting
task's symbols are `sorting.SortingTokenizer`; `factory` picks one of them by name.
"""

import abc
import collections
import hashlib
import json
import os
from typing import Any, Iterable, List, Optional, Sequence

import numpy as np

from memjax import errors
from memjax.runtime import storage

TOKENIZER_FILE = 'tokenizer.json'
SENTENCEPIECE_FILE = 'tokenizer.model'
EOS = '<eos>'
UNK = '<unk>'
# Written for characters outside the char vocabulary.
UNK_CHAR = '\ufffd'
# GPT-2's byte-level BPE files (data.vocab_path: the folder holding them, e.g. an HF gpt2 download).
GPT2_FILES = ('vocab.json', 'merges.txt')
# Bounds sentencepiece's training input; lines beyond it are subsampled.
SP_MAX_TRAIN_LINES = 2_000_000


def split_lines(text: str) -> List[str]:
    """Lines of `text`; a final newline does not start another line."""
    lines = text.split('\n')
    if lines[-1] == '':
        lines.pop()
    return lines


def _sha256_json(obj: Any) -> str:
    data = json.dumps(obj, sort_keys=True, ensure_ascii=True).encode('ascii')
    return hashlib.sha256(data).hexdigest()


class Tokenizer(abc.ABC):
    """Text <-> np.int32 ids. `unit` says how to report the loss."""

    kind: str
    unit: str

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids; every id is in [0, vocab_size)."""

    @abc.abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` as an np.int32 vector."""

    @abc.abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`."""

    @abc.abstractmethod
    def to_json(self) -> dict:
        """The JSON-serialisable description saved in tokenizer.json."""

    @property
    def fingerprint(self) -> str:
        """Changes whenever the id assignment changes (keys token caches)."""
        return _sha256_json(self.to_json())

    def save(self, directory: os.PathLike) -> os.PathLike:
        """Writes tokenizer.json into `directory` (a folder or gs:// location), replacing it whole."""
        storage.path(directory).mkdir(parents=True, exist_ok=True)
        path = storage.path(directory) / TOKENIZER_FILE
        storage.write_text(path, json.dumps(self.to_json(), ensure_ascii=True))
        return path

    def _check_ids(self, ids: Iterable[int]) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise errors.DataError(
                f'{self.kind} tokenizer got ids in [{ids.min()}, {ids.max()}] '
                f'but its vocabulary has {self.vocab_size} entries.')
        return ids


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes, vocabulary 256 (enwik8 style).

    Invalid UTF-8 (e.g. a character cut by enwik8's byte split) is carried in
    the text as surrogate escapes, so the original bytes round-trip exactly.

    `order` (imported vocabularies, memjax.convert.transfo_xl_original): the byte of each id, in id
    order, for a model whose ids are not the byte values; `dropped`: bytes the preprocessing
    removes (enwik8's line breaks in the original code), which encoding drops. Any other byte
    missing from `order` is an error.
    """

    kind = 'byte'
    unit = 'byte'

    def __init__(self, order: Optional[Sequence[int]] = None, dropped: Sequence[int] = ()):
        self.order = None if order is None else [int(b) for b in order]
        self.dropped = sorted(int(b) for b in dropped)
        self._ids = np.arange(256)
        if self.order is not None:
            if len(set(self.order)) != len(self.order) or not all(0 <= b < 256 for b in self.order):
                raise errors.DataError('a byte vocabulary\'s order must list distinct bytes in [0, 256).')
            self._ids = np.full(256, -1)
            self._ids[self.order] = np.arange(len(self.order))

    @property
    def vocab_size(self) -> int:
        return 256 if self.order is None else len(self.order)

    def encode(self, text: str) -> np.ndarray:
        data = np.frombuffer(text.encode('utf-8', 'surrogateescape'), dtype=np.uint8)
        if self.dropped:
            data = data[~np.isin(data, self.dropped)]
        if self.order is None:
            return data.astype(np.int32)
        ids = self._ids[data]
        if (ids < 0).any():
            raise errors.DataError(f'bytes {sorted(set(data[ids < 0].tolist()))[:5]} are not in this imported byte '
                                   'vocabulary: the model never saw them.')
        return ids.astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        ids = self._check_ids(ids)
        data = (ids if self.order is None else np.asarray(self.order, np.int64)[ids]).astype(np.uint8).tobytes()
        return data.decode('utf-8', 'surrogateescape')

    def to_json(self) -> dict:
        if self.order is None:
            return {'kind': self.kind, **({'dropped': self.dropped} if self.dropped else {})}
        return {'kind': self.kind, 'order': self.order, 'dropped': self.dropped}


def _code_points(text: str) -> np.ndarray:
    # surrogatepass keeps surrogate-escaped bytes as their own characters.
    data = text.encode('utf-32-le', 'surrogatepass')
    return np.frombuffer(data, dtype='<u4')


class CharTokenizer(Tokenizer):
    """Characters seen in the train split (text8 style), plus one unknown id.

    Ids follow code point order; the last id stands for any character missing
    from the train split (decoded as U+FFFD).
    """

    kind = 'char'
    unit = 'char'

    def __init__(self, chars: Sequence[str]):
        if not chars:
            raise errors.DataError('Char vocabulary is empty (no text in the train '
                                   'split?).')
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars):
            raise errors.DataError('Char vocabulary must hold distinct single '
                                   'characters.')
        self.chars = sorted(chars)
        self._points = _code_points(''.join(self.chars)).astype(np.int64)
        self.unk_id = len(self.chars)

    @classmethod
    def from_documents(cls, documents: Iterable[str]) -> 'CharTokenizer':
        chars = set()
        for doc in documents:
            chars.update(np.unique(_code_points(doc)).tolist())
        return cls([chr(c) for c in chars])

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> np.ndarray:
        points = _code_points(text).astype(np.int64)
        pos = np.minimum(np.searchsorted(self._points, points),
                         len(self._points) - 1)
        known = self._points[pos] == points
        return np.where(known, pos, self.unk_id).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        table = np.append(self._points, ord(UNK_CHAR)).astype('<u4')
        points = table[self._check_ids(ids)]
        return points.tobytes().decode('utf-32-le', 'surrogatepass')

    def to_json(self) -> dict:
        return {'kind': self.kind, 'chars': self.chars}


class WordTokenizer(Tokenizer):
    """Whitespace-split words with `<eos>` after every line (WikiText style).

    Ids: `<eos>` = 0, then words by decreasing train frequency, ties in the order the words first
    appear, as the original code builds WikiText-103's (`Counter.most_common`): adaptive-softmax
    cutoffs see frequent words first and split the same words into clusters. A literal `<unk>` in
    the text (WikiText's) takes its own place; a text without one gets it as id 1. An imported
    vocabulary (memjax.convert.transfo_xl_original) keeps its own order, and with `lower_case`
    (the original code's for Penn Treebank) lower-cases each line before splitting it, as it does.
    """

    kind = 'word'
    unit = 'word'

    def __init__(self, tokens: Sequence[str], lower_case: bool = False):
        self.tokens = list(tokens)
        self.lower_case = bool(lower_case)
        self._index = {tok: i for i, tok in enumerate(self.tokens)}
        if len(self._index) != len(self.tokens):
            raise errors.DataError('Word vocabulary has duplicate tokens.')
        missing = [special for special in (EOS, UNK) if special not in self._index]
        if missing:
            raise errors.DataError(f'Word vocabulary lacks {missing}: it needs {EOS!r} (line ends) and '
                                   f'{UNK!r} (words outside it).')
        self.eos_id = self._index[EOS]
        self.unk_id = self._index[UNK]

    @classmethod
    def from_documents(cls, documents: Iterable[str], min_freq: int = 1,
                       max_size: Optional[int] = None) -> 'WordTokenizer':
        """Builds the vocabulary from (train) documents.

        Args:
          documents: texts to count words in.
          min_freq: words seen fewer times become `<unk>`.
          max_size: cap on the vocabulary size, specials included.
        """
        counts = collections.Counter()
        for doc in documents:
            for line in split_lines(doc):
                counts.update(line.split())
        counts.pop(EOS, None)
        # most_common sorts stably: ties keep the order in which the words were first counted.
        words = [w for w, c in counts.most_common() if c >= min_freq or w == UNK]
        if UNK not in counts:
            words.insert(0, UNK)
        tokens = [EOS] + words
        if max_size is not None:
            if max_size < 2:
                raise errors.DataError(f'word max_size must be >= 2, got {max_size}.')
            if UNK not in tokens[:max_size]:  # Words the cap leaves out become <unk>: it stays.
                tokens = tokens[:max_size - 1] + [UNK]
            tokens = tokens[:max_size]
        return cls(tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str) -> np.ndarray:
        get, unk = self._index.get, self.unk_id
        ids = []
        for line in split_lines(text):
            ids.extend(get(w, unk) for w in (line.lower() if self.lower_case else line).split())
            ids.append(self.eos_id)
        return np.asarray(ids, dtype=np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        pieces, line = [], []
        for i in self._check_ids(ids).tolist():
            if i == self.eos_id:
                pieces.append(' '.join(line) + '\n')
                line = []
            else:
                line.append(self.tokens[i])
        pieces.append(' '.join(line))
        return ''.join(pieces)

    def to_json(self) -> dict:
        # The field only when set: a vocabulary that keeps case has the fingerprint it always had.
        return {'kind': self.kind, 'tokens': self.tokens, **({'lower_case': True} if self.lower_case else {})}


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model applied line by line; its eos id marks newlines.

    Sentencepiece works on sentences without newlines, so each line is encoded
    separately and followed by eos; decoding turns eos back into '\\n'.
    """

    kind = 'sentencepiece'
    unit = 'subword'

    def __init__(self, model_proto: bytes, source: str = '<memory>'):
        import sentencepiece as spm  # Only needed for this tokenizer.
        self.model_proto = bytes(model_proto)
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=self.model_proto)
        except (RuntimeError, OSError) as e:
            raise errors.DataError(
                f'{source} is not a sentencepiece model ({e}); point data.vocab_path at a '
                '.model file written by sentencepiece, or leave it empty to train one.') from e
        self.eos_id = self._sp.eos_id()
        if self.eos_id < 0:
            raise errors.DataError(
                f'Sentencepiece model {source} has no eos piece, which memjax '
                'uses to mark line ends; train it with eos_id >= 0 (the '
                'default) or let memjax train one (leave data.vocab_path empty).')

    @classmethod
    def load(cls, path: os.PathLike) -> 'SentencePieceTokenizer':
        return cls(storage.path(path).read_bytes(), source=str(path))

    @classmethod
    def train(cls, documents: Iterable[str],
              vocab_size: int) -> 'SentencePieceTokenizer':
        """Trains a unigram model with byte fallback (lossless round trip)."""
        import io
        import sentencepiece as spm
        lines = [line for doc in documents for line in split_lines(doc)
                 if line.strip()]
        if not lines:
            raise errors.DataError('Cannot train sentencepiece: the train split has '
                                   'no non-empty lines.')
        # Deterministic subsampling instead of sentencepiece's random one.
        stride = -(-len(lines) // SP_MAX_TRAIN_LINES)
        model = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(lines[::stride]), model_writer=model,
                vocab_size=vocab_size, model_type='unigram',
                byte_fallback=True, character_coverage=1.0,
                normalization_rule_name='identity',
                remove_extra_whitespaces=False, add_dummy_prefix=False,
                hard_vocab_limit=False, shuffle_input_sentence=False,
                num_threads=min(os.cpu_count() or 1, 16), minloglevel=2)
        except RuntimeError as e:
            raise errors.DataError(
                f'Sentencepiece training failed for data.sp_vocab_size='
                f'{vocab_size} (byte fallback needs more than 256 + the '
                f'number of distinct characters): {e}') from e
        return cls(model.getvalue())

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> np.ndarray:
        lines = split_lines(text)
        if not lines:
            return np.zeros([0], np.int32)
        encoded = self._sp.encode(lines, add_eos=True)
        return np.concatenate([np.asarray(x, np.int32) for x in encoded])

    def decode(self, ids: Iterable[int]) -> str:
        ids = self._check_ids(ids)
        ends = np.flatnonzero(ids == self.eos_id)
        starts = np.concatenate([[0], ends + 1])
        pieces = [self._sp.decode(ids[s:e].tolist()) + '\n'
                  for s, e in zip(starts, ends)]
        pieces.append(self._sp.decode(ids[starts[-1]:].tolist()))
        return ''.join(pieces)

    def to_json(self) -> dict:
        return {'kind': self.kind, 'model_file': SENTENCEPIECE_FILE,
                'model_sha256': hashlib.sha256(self.model_proto).hexdigest()}

    def save(self, directory: os.PathLike) -> os.PathLike:
        # The model first: a save cut short never leaves a tokenizer.json without its model.
        storage.path(directory).mkdir(parents=True, exist_ok=True)
        storage.write_bytes(storage.join(directory, SENTENCEPIECE_FILE), self.model_proto)
        return super().save(directory)


class GPT2BPETokenizer(Tokenizer):
    """GPT-2's byte-level BPE (HF `tokenizers`), from its vocab.json and merges.txt.

    Lossless on any text, like GPT-2 itself (no normalisation, no prefix space), so ids match a
    pretrained GPT-2's. Saved as one tokenizer.json holding both files' contents.
    """

    kind = 'gpt2_bpe'
    unit = 'subword'

    def __init__(self, vocab: dict, merges: Sequence[str]):
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers  # Only needed here.
        self.vocab, self.merges = dict(vocab), list(merges)
        model = models.BPE(self.vocab, [tuple(m.split(' ')) for m in self.merges])
        self._tok = HFTokenizer(model)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()

    @classmethod
    def from_folder(cls, folder: os.PathLike) -> 'GPT2BPETokenizer':
        folder = storage.path(folder)
        missing = [name for name in GPT2_FILES if not (folder / name).is_file()]
        if missing:
            raise errors.MissingFileError(
                f'{folder} lacks {missing}: data.tokenizer=gpt2_bpe reads GPT-2\'s {list(GPT2_FILES)} '
                'from data.vocab_path (e.g. the folder of an HF gpt2 download).')
        try:
            vocab = json.loads((folder / 'vocab.json').read_text(encoding='utf-8'))
        except ValueError as e:
            raise errors.DataError(f'{folder / "vocab.json"} is not JSON ({e}); download it again.') from e
        lines = (folder / 'merges.txt').read_text(encoding='utf-8').splitlines()
        return cls(vocab, [m for m in lines if m and not m.startswith('#version')])

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(self._check_ids(ids).tolist())

    def to_json(self) -> dict:
        return {'kind': self.kind, 'vocab': self.vocab, 'merges': self.merges}
