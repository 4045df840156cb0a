"""Transformer-XL on text8 (277M parameters; paper: 1.08 test bpc).

The paper's text8 model is the enwik8 large architecture and recipe (24 x 1024, 8 heads x
128, tgt = mem = 768, dropout 0.15, 4k warmup steps as the TF script; the PyTorch one has none) on
characters; evaluation tgt 128, mem 3800, clamp 1000, same_length, batch 10.
"""

from memjax import config_lib


def get_config():
    config = config_lib.sibling_config(__file__, 'transformer_xl_enwik8_large.py')
    config.data.update(name='text8', tokenizer='char', drop_bytes=())
    return config
