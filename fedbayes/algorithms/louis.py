"""Uncertainty for EM fits: local posteriors and the observed information by Louis' identity.

Louis (1982): for the marginal log-likelihood l(theta) = sum_i log p(D_i | theta),

    -grad^2 l(theta) = sum_i ( E[-grad^2 log p(D_i, h | theta)] - Cov[grad log p(D_i, h | theta)] ),

expectations over h ~ p(h | D_i, theta). The first sum is -grad^2 Q(theta; s) for the summed E-step
statistic s at theta (Q is linear in s), so the server computes it from the statistics; each client
computes the covariance of its complete-data score locally (from the same E-step posterior) and
sends that symmetric d x d matrix once, as its d(d+1)/2 upper triangle, with its E-step statistic
(FedMM's final exchange, :class:`fedbayes.protocol.FederatedRun`); its local posterior stays with it. The
server adds the prior's curvature -grad^2 log p(theta) and inverts: Cov(theta-hat) ~ I^{-1}
(unconstrained coordinates), standard errors of the constrained sites by the delta method, and draws of the asymptotic
normal
approximation N(theta-hat, I^{-1}) as an approximate posterior for the globals.

The covariance terms are exact for enumerated discrete latents (sums over components), for models without
latents, and for per-client Gaussian latents (the score is quadratic in h:
Cov = J V J^T + 1/2 tr(H_a V H_b V)); per-observation Gaussian latents and Monte Carlo E-steps use
``louis_draws`` posterior draws.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from ..engine import run_jit
from ..protocol import ClientData
from ..errors import ConvergenceWarning
from ..linalg import lapack_free_cholesky, lapack_free_spd_inverse
from ..kernels import ula_chain
from ..introspect import Params
from .. import symmetry

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
    """Louis' information, standard errors and approximate global posterior draws (the server's part;
    one compiled computation). Where the information is not positive definite the standard errors are
    NaN, the draws are left out and a :class:`ConvergenceWarning` says so."""
    summary = run_jit(run, "louis_summary", lambda: lambda *a: _summary(run, *a), once=0)
    out = finish_normal_approximation(summary(key, theta_u, statistic, covariance_tris))
    if not out.pop("positive_definite"):
        warnings.warn(
            f"{run.name}: Louis' observed information at the estimate is not positive definite (smallest "
            f"eigenvalue {smallest_eigenvalue(out['information']):.3g}), so the globals have no "
            "standard errors or normal approximation: the estimate is not at a maximum of the likelihood "
            "(run more rounds) or the model is not identified there",
            ConvergenceWarning,
            stacklevel=3,
        )
    return out


def _summary(run, k_global, theta_u, statistic, covariance_tris):
    information = observed_information(run, theta_u, statistic, covariance_tris)
    basis = symmetry.basis(run._fm, theta_u)
    return normal_approximation_arrays(run._fm, k_global, theta_u, information, (1, NUM_DRAWS), basis)


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


# ------------------------------------------------------------------------------ from posterior draws (FedSOUL)
def draws_information(
    fm, theta_u: Params, zs: Params, client: ClientData, num_batches: int = 10
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A client's Louis terms from draws of its local posterior at theta_u (FedSOUL's final exchange).

    ``zs`` are unconstrained draws ``{site: (chains, S, ...)}`` (flattened: z, q numbers) of
    pi(z) = p(z | D_i, theta). With ell(theta, z) = log p(D_i, z | theta), the scores g_m =
    grad_theta ell(theta, z_m) (flat, unconstrained theta, d numbers), the local gradients
    u_m = grad_z ell(theta, z_m) (q numbers), J = mean_m d g / dz (d x q), P = mean_m[-grad^2_z ell] and
    V = P^-1, returns

    * the Fisher-identity gradient  G_i = mean_m g~_m  ~ grad_theta log p(D_i | theta), with the Stein control
      variate g~_m = g_m + J V u_m: E_pi[u] = 0 (the integral of a density's gradient vanishes), so g~ has
      g's mean for any coefficient, and J V (the regression coefficient of g on u when pi is Gaussian)
      removes every part of g linear in z: for a Gaussian pi and a score linear in z, g~ is constant;
    * Louis' term  E[-grad^2_theta ell] - C_i,  ~ -grad^2_theta log p(D_i | theta), with the missing
      information

          C_i = Cov_pi[g] = J V J^T + Cov_pi[g~],

      an identity when J = E_pi[dg/dz] and V^-1 = E_pi[-grad^2_z ell] = E_pi[u u^T] (integration by parts
      gives E_pi[g u^T] = -J, so Cov(g~, u) = 0 and Cov(J V u) = J V J^T); here with their draws' means,
      and Cov[g~] the draws' covariance. Where the client's data determine its latents well, E[-grad^2] and
      Cov[g] are both close to the complete-data information and the observed information is their
      small difference (the fraction of missing information near 1): the draws' plain covariance of g,
      whose relative error is sqrt(2 / draws), would swamp it; g~ is nearly constant there, and its
      covariance, the only sampled second moment left, is a small part of C_i. (A second-order expansion
      of Cov[g] about the draws' mean, the Laplace form, was 10% off the quadrature information of a
      Poisson random-intercept model, MASS epil; this estimate 0.3%.) E[-grad^2_theta ell] by the
      expansion -grad^2_theta ell(z_bar) - 1/2 sum_jk V_jk d^2/dz_j dz_k grad^2_theta ell(z_bar) about
      the draws' mean z_bar (exact for a Gaussian pi and a log-density quadratic in z);
    * the Monte Carlo covariance of G_i by batch means of g~: each chain cut into ``num_batches``
      batches of consecutive draws, Var(G_i) ~ Cov(batch means) / (number of batches) (valid when a
      batch is longer than the chain's autocorrelation time),

    the two matrices as upper triangles (``jnp.triu_indices``; d(d+1)/2 floats each). Both identities
    hold for exact draws of pi (FedSOUL's final exchange uses MALA by default); an unadjusted chain
    (``local_kernel="ula"``) adds its O(step) bias.
    """
    flat, unravel = ravel_pytree(theta_u)
    d = flat.size
    chains, S = jax.tree_util.tree_leaves(zs)[0].shape[:2]
    pooled = jax.tree_util.tree_map(lambda a: a.reshape((chains * S,) + a.shape[2:]), zs)
    zflat = jax.vmap(lambda z: ravel_pytree(z)[0])(pooled)  # (n, q)
    _, unravel_z = ravel_pytree(jax.tree_util.tree_map(lambda a: a[0], pooled))
    ell = lambda x, h: fm.client_log_joint(unravel(x), unravel_z(h), client.data, client.mask)  # noqa: E731

    def derivatives(h):  # one forward pass of q tangents over the reverse pass: (d g / dz, d u / dz), (g, u)
        both = jax.grad(ell, argnums=(0, 1))(flat, h)
        return both, both

    (jac, hz), (g, u) = jax.vmap(jax.jacfwd(derivatives, has_aux=True))(zflat)  # (n, d, q), (n, q, q); (n, d), (n, q)
    zbar = jnp.mean(zflat, 0)
    P = -jnp.mean(hz, 0)
    V = lapack_free_spd_inverse(0.5 * (P + P.T))
    J = jnp.mean(jac, 0)
    g = g + u @ (J @ V).T  # the control-variate scores g~
    centred = g - jnp.mean(g, 0)
    cov = J @ V @ J.T + centred.T @ centred / max(chains * S - 1, 1)
    # E[-grad^2_theta ell] by the expansion -grad^2_theta [ell + 1/2 tr(V grad^2_z ell)] (theta, z_bar): the
    # second-order term sum_jk V_jk d^2/dz_j dz_k of grad^2_theta ell, with the derivatives in theta taken last
    # (they commute): one Hessian in theta of a scalar, not d x d matrices differentiated twice more along z
    Vs = 0.5 * (V + V.T)
    smoothed = lambda x: ell(x, zbar) + 0.5 * jnp.sum(Vs * jax.hessian(ell, argnums=1)(x, zbar))  # noqa: E731
    expected = -jax.hessian(smoothed)(flat)
    info = expected - cov
    mean = jnp.mean(g, 0)
    nb = max(1, min(num_batches, S))
    per = S // nb
    batches = jnp.mean(g.reshape(chains, S, d)[:, : nb * per].reshape(chains * nb, per, d), 1)
    bc = batches - jnp.mean(batches, 0)
    k = chains * nb
    grad_cov = bc.T @ bc / max(k - 1, 1) / k
    rows, cols = jnp.triu_indices(d)
    return mean, info[rows, cols], grad_cov[rows, cols]


def smallest_eigenvalue(information: Any) -> float:
    """The smallest eigenvalue of a symmetric information matrix, on the host (NumPy: for a warning's message,
    nothing compiled)."""
    return float(np.linalg.eigvalsh(np.asarray(information))[0])


def information_eigen(
    information: jax.Array, basis: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(I, lam, vec, positive_definite)``: the symmetrised information, its eigenvalues and vectors, and
    whether it is finite and positive definite (traceable).

    With ``basis`` B (d, k; orthonormal columns: the directions the data identify, the complement of a
    declared symmetry's orbit, :func:`fedbayes.symmetry.basis`) they are those of B^T I B, with the
    vectors mapped back (``vec`` = B V, d x k): I^-1 below then means B (B^T I B)^-1 B^T, the inverse
    across the orbit, and no direction along it enters a step, a standard error or a draw."""
    information = 0.5 * (information + information.T)
    if basis is None:
        lam, vec = jnp.linalg.eigh(information)
    else:
        lam, v = jnp.linalg.eigh(basis.T @ information @ basis)
        vec = basis @ v
    return information, lam, vec, jnp.all(jnp.isfinite(lam)) & (jnp.min(lam) > 0)


def normal_approximation_arrays(
    fm,
    key: jax.Array,
    theta_u: Params,
    information: jax.Array,
    shape: tuple[int, int] = (1, NUM_DRAWS),
    basis: jax.Array | None = None,
) -> dict[str, Any]:
    """Standard errors (delta method, constrained sites) and draws ``shape = (chains, draws)`` of
    N(theta_u, I^-1) mapped to the constrained space, from an information matrix I in the unconstrained
    coordinates of theta_u; traceable (call it inside ``jit``). ``positive_definite`` is a boolean array;
    where it is false the standard errors and draws are NaN (:func:`finish_normal_approximation` turns
    it into a bool and drops the draws). With ``basis`` (a declared symmetry) I^-1 is the inverse across
    the orbit (:func:`information_eigen`)."""
    flat, unravel = ravel_pytree(theta_u)
    information, lam, vec, pd = information_eigen(information, basis)
    cov_u = (vec / jnp.where(lam > 0, lam, jnp.nan)) @ vec.T
    constrained_flat = lambda x: ravel_pytree(fm.constrain(unravel(x)))[0]  # noqa: E731
    Jc = jax.jacfwd(constrained_flat)(flat)
    cov_c = Jc @ cov_u @ Jc.T
    _, unravel_c = ravel_pytree(fm.constrain(theta_u))
    se = unravel_c(jnp.where(pd, jnp.sqrt(jnp.clip(jnp.diag(cov_c), 0.0)), jnp.nan))
    chains, draws = shape
    root = vec * jnp.sqrt(1.0 / jnp.where(pd, lam, jnp.nan))  # root root^T = I^-1
    eps = jax.random.normal(key, (chains * draws, lam.size))
    approx = jax.vmap(lambda x: fm.constrain(unravel(x)))(flat + eps @ root.T)
    return {
        "information": information,
        "cov_unconstrained": cov_u,
        "se": se,
        "positive_definite": pd,
        "global_approx": {k: v.reshape((chains, draws) + v.shape[1:]) for k, v in approx.items()},
    }


def finish_normal_approximation(out: dict[str, Any]) -> dict[str, Any]:
    """The result of :func:`normal_approximation_arrays` on the host: ``positive_definite`` a bool, the
    draws left out where it is false."""
    out = dict(out)
    out["positive_definite"] = pd = bool(out["positive_definite"])
    if not pd:
        out.pop("global_approx")
    return out
