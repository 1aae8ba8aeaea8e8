"""``numpyro.deterministic`` sites: recorded, never parameters, in ``idata`` and in predictions.

Every expected value is recomputed here from the fit's own draws / estimates by the formula the model
records (closed form), so the checks are exact (float64 rounding only).
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.distributions import constraints

import fedbayes as fb
from fedbayes.introspect import FedModel
from fedbayes.result import Result, az, group

# Fits: the second tier (make test-slow, run by .ci/run), to keep make test under 10 minutes.
pytestmark = pytest.mark.slow

EXACT = dict(rtol=1e-12, atol=1e-12)  # the same float64 formula evaluated by XLA and by NumPy


def random_intercepts(x, y=None, record=True):
    """y_ij ~ N(x_ij w + b_i, 1), b_i ~ N(0, s^2): globals w, s; local b; recorded values of every kind."""
    w = numpyro.sample("w", dist.Normal(0.0, 2.0).expand([x.shape[-1]]).to_event(1))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    if record:
        numpyro.deterministic("s2", s**2)  # global: a function of the globals alone
    with fb.local():
        b = numpyro.sample("b", dist.Normal(0.0, s))
    mu = x @ w + b
    if record:
        numpyro.deterministic("shift", b + w[0])  # per client, one value
        mu = numpyro.deterministic("mu", mu)  # per observation, outside any plate
    with numpyro.plate("obs", x.shape[0]):
        if record:
            numpyro.deterministic("mu2", 2.0 * mu)  # per observation, inside the data plate
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def logistic(x, y=None):
    """Globals-only logistic regression recording its linear predictor and a summary of the weights."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    numpyro.deterministic("w_sum", jnp.sum(w))
    eta = numpyro.deterministic("eta", x @ w)
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=eta), obs=y)


def lme(x, z, y=None):
    """``fb.models.linear_mixed_effects`` with recorded sigma^2, Omega and fitted values."""
    p, q = x.shape[-1], z.shape[-1]
    beta = numpyro.param("beta", jnp.zeros(p))
    scale_tril = numpyro.param("scale_tril", jnp.eye(q), constraint=constraints.lower_cholesky)
    sigma = numpyro.param("sigma", jnp.ones(()), constraint=constraints.positive)
    numpyro.deterministic("sigma2", sigma**2)
    numpyro.deterministic("omega", scale_tril @ scale_tril.T)
    with fb.local():
        b = numpyro.sample("b", dist.MultivariateNormal(jnp.zeros(q), scale_tril=scale_tril))
    fitted = numpyro.deterministic("fitted", x @ beta + z @ b)
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(fitted, sigma), obs=y)


def ragged(seed=0, sizes=(5, 8, 3)):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(n, 2)) for n in sizes]
    ys = [x @ np.array([1.0, -0.5]) + 0.3 * (i - 1) + rng.normal(size=len(x)) for i, x in enumerate(xs)]
    return fb.FederatedData({"x": xs, "y": ys}), xs


def binary(seed=0, sizes=(5, 8, 3)):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(n, 2)) for n in sizes]
    ys = [(x @ np.array([1.0, -1.0]) + rng.normal(size=len(x)) > 0).astype(np.float64) for x in xs]
    return fb.FederatedData({"x": xs, "y": ys}), xs


def personalised_result(model, data, params, local_u, algorithm="FedSOUL"):
    """A Result as a personalised fit (FedSOUL, FedMM with draws) hands it over: theta* and every client's
    unconstrained local draws ``{site: (C, chains, draws, ...)}``, without running rounds (no compilation)."""
    fm = FedModel(model, data)
    parts = {"theta": fm.unconstrain(params), "params": params, "params_last": params, "local_samples": local_u}
    history = {"bits_up": np.zeros(1, np.int64), "bits_down": np.zeros(1, np.int64)}
    return Result(model=fm, data=data, run=None, algorithm=algorithm, seed=0, parts=parts, history=history)


def sampler_result(model, data, global_samples, algorithm="LMC"):
    """A Result as a sampler (LMC, ELF, QLSD) hands it over: draws ``{site: (chains, draws, ...)}`` of the
    globals (no warm-up or thinning), without running rounds."""
    from types import SimpleNamespace

    fm = FedModel(model, data)
    mean = {k: v.mean(axis=(0, 1)) for k, v in global_samples.items()}
    parts = {"global_samples": global_samples, "params": mean, "params_last": mean}
    draws = next(iter(global_samples.values())).shape[1]
    history = {"bits_up": np.zeros(draws, np.int64), "bits_down": np.zeros(draws, np.int64)}
    run = SimpleNamespace(cfg=fb.LMC(warmup=0, thinning=1), init_bits=(0, 0))
    return Result(model=fm, data=data, run=run, algorithm=algorithm, seed=0, parts=parts, history=history)


def point_result(model, data, params, algorithm="TAMUNA"):
    """A Result as a MAP solver (TAMUNA, Scaffnew, GD) hands it over: theta* alone."""
    fm = FedModel(model, data)
    parts = {"theta": fm.unconstrain(params), "params": params, "params_last": params}
    history = {"bits_up": np.zeros(1, np.int64), "bits_down": np.zeros(1, np.int64)}
    return Result(model=fm, data=data, run=None, algorithm=algorithm, seed=0, parts=parts, history=history)


def intercepts_result(chains=2, draws=6, seed=3):
    data, xs = ragged()
    b = np.random.default_rng(seed).normal(size=(data.num_clients, chains, draws))
    params = {"w": np.array([0.8, -0.4]), "s": np.array(0.6)}
    return personalised_result(random_intercepts, data, params, {"b": b}), data, xs


def pooled_rows(per_client: list[np.ndarray]) -> np.ndarray:
    """Concatenate per-client values along rows (the ``obs`` dimension's client-major order)."""
    return np.concatenate(per_client, axis=-1)


# ----------------------------------------------------------------------------- the model analysis


def test_deterministic_sites_are_recorded_not_classified_as_parameters():
    data, _ = ragged()
    fm = FedModel(random_intercepts, data)
    assert fm.global_names == ("w", "s") and fm.local_names == ("b",) and fm.observed == ("y",)
    d = fm.deterministic
    assert list(d) == ["s2", "shift", "mu", "mu2"]
    assert not d["s2"].per_client and d["s2"].row_axis is None
    assert d["shift"].per_client and d["shift"].row_axis is None
    # a data-length value outside any plate is neither refused nor taken for a latent
    assert d["mu"].per_client and d["mu"].row_axis == 0 and d["mu"].shape == (8,)
    assert d["mu2"].per_client and d["mu2"].row_axis == 0
    assert all(site.from_draws for site in d.values())


def test_deterministic_sites_do_not_enter_the_log_density():
    """The federated log-density with recording sites equals the one without them (same draws of theta,
    z), on ragged padded clients: nothing recorded is padded into the likelihood."""
    data, _ = ragged()
    with_sites = FedModel(random_intercepts, data)
    without = FedModel(random_intercepts, data, model_kwargs={"record": False})
    assert not without.deterministic
    theta = {"w": jnp.array([0.7, -0.2]), "s": jnp.array(-0.3)}
    z = {"b": jnp.array([0.4, -1.1, 0.2])}
    a = jax.jit(lambda t, z: with_sites.federated_log_density(t, z, data))(theta, z)
    b = jax.jit(lambda t, z: without.federated_log_density(t, z, data))(theta, z)
    assert float(a) == float(b)


def test_a_padding_dependent_deterministic_site_is_left_out_with_a_warning():
    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        numpyro.deterministic("x_mean", jnp.mean(x))  # counts padded rows
        numpyro.deterministic("n_rows", x.shape[0])
        numpyro.deterministic("eta", x @ w)
        with numpyro.plate("obs", x.shape[0]):
            numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)

    data, _ = ragged()
    with pytest.warns(UserWarning, match="'x_mean'.*'n_rows'.*left out of res.idata.posterior"):
        fm = FedModel(model, data)
    assert not fm.deterministic["x_mean"].paddable and not fm.deterministic["n_rows"].paddable
    assert fm.deterministic["eta"].paddable and fm.deterministic["eta"].row_axis == 0


def test_a_deterministic_site_of_per_observation_latents_is_flagged():
    def mixture(y):
        p = numpyro.param("p", 0.5, constraint=constraints.unit_interval)
        loc = numpyro.param("loc", jnp.array([-1.0, 1.0]))
        with numpyro.plate("obs", y.shape[0]):
            c = numpyro.sample("c", dist.Bernoulli(p))
            numpyro.deterministic("centre", loc[c.astype(jnp.int32)])
            numpyro.sample("y", dist.Normal(loc[c.astype(jnp.int32)], 1.0), obs=y)

    rng = np.random.default_rng(1)
    data = fb.FederatedData({"y": [rng.normal(size=n) for n in (4, 6)]})
    with pytest.warns(UserWarning, match="'centre': it depends on per-observation latent sites"):
        fm = FedModel(mixture, data)
    assert fm.obs_latent_names == ("c",) and fm.deterministic["centre"].obs_latent


# ----------------------------------------------------------------------------- results of every family


@pytest.fixture(scope="module")
def personalised():
    return intercepts_result()


@pytest.fixture(scope="module")
def soul():
    data, xs = ragged()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fb.ConvergenceWarning)  # a short run: only the bookkeeping is tested
        res = fb.fed_fit(random_intercepts, data, fb.FedSOUL(num_samples=6, warmup=5), num_rounds=10, seed=0)
    return res, data, xs


@pytest.mark.parametrize("fit", ["personalised", pytest.param("soul", marks=pytest.mark.slow)])
def test_personalised_posterior_holds_deterministic_sites(fit, request):
    """Per-client sites at client i's local draws with theta*, global ones at theta* (and at the globals'
    draws when the fit has them); ``personalised`` is a fit's hand-over without rounds, ``soul`` a
    FedSOUL fit."""
    res, data, xs = request.getfixturevalue(fit)
    post = group(res.idata, "posterior")
    w_star = res.params["w"]
    b = np.moveaxis(res._local_chains["b"], 0, 2)  # (chain, draw, client): the posterior's b
    np.testing.assert_array_equal(post["b"].values, b)
    # per client: client i's local draws with theta*
    np.testing.assert_allclose(post["shift"].values, b + w_star[0], **EXACT)
    assert post["shift"].dims == ("chain", "draw", "client")
    # per observation: along obs, client-major over the real rows
    mu = pooled_rows([x @ w_star + b[..., i, None] for i, x in enumerate(xs)])
    assert post["mu"].dims == ("chain", "draw", "obs") and post["mu"].shape[2] == data.total_size
    np.testing.assert_allclose(post["mu"].values, mu, **EXACT)
    np.testing.assert_allclose(post["mu2"].values, 2.0 * mu, **EXACT)
    assert post["obs"].values.tolist() == [f"{c}:{j}" for c in range(3) for j in range(data.sizes[c])]
    # global: at theta* in fed_params, and at the globals' draws in the posterior when they have draws
    np.testing.assert_allclose(group(res.idata, "fed_params")["s2"].values, res.params["s"] ** 2, **EXACT)
    if "s" in post:
        np.testing.assert_allclose(post["s2"].values, post["s"].values ** 2, **EXACT)


def test_personalised_predictions_return_deterministic_sites(personalised):
    """As NumPyro's Predictive: the recorded sites recomputed at the new inputs, with client i's draws."""
    res, _, _ = personalised
    x_new = np.array([[0.5, 1.0], [-1.0, 2.0], [0.0, 0.0], [3.0, -1.0]])
    out = res.predict({"x": x_new}, client=1, seed=2)
    assert list(out) == ["y", "s2", "shift", "mu", "mu2"]
    b = res.local_samples["b"][1]  # (S,), in order: num_samples=None keeps every draw
    mu = b[:, None] + x_new @ res.params["w"]
    np.testing.assert_allclose(out["mu"], mu, **EXACT)
    np.testing.assert_allclose(out["mu2"], 2.0 * mu, **EXACT)
    np.testing.assert_allclose(out["shift"], b + res.params["w"][0], **EXACT)
    np.testing.assert_allclose(out["s2"], np.full(len(b), res.params["s"] ** 2), **EXACT)
    assert out["y"].shape == mu.shape


def test_arviz_summary_lists_deterministic_sites(personalised):
    """az.summary of the whole posterior on either ArviZ line (1.x: make test-arviz1), a row per element."""
    res, data, _ = personalised
    summary = az.summary(res.idata)
    assert len(summary) == 2 * data.num_clients + 2 * data.total_size  # b and shift per client; mu and mu2 per row
    assert "mu[1:7]" in summary.index and "shift[2]" in summary.index


@pytest.fixture(scope="module")
def sampler():
    data, xs = binary()
    w = np.random.default_rng(4).normal(size=(2, 15, 2))
    return sampler_result(logistic, data, {"w": w}), data, xs


@pytest.fixture(scope="module")
def lmc():
    data, xs = binary()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fb.ConvergenceWarning)  # a short run: only the bookkeeping is tested
        res = fb.fed_fit(logistic, data, fb.LMC(step_size=0.05, num_chains=2, warmup=10), num_rounds=40, seed=1)
    return res, data, xs


@pytest.mark.parametrize("fit", ["sampler", pytest.param("lmc", marks=pytest.mark.slow)])
def test_sampler_posterior_holds_deterministic_sites_at_every_draw(fit, request):
    res, data, xs = request.getfixturevalue(fit)
    post = group(res.idata, "posterior")
    w = res.global_samples["w"]  # (chain, draw, 2)
    np.testing.assert_allclose(post["w_sum"].values, w.sum(-1), **EXACT)
    eta = pooled_rows([np.einsum("cdk,nk->cdn", w, x) for x in xs])
    np.testing.assert_allclose(post["eta"].values, eta, **EXACT)
    assert post["eta"].dims == ("chain", "draw", "obs")
    out = res.predict({"x": xs[0]}, num_samples=7, seed=0)
    assert list(out) == ["y", "w_sum", "eta"] and out["eta"].shape == (7, len(xs[0]))


@pytest.mark.parametrize("algorithm", ["hand-over", pytest.param("tamuna", marks=pytest.mark.slow),
                                       pytest.param("gd", marks=pytest.mark.slow)])
def test_point_estimates_hold_deterministic_sites_at_the_estimate(algorithm):
    data, xs = binary()
    if algorithm == "hand-over":
        res = point_result(logistic, data, {"w": np.array([0.9, -1.2])})
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fb.ConvergenceWarning)
            res = fb.fed_fit(logistic, data, algorithm, num_rounds=20, seed=0)
    assert "posterior" not in res.idata.children if hasattr(res.idata, "children") else "posterior" not in res.idata
    params = group(res.idata, "fed_params")
    w = res.params["w"]
    np.testing.assert_allclose(params["w_sum"].values, w.sum(), **EXACT)
    np.testing.assert_allclose(params["eta"].values, pooled_rows([x @ w for x in xs]), **EXACT)
    assert params["obs"].values.tolist() == [f"{c}:{j}" for c in range(3) for j in range(data.sizes[c])]
    out = res.predict({"x": xs[2]})  # a point estimate: one draw
    np.testing.assert_allclose(out["eta"], (xs[2] @ w)[None], **EXACT)


@pytest.mark.slow
def test_fedmm_normal_approximation_group_holds_global_deterministic_sites_and_the_posterior_does_not():
    data, _ = fb.models.make_linear_mixed_effects(8, sizes=(5, 12), seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fb.ConvergenceWarning)
        res = fb.fed_fit(lme, data, fb.FedMM(), num_rounds=30, seed=0)
    approx, params = group(res.idata, "fed_normal_approx"), group(res.idata, "fed_params")
    post = group(res.idata, "posterior")  # the random effects' exact local posterior draws at theta*, alone
    assert not {"sigma", "sigma2", "scale_tril", "omega"} & set(post.data_vars)
    np.testing.assert_allclose(approx["sigma2"].values, approx["sigma"].values ** 2, **EXACT)
    L = approx["scale_tril"].values
    np.testing.assert_allclose(approx["omega"].values, L @ np.swapaxes(L, -1, -2), **EXACT)
    np.testing.assert_allclose(params["sigma2"].values, res.params["sigma"] ** 2, **EXACT)
    # fitted values need the random effects' draws: FedMM's Gaussian E-step keeps means and covariances,
    # so they are left to predictions (with a client's draws) rather than given at a point
    assert "fitted" not in post or post["fitted"].dims == ("chain", "draw", "obs")
    x, z = data.client(0)["x"], data.client(0)["z"]
    out = res.predict({"x": x, "z": z}, num_samples=5, seed=0)
    assert out["fitted"].shape == (5, len(x))
    np.testing.assert_allclose(out["sigma2"], np.full(5, res.params["sigma"] ** 2), **EXACT)


def test_arviz_summary_of_a_sampler_lists_deterministic_sites(sampler):
    """az.summary on either ArviZ line (ArviZ 1.x under the 3.12 venv: make test-arviz1)."""
    res, data, _ = sampler
    summary = az.summary(res.idata, var_names=["w_sum", "eta"])
    assert len(summary) == 1 + data.total_size
