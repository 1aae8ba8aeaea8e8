"""The federated damped Newton MAP solver (fedbayes.algorithms.newton, tamuna.map_solve / map_estimate)
against closed forms and centralised Newton on pooled data, on raw and standardised versions of a model."""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedbayes as fb
from fedbayes.algorithms import tamuna as tm
from fedbayes.engine import Problem


def sleep_like(scale=1.0, shift=0.0, clients=18, seed=0):
    """Reaction-time-like data on raw units: intercept ~250 ms, slope ~10 ms/day over days 0..9,
    residual sd ~25 ms, random intercepts (sd 25) and slopes (sd 6); ``(y - shift) / scale``."""
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for _ in range(clients):
        days = np.arange(10.0)
        b = rng.normal([0.0, 0.0], [25.0, 6.0])
        xs.append(np.column_stack([np.ones(10), days]))
        ys.append((250 + b[0] + (10 + b[1]) * days + 25 * rng.normal(size=10) - shift) / scale)
    return fb.FederatedData({"x": xs, "z": xs, "y": ys}), np.concatenate(xs), np.concatenate(ys)


@pytest.mark.parametrize("scale,shift", [(1.0, 0.0), (25.0, 250.0)], ids=["raw", "standardised"])
def test_mixed_model_warm_start_is_ols_on_raw_and_standardised_scales(scale, shift):
    """The non-personalised LME (latents at their mean 0) is y = X beta + e: its maximiser is OLS
    (numpy lstsq) with sigma^2 = RSS / N; the random-effect scale does not enter it and stays at its start."""
    data, X, y = sleep_like(scale, shift)
    fm = fb.FedModel(fb.models.linear_mixed_effects, data)
    problem = Problem(fm, data, 1)
    out = tm.map_solve(problem)
    assert out.converged
    est = fm.constrain(out.unravel(out.x))
    beta, rss = np.linalg.lstsq(X, y, rcond=None)[:2]
    np.testing.assert_allclose(est["beta"], beta, rtol=1e-9)
    np.testing.assert_allclose(est["sigma"], np.sqrt(rss[0] / len(y)), rtol=1e-9)
    np.testing.assert_array_equal(est["scale_tril"], fm.constrain(fm.init_globals(None))["scale_tril"])
    assert out.frozen.sum() == 3  # the three Cholesky coordinates
    # map_estimate (the warm start of FedSOUL / FedMM init="map") gives the same constrained values
    warm = tm.map_estimate(problem)
    np.testing.assert_allclose(warm["beta"], est["beta"], rtol=1e-12)
    # honest ledger: at least the first curvature exchange (l_i, gradient, upper triangle of the Hessian)
    n, d = data.num_clients, 6
    assert out.bits[0] >= n * 32 * (1 + d + d * (d + 1) // 2) * out.iterations
    assert out.bits[1] >= n * 32 * d * out.iterations


def mle_logistic(x, y=None):
    """Logistic regression by maximum likelihood (a param without prior): affine equivariant."""
    w = numpyro.param("w", jnp.zeros(x.shape[1]))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def age_data(seed=1, clients=6):
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for i in range(clients):
        n = 40 + 7 * i
        age = rng.uniform(20, 80, n) + 3 * i  # raw units: years, heterogeneous across clients
        x = np.column_stack([np.ones(n), age, rng.normal(size=n)])
        p = 1 / (1 + np.exp(-(-4.0 + 0.07 * age + 0.8 * x[:, 2])))
        xs.append(x)
        ys.append((rng.random(n) < p).astype(np.float64))
    return xs, ys


def test_newton_is_affine_invariant():
    """Raw units (age in years) and standardised columns give the same iterates, w_raw = w_std / s."""
    xs, ys = age_data()
    s = np.array([1.0, 15.0, 1.0])
    runs = []
    for cols in (xs, [x / s for x in xs]):
        data = fb.FederatedData({"x": cols, "y": ys})
        fm = fb.FedModel(mle_logistic, data)
        out = tm.map_solve(Problem(fm, data, 1))
        runs.append((out, fm.constrain(out.unravel(out.x))["w"]))
    (raw, w_raw), (std, w_std) = runs
    assert raw.converged and std.converged
    assert raw.iterations == std.iterations
    np.testing.assert_allclose(w_raw * s, w_std, rtol=1e-9)


def test_map_of_a_wide_prior_logistic_regression_is_pooled_newton():
    """N(0, 5^2) prior, raw age column: the federated MAP equals centralised Newton (float64, 60 steps)."""
    xs, ys = age_data(seed=2)
    data = fb.FederatedData({"x": xs, "y": ys})
    fm = fb.FedModel(fb.models.logistic_regression(5.0), data)
    est = tm.map_estimate(Problem(fm, data, 1))
    ref = fb.models.logistic_map(np.concatenate(xs), np.concatenate(ys), 5.0)
    np.testing.assert_allclose(est["w"], ref, rtol=1e-9)
