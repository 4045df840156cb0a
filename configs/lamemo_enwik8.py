"""LaMemo on enwik8 (Ji et al. 2022, appendix C; paper: 1.129 dev / 1.107 test bpc).

  python -m memjax.train --config=configs/lamemo_enwik8.py --workdir=runs/lamemo_enwik8
  python -m memjax.train --config=configs/lamemo_enwik8.py:smoke --workdir=/tmp/lamemo_enwik8_smoke

The Transformer-XL base model of configs/transformer_xl_enwik8_base.py (12 layers, 8 heads x 64,
d_model 512, d_inner 2048, dropout 0.1, bytes) with the look-ahead memory: tgt = mem = 512,
disentangled relative positions; batch 40, 100k steps (the paper's; a quarter of Transformer-XL's
steps, about half its tokens; the released script runs 50k), Adam 2.5e-4 without warmup, cosine to 0,
clip 0.25. Evaluation as in training, batch 16 as the released evaluation scripts.
'smoke': the same family at tiny size on the embedded corpus.
"""

from memjax import config_lib


def get_config(arg: str = ''):
    options = config_lib.config_options(__file__, arg, ('smoke',))
    config = config_lib.sibling_config(__file__, 'transformer_xl_enwik8_base.py')
    config.model.update(memory='lamemo', mem_len=512, lamemo_eps=1e-6)
    config.train.update(batch_size=40, num_steps=100_000)
    config_lib.evaluate_as_trained(config)
    config.eval.batch_size = 16
    if 'smoke' in options:
        config_lib.shrink_to_smoke(config)
    return config
