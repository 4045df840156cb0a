"""Transformer-XL Large on WikiText-103 (257M parameters; paper: 18.2 valid / 18.9 test ppl).

18 layers, d_model 1024, 16 heads x 64, d_inner 4096, dropout = dropatt = 0.2, adaptive
input/softmax with div_val 4, tgt = mem = 384, batch 128, Adam 2.5e-4 with 16k warmup
steps, clip 0.25, init std 0.005 as in the reference large configs. Evaluation: tgt 128,
mem 1600, clamp 1000, same_length (attention length 1600 in the paper).
The layers are scanned (`scan_layers`): XLA compiles one layer instead of 18, half the compile
time (BENCHMARKS.md, accelerators); parameters stack under params['layers']. A run started unscanned resumes with
--config.model.scan_layers=False; evaluation reads either layout.
"""

from memjax import config_lib


def get_config():
    config = config_lib.sibling_config(__file__, 'transformer_xl_wt103_base.py')
    config.model.update(
        d_model=1024, n_layer=18, n_head=16, d_head=64, d_inner=4096, dropout=0.2, dropatt=0.2,
        mem_len=384, div_val=4, init_std=0.005, scan_layers=True)
    config.train.update(batch_size=128, tgt_len=384, num_steps=4_000_000, warmup_steps=16_000,
                        eval_every=20_000, checkpoint_every=20_000)
    config.eval.tgt_len = 128
    config.eval.model.update(mem_len=1600, clamp_len=1000, same_length=True)
    return config
