"""Byte-level Transformer-XL on the embedded corpus: trains on a 2-core CPU in minutes.

Measured in docs/training.md ("Quickstart"): about 1.77 validation bits per byte; the job alone took
1 min 54 s (AMD EPYC Zen 5) to about 9 minutes (AVX2-only AMD EPYC) on 2 idle cores, by CPU kind.
Small and without dropout, since it sees each training byte about once.
"""

from memjax import config_lib


def get_config():
    config = config_lib.base_config()
    config.data.update(name='embedded', tokenizer='byte')
    config.model.update(d_model=128, n_layer=4, n_head=4, d_head=32, d_inner=512, mem_len=64,
                        dropout=0.0, dropatt=0.0)
    config.train.update(batch_size=16, tgt_len=64, segments_per_step=10, num_steps=4000,
                        learning_rate=1e-3, warmup_steps=100, min_lr_ratio=0.1, clip_norm=1.0,
                        log_every=200, eval_every=2000, eval_batches=20,
                        checkpoint_every=2000, keep_checkpoints=2)
    return config
