"""Ablation: the WikiText-103 base model without recurrence (memory 'none'), relative positions only.

Same architecture and optimisation as transformer_xl_wt103_base; no memory in training or
evaluation, which isolates what the segment-level recurrence contributes (the paper's Table 5
rows without recurrence). same_length needs a memory, so it is off.
"""

from memjax import config_lib


def get_config():
    config = config_lib.sibling_config(__file__, 'transformer_xl_wt103_base.py')
    config.model.update(memory='none', mem_len=0)
    config.eval.tgt_len = 150
    config.eval.model = config_lib.eval_model_placeholders()  # Nothing of the base's evaluation memory.
    return config
