"""Adaptive input embeddings (Baevski & Auli) and adaptive softmax (Grave et al.), with ties.

The vocabulary is cut into clusters at `cutoffs`. Cluster i has width d_embed // div_val**i and a
projection to / from d_model. The output head scores the first cluster's tokens plus one logit per
tail cluster, in cluster order (the HF / TF order; kimiyoung's PyTorch code stores them reversed).
With no cutoffs this is an ordinary (optionally projected) embedding and softmax.

Parameter layout (kernels are [in, out] as everywhere in Flax):
  emb_table_{i} [V_i, d_i]      (div_val == 1: a single emb_table_0 [V, d_embed], sliced per cluster)
  emb_proj_{i}  [d_i, d_model]  (div_val == 1: only when d_embed != d_model)
  out_table_{i}, out_proj_{i}   (absent when tied to the embedding's), out_bias_{i} [V_i]
  cluster_kernel [d_embed, n_tail], cluster_bias [n_tail]
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from memjax.kernels import cpu as cpu_kernels
from memjax.model.config import ModelConfig
from memjax.model.primitives import BLOCKS, normal, param

# How many logits a step of a tail cluster's loop may form on accelerators (256 MB in float32): it
# bounds the chunk of positions scored together, and the memory their logits take.
_TAIL_CHUNK_LOGITS = 2**26


def _cluster_inputs(weights: dict, hidden: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(x [..., d_i], table [V_i (+ n_tail), d_i], bias): one cluster's logits are x table^T + bias."""
    x = hidden.astype(dtype)
    if weights['proj'] is not None:
        x = cpu_kernels.linear_transposed(x, weights['proj'].astype(dtype)).astype(dtype)
    table, bias = weights['table'], weights['bias']
    if 'cluster_kernel' in weights:
        # The tail clusters' scores as more rows of the head's table: one product, and neither the
        # [tokens, V_0 + n_tail] logits concatenated nor their gradient split.
        table = jnp.concatenate([table, weights['cluster_kernel'].T.astype(table.dtype)])
        bias = jnp.concatenate([bias, weights['cluster_bias']])
    return x, table.astype(dtype), bias


def cluster_logits(weights: dict, hidden: jax.Array, dtype) -> jax.Array:
    """Float32 logits [..., V_i (+ n_tail)] of one cluster from its `_cluster_weights`."""
    x, table, bias = _cluster_inputs(weights, hidden, dtype)
    logits = cpu_kernels.linear_transposed(x, table)
    return nn.with_logical_constraint(logits + bias, ('activation_batch', 'activation_length', 'activation_vocab'))


def _picked_logprobs(dtype, weights: dict, hidden: jax.Array, index: jax.Array, rows: jax.Array) -> jax.Array:
    """[...] a cluster's log-softmax at `index` [...] on `rows` [...] (0 on the others), by the CPU
    kernel: each row's logsumexp with no [tokens, V_i] logits in memory, forward and backward."""
    x, table, bias = _cluster_inputs(weights, hidden, dtype)
    logprobs = cpu_kernels.cluster_logprobs(_dense_picked_logprobs, x.reshape(-1, x.shape[-1]), table,
                                            bias.astype(jnp.float32), index.reshape(-1), rows.reshape(-1))
    return logprobs.reshape(index.shape)


def _dense_picked_logprobs(x, table, bias, index, rows):
    """`_picked_logprobs`'s definition, every row's logits formed (where a program lowered for CPU
    runs on another platform)."""
    logprobs = jax.nn.log_softmax(jnp.einsum('nd,vd->nv', x, table, preferred_element_type=jnp.float32) + bias)
    return jnp.where(rows, jnp.take_along_axis(logprobs, index[:, None], axis=-1)[:, 0], 0.0)


def _kernel_applies(dtype) -> bool:
    return cpu_kernels.applies(jax.ShapeDtypeStruct((), dtype))


def _head_logprobs(dtype, weights, hidden, index):
    """The head's log-softmax at `index`, by XLA: its logits kept for the backward pass.

    The logits come out of the product in float32 (`cluster_logits`) and the log-softmax stays
    there: a logsumexp over 10^4-10^5 words in bf16 is off by more than the differences training
    follows."""
    logprobs = jax.nn.log_softmax(cluster_logits(weights, hidden, dtype), axis=-1)
    return jnp.take_along_axis(logprobs, index[..., None], axis=-1)[..., 0]


def _chunk_logprobs(dtype, weights, x_chunk, local_chunk):
    logits = cluster_logits(weights, x_chunk, dtype)
    picked = jnp.take_along_axis(logits, local_chunk[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_logprobs(dtype, weights, x, local):
    """[C, B, chunk] log p(local | cluster) of x [C, B, chunk, d_model], chunk by chunk.

    A custom VJP so that the backward keeps only the inputs: it forms each chunk's logits again
    and sums the weights' gradient in the loop's carry. Autodiff would keep every chunk's logits
    (the [tokens, cluster size] matrix the chunks exist to avoid).
    """
    def step(carry, inputs):
        return carry, _chunk_logprobs(dtype, weights, *inputs)

    return jax.lax.scan(step, None, (x, local))[1]


def _chunked_logprobs_fwd(dtype, weights, x, local):
    return _chunked_logprobs(dtype, weights, x, local), (weights, x, local)


def _chunked_logprobs_bwd(dtype, residuals, cotangent):
    weights, x, local = residuals

    def step(weights_grad, inputs):
        x_chunk, local_chunk, ct_chunk = inputs
        _, vjp = jax.vjp(lambda w, xc: _chunk_logprobs(dtype, w, xc, local_chunk), weights, x_chunk)
        d_weights, d_x = vjp(ct_chunk)
        return jax.tree.map(jnp.add, weights_grad, d_weights), d_x

    weights_grad, x_grad = jax.lax.scan(step, jax.tree.map(jnp.zeros_like, weights), (x, local, cotangent))
    return weights_grad, x_grad, None


_chunked_logprobs.defvjp(_chunked_logprobs_fwd, _chunked_logprobs_bwd)


def _every_position_tail_logprobs(dtype, weights: dict, hidden: jax.Array, local: jax.Array) -> jax.Array:
    """[B, T] log p(local | the tail cluster of `weights`) at every position, by XLA.

    Every position is scored, whatever its target: a loop that skipped the chunks without a target
    in the cluster would branch once per chunk, and a GPU copies each branch's predicate to the host
    and waits for its stream (hundreds of round trips a step at WikiText-103's sizes). Scoring all
    positions costs the same on any text, with shapes and a trip count fixed at compile time; the
    chunks (along T, every batch row in each, so that a batch-sharded step keeps its rows on their
    devices) bound the logits formed at once by _TAIL_CHUNK_LOGITS, so the [tokens, cluster size]
    matrix (GBs for WikiText-103's 160k-word cluster) never exists.
    """
    batch, length = local.shape
    chunk = max(1, min(length, _TAIL_CHUNK_LOGITS // (batch * weights['table'].shape[0])))
    n_chunks = -(-length // chunk)
    pad = [(0, 0), (0, n_chunks * chunk - length)]
    x = jnp.pad(hidden, pad + [(0, 0)]).reshape(batch, n_chunks, chunk, -1).swapaxes(0, 1)
    local = jnp.pad(local, pad).reshape(batch, n_chunks, chunk).swapaxes(0, 1)
    logprobs = _chunked_logprobs(dtype, weights, x, local)
    return logprobs.swapaxes(0, 1).reshape(batch, -1)[:, :length]


class AdaptiveIO(nn.Module):
    """Owns the embedding and softmax parameters so that they can be tied to each other."""

    config: ModelConfig

    def setup(self):
        cfg = self.config
        bounds = cfg.cluster_bounds
        n_clusters = len(bounds) - 1
        table_init = normal(cfg.init_std, ('vocab', 'embed'))
        proj_init = normal(cfg.proj_init_std, (None, 'embed'))
        zeros = nn.with_logical_partitioning(nn.initializers.zeros, ('vocab',))
        single_table = cfg.div_val == 1
        n_tables = 1 if single_table else n_clusters

        self.emb_tables = [
            param(self, f'emb_table_{i}', table_init, (bounds[i + 1] - bounds[i] if not single_table
                                                       else cfg.vocab_size, cfg.cluster_dim(i)))
            for i in range(n_tables)]
        needs_proj = [not single_table or cfg.d_embed != cfg.d_model for _ in range(n_clusters)]
        self.emb_projs = [
            param(self, f'emb_proj_{i}', proj_init, (cfg.cluster_dim(i), cfg.d_model)) if needs_proj[i] else None
            for i in range(n_tables)]

        self.out_tables = self.emb_tables if cfg.tie_weight else [
            param(self, f'out_table_{i}', table_init, table.shape) for i, table in enumerate(self.emb_tables)]
        out_projs = []
        for i in range(n_clusters):
            dim = cfg.cluster_dim(0 if single_table else i)
            if not needs_proj[i]:
                out_projs.append(None)
            elif cfg.tie_projs[i]:
                out_projs.append(self.emb_projs[0 if single_table else i])
            else:
                out_projs.append(param(self, f'out_proj_{i}', proj_init, (dim, cfg.d_model)))
        self.out_projs = out_projs
        self.out_biases = [param(self, f'out_bias_{i}', zeros, (bounds[i + 1] - bounds[i],))
                           for i in range(n_clusters)]
        if n_clusters > 1:
            self.cluster_kernel = param(self, 'cluster_kernel', normal(cfg.init_std, ('embed', None)),
                                        (cfg.d_embed, n_clusters - 1))
            self.cluster_bias = param(self, 'cluster_bias',
                                      nn.with_logical_partitioning(nn.initializers.zeros, (None,)), (n_clusters - 1,))

    def _cluster_table(self, tables, i: int) -> jax.Array:
        if self.config.div_val == 1:
            lo, hi = self.config.cluster_bounds[i], self.config.cluster_bounds[i + 1]
            return tables[0][lo:hi]
        return tables[i]

    def embed(self, ids: jax.Array) -> jax.Array:
        """[...] token ids -> [..., d_model], scaled by sqrt(d_model) in Transformer-XL's block style."""
        cfg = self.config
        dtype = cfg.dtype
        if cfg.div_val == 1:
            out = jnp.take(self.emb_tables[0], ids, axis=0).astype(dtype)
            if self.emb_projs[0] is not None:
                out = cpu_kernels.linear(out, self.emb_projs[0].astype(dtype))
        else:
            out = jnp.zeros(ids.shape + (cfg.d_model,), dtype)
            bounds = cfg.cluster_bounds
            for i, (table, proj) in enumerate(zip(self.emb_tables, self.emb_projs)):
                lo, hi = bounds[i], bounds[i + 1]
                inside = (ids >= lo) & (ids < hi)
                local = jnp.clip(ids - lo, 0, hi - lo - 1)
                # Masked before the projection: the gradient's mask is then on the cluster's narrow
                # rows, and every cluster's projection gradient reads the same output gradient.
                rows = jnp.where(inside[..., None], jnp.take(table, local, axis=0).astype(dtype), 0)
                out = out + cpu_kernels.linear(rows, proj.astype(dtype))
        if not BLOCKS[cfg.block].embed_scale:
            return out
        return out * jnp.asarray(math.sqrt(cfg.d_model), dtype)

    def _cluster_weights(self, i: int) -> dict:
        """Cluster i's output weights: what its logits depend on besides the hidden states."""
        weights = {'proj': self.out_projs[i], 'table': self._cluster_table(self.out_tables, i),
                   'bias': self.out_biases[i]}
        if i == 0 and len(self.config.cutoffs):
            weights.update(cluster_kernel=self.cluster_kernel, cluster_bias=self.cluster_bias)
        return weights

    def _cluster_logits(self, hidden: jax.Array, i: int) -> jax.Array:
        """Float32 logits of cluster i's own tokens (plus, for i == 0, one per tail cluster)."""
        return cluster_logits(self._cluster_weights(i), hidden, self.config.dtype)

    def _tail_logprobs(self, hidden: jax.Array, targets: jax.Array, inside: jax.Array, i: int) -> jax.Array:
        """[B, T] log p(target | tail cluster i) where `inside` (the target is in cluster i), junk
        elsewhere: on CPU by the kernel, which scores exactly those positions (`_picked_logprobs`),
        elsewhere at every position (`_every_position_tail_logprobs`)."""
        lo, hi = self.config.cluster_bounds[i], self.config.cluster_bounds[i + 1]
        dtype, weights, local = self.config.dtype, self._cluster_weights(i), jnp.clip(targets - lo, 0, hi - lo - 1)
        if _kernel_applies(dtype):
            return _picked_logprobs(dtype, weights, hidden, local, inside)
        return _every_position_tail_logprobs(dtype, weights, hidden, local)

    def target_logprobs(self, hidden: jax.Array, targets: jax.Array, evaluation: bool = False) -> jax.Array:
        """[B, T] log p(target) for hidden [B, T, d_model], computed cluster by cluster: the
        full-vocabulary logit matrix is never formed, nor a tail cluster's for positions whose
        target is elsewhere. `evaluation` (no gradient expected): on CPU the head's logits are not
        formed either (`_picked_logprobs`); training keeps them for its backward pass."""
        bounds = self.config.cluster_bounds
        shortlist, dtype = bounds[1], self.config.dtype
        targets = jnp.clip(targets, 0, bounds[-1] - 1)
        # The head scores a head token itself and a tail token by its cluster's logit.
        cluster = sum(((targets >= bound).astype(jnp.int32) for bound in bounds[1:-1]), jnp.zeros_like(targets))
        head_index = jnp.where(cluster == 0, targets, shortlist + cluster - 1)
        if evaluation and _kernel_applies(dtype):
            picked = _picked_logprobs(dtype, self._cluster_weights(0), hidden, head_index, jnp.ones(targets.shape, bool))
        else:
            picked = _head_logprobs(dtype, self._cluster_weights(0), hidden, head_index)
        for i in range(1, len(bounds) - 1):
            inside = cluster == i
            picked = jnp.where(inside, picked + self._tail_logprobs(hidden, targets, inside, i), picked)
        return picked

    def cluster_logprobs(self, hidden: jax.Array, i: int) -> jax.Array:
        """Cluster 0: log p [..., V_0 + n_tail] of its tokens and of each tail cluster, in order;
        cluster i > 0: log p(token | cluster i) [..., V_i]."""
        return jax.nn.log_softmax(self._cluster_logits(hidden, i), axis=-1)

    def logprobs(self, hidden: jax.Array) -> jax.Array:
        """Full-vocabulary log-probabilities [..., vocab_size] (for sampling and tests)."""
        bounds = self.config.cluster_bounds
        shortlist = bounds[1]
        head = self.cluster_logprobs(hidden, 0)
        parts = [head[..., :shortlist]]
        for i in range(1, len(bounds) - 1):
            parts.append(head[..., shortlist + i - 1:shortlist + i] + self.cluster_logprobs(hidden, i))
        return jnp.concatenate(parts, axis=-1)
