"""The layer stack: n_layer decoder layers, each with its slice of the memory state.

Every memory kind runs this stack; it differs only in the `LayerMemory` each layer calls. The stack
is a Python loop ('layer_{i}' parameters) or one nn.scan ('layers' parameters stacked on a leading
axis). Random streams are split per layer either way, and a layer can be skipped for a step under
`lax.cond`: its compute is really not done.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from memjax.model.attention import AttentionContext, RelativeAttention, dropout_residual_norm
from memjax.model.config import ModelConfig
from memjax.model.memories import MemoryKind
from memjax.model.positions import POSITIONS
from memjax.model.primitives import BLOCKS, BTE, Dropout, layer_norm, normal


class FeedForward(nn.Module):
    """Linear -> activation -> dropout -> Linear -> dropout, with a residual and LayerNorm (pre or post)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, h, deterministic: bool):
        cfg = self.config

        def dense(features, name, axes):
            return nn.Dense(features, dtype=cfg.dtype, name=name, kernel_init=normal(cfg.init_std, axes),
                            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, axes[1:]))

        x = layer_norm(cfg, 'layer_norm')(h) if cfg.pre_lnorm else h
        x = BLOCKS[cfg.block].activation(dense(cfg.d_inner, 'inner', ('embed', 'mlp'))(x))
        x = nn.with_logical_constraint(x, ('activation_batch', 'activation_length', 'activation_mlp'))
        x = Dropout(cfg.dropout)(x, deterministic=deterministic)
        return dropout_residual_norm(cfg, h, dense(cfg.d_model, 'outer', ('mlp', 'embed'))(x), deterministic)


class DecoderLayer(nn.Module):
    """Attention over the memory's key blocks and the segment, then feed-forward.

    `(h, state, shared, ctx, skip) -> (h, (next state, aux losses))`, the signature of both the
    loop and the nn.scan body. `skip` (a traced bool, or None) runs the layer under `lax.cond`.
    """

    config: ModelConfig
    kind: MemoryKind
    deterministic: bool = True

    def __call__(self, h, state, shared, ctx: AttentionContext, skip):
        if skip is None or self.is_initializing():
            return self.compute(h, state, shared, ctx)
        return nn.cond(skip, DecoderLayer.skip, DecoderLayer.compute, self, h, state, shared, ctx)

    def skip(self, h, state, shared, ctx):
        losses = {name: jnp.zeros((), jnp.float32) for name in self.kind.loss_weights}
        return h, (self.memory.skipped(state, shared), losses)

    @nn.compact
    def compute(self, h, state, shared, ctx):
        cfg = self.config
        u_bias, v_bias = ctx.u_bias, ctx.v_bias
        if cfg.untie_r and POSITIONS[cfg.positions] is not None:
            u_bias = self.param('u_bias', normal(cfg.init_std, ('heads', 'kv')), (cfg.n_head, cfg.d_head))
            v_bias = self.param('v_bias', normal(cfg.init_std, ('heads', 'kv')), (cfg.n_head, cfg.d_head))
        memory = self.memory
        out, notes = RelativeAttention(cfg, name='attention')(
            h, memory.blocks(state, shared, h), ctx, u_bias, v_bias, self.deterministic,
            attend=lambda view: memory.attend(state, shared, view))
        out = FeedForward(cfg, name='feed_forward')(out, self.deterministic)
        return nn.with_logical_constraint(out, BTE), memory.write(state, shared, h, notes)

    def setup(self):
        self.memory = self.kind.layer(self.config, name='memory')


REMAT_POLICIES = {'none': None, 'full': None, 'dots_saveable': jax.checkpoint_policies.dots_saveable}


def layer_stack(cfg: ModelConfig, kind: MemoryKind, deterministic: bool):
    """The layers as one callable `(h, layers, shared, ctx, skip) -> (h, next layers, losses)`,
    created in the calling module's scope (parameter names 'layer_{i}' or 'layers').

    layers: the memory state's per-layer pytree; skip: [n_layer] bool or None; losses: summed over
    layers. Besides 'dropout', the kind's random streams are split per layer.
    """
    layer_cls = DecoderLayer
    if cfg.remat != 'none':
        layer_cls = nn.remat(DecoderLayer, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)
    if cfg.scan_layers:
        rngs = {'params': True, 'dropout': True, **{name: True for name in kind.streams}}
        scanned = nn.scan(layer_cls, variable_axes={'params': 0}, split_rngs=rngs,
                          in_axes=(0, nn.broadcast, nn.broadcast, 0), length=cfg.n_layer,
                          metadata_params={nn.PARTITION_NAME: 'layers'})(cfg, kind, deterministic, name='layers')

        def scan(h, layers, shared, ctx, skip):
            h, (layers, losses) = scanned(h, layers, shared, ctx, skip)
            return h, layers, jax.tree.map(lambda x: x.sum(0), losses)

        return scan
    stack = [layer_cls(cfg, kind, deterministic, name=f'layer_{i}') for i in range(cfg.n_layer)]

    def loop(h, layers, shared, ctx, skip):
        written, losses = [], []
        for i, layer in enumerate(stack):
            h, (state, loss) = layer(h, jax.tree.map(lambda x: x[i], layers), shared, ctx,
                                     None if skip is None else skip[i])
            written.append(state)
            losses.append(loss)
        return h, jax.tree.map(lambda *xs: jnp.stack(xs), *written), jax.tree.map(lambda *xs: sum(xs), *losses)

    return loop
