"""Samplers with default settings on a globals-only logistic regression with a wide N(0, 5^2) prior and
an age column in raw years, against NumPyro NUTS on the pooled data (fedbayes.reference.nuts): the chains
start around the Newton mode (dispersed by N(mode, H^-1)), the step is measured there, the server
preconditions by the inverse Hessian at the mode, and half the rounds are warm-up."""

import numpy as np
import pytest

import fedbayes as fb
from fedbayes.engine import Problem

# Fits: the second tier (make test-slow, run by .ci/run), to keep make test under 10 minutes.
pytestmark = pytest.mark.slow

PRIOR = 5.0


def age_logistic(seed=4, clients=8):
    rng = np.random.default_rng(seed)
    xs, ys = [], []
    for i in range(clients):
        n = 50 + 10 * i
        age = rng.uniform(20, 80, n) + 2 * i  # years: the design is far from standardised
        x = np.column_stack([np.ones(n), age, rng.normal(size=n)])
        p = 1 / (1 + np.exp(-(-4.0 + 0.07 * age + 0.8 * x[:, 2])))
        xs.append(x)
        ys.append((rng.random(n) < p).astype(np.float64))
    return fb.FederatedData({"x": xs, "y": ys})


@pytest.fixture(scope="module")
def reference():
    data = age_logistic()
    model = fb.models.logistic_regression(PRIOR)
    post = fb.reference.nuts(model, data, num_warmup=1000, num_samples=4000, num_chains=2, seed=1)
    w = np.asarray(post.posterior["w"]).reshape(-1, 3)
    return model, data, w.mean(0), w.std(0)


def assert_matches_nuts(res, mean, sd):
    w = res.global_samples["w"]
    # Monte Carlo error. Preconditioned at the mode, the chains move in y = S^-1 x, where the posterior is
    # close to N(0, I), with step gamma = 0.1: each coordinate is about AR(1) with rho = 1 - gamma = 0.9,
    # integrated autocorrelation time (1 + rho) / (1 - rho) = 19 rounds, so 4 chains x 3000 kept draws
    # give ESS ~ 630 and a Monte Carlo sd of the mean of 0.04 posterior sd; NUTS's 8000 draws (ESS >~ 2000)
    # add 0.02: the 0.15-sd bar is > 3 combined standard errors. The sd: ULA at gamma = 0.1 inflates each
    # variance by 1 / (1 - gamma / 2) (+2.6% sd), and its relative Monte Carlo error is ~ 1 / sqrt(2 ESS)
    # = 3%: the 10% bar is > 2.4 standard errors beyond the bias.
    np.testing.assert_array_less(np.abs(w.mean((0, 1)) - mean) / sd, 0.15)
    np.testing.assert_allclose(w.std((0, 1)), sd, rtol=0.10)
    assert res.settings["start"] == "map" and res.settings["preconditioned"]
    assert res.settings["warmup"] == 3000


@pytest.mark.slow
def test_lmc_defaults_match_nuts(reference):
    model, data, mean, sd = reference
    assert_matches_nuts(fb.fed_fit(model, data, fb.LMC(), num_rounds=6000), mean, sd)


@pytest.mark.slow
@pytest.mark.parametrize("algo", [fb.DELF(uplink=fb.compress.top_k(2)), fb.PELF(downlink=fb.compress.top_k(2)),
                                  fb.BELF(uplink=fb.compress.top_k(2), downlink=fb.compress.top_k(2)), fb.QLSD()],
                         ids=["d-elf", "p-elf", "b-elf", "qlsd"])
def test_compressed_samplers_defaults_match_nuts(reference, algo):
    model, data, mean, sd = reference
    assert_matches_nuts(fb.fed_fit(model, data, algo, num_rounds=6000), mean, sd)


def test_default_start_is_the_mode_with_dispersed_chains():
    """The chains start at independent draws of N(mode, H^-1): their sample mean and covariance over many
    chains match the Newton mode and the inverse Hessian (Monte Carlo: 400 chains, 5 standard errors)."""
    model, data = fb.models.logistic_regression(PRIOR), age_logistic()
    fm = fb.FedModel(model, data)
    problem = Problem(fm, data, 10)
    from fedbayes.algorithms.tamuna import map_solve
    import jax

    sol = map_solve(problem, jacobian=True)
    run = fb.LMC(num_chains=400).build(problem)
    x0, _ = run.setup_server(jax.random.PRNGKey(0))
    x0 = np.asarray(x0)
    cov = np.linalg.inv(np.asarray(sol.hessian))
    se = np.sqrt(np.diag(cov) / 400)
    np.testing.assert_array_less(np.abs(x0.mean(0) - np.asarray(sol.x)), 5 * se)
    np.testing.assert_allclose(np.cov(x0.T).diagonal(), cov.diagonal(), rtol=5 * np.sqrt(2 / 399))
    # the automatic step is measured at the mode in the preconditioned metric: 0.1 / lambda_max(S' H S) = 0.1
    np.testing.assert_allclose(float(run._step_from(np.asarray(sol.hessian)[None])), 0.1, rtol=1e-8)
