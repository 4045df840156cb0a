"""The WikiText-103 base model without recurrence (memory 'none'), relative positions only.

The "Transformer+RPE" row of LaMemo's and TRAMS's table 1 (151M parameters, no memory: 28.11 dev /
29.14 test ppl): transformer_xl_wt103_base's architecture with LaMemo's wt103 schedule (batch 64,
250k steps), segments of 150 in training and evaluation, evaluation batch 16 as LaMemo's scripts.
It isolates what the segment-level recurrence contributes. (Transformer-XL's own table 5 rows
without recurrence used a smaller 128M model trained on segments of 128.) same_length needs a
memory, so it is off. docs/paper_configs.md lists every field against the papers.
"""

from memjax import config_lib


def get_config():
    config = config_lib.sibling_config(__file__, 'transformer_xl_wt103_base.py')
    config.model.update(memory='none', mem_len=0)
    config.train.update(batch_size=64, num_steps=250_000)
    config.eval.update(tgt_len=150, batch_size=16)
    config.eval.model = config_lib.eval_model_placeholders()  # Nothing of the base's evaluation memory.
    return config
