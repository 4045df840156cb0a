"""24-layer Transformer-XL on enwik8 (277M parameters; paper: 0.99 test bpc).

24 layers, d_model 1024, 8 heads x 128, d_inner 3072, dropout = dropatt = 0.15,
tgt = mem = 768 (the reference scripts'; the paper says 784), batch 64, Adam 2.5e-4 with 4k warmup
steps, 400k steps, clip 0.25, init std 0.02 (neither reference script sets another). Evaluation:
tgt 128, mem 3800, clamp 1000, same_length (attention length 3800 in the paper), batch 10.
The layers are scanned (`scan_layers`): XLA compiles one layer instead of 24, a third of the
compile time (BENCHMARKS.md, accelerators); parameters stack under params['layers']. A run started unscanned resumes with
--config.model.scan_layers=False; evaluation reads either layout.
"""

from memjax import config_lib


def get_config():
    config = config_lib.sibling_config(__file__, 'transformer_xl_enwik8_base.py')
    config.model.update(
        d_model=1024, n_layer=24, n_head=8, d_head=128, d_inner=3072, dropout=0.15,
        dropatt=0.15, mem_len=768, scan_layers=True)
    config.train.update(batch_size=64, tgt_len=768, warmup_steps=4000)
    config.eval.tgt_len = 128
    config.eval.model.update(mem_len=3800, clamp_len=1000, same_length=True)
    return config
