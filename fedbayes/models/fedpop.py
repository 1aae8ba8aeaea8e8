"""FedPop's synthetic low-rank regression (Kotelevskii et al. 2022, section 5; Collins et al. 2021).

Client i has covariates x_j in R^k and responses

    y_j = x_j^T phi z_i + eps_j,    eps_j ~ N(0, noise_sd^2),    z_i ~ N(mu, sigma^2 I_d)

with a shared representation phi in R^{k x d} (the fixed effect) and a personal head z_i in R^d
(the random effect). theta = (phi, mu, sigma) is estimated; only the column space of phi and the
predictions are identified (phi -> phi R, z -> R^{-1} z leaves the likelihood unchanged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

from ..data import FederatedData
from ..introspect import local
from ..symmetry import Symmetry


def latent_rotation_and_scale(loading: str = "phi", mean: str = "mu", scale: str = "sigma") -> Symmetry:
    """The symmetry of a personal head z ~ N(mu, sigma^2 I_d) that enters the likelihood as ``phi @ z``.

    With A = c R (c > 0, R orthogonal), phi -> phi A, mu -> A^-1 mu, sigma -> sigma / c leaves the
    likelihood unchanged (z -> A^-1 z keeps phi z and maps the prior to N(A^-1 mu, (sigma / c)^2 I)). The
    group has d(d - 1) / 2 + 1 coordinates: a[0] = log c and a[1:] the entries of a skew-symmetric
    G above its diagonal, R = exp(G). Declared on :func:`fedpop_synthetic`.

    >>> import fedbayes as fb
    >>> fb.models.fedpop_synthetic.symmetry.name
    'the rotation and scale of the latent head (phi, mu, sigma)'
    """

    def action(p, a):
        d = p[mean].shape[-1]
        rows, cols = np.triu_indices(d, 1)
        g = jnp.zeros((d, d), a.dtype).at[rows, cols].set(a[1:])
        rot = jax.scipy.linalg.expm(g - g.T)
        c = jnp.exp(a[0])
        return {loading: p[loading] @ rot * c, mean: rot.T @ p[mean] / c, scale: p[scale] / c}

    return Symmetry(
        action,
        dim=lambda p: p[mean].shape[-1] * (p[mean].shape[-1] - 1) // 2 + 1,
        name=f"the rotation and scale of the latent head ({loading}, {mean}, {scale})",
    )


@latent_rotation_and_scale()
def fedpop_synthetic(x, y=None, *, latent_dim: int = 2, noise_sd: float = 0.1):
    """y ~ N(x^T phi z, noise_sd^2) with personal z ~ N(mu, sigma^2 I) (FedPop's synthetic model).

    It declares its symmetry (:func:`latent_rotation_and_scale`), so that the convergence checks and the
    standard errors judge what the data identify."""
    k = x.shape[-1]
    phi = numpyro.param("phi", lambda key: 0.3 * jax.random.normal(key, (k, latent_dim)))
    mu = numpyro.param("mu", jnp.zeros(latent_dim))
    sigma = numpyro.param("sigma", jnp.ones(()), constraint=constraints.positive)
    with local():
        z = numpyro.sample("z", dist.Normal(mu, sigma).expand([latent_dim]).to_event(1))
    with numpyro.plate("obs", x.shape[0]):
        # x (phi z): phi z is one d-vector per client, so each row costs d multiply-adds (not 2d + 2 for
        # (x phi) z), and its gradients are vector products; 3.4x faster FedSOUL rounds on a CPU at
        # 10 000 clients (benchmarks/README.md)
        numpyro.sample("y", dist.Normal(x @ (phi @ z), noise_sd), obs=y)


def make_fedpop_synthetic(
    num_clients: int = 100,
    *,
    small_fraction: float = 0.9,
    small_size: int = 5,
    large_size: int = 10,
    test_size: int = 100,
    input_dim: int = 20,
    latent_dim: int = 2,
    noise_sd: float = 0.1,
    seed: int = 0,
) -> tuple[FederatedData, FederatedData, dict[str, np.ndarray]]:
    """Train / test data of the FedPop synthetic study and the true parameters.

    90% of the clients (``small_fraction``) hold ``small_size`` points and the rest ``large_size``;
    phi has orthonormal columns and each z_i unit norm (as in the public FedRep / FedPop set-up);
    every client has ``test_size`` test points from its own z_i.
    """
    rng = np.random.default_rng(seed)
    phi, _ = np.linalg.qr(rng.normal(size=(input_dim, latent_dim)))
    z = rng.normal(size=(num_clients, latent_dim))
    z /= np.linalg.norm(z, axis=1, keepdims=True)
    n_small = int(round(small_fraction * num_clients))
    sizes = np.where(np.arange(num_clients) < n_small, small_size, large_size)

    def draw(n, zi):
        x = rng.normal(size=(n, input_dim))
        return x, x @ phi @ zi + noise_sd * rng.normal(size=n)

    train = [draw(n, zi) for n, zi in zip(sizes, z)]
    test = [draw(test_size, zi) for zi in z]
    as_data = lambda pairs: FederatedData({"x": [p[0] for p in pairs], "y": [p[1] for p in pairs]})  # noqa: E731
    return as_data(train), as_data(test), {"phi": phi, "z": z}


def principal_angle_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Principal-angle distance ||U_a^T_perp U_b||_2 = sin(largest principal angle) between col(a), col(b)."""
    qa, _ = np.linalg.qr(np.asarray(a))
    qb, _ = np.linalg.qr(np.asarray(b))
    return float(np.linalg.norm(qb - qa @ (qa.T @ qb), ord=2))


def aligned_head_error(phi_hat: np.ndarray, z_hat: np.ndarray, phi: np.ndarray, z: np.ndarray) -> float:
    """FedPop's aligned l2(z): the mean over clients of ||R^{-1} z_hat_i - z_i||, R = argmin ||phi_hat R - phi||_F.

    phi -> phi R, z -> R^{-1} z leaves every prediction unchanged, so heads are compared after the
    estimated representation is aligned with the true one by least squares. ``z_hat`` (clients, d) are
    point values of the heads (e.g. local posterior means), ``phi_hat`` (k, d)."""
    R = np.linalg.lstsq(np.asarray(phi_hat, float), np.asarray(phi, float), rcond=None)[0]
    aligned = np.linalg.solve(R, np.asarray(z_hat, float).T).T
    return float(np.mean(np.linalg.norm(aligned - np.asarray(z, float), axis=1)))
