"""Exponential-family latent-variable models of one client's data (EM / FedMM-ready).

Each factory returns a NumPyro model ``model(y, ...)`` whose global parameters are ``numpyro.param``
sites (maximum likelihood); pass ``priors=True`` for conjugate-style priors (MAP-EM). The initial
values are the ``param`` inits below, or ``fb.FedMM(init={...})``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

from ..data import FederatedData


def _spread_means(k: int, d: int) -> np.ndarray:
    """Deterministic, distinct initial component means (a scaled Halton-like grid)."""
    rng = np.random.default_rng(1234)
    return rng.normal(size=(k, d))


def gaussian_mixture(num_components: int, dim: int, *, covariance: str = "full", priors: bool = False):
    """Gaussian mixture: z_j ~ Categorical(weights), y_j | z_j = k ~ N(means_k, Sigma_k).

    ``covariance="full"`` (``covs`` (K, D, D)) or ``"diag"`` (``sds`` (K, D) standard deviations).
    With ``priors=True``: weights ~ Dirichlet(2), means ~ N(0, 10^2) (MAP-EM, numerical M-step).
    """
    if covariance not in ("full", "diag"):
        raise ValueError(f"covariance must be 'full' or 'diag', got {covariance!r}")
    K, D = int(num_components), int(dim)
    init_means = jnp.asarray(_spread_means(K, D))

    def model(y):
        if priors:
            weights = numpyro.sample("weights", dist.Dirichlet(2.0 * jnp.ones(K)))
            means = numpyro.sample("means", dist.Normal(0.0, 10.0).expand([K, D]).to_event(2))
        else:
            weights = numpyro.param("weights", jnp.ones(K) / K, constraint=constraints.simplex)
            means = numpyro.param("means", init_means)
        if covariance == "full":
            covs = numpyro.param(
                "covs", jnp.broadcast_to(jnp.eye(D), (K, D, D)), constraint=constraints.positive_definite
            )
        else:
            sds = numpyro.param("sds", jnp.ones((K, D)), constraint=constraints.positive)
        with numpyro.plate("obs", y.shape[0]):
            z = numpyro.sample("z", dist.Categorical(weights))
            if covariance == "full":
                numpyro.sample("y", dist.MultivariateNormal(means[z], covariance_matrix=covs[z]), obs=y)
            else:
                numpyro.sample("y", dist.Normal(means[z], sds[z]).to_event(1), obs=y)

    model.__name__ = f"gaussian_mixture_{covariance}"
    return model


def mixture_of_regressions(num_components: int, num_features: int):
    """Mixture of linear regressions: z_j ~ Cat(weights), y_j | z_j = k ~ N(x_j^T coefs_k, sigmas_k^2)."""
    K, p = int(num_components), int(num_features)
    init = jnp.asarray(_spread_means(K, p))

    def model(x, y):
        weights = numpyro.param("weights", jnp.ones(K) / K, constraint=constraints.simplex)
        coefs = numpyro.param("coefs", init)
        sigmas = numpyro.param("sigmas", jnp.ones(K), constraint=constraints.positive)
        with numpyro.plate("obs", y.shape[0]):
            z = numpyro.sample("z", dist.Categorical(weights))
            numpyro.sample("y", dist.Normal(jnp.sum(x * coefs[z], -1), sigmas[z]), obs=y)

    return model


def ppca(dim: int, latent_dim: int):
    """Probabilistic PCA: z_j ~ N(0, I_q), y_j = W z_j + mu + eps_j, eps_j ~ N(0, sigma^2 I_D)."""
    D, q = int(dim), int(latent_dim)
    init_w = jnp.asarray(_spread_means(D, q))

    def model(y):
        W = numpyro.param("W", init_w)
        mu = numpyro.param("mu", jnp.zeros(D))
        sigma = numpyro.param("sigma", jnp.ones(()), constraint=constraints.positive)
        with numpyro.plate("obs", y.shape[0]):
            z = numpyro.sample("z", dist.Normal(0.0, 1.0).expand([q]).to_event(1))
            numpyro.sample("y", dist.Normal(z @ W.T + mu, sigma).to_event(1), obs=y)

    return model


def make_gaussian_mixture(
    num_clients: int = 20,
    *,
    num_components: int = 3,
    dim: int = 2,
    sizes=(50, 150),
    concentration: float = 0.5,
    separation: float = 4.0,
    seed: int = 0,
):
    """Heterogeneous clients of a Gaussian mixture: each client's mixing weights ~ Dirichlet(concentration).

    Returns ``(FederatedData({"y": ...}), truth)`` with the true means, covariances and per-client weights.
    """
    rng = np.random.default_rng(seed)
    K, D = num_components, dim
    means = separation * rng.normal(size=(K, D))
    A = rng.normal(size=(K, D, D)) * 0.4
    covs = A @ np.swapaxes(A, 1, 2) + 0.5 * np.eye(D)
    ys, ws = [], []
    for _ in range(num_clients):
        n = int(rng.integers(sizes[0], sizes[1] + 1))
        w = rng.dirichlet(concentration * np.ones(K))
        z = rng.choice(K, size=n, p=w)
        ys.append(np.stack([rng.multivariate_normal(means[k], covs[k]) for k in z]))
        ws.append(w)
    return FederatedData({"y": ys}), {"means": means, "covs": covs, "client_weights": np.asarray(ws)}
