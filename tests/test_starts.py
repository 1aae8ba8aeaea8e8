"""The deterministic start (FedModel.init_globals): no random draw, the exact centre of each prior,
hierarchical priors centred at the earlier sites' start values, user values and param inits kept; and the
deterministic optimisers' move of it off a saddle of the likelihood (FedModel.off_saddle)."""

import warnings

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


def network(x, y=None, *, hidden: int = 4, classes: int = 3):
    """A tanh layer and a softmax head with zero-mean priors: at the prior centre every weight is 0, a
    saddle of the likelihood (tanh(0) = 0 and a zero head pass each other no gradient)."""
    w_in = numpyro.sample("w_in", dist.Normal(0, 1).expand([x.shape[-1], hidden]).to_event(2))
    c_in = numpyro.sample("c_in", dist.Normal(0, 1).expand([hidden]).to_event(1))
    w = numpyro.sample("w", dist.Normal(0, 1).expand([hidden, classes]).to_event(2))
    b = numpyro.sample("b", dist.Normal(0, 1).expand([classes]).to_event(1))
    unused = numpyro.sample("unused", dist.Normal(0, 1))  # a site that no likelihood term reads
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=jnp.tanh(x @ w_in + c_in) @ w + b + 0.0 * unused), obs=y)


@pytest.fixture(scope="module")
def net_data():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(n, 2)) for n in (40, 30)]
    # class = which of three sectors the point lies in: learnable only through the hidden layer
    ys = [np.digitize(np.arctan2(x[:, 1], x[:, 0]), [-np.pi / 3, np.pi / 3]) for x in xs]
    return fb.FederatedData({"x": xs, "y": ys})


def test_a_network_starts_off_its_saddle_and_only_where_stuck(net_data):
    fm = fb.FedModel(network, net_data)
    centre = fm.init_globals()
    start = fm.off_saddle(centre)
    again = fm.off_saddle(fm.init_globals(jax.random.PRNGKey(7)))  # still deterministic
    for name in start:
        np.testing.assert_array_equal(start[name], again[name])
    # b has a non-zero gradient at the centre (the class frequencies): it stays there; so does the
    # site that no likelihood term reads (its move would not change the gradient of the data)
    np.testing.assert_array_equal(start["b"], 0.0)
    np.testing.assert_array_equal(start["unused"], 0.0)
    # the stuck sites move by SADDLE_JITTER times a N(0, 1) draw: every entry non-zero, and the sample
    # sd of the 2 * 4 + 4 + 4 * 3 = 24 entries is 0.1 within its chi-square spread (sd / 0.1 in
    # [0.6, 1.45] holds with probability > 0.99 for 24 draws)
    moved = np.concatenate([np.ravel(start[n]) for n in ("w_in", "c_in", "w")])
    assert np.all(moved != 0)
    assert 0.06 < np.std(moved) < 0.145
    # off the saddle: each moved site's gradient is no longer 0
    client0 = {k: jnp.asarray(v) for k, v in net_data.client(0).items()}
    grad = jax.grad(lambda t: fm.client_loglik_population(t, client0, jnp.ones(40, bool)))(start)
    for name in ("w_in", "c_in", "w"):
        assert np.any(np.asarray(grad[name]) != 0), name
    traced = jax.jit(fm.off_saddle)(centre)  # the choice is traceable
    for name in start:
        np.testing.assert_allclose(traced[name], start[name], rtol=1e-12, atol=0)
    # a user's start values are kept, and a start off the saddle already is returned as it is
    kept = fm.off_saddle(centre, fixed=("w",))
    np.testing.assert_array_equal(kept["w"], 0.0)
    for name in start:
        np.testing.assert_array_equal(fm.off_saddle(start)[name], start[name])


def test_a_start_with_a_gradient_everywhere_is_not_moved(fm):
    centre = fm.init_globals()
    moved = fm.off_saddle(centre)
    for name in centre:
        np.testing.assert_array_equal(moved[name], centre[name])


@pytest.mark.slow  # 300 rounds of FedAvg: about 20 s
def test_the_default_start_lets_a_network_learn(net_data):
    """From the prior centre the best a fit can do is the class frequencies (only b has a gradient): the
    pooled NLL of the saddle is -sum_k n_k log(n_k / n). The default FedAvg start must beat it by far."""
    ys = np.concatenate([net_data.client(i)["y"] for i in range(2)])
    counts = np.bincount(ys.astype(int), minlength=3)
    saddle_nll = -np.sum(counts * np.log(counts / counts.sum()))
    # the tiny network's softmax shift is identified by the prior only, so the fit's own checks may warn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fb.ConvergenceWarning)
        res = fb.fed_fit(network, net_data, fb.FedAvg(local_steps=10), num_rounds=300, seed=0, progress=False)
    logits = lambda x: np.tanh(x @ res.params["w_in"] + res.params["c_in"]) @ res.params["w"] + res.params["b"]
    nll = 0.0
    for i in range(2):
        c = net_data.client(i)
        x, y = c["x"], c["y"].astype(int)
        lg = logits(x)
        nll -= np.sum(lg[np.arange(len(y)), y] - np.log(np.exp(lg).sum(1)))
    assert nll < 0.5 * saddle_nll, (nll, saddle_nll)
