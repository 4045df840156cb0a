"""Skip Cross-Head Transformer-XL on WikiText-103 (Vishnu & Sekhar, appendix B.2; paper table 2:
22.88 dev / 23.92 test ppl at context 640, 21.87 / 22.91 at 2000).

  python -m memjax.train --config=configs/skip_cross_head_wt103.py --workdir=runs/sch_wt103
  python -m memjax.train --config=configs/skip_cross_head_wt103.py:phase1 --workdir=runs/sch_wt103_phase1
  python -m memjax.train --config=configs/skip_cross_head_wt103.py:phase2 --workdir=runs/sch_wt103_phase2 \
      --config.train.init_from=runs/sch_wt103_phase1
  python -m memjax.train --config=configs/skip_cross_head_wt103.py:smoke --workdir=/tmp/sch_smoke

15 layers, d_model 624, 16 heads x 39, d_inner 2496, dropout 0.15, dropatt 0, adaptive input and
softmax (cutoffs 20k/40k/200k, div_val 4) with untied input and output weights (the released script
leaves --adapt_io_tied off: 122M parameters, the paper's count), tgt = mem = 512, batch 32, Adam
2.5e-4, clip 0.25, every layer's memory starting as mem_len zero rows that are attended (the
released trainer's, in training and evaluation). Schedule: 16k warmup steps, then cosine to 0 over
the 1.2M steps. The paper says "cosine annealing with max iterations 16000", and the released
script's --warmup 16000 is both a 16k warmup and the period of a cosine that never decays over the
run (the learning rate is 0 at steps 16k, 48k, ... and back at its peak at 32k, 64k, ...); memjax
decays once instead. The released run stops on a validation plateau within 1.2M steps; memjax runs
the fixed schedule. Skip-Retain with eq. (1) and Stochastic Cross-Head attention with beta = 0.1.
One run holds both phases: skipping for the first 3/4 of the steps, plain training for the last
quarter (the split of the paper's table 5 wall times, 74 and 21 hours). Evaluation as the released
scripts: segments of 128, batch 10, memory 640, clamp 800, same_length; `long`: memory 2000 (table
2's second row). The embedding dropout is 0 in the paper; memjax's one `dropout` also applies there.
Arguments: `phase1` (the whole run skips, the paper's first run), `phase2` (no skipping: continue a
phase-1 workdir with train.init_from), `no_sch` (beta = 0), `no_skip` (SCH alone), `xl` (neither),
`ablation` (appendix B.1's model, on which tables 5-9 were measured: 8 layers, d_model 512, 8 heads
x 64, d_inner 2048, dropout 0.1, batch 50; with `xl`, `no_sch`, `no_skip`, `phase1`: table 5's rows),
`long`, `smoke`, `notebook` (the quickstart's size on a text file in bytes, docs/notebooks.md).
docs/paper_configs.md lists every field against the paper and the released code.
"""

from memjax import config_lib

OPTIONS = ('phase1', 'phase2', 'no_sch', 'no_skip', 'xl', 'ablation', 'smoke', 'notebook')


def skip_cross_head(config, options: set, phase2_from: float = 0.75):
    """The paper's two switches over a Transformer-XL config, with the arguments above."""
    steps = config.train.num_steps
    config.model.update(skip_rule='linear', skip_until=int(phase2_from * steps), sch_beta=0.1,
                        memory_start='zeros')
    if 'ablation' in options:
        config.model.update(n_layer=8, d_model=512, n_head=8, d_head=64, d_inner=2048, dropout=0.1)
        config.train.batch_size = 50
    if 'phase1' in options:
        config.model.skip_until = -1
    if options & {'phase2', 'no_skip', 'xl'}:
        config.model.update(skip_rule='none', skip_until=-1)
    if options & {'no_sch', 'xl'}:
        config.model.sch_beta = 0.0
    if options & {'smoke', 'notebook'}:
        config_lib.evaluate_as_trained(config)
        (config_lib.shrink_to_smoke if 'smoke' in options else config_lib.shrink_to_notebook)(config)
        config.model.n_layer = 4  # Eq. (1) then skips layers 2 and 3 (1-based) with p = 1/8 and 1/4.
        if config.model.skip_until > 0:
            config.model.skip_until = int(phase2_from * config.train.num_steps)
    return config


def get_config(arg: str = ''):
    config = config_lib.sibling_config(__file__, 'transformer_xl_wt103_base.py')
    config.model.update(d_model=624, n_layer=15, n_head=16, d_head=39, d_inner=2496, dropout=0.15, dropatt=0.0,
                        mem_len=512, div_val=4, tie_weight=False, tie_projs=(False,) * 4)
    config.train.update(batch_size=32, tgt_len=512, num_steps=1_200_000, warmup_steps=16_000)
    config.eval.update(tgt_len=128, batch_size=10)
    options = config_lib.config_options(__file__, arg, OPTIONS + ('long',))
    config.eval.model.update(mem_len=2000 if 'long' in options else 640, clamp_len=800, same_length=True)
    return skip_cross_head(config, options)
