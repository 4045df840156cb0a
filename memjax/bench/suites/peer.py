"""`peer`: memjax against Hugging Face's PyTorch Transformer-XL, same weights, same invocation.

A throughput ratio only means something between two implementations of one model, so the suite
builds the HF `TransfoXLLMHeadModel` first, imports its weights into memjax with
`memjax.convert`, asserts that both have the same number of parameters and that their per-token
log-probs agree over two segments (memory carried) before anything is timed.

What each side is allowed (identical unless stated):
- float32, dropout 0, the same shapes, batch, memory length and vocabulary (a plain softmax and an
  adaptive softmax with `div_val`), memory carried from step to step, plain Adam with one
  learning rate, forward + backward + update per training step.
- torch: `torch.set_num_threads` = the cores XLA's CPU client uses (the process's CPU affinity);
  eager mode, and `torch.compile` (inductor) when the size is 'full' (it compiles for minutes,
  too slow for CI); evaluation under `torch.no_grad`.
- memjax: one jitted step per segment (`memjax.bench.workload`'s training step, the project's
  evaluation step `train_step.eval_step_fn`), parameters, optimizer state and memory donated.
  Evaluation runs the model `memjax.evaluate` runs (the memory as its layers projected it,
  memory='xl_cached': the same log-probs, asserted); `memjax_reprojecting` is the evaluation that
  projects the memory again every segment, as HF and training do.
- Timing: per mode (train, then eval), memjax and every torch variant run round-robin, one timed
  step of each per round (`harness.time_interleaved`), so load from other processes hits all
  alike; each timed step follows an untimed one of the same implementation, so that it is timed
  as in a loop of its own steps, not in the wake of another implementation's threads.
- HF scores T - 1 targets per segment (its labels shift inside the model), memjax all T: both
  sides count tokens/s as batch x tgt_len input tokens, which slightly favours HF.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from memjax import convert
from memjax import model as model_lib
from memjax.model import memories
from memjax.bench import harness
from memjax.bench import workload

LEARNING_RATE = 1e-4
LOGPROB_TOLERANCE = 1e-3  # float32 over a few layers agrees to ~1e-5; a wrong weight shows as O(1).
INSTALL_HINT = "pip install -e '.[parity]'"


@dataclasses.dataclass(frozen=True)
class Shape:
    n_layer: int
    d_model: int
    n_head: int
    d_head: int
    d_inner: int
    tgt_len: int
    mem_len: int
    batch_size: int


@dataclasses.dataclass(frozen=True)
class Vocab:
    name: str
    vocab_size: int
    cutoffs: tuple[int, ...]
    div_val: int


SHAPES = {
    'full': Shape(n_layer=6, d_model=256, n_head=4, d_head=64, d_inner=1024, tgt_len=128, mem_len=128,
                  batch_size=8),
    'tiny': Shape(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, tgt_len=8, mem_len=8, batch_size=2),
}
VOCABS = {
    'full': (Vocab('plain', 256, (), 1), Vocab('adaptive', 10000, (2000, 5000), 2)),
    'tiny': (Vocab('plain', 64, (), 1), Vocab('adaptive', 300, (50, 150), 2)),
}


def import_torch():
    """(torch, transformers), or a BenchError saying how to install them."""
    try:
        import torch  # pylint: disable=g-import-not-at-top
        import transformers  # pylint: disable=g-import-not-at-top
    except ImportError as error:
        raise harness.BenchError(f'the peer suite needs torch and transformers 4.37 ({error}); '
                                 f'install them with {INSTALL_HINT}.') from error
    return torch, transformers


def jax_cpu_cores() -> int:
    """The cores XLA's CPU thread pool spreads over: the ones this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@contextlib.contextmanager
def torch_on_jax_cores():
    """(torch, transformers, threads) with torch's thread count set to the cores XLA's CPU client
    uses, as the sides of a comparison must be; the previous count restored afterwards."""
    torch, transformers = import_torch()
    previous, threads = torch.get_num_threads(), jax_cpu_cores()
    torch.set_num_threads(threads)
    try:
        yield torch, transformers, threads
    finally:
        torch.set_num_threads(previous)


def build_pair(shape: Shape, vocab: Vocab, seed: int = 0, device: str = 'cpu') -> tuple[Any, model_lib.ModelConfig, dict]:
    """A random HF model on torch `device` and the same model in memjax: (hf_model, memjax config,
    memjax params)."""
    torch, transformers = import_torch()
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # TransfoXL is deprecated in transformers 4.37; it still works.
        warnings.simplefilter('ignore')
        hf_config = transformers.TransfoXLConfig(
            vocab_size=vocab.vocab_size, cutoffs=list(vocab.cutoffs), div_val=vocab.div_val,
            d_model=shape.d_model, d_embed=shape.d_model, n_head=shape.n_head, d_head=shape.d_head,
            d_inner=shape.d_inner, n_layer=shape.n_layer, mem_len=shape.mem_len, clamp_len=-1,
            same_length=False, dropout=0.0, dropatt=0.0)
        hf_model = transformers.TransfoXLLMHeadModel(hf_config)
    mcfg = convert.model_config_from_hf(hf_config)
    params = convert.params_from_hf_state_dict(hf_model.state_dict(), mcfg, source='HF peer model')
    return hf_model.to(device), mcfg, jax.tree_util.tree_map(jnp.asarray, params)


def hf_param_count(hf_model) -> int:
    """Parameters of the HF model, a tensor tied under several names counted once."""
    unique = {id(p): p.numel() for _, p in hf_model.named_parameters(remove_duplicate=False)}
    return int(sum(unique.values()))


def memjax_param_count(params) -> int:
    return int(sum(x.size for x in jax.tree_util.tree_leaves(params)))


def random_tokens(vocab_size: int, batch_size: int, length: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab_size, (batch_size, length)).astype(np.int64)


def max_logprob_difference(hf_model, mcfg: model_lib.ModelConfig, params, tokens: np.ndarray,
                           tgt_len: int) -> float:
    """Largest |log p_HF - log p_memjax| of the targets over consecutive segments, memory carried.

    HF predicts inputs[t + 1] from position t (T - 1 targets per segment); memjax's targets are
    given explicitly, so its last position per segment is left out of the comparison.
    """
    torch, _ = import_torch()
    device = next(hf_model.parameters()).device
    segments = (tokens.shape[1] - 1) // tgt_len
    apply = jax.jit(lambda p, x, m, y: model_lib.build_model(mcfg).apply({'params': p}, x, m, targets=y))
    memory, mems, worst = model_lib.init_memory(mcfg, tokens.shape[0]), None, 0.0
    keep_order = hf_model.crit.keep_order
    hf_model.eval()
    hf_model.crit.keep_order = True  # Losses in position order (HF groups them by cluster otherwise).
    try:
        with torch.no_grad():
            for s in range(segments):
                inputs = tokens[:, s * tgt_len:(s + 1) * tgt_len]
                inputs_on_device = torch.as_tensor(inputs, device=device)
                out = hf_model(inputs_on_device, mems=mems, labels=inputs_on_device)
                mems = out.mems
                mj, memory = apply(params, jnp.asarray(inputs, jnp.int32), memory,
                                   jnp.asarray(tokens[:, s * tgt_len + 1:(s + 1) * tgt_len + 1], jnp.int32))
                diff = np.abs(np.asarray(mj.target_logprobs)[:, :-1] + out.losses.float().cpu().numpy()).max()
                worst = max(worst, float(diff))
    finally:
        hf_model.crit.keep_order = keep_order
    return worst


def check_same_model(hf_model, mcfg: model_lib.ModelConfig, params, shape: Shape) -> dict[str, Any]:
    """Asserts equal parameter counts and agreeing log-probs (training's model and evaluation's);
    returns both figures."""
    counts = {'hf_params': hf_param_count(hf_model), 'memjax_params': memjax_param_count(params)}
    if counts['hf_params'] != counts['memjax_params']:
        raise AssertionError(f'the peer models differ: HF has {counts["hf_params"]} parameters, memjax '
                             f'{counts["memjax_params"]}; the importer or the HF config is wrong.')
    tokens = random_tokens(mcfg.vocab_size, shape.batch_size, 2 * shape.tgt_len + 1, seed=1)
    # The trained kind's model and the one evaluation runs (memory='xl_cached') alike.
    diff = max(max_logprob_difference(hf_model, cfg, params, tokens, shape.tgt_len)
               for cfg in {mcfg, memories.evaluation_config(mcfg, {})})
    if not diff < LOGPROB_TOLERANCE:
        raise AssertionError(f'HF and memjax log-probs differ by {diff:.3g} (> {LOGPROB_TOLERANCE}) on the '
                             'same weights; refusing to time two different models.')
    return {**counts, 'max_abs_logprob_diff': diff}


# ----------------------------------------------------------------------------------------------
# The timed loops: each call advances one segment and carries the memory (and the weights).


def torch_autocast(device, dtype: Optional[str]):
    """`torch.autocast` to `dtype` ('bfloat16') on `device`'s kind, or nothing (dtype None): the
    mixed precision PyTorch users train with (float32 weights, bf16 products)."""
    torch, _ = import_torch()
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, dtype))


def _synchronize(device) -> None:
    """Waits for `device`'s queued kernels: a CUDA call returns before its work is done, so a timed
    step ends here (as memjax's ends at `jax.block_until_ready`)."""
    torch, _ = import_torch()
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


class HFTrainLoop:
    """HF forward + backward + Adam on one segment per call, `mems` carried (HF detaches them);
    under `autocast` ('bfloat16') the products run in bf16, weights and Adam in float32."""

    def __init__(self, hf_model, forward: Callable, inputs, autocast: Optional[str] = None):
        torch, _ = import_torch()
        self._model = hf_model
        self._forward = forward
        self._inputs = inputs
        self._autocast = autocast
        self._optimizer = torch.optim.Adam(hf_model.parameters(), lr=LEARNING_RATE)
        self._mems = hf_model.transformer.init_mems(inputs.shape[0])

    def __call__(self) -> None:
        self._model.train()  # Dropout is 0, so train mode computes what eval mode computes.
        with torch_autocast(self._inputs.device, self._autocast):
            out = self._forward(self._inputs, mems=self._mems, labels=self._inputs)
        out.loss.backward()
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._mems = out.mems
        _synchronize(self._inputs.device)


class HFEvalLoop:
    """HF forward with target scores, no gradients, `mems` carried."""

    def __init__(self, hf_model, forward: Callable, inputs, autocast: Optional[str] = None):
        self._model = hf_model
        self._forward = forward
        self._inputs = inputs
        self._autocast = autocast
        self._mems = hf_model.transformer.init_mems(inputs.shape[0])

    def __call__(self) -> None:
        torch, _ = import_torch()
        self._model.eval()
        with torch.no_grad(), torch_autocast(self._inputs.device, self._autocast):
            self._mems = self._forward(self._inputs, mems=self._mems, labels=self._inputs).mems
        _synchronize(self._inputs.device)


def memjax_cases(mcfg: model_lib.ModelConfig, params, tokens: np.ndarray, shape: Shape,
                 reprojecting: bool = True) -> dict[str, workload.Case]:
    """memjax's compiled train and eval steps on the peer's weights and tokens, by mode (a case's
    optimized HLO names the ops the profiler reports). 'eval' is the model `memjax.evaluate` runs,
    'eval_reprojecting' (unless not `reprojecting`) the trained kind's own."""
    inputs = jnp.asarray(tokens[:, :shape.tgt_len], jnp.int32)
    targets = jnp.asarray(tokens[:, 1:shape.tgt_len + 1], jnp.int32)
    tx = optax.adam(LEARNING_RATE)
    work = workload.TrainWorkload(
        mcfg=mcfg, batch_size=shape.batch_size, tgt_len=shape.tgt_len, tx=tx,
        step=workload.train_step_fn(model_lib.build_model(mcfg), tx),
        params=workload.copy_tree(params), opt_state=tx.init(params),
        memory=model_lib.init_memory(mcfg, shape.batch_size),
        batch={'inputs': inputs, 'targets': targets}, key=jax.random.PRNGKey(0))
    cases = {'train': workload.train_case(work)}
    for mode, eval_mcfg in (('eval', memories.evaluation_config(mcfg, {})), ('eval_reprojecting', mcfg))[:1 + reprojecting]:
        cases[mode] = workload.eval_case(eval_mcfg, params, inputs, targets)
    return cases


def time_against_hf(ctx: harness.Context, label: str, ours: dict[str, workload.Case], theirs: dict[str, Callable]
                    ) -> tuple[dict[str, harness.Timing], dict[str, float], dict[str, str]]:
    """memjax's cases and HF's loops of one mode timed round-robin, each timed step after an
    untimed one of its own: (timings, seconds of each one's first call (memjax's: its compile),
    errors). An HF variant whose first call fails (torch.compile's failures vary) is left out, its
    error in `errors`; eager HF's failure is raised."""
    calls = {name: case.loop for name, case in ours.items()}
    first_s, errors = {name: case.compiled.total_s for name, case in ours.items()}, {}
    for call in calls.values():
        first_call_seconds(call)
    for impl, call in theirs.items():
        ctx.log(f'{label} {impl}: first call')
        try:
            first_s[impl] = first_call_seconds(call)
        except Exception as error:  # pylint: disable=broad-except
            if impl == 'hf_eager':
                raise
            errors[impl] = f'{type(error).__name__}: {str(error)[:300]}'
            continue
        calls[impl] = call
    ctx.log(f'{label}: timing {", ".join(calls)} interleaved')
    timings = harness.time_interleaved(calls, warmup=max(ctx.warmup - 1, 0), repeats=ctx.repeats, settle=1)
    return timings, first_s, errors


def _criterion_in_float32(hf_model) -> None:
    """Runs HF's softmax layer outside autocast on float32 hidden states. CPU autocast leaves its
    log_softmax in bf16, which HF's loss cannot write into its float32 buffer (CUDA autocast takes
    log_softmax to float32 itself, so there the model runs unpatched)."""
    torch, _ = import_torch()
    crit = hf_model.crit
    if getattr(crit, 'memjax_float32', False):
        return
    original = crit.forward

    def forward(hidden, labels=None, *args, **kwargs):
        with torch.autocast(hidden.device.type, enabled=False):
            return original(hidden.float(), labels, *args, **kwargs)

    crit.forward, crit.memjax_float32 = forward, True


def hf_loops(hf_model, forward: Callable, tokens: np.ndarray, shape: Shape,
             autocast: Optional[str] = None) -> dict[str, Any]:
    torch, _ = import_torch()
    inputs = torch.as_tensor(tokens[:, :shape.tgt_len], device=next(hf_model.parameters()).device)
    if autocast and inputs.device.type == 'cpu':
        _criterion_in_float32(hf_model)
    return {'train': HFTrainLoop(hf_model, forward, inputs, autocast),
            'eval': HFEvalLoop(hf_model, forward, inputs, autocast)}


def first_call_seconds(loop: Callable) -> float:
    """Seconds of one call: for torch.compile the first call is the compile."""
    start = time.perf_counter()
    jax.block_until_ready(loop())
    return time.perf_counter() - start


def with_torch_threads(loop: Callable, threads: int) -> Callable:
    """`loop` run with torch using `threads` threads (impls differ, and they are interleaved)."""
    torch, _ = import_torch()

    def call():
        torch.set_num_threads(threads)
        return loop()

    return call


def _row(vocab: Vocab, mode: str, impl: str, timing: harness.Timing, tokens: int, compile_s) -> dict[str, Any]:
    return {'vocab': vocab.name, 'mode': mode, 'impl': impl, 'median_ms': timing.median_s * 1e3,
            'tokens_per_s': tokens / timing.median_s, 'compile_s': compile_s, 'timing': timing.as_dict()}


def measure_vocab(vocab: Vocab, shape: Shape, ctx: harness.Context, try_compile: bool) -> dict[str, Any]:
    """Checks one vocabulary variant and times every implementation on it."""
    torch, _ = import_torch()
    ctx.log(f'peer: {vocab.name} softmax: building HF model, importing, checking log-probs')
    hf_model, mcfg, params = build_pair(shape, vocab)
    check = check_same_model(hf_model, mcfg, params, shape)
    tokens = random_tokens(vocab.vocab_size, shape.batch_size, shape.tgt_len + 1, seed=2)
    tokens_per_step = shape.batch_size * shape.tgt_len
    rows, errors = [], {}

    cases = memjax_cases(mcfg, params, tokens, shape)
    threads = torch.get_num_threads()  # Set back at the end: the 1-thread variant changes it.
    # One thread too: on a shared machine torch's OpenMP threads can stall each other for seconds
    # when the cores are oversubscribed, which the 2-thread rows alone would hide.
    impls = {'hf_eager': (hf_model, threads), 'hf_eager_1thread': (hf_model, 1)}
    if try_compile:
        impls['hf_compiled'] = (torch.compile(hf_model), threads)
    theirs = {impl: hf_loops(hf_model, forward, tokens, shape) for impl, (forward, _) in impls.items()}
    memjax_sides = {'train': {'memjax': cases['train']},
                    'eval': {'memjax': cases['eval'], 'memjax_reprojecting': cases['eval_reprojecting']}}
    for mode, sides in memjax_sides.items():
        timings, first_s, failed = time_against_hf(
            ctx, f'peer: {vocab.name} {mode}', sides,
            {impl: with_torch_threads(theirs[impl][mode], impl_threads) for impl, (_, impl_threads) in impls.items()})
        errors.update({f'{impl}_{mode}': error for impl, error in failed.items()})
        # An HF first call is a compile for torch.compile only; memjax's compile is its own.
        compile_s = {impl: seconds if impl in sides or impl == 'hf_compiled' else None
                     for impl, seconds in first_s.items()}
        rows += [_row(vocab, mode, impl, timing, tokens_per_step, compile_s[impl])
                 for impl, timing in timings.items()]
    torch.set_num_threads(threads)

    for row in rows:
        ours = next(r for r in rows if r['mode'] == row['mode'] and r['impl'] == 'memjax')
        row['memjax_speedup'] = ours['tokens_per_s'] / row['tokens_per_s']
        row.update(vocab_size=vocab.vocab_size, **{k: v for k, v in check.items() if k != 'hf_params'})
    return {'rows': rows, 'check': check, 'errors': errors, 'mcfg': dataclasses.asdict(mcfg)}


@harness.register('peer')
def run(ctx: harness.Context) -> harness.SuiteResult:
    shape, try_compile = SHAPES[ctx.size], not ctx.tiny
    with torch_on_jax_cores() as (torch, transformers, threads):
        results = [measure_vocab(vocab, shape, ctx, try_compile) for vocab in VOCABS[ctx.size]]

    rows = [row for result in results for row in result['rows']]
    figures = {'torch_threads': threads, 'jax_cpu_cores': threads}
    for row in rows:
        if row['impl'] != 'memjax':
            figures[f'memjax_over_{row["impl"]}_{row["mode"]}_{row["vocab"]}'] = row['memjax_speedup']
    for result, vocab in zip(results, VOCABS[ctx.size]):
        figures[f'params_{vocab.name}'] = result['check']['memjax_params']
        figures[f'max_abs_logprob_diff_{vocab.name}'] = result['check']['max_abs_logprob_diff']
    errors = {f'{vocab.name}_{k}': v for result, vocab in zip(results, VOCABS[ctx.size])
              for k, v in result['errors'].items()}
    notes = [
        f'torch {torch.__version__}, transformers {transformers.__version__}, torch.set_num_threads({threads}) '
        f'= the {threads} CPU cores XLA uses (hf_eager_1thread: 1 thread, a check against OpenMP stalls on a '
        f'loaded machine); float32, dropout 0, Adam lr {LEARNING_RATE} on both sides.',
        'Same weights: HF model imported into memjax; parameter counts asserted equal (HF tied tensors '
        f'counted once) and per-token log-probs checked to agree within {LOGPROB_TOLERANCE} before timing.',
        'HF scores T-1 targets per segment (its label shift), memjax T; tokens/s = batch x tgt_len on both.',
        'memjax_speedup = memjax tokens/s / this row\'s tokens/s (same mode, same vocabulary, same invocation).',
        'compile_s: memjax = lower + compile (AOT); hf_compiled = its first call (torch.compile compiles '
        'there, plus one step; inductor\'s on-disk cache shortens it on re-runs); hf_eager has none.',
    ]
    if not try_compile:
        notes.append('torch.compile not tried at --size=tiny (it compiles for minutes); run --size=full.')
    for name, error in errors.items():
        notes.append(f'torch.compile failed for {name}: {error}')
    if ctx.config is not None:
        notes.append('--config is ignored: the peer shapes are fixed so that both sides build the same model.')
    return harness.SuiteResult(
        rows=rows,
        columns=('vocab', 'mode', 'impl', 'median_ms', 'tokens_per_s', 'memjax_speedup', 'compile_s'),
        figures=figures,
        config={'shape': dataclasses.asdict(shape), 'vocabs': [dataclasses.asdict(v) for v in VOCABS[ctx.size]],
                'memjax_model_configs': [r['mcfg'] for r in results], 'learning_rate': LEARNING_RATE,
                'dtype': 'float32', 'torch_threads': threads, 'torch_compile_tried': try_compile,
                'torch_compile_errors': errors},
        notes=notes)
