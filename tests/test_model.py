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
    fed = fm.federated_log_density(fm.unconstrain(theta), {}, data)
    pooled, _ = log_density(logistic, (jnp.asarray(x), jnp.asarray(y)), {}, theta)
    assert float(fed) == pytest.approx(float(pooled), rel=1e-12)
    g_fed = jax.grad(lambda t: fm.federated_log_density(t, {}, data))(fm.unconstrain(theta))
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


def _per_sample_grads(fm, theta_u, zs, data, i):
    d = {k: v[i] for k, v in data.padded.items()}
    g = jax.vmap(jax.grad(fm.client_log_joint), in_axes=(None, 0, None, None))(theta_u, zs, d, data.mask[i])
    return jax.flatten_util.ravel_pytree(g)[0] if False else jnp.concatenate(
        [g[k].reshape(g[k].shape[0], -1) for k in sorted(g)], axis=1)


def test_fisher_identity_gradient_matches_the_closed_form_marginal(lme):
    # grad_theta log p(D_i | theta) = E_{z ~ p(z|D_i,theta)} grad_theta log p(D_i, z | theta), with exact
    # posterior draws of z: the Monte Carlo estimate is unbiased and its standard error is computed.
    data, fm, params = lme
    theta_u = fm.unconstrain(params)
    exact = jax.grad(lambda t: marginal_loglik(fm.constrain(t), data))(theta_u)
    exact_flat = jnp.concatenate([exact[k].reshape(-1) for k in sorted(exact)])
    rng = np.random.default_rng(0)
    n = 4000
    total, var = 0.0, 0.0
    for i in range(data.num_clients):
        m, S = local_posterior(params, data.client(i))
        zs = {"b": jnp.asarray(rng.multivariate_normal(m, S, size=n))}
        g = _per_sample_grads(fm, theta_u, zs, data, i)
        total = total + g.mean(0)
        var = var + g.var(0) / n
        est = fm.fisher_gradient(theta_u, zs, {k: v[i] for k, v in data.padded.items()}, data.mask[i])
        np.testing.assert_allclose(jnp.concatenate([est[k].reshape(-1) for k in sorted(est)]), g.mean(0), rtol=1e-12, atol=1e-12)
    se = np.sqrt(var)
    # entries of the lower-Cholesky's strict upper triangle are structurally zero in both
    live = np.abs(np.asarray(exact_flat)) > 1e-12
    np.testing.assert_array_less(np.abs(np.asarray(total - exact_flat))[live], 5 * se[live])
    assert np.all(se[live] < 0.1 * np.abs(np.asarray(exact_flat))[live] + 0.05)  # the check is informative


def test_fisher_identity_with_ula_samples_has_exact_fixed_effect_gradient(lme):
    # ULA's stationary law on a Gaussian target has the exact mean; grad_beta is linear in z, so the
    # Fisher estimate from (independent) ULA chains is unbiased for the fixed effects.
    data, fm, params = lme
    theta_u = fm.unconstrain(params)
    exact = jax.grad(lambda t: marginal_loglik(fm.constrain(t), data))(theta_u)["beta"]
    total, var = 0.0, 0.0
    for i in range(data.num_clients):
        d = {k: v[i] for k, v in data.padded.items()}
        score = lambda z: fm.local_score(theta_u, z, d, data.mask[i])  # noqa: E731
        _, S = local_posterior(params, data.client(i))
        gamma = 0.2 / np.linalg.eigvalsh(np.linalg.inv(S)).max()
        keys = jax.random.split(jax.random.PRNGKey(i), 3000)
        final = jax.vmap(lambda k: fb.kernels.ula_chain(k, {"b": jnp.zeros(2)}, score, gamma, 300)[0])(keys)
        g = jax.vmap(jax.grad(fm.client_log_joint), in_axes=(None, 0, None, None))(theta_u, final, d, data.mask[i])["beta"]
        total, var = total + g.mean(0), var + g.var(0) / g.shape[0]
    np.testing.assert_array_less(np.abs(np.asarray(total - exact)), 5 * np.sqrt(var))
