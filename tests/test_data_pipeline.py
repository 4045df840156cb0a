"""LMStreams layout, resets, exact coverage, process split and resumption."""

import dataclasses
import json
import os

import numpy as np
import pytest

from memjax.data import factory, pipeline, tokenizers
from memjax.data.config import DataConfig


def _write_docs(folder, doc_lengths, seed=0):
    """Explicit train/valid/test folders; doc i of a split has n_i words."""
    rng = np.random.default_rng(seed)
    words = [f'w{i}' for i in range(20)]
    docs = {}
    for split, lengths in doc_lengths.items():
        (folder / split).mkdir(parents=True)
        docs[split] = []
        for i, n in enumerate(lengths):
            # Word level with one line per doc: n - 1 words + <eos> = n ids.
            text = ' '.join(rng.choice(words, n - 1)) + '\n'
            (folder / split / f'{i:03d}.txt').write_text(text)
            docs[split].append(text)
    return docs


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp('corpus')
    lengths = {'train': [40, 7, 1, 23, 61, 15, 2, 33, 9, 18],
               'valid': [30, 12, 25, 8], 'test': [20, 20, 20]}
    docs = _write_docs(root / 'text', lengths)
    cfg = DataConfig(name='text', text_path=str(root / 'text'),
                     data_dir=str(root / 'tfds'), tokenizer='word')
    tok = factory.build_tokenizer(cfg, root / 'run')
    ids = {s: [tok.encode(d) for d in docs[s]] for s in docs}
    return cfg, tok, ids


def _collect(streams):
    batches = list(streams.iterator())
    assert len(batches) == streams.num_batches
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def test_word_vocab_comes_from_train_split(corpus):
    cfg, tok, ids = corpus
    train_ids = np.concatenate(ids['train'])
    assert (train_ids != tok.unk_id).all()
    assert tok.vocab_size == len(np.unique(train_ids)) + 1  # + unused <unk>.


@pytest.mark.parametrize('batch_size,tgt_len,segs', [(3, 5, 1), (2, 8, 3)])
def test_contiguous_streams_match_naive_slicing(corpus, batch_size, tgt_len,
                                                segs):
    cfg, tok, ids = corpus
    data = np.concatenate(ids['train'])
    streams = pipeline.LMStreams(cfg, 'train', tok, batch_size=batch_size,
                                 tgt_len=tgt_len, segments_per_batch=segs)
    out = _collect(streams)
    # Naive: stream b holds targets data[1 + off_b : 1 + off_b + len_b].
    m = len(data) - 1
    lens = [m // batch_size + (b < m % batch_size) for b in range(batch_size)]
    off = 0
    for b, n in enumerate(lens):
        row_in = out['inputs'][:, b].reshape(-1)
        row_tg = out['targets'][:, b].reshape(-1)
        row_mask = out['mask'][:, b].reshape(-1)
        assert row_mask[:n].all() and not row_mask[n:].any()
        np.testing.assert_array_equal(row_in[:n], data[off:off + n])
        np.testing.assert_array_equal(row_tg[:n], data[off + 1:off + 1 + n])
        # Targets are the next segment's inputs, across segment boundaries.
        np.testing.assert_array_equal(row_tg[:n - 1], row_in[1:n])
        off += n
    assert off == m
    assert streams.num_target_tokens == int(out['mask'].sum()) == m
    expected_reset = np.zeros_like(out['reset'])
    expected_reset[0] = True
    np.testing.assert_array_equal(out['reset'], expected_reset)


def test_document_streams_reset_and_pad_at_boundaries(corpus):
    cfg, tok, ids = corpus
    cfg = dataclasses.replace(cfg, reset_at_doc_boundary=True)
    t = 6
    streams = pipeline.LMStreams(cfg, 'train', tok, batch_size=3, tgt_len=t,
                                 segments_per_batch=2)
    out = _collect(streams)
    found = []
    for b in range(3):
        seg_docs = []
        for k in range(out['inputs'].shape[0]):
            if out['reset'][k, b]:
                seg_docs.append([])
            n = int(out['mask'][k, b].sum())
            # Real targets are a prefix of the segment; the rest is padding.
            assert out['mask'][k, b, :n].all() and n <= t
            if n:
                seg_docs[-1].append((out['inputs'][k, b, :n],
                                     out['targets'][k, b, :n]))
        for segs in seg_docs:
            if segs:
                inputs = np.concatenate([s[0] for s in segs])
                targets = np.concatenate([s[1] for s in segs])
                np.testing.assert_array_equal(inputs[1:], targets[:-1])
                found.append(np.concatenate([inputs[:1], targets]))
    scorable = [d for d in ids['train'] if len(d) >= 2]
    assert sorted(map(tuple, found)) == sorted(map(tuple, scorable))
    assert streams.num_target_tokens == sum(len(d) - 1 for d in scorable)
    # Streams are balanced: lengths differ by at most the largest document.
    real_segments = (out['mask'].sum(-1) > 0).sum(0)
    max_doc_segments = max(-(-(len(d) - 1) // t) for d in scorable)
    assert real_segments.max() - real_segments.min() <= max_doc_segments


def test_process_split_reassembles_the_global_batch(corpus):
    cfg, tok, _ = corpus
    kwargs = dict(batch_size=4, tgt_len=4, segments_per_batch=2)
    whole = _collect(pipeline.LMStreams(cfg, 'train', tok, **kwargs))
    parts = [_collect(pipeline.LMStreams(cfg, 'train', tok, process_index=p,
                                         process_count=2, **kwargs))
             for p in range(2)]
    for key in whole:
        np.testing.assert_array_equal(
            whole[key], np.concatenate([p[key] for p in parts], axis=1))


@pytest.mark.parametrize('repeat', [False, True])
def test_iterator_state_round_trip(corpus, repeat):
    cfg, tok, _ = corpus
    streams = pipeline.LMStreams(cfg, 'valid', tok, batch_size=2, tgt_len=5,
                                 segments_per_batch=2, repeat=repeat)
    steps = streams.num_batches + 2 if repeat else streams.num_batches - 2
    it = streams.iterator()
    for _ in range(steps):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(2)]
    resumed = streams.iterator()
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])


def test_repeat_cycles_in_the_same_order(corpus):
    cfg, tok, _ = corpus
    streams = pipeline.LMStreams(cfg, 'test', tok, batch_size=2, tgt_len=4,
                                 repeat=True)
    it = streams.iterator()
    first = [next(it) for _ in range(streams.num_batches)]
    second = [next(it) for _ in range(streams.num_batches)]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a['inputs'], b['inputs'])
    assert first[0]['reset'].all()


def test_token_ids_are_cached(corpus, monkeypatch):
    cfg, tok, ids = corpus
    pipeline.load_token_ids(cfg, 'test', tok)

    def fail(text):
        raise AssertionError('tokenised again')
    monkeypatch.setattr(tok, 'encode', fail)
    tokens, offsets = pipeline.load_token_ids(cfg, 'test', tok)
    np.testing.assert_array_equal(tokens, np.concatenate(ids['test']))
    np.testing.assert_array_equal(np.diff(offsets),
                                  [len(d) for d in ids['test']])


class _TooSmallVocab(tokenizers.ByteTokenizer):
    kind = 'byte_small'

    @property
    def vocab_size(self):
        return 100


@pytest.mark.parametrize('damage', ['truncate', 'garble'])
def test_damaged_token_cache_is_rebuilt(corpus, tmp_path, damage):
    cfg, tok, ids = corpus
    cache_dir = str(tmp_path)
    pipeline.load_token_ids(cfg, 'test', tok, cache_dir=cache_dir)
    (path,) = [os.path.join(cache_dir, n) for n in os.listdir(cache_dir) if 'tokens' in n]
    if damage == 'truncate':  # A copy or a full disk cut it short.
        with open(path, 'r+b') as f:
            f.truncate(os.path.getsize(path) - 7)
    else:  # Same size, ids out of range: not these tokens.
        np.save(path, np.full(np.load(path).shape, 10_000, np.int32))
    tokens, offsets = pipeline.load_token_ids(cfg, 'test', tok, cache_dir=cache_dir)
    np.testing.assert_array_equal(tokens, np.concatenate(ids['test']))
    np.testing.assert_array_equal(np.diff(offsets), [len(d) for d in ids['test']])


def test_out_of_range_ids_name_the_split_and_fix(corpus):
    cfg, _, _ = corpus
    with pytest.raises(ValueError, match=r"'test'.*vocab_size 100.*delete"):
        pipeline.LMStreams(cfg, 'test', _TooSmallVocab(), batch_size=1,
                           tgt_len=4)


def test_too_short_split_reports_numbers(corpus):
    cfg, tok, ids = corpus
    n = sum(len(d) for d in ids['test'])
    with pytest.raises(ValueError, match=f'has {n} tokens.*needs {4 * 20 + 1}'):
        pipeline.LMStreams(cfg, 'test', tok, batch_size=4, tgt_len=20)
    with pytest.raises(ValueError, match='3 documents.*batch_size=4'):
        pipeline.LMStreams(dataclasses.replace(cfg, reset_at_doc_boundary=True), 'test', tok,
                           batch_size=4, tgt_len=4)


def test_batch_not_divisible_by_processes(corpus):
    cfg, tok, _ = corpus
    with pytest.raises(ValueError, match='not divisible'):
        pipeline.LMStreams(cfg, 'test', tok, batch_size=3, tgt_len=4,
                           process_count=2)


def test_embedded_corpus_streams_smoke(tmp_path):
    cfg = DataConfig(name='embedded', data_dir=str(tmp_path / 'tfds'),
                     tokenizer='byte')
    tok = factory.build_tokenizer(cfg, tmp_path / 'run')
    streams = pipeline.LMStreams(cfg, 'validation', tok, batch_size=4,
                                 tgt_len=64, segments_per_batch=2)
    batch = next(streams.iterator())
    assert batch['inputs'].shape == (2, 4, 64)
    text = tok.decode(batch['inputs'][0, 0])
    assert text == tok.decode(streams.tokens[:64])
    assert streams.num_target_tokens == len(streams.tokens) - 1
