"""`programs`: a fingerprint of each compiled train and eval step, to show a refactor changed none.

A refactor that leaves the optimized program of a step unchanged cannot have changed its speed
or its numbers on that machine. For each memory kind (and Transformer-XL with an adaptive
softmax, and with Skip-Retain and cross-head attention) the suite builds the steps exactly as
training does (`training.experiment.setup`, `make_train_step`, `make_eval_step` on a small model),
compiles them and hashes the optimized HLO with its source locations (file names, lines,
stack frames, op metadata) removed: they move with every edited line, the program does not.
Run it before and after a change on the same machine and jax version; equal fingerprints are
the same programs.
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp

from memjax import config_lib
from memjax import model as model_lib
from memjax.bench import harness
from memjax.bench import hlo
from memjax.training import experiment

# Model field overrides of each case over the small model below.
CASES = {
    'xl': {},
    'xl_adaptive': dict(cutoffs=(64, 128), div_val=2),
    'lamemo': dict(memory='lamemo'),
    'infinity': dict(memory='infinity', ltm_basis=32, ltm_samples=16),
    'xl_skip_cross_head': dict(skip_rule='linear', sch_beta=0.1),
}
SHAPE = dict(d_model=64, n_layer=2, n_head=4, d_head=16, d_inner=128, mem_len=16, dropout=0.1)
TINY_SHAPE = dict(d_model=16, n_layer=2, n_head=2, d_head=8, d_inner=32, mem_len=8, dropout=0.1)


def _experiment(overrides: dict, shape: dict, batch: int, tgt_len: int, workdir: str) -> experiment.Experiment:
    config = config_lib.base_config()
    config.model.update(**shape, **overrides)
    config.train.update(batch_size=batch, tgt_len=tgt_len)
    return experiment.setup(config, workdir)


def lowered_steps(exp: experiment.Experiment) -> dict[str, jax.stages.Lowered]:
    """The run's train and eval steps lowered as training builds them, on abstract inputs of the
    run's shapes (nothing is initialised or run)."""
    state, memory = experiment.abstract_state(exp)
    run = exp.run

    def batch_of(segments: int, rows: int, length: int) -> dict:
        shaped = lambda dtype: jax.ShapeDtypeStruct((segments, rows, length), dtype)
        return {'inputs': shaped(jnp.int32), 'targets': shaped(jnp.int32), 'mask': shaped(jnp.float32),
                'reset': jax.ShapeDtypeStruct((segments, rows), bool)}

    eval_rows = run.eval.batch_size
    eval_memory = jax.eval_shape(lambda: model_lib.init_memory(exp.eval_mcfg, eval_rows))
    return {
        'train': experiment.make_train_step(exp).lower(
            state, memory, batch_of(run.train.segments_per_step, run.train.batch_size, run.train.tgt_len)),
        'eval': experiment.make_eval_step(exp).lower(state.params, eval_memory, batch_of(1, eval_rows, run.eval.tgt_len),
                                                  jax.ShapeDtypeStruct((2,), jnp.uint32)),
    }


def fingerprints(overrides: dict, shape: dict, batch: int = 4, tgt_len: int = 16) -> dict[str, dict]:
    """{'train': {...}, 'eval': {...}}: each step's fingerprint and size, for one model."""
    out = {}
    with tempfile.TemporaryDirectory(prefix='memjax-bench-programs-') as workdir:  # The setup's tokenizer.
        steps = lowered_steps(_experiment(overrides, shape, batch, tgt_len, workdir))
    for name, program in steps.items():
        text = hlo.program_text(program.compile())
        out[name] = {'fingerprint': hlo.fingerprint(text),
                     'instructions': sum(1 for line in text.splitlines() if ' = ' in line)}
    return out


@harness.register('programs')
def run(ctx: harness.Context) -> harness.SuiteResult:
    shape = TINY_SHAPE if ctx.tiny else SHAPE
    rows = []
    for case, overrides in CASES.items():
        ctx.log(f'programs: {case}')
        for step, found in fingerprints(overrides, shape).items():
            rows.append({'case': case, 'step': step, **found})
    return harness.SuiteResult(
        rows=rows, columns=('case', 'step', 'fingerprint', 'instructions'),
        figures={f'{r["case"]}/{r["step"]}': r['fingerprint'] for r in rows},
        config={'model': shape, 'cases': {k: dict(v) for k, v in CASES.items()}, 'batch': 4, 'tgt_len': 16,
                'jax': jax.__version__},
        notes=['Equal fingerprints on the same machine and jax version are the same compiled programs.'])
