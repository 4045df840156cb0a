"""The infinity-former's sorting task (paper section 4.1, figure 3), generated on the fly.

  python -m memjax.train --config=configs/inftyformer_sorting.py:8000 --workdir=runs/sort8000
  python -m memjax.train --config=configs/inftyformer_sorting.py:8000,xl --workdir=runs/sort8000_xl

The argument is the sequence length (4000, 8000 or 16000 in the paper; any length works) and
optionally 'xl': the same task with a plain Transformer-XL whose memory has the same size as the
infinity-former's two (2048), the paper's baseline. Give the length here, not as
--config.data.sort_length: the schedule (segments per dispatch, steps, evaluation and checkpoint
intervals, learning rate) follows from it. The loss,
the validation loss and the accuracy (config.eval.accuracy) are on the 20 answer tokens; every
earlier segment only builds memory.

Paper setting (section 4.1, appendix C.1): 3 layers, 6 heads, input 1024; infinity-former: STM
1024 + LTM of N = 1024 Gaussian RBFs (widths 0.01, 0.05), tau 0.75, ridge 1.0, lambda_KL 1e-5 with
sigma_0 0.05, variance floor 1e-6, memory started afresh for every sequence; Transformer-XL: memory
2048. 8,000 training sequences, batch 8, 20 epochs, Adam at 2.5e-4 (2e-4 for 16,000), cosine to 0.
The paper gives no widths: d_model 300 (50 per head) and d_inner 300 are the released sorting
script's (which fits N = 512 at 512 points; memjax keeps the paper's N and fits at N points).
docs/paper_configs.md lists every field against the paper and the code.
"""

from memjax import config_lib


def get_config(arg: str = '8000'):
    options = [a for a in arg.split(',') if a]
    lengths = [int(a) for a in options if a.isdigit()]
    unknown = [a for a in options if not a.isdigit() and a != 'xl']
    if unknown or len(lengths) > 1:
        raise ValueError(f'configs/inftyformer_sorting.py: the argument is LENGTH[,xl], got {arg!r}.')
    length = lengths[0] if lengths else 8000
    config = config_lib.base_config()
    config.data.update(name='sorting', tokenizer='sorting', sort_length=length, sort_train_sequences=8000,
                       sort_validation_sequences=800, sort_test_sequences=800)
    config.model.update(
        memory='infinity', d_model=300, n_layer=3, n_head=6, d_head=50, d_inner=300, dropout=0.1,
        dropatt=0.0, mem_len=1024, ltm_basis=1024, ltm_widths=(0.01, 0.05), ltm_ridge=1.0, ltm_tau=0.75,
        ltm_reset_tokens=0, ltm_min_variance=1e-6, ltm_kl_sigma=0.05,
        # The paper's lambda_KL 1e-5 weighs the KL averaged over the answer segment's 1024 positions;
        # memjax divides the KL summed over them by the 20 scored tokens instead.
        ltm_kl_weight=1e-5 * 20 / 1024)
    if 'xl' in options:
        config.model.update(memory='xl', mem_len=2048)
    tgt_len = 1024
    # One dispatch per sequence (its answer ends the last segment). As in the reference, every segment
    # is an optimizer update, and only the answer's has a gradient (the others build memory).
    segments = -(-(length + 21) // tgt_len)
    sequences_per_epoch = 8000 // 8
    config.train.update(
        batch_size=8, tgt_len=tgt_len, segments_per_step=segments, num_steps=20 * sequences_per_epoch * segments,
        learning_rate=2e-4 if length > 8000 else 2.5e-4, warmup_steps=0, min_lr_ratio=0.0, clip_norm=0.25,
        log_every=100 * segments, eval_every=sequences_per_epoch * segments, eval_batches=-1,
        checkpoint_every=sequences_per_epoch * segments)
    config.eval.accuracy = True
    return config
