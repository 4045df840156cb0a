"""TRAMS on enwik8 (Yu et al. 2023, table 1: test bpc 1.215 with XL memory 200, 1.198 with TRAMS).

  python -m memjax.evaluate --config=configs/trams_enwik8.py --workdir=runs/xl_enwik8_for_trams --config.eval.split=test
  python -m memjax.evaluate --config=configs/trams_enwik8.py:xl --workdir=runs/xl_enwik8_for_trams --config.eval.split=test
  python -m memjax.evaluate --config=configs/trams_enwik8.py:released --workdir=runs/xl_enwik8_for_trams --config.eval.split=test
  python -m memjax.train --config=configs/trams_enwik8.py --workdir=runs/xl_enwik8_for_trams

The paper's enwik8 Transformer-XL (appendix B): 12 x 512, 8 heads x 64, d_inner 2048, dropout 0.1,
bytes; trained with tgt = mem = 150, batch 60, Adam 2.5e-4, cosine without warmup, 350k steps (the
last command; it validates with TRAMS). The evaluation is that of configs/trams_wt103.py: n = 64,
batch 10, pool 600, 200 attended (150 newest + 50 ranked), clamp 1000, the paper's metric and true
distances; `xl`, `released` and `xl,released` as there.
"""

from memjax import config_lib


def get_config(arg: str = ''):
    config = config_lib.sibling_config(__file__, 'transformer_xl_enwik8_base.py')
    config.model.update(mem_len=150)
    config.train.update(tgt_len=150, batch_size=60, num_steps=350_000)
    return config_lib.sibling_module(__file__, 'trams_wt103.py').trams_evaluation(config, __file__, arg)
