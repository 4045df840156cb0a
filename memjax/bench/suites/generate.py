"""`generate`: tokens/s of generation, incremental against re-running the segment, and against HF.

For two models with the same weights on both sides, a Transformer-XL (HF `TransfoXLLMHeadModel`,
adaptive softmax) and a GPT-2 (HF `GPT2LMHeadModel`, memjax memory 'none' over one window), each
implementation continues the same random prompt greedily, at batch 1 and batch 8:

- memjax: `memjax.generation.sample` (one jitted step per token over the cached keys; the segment
  runs whole once at its start and once at its end);
- memjax_rerun: the same model re-running the whole current segment for every token (what a
  decoder without a key cache does), then taking the token's position;
- hf: `generate(do_sample=False)` (Transformer-XL: `mems` carried, the memory re-projected every
  token; GPT-2: its key/value cache).
The prompt is one segment; the continuation crosses segment boundaries. tokens/s counts the new
tokens of every row, the prompt's processing included in the time on every side. memjax and its
re-run must choose the same tokens; GPT-2's must equal HF's (the same computation); HF
Transformer-XL's memory slides by one token per step instead of by segments, so only its first
token is compared.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memjax import model as model_lib
from memjax.bench import harness
from memjax.bench.suites import peer
from memjax.convert import hf_gpt2
from memjax.generation import Sampling, sample
from memjax.generation import sampling as sampling_lib


@dataclasses.dataclass(frozen=True)
class Setup:
    shape: peer.Shape  # tgt_len: the segment (and the prompt); batch_size unused (BATCHES).
    vocab: peer.Vocab
    new_tokens: int
    batches: tuple[int, ...]


SETUPS = {
    'full': Setup(peer.Shape(n_layer=6, d_model=256, n_head=4, d_head=64, d_inner=1024, tgt_len=64, mem_len=64,
                             batch_size=1), peer.Vocab('adaptive', 10000, (2000, 5000), 2), new_tokens=128,
                  batches=(1, 8)),
    'tiny': Setup(peer.Shape(n_layer=2, d_model=32, n_head=2, d_head=16, d_inner=64, tgt_len=8, mem_len=8,
                             batch_size=1), peer.Vocab('adaptive', 300, (50, 150), 2), new_tokens=12,
                  batches=(1, 2)),
}
GREEDY = Sampling(temperature=0)


def build_gpt2(shape: peer.Shape, vocab: peer.Vocab, window: int, seed: int = 0):
    """A random HF GPT-2 of the Transformer-XL's width and the same model in memjax ('none' memory,
    one segment of `window` positions)."""
    torch, transformers = peer.import_torch()
    torch.manual_seed(seed)
    hf_config = transformers.GPT2Config(vocab_size=vocab.vocab_size, n_positions=window, n_embd=shape.d_model,
                                        n_layer=shape.n_layer, n_head=shape.n_head, n_inner=shape.d_inner,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    hf_model = transformers.GPT2LMHeadModel(hf_config).eval()
    mcfg = hf_gpt2.model_config_from_hf(hf_config).replace(dropout=0.0, dropatt=0.0, segment_len=window)
    params = hf_gpt2.params_from_hf_state_dict(hf_model.state_dict(), mcfg, source='HF peer GPT-2')
    return hf_model, mcfg, jax.tree_util.tree_map(jnp.asarray, params)


@functools.lru_cache(maxsize=4)
def _segment_programs(model):
    hidden = jax.jit(lambda p, x, m: model.apply({'params': p}, x, m)[0].hidden)
    advance = jax.jit(lambda p, x, m: model.apply({'params': p}, x, m)[1])
    choose = jax.jit(lambda p, h: sampling_lib.choose(
        functools.partial(model.apply, {'params': p}, method=model.cluster_logprobs), model.config, h,
        jax.random.key(0), GREEDY)[0])
    return hidden, advance, choose


def rerun_generate(model, params, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy continuation that runs the whole current segment for every token (no key cache);
    a segment joins the memory once the text has moved past it, as in `Decoder`."""
    seg = model.config.segment_len
    hidden_fn, advance_fn, choose_fn = _segment_programs(model)
    memory = model_lib.init_memory(model.config, prompt.shape[0])
    text, folded, produced = np.asarray(prompt, np.int32), 0, []
    for _ in range(new_tokens):
        current = (text.shape[1] - 1) // seg  # The segment of the last token.
        for s in range(folded, current):
            memory = advance_fn(params, text[:, s * seg:(s + 1) * seg], memory)
        folded, start = current, current * seg
        segment = np.zeros((text.shape[0], seg), np.int32)
        segment[:, :text.shape[1] - start] = text[:, start:]
        token = np.asarray(choose_fn(params, hidden_fn(params, segment, memory)[:, text.shape[1] - 1 - start]))
        produced.append(token)
        text = np.concatenate([text, token[:, None]], axis=1)
    return np.stack(produced, axis=1)


def hf_generate(hf_model, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    torch, _ = peer.import_torch()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter('ignore')
        # No end-of-text id: every side produces all `new_tokens`.
        out = hf_model.generate(torch.as_tensor(prompt, dtype=torch.long), max_new_tokens=new_tokens,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, prompt.shape[1]:].numpy()


def measure(name: str, hf_model, mcfg, params, setup: Setup, batch: int, ctx: harness.Context,
            compare_all: bool) -> list[dict[str, Any]]:
    model = model_lib.build_model(mcfg)
    prompt = peer.random_tokens(mcfg.vocab_size, batch, setup.shape.tgt_len, seed=3).astype(np.int32)
    n = setup.new_tokens
    calls = {'memjax': lambda: sample(model, params, prompt, n, GREEDY).tokens,
             'memjax_rerun': lambda: rerun_generate(model, params, prompt, n),
             'hf': peer.with_torch_threads(lambda: hf_generate(hf_model, prompt, n), peer.jax_cpu_cores())}
    ctx.log(f'generate: {name} batch {batch}: checking the tokens agree')
    tokens = {impl: np.asarray(call()) for impl, call in calls.items()}
    if not (tokens['memjax'] == tokens['memjax_rerun']).all():
        raise AssertionError(f'{name}: incremental and re-run greedy generation chose different tokens.')
    agree = float((tokens['memjax'] == tokens['hf']).mean())
    if not (tokens['memjax'][:, 0] == tokens['hf'][:, 0]).all() or (compare_all and agree < 1):
        raise AssertionError(f'{name}: memjax and HF greedy tokens differ on the same weights ({agree:.0%} agree).')
    ctx.log(f'generate: {name} batch {batch}: timing {", ".join(calls)} interleaved')
    timings = harness.time_interleaved(calls, warmup=max(ctx.warmup - 1, 0), repeats=ctx.repeats)
    rows = [{'model': name, 'batch': batch, 'impl': impl, 'median_ms': t.median_s * 1e3,
             'tokens_per_s': batch * n / t.median_s, 'agree_with_hf': agree, 'timing': t.as_dict()}
            for impl, t in timings.items()]
    for row in rows:
        row['memjax_speedup'] = rows[0]['tokens_per_s'] / row['tokens_per_s']
    return rows


@harness.register('generate')
def run(ctx: harness.Context) -> harness.SuiteResult:
    setup = SETUPS[ctx.size]
    with peer.torch_on_jax_cores() as (torch, transformers, threads):
        ctx.log('generate: building the Transformer-XL pair and checking its log-probs')
        shape = dataclasses.replace(setup.shape, batch_size=setup.batches[0])
        hf_xl, xl_cfg, xl_params = peer.build_pair(shape, setup.vocab)
        check = peer.check_same_model(hf_xl, xl_cfg, xl_params, shape)
        xl_cfg = xl_cfg.replace(segment_len=shape.tgt_len)
        window = setup.shape.tgt_len + setup.new_tokens
        hf_gpt, gpt_cfg, gpt_params = build_gpt2(setup.shape, setup.vocab, window)
        rows = []
        for batch in setup.batches:
            rows += measure('transformer_xl', hf_xl.eval(), xl_cfg, xl_params, setup, batch, ctx, compare_all=False)
            rows += measure('gpt2', hf_gpt, gpt_cfg, gpt_params, setup, batch, ctx, compare_all=True)
    figures = {f'memjax_over_{r["impl"]}_{r["model"]}_batch{r["batch"]}': r['memjax_speedup']
               for r in rows if r['impl'] != 'memjax'}
    figures['max_abs_logprob_diff_transformer_xl'] = check['max_abs_logprob_diff']
    notes = [
        f'torch {torch.__version__}, transformers {transformers.__version__}, {threads} threads each; float32; '
        'greedy; the prompt (one segment) is processed inside the timed call on every side.',
        f'Transformer-XL: tgt_len = mem_len = {setup.shape.tgt_len}, adaptive softmax {setup.vocab.vocab_size} '
        f'words (cutoffs {setup.vocab.cutoffs}); HF log-probs checked equal to memjax\'s within '
        f'{peer.LOGPROB_TOLERANCE} first. GPT-2: the same width, a window of {window} positions.',
        'memjax_speedup = memjax tokens/s / this row\'s (same model, same batch, same invocation).',
    ]
    if ctx.config is not None:
        notes.append('--config is ignored: the shapes are fixed so that both sides build the same models.')
    return harness.SuiteResult(
        rows=rows, columns=('model', 'batch', 'impl', 'median_ms', 'tokens_per_s', 'memjax_speedup', 'agree_with_hf'),
        figures=figures,
        config={'setup': dataclasses.asdict(setup), 'torch_threads': threads, 'dtype': 'float32'},
        notes=notes)
