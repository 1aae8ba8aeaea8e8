"""The deterministic start (FedModel.init_globals): no random draw, the exact centre of each prior,
hierarchical priors centred at the earlier sites' start values, user values and param inits kept."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from scipy import stats

import fedbayes as fb
from fedbayes.errors import ModelError


def model(x, y=None):
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))              # mean infinite: the median
    s = numpyro.sample("s", dist.HalfNormal(tau))                  # hierarchical: centred at tau's start
    a = numpyro.sample("a", dist.Normal(jnp.array([3.0, -1.0]), 2.0).to_event(1))
    lg = numpyro.sample("lg", dist.LogNormal(0.5, 0.3))
    g = numpyro.sample("g", dist.Gamma(2.0, 4.0).expand([3]).to_event(1))
    b = numpyro.sample("b", dist.Beta(2.0, 5.0))
    p = numpyro.sample("p", dist.Dirichlet(jnp.array([1.0, 2.0, 3.0])))
    c = numpyro.sample("c", dist.Cauchy(1.0, 3.0))                 # mean undefined: the median
    t = numpyro.sample("t", dist.StudentT(1.0, -2.0, 1.0))         # mean undefined: the location
    ig = numpyro.sample("ig", dist.InverseGamma(1.0, 1.0))         # neither in closed form: exp(0) = 1
    u = numpyro.sample("u", dist.Uniform(-1.0, 3.0))
    w = numpyro.param("w", jnp.array(0.25))
    mu = a[0] + x * s + lg + g.sum() + b + p[0] + c + t + ig + u + w
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@pytest.fixture(scope="module")
def fm():
    data = fb.FederatedData({"x": [np.ones(3), np.arange(4.0)], "y": [np.zeros(3), np.ones(4)]})
    return fb.FedModel(model, data)


def expected(tau=5.0):
    """Each prior's mean (scipy), or its median where the mean is infinite or undefined."""
    return {
        "tau": stats.halfcauchy(scale=5.0).median(),
        "s": stats.halfnorm(scale=tau).mean(),
        "a": np.array([3.0, -1.0]),
        "lg": stats.lognorm(s=0.3, scale=np.exp(0.5)).mean(),
        "g": np.full(3, stats.gamma(2.0, scale=1 / 4.0).mean()),
        "b": stats.beta(2.0, 5.0).mean(),
        "p": stats.dirichlet([1.0, 2.0, 3.0]).mean(),
        "c": stats.cauchy(1.0, 3.0).median(),
        "t": stats.t(1.0, loc=-2.0).median(),
        "ig": 1.0,  # InverseGamma(1, 1): infinite mean, median needs an incomplete-gamma inverse: exp(0)
        "u": stats.uniform(-1.0, 4.0).mean(),
        "w": 0.25,  # a param keeps its own initial value
    }


def test_start_is_the_exact_prior_centre_and_ignores_the_key(fm):
    starts = [fm.constrain(fm.init_globals(jax.random.PRNGKey(k))) for k in (0, 1, 123)]
    for other in starts[1:]:
        for name in starts[0]:
            np.testing.assert_array_equal(other[name], starts[0][name])
    for name, value in expected().items():
        np.testing.assert_allclose(starts[0][name], value, rtol=1e-12, atol=1e-12, err_msg=name)


def test_hierarchical_prior_is_centred_at_the_given_parent(fm):
    start = fm.constrain(fm.init_globals(None, {"tau": 0.7, "w": -3.0}))
    np.testing.assert_allclose(start["tau"], 0.7, rtol=1e-15)
    np.testing.assert_allclose(start["s"], stats.halfnorm(scale=0.7).mean(), rtol=1e-12)
    np.testing.assert_allclose(start["w"], -3.0, rtol=1e-15)


def test_start_is_traceable_and_checks_user_values(fm):
    shapes = jax.eval_shape(lambda k: fm.init_globals(k), jax.random.PRNGKey(0))
    assert shapes["p"].shape == (2,)  # the simplex's unconstrained (stick-breaking) coordinates
    with pytest.raises(ModelError, match="not global sites"):
        fm.init_globals(None, {"nope": 1.0})
    with pytest.raises(ModelError, match="expected \\(2,\\)"):
        fm.init_globals(None, {"a": np.zeros(3)})


def test_library_model_starts_at_its_prior_mean():
    """A library model's start is its prior mean (0 for the N(0, 5^2) weights), not a median of draws."""
    data, _ = fb.models.make_glm_clients(3, 2, (10, 20), family="linear", seed=0)
    fm = fb.FedModel(fb.models.linear_regression(1.0, 5.0), data)
    u = fm.init_globals(jax.random.PRNGKey(0))
    np.testing.assert_array_equal(np.asarray(u["w"]), np.zeros(2))  # N(0, 5^2) prior: its mean
