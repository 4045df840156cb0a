"""The infinity-former trained from scratch on WikiText-103 (paper appendix D, table 3).

  python -m memjax.train --config=configs/inftyformer_wt103.py --workdir=runs/inftyformer_wt103
  python -m memjax.train --config=configs/inftyformer_wt103.py:sticky --workdir=runs/inftyformer_wt103_sm
  python -m memjax.train --config=configs/inftyformer_wt103.py:smoke --workdir=/tmp/inftyformer_wt103_smoke

Transformer-XL's architecture (16 layers, 10 heads, d_model 410, d_inner 2100, adaptive softmax as
in configs/transformer_xl_wt103_base.py) with STM 150 and an LTM of N = 150 Gaussian RBFs (widths
0.01, 0.05), tau 0.5, memory threshold 900 tokens, lambda_KL 1e-5 with sigma_0 0.1; batch 40, 250k
steps, Adam 2.5e-4 with cosine decay to 0. Reported perplexity: 24.29 (24.22 with sticky memories)
against 24.52 for Transformer-XL with memory 150. 'smoke': the same family at tiny size on the
embedded corpus (byte tokens).
"""

from memjax import config_lib


def get_config(arg: str = ''):
    options = config_lib.config_options(__file__, arg, ('smoke', 'sticky'))
    config = config_lib.sibling_config(__file__, 'transformer_xl_wt103_base.py')
    config.model.update(
        memory='infinity', mem_len=150, ltm_basis=150, ltm_widths=(0.01, 0.05), ltm_ridge=1.0, ltm_tau=0.5,
        ltm_reset_tokens=900, ltm_min_variance=1e-6, ltm_kl_weight=1e-5, ltm_kl_sigma=0.1,
        ltm_sticky='sticky' in options)
    config.train.update(batch_size=40, num_steps=250_000)
    # Evaluation as in training (the XL config evaluates with a longer memory instead).
    config.eval.tgt_len = -1
    config.eval.model.update(mem_len=None, clamp_len=None, same_length=None)
    if 'smoke' in options:
        config.data.update(name='embedded', tokenizer='byte')
        config.model.update(d_model=64, n_layer=2, n_head=4, d_head=16, d_inner=256, dropout=0.0, cutoffs=(),
                            tie_projs=(), mem_len=32, ltm_basis=32, ltm_reset_tokens=256)
        config.train.update(batch_size=8, tgt_len=32, num_steps=600, learning_rate=2e-3, warmup_steps=20,
                            min_lr_ratio=0.1, log_every=100, eval_every=0, checkpoint_every=0)
    return config
