"""Mixed-effects models of one client (a group): linear and logistic with personal effects."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

from ..data import FederatedData
from ..introspect import local
from .tables import CovarianceBlock, MixedLayout, column_labels


def linear_mixed_effects(x, z, y=None):
    """Linear mixed model with correlated random effects (maximum marginal likelihood via ``param``s).

        b_i ~ N(0, Omega),   Omega = L L^T,
        y_ij = x_ij^T beta + z_ij^T b_i + eps_ij,   eps_ij ~ N(0, sigma^2)

    ``x`` (n, p) are fixed-effect covariates, ``z`` (n, q) random-effect covariates (a column of
    ones and a slope for random intercepts and slopes). The marginal likelihood is Gaussian,
    y_i ~ N(X_i beta, Z_i Omega Z_i^T + sigma^2 I), so the estimates can be checked exactly.
    """
    p, q = x.shape[-1], z.shape[-1]
    beta = numpyro.param("beta", jnp.zeros(p))
    scale_tril = numpyro.param("scale_tril", jnp.eye(q), constraint=constraints.lower_cholesky)
    sigma = numpyro.param("sigma", jnp.ones(()), constraint=constraints.positive)
    with local():
        b = numpyro.sample("b", dist.MultivariateNormal(jnp.zeros(q), scale_tril=scale_tril))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ beta + z @ b, sigma), obs=y)


def _linear_mixed_effects_layout(data: FederatedData) -> MixedLayout:
    """linear_mixed_effects' tables: ``beta`` by ``x``'s columns, one dense block over ``z``'s, residual ``sigma``
    (the names are the DataFrame's where the data came from one, :meth:`FederatedData.from_dataframe`)."""
    p, q = data.padded["x"].shape[-1], data.padded["z"].shape[-1]
    random = CovarianceBlock("scale_tril", column_labels(data, "z", q), correlated=True)
    return MixedLayout(data.client_column or "client", column_labels(data, "x", p), (random,), residual="sigma")


linear_mixed_effects.mixed_layout = _linear_mixed_effects_layout  # type: ignore[attr-defined]


def make_linear_mixed_effects(
    num_clients: int = 30,
    *,
    sizes: tuple[int, int] = (5, 20),
    beta=(1.0, -0.5),
    cov=((0.8, 0.2), (0.2, 0.3)),
    sigma: float = 0.5,
    seed: int = 0,
) -> tuple[FederatedData, dict[str, np.ndarray]]:
    """Random intercepts and slopes: x = [1, t], z = [1, t], t ~ N(0, 1), ragged sizes in ``sizes``."""
    rng = np.random.default_rng(seed)
    beta, cov = np.asarray(beta), np.asarray(cov)
    b = rng.multivariate_normal(np.zeros(len(cov)), cov, size=num_clients)
    xs, zs, ys = [], [], []
    for i in range(num_clients):
        n = int(rng.integers(sizes[0], sizes[1] + 1))
        t = rng.normal(size=n)
        design = np.column_stack([np.ones(n), t])
        xs.append(design)
        zs.append(design)
        ys.append(design @ beta + design @ b[i] + sigma * rng.normal(size=n))
    return FederatedData({"x": xs, "z": zs, "y": ys}), {"beta": beta, "cov": cov, "sigma": sigma, "b": b}


def personalized_logistic(features, y=None, *, num_classes: int = 2, hidden: int = 16):
    """Multinomial logistic regression with a personal last layer over shared learned features.

        h = tanh(features W_phi + c_phi)               (shared representation, ``param``s)
        vec(W_i, b_i) = z_i ~ N(mu, sigma^2 I)        (personal head, local)
        y_ij ~ Categorical(softmax(h_ij W_i + b_i))

    The FedPop image models' structure (a personalised head on a shared backbone) at laptop size.
    """
    k = features.shape[-1]
    d = (hidden + 1) * num_classes
    w_phi = numpyro.param("w_phi", lambda key: jax.random.normal(key, (k, hidden)) / np.sqrt(k))
    c_phi = numpyro.param("c_phi", jnp.zeros(hidden))
    mu = numpyro.param("mu", jnp.zeros(d))
    sigma = numpyro.param("sigma", jnp.ones(()), constraint=constraints.positive)
    with local():
        head = numpyro.sample("head", dist.Normal(mu, sigma).expand([d]).to_event(1))
    h = jnp.tanh(features @ w_phi + c_phi)
    w, b = head[: hidden * num_classes].reshape(hidden, num_classes), head[hidden * num_classes :]
    with numpyro.plate("obs", features.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=h @ w + b), obs=y)


EIGHT_SCHOOLS_Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
"""Eight schools (Rubin 1981): the estimated effects of SAT coaching programmes in eight high schools..."""
EIGHT_SCHOOLS_SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])
"""... and their standard errors."""


def random_intercepts(y):
    """One group's model of the simplest Gaussian hierarchy (a group per client):

        mu ~ N(0, 10^2) (global),  z ~ N(mu, 1) (the group's own mean, ``fb.local()``),  y_j ~ N(z, 1).

    Its joint posterior of (mu, z_1..z_b) is Gaussian in closed form, the exact reference of the joint samplers'
    and the minibatch samplers' tests."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with local():
        z = numpyro.sample("z", dist.Normal(mu, 1.0))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(z, 1.0), obs=y)


def eight_schools(y, sigma):
    """One school's model of the non-centred eight-schools hierarchy (a school per client):

        mu ~ N(0, 5^2),  tau ~ HalfCauchy(5)   (globals),
        eta_j ~ N(0, 1)                        (the school's own latent, ``fb.local()``),
        y_j ~ N(mu + tau eta_j, sigma_j^2)     (its estimate, with known standard error sigma_j).

    The joint posterior of (mu, tau, eta_1..eta_8) is what :class:`fedbayes.JointMALA` / ``JointHMC`` sample;
    :func:`eight_schools_pooled` is the same model on the pooled data, for NUTS."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with local():
        eta = numpyro.sample("eta", dist.Normal(0.0, 1.0))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu + tau * eta, sigma), obs=y)


def eight_schools_pooled(y, sigma):
    """:func:`eight_schools` on the pooled data (``y``, ``sigma`` of all schools), with a plate over schools."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("school", y.shape[0]):
        eta = numpyro.sample("eta", dist.Normal(0.0, 1.0))
        numpyro.sample("y", dist.Normal(mu + tau * eta, sigma), obs=y)


def eight_schools_data() -> FederatedData:
    """The eight schools as eight clients, each with its one estimate ``y`` and standard error ``sigma``."""
    return FederatedData(
        {
            "y": [EIGHT_SCHOOLS_Y[j : j + 1] for j in range(8)],
            "sigma": [EIGHT_SCHOOLS_SIGMA[j : j + 1] for j in range(8)],
        },
        client_names=[f"school {chr(ord('A') + j)}" for j in range(8)],
    )
