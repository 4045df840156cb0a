"""Analytic FLOP count of a Transformer-XL training step (the numerator of MFU).

The infinity-former (memory='infinity') adds its long-term memory's work per layer: the gate over the
rows leaving the short-term memory, the ridge refit of N coefficients, their key and value maps,
the queries' scores against them, the mu / sigma maps and the read (`_ltm_flops`).

LaMemo (memory='lamemo') adds the memory rows' work: every layer projects their output and runs
their feed-forward (they go up the stack with the segment), and with look-ahead projects their
queries and scores them against the W = min(M, T) window keys (positional scores: the newest W
rows against W distances, older rows in blocks of W against 2W - 1). Above the first layer the
memory rows carry gradients, so their key and value projections need input gradients there.

Counted: every matmul of the forward pass, 2 FLOPs per multiply-add, with the shapes the model
actually runs (keys and values over K = mem_len + tgt_len rows, the positional projection once
per distance row, the positional scores over K rows before the relative shift). Element-wise
work (softmax, LayerNorm, dropout, Adam) is not counted: it is O(tokens * width), not
O(tokens * width^2), and MFU conventionally counts only the matmuls.

Forward + backward = 3 x forward, less the input gradients nobody needs: the backward pass of
`y = x @ w` is two matmuls of the same size (dx = dy @ w.T, dw = x.T @ dy), but dx is never
computed where x carries no gradient (the constant sinusoids of the positional projection, the
stop-gradient memory rows of the key/value projections). `tests/test_bench.py` checks the total
against XLA's own cost analysis.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax

from memjax.kernels import cpu as cpu_kernels
from memjax.model import ModelConfig
from memjax.model import positions
from memjax.model.primitives import BLOCKS

BACKWARD_FACTOR = 3  # forward (1) + backward (2: input and weight gradients).


def _softmax_flops(cfg: ModelConfig, tokens: int, clusters: Optional[range] = None) -> dict[str, float]:
    """Output layer: per cluster an optional projection to its width, then its logits.

    Every cluster is counted at every position: what memjax computes off the CPU kernel (and a
    full softmax needs); on one CPU device the kernel scores a tail cluster only where a target
    falls in it, so there this is an upper bound."""
    bounds = cfg.cluster_bounds
    n_clusters = len(bounds) - 1
    projected = cfg.div_val != 1 or cfg.d_embed != cfg.d_model
    flops = {'softmax_proj': 0.0, 'softmax_logits': 0.0}
    for i in clusters if clusters is not None else range(n_clusters):
        width = cfg.cluster_dim(0 if cfg.div_val == 1 else i)
        if projected:
            flops['softmax_proj'] += 2.0 * tokens * cfg.d_model * width
        outputs = bounds[i + 1] - bounds[i] + (n_clusters - 1 if i == 0 else 0)  # + tail-cluster logits.
        flops['softmax_logits'] += 2.0 * tokens * width * outputs
    return flops


def tail_recompute_flops(cfg: ModelConfig, batch: int, tgt_len: int) -> float:
    """The tail clusters' logits again: their backward recomputes them rather than storing them,
    and their projections too where memjax's CPU kernel does not score the clusters (it projects
    every position once, outside). Work the step does (XLA counts it) but not model FLOPs, so MFU
    leaves it out."""
    tail = _softmax_flops(cfg, batch * tgt_len, range(1, len(cfg.cluster_bounds) - 1))
    if cpu_kernels.applies(jax.ShapeDtypeStruct((), cfg.dtype)):
        del tail['softmax_proj']
    return sum(tail.values())


def _embedding_flops(cfg: ModelConfig, tokens: int) -> float:
    """The table lookup is a gather (no FLOPs); the projections to d_model are matmuls."""
    if cfg.div_val != 1:  # Every cluster's projection runs for every token (then masked).
        return sum(2.0 * tokens * cfg.cluster_dim(i) * cfg.d_model for i in range(len(cfg.cutoffs) + 1))
    return 2.0 * tokens * cfg.d_embed * cfg.d_model if cfg.d_embed != cfg.d_model else 0.0


def relative(cfg: ModelConfig) -> bool:
    """Whether the attention scores relative positions (a projected table of distances)."""
    return positions.POSITIONS[cfg.positions] is not None


def forward_flops(cfg: ModelConfig, batch: int, tgt_len: int) -> dict[str, float]:
    """Forward matmul FLOPs of one segment of `batch` x `tgt_len` tokens, by component."""
    tokens = batch * tgt_len
    klen = cfg.mem_len + tgt_len
    inner = cfg.n_head * cfg.d_head
    # 'xl_cached' keeps the memory's keys and values as projected: only the segment is projected.
    projected = tgt_len if cfg.memory == 'xl_cached' else klen
    per_layer = {
        'q_proj': 2.0 * tokens * cfg.d_model * inner,
        'kv_proj': 2 * 2.0 * batch * projected * cfg.d_model * inner,
        'pos_proj': 2.0 * klen * cfg.d_model * inner,  # Shared by the batch.
        'content_scores': 2.0 * batch * cfg.n_head * tgt_len * klen * cfg.d_head,
        'position_scores': 2.0 * batch * cfg.n_head * tgt_len * klen * cfg.d_head,
        'attend_values': 2.0 * batch * cfg.n_head * tgt_len * klen * cfg.d_head,
        'out_proj': 2.0 * tokens * inner * cfg.d_model,
        'feed_forward': 2 * 2.0 * tokens * cfg.d_model * cfg.d_inner,
    }
    if not relative(cfg):  # Absolute positions are added to the embeddings: no positional keys.
        del per_layer['pos_proj'], per_layer['position_scores']
    if cfg.memory == 'xl_cached' and cfg.memory_start == 'zeros' and (cfg.pre_lnorm or BLOCKS[cfg.block].bias):
        # The key and value of a zero input (maps without biases and LayerNorm take it to zeros).
        per_layer['zero_row_kv'] = 2 * 2.0 * cfg.d_model * inner
    per_layer.update(_memory_row_flops(cfg, batch, tgt_len))
    flops = {name: cfg.n_layer * value for name, value in per_layer.items()}
    flops['embedding'] = _embedding_flops(cfg, tokens)
    flops.update(_softmax_flops(cfg, tokens))
    return flops


def _look_ahead_distances(cfg: ModelConfig, tgt_len: int) -> tuple[int, int]:
    """(W, distance rows projected) of LaMemo's look-ahead (memjax.model.memories.lamemo): W for the
    newest W rows, 2W - 1 for each block of W older rows."""
    w = min(cfg.mem_len, tgt_len)
    return w, w + (-(-cfg.mem_len // w) - 1) * (2 * w - 1)


def _ltm_flops(cfg: ModelConfig, batch: int, tgt_len: int) -> dict[str, float]:
    """Per layer: the infinity-former's LTM (memjax.model.memories.infinity), S = segment rows
    refit into N coefficients; sticky memories resample at `samples` points instead of the
    static [N, N] map."""
    n, d, inner = cfg.ltm_basis, cfg.d_model, cfg.n_head * cfg.d_head
    samples = n if cfg.ltm_samples == -1 else cfg.ltm_samples
    rows = batch * tgt_len
    return {
        'ltm_gate': 2.0 * rows * 3 * d * d,
        'ltm_refit': 2.0 * rows * n * d,
        'ltm_resample': 2.0 * batch * (2 * samples * n * d if cfg.ltm_sticky else n * n * d),
        'ltm_kv_proj': 2 * 2.0 * batch * n * d * inner,
        'ltm_scores': 2.0 * rows * n * inner,
        'ltm_mu_sigma': 2 * 2.0 * rows * cfg.n_head * n,
        'ltm_read': 2.0 * rows * n * inner,
        'ltm_out_proj': 2.0 * rows * inner * d,
    }


def _memory_row_flops(cfg: ModelConfig, batch: int, tgt_len: int) -> dict[str, float]:
    """Per layer: LaMemo's memory rows (module docstring), the infinity-former's LTM; nothing for
    other memories."""
    if cfg.memory == 'infinity':
        return _ltm_flops(cfg, batch, tgt_len)
    if cfg.memory != 'lamemo':
        return {}
    rows = batch * cfg.mem_len
    inner = cfg.n_head * cfg.d_head
    flops = {'memory_out_proj': 2.0 * rows * inner * cfg.d_model,
             'memory_feed_forward': 2 * 2.0 * rows * cfg.d_model * cfg.d_inner}
    if cfg.lamemo_look_ahead:
        w, distances = _look_ahead_distances(cfg, tgt_len)
        flops.update({
            'memory_q_proj': 2.0 * rows * cfg.d_model * inner,
            'look_ahead_pos_proj': 2.0 * distances * cfg.d_model * inner,
            'look_ahead_scores': 2.0 * rows * w * inner * 2,  # content, then values
            'look_ahead_position_scores': 2.0 * batch * w * distances * inner,
        })
    return flops


def skipped_input_gradient_flops(cfg: ModelConfig, batch: int, tgt_len: int) -> float:
    """Backward matmuls that do not run because their input needs no gradient."""
    inner = cfg.n_head * cfg.d_head
    memory_rows = 2 * 2.0 * batch * cfg.mem_len * cfg.d_model * inner  # keys and values
    sinusoids = 2.0 * (cfg.mem_len + tgt_len) * cfg.d_model * inner if relative(cfg) else 0.0
    if cfg.memory == 'infinity':
        # The gate reads the carried rows (no input gradient), the ridge matrices are constants,
        # and the old coefficients are carried state: their resampling has no backward at all.
        ltm = _ltm_flops(cfg, batch, tgt_len)
        constants = ltm['ltm_gate'] + ltm['ltm_refit'] + 2 * ltm['ltm_resample']
        return cfg.n_layer * (memory_rows + sinusoids + constants)
    if cfg.memory != 'lamemo':
        return cfg.n_layer * (memory_rows + sinusoids)
    # LaMemo: only the first layer's memory rows (the stored embeddings) are constants.
    if cfg.lamemo_look_ahead:
        _, distances = _look_ahead_distances(cfg, tgt_len)
        sinusoids += 2.0 * distances * cfg.d_model * inner
        memory_rows += 2.0 * batch * cfg.mem_len * cfg.d_model * inner  # and their queries
    return cfg.n_layer * sinusoids + memory_rows


def train_step_flops(cfg: ModelConfig, batch: int, tgt_len: int) -> float:
    """Model FLOPs of one training step (forward + backward) on one segment."""
    return (BACKWARD_FACTOR * sum(forward_flops(cfg, batch, tgt_len).values())
            - skipped_input_gradient_flops(cfg, batch, tgt_len))


def train_flops_per_token(cfg: ModelConfig, batch: int, tgt_len: int) -> float:
    return train_step_flops(cfg, batch, tgt_len) / (batch * tgt_len)


@dataclasses.dataclass(frozen=True)
class Product:
    """`count` batched matrix products [batch, m, k] x [batch, k, n] of one training step."""
    name: str
    shape: tuple[int, int, int, int]  # (batch, m, k, n)
    count: int

    @property
    def flops(self) -> float:
        batch, m, k, n = self.shape
        return 2.0 * batch * m * k * n * self.count


def training_products(cfg: ModelConfig, batch: int, tgt_len: int) -> list[Product]:
    """The matrix products of one Transformer-XL training step (memory 'xl': the roofline's
    shapes): each forward product `y = x w` of `forward_flops`, then its input gradient `dy w^T`
    (where x needs one) and its weight gradient `x^T dy`. Their FLOPs are `train_step_flops`."""
    if cfg.memory != 'xl':
        raise ValueError(f"the products are listed for memory 'xl', not {cfg.memory!r}")
    tokens, klen, inner = batch * tgt_len, cfg.mem_len + tgt_len, cfg.n_head * cfg.d_head
    rows = batch * cfg.n_head
    forward = [  # (name, (batch, m, k, n), count per step, rows of x that take a gradient)
        ('q_proj', (1, tokens, cfg.d_model, inner), cfg.n_layer, tokens),
        ('kv_proj', (1, batch * klen, cfg.d_model, inner), 2 * cfg.n_layer, tokens),  # Memory rows: none.
        ('pos_proj', (1, klen, cfg.d_model, inner), cfg.n_layer, 0),  # Sinusoids: constants.
        ('content_scores', (rows, tgt_len, cfg.d_head, klen), cfg.n_layer, None),
        ('position_scores', (rows, tgt_len, cfg.d_head, klen), cfg.n_layer, None),
        ('attend_values', (rows, tgt_len, klen, cfg.d_head), cfg.n_layer, None),
        ('out_proj', (1, tokens, inner, cfg.d_model), cfg.n_layer, None),
        ('ff_inner', (1, tokens, cfg.d_model, cfg.d_inner), cfg.n_layer, None),
        ('ff_outer', (1, tokens, cfg.d_inner, cfg.d_model), cfg.n_layer, None),
    ]
    if cfg.div_val != 1:
        forward += [(f'embed_proj_{i}', (1, tokens, cfg.cluster_dim(i), cfg.d_model), 1, None)
                    for i in range(len(cfg.cutoffs) + 1)]
    elif cfg.d_embed != cfg.d_model:
        forward.append(('embed_proj', (1, tokens, cfg.d_embed, cfg.d_model), 1, None))
    bounds, projected = cfg.cluster_bounds, cfg.div_val != 1 or cfg.d_embed != cfg.d_model
    for i in range(len(bounds) - 1):
        width = cfg.cluster_dim(0 if cfg.div_val == 1 else i)
        if projected:
            forward.append((f'softmax_proj_{i}', (1, tokens, cfg.d_model, width), 1, None))
        outputs = bounds[i + 1] - bounds[i] + (len(bounds) - 2 if i == 0 else 0)
        forward.append((f'softmax_logits_{i}', (1, tokens, width, outputs), 1, None))
    products = []
    for name, (b, m, k, n), count, grad_rows in forward:
        grad_rows = m if grad_rows is None else grad_rows
        products.append(Product(name, (b, m, k, n), count))
        if grad_rows:
            products.append(Product(f'{name} input grad', (b, grad_rows, n, k), count))
        products.append(Product(f'{name} weight grad', (b, k, m, n), count))
    return products
