"""Ablation: the WikiText-103 base model without recurrence (mem_len 0), relative positions only.

Same architecture and optimisation as transformer_xl_wt103_base; the memory is disabled in
training and evaluation, which isolates what the segment-level recurrence contributes
(the paper's Table 5 rows without recurrence). same_length needs a memory, so it is off.
"""

from memjax import config_lib


def get_config():
    config = config_lib.sibling_config(__file__, 'transformer_xl_wt103_base.py')
    config.model.mem_len = 0
    config.eval.update(tgt_len=150, mem_len=0, clamp_len=-1, same_length=False)
    return config
