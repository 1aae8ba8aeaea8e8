"""FedSOUL's standard errors: Louis' identity from the clients' draws in the final exchange against the
closed-form observed information of a linear mixed model, y_i ~ N(X_i beta, Z_i L L^T Z_i^T + sigma^2 I)
(jax.hessian of that marginal log-likelihood in the same unconstrained coordinates, at the same theta)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import fedbayes as fb
from fedbayes.algorithms.fedsoul import FedSOULRun
from lme_reference import local_posterior, marginal_loglik, mml

# Fits: the second tier (make test-slow, run by .ci/run), to keep make test under 10 minutes.
pytestmark = pytest.mark.slow

C = 20


def _optimum(data) -> dict:
    """The maximum marginal likelihood (closed form), as FedSOUL's ``init``."""
    ref = mml(data)
    return {k: np.asarray(ref[k]) for k in ("beta", "scale_tril", "sigma")}


def _fit_keeping_parts(data, algorithm):
    """fed_fit (60 rounds) and the finalize parts (gradient, gradient_cov) the convergence check reads."""
    parts = {}
    original = FedSOULRun.final_server

    def keep(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        parts.update(out)
        return out

    FedSOULRun.final_server = keep
    try:
        # Louis' identity holds at any theta, so the comparison does not need a converged fit; started at the
        # maximum marginal likelihood, 60 rounds stay near it (the standard errors a user reads are there,
        # where the information is positive definite)
        res = fb.fed_fit(fb.models.linear_mixed_effects, data, algorithm, num_rounds=60, seed=0, progress=False)
    finally:
        FedSOULRun.final_server = original
    return res, parts


@pytest.fixture(scope="module")
def lme_se_fit():
    data, _ = fb.models.make_linear_mixed_effects(C, seed=0)
    res, parts = _fit_keeping_parts(data, fb.FedSOUL(init=_optimum(data)))
    return data, res, parts


def _closed_form(res, data):
    """(gradient, observed information) of the exact marginal log-likelihood at the fit's theta (unconstrained)."""
    fm = res._fm
    flat, unravel = ravel_pytree(res._theta_u)
    ll = lambda x: marginal_loglik(fm.constrain(unravel(x)), data)  # noqa: E731
    return np.asarray(jax.grad(ll)(flat)), -np.asarray(jax.hessian(ll)(flat))


def test_louis_information_matches_the_closed_form(lme_se_fit):
    data, res, _ = lme_se_fit
    _, info = _closed_form(res, data)
    est = np.asarray(res.information)
    d = np.sqrt(np.diag(info))
    err = (est - info) / np.outer(d, d)  # the error on the correlation scale: unit-free
    # Both moments of Louis' identity come from the Laplace covariance of each local posterior (exact
    # here: Gaussian, with a log-density quadratic in b) about the mean of the client's draws, so the error
    # left is that mean's Monte Carlo error (one continuing chain, 200 thinned correlated draws per client),
    # entering to first order (the exact mean gives the exact matrix), averaged over the 20 clients.
    # Measured: 0.048 at most (a cross term of the Cholesky factor's log-diagonals). Bound 0.1, about twice.
    # The beta block has no b in it (X^T X / sigma^2 - J V J^T with a constant J): exact to float32.
    assert np.max(np.abs(err)) < 0.1
    np.testing.assert_allclose(est[:2, :2], info[:2, :2], rtol=1e-3)
    assert np.all(np.linalg.eigvalsh(est) > 0)


def test_standard_errors_match_the_closed_form(lme_se_fit):
    data, res, _ = lme_se_fit
    _, info = _closed_form(res, data)
    fm = res._fm
    flat, unravel = ravel_pytree(res._theta_u)
    Jc = np.asarray(jax.jacfwd(lambda x: ravel_pytree(fm.constrain(unravel(x)))[0])(flat))
    se_true = np.sqrt(np.clip(np.diag(Jc @ np.linalg.inv(info) @ Jc.T), 0, None))
    se = np.asarray(ravel_pytree({k: jnp.asarray(v) for k, v in res.standard_errors.items()})[0])
    # se ~ I^{-1/2}: half the information's relative error bound above (the zero entry is the Cholesky
    # factor's upper corner, 0 in both)
    np.testing.assert_allclose(se, se_true, rtol=0.05, atol=1e-7)


def test_gradient_is_the_fisher_identity_gradient_up_to_its_monte_carlo_error(lme_se_fit):
    """The final exchange's gradient of the marginal log-likelihood equals the closed form's within 4 of its
    own Monte Carlo standard errors (parts ``gradient`` / ``gradient_cov``, the convergence check's input):
    the default local kernel is MALA, whose stationary law is the local posterior exactly."""
    data, res, parts = lme_se_fit
    assert res.settings["local_kernel"] == "mala"
    g_true, _ = _closed_form(res, data)
    g, sd = np.asarray(parts["gradient"]), np.sqrt(np.diag(np.asarray(parts["gradient_cov"])))
    np.testing.assert_array_less(np.abs(g - g_true), 4 * sd)
    assert np.all(sd > 0)


def test_ula_gradient_carries_the_exact_bias_of_unadjusted_langevin():
    """With local_kernel="ula" and the identity metric the same gradient is off by ULA's exact bias: for a
    Gaussian local posterior N(m, V) and step gamma the stationary law is N(m, V_g), V_g = (I - gamma P / 2)^-1 V,
    P = V^-1, so E_ULA[g] - E[g] = 1/2 tr(T_a (V_g - V)), T_a = d^2 g_a / db^2 (constant: the score is quadratic
    in b). The bias is many standard errors, so the check could not pass with MALA's draws."""
    data, _ = fb.models.make_linear_mixed_effects(C, seed=0)
    res, parts = _fit_keeping_parts(data, fb.FedSOUL(local_kernel="ula", local_metric="identity", step_scale=0.5,
                                                     num_samples=1000, init=_optimum(data)))
    g_true, _ = _closed_form(res, data)
    fm = res._fm
    flat, unravel = ravel_pytree(res._theta_u)

    def third(x, z, y, mask):  # T for one padded client
        score = jax.grad(lambda t, b: fm.client_log_joint(unravel(t), {"b": b}, {"x": x, "z": z, "y": y}, mask))
        return jax.jacfwd(jax.jacfwd(score, argnums=1), argnums=1)(flat, jnp.zeros(2))

    p = data.padded
    T = np.asarray(jax.jit(jax.vmap(third))(p["x"], p["z"], p["y"], data.mask))  # (C, d, 2, 2)
    bias = np.zeros(flat.size)
    for i in range(C):
        _, V = local_posterior(res.params, data.client(i))
        gamma = float(res.client_info["step_size"][i])
        Vg = np.linalg.solve(np.eye(2) - gamma * np.linalg.inv(V) / 2, V)
        bias += 0.5 * np.einsum("aij,ji->a", T[i], Vg - V)
    g, sd = np.asarray(parts["gradient"]), np.sqrt(np.diag(np.asarray(parts["gradient_cov"])))
    np.testing.assert_array_less(np.abs(g - g_true - bias), 4 * sd)
    assert np.max(np.abs(bias) / sd) > 8


def test_globals_in_the_posterior_and_the_ledger(lme_se_fit):
    az = pytest.importorskip("arviz")
    data, res, _ = lme_se_fit
    post = res.idata.posterior
    for site in ("beta", "scale_tril", "sigma", "b"):
        assert site in post
    assert post["sigma"].shape == (2, 200)  # like the local chains: num_chains x num_samples
    summary = az.summary(res.idata, var_names=["beta", "sigma"])
    # the normal approximation's mean and sd are theta_bar and the standard errors (500 draws: sd of the
    # mean se / sqrt(400), of the sd about se / sqrt(800))
    np.testing.assert_allclose(summary["mean"].to_numpy()[:2], res.params["beta"], atol=4 * res.standard_errors["beta"].max() / 20)
    np.testing.assert_allclose(summary["sd"].to_numpy()[:2], res.standard_errors["beta"], rtol=4 / np.sqrt(800))
    d = 6
    # final exchange: theta_bar (d floats) to each client; back the mean score (d) and two triangles
    assert res.final_bits == (C * 32 * (d + d * (d + 1)), C * 32 * d)
    # each round: gradient (d), objective (1) and the complete-data information's triangle up
    np.testing.assert_array_equal(res.history["bits_up"], C * 32 * (d + 1 + d * (d + 1) // 2))
    assert res.settings["server_optimizer"] == "fisher" and res.settings["server_lr"] == 1.0
