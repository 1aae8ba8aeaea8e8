"""fed_fit input validation: every error is raised before compute with an actionable message."""

import numpy as np
import pytest

import fedbayes as fb
from fedbayes.errors import ConfigError, DataError


@pytest.fixture(scope="module")
def data():
    return fb.models.make_fedpop_synthetic(6, seed=0)[0]


@pytest.mark.parametrize("kwargs, err, match", [
    ({"algorithm": "nope"}, ConfigError, "unknown algorithm 'nope'"),
    ({"algorithm": object()}, ConfigError, "algorithm must be"),
    ({"num_rounds": 0}, ConfigError, "num_rounds"),
    ({"num_rounds": 2.5}, ConfigError, "num_rounds"),
    ({"seed": -1}, ConfigError, "seed"),
    ({"clients_per_round": 0}, ConfigError, "clients_per_round"),
    ({"clients_per_round": 7}, ConfigError, r"\[1, 6\]"),
    ({"clients_per_round": 1.5}, ConfigError, "fraction"),
    ({"chunk_size": 0}, ConfigError, "chunk_size"),
])
def test_bad_fit_options(data, kwargs, err, match):
    with pytest.raises(err, match=match):
        fb.fed_fit(fb.models.fedpop_synthetic, data, **kwargs)


@pytest.fixture(scope="module")
def short_fit(data):
    """A short FedSOUL fit; test_same_seed_same_result repeats it, reusing its compiled programs."""
    return fb.fed_fit(fb.models.fedpop_synthetic, data, fb.FedSOUL(num_samples=5, warmup=5), num_rounds=20, seed=4)


def test_bad_data_and_prediction_inputs(short_fit):
    with pytest.raises(DataError, match="FederatedData"):
        fb.fed_fit(fb.models.fedpop_synthetic, [np.zeros(3)])
    with pytest.raises(DataError, match="NaN"):
        fb.fed_fit(fb.models.fedpop_synthetic, {"x": [np.full((3, 20), np.nan)], "y": [np.zeros(3)]})
    res = short_fit
    with pytest.raises(DataError, match="out of range"):
        res.predict({"x": np.zeros((2, 20))}, client=6)
    with pytest.raises(DataError, match="keys"):
        res.predict({"w": np.zeros((2, 20))})
    with pytest.raises(DataError, match="NaN or inf"):
        res.predict({"x": np.full((2, 20), np.inf)})
    with pytest.raises(DataError, match="lacks keys"):
        res.sample_client({"x": np.zeros((3, 20))})
    assert res.predict({"x": np.zeros((2, 20))}, client=1, num_samples=7)["y"].shape == (7, 2)


def test_divergence_is_reported_with_the_round_and_the_cause(data):
    # a plain gradient step of 100 per unit of gradient throws theta where the clients' log-densities overflow
    # (the local moves themselves cannot blow up: tamed, and rejected where non-finite)
    with pytest.raises(fb.DivergenceError, match=r"FedSOUL diverged.*round \d+.*step_size.*server_lr") as info:
        fb.fed_fit(fb.models.fedpop_synthetic, data, fb.FedSOUL(server_optimizer="sgd", server_lr=100.0, num_samples=2,
                                                                warmup=0), num_rounds=30, seed=0, chunk_size=7)
    assert info.value.round < 30 and len(info.value.history["bits_up"]) == info.value.round


def test_a_diverged_fit_returns_everything_up_to_the_last_good_round():
    # GD with a step 0.2 > 2 / L on a quadratic: |1 - gamma L| > 1, the iterates grow geometrically
    # and overflow (float64 here) after a couple of hundred rounds: the clients' uploads turn non-finite
    # first, every one of them at once, which is reported as a divergence, in the middle of a chunk of 7
    data, _ = fb.models.make_glm_clients(4, 3, 30, family="linear", seed=2)
    model = fb.models.linear_regression()
    with pytest.raises(fb.DivergenceError, match=r"GD diverged.*round (\d+).*last good one") as info:
        fb.fed_fit(model, data, fb.GD(step_size=0.2), num_rounds=300, seed=0, chunk_size=7)
    err = info.value
    assert 7 < err.round < 300 and err.round % 7 != 0
    assert len(err.history["bits_up"]) == len(err.result.history["bits_up"]) == err.round
    # the partial result is exactly the fit stopped at the last good round
    clean = fb.fed_fit(model, data, fb.GD(step_size=0.2), num_rounds=err.round, seed=0, chunk_size=7)
    np.testing.assert_array_equal(err.result.params["w"], clean.params["w"])
    np.testing.assert_array_equal(err.history["theta/w"], clean.history["theta/w"])
    assert np.all(np.isfinite(err.result.params["w"]))


def test_same_seed_same_result(data, short_fit):
    a = short_fit
    b = fb.fed_fit(fb.models.fedpop_synthetic, data, fb.FedSOUL(num_samples=5, warmup=5), num_rounds=20, seed=4)
    c = fb.fed_fit(fb.models.fedpop_synthetic, data, fb.FedSOUL(num_samples=5, warmup=5), num_rounds=20, seed=5)
    np.testing.assert_array_equal(a.params["phi"], b.params["phi"])
    np.testing.assert_array_equal(a.local_samples["z"], b.local_samples["z"])
    assert not np.array_equal(a.params["phi"], c.params["phi"])


def test_options_of_the_wrong_kind_are_refused_before_any_compute():
    """Issue 53 (5, 6): the algorithm's class instead of an instance, a progress flag that is not a bool, and a
    number of rounds past the device's 32-bit round counter (2**63 used to be planned chunk by chunk until the
    process was killed for memory)."""
    import numpyro
    import numpyro.distributions as dist

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    data = fb.FederatedData({"y": [np.ones(3)] * 2})
    with pytest.raises(ConfigError, match=r"pass fb.GD\(\)"):
        fb.fed_fit(model, data, fb.GD, num_rounds=5, progress=False)
    for flag in ("no", 1, "False"):
        with pytest.raises(ConfigError, match="progress must be None, True or False"):
            fb.fed_fit(model, data, fb.GD(), num_rounds=5, progress=flag)
    with pytest.raises(ConfigError, match="num_rounds must be at most 2,147,483,647"):
        fb.fed_fit(model, data, fb.GD(), num_rounds=2**63, progress=False)
    assert fb.api.MAX_ROUNDS == 2**31 - 1


@pytest.mark.slow  # three LMC fits, about 13 s
@pytest.mark.filterwarnings("ignore::fedbayes.ConvergenceWarning")  # 20 rounds: the draws, not the fit, are compared
def test_a_jax_key_is_accepted_as_the_seed_it_holds():
    """Issue 52 (8): ``seed=jax.random.PRNGKey(s)`` (or ``jax.random.key(s)``) is the fit of ``seed=s``, draw for draw."""
    import jax
    import numpyro
    import numpyro.distributions as dist

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    data = fb.FederatedData({"y": [np.ones(3), np.zeros(2)]})
    fits = [fb.fed_fit(model, data, fb.LMC(), num_rounds=20, progress=False, seed=s)
            for s in (3, jax.random.PRNGKey(3), jax.random.key(3))]
    for res in fits[1:]:
        assert res.seed == 3
        np.testing.assert_array_equal(res.global_samples["mu"], fits[0].global_samples["mu"])
    with pytest.raises(ConfigError, match="one PRNG key"):
        fb.fed_fit(model, data, fb.LMC(), num_rounds=5, progress=False, seed=jax.random.split(jax.random.PRNGKey(0)))
