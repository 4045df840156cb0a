"""LaMemo on WikiText-103 (Ji et al. 2022, appendix C; paper: 22.98 dev / 23.77 test ppl).

  python -m memjax.train --config=configs/lamemo_wt103.py --workdir=runs/lamemo_wt103
  python -m memjax.train --config=configs/lamemo_wt103.py:no_interp --workdir=runs/lamemo_wt103_no_interp
  python -m memjax.train --config=configs/lamemo_wt103.py:smoke --workdir=/tmp/lamemo_smoke

Transformer-XL's base architecture (16 layers, 10 heads x 41, d_model 410, d_inner 2100, dropout
0.1, adaptive input and softmax as in configs/transformer_xl_wt103_base.py) with the look-ahead
memory: tgt = mem = 150, disentangled relative positions, interpolation epsilon 1e-6; batch 64,
250k steps, Adam 2.5e-4 without warmup, cosine to 0, clip 0.25. Evaluation as in training (the
paper's main results use no longer memory), batch 16 as the released evaluation scripts. The paper's ablations (table 3) are arguments:
`no_interp` (alpha = 0: 23.67 dev), `no_look_ahead` (Transformer-XL: 23.42 dev), `xl_encoding`
(Transformer-XL's relative encoding for the look-ahead too: the paper reports it fails to converge).
'smoke': the same family at tiny size on the embedded corpus (byte tokens). 'notebook': LaMemo at the
quickstart's size on a text file in bytes, the run notebooks/lamemo_memory.ipynb loads (docs/notebooks.md):
  python -m memjax.train --config=configs/lamemo_wt103.py:notebook --workdir=runs/lamemo_notebook \
      --config.data.text_path=kjv.txt
"""

from memjax import config_lib

ABLATIONS = {'no_interp': {'lamemo_interpolate': False}, 'no_look_ahead': {'lamemo_look_ahead': False},
             'xl_encoding': {'lamemo_encoding': 'xl'}}


def get_config(arg: str = ''):
    options = config_lib.config_options(__file__, arg, ('smoke', 'notebook') + tuple(ABLATIONS))
    config = config_lib.sibling_config(__file__, 'transformer_xl_wt103_base.py')
    config.model.update(memory='lamemo', mem_len=150, lamemo_eps=1e-6)
    for option in options & set(ABLATIONS):
        config.model.update(ABLATIONS[option])
    config.train.update(batch_size=64, num_steps=250_000)
    config_lib.evaluate_as_trained(config)
    config.eval.batch_size = 16
    if 'smoke' in options:
        config_lib.shrink_to_smoke(config)
    if 'notebook' in options:
        config_lib.shrink_to_notebook(config)
    return config
