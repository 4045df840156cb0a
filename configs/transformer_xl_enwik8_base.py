"""12-layer Transformer-XL on enwik8 (41M parameters; paper: 1.06 test bpc).

12 layers, d_model 512, 8 heads x 64, d_inner 2048, dropout 0.1, tgt = mem = 512, batch 22,
Adam 2.5e-4, cosine to 0 over 400k steps, clip 0.25, byte vocabulary, plain softmax.
Evaluation as in the reference script: tgt 80, mem 2100, clamp 820, same_length, batch 10 (its
eval.py's; on a mesh whose data x fsdp does not divide 10, set --config.eval.batch_size).
"""

from memjax import config_lib


def get_config():
    config = config_lib.base_config()
    config.data.update(name='enwik8', tokenizer='byte', drop_bytes=(10,))
    config.model.update(
        d_model=512, n_layer=12, n_head=8, d_head=64, d_inner=2048, dropout=0.1, dropatt=0.0,
        mem_len=512)
    config.train.update(
        batch_size=22, tgt_len=512, num_steps=400_000, learning_rate=2.5e-4, warmup_steps=0,
        min_lr_ratio=0.0, clip_norm=0.25, log_every=200, eval_every=4000, eval_batches=-1,
        checkpoint_every=4000)
    config.eval.update(tgt_len=80, batch_size=10)
    config.eval.model.update(mem_len=2100, clamp_len=820, same_length=True)
    return config
