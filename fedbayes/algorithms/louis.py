"""Uncertainty for EM fits: local posteriors and the observed information by Louis' identity.

Louis (1982): for the marginal log-likelihood l(theta) = sum_i log p(D_i | theta),

    -grad^2 l(theta) = sum_i ( E[-grad^2 log p(D_i, h | theta)] - Cov[grad log p(D_i, h | theta)] ),

expectations over h ~ p(h | D_i, theta). The first sum is -grad^2 Q(theta; s) for the summed E-step
statistic s at theta (Q is linear in s), so the server computes it from the statistics; each client
computes the covariance of its complete-data score locally (from the same E-step posterior) and
sends that symmetric d x d matrix once, as its d(d+1)/2 upper triangle, with its E-step statistic
(FedMM's final exchange, :class:`fedbayes.engine.Final`); its local posterior stays with it. The
server adds the prior's curvature -grad^2 log p(theta) and inverts: Cov(theta-hat) ~ I^{-1}
(unconstrained coordinates), standard errors of the constrained sites by the delta method, and draws of the asymptotic normal
approximation N(theta-hat, I^{-1}) as an approximate posterior for the globals.

The covariance terms are exact for enumerated discrete latents (sums over components), for models without
latents, and for per-client Gaussian latents (the score is quadratic in h:
Cov = J V J^T + 1/2 tr(H_a V H_b V)); per-observation Gaussian latents and Monte Carlo E-steps use
``louis_draws`` posterior draws.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from ..engine import ClientData
from ..expfam import lapack_free_cholesky
from ..kernels import ula_chain
from ..model import Params

NUM_DRAWS = 500  # draws of each local posterior and of the globals' normal approximation


def _client_information(run, key, theta_u: Params, state, client: ClientData) -> tuple[jax.Array, dict]:
    d, fm = run.stats, run._fm
    flat, unravel_theta = ravel_pytree(theta_u)

    def ell(x, lat):
        return d.complete_log_joint(fm.constrain(unravel_theta(x)), lat, client.data, client.mask)

    theta_c = fm.constrain(theta_u)
    if d.latent_mode == "none":
        return jnp.zeros((flat.size, flat.size)), {}
    if d.latent_mode == "enumerate":
        lp = lambda x: d.component_log_probs(fm.constrain(unravel_theta(x)), client.data, client.mask)  # noqa: E731
        r = d.responsibilities(theta_c, client.data, client.mask)
        g = jax.jacfwd(lp)(flat)  # (N, K, d): scores of each row's complete log-density per component
        mean = jnp.einsum("nk,nkd->nd", r, g)
        cov = jnp.einsum("nk,nkd,nke->de", r, g, g) - jnp.einsum("nd,ne->de", mean, mean)
        return cov, {"responsibilities": r}
    if d.latent_mode == "gaussian" and not d.latent_per_obs:
        m, V = d.gaussian_posterior(theta_c, client.data, client.mask)
        _, unravel_h = d._latent_vector(d._zero_latents(client.data, client.mask))
        score = lambda h: jax.grad(ell)(flat, unravel_h(h))  # noqa: E731
        J = jax.jacfwd(score)(m)  # (d, q)
        H = jax.jacfwd(jax.jacfwd(score))(m)  # (d, q, q), constant: the score is quadratic in h
        HV = H @ V
        cov = J @ V @ J.T + 0.5 * jnp.einsum("aij,bji->ab", HV, HV)
        draws = m + jax.random.normal(key, (NUM_DRAWS, m.size)) @ lapack_free_cholesky(V).T
        return cov, {"draws": jax.vmap(unravel_h)(draws)}
    # Monte Carlo: draws of the exact per-row Gaussian posteriors, or of the client's Langevin chain
    S = run.cfg.louis_draws
    if d.latent_mode == "gaussian":
        m, V = d.gaussian_posterior(theta_c, client.data, client.mask)
        _, unravel_h = d._latent_vector(d._zero_latents(client.data, client.mask))
        eps = jax.random.normal(key, (S,) + m.shape)
        hs = m + jnp.einsum("nij,snj->sni", lapack_free_cholesky(V), eps)
        lats = jax.vmap(unravel_h)(hs)
        extra = {"mean": m, "cov": V}
    else:
        score = lambda z: fm.local_score(theta_u, z, client.data, client.mask)  # noqa: E731
        _, zs = ula_chain(key, state.z, score, state.step, run.cfg.burn_in + S)
        zs = jax.tree_util.tree_map(lambda a: a[-S:], zs)
        lats = jax.vmap(fm.constrain)(zs)
        thin = max(1, S // NUM_DRAWS)
        extra = {"draws": jax.tree_util.tree_map(lambda a: a[::thin], zs)}
    grads = jax.vmap(lambda lat: jax.grad(ell)(flat, lat))(lats)
    centred = grads - jnp.mean(grads, 0)
    return centred.T @ centred / (S - 1), extra


def client_information(run, key, theta_u: Params, state, client: ClientData) -> tuple[jax.Array, dict]:
    """A client's part of the final exchange: the upper triangle (row-major, ``jnp.triu_indices``) of the
    conditional covariance of its complete-data score at theta_u, and its local posterior (kept)."""
    cov, extra = _client_information(run, key, theta_u, state, client)
    rows, cols = jnp.triu_indices(cov.shape[0])
    return cov[rows, cols], extra


def _symmetric(tri: jax.Array, d: int) -> jax.Array:
    rows, cols = jnp.triu_indices(d)
    full = jnp.zeros((d, d), tri.dtype).at[rows, cols].set(tri)
    return full + jnp.triu(full, 1).T


def observed_information(run, theta_u: Params, statistic, covariance_tris: jax.Array) -> jax.Array:
    """Louis' identity summed over clients, plus the prior's curvature (unconstrained coordinates).

    ``statistic`` is the summed E-step statistic at theta_u: E[-grad^2 log p(D, h | theta)] summed
    over clients is -grad^2 Q(theta; statistic), computed once at the server from the statistics;
    ``covariance_tris`` (clients x d(d+1)/2) are the clients' conditional covariances of their
    complete-data scores (:func:`client_information`).
    """
    fm = run._fm
    flat, unravel = ravel_pytree(theta_u)
    neg_hess = -jax.hessian(lambda x: run.stats.surrogate(unravel(x), statistic) + fm.log_prior(unravel(x)))(flat)
    return neg_hess - _symmetric(jnp.sum(covariance_tris, 0), flat.size)


def posterior_summary(run, key, theta_u: Params, statistic, covariance_tris: jax.Array) -> dict[str, Any]:
    """Louis' information, standard errors and approximate global posterior draws (the server's part)."""
    return jax.jit(lambda *a: _summary(run, *a))(key, theta_u, statistic, covariance_tris)


def _summary(run, k_global, theta_u, statistic, covariance_tris):
    fm = run._fm
    information = observed_information(run, theta_u, statistic, covariance_tris)
    flat, unravel = ravel_pytree(theta_u)
    information = 0.5 * (information + information.T)
    cov_u = jnp.linalg.inv(information)
    constrained_flat = lambda x: ravel_pytree(fm.constrain(unravel(x)))[0]  # noqa: E731
    Jc = jax.jacfwd(constrained_flat)(flat)
    cov_c = Jc @ cov_u @ Jc.T
    _, unravel_c = ravel_pytree(fm.constrain(theta_u))
    se = unravel_c(jnp.sqrt(jnp.clip(jnp.diag(cov_c), 0.0)))
    draws = flat + jax.random.normal(k_global, (NUM_DRAWS, flat.size)) @ jnp.linalg.cholesky(
        cov_u + 1e-300 * jnp.eye(flat.size)).T
    approx = jax.vmap(lambda x: fm.constrain(unravel(x)))(draws)
    return {
        "information": information,
        "cov_unconstrained": cov_u,
        "se": se,
        "global_approx": {k: v[None] for k, v in approx.items()},
    }


def local_parts(extra: dict) -> dict[str, Any]:
    """The clients' local posteriors (stacked over clients) as Result parts: draws as ``local_samples``
    (one chain each), the rest (responsibilities, Gaussian means and covariances) as ``local_info``."""
    out: dict[str, Any] = {}
    if "draws" in extra:
        out["local_samples"] = jax.tree_util.tree_map(lambda a: a[:, None], extra["draws"])  # (C, 1 chain, draws, ...)
    local_info = {k: v for k, v in extra.items() if k != "draws"}
    if local_info:
        out["local_info"] = local_info
    return out
