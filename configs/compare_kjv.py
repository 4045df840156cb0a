"""Every method at one equal budget on the King James Bible in bytes: a table and plots.

  python -m memjax.compare --config=configs/compare_kjv.py --workdir=runs/compare_kjv \
      --config.data.text_path=kjv.txt        # the King James Bible as plain text (public domain)
  python -m memjax.compare --config=configs/compare_kjv.py:smoke --workdir=runs/compare_smoke
  python -m memjax.compare --config=configs/compare_kjv.py:wt103 --workdir=gs://... (GPUs/TPUs)
  python -m memjax.compare --config=configs/compare_kjv.py:extrapolate --workdir=runs/extrapolate_kjv \
      --config.data.text_path=kjv.txt
  python -m memjax.compare --config=configs/compare_kjv.py --workdir=runs/compare_kjv \
      --config.data.text_path=kjv.txt --config.compare.recl_contexts="(32, 64, 96, 128, 160, 192, 224, 256)"

kjv.txt: the King James Bible in plain text, e.g. Project Gutenberg eBook #10
(https://www.gutenberg.org/ebooks/10). BENCHMARKS.md's tables used a 4,298,239-byte UTF-8 edition
with a "Book N" line heading each chapter and numbered verses; another edition's formatting moves
the numbers a little. data.name='text' cuts one file 90/5/5 % into train, validation and test.

Default: the quickstart's model (4 x 128, segments and memory of 64) for 4,000 segments of 16 x 64
bytes per method and seed, evaluated with memory 64, 128 and 256, six trained methods x 2 seeds:
78 minutes on 2 cores of an AMD EPYC, 105 minutes on 2 cores of an Intel Xeon (family 6 model 167,
2026-11-27, f469a77) whose cores other work shared. `:smoke`: a tiny model on the embedded
corpus (12 short trainings and 28 evaluations of the whole validation split): 5 min 45 s on 2 idle
cores of an AMD EPYC Zen 4 (2026-11-28); 22 minutes on an AVX2-only EPYC whose cores other work
shared. `:wt103`: WikiText-103 words with Transformer-XL base's shape, for accelerators.
`:extrapolate`: the LaMemo paper's figure 5 protocol at this budget: XL and LaMemo trained with
segments and memory of 128 (the paper's 150), evaluated with segments of 64 and memory 64 x m,
m = 1..10, with and without clamping the distances at the longest one trained.
"""

import ml_collections

from memjax import config_lib

METHODS = ('none', 'xl', 'lamemo', 'infinity', 'trams', 'skip_retain', 'cross_head')


def get_config(arg: str = ''):
    options = config_lib.config_options(__file__, arg, ('smoke', 'wt103', 'extrapolate'))
    config = config_lib.base_config()
    config.compare = ml_collections.ConfigDict({
        'methods': METHODS,
        'seeds': 2,  # Two seeds of one XL differed by 0.02 bpc on held-out text: the spread is reported.
        'eval_mem_lens': (64, 128, 256),
        # Each evaluation's config.eval.model.clamp_len, one row per value: -2 clamps the distances a
        # longer memory adds at the longest one trained (mem_len + tgt_len - 1), -1 leaves them.
        'clamp_lens': (-2,),
        'match_params': True,  # d_inner per method so that every model has XL's parameter count.
        # Given context lengths, the table gains a RECL column per r (memjax.recl, one group per seed):
        # --config.compare.recl_contexts="(32, 64, 96, 128, 160, 192, 224, 256)".
        'recl_contexts': (),
        'recl_rs': (0.1,),
        'recl_batches': 4,  # Evaluation batches of the split scored at each context; -1: all of it.
    })
    config.data.update(name='text', tokenizer='byte', heldout_size=1000)
    config.model.update(d_model=128, n_layer=4, n_head=4, d_head=32, d_inner=512, mem_len=64,
                        dropout=0.0, dropatt=0.0, ltm_basis=64, ltm_samples=64)
    config.train.update(batch_size=16, tgt_len=64, segments_per_step=10, num_steps=4000, learning_rate=1e-3,
                        warmup_steps=100, min_lr_ratio=0.1, clip_norm=1.0, log_every=200, eval_every=1000,
                        eval_batches=20, checkpoint_every=1000, keep_checkpoints=1)
    if 'smoke' in options:
        config.data.update(name='embedded')
        # Four layers: with two, the linear skip rule skips none (eq. 1 never skips the top layer).
        config.model.update(d_model=32, n_layer=4, n_head=2, d_head=16, d_inner=64, mem_len=16, ltm_basis=16,
                            ltm_samples=16)
        config.train.update(batch_size=4, tgt_len=16, segments_per_step=1, num_steps=60, warmup_steps=5,
                            log_every=20, eval_every=30, eval_batches=4, checkpoint_every=30)
        config.eval.update(batch_size=32)  # Each evaluation scores the whole embedded validation split.
        config.compare.eval_mem_lens = (16, 32)
    if 'wt103' in options:
        config.data.update(name='wikitext103', tokenizer='word')
        config.model.update(d_model=410, n_layer=16, n_head=10, d_head=41, d_inner=2100, mem_len=150,
                            cutoffs=(20000, 40000, 200000), div_val=1, dropout=0.1, dropatt=0.0, ltm_basis=150,
                            ltm_samples=150)
        config.train.update(batch_size=60, tgt_len=150, segments_per_step=1, num_steps=200000, learning_rate=2.5e-4,
                            warmup_steps=0, eval_every=4000, checkpoint_every=4000)
        config.compare.eval_mem_lens = (150, 300, 640)
    if 'extrapolate' in options:
        # The same number of training bytes per run as the default; distances 0-255 are trained, so
        # memory 64 x m at segments of 64 first goes beyond them at m = 4, as 150 / 64 does.
        config.compare.update(methods=('xl', 'lamemo'), eval_mem_lens=tuple(64 * m for m in range(1, 11)),
                              clamp_lens=(-1, -2))
        config.model.mem_len = 128
        config.train.update(tgt_len=128, num_steps=2000, eval_every=500, checkpoint_every=500)
        config.eval.tgt_len = 64
    return config
