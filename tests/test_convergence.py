"""Convergence checks (fedbayes.convergence): the criteria on constructed inputs with known answers, and
for every family of algorithms both directions: an under-run fit warns (fb.ConvergenceWarning) and a
converged one does not."""

import warnings

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedbayes as fb
from fedbayes import convergence as cv

# ------------------------------------------------------------------------------ the criteria


def _spd(rng, d, low=0.5, high=5.0):
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    return (q * rng.uniform(low, high, d)) @ q.T


def test_newton_decrement_is_the_squared_distance_in_standard_errors():
    rng = np.random.default_rng(0)
    info, g = _spd(rng, 5), rng.normal(size=5)
    blocks = {"a": np.arange(0, 2), "b": np.arange(2, 5)}
    out = cv.newton_decrement(g, info, blocks=blocks)
    assert out[cv.JOINT]["value"] == pytest.approx(g @ np.linalg.solve(info, g), rel=1e-12)
    # per site: the Newton step delta_s = (I^-1 g)_s in its marginal covariance (I^-1)_ss, whose inverse is
    # the Schur complement I_ss - I_s,r I_rr^-1 I_r,s (computed here without inverting I)
    delta = np.linalg.solve(info, g)
    for s, idx in blocks.items():
        rest = np.setdiff1d(np.arange(5), idx)
        schur = info[np.ix_(idx, idx)] - info[np.ix_(idx, rest)] @ np.linalg.solve(info[np.ix_(rest, rest)],
                                                                                  info[np.ix_(rest, idx)])
        assert out[s]["value"] == pytest.approx(delta[idx] @ schur @ delta[idx], rel=1e-10)
        assert out[s]["value"] <= out[cv.JOINT]["value"] * (1 + 1e-12)  # a margin of the joint distance
    assert out[cv.JOINT]["threshold"] == cv.DECREMENT_TOL and out[cv.JOINT]["noise_mean"] == 0  # exact gradient
    # an estimate off the optimum by k standard errors along a direction u: delta = k u / sqrt(u' I u)
    u = rng.normal(size=5)
    off = 3.0 * u / np.sqrt(u @ info @ u)
    assert cv.newton_decrement(info @ off, info)[cv.JOINT]["value"] == pytest.approx(9.0, rel=1e-12)
    # not at a strict maximum: refused as a value, reported as failed
    saddle = np.diag([2.0, -1.0, 1.0, 1.0, 1.0])
    assert np.isnan(cv.newton_decrement(g, saddle)[cv.JOINT]["value"])


@pytest.mark.parametrize("isotropic", [True, False])
def test_decrement_noise_allowance_matches_gaussian_gradient_noise(isotropic):
    """A gradient estimate g + eps, eps ~ N(0, Sigma_g): E[decrement] = g'I^-1 g + tr(I^-1 Sigma_g), and a
    converged estimate (g = 0) exceeds the noise quantile with probability NOISE_LEVEL.

    The exceedance rate is exact where I^-1 Sigma_g is a multiple of the identity (a chi^2_d law); otherwise
    Satterthwaite's matched chi^2 is an approximation whose tail rate was 0.6e-3..1.6e-3 here, bounded
    below by 0.4e-3 and above by 2.5e-3. 400 000 draws give the rate a binomial sd of 5e-5 (at 1e-3)."""
    rng = np.random.default_rng(1)
    d, n = 4, 400_000
    info = _spd(rng, d)
    sigma_g = 0.3 * info if isotropic else _spd(rng, d, 0.01, 3.0)
    eps = rng.multivariate_normal(np.zeros(d), sigma_g, size=n)
    sims = np.einsum("nd,nd->n", eps, np.linalg.solve(info, eps.T).T)
    ref = cv.newton_decrement(np.zeros(d), info, sigma_g)[cv.JOINT]
    assert ref["noise_mean"] == pytest.approx(np.trace(np.linalg.solve(info, sigma_g)), rel=1e-10)
    assert abs(sims.mean() - ref["noise_mean"]) < 4 * sims.std() / np.sqrt(n)
    rate = np.mean(sims > ref["noise_quantile"])
    if isotropic:
        assert abs(rate - cv.NOISE_LEVEL) < 4 * np.sqrt(cv.NOISE_LEVEL / n)
    else:
        assert 0.4e-3 < rate < 2.5e-3
    for k in range(3):  # the function measures what the simulation measured
        assert cv.newton_decrement(eps[k], info, sigma_g)[cv.JOINT]["value"] == pytest.approx(sims[k], rel=1e-10)
    # a gradient 2 standard errors from the optimum is seen through noise of mean ~1 standard error^2 or less
    u = rng.normal(size=d)
    g = info @ (2.0 * u / np.sqrt(u @ info @ u))
    shifted = np.einsum("nd,nd->n", g + eps, np.linalg.solve(info, (g + eps).T).T)
    assert abs(shifted.mean() - (4.0 + ref["noise_mean"])) < 4 * shifted.std() / np.sqrt(n)


def test_trend_change_of_a_line_is_exact():
    t = np.arange(200.0)
    change, se = cv.trend_change(3.0 + 0.01 * t)
    assert change[0] == pytest.approx(0.01 * 200, rel=1e-12) and se[0] == pytest.approx(0.0, abs=1e-12)


def _ar1(rng, n, phi, sd=1.0, size=()):
    """Stationary AR(1) series x_t = phi x_{t-1} + sd e_t (last axis: time)."""
    from scipy.signal import lfilter

    e = sd * rng.normal(size=(*size, n))
    e[..., 0] /= np.sqrt(1 - phi**2)  # start in the stationary law
    return lfilter([1.0], [1.0, -phi], e, axis=-1)


def test_trace_check_separates_drift_from_noise_and_from_settled_runs():
    rng = np.random.default_rng(2)
    # stationary AR(1) noise around 5 (autocorrelation time 3 rounds, batches of 40): converged. With the
    # Bonferroni level 1e-3 the expected number of false alarms in 200 runs is 0.2; more than 3 has
    # probability 6e-5 (Poisson)
    alarms = sum(not cv.trace_check(5.0 + 0.05 * _ar1(rng, 400, 0.5))["ok"] for _ in range(200))
    assert alarms <= 3
    # the same noise on a drift of 0.5 over the window: the trend is 10 times its noise allowance
    drift = 5.0 + 0.5 * np.arange(400) / 400 + 0.05 * _ar1(rng, 400, 0.5)
    r = cv.trace_check(drift)
    assert not r["ok"] and r["value"] == pytest.approx(0.5 / 5.25, rel=0.1)
    # deterministic: a fast geometric approach that has settled (change 1e-17) passes, a slow one fails
    t = np.arange(300, 400)
    assert cv.trace_check(1.0 + 0.5 * 0.9**t)["ok"]
    slow = cv.trace_check(1.0 + 0.5 * 0.999**t)
    assert not slow["ok"] and slow["threshold"] == cv.TRACE_TOL_REL
    # in standard errors: a change of 0.05 SE passes, 0.3 SE fails
    line = np.arange(100) / 100
    assert cv.trace_check(2.0 + 0.05 * line, se=[1.0])["ok"]
    assert not cv.trace_check(2.0 + 0.3 * line, se=[1.0])["ok"]


def _trace_result(traces, standard_errors=None):
    """A result with only what the trace rows read: the history, the sites' bijections to R^n and the
    standard errors."""
    from types import SimpleNamespace

    from numpyro.distributions import constraints
    from numpyro.distributions.transforms import biject_to

    from fedbayes.introspect import Site

    support = {"sigma": constraints.positive, "mu": constraints.real}
    sites = {n: Site(n, "global", np.shape(t)[1:], biject_to(support[n])) for n, t in traces.items()}
    return SimpleNamespace(history={f"theta/{n}": t for n, t in traces.items()}, _fm=SimpleNamespace(sites=sites),
                           standard_errors=standard_errors)


def test_trace_checks_a_scale_in_its_unconstrained_coordinates_and_calls_a_runaway_one():
    rng = np.random.default_rng(4)
    t = np.arange(300)
    # a population scale growing geometrically (doubling every 20 rounds, 5% noise; FedSOUL's learned
    # sigma on nearly separable image classes with mixing heads grew from 1 to 4e6 in 300 rounds) beside
    # 1000 settled coordinates (a network's weights)
    runaway = np.exp(np.log(2) / 20 * t + 0.05 * rng.normal(size=300))
    weights = 1.0 + 0.01 * _ar1(rng, 300, 0.5, size=(1000,)).T
    # in its own units the window's batch means curve away from a line (a factor 13.5 over it), and with
    # 1001 coordinates' Bonferroni quantile the curvature's misfit passes for noise: the old check let it through
    own = cv.trace_check(runaway[-75:], first=runaway[0], num_coords=1001)
    assert own["ok"]
    rows = {r["site"]: r for r in cv._trace_rows(_trace_result({"sigma": runaway, "mu": weights}), False)}
    assert not rows["sigma"]["ok"] and "unconstrained" in rows["sigma"]["note"]
    assert "running away" in rows["sigma"]["note"] and "more rounds will not help" in rows["sigma"]["note"]
    # in log units the growth over the 75-round window is a line of 75 log(2) / 20 = 2.599; the noise's share
    # (5% per round, a trend fitted to 10 batch means of 7.5 rounds) has a standard error of about 0.01
    import re

    moved = float(re.search(r"worst coordinate 0: ([0-9.]+)", rows["sigma"]["note"]).group(1))
    assert moved == pytest.approx(75 * np.log(2) / 20, abs=0.05) and rows["mu"]["ok"]
    # a variance collapsing to its boundary 0 (a singular fit: sigma = e^(-t / 20), 1e-5 of its travel left at the
    # window): settled in its own units, so not judged again in log units, where it still moves by 3.75
    collapse = np.exp(-t / 20.0)
    rows = {r["site"]: r for r in cv._trace_rows(_trace_result({"sigma": collapse, "mu": weights}), False)}
    assert rows["sigma"]["ok"] and "unconstrained" not in rows["sigma"]["note"]
    # the same collapse still under way (e^(-t / 200): 22% of its travel over the window) fails in its own units
    slow = cv._trace_rows(_trace_result({"sigma": np.exp(-t / 200.0), "mu": weights}), False)
    assert not {r["site"]: r for r in slow}["sigma"]["ok"]
    # a settled scale (AR(1) noise of 1% around 2) passes both ways: over 200 runs at the Bonferroni level
    # 1e-3 (for all coordinates, the scale's two parametrisations included) the expected number of false
    # alarms is at most 0.2 (<= 3: probability 6e-5)
    alarms = 0
    for _ in range(200):
        settled = 2.0 * np.exp(0.01 * _ar1(rng, 300, 0.5))
        rows = cv._trace_rows(_trace_result({"sigma": settled, "mu": 1.0 + 0.01 * _ar1(rng, 300, 0.5, size=(3,)).T}),
                              False)
        alarms += not all(r["ok"] for r in rows)
    assert alarms <= 3
    # with standard errors both parametrisations are judged in them (log sigma's by the delta method, se / sigma):
    # a drift of 0.05 se over the window (the last 25 of 100 rounds) passes both ways, 0.5 se fails both ways
    line = np.arange(100) / 100
    for drift, ok in ((0.05, True), (0.5, False)):
        sigma = 2.0 + 4 * drift * 0.2 * line
        rows = cv._trace_rows(_trace_result({"sigma": sigma}, {"sigma": np.array(0.2)}), False)
        # log sigma's change over the window in se / sigma, at the window's mean sigma: the same to first order
        assert rows[0]["ok"] is ok and rows[0]["value"] == pytest.approx(drift, rel=0.05)
        assert cv.trace_check(sigma[-25:], se=[0.2])["value"] == pytest.approx(drift, rel=1e-9)


def test_statistic_check_extrapolates_a_geometric_em_mean_field():
    t = np.arange(100)
    rho, r0, norm = 0.95, 1e-1, 4.0
    r = cv.statistic_check(norm * r0 * rho**t, norm, gamma=0.5)
    # |S_T - S*| = gamma sum_{k>=1} |h_{T+k}| = gamma r_T rho / (1 - rho) for an exactly geometric field
    assert r["value"] == pytest.approx(0.5 * r0 * rho**99 * rho / (1 - rho), rel=1e-8) and not r["ok"]
    assert cv.statistic_check(norm * r0 * 0.5**t[:40], norm)["ok"]  # fast: settled
    noisy = np.abs(1e-2 * (1 + 0.2 * np.random.default_rng(3).normal(size=100)))  # a flat noise floor
    r = cv.statistic_check(noisy, 1.0)
    assert r["ok"] and "noise floor" in r["note"]


def test_rhat_and_ess_through_the_arviz_adapter_match_closed_forms():
    """ESS of AR(1) chains is N (1 - phi) / (1 + phi); the estimate's relative error at 4 x 5000 draws is
    about 3% (its batch-means variance), asserted at 12%. Shifted chains raise R-hat above 1.01."""
    rng = np.random.default_rng(4)
    iid = rng.normal(size=(4, 5000))
    ar = _ar1(rng, 5000, 0.8, size=(4,))
    shifted = rng.normal(size=(4, 5000)) + np.array([0.0, 0.0, 0.0, 1.0])[:, None]
    st = cv._chain_stats({"iid": iid, "ar": ar, "shifted": shifted})
    assert st["iid"]["ess_bulk"] == pytest.approx(20000, rel=0.12) and st["iid"]["rhat"] < 1.005
    assert st["ar"]["ess_bulk"] == pytest.approx(20000 * 0.2 / 1.8, rel=0.12)
    assert st["shifted"]["rhat"] > 1.05
    one = cv._chain_stats({"x": ar[:1]})["x"]  # one chain: split in halves
    assert np.isfinite(one["rhat"]) and one["ess_bulk"] == pytest.approx(5000 * 0.2 / 1.8, rel=0.35)


# ------------------------------------------------------------------------------ fits, both directions

D = 3


def linear_model(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 100.0).expand([D]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


def _linear_data():
    """Four clients; features with scales 1, 3 and 0.3 (curvature condition number ~100) and weights far
    from the start (0): gradient descent at step 1 / L needs hundreds of rounds."""
    rng = np.random.default_rng(5)
    xs = [rng.normal(size=(30, D)) * np.array([1.0, 3.0, 0.3]) for _ in range(4)]
    w = np.array([20.0, -10.0, 5.0])
    ys = [x @ w + rng.normal(size=30) for x in xs]
    data = fb.FederatedData({"x": xs, "y": ys})
    X, Y = np.concatenate(xs), np.concatenate(ys)
    precision = X.T @ X + np.eye(D) / 100.0**2  # the posterior's (the information at every point)
    return data, np.linalg.solve(precision, X.T @ Y), precision


def _fit_warnings(*args, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = fb.fed_fit(*args, **kwargs)
    return res, [w for w in caught if issubclass(w.category, fb.ConvergenceWarning)]


def _fit_silently(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", fb.ConvergenceWarning)
        return fb.fed_fit(*args, **kwargs)


def _check_warnings(res, caught):
    """One warning per failed check, naming the criterion, the values against thresholds and a fix,
    pointing at the caller's line; and the table agrees."""
    assert not res.converged
    table = res.diagnostics
    assert list(table.columns) == cv.COLUMNS
    failed = set(table.loc[~table["ok"], "check"])
    assert len(caught) == len(failed) >= 1
    for w in caught:
        text = str(w.message)
        assert "has not converged by" in text and "Fix:" in text and "res.diagnostics" in text
        assert w.filename == __file__
    return [str(w.message) for w in caught]


def test_gradient_descent_under_run_warns_and_converged_does_not():
    data, w_map, precision = _linear_data()
    sd = np.sqrt(np.diag(np.linalg.inv(precision)))
    # precondition=False: preconditioned GD (the default) is Newton-like on this quadratic and has converged
    # within 50 rounds; the warning is tested on plain gradient descent, which is really under-run here
    res, caught = _fit_warnings(linear_model, data, fb.GD(precondition=False), num_rounds=50, seed=0, chunk_size=50)
    texts = _check_warnings(res, caught)
    assert any("num_rounds" in t for t in texts)
    table = res.diagnostics.set_index(["check", "site"])
    if ("newton_decrement", cv.JOINT) in table.index:  # where GD reports its gradient and information:
        # the log posterior is quadratic, so the Newton step lands on the MAP and the decrement is exactly
        # the squared Mahalanobis distance (w - w_map)' P (w - w_map)
        delta = res.params["w"] - w_map
        assert table.loc[("newton_decrement", cv.JOINT), "value"] == pytest.approx(delta @ precision @ delta, rel=1e-8)
    assert np.max(np.abs(res.params["w"] - w_map) / sd) > 1.0  # it really is far from the MAP
    res = _fit_silently(linear_model, data, fb.GD(precondition=False), num_rounds=3000, seed=0,
                        chunk_size=50)  # one compilation
    assert res.converged and res.diagnostics["ok"].all()
    # and it really is at the MAP: within 0.01 posterior sd (the checks' tolerance is 0.1)
    np.testing.assert_array_less(np.abs(res.params["w"] - w_map), 0.01 * sd)


PRIOR_SD = 10.0


def gauss_model(m, prec):
    x = numpyro.sample("x", dist.Normal(0.0, PRIOR_SD).expand([2]).to_event(1))
    with numpyro.plate("obs", m.shape[0]):
        numpyro.sample("y", dist.MultivariateNormal(x, precision_matrix=prec), obs=m)


def _gauss_data():
    rng = np.random.default_rng(6)
    precs = [np.diag(rng.uniform(0.8, 1.2, 2)) for _ in range(4)]
    ms = [rng.normal(3.0, 1.0, 2) for _ in range(4)]
    data = fb.FederatedData({"m": [m[None] for m in ms], "prec": [a[None] for a in precs]})
    return data, sum(precs) + np.eye(2) / PRIOR_SD**2


def test_sampler_under_run_warns():
    data, P = _gauss_data()
    res, caught = _fit_warnings(gauss_model, data, fb.LMC(), num_rounds=40, seed=0)
    texts = _check_warnings(res, caught)
    assert any(t.startswith("LMC has not converged by split R-hat") and "> 1.01" in t for t in texts)
    assert any("effective sample size" in t and "< 400" in t for t in texts)  # 100 per chain, 4 chains


@pytest.mark.slow
def test_sampler_converged_does_not_warn():
    data, P = _gauss_data()
    # a well-conditioned Gaussian posterior (kappa ~ 1.5, P diagonal) at step 0.15 / lambda_max. ULA's
    # stationary variance in an eigendirection is 1 / (lambda (1 - h lambda / 2)), so its widest sd is
    # 1 / sqrt(1 - 0.075) = 1.040 of the posterior's: inside the 5% the sd_inflation check accepts (at
    # 0.5 / lambda_max it is 1.155, and the fit rightly warns). The slowest direction's AR(1) coefficient is
    # 1 - h lambda_min ~ 0.9, an autocorrelation time of about 2 / 0.1 = 20 rounds, so 4 chains x 4000
    # draws give a bulk ESS near 800, twice the 400 the check asks for.
    lam = np.linalg.eigvalsh(P)
    step = 0.15 / lam.max()
    res = _fit_silently(gauss_model, data, fb.LMC(step_size=step, warmup=200), num_rounds=4200, seed=0,
                        chunk_size=600)
    table = res.diagnostics
    assert res.converged and set(table["check"]) == {"rhat", "ess_bulk", "ess_tail", "sd_inflation"}
    assert (table.loc[table.check == "ess_bulk", "threshold"] == 400).all()
    # the reported inflation is ULA's closed form on this Gaussian (P is diagonal: coordinates = eigenvectors)
    inflation = table.loc[table.check == "sd_inflation", "value"].item()
    assert inflation == pytest.approx(1.0 / np.sqrt(1.0 - step * lam.max() / 2.0), rel=1e-6)


def test_local_rhat_limit_lets_well_mixed_clients_pass_and_catches_a_stuck_chain():
    """100 clients, 2 AR(1) chains each (phi = 0.6, 1000 draws, ESS ~ 250 per chain): at the fixed
    R-hat 1.01 some client fails by chance; at the ESS-aware limit none may (the Bonferroni level makes a
    false alarm in the whole set a 1e-3 event). A client whose second chain sits 0.5 sd away fails."""
    rng = np.random.default_rng(7)
    C = 100
    chains = _ar1(rng, 1000, 0.6, 0.8, size=(C, 2))  # (client, chain, draw)
    def rhat_and_limit(c):
        draws = {"z": np.moveaxis(c, 0, 2)}
        st = cv._chain_stats(draws)["z"]
        within = cv._chain_stats(cv._per_chain(draws))["z"]["ess_bulk"].sum(1)
        # each chain's own ESS is 1000 (1 - phi) / (1 + phi) = 250, so 500 a client (the median of 100
        # estimates has a relative sd of ~1.5%)
        assert np.median(within) == pytest.approx(500, rel=0.1)
        return st["rhat"], cv.local_rhat_limit(within, 4, C)

    rhat, limit = rhat_and_limit(chains)
    assert np.any(rhat > cv.RHAT_MAX) and np.all(rhat <= limit)
    stuck = chains.copy()
    stuck[3, 1] += 0.5
    rhat, limit = rhat_and_limit(stuck)
    assert rhat[3] > limit[3] and np.sum(rhat > limit) == 1


def hierarchical_model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    tau = numpyro.sample("tau", dist.HalfNormal(5.0))
    with fb.local():
        b = numpyro.sample("b", dist.Normal(mu, tau))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(b, 1.0), obs=y)


def _hierarchical_data():
    rng = np.random.default_rng(8)
    return fb.FederatedData({"y": [b + rng.normal(size=20) for b in 2.0 + rng.normal(size=10)]})


@pytest.mark.slow
def test_fedsoul_under_run_warns():
    res, caught = _fit_warnings(hierarchical_model, _hierarchical_data(), fb.FedSOUL(init={"mu": 40.0}),
                                num_rounds=25, seed=0, chunk_size=25)
    # at a point this far from the optimum Louis' information may also be indefinite, which FedSOUL warns about
    # on its own (not a row of the diagnostics table; the table's Newton-decrement row then says the same)
    caught = [w for w in caught if "Louis' observed information at the estimate" not in str(w.message)]
    texts = _check_warnings(res, caught)
    point = [t for t in texts if "Newton decrement" in t or "drift of the estimate" in t or "number of rounds" in t]
    assert point
    if res.standard_errors:  # standard errors at a non-converged point say so
        assert all("standard errors" in t and "not reliable" in t for t in point)


@pytest.mark.slow
def test_fedsoul_converged_does_not_warn():
    res = _fit_silently(hierarchical_model, _hierarchical_data(), fb.FedSOUL(num_samples=1000), num_rounds=600,
                        seed=0, chunk_size=50)
    assert res.converged and "local_rhat" in set(res.diagnostics["check"])


def _gmm():
    data, _ = fb.models.make_gaussian_mixture(6, num_components=3, dim=2, sizes=(30, 90), concentration=0.3, seed=3)
    y = np.asarray(data.pooled()["y"])
    init = {"weights": np.ones(3) / 3, "means": y[[0, 100, 200]], "covs": np.broadcast_to(np.eye(2), (3, 2, 2)).copy()}
    return data, init, fb.models.gaussian_mixture(3, 2)


@pytest.mark.slow
def test_fedmm_under_run_warns():
    data, init, model = _gmm()
    res, caught = _fit_warnings(model, data, fb.FedMM(init=init), num_rounds=8, seed=0, chunk_size=8)
    texts = _check_warnings(res, caught)
    assert all("FedMM has not converged" in t and "EM converges linearly" in t for t in texts)
    assert any("standard errors" in t and "not reliable" in t for t in texts)


@pytest.mark.slow
def test_fedmm_converged_does_not_warn():
    """Centralised EM (gamma = 1, full participation): 150 rounds reach sklearn's fixed point to 1e-6
    (tests/test_fedmm.py); every check agrees."""
    data, init, model = _gmm()
    res = _fit_silently(model, data, fb.FedMM(init=init), num_rounds=150, seed=0)
    assert res.converged and "statistic_change" in set(res.diagnostics["check"])


@pytest.mark.slow
def test_resumed_fit_is_checked_like_the_uninterrupted_one(tmp_path):
    data, _, _ = _linear_data()
    path = tmp_path / "fit.ckpt"
    res, caught = _fit_warnings(linear_model, data, fb.GD(precondition=False), num_rounds=60, seed=0, chunk_size=30,
                                checkpoint=path)  # the model is a top-level function: the checkpoint names it
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        resumed = fb.resume(path)  # continues from round 30 to 60: the same result, the same checks
    again = [w for w in again if issubclass(w.category, fb.ConvergenceWarning)]
    assert [str(w.message) for w in again] == [str(w.message) for w in caught] != []
    assert all(w.filename == __file__ for w in again)
    assert resumed.diagnostics.equals(res.diagnostics) and not resumed.converged


def test_local_rhat_in_blocks_of_clients_is_the_local_rhat_of_all_at_once(monkeypatch):
    """The clients' local R-hat check runs a block of clients at a time (to bound its memory): its row (the
    worst client, its R-hat, its threshold, how many clients fail) does not depend on the block size."""
    data, _, _ = fb.models.make_fedpop_synthetic(13, test_size=1, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res = fb.fed_fit(fb.models.fedpop_synthetic, data, fb.FedSOUL(local_steps=5, num_samples=40, warmup=20),
                         num_rounds=30, progress=False)
    whole = cv._local_rows(res)
    monkeypatch.setattr(cv, "LOCAL_BLOCK", 4)  # 13 clients: blocks of 4, 4, 4 and 1
    blocks = cv._local_rows(res)
    assert len(whole) == len(blocks) == 1
    assert whole[0] == blocks[0]


def test_a_private_fit_drowned_in_its_noise_reports_not_converged_and_says_why():
    """Issue 53, item 8: GD with noise_multiplier 1e6 on 20 clients of a 3-coefficient regression ended 1e5-1e6
    from the optimum, and with noise seeds 0 and 1 reported converged (a random walk passes the trace check as
    noise). The privacy row compares the noise on the cohort's mean update, averaged over the window
    (z sqrt(d) / (m sqrt(W)) = 1e6 sqrt(3) / (20 sqrt(125)) = 7 746 clips), with the clipped signal (at most
    one clip); at z = 1 it is 0.0077 and the fit converges."""
    data, _ = fb.models.make_glm_clients(20, 3, 30, family="linear", seed=0)
    model = fb.models.linear_regression()
    for seed in (0, 1):
        algo = fb.GD(step_size=0.01, privacy=fb.privacy.DP(clip=1.0, noise_multiplier=1e6, noise_seed=seed))
        with pytest.warns(fb.ConvergenceWarning, match="privacy noise against the clipped signal.*clients_per_round"):
            res = fb.fed_fit(model, data, algo, num_rounds=500, progress=False)
        row = res.diagnostics.set_index("check").loc["privacy_noise"]
        assert not res.converged and row["value"] == pytest.approx(1e6 * np.sqrt(3) / (20 * np.sqrt(125)))
    calm = fb.fed_fit(model, data, fb.GD(step_size=0.01, privacy=fb.privacy.DP(clip=1.0, noise_multiplier=1.0)),
                      num_rounds=500, progress=False)
    assert calm.converged and calm.diagnostics.set_index("check").loc["privacy_noise", "value"] < 0.01
