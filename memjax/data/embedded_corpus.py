"""A small real-text corpus shipped with the package, so training runs offline.

The text is Python's own standard library source plus its pydoc topic help,
taken once from one Python installation and committed as xz-compressed split
files. Reading the committed snapshot (rather than the running interpreter's
stdlib) keeps the corpus byte-identical on every machine and Python version.

Each split file holds the split's documents (one per source file) joined by
DOC_SEPARATOR, a control character that never occurs in the sources.

Rebuild the snapshot with:
  python -m memjax.data.embedded_corpus --rebuild
"""

import argparse
import hashlib
import json
import lzma
import os
import sys
import sysconfig
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from memjax import errors

SPLITS = ('train', 'validation', 'test')
CORPUS_DIR = Path(__file__).resolve().parent / 'corpus'
MANIFEST_NAME = 'manifest.json'
DOC_SEPARATOR = '\x1e'  # ASCII record separator.

# Held-out fractions by size; the rest is train.
HELDOUT_FRACTIONS = {'validation': 0.05, 'test': 0.05}

# Stdlib folders left out: tests and GUI/demo code would dominate the corpus
# with repetitive fixtures, and site-packages is not part of the stdlib.
_EXCLUDED_DIRS = frozenset({
    '__pycache__', 'site-packages', 'test', 'tests', 'idlelib', 'tkinter',
    'turtledemo', 'lib2to3', 'ensurepip',
})


def split_file(split: str, corpus_dir: Path = CORPUS_DIR) -> Path:
    return corpus_dir / f'{split}.txt.xz'


def stable_hash(key: str) -> str:
    """Hash used to order files; independent of Python's salted hash()."""
    return hashlib.sha256(key.encode('utf-8')).hexdigest()


def assign_splits(sizes: Dict[str, int]) -> Dict[str, str]:
    """Deterministically assigns named documents to train/validation/test.

    Documents are visited in stable-hash order of their names; each goes to
    the least filled held-out split it fits in (within the split's size
    fraction), otherwise to train.
    A held-out split left empty (tiny corpora) takes the smallest train
    document. The result depends only on the names and sizes.

    Args:
      sizes: document name -> size (any unit, e.g. bytes).

    Returns:
      document name -> split name.
    """
    total = sum(sizes.values())
    filled = {split: 0 for split in HELDOUT_FRACTIONS}
    assignment = {}
    order = sorted(sizes, key=stable_hash)
    for name in order:
        fits = [split for split, fraction in HELDOUT_FRACTIONS.items()
                if filled[split] + sizes[name] <= fraction * total]
        # The emptiest held-out split first, so small corpora fill all splits.
        split = min(fits, key=lambda s: filled[s], default='train')
        assignment[name] = split
        if split != 'train':
            filled[split] += sizes[name]
    for split in HELDOUT_FRACTIONS:
        train = [name for name in order if assignment[name] == 'train']
        if filled[split] == 0 and len(train) > 1:
            smallest = min(train, key=lambda name: sizes[name])
            assignment[smallest] = split
            filled[split] = sizes[smallest]
    return assignment


def _stdlib_sources(stdlib_dir: Path) -> List[Path]:
    """The stdlib .py files in sorted relative-path order (plus pydoc topics)."""
    paths = []
    for root, dirs, files in os.walk(stdlib_dir):
        dirs[:] = sorted(d for d in dirs if d not in _EXCLUDED_DIRS
                         and not d.startswith('config-'))
        paths.extend(Path(root) / f for f in files if f.endswith('.py'))
    return sorted(paths, key=lambda p: p.relative_to(stdlib_dir).as_posix())


def collect_documents(
        stdlib_dir: Optional[Path] = None) -> Dict[str, List[Tuple[str, str]]]:
    """Reads the running interpreter's stdlib into split -> [(path, text)]."""
    stdlib_dir = Path(stdlib_dir or sysconfig.get_paths()['stdlib'])
    texts, seen = {}, set()
    for path in _stdlib_sources(stdlib_dir):
        try:
            text = path.read_text(encoding='utf-8')
        except UnicodeDecodeError:
            continue  # A few legacy-encoded files; not worth a special case.
        # Identical files (e.g. tiny __init__.py) would leak across splits.
        if DOC_SEPARATOR in text or not text.strip() or text in seen:
            continue
        seen.add(text)
        texts[path.relative_to(stdlib_dir).as_posix()] = text
    sizes = {name: len(text.encode('utf-8')) for name, text in texts.items()}
    assignment = assign_splits(sizes)
    documents = {split: [] for split in SPLITS}
    for name in sorted(texts):  # Corpus order within a split: sorted paths.
        documents[assignment[name]].append((name, texts[name]))
    return documents


def rebuild(corpus_dir: Path = CORPUS_DIR,
            stdlib_dir: Optional[Path] = None) -> dict:
    """Writes the split files and the manifest; returns the manifest."""
    corpus_dir.mkdir(parents=True, exist_ok=True)
    documents = collect_documents(stdlib_dir)
    manifest = {
        'source': 'Python standard library sources (.py) and pydoc topics',
        'python_version': sys.version.split()[0],
        'document_separator': hex(ord(DOC_SEPARATOR)),
        'splits': {},
    }
    for split in SPLITS:
        raw = DOC_SEPARATOR.join(text for _, text in documents[split])
        raw_bytes = raw.encode('utf-8')
        # Fixed preset and no timestamps: the same input gives the same file.
        split_file(split, corpus_dir).write_bytes(
            lzma.compress(raw_bytes, preset=9 | lzma.PRESET_EXTREME))
        manifest['splits'][split] = {
            'num_documents': len(documents[split]),
            'num_bytes': len(raw_bytes),
            'num_chars': len(raw),
            'sha256': hashlib.sha256(raw_bytes).hexdigest(),
            'files': [name for name, _ in documents[split]],
        }
    (corpus_dir / MANIFEST_NAME).write_text(
        json.dumps(manifest, indent=1, sort_keys=True) + '\n')
    return manifest


def read_manifest(corpus_dir: Path = CORPUS_DIR) -> dict:
    return json.loads((corpus_dir / MANIFEST_NAME).read_text())


def read_split_text(split: str, corpus_dir: Path = CORPUS_DIR) -> str:
    """The raw text of a split (documents joined by DOC_SEPARATOR)."""
    if split not in SPLITS:
        raise errors.DataError(f'Unknown embedded corpus split {split!r}; '
                               f'expected one of {SPLITS}.')
    path = split_file(split, corpus_dir)
    if not path.exists():
        raise errors.MissingFileError(
            f'Embedded corpus file {path} is missing; reinstall memjax or run '
            '`python -m memjax.data.embedded_corpus --rebuild`.')
    return lzma.decompress(path.read_bytes()).decode('utf-8')


def load_documents(split: str, corpus_dir: Path = CORPUS_DIR) -> List[str]:
    """The documents (one per stdlib source file) of a split, in order."""
    return read_split_text(split, corpus_dir).split(DOC_SEPARATOR)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--rebuild', action='store_true',
                        help='Regenerate the snapshot from this Python stdlib.')
    parser.add_argument('--corpus_dir', type=Path, default=CORPUS_DIR)
    args = parser.parse_args(argv)
    if args.rebuild:
        manifest = rebuild(args.corpus_dir)
    else:
        manifest = read_manifest(args.corpus_dir)
    for split, info in manifest['splits'].items():
        print(f"{split}: {info['num_documents']} documents, "
              f"{info['num_bytes']:,} bytes, sha256 {info['sha256'][:16]}")


if __name__ == '__main__':
    main()
