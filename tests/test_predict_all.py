"""Predictions for every client in one vectorised call: equal to the one-client calls, one program.

The results are built as the algorithms hand them over (theta*, local draws, global draws) without
running rounds, so nothing here compiles a fit; tests/test_deterministic.py checks the hand-over of
real fits (FedSOUL, LMC, TAMUNA, GD, FedMM).
"""

import numpy as np
import pytest
from test_deterministic import intercepts_result, logistic, point_result, random_intercepts, sampler_result

import fedbayes as fb
from fedbayes.errors import DataError
from fedbayes.introspect import FedModel

# Fits: the second tier (make test-slow, run by .ci/run), to keep make test under 10 minutes.
pytestmark = pytest.mark.slow

CALLS = {"model": 0}


def counted_intercepts(x, y=None):
    """``random_intercepts``, counting how often its Python body runs (once per trace)."""
    CALLS["model"] += 1
    random_intercepts(x, y)


def counted_logistic(x, y=None):
    CALLS["model"] += 1
    logistic(x, y)


def new_inputs(sizes=(4, 2, 6), seed=7, names=None):
    rng = np.random.default_rng(seed)
    return fb.FederatedData({"x": [rng.normal(size=(n, 2)) for n in sizes]}, client_names=names)


def assert_matches_one_client(res, out, new, seed, num_samples=None, sites=None):
    """Entry i of the all-clients predictions equals the one-client call for client i exactly, and its
    rows past client i's size are masked."""
    for i in range(new.num_clients):
        one = res.predict(new.client(i), client=new.client_names[i], num_samples=num_samples, seed=seed)
        assert list(one) == list(out)
        for site, value in one.items():
            got = out[site][i]
            if res._fm.row_axes.get(site) is None:
                assert not np.ma.getmaskarray(got).any()
                np.testing.assert_array_equal(np.ma.getdata(got), value)
            else:
                n = value.shape[1]
                np.testing.assert_array_equal(np.ma.getdata(got)[:, :n], value)
                assert not np.ma.getmaskarray(got)[:, :n].any() and np.ma.getmaskarray(got)[:, n:].all()
            assert got.dtype == value.dtype


@pytest.fixture(scope="module")
def personalised():
    return intercepts_result()[0]


@pytest.mark.parametrize("num_samples", [None, pytest.param(4, marks=pytest.mark.slow)])
def test_all_clients_equal_their_one_client_predictions(personalised, num_samples):
    """Each client predicted from its own local draws (all of them, or the same subsample for every
    client), ragged new inputs padded and masked."""
    res = personalised
    new = new_inputs()
    out = res.predict(new, num_samples=num_samples, seed=5)
    assert list(out) == ["y", "s2", "shift", "mu", "mu2"]
    S = 12 if num_samples is None else num_samples  # 2 chains x 6 draws per client
    assert out["mu"].shape == (3, S, 6) and out["shift"].shape == (3, S)
    assert isinstance(out["y"], np.ma.MaskedArray)
    assert_matches_one_client(res, out, new, 5, num_samples)
    # the mean over draws of a masked row is masked, not a padded row's value
    assert out["mu"].mean(axis=1).mask.tolist() == (~np.asarray(new.mask)).tolist()


@pytest.mark.slow
def test_per_client_lists_and_client_names(personalised):
    res = personalised
    new = new_inputs()
    out = res.predict(new, seed=1)
    as_lists = res.predict({"x": [new.client(i)["x"] for i in range(3)]}, client="all", seed=1)
    for site in out:
        np.testing.assert_array_equal(np.ma.getdata(as_lists[site]), np.ma.getdata(out[site]))
        np.testing.assert_array_equal(np.ma.getmaskarray(as_lists[site]), np.ma.getmaskarray(out[site]))
    # a subset of the fitted clients, in another order, matched by name
    named = new_inputs(sizes=(3, 5), seed=8, names=[2, 0])
    out = res.predict(named, seed=1)
    assert out["mu"].shape[:2] == (2, 12)
    assert_matches_one_client(res, out, named, 1)
    with pytest.raises(DataError, match="not clients of the fit"):
        res.predict(new_inputs(names=["a", "b", "c"]))
    with pytest.raises(DataError, match="pass client='all'"):
        res.predict(new, client=1)


def test_sampler_probabilities_for_all_clients_equal_the_one_client_calls():
    """Globals-only model with sampled globals: every client predicts from the globals' draws, with its own
    keys (independent draws across clients)."""
    from test_deterministic import binary

    data, _ = binary()
    res = sampler_result(logistic, data, {"w": np.random.default_rng(4).normal(size=(2, 15, 2))})
    new = new_inputs()
    probs = res.predictive_probs(new, num_samples=9, seed=3)
    assert probs.shape == (3, 9, 6, 2)
    for i in range(3):
        one = res.predictive_probs(new.client(i), client=i, num_samples=9, seed=3)
        n = one.shape[1]
        np.testing.assert_array_equal(probs.data[i, :, :n], one)
        assert probs.mask[i, :, n:].all() and not probs.mask[i, :, :n].any()
    out = res.predict(new, num_samples=9, seed=3)
    assert_matches_one_client(res, out, new, 3, num_samples=9)
    # the same inputs at two clients: the same draws of w, but each client's own keys for y
    same = fb.FederatedData({"x": [new.client(2)["x"]] * 2})
    y = res.predict(same, seed=0)["y"]
    np.testing.assert_array_equal(res.predict(same, seed=0)["eta"][0], res.predict(same, seed=0)["eta"][1])
    assert (y[0] != y[1]).any()


def test_point_estimate_predictions_for_all_clients():
    from test_deterministic import binary

    data, _ = binary()
    w = np.array([0.9, -1.2])
    res = point_result(logistic, data, {"w": w})
    new = new_inputs()
    out = res.predict(new, seed=2)
    assert out["eta"].shape == (3, 1, 6)
    for i in range(3):
        n = new.sizes[i]
        np.testing.assert_allclose(out["eta"].data[i, 0, :n], new.client(i)["x"] @ w, rtol=1e-12, atol=1e-12)
    assert_matches_one_client(res, out, new, 2)
    probs = res.predictive_probs(new, seed=2)
    x = np.asarray(new.padded["x"])
    p1 = 1.0 / (1.0 + np.exp(-(x @ w)))
    np.testing.assert_allclose(probs.data[:, 0, :, 1], p1, rtol=1e-12)


def test_all_clients_are_one_compiled_program():
    """The model's Python body runs once for all clients (one trace of one program vmapped over clients and
    draws); a loop over clients would run it once per client."""
    from test_deterministic import binary, personalised_result, ragged

    data, _ = ragged()
    b = np.random.default_rng(0).normal(size=(3, 1, 5))
    res = personalised_result(counted_intercepts, data, {"w": np.array([0.8, -0.4]), "s": np.array(0.6)}, {"b": b})
    CALLS["model"] = 0
    res.predict(new_inputs(), seed=0)
    assert CALLS["model"] == 1
    data, _ = binary()
    res = point_result(counted_logistic, data, {"w": np.array([0.9, -1.2])})
    CALLS["model"] = 0
    res.predictive_probs(new_inputs(), seed=0)
    assert CALLS["model"] == 1


@pytest.mark.slow
def test_a_padding_dependent_site_is_only_in_one_client_predictions():
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    def model(x, y=None):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        numpyro.deterministic("x_mean", jnp.mean(x))
        with numpyro.plate("obs", x.shape[0]):
            numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)

    from test_deterministic import ragged

    data, xs = ragged()
    with pytest.warns(UserWarning, match="x_mean"):
        res = point_result(model, data, {"w": np.array([1.0, 2.0])})
    assert isinstance(res._fm, FedModel)
    new = new_inputs()
    assert list(res.predict(new)) == ["y"]
    np.testing.assert_allclose(res.predict(new.client(2))["x_mean"], [np.mean(new.client(2)["x"])], rtol=1e-12)
