"""The stationary law's closed form at the mode (fedbayes.algorithms.stationary) and the samplers' report of it.

The closed form is checked two ways: as the solution of the discrete Lyapunov equation it claims to solve
(to rounding), and against long runs of the samplers on a Gaussian posterior (Bayesian linear regression,
whose posterior is exactly N(P^-1 X'y, P^-1), P = X'X + I / s^2), where ULA's law is exactly the closed
form's Gaussian. The Monte Carlo error of a chain's sd is about sd / sqrt(2 ESS) (ESS the bulk effective
sample size), so each measured sd ratio is held to 4 of those standard errors: a two-sided 6e-5 chance per
coordinate with a correct formula.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import fedbayes as fb
from fedbayes.algorithms.stationary import LagTerm, NoiseTerm, _Whitened, sd_inflation, step_for_inflation
from fedbayes.chain_stats import ess_bulk
from fedbayes.models.glm import linear_regression, make_glm_clients

PRIOR = 3.0


def _random_problem(d: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(d, d))
    h = a @ a.T + d * np.eye(d)
    b = rng.normal(size=(d, d))
    s = np.linalg.inv(np.linalg.cholesky(h + b @ b.T)).T  # an inexact preconditioner: S' H S is not I
    v = rng.normal(size=(d, d))
    return h, s, v @ v.T


def test_the_closed_form_solves_the_lyapunov_equation():
    """Sigma_y = A Sigma_y A' + 2 gamma I + gamma^2 V_y with A = I - gamma H_y, to rounding, with and without
    a preconditioner and with a noise term."""
    h, s, v = _random_problem()
    for precond in (None, s):
        w = _Whitened(h, precond)
        step = 0.3 / w.lam[-1]
        sy = np.eye(h.shape[0]) if precond is None else precond
        hy = sy.T @ h @ sy
        # the whole covariance, rebuilt from the module's eigenbasis formula
        a = 1.0 - step * w.lam
        r = 2 * step * np.eye(4) + step**2 * (w.q.T @ v @ w.q)
        cov_y = w.q @ (r / (1 - np.outer(a, a))) @ w.q.T
        big_a = np.eye(4) - step * hy
        resid = cov_y - big_a @ cov_y @ big_a.T - 2 * step * np.eye(4) - step**2 * v
        assert np.max(np.abs(resid)) < 1e-12 * np.max(np.abs(cov_y))
        got = w.variances(step, [NoiseTerm(0, v)])
        assert np.allclose(got, np.diag(sy @ cov_y @ sy.T), rtol=1e-12)


def test_inflation_formulas_in_closed_form():
    """No preconditioner, diagonal H: 1 / sqrt(1 - gamma lambda_j / 2); the default preconditioner (S S' = H^-1):
    1 / sqrt(1 - gamma / 2) everywhere; a lag tau: 1 / sqrt(1 - gamma (tau + 1/2)); an unstable step: inf."""
    lam = np.array([4.0, 1.0, 0.25])
    assert np.allclose(sd_inflation(np.diag(lam), 0.1), 1 / np.sqrt(1 - 0.1 * lam / 2), rtol=1e-13)
    h, _, _ = _random_problem()
    s = np.linalg.inv(np.linalg.cholesky(h)).T
    assert np.allclose(sd_inflation(h, 0.1, s), 1 / np.sqrt(0.95), rtol=1e-12)
    assert np.allclose(sd_inflation(h, 0.1, s, [LagTerm(2.0)]), 1 / np.sqrt(1 - 0.1 * 2.5), rtol=1e-12)
    assert np.allclose(sd_inflation(h, 0.1, s, [LagTerm(0.0)]), sd_inflation(h, 0.1, s), rtol=1e-14)
    assert np.all(np.isinf(sd_inflation(np.diag(lam), 0.6)))  # past 2 / lambda_max = 0.5
    assert np.all(np.isinf(sd_inflation(h, 0.5, s, [LagTerm(2.0)])))  # gamma (tau + 1/2) = 1.25 > 1


def test_the_step_for_five_percent_meets_it():
    h, s, v = _random_problem()
    for precond, noise in ((None, ()), (s, ()), (s, [LagTerm(1.0), NoiseTerm(0, v)])):
        step = step_for_inflation(h, precond, noise)
        assert np.max(sd_inflation(h, step, precond, noise)) == pytest.approx(1.05, rel=1e-9)
    exact = np.linalg.inv(np.linalg.cholesky(h)).T
    assert step_for_inflation(h, exact) == pytest.approx(2 * (1 - 1 / 1.05**2), rel=1e-9)


@pytest.fixture(scope="module")
def gaussian():
    """10 clients of a 3-coefficient linear regression, and the exact posterior sds."""
    data, _ = make_glm_clients(10, 3, 20, family="linear", seed=0)
    x = data.pooled()["x"]
    sd = np.sqrt(np.diag(np.linalg.inv(x.T @ x + np.eye(3) / PRIOR**2)))
    return data, sd


def _measured(res, sd) -> tuple[np.ndarray, np.ndarray]:
    """(the draws' sd over the posterior's, its Monte Carlo standard error) per coordinate."""
    draws = np.asarray(res.global_samples["w"])
    ratio = draws.reshape(-1, 3).std(0, ddof=1) / sd
    ess = np.asarray(ess_bulk(draws))
    return ratio, ratio / np.sqrt(2 * ess)


def _fit(data, algorithm, rounds=20000):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = fb.fed_fit(linear_regression(1.0, PRIOR), data, algorithm, num_rounds=rounds, seed=1, progress=False)
    return res, [str(w.message) for w in caught if issubclass(w.category, fb.ConvergenceWarning)]


def test_default_lmc_reports_ulas_widening_and_stays_quiet(gaussian):
    data, sd = gaussian
    res, warned = _fit(data, fb.LMC(num_chains=8))
    assert res.settings["sd_inflation"] == pytest.approx(1 / np.sqrt(0.95), rel=1e-6)
    ratio, se = _measured(res, sd)
    assert np.all(np.abs(ratio - 1 / np.sqrt(0.95)) <= 4 * se), (ratio, se)
    assert not [m for m in warned if "wider than the posterior" in m]
    assert "step bias" not in str(res)


@pytest.mark.parametrize(
    "algorithm, exact",
    [
        (fb.LMC(num_chains=8, step_size=0.002), True),  # ULA without preconditioning: the closed form is exact
        (fb.LMC(num_chains=8, compressor=fb.compress.rand_k(1)), True),  # rand_k's diagonal: exact to MC error
        (fb.PELF(num_chains=8, downlink=fb.compress.rand_k_unscaled(1)), True),  # the lag model, first order
        (fb.DELF(num_chains=8, uplink=fb.compress.top_k(1)), False),  # round-robin lag: conservative for top_k
        (fb.BELF(num_chains=8, uplink=fb.compress.top_k(1), downlink=fb.compress.top_k(1)), False),
    ],
    ids=["ula-step", "lmc-rand-k", "p-elf-rand-k", "d-elf-top-k", "b-elf-top-k"],
)
def test_the_report_against_the_exact_posterior(gaussian, algorithm, exact):
    """The predicted widest sd ratio against the measured one (exact posterior sds). Exact models within 4
    Monte Carlo standard errors of the widest coordinate; the conservative ones (top_k under error feedback)
    at least as wide as measured, less 4 standard errors. Every one of these is above 5%, so each warns with
    a step, and the fit at that step reports at most 5%."""
    data, sd = gaussian
    res, warned = _fit(data, algorithm)
    predicted = res.settings["sd_inflation"]
    ratio, se = _measured(res, sd)
    j = int(np.argmax(ratio))
    if exact:
        assert abs(predicted - ratio[j]) <= 4 * se[j], (predicted, ratio, se)
    else:
        assert predicted >= ratio[j] - 4 * se[j], (predicted, ratio, se)
    assert predicted > 1.05
    assert [m for m in warned if "wider than the posterior" in m]
    option = "step_size" if algorithm.step_size is not None else "step_scale"
    step = res.settings["sd_inflation_step"]
    assert f"{option}={step:.3g}" in str(res)
    import dataclasses

    again, _ = _fit(data, dataclasses.replace(algorithm, **{option: step}), rounds=200)
    assert again.settings["sd_inflation"] == pytest.approx(1.05, rel=1e-6)


def test_no_report_without_a_mode_or_a_model_of_the_error(gaussian):
    data, _ = gaussian
    res, _ = _fit(data, fb.LMC(init="prior", step_size=1e-3), rounds=50)
    assert "sd_inflation" not in res.settings and "did not start at a mode" in res.settings["sd_inflation_note"]
    res, _ = _fit(data, fb.LMC(compressor=fb.compress.top_k(1)), rounds=50)  # biased, no error feedback
    assert "sd_inflation" not in res.settings and "no model" in res.settings["sd_inflation_note"]
    assert "sd_inflation" not in set(res.diagnostics["check"])


def test_step_scale_is_validated():
    for bad in (0.0, 2.0, -1.0, True, "0.1", float("nan")):
        with pytest.raises(fb.ConfigError, match="step_scale"):
            fb.LMC(step_scale=bad)
