"""LaMemo's look-ahead memory (Ji et al., 2022): a Transformer-XL memory that every segment
refreshes with what came after it.

Only the embeddings of the last `mem_len` positions are kept as hidden states; every layer
recomputes the memory rows' representations (they go up the stack with the segment,
`MemoryKind.stack_rows`, and through each layer's residual, LayerNorm and feed-forward):

1. Look-ahead (eq. 7-9): memory row i attends, with the layer's own query, key and value maps,
   the keys that arrived since the previous segment (its tokens after the first, and the current
   segment's first token, never a target), those right of i: key j in [max(i+1, M-W+1), M] of
   [memory; segment], W = min(M, T). Cost O(M x T) per layer, positional scores included
   (computed per block of W rows, `look_ahead_position_scores`).
2. Interpolation (eq. 10-11): C = alpha stop_gradient(C_prev) + (1 - alpha) C_new, alpha =
   s_prev / (s_prev + s_new + eps) from the softmax denominators, carried as float32 logs (a
   logaddexp per segment), so nothing overflows under bf16. By appendix A this is attention over
   the keys of both sides.
3. Disentangled positions (eq. 12): look-ahead entries use R_(j-i) and their own global bias v-
   (`v_ahead_bias`); causal ones are Transformer-XL's. `lamemo_encoding='xl'` uses R_(i-j) and v
   instead (the paper's diverging ablation).

State per layer: `context` [B, M, H, Dh], the memory rows' attention outputs before the output
map (attention dropout included), and `log_norm` [B, H, M] float32, their log-denominators;
both are FIFO over the last M positions like the XL memory. Shared: `embedded` [B, M, d_model]
and `valid` [B, M]. Where the paper and the authors' code differ, memjax follows the paper's
float32 denominators (the code stores them in fp16), and its positional look-ahead scores cost
O(M x T) (the code's are O(M^2)).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from memjax.kernels import cpu as cpu_kernels
from memjax.kernels import softmax as softmax_lib
from memjax.model.attention import Attended, KeyBlock, span_attention, span_scores_masked
from memjax.model.config import KindFields
from memjax.model.memories import LayerMemory, MemoryKind, MemoryState, register
from memjax.model.positions import rel_shift
from memjax.model.primitives import Dropout

ENCODINGS = ('disentangled', 'xl')


@dataclasses.dataclass(frozen=True)
class LaMemoFields(KindFields):
    """config.model.lamemo_*: the look-ahead memory and the paper's ablations."""

    lamemo_look_ahead: bool = True  # False: the memory keeps its causal outputs (Transformer-XL).
    lamemo_interpolate: bool = True  # False: alpha = 0, the refreshed memory forgets its past.
    # 'disentangled': R_|i-j| with v+ / v- by direction (eq. 12); 'xl': R_(i-j) and one v (eq. 6).
    lamemo_encoding: str = 'disentangled'
    lamemo_eps: float = 1e-6  # epsilon of alpha's denominator (eq. 11).
_NEG = float(np.finfo(np.float32).min)  # log(0) that stays finite: exp() of it is 0, no NaN.


def look_ahead_window(mem_len: int, seg_len: int) -> int:
    """W: how many keys arrived since the previous segment (its last W-1 tokens, still in the
    memory, and the current segment's first)."""
    return min(mem_len, seg_len)


def look_ahead_distances(mem_len: int, seg_len: int) -> np.ndarray:
    """[M, W] int: memory row i's distance j - i to the window's keys j = M-W+1 ... M; attended
    where it is >= 1."""
    w = look_ahead_window(mem_len, seg_len)
    return (mem_len - w + 1 + np.arange(w))[None, :] - np.arange(mem_len)[:, None]


def look_ahead_position_scores(query: jax.Array, positions: jax.Array, project, seg_len: int) -> jax.Array:
    """[B, M, H, Dh] memory-row queries -> [B, H, M, W] positional scores at the look-ahead distances.

    positions: [P, d_model] encodings of distances P-1 ... 0, P > M; project: [n, d_model] ->
    [n, H, Dh], the layer's positional key map. Cost about 2 M W products, not the M (M + W) of
    scoring every row against every distance:
    - the newest W rows see distances 1 ... W, each row a suffix of the window (the rest is
      masked): with rows and keys both reversed that is Transformer-XL's causal `rel_shift` over W
      distances, W x W products;
    - older rows see all W keys at distances that are consecutive, one lower for each later row, so
      they are taken in blocks of W: a block needs 2W - 1 distance rows, lined up by `rel_shift`.
    With M <= T (tgt = mem, the paper's settings) there are no older rows.
    """
    batch, rows, heads, d_head = query.shape
    w = look_ahead_window(rows, seg_len)
    table_rows = positions.shape[0]
    near = project(positions[table_rows - 1 - w:table_rows - 1])  # Distances W ... 1.
    newest = jnp.einsum('bahd,rhd->bhar', query[:, rows - w:][:, ::-1], near, preferred_element_type=jnp.float32)
    newest = rel_shift(newest)[:, :, ::-1, ::-1]  # Row a, key k: distance k + 1 - a.
    older_rows = rows - w
    if not older_rows:
        return newest
    blocks = -(-older_rows // w)
    pad = blocks * w - older_rows  # Padded rows (dropped below) go first, on the oldest side.
    query = jnp.pad(query[:, :older_rows], ((0, 0), (pad, 0), (0, 0), (0, 0)))
    query = query.reshape(batch, blocks, w, heads, d_head)
    # Block c's rows (local a) see distance (blocks-c) w + 1 + k - a at window key k: rows
    # base_c + r, r = k - a + w - 1 in [0, 2w - 1).
    base = (blocks - 1 - np.arange(blocks)) * w + 2
    distance = base[:, None] + np.arange(2 * w - 1)[None, :]  # [C, 2w-1], ascending
    index = np.clip(table_rows - 1 - distance, 0, table_rows - 1)
    pos_key = project(positions[index.reshape(-1)]).reshape(blocks, 2 * w - 1, heads, d_head)
    scores = jnp.einsum('bcahd,crhd->bhcar', query, pos_key, preferred_element_type=jnp.float32)
    # rel_shift moves row a's column k + w - 1 - a to k: its window keys, in order.
    scores = rel_shift(scores)[..., :w].reshape(batch, heads, blocks * w, w)[:, :, pad:]
    return jnp.concatenate([scores, newest], axis=2)


def interpolation_weight(log_prev: jax.Array, log_new: jax.Array, eps: float) -> jax.Array:
    """alpha = s_prev / (s_prev + s_new + eps) from log-denominators (eq. 11), in float32, shifted by
    their maximum as the authors' code does (so eps acts on the shifted sums).

    The denominators are carried as float32 logs under any compute dtype: a sum of exp(scores) over
    M + T keys overflows float16 and bf16's range is no help to its 8-bit precision, and alpha is
    re-applied every segment, so its error would compound in the memory."""
    top = jnp.maximum(log_prev, log_new)
    prev, new = jnp.exp(log_prev - top), jnp.exp(log_new - top)
    return prev / (prev + new + eps)


class LaMemoLayerMemory(LayerMemory):
    """The memory rows' look-ahead attention and interpolation inside one layer (module docstring)."""

    def setup(self):
        self.dropatt = Dropout(self.config.dropatt)

    def look_ahead(self, shared, view):
        """(C_new [B, M, H, Dh], log s_new [B, H, M] float32) of the memory rows."""
        cfg = self.config
        mem_len, seg_len = view.rows.shape[1], view.query.shape[1]
        w = look_ahead_window(mem_len, seg_len)
        window = slice(mem_len - w + 1, mem_len + 1)  # Keys of [memory; segment].
        query = view.maps.query(view.rows)  # [B, M, H, Dh]
        disentangled = cfg.lamemo_encoding == 'disentangled'
        positions = view.positions
        if not disentangled:  # R_(i-j) at i < j: the sine half changes sign.
            positions = positions * jnp.concatenate([-jnp.ones(cfg.d_model // 2), jnp.ones(cfg.d_model // 2)])
        v_ahead = view.biases['v_ahead_bias'] if disentangled else view.v_bias
        content_query, position_query = query + view.u_bias.astype(query.dtype), query + v_ahead.astype(query.dtype)
        key_valid = jnp.concatenate([shared['valid'][:, mem_len - w + 1:],
                                     jnp.ones((shared['valid'].shape[0], 1), bool)], axis=1)
        keys, values = view.key[:, window], view.value[:, window]
        scale = cfg.d_head ** -0.5
        if mem_len == w:
            # Rows and keys both reversed, row a sees keys k <= a at distance a - k + 1: Transformer-XL's
            # causal span over W keys with the distance rows W ... 1, so the span softmax (memjax's
            # CPU kernel where it applies) serves, its output rows reversed back.
            near = view.maps.position(positions[positions.shape[0] - 1 - w:positions.shape[0] - 1])
            reversed_operands = (content_query[:, ::-1], keys[:, ::-1], position_query[:, ::-1], near,
                                 key_valid[:, ::-1])
            if view.deterministic and not self.is_mutable_collection('intermediates'):
                # Evaluation: the one pass, the whole window as the span's own block (no memory block).
                cq, k, pq, r, ok = reversed_operands
                none = k[:, :0]
                attended, log_norm = cpu_kernels.span_attention(
                    functools.partial(span_attention, scale), cq, none, k, pq, r, ok, none, values[:, ::-1], scale)
            else:
                probs, log_norm = cpu_kernels.relative_softmax(
                    functools.partial(span_scores_masked, scale), *reversed_operands, scale, cfg.dtype)
                probs = self.dropatt(probs, deterministic=view.deterministic)
                attended = cpu_kernels.attend(probs, values[:, ::-1], causal=True)
            return attended[:, ::-1], log_norm[..., ::-1]
        scores = jnp.einsum('bmhd,bwhd->bhmw', content_query, keys, preferred_element_type=jnp.float32)
        scores += look_ahead_position_scores(position_query, positions, view.maps.position, seg_len)
        visible = (look_ahead_distances(mem_len, seg_len) >= 1)[None, None] & key_valid[:, None, None, :]
        scores = jnp.where(visible, scores * scale, _NEG)
        probs, log_norm = softmax_lib.softmax_with_log_norm(scores, cfg.dtype)  # Every row sees key M: never empty.
        probs = self.dropatt(probs, deterministic=view.deterministic)
        return jnp.einsum('bhmw,bwhd->bmhd', probs, values), log_norm

    def attend(self, state, shared, view):
        cfg = self.config
        prev, log_prev = state['context'], state['log_norm']
        if cfg.lamemo_look_ahead:
            new, log_new = self.look_ahead(shared, view)
            if cfg.lamemo_interpolate:
                alpha = interpolation_weight(log_prev, log_new, cfg.lamemo_eps)
                self.sow('intermediates', 'alpha', alpha)  # memjax.analysis.lamemo.memorizing_coefficients
                alpha = alpha.transpose(0, 2, 1)[..., None]
                # Mixed in float32, rounded to the compute dtype once for the carried rows: a
                # rounding per segment that alpha < 1 contracts, so it does not accumulate
                # (tests/test_mixed_precision.py: the bf16 error flat over 40 segments).
                context = alpha * prev.astype(jnp.float32) + (1.0 - alpha) * new.astype(jnp.float32)
            else:
                context = new
            log_norm = jnp.logaddexp(log_prev, log_new)
        else:  # The memory keeps its causal outputs: Transformer-XL's memory, recomputed.
            context, log_norm = prev, log_prev
        context = context.astype(cfg.dtype)
        segment_log_norm = view.log_norm  # [B, H, T]
        return Attended(rows=view.maps.output(context),
                        notes={'context': context, 'log_norm': log_norm,
                               'segment_context': view.attended, 'segment_log_norm': segment_log_norm})

    def write(self, state, shared, layer_input, notes):
        keep = state['context'].shape[1]
        context = jnp.concatenate([notes['context'], notes['segment_context'].astype(notes['context'].dtype)],
                                  axis=1)
        log_norm = jnp.concatenate([notes['log_norm'], notes['segment_log_norm']], axis=-1)
        # Gradients never flow into a past segment.
        return jax.lax.stop_gradient({'context': context[:, -keep:], 'log_norm': log_norm[..., -keep:]}), {}


@register
class LaMemoMemory(MemoryKind):
    """layers.context [n_layer, B, M, H, Dh], layers.log_norm [n_layer, B, H, M] float32;
    shared.embedded [B, M, d_model] (the first layer's input), shared.valid [B, M]."""
    fields = LaMemoFields

    name = 'lamemo'
    layer = LaMemoLayerMemory
    run_time_fields = ('mem_len', 'memory_start', 'lamemo_look_ahead', 'lamemo_interpolate')

    @property
    def bias_names(self):
        return ('v_ahead_bias',) if self.config.lamemo_encoding == 'disentangled' else ()

    @classmethod
    def validate(cls, config):
        problems = []
        if config.mem_len < 1:
            problems.append(f"memory='lamemo' refreshes a memory: mem_len={config.mem_len} must be >= 1.")
        if config.positions != 'relative_sinusoid':
            problems.append(f"memory='lamemo' needs relative distances: positions={config.positions!r} "
                            "must be 'relative_sinusoid'.")
        if config.lamemo_encoding not in ENCODINGS:
            problems.append(f'lamemo_encoding={config.lamemo_encoding!r} must be one of {ENCODINGS}.')
        if config.lamemo_eps <= 0:
            problems.append(f'lamemo_eps={config.lamemo_eps} must be > 0.')
        return problems

    def init(self, batch_size):
        cfg = self.config
        m = cfg.mem_len
        return MemoryState(
            layers={'context': jnp.zeros((cfg.n_layer, batch_size, m, cfg.n_head, cfg.d_head), cfg.dtype),
                    # log(0): nothing attended yet, so alpha = 0 for a memory row seen the first time.
                    'log_norm': jnp.full((cfg.n_layer, batch_size, cfg.n_head, m), _NEG, jnp.float32)},
            shared={'embedded': jnp.zeros((batch_size, m, cfg.d_model), cfg.dtype),
                    'valid': jnp.full((batch_size, m), cfg.memory_start == 'zeros')})

    def logical_axes(self):
        return MemoryState(
            layers={'context': P(None, 'activation_batch', 'activation_length', 'activation_heads', 'activation_kv'),
                    'log_norm': P(None, 'activation_batch', 'activation_heads', 'activation_length')},
            shared={'embedded': P('activation_batch', 'activation_length', 'activation_embed'),
                    'valid': P('activation_batch', 'activation_length')})

    def stack_rows(self, shared):
        return KeyBlock(rows=shared['embedded'], valid=shared['valid'][:, None, None, :])

    def advance(self, shared, embedded):
        keep = shared['valid'].shape[1]
        fifo = lambda old, new: jnp.concatenate([old, new.astype(old.dtype)], axis=1)[:, -keep:]
        seg_valid = jnp.ones(embedded.shape[:2], bool)
        return {'embedded': jax.lax.stop_gradient(fifo(shared['embedded'], embedded)),
                'valid': fifo(shared['valid'], seg_valid)}

    def position_rows(self, seg_len):
        return self.config.mem_len + seg_len
