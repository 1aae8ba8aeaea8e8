"""Exponential-family structure of a NumPyro model: E-step statistics S and M-step map T.

For EM-type federated fits (:mod:`fedbayes.algorithms.fedmm`) the complete-data log-likelihood of a
client must be an exponential family in the global parameters theta (FedMM Example 2):

    log p(D_i, h_i | theta) = < S(D_i, h_i), phi(theta) > + (terms free of theta),

so that the EM surrogate of all clients, Q(theta; s) = < s, phi(theta) > with s = sum_i E[S(D_i, h_i)],
depends on the data only through the summed statistic s. Clients send E-step statistics; the server
applies the M-step map T(s) = argmax_theta Q(theta; s) + log p(theta) (MAP-EM; ML for ``param`` sites).

:func:`derive` builds S and T from the traced model. Every sample site whose distribution depends on
theta contributes one *term* to Q:

* a **table term**: the site's family is in :data:`FAMILIES` (Normal, MultivariateNormal, Bernoulli,
  Categorical, Poisson, Gamma, Exponential) and its parameters are the same for every observation
  and every value of the latents (a mixture component's parameters, a random effect's population
  law). Its statistic is the family's sufficient statistic summed over observations, per component:
  ``sum_j r_jk t(x_j)``;
* a **linear-Gaussian term**: a Normal site whose mean is affine in real-valued global
  *coefficients* beta with a design that may depend on covariates and latents,
  ``loc_j = G_j beta + o_j``, and whose scale is the same for every observation. Per component k and
  event element e it keeps ``n = sum w``, ``rr = sum w (y - o)^2``, ``Gr = sum w G (y - o)`` and
  ``GG = sum w G G^T`` (regression, mixture of regressions, mixed effects, probabilistic PCA);
* a discrete per-observation latent's own law contributes the component counts ``N_k``.

Latents are integrated out exactly where possible (the E-step):

* ``enumerate``: one discrete per-observation latent (mixture labels), by exact enumeration of its
  support with responsibilities ``r_jk`` (log-sum-exp, all theta-free terms kept);
* ``gaussian``: continuous latents (per client under ``fb.local()``, or per observation) in a model
  whose complete log-density is quadratic in them: exact Gaussian posterior from the gradient and
  Hessian, and exact expectations of the (at most quadratic) statistics,
  ``E[s(h)] = s(m) + 1/2 sum_a D^2 s(m)[L e_a, L e_a]`` with ``V = L L^T``;
* ``monte_carlo``: other continuous per-client latents, sampled by the client's unadjusted Langevin
  chain (stochastic EM / SAEM flavour; the statistic is a Monte Carlo average);
* ``none``: no latents (a fully observed exponential family).

T is computed in closed form when every global site maps one-to-one onto a parameter of the terms
(mixture weights, means, covariances, regression coefficients and noise scales: moment matching and
least squares) and the globals have no prior; otherwise (priors, shared or transformed parameters,
Gamma shapes) by maximising Q(theta; s) + log p(theta) numerically (BFGS in unconstrained space,
started from the closed form where it exists). Users can supply their own S and T with
:class:`CustomStatistics`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import jax.scipy.optimize
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.scipy.special import gammaln
from numpyro import distributions as dist
from numpyro import handlers
from numpyro.distributions.distribution import validation_enabled

from ..seeds import seed_key
from ..errors import ModelError
from ..introspect import FedModel, Params, DataMask, sum_log_prob
from ..linalg import lapack_free_cholesky, lapack_free_spd_inverse, lapack_free_tril_inverse

Stats = dict[str, Any]

# ------------------------------------------------------------------------------------ the family table


def _base(fn: dist.Distribution) -> dist.Distribution:
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution, dist.MaskedDistribution)):
        fn = fn.base_dist
    return fn


def _param(fn: dist.Distribution, name: str, extra: tuple[int, ...] = ()) -> jax.Array:
    """A parameter of the innermost distribution broadcast to the site's sample shape (+ ``extra``)."""
    return jnp.broadcast_to(getattr(_base(fn), name), fn.batch_shape + fn.event_shape + extra)


# ------------------------------------------------------------------------------------ Gaussian algebra
# jaxlib's CPU LAPACK kernels (Cholesky, triangular solve, LU, eigh, ...) split a batch of matrices
# over XLA's intra-op thread pool from inside a pool thread and block until the pieces are done. When
# as many such calls run at once as the pool has threads (XLA runs independent operations
# concurrently: one per mixture component, say), every pool thread waits for work queued behind it:
# a deadlock (jaxlib 0.10.2, batches of about 200,000 matrix elements or more). The client step runs
# under the engine's vmap, so a LAPACK call on anything that varies over clients or rows is such a
# batch. The E-step therefore factors a covariance shared by rows once (one matrix, never split;
# :func:`_shared_factor`) and factors per-client / per-row matrices with array operations below.


def _rebase(fn: dist.Distribution, base: dist.Distribution) -> dist.Distribution:
    """``fn`` with its innermost distribution replaced by ``base`` (the wrappers :func:`_base` unwraps kept)."""
    if isinstance(fn, dist.Independent):
        return dist.Independent(_rebase(fn.base_dist, base), fn.reinterpreted_batch_ndims)
    if isinstance(fn, dist.ExpandedDistribution):
        return dist.ExpandedDistribution(_rebase(fn.base_dist, base), fn.batch_shape)
    if isinstance(fn, dist.MaskedDistribution):
        return dist.MaskedDistribution(_rebase(fn.base_dist, base), fn._mask)
    return base


def _shared_factor(fn: dist.Distribution, axis: int) -> dist.Distribution:
    """A table term's MultivariateNormal ``fn`` (rows on ``axis``) evaluated with one Cholesky factor.

    A table term's covariance Sigma is the same on every row, so with Sigma = L L^T from row 0,

        log N(x_j | m_j, Sigma) = -1/2 |L^{-1} (x_j - m_j)|^2 - sum_i log L_ii - D/2 log(2 pi),

    one D x D factorisation and one triangular solve with every row (and, under the engine's vmap, every
    client) as a right-hand side: single-matrix LAPACK calls, which are never split over the thread
    pool. NumPyro's own evaluation factors and solves with each row's copy of Sigma, a batch over the
    rows (see the section comment above). Sigma depends on theta alone in a mixture's E-step, so this
    is one factorisation per component and round. Unchanged when row 0 holds more than one matrix.
    """
    factor = _row0_factor(fn, axis)
    return fn if factor is None else _rebase(fn, _WhitenedMVN(_base(fn).loc, scale_tril=factor))


def _row0_factor(fn: dist.Distribution, axis: int) -> jax.Array | None:
    """The Cholesky factor of a MultivariateNormal site's covariance on row 0 (one matrix, so a single LAPACK
    call); None when row 0 holds more than one matrix."""
    cov = _first(axis, _param(fn, "covariance_matrix", fn.event_shape))
    return jnp.linalg.cholesky(cov) if cov.ndim == 2 else None


class _WhitenedMVN(dist.MultivariateNormal):
    """A MultivariateNormal with one D x D Cholesky factor L whose log density whitens every row with
    L^{-1} formed once (:func:`fedbayes.linalg.lapack_free_tril_inverse`):

        log N(x | m, L L^T) = -1/2 |L^{-1} (x - m)|^2 - sum_i log L_ii - D/2 log(2 pi),

    a matrix product over all rows (and, under the engine's vmap, all clients at once) where NumPyro's
    ``log_prob`` solves a triangular system per batch: about 5x faster for a mixture's E-step on a CPU
    (``benchmarks/bench_fedmm.py``), and the same numbers up to rounding (L^{-1} of a well-conditioned
    covariance, as a centralised EM code forms it)."""

    def log_prob(self, value):
        # NumPyro broadcasts L to the batch shape; every copy is the one factor (XLA folds the slice away)
        factor = jnp.reshape(self.scale_tril, (-1,) + self.scale_tril.shape[-2:])[0]
        z = jnp.einsum("...j,ij->...i", value - self.loc, lapack_free_tril_inverse(factor))
        half_log_det = jnp.sum(jnp.log(jnp.diagonal(factor)))
        return -0.5 * (self.event_shape[0] * math.log(2 * math.pi) + jnp.sum(z**2, -1)) - half_log_det


def _components_mvn_log_probs(sites: list[dict], axis: int) -> jax.Array | None:
    """(K, N) log N(x_j | m_k, Sigma_k) of every component k and row j at once, for a MultivariateNormal table
    term whose component traces ``sites`` (one per k, rows on ``axis``) observe the same rows x; None where the
    term is not of that form (then each component is evaluated on its own).

    A table term's mean and covariance are the same on every row, so with Sigma_k = L_k L_k^T and A_k = L_k^-1
    (both from row 0) and any shift c (here the components' mean of the m_k),

        z_jk = A_k (x_j - m_k) = A_k (x_j - c) - A_k (m_k - c),

    one matrix product of the rows with the K factors side by side (D x KD) where component by component it
    would be K products of D columns each: on a CPU about 3x faster for a mixture's E-step (the products
    are too narrow to use the machine). The shift keeps the two terms at the scale of the data's spread
    about the means, as in the per-component form, whatever the data's offset (raw units)."""
    values = [site["value"] for site in sites]
    fns = [site["fn"] for site in sites]
    masks = [fn._mask if isinstance(fn, dist.MaskedDistribution) else None for fn in fns]  # the engine's padding
    inner = [fn.base_dist if isinstance(fn, dist.MaskedDistribution) else fn for fn in fns]
    plain = all(
        len(fn.batch_shape) == 1
        and type(_base(fn)) is dist.MultivariateNormal
        and (fn is _base(fn) or (isinstance(fn, dist.ExpandedDistribution) and fn.base_dist is _base(fn)))
        for fn in inner
    )
    same = all(v is values[0] for v in values) and all(m is masks[0] for m in masks)
    if not plain or not same or values[0].ndim != 2:
        return None
    locs = jnp.stack([_first(axis, _param(fn, "loc")) for fn in fns])  # (K, D)
    each = [_row0_factor(fn, axis) for fn in fns]  # one factorisation per component
    if any(f is None for f in each):
        return None
    factors = jnp.stack(cast(list[jax.Array], each))
    whiten = lapack_free_tril_inverse(factors)  # (K, D, D)
    x = jnp.moveaxis(values[0], axis, 0)
    shift = jnp.mean(locs, 0)
    # rows first in the product (one matrix product whatever the clients), components first in the result: the
    # E-step's sums over the K components then run along a leading axis, vectorised over the rows
    z = jnp.einsum("nj,kij->nki", x - shift, whiten) - jnp.einsum("kij,kj->ki", whiten, locs - shift)
    half_log_det = jnp.sum(jnp.log(jnp.diagonal(factors, axis1=-2, axis2=-1)), -1)
    lp = -0.5 * (x.shape[-1] * math.log(2 * math.pi) + jnp.sum(z**2, -1).T) - half_log_det[:, None]
    if masks[0] is None:
        return lp
    keep = jnp.broadcast_to(jnp.asarray(masks[0]), fns[0].batch_shape)
    return jnp.where(keep[None, :], lp, 0.0)  # as MaskedDistribution.log_prob: 0 off the mask


def family_of(fn: dist.Distribution) -> str | None:
    """The table entry of a NumPyro distribution, or None if it is not in the table."""
    base = _base(fn)
    for name, classes in _CLASSES.items():
        if isinstance(base, classes):
            return name
    return None


_CLASSES = {
    "normal": (dist.Normal,),
    "mvn": (dist.MultivariateNormal,),
    "bernoulli": (dist.BernoulliProbs, dist.BernoulliLogits),
    "categorical": (dist.CategoricalProbs, dist.CategoricalLogits),
    "poisson": (dist.Poisson,),
    "gamma": (dist.Gamma,),
    "exponential": (dist.Exponential,),
}


@dataclass(frozen=True)
class Family:
    """One exponential family: its sufficient statistic, surrogate and maximum-likelihood map.

    ``stats(x, w)`` sums the sufficient statistic over rows with weights ``w`` (x has rows first,
    then elements; None where it needs the distribution too, see :func:`_family_stats`);
    ``expected_loglik(params, s)`` is sum_j w_j log p(x_j | params) without the theta-free base
    measure; ``ml(s, fixed)`` is the closed-form maximiser (None if there is none), where ``fixed``
    holds the parameters that are constants of the model; ``ml_needs`` names the parameters without
    which it has none (they must be in ``fixed``: a Gamma shape).
    """

    params: tuple[str, ...]
    get: Callable[[dist.Distribution], dict[str, jax.Array]]
    stats: Callable[[jax.Array, jax.Array], dict[str, jax.Array]] | None
    expected_loglik: Callable[[dict[str, jax.Array], dict[str, jax.Array]], jax.Array]
    ml: Callable[[dict[str, jax.Array], dict[str, jax.Array]], dict[str, jax.Array] | None]
    project: Callable[[dict[str, jax.Array]], dict[str, jax.Array]]
    ml_needs: tuple[str, ...] = ()


def _ws(w, x):
    return jnp.reshape(w, w.shape + (1,) * (x.ndim - w.ndim))


def _count_sum(x, w, **more):
    """``{"s0": sum w, "s1": sum w x}`` plus ``{name: sum w f(x)}`` for each ``more`` f."""
    ww = _ws(w, x)
    out = {"s0": jnp.sum(ww * jnp.ones_like(x), 0), "s1": jnp.sum(ww * x, 0)}
    out.update({k: jnp.sum(ww * f(x), 0) for k, f in more.items()})
    return out


OUTER_FEATURES_DIM = 16
"""Up to this dimension D a multivariate normal's second moment sum_n w_n x_n x_n' is one product of the weights
with the rows' outer products x_n x_n' (D^2 numbers a row, from the data alone), beyond it a product of the
weighted rows w_n x_n with the rows (D numbers a row, but a product per weighting). The same sum; under a vmap over
several weightings (a mixture's components) the first is one matrix product with no weighted copy of the rows:
FedMM's round on a 5-component, 10-dimensional mixture at 100 clients went from 1.87 to 1.57 ms on two cores."""


def _weighted_outer_sum(x: jax.Array, w: jax.Array) -> jax.Array:
    """sum over the leading (row) axis of w_n x_n x_n' (x: (n, ..., D); w: (n, ...), a prefix of x's axes)."""
    if x.shape[-1] > OUTER_FEATURES_DIM:
        return jnp.einsum("n...i,n...j->...ij", _ws(w, x) * x, x)
    outer = x[..., :, None] * x[..., None, :]  # (n, ..., D, D): the data's alone
    weights = jnp.broadcast_to(_ws(w, x[..., 0]), x.shape[:-1]).astype(outer.dtype)
    return jnp.einsum("n...,n...ij->...ij", weights, outer)


def _clip_count(s0):
    return jnp.maximum(s0, _EPS)


_EPS = 1e-10


def _psd(m: jax.Array) -> jax.Array:
    """Euclidean projection of a symmetric matrix onto {M >= eps I} (eigenvalue clipping).

    Where every M - eps I of the batch has a Cholesky factor (all its eigenvalues exceed eps) the projection is M
    itself and the eigendecompositions are skipped (``lax.cond``: a statistic averaged from valid ones, FedMM's
    usual round, pays a Cholesky factorisation instead of an eigendecomposition; under ``jax.vmap`` over a batch of
    statistics, where ``lax.cond`` becomes a select, both run)."""
    m = 0.5 * (m + jnp.swapaxes(m, -1, -2))

    def clip(m: jax.Array) -> jax.Array:
        vals, vecs = jnp.linalg.eigh(m)
        return (vecs * jnp.maximum(vals, _EPS)[..., None, :]) @ jnp.swapaxes(vecs, -1, -2)

    inside = jnp.all(jnp.isfinite(jnp.linalg.cholesky(m - _EPS * jnp.eye(m.shape[-1], dtype=m.dtype))))
    return jax.lax.cond(inside, lambda m: m, clip, m)


def _normal_ml(s, fixed):
    loc = fixed["loc"] if "loc" in fixed else s["s1"] / s["s0"]
    if "scale" in fixed:
        return {"loc": loc}
    var = (s["s2"] - 2 * loc * s["s1"] + loc**2 * s["s0"]) / s["s0"]
    return {"loc": loc, "scale": jnp.sqrt(jnp.maximum(var, 0.0))}


def _normal_project(s):
    block = jnp.stack([jnp.stack([s["s0"], s["s1"]], -1), jnp.stack([s["s1"], s["s2"]], -1)], -2)
    block = _psd(block)
    return {"s0": block[..., 0, 0], "s1": block[..., 0, 1], "s2": block[..., 1, 1]}


def _mvn_ml(s, fixed):
    s0 = s["s0"][..., None]
    loc = fixed["loc"] if "loc" in fixed else s["s1"] / s0
    if "covariance_matrix" in fixed:
        return {"loc": loc}
    outer = jnp.einsum("...i,...j->...ij", loc, s["s1"])
    cov = s["s2"] - outer - jnp.swapaxes(outer, -1, -2) + s0[..., None] * jnp.einsum("...i,...j->...ij", loc, loc)
    return {"loc": loc, "covariance_matrix": cov / s0[..., None]}


def _mvn_loglik(p, s):
    loc, cov = p["loc"], p["covariance_matrix"]
    prec = jnp.linalg.inv(cov)
    outer = jnp.einsum("...i,...j->...ij", loc, s["s1"])
    centred = (
        s["s2"]
        - outer
        - jnp.swapaxes(outer, -1, -2)
        + s["s0"][..., None, None] * jnp.einsum("...i,...j->...ij", loc, loc)
    )
    return jnp.sum(-0.5 * jnp.einsum("...ij,...ji->...", prec, centred) - 0.5 * s["s0"] * jnp.linalg.slogdet(cov)[1])


def _mvn_project(s):
    d = s["s1"].shape[-1]
    top = jnp.concatenate([s["s0"][..., None, None], s["s1"][..., None, :]], -1)
    bottom = jnp.concatenate([s["s1"][..., :, None], s["s2"]], -1)
    block = _psd(jnp.concatenate([top, bottom], -2))
    return {
        "s0": block[..., 0, 0],
        "s1": block[..., 0, 1:],
        "s2": block[..., 1:, 1:].reshape(s["s2"].shape[:-2] + (d, d)),
    }


def _nonneg(*names):
    return lambda s: {k: (jnp.maximum(v, _EPS if k == "s0" else 0.0) if k in names else v) for k, v in s.items()}


def _bernoulli_project(s):
    s0 = _clip_count(s["s0"])
    return {"s0": s0, "s1": jnp.clip(s["s1"], 0.0, s0)}


FAMILIES: dict[str, Family] = {
    "normal": Family(
        ("loc", "scale"),
        lambda fn: {"loc": _param(fn, "loc"), "scale": _param(fn, "scale")},
        lambda x, w: _count_sum(x, w, s2=jnp.square),
        lambda p, s: jnp.sum(
            (p["loc"] * s["s1"] - 0.5 * s["s2"] - 0.5 * p["loc"] ** 2 * s["s0"]) / p["scale"] ** 2
            - s["s0"] * jnp.log(p["scale"])
        ),
        _normal_ml,
        _normal_project,
    ),
    "mvn": Family(
        ("loc", "covariance_matrix"),
        lambda fn: {"loc": _param(fn, "loc"), "covariance_matrix": _param(fn, "covariance_matrix", fn.event_shape)},
        lambda x, w: {
            "s0": jnp.sum(w * jnp.ones(x.shape[:-1]), 0),
            "s1": jnp.sum(_ws(w, x) * x, 0),
            "s2": _weighted_outer_sum(x, w),
        },
        _mvn_loglik,
        _mvn_ml,
        _mvn_project,
    ),
    "bernoulli": Family(
        ("probs",),
        lambda fn: {"probs": _param(fn, "probs")},
        _count_sum,
        lambda p, s: jnp.sum(s["s1"] * jnp.log(p["probs"]) + (s["s0"] - s["s1"]) * jnp.log1p(-p["probs"])),
        lambda s, fixed: {"probs": s["s1"] / s["s0"]},
        _bernoulli_project,
    ),
    "categorical": Family(
        ("probs",),
        lambda fn: {"probs": _param(fn, "probs", (_base(fn).probs.shape[-1],))},
        None,  # needs the number of classes: see _family_stats
        lambda p, s: jnp.sum(s["s1"] * jnp.log(p["probs"])),
        lambda s, fixed: {"probs": s["s1"] / s["s0"][..., None]},
        _nonneg("s0", "s1"),
    ),
    "poisson": Family(
        ("rate",),
        lambda fn: {"rate": _param(fn, "rate")},
        _count_sum,
        lambda p, s: jnp.sum(s["s1"] * jnp.log(p["rate"]) - s["s0"] * p["rate"]),
        lambda s, fixed: {"rate": s["s1"] / s["s0"]},
        _nonneg("s0", "s1"),
    ),
    "exponential": Family(
        ("rate",),
        lambda fn: {"rate": _param(fn, "rate")},
        _count_sum,
        lambda p, s: jnp.sum(s["s0"] * jnp.log(p["rate"]) - p["rate"] * s["s1"]),
        lambda s, fixed: {"rate": s["s0"] / s["s1"]},
        _nonneg("s0", "s1"),
    ),
    "gamma": Family(
        ("concentration", "rate"),
        lambda fn: {"concentration": _param(fn, "concentration"), "rate": _param(fn, "rate")},
        lambda x, w: _count_sum(x, w, s2=jnp.log),
        lambda p, s: jnp.sum(
            s["s0"] * (p["concentration"] * jnp.log(p["rate"]) - gammaln(p["concentration"]))
            + (p["concentration"] - 1) * s["s2"]
            - p["rate"] * s["s1"]
        ),
        lambda s, fixed: {"rate": fixed["concentration"] * s["s0"] / s["s1"]} if "concentration" in fixed else None,
        _nonneg("s0", "s1"),
        ml_needs=("concentration",),
    ),
}


def _family_stats(family: str, fn: dist.Distribution, x: jax.Array, w: jax.Array) -> dict[str, jax.Array]:
    if family == "categorical":
        onehot = jax.nn.one_hot(x, _base(fn).probs.shape[-1], dtype=w.dtype)
        return {"s0": jnp.sum(_ws(w, x) * jnp.ones(x.shape, w.dtype), 0), "s1": jnp.sum(_ws(w, onehot) * onehot, 0)}
    stats = FAMILIES[family].stats
    if stats is None:
        raise AssertionError(f"family {family!r} has no row statistic of its own")
    return stats(x, w)


# ------------------------------------------------------------------------------------ derived terms


@dataclass(frozen=True)
class _Target:
    """Where a term's parameter lives among the globals: ``site[index]`` (index None: the whole site)."""

    site: str
    index: int | None
    kind: str = "value"  # value | scale_tril (for an MVN covariance given by its Cholesky factor)


# where a family parameter comes from: a global (_Target) or a constant of the model ("const", value)
_Source = _Target | tuple[str, jax.Array]


@dataclass(frozen=True)
class _Table:
    site: str
    family: str
    in_plate: bool
    targets: dict[tuple[int, str], _Source] | None  # {(k, param): source} for the closed form, or None


@dataclass(frozen=True)
class _Linear:
    site: str
    coef_sites: tuple[str, ...]
    support: np.ndarray  # (components, elements, P_e): coefficient indices touching each element
    scale_targets: tuple[tuple[str, int], ...] | None  # per (k, e): (site, flat index) for the closed form, or None


@dataclass
class Derived:
    """S and T derived from a model (see the module docstring). Built by :func:`derive`."""

    fm: FedModel
    latent_mode: str  # none | enumerate | gaussian | monte_carlo
    latent_sites: tuple[str, ...]
    num_components: int
    tables: tuple[_Table, ...]
    linears: tuple[_Linear, ...]
    latent_targets: _Target | None
    latent_per_obs: bool
    closed_form: bool
    m_step_iters: int = 200

    # ------------------------------------------------------------------ evaluation helpers
    @property
    def rowwise(self) -> bool:
        """Whether the client's statistic is a sum over its rows of terms that each depend on one row only
        (no latents, or latents that belong to single rows): then a batch's mean is an unbiased estimate of
        the client's (FedMM's minibatch E-step). A Monte Carlo E-step's chain state spans all the client's
        rows, so it is not."""
        return self.latent_mode == "none" or (bool(self.latent_per_obs) and self.latent_mode != "monte_carlo")

    def _trace(self, theta_c: Params, latents_c: Params, data, mask):
        """The client's trace with every sample value an array (``obs=1.0`` gives a Python float)."""
        tr = self.fm._client_trace({**theta_c, **latents_c}, data, mask)
        for site in tr.values():
            if site["type"] == "sample":
                site["value"] = jnp.asarray(site["value"])
        return tr

    def _rows(self, site: dict) -> int | None:
        """The axis of a site's value that runs over the data plate (None outside it)."""
        fn = site["fn"]
        for frame in site["cond_indep_stack"]:
            if frame.name in self.fm.data_plates:
                return len(fn.batch_shape) + frame.dim
        return None

    def _mask_rows(self, site: dict) -> jax.Array | None:
        """The weight 0 / 1 of each of a site's rows from the masks on its distribution (``numpyro.handlers.mask``
        and the engine's padding; None: no mask), rows first (one row outside the data plate). A mask that
        varies within a row (over a non-row axis of the site's batch) is refused: the statistics weigh rows."""
        fn, masks = site["fn"], []
        while isinstance(fn, dist.MaskedDistribution):
            if not (isinstance(fn._mask, bool) and fn._mask):
                masks.append(fn._mask)
            fn = fn.base_dist
        if not masks:
            return None
        batch, axis = site["fn"].batch_shape, self._rows(site)
        for m in masks:
            shape = (1,) * (len(batch) - jnp.ndim(m)) + tuple(jnp.shape(m))
            if any(size != 1 for a, size in enumerate(shape) if a != axis):
                raise ModelError(
                    f"EM: site '{site['name']}' is masked element by element within its rows (mask shape "
                    f"{jnp.shape(m)} on batch shape {batch}); EM's statistics weigh whole rows: mask whole "
                    "rows (a mask over the data plate only)"
                )
        keep = jnp.ones(batch, bool)
        for m in masks:
            keep = keep & jnp.broadcast_to(jnp.asarray(m, bool), batch)
        rows = keep.reshape(-1)[:1] if axis is None else jnp.moveaxis(keep, axis, 0).reshape(batch[axis], -1)[:, 0]
        return rows.astype(jnp.result_type(float))

    def _first_row(self, site: dict, arr: jax.Array) -> jax.Array:
        return _first(self._rows(site), arr)

    def _site_values(self, site: dict) -> tuple[jax.Array, Callable]:
        """(value with rows first, a function moving any param array the same way)."""
        axis = self._rows(site)
        if axis is None:
            return site["value"][None], lambda a: a[None]
        return jnp.moveaxis(site["value"], axis, 0), lambda a: jnp.moveaxis(a, axis, 0)

    def complete_stats(
        self,
        theta_c: Params,
        latents_c: Params,
        data,
        mask: jax.Array,
        weights: jax.Array | None = None,
        component: int | None = None,
        skip: frozenset[str] = frozenset(),
    ) -> Stats:
        """S(D_i, h) for fixed latent values ``h`` (one component's share with row ``weights``), without the
        tables named in ``skip``."""
        w = mask.astype(jnp.result_type(float)) if weights is None else weights
        tr = self._trace(theta_c, latents_c, data, mask)
        out: Stats = {}
        for t in self.tables:
            if t.site in skip:
                continue
            x, _ = self._site_values(tr[t.site])
            rw = w if t.in_plate else jnp.ones((1,), w.dtype)
            keep = self._mask_rows(tr[t.site])
            rw = rw if keep is None else rw * keep
            out[t.site] = _family_stats(t.family, tr[t.site]["fn"], x, rw)
        for lin in self.linears:
            out[lin.site] = self._linear_stats(lin, theta_c, latents_c, data, mask, w, component or 0)
        return out

    def _linear_design(self, lin: _Linear, theta_c, latents_c, data, mask):
        """(G (N, E, P), o (N, E), y (N, E)): loc = G beta + o for the site's rows and elements."""
        beta0, unravel = ravel_pytree({n: theta_c[n] for n in lin.coef_sites})

        def loc(beta):
            tr = self._trace({**theta_c, **unravel(beta)}, latents_c, data, mask)
            site = tr[lin.site]
            y, move = self._site_values(site)
            return move(_param(site["fn"], "loc")).reshape(y.shape[0], -1), y.reshape(y.shape[0], -1), site

        zero = jnp.zeros_like(beta0)
        G = jax.jacfwd(lambda b: loc(b)[0])(zero)
        o, y, site = loc(zero)
        return G, o, y, self._mask_rows(site)

    def _linear_stats(self, lin: _Linear, theta_c, latents_c, data, mask, w, k: int):
        G, o, y, keep = self._linear_design(lin, theta_c, latents_c, data, mask)
        rows = G.shape[0]
        rw = w if rows == w.shape[0] else jnp.ones((rows,), w.dtype)
        rw = rw if keep is None else rw * keep
        Ge = jnp.take_along_axis(G, jnp.asarray(lin.support[k])[None], axis=2)  # (N, E, P_e)
        r = y - o
        return {
            "n": jnp.sum(rw[:, None] * jnp.ones_like(r), 0),
            "rr": jnp.sum(rw[:, None] * r**2, 0),
            "Gr": jnp.einsum("n,ne,nep->ep", rw, r, Ge),
            "GG": jnp.einsum("n,nep,neq->epq", rw, Ge, Ge),
        }

    # ------------------------------------------------------------------ the client E-step
    def e_step(self, theta_u: Params, data, mask):
        """``(S_i, local posterior summary)``: the client's expected statistic (a sum over its data)."""
        theta_c = self.fm.constrain(theta_u)
        if self.latent_mode == "none":
            return self.complete_stats(theta_c, {}, data, mask), {}
        if self.latent_mode == "enumerate":
            traces = self._component_traces(theta_c, data, mask)
            weights = jax.nn.softmax(self._log_probs_by_component(theta_c, data, mask, traces), 0) * mask  # (K, N)
            name = self.latent_sites[0]
            # an in-plate table observing the same rows in every component: its K statistics at once (one
            # product of the rows with the K rows of weights, :func:`_family_stats` under vmap over them)
            joint = [
                t
                for t in self.tables
                if t.in_plate and all(tr[t.site]["value"] is traces[0][t.site]["value"] for tr in traces)
            ]
            skip = frozenset(t.site for t in joint)
            per_k = [
                self._component_stats(theta_c, name, k, data, mask, weights[k], skip=skip)
                for k in range(self.num_components)
            ]
            stats = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *per_k)
            for t in joint:
                site = traces[0][t.site]
                x, _ = self._site_values(site)
                stats[t.site] = jax.vmap(lambda w: _family_stats(t.family, site["fn"], x, w))(weights)
            stats["latent"] = jnp.sum(weights, 1)
            return stats, {"responsibilities": weights.T}
        if self.latent_mode == "gaussian":
            m, V = self.gaussian_posterior(theta_c, data, mask)
            return self._gaussian_expectation(lambda h: self.complete_stats(theta_c, h, data, mask), m, V, mask), {
                "mean": m,
                "cov": V,
            }
        raise NotImplementedError  # monte_carlo: the algorithm averages complete_stats over its chain

    def _component_stats(self, theta_c, name, k, data, mask, r, skip: frozenset[str] = frozenset()):
        z = jnp.full(mask.shape, k, jnp.int32)
        return self.complete_stats(theta_c, {name: z}, data, mask, r * mask, component=k, skip=skip)

    def _component_traces(self, theta_c: Params, data, mask) -> list[dict]:
        """The client's trace with every row in component k, for each k."""
        name = self.latent_sites[0]
        return [
            self._trace(theta_c, {name: jnp.full(mask.shape, k, jnp.int32)}, data, mask)
            for k in range(self.num_components)
        ]

    def component_log_probs(self, theta_c: Params, data, mask) -> jax.Array:
        """(N, K): sum over the data-plate sites of log p(x_j, z_j = k | theta) per row and component."""
        return self._log_probs_by_component(theta_c, data, mask).T

    def _log_probs_by_component(self, theta_c: Params, data, mask, traces: list[dict] | None = None) -> jax.Array:
        """:meth:`component_log_probs` laid out (K, N), components first (``traces``: :meth:`_component_traces`,
        traced here if not given)."""
        traces = self._component_traces(theta_c, data, mask) if traces is None else traces
        shared = {t.site for t in self.tables if t.family == "mvn" and t.in_plate}  # one covariance for all rows
        joint = jnp.zeros((self.num_components,) + mask.shape)
        each = [jnp.zeros(mask.shape) for _ in traces]
        for n, site in traces[0].items():
            axis = self._rows(site)
            if site["type"] != "sample" or axis is None:
                continue
            together = _components_mvn_log_probs([tr[n] for tr in traces], axis) if n in shared else None
            if together is not None:
                joint = joint + together
                continue
            for k, tr in enumerate(traces):
                fn = _shared_factor(tr[n]["fn"], axis) if n in shared else tr[n]["fn"]
                lp = jnp.moveaxis(fn.log_prob(tr[n]["value"]), axis, 0)
                each[k] = each[k] + jnp.reshape(lp, (mask.shape[0], -1)).sum(-1)
        return joint + jnp.stack(each)

    def responsibilities(self, theta_c: Params, data, mask) -> jax.Array:
        """r_jk = p(z_j = k | x_j, theta) by exact enumeration (zero rows for padding)."""
        lp = self.component_log_probs(theta_c, data, mask)
        return jax.nn.softmax(lp, -1) * mask[:, None]

    # ------------------------------------------------------------------ Gaussian latents
    def _latent_vector(self, latents: Params):
        if self.latent_per_obs:
            n = next(iter(latents.values())).shape[0]
            flat = jnp.concatenate([v.reshape(n, -1) for v in latents.values()], -1)
            sizes = [int(np.prod(v.shape[1:])) for v in latents.values()]
            shapes = {k: v.shape for k, v in latents.items()}

            def unravel(h):
                out, i = {}, 0
                for (k, shp), s in zip(shapes.items(), sizes):
                    out[k] = h[:, i : i + s].reshape(shp)
                    i += s
                return out

            return flat, unravel
        return ravel_pytree(latents)

    def _zero_latents(self, data, mask) -> Params:
        fm = self.fm
        out = {}
        for n in self.latent_sites:
            shape = fm.sites[n].shape
            if fm.sites[n].role == "obs_latent":
                shape = (mask.shape[0],) + shape[1:]
            out[n] = jnp.zeros(shape)
        return out

    def complete_log_joint(self, theta_c: Params, latents_c: Params, data, mask) -> jax.Array:
        """log p(D_i, h | theta) summed over the client's local, per-observation latent and observed sites."""
        tr = self._trace(theta_c, latents_c, data, mask)
        names = set(self.fm.local_names) | set(self.fm.obs_latent_names) | set(self.fm.observed)
        return sum((sum_log_prob(tr[n]) for n in names), jnp.zeros(()))

    # ------------------------------------------------------------------ the population start
    @property
    def has_population_start(self) -> bool:
        """Whether :meth:`population_coefficients` applies: linear-Gaussian terms and per-client latents
        (one component; per-observation latents and mixtures have no population model to start from)."""
        return bool(self.linears) and self.latent_mode in ("gaussian", "monte_carlo") and not self.latent_per_obs

    def population_latents(self, theta_c: Params, data, mask) -> Params:
        """The per-client latents at their population mean E[h_i | theta] (constrained): the latents of
        the non-personalised model (every client the average client)."""
        fm = self.fm

        def at_mean(site):
            return site["fn"].mean if site["name"] in fm.local_names else None

        fn = handlers.substitute(handlers.substitute(handlers.seed(fm.model, 0), data=theta_c), substitute_fn=at_mean)
        tr = handlers.trace(DataMask(fn, mask, fm.data_plates)).get_trace(**data, **fm.model_kwargs)
        return {n: jnp.asarray(tr[n]["value"]) for n in fm.local_names}

    def population_statistics(self, theta_c: Params, data, mask) -> Stats:
        """A client's least-squares statistics of the linear-Gaussian terms with its latents at their
        population mean: per term ``Gr = sum_j G_j^T (y_j - o_j)`` and ``GG = sum_j G_j^T G_j`` (sums
        over the client's rows, ``o_j`` the offset with ``h = E[h | theta]``)."""
        lat = self.population_latents(theta_c, data, mask)
        w = mask.astype(jnp.result_type(float))
        return {
            lin.site: {
                k: v for k, v in self._linear_stats(lin, theta_c, lat, data, mask, w, 0).items() if k in ("Gr", "GG")
            }
            for lin in self.linears
        }

    def population_coefficients(self, s: Stats, theta_c: Params) -> dict[str, jax.Array]:
        """The coefficients of the linear-Gaussian terms fitted by least squares on the summed
        :meth:`population_statistics`, ``beta_e = GG_e^{-1} Gr_e`` per element e: ordinary least
        squares of the non-personalised model, the classical start of a mixed model's fixed effects
        (unbiased for them: the random effects have mean E[h]). A coefficient whose system is singular
        keeps its value in ``theta_c``."""
        out: dict[str, jax.Array] = {}
        for lin in self.linears:
            beta, unravel = ravel_pytree({n: jnp.asarray(theta_c[n], jnp.result_type(float)) for n in lin.coef_sites})
            sk = s[lin.site]
            b = jnp.linalg.solve(sk["GG"], sk["Gr"][..., None])[..., 0]  # (E, P_e)
            idx = jnp.asarray(lin.support[0])
            b = jnp.where(jnp.isfinite(b), b, beta[idx])
            out.update(unravel(beta.at[idx].set(b)))
        return out

    def gaussian_posterior(self, theta_c: Params, data, mask):
        """Exact N(m, V) of the latents (per row for per-observation latents): m = P^{-1} g(0), V = P^{-1}
        with P the negative Hessian (:func:`lapack_free_spd_inverse`: P varies over clients and rows)."""
        h0, unravel = self._latent_vector(self._zero_latents(data, mask))
        f = lambda h: self.complete_log_joint(theta_c, unravel(h), data, mask)  # noqa: E731
        g = jax.grad(f)(h0)
        if not self.latent_per_obs:
            V = lapack_free_spd_inverse(-jax.hessian(f)(h0))
            return V @ g, V
        q = h0.shape[1]
        cols = [jax.jvp(jax.grad(f), (h0,), (jnp.zeros_like(h0).at[:, a].set(1.0),))[1] for a in range(q)]
        P = -jnp.stack(cols, -1)  # (N, q, q): the block diagonal of the Hessian
        P = P + (1.0 - mask)[:, None, None] * jnp.eye(q)  # padded rows: any proper law (they carry no weight)
        V = lapack_free_spd_inverse(P)
        return jnp.einsum("nij,nj->ni", V, g), V

    def _gaussian_expectation(self, fn, m, V, mask):
        """E[fn(h)] for h ~ N(m, V) and fn at most quadratic in h (exact)."""
        _, unravel = self._latent_vector(self._zero_latents(None, mask))
        f = lambda h: fn(unravel(h))  # noqa: E731
        L = lapack_free_cholesky(V)
        base = f(m)
        q = m.shape[-1]
        for a in range(q):
            t = L[..., :, a]

            def second(h, t=t):
                return jax.jvp(lambda x: jax.jvp(f, (x,), (t,))[1], (h,), (t,))[1]

            base = jax.tree_util.tree_map(lambda b, c: b + 0.5 * c, base, second(m))
        return base

    # ------------------------------------------------------------------ the surrogate and T
    def _row0_data(self):
        """The first row of :func:`_layout_data` (numpy, so that under jit it is a constant, not a tracer)."""
        return {k: v[:1] for k, v in _layout_data(self.fm).items()}, np.ones((1,), bool)

    def _row0_latents(self, k: int) -> Params:
        data, mask = self._row0_data()
        lat = self._zero_latents(data, mask) if self.latent_mode in ("gaussian", "monte_carlo") else {}
        if self.latent_mode == "enumerate":
            lat = {self.latent_sites[0]: jnp.full((1,), k, jnp.int32)}
        elif self.latent_mode == "monte_carlo":
            lat = self.fm.constrain(self.fm.zeros_local())
        return lat

    def term_params(self, theta_c: Params) -> list[dict[str, Any]]:
        """Per component k: each term's parameters at theta (row 0; they are the same on every row)."""
        data, mask = self._row0_data()
        out = []
        for k in range(self.num_components):
            tr = self._trace(theta_c, self._row0_latents(k), data, mask)
            comp: dict[str, Any] = {}
            for t in self.tables:
                p = FAMILIES[t.family].get(tr[t.site]["fn"])
                comp[t.site] = {n: self._first_row(tr[t.site], v) for n, v in p.items()}
            for lin in self.linears:
                site = tr[lin.site]
                comp[lin.site] = {"scale": self._first_row(site, _param(site["fn"], "scale")).reshape(-1)}
            if self.latent_mode == "enumerate":
                name = self.latent_sites[0]
                comp["latent"] = tr[name]["fn"].log_prob(jnp.asarray(k))
                comp["latent"] = jnp.reshape(comp["latent"], (-1,))[0]
            out.append(comp)
        return out

    def surrogate(self, theta_u: Params, s: Stats) -> jax.Array:
        """Q(theta; s) = sum_terms E[log p(term | theta)] for the summed statistic s (theta-free parts dropped)."""
        theta_c = self.fm.constrain(theta_u)
        params = self.term_params(theta_c)
        total = jnp.zeros(())
        K = self.num_components
        for k in range(K):
            sk = jax.tree_util.tree_map(lambda a: a[k], s) if self.latent_mode == "enumerate" else s
            for t in self.tables:
                total = total + FAMILIES[t.family].expected_loglik(params[k][t.site], sk[t.site])
            for lin in self.linears:
                total = total + self._linear_loglik(lin, theta_c, params[k][lin.site]["scale"], sk[lin.site], k)
            if self.latent_mode == "enumerate":
                total = total + s["latent"][k] * params[k]["latent"]
        return total

    def _linear_loglik(self, lin: _Linear, theta_c, scale, s, k: int):
        beta, _ = ravel_pytree({n: theta_c[n] for n in lin.coef_sites})
        b = beta[jnp.asarray(lin.support[k])]  # (E, P_e)
        resid = s["rr"] - 2 * jnp.sum(b * s["Gr"], -1) + jnp.einsum("ep,epq,eq->e", b, s["GG"], b)
        scale = jnp.broadcast_to(scale, resid.shape)
        return jnp.sum(-0.5 * resid / scale**2 - s["n"] * jnp.log(scale))

    def m_step(self, s: Stats, theta_u: Params, prior_weight: float | jax.Array = 1.0) -> Params:
        """T(s): argmax_theta Q(theta; s) + prior_weight * log p(theta), from the *summed* statistic s.

        Closed form when the model allows it (no prior, one-to-one parameters); otherwise BFGS in
        unconstrained space started from the closed form (or from ``theta_u``).
        """
        has_prior = any(self.fm.sites[n].role == "global" for n in self.fm.global_names)
        if self.closed_form:
            start = self.fm.unconstrain(self._closed_form(s))
            if not has_prior:
                return start
        else:
            start = theta_u
        x0, unravel = ravel_pytree(start)
        scale = 1.0 / jnp.maximum(self._count(s), 1.0)

        def objective(x):
            th = unravel(x)
            return -scale * (self.surrogate(th, s) + prior_weight * self.fm.log_prior(th))

        res = jax.scipy.optimize.minimize(
            objective, x0, method="BFGS", options={"maxiter": self.m_step_iters, "gtol": 1e-12}
        )
        return unravel(res.x)

    def _count(self, s: Stats) -> jax.Array:
        if "latent" in s:
            return jnp.sum(s["latent"])
        leaves = [v["s0"] if "s0" in v else v["n"] for k, v in s.items() if isinstance(v, dict)]
        return jnp.max(jnp.asarray([jnp.max(jnp.sum(x, 0) if self.latent_mode == "enumerate" else x) for x in leaves]))

    def _closed_form(self, s: Stats) -> dict[str, jax.Array]:
        """Moment matching and least squares (requires ``closed_form``)."""
        values: dict[str, Any] = {}
        K = self.num_components
        enum = self.latent_mode == "enumerate"
        if self.latent_targets is not None:
            values[self.latent_targets.site] = s["latent"] / jnp.sum(s["latent"])
        for t in self.tables:
            if t.targets is None:  # closed_form (_covered) requires every table's targets
                raise AssertionError(f"no closed-form M-step for site {t.site!r}")
            for k in range(K):
                sk = jax.tree_util.tree_map(lambda a: a[k], s[t.site]) if enum else s[t.site]
                fixed = {p: v[1] for (kk, p), v in t.targets.items() if kk == k and isinstance(v, tuple)}
                ml = FAMILIES[t.family].ml(sk, fixed)
                if ml is None:  # _covered rules out the families' ml_needs among the targets
                    raise AssertionError(f"no closed-form maximiser for site {t.site!r}")
                for (kk, p), target in t.targets.items():
                    if kk != k or isinstance(target, tuple):
                        continue
                    v = ml[p] if p in ml else ml["covariance_matrix"]
                    if target.kind == "scale_tril":  # per client in ParamAveragingEM's local M-step
                        v = lapack_free_cholesky(v)
                    _assign(values, target, v, self.fm)
        for lin in self.linears:
            if lin.scale_targets is None:  # closed_form (_covered) requires every noise scale's target
                raise AssertionError(f"no closed-form M-step for site {lin.site!r}")
            beta, unravel = ravel_pytree({n: jnp.zeros(self.fm.sites[n].shape) for n in lin.coef_sites})
            resid_sum: dict[tuple[str, int], Any] = {}
            for k in range(K):
                sk = jax.tree_util.tree_map(lambda a: a[k], s[lin.site]) if enum else s[lin.site]
                b = jnp.linalg.solve(sk["GG"], sk["Gr"][..., None])[..., 0]  # (E, P_e)
                beta = beta.at[jnp.asarray(lin.support[k])].set(b)
                resid = sk["rr"] - jnp.sum(b * sk["Gr"], -1)
                for e in range(resid.shape[0]):
                    key = lin.scale_targets[k * resid.shape[0] + e]
                    acc = resid_sum.get(key, (0.0, 0.0))
                    resid_sum[key] = (acc[0] + resid[e], acc[1] + sk["n"][e])
            values.update({n: v for n, v in unravel(beta).items()})
            for (site, idx), (rss, n) in resid_sum.items():
                arr = values.get(site, jnp.zeros(self.fm.sites[site].shape))
                values[site] = arr.reshape(-1).at[idx].set(jnp.sqrt(rss / n)).reshape(self.fm.sites[site].shape)
        return values

    # ------------------------------------------------------------------ projection onto the valid set
    def project(self, s: Stats) -> Stats:
        """Euclidean projection of a statistic onto its valid set: non-negative counts, PSD moment blocks."""
        out = dict(s)
        if "latent" in s:
            out["latent"] = jnp.maximum(s["latent"], _EPS)
        for t in self.tables:
            out[t.site] = FAMILIES[t.family].project(s[t.site])
        for lin in self.linears:
            v = s[lin.site]
            top = jnp.concatenate([v["GG"], v["Gr"][..., :, None]], -1)
            bottom = jnp.concatenate([v["Gr"][..., None, :], v["rr"][..., None, None]], -1)
            block = _psd(jnp.concatenate([top, bottom], -2))
            out[lin.site] = {
                "n": jnp.maximum(v["n"], _EPS),
                "rr": block[..., -1, -1],
                "Gr": block[..., :-1, -1],
                "GG": block[..., :-1, :-1],
            }
        return out


def _assign(values, target: _Target, v, fm: FedModel):
    if target.index is None:
        values[target.site] = v
    else:
        arr = values.get(target.site, jnp.zeros(fm.sites[target.site].shape))
        values[target.site] = arr.at[target.index].set(jnp.reshape(v, arr.shape[1:]))


# ------------------------------------------------------------------------------------ derivation


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=1e-9, atol=1e-12, equal_nan=True))


def _spread(fn):
    try:
        return fn.variance
    except Exception:
        return jnp.zeros(())


def _moments(fn: dist.Distribution, value: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mean, spread) of a site broadcast to its value, through which :func:`derive` sees whether the site
    depends on theta; a distribution without a mean (``numpyro.factor``'s Unit) shows its log-density."""
    try:
        mean = fn.mean
    except NotImplementedError:
        return fn.log_prob(value), jnp.zeros(())
    return jnp.broadcast_to(mean, value.shape), jnp.broadcast_to(_spread(fn), value.shape)


def _first(axis: int | None, arr):
    """Row 0 of ``arr`` along its data-plate ``axis`` (``arr`` itself outside a plate)."""
    return arr if axis is None else jnp.moveaxis(arr, axis, 0)[0]


def _rows_equal(axis: int | None, arr) -> bool:
    if axis is None:
        return True
    a = np.moveaxis(np.asarray(arr), axis, 0)
    return bool(np.allclose(a, a[:1], rtol=1e-9, atol=1e-12, equal_nan=True))


def _layout_data(fm: FedModel) -> dict[str, np.ndarray]:
    """Data of client 0's layout (keys, padded length, trailing shapes, dtypes) with fixed generic
    values, on which the structure of S and T is read: floats uniform in (0.1, 0.9) (non-zero, so a
    design shows every coefficient it can use; in the support of the table's families), integers
    0, 1, 2, ... (every index up to the length), booleans alternating. The structure is then a function
    of the model and the layout alone, the same at every end of a federation: a server that holds
    only the layout (``FederatedData.blank()``, every value zero) derives the statistic its clients
    send, and one client's values (an all-zero column, a category it lacks) cannot change it.
    """
    rng = np.random.default_rng(0)
    out = {}
    for k, example in fm._example.items():
        v = np.asarray(example)
        if np.issubdtype(v.dtype, np.floating):
            out[k] = rng.uniform(0.1, 0.9, v.shape).astype(v.dtype)
        elif v.dtype == np.bool_:
            out[k] = (np.arange(v.size) % 2 == 0).reshape(v.shape)
        else:
            out[k] = np.arange(v.size).reshape(v.shape).astype(v.dtype)
    return out


class _Probe:
    """The model evaluated (under one jit) at random parameters and latents, to read its structure.

    ``view(theta, latents)`` returns, per non-global sample site, its value, mean, spread, family
    parameters and (Normal) loc / scale; ``meta`` holds each site's family, row axis and class name.
    """

    def __init__(self, d: Derived, key: jax.Array, thetas: list | None = None):
        fm = d.fm
        self.d, self.fm = d, fm
        self.data = {k: jnp.asarray(v) for k, v in _layout_data(fm).items()}
        self.mask = jnp.ones(next(iter(self.data.values())).shape[0], bool)
        keys = jax.random.split(key, 4)
        if thetas is None:
            draw = jax.jit(jax.vmap(lambda k: fm.constrain(self._random(k, fm.global_names))))
            both = draw(keys[:2])
            thetas = [jax.tree_util.tree_map(lambda a: a[i], both) for i in range(2)]
        self.thetas = thetas
        self.latents = [self._random_latents(k) for k in keys[2:]]
        self.meta: dict[str, dict] = {}
        self._view = jax.jit(self._extract)

    def _random(self, key, names):
        return {
            n: 0.5 * jax.random.normal(jax.random.fold_in(key, i), self.fm.sites[n].unconstrained_shape)
            for i, n in enumerate(names)
        }

    def _random_latents(self, key):
        d = self.d
        if d.latent_mode in ("none", "enumerate"):
            return {}
        if d.latent_mode == "gaussian":
            zeros = d._zero_latents(self.data, self.mask)
            return {n: jax.random.normal(jax.random.fold_in(key, i), v.shape) for i, (n, v) in enumerate(zeros.items())}
        return jax.jit(lambda k: self.fm.constrain(self._random(k, d.latent_sites)))(key)

    def _extract(self, theta, lat):
        tr = self.d._trace(theta, lat, self.data, self.mask)
        out = {}
        for name, site in tr.items():
            if site["type"] != "sample" or name in self.fm.global_names:
                continue
            fn, value = site["fn"], site["value"]
            fam = family_of(fn)
            self.meta[name] = {"family": fam, "rows": self.d._rows(site), "cls": type(_base(fn)).__name__}
            mean, spread = _moments(fn, value)
            v = {"value": value, "mean": mean, "spread": spread}
            if fam is not None:
                v["params"] = FAMILIES[fam].get(fn)
            if fam == "normal":
                v["loc"], v["scale"] = _param(fn, "loc"), _param(fn, "scale")
            out[name] = v
        return out

    def latent_values(self, latent_i: int = 0, k: int = 0) -> Params:
        if self.d.latent_mode == "enumerate":
            return {self.d.latent_sites[0]: jnp.full(self.mask.shape, k, jnp.int32)}
        return dict(self.latents[latent_i])

    def view(self, theta_i: int = 0, latent_i: int = 0, k: int = 0, theta=None) -> dict:
        theta = theta if theta is not None else self.thetas[theta_i]
        return jax.tree_util.tree_map(np.asarray, self._view(theta, self.latent_values(latent_i, k)))


def _find_target(probe: _Probe, values: list, k: int, K: int, allow_tril: bool = False) -> _Source | None:
    """The global site (and index k) equal to a parameter at both random thetas, or a constant."""
    v1, v2 = (np.asarray(v) for v in values)
    if _close(v1, v2):
        return ("const", jnp.asarray(v1))
    kinds = [("value", lambda v: v)]
    if allow_tril:
        kinds.append(("scale_tril", lambda v: np.linalg.cholesky(v)))
    for kind, f in kinds:
        w1, w2 = f(v1), f(v2)
        for g in probe.fm.global_names:
            c1, c2 = (np.asarray(t[g]) for t in probe.thetas)
            if K == 1 and _close(c1, w1) and _close(c2, w2):
                return _Target(g, None, kind)
            if c1.ndim and c1.shape[0] == K and _close(c1[k], w1) and _close(c2[k], w2):
                return _Target(g, k, kind)
            if K > 1 and _close(c1, w1) and _close(c2, w2):
                return _Target(g, None, kind)
    return None


def _latent_mode(fm: FedModel) -> tuple[str, tuple[str, ...], bool]:
    latents = fm.local_names + fm.obs_latent_names
    discrete = [n for n in latents if fm.sites[n].discrete]
    for n in discrete:
        if fm.sites[n].role == "local":
            raise ModelError(
                f"EM: the per-client latent site '{n}' is discrete; only per-observation discrete "
                "latents (inside the data plate) are enumerated"
            )
    if len(discrete) > 1:
        raise ModelError(
            f"EM: enumeration supports one discrete per-observation latent; '{discrete[1]}' is a second "
            f"one (besides '{discrete[0]}'): combine them into one Categorical site"
        )
    if discrete:
        others = [n for n in latents if n != discrete[0]]
        if others:
            raise ModelError(
                f"EM: latent site '{others[0]}' alongside the enumerated discrete site '{discrete[0]}' "
                "is not supported (mixtures of latent-variable models need a custom E-step)"
            )
        return "enumerate", (discrete[0],), True
    if not latents:
        return "none", (), False
    per_obs = [n for n in latents if fm.sites[n].role == "obs_latent"]
    if per_obs and len(per_obs) != len(latents):
        raise ModelError(
            f"EM: per-client latents {list(fm.local_names)} together with per-observation latent "
            f"'{per_obs[0]}' are not supported; keep one kind"
        )
    return "continuous", tuple(latents), bool(per_obs)


def derive(fm: FedModel, *, m_step_iters: int = 200, seed: int = 0) -> Derived:
    """Read S and T off a model (see the module docstring); ModelError naming the site if it cannot."""
    for n in fm.global_names:
        if fm.sites[n].discrete:
            raise ModelError(f"EM: global site '{n}' is discrete; global parameters must be continuous")
    mode, latent_sites, per_obs = _latent_mode(fm)
    d = Derived(fm, mode, latent_sites, 1, (), (), None, per_obs, False, m_step_iters)
    key = seed_key(seed)
    thetas = None
    if mode == "enumerate":
        probe = _Probe(d, key)  # value k = 0 for every row
        first = probe.view()
        thetas = probe.thetas
        fam = probe.meta[latent_sites[0]]["family"]
        if fam not in ("categorical", "bernoulli"):
            raise ModelError(
                f"EM: discrete latent '{latent_sites[0]}' must be Categorical or Bernoulli to be "
                f"enumerated, got {probe.meta[latent_sites[0]]['cls']}"
            )
        probs = first[latent_sites[0]]["params"]["probs"]
        d.num_components = int(probs.shape[-1]) if fam == "categorical" else 2
    elif mode == "continuous":
        real = all(_is_identity(fm.sites[n].transform, fm.sites[n].unconstrained_shape) for n in latent_sites)
        d.latent_mode = "gaussian"
        pre = _Probe(d, key)
        thetas = pre.thetas
        d.latent_mode = "gaussian" if real and _is_quadratic(pre, key) else "monte_carlo"
        if d.latent_mode == "monte_carlo" and per_obs:
            raise ModelError(
                f"EM: the per-observation latent '{latent_sites[0]}' enters the model non-linearly "
                "(its complete log-density is not quadratic); only linear-Gaussian per-observation "
                "latents have an exact E-step. Make it a per-client latent under fb.local() or "
                "marginalise it in the model."
            )
    probe = probe if mode == "enumerate" else _Probe(d, key, thetas)
    K = d.num_components
    views = {(t, l, k): probe.view(t, l, k) for t in range(2) for l in range(2) for k in range(K)}
    tables, linears = [], []
    for name in views[(0, 0, 0)]:
        if mode == "enumerate" and name == latent_sites[0]:
            continue
        meta = probe.meta[name]
        fam, axis = meta["family"], meta["rows"]
        keys = ("params",) if fam is not None else ("mean", "spread")
        depends = any(
            not _close(views[(0, 0, k)][name][key], views[(1, 0, k)][name][key]) for k in range(K) for key in keys
        )
        if not depends:
            continue  # theta-free: enters the E-step only
        if fam is None and meta["cls"] == "Unit":
            raise ModelError(
                f"EM: site '{name}' is a numpyro.factor whose log-density depends on the global "
                "parameters; EM needs every term that involves them as a sample site of an "
                f"exponential family {sorted(FAMILIES)} (a factor free of them is fine), or S and T "
                "supplied with fb.CustomStatistics"
            )
        if fam is None:
            raise ModelError(
                f"EM: site '{name}' has distribution {meta['cls']}, which is not in the "
                f"exponential-family table {sorted(FAMILIES)}; supply S and T with fb.CustomStatistics"
            )
        params = {key: views[key][name]["params"] for key in views}
        table = all(_rows_equal(axis, v) for p in params.values() for v in p.values()) and all(
            _close(params[(t, 0, k)][p], params[(t, 1, k)][p])
            for t in range(2)
            for k in range(K)
            for p in params[(0, 0, 0)]
        )
        if table:
            targets: dict[tuple[int, str], _Source] = {}
            complete = True
            for k in range(K):
                for p in FAMILIES[fam].params:
                    vals = [_first(axis, params[(t, 0, k)][p]) for t in range(2)]
                    tgt = _find_target(probe, vals, k, K, allow_tril=(fam == "mvn" and p == "covariance_matrix"))
                    if tgt is None:
                        complete = False
                        break
                    targets[(k, p)] = tgt
                if not complete:
                    break
            tables.append(_Table(name, fam, axis is not None, targets if complete else None))
        elif fam == "normal" and axis is not None:
            linears.append(_derive_linear(d, probe, name, views, K))
        else:
            raise ModelError(
                f"EM: the parameters of site '{name}' ({meta['cls']}) vary across observations or with "
                "the latents, and only Normal sites with a mean linear in global coefficients have "
                "finite sufficient statistics then; supply S and T with fb.CustomStatistics"
            )
    d.tables, d.linears = tuple(tables), tuple(linears)
    if mode == "enumerate":
        probs = [views[(t, 0, 0)][latent_sites[0]]["params"]["probs"] for t in range(2)]
        axis = probe.meta[latent_sites[0]]["rows"]
        if not all(_rows_equal(axis, p) for p in probs):
            raise ModelError(f"EM: the law of the discrete latent '{latent_sites[0]}' varies across observations")
        if probe.meta[latent_sites[0]]["family"] == "categorical":
            tgt = _find_target(probe, [_first(axis, p) for p in probs], 0, 1)
            d.latent_targets = tgt if isinstance(tgt, _Target) else None
    d.closed_form = _covered(d)
    return d


def _is_identity(t, shape) -> bool:
    x = np.linspace(-3.0, 3.0, int(np.prod(shape)) or 1).reshape(shape)
    return _close(t(x), x)


def _is_quadratic(probe: _Probe, key) -> bool:
    d = probe.d
    h0, unravel = d._latent_vector(d._zero_latents(probe.data, probe.mask))
    f = lambda h: d.complete_log_joint(probe.thetas[0], unravel(h.reshape(h0.shape)), probe.data, probe.mask)  # noqa: E731
    hess = jax.jit(jax.hessian(f))
    # The layout data's observations need not lie in their family's support (a Poisson count of 0.6);
    # NumPyro's support check would set such a term to -inf and hide its curvature, so the check reads
    # the log-densities as formulas (the curvature in the latents is the family's, whatever the value).
    with validation_enabled(False):
        hs = [hess(jax.random.normal(jax.random.fold_in(key, i), (h0.size,))) for i in range(2)]
    return bool(np.all(np.isfinite(hs[0]))) and _close(hs[0], hs[1])


def _derive_linear(d: Derived, probe: _Probe, name: str, views, K: int) -> _Linear:
    fm = d.fm
    axis = probe.meta[name]["rows"]
    base = views[(0, 0, 0)][name]
    for (t, l, k), v in views.items():
        if not _rows_equal(axis, v[name]["scale"]) or not _close(v[name]["scale"], views[(t, 1 - l, k)][name]["scale"]):
            raise ModelError(
                f"EM: the scale of Normal site '{name}' varies across observations or with the latents; "
                "the linear-Gaussian E-step needs one noise scale per component and element"
            )
    coef: list[str] = []
    other: list[str] = []
    for g in fm.global_names:
        swapped = probe.view(theta={**probe.thetas[0], g: probe.thetas[1][g]})[name]
        moves_loc = not _close(swapped["loc"], base["loc"])
        moves_scale = not _close(swapped["scale"], base["scale"])
        if moves_loc and (moves_scale or not _is_identity(fm.sites[g].transform, fm.sites[g].unconstrained_shape)):
            raise ModelError(
                f"EM: the mean of Normal site '{name}' depends on global '{g}', which is constrained or "
                "also sets the scale; the mean must be linear in real-valued coefficients"
            )
        (coef if moves_loc else other).append(g)
    lin = _Linear(name, tuple(coef), np.zeros((K, 1, 0), int), None)
    design = jax.jit(lambda th, lat: d._linear_design(lin, th, lat, probe.data, probe.mask)[:2])
    designs = {
        key: tuple(np.asarray(a) for a in design(probe.thetas[key[0]], probe.latent_values(key[1], key[2])))
        for key in views
    }
    for (t, l, k), (G, o) in designs.items():
        G2, o2 = designs[(1 - t, l, k)]
        if not (_close(G, G2) and _close(o, o2)):
            raise ModelError(f"EM: the mean of Normal site '{name}' is not affine in its coefficients {coef}")
    E = designs[(0, 0, 0)][0].shape[1]
    per_component = []
    for k in range(K):
        used = np.zeros(designs[(0, 0, 0)][0].shape[1:], bool)
        for (_, _, kk), (G, _) in designs.items():
            if kk == k:
                used |= np.any(G != 0, axis=0)
        if len({int(u.sum()) for u in used}) != 1:
            raise ModelError(f"EM: the elements of Normal site '{name}' depend on different numbers of coefficients")
        per_component.append(np.stack([np.flatnonzero(u) for u in used]))
    support = np.stack(per_component)  # (K, E, P_e)
    targets: list[tuple[str, int] | None] = []
    for k in range(K):
        vals = [
            np.broadcast_to(np.asarray(_first(axis, views[(t, 0, k)][name]["scale"])).reshape(-1), (E,))
            for t in range(2)
        ]
        for e in range(E):
            found: tuple[str, int] | None = None
            for g in other:
                c1, c2 = (np.asarray(th[g]).reshape(-1) for th in probe.thetas)
                hits = np.flatnonzero(
                    np.isclose(c1, vals[0][e], rtol=1e-12, atol=0) & np.isclose(c2, vals[1][e], rtol=1e-12, atol=0)
                )
                if len(hits) == 1:
                    found = (g, int(hits[0]))
            targets.append(found)
    flat = support.reshape(-1)
    disjoint = len(np.unique(flat)) == flat.size and flat.size == sum(int(np.prod(fm.sites[c].shape)) for c in coef)
    found_all = [t for t in targets if t is not None]
    scale_targets = tuple(found_all) if disjoint and len(found_all) == len(targets) else None
    return _Linear(name, tuple(coef), support, scale_targets)


def _covered(d: Derived) -> bool:
    """True when every global site is set by exactly one closed-form parameter (no sharing)."""
    uses: dict[str, list] = {n: [] for n in d.fm.global_names}
    if d.latent_mode == "enumerate":
        if d.latent_targets is None:
            return False
        uses[d.latent_targets.site].append(None)
    for t in d.tables:
        if t.targets is None:
            return False
        for (_, p), tgt in t.targets.items():
            if isinstance(tgt, _Target):
                if p in FAMILIES[t.family].ml_needs:  # a free Gamma shape: no closed-form maximiser
                    return False
                uses[tgt.site].append(tgt.index)
    for lin in d.linears:
        if lin.scale_targets is None:
            return False
        for c in lin.coef_sites:
            uses[c].append("coef")
        for site, _ in set(lin.scale_targets):
            uses[site].append("scale")
    for n, u in uses.items():
        if not u:
            return False
        if None in u and len(u) > 1:
            return False
        idx = [i for i in u if isinstance(i, int)]
        if idx and (sorted(idx) != list(range(d.fm.sites[n].shape[0])) or len(idx) != len(u)):
            return False
    return True


# ------------------------------------------------------------------------------------ user-supplied S and T


@dataclass(frozen=True)
class CustomStatistics:
    """S and T written by the user, for models outside the derived classes.

    ``e_step(theta, data, mask) -> S_i`` returns the client's expected complete-data statistic summed
    over its observations (a pytree of arrays; ``theta`` constrained, ``data`` padded with ``mask``);
    ``m_step(s) -> theta`` maps a summed statistic to constrained global values (the maximiser of
    the surrogate plus log-prior). ``project`` (optional) maps a statistic onto its valid set.
    Q(theta; s) = < s, phi(theta) > must be linear in s for the federated average to be exact.
    """

    e_step: Callable[[Params, Mapping[str, jax.Array], jax.Array], Stats]
    m_step: Callable[[Stats], Params]
    project: Callable[[Stats], Stats] | None = None
