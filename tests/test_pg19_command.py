"""The infinity-former's headline command, `python -m memjax.train
--config=configs/inftyformer_pg19.py`, end to end at tiny sizes: PG-19's folder layout, GPT-2's
byte-level BPE files, the paper's first-N-books subset, the LTM model, training and validation."""

import json
import math
import os

import numpy as np

from memjax import config_lib
from memjax.data import pipeline, tokenizers
from memjax.training import loop as trainer
import training_fixtures

CONFIG = os.path.join(training_fixtures.REPO, 'configs', 'inftyformer_pg19.py')


def gpt2_byte_symbols() -> list[str]:
    """GPT-2's printable stand-in for each byte (its vocab.json spells bytes this way)."""
    printable = [*range(ord('!'), ord('~') + 1), *range(ord('¡'), ord('¬') + 1), *range(ord('®'), ord('ÿ') + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_gpt2_files(folder):
    symbols = gpt2_byte_symbols()
    merges = ['Ġ t', 'h e', 'Ġt he']  # ' the' becomes one token.
    vocab = {s: i for i, s in enumerate(symbols + ['Ġt', 'he', 'Ġthe', '<|endoftext|>'])}
    os.makedirs(folder)
    with open(os.path.join(folder, 'vocab.json'), 'w', encoding='utf-8') as f:
        json.dump(vocab, f)
    with open(os.path.join(folder, 'merges.txt'), 'w', encoding='utf-8') as f:
        f.write('#version: 0.2\n' + '\n'.join(merges) + '\n')
    return len(vocab)


def write_pg19(root, books):
    for split, items in books.items():
        os.makedirs(os.path.join(root, split))
        for book_id, text in items.items():
            with open(os.path.join(root, split, f'{book_id}.txt'), 'w', encoding='utf-8') as f:
                f.write(text)


def test_pg19_config_trains_and_validates_on_the_first_books(tmp_path):
    rng = np.random.RandomState(0)
    words = ['the', 'king', 'and', 'his', 'people', 'went', 'into', 'city', 'of', 'light']
    book = lambda n: ' '.join(rng.choice(words, n)) + '.\n'
    books = {'train': {'30': book(60), '4': book(60), '100': book(60)},
             'validation': {'7': book(40), '9': book(30)}, 'test': {'8': book(40)}}
    write_pg19(tmp_path / 'pg19', books)
    vocab_size = write_gpt2_files(str(tmp_path / 'gpt2'))
    config = training_fixtures.override(
        config_lib.load_config_file(CONFIG),
        data__manual_dir=str(tmp_path / 'pg19'), data__vocab_path=str(tmp_path / 'gpt2'),
        data__data_dir=str(tmp_path / 'tfds'), data__train_documents=2,
        model__d_model=16, model__n_layer=1, model__n_head=2, model__d_head=8, model__d_inner=32,
        model__n_positions=32, model__ltm_basis=8, model__dropout=0.0, model__dropatt=0.0,
        train__tgt_len=16, train__batch_size=2, train__num_steps=8, train__log_every=4,
        train__learning_rate=1e-2, train__memory_learning_rate=1e-2,
        train__eval_every=0, train__checkpoint_every=0)
    summary = trainer.train_and_evaluate(config, str(tmp_path / 'run'))

    tok = tokenizers.GPT2BPETokenizer.from_folder(tmp_path / 'gpt2')
    assert tok.vocab_size == vocab_size and len(tok.encode(' the')) == 1
    # Validation scores every target of its books; training read books 4 and 30, not 100.
    assert summary['valid_tokens'] == sum(len(tok.encode(text)) - 1 for text in books['validation'].values())
    assert summary['valid_loss'] < math.log(vocab_size) - 1  # It learns (10 words, 260 ids).
    tokens, offsets = pipeline.load_token_ids(config_lib.resolve(config).data, 'train', tok)
    read = [tok.decode(tokens[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]
    assert read == [books['train']['4'], books['train']['30']]
