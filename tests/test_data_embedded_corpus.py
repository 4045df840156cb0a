"""The committed embedded corpus: size, split hygiene and manifest integrity."""

import hashlib

import pytest

from memjax.data import embedded_corpus


@pytest.fixture(scope='module')
def split_texts():
    return {split: embedded_corpus.read_split_text(split)
            for split in embedded_corpus.SPLITS}


def test_splits_match_manifest_hashes(split_texts):
    manifest = embedded_corpus.read_manifest()
    for split, text in split_texts.items():
        info = manifest['splits'][split]
        data = text.encode('utf-8')
        assert hashlib.sha256(data).hexdigest() == info['sha256']
        assert len(data) == info['num_bytes']
        docs = text.split(embedded_corpus.DOC_SEPARATOR)
        assert len(docs) == info['num_documents'] == len(info['files'])


def test_corpus_is_large_and_mostly_train(split_texts):
    sizes = {s: sum(len(doc.encode('utf-8')) for doc in
                    t.split(embedded_corpus.DOC_SEPARATOR))
             for s, t in split_texts.items()}
    total = sum(sizes.values())
    assert total >= 5_000_000
    for split in ('validation', 'test'):
        assert 0.02 * total < sizes[split] <= 0.05 * total


def test_splits_nonempty_and_disjoint_by_document(split_texts):
    manifest = embedded_corpus.read_manifest()
    seen_files, seen_docs = set(), set()
    for split in embedded_corpus.SPLITS:
        docs = embedded_corpus.load_documents(split)
        assert docs and all(doc.strip() for doc in docs)
        files = set(manifest['splits'][split]['files'])
        assert not files & seen_files
        doc_hashes = {hashlib.sha256(d.encode()).hexdigest() for d in docs}
        assert not doc_hashes & seen_docs
        seen_files |= files
        seen_docs |= doc_hashes


def test_assign_splits_depends_only_on_names_and_sizes():
    sizes = {f'doc{i}.txt': 100 + (i * 37) % 50 for i in range(200)}
    forward = embedded_corpus.assign_splits(sizes)
    backward = embedded_corpus.assign_splits(dict(reversed(sizes.items())))
    assert forward == backward
    total = sum(sizes.values())
    for split in ('validation', 'test'):
        held = sum(sizes[n] for n, s in forward.items() if s == split)
        assert 0 < held <= 0.05 * total


def test_assign_splits_fills_every_split_for_tiny_corpora():
    sizes = {'a.txt': 1000, 'b.txt': 10, 'c.txt': 20}
    assignment = embedded_corpus.assign_splits(sizes)
    assert sorted(assignment.values()) == ['test', 'train', 'validation']
    # The held-out splits get the small files, train keeps the big one.
    assert assignment['a.txt'] == 'train'


def test_unknown_split_is_rejected():
    with pytest.raises(ValueError, match='expected one of'):
        embedded_corpus.read_split_text('valid')
