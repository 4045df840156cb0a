"""LaMemo on text8 (Ji et al. 2022, appendix C; paper: 1.128 dev / 1.196 test bpc).

  python -m memjax.train --config=configs/lamemo_text8.py --workdir=runs/lamemo_text8

Unlike Transformer-XL's text8 model (the enwik8 large one), LaMemo trains its enwik8 base model
(configs/lamemo_enwik8.py) on text8's characters; its smoke variant is lamemo_enwik8.py:smoke.
"""

from memjax import config_lib


def get_config():
    config = config_lib.sibling_config(__file__, 'lamemo_enwik8.py')
    config.data.update(name='text8', tokenizer='char', drop_bytes=())
    return config
