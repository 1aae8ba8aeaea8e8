"""FedSOUL's default server step is scale-free: Fisher scoring preconditioned by the clients' information.

Exact checks: the safeguarded Newton direction commutes with a change of units; a default FedSOUL fit of
a linear mixed model on data y' = a + s y started from the mapped start gives the mapped iterates of the
fit on y (so raw and standardised units give the same answer), where Adam's do not; the
ledger counts the information's triangle."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedbayes as fb
from fedbayes.optim import newton_direction

# Fits: the second tier (make test-slow, run by .ci/run), to keep make test under 10 minutes.
pytestmark = pytest.mark.slow


def test_newton_direction_commutes_with_a_change_of_units():
    # x = S x' + c: gradient g' = S g, information I' = S I S (S diagonal); nonlinear (log-scale)
    # coordinates only shift (S_jj = 1), so delta' = S^-1 delta for every safeguard.
    rng = np.random.default_rng(0)
    d = 6
    a = rng.normal(size=(d, d))
    info = a @ a.T + 0.1 * np.eye(d)
    info[0, 1] = info[1, 0] = 3.0 * np.sqrt(info[0, 0] * info[1, 1])  # indefinite: exercises |lambda|
    g = rng.normal(size=d) * 50
    nonlinear = np.array([False, False, False, True, True, True])
    S = np.where(nonlinear, 1.0, np.array([1e3, 1e-2, 7.0, 1, 1, 1]))
    for radius, cap in ((None, None), (None, 0.3), (2.0, None), (2.0, 0.3)):
        delta, nu = newton_direction(jnp.asarray(info), jnp.asarray(g), radius, nonlinear=jnp.asarray(nonlinear),
                                     max_nonlinear_step=cap)
        delta2, nu2 = newton_direction(jnp.asarray(S[:, None] * info * S[None, :]), jnp.asarray(S * g), radius,
                                       nonlinear=jnp.asarray(nonlinear), max_nonlinear_step=cap)
        np.testing.assert_allclose(np.asarray(delta2) * S, np.asarray(delta), rtol=2e-4, atol=1e-6 * np.abs(delta).max())
        assert float(nu2) == pytest.approx(float(nu), rel=1e-4)
    # with a positive-definite information and no bound active it is Newton's step
    pd = a @ a.T + np.eye(d)
    delta, nu = newton_direction(jnp.asarray(pd), jnp.asarray(g))
    np.testing.assert_allclose(np.asarray(delta), np.linalg.solve(pd, g), rtol=1e-4)
    assert float(nu) == pytest.approx(np.sqrt(g @ np.linalg.solve(pd, g)), rel=1e-4)
    # the log-scale bound shortens the whole step, so its direction is kept
    capped, _ = newton_direction(jnp.asarray(pd), jnp.asarray(g), nonlinear=jnp.asarray(nonlinear),
                                 max_nonlinear_step=1e-3)
    assert np.max(np.abs(np.asarray(capped)[nonlinear])) == pytest.approx(1e-3, rel=1e-4)
    np.testing.assert_allclose(np.asarray(capped) / np.asarray(capped)[0], np.asarray(delta) / np.asarray(delta)[0],
                               rtol=1e-3)


SHIFT, SCALE = 250.0, 40.0


def _fit(data, init, optimizer, rounds=15):
    algo = fb.FedSOUL(server_optimizer=optimizer, init=init, num_samples=10, warmup=10, uncertainty=False)
    return fb.fed_fit(fb.models.linear_mixed_effects, data, algo, num_rounds=rounds, seed=3, progress=False)


@pytest.fixture(scope="module")
def unit_pair():
    data, _ = fb.models.make_linear_mixed_effects(12, seed=4)
    raw = fb.FederatedData({"x": [data.client(i)["x"] for i in range(12)],
                            "z": [data.client(i)["z"] for i in range(12)],
                            "y": [SHIFT + SCALE * data.client(i)["y"] for i in range(12)]})
    start = {"beta": np.array([0.3, -0.2]), "scale_tril": np.array([[1.5, 0.0], [0.2, 0.7]]), "sigma": np.array(2.0)}
    mapped = {"beta": SHIFT * np.array([1.0, 0.0]) + SCALE * start["beta"], "scale_tril": SCALE * start["scale_tril"],
              "sigma": SCALE * start["sigma"]}
    return data, raw, start, mapped


def _mapped_back(hist):
    return (np.asarray(hist["theta/beta"]) - SHIFT * np.array([1.0, 0.0])) / SCALE, np.asarray(hist["theta/sigma"]) / SCALE


def test_default_fit_in_raw_units_is_the_standardised_fit_mapped(unit_pair):
    """x = [1, t]: y' = 250 + 40 y maps beta' = 250 e_1 + 40 beta, L' = 40 L, sigma' = 40 sigma, and the
    latents b' = 40 b. Every part of a default round is equivariant under that map (the Langevin step
    step_scale / lambda_max scales by 40^2, the prior draws by 40, Fisher scoring is affine-invariant), so the
    two fits are the same computation in two units: equal after mapping up to float32 rounding, grown
    over 15 rounds."""
    data, raw, start, mapped = unit_pair
    std_fit, raw_fit = _fit(data, start, "auto"), _fit(raw, mapped, "auto")
    assert raw_fit.settings["server_optimizer"] == "fisher"
    beta, sigma = _mapped_back(raw_fit.history)
    np.testing.assert_allclose(beta, std_fit.history["theta/beta"], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(sigma, std_fit.history["theta/sigma"], rtol=1e-3)
    np.testing.assert_allclose(raw_fit.params["scale_tril"] / SCALE, std_fit.params["scale_tril"], rtol=1e-3, atol=1e-3)
    # the iterates really moved: the start is far from the fit (a test of a frozen fit would pass too)
    assert np.max(np.abs(std_fit.params["beta"] - start["beta"])) > 0.3


@pytest.mark.slow  # second tier: the control of the test above (~15 s)
def test_adam_is_not_scale_free(unit_pair):
    """The control: Adam's step is ~lr per round in every unit, so the raw fit is not the mapped one."""
    data, raw, start, mapped = unit_pair
    std_fit, raw_fit = _fit(data, start, "adam"), _fit(raw, mapped, "adam")
    beta, _ = _mapped_back(raw_fit.history)
    assert np.max(np.abs(beta[-1] - std_fit.history["theta/beta"][-1])) > 0.1


# The real sleepstudy with default settings: tests/test_real_data.py::test_sleepstudy_fedsoul_defaults.


@pytest.mark.parametrize("kwargs, match", [
    ({"max_log_step": 0.0}, "max_log_step"), ({"trust_radius": -1.0}, "trust_radius"),
    ({"information_max_dim": -1}, "information_max_dim"), ({"information_window": 0}, "information_window"),
    ({"uncertainty": "yes"}, "uncertainty"), ({"server_optimizer": "newton"}, "server_optimizer"),
])
def test_invalid_fisher_options_are_refused(kwargs, match):
    with pytest.raises(fb.ConfigError, match=match):
        fb.FedSOUL(**kwargs)


def test_auto_optimizer_follows_the_number_of_global_coordinates():
    data, _ = fb.models.make_linear_mixed_effects(4, seed=0)
    problem = fb.engine.Problem(fb.FedModel(fb.models.linear_mixed_effects, data), data, 10)
    run = fb.FedSOUL().build(problem)  # d = 6
    assert (run.optimizer, run.server_lr, run.uncertainty) == ("fisher", 1.0, True)
    run = fb.FedSOUL(information_max_dim=5).build(problem)
    assert (run.optimizer, run.server_lr, run.uncertainty) == ("adam", 0.05, False)
    # beta and the Cholesky factor's off-diagonal are locations; its log-diagonal and log sigma are not
    np.testing.assert_array_equal(np.asarray(fb.FedSOUL().build(problem)._nonlinear),
                                  [False, False, False, True, True, True])
