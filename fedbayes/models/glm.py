"""Global generalised linear models (no per-client latents) and heterogeneous synthetic data for them.

These are the finite-sum problems of federated optimisation (``fb.TAMUNA``) and of the federated
Langevin samplers: every client's negative log-likelihood is a smooth function of the shared weights.
"""

from __future__ import annotations

from typing import cast

import numpy as np
import numpyro
import numpyro.distributions as dist

from ..data import FederatedData
from ..errors import ConfigError, require_int


def logistic_regression(prior_scale: float = 1.0):
    """Bayesian logistic regression ``y ~ Bernoulli(sigmoid(x @ w))`` with ``w ~ N(0, prior_scale^2 I)``.

    With M points in all, the MAP minimises (1/M) sum_m log(1 + exp(-b_m a_m^T w)) + (lambda/2)|w|^2
    with lambda = 1 / (M prior_scale^2): L2-regularised logistic regression (labels b = 2 y - 1).
    Include a column of ones in ``x`` for an intercept.
    """
    if not prior_scale > 0:
        raise ConfigError(f"prior_scale must be positive, got {prior_scale!r}")

    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([x.shape[-1]]).to_event(1))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)

    return model


def linear_regression(noise_scale: float = 1.0, prior_scale: float = 1.0):
    """Bayesian linear regression ``y ~ N(x @ w, noise_scale^2)``, ``w ~ N(0, prior_scale^2 I)``: every
    client's negative log-likelihood is a quadratic, and the posterior is Gaussian in closed form."""
    if not noise_scale > 0 or not prior_scale > 0:
        raise ConfigError("noise_scale and prior_scale must be positive")

    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, prior_scale).expand([x.shape[-1]]).to_event(1))
        with numpyro.plate("data", x.shape[0]):
            numpyro.sample("y", dist.Normal(x @ w, noise_scale), obs=y)

    return model


def make_glm_clients(
    num_clients: int,
    dim: int,
    points_per_client: int | tuple[int, int] = 50,
    *,
    family: str = "logistic",
    heterogeneity: float = 1.0,
    noise_scale: float = 1.0,
    seed: int = 0,
) -> tuple[FederatedData, np.ndarray]:
    """Heterogeneous synthetic clients for :func:`logistic_regression` or :func:`linear_regression`.

    Client i draws features ``x ~ N(m_i, diag(s_i^2))`` with its own mean shift m_i (scale
    ``heterogeneity``) and per-feature scales s_i, and labels from its own weights
    ``w_i = w + heterogeneity * N(0, I) / sqrt(dim)`` around a shared ``w``: clients disagree about
    both the inputs and the labelling rule, so their individual minimisers differ. A tuple
    ``points_per_client`` gives a range of sizes. Returns ``(data, w)``.
    """
    require_int(num_clients, "num_clients")
    require_int(dim, "dim")
    if family not in ("logistic", "linear"):
        raise ConfigError(f"family must be 'logistic' or 'linear', got {family!r}")
    rng = np.random.default_rng(seed)
    if np.isscalar(points_per_client):
        lo = hi = cast(int, points_per_client)
    else:
        lo, hi = cast(tuple[int, int], points_per_client)
    w = rng.normal(size=dim) / np.sqrt(dim) * 2.0
    xs, ys = [], []
    for _ in range(num_clients):
        m = rng.integers(lo, hi + 1)
        shift = heterogeneity * rng.normal(size=dim) / np.sqrt(dim)
        scales = np.exp(0.5 * heterogeneity * rng.normal(size=dim))
        x = shift + scales * rng.normal(size=(m, dim))
        w_i = w + heterogeneity * rng.normal(size=dim) / np.sqrt(dim)
        eta = x @ w_i
        if family == "logistic":
            y = (rng.uniform(size=m) < 1.0 / (1.0 + np.exp(-eta))).astype(np.float64)
        else:
            y = eta + noise_scale * rng.normal(size=m)
        xs.append(x)
        ys.append(y)
    return FederatedData({"x": xs, "y": ys}), w


def prior_scale_for_kappa(data: FederatedData, kappa: float) -> float:
    """The prior scale of :func:`logistic_regression` giving the clients' TAMUNA objectives condition
    number ``kappa`` = L_max / mu, with L_max = max_i lambda_max(X_i' X_i) / 4 + mu (the logistic
    Hessian is largest at w = 0) and mu = 1 / (n prior_scale^2) (each client's share of the prior)."""
    if not kappa > 1:
        raise ConfigError(f"kappa must be > 1, got {kappa!r}")
    lam = max(
        np.linalg.eigvalsh(np.asarray(data.client(i)["x"]).T @ np.asarray(data.client(i)["x"]))[-1]
        for i in range(data.num_clients)
    )
    return float(np.sqrt(4 * (kappa - 1) / (data.num_clients * lam)))


def logistic_map(x: np.ndarray, y: np.ndarray, prior_scale: float, iters: int = 60) -> np.ndarray:
    """Centralised reference: the exact MAP of :func:`logistic_regression` on pooled data, by Newton's
    method in float64 (quadratic convergence; 60 iterations reach machine precision)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    w = np.zeros(x.shape[1])
    for _ in range(iters):
        p = 1 / (1 + np.exp(-x @ w))
        g = x.T @ (p - y) + w / prior_scale**2
        H = x.T @ (x * (p * (1 - p))[:, None]) + np.eye(x.shape[1]) / prior_scale**2
        w -= np.linalg.solve(H, g)
    return w
