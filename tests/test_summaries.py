"""The daily loop's summaries of a fit: ``res.summary()``, ``print(res)``, the notebook's ``_repr_html_`` and
``fb.diagnostics.plot_fit`` (issue 27): their numbers are the fit's own (estimates, standard errors, draws,
history), checked here against those attributes."""

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest
from scipy import stats

import fedbayes as fb


@pytest.fixture(scope="module")
def em_fit():
    data, _ = fb.models.make_linear_mixed_effects(12, seed=0)
    return fb.fed_fit(fb.models.linear_mixed_effects, data, fb.FedMM(), num_rounds=60, seed=0, progress=False)


@pytest.fixture(scope="module")
def lmc_fit():
    data = fb.models.make_glm_clients(4, 2, 30, family="linear", seed=0)[0]
    return fb.fed_fit(fb.models.linear_regression(), data, fb.LMC(), num_rounds=400, seed=0, progress=False)


def test_summary_of_a_point_estimate_is_its_estimate_and_standard_errors(em_fit):
    res = em_fit
    table = res.summary(prob=0.9)
    z = stats.norm.ppf(0.95)
    for site, value in res.params.items():
        value, se = np.asarray(value), np.asarray(res.standard_errors[site])
        for idx in np.ndindex(value.shape):
            row = table.loc[site + ("[" + ", ".join(map(str, idx)) + "]" if idx else "")]
            assert row["estimate"] == value[idx] and row["sd"] == se[idx]
            np.testing.assert_allclose([row["lower"], row["upper"]], [value[idx] - z * se[idx], value[idx] + z * se[idx]])
    assert len(table) == sum(np.size(v) for v in res.params.values())


def test_summary_of_a_sampler_is_its_draws(lmc_fit):
    res = lmc_fit
    table = res.summary()
    (site,) = res.params  # the regression's weights, 2 of them
    rows = [f"{site}[0]", f"{site}[1]"]
    draws = np.asarray(res.global_samples[site]).reshape(-1, 2)
    np.testing.assert_array_equal(table.loc[rows, "estimate"], np.asarray(res.params[site]))
    np.testing.assert_allclose(table.loc[rows, "sd"], draws.std(0, ddof=1), rtol=1e-12)
    np.testing.assert_allclose(table.loc[rows, "lower"], np.quantile(draws, 0.025, 0), rtol=1e-12)
    np.testing.assert_allclose(table.loc[rows, "upper"], np.quantile(draws, 0.975, 0), rtol=1e-12)
    with pytest.raises(ValueError):
        res.summary(prob=1.0)


def test_text_and_html_summaries(lmc_fit):
    res = lmc_fit
    text, html = str(res), res._repr_html_()
    assert text.startswith("LMC fit: 400 rounds, 4 clients, seed 0")
    assert ("converged (every check passed)" in text) == res.converged
    assert "communication: up" in text and "posterior mean, sd and central 95% interval" in text
    first = res.summary().index[0]
    assert first in text and first in html and "<table" in html
    assert f"{res.summary().iloc[0]['estimate']:.4g}" in text
    assert repr(res).startswith("Result(LMC, 400 rounds")  # the one-line repr stays


def test_a_mixed_model_is_summarised_as_lme4_does(em_fit):
    """A model with a mixed layout: the fixed effects and the variance components (sds, correlation, residual
    sd) with their standard errors, in the text and the notebook summaries, instead of the raw sites."""
    res = em_fit
    text, html = str(res), res._repr_html_()
    assert "estimate and standard error (observed information" in text
    for table in (res.fixed_effects, res.variance_components):
        for value in table["estimate"].to_numpy()[:2]:
            assert f"{value:.4g}" in text and f"{value:.4g}" in html
    assert "Random effects" in text and "cor(z[0], z[1])" in text and "cor(z[0], z[1])" in html
    assert "scale_tril" not in text  # the Cholesky entries are in res.summary()


def test_an_unconverged_fit_says_so_in_both_summaries():
    data, _ = fb.models.make_linear_mixed_effects(12, seed=0)
    with pytest.warns(fb.ConvergenceWarning):
        res = fb.fed_fit(fb.models.linear_mixed_effects, data, fb.FedMM(), num_rounds=2, seed=0, progress=False)
    failed = res.diagnostics[~res.diagnostics["ok"]]
    assert len(failed)
    text, html = str(res), res._repr_html_()
    assert "NOT converged: " in text and "not converged" in html
    for r in failed.itertuples():
        assert f"{r.check} ({r.site})" in text and f"{r.check} ({r.site})" in html


def test_plot_fit_draws_the_history(em_fit, tmp_path):
    res = em_fit
    fig = fb.diagnostics.plot_fit(res, path=tmp_path / "fit.png")
    assert (tmp_path / "fit.png").stat().st_size > 0
    sites = [k[len("theta/"):] for k in res.history if k.startswith("theta/")]
    axes = {a.get_title().split(" (")[0]: a for a in fig.axes if a.get_visible()}
    for site in sites:
        trace = np.asarray(res.history[f"theta/{site}"]).reshape(len(res.history["bits_up"]), -1)
        lines = axes[site].get_lines()
        data_lines = [ln for ln in lines if len(ln.get_xdata()) == trace.shape[0]]
        for j, ln in enumerate(data_lines):
            np.testing.assert_array_equal(ln.get_ydata(), trace[:, j])
            np.testing.assert_array_equal(ln.get_xdata(), np.arange(1, trace.shape[0] + 1))
        dashed = [ln.get_ydata()[0] for ln in lines if ln.get_linestyle() == "--"]
        np.testing.assert_array_equal(dashed, np.asarray(res.params[site]).reshape(-1)[: len(dashed)])
    comm = [a for a in fig.axes if a.get_ylabel() == "bits (cumulative)"][0]
    up, down = comm.get_lines()
    np.testing.assert_array_equal(up.get_ydata(), np.cumsum(res.history["bits_up"]))
    np.testing.assert_array_equal(down.get_ydata(), np.cumsum(res.history["bits_down"]))
    if np.any(np.isfinite(res.history.get("objective", [np.nan]))):
        obj = [a for a in fig.axes if a.get_ylabel() == "objective"][0]
        np.testing.assert_array_equal(obj.get_lines()[0].get_ydata(), res.history["objective"])
    with pytest.raises(fb.DataError):
        fb.diagnostics.plot_fit(res, sites="nope")
    one = fb.diagnostics.plot_fit(res, sites=sites[0])
    assert sum(a.get_visible() for a in one.axes) <= 3


def test_a_large_fit_without_uncertainty_prints_a_short_table():
    """Estimates alone where no coordinate has an uncertainty, and at most SUMMARY_ROWS of them (FedPop's
    synthetic model: phi has 40 coordinates; Adam's FedSOUL fit here has no standard errors)."""
    from fedbayes.result import SUMMARY_ROWS

    train, _, _ = fb.models.make_fedpop_synthetic(20, seed=0)
    res = fb.fed_fit(fb.models.fedpop_synthetic, train, fb.FedSOUL(server_optimizer="adam", uncertainty=False),
                     num_rounds=5, seed=0, progress=False)
    text = str(res)
    assert "estimate (this fit has no standard errors)" in text and "lower" not in text
    assert f"({len(res.summary())} coordinates: res.summary() has them all)" in text
    table_lines = [line for line in text.splitlines() if line.split("[")[0].split(" ")[0] in res.params]
    assert len(table_lines) == SUMMARY_ROWS


def test_a_result_saved_before_the_one_step_estimate_loads(em_fit):
    state = em_fit.__getstate__()
    state.pop("params_averaged")  # what a result pickled before the field existed holds
    old = fb.Result.__new__(fb.Result)
    old.__setstate__(state)
    assert old.params_averaged is None and old.params.keys() == em_fit.params.keys()


def test_a_private_fit_names_its_epsilon_in_both_summaries():
    pytest.importorskip("dp_accounting")
    data = fb.models.make_glm_clients(6, 3, 25, family="linear", seed=0)[0]
    dp = fb.privacy.DP(clip=1.0, noise_multiplier=2.0)
    res = fb.fed_fit(fb.models.linear_regression(), data, fb.GD(step_size=0.005, privacy=dp), num_rounds=20, seed=0,
                     progress=False)
    line = f"privacy: epsilon {res.privacy['epsilon']:.3g} at delta {res.privacy['delta']:.3g}"
    assert line in str(res) and line in res._repr_html_()


@pytest.mark.parametrize(
    "algorithm, says",
    [
        (fb.DELF(), "no compression (the identity compressor: pass uplink= to compress)"),
        (fb.BELF(), "no compression (the identity compressor: pass uplink= / downlink= to compress)"),
        (fb.BELF(uplink=fb.compress.top_k(1)), "compression: uplink top_k(k=1), downlink identity"),
        (fb.FedMM(), "no compression (the identity compressor: pass compressor= to compress)"),
    ],
)
def test_the_summary_says_what_was_compressed(algorithm, says):
    """Issue 52 (8): D-ELF and B-ELF compress nothing by default (they are then LMC); the summary says so."""
    if isinstance(algorithm, fb.FedMM):
        data, _ = fb.models.make_linear_mixed_effects(6, seed=0)
        res = fb.fed_fit(fb.models.linear_mixed_effects, data, algorithm, num_rounds=20, seed=0, progress=False)
    else:
        data = fb.models.make_glm_clients(3, 2, 10, family="linear", seed=0)[0]
        res = fb.fed_fit(fb.models.linear_regression(), data, algorithm, num_rounds=30, seed=0, progress=False)
    assert says in str(res) and says in res._repr_html_()
