"""The layer stack: n_layer decoder layers, each with its slice of the memory state.

Every memory kind runs this stack; it differs only in the `LayerMemory` each layer calls. The stack
is a Python loop ('layer_{i}' parameters) or one nn.scan ('layers' parameters stacked on a leading
axis). Random streams are split per layer either way, and a layer can be skipped for a step under
`lax.cond`: its compute is really not done.
"""

from __future__ import annotations

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from memjax.model.attention import AttentionContext, RelativeAttention, dropout_residual_norm
from memjax.model.config import ModelConfig, add_check
from memjax.model.memories import MemoryKind
from memjax.model.positions import POSITIONS
from memjax.model.primitives import BLOCKS, BTE, Dropout, layer_norm, normal, param, projection


class FeedForward(nn.Module):
    """Linear -> activation -> dropout -> Linear -> dropout, with a residual and LayerNorm (pre or post)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, h, deterministic: bool):
        cfg = self.config

        def dense(features, name, axes):
            return projection(cfg, features, name, axes, bias=True)

        x = layer_norm(cfg, 'layer_norm')(h) if cfg.pre_lnorm else h
        # Both products on [B*T, d] rows: on [B, T, d] XLA:CPU copies the hidden gradient into a
        # transposed layout for the weight gradients (training steps 6-8 % slower at the peer shape,
        # docs/perf-notes.md). The rows are batch-major, so they shard as the batch does.
        x = x.reshape(-1, x.shape[-1])
        x = BLOCKS[cfg.block].activation(dense(cfg.d_inner, 'inner', ('embed', 'mlp'))(x))
        x = nn.with_logical_constraint(x, ('activation_batch', 'activation_mlp'))
        x = Dropout(cfg.dropout)(x, deterministic=deterministic)
        out = dense(cfg.d_model, 'outer', ('mlp', 'embed'))(x).reshape(h.shape[:-1] + (cfg.d_model,))
        return dropout_residual_norm(cfg, h, out, deterministic)


class DecoderLayer(nn.Module):
    """Attention over the memory's key blocks and the segment, then feed-forward.

    `(carry, state, shared, ctx, skip, index) -> (carry, (next state, aux losses))`, the signature
    of both the loop and the nn.scan body; `carry` is (the kind's stack rows or None, the segment's
    hidden states). `skip` (a traced bool, or None) runs the layer under `lax.cond`; `index` is the
    layer's place in the stack (int32, traced under nn.scan), which its memory sees in `LayerMaps`.
    """

    config: ModelConfig
    kind: MemoryKind
    deterministic: bool = True
    # Decoding token by token (memjax/generation): 'record' runs the segment whole and also returns
    # its LayerCache; 'step' runs one token at `position` against `cache`, the state unchanged.
    decoding: Optional[str] = None

    def __call__(self, carry, state, shared, ctx: AttentionContext, skip, index, cache=None, position=None):
        if skip is None or self.is_initializing():
            return self.compute(carry, state, shared, ctx, index, cache, position)
        # Only the parameters enter the branches: both must return the same variables, and the
        # skipped one sows nothing, so a layer that may be skipped sows nothing either.
        return nn.cond(skip, DecoderLayer.skip, DecoderLayer.compute, self, carry, state, shared, ctx, index,
                       variables='params')

    def _no_losses(self):
        return {name: jnp.zeros((), jnp.float32) for name in self.kind.loss_weights}

    def skip(self, carry, state, shared, ctx, index):
        return carry, (self.memory.skipped(state, shared, carry[1]), self._no_losses())

    @nn.compact
    def compute(self, carry, state, shared, ctx, index, cache=None, position=None):
        cfg = self.config
        rows, h = carry
        u_bias, v_bias, biases = ctx.u_bias, ctx.v_bias, ctx.biases
        if cfg.untie_r and POSITIONS[cfg.positions] is not None:
            bias = lambda name: param(self, name, normal(cfg.init_std, ('heads', 'kv')), (cfg.n_head, cfg.d_head))
            u_bias, v_bias = bias('u_bias'), bias('v_bias')
            biases = {name: bias(name) for name in self.kind.bias_names}
        memory = self.memory
        attention = RelativeAttention(cfg, name='attention')
        if self.decoding == 'step':  # The memory's keys and the kind's stack rows' are in the cache.
            out, _, cache = attention(h, [], ctx, u_bias, v_bias, self.deterministic,
                                      attend=lambda view: memory.attend_token(state, shared, view),
                                      biases=biases, index=index, cache=cache, position=position)
            out = FeedForward(cfg, name='feed_forward')(out, self.deterministic)
            return (None, out), (state, self._no_losses(), cache)
        row_block = None
        if rows is not None:
            row_block = self.kind.stack_rows(shared).replace(rows=rows)
        out, notes, *recorded = attention(
            h, lambda maps: memory.blocks(state, shared, h, maps), ctx, u_bias, v_bias, self.deterministic,
            attend=lambda view: memory.attend(state, shared, view), rows=row_block, biases=biases, index=index,
            record=self.decoding == 'record')
        out = FeedForward(cfg, name='feed_forward')(out, self.deterministic)
        written = memory.write(state, shared, h, notes)
        if rows is not None:  # The rows leave with their output, refreshed for the next layer.
            rows, out = out[:, :rows.shape[1]], out[:, rows.shape[1]:]
        return (rows, nn.with_logical_constraint(out, BTE)), written + tuple(recorded)

    def setup(self):
        self.memory = self.kind.layer(self.config, name='memory')


def _stack_rows(kind: MemoryKind, shared, h, decoding: Optional[str]):
    block = None if decoding == 'step' else kind.stack_rows(shared)
    return None if block is None else block.rows.astype(h.dtype)


REMAT_POLICIES = {'none': None, 'full': None, 'dots_saveable': jax.checkpoint_policies.dots_saveable}


@add_check
def _known_remat(cfg: ModelConfig) -> list[str]:
    return [] if cfg.remat in REMAT_POLICIES else [f'remat={cfg.remat!r} must be one of {tuple(REMAT_POLICIES)}.']


def layer_stack(cfg: ModelConfig, kind: MemoryKind, deterministic: bool, decoding: Optional[str] = None):
    """The layers as one callable `(h, layers, shared, ctx, skip) -> (h, next layers, losses)`,
    created in the calling module's scope (parameter names 'layer_{i}' or 'layers').

    layers: the memory state's per-layer pytree; skip: [n_layer] bool or None; losses: summed over
    layers. Besides 'dropout', the kind's random streams are split per layer. The kind's stack rows
    (`MemoryKind.stack_rows`) go up with h and are dropped after the last layer.

    With `decoding` (DecoderLayer.decoding) the callable also takes and returns the layers'
    LayerCaches: `(h, layers, shared, ctx, skip, caches, position) -> (h, next layers, losses,
    caches)`, a tuple of one per layer (stacked on a leading [n_layer] axis with scan_layers). Not
    stacked in the loop: a token step writes one slot of each, and slicing a stack apart and
    putting it back together would copy every cache every token.
    """
    layer_cls = DecoderLayer
    if cfg.remat != 'none':
        layer_cls = nn.remat(DecoderLayer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
        rngs = {'params': True, 'dropout': True, **{name: True for name in kind.streams}}
        # 'intermediates': values a memory sows for analysis, stacked over the layers.
        scanned = nn.scan(layer_cls, variable_axes={'params': 0, 'intermediates': 0}, split_rngs=rngs,
                          in_axes=(0, nn.broadcast, nn.broadcast, 0, 0, 0, nn.broadcast), length=cfg.n_layer,
                          metadata_params={nn.PARTITION_NAME: 'layers'})(cfg, kind, deterministic, decoding,
                                                                         name='layers')

        def scan(h, layers, shared, ctx, skip, caches=None, position=None):
            (_, h), (layers, losses, *caches) = scanned(
                (_stack_rows(kind, shared, h, decoding), h), layers, shared, ctx, skip,
                jnp.arange(cfg.n_layer, dtype=jnp.int32), caches, position)
            return (h, layers, jax.tree.map(lambda x: x.sum(0), losses), *caches)

        return scan
    stack = [layer_cls(cfg, kind, deterministic, decoding, name=f'layer_{i}') for i in range(cfg.n_layer)]

    def loop(h, layers, shared, ctx, skip, caches=None, position=None):
        outputs = []
        carry = (_stack_rows(kind, shared, h, decoding), h)
        for i, layer in enumerate(stack):
            carry, output = layer(carry, jax.tree.map(lambda x: x[i], layers), shared, ctx,
                                  None if skip is None else skip[i], jnp.int32(i),
                                  None if caches is None else caches[i], position)
            outputs.append(output)
        written, losses, *caches = zip(*outputs)
        return (carry[1], jax.tree.map(lambda *xs: jnp.stack(xs), *written), jax.tree.map(lambda *xs: sum(xs), *losses),
                *caches)

    return loop
