"""TFDS builders on tiny generated raw files, read back with tfds.data_source."""

import dataclasses
import logging
import os
import tempfile
import zipfile

import pytest
import tensorflow_datasets as tfds

from memjax import config_lib
from memjax.data import builders, factory, pipeline, prepared, tokenizers
from memjax.data.config import DataConfig

REPO = os.path.join(os.path.dirname(__file__), '..')


def _records(name, data_dir, split):
    source = tfds.data_source(name, split=split, data_dir=str(data_dir))
    return [source[i] for i in range(len(source))]


def _docs_from_records(records):
    docs = []
    for r in records:
        if r['doc_start']:
            docs.append(b'')
        docs[-1] += r['text']
    return [d.decode() for d in docs]


def test_chunk_document_bounded_prefers_line_ends():
    data = b'aaaa\nbbbb\ncc cc dd\n' + b'x' * 12
    chunks = builders.chunk_document(data, max_bytes=8)
    assert b''.join(chunks) == data
    assert all(len(c) <= 8 for c in chunks)
    assert chunks[:3] == [b'aaaa\n', b'bbbb\n', b'cc cc ']


def _write_wikitext(folder):
    texts = {
        'train': ' \n = Alpha = \n \n alpha text \n = = Section = = \n more \n'
                 ' = Beta = \n beta text \n',
        'valid': ' = Gamma = \n gamma \n',
        'test': ' = Delta = \n delta \n = Eps = \n eps \n',
    }
    folder.mkdir()
    for split, text in texts.items():
        (folder / f'wiki.{split}.tokens').write_text(text)
    return texts


def test_wikitext103_one_document_per_article(tmp_path):
    texts = _write_wikitext(tmp_path / 'raw')
    cfg = DataConfig(name='wikitext103', data_dir=str(tmp_path / 'tfds'),
                     manual_dir=str(tmp_path / 'raw'))
    prepared.prepare(cfg)
    train = _docs_from_records(
        _records('memjax_wikitext103', tmp_path / 'tfds', 'train'))
    assert train == [' \n = Alpha = \n \n alpha text \n = = Section = = \n'
                     ' more \n', ' = Beta = \n beta text \n']
    assert ''.join(train) == texts['train']
    test = load_split_documents(cfg, 'test')
    assert test == [' = Delta = \n delta \n', ' = Eps = \n eps \n']
    assert load_split_documents(cfg, 'valid') == [texts['valid']]


def test_wikitext103_missing_file_names_it_and_the_fix(tmp_path):
    _write_wikitext(tmp_path / 'raw')
    (tmp_path / 'raw' / 'wiki.valid.tokens').unlink()
    cfg = DataConfig(name='wikitext103', data_dir=str(tmp_path / 'tfds'),
                     manual_dir=str(tmp_path / 'raw'))
    with pytest.raises(FileNotFoundError, match='wiki.valid.tokens.*manual_dir'):
        prepared.prepare(cfg)


def test_missing_manual_dir_is_one_message_without_tfds_warnings(tmp_path, caplog):
    cfg = DataConfig(name='pg19', data_dir=str(tmp_path / 'tfds'))
    with pytest.raises(FileNotFoundError, match='downloads/manual.*train/'):
        prepared.prepare(cfg)
    # TFDS's own "Variant folder ... has no dataset_info.json" would come before memjax's line.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_enwik8_byte_split_and_bounded_records(tmp_path, monkeypatch):
    monkeypatch.setattr(builders, 'RECORD_BYTES', 64)
    raw = ('<page>\n' + 'ab☃cd\n' * 60).encode()
    (tmp_path / 'raw').mkdir()
    with zipfile.ZipFile(tmp_path / 'raw' / 'enwik8.zip', 'w') as z:
        z.writestr('enwik8', raw)
    held = 50  # Cuts through a 3-byte character on purpose.
    cfg = DataConfig(name='enwik8', data_dir=str(tmp_path / 'tfds'),
                     manual_dir=str(tmp_path / 'raw'), heldout_size=held)
    prepared.prepare(cfg)
    n = len(raw)
    expected = {'train': raw[:n - 2 * held],
                'validation': raw[n - 2 * held:n - held], 'test': raw[n - held:]}
    for split, want in expected.items():
        docs = load_split_documents(cfg, split)
        assert len(docs) == 1
        assert docs[0].encode('utf-8', 'surrogateescape') == want
    records = _records('memjax_enwik8/heldout50', tmp_path / 'tfds', 'train')
    assert len(records) > 1 and all(len(r['text']) <= 64 for r in records)
    assert [r['doc_start'] for r in records] == [True] + [False] * (
        len(records) - 1)


def test_enwik8_as_its_configs_read_it_drops_the_line_breaks_as_the_original_preprocessing(tmp_path):
    """prep_enwik8.py (Transformer-XL's getdata.sh) writes each line-break byte as a line end, which the
    original vocabulary strips: every split is its bytes without them, and evaluation scores the rest."""
    raw = ('<page>\n  <title>A</title>\n' + 'ab\u2603cd\r\n' * 40).encode()
    (tmp_path / 'raw').mkdir()
    with zipfile.ZipFile(tmp_path / 'raw' / 'enwik8.zip', 'w') as z:
        z.writestr('enwik8', raw)
    config = config_lib.load_config_module(os.path.join(REPO, 'configs', 'transformer_xl_enwik8_base.py')).get_config()
    held = 100
    cfg = DataConfig(**{**config.data.to_dict(), 'data_dir': str(tmp_path / 'tfds'),
                        'manual_dir': str(tmp_path / 'raw'), 'heldout_size': held})
    assert cfg.drop_bytes == (10,) and not cfg.problems()
    tokenizer = factory.train_tokenizer(cfg, ())
    n = len(raw)
    for split, part in (('train', raw[:n - 2 * held]), ('validation', raw[n - 2 * held:n - held]),
                        ('test', raw[n - held:])):
        tokens, _ = pipeline.load_token_ids(cfg, split, tokenizer, cache_dir=tmp_path / 'cache')
        assert tokens.tolist() == [b for b in part if b != 10]
    again = factory.load_tokenizer(tokenizer.save(tmp_path / 'saved'))
    assert again.encode('a\nb').tolist() == [97, 98] and again.fingerprint == tokenizer.fingerprint
    assert tokenizers.ByteTokenizer().fingerprint != tokenizer.fingerprint  # Token caches kept apart.
    assert DataConfig(drop_bytes=(10,), tokenizer='char').problems() == [
        "config.data.drop_bytes=(10,) must be byte values in [0, 256), for tokenizer='byte' only "
        "(config.data.tokenizer='char': set config.data.drop_bytes=())."]


def test_enwik8_wrong_size_is_rejected(tmp_path):
    (tmp_path / 'raw').mkdir()
    (tmp_path / 'raw' / 'enwik8').write_bytes(b'x' * 1000)
    cfg = DataConfig(name='enwik8', data_dir=str(tmp_path / 'tfds'),
                     manual_dir=str(tmp_path / 'raw'))
    with pytest.raises(ValueError, match='standard enwik8 has 100,000,000'):
        prepared.prepare(cfg)


def test_text8_rejects_non_utf8(tmp_path):
    (tmp_path / 'raw').mkdir()
    (tmp_path / 'raw' / 'text8').write_bytes(b'abc def \xff' * 30)
    cfg = DataConfig(name='text8', data_dir=str(tmp_path / 'tfds'),
                     manual_dir=str(tmp_path / 'raw'), heldout_size=20)
    with pytest.raises(ValueError, match='text8 is not valid UTF-8'):
        prepared.prepare(cfg)


def _write_pg19(root):
    books = {'train': {'10': 'ten\n', '9': 'nine\n', '100': 'hundred\n'},
             'validation': {'5': 'five\n'}, 'test': {'7': 'seven\n'}}
    for split, items in books.items():
        (root / split).mkdir(parents=True)
        for book_id, text in items.items():
            (root / split / f'{book_id}.txt').write_text(text)


def test_pg19_books_in_numeric_order(tmp_path):
    _write_pg19(tmp_path / 'raw')
    cfg = DataConfig(name='pg19', data_dir=str(tmp_path / 'tfds'),
                     manual_dir=str(tmp_path / 'raw'))
    prepared.prepare(cfg)
    records = _records('memjax_pg19', tmp_path / 'tfds', 'train')
    assert _docs_from_records(records) == ['nine\n', 'ten\n', 'hundred\n']
    assert load_split_documents(cfg, 'test') == ['seven\n']


def test_train_documents_reads_the_first_books_by_id_and_caches_them_apart(tmp_path):
    # The infinity-former's PG-19 subset: the first N training books; other splits stay whole.
    _write_pg19(tmp_path / 'raw')
    cfg = DataConfig(name='pg19', data_dir=str(tmp_path / 'tfds'), manual_dir=str(tmp_path / 'raw'))
    tok = tokenizers.ByteTokenizer()
    whole = pipeline.load_token_ids(cfg, 'train', tok)
    first_two = pipeline.load_token_ids(dataclasses.replace(cfg, train_documents=2), 'train', tok)
    tokens, offsets = first_two
    assert [tok.decode(tokens[a:b]) for a, b in zip(offsets[:-1], offsets[1:])] == ['nine\n', 'ten\n']
    assert len(whole[1]) == 4  # The full split's cache was not overwritten by the subset's.
    assert pipeline.load_token_ids(cfg, 'train', tok)[0].tolist() == whole[0].tolist()
    valid = pipeline.load_token_ids(dataclasses.replace(cfg, train_documents=2), 'validation', tok)
    assert tok.decode(valid[0]) == 'five\n'


def test_pg19_undecodable_book_names_the_file(tmp_path):
    _write_pg19(tmp_path / 'raw')
    (tmp_path / 'raw' / 'test' / '7.txt').write_bytes(b'caf\xe9\n')
    cfg = DataConfig(name='pg19', data_dir=str(tmp_path / 'tfds'),
                     manual_dir=str(tmp_path / 'raw'))
    with pytest.raises(ValueError, match=r'7\.txt is not valid UTF-8.*iconv'):
        prepared.prepare(cfg)


def test_pg19_empty_split_folder(tmp_path):
    _write_pg19(tmp_path / 'raw')
    (tmp_path / 'raw' / 'validation' / '5.txt').unlink()
    cfg = DataConfig(name='pg19', data_dir=str(tmp_path / 'tfds'),
                     manual_dir=str(tmp_path / 'raw'))
    with pytest.raises(ValueError, match='validation has no .txt books'):
        prepared.prepare(cfg)


def test_text_folder_hash_splits_one_document_per_file(tmp_path):
    folder = tmp_path / 'texts'
    (folder / 'sub').mkdir(parents=True)
    contents = {f'sub/f{i:02d}.txt' if i % 2 else f'f{i:02d}.txt':
                f'file {i}\n' * (i + 1) for i in range(30)}
    for name, text in contents.items():
        (folder / name).write_text(text)
    (folder / '.hidden').write_text('ignored\n')
    cfg = DataConfig(name='text', text_path=str(folder),
                     data_dir=str(tmp_path / 'tfds'))
    splits = {s: load_split_documents(cfg, s) for s in builders.SPLITS}
    all_docs = [d for docs in splits.values() for d in docs]
    assert sorted(all_docs) == sorted(contents.values())
    assert all(splits.values())
    # Within a split, documents keep sorted path order.
    order = {text: name for name, text in contents.items()}
    for docs in splits.values():
        names = [order[d] for d in docs]
        assert names == sorted(names)
    builder = builders.make_builder(cfg)
    records = _records(f'memjax_text/{builder.builder_config.name}',
                       tmp_path / 'tfds', 'test')
    assert _docs_from_records(records) == splits['test']


def test_text_folder_explicit_splits_and_single_file(tmp_path):
    folder = tmp_path / 'given'
    folder.mkdir()
    for name in ('train.txt', 'valid.txt', 'test.txt'):
        (folder / name).write_text(f'{name} body\n')
    cfg = DataConfig(name='text', text_path=str(folder),
                     data_dir=str(tmp_path / 'tfds'))
    assert load_split_documents(cfg, 'validation') == [
        'valid.txt body\n']
    single = tmp_path / 'one.txt'
    single.write_text(''.join(f'line {i}\n' for i in range(100)))
    cfg1 = dataclasses.replace(cfg, text_path=str(single))
    parts = [load_split_documents(cfg1, s) for s in builders.SPLITS]
    assert ''.join(p[0] for p in parts) == single.read_text()
    text = single.read_text()
    starts = [i + 1 for i, c in enumerate(text) if c == '\n']
    # Validation begins at the first line start after 90 % of the bytes.
    cut = min(x for x in starts if x > int(0.9 * len(text)))
    assert parts[0][0] == text[:cut]


def test_text_incomplete_explicit_splits(tmp_path):
    folder = tmp_path / 'given'
    folder.mkdir()
    (folder / 'train.txt').write_text('a\n')
    (folder / 'test.txt').write_text('b\n')
    cfg = DataConfig(name='text', text_path=str(folder),
                     data_dir=str(tmp_path / 'tfds'))
    with pytest.raises(FileNotFoundError, match=r"not \['validation'\]"):
        prepared.prepare(cfg)


def test_unknown_dataset_and_split():
    with pytest.raises(ValueError, match='data.name'):
        builders.make_builder(DataConfig(name='wikitext2'))
    with pytest.raises(ValueError, match='Unknown split'):
        builders.canonical_split('training')


def test_empty_split_file_is_rejected(tmp_path):
    folder = tmp_path / 'given'
    folder.mkdir()
    for name, text in (('train.txt', 'a b\n'), ('valid.txt', ''),
                       ('test.txt', 'c\n')):
        (folder / name).write_text(text)
    cfg = DataConfig(name='text', text_path=str(folder),
                     data_dir=str(tmp_path / 'tfds'))
    with pytest.raises(ValueError, match="'validation' of memjax_text is empty"):
        prepared.prepare(cfg)


def load_split_documents(data_cfg, split):
    """Prepares data.name if needed and returns the split's documents."""
    return prepared.read_documents(prepared.prepare(data_cfg), split)


def test_preparing_a_dataset_leaves_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
    """TFDS's lookup of a not-yet-prepared dataset in its GCS bucket made a temporary folder it never
    removed: one per preparation (memjax's builders skip that lookup)."""
    scratch = tmp_path / 'scratch'
    scratch.mkdir()
    monkeypatch.setattr(tempfile, 'tempdir', str(scratch))
    (tmp_path / 'train.txt').write_text(''.join(f'line {i} of the text\n' for i in range(200)))
    cfg = DataConfig(name='text', text_path=str(tmp_path / 'train.txt'), data_dir=str(tmp_path / 'tfds'))
    assert load_split_documents(cfg, 'train')
    assert sorted(os.listdir(scratch)) == []
