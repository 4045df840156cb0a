"""The datasets a DataConfig names, prepared once in data.data_dir and read back as documents.

Preparing runs a builder (memjax/data/builders.py) over the raw files, unless its records are
there already; reading joins a split's records back into its documents, in corpus order, for
the tokenizer (memjax/data/pipeline.py).
"""

import contextlib
import hashlib
import io
import itertools
import logging
import time
from pathlib import Path
from typing import Iterator, List

from absl import logging as absl_logging
import tensorflow_datasets as tfds

from memjax import errors
from memjax.data import builders
from memjax.data.config import DataConfig, data_folder, manual_folder


def make_folder(folder: Path, field: str) -> None:
    """Creates `folder`, which config.data.<field> names, or says which field to change."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise errors.DataError(f'config.data.{field}: {folder} cannot be created ({error.strerror or error}): '
                               'name a folder you can write to.') from None


def _is_prepared(builder: builders.MemjaxTextBuilder) -> bool:
    """builder.is_prepared() without TFDS's warning that a version folder has no dataset_info.json
    (it says so even where the folder does not exist): missing data gets memjax's one-line message."""
    absl_logger = logging.getLogger('absl')
    level = absl_logger.level
    absl_logger.setLevel(logging.ERROR)
    try:
        return builder.is_prepared()
    finally:
        absl_logger.setLevel(level)


def prepare(data_cfg: DataConfig) -> builders.MemjaxTextBuilder:
    """Prepares data.name in data.data_dir unless done; returns the builder."""
    builder = builders.make_builder(data_cfg)
    if _is_prepared(builder):
        return builder
    download_config = None
    if builder.MANUAL_DOWNLOAD_INSTRUCTIONS:
        folder = manual_folder(data_cfg)
        builder.check_manual_files(folder)
        download_config = tfds.download.DownloadConfig(manual_dir=str(folder))
    tfds.disable_progress_bar()
    make_folder(data_folder(data_cfg), 'data_dir')
    absl_logging.info('Preparing %s in %s: its splits as array_record files, once (later runs read them).',
                      builder.info.full_name, builder.data_dir)
    start = time.time()
    # TFDS prints "Downloading and preparing dataset ..." to stdout: nothing is downloaded here, and
    # stdout is the commands' results (evaluate's JSON). The lines above and below say what happens.
    with contextlib.redirect_stdout(io.StringIO()):
        builder.download_and_prepare(download_config=download_config)
    absl_logging.info('Prepared %s in %.1f s (%s).', builder.info.full_name, time.time() - start,
                      ', '.join(f'{name} {info.num_examples:,} document{"s" * (info.num_examples != 1)}'
                                for name, info in builder.info.splits.items()))
    return builder


def dataset_fingerprint(builder: builders.MemjaxTextBuilder, split: str) -> str:
    """Identifies the prepared records of a split (keys token caches)."""
    info_file = Path(builder.data_dir) / 'dataset_info.json'
    digest = hashlib.sha256(info_file.read_bytes())
    digest.update(f'\0{builder.info.full_name}\0{split}'.encode())
    return digest.hexdigest()


def iter_documents(builder: builders.MemjaxTextBuilder, split: str) -> Iterator[str]:
    """Yields the documents of a prepared split, records joined back together.

    A generator, so a split larger than memory (PG-19) can be tokenised
    document by document.
    """
    split = builders.canonical_split(split)
    source = builder.as_data_source(split=split)
    if not len(source):
        raise errors.DataError(f'Split {split!r} of {builder.info.full_name} in '
                               f'{builder.data_dir} is empty; delete that folder and '
                               'prepare again from complete raw files.')
    parts = []
    for i in range(len(source)):
        record = source[i]
        if record['doc_start'] and parts:
            # surrogateescape: enwik8's byte split may cut a character.
            yield b''.join(parts).decode('utf-8', 'surrogateescape')
            parts = []
        parts.append(record['text'])
    yield b''.join(parts).decode('utf-8', 'surrogateescape')


def run_documents(data_cfg: DataConfig, builder: builders.MemjaxTextBuilder, split: str) -> Iterator[str]:
    """The documents a run reads from a prepared split: all of them, or the first
    data.train_documents of the train split (a subset is a choice of the run, not of the prepared
    data, so one preparation serves both)."""
    documents = iter_documents(builder, split)
    limit = train_documents(data_cfg, split)
    return itertools.islice(documents, limit) if limit else documents


def train_documents(data_cfg: DataConfig, split: str) -> int:
    """How many leading documents of `split` a run reads (0: all)."""
    return data_cfg.train_documents if builders.canonical_split(split) == 'train' else 0


def read_documents(builder: builders.MemjaxTextBuilder, split: str) -> List[str]:
    return list(iter_documents(builder, split))
