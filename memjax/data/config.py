"""config.data as a typed, frozen section: every field the data package reads, with its default.

`config_lib.base_config` builds config.data from these defaults, so a field added here can be
set from any config file and from the command line (--config.data.<field>=...); `config_lib.resolve`
builds the section from config.data.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from memjax.errors import failed

DATA_NAMES = ('embedded', 'wikitext103', 'enwik8', 'text8', 'pg19', 'text', 'sorting')
TOKENIZERS = ('byte', 'char', 'word', 'sentencepiece', 'gpt2_bpe', 'sorting')
# The names config.eval.split accepts ('valid' reads 'validation').
SPLITS = ('train', 'validation', 'valid', 'test')
DEFAULT_DATA_DIR = '~/tensorflow_datasets'


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What a run reads and how it is tokenised."""

    name: str = 'embedded'
    data_dir: str = DEFAULT_DATA_DIR  # '': the same.
    manual_dir: str = ''  # '': <data_dir>/downloads/manual.
    text_path: str = ''
    tokenizer: str = 'byte'
    # tokenizer='byte': bytes removed before encoding. The enwik8 configs drop line breaks (10), as
    # the original code's preprocessing does (prep_enwik8.py writes each as a line end, which its
    # vocabulary then strips): its published bits per byte neither predict nor count them.
    drop_bytes: tuple = ()
    vocab_path: str = ''
    sp_vocab_size: int = 8000
    word_min_freq: int = 1  # words seen fewer times in train become <unk>.
    word_max_size: int = 0  # 0: no cap on the word vocabulary (specials included).
    heldout_size: int = 5_000_000  # enwik8 / text8: bytes or characters of validation and of test.
    cache_dir: str = ''  # '': <data_dir>/memjax_token_cache.
    reset_at_doc_boundary: bool = False
    # > 0: only the first N documents of the train split, in the prepared order (PG-19: by book
    # id); the infinity-former fine-tunes on PG-19's first 2,000 books.
    train_documents: int = 0
    # A resumed run whose training data reads as other token ids than it was trained on stops;
    # True: it continues on the new data, with a warning.
    accept_changed_data: bool = False
    # name='sorting': symbols per sequence, and sequences per split (the paper's 8,000 / 800 / 800).
    sort_length: int = 4000
    sort_train_sequences: int = 8000
    sort_validation_sequences: int = 800
    sort_test_sequences: int = 800

    def __post_init__(self):
        # A saved config (JSON) gives a list.
        object.__setattr__(self, 'drop_bytes', tuple(self.drop_bytes))

    def problems(self) -> list[str]:
        """One line per unusable value, for `config_lib.validate_config` to report with the rest."""
        return failed(
            (self.name in DATA_NAMES, f'config.data.name={self.name!r} must be one of {DATA_NAMES}.'),
            (self.tokenizer in TOKENIZERS,
             f'config.data.tokenizer={self.tokenizer!r} must be one of {TOKENIZERS}.'),
            (self.name != 'text' or bool(self.text_path),
             "config.data.name='text' reads a text file of yours: give it as --config.data.text_path=FILE "
             '(a UTF-8 text file, or a folder of them).'),
            (self.train_documents >= 0,
             f'config.data.train_documents={self.train_documents} must be >= 0 (0: every document).'),
            ((self.tokenizer == 'sorting') == (self.name == 'sorting'),
             f"config.data.tokenizer={self.tokenizer!r} with config.data.name={self.name!r}: the 'sorting' tokenizer "
             "reads only the generated sorting task (name='sorting'), and that task only it."),
            (self.word_min_freq >= 1, f'config.data.word_min_freq={self.word_min_freq} must be >= 1.'),
            (not self.drop_bytes or (self.tokenizer == 'byte' and all(
                isinstance(b, int) and 0 <= b < 256 for b in self.drop_bytes)),
             f'config.data.drop_bytes={tuple(self.drop_bytes)} must be byte values in [0, 256), for '
             f"tokenizer='byte' only (config.data.tokenizer={self.tokenizer!r}: set config.data.drop_bytes=())."),
            (self.word_max_size == 0 or self.word_max_size >= 2,
             f'config.data.word_max_size={self.word_max_size} must be 0 (no cap) or >= 2 (<eos> and <unk> count).'),
            (self.name != 'sorting' or min(self.sort_length, self.sort_train_sequences, self.sort_validation_sequences,
                                           self.sort_test_sequences) >= 1,
             'config.data.sort_length and sort_{train,validation,test}_sequences must be >= 1.'),
            *((('://' not in getattr(self, field),
                f'config.data.{field}={getattr(self, field)}: the prepared data is read from local '
                'disk (array_record has no Cloud Storage reader without TensorFlow); copy it to each '
                'host (gcloud storage cp -r) or mount the bucket with Cloud Storage FUSE and give that '
                'path. The workdir, train.init_from and data.vocab_path may be gs:// URLs.')
               for field in ('data_dir', 'manual_dir', 'text_path', 'cache_dir'))))


# Functions, not DataConfig methods: they also read config.data as an ml_collections ConfigDict.
def data_folder(data_cfg: DataConfig) -> Path:
    """data.data_dir as a path: where datasets are prepared (and, by default, the raw files and
    token caches are)."""
    return Path(data_cfg.data_dir or DEFAULT_DATA_DIR).expanduser()


def manual_folder(data_cfg: DataConfig) -> Path:
    """Where the raw files of the datasets that are not shipped are read from."""
    return Path(data_cfg.manual_dir).expanduser() if data_cfg.manual_dir else data_folder(data_cfg) / 'downloads' / 'manual'
