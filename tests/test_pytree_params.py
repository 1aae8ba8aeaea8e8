"""Pytree-valued param sites (a flax module's weights, or any dict of arrays) as one site per leaf.

References: the same model written with one array site per weight (the same fit bit for bit), the
pooled least-squares solution (a linear model's MLE), a fit interrupted and resumed from its checkpoint
(bit for bit), and the same fit through Flower's messages (fb.flower.simulate).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedbayes as fb
from fedbayes.arviz_adapter import group
from resume_helper import interrupted_and_resumed

flax_linen = pytest.importorskip("flax.linen")  # the "nn" extra, installed by make test
from numpyro.contrib.module import flax_module  # noqa: E402


def linear_pytree(x, y):
    net = numpyro.param("net", {"w": jnp.zeros((2,)), "b": jnp.zeros(())})
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(x @ net["w"] + net["b"], 1.0), obs=y)


def linear_arrays(x, y):  # the same model, one site per weight, named as the pytree's leaves are
    w = numpyro.param("net/w", jnp.zeros((2,)))
    b = numpyro.param("net/b", jnp.zeros(()))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w + b, 1.0), obs=y)


class Features(flax_linen.Module):
    @flax_linen.compact
    def __call__(self, x):
        return flax_linen.tanh(flax_linen.Dense(3)(x))


def personalised_net(x, y):
    """FedPop's structure: a shared flax feature extractor, a personal linear head per client with a
    learned population prior N(mu, 1)."""
    net = flax_module("net", Features(), input_shape=(1, 2))
    mu = numpyro.param("mu", jnp.zeros((3, 2)))
    with fb.local():
        head = numpyro.sample("head", dist.Normal(mu, 1.0).to_event(2))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=net(x) @ head), obs=y)


def personalised_eqx_net(x, y):
    """The same structure with an equinox feature extractor (numpyro.contrib.module.eqx_module declares
    the module's arrays by an init function)."""
    eqx = pytest.importorskip("equinox")
    from numpyro.contrib.module import eqx_module

    net = eqx_module("net", _eqx_features())
    mu = numpyro.param("mu", jnp.zeros((3, 2)))
    with fb.local():
        head = numpyro.sample("head", dist.Normal(mu, 1.0).to_event(2))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=jnp.tanh(eqx.filter_vmap(net)(x)) @ head), obs=y)


def _eqx_features():
    eqx = pytest.importorskip("equinox")
    import jax

    return eqx.nn.Linear(2, 3, key=jax.random.PRNGKey(0))


NETWORKS = {
    "flax": (personalised_net, {"net$params/Dense_0/bias", "net$params/Dense_0/kernel", "mu"}, "net$params/Dense_0/kernel"),
    "equinox": (personalised_eqx_net, {"net$params/bias", "net$params/weight", "mu"}, "net$params/weight"),
}


def _linear_data(seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(25, 2)) for _ in range(4)]
    ys = [x @ np.array([1.0, -0.5]) + 0.3 + rng.normal(size=25) for x in xs]
    return fb.FederatedData({"x": xs, "y": ys}), np.concatenate([np.c_[x, np.ones(len(x))] for x in xs]), np.concatenate(ys)


def assert_samples_the_ridge_posterior(bayesian_linear, weight: str, bias: str) -> None:
    """A Bayesian linear layer's weights are its two global sample sites, and LMC's posterior mean of this
    conjugate Gaussian model is the ridge solution with penalty 1 / 3^2."""
    data, X, Y = _linear_data()
    fm = fb.FedModel(bayesian_linear, data)
    assert {n: s.role for n, s in fm.sites.items()} == {weight: "global", bias: "global"}
    res = fb.fed_fit(bayesian_linear, data, fb.LMC(num_chains=1), num_rounds=400, seed=0, progress=False)
    ridge = np.linalg.solve(X.T @ X + np.eye(3) / 9.0, X.T @ Y)
    post_sd = np.sqrt(np.diag(np.linalg.inv(X.T @ X + np.eye(3) / 9.0)))
    est = np.r_[np.ravel(res.params[weight]), np.ravel(res.params[bias])]
    # 200 draws of a chain started at the mode with AR coefficient below 0.9: the mean's standard error is
    # under sd / sqrt(200 / 19) ~ 0.31 sd; 1.5 sd leaves 5 standard errors
    assert np.all(np.abs(est - ridge) < 1.5 * post_sd)


def _class_data(seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(20, 2)) for _ in range(4)]
    ys = [((x[:, 0] * (1 if i % 2 else -1) + 0.3 * rng.normal(size=20)) > 0).astype(np.int32) for i, x in enumerate(xs)]
    return fb.FederatedData({"x": xs, "y": ys})


def test_a_pytree_param_is_one_site_per_leaf_and_fits_as_the_arrays_do():
    data, X, Y = _linear_data()
    fm = fb.FedModel(linear_pytree, data)
    assert set(fm.global_names) == {"net/w", "net/b"} and fm.pytree_params["net"][0] == ["net/b", "net/w"]
    kw = dict(num_rounds=150, seed=0, progress=False)
    tree = fb.fed_fit(linear_pytree, data, fb.GD(), **kw)
    arrays = fb.fed_fit(linear_arrays, data, fb.GD(), **kw)
    for k in ("net/w", "net/b"):
        np.testing.assert_array_equal(tree.params[k], arrays.params[k])
    np.testing.assert_array_equal(tree.history["bits_up"], arrays.history["bits_up"])
    ols = np.linalg.lstsq(X, Y, rcond=None)[0]
    # GD's fixed point is the pooled least-squares solution; float32 arithmetic leaves ~1e-6
    np.testing.assert_allclose(np.r_[tree.params["net/w"], tree.params["net/b"]], ols, atol=2e-5)
    assert {"net/w", "net/b"} <= set(group(tree.idata, "fed_params").data_vars)


@pytest.mark.parametrize("kind", sorted(NETWORKS))
def test_a_feature_extractor_with_personal_heads_trains_checkpoints_and_runs_on_flower(tmp_path, kind):
    personalised_net, names, kernel = NETWORKS[kind]
    data = _class_data()
    fm = fb.FedModel(personalised_net, data)
    assert set(fm.global_names) == names
    soul = fb.FedSOUL(num_samples=10, warmup=10, num_chains=1, uncertainty=False)
    kw = dict(num_rounds=24, seed=5, progress=False)
    res = fb.fed_fit(personalised_net, data, soul, **kw)
    assert res.params[kernel].size == 6 and res.local_samples["head"].shape[:2] == (4, 10)
    first = np.asarray(res.history[f"theta/{kernel}"])
    assert not np.allclose(first[0], first[-1])  # the feature extractor was trained
    assert names <= set(group(res.idata, "fed_params").data_vars)  # one variable per leaf
    posterior = group(res.idata, "posterior")
    assert "head" in posterior.data_vars

    # interrupted at round 12 and resumed from its checkpoint: the same fit bit for bit
    resumed = interrupted_and_resumed(personalised_net, data, soul, tmp_path / "net.ckpt", 12, **kw)
    for k, v in res.params.items():
        np.testing.assert_array_equal(resumed.params[k], v)

    # FedAvg of the shared model (heads at their population mean), in fed_fit and through Flower's messages
    avg = fb.FedAvg(local_latents="population-mean")
    direct = fb.fed_fit(personalised_net, data, avg, num_rounds=6, seed=1, progress=False)
    flower = fb.flower.simulate(personalised_net, data, avg, num_rounds=6, seed=1, backend="local")
    for k, v in direct.params.items():
        np.testing.assert_allclose(flower.params[k], v, rtol=1e-6, atol=1e-7)
    assert int(np.sum(flower.history["bits_up"])) == int(np.sum(direct.history["bits_up"]))


@pytest.fixture
def float32():
    """JAX's default float32 for one test (tests/test_flower.py says why: floats cross Flower's wire as float32,
    so only then is the network exact)."""
    import jax

    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    yield
    jax.config.update("jax_enable_x64", before)


def test_fedsoul_on_a_network_with_a_compressed_uplink_is_the_same_fit_on_flower(float32):
    """FedSOUL's uploads in the shared sites of a flax network, flattened leaf by leaf into one vector, go
    through QSGD and the ledger, in fed_fit and through Flower's messages (the wire format of the leaves):
    the same fit, and the same bits (in float32)."""
    data = _class_data()
    data = fb.FederatedData({"x": [data.client(i)["x"].astype(np.float32) for i in range(data.num_clients)],
                             "y": [data.client(i)["y"] for i in range(data.num_clients)]})
    soul = fb.FedSOUL(num_samples=10, warmup=10, num_chains=1, uncertainty=False, compressor=fb.compress.qsgd(4))
    kw = dict(num_rounds=6, clients_per_round=3, seed=2, progress=False)
    direct = fb.fed_fit(personalised_net, data, soul, **kw)
    flower = fb.flower.simulate(personalised_net, data, soul, backend="local", **kw)
    # fed_fit on the data moved one float32 ulp: how far last-bit differences carry through these rounds
    # (tests/test_flower.py's DRIFT: a Flower run's floats are within 10 times that of fed_fit's; an
    # algorithmic difference moves them by orders of magnitude more)
    clients = [data.client(i) for i in range(data.num_clients)]
    nudged = fb.FederatedData({"x": [np.nextafter(c["x"], np.inf).astype(c["x"].dtype) for c in clients],
                               "y": [c["y"] for c in clients]})
    moved = fb.fed_fit(personalised_net, nudged, soul, **kw)
    for k, v in direct.params.items():
        drift = float(np.max(np.abs(np.asarray(moved.params[k], np.float64) - np.asarray(v, np.float64))))
        np.testing.assert_allclose(flower.params[k], v, rtol=1e-4, atol=max(1e-5, 10 * drift), err_msg=k)
    assert int(np.sum(flower.history["bits_up"])) == int(np.sum(direct.history["bits_up"])) > 0
    # each client's upload: the gradient in the 15 shared coordinates (kernel 6, bias 3, mu 6) as one flat vector
    # through QSGD (qsgd(4).bits(15) = 92 bits, against 15 x 32 uncompressed), then the Fisher-scoring
    # information's upper triangle (15 x 16 / 2 = 120 floats) and the objective, uncompressed
    np.testing.assert_array_equal(direct.history["bits_up"], 3 * (fb.compress.qsgd(4).bits(15) + (120 + 1) * 32))


def test_random_flax_module_is_its_sample_sites_and_mutable_state_is_refused():
    """random_flax_module declares the module's params (a pytree) and replaces each by a sample site with the
    prior: the unused params are left out, so the samplers take the model; flax's mutable state is refused."""
    from numpyro.contrib.module import random_flax_module

    class Linear(flax_linen.Module):
        @flax_linen.compact
        def __call__(self, x):
            return flax_linen.Dense(1)(x)[..., 0]

    def bayesian_linear(x, y):
        net = random_flax_module("net", Linear(), dist.Normal(0.0, 3.0), input_shape=(1, 2))
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(net(x), 1.0), obs=y)

    assert_samples_the_ridge_posterior(bayesian_linear, "net/Dense_0.kernel", "net/Dense_0.bias")

    class WithState(flax_linen.Module):
        @flax_linen.compact
        def __call__(self, x):
            return flax_linen.BatchNorm(use_running_average=False)(flax_linen.Dense(1)(x))[..., 0]

    def stateful(x, y):
        net = flax_module("net", WithState(), input_shape=(1, 2), mutable=["batch_stats"])
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(net(x), 1.0), obs=y)

    with pytest.raises(fb.ModelError, match="is mutable state"):
        fb.FedModel(stateful, _linear_data()[0])


def test_random_eqx_module_is_its_sample_sites():
    """equinox's random_eqx_module: the module's arrays (declared by eqx_module through an init function)
    replaced by sample sites with the prior; the unused param leaves are left out, and LMC's posterior mean
    of a conjugate Gaussian model is the ridge solution."""
    eqx = pytest.importorskip("equinox")
    import jax
    from numpyro.contrib.module import random_eqx_module

    linear = eqx.nn.Linear(2, "scalar", key=jax.random.PRNGKey(1))

    def bayesian_linear(x, y):
        net = random_eqx_module("net", linear, dist.Normal(0.0, 3.0))
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(eqx.filter_vmap(net)(x), 1.0), obs=y)

    assert_samples_the_ridge_posterior(bayesian_linear, "net/weight", "net/bias")
