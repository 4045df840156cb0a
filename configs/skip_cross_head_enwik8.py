"""Skip Cross-Head Transformer-XL on enwik8 (Vishnu & Sekhar, appendix B.2; paper table 1: 1.058 dev /
1.033 test bpc at context 3800, 1.060 / 1.037 at 1600).

  python -m memjax.train --config=configs/skip_cross_head_enwik8.py --workdir=runs/sch_enwik8
  python -m memjax.train --config=configs/skip_cross_head_enwik8.py:smoke --workdir=/tmp/sch_enwik8_smoke

12 layers, d_model 512, 8 heads x 64, d_inner 2048, dropout 0.15, dropatt 0, bytes with untied input
and output weights (the released model's separate embedding and output layer), tgt = mem = 512,
memory starting as zero rows, batch 60, Adam 2.5e-4, clip 0.25, cosine to 0 over 400k steps
(Transformer-XL's enwik8 schedule; the paper gives no step count and "cosine annealing with max
iterations 4000", which memjax does not repeat: see configs/skip_cross_head_wt103.py); Skip-Retain
eq. (1) for the first 3/4 of the steps, then plain training; SCH with beta = 0.1. Evaluation:
segments of 128, batch 10, memory 3800, clamp 800, same_length; `short`: memory 1600 (table 1's
other row). The other arguments are those of configs/skip_cross_head_wt103.py.
"""

from memjax import config_lib


def get_config(arg: str = ''):
    shared = config_lib.sibling_module(__file__, 'skip_cross_head_wt103.py')
    options = config_lib.config_options(__file__, arg, shared.OPTIONS + ('short',))
    config = config_lib.sibling_config(__file__, 'transformer_xl_enwik8_base.py')
    config.model.update(dropout=0.15, dropatt=0.0, mem_len=512, tie_weight=False)
    config.train.update(batch_size=60, tgt_len=512, num_steps=400_000)
    config.eval.update(tgt_len=128, batch_size=10)
    config.eval.model.update(mem_len=1600 if 'short' in options else 3800, clamp_len=800, same_length=True)
    return shared.skip_cross_head(config, options)
