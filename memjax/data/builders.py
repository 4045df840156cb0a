"""TFDS builders (array_record, no TensorFlow) for memjax's text corpora: how each corpus's raw
files become records, and the builder a DataConfig names (`make_builder`). Preparing them in
data.data_dir and reading their documents back: memjax/data/prepared.py.

Every dataset has the same features: `text` (UTF-8 bytes of one record) and
`doc_start` (True on the first record of a document). Records keep corpus
order (shuffling disabled) and are at most RECORD_BYTES long, so huge single
documents (enwik8, a book) stay readable record by record while their
boundaries survive for memory resets.

Raw files are never downloaded: the manual builders read them from a local
folder (data.manual_dir, default <data_dir>/downloads/manual).
"""

import abc
import dataclasses
import hashlib
import inspect
import os
import re
import zipfile
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.core import utils as tfds_utils

from memjax import errors
from memjax.data import embedded_corpus
from memjax.data.config import DataConfig, data_folder
from memjax.runtime import logs

SPLITS = embedded_corpus.SPLITS
SPLIT_ALIASES = {'valid': 'validation', 'val': 'validation', 'dev': 'validation'}
RECORD_BYTES = 1 << 20
# enwik8 / text8: the standard split is 90M / 5M / 5M of the 100M file.
STANDARD_HELDOUT = 5_000_000
STANDARD_TOTAL = 100_000_000

Documents = Dict[str, Iterable[bytes]]


def canonical_split(split: str) -> str:
    split = SPLIT_ALIASES.get(split, split)
    if split not in SPLITS:
        raise errors.DataError(f'Unknown split {split!r}; expected one of {SPLITS} '
                               f'(or {sorted(SPLIT_ALIASES)}).')
    return split


def check_utf8(data: bytes, path: os.PathLike) -> None:
    """Raises a clear error for text that is not UTF-8."""
    try:
        data.decode('utf-8')
    except UnicodeDecodeError as e:
        raise errors.DataError(
            f'{path} is not valid UTF-8 (byte offset {e.start}); convert it, '
            f'e.g. `iconv -f latin1 -t utf-8 {path} > fixed.txt`.') from None


def chunk_document(data: bytes,
                   max_bytes: Optional[int] = None) -> List[bytes]:
    """Cuts a document into records of at most `max_bytes` (RECORD_BYTES).

    Cuts go after the last newline (else space) of each window, so records
    rarely split a line or word; joining the records restores `data`.
    """
    max_bytes = max_bytes or RECORD_BYTES
    chunks, start = [], 0
    while len(data) - start > max_bytes:
        end = start + max_bytes
        cut = data.rfind(b'\n', start, end) + 1 or data.rfind(b' ', start,
                                                              end) + 1
        cut = cut if cut > start else end
        chunks.append(data[start:cut])
        start = cut
    if start < len(data):
        chunks.append(data[start:])
    return chunks


def _missing(path: Path, fix: str, folder: bool = False) -> errors.UserError:
    """The error for a raw file (or, with `folder`, a folder) that is not where memjax reads it."""
    if path.exists():
        return errors.DataError(f'{path} is {"not a folder" if folder else "a folder, not a file"}. {fix}')
    return errors.MissingFileError(f'{path} not found. {fix}')


def _read_maybe_zipped(folder: Path, name: str, fix: str) -> bytes:
    """Reads `folder/name`, or member `name` of `folder/name.zip`."""
    if (folder / name).is_file():
        return (folder / name).read_bytes()
    if (folder / f'{name}.zip').is_file():
        with zipfile.ZipFile(folder / f'{name}.zip') as archive:
            if name not in archive.namelist():
                raise errors.DataError(f'{folder / name}.zip has no member {name!r}; '
                                       f'{fix}')
            return archive.read(name)
    raise _missing(folder / name, fix)


def _sorted_files(folder: Path) -> List[Path]:
    """Regular, non-hidden files under `folder` in sorted relative order."""
    files = [p for p in folder.rglob('*') if p.is_file() and not any(
        part.startswith('.') for part in p.relative_to(folder).parts)]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def _read_utf8(path: Path) -> bytes:
    data = path.read_bytes()
    check_utf8(data, path)
    return data


class _LocalDatasetInfo(tfds.core.DatasetInfo):
    """TFDS's DatasetInfo without the lookup in TFDS's own GCS bucket that a builder makes while
    its dataset is not prepared: memjax's datasets are never there, and the lookup first makes a
    temporary folder that it never removes (an empty /tmp/tmp*tfds per preparation)."""

    def initialize_from_bucket(self) -> None:
        pass


class MemjaxTextBuilder(tfds.core.GeneratorBasedBuilder,
                         skip_registration=True):
    """Shared layout; subclasses only say where each split's documents are."""

    VERSION = tfds.core.Version('1.0.0')
    RELEASE_NOTES = {'1.0.0': 'Initial release.'}

    @tfds_utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # TFDS's own lookup imports importlib_resources, which it does not
        # require at install time; the defining file is all it needs.
        return epath.Path(inspect.getfile(cls))

    def _info(self) -> tfds.core.DatasetInfo:
        return _LocalDatasetInfo(
            builder=self,
            description=self.__doc__,
            features=tfds.features.FeaturesDict({
                'text': tfds.features.Text(),
                'doc_start': tfds.features.Scalar(dtype=np.bool_),
            }),
            disable_shuffling=True,
        )

    @abc.abstractmethod
    def _documents(self, manual_dir: Optional[Path]) -> Documents:
        """split -> iterable of documents as bytes, in corpus order."""

    @classmethod
    def locate(cls, manual_dir: Path) -> Any:
        """The raw files in manual_dir of a builder that reads some; raises the missing one's
        DataError with the fix."""
        del manual_dir

    def check_manual_files(self, folder: Path) -> None:
        """Fails before TFDS starts, with the file and the fix."""
        if not folder.is_dir():
            raise _missing(folder, folder=True, fix=(
                f'{self.name} reads raw files from data.manual_dir (default '
                f'<data_dir>/downloads/manual). '
                f'{self.MANUAL_DOWNLOAD_INSTRUCTIONS}'))
        self.locate(folder)

    def _split_generators(self, dl_manager):
        manual_dir = (Path(dl_manager.manual_dir)
                      if self.MANUAL_DOWNLOAD_INSTRUCTIONS else None)
        docs = self._documents(manual_dir)
        return {split: self._generate_examples(split, docs[split])
                for split in SPLITS}

    def _generate_examples(self, split: str, documents: Iterable[bytes]
                           ) -> Iterator[Tuple[int, Dict[str, Any]]]:
        key = 0
        for doc in documents:
            for i, chunk in enumerate(chunk_document(doc)):
                yield key, {'text': chunk, 'doc_start': i == 0}
                key += 1
        if key == 0:
            raise errors.DataError(
                f'Split {split!r} of {self.name} is empty; check that its raw '
                f'files hold text ({self.MANUAL_DOWNLOAD_INSTRUCTIONS or ""}).')


class MemjaxEmbedded(MemjaxTextBuilder):
    """Python stdlib sources shipped with memjax; one document per file."""

    def _documents(self, manual_dir):
        return {split: (doc.encode('utf-8') for doc in
                        embedded_corpus.load_documents(split))
                for split in SPLITS}


_WIKITEXT_FILES = {'train': 'wiki.train.tokens',
                   'validation': 'wiki.valid.tokens',
                   'test': 'wiki.test.tokens'}
# A top-level heading ' = Title = ' (not ' = = Section = = ') opens an article.
_WIKITEXT_TITLE = re.compile(rb' = (?!=).*(?<!=) = ')


def wikitext_articles(path: Path) -> Iterator[bytes]:
    """The articles of a WikiText .tokens file (lines before the first title
    belong to the first article)."""
    article = []
    with open(path, 'rb') as f:
        for line_no, line in enumerate(f, 1):
            try:
                line.decode('utf-8')
            except UnicodeDecodeError:
                raise errors.DataError(f'{path}:{line_no} is not valid UTF-8; use the '
                                       'original WikiText-103 files.') from None
            if (_WIKITEXT_TITLE.fullmatch(line.rstrip(b'\r\n'))
                    and any(x.strip() for x in article)):
                yield b''.join(article)
                article = []
            article.append(line)
    if article:
        yield b''.join(article)


class MemjaxWikitext103(MemjaxTextBuilder):
    """WikiText-103 (word level); one document per Wikipedia article."""

    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        'Put wiki.train.tokens, wiki.valid.tokens and wiki.test.tokens (from '
        'wikitext-103-v1.zip) directly in data.manual_dir.')

    @classmethod
    def locate(cls, manual_dir: Path) -> Dict[str, Path]:
        paths = {s: manual_dir / f for s, f in _WIKITEXT_FILES.items()}
        for path in paths.values():
            if not path.is_file():
                raise _missing(path, cls.MANUAL_DOWNLOAD_INSTRUCTIONS)
        return paths

    def _documents(self, manual_dir):
        return {s: wikitext_articles(p)
                for s, p in self.locate(manual_dir).items()}


@dataclasses.dataclass(eq=False)
class HeldoutConfig(tfds.core.BuilderConfig):
    """Validation and test are the last 2 x heldout_size units of the file."""
    heldout_size: int = STANDARD_HELDOUT


def _heldout_configs() -> List[HeldoutConfig]:
    return [HeldoutConfig(name='standard', description='90M / 5M / 5M.')]


def _single_file_instructions(name: str) -> str:
    return f'Put {name} (or {name}.zip) in data.manual_dir.'


class _SingleFileBuilder(MemjaxTextBuilder, skip_registration=True):
    """A 100M-unit file split 90M / 5M / 5M (enwik8 bytes, text8 chars)."""

    BUILDER_CONFIGS = _heldout_configs()
    FILE_NAME = ''

    @classmethod
    def locate(cls, manual_dir: Path) -> Path:
        name = cls.FILE_NAME
        if not ((manual_dir / name).is_file() or (manual_dir / f'{name}.zip').is_file()):
            raise _missing(manual_dir / name, cls.MANUAL_DOWNLOAD_INSTRUCTIONS)
        return manual_dir / name

    def _documents(self, manual_dir):
        data = _read_maybe_zipped(manual_dir, self.FILE_NAME,
                                  self.MANUAL_DOWNLOAD_INSTRUCTIONS)
        held = self.builder_config.heldout_size
        if held == STANDARD_HELDOUT and len(data) != STANDARD_TOTAL:
            raise errors.DataError(
                f'{manual_dir / self.FILE_NAME} has {len(data):,} bytes; the '
                f'standard {self.FILE_NAME} has {STANDARD_TOTAL:,}. Replace it '
                'with an intact copy.')
        if len(data) < 3 * held:
            raise errors.DataError(f'{manual_dir / self.FILE_NAME} has {len(data):,} '
                                   f'bytes, fewer than 3 x heldout_size ({held:,}).')
        n = len(data)
        return {'train': [data[:n - 2 * held]],
                'validation': [data[n - 2 * held:n - held]],
                'test': [data[n - held:]]}


class MemjaxEnwik8(_SingleFileBuilder):
    """enwik8: first 100M bytes of English Wikipedia XML, byte level.

    The byte split may cut a UTF-8 character; readers decode with
    surrogateescape so the byte tokenizer sees the exact original bytes.
    """

    FILE_NAME = 'enwik8'
    MANUAL_DOWNLOAD_INSTRUCTIONS = _single_file_instructions('enwik8')


class MemjaxText8(_SingleFileBuilder):
    """text8: 100M characters of cleaned Wikipedia (a-z and space)."""

    FILE_NAME = 'text8'
    MANUAL_DOWNLOAD_INSTRUCTIONS = _single_file_instructions('text8')

    def _documents(self, manual_dir):
        docs = super()._documents(manual_dir)
        for split_docs in docs.values():
            check_utf8(split_docs[0], manual_dir / self.FILE_NAME)
        return docs


def _book_key(path: Path) -> Tuple[int, str]:
    # Numeric book ids sort numerically; other names after them by name.
    return (int(path.stem), '') if path.stem.isdigit() else (1 << 62, path.name)


class MemjaxPg19(MemjaxTextBuilder):
    """PG-19 books from a local copy; one document per book."""

    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        'Put the PG-19 folders train/, validation/ and test/ (each holding '
        '<book_id>.txt files) in data.manual_dir.')

    @classmethod
    def locate(cls, manual_dir: Path) -> Dict[str, List[Path]]:
        books = {}
        for split in SPLITS:
            folder = manual_dir / split
            if not folder.is_dir():
                raise _missing(folder, cls.MANUAL_DOWNLOAD_INSTRUCTIONS, folder=True)
            books[split] = sorted(folder.glob('*.txt'), key=_book_key)
            if not books[split]:
                raise errors.DataError(f'{folder} has no .txt books. '
                                       f'{cls.MANUAL_DOWNLOAD_INSTRUCTIONS}')
        return books

    def _documents(self, manual_dir):
        return {s: (_read_utf8(p) for p in paths)
                for s, paths in self.locate(manual_dir).items()}


@dataclasses.dataclass(eq=False)
class TextConfig(tfds.core.BuilderConfig):
    text_path: str = ''


_EXPLICIT_SPLIT_NAMES = {'train': ('train',),
                         'validation': ('validation', 'valid'),
                         'test': ('test',)}


def explicit_text_splits(folder: Path) -> Optional[Dict[str, List[Path]]]:
    """User-given splits: train/valid(ation)/test files or folders, or None."""
    found = {}
    for split, names in _EXPLICIT_SPLIT_NAMES.items():
        for name in names:
            for candidate in (folder / name, folder / f'{name}.txt'):
                if candidate.exists():
                    found[split] = ([candidate] if candidate.is_file()
                                    else _sorted_files(candidate))
    if not found:
        return None
    missing = [s for s in SPLITS if not found.get(s)]
    if missing:
        raise _missing(folder / missing[0], (
            f'{folder} defines some splits explicitly ({sorted(found)}) but '
            f'not {missing}; add train, valid and test (files or folders).'))
    return found


def _single_file_splits(path: Path) -> Documents:
    """One file: 90 / 5 / 5 % of its bytes, cut at line starts."""
    data = _read_utf8(path)
    cuts = []
    for fraction in (0.90, 0.95):
        cut = data.find(b'\n', int(fraction * len(data))) + 1
        cuts.append(cut if cut > 0 else len(data))
    docs = {'train': data[:cuts[0]], 'validation': data[cuts[0]:cuts[1]],
            'test': data[cuts[1]:]}
    for split, doc in docs.items():
        if not doc.strip():
            raise errors.DataError(
                f'{path}: the {split} part (cut at line starts, 90/5/5 %) is '
                'empty; give a longer file with more lines, or a folder with '
                'train.txt, valid.txt and test.txt.')
    return {split: [doc] for split, doc in docs.items()}


class MemjaxText(MemjaxTextBuilder):
    """Any local text: a file, or a folder with one document per file.

    Splits: a folder with train / valid(ation) / test entries (files or
    folders, optional .txt suffix) uses them; any other folder gets a
    deterministic 90/5/5 %-by-size assignment by a stable hash of each file's
    relative path; a single file is cut 90/5/5 % at line starts.
    """

    BUILDER_CONFIGS = [TextConfig(name='default')]

    def _documents(self, manual_dir):
        path = Path(self.builder_config.text_path)
        if path.is_file():
            return _single_file_splits(path)
        if not path.is_dir():
            raise _missing(path, 'Set data.text_path to a UTF-8 text file or '
                           'a folder of them.')
        explicit = explicit_text_splits(path)
        if explicit is not None:
            return {s: (_read_utf8(p) for p in paths)
                    for s, paths in explicit.items()}
        files = _sorted_files(path)
        if len(files) < 3:
            raise errors.DataError(
                f'{path} holds {len(files)} files; a folder needs at least 3 '
                'documents for train/validation/test, or explicit train.txt, '
                'valid.txt and test.txt.')
        names = {p.relative_to(path).as_posix(): p for p in files}
        assignment = embedded_corpus.assign_splits(
            {name: p.stat().st_size for name, p in names.items()})
        members = {split: [p for n, p in names.items()
                           if assignment[n] == split] for split in SPLITS}
        return {s: (_read_utf8(p) for p in paths)
                for s, paths in members.items()}


_BUILDERS = {
    'embedded': MemjaxEmbedded,
    'wikitext103': MemjaxWikitext103,
    'enwik8': MemjaxEnwik8,
    'text8': MemjaxText8,
    'pg19': MemjaxPg19,
    'text': MemjaxText,
}


def _text_config(text_path: str) -> TextConfig:
    """A config named after the path and its files' sizes and mtimes, so
    changed files get prepared afresh instead of reusing stale records."""
    if not text_path:
        raise errors.DataError("data.text_path must name a file or folder for "
                               "data.name='text'.")
    path = Path(text_path).expanduser().resolve()
    files = [path] if path.is_file() else (
        _sorted_files(path) if path.is_dir() else [])
    stamp = hashlib.sha256(str(path).encode())
    for p in files:
        st = p.stat()
        stamp.update(f'{p}\0{st.st_size}\0{st.st_mtime_ns}\n'.encode())
    return TextConfig(name='p' + stamp.hexdigest()[:16], text_path=str(path),
                      description=f'Text from {path}.')


def make_builder(data_cfg: DataConfig) -> MemjaxTextBuilder:
    """The TFDS builder for data.name, configured from data_cfg."""
    name = data_cfg.name
    if name not in _BUILDERS:
        raise errors.DataError(f'Unknown data.name {name!r}; expected one of '
                               f'{sorted(_BUILDERS)}.')
    cls = _BUILDERS[name]
    config = None
    if name == 'text':
        config = _text_config(data_cfg.text_path)
    elif issubclass(cls, _SingleFileBuilder):
        held = data_cfg.heldout_size
        if held != STANDARD_HELDOUT:
            config = HeldoutConfig(name=f'heldout{held}', heldout_size=held)
    with logs.dropped('Using custom data configuration'):  # A text file's config is memjax's own.
        return cls(data_dir=str(data_folder(data_cfg)), config=config, file_format='array_record')
