"""`accel`: memjax on one GPU or TPU, against the chip's datasheet and PyTorch on the same chip.

One command for a time-limited allocation of an accelerator (`launch/accel_bench.sh` runs it in one job):

- profile: where the wt103-large and enwik8-large bf16 training steps spend their time on the
  device, from a `jax.profiler` trace of a few steps: attention, dense products, adaptive softmax,
  LayerNorm and elementwise work, optimizer, unattributed kernels, host-device copies, idle
  (memjax/bench/step_profile.py), adding up to the traced step, beside the step timed without the
  profiler; the trace files are kept beside the `--out` report.
- peak: bf16 and float32 (TF32 on GPUs) products up to 16384^3 beside the datasheet rate.
- peer: HF `TransfoXLLMHeadModel` on the same device (CUDA PyTorch), at enwik8-base's shape:
  eager with bf16 autocast and `torch.compile`, against memjax in bf16, training and evaluation.
  Same weights: imported into memjax, parameter counts and float32 log-probs checked first.
- train: Transformer-XL's training step at enwik8-base, wt103-large and enwik8-large, bf16 and
  float32 without dropout, then bf16 with the config's dropout and dropatt (as the papers train):
  compile seconds (persistent cache off), tokens/s, TFLOP/s, MFU against the datasheet and the
  measured peak, the step's device memory. The targets are uniform random ids: off the CPU a tail
  cluster scores every position, whatever its target (memjax.model.adaptive), so the step's work is
  the same on any text.
- roofline: the matrix products of each training row (`flops.training_products`: forward, input
  and weight gradients), each shape timed in a loop inside one compiled program (no host wait
  between products), its TFLOP/s beside the datasheet and the peak part's best product; then per
  row the products' time at those rates over the step's.
- eval: wt103-large's evaluation at the paper's protocol (tgt 128, mem 1600, clamp 1000,
  same_length), the model `memjax.evaluate` runs.
- methods: LaMemo / XL and infinity-former / XL training steps at wt103-base (bf16), timed
  round-robin, beside their FLOPs ratios; and XL with d_head 48 against 41 (tensor-core tiles).
- attention: one layer's attention at wt103-large's shape in bf16, forward and backward: memjax's
  against cuDNN's fused attention (`jax.nn.dot_product_attention`) given Transformer-XL's
  positional term as a materialised bias, and without the term (plain causal attention: what a
  fused kernel of the term must approach).
- fused: the fused relative attention (memjax/kernels/relative_attention.py) against XLA's path
  (the reference: scores, softmax and weighted values as XLA ops), one layer's attention at
  wt103-large's heads in bf16 with tgt = mem = 384, 768 and 1600, forward and forward plus
  backward: time and XLA's memory for the call; then the training steps (wt103-large,
  enwik8-large, bf16) and the evaluation with each path (`attention_impl`).
- choices: at wt103-large bf16 (`largest`), the step unrolled (`scan_layers=False`), without donation, and
  with `remat='dots_saveable'`, each against the train part's row.
- probe: the wt103-large bf16 row alone, for A/B runs of XLA flags in separate processes.

Rows print as they are measured, and `--out` is rewritten with each (an allocation may end mid-suite);
`--parts` picks parts. The peer runs
before the large steps because JAX's allocator keeps what it grew to, and PyTorch shares the chip.
`--size=tiny` runs the same code on CPU at seconds-long shapes (the test suite).
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp

from memjax import model as model_lib
from memjax.bench import flops
from memjax.bench import harness
from memjax.bench import step_profile
from memjax.bench import workload
from memjax.bench.suites import peak
from memjax.bench.suites import peer
from memjax.kernels import fused_choice
from memjax.kernels import relative_attention
from memjax.kernels import softmax as softmax_lib
from memjax.model import memories
from memjax.model.attention import span_scores_masked
from memjax.model.positions import position_scores, rel_shift

PARTS = ('profile', 'peak', 'peer', 'train', 'roofline', 'eval', 'methods', 'attention', 'fused', 'choices', 'probe')
DEFAULT_PARTS = PARTS[:-1]
# PyTorch allocates on the same chip in the peer part: JAX takes memory as it needs it instead of
# 75 % of it up front. Read once, when JAX starts its backend (after this module is imported).
ENVIRONMENT = {'XLA_PYTHON_CLIENT_PREALLOCATE': 'false'}
# XLA:CPU names its ops in a trace only with this flag (the profile part on a CPU: the tests); an
# accelerator's kernels are named without it.
XLA_FLAGS = ('--xla_cpu_enable_xprof_traceme=true',)

# The papers' shapes (configs/transformer_xl_*.py; tests/test_bench.py holds them to the files).
# Batches are per chip: the papers' global batches ran over 4-64 chips. Each is the largest share
# of the config's batch (its quarter) that XLA's buffer assignment puts well inside an 80 GB card
# without remat: wt103-large 32 of 128 (~38 GiB), enwik8-large 16 of 64 (~44 GiB), enwik8-base its
# whole 22 (~12 GiB), measured on XLA:CPU's assignment (BENCHMARKS.md); a step that does not fit
# the device is compiled again at half the batch.
ENWIK8_BASE = dict(n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048, vocab_size=204)
WT103_BASE = dict(n_layer=16, d_model=410, n_head=10, d_head=41, d_inner=2100, vocab_size=267735,
                  cutoffs=(20000, 40000, 200000), div_val=1, tie_projs=(False, True, True, True))
WT103_LARGE = dict(n_layer=18, d_model=1024, n_head=16, d_head=64, d_inner=4096, vocab_size=267735,
                   cutoffs=(20000, 40000, 200000), div_val=4, tie_projs=(False, True, True, True))
ENWIK8_LARGE = dict(n_layer=24, d_model=1024, n_head=8, d_head=128, d_inner=3072, vocab_size=204)
INFINITY = dict(memory='infinity', ltm_basis=150, ltm_widths=(0.01, 0.05), ltm_ridge=1.0, ltm_tau=0.5,
                ltm_reset_tokens=900, ltm_min_variance=1e-6, ltm_kl_weight=1e-5, ltm_kl_sigma=0.1)


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    model: dict
    batch: int
    tgt_len: int  # = mem_len in training.
    dropout: tuple[float, float] = (0.0, 0.0)  # The config's (dropout, dropatt), for the rows with it.


TINY_MODEL = dict(n_layer=1, d_model=32, n_head=2, d_head=16, d_inner=64, vocab_size=64)
TINY_ADAPTIVE = dict(TINY_MODEL, vocab_size=300, cutoffs=(100, 200), div_val=2, tie_projs=(False, True, True))
SETUPS = {
    'full': dict(
        train=(Step('enwik8-base', ENWIK8_BASE, 22, 512, (0.1, 0.0)), Step('wt103-large', WT103_LARGE, 32, 384, (0.2, 0.2)),
               Step('enwik8-large', ENWIK8_LARGE, 16, 768, (0.15, 0.15))),
        profile=(Step('wt103-large', WT103_LARGE, 32, 384), Step('enwik8-large', ENWIK8_LARGE, 16, 768)),
        largest=Step('wt103-large', WT103_LARGE, 32, 384),
        eval=Step('wt103-large', WT103_LARGE, 16, 128), eval_model=dict(mem_len=1600, clamp_len=1000, same_length=True),
        methods=Step('wt103-base', WT103_BASE, 32, 150),
        peer=peer.Shape(n_layer=12, d_model=512, n_head=8, d_head=64, d_inner=2048, tgt_len=512, mem_len=512,
                        batch_size=22),
        peer_vocab=peer.Vocab('enwik8 bytes', 204, (), 1), aligned_d_head=48, fused_lengths=(384, 768, 1600)),
    'tiny': dict(
        train=(Step('1x32 adaptive', TINY_ADAPTIVE, 2, 8, (0.1, 0.1)),), largest=Step('1x32 adaptive', TINY_ADAPTIVE, 2, 8),
        profile=(Step('1x32 adaptive', TINY_ADAPTIVE, 2, 8),),
        eval=Step('1x32', TINY_MODEL, 2, 4), eval_model=dict(mem_len=12, clamp_len=6, same_length=True),
        methods=Step('1x32', TINY_MODEL, 2, 8),
        peer=peer.SHAPES['tiny'], peer_vocab=peer.VOCABS['tiny'][0], aligned_d_head=24, fused_lengths=(12,)),
}
COLUMNS = ('part', 'case', 'dtype', 'batch', 'tgt_len', 'mem_len', 'compile_s', 'step_ms', 'tokens_per_s',
           'tflops_per_s', 'mfu_datasheet_percent', 'mfu_percent', 'step_memory_gib', 'vs', 'ratio', 'memory_ratio', 'flops_ratio')
# Largest |difference| between memjax's attention outputs and a fused variant's that computes the
# same attention: bf16 rounding of values ~1 (seen: < 0.02 on CPU); a wrong bias gives ~1.
ATTENTION_TOLERANCE = 0.05


def _memory_limit() -> Optional[int]:
    """Bytes the first device may allocate (None where the backend does not say: CPUs)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get('bytes_limit')


def _out_of_memory(error: Exception) -> bool:
    return 'RESOURCE_EXHAUSTED' in str(error) or 'out of memory' in str(error).lower()


class Suite:
    """The rows measured so far and what every part divides by."""

    def __init__(self, ctx: harness.Context):
        self.ctx = ctx
        self.setup = SETUPS[ctx.size]
        self.rows: list[dict[str, Any]] = []
        self.peak: Optional[dict[str, Any]] = None
        self.notes: list[str] = []

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        self.rows.append(row)
        if self.ctx.on_rows:
            self.ctx.on_rows(self.rows)
        shown = ', '.join(f'{c}={harness.format_value(row.get(c))}' for c in COLUMNS if row.get(c) is not None)
        self.ctx.log(f'accel row: {shown}')
        return row

    def throughput(self, part: str, case: str, mcfg: model_lib.ModelConfig, batch: int, tgt_len: int,
                   step_s: float, model_flops: float, compiled: Optional[harness.Compiled], **extra) -> dict:
        """A row of a timed step: tokens/s, TFLOP/s and MFU against the datasheet and the peak."""
        achieved = model_flops / step_s / 1e9
        mfu = peak.mfu_percents(achieved, mcfg.compute_dtype, self.peak) if self.peak else {}
        return {'part': part, 'case': case, 'dtype': mcfg.compute_dtype, 'batch': batch, 'tgt_len': tgt_len,
                'mem_len': mcfg.mem_len, 'step_ms': step_s * 1e3, 'tokens_per_s': batch * tgt_len / step_s,
                'tflops_per_s': achieved / 1e3, 'model_flops_per_step': model_flops,
                'compile_s': compiled.total_s if compiled else None,
                'step_memory_gib': compiled.live_bytes / harness.GIB if compiled else None,
                'scan_layers': mcfg.scan_layers, 'remat': mcfg.remat, 'model': mcfg.as_dict(), **mfu, **extra}

    # ------------------------------------------------------------------------------------------

    def measure_peak(self) -> None:
        if self.ctx.peak_from:
            self.peak = peak.from_report(self.ctx.peak_from)
            self.notes.append(f'peak: the peak rows of {self.ctx.peak_from}, not measured again')
            return
        self.peak = peak.measure_peak(self.ctx)
        for row in self.peak['rows']:
            self.add({'part': 'peak', 'case': row['matmul'], 'dtype': row['dtype'],
                      'step_ms': row['median_ms'], 'tflops_per_s': row['gflops_per_s'] / 1e3,
                      'mfu_datasheet_percent': row['datasheet_percent'], 'timing': row['timing']})

    def compile_fitting(self, mcfg: model_lib.ModelConfig, batch: int, tgt_len: int,
                        donate: bool = True) -> workload.Case:
        """The training step's case at `batch`, halved (at most twice) while XLA's buffer assignment
        says the step does not fit the device."""
        limit = _memory_limit()
        for _ in range(3):
            case = workload.train_case(workload.build(mcfg, batch, tgt_len, self.ctx.config), donate=donate)
            if limit is None or case.compiled.live_bytes <= limit or batch == 1:
                return case
            self.ctx.log(f'accel: batch {batch} needs {case.compiled.live_bytes / harness.GIB:.1f} GiB of '
                         f'{limit / harness.GIB:.1f}; trying {batch // 2}')
            batch //= 2
        return case

    def train_row(self, part: str, step: Step, dtype: str, vs: Optional[dict] = None, donate: bool = True,
                  dropout: bool = False, **fields) -> Optional[dict]:
        """Compiles and times one training step (`dropout`: with the step's config's dropout and
        dropatt, else none); a step out of device memory is a row saying so."""
        rates = dict(zip(('dropout', 'dropatt'), step.dropout if dropout else (0.0, 0.0)))
        mcfg = workload.model_config(self.ctx.config, mem_len=step.tgt_len, compute_dtype=dtype,
                                     **{'scan_layers': True, **step.model, **rates, **fields})
        shown = {**(rates if dropout else {}), **fields}
        case = step.name + ''.join(f' {k}={v}' for k, v in shown.items()) + ('' if donate else ' not donated')
        self.ctx.log(f'accel: {part} {case} {dtype} batch {step.batch} tgt = mem = {step.tgt_len}')
        fitted = None
        try:
            fitted = self.compile_fitting(mcfg, step.batch, step.tgt_len, donate)
            timing = fitted.time_alone(self.ctx)
        except Exception as error:  # pylint: disable=broad-except
            if not _out_of_memory(error):
                raise
            return self.add({'part': part, 'case': case, 'dtype': dtype,
                             'batch': fitted.work.batch_size if fitted else step.batch,
                             'error': f'out of device memory: {str(error)[:200]}'})
        batch = fitted.work.batch_size
        row = self.throughput(part, case, mcfg, batch, step.tgt_len, timing.median_s,
                              flops.train_step_flops(mcfg, batch, step.tgt_len), fitted.compiled,
                              donated=donate, timing=timing.as_dict())
        if vs is not None and 'step_ms' in vs:
            row.update(vs=vs['case'], ratio=row['step_ms'] / vs['step_ms'] * vs['batch'] / row['batch'])
        device = jax.devices()[0].memory_stats() or {}
        row['device_peak_gib_so_far'] = (device['peak_bytes_in_use'] / harness.GIB if 'peak_bytes_in_use' in device
                                         else None)
        return self.add(row)

    def profile(self) -> None:
        """Each profiled step timed alone, then traced: its device time by category
        (memjax/bench/step_profile.py), one row per step, the categories also as a table."""
        if jax.default_backend() == 'cpu' and not all(f in os.environ.get('XLA_FLAGS', '') for f in XLA_FLAGS):
            raise harness.BenchError(f'the profile part needs XLA_FLAGS={" ".join(XLA_FLAGS)} on a CPU, set before JAX '
                                     'starts; run it as python -m memjax.bench accel, which sets it.')
        for step in self.setup['profile']:
            mcfg = workload.model_config(self.ctx.config, mem_len=step.tgt_len, compute_dtype='bfloat16', dropout=0.0,
                                         dropatt=0.0, **{'scan_layers': True, **step.model})
            self.ctx.log(f'accel: profile {step.name} bfloat16 batch {step.batch} tgt = mem = {step.tgt_len}')
            keep = (os.path.splitext(self.ctx.out)[0] + f'_profile_{step.name.replace(" ", "_")}.xplane.pb'
                    if self.ctx.out else None)
            case = None
            try:
                case = self.compile_fitting(mcfg, step.batch, step.tgt_len)
                timing = case.time_alone(self.ctx)
                found = step_profile.profile(case.loop, self.ctx.repeats, case.compiled.executable.as_text(), keep)
            except Exception as error:  # pylint: disable=broad-except
                if not _out_of_memory(error):
                    raise
                self.add({'part': 'profile', 'case': step.name, 'dtype': 'bfloat16',
                          'batch': case.work.batch_size if case else step.batch,
                          'error': f'out of device memory: {str(error)[:200]}'})
                continue
            batch = case.work.batch_size
            row = self.throughput('profile', step.name, mcfg, batch, step.tgt_len, timing.median_s,
                                  flops.train_step_flops(mcfg, batch, step.tgt_len), case.compiled,
                                  donated=True,
                                  timing=timing.as_dict(), profiled_step_ms=found['step_s'] * 1e3,
                                  profiled_vs_timed=found['step_s'] / timing.median_s, trace=found['trace'],
                                  **{f'{name} ms': seconds * 1e3 for name, seconds in found['seconds'].items()})
            self.ctx.log(f'accel: profile {step.name}, device time per step by category:\n' + harness.format_table(
                [{'category': name, 'ms': seconds * 1e3, 'share': seconds / found['step_s'] if found['step_s'] else None}
                 for name, seconds in found['seconds'].items()], ('category', 'ms', 'share')))
            self.add(row)
            # The same compiled step, timed without the profiler: the train part's bf16 row, not
            # compiled a second time (tens of seconds on a GPU).
            self.add({**row, 'part': 'train', 'timed_by': 'profile'})

    def train(self) -> None:
        for step in self.setup['train']:
            for dtype in ('bfloat16', 'float32'):
                if not any(r['part'] == 'train' and r['case'] == step.name and r['dtype'] == dtype for r in self.rows):
                    self.train_row('train', step, dtype)
            self.train_row('train', step, 'bfloat16', dropout=True)

    def roofline(self) -> None:
        """Each distinct product shape of the training rows, bf16 with float32 accumulation as the
        model multiplies, timed in a compiled loop; then per row the products' time at those rates."""
        rates: dict[tuple, dict] = {}
        for step in self.setup['train']:
            mcfg = workload.model_config(self.ctx.config, mem_len=step.tgt_len, compute_dtype='bfloat16', **step.model)
            products = flops.training_products(mcfg, step.batch, step.tgt_len)
            for product in sorted(products, key=lambda p: -p.flops):
                if product.shape not in rates:
                    self.ctx.log(f'accel: roofline {step.name} {product.name} {product.shape}')
                    rates[product.shape] = self.roofline_row(step, product)
            total_s = sum(rates[p.shape]['product_s'] * p.count for p in products)
            trained = next((r for r in self.rows if r['part'] == 'train' and r['case'] == step.name
                            and r['dtype'] == 'bfloat16' and 'step_ms' in r), None)
            flop_count = sum(p.flops for p in products)
            # Per token: the train part may have halved a batch that did not fit.
            self.add({'part': 'roofline', 'case': f'{step.name} every product', 'dtype': 'bfloat16',
                      'batch': step.batch, 'tgt_len': step.tgt_len, 'step_ms': total_s * 1e3,
                      'tflops_per_s': flop_count / total_s / 1e12, 'model_flops_per_step': flop_count,
                      **(peak.mfu_percents(flop_count / total_s / 1e9, 'bfloat16', self.peak) if self.peak else {}),
                      **({'vs': trained['case'], 'ratio': total_s * 1e3 / trained['step_ms'] * trained['batch']
                          / step.batch} if trained else {})})

    def roofline_row(self, step: Step, product: flops.Product) -> dict:
        batch, m, k, n = product.shape
        measured = peak.measure(product.shape, 'bfloat16', self.ctx)  # In a loop inside one program.
        product_s = measured['median_ms'] / 1e3
        return self.add({'part': 'roofline', 'case': f'{step.name} {product.name} {batch}x{m}x{k}x{n}',
                         'dtype': 'bfloat16', 'step_ms': measured['median_ms'],
                         'tflops_per_s': measured['gflops_per_s'] / 1e3, 'product_s': product_s,
                         'products_per_call': measured['products_per_call'], 'compile_s': measured['compile_s'],
                         **(peak.mfu_percents(measured['gflops_per_s'], 'bfloat16', self.peak) if self.peak else {}),
                         'timing': measured['timing']})

    def evaluation(self, impls=('auto',), part: str = 'eval') -> None:
        step = self.setup['eval']
        for dtype in ('bfloat16', 'float32') if part == 'eval' else ('bfloat16',):
            base = None
            for impl in impls:
                trained = workload.model_config(self.ctx.config, mem_len=step.tgt_len, compute_dtype=dtype,
                                                dropout=0.0, dropatt=0.0, scan_layers=True, attention_impl=impl,
                                                **step.model)
                mcfg = memories.evaluation_config(trained, self.setup['eval_model'], segment_len=step.tgt_len)
                self.ctx.log(f'accel: {part} {step.name} {dtype} ({mcfg.memory}, mem {mcfg.mem_len}, batch '
                             f'{step.batch}, attention {impl})')
                evaluation = workload.random_eval_case(mcfg, step.batch, step.tgt_len, trained=trained)
                timing = evaluation.time_alone(self.ctx)
                model_flops = sum(flops.forward_flops(mcfg, step.batch, step.tgt_len).values())
                impl_name = '' if impl == 'auto' else f' attention_impl={impl}'
                row = self.throughput(part, f'{step.name} {mcfg.memory} clamp {mcfg.clamp_len} same_length{impl_name}',
                                      mcfg, step.batch, step.tgt_len, timing.median_s, model_flops,
                                      evaluation.compiled, timing=timing.as_dict())
                if base is not None:
                    row.update(vs=base['case'], ratio=row['step_ms'] / base['step_ms'])
                base = base or row
                self.add(row)

    def methods(self) -> None:
        """LaMemo and the infinity-former against XL, timed round-robin at one shape and batch."""
        step = self.setup['methods']
        kinds = {'xl': {}, 'lamemo': {'memory': 'lamemo'},
                 'infinity': {**INFINITY, 'segment_len': step.tgt_len,
                              **({'ltm_basis': 8, 'ltm_widths': (0.05, 0.1)} if self.ctx.tiny else {})}}
        cases = {}
        for name, fields in kinds.items():
            mcfg = workload.model_config(self.ctx.config, mem_len=step.tgt_len, compute_dtype='bfloat16',
                                         dropout=0.0, dropatt=0.0, scan_layers=True, **step.model, **fields)
            self.ctx.log(f'accel: methods {step.name} {name} batch {step.batch}')
            cases[name] = workload.train_case(workload.build(mcfg, step.batch, step.tgt_len, self.ctx.config))
        timings = workload.time_together(cases, self.ctx)
        flop_counts = {n: flops.train_step_flops(cases[n].work.mcfg, step.batch, step.tgt_len) for n in kinds}
        for name, case in cases.items():
            self.add(self.throughput(
                'methods', f'{step.name} {name}', case.work.mcfg, step.batch, step.tgt_len, timings[name].median_s,
                flop_counts[name], case.compiled, vs=f'{step.name} xl',
                ratio=timings[name].median_s / timings['xl'].median_s,
                flops_ratio=flop_counts[name] / flop_counts['xl'], timing=timings[name].as_dict()))
        # The head dim the tensor cores tile (a multiple of 16): what wt103-base's 41 costs.
        xl = self.rows[-3]
        self.train_row('methods', step, 'bfloat16', vs=xl, d_head=self.setup['aligned_d_head'])

    def choices(self) -> None:
        """The step's build choices at the largest wt103 shape, each against the train part's row."""
        step = self.setup['largest']
        base = next((r for r in self.rows if r['part'] in ('train', 'probe') and r['case'] == step.name
                     and r['dtype'] == 'bfloat16' and 'step_ms' in r), None)
        base = base or self.train_row('probe', step, 'bfloat16')
        self.train_row('choices', step, 'bfloat16', vs=base, scan_layers=False)
        self.train_row('choices', step, 'bfloat16', vs=base, donate=False)
        self.train_row('choices', step, 'bfloat16', vs=base, remat='dots_saveable')

    def attention(self) -> None:
        """The attention's scores to weighted values, forward and backward (q, k, v and distance rows
        [K, H, D] take gradients), at the largest step's shape: batch, T = M queries, K = 2T keys."""
        step = self.setup['largest']
        heads, dim = step.model['n_head'], step.model['d_head']
        batch, qlen, klen = step.batch, step.tgt_len, 2 * step.tgt_len
        scale = dim ** -0.5
        operands, cotangent, memjax_attention = _one_layer_attention(step, batch, qlen, seed=0)
        visible = jnp.arange(klen)[None, :] <= klen - qlen + jnp.arange(qlen)[:, None]  # [T, K]
        fused = 'cudnn' if jax.default_backend() == 'gpu' else None  # XLA's elsewhere (the code path only).

        def fused_with_position_bias(q, k, v, r):
            bias = (rel_shift(position_scores(q, r)) * scale).astype(jnp.bfloat16)  # The kernel scales q.k only.
            return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=visible[None, None], scale=scale,
                                                implementation=fused)

        def fused_plain(q, k, v, r):
            del r
            return jax.nn.dot_product_attention(q, k, v, mask=visible[None, None], scale=scale, implementation=fused)

        # Per head: content scores, positional scores (before the shift: K distance rows), weighted
        # values, each 2 T K D; backward twice the forward; the plain form lacks the positional one.
        forward = 2.0 * batch * heads * qlen * klen * dim
        variants = {'memjax relative': (memjax_attention, 3), 'fused + position bias': (fused_with_position_bias, 3),
                    'fused plain (no position term)': (fused_plain, 2)}
        base, reference = None, jax.jit(memjax_attention)(*operands).astype(jnp.float32)
        for name, (fn, products) in variants.items():
            self.ctx.log(f'accel: attention {name}')
            grad = lambda *x, fn=fn: jax.vjp(fn, *x)[1](cotangent)
            try:
                difference = float(jnp.abs(jax.jit(fn)(*operands).astype(jnp.float32) - reference).max())
                if products == 3 and not difference < ATTENTION_TOLERANCE:  # Not plain attention: must be memjax's.
                    raise AssertionError(f'{name} differs from memjax\'s attention by {difference:.3g}; not timed')
                compiled, timing = harness.compile_and_time(grad, *operands, ctx=self.ctx)
            except Exception as error:  # pylint: disable=broad-except  (cuDNN refuses some shapes and dtypes)
                self.add({'part': 'attention', 'case': name, 'dtype': 'bfloat16', 'batch': batch,
                          'error': f'{type(error).__name__}: {str(error)[:300]}'})
                continue
            mcfg = workload.model_config(self.ctx.config, mem_len=qlen, compute_dtype='bfloat16', **step.model)
            row = self.throughput('attention', name, mcfg, batch, qlen, timing.median_s, 3 * products * forward,
                                  compiled, implementation=fused or 'xla', max_abs_diff_vs_memjax=difference,
                                  timing=timing.as_dict())
            base = base or row
            row.update(vs=base['case'], ratio=row['step_ms'] / base['step_ms'])
            self.add(row)

    def fused(self) -> None:
        """The fused attention against XLA's path alone, then in the training and evaluation steps."""
        self.fused_attention()
        # The large configs (of the full size's enwik8-base, wt103-large, enwik8-large); tiny has one.
        for step in self.setup['train'][1:] or self.setup['train']:
            xla = self.train_row('fused', step, 'bfloat16', attention_impl='reference')
            self.train_row('fused', step, 'bfloat16', vs=xla, attention_impl='fused')
        self.evaluation(impls=('reference', 'fused'), part='fused')

    def fused_attention(self) -> None:
        """One layer's attention at tgt = mem = L (K = 2L keys, the same tokens per call at every
        L): the fused kernel against XLA's path, forward and forward plus backward (queries, keys,
        values and distance rows take gradients)."""
        step = self.setup['largest']
        heads, dim = step.model['n_head'], step.model['d_head']
        scale = dim ** -0.5
        options = fused_choice.path('fused', dim, jnp.bfloat16)
        block_q, block_k = relative_attention.tiles_for(dim)
        for length in self.setup['fused_lengths']:
            batch, klen = max(1, step.batch * step.tgt_len // length), 2 * length
            operands, cotangent, xla = _one_layer_attention(step, batch, length, seed=length)
            valid = jnp.ones((batch, klen), bool)

            def fused(q, k, v, r):
                return relative_attention.span_attention(q, q, k, v, r, valid, scale=scale, block_q=block_q,
                                                         block_k=block_k, **options)[0]

            reference = jax.jit(xla)(*operands).astype(jnp.float32)
            difference = float(jnp.abs(jax.jit(fused)(*operands).astype(jnp.float32) - reference).max())
            forward = 2.0 * batch * heads * length * klen * dim  # One of the three products.
            base = {}
            for name, fn in (('xla', xla), ('fused', fused)):
                for mode, call, products in (('forward', fn, 3), ('forward+backward', None, 9)):
                    call = call or (lambda *x, fn=fn: jax.vjp(fn, *x)[1](cotangent))
                    case = f'{name} {mode} tgt = mem = {length}'
                    self.ctx.log(f'accel: fused {case}, batch {batch}')
                    try:
                        compiled, timing = harness.compile_and_time(call, *operands, ctx=self.ctx)
                    except Exception as error:  # pylint: disable=broad-except
                        if not _out_of_memory(error):
                            raise
                        self.add({'part': 'fused', 'case': case, 'dtype': 'bfloat16', 'batch': batch,
                                  'error': f'out of device memory: {str(error)[:200]}'})
                        continue
                    mcfg = workload.model_config(self.ctx.config, mem_len=length, compute_dtype='bfloat16',
                                                 **step.model)
                    row = self.throughput('fused', case, mcfg, batch, length, timing.median_s, products * forward,
                                          compiled, max_abs_diff_vs_xla=difference, timing=timing.as_dict())
                    if mode in base:
                        row.update(vs=base[mode]['case'], ratio=row['step_ms'] / base[mode]['step_ms'],
                                   memory_ratio=row['step_memory_gib'] / base[mode]['step_memory_gib'])
                    else:
                        base[mode] = row
                    self.add(row)

    def probe(self) -> None:
        self.train_row('probe', self.setup['largest'], 'bfloat16')

    def peer(self) -> None:
        """memjax against HF on the same device in bf16 (autocast on the PyTorch side)."""
        torch, transformers = peer.import_torch()
        device = 'cuda' if jax.default_backend() == 'gpu' and torch.cuda.is_available() else 'cpu'
        shape, vocab = self.setup['peer'], self.setup['peer_vocab']
        self.ctx.log(f'accel: peer {vocab.name} on torch {device}: building HF model, importing, checking log-probs')
        hf_model, mcfg, params = peer.build_pair(shape, vocab, device=device)
        with jax.default_matmul_precision('float32'):  # The check at float32, not TF32, on both sides.
            check = peer.check_same_model(hf_model, mcfg, params, shape)
        tokens = peer.random_tokens(vocab.vocab_size, shape.batch_size, shape.tgt_len + 1, seed=2)
        bf16 = mcfg.replace(compute_dtype='bfloat16')
        ours = peer.memjax_cases(bf16, params, tokens, shape, reprojecting=False)
        impls = {'hf_eager': hf_model}
        if not self.ctx.tiny:  # torch.compile takes minutes; the CPU test suite cannot wait.
            impls['hf_compiled'] = torch.compile(hf_model)
        theirs = {impl: peer.hf_loops(hf_model, forward, tokens, shape, autocast='bfloat16')
                  for impl, forward in impls.items()}
        for mode in ('train', 'eval'):
            timings, compile_s, failed = peer.time_against_hf(self.ctx, f'accel: peer {mode}', {'memjax': ours[mode]},
                                                              {impl: theirs[impl][mode] for impl in impls})
            self.notes += [f'torch.compile failed in {mode}: {error}' for error in failed.values()]
            # memjax's evaluation runs the model `memjax.evaluate` runs (xl_cached: no memory row
            # projected again), as peer.memjax_cases compiles it; HF re-projects, and is slower for it.
            model_flops = (flops.train_step_flops(mcfg, shape.batch_size, shape.tgt_len) if mode == 'train'
                           else sum(flops.forward_flops(memories.evaluation_config(mcfg, {}), shape.batch_size,
                                                        shape.tgt_len).values()))
            for impl, timing in timings.items():
                row = self.throughput('peer', f'{vocab.name} {mode} {impl}', bf16, shape.batch_size, shape.tgt_len,
                                      timing.median_s, model_flops, None, timing=timing.as_dict(), **check)
                row.update(compile_s=compile_s[impl], vs=f'{mode} {impl}',
                           ratio=timing.median_s / timings['memjax'].median_s)  # memjax's speed-up over it.
                self.add(row)
        self.notes.append(f'peer: torch {torch.__version__} on {device}, transformers {transformers.__version__}; '
                          'HF under torch.autocast(bfloat16), memjax compute_dtype=bfloat16; '
                          f'log-probs agreed to {check["max_abs_logprob_diff"]:.2g} in float32 before timing; '
                          'ratio = the row\'s step time over memjax\'s (memjax\'s speed-up).')
        del impls, theirs, hf_model, ours
        if device == 'cuda':
            gc.collect()
            torch.cuda.empty_cache()  # Back to the large steps' allocator.


def _one_layer_attention(step: Step, batch: int, qlen: int, seed: int):
    """(operands (q, k, v, distance rows) in bf16 with K = 2 qlen keys, a cotangent of the output,
    memjax's XLA attention over them: scores, softmax and weighted values as the model runs them)."""
    heads, dim, klen = step.model['n_head'], step.model['d_head'], 2 * qlen
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
    operands = (normal(keys[0], (batch, qlen, heads, dim)), normal(keys[1], (batch, klen, heads, dim)),
                normal(keys[2], (batch, klen, heads, dim)), normal(keys[3], (klen, heads, dim)))
    valid = jnp.ones((batch, klen), bool)

    def attention(q, k, v, r):
        scores = span_scores_masked(dim ** -0.5, q, k, q, r, valid)
        probs, _ = softmax_lib.softmax_with_log_norm(scores, jnp.bfloat16)
        return jnp.einsum('bhtk,bkhd->bthd', probs, v)

    return operands, normal(keys[4], (batch, qlen, heads, dim)), attention


def _parts(ctx: harness.Context) -> tuple[str, ...]:
    unknown = sorted(set(ctx.parts) - set(PARTS))
    if unknown:
        raise harness.BenchError(f'--parts has {unknown}; the accel suite\'s parts are {list(PARTS)}.')
    return tuple(p for p in PARTS if p in ctx.parts) if ctx.parts else DEFAULT_PARTS


@harness.register('accel')
def run(ctx: harness.Context) -> harness.SuiteResult:
    parts = _parts(ctx)
    suite = Suite(ctx)
    started = time.perf_counter()
    cache = jax.config.jax_enable_compilation_cache
    # Compile seconds are figures here: a compilation served from a persistent cache is not one.
    jax.config.update('jax_enable_compilation_cache', False)
    try:
        if 'peak' in parts or set(parts) & {'train', 'roofline', 'eval', 'methods', 'attention', 'fused', 'choices', 'probe'}:
            suite.measure_peak()  # Every MFU's denominator: measured first, in the same process.
        for part in parts:
            if part != 'peak':
                getattr(suite, 'evaluation' if part == 'eval' else part)()
    finally:
        jax.config.update('jax_enable_compilation_cache', cache)
    figures = {'chip': suite.peak['chip'] if suite.peak else None, 'parts': list(parts),
               'wall_s': time.perf_counter() - started,
               'persistent_compilation_cache': 'off', 'device_memory_limit_gib':
                   _memory_limit() / harness.GIB if _memory_limit() else None}
    if suite.peak:
        for dtype in peak.DTYPES:
            figures[f'peak_tflops_per_s_{dtype}'] = suite.peak['peak_gflops_per_s'][dtype] / 1e3
            sheet = suite.peak['datasheet_gflops_per_s'][dtype]
            figures[f'datasheet_tflops_per_s_{dtype}'] = sheet / 1e3 if sheet else None
    for row in suite.rows:
        if row['part'] == 'profile' and 'profiled_step_ms' in row:
            figures.update({f"profile {row['case']} {name} share": row[f'{name} ms'] / row['profiled_step_ms']
                            for name in step_profile.CATEGORIES if row['profiled_step_ms']})
            figures[f"profile {row['case']} profiled_vs_timed"] = row['profiled_vs_timed']
        if row['part'] in ('train', 'eval') and 'mfu_datasheet_percent' in row:
            figures[f"{row['part']} {row['case']} {row['dtype']} mfu_datasheet_percent"] = row['mfu_datasheet_percent']
        if row['part'] in ('methods', 'peer', 'choices', 'fused') and row.get('ratio') is not None and row['ratio'] != 1.0:
            figures[f"{row['case']} ratio"] = row['ratio']
    return harness.SuiteResult(
        rows=suite.rows, columns=COLUMNS, figures=figures,
        config={'parts': list(parts), 'setup': {k: (dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v)
                                                 for k, v in suite.setup.items() if not isinstance(v, tuple)},
                'train_steps': [dataclasses.asdict(s) for s in suite.setup['train']],
                'environment': {k: os.environ.get(k) for k in ENVIRONMENT},
                'step': 'memjax.bench.workload train step (forward, backward, clip + Adam), state donated unless '
                        'said, dropout 0, scan_layers unless said',
                'targets': 'uniform random ids (off the CPU the step\'s work does not depend on them)',
                'flops': 'memjax.bench.flops (model FLOPs; MFU counts no recomputation)'},
        notes=suite.notes + [
            'mfu_datasheet_percent: against the chip\'s dense rate for the dtype (memjax.bench.chips; float32 = '
            'TF32 on GPUs, what a default-precision float32 product runs); mfu_percent: against the best product '
            'of the peak part in this process.',
            'step_memory_gib: XLA\'s buffer assignment for one call (arguments + temporaries + outputs not '
            'aliased to a donated argument).',
            'methods ratio: step time over XL\'s, flops_ratio the FLOPs\'; choices ratio: per-token time over '
            'the train part\'s row; peer ratio: memjax\'s speed-up over the row.',
            'roofline: step_ms of a product is one product (a loop of products_per_call in one call, / that '
            'count); "every product": the step\'s products at those rates, ratio: per token, over the train '
            'part\'s bf16 step (dropout off).'])
