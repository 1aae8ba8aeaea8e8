"""Result and ArviZ data on the installed ArviZ line (0.x InferenceData or 1.x DataTree)."""

import warnings

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedbayes as fb
from fedbayes.arviz_adapter import group_names
from fedbayes.result import ARVIZ_1, group

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import arviz as az


@pytest.fixture(scope="module")
def res():
    train, _, _ = fb.models.make_fedpop_synthetic(12, seed=5)
    return fb.fed_fit(fb.models.fedpop_synthetic, train, fb.FedSOUL(local_steps=3, num_samples=60, warmup=20),
                      num_rounds=40, clients_per_round=6, seed=3)


def test_idata_has_local_sites_with_a_client_dim(res):
    post = group(res.idata, "posterior")
    assert post["z"].dims == ("chain", "draw", "client", "z_dim_0")
    assert post["z"].shape == (2, 60, 12, 2)  # default 2 chains per client
    pooled = post["z"].values.transpose(2, 0, 1, 3).reshape(12, 120, 2)
    np.testing.assert_array_equal(pooled, res.local_samples["z"])
    assert post.attrs["inference_library"] == "fedbayes"


def test_idata_holds_estimates_history_and_ledger(res):
    params = group(res.idata, "fed_params")
    np.testing.assert_array_equal(params["phi"].values, res.params["phi"])
    hist = group(res.idata, "fed_history")
    assert hist["theta_phi"].dims[0] == "round" and hist.sizes["round"] == 40
    np.testing.assert_array_equal(hist["bits_up"].values, res.history["bits_up"])
    # FedSOUL's final exchange: theta_bar (phi 20x2, mu 2, sigma 1: d = 43) to all 12 clients; each sends
    # back its Louis terms (the mean score, d floats, and two upper triangles of d(d+1)/2 floats)
    d = 43
    final_up = 12 * 32 * (d + d * (d + 1))
    assert (hist.attrs["final_bits_up"], hist.attrs["final_bits_down"]) == res.final_bits == (final_up, 12 * 32 * d)
    assert hist.attrs["bits_up_total"] == res.bits_up == int(res.history["bits_up"].sum()) + final_up
    assert hist.attrs["bits_down_total"] == res.bits_down == (int(res.history["bits_down"].sum()) + res.init_bits[1]
                                                               + res.final_bits[1])
    clients = group(res.idata, "fed_clients")
    np.testing.assert_array_equal(clients["num_observations"].values, [5] * 11 + [10])  # 90% small clients
    assert np.all(clients["step_size"].values > 0)


def test_arviz_summary_and_diagnostics_work(res):
    summary = az.summary(res.idata, var_names=["z"])
    assert len(summary) == 12 * 2
    mean_col = [c for c in summary.columns if c == "mean"][0]
    np.testing.assert_allclose(summary[mean_col].to_numpy(dtype=float),
                               res.local_samples["z"].mean(1).reshape(-1), atol=0.01)  # summary rounds
    ess = az.ess(res.idata, var_names=["z"])
    ess = ess.to_dataset() if hasattr(ess, "to_dataset") and not hasattr(ess, "data_vars") else ess
    assert np.all(np.asarray(ess["z"]) > 1)
    rhat = az.rhat(res.idata, var_names=["z"])
    assert np.all(np.isfinite(np.asarray(rhat["z"])))  # two chains per client: R-hat is defined


def test_numpyro_ula_run_converts_with_from_numpyro():
    def model():
        numpyro.sample("x", dist.Normal(0.0, 1.0))

    mcmc = numpyro.infer.MCMC(fb.ULA(model, step_size=0.1), num_warmup=50, num_samples=200, num_chains=2,
                              chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0))
    idata = az.from_numpyro(mcmc)
    post = group(idata, "posterior")
    assert post["x"].shape == (2, 200)
    np.testing.assert_array_equal(post["x"].values.reshape(-1), np.asarray(mcmc.get_samples()["x"]))


def test_adapter_reports_its_line():
    assert ARVIZ_1 == (int(az.__version__.split(".")[0]) >= 1)


def test_sampler_idata_has_global_draws_and_ledger_per_draw():
    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        with numpyro.plate("obs", x.shape[0]):
            numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)

    rng = np.random.default_rng(0)
    data = fb.FederatedData({"x": [rng.normal(size=(8, 2)) for _ in range(3)], "y": [rng.normal(size=8) for _ in range(3)]})
    res = fb.fed_fit(model, data, fb.DELF(uplink=fb.compress.top_k(1), num_chains=2, warmup=10, thinning=3),
                     num_rounds=40, seed=0)
    post = group(res.idata, "posterior")
    assert post["w"].dims == ("chain", "draw", "w_dim_0") and post["w"].shape == (2, 10, 2)
    stats = group(res.idata, "sample_stats")
    # the ledger of the round each draw comes from, split over the chains
    np.testing.assert_array_equal(stats["bits_up"].values[0], res.history["bits_up"][10::3] / 2)
    assert np.all(np.isfinite(np.asarray(az.rhat(res.idata, var_names=["w"])["w"])))


# ------------------------------------------------------------------ model-checking groups and plots


def test_extend_idata_adds_exact_log_likelihood_predictive_and_observed_groups(res):
    from scipy.stats import norm

    train, _, _ = fb.models.make_fedpop_synthetic(12, seed=5)
    idata = res.extend_idata(seed=1)
    ll, pp, obs = (group(idata, g) for g in ("log_likelihood", "posterior_predictive", "observed_data"))
    assert ll["y"].dims == ("chain", "draw", "obs") and ll["y"].shape == (2, 60, train.total_size)
    np.testing.assert_array_equal(ll["client"].values, train.pooled_client_ids())
    np.testing.assert_allclose(obs["y"].values, train.pooled()["y"], rtol=1e-6)
    # log N(y | x' phi z, 0.1^2) at every client's own draws (client-major, real rows only)
    x, ids = train.pooled()["x"], train.pooled_client_ids()
    mean = np.einsum("nk,kd,nsd->sn", x, res.params["phi"], res.local_samples["z"][ids])  # (chain*draw, obs)
    exact = norm.logpdf(train.pooled()["y"], mean, 0.1).reshape(2, 60, -1)
    np.testing.assert_allclose(ll["y"].values, exact, atol=1e-3)  # float32 model evaluation
    # replicates: y_rep = x' phi z + 0.1 eps, so standardised residuals are N(0, 1) over 7800 values
    resid = (pp["y"].values - mean.reshape(2, 60, -1)) / 0.1
    assert abs(resid.mean()) < 4 / np.sqrt(resid.size) and abs(resid.std() - 1) < 0.05
    loo = fb.diagnostics.loo_per_client(res)
    assert list(loo.index) == list(range(12)) and list(loo["n"]) == list(train.sizes)
    assert np.all(np.isfinite(loo["elpd_loo"]))


def test_arviz_pit_plot_renders_headless(res, tmp_path):
    res.extend_idata()
    path = tmp_path / "pit.png"
    fb.diagnostics.plot_arviz_pit(res, path=path)
    assert path.stat().st_size > 1000


@pytest.fixture(scope="module")
def logistic():
    data, _ = fb.models.make_glm_clients(3, 2, 40, seed=1)
    model = fb.models.logistic_regression(prior_scale=2.0)
    return data, fb.fed_fit(model, data, fb.LMC(num_chains=2, warmup=50, thinning=2), num_rounds=250, seed=0)


def test_predictive_probs_are_the_model_probabilities_at_each_draw(logistic):
    data, fit = logistic
    x = data.client(0)["x"][:7]
    probs = fit.predictive_probs({"x": x}, num_samples=30, seed=2)
    draws = fit.global_samples["w"].reshape(-1, 2)[np.random.default_rng(2).choice(200, 30)]
    p1 = 1 / (1 + np.exp(-(draws @ x.T)))
    np.testing.assert_allclose(probs, np.stack([1 - p1, p1], -1), atol=1e-5)


def test_arviz_pava_plot_renders_headless(logistic, tmp_path):
    _, fit = logistic
    fit.extend_idata()
    path = tmp_path / "pava.png"
    fb.diagnostics.plot_arviz_pava(fit, data_type="binary", path=path)
    assert path.stat().st_size > 1000


def test_client_novelty_flags_a_client_far_from_the_population(res):
    rng = np.random.default_rng(9)
    phi = res.params["phi"]
    x = rng.normal(size=(10, phi.shape[0]))
    mu, sigma = res.params["mu"], float(res.params["sigma"])
    typical = {"x": x, "y": x @ phi @ mu + 0.1 * rng.normal(size=10)}
    far = {"x": x, "y": x @ phi @ (mu + 8 * sigma) + 0.1 * rng.normal(size=10)}
    a = fb.diagnostics.client_novelty(res, typical, num_samples=200, warmup=200)
    b = fb.diagnostics.client_novelty(res, far, num_samples=200, warmup=200)
    assert len(a["training_scores"]) == 12
    # the local posterior of a 10-point client sits near its data's z: 8 prior sds is beyond every training client
    assert b["p_value"] == 0.0 and b["score"] > 4 * a["score"]
    assert a["p_value"] > 0.2


def test_settings_hold_the_options_and_the_resolved_hyper_parameters():
    """res.settings: every algorithm's scalar options, overridden by what the fit resolved. For
    w ~ N(0, 1), y ~ N(w x, 1) the potential's curvature is 1 + sum x^2 everywhere, so the samplers'
    automatic step 0.1 / lambda_max is known exactly."""
    rng = np.random.default_rng(0)
    x = [rng.normal(size=8) for _ in range(3)]
    data = fb.FederatedData({"x": x, "y": [xi + rng.normal(size=8) for xi in x]})

    def model(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0))
        with numpyro.plate("obs", x.shape[0]):
            numpyro.sample("y", dist.Normal(w * x, 1.0), obs=y)

    # init="prior": the unpreconditioned automatic step 0.1 / lambda_max at the start (the default start at
    # the mode preconditions the step, which is then 0.1 in the whitened metric); warm-up: half the rounds
    lmc = fb.fed_fit(model, data, fb.LMC(num_chains=2, init="prior"), num_rounds=20, progress=False).settings
    np.testing.assert_allclose(lmc["step_size"], 0.1 / (1.0 + sum(xi @ xi for xi in x)), rtol=1e-10)
    assert lmc["num_chains"] == 2 and lmc["warmup"] == 10 and not lmc["preconditioned"]
    tam = fb.fed_fit(model, data, fb.TAMUNA(s=2), num_rounds=20, progress=False).settings
    assert tam["s"] == 2 and tam["c"] == 3 and 0 < tam["p"] <= 1 and tam["gamma"] > 0
    em = fb.fed_fit(model, data, fb.FedMM(uncertainty=False), num_rounds=5, progress=False).settings
    assert em["step_size"] == 1.0 and em["uncertainty"] is False


# ------------------------------------------------------------------ what ArviZ reads as a posterior


def _groups(idata) -> set[str]:
    return set(group_names(idata))


def test_posterior_holds_draws_only_and_the_normal_approximation_has_its_own_group(res):
    """FedSOUL: the locals' draws in `posterior`, the globals' normal approximation (if Louis' information is
    positive definite) in `fed_normal_approx`, never beside the draws; log_likelihood is there by default."""
    post = group(res.idata, "posterior")
    assert set(post.data_vars) == {"z"}
    assert "log_likelihood" in _groups(res.idata)
    if res.global_approx:
        approx = group(res.idata, "fed_normal_approx")
        assert set(approx.data_vars) == set(res.global_approx)
        np.testing.assert_array_equal(approx["phi"].values, res.global_approx["phi"])


def test_arviz_round_trip_of_a_sampler_summary_trace_loo_and_compare(logistic, tmp_path):
    """az.summary's mean and sd are print(res)'s estimate and sd (the same draws); az.plot_trace shows the
    sampled site alone; az.loo and az.compare work without extend_idata."""
    import matplotlib

    matplotlib.use("Agg")
    data, fit = logistic
    table, mine = az.summary(fit.idata, var_names=["w"], round_to="none"), fit.summary()
    np.testing.assert_allclose(table["mean"].to_numpy(float), mine["estimate"].to_numpy(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(table["sd"].to_numpy(float), mine["sd"].to_numpy(), rtol=1e-5)
    shown = az.plot_trace(fit.idata)  # the posterior group only: the draws of w, no estimate drawn as a chain
    if not ARVIZ_1:  # 0.x returns the axes (1.x a PlotCollection): one row for the one site
        assert np.asarray(shown).shape == (1, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pareto k notes of a small fit
        loo = az.loo(fit.idata)
        ranked = az.compare({"lmc": fit.idata, "again": fit.idata})
    assert np.isfinite(float(getattr(loo, "elpd", None) if ARVIZ_1 else loo["elpd_loo"]))
    assert len(ranked) == 2


def test_a_point_estimate_cannot_be_compared_as_a_posterior(logistic):
    """GD's and FedRep's idata have no posterior and no log_likelihood: az.compare refuses them, and
    extend_idata says why."""
    data, fit = logistic
    gd = fb.fed_fit(fb.models.logistic_regression(prior_scale=2.0), data, fb.GD(), num_rounds=200, seed=0,
                    progress=False)
    assert not {"posterior", "log_likelihood"} & _groups(gd.idata)
    with pytest.raises(fb.FedbayesError, match="point estimate"):
        gd.extend_idata()
    with pytest.raises(Exception):  # ArviZ's own error: no ELPD for a model without a log-likelihood
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            az.compare({"lmc": fit.idata, "gd": gd.idata})


def test_baselines_keep_fitted_points_apart_from_posteriors_and_run_no_chain_check():
    train, _, _ = fb.models.make_fedpop_synthetic(8, seed=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fb.ConvergenceWarning)
        rep = fb.fed_fit(fb.models.fedpop_synthetic, train, fb.LocalOnly(local_steps=3), num_rounds=30, seed=0,
                         progress=False)
    assert rep.local_point and "posterior" not in _groups(rep.idata)
    points = group(rep.idata, "fed_client_params")
    np.testing.assert_array_equal(points["z"].values, rep.local_samples["z"][:, 0])
    assert "local_rhat" not in set(rep.diagnostics["check"])  # no R-hat of a repeated point, no FedSOUL hint
    with pytest.raises(fb.FedbayesError, match="one point per client"):
        rep.extend_idata()


def _logistic_intercepts(x, y=None):
    """y ~ Bernoulli(sigmoid(beta x + b_i)), b_i ~ N(0, tau^2) per client, the logit recorded."""
    beta = numpyro.param("beta", 0.0)
    tau = numpyro.param("tau", 1.0, constraint=dist.constraints.positive)
    with fb.local():
        b = numpyro.sample("b", dist.Normal(0.0, tau))
    logit = numpyro.deterministic("logit", beta * x + b)
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=logit), obs=y)


@pytest.mark.slow  # 12-25 s: a fit, a new client's chains and two prediction programs
def test_a_new_client_predicts_from_its_own_draws():
    """``local_samples=``: a new client's draws (``res.sample_client``) are what ``predict`` and ``predictive_probs``
    average over, exactly (the logit is beta* x + b_s for each draw s); fitted clients and wrong sites are refused."""
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=20) for _ in range(6)]
    data = fb.FederatedData({"x": xs, "y": [(rng.random(20) < 0.5).astype(np.int32) for _ in xs]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fb.ConvergenceWarning)
        res = fb.fed_fit(_logistic_intercepts, data, fb.FedSOUL(num_samples=10, warmup=10), num_rounds=10,
                         seed=0, progress=False)
    new_x = rng.normal(size=8)
    draws = res.sample_client({"x": new_x, "y": (new_x > 0).astype(np.int32)}, num_samples=12, warmup=20)
    assert draws["b"].shape == (2 * 12,)  # FedSOUL's two chains, 12 draws each
    beta = float(res.params["beta"])
    logit = beta * new_x[None] + draws["b"][:, None]
    out = res.predict({"x": new_x}, local_samples=draws)
    np.testing.assert_allclose(out["logit"], logit, rtol=1e-5, atol=1e-5)
    probs = res.predictive_probs({"x": new_x}, local_samples=draws)
    np.testing.assert_allclose(probs[..., 1], 1.0 / (1.0 + np.exp(-logit)), rtol=1e-5, atol=1e-6)
    with pytest.raises(fb.DataError, match="client=None"):
        res.predict({"x": new_x}, client=0, local_samples=draws)
    with pytest.raises(fb.DataError, match="local sites"):
        res.predict({"x": new_x}, local_samples={"z": draws["b"]})
