"""fb.reference.nuts against closed-form posteriors; communication tables and plots from real fits."""

import copy

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedbayes as fb
from fedbayes import diagnostics as dg
from fedbayes.result import group

TAU = 0.5


def hierarchical_normal(y):
    """y_ij ~ N(z_i, 1), z_i ~ N(mu, TAU^2), mu ~ N(0, 1): every posterior marginal is Gaussian in closed form."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with fb.local():
        z = numpyro.sample("z", dist.Normal(mu, TAU))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(z, 1.0), obs=y)


def test_nuts_reference_matches_the_closed_form_hierarchical_posterior():
    rng = np.random.default_rng(0)
    sizes = np.array([3, 5, 8, 4, 10, 6])
    data = fb.FederatedData({"y": [0.7 + TAU * rng.normal() + rng.normal(size=n) for n in sizes]})
    ref = fb.reference.nuts(hierarchical_normal, data, num_warmup=300, num_samples=1500, num_chains=2, seed=1)
    post = group(ref, "posterior")
    assert post["z"].dims == ("chain", "draw", "client") and post["mu"].shape == (2, 1500)
    # mu | D: ybar_i ~ N(mu, TAU^2 + 1/n_i) independently, prior N(0, 1)
    ybar = np.array([data.client(i)["y"].mean() for i in range(len(sizes))])
    v = TAU**2 + 1 / sizes
    prec = 1 + np.sum(1 / v)
    m = np.sum(ybar / v) / prec
    # z_i | D: z_i | mu, D ~ N((1 - w) ybar_i + w mu, 1 / (n_i + 1/TAU^2)), w = (1/TAU^2) / (n_i + 1/TAU^2)
    w = (1 / TAU**2) / (sizes + 1 / TAU**2)
    ez, vz = (1 - w) * ybar + w * m, 1 / (sizes + 1 / TAU**2) + w**2 / prec
    mu, z = post["mu"].values.ravel(), post["z"].values.reshape(-1, len(sizes))
    # NUTS on a Gaussian target: effective sample size near 3000, so the mean is within 4 sd / sqrt(1000)
    # (a conservative ESS) and the variance within 15 %
    assert abs(mu.mean() - m) < 4 * np.sqrt(1 / prec / 1000)
    assert mu.var() == pytest.approx(1 / prec, rel=0.15)
    assert np.all(np.abs(z.mean(0) - ez) < 4 * np.sqrt(vz / 1000))
    np.testing.assert_allclose(z.var(0), vz, rtol=0.15)
    # the same reference compared with exact draws of the closed form: every distance is sampling noise
    exact = rng.normal(size=(2, 3000)) * np.sqrt(1 / prec) + m
    import xarray as xr

    table = dg.compare_to_reference(fb.result.to_arviz({"posterior": xr.Dataset({"mu": (["chain", "draw"], exact)})}),
                                    ref)
    assert table.loc["mu", "mean_err"] < 0.15 and table.loc["mu", "w2_gauss"] < 0.05


def test_nuts_reference_refuses_param_sites():
    def model(y):
        m = numpyro.param("m", 0.0)
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(m, 1.0), obs=y)

    with pytest.raises(fb.ModelError, match="no prior"):
        fb.reference.nuts(model, {"y": [np.zeros(3), np.ones(2)]})


@pytest.fixture(scope="module")
def glm_fits():
    data, _ = fb.models.make_glm_clients(4, 3, 30, seed=2)
    model = fb.models.logistic_regression(prior_scale=1.0)
    w_map = fb.models.logistic_map(data.pooled()["x"], data.pooled()["y"], prior_scale=1.0)
    fits = {"GD": fb.fed_fit(model, data, fb.GD(), num_rounds=60, seed=0),
            "Scaffnew": fb.fed_fit(model, data, fb.Scaffnew(), num_rounds=60, seed=0)}
    return data, w_map, fits


def test_communication_table_accumulates_the_ledger_and_measures_error(glm_fits):
    _, w_map, fits = glm_fits
    table = dg.communication_table(fits, reference={"w": w_map})
    for name, res in fits.items():
        t = table[table["method"] == name]
        assert list(t["round"]) == list(range(1, 61))
        np.testing.assert_array_equal(t["bits_up"], np.cumsum(res.history["bits_up"]) + res.init_bits[0])
        np.testing.assert_array_equal(t["bits_down"], np.cumsum(res.history["bits_down"]) + res.init_bits[1])
        exact = np.linalg.norm(res.history["theta/w"] - w_map, axis=1) / np.linalg.norm(w_map)
        np.testing.assert_allclose(t["error"], exact, rtol=1e-12)
        assert t["error"].iloc[-1] < t["error"].iloc[0]
    custom = dg.communication_table(fits["GD"], error=lambda p: float(np.abs(p["w"][0] - w_map[0])), every=7)
    assert list(custom["round"]) == [1, 8, 15, 22, 29, 36, 43, 50, 57, 60]
    reach = dg.communication_to_reach(table, tolerance=float(table["error"].max()))
    assert list(reach["round"]) == [1, 1]  # every method starts within the largest error
    # without a reference the recorded objective (F at each broadcast point, the safeguard's record) is the measure
    by_objective = dg.communication_table(fits)
    for name, res in fits.items():
        np.testing.assert_array_equal(by_objective[by_objective["method"] == name]["error"], res.history["objective"])
    blind = copy.copy(fits["GD"])
    blind.history = {k: v for k, v in blind.history.items() if k != "objective"}
    with pytest.raises(fb.ConfigError):
        dg.communication_table(blind)  # no reference, no error function, no recorded objective
    with pytest.raises(fb.DataError, match="no trajectory"):
        dg.communication_table(fits, reference={"v": w_map})


def test_plots_render_headless_to_png(glm_fits, tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.ones(3), size=300)
    y = np.array([rng.choice(3, p=row) for row in p])
    draws = rng.dirichlet(np.ones(3), size=(5, 40))
    paths = {
        "reliability": dg.plot_reliability({"a": p, "b": p**2 / (p**2).sum(1, keepdims=True)}, y,
                                           path=tmp_path / "rel.png"),
        "scores": dg.plot_score_histograms({"m": (dg.predictive_entropy(draws), dg.mutual_information(draws))},
                                           path=tmp_path / "ent.png"),
        "pit": dg.plot_pit(rng.normal(size=(100, 50)), rng.normal(size=50), path=tmp_path / "pit.png"),
        "communication": dg.plot_communication(glm_fits[2], reference={"w": glm_fits[1]}, path=tmp_path / "comm.png"),
    }
    for name in ("rel", "ent", "pit", "comm"):
        assert (tmp_path / f"{name}.png").stat().st_size > 5000, name
    # the plotted points are the tested data functions' values
    ax = paths["reliability"].axes[0]
    rel = dg.reliability_diagram(p, y)
    np.testing.assert_allclose(ax.collections[0].get_offsets()[:, 1], rel["accuracy"][rel["count"] > 0])
