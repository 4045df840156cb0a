"""Jitted training and evaluation steps over a block of consecutive segments.

Transformer-XL updates the parameters after every segment and carries the memory into
the next one; `lax.scan` over the segments of a batch keeps exactly that semantics while
paying for one dispatch per block instead of one per segment.
"""

import zlib
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax

from memjax import model as model_lib
from memjax.model import memories
from memjax.model.lm import ids_in_range

BATCH_KEYS = ('inputs', 'targets', 'mask', 'reset')
# Memory leaves without a batch axis (counters) are carried unsplit; every chunk sees the same.
NO_BATCH_AXIS = -1
# Metrics of the memory kind's auxiliary losses: f'{AUX_PREFIX}{name}' summed like 'nll_sum'.
AUX_PREFIX = 'aux_sum/'


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer updates applied so far.
    params: Any
    opt_state: Any
    rng: jax.Array  # Base key; each update's dropout key folds in `step`, so resumes replay it.


def state_shardings(partitioner: Any, mcfg: model_lib.ModelConfig, tx: optax.GradientTransformation) -> TrainState:
    """TrainState of the shardings `partitioner` (a runtime.sharding.Partitioner) gives its parts."""
    params, opt_state = partitioner.params_and_optimizer(mcfg, tx)
    return TrainState(step=partitioner.replicated, params=params, opt_state=opt_state, rng=partitioner.replicated)


def memory_batch_axes(mcfg: model_lib.ModelConfig) -> Any:
    """Per memory leaf, the index of its 'activation_batch' axis (NO_BATCH_AXIS when it has none):
    gradient accumulation splits the memory along it with the batch's streams."""
    axes = model_lib.memory_logical_axes(mcfg)
    batch = memories.BATCH_AXIS
    return jax.tree.map(lambda names: list(names).index(batch) if batch in names else NO_BATCH_AXIS,
                        axes, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def stream_keys(key: jax.Array, kind: memories.MemoryKind, chunk: jax.Array) -> dict:
    """The keys of the kind's random streams for accumulation chunk `chunk`: the same in every
    chunk of the step when the stream says so (a skip decision), else not."""
    rngs = {}
    for name, same_in_every_chunk in kind.streams.items():
        stream = jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)
        rngs[name] = stream if same_in_every_chunk else jax.random.fold_in(stream, chunk)
    return rngs


def _split_streams(x: jax.Array, chunks: int) -> jax.Array:
    """[B, ...] -> [chunks, B / chunks, ...], chunk c holding streams c, c + chunks, ...

    Strided, not contiguous: when B is split over devices in blocks, every device then holds
    rows of every chunk, so scanning over the chunks needs no communication.
    """
    x = x.reshape((x.shape[0] // chunks, chunks) + x.shape[1:])
    return jnp.moveaxis(x, 1, 0)


def _merge_streams(x: jax.Array) -> jax.Array:
    """Inverse of `_split_streams`."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def _split_memory(memory: Any, axes: Any, chunks: int) -> Any:
    def split(x, axis):
        if axis == NO_BATCH_AXIS:
            return jnp.broadcast_to(x, (chunks,) + x.shape)
        x = _split_streams(jnp.moveaxis(x, axis, 0), chunks)
        return jnp.moveaxis(x, 1, axis + 1)  # Each chunk keeps the memory's own layout.

    return jax.tree_util.tree_map(split, memory, axes)


def _merge_memory(memory: Any, axes: Any) -> Any:
    def merge(x, axis):
        if axis == NO_BATCH_AXIS:
            return x[-1]
        return jnp.moveaxis(_merge_streams(jnp.moveaxis(x, axis + 1, 1)), 0, axis)

    return jax.tree_util.tree_map(merge, memory, axes)


def _nll_sum(target_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    # `where`, not a product: a padded position may hold -inf and -inf * 0 is NaN.
    return -jnp.sum(jnp.where(mask > 0, target_logprobs.astype(jnp.float32), 0.0))


def out_of_range_ids(segment: dict, vocab_size: int) -> jax.Array:
    """Input ids, and target ids of scored positions, outside [0, vocab_size)."""
    bad_inputs = ~ids_in_range(segment['inputs'], vocab_size)
    bad_targets = (segment['mask'] > 0) & ~ids_in_range(segment['targets'], vocab_size)
    return jnp.sum(bad_inputs) + jnp.sum(bad_targets)


def train_step_fn(model: model_lib.MemoryLM, tx: optax.GradientTransformation,
                  schedule: optax.Schedule, memory_axes: Any,
                  grad_accum_steps: int) -> Callable:
    """Returns `(state, memory, batch[S, B, ...]) -> (state, memory, metrics[S])`, to be jitted.

    The batch's streams are cut into `grad_accum_steps` chunks, each with its slice of
    the memory; every chunk's loss is its NLL sum, plus the memory kind's weighted auxiliary
    loss sums, over the tokens of the whole batch, so the summed chunk gradients equal the
    gradient of the batch's mean loss exactly.
    """
    chunks = grad_accum_steps
    kind = model.kind

    def chunk_loss(params, segment, memory, rngs, num_tokens, scored):
        out, new_memory = model.apply(
            {'params': params}, segment['inputs'], memory, targets=segment['targets'],
            reset=segment['reset'], deterministic=False, rngs=rngs)
        nll = _nll_sum(out.target_logprobs, segment['mask'])
        total = nll
        if out.losses:
            # A segment with nothing scored (in any chunk) only builds memory, as the sorting
            # task's question does: no auxiliary loss trains on it either.
            aux = sum(kind.loss_weights[name] * value for name, value in out.losses.items())
            total = nll + jnp.where(scored, aux, 0.0)
        return total / num_tokens, (new_memory, nll, out.losses)

    grad_fn = jax.value_and_grad(chunk_loss, has_aux=True)

    def update(carry, segment):
        state, memory = carry
        key = jax.random.fold_in(state.rng, state.step)
        num_tokens = jnp.maximum(jnp.sum(segment['mask']), 1.0)
        scored = jnp.sum(segment['mask']) > 0
        split_segment = jax.tree_util.tree_map(lambda x: _split_streams(x, chunks), segment)
        split_memory = _split_memory(memory, memory_axes, chunks)

        def accumulate(grad_sum, xs):
            chunk_segment, chunk_memory, index = xs
            (_, (new_memory, nll, losses)), grads = grad_fn(
                state.params, chunk_segment, chunk_memory,
                {'dropout': jax.random.fold_in(key, index), **stream_keys(key, kind, index)}, num_tokens, scored)
            return jax.tree_util.tree_map(jnp.add, grad_sum, grads), (new_memory, nll, losses)

        zeros = jax.tree_util.tree_map(jnp.zeros_like, state.params)
        grads, (new_memory, nlls, losses) = jax.lax.scan(
            accumulate, zeros, (split_segment, split_memory, jnp.arange(chunks)))
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {
            'nll_sum': jnp.sum(nlls),
            'num_tokens': jnp.sum(segment['mask']),
            'grad_norm': optax.tree.norm(grads),
            'learning_rate': schedule(state.step),
            # Such ids make the loss NaN; counting them lets the NaN stop name its cause.
            'out_of_range_ids': out_of_range_ids(segment, model.config.vocab_size),
            **{AUX_PREFIX + name: jnp.sum(value) for name, value in losses.items()},
        }
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return (new_state, _merge_memory(new_memory, memory_axes)), metrics

    def train_step(state, memory, batch):
        batch = {k: batch[k] for k in BATCH_KEYS}
        (state, memory), metrics = jax.lax.scan(update, (state, memory), batch)
        return state, memory, metrics

    return train_step


def eval_step_fn(model: model_lib.MemoryLM, accuracy: bool = False, per_token: bool = False) -> Callable:
    """Returns `(params, memory, batch[S, B, ...], key) -> (memory, metrics[S])`, to be jitted.

    metrics: 'nll_sum' and 'num_tokens' per segment (with `accuracy`, also 'num_correct': scored
    tokens whose target is the most probable token), summed over the global batch, so
    every process reads the same totals; with `per_token`, also 'token_nll' [S, B, T], each
    target's loss (NaN where nothing is scored). `key` feeds the memory kind's random streams (a
    kind that samples at evaluation); segment s draws from `fold_in(key, s)`.
    """
    kind = model.kind

    def segment_nll(params, memory, segment, key):
        out, memory = model.apply(
            {'params': params}, segment['inputs'], memory, targets=segment['targets'],
            reset=segment['reset'], deterministic=True, rngs=stream_keys(key, kind, 0))
        metrics = {'nll_sum': _nll_sum(out.target_logprobs, segment['mask']),
                   'num_tokens': jnp.sum(segment['mask'] > 0)}
        if accuracy:
            guess = jnp.argmax(model.apply({'params': params}, out.hidden, method=model.logprobs), axis=-1)
            metrics['num_correct'] = jnp.sum((guess == segment['targets']) & (segment['mask'] > 0))
        if per_token:
            metrics['token_nll'] = jnp.where(segment['mask'] > 0, -out.target_logprobs.astype(jnp.float32), jnp.nan)
        return memory, metrics

    def eval_step(params, memory, batch, key):
        batch = {k: batch[k] for k in BATCH_KEYS}
        keys = jax.vmap(lambda s: jax.random.fold_in(key, s))(jnp.arange(batch['inputs'].shape[0]))
        return jax.lax.scan(lambda m, xs: segment_nll(params, m, *xs), memory, (batch, keys))

    return eval_step
