"""Tokenizer round trips, vocabulary rules and persistence."""

import collections
import dataclasses
import json
import random

import numpy as np
import pytest

from memjax import errors
from memjax.data import factory, tokenizers
from memjax.data.config import DataConfig


def _random_corpus(seed, num_lines, words):
    rng = random.Random(seed)
    return ''.join(' '.join(rng.choice(words) for _ in range(rng.randint(0, 9)))
                   + '\n' for _ in range(num_lines))


def test_byte_round_trip_including_invalid_utf8():
    tok = tokenizers.ByteTokenizer()
    raw = 'héllo ☃\n'.encode('utf-8') + b'\xe2\x98'  # A cut-off character.
    text = raw.decode('utf-8', 'surrogateescape')
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert ids.tolist() == list(raw)
    assert tok.decode(ids) == text
    assert tok.vocab_size == 256 and tok.unit == 'byte'


def test_char_vocab_from_train_only_and_unknown_chars():
    tok = tokenizers.CharTokenizer.from_documents(['abca', 'b c'])
    assert tok.vocab_size == 5  # ' ', a, b, c + unknown.
    assert tok.encode('cab ').tolist() == [3, 1, 2, 0]
    ids = tok.encode('ab?z')
    assert ids.tolist() == [1, 2, 4, 4]
    assert tok.decode(ids) == 'ab\ufffd\ufffd'
    assert tok.decode(tok.encode('a c b')) == 'a c b'
    assert tok.unit == 'char'


def reference_word_vocab(lines, min_freq=1):
    """The original code's WikiText-103 vocabulary (kimiyoung/transformer-xl utils/vocabulary.py),
    written out: '<eos>' first, then Counter.most_common() of the stripped, split lines, a literal
    '<unk>' among them, down to min_freq."""
    counter = collections.Counter()
    for line in lines:
        counter.update(line.strip().split())
    return ['<eos>'] + [sym for sym, cnt in counter.most_common() if cnt >= min_freq]


def test_word_vocab_is_the_original_codes_frequency_order_with_ties_in_order_of_appearance():
    train = ['b a c\nz <unk> y\n', 'b d <unk> a\nd']
    tok = tokenizers.WordTokenizer.from_documents(train)
    # Counts: b 2, a 2, <unk> 2, d 2, then c, z, y once each: ties as first seen.
    assert tok.tokens == reference_word_vocab(''.join(train).splitlines()) == [
        '<eos>', 'b', 'a', '<unk>', 'd', 'c', 'z', 'y']
    ids = tok.encode('a  zz b\n\nc')
    assert ids.tolist() == [2, 3, 1, 0, 0, 5, 0]
    assert tok.decode(ids) == 'a <unk> b\n\nc\n'
    # A text without a literal <unk> gets one as id 1, for the words it never saw.
    assert tokenizers.WordTokenizer.from_documents(['y x x\n']).tokens == ['<eos>', '<unk>', 'x', 'y']


def test_word_min_freq_max_size_and_literal_unk():
    train = ['x x x y y z <unk> <unk>\n']
    tok = tokenizers.WordTokenizer.from_documents(train, min_freq=2)
    assert tok.tokens == reference_word_vocab(train, min_freq=2) == ['<eos>', 'x', 'y', '<unk>']
    assert tok.encode('<unk> z').tolist() == [3, 3, 0]
    capped = tokenizers.WordTokenizer.from_documents(train, max_size=3)
    assert capped.tokens == ['<eos>', 'x', '<unk>']  # The cap keeps <unk>, which the words it drops become.


def test_word_round_trip_on_normalised_text():
    words = ['the', 'cat', 'sat', 'on', 'a', 'mat', ',', '.']
    text = _random_corpus(0, 200, words)
    tok = tokenizers.WordTokenizer.from_documents([text])
    ids = tok.encode(text)
    assert int((ids == tok.eos_id).sum()) == text.count('\n')
    assert tok.decode(ids) == text


@pytest.fixture(scope='module')
def sp_tokenizer():
    words = ['alpha', 'beta', 'gamma', 'delta', 'epsilon', 'zeta']
    return tokenizers.SentencePieceTokenizer.train(
        [_random_corpus(1, 1500, words)], vocab_size=300)


def test_sentencepiece_round_trip_is_lossless(sp_tokenizer):
    tok = sp_tokenizer
    assert tok.unit == 'subword' and 256 < tok.vocab_size <= 300
    text = 'alpha  beta\n\n\t gamma ünseen ☃\nlast line without newline'
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert ids.min() >= 0 and ids.max() < tok.vocab_size
    assert int((ids == tok.eos_id).sum()) == 4  # Every line ends in eos.
    assert tok.decode(ids) == text + '\n'
    # Frequent training words become single pieces.
    assert len(tok.encode('alpha')) == 2


def test_sentencepiece_save_and_load(tmp_path, sp_tokenizer):
    sp_tokenizer.save(tmp_path)
    loaded = factory.load_tokenizer(tmp_path)
    text = 'beta gamma\nzeta\n'
    assert loaded.encode(text).tolist() == sp_tokenizer.encode(text).tolist()
    direct = factory.load_tokenizer(tmp_path / tokenizers.SENTENCEPIECE_FILE)
    assert direct.fingerprint == sp_tokenizer.fingerprint


def test_sentencepiece_too_small_vocab_names_the_field():
    with pytest.raises(ValueError, match='data.sp_vocab_size'):
        tokenizers.SentencePieceTokenizer.train(['abc def\n'], vocab_size=20)


@pytest.mark.parametrize('tok', [
    tokenizers.ByteTokenizer(),
    tokenizers.CharTokenizer(list('abc ')),
    tokenizers.WordTokenizer(['<eos>', '<unk>', 'b', 'a']),
])
def test_save_load_preserves_ids(tmp_path, tok):
    path = tok.save(tmp_path)
    json.loads(path.read_text())  # Plain JSON, no pickles.
    loaded = factory.load_tokenizer(path)
    assert loaded.fingerprint == tok.fingerprint
    text = 'a b\nc a\n'
    assert loaded.encode(text).tolist() == tok.encode(text).tolist()


def test_decode_rejects_out_of_range_ids():
    tok = tokenizers.CharTokenizer(list('ab'))
    with pytest.raises(ValueError, match='vocabulary has 3 entries'):
        tok.decode([0, 3])


def test_build_tokenizer_reuses_workdir_and_checks_kind(tmp_path):
    vocab = tokenizers.WordTokenizer(['<eos>', '<unk>', 'hello'])
    vocab.save(tmp_path / 'given')
    cfg = DataConfig(name='embedded', tokenizer='word',
                     vocab_path=str(tmp_path / 'given' / 'tokenizer.json'))
    tok = factory.build_tokenizer(cfg, tmp_path / 'run')
    assert tok.tokens == vocab.tokens
    assert (tmp_path / 'run' / 'tokenizer.json').exists()
    # The run's saved vocabulary wins over data.vocab_path from now on.
    again = factory.build_tokenizer(dataclasses.replace(cfg, vocab_path='/nonexistent'),
                                  tmp_path / 'run')
    assert again.fingerprint == vocab.fingerprint
    with pytest.raises(ValueError, match='fresh workdir'):
        factory.build_tokenizer(dataclasses.replace(cfg, tokenizer='char'),
                              tmp_path / 'run')


def test_a_training_start_replaces_a_tokenizer_an_earlier_start_left_behind(tmp_path, caplog):
    """A workdir without a checkpoint holds at most the tokenizer of a start that saved nothing, made
    from the data and settings of then: a new start writes its own (init_from's run's before
    config.data's), with a warning when it differs; a damaged one is replaced too."""
    def vocabulary(name, words):
        tokenizers.WordTokenizer(['<eos>', '<unk>', *words]).save(tmp_path / name)
        return str(tmp_path / name)

    workdir, then, now = tmp_path / 'run', vocabulary('then', ['old']), vocabulary('now', ['new', 'words'])
    cfg = DataConfig(name='embedded', tokenizer='word', vocab_path=now)
    factory.build_tokenizer(dataclasses.replace(cfg, vocab_path=then), workdir)  # The earlier start's.
    factory.start_tokenizer(cfg, workdir)
    assert factory.load_tokenizer(workdir).tokens == ['<eos>', '<unk>', 'new', 'words']
    assert 'another than this start\'s (data.vocab_path=' in caplog.text
    caplog.clear()
    written = (workdir / 'tokenizer.json').stat().st_mtime_ns
    factory.start_tokenizer(cfg, workdir)  # The same one: nothing written, nothing said.
    assert (workdir / 'tokenizer.json').stat().st_mtime_ns == written and 'replaced' not in caplog.text
    source_run = vocabulary('source_run', ['trained', 'with'])
    factory.start_tokenizer(cfg, workdir, source_run)
    assert factory.load_tokenizer(workdir).tokens == ['<eos>', '<unk>', 'trained', 'with']
    assert 'the run of config.train.init_from' in caplog.text
    (workdir / 'tokenizer.json').write_text('{"kind": "word", "tok')  # Cut short.
    factory.start_tokenizer(cfg, workdir)
    assert factory.load_tokenizer(workdir).tokens == ['<eos>', '<unk>', 'new', 'words']
    with pytest.raises(ValueError, match="data.tokenizer is 'char' but .*source_run's, the run of config.* set data.tokenizer='word'"):
        factory.start_tokenizer(dataclasses.replace(cfg, tokenizer='char'), workdir, source_run)


def test_a_tokenizer_file_that_does_not_hold_a_vocabulary_is_named_with_the_fix(tmp_path):
    (tmp_path / 'tokenizer.json').write_text('{"kind": "word", "tokens": []}')
    with pytest.raises(ValueError, match=r'tokenizer\.json is a damaged memjax tokenizer file \(Word vocabulary lacks '
                                         r".*'<eos>'.*delete it to build it again"):
        factory.load_tokenizer(tmp_path)
    with pytest.raises(errors.MissingFileError,
                       match=r"a sentencepiece \.model, or a folder with GPT-2's vocab\.json and merges"):
        factory.load_tokenizer(tmp_path / 'none')


def test_unknown_tokenizer_kind():
    with pytest.raises(ValueError, match='data.tokenizer'):
        factory.build_tokenizer(DataConfig(tokenizer='bpe'), None)
