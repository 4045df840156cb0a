"""Choices by name: the tokenizer that data.tokenizer or a saved tokenizer file names, and the
streams of data.name. The one module that imports every concrete tokenizer and stream class, so
that their own modules need not import each other."""

import json
import os
from typing import Iterable, Optional

from absl import logging

from memjax import errors
from memjax.data import builders, pipeline, prepared, sorting
from memjax.data.config import TOKENIZERS, DataConfig
from memjax.data.streams import BatchedStreams
from memjax.data.tokenizers import (GPT2_FILES, TOKENIZER_FILE, ByteTokenizer, CharTokenizer,
                                    GPT2BPETokenizer, SentencePieceTokenizer, Tokenizer,
                                    WordTokenizer)
from memjax.runtime import storage

# Tokenizers whose vocabulary does not depend on the data.
FIXED_VOCABULARIES = ('byte', 'sorting')


def load_tokenizer(path: os.PathLike) -> Tokenizer:
    """Loads a tokenizer.json (or its folder) or a sentencepiece .model file, local or gs://."""
    path = storage.path(path)
    if path.is_dir() and not (path / TOKENIZER_FILE).exists() and (path / GPT2_FILES[0]).exists():
        return GPT2BPETokenizer.from_folder(path)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.exists():
        raise errors.MissingFileError(
            f'Tokenizer file {path} does not exist; point data.vocab_path at a {TOKENIZER_FILE} written by '
            f'memjax, a sentencepiece .model, or a folder with GPT-2\'s {" and ".join(GPT2_FILES)}.')
    if path.suffix == '.model':
        return SentencePieceTokenizer.load(path)
    try:
        spec = json.loads(path.read_text())
        kind = spec['kind']
    except (ValueError, KeyError, TypeError) as e:
        raise errors.DataError(f'{path} is not a memjax tokenizer file '
                               f'(JSON with a "kind" field): {e}') from e
    try:
        if kind == 'byte':
            return ByteTokenizer(spec.get('order'), spec.get('dropped', ()))
        if kind == 'char':
            return CharTokenizer(spec['chars'])
        if kind == 'word':
            return WordTokenizer(spec['tokens'], lower_case=spec.get('lower_case', False))
        if kind == 'gpt2_bpe':
            return GPT2BPETokenizer(spec['vocab'], spec['merges'])
        if kind == 'sorting':
            return sorting.SortingTokenizer()
        if kind == 'sentencepiece':
            model_path = path.parent / spec['model_file']
            if not model_path.is_file():
                raise errors.MissingFileError(
                    f'{model_path}, named by {path}, does not exist; keep the two files '
                    'together.')
            model = SentencePieceTokenizer.load(model_path)
            if model.to_json()['model_sha256'] != spec.get('model_sha256'):
                raise errors.DataError(f'{model_path} does not match the model hash '
                                       f'recorded in {path}; the pair was mixed up.')
            return model
    except (KeyError, TypeError, errors.DataError) as e:
        if kind == 'sentencepiece' and isinstance(e, errors.DataError):
            raise  # About its model file, which it names.
        why = f'no valid {e} for kind {kind!r}' if isinstance(e, (KeyError, TypeError)) else str(e).rstrip('.')
        raise errors.DataError(f'{path} is a damaged memjax tokenizer file ({why}); restore it from a backup, or '
                               'delete it to build it again from the same data (the build is deterministic).') from e
    raise errors.DataError(f'{path}: unknown tokenizer kind {kind!r}; expected one '
                           f'of {TOKENIZERS}.')


def train_tokenizer(data_cfg: DataConfig, train_documents: Iterable[str]) -> Tokenizer:
    """Builds a new tokenizer of data.tokenizer from the train split's documents."""
    kind = data_cfg.tokenizer
    if kind == 'byte':
        return ByteTokenizer(dropped=data_cfg.drop_bytes)
    if kind == 'sorting':
        return sorting.SortingTokenizer()
    if kind == 'char':
        return CharTokenizer.from_documents(train_documents)
    if kind == 'word':
        return WordTokenizer.from_documents(
            train_documents, min_freq=data_cfg.word_min_freq,
            max_size=data_cfg.word_max_size if data_cfg.word_max_size > 0 else None)
    if kind == 'sentencepiece':
        return SentencePieceTokenizer.train(train_documents, data_cfg.sp_vocab_size)
    if kind == 'gpt2_bpe':
        raise errors.MissingFileError(
            f'data.tokenizer=gpt2_bpe is not trained: set data.vocab_path to a folder with GPT-2\'s '
            f'{list(GPT2_FILES)} (e.g. an HF gpt2 download).')
    raise errors.DataError(f'Unknown data.tokenizer {kind!r}; expected one of '
                           f'{TOKENIZERS}.')


def build_tokenizer(data_cfg: DataConfig,
                    workdir: Optional[os.PathLike] = None,
                    save: bool = True) -> Tokenizer:
    """Loads the run's tokenizer, or builds it from the train split once.

    Order: `workdir`/tokenizer.json if present (resumed run, evaluation; a training start has
    written its own there: `start_tokenizer`), else data.vocab_path, else trained on the train
    split of data.name. With `save` the result is saved into `workdir` so later commands reuse
    the same ids.
    """
    saved = storage.path(workdir) / TOKENIZER_FILE if workdir else None
    if saved is not None and saved.exists():
        tok = _checked_kind(load_tokenizer(saved), data_cfg, str(saved))
    else:
        tok = _from_config(data_cfg)[0]
    if save and saved is not None and not saved.exists():
        tok.save(saved.parent)
    return tok


def start_tokenizer(data_cfg: DataConfig, workdir: os.PathLike, source_run: Optional[str] = None) -> None:
    """Writes the tokenizer of a training start into its `workdir`, which holds no checkpoint:
    `source_run`'s (config.train.init_from: its parameters were trained with those ids, which a
    tokenizer built afresh could give otherwise at the same size), else the one config.data gives.

    A tokenizer.json already there was left by a start that saved nothing, made from the data and
    settings of then: it is replaced, with a warning, when it differs.
    """
    source = storage.path(source_run) / TOKENIZER_FILE if source_run else None
    if source is not None and source.exists():
        origin = f'{source_run}\'s, the run of config.train.init_from'
        tok = load_tokenizer(source)
        _checked_kind(tok, data_cfg, origin, f'set data.tokenizer={tok.kind!r}, whose ids its parameters were trained with')
        logging.info('Took the tokenizer of %s (config.train.init_from).', source_run)
    else:
        tok, origin = _from_config(data_cfg)
    saved = storage.path(workdir) / TOKENIZER_FILE
    if saved.exists():
        try:
            left = load_tokenizer(saved).fingerprint
        except errors.UserError:  # Damaged: nothing to keep.
            left = None
        if left == tok.fingerprint:
            return
        logging.warning('%s held the tokenizer of an earlier start that saved no checkpoint, another than '
                        'this start\'s (%s): replaced by this one.', saved, origin)
    tok.save(saved.parent)


def _from_config(data_cfg: DataConfig) -> tuple[Tokenizer, str]:
    """(the tokenizer config.data gives, where it came from): data.vocab_path's, a fixed
    vocabulary, or one trained on the train split."""
    kind = data_cfg.tokenizer
    if kind not in TOKENIZERS:
        raise errors.DataError(f'Unknown data.tokenizer {kind!r}; expected one of '
                               f'{TOKENIZERS}.')
    if data_cfg.vocab_path:
        tok, origin = load_tokenizer(data_cfg.vocab_path), f'data.vocab_path={data_cfg.vocab_path}'
    elif kind in FIXED_VOCABULARIES:
        tok, origin = train_tokenizer(data_cfg, ()), 'its fixed vocabulary'
    else:
        docs = prepared.run_documents(data_cfg, prepared.prepare(data_cfg), 'train')
        tok, origin = train_tokenizer(data_cfg, docs), 'trained on the train split'
    return _checked_kind(tok, data_cfg, origin), origin


def _checked_kind(tok: Tokenizer, data_cfg: DataConfig, origin: str,
                  fix: str = 'use a fresh workdir or the matching data.tokenizer') -> Tokenizer:
    if tok.kind != data_cfg.tokenizer:
        raise errors.DataError(f'data.tokenizer is {data_cfg.tokenizer!r} but {origin} holds a {tok.kind!r} '
                               f'tokenizer; {fix}.')
    return tok


def make_streams(data_cfg: DataConfig, split: str, tokenizer: Tokenizer, **kwargs) -> BatchedStreams:
    """The split's batches: LMStreams over a text corpus, or the generated sorting task
    (data.name='sorting', no corpus; its sequences follow from `seed`)."""
    seed = kwargs.pop('seed', 0)
    if data_cfg.name == 'sorting':
        kwargs.pop('cache_dir', None)
        return sorting.SortingStreams(data_cfg, builders.canonical_split(split), seed=seed, **kwargs)
    return pipeline.LMStreams(data_cfg, split, tokenizer, **kwargs)
