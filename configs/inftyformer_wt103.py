"""The infinity-former trained from scratch on WikiText-103 (paper appendix D, table 3).

  python -m memjax.train --config=configs/inftyformer_wt103.py --workdir=runs/inftyformer_wt103
  python -m memjax.train --config=configs/inftyformer_wt103.py:sticky --workdir=runs/inftyformer_wt103_sm
  python -m memjax.train --config=configs/inftyformer_wt103.py:smoke --workdir=/tmp/inftyformer_wt103_smoke

Transformer-XL's architecture (16 layers, 10 heads, d_model 410, d_inner 2100, adaptive softmax as
in configs/transformer_xl_wt103_base.py) with STM 150 and an LTM of N = 150 Gaussian RBFs (widths
0.01, 0.05), tau 0.5, memory threshold 900 tokens, lambda_KL 1e-5 with sigma_0 0.1; batch 40, 250k
steps, Adam 2.5e-4 with cosine decay to 0. Reported perplexity: 24.29 (24.22 with sticky memories)
against 24.52 for Transformer-XL with memory 150. 'smoke': the same family at tiny size on the
embedded corpus (byte tokens). 'notebook': the infinity-former at the quickstart's size on a text file
in bytes, an LTM of 64 basis functions that starts afresh after 512 bytes, the run
notebooks/inftyformer_ltm.ipynb loads (docs/notebooks.md) with `notebook,sticky`; its KL weight is
1e-3, as the notebook explains (at 1e-5 a short run's densities stay as wide as [0, 1]):
  python -m memjax.train --config=configs/inftyformer_wt103.py:notebook,sticky --workdir=runs/infinity_notebook \
      --config.data.text_path=kjv.txt
"""

from memjax import config_lib


def get_config(arg: str = ''):
    options = config_lib.config_options(__file__, arg, ('smoke', 'notebook', 'sticky'))
    config = config_lib.sibling_config(__file__, 'transformer_xl_wt103_base.py')
    config.model.update(
        memory='infinity', mem_len=150, ltm_basis=150, ltm_widths=(0.01, 0.05), ltm_ridge=1.0, ltm_tau=0.5,
        ltm_reset_tokens=900, ltm_min_variance=1e-6, ltm_kl_weight=1e-5, ltm_kl_sigma=0.1,
        ltm_sticky='sticky' in options)
    config.train.update(batch_size=40, num_steps=250_000)
    config_lib.evaluate_as_trained(config)
    if 'smoke' in options:
        config_lib.shrink_to_smoke(config, ltm_basis=32, ltm_reset_tokens=256)
    if 'notebook' in options:
        config_lib.shrink_to_notebook(config, ltm_basis=64, ltm_samples=64, ltm_reset_tokens=512, ltm_kl_weight=1e-3)
    return config
