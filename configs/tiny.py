"""A model small enough for unit tests: seconds to compile and run on one CPU core."""

from memjax import config_lib


def get_config():
    config = config_lib.base_config()
    config.model.update(d_model=32, n_layer=2, n_head=2, d_head=16, d_inner=64, mem_len=8,
                        dropout=0.1)
    config.train.update(batch_size=4, tgt_len=8, segments_per_step=2, num_steps=8,
                        learning_rate=1e-3, warmup_steps=2, log_every=2, eval_every=4,
                        eval_batches=2, checkpoint_every=4, keep_checkpoints=3)
    config.eval.update(batch_size=2)
    return config
