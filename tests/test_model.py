"""Model introspection: roles, errors, masking, the federated target and Fisher-identity gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer.util import log_density

import fedbayes as fb
from fedbayes.errors import ModelError
from lme_reference import local_posterior, marginal_loglik


def logistic(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    b0 = numpyro.sample("b0", dist.Normal(0.0, 2.0))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w + b0), obs=y)


def mixed(x, y=None):
    w = numpyro.sample("w", dist.Normal(0, 1).expand([x.shape[1]]).to_event(1))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    s = numpyro.param("s", 1.0, constraint=dist.constraints.positive)
    with fb.local():
        b = numpyro.sample("b", dist.Normal(0.0, tau))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w + b, s), obs=y)


def _pooled(seed=0, n=200, d=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d))
    y = (rng.random(n) < 1 / (1 + np.exp(-(x @ np.array([1.0, -1.0, 0.5]))))).astype(np.int32)
    return x, y


def test_site_roles_are_read_from_the_model():
    x, y = _pooled()
    data = fb.FederatedData({"x": [x[:10], x[10:30]], "y": [y[:10], y[10:30]]})
    fm = fb.FedModel(mixed, data)
    roles = {n: s.role for n, s in fm.sites.items()}
    assert roles == {"w": "global", "tau": "global", "s": "param", "b": "local"}
    assert fm.observed == ("y",) and fm.data_plates == frozenset({"obs"})
    assert fm.global_names == ("w", "tau", "s") and fm.local_names == ("b",)


@pytest.mark.parametrize("splits", [1, 2, 50])
def test_splitting_pooled_data_gives_the_same_target(splits):
    # log p(theta) + sum_i log p(D_i | theta) equals the pooled log joint for any split, padding included.
    x, y = _pooled()
    ids = fb.partition_iid(len(y), splits, seed=3)
    if splits == 50:  # ragged sizes to exercise padding
        ids = np.sort(np.random.default_rng(0).integers(0, splits, len(y)))
        ids[:splits] = np.arange(splits)
    data = fb.FederatedData.from_pooled({"x": x, "y": y}, ids)
    fm = fb.FedModel(logistic, data)
    theta = {"w": jnp.array([0.3, -0.2, 0.1]), "b0": jnp.array(0.4)}
    fed = jax.jit(lambda t: fm.federated_log_density(t, {}, data))(fm.unconstrain(theta))
    pooled, _ = log_density(logistic, (jnp.asarray(x), jnp.asarray(y)), {}, theta)
    assert float(fed) == pytest.approx(float(pooled), rel=1e-12)
    g_fed = jax.jit(jax.grad(lambda t: fm.federated_log_density(t, {}, data)))(fm.unconstrain(theta))
    g_pool = jax.grad(lambda t: log_density(logistic, (jnp.asarray(x), jnp.asarray(y)), {}, t)[0])(theta)
    for k in theta:
        np.testing.assert_allclose(g_fed[k], g_pool[k], rtol=1e-10, atol=1e-12)


def test_padding_does_not_change_a_client_log_density():
    x, y = _pooled(n=40)
    data = fb.FederatedData({"x": [x[:3], x[3:40]], "y": [y[:3], y[3:40]]})  # client 0 padded 3 -> 37
    fm = fb.FedModel(mixed, data)
    theta = fm.unconstrain({"w": jnp.array([0.1, 0.2, 0.3]), "tau": jnp.array(0.7), "s": jnp.array(1.3)})
    z = {"b": jnp.array(0.25)}
    padded = fm.client_log_joint(theta, z, {k: v[0] for k, v in data.padded.items()}, data.mask[0])
    exact = fm.client_log_joint(theta, z, {k: jnp.asarray(v) for k, v in data.client(0).items()}, jnp.ones(3, bool))
    assert float(padded) == pytest.approx(float(exact), rel=1e-12)
    gp = jax.grad(lambda t: fm.client_log_joint(t, z, {k: v[0] for k, v in data.padded.items()}, data.mask[0]))(theta)
    assert all(np.all(np.isfinite(v)) for v in gp.values())


def _two_clients():
    x, y = _pooled(n=20)
    return fb.FederatedData({"x": [x[:8], x[8:]], "y": [y[:8].astype(float), y[8:].astype(float)]})


def test_unsupported_structures_raise_model_errors_naming_the_site():
    data = _two_clients()

    def no_obs(x, y=None):
        numpyro.sample("w", dist.Normal(0, 1))

    def no_plate(x, y=None):
        w = numpyro.sample("w", dist.Normal(0, 1))
        numpyro.sample("y", dist.Normal(w, 1).expand([x.shape[0]]).to_event(1), obs=y)

    def per_obs_latent(x, y=None):
        with numpyro.plate("obs", x.shape[0]):
            k = numpyro.sample("k", dist.Normal(0, 1))
            numpyro.sample("y", dist.Normal(k, 1), obs=y)

    def discrete_local(x, y=None):
        with fb.local():
            c = numpyro.sample("c", dist.Bernoulli(0.5))
        with numpyro.plate("obs", x.shape[0]):
            numpyro.sample("y", dist.Normal(c, 1.0), obs=y)

    def broken(x, y=None):
        raise RuntimeError("boom")

    with pytest.raises(ModelError, match="no observed site"):
        fb.FedModel(no_obs, data)
    with pytest.raises(ModelError, match="observed site 'y'.*numpyro.plate"):
        fb.FedModel(no_plate, data)
    with pytest.raises(ModelError, match="per-observation latent site 'k'"):
        fb.FedModel(per_obs_latent, data).require("FedSOUL")
    with pytest.raises(ModelError, match="local site 'c' is discrete"):
        fb.FedModel(discrete_local, data).require("FedSOUL")
    with pytest.raises(ModelError, match="RuntimeError: boom"):
        fb.FedModel(broken, data)
    with pytest.raises(ModelError, match="callable"):
        fb.FedModel("not a model", data)
    with pytest.raises(ModelError, match="clash"):
        fb.FedModel(mixed, data, model_kwargs={"x": 1})


@pytest.fixture(scope="module")
def lme():
    data, _ = fb.models.make_linear_mixed_effects(12, seed=4)
    fm = fb.FedModel(fb.models.linear_mixed_effects, data)
    params = {"beta": jnp.array([0.7, -0.2]), "scale_tril": jnp.array([[0.9, 0.0], [0.3, 0.6]]), "sigma": jnp.array(0.6)}
    return data, fm, params


def _flat(tree):
    return jnp.concatenate([tree[k].reshape(tree[k].shape[:2] + (-1,)) for k in sorted(tree)], axis=-1)


def _per_sample_grads(fm, theta_u, zs, data):
    """grad_theta log p(D_i, z | theta) for samples zs (clients, n, ...) of every client, flattened."""
    per_client = jax.vmap(jax.grad(fm.client_log_joint), in_axes=(None, 0, None, None))
    g = jax.jit(jax.vmap(per_client, in_axes=(None, 0, 0, 0)))(theta_u, zs, data.padded, data.mask)
    return _flat(g)


def _exact_marginal_grad(fm, theta_u, data):
    g = jax.jit(jax.grad(lambda t: marginal_loglik(fm.constrain(t), data)))(theta_u)
    return g


def test_fisher_identity_gradient_matches_the_closed_form_marginal(lme):
    # grad_theta log p(D_i | theta) = E_{z ~ p(z|D_i,theta)} grad_theta log p(D_i, z | theta), with exact
    # posterior draws of z: the Monte Carlo estimate is unbiased and its standard error is computed.
    data, fm, params = lme
    theta_u = fm.unconstrain(params)
    exact = _exact_marginal_grad(fm, theta_u, data)
    exact_flat = np.concatenate([np.asarray(exact[k]).reshape(-1) for k in sorted(exact)])
    rng = np.random.default_rng(0)
    n = 4000
    zs = np.stack([rng.multivariate_normal(*local_posterior(params, data.client(i)), size=n)
                   for i in range(data.num_clients)])
    g = np.asarray(_per_sample_grads(fm, theta_u, {"b": jnp.asarray(zs)}, data))  # (clients, n, dim)
    total, se = g.mean(1).sum(0), np.sqrt((g.var(1) / n).sum(0))
    est = fm.fisher_gradient(theta_u, {"b": jnp.asarray(zs[0])}, {k: v[0] for k, v in data.padded.items()}, data.mask[0])
    np.testing.assert_allclose(np.concatenate([np.asarray(est[k]).reshape(-1) for k in sorted(est)]), g[0].mean(0),
                               rtol=1e-10, atol=1e-12)
    # entries of the lower-Cholesky's strict upper triangle are structurally zero in both
    live = np.abs(exact_flat) > 1e-12
    np.testing.assert_array_less(np.abs(total - exact_flat)[live], 5 * se[live])
    assert np.all(se[live] < 0.1 * np.abs(exact_flat)[live] + 0.05)  # the check is informative


def test_fisher_identity_with_ula_samples_has_exact_fixed_effect_gradient(lme):
    # ULA's stationary law on a Gaussian target has the exact mean; grad_beta is linear in z, so the
    # Fisher estimate from independent ULA chains is unbiased for the fixed effects.
    data, fm, params = lme
    theta_u = fm.unconstrain(params)
    exact = np.asarray(_exact_marginal_grad(fm, theta_u, data)["beta"])
    lam = np.array([np.linalg.eigvalsh(np.linalg.inv(local_posterior(params, data.client(i))[1])).max()
                    for i in range(data.num_clients)])
    gammas = jnp.asarray(0.2 / lam)

    def chains(key, d, m, gamma):
        score = lambda z: fm.local_score(theta_u, z, d, m)  # noqa: E731
        return jax.vmap(lambda k: fb.kernels.ula_chain(k, {"b": jnp.zeros(2)}, score, gamma, 300)[0])(
            jax.random.split(key, 3000))

    keys = jax.random.split(jax.random.PRNGKey(0), data.num_clients)
    final = jax.jit(jax.vmap(chains))(keys, data.padded, data.mask, gammas)
    g = np.asarray(_per_sample_grads(fm, theta_u, final, data))[..., :2]  # beta is first in sorted order
    total, se = g.mean(1).sum(0), np.sqrt((g.var(1) / g.shape[1]).sum(0))
    np.testing.assert_array_less(np.abs(total - exact), 5 * se)


def test_a_pytree_valued_param_is_one_site_per_leaf():
    """A module's parameter pytree (numpyro.contrib.module's flax_module registers one param site holding a
    dict of arrays) is one global site per leaf, not a TypeError from inside init_globals
    (tests/test_pytree_params.py fits such models against references)."""
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(5, 3)) for _ in range(3)]
    data = fb.FederatedData({"x": x, "y": [xi.sum(1) for xi in x]})

    def model(x, y):
        net = numpyro.param("net", {"w": jnp.zeros(3), "b": jnp.zeros(())})
        with numpyro.plate("obs", x.shape[0]):
            numpyro.sample("y", dist.Normal(x @ net["w"] + net["b"], 1.0), obs=y)

    res = fb.fed_fit(model, data, fb.GD(), num_rounds=3, progress=False)
    assert sorted(res.params) == ["net/b", "net/w"] and res.params["net/w"].shape == (3,)


@pytest.mark.parametrize("algo", [fb.GD, fb.LMC])
def test_a_model_invalid_at_its_start_is_a_model_error_with_the_fix(algo):
    """Issue 53 (3): a global whose prior centre makes a later distribution invalid (a scale of -1) gave NumPyro's
    bare ValueError from the globals' start; it is a ModelError that names the site, its start and the fix."""

    def model(y):
        s = numpyro.sample("s", dist.Normal(-1.0, 1.0))
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(0.0, s), obs=y)

    data = fb.FederatedData({"y": [np.ones(3)] * 2})
    with pytest.raises(fb.ModelError, match=r"invalid at its starting values.*'s'.*HalfNormal"):
        fb.fed_fit(model, data, algo(), num_rounds=5, progress=False)


@pytest.mark.parametrize("on", ["param", "data"])
@pytest.mark.parametrize("algo", [fb.GD, fb.FedSOUL])
def test_python_control_flow_on_a_traced_value_is_a_model_error_with_the_fix(on, algo):
    """Issue 53 (4): an ``if`` on a parameter (or on the data) gave JAX's bare TracerBoolConversionError from the
    model analysis; it is a ModelError, raised before any round, that says what to write instead."""

    def model(x, y=None):
        beta = numpyro.param("beta", 0.0)
        if (beta if on == "param" else x.sum()) > 0:
            beta = 2.0 * beta
        with fb.local():
            b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        with numpyro.plate("obs", x.shape[0]):
            numpyro.sample("y", dist.Normal(beta * x + b, 1.0), obs=y)

    rng = np.random.default_rng(0)
    data = fb.FederatedData({"x": [rng.normal(size=4) for _ in range(3)], "y": [rng.normal(size=4) for _ in range(3)]})
    what = "a parameter or latent" if on == "param" else "the data or a parameter"
    with pytest.raises(fb.ModelError, match=rf"Python decision .* depends on {what}.*jnp.where"):
        fb.fed_fit(model, data, algo(), num_rounds=5, progress=False)


def test_an_improper_uniform_prior_starts_in_its_support_and_fits():
    """Issue 53 (minor): an ImproperUniform prior (a flat prior, NumPyro's way) failed the model analysis with a
    bare NotImplementedError (it has no sampler). It gets a start in its support, as NumPyro's init_to_uniform
    places it; GD's MAP under a flat prior is then least squares on the pooled data (exact, to 1e-8)."""
    from numpyro.distributions import constraints

    def model(x, y=None):
        beta = numpyro.sample("beta", dist.ImproperUniform(constraints.real, (), ()))
        with numpyro.plate("obs", x.shape[0]):
            numpyro.sample("y", dist.Normal(beta * x, 1.0), obs=y)

    rng = np.random.default_rng(0)
    xs = [rng.normal(size=6) for _ in range(3)]
    ys = [1.5 * x + rng.normal(size=6) for x in xs]
    res = fb.fed_fit(model, fb.FederatedData({"x": xs, "y": ys}), fb.GD(), seed=0, progress=False)
    x, y = np.concatenate(xs), np.concatenate(ys)
    np.testing.assert_allclose(float(res.params["beta"]), x @ y / (x @ x), rtol=1e-8)
