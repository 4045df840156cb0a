"""`eval-speed`: the Transformer-XL paper's Table 7 on this machine.

Per-token evaluation time of Transformer-XL with state reuse against a vanilla Transformer that,
as Al-Rfou et al. (2018) evaluate, recomputes its whole window for every predicted token: for
token t+1 it runs over the last L tokens with no memory and keeps the last position's log-prob.

Both sides are the same memjax model (same weights, same relative positions), so the ratio
isolates state reuse. The attention length is matched per predicted token: the vanilla window
makes its last position attend L keys; XL runs with `mem_len = L` and `same_length=True`, so
every query of a segment attends exactly L keys (its memory part cached, not recomputed).
The vanilla per-token cost does not depend on which token is predicted, so a few windows are
timed, not a whole stream.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from memjax import model as model_lib
from memjax.bench import harness
from memjax.bench import workload

PAPER_SPEEDUP = {3800: 1874, 2800: 1409, 1800: 773, 800: 363}  # Table 7, one GPU.


@dataclasses.dataclass(frozen=True)
class Setup:
    attn_lens: tuple[int, ...]
    tgt_len: int  # XL segment length: tokens predicted per XL call and stream.
    batch_size: int  # Streams (XL) / windows (vanilla) per call, equal on both sides.
    model: dict  # ModelConfig fields.


SETUPS = {
    'full': Setup(attn_lens=(200, 400, 800), tgt_len=128, batch_size=4, model=dict(
        vocab_size=256, n_layer=6, d_model=256, n_head=4, d_head=64, d_inner=1024)),
    'tiny': Setup(attn_lens=(12, 24), tgt_len=4, batch_size=2, model=dict(
        vocab_size=64, n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64)),
}


# ----------------------------------------------------------------------------------------------
# The two evaluators.


def xl_config(mcfg: model_lib.ModelConfig, attn_len: int) -> model_lib.ModelConfig:
    """XL evaluation where every query attends exactly `attn_len` keys (memory + itself)."""
    return mcfg.replace(mem_len=attn_len, same_length=True, clamp_len=-1)


def vanilla_config(mcfg: model_lib.ModelConfig) -> model_lib.ModelConfig:
    """The same model without memory: each window is a fresh context."""
    return mcfg.replace(mem_len=0, same_length=False, clamp_len=-1)


def vanilla_step_fn(mcfg: model_lib.ModelConfig) -> Callable:
    """`(params, windows [B, L], targets [B]) -> log p(targets | windows) [B]`, unjitted.

    The body runs over the whole window (that is the baseline's cost); the softmax only for
    the last position, the only prediction the window is used for.
    """
    model = model_lib.build_model(vanilla_config(mcfg))

    def step(params, windows, targets):
        memory = model_lib.init_memory(model.config, windows.shape[0])
        out, _ = model.apply({'params': params}, windows, memory)
        logprobs = model.apply({'params': params}, out.hidden[:, -1:], method=model_lib.MemoryLM.logprobs)
        return jnp.take_along_axis(logprobs[:, 0], targets[:, None], axis=-1)[:, 0]

    return step


@functools.lru_cache(maxsize=None)
def _jitted_vanilla_step(mcfg: model_lib.ModelConfig) -> Callable:
    return jax.jit(vanilla_step_fn(mcfg))  # One per config: each window length compiles once.


def sliding_window_logprobs(mcfg: model_lib.ModelConfig, params, tokens: np.ndarray, window: int) -> np.ndarray:
    """log p(tokens[:, t + 1] | the last `window` tokens up to t) for every t: [B, N - 1].

    Early tokens see their whole (shorter) history: the baseline starts like XL's empty memory.
    """
    step = _jitted_vanilla_step(mcfg)
    columns = [step(params, jnp.asarray(tokens[:, max(0, t + 1 - window):t + 1]), jnp.asarray(tokens[:, t + 1]))
               for t in range(tokens.shape[1] - 1)]
    return np.stack([np.asarray(c) for c in columns], axis=1)


def xl_logprobs(mcfg: model_lib.ModelConfig, params, tokens: np.ndarray, tgt_len: int) -> np.ndarray:
    """Target log-probs of consecutive segments with the memory carried: [B, N - 1]."""
    model = model_lib.build_model(mcfg)
    apply = jax.jit(lambda p, x, m, y: model.apply({'params': p}, x, m, targets=y))
    memory, columns = model_lib.init_memory(mcfg, tokens.shape[0]), []
    for start in range(0, tokens.shape[1] - 1, tgt_len):
        stop = min(start + tgt_len, tokens.shape[1] - 1)
        out, memory = apply(params, jnp.asarray(tokens[:, start:stop]), memory,
                            jnp.asarray(tokens[:, start + 1:stop + 1]))
        columns.append(np.asarray(out.target_logprobs))
    return np.concatenate(columns, axis=1)


# ----------------------------------------------------------------------------------------------
# The suite.


def measure(mcfg: model_lib.ModelConfig, params, setup: Setup, attn_len: int,
            ctx: harness.Context) -> dict[str, Any]:
    """Per-token seconds of both evaluators at one attention length."""
    rng = np.random.RandomState(attn_len)
    batch, tgt = setup.batch_size, setup.tgt_len
    segment = jnp.asarray(rng.randint(0, mcfg.vocab_size, (batch, tgt + 1)), jnp.int32)
    # The memory carried until it is full, so the timed segments attend real (valid) keys.
    xl_case = workload.eval_case(xl_config(mcfg, attn_len), params, segment[:, :-1], segment[:, 1:]).fill(attn_len, tgt)
    xl = xl_case.time_alone(ctx)

    windows = jnp.asarray(rng.randint(0, mcfg.vocab_size, (batch, attn_len)), jnp.int32)
    targets = jnp.asarray(rng.randint(0, mcfg.vocab_size, (batch,)), jnp.int32)
    vanilla_compiled, vanilla = harness.compile_and_time(vanilla_step_fn(mcfg), params, windows, targets, ctx=ctx)

    xl_per_token = xl.median_s / (batch * tgt)
    vanilla_per_token = vanilla.median_s / batch
    return {'attn_len': attn_len, 'xl_mem_len': attn_len, 'xl_tgt_len': tgt,
            'xl_us_per_token': xl_per_token * 1e6, 'vanilla_us_per_token': vanilla_per_token * 1e6,
            'speedup': vanilla_per_token / xl_per_token, 'paper_speedup': PAPER_SPEEDUP.get(attn_len),
            'xl_compile_s': xl_case.compiled.total_s,
            'vanilla_compile_s': vanilla_compiled.total_s,
            'xl_timing': xl.as_dict(), 'vanilla_timing': vanilla.as_dict()}


@harness.register('eval-speed')
def run(ctx: harness.Context) -> harness.SuiteResult:
    setup = SETUPS[ctx.size]
    mcfg = model_lib.ModelConfig(**setup.model, dropout=0.0, dropatt=0.0)
    params = model_lib.init_params(mcfg, jax.random.PRNGKey(0))
    rows = []
    for attn_len in setup.attn_lens:
        ctx.log(f'eval-speed: attention length {attn_len}')
        rows.append(measure(mcfg, params, setup, attn_len, ctx))
    notes = [
        'Same memjax model and weights on both sides, float32. Attention length L matched per predicted '
        'token: vanilla = window of L tokens, no memory, last position scored (one prediction per window '
        'and row); XL = mem_len L with same_length, every query attends exactly L keys, '
        f'{setup.tgt_len} predictions per segment and row.',
        f'Both sides run {setup.batch_size} rows per call; per-token time = median call time / predictions.',
        'paper_speedup: Transformer-XL paper Table 7 (one GPU, its own model sizes), for reference.',
    ]
    if ctx.config is not None:
        notes.append('--config is ignored: the model is fixed so that the table is comparable across runs.')
    return harness.SuiteResult(
        rows=rows,
        columns=('attn_len', 'xl_mem_len', 'xl_tgt_len', 'xl_us_per_token', 'vanilla_us_per_token', 'speedup',
                 'paper_speedup'),
        figures={f'speedup_at_{row["attn_len"]}': row['speedup'] for row in rows},
        config={'model': dataclasses.asdict(mcfg), 'batch_size': setup.batch_size, 'xl_tgt_len': setup.tgt_len,
                'attn_lens': list(setup.attn_lens), 'dtype': 'float32'},
        notes=notes)
