"""FedSOUL's standard errors: Louis' identity from the clients' draws in the final exchange against the
closed-form observed information of a linear mixed model, y_i ~ N(X_i beta, Z_i L L^T Z_i^T + sigma^2 I)
(jax.hessian of that marginal log-likelihood in the same unconstrained coordinates, at the same theta)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import fedbayes as fb
from fedbayes.result import group
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


def _drawn_at(res) -> dict:
    """The unconstrained theta at which the final exchange drew the local posteriors: the averaged iterate
    (``res.params_averaged`` where ``res.params`` is its one Newton step)."""
    if res.params_averaged is None:
        return res._theta_u
    return res._fm.unconstrain({k: jnp.asarray(v) for k, v in res.params_averaged.items()})


def _closed_form(res, data):
    """(gradient, observed information) of the exact marginal log-likelihood (unconstrained) where the final
    exchange's clients drew their local posteriors."""
    fm = res._fm
    flat, unravel = ravel_pytree(_drawn_at(res))
    ll = lambda x: marginal_loglik(fm.constrain(unravel(x)), data)  # noqa: E731
    return np.asarray(jax.grad(ll)(flat)), -np.asarray(jax.hessian(ll)(flat))


def test_louis_information_matches_the_closed_form(lme_se_fit):
    data, res, _ = lme_se_fit
    _, info = _closed_form(res, data)
    est = np.asarray(res.information)
    d = np.sqrt(np.diag(info))
    err = (est - info) / np.outer(d, d)  # the error on the correlation scale: unit-free
    # E[-grad^2] comes from the Laplace covariance of each local posterior (exact here: Gaussian, with a
    # log-density quadratic in b) about the mean of the client's draws, and the missing information from
    # J V J^T plus the draws' covariance of the control-variate score (louis.draws_information), so the error
    # left is Monte Carlo error (one continuing chain, 200 thinned correlated draws per client) of that mean
    # and of that covariance, averaged over the 20 clients.
    # Measured: 0.0066 at most (0.048 when the missing information came from the Laplace form alone).
    # Bound 0.03, about 4.5 times.
    # The beta block has no b in it (X^T X / sigma^2 - J V J^T with a constant J, and a constant control-variate
    # score): exact to float32.
    assert np.max(np.abs(err)) < 0.03
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
    np.testing.assert_allclose(se, se_true, rtol=0.015, atol=1e-7)


def test_gradient_is_the_fisher_identity_gradient_up_to_its_monte_carlo_error(lme_se_fit):
    """The final exchange's gradient of the marginal log-likelihood equals the closed form's within 4 of its
    own Monte Carlo standard errors (parts ``gradient`` / ``gradient_cov``, the convergence check's input):
    the default local kernel is MALA, whose stationary law is the local posterior exactly."""
    data, res, parts = lme_se_fit
    assert res.settings["local_kernel"] == "mala"
    g_true, _ = _closed_form(res, data)
    g, sd = np.asarray(parts["gradient"]), np.sqrt(np.diag(np.asarray(parts["gradient_cov"])))
    rounding = 1e-10 * np.max(np.abs(g_true))
    np.testing.assert_array_less(np.abs(g - g_true), 4 * sd + rounding)
    # beta's score is linear in b, and the Stein control variate g + J V grad_b log p removes every linear
    # part of a Gaussian local posterior's score: exact to rounding, with no Monte Carlo noise left
    np.testing.assert_allclose(g[:2], g_true[:2], rtol=0, atol=rounding)
    assert np.all(sd[:2] <= rounding) and np.all(sd[2:] > 0)


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
    flat, unravel = ravel_pytree(_drawn_at(res))

    def third(x, z, y, mask):  # T for one padded client
        score = jax.grad(lambda t, b: fm.client_log_joint(unravel(t), {"b": b}, {"x": x, "z": z, "y": y}, mask))
        return jax.jacfwd(jax.jacfwd(score, argnums=1), argnums=1)(flat, jnp.zeros(2))

    p = data.padded
    T = np.asarray(jax.jit(jax.vmap(third))(p["x"], p["z"], p["y"], data.mask))  # (C, d, 2, 2)
    bias = np.zeros(flat.size)
    for i in range(C):
        _, V = local_posterior(res.params_averaged or res.params, data.client(i))
        gamma = float(res.client_info["step_size"][i])
        Vg = np.linalg.solve(np.eye(2) - gamma * np.linalg.inv(V) / 2, V)
        bias += 0.5 * np.einsum("aij,ji->a", T[i], Vg - V)
    g, sd = np.asarray(parts["gradient"]), np.sqrt(np.diag(np.asarray(parts["gradient_cov"])))
    # (ULA's stationary law of a Gaussian has the exact mean, so the control variate, linear in b, adds no bias)
    np.testing.assert_array_less(np.abs(g - g_true - bias), 4 * sd + 1e-10 * np.max(np.abs(g_true)))
    assert np.max(np.abs(bias[2:]) / sd[2:]) > 8


def test_globals_normal_approximation_beside_the_posterior_and_the_ledger(lme_se_fit):
    az = pytest.importorskip("arviz")
    data, res, _ = lme_se_fit
    post, approx = group(res.idata, "posterior"), group(res.idata, "fed_normal_approx")
    assert set(post.data_vars) == {"b"}  # the random effects' draws; the globals' approximation is not a draw
    for site in ("beta", "scale_tril", "sigma"):
        assert site in approx
    assert approx["sigma"].shape == (2, 200)  # like the local chains: num_chains x num_samples
    summary = az.summary(res.idata, group="fed_normal_approx", var_names=["beta", "sigma"])
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


def test_the_estimate_is_one_newton_step_from_the_averaged_iterate(lme_se_fit):
    """res.params = constrain(theta_bar + I^-1 g) with the final exchange's g and I at theta_bar
    (res.params_averaged), and the normal approximation is centred there."""
    data, res, parts = lme_se_fit
    assert res.params_averaged is not None and res.settings["one_step"] is True
    fm = res._fm
    bar, unravel = ravel_pytree(_drawn_at(res))
    g, info = np.asarray(parts["gradient"]), np.asarray(res.information)
    assert g @ np.linalg.solve(info, g) <= fb.convergence.ONE_STEP_MAX
    stepped = fm.constrain(unravel(bar + np.linalg.solve(info, g)))
    for k in res.params:
        np.testing.assert_allclose(res.params[k], stepped[k], rtol=1e-9, atol=1e-12, err_msg=k)
    rows = res.diagnostics.set_index(["check", "site"])
    assert rows.loc[("one_step_noise", "(all)"), "ok"] and rows.loc[("newton_decrement", "(all)"), "threshold"] > 0.25


def test_no_step_beyond_half_a_standard_error_or_when_switched_off():
    """The rule itself, on crafted final-exchange terms (information 4 I, so g' I^-1 g = |g|^2 / 4): a gradient
    at 0.2 (squared) standard errors is stepped on, one at 1.0 is not (the estimate stays theta_bar), nor
    any with one_step=False or without a positive definite information."""
    data, _ = fb.models.make_linear_mixed_effects(C, seed=0)
    problem = fb.engine.Problem(fb.FedModel(fb.models.linear_mixed_effects, data), data, C)
    theta = problem.model.unconstrain(_optimum(data))
    flat, unravel = ravel_pytree(theta)
    d = flat.size
    rows, cols = np.triu_indices(d)
    info_tris = jnp.asarray((4.0 * np.eye(d))[rows, cols])[None]
    cov_tris = jnp.zeros_like(info_tris)
    key = jax.random.PRNGKey(0)
    # the prior is flat (param sites): the information and gradient are the clients' sums
    for one_step, lam2, info_scale, taken in [(True, 0.2, 1.0, True), (True, 1.0, 1.0, False),
                                              (False, 0.2, 1.0, False), (True, 0.2, -1.0, False)]:
        run = fb.FedSOUL(one_step=one_step).build(problem)
        g = np.zeros(d)
        g[0] = 2.0 * np.sqrt(lam2)
        out = run._uncertainty_arrays(key, theta, jnp.asarray(g)[None], info_scale * info_tris, cov_tris)
        assert bool(out["one_step"]) is taken
        expected = flat + (g / 4.0 if taken else 0.0)
        np.testing.assert_allclose(ravel_pytree(out["theta"])[0], expected, rtol=1e-12, atol=1e-12)
