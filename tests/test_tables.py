"""fedbayes.models.tables and the Result tables that read it: names, the components' algebra, the delta method
and the draws' moments, each against a computation by hand. The fits against statsmodels and the exact
marginal likelihood are in tests/test_formula.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pandas as pd
import pytest
from jax.flatten_util import ravel_pytree
from numpyro.distributions import constraints

import fedbayes as fb
from fedbayes.introspect import FedModel
from fedbayes.models import CovarianceBlock, MixedLayout


def _layout():
    return MixedLayout(
        "school",
        ("Intercept", "x"),
        (CovarianceBlock("tau_0", ("a",), False), CovarianceBlock("scale_tril_1", ("b", "c", "d"), True)),
        residual="sigma",
    )


def test_names_follow_the_blocks_sds_then_correlations_then_the_residual():
    assert _layout().component_names() == [
        ("school", "sd(a)"),
        ("school", "sd(b)"), ("school", "sd(c)"), ("school", "sd(d)"),
        ("school", "cor(b, c)"), ("school", "cor(b, d)"), ("school", "cor(c, d)"),
        ("Residual", "sd"),
    ]


def test_components_are_the_covariances_sds_and_correlations():
    rng = np.random.default_rng(0)
    L = np.tril(rng.normal(size=(3, 3)))
    params = {"tau_0": np.array(0.7), "scale_tril_1": L, "sigma": np.array(2.5)}
    cov = L @ L.T
    sd = np.sqrt(np.diag(cov))
    corr = cov / np.outer(sd, sd)
    expected = [0.7, *sd, corr[1, 0], corr[2, 0], corr[2, 1], 2.5]
    np.testing.assert_allclose(_layout().components(params), expected, rtol=1e-6)


def _model(x, z, y=None):  # the layout's sites, as numpyro params with their constraints
    numpyro.param("beta", jnp.zeros(2))
    numpyro.param("tau_0", jnp.ones(()), constraint=constraints.positive)
    numpyro.param("scale_tril_1", jnp.eye(3), constraint=constraints.lower_cholesky)
    numpyro.param("sigma", jnp.ones(()), constraint=constraints.positive)
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(0.0, 1.0), obs=y)


_model.mixed_layout = lambda data: _layout()  # type: ignore[attr-defined]


def _data():
    df = pd.DataFrame({"g": [1, 1, 2], "i": 1.0, "x": [0.1, 0.2, 0.3], "y": [0.0, 1.0, 2.0]})
    return fb.FederatedData.from_dataframe(df, "g", {"x": ["i", "x"], "z": ["i"], "y": "y"})


def _result(fm, **parts):
    return fb.Result(model=fm, data=fm_data, run=None, algorithm="test", seed=0, parts=parts, history={})


fm_data = _data()


def test_point_estimates_get_the_delta_method_standard_errors():
    """sqrt(diag(J C J^T)) with J by central differences of the components in the unconstrained coordinates."""
    fm = FedModel(_model, fm_data)
    rng = np.random.default_rng(1)
    theta = {"beta": jnp.array([1.0, -2.0]), "tau_0": jnp.array(-0.3), "scale_tril_1": jnp.asarray(rng.normal(size=6)),
             "sigma": jnp.array(0.4)}
    theta = fm.unconstrain(fm.constrain(theta))
    flat, unravel = ravel_pytree(theta)
    a = rng.normal(size=(flat.size, flat.size))
    cov = a @ a.T / flat.size
    params = fm.constrain(theta)
    res = _result(fm, theta=theta, params=params, params_last=params, cov_unconstrained=cov)
    f = lambda u: np.asarray(_layout().components(fm.constrain(unravel(jnp.asarray(u)))), np.float64)  # noqa: E731
    h = 1e-3
    jac = np.stack([(f(flat + h * e) - f(flat - h * e)) / (2 * h) for e in np.eye(flat.size)], axis=1)
    vc = res.variance_components
    np.testing.assert_allclose(vc["estimate"], f(flat), rtol=1e-5)
    # central differences at h = 1e-3 carry O(h^2) = 1e-6 relative error (float64: the suite enables x64)
    np.testing.assert_allclose(vc["std_error"], np.sqrt(np.diag(jac @ cov @ jac.T)), rtol=1e-5)
    fe = res.fixed_effects
    assert list(fe.index) == ["Intercept", "x"]
    np.testing.assert_allclose(fe["std_error"], np.sqrt(np.diag(cov))[:2], rtol=1e-5)  # beta is unconstrained


def test_draws_give_their_mean_and_sd_and_no_information_gives_nan():
    fm = FedModel(_model, fm_data)
    rng = np.random.default_rng(2)
    L = np.tril(rng.normal(size=(2, 50, 3, 3))) + 3 * np.eye(3)
    draws = {"beta": rng.normal(size=(2, 50, 2)), "tau_0": np.exp(rng.normal(size=(2, 50))), "scale_tril_1": L,
             "sigma": np.exp(rng.normal(size=(2, 50)))}
    params = {k: v.mean((0, 1)) for k, v in draws.items()}
    res = _result(fm, params=params, params_last=params, global_samples=draws)
    each = np.stack([np.asarray(_layout().components({k: v[c, d] for k, v in draws.items()}))
                     for c in range(2) for d in range(50)])
    vc = res.variance_components
    np.testing.assert_allclose(vc["estimate"], each.mean(0), rtol=1e-5)
    np.testing.assert_allclose(vc["std_error"], each.std(0, ddof=1), rtol=1e-4)
    bare = _result(fm, params=params, params_last=params)
    assert bare.variance_components["std_error"].isna().all() and bare.fixed_effects["std_error"].isna().all()


def test_a_model_without_a_layout_is_refused_with_the_fix():
    def plain(x, z, y=None):
        beta = numpyro.param("beta", jnp.zeros(2))
        with numpyro.plate("obs", x.shape[0]):
            numpyro.sample("y", dist.Normal(x @ beta, 1.0), obs=y)

    res = _result(FedModel(plain, fm_data), params={"beta": np.zeros(2)}, params_last={"beta": np.zeros(2)})
    with pytest.raises(fb.ConfigError, match="plain.*mixed_layout"):
        res.fixed_effects


def test_linear_mixed_effects_names_its_terms_by_the_dataframe_columns():
    layout = fb.models.linear_mixed_effects.mixed_layout(fm_data)
    assert (layout.group, layout.fixed, layout.blocks[0].columns) == ("g", ("i", "x"), ("i",))
    plain = fb.models.make_linear_mixed_effects(3)[0]  # no DataFrame: positional names, the default group
    layout = fb.models.linear_mixed_effects.mixed_layout(plain)
    assert (layout.group, layout.fixed, layout.blocks[0].columns) == ("client", ("x[0]", "x[1]"), ("z[0]", "z[1]"))


def test_a_result_saved_before_the_tables_falls_back_on_its_information():
    """A result pickled before ``_cov_u`` existed: the standard errors come from inverting ``information``."""
    fm = FedModel(_model, fm_data)
    theta = fm.unconstrain(fm.constrain({"beta": jnp.array([1.0, -2.0]), "tau_0": jnp.array(0.2),
                                         "scale_tril_1": jnp.arange(6.0) / 10, "sigma": jnp.array(0.1)}))
    d = ravel_pytree(theta)[0].size
    rng = np.random.default_rng(3)
    a = rng.normal(size=(d, d))
    cov = a @ a.T / d + np.eye(d)
    params = fm.constrain(theta)
    res = _result(fm, theta=theta, params=params, params_last=params, cov_unconstrained=cov,
                  information=np.linalg.inv(cov))
    state = res.__getstate__()
    del state["_cov_u"]
    old = fb.Result.__new__(fb.Result)
    old.__setstate__(state)
    pd.testing.assert_frame_equal(old.variance_components, res.variance_components, rtol=1e-8)
