"""`adaptive-softmax`: training-step cost of an adaptive softmax as the share of tail targets grows.

On one CPU device memjax's kernel scores a tail cluster only at the positions whose target falls
in it (`memjax.model.adaptive`), so on real text, where most targets are frequent words, a step
should cost little more than the head alone, and no [tokens x tail vocabulary] logit matrix is ever
held. (Elsewhere XLA scores every position in chunks, with no branch: there the cost does not depend
on the targets.)
The suite compiles one training step with a WikiText-103-sized vocabulary, then times it on batches
whose targets fall in the tail clusters at a chosen rate, and reports XLA's planned temporaries
beside the size one full tail-logit matrix would have.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from memjax.bench import harness
from memjax.bench import workload

TAIL_SHARES = (0.0, 0.1, 0.35, 1.0)  # Real WikiText-103 text puts ~10 % of targets past 20k.
FULL = dict(model=dict(vocab_size=267735, cutoffs=(20000, 40000, 200000), div_val=4, d_model=256,
                       d_embed=256, n_layer=2, n_head=4, d_head=64, d_inner=1024),
            batch=8, seq=128)
TINY = dict(model=dict(vocab_size=300, cutoffs=(50, 150), div_val=2, d_model=16, d_embed=16, n_layer=1,
                       n_head=2, d_head=8, d_inner=32),
            batch=2, seq=8)


def targets_with_tail_share(vocab_size: int, shortlist: int, shape: tuple[int, int], share: float,
                            seed: int) -> np.ndarray:
    """Targets uniform over the head, except a `share` of positions uniform over the tail."""
    rng = np.random.RandomState(seed)
    head = rng.randint(0, shortlist, shape)
    tail = rng.randint(shortlist, vocab_size, shape)
    return np.where(rng.rand(*shape) < share, tail, head).astype(np.int32)


@harness.register('adaptive-softmax')
def run(ctx: harness.Context) -> harness.SuiteResult:
    setting = TINY if ctx.tiny else FULL
    batch, seq = setting['batch'], setting['seq']
    mcfg = workload.model_config(ctx.config, mem_len=seq, dropout=0.0, **setting['model'])
    shortlist = mcfg.cutoffs[0]
    ctx.log(f'adaptive-softmax: compiling (vocabulary {mcfg.vocab_size}, cutoffs {mcfg.cutoffs})')
    work = workload.build(mcfg, batch, seq, ctx.config)
    case = workload.train_case(work)  # Compiled once; each share runs it on a copy of the state.
    temp_mib = case.compiled.memory()['temp_size_bytes'] / harness.MIB
    full_tail_mib = batch * seq * (mcfg.vocab_size - shortlist) * 4 / harness.MIB

    rows = []
    for i, share in enumerate(TAIL_SHARES):
        targets = targets_with_tail_share(mcfg.vocab_size, shortlist, (batch, seq), share, seed=i)
        inputs = np.roll(targets, 1, axis=1)
        fresh = workload.copy_state(work)
        fresh.batch = {'inputs': jnp.asarray(inputs), 'targets': jnp.asarray(targets)}
        ctx.log(f'adaptive-softmax: {share:.0%} of targets in the tail')
        shared = case.on(fresh)
        timing = shared.time_alone(ctx)
        rows.append({'tail_share': share, 'measured_tail_share': float((targets >= shortlist).mean()),
                     **shared.figures(timing), 'temp_mib': temp_mib, 'full_tail_logits_mib': full_tail_mib})
    for row in rows:
        row['time_vs_no_tail'] = row['step_ms'] / rows[0]['step_ms']
    return harness.SuiteResult(
        rows=rows,
        columns=('tail_share', 'measured_tail_share', 'step_ms', 'tokens_per_s', 'time_vs_no_tail',
                 'temp_mib', 'full_tail_logits_mib'),
        figures={'temp_mib': temp_mib, 'full_tail_logits_mib': full_tail_mib,
                 'compile_s': case.compiled.compile_s,
                 **{f'time_tail_{row["tail_share"]:g}_vs_no_tail': row['time_vs_no_tail'] for row in rows}},
        config={'model': setting['model'], 'batch': batch, 'tgt_len': seq, 'mem_len': seq,
                'dtype': mcfg.compute_dtype, 'step': 'the train suite\'s step, compiled once, dropout 0',
                'targets': 'uniform over the head, a tail_share of positions uniform over the tail'},
        notes=['full_tail_logits_mib: one float32 [tokens, vocabulary - first cutoff] matrix, what '
               'scoring every tail cluster at every position would hold (before its backward copies).'])
