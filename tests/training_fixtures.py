"""Helpers shared by the training, checkpoint and evaluation tests (not a test module).

A generated text corpus keeps these tests independent of any downloaded data and small
enough that a full validation pass takes a fraction of a second.
"""

import os

import ml_collections
import numpy as np

from memjax import config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, 'configs', 'tiny.py')


def write_text_corpus(folder: str, seed: int = 0) -> str:
    """train/valid/test.txt of random sentences over a small vocabulary; returns folder."""
    rng = np.random.RandomState(seed)
    words = ['alpha', 'beta', 'gamma', 'delta', 'memory', 'segment', 'token', 'jax', 'the', 'of']
    sizes = {'train.txt': 3000, 'valid.txt': 120, 'test.txt': 90}  # In words.
    os.makedirs(folder, exist_ok=True)
    for name, count in sizes.items():
        chosen = rng.choice(words, size=count)
        lines = [' '.join(chosen[i:i + 12]) + '.' for i in range(0, count, 12)]
        with open(os.path.join(folder, name), 'w') as f:
            f.write('\n'.join(lines) + '\n')
    return folder


def tiny_config(corpus: str, **overrides) -> ml_collections.ConfigDict:
    """configs/tiny.py on the generated corpus; overrides like `train__num_steps=4` or
    `eval__model__mem_len=16`."""
    config = config_lib.load_config_file(TINY)
    config.data.update(name='text', text_path=corpus, data_dir=os.path.join(corpus, 'tfds'))
    return override(config, **overrides)


def override(config: ml_collections.ConfigDict, **overrides) -> ml_collections.ConfigDict:
    """Sets `section__field=value` (any depth, `seed=1` at the top) in `config`; returns it."""
    for key, value in overrides.items():
        *sections, field = key.split('__')
        node = config
        for section in sections:
            node = node[section]
        node[field] = value
    return config
