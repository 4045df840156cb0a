"""Transformer-XL Standard on WikiText-103 (151M parameters; paper: 23.1 valid / 24.0 test ppl).

Architecture and optimisation from the reference training script: 16 layers, d_model 410,
10 heads x 41, d_inner 2100, dropout 0.1, adaptive input/softmax with cutoffs
20k/40k/200k and div_val 1, tgt = mem = 150, batch 60, Adam 2.5e-4, cosine to 0 over
200k steps, clip 0.25. Evaluation with a longer attention: tgt 64, mem 640, clamp 400,
same_length, batch 10 (the reference eval.py's; on a mesh whose data x fsdp does not divide 10, set
--config.eval.batch_size to a multiple of it).

  python -m memjax.train --config=configs/transformer_xl_wt103_base.py --workdir=runs/transformer_xl_wt103_base
  python -m memjax.train --config=configs/transformer_xl_wt103_base.py:notebook --workdir=runs/xl_notebook \
      --config.data.text_path=kjv.txt

`notebook`: Transformer-XL at the quickstart's size on a text file in bytes, the run that
notebooks/transformer_xl_attention.ipynb, lamemo_memory.ipynb and trams_selection.ipynb load
(docs/notebooks.md).
"""

from memjax import config_lib


def get_config(arg: str = ''):
    options = config_lib.config_options(__file__, arg, ('notebook',))
    config = config_lib.base_config()
    config.data.update(name='wikitext103', tokenizer='word')
    config.model.update(
        d_model=410, n_layer=16, n_head=10, d_head=41, d_inner=2100, dropout=0.1, dropatt=0.0,
        mem_len=150, cutoffs=(20000, 40000, 200000), div_val=1,
        tie_projs=(False, True, True, True))
    config.train.update(
        batch_size=60, tgt_len=150, num_steps=200_000, learning_rate=2.5e-4, warmup_steps=0,
        min_lr_ratio=0.0, clip_norm=0.25, log_every=200, eval_every=4000, eval_batches=-1,
        checkpoint_every=4000)
    config.eval.update(tgt_len=64, batch_size=10)
    config.eval.model.update(mem_len=640, clamp_len=400, same_length=True)
    if 'notebook' in options:
        config_lib.shrink_to_notebook(config)
    return config
