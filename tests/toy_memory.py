"""A memory kind that exists only for the tests, registered as 'every_other'.

It keeps every other position of each layer's inputs, so its keys are not contiguous (explicit
distances through the gather path), and it uses every hook of the protocol: a shared leaf
without a batch axis, two random streams (one the same in every accumulation chunk), an
auxiliary loss, a random skip decision and a second training phase. Nothing in memjax knows it.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from memjax.model import memories
from memjax.model.attention import KeyBlock

SKIP_FROM_STEP = 2  # Phase 1 (random layer skips) starts here.
SQUARE_WEIGHT = 1e-3


def _kept_positions(seg_len: int) -> range:
    """Positions t of a segment whose distance seg_len - t to the next segment is even."""
    return range(seg_len % 2, seg_len, 2)


class EveryOtherLayer(memories.LayerMemory):

    def blocks(self, state, shared, layer_input, maps):
        seg_len = layer_input.shape[1]
        distances = shared['distance'][None, None, None, :] + jnp.arange(seg_len)[None, None, :, None]
        return [KeyBlock(rows=state['hidden'], valid=shared['valid'][:, None, None, :],
                         distances=distances)]

    def write(self, state, shared, layer_input, notes):
        keep = state['hidden'].shape[1]
        kept = layer_input[:, layer_input.shape[1] % 2::2]  # _kept_positions
        hidden = jnp.concatenate([state['hidden'], kept.astype(state['hidden'].dtype)], axis=1)
        rows = layer_input.shape[0]
        # One draw per layer and batch chunk of each stream, spread over the chunk's rows.
        draws = {name: jnp.full((rows,), jax.random.uniform(self.make_rng(name), ()))
                 for name in ('same_in_chunks', 'own')}
        square = jnp.sum(layer_input.astype(jnp.float32) ** 2) / layer_input.shape[-1]
        return {'hidden': jax.lax.stop_gradient(hidden[:, hidden.shape[1] - keep:]), **draws}, {'square': square}


@memories.register
class EveryOtherMemory(memories.MemoryKind):
    name = 'every_other'
    layer = EveryOtherLayer
    run_time_fields = ('mem_len',)
    streams = {'same_in_chunks': True, 'own': False, 'skip': True}
    loss_weights = {'square': SQUARE_WEIGHT}
    phase_starts = (SKIP_FROM_STEP,)

    @classmethod
    def validate(cls, config):
        return []

    def init(self, batch_size):
        cfg = self.config
        m = cfg.mem_len
        per_layer = lambda: jnp.zeros((cfg.n_layer, batch_size), jnp.float32)
        return memories.MemoryState(
            layers={'hidden': jnp.zeros((cfg.n_layer, batch_size, m, cfg.d_model), cfg.dtype),
                    'same_in_chunks': per_layer(), 'own': per_layer()},
            shared={'valid': jnp.zeros((batch_size, m), bool),
                    'distance': 2 * (m - jnp.arange(m, dtype=jnp.int32))})

    def logical_axes(self):
        per_layer = P(None, 'activation_batch')
        return memories.MemoryState(
            layers={'hidden': P(None, 'activation_batch', 'activation_length', 'activation_embed'),
                    'same_in_chunks': per_layer, 'own': per_layer},
            shared={'valid': P('activation_batch', 'activation_length'), 'distance': P(None)})

    def advance(self, shared, embedded):
        seg_len = embedded.shape[1]
        keep = shared['distance'].shape[0]
        new = jnp.asarray([seg_len - t for t in _kept_positions(seg_len)], jnp.int32)
        valid = jnp.concatenate([shared['valid'], jnp.ones((shared['valid'].shape[0], len(new)), bool)], axis=1)
        distance = jnp.concatenate([shared['distance'] + seg_len, new])
        return {'valid': valid[:, valid.shape[1] - keep:], 'distance': distance[distance.shape[0] - keep:]}

    def position_rows(self, seg_len):
        return 2 * (self.config.mem_len + seg_len)

    def skip_layers(self, key, phase):
        if phase == 0:
            return None
        return jax.random.bernoulli(key, 0.5, (self.config.n_layer,))
