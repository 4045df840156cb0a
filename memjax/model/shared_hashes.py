"""Random draws that share their Threefry hashes: the same bits, a fraction of the compile time.

A model's init folds a key per parameter and draws each parameter from it: two Threefry hashes per
parameter, each 20 rounds of integer operations that XLA inlines, fuses and schedules on its own,
so compiling a small model's init takes seconds, most of it these hashes. `with_shared_hashes(fn)`
traces `fn` and runs it with the hashes that do not depend on one another merged: every key fold
of one round is one hash over a vector of keys, every small draw of one round one hash over the
draws' counters laid end to end. Threefry works on each (key, counter) pair alone, so the bits, and
every value made from them, are JAX's own, bit for bit. A scanned layer stack's body shares its
own draws (one layer's, at each step); other control flow runs as traced. `python -m memjax.bench
compile` times an init both ways.

Large draws keep a hash each: under a sharded init (the train state's jit with out_shardings) XLA
computes each device's shard of a draw where it lives, and a shared hash would compute it whole on
every device. Keys of other implementations (`jax_default_prng_impl`), key arrays, 64-bit draws and
the original, non-partitionable Threefry bits run as JAX runs them.
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
from typing import Any, Callable

import jax
import jax.extend.core as jex_core
import jax.extend.random as jex_random
import jax.numpy as jnp
from jax import lax

# Draws up to this many values share hashes (256 KiB of float32; biases, norms, a small model's
# matrices); larger ones are sharded draws in real models.
SHARED_DRAW_MAX_SIZE = 2**16

_RANDOM = ('random_bits', 'random_fold_in')


def with_shared_hashes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn with the same outputs, its independent Threefry hashes computed together (module doc)."""

    @functools.wraps(fn)
    def shared(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _Program(closed).run(jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return shared


class _Program:
    """A traced function as one flat list of operations: the bodies of jitted helpers
    (jax.random.normal is one) inlined, so that the draws made inside them can be merged."""

    def __init__(self, closed):
        self.eqns = []  # (equation, scope): a variable is known by its scope, one per inlined body.
        self.alias = {}  # An inlined body's inputs and its call's outputs: what they stand for.
        self.values = {}  # Constants, arguments, then each operation's results.
        self.scopes = itertools.count(1)
        self.jaxpr = closed.jaxpr
        self._inline(closed.jaxpr, closed.consts, 0)

    def name(self, atom, scope):
        """What an atom of `scope` stands for: a Literal, or the (scope, variable) that holds it."""
        if isinstance(atom, jex_core.Literal):
            return atom
        return self.alias.get((scope, atom), (scope, atom))

    def sources(self, eqn, scope) -> list:
        """The (scope, variable)s an operation reads (not its literals)."""
        return [n for n in (self.name(v, scope) for v in eqn.invars) if not isinstance(n, jex_core.Literal)]

    def read(self, atom, scope):
        named = self.name(atom, scope)
        return named.val if isinstance(named, jex_core.Literal) else self.values[named]

    def _inline(self, jaxpr, consts, scope):
        self.values.update(((scope, v), c) for v, c in zip(jaxpr.constvars, consts))
        for eqn in jaxpr.eqns:
            if eqn.primitive.name != 'jit':
                self.eqns.append((eqn, scope))
                continue
            body, inner = eqn.params['jaxpr'], next(self.scopes)
            self.alias.update(((inner, v), self.name(a, scope)) for v, a in zip(body.jaxpr.invars, eqn.invars))
            self._inline(body.jaxpr, body.consts, inner)
            self.alias.update(((scope, v), self.name(a, inner)) for v, a in zip(eqn.outvars, body.jaxpr.outvars))

    def _needed(self) -> list:
        """The operations the outputs depend on, in order (a model's init traces its forward too)."""
        live = {n for n in (self.name(v, 0) for v in self.jaxpr.outvars) if not isinstance(n, jex_core.Literal)}
        kept = []
        for eqn, scope in reversed(self.eqns):
            if eqn.effects or any((scope, v) in live for v in eqn.outvars):
                kept.append((eqn, scope))
                live.update(self.sources(eqn, scope))
        return kept[::-1]

    def run(self, args) -> list:
        self.values.update(((0, v), x) for v, x in zip(self.jaxpr.invars, args))
        # An operation's round: the most random operations on any path to it. A round's random
        # operations depend only on earlier rounds, so they run together, then the rest of the
        # round in the trace's order (they may read this round's draws, never its later results).
        rounds = collections.defaultdict(lambda: ([], []))
        depth = collections.defaultdict(int)
        for eqn, scope in self._needed():
            d = max((depth[n] for n in self.sources(eqn, scope)), default=0)
            d += eqn.primitive.name in _RANDOM
            depth.update(((scope, v), d) for v in eqn.outvars)
            rounds[d][eqn.primitive.name not in _RANDOM].append((eqn, scope))

        for d in sorted(rounds):
            random, rest = rounds[d]
            key = lambda e, s: self.read(e.invars[0], s)
            folds = [(e, s) for e, s in random if e.primitive.name == 'random_fold_in' and _shares(key(e, s), e)
                     and self.read(e.invars[1], s).shape == () and self.read(e.invars[1], s).dtype == jnp.uint32]
            draws = [(e, s) for e, s in random if e.primitive.name == 'random_bits' and _shares(key(e, s), e)
                     and e.params['bit_width'] <= 32 and 0 < math.prod(e.params['shape']) <= SHARED_DRAW_MAX_SIZE]
            if folds:
                keys = _fold_in_together([key(e, s) for e, s in folds], [self.read(e.invars[1], s) for e, s in folds])
                self.values.update(((s, e.outvars[0]), k) for (e, s), k in zip(folds, keys))
            if draws:
                bits = _bits_together([key(e, s) for e, s in draws],
                                      [(e.params['bit_width'], tuple(e.params['shape'])) for e, _ in draws])
                self.values.update(((s, e.outvars[0]), b) for (e, s), b in zip(draws, bits))
            merged = {id(e) for e, _ in folds + draws}
            for eqn, scope in [(e, s) for e, s in random if id(e) not in merged] + rest:
                self._bind(eqn, scope)
        return [self.read(v, 0) for v in self.jaxpr.outvars]

    def _bind(self, eqn, scope):
        params = eqn.params
        if eqn.primitive.name == 'scan':  # A scanned layer stack: its body's draws share, per step.
            params = {**params, 'jaxpr': _shared_body(params['jaxpr'])}
        with eqn.ctx.manager:  # The settings it was traced under.
            outs = eqn.primitive.bind(*(self.read(v, scope) for v in eqn.invars),
                                      **eqn.primitive.get_bind_params(params))
        outs = outs if eqn.primitive.multiple_results else [outs]
        self.values.update(((scope, v), x) for v, x in zip(eqn.outvars, outs))


def _shared_body(closed):
    """A loop body (a ClosedJaxpr) with its own draws' hashes shared."""
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in closed.in_avals]
    return jax.make_jaxpr(lambda *args: _Program(closed).run(list(args)))(*args)


def _shares(key, eqn) -> bool:
    """One Threefry key, drawn from as jax_threefry_partitionable does (each value's counter alone),
    the setting the operation was traced under."""
    return key.shape == () and jax.random.key_impl(key) == 'threefry2x32' and eqn.ctx.threefry_partitionable


def _threefry(keys: list, counters_hi: jax.Array, counters_lo: jax.Array, sizes: list[int]):
    """One hash of each key with its `sizes[i]` counters, all keys' counters laid end to end."""
    raw = [jax.random.key_data(k) for k in keys]
    spread = lambda i: jnp.concatenate([jnp.broadcast_to(r[i], (n,)) for r, n in zip(raw, sizes)])
    return jex_random.threefry2x32_p.bind(spread(0), spread(1), counters_hi, counters_lo)


def _fold_in_together(keys: list, messages: list) -> list:
    # JAX's fold_in: the key's hash of the counter pair (message >> 32, message), 32-bit messages.
    n = len(keys)
    hi, lo = _threefry(keys, jnp.zeros((n,), jnp.uint32), jnp.stack(messages), [1] * n)
    return [jax.random.wrap_key_data(jnp.stack([hi[i], lo[i]]), impl='threefry2x32') for i in range(n)]


def _bits_together(keys: list, requests: list[tuple[int, tuple[int, ...]]]) -> list:
    # JAX's partitionable bits: value j of a draw hashes the counter pair (j >> 32, j); the two
    # halves are XORed (draws here are of 32 bits or fewer, and fewer than 2**32 values).
    sizes = [math.prod(shape) for _, shape in requests]
    counters = jnp.concatenate([lax.iota(jnp.uint32, n) for n in sizes])
    hi, lo = _threefry(keys, jnp.zeros_like(counters), counters, sizes)
    out, start = [], 0
    for (bit_width, shape), n in zip(requests, sizes):
        h, l = hi[start:start + n], lo[start:start + n]
        start += n
        out.append((h ^ l).astype(jnp.dtype(f'uint{bit_width}')).reshape(shape))
    return out
