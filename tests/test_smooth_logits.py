"""Bernoulli-logit sites are evaluated with exact derivatives at logit 0 (NumPyro's are one-sided there).

The deterministic start puts every logit of a logistic model at exactly 0; NumPyro's
``Bernoulli(logits=x).log_prob`` has the autodiff gradient y there instead of y - 1/2, which sent
Newton's first step (the samplers' start, ``init="map"``) and gradient descent's uphill.
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedbayes as fb
from fedbayes.algorithms.newton import federated_newton
from fedbayes.engine import stack_clients

# Fits: the second tier (make test-slow, run by .ci/run), to keep make test under 10 minutes.
pytestmark = pytest.mark.slow


def _model(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 5.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def _data(seed=0, clients=4):
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for i in range(clients):
        n = 20 + 5 * i
        x = np.column_stack([np.ones(n), rng.normal(40.0, 10.0, n)])  # an age-like column in raw units
        p = 1 / (1 + np.exp(-(-2.0 + 0.05 * x[:, 1])))
        xs.append(x)
        ys.append((rng.uniform(size=n) < p).astype(float))
    return fb.FederatedData({"x": xs, "y": ys}), np.concatenate(xs), np.concatenate(ys)


def test_gradient_at_logit_zero_is_exact_and_values_are_numpyros():
    data, x, y = _data()
    fm = fb.FedModel(_model, data)
    client = jax.tree_util.tree_map(lambda a: a[0], stack_clients(data))
    n0 = int(data.sizes[0])
    x0, y0 = x[:n0], y[:n0]
    for w in (np.zeros(2), np.array([0.3, -0.01])):
        theta = {"w": jnp.asarray(w)}
        lik = lambda t: fm.client_log_terms(t, {}, client.data, client.mask)[1]  # noqa: E731
        grad = jax.grad(lik)(theta)["w"]
        # closed form: sum_j (y_j - sigmoid(x_j w)) x_j
        eta = x0 @ w
        expected = x0.T @ (y0 - 1 / (1 + np.exp(-eta)))
        np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-10, atol=1e-10)
        # the value is NumPyro's own to rounding (the same operations; the padded client's masked sum may
        # add in another order: a few ulp of the total)
        plain = jnp.sum(dist.Bernoulli(logits=jnp.asarray(eta)).log_prob(jnp.asarray(y0)))
        np.testing.assert_allclose(float(lik(theta)), float(plain), rtol=1e-14)


def test_newton_from_the_deterministic_start_reaches_the_pooled_map():
    data, x, y = _data()
    fm = fb.FedModel(_model, data)
    x0 = fm.init_globals(None)["w"]
    assert np.all(np.asarray(x0) == 0.0)  # every logit at exactly 0
    clients = stack_clients(data)
    loglik = lambda v, c: fm.client_log_terms({"w": v}, {}, c.data, c.mask)[1]  # noqa: E731
    sol = federated_newton(loglik, lambda v: fm.log_prior({"w": v}), x0, clients)
    # pooled Newton in numpy on the same objective (prior N(0, 25 I))
    w = np.zeros(2)
    for _ in range(50):
        p = 1 / (1 + np.exp(-(x @ w)))
        g = x.T @ (y - p) - w / 25.0
        h = (x * (p * (1 - p))[:, None]).T @ x + np.eye(2) / 25.0
        w = w + np.linalg.solve(h, g)
    assert sol.converged
    np.testing.assert_allclose(np.asarray(sol.x), w, rtol=1e-8)
