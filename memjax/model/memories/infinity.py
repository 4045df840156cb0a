"""The infinity-former's memory (Martins et al., 2022): a continuous, unbounded long-term memory
(LTM) in every layer, beside Transformer-XL's short-term memory (STM).

Each layer keeps its past as a continuous signal X(t) = B^T psi(t) over t in [0, 1]: N Gaussian
basis functions psi and coefficients B [N, d_model], fitted by ridge regression (eq. 5). Each step:

1. The rows that left the STM the step before (the previous segment when mem_len = 0), smoothed by
   a convolutional gate (eq. 18), are appended to the old signal contracted into [0, tau] and
   sampled at M positions (eq. 13-15), and B is refitted. The sample positions are evenly spaced
   or, with sticky memories (section 3.3), drawn where the previous step's attention went.
2. Every query attends the signal with a Gaussian density N(mu, sigma^2) whose parameters come
   from its scores against the LTM keys (eq. 8-10); the closed form E_p[psi] gives the context
   (eq. 11), projected and added to the attention output (eq. 12).
3. A KL term pulls sigma^2 towards sigma_0^2 (eq. 20-22), reported as the auxiliary loss 'kl'.

Per-step cost is independent of how much text the memory holds: N, M and the segment fix every
shape. Where the paper is silent or differs from the authors' released code
(deep-spin/infinite-former), memjax computes what the code computes by default and offers the
alternative by name:

- the mu / sigma networks have no bias (as the code);
- the regression zero-pads the signal on both sides (paper: silent). A fresh memory's fit (G_L)
  pads at the rows' own spacing, as the code does. The refit after an update (G_inf) pads, by
  default (`ltm_padding='released'`), where the code does: a grid shifted by 1 / (2L + M) rather
  than by its half step; 'even' continues the rows' spacing instead (about 1 % apart in G_inf at
  the PG-19 shape). The code's G_inf needs an even segment length (its odd branch fails); memjax
  uses the same grid for any length;
- the KL term is the true KL of eq. 20 (eq. 21 as printed drops a 2), averaged over heads (the
  code's mean, which its lambda_KL values were tuned with). By default the prior is centred on mu
  (variance term only, eq. 21 and the sorting code); `ltm_kl_mu0` adds the mean term
  (mu - mu_0)^2 / sigma_0^2, which the released GPT-2 runs have with mu_0 = -1 (their code adds it
  only for mu_0 <= 0; memjax whenever the field is set);
- a sticky sample is uniform inside its histogram bin by default; the code takes the bin's left
  edge (`ltm_sticky_within_bin='left_edge'`).

State per layer: `hidden` [B, segment_len + mem_len, d_model] (oldest segment_len rows: waiting
for the LTM; the rest: the STM), `coefficients` [B, N, d_model] float32, and the previous step's
`mu`, `sigma2` [B, H, segment_len]. Shared: `valid` [B, segment_len + mem_len] and `ltm_tokens`
[B], the tokens the LTM holds since it last started afresh.

A memory that is not whole segments (mem_len = q S + r, 0 < r < S) hands the LTM, once per
document, a waiting block whose oldest r rows precede the document: the LTM then starts from the
block's S - r rows alone (their own fresh fit), so every token of the document reaches it, as with
whole segments. (The authors' code has fit matrices for whole segments only.)
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from memjax.model.attention import Attended, KeyBlock
from memjax.model.config import KindFields, ModelConfig, example
from memjax.model.memories import LayerMemory, MemoryState, Problems, register
from memjax.model.memories.xl import XLMemory
from memjax.model.primitives import normal, param, projection


# ----------------------------------------------------------------------------------------------
# The continuous signal: basis, ridge regression, continuous attention, sticky sampling.


def gaussian_basis(n_basis: int, widths: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(centres, widths) [N] of the basis: N / len(widths) centres evenly spaced over [0, 1], each
    with every width."""
    centres = np.linspace(0.0, 1.0, n_basis // len(widths))
    return np.repeat(centres, len(widths)), np.tile(np.asarray(widths, np.float64), len(centres))


def basis_values(t, centres, widths):
    """psi(t) [..., N]: Gaussian densities N(t; centre_j, width_j^2) (numpy or jax)."""
    xp = jnp if isinstance(t, jax.Array) else np
    z = (t[..., None] - centres) / widths
    return xp.exp(-0.5 * z * z) / (widths * np.sqrt(2.0 * np.pi))


# The regression zero-pads the signal on both sides, so the fit does not bend towards the ends of
# [0, 1]: floor(n / 2) zero-target points left of 0 (these functions place them) and their mirror
# images right of 1, for n real positions.
PADDINGS = ('released', 'even')


def even_padding(n: int) -> np.ndarray:
    """-(k + 1/2) / n: the rows' own spacing continued. The authors' code pads the fit of a fresh
    memory (G_L) this way, and memjax's `ltm_padding='even'` the refit after an update too."""
    return -(np.arange(n // 2)[::-1] + 0.5) / n


def released_padding(segment: int, samples: int) -> np.ndarray:
    """The authors' code's padding of the refit after an update (G_inf, with segment L and samples
    M): the points below 0 of a grid of 2 (L + M) points over [-1/2 + s, 3/2 - s] with
    s = 1 / (2L + M) (not 1 / (2 (L + M)), the grid's own half step)."""
    shift = 1.0 / (2 * segment + samples)
    grid = np.linspace(-0.5 + shift, 1.5 - shift, 2 * (segment + samples))
    return grid[grid < 0]


@functools.lru_cache(maxsize=32)
def ridge_matrix(positions: tuple[float, ...], padding: tuple[float, ...], n_basis: int,
                 widths: tuple[float, ...], ridge: float) -> np.ndarray:
    """G [len(positions), N] with B^T = X^T G the ridge fit of rows X placed at `positions` (eq. 5),
    the signal zero at `padding` (the points left of 0) and at their mirror images right of 1.

    Static: computed once per shape in float64 (numpy), never per step. Padded rows are zero, so
    only the real positions' rows of G are kept.
    """
    left = np.asarray(padding, np.float64)
    every = np.concatenate([left, np.asarray(positions, np.float64), 1.0 - left[::-1]])
    centres, sigmas = gaussian_basis(n_basis, widths)
    f = basis_values(every, centres, sigmas).T  # [N, n + pads]
    g = np.linalg.solve(f @ f.T + ridge * np.eye(n_basis), f).T  # F^T (F F^T + lambda I)^-1
    return g[len(left):len(left) + len(positions)].astype(np.float32)


def expected_basis(mu: jax.Array, sigma2: jax.Array, n_basis: int, widths: tuple[float, ...]) -> jax.Array:
    """E_{t ~ N(mu, sigma2)}[psi(t)] [..., N] over `gaussian_basis(n_basis, widths)`, in closed form:
    the integral over the real line of two Gaussian densities is N(mu; centre_j, sigma2 + width_j^2)."""
    return _expected_basis((n_basis, tuple(float(w) for w in widths)), mu, sigma2)


def _expected_basis_values(basis, mu, sigma2):
    centres, widths = gaussian_basis(*basis)
    var = sigma2[..., None] + jnp.asarray(np.square(widths), jnp.float32)
    return jnp.exp(-0.5 * (mu[..., None] - jnp.asarray(centres, jnp.float32)) ** 2 / var) / jnp.sqrt(
        2.0 * np.pi * var)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _expected_basis(basis, mu, sigma2):
    """basis: (n_basis, widths). The gradient is written out because XLA:CPU ran autodiff's (sums
    over N fused with the exponentials) at 40x the forward's time, 45 ms per layer at the PG-19
    shape; per width, its three sums over the centres are contractions."""
    return _expected_basis_values(basis, mu, sigma2)


def _expected_basis_fwd(basis, mu, sigma2):
    values = _expected_basis_values(basis, mu, sigma2)
    return values, (mu, sigma2, values)


def _expected_basis_bwd(basis, residuals, cotangent):
    # E_j = N(mu; c_j, v_j): dE/dmu = E (c - mu) / v, dE/dv = E ((c - mu)^2 / v^2 - 1 / v) / 2.
    # gaussian_basis orders j as (centre, width), so a [..., centres, widths] view splits them.
    mu, sigma2, values = residuals
    n_basis, widths = basis
    centres = jnp.linspace(0.0, 1.0, n_basis // len(widths))
    inv = 1.0 / (sigma2[..., None] + jnp.asarray(np.square(widths), jnp.float32))  # [..., widths]
    d = centres - mu[..., None]  # [..., centres]
    weighted = (cotangent * values).reshape(cotangent.shape[:-1] + (len(centres), len(widths)))
    by_power = [weighted.sum(-2)] + [jnp.einsum('...cw,...c->...w', weighted, p) for p in (d, d * d)]
    return (inv * by_power[1]).sum(-1), 0.5 * (inv * inv * by_power[2] - inv * by_power[0]).sum(-1)


_expected_basis.defvjp(_expected_basis_fwd, _expected_basis_bwd)


def kl_to_prior(mu: jax.Array, sigma2: jax.Array, sigma0: float, mu0: float | None = None) -> jax.Array:
    """KL(N(mu, sigma2) || N(mu0, sigma0^2)) (eq. 20):
    (sigma2 / s0^2 - log(sigma2 / s0^2) - 1 + (mu - mu0)^2 / s0^2) / 2.

    mu0 None: the prior is centred on mu itself, leaving the variance term only (the paper's eq. 21
    and the authors' sorting code); the released GPT-2 runs set mu0 = -1."""
    ratio = sigma2 / sigma0 ** 2
    mean = 0.0 if mu0 is None else (mu - mu0) ** 2 / sigma0 ** 2
    return 0.5 * (ratio - jnp.log(ratio) - 1.0 + mean)


def sticky_histogram(mu: jax.Array, sigma2: jax.Array, bins: int) -> jax.Array:
    """[B, bins] attention mass per bin of [0, 1], summed over heads and queries and normalised
    (eq. 16-17): Phi(edge_{k+1}) - Phi(edge_k) under each N(mu, sigma2); mu, sigma2 [B, H, T]."""
    edges = jnp.linspace(0.0, 1.0, bins + 1)
    cdf = 0.5 * jax.scipy.special.erf((edges - mu[..., None]) / jnp.sqrt(2.0 * sigma2[..., None]))
    mass = (cdf[..., 1:] - cdf[..., :-1]).sum(axis=(1, 2))
    mass = mass + jnp.finfo(jnp.float32).tiny  # No row without mass (all of it outside [0, 1]).
    return mass / mass.sum(-1, keepdims=True)


STICKY_WITHIN_BIN = ('uniform', 'left_edge')


@dataclasses.dataclass(frozen=True)
class InfinityFields(KindFields):
    """config.model.ltm_*: the continuous long-term memory."""

    ltm_basis: int = 512  # N Gaussian basis functions: N / len(ltm_widths) centres x the widths.
    ltm_widths: tuple[float, ...] = example((0.01, 0.05), '(0.01, 0.05)')
    ltm_ridge: float = 1.0  # lambda of the ridge regression.
    ltm_tau: float = 0.75  # The old signal is contracted into [0, tau].
    ltm_samples: int = -1  # M positions the old signal is sampled at; -1: ltm_basis.
    ltm_reset_tokens: int = 0  # Start the memory afresh after this many tokens; 0: only at documents.
    ltm_min_variance: float = 1e-6  # Floor of the attention density's variance.
    ltm_kl_weight: float = 1e-5  # lambda_KL; the KL term is also logged on its own (aux/kl).
    ltm_kl_sigma: float = 0.05  # sigma_0 of the KL prior.
    # mu_0 of the KL prior; None: centred on mu (variance term only). The released GPT-2 runs: -1.
    ltm_kl_mu0: float | None = None
    # Zero-padding of the refit after an update: 'released' (the authors' code) or 'even'.
    ltm_padding: str = 'released'
    ltm_sticky: bool = False  # Sticky memories: sample where last step attended, not evenly.
    ltm_sticky_bins: int = 128
    ltm_sticky_within_bin: str = 'uniform'  # Or 'left_edge', as the authors' code.


def sticky_positions(key: jax.Array, histogram: jax.Array, samples: int, within_bin: str = 'uniform') -> jax.Array:
    """[B, samples] sorted positions in [0, 1]: a bin drawn from each row's histogram, then a
    position inside it: uniform, or the bin's left edge as the authors' code takes it (M samples
    then fall on at most `bins` distinct points, sampling the old signal at those alone)."""
    bins = histogram.shape[-1]
    k_bin, k_pos = jax.random.split(key)
    chosen = jax.random.categorical(k_bin, jnp.log(histogram), axis=-1, shape=(samples,) + histogram.shape[:1])
    offset = jax.random.uniform(k_pos, chosen.shape) if within_bin == 'uniform' else 0.0
    return jnp.sort(((chosen + offset) / bins).T, axis=-1)


# ----------------------------------------------------------------------------------------------
# The memory kind.


class Gate(nn.Module):
    """The smoothing gate's convolution (eq. 18): width 3, stride 1, zero-padded, d_model -> d_model,
    with nn.Conv's parameters (kernel [3, in, out], bias [out]).

    Written as one matmul over each row and its two neighbours: XLA:CPU's convolution backward ran
    this layer at a fraction of the matmul's speed at some shapes (docs/perf-notes.md)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        kernel = param(self, 'kernel', normal(cfg.init_std, (None, 'embed', 'mlp')), (3, x.shape[-1], cfg.d_model))
        bias = param(self, 'bias', nn.with_logical_partitioning(nn.initializers.zeros, ('mlp',)), (cfg.d_model,))
        padded = jnp.pad(x, ((0, 0), (1, 1), (0, 0)))
        window = jnp.stack([padded[:, :-2], padded[:, 1:-1], padded[:, 2:]], axis=2)  # [B, S, 3, D]
        return jnp.einsum('bskd,kde->bse', window.astype(cfg.dtype), kernel.astype(cfg.dtype)) + bias.astype(cfg.dtype)


class InfinityLayerMemory(LayerMemory):
    """One layer's LTM: the gate, the LTM's key/value/output maps and the mu / sigma networks."""

    def setup(self):
        cfg = self.config
        heads, in_axes = (cfg.n_head, cfg.d_head), ('embed', 'heads', 'kv')
        self.gate = Gate(cfg)
        self.key = projection(cfg, heads, 'key', in_axes)
        self.value = projection(cfg, heads, 'value', in_axes)
        self.out = projection(cfg, cfg.d_model, 'out', ('heads', 'kv', 'embed'), in_dims=2)
        self.mu = projection(cfg, 1, 'mu', (None, None))
        self.sigma = projection(cfg, 1, 'sigma', (None, None))

    def blocks(self, state, shared, layer_input, maps):
        cfg = self.config
        if cfg.mem_len == 0:
            return []
        return [KeyBlock(rows=state['hidden'][:, cfg.segment_len:],
                         valid=shared['valid'][:, None, None, cfg.segment_len:])]

    def _refit(self, state, shared):
        """Coefficients [B, N, D] of the old signal, contracted, plus the gated waiting rows."""
        cfg = self.config
        kind = InfinityMemory(cfg)
        waiting = state['hidden'][:, :cfg.segment_len]
        if kind.partial_rows():  # Rows before the document are none of its signal, nor its gate's.
            waiting = jnp.where(shared['valid'][:, :cfg.segment_len, None], waiting, 0)
        # The ridge fit (G solved in float64 once per shape) is applied in float32 at full precision
        # under any compute dtype: the coefficients are refit from themselves every update, so a
        # bf16 or TF32 rounding would compound over a document.
        einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
        new = (waiting * nn.sigmoid(self.gate(waiting))).astype(jnp.float32)
        past_rows, new_rows = kind.update_matrices()
        fresh = kind.starts_afresh(shared)[:, None, None]
        g_fresh = kind.fresh_matrix()
        if kind.partial_rows():  # Only then can a used block start before the document.
            partial = ~shared['valid'][:, 0, None, None]
            g_fresh = jnp.where(partial, kind.fresh_matrix(kind.partial_rows()), g_fresh)
        g_new = jnp.where(fresh, g_fresh, new_rows)  # [B, S, N]
        coefficients = einsum('bsn,bsd->bnd', g_new, new)
        old = state['coefficients']
        if cfg.ltm_sticky:
            positions = sticky_positions(self.make_rng('sticky'),
                                         sticky_histogram(state['mu'], state['sigma2'], cfg.ltm_sticky_bins),
                                         kind.samples, cfg.ltm_sticky_within_bin)
            # Where the memory was sampled (apply(..., mutable='intermediates') to inspect or plot).
            self.sow('intermediates', 'sticky_positions', positions)
            sampled = einsum('bmn,bnd->bmd', basis_values(positions, *kind.basis), old)
            past = einsum('mn,bmd->bnd', past_rows, sampled)
        else:  # Evenly spaced samples: sampling and refitting fold into one static [N, N] map.
            past = einsum('nk,bkd->bnd', kind.even_resample_matrix(), old)
        return coefficients + jnp.where(fresh, 0.0, past)

    def attend(self, state, shared, view):
        cfg = self.config
        used = InfinityMemory(cfg).waiting_used(shared)  # The LTM holds something this step.
        coefficients = self._refit(state, shared)
        ltm = {'keys': self.key(coefficients), 'values': self.value(coefficients), 'used': used}  # [B, N, H, Dh]
        extra, mu, sigma2 = self._read(ltm, view.query)
        kl = (kl_to_prior(mu, sigma2, cfg.ltm_kl_sigma, cfg.ltm_kl_mu0).mean(axis=1).sum(axis=-1) * used).sum()
        return Attended(extra, notes={'coefficients': coefficients, 'mu': mu, 'sigma2': sigma2, 'used': used,
                                      'kl': kl}, cache=ltm)

    def attend_token(self, state, shared, view):
        return Attended(self._read(view.cached, view.query)[0])

    def _read(self, ltm, query):
        """The continuous attention of queries [B, T, H, Dh] over the LTM's keys and values:
        (its output [B, T, d_model], mu and sigma^2 [B, H, T]); each query alone."""
        cfg = self.config
        scores = jnp.einsum('bthd,bnhd->bhtn', query, ltm['keys'],
                            preferred_element_type=jnp.float32) * cfg.d_head ** -0.5
        # mu, sigma^2 and the Gaussian densities in float32: bf16 spaces mu's values near 1 by
        # 2^-8 = 0.004, 40 % of the narrowest basis width (0.01), enough to move the read.
        mu = nn.sigmoid(self.mu(scores)[..., 0].astype(jnp.float32))  # [B, H, T]
        sigma2 = jnp.maximum(nn.softplus(self.sigma(scores)[..., 0].astype(jnp.float32)), cfg.ltm_min_variance)
        density = expected_basis(mu, sigma2, cfg.ltm_basis, cfg.ltm_widths)  # [B, H, T, N]
        context = jnp.einsum('bhtn,bnhd->bthd', density.astype(cfg.dtype), ltm['values'])
        return self.out(context) * ltm['used'][:, None, None].astype(cfg.dtype), mu, sigma2

    def write(self, state, shared, layer_input, notes):
        keep = state['hidden'].shape[1]
        hidden = jnp.concatenate([state['hidden'], layer_input.astype(state['hidden'].dtype)], axis=1)
        used = notes['used']
        pick = lambda new, old: jnp.where(used.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)
        written = {'hidden': hidden[:, -keep:],
                   **{name: pick(notes[name], state[name]) for name in ('coefficients', 'mu', 'sigma2')}}
        # Gradients never flow into a past segment.
        return jax.lax.stop_gradient(written), {'kl': notes['kl']}


@register
class InfinityMemory(XLMemory):
    """The XL memory extended by segment_len waiting rows and the continuous LTM (module docstring)."""
    fields = InfinityFields

    name = 'infinity'
    layer = InfinityLayerMemory
    run_time_fields = ('mem_len', 'memory_start', 'ltm_reset_tokens', 'ltm_sticky', 'ltm_sticky_bins',
                       'ltm_sticky_within_bin', 'ltm_tau', 'ltm_samples', 'ltm_padding')
    # Sticky samples: every accumulation chunk draws its own (its rows are other sequences).
    streams = {'sticky': False}
    skip_retain = False  # Its long-term memory would have to age too: not built.
    cross_head = False  # Its long-term memory's keys and values are its own, not permuted.

    def holds(self) -> str:
        cfg = self.config
        recent = f' and {cfg.mem_len} recent tokens' if cfg.mem_len else ''
        return f'long-term memory of {cfg.ltm_basis} basis functions{" (sticky)" if cfg.ltm_sticky else ""}{recent}'

    @classmethod
    def validate(cls, config):
        problems = Problems()
        need = problems.need

        need(config.segment_len >= 1, f'memory=\'infinity\' sizes its state by the segment: segment_len='
             f'{config.segment_len} must be >= 1 (-1 takes config.train.tgt_len).')
        need(config.ltm_basis >= 1 and config.ltm_widths and config.ltm_basis % len(config.ltm_widths) == 0,
             f'ltm_basis={config.ltm_basis} must be a positive multiple of len(ltm_widths)='
             f'{len(config.ltm_widths)} (centres x widths).')
        need(all(w > 0 for w in config.ltm_widths), f'ltm_widths={config.ltm_widths} must be > 0.')
        need(0.0 < config.ltm_tau < 1.0, f'ltm_tau={config.ltm_tau} must be in (0, 1).')
        for name in ('ltm_ridge', 'ltm_min_variance', 'ltm_kl_sigma'):
            need(getattr(config, name) > 0, f'{name}={getattr(config, name)} must be > 0.')
        need(config.ltm_kl_weight >= 0, f'ltm_kl_weight={config.ltm_kl_weight} must be >= 0.')
        need(config.ltm_samples == -1 or config.ltm_samples >= 1,
             f'ltm_samples={config.ltm_samples} must be >= 1 (-1: ltm_basis).')
        need(config.ltm_reset_tokens >= 0, f'ltm_reset_tokens={config.ltm_reset_tokens} must be >= 0 '
             '(0: only at document boundaries).')
        need(config.ltm_sticky_bins >= 1, f'ltm_sticky_bins={config.ltm_sticky_bins} must be >= 1.')
        need(config.ltm_sticky_within_bin in STICKY_WITHIN_BIN,
             f'ltm_sticky_within_bin={config.ltm_sticky_within_bin!r} must be one of {STICKY_WITHIN_BIN}.')
        need(config.ltm_padding in PADDINGS, f'ltm_padding={config.ltm_padding!r} must be one of {PADDINGS}.')
        need(config.ltm_kl_mu0 is None or np.isfinite(config.ltm_kl_mu0),
             f'ltm_kl_mu0={config.ltm_kl_mu0} must be a finite number, or unset for the variance-only KL.')
        return problems

    @property
    def loss_weights(self):
        return {'kl': self.config.ltm_kl_weight}

    @property
    def samples(self) -> int:
        cfg = self.config
        return cfg.ltm_basis if cfg.ltm_samples == -1 else cfg.ltm_samples

    @property
    def basis(self) -> tuple[np.ndarray, np.ndarray]:
        return gaussian_basis(self.config.ltm_basis, self.config.ltm_widths)

    def _ridge(self, positions, padding) -> np.ndarray:
        cfg = self.config
        return ridge_matrix(tuple(float(p) for p in positions), tuple(float(p) for p in padding),
                            cfg.ltm_basis, cfg.ltm_widths, cfg.ltm_ridge)

    def fresh_matrix(self, rows: int | None = None) -> np.ndarray:
        """G_L [S, N] of a memory starting afresh from the newest `rows` of the S waiting rows
        (default: all), at (k + 1/2) / rows, evenly padded; the older rows get no weight."""
        s = self.config.segment_len
        rows = s if rows is None else rows
        return np.pad(self._ridge((np.arange(rows) + 0.5) / rows, even_padding(rows)), ((s - rows, 0), (0, 0)))

    def partial_rows(self) -> int:
        """The rows of the one waiting block per document that is partly before the document's start
        (mem_len not whole segments; module docstring), else 0."""
        part = self.config.mem_len % self.config.segment_len
        return self.config.segment_len - part if part else 0

    def waiting_used(self, shared) -> jax.Array:
        """[B] rows whose waiting block holds a token this step: its newest row does, if any (with
        whole segments a block is valid or not as a whole, and its oldest row says so)."""
        return shared['valid'][:, self.config.segment_len - 1 if self.partial_rows() else 0]

    def update_matrices(self) -> tuple[np.ndarray, np.ndarray]:
        """G_inf's rows [M, N] for the old signal's samples at k tau / M and [S, N] for the new rows
        at tau + (1 - tau) k / S (eq. 15; k from 1), padded as `ltm_padding` says."""
        cfg, m, s = self.config, self.samples, self.config.segment_len
        positions = np.concatenate([np.arange(1, m + 1) * cfg.ltm_tau / m,
                                    cfg.ltm_tau + (1.0 - cfg.ltm_tau) * np.arange(1, s + 1) / s])
        padding = released_padding(s, m) if cfg.ltm_padding == 'released' else even_padding(m + s)
        g = self._ridge(positions, padding)
        return g[:m], g[m:]

    def even_resample_matrix(self) -> np.ndarray:
        """[N, N]: old coefficients -> their part of the new ones, sampling at k / M (eq. 14)."""
        past_rows, _ = self.update_matrices()
        centres, widths = self.basis
        samples = basis_values(np.arange(1, self.samples + 1) / self.samples, centres, widths)  # [M, N]
        return (past_rows.astype(np.float64).T @ samples).astype(np.float32)

    def starts_afresh(self, shared) -> jax.Array:
        """[B] rows whose LTM is empty or has reached ltm_reset_tokens: refit from the new rows only."""
        tokens = shared['ltm_tokens']
        fresh = tokens == 0
        if self.config.ltm_reset_tokens:
            fresh |= tokens >= self.config.ltm_reset_tokens
        return fresh

    def init(self, batch_size):
        cfg = self.config
        rows = cfg.segment_len + cfg.mem_len
        per_query = jnp.zeros((cfg.n_layer, batch_size, cfg.n_head, cfg.segment_len), jnp.float32)
        return MemoryState(
            layers={'hidden': jnp.zeros((cfg.n_layer, batch_size, rows, cfg.d_model), cfg.dtype),
                    'coefficients': jnp.zeros((cfg.n_layer, batch_size, cfg.ltm_basis, cfg.d_model), jnp.float32),
                    'mu': per_query, 'sigma2': per_query + 1.0},
            shared={'valid': jnp.full((batch_size, rows), cfg.memory_start == 'zeros'),
                    'ltm_tokens': jnp.zeros((batch_size,), jnp.int32)})

    def logical_axes(self):
        per_query = P(None, 'activation_batch', 'activation_heads', 'activation_length')
        return MemoryState(
            layers={'hidden': P(None, 'activation_batch', 'activation_length', 'activation_embed'),
                    'coefficients': P(None, 'activation_batch', None, 'activation_embed'),
                    'mu': per_query, 'sigma2': per_query},
            shared={'valid': P('activation_batch', 'activation_length'), 'ltm_tokens': P('activation_batch')})

    def advance(self, shared, embedded):
        used = self.waiting_used(shared)
        entered = (jnp.sum(shared['valid'][:, :self.config.segment_len], axis=1, dtype=jnp.int32)
                   if self.partial_rows() else self.config.segment_len)  # A used block of whole segments is whole.
        tokens = jnp.where(self.starts_afresh(shared), 0, shared['ltm_tokens']) + entered
        return {**super().advance({'valid': shared['valid']}, embedded),
                'ltm_tokens': jnp.where(used, tokens, shared['ltm_tokens'])}
