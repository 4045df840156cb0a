"""TRAMS on WikiText-103 (Yu et al. 2023, table 1: test ppl 24.17 with XL memory 200, 23.98 with TRAMS).

  python -m memjax.evaluate --config=configs/trams_wt103.py --workdir=runs/transformer_xl_wt103_base --config.eval.split=test
  python -m memjax.evaluate --config=configs/trams_wt103.py:xl --workdir=runs/transformer_xl_wt103_base --config.eval.split=test
  python -m memjax.evaluate --config=configs/trams_wt103.py:released --workdir=runs/transformer_xl_wt103_base --config.eval.split=test
  python -m memjax.train --config=configs/trams_wt103.py --workdir=runs/xl_wt103_for_trams

TRAMS is training-free: the first command evaluates a Transformer-XL workdir (any run of
configs/transformer_xl_wt103_base.py) with selection. The model is that base architecture (16 x 410,
10 heads x 41, d_inner 2100, adaptive input and softmax); the paper trained it (appendix B) with
tgt = mem = 150, batch 60, Adam 2.5e-4, cosine without warmup, 350k steps, which the last command
repeats, validating with TRAMS. Evaluation (section 3.2 and the released scripts): segments of
n = 64, batch 10, a pool of M = 600 rows per layer, m = 200 attended per head (the newest 150 and
the 50 best-ranked older ones, the released split), clamp_len 1000 (the released default), the
paper's metric cos(K', 1) ||K'|| and true distances. Arguments:
`xl`: the table's baseline row, Transformer-XL attending the newest 200;
`released`: the authors' code (pool 400, ||K'|| |sum K'|, selected keys placed contiguously, every
layer's memory starting as mem_len zero rows that are attended, as its init_mems);
`xl,released`: the authors' baseline script (the newest 200, from zero rows).
docs/paper_configs.md lists every field against the paper and the released code.
"""

from memjax import config_lib

PAPER = dict(memory='trams', mem_len=600, trams_select=200, trams_remain=150, trams_metric='paper',
             trams_positions='true', clamp_len=1000, same_length=False)
# Applied in this order: `xl,released` is the released code's Transformer-XL baseline.
OPTIONS = {'released': dict(mem_len=400, trams_metric='released', trams_positions='contiguous', memory_start='zeros'),
           'xl': dict(memory='xl', mem_len=200)}


def trams_evaluation(config, this_file: str, arg: str):
    """The paper's evaluation over a Transformer-XL config, or an argument's variant of it."""
    fields = dict(PAPER)
    options = config_lib.config_options(this_file, arg, tuple(OPTIONS))
    for option in [o for o in OPTIONS if o in options]:
        fields.update(OPTIONS[option])
    if fields['memory'] == config.model.memory:  # The baseline: no selection, no TRAMS fields.
        fields = {k: v for k, v in fields.items() if k != 'memory' and not k.startswith('trams_')}
    config.eval.update(tgt_len=64, batch_size=10)
    config.eval.model.update(fields)
    return config


def get_config(arg: str = ''):
    config = config_lib.sibling_config(__file__, 'transformer_xl_wt103_base.py')
    config.model.update(mem_len=150)
    config.train.update(tgt_len=150, batch_size=60, num_steps=350_000)
    return trams_evaluation(config, __file__, arg)
