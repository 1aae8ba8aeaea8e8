"""Padded rows never enter a likelihood silently.

Clients are padded to a common length and only sites inside a data plate are masked. A model that
reduces over its client's rows outside a plate (``numpyro.factor`` of a sum, ``obs=y.mean()``, a
term using ``x.shape[0]``) would count the padding: with clients of 4 and 1 points, client 1's
log-likelihood was -44.2 where NumPyro gives -11.0, and GD's MAP 1.43 against 1.094. Such models are
refused before any computation, by every algorithm; the same likelihood written per observation
inside the plate gives NumPyro's exact pooled log-density on ragged clients.
"""

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.infer.util import log_density

import fedbayes as fb

RNG = np.random.default_rng(0)
X = [RNG.normal(size=4), RNG.normal(size=1)]
Y = [1.0 + xi + RNG.normal(size=xi.shape) for xi in X]


@pytest.fixture(scope="module")
def ragged():
    return fb.FederatedData({"x": X, "y": Y})


def factor_of_sum(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    numpyro.factor("lik", dist.Normal(w * x, 1.0).log_prob(y).sum())


def observed_mean(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    numpyro.sample("ybar", dist.Normal(w, 1.0 / jnp.sqrt(x.shape[0])), obs=y.mean())


def prior_uses_row_count(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0 / x.shape[0]))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(w * x, 1.0), obs=y)


def reduction_inside_plate(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(w * (x - x.mean()), 1.0), obs=y)


def per_row_factor(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.factor("lik", dist.Normal(w * x, 1.0).log_prob(y))


ALGORITHMS = [fb.TAMUNA(s=2), fb.GD(), fb.LMC(), fb.DELF(), fb.QLSD(), fb.FedSOUL(), fb.FedMM()]


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: type(a).__name__)
def test_every_algorithm_refuses_a_factor_of_a_sum_before_computing(ragged, algorithm):
    with pytest.raises(fb.ModelError, match=r"site 'lik'.*outside the data plate.*numpyro.plate"):
        fb.fed_fit(factor_of_sum, ragged, algorithm, num_rounds=5, progress=False)


@pytest.mark.parametrize("model, site", [(observed_mean, "ybar"), (prior_uses_row_count, "w"),
                                         (reduction_inside_plate, "y")])
def test_other_padding_dependent_terms_are_refused(ragged, model, site):
    with pytest.raises(fb.ModelError, match=f"site '{site}'"):
        fb.FedModel(model, ragged)


def test_refused_even_when_all_clients_have_one_size():
    """Equal sizes need no padding today, but predictions and deployments pad: refused all the same."""
    data = fb.FederatedData({"x": [X[0], X[0] + 1.0], "y": [Y[0], Y[0]]})
    with pytest.raises(fb.ModelError, match="site 'lik'"):
        fb.FedModel(factor_of_sum, data)


def test_per_row_likelihood_gives_numpyro_pooled_log_density_on_ragged_clients(ragged):
    assert jnp.result_type(float) == jnp.float64  # the suite runs in float64 (conftest)
    fm = fb.FedModel(per_row_factor, ragged)
    pooled = ragged.pooled()
    for w in (-1.3, 0.2, 1.094):
        ours = fm.federated_log_density({"w": jnp.asarray(w)}, {}, ragged)
        ref, _ = log_density(per_row_factor, (), pooled, {"w": w})
        np.testing.assert_allclose(ours, ref, rtol=1e-12)
    # the short client (1 real row, 3 padded) alone: exactly NumPyro's value of its single row
    _, lik1 = fm.client_log_terms({"w": jnp.asarray(0.5)}, {}, {k: v[1] for k, v in ragged.padded.items()},
                                  ragged.mask[1])
    np.testing.assert_allclose(lik1, dist.Normal(0.5 * X[1], 1.0).log_prob(Y[1]).sum(), rtol=1e-12)


def test_gd_map_of_per_row_model_equals_closed_form(ragged):
    """w ~ N(0, 1), y ~ N(w x, 1): the MAP is sum(x y) / (1 + sum(x^2)) on the pooled data."""
    x, y = np.concatenate(X), np.concatenate(Y)
    exact = float(x @ y / (1.0 + x @ x))
    res = fb.fed_fit(per_row_factor, ragged, fb.GD(), num_rounds=400, progress=False)
    np.testing.assert_allclose(float(res.params["w"]), exact, rtol=1e-6)


def subsampled(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    with numpyro.plate("obs", x.shape[0], subsample_size=2) as idx:
        numpyro.sample("y", dist.Normal(w * x[idx], 1.0), obs=y[idx])


def test_a_subsampled_plate_is_refused_before_computing(ragged):
    """A plate with subsample_size asks for minibatches, which FedMM does not take from the model (its own
    ``batch_size`` draws them; tests/test_minibatch.py): refused, never silently wrong."""
    with pytest.raises(fb.ModelError, match=r"data plate subsamples 2 rows.*but FedMM evaluates every client's likelihood on all of its rows; remove subsample_size"):
        fb.fed_fit(subsampled, ragged, fb.FedMM(), num_rounds=5, progress=False)


def test_a_plate_whose_subsample_is_the_whole_client_is_accepted(ragged):
    def full(x, y):
        w = numpyro.sample("w", dist.Normal(0.0, 1.0))
        with numpyro.plate("obs", x.shape[0], subsample_size=x.shape[0]):
            numpyro.sample("y", dist.Normal(w * x, 1.0), obs=y)

    fm = fb.FedModel(full, ragged)
    assert fm.data_plates == frozenset({"obs"})


def slope_times_sum(x, y):
    """A padding-dependent term that vanishes where its latent is 0 (the mean of its prior)."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(x, 1.0), obs=y)
    numpyro.factor("drift", w * jnp.sum(y))


def test_the_check_takes_spread_latent_values_not_a_centre(ragged):
    """The padding check evaluates the model at spread latent values (``_spread_value``: uniform on (-2, 2) in the
    unconstrained space, fixed per site name), not at a prior's centre where a term like w * sum(y) would vanish
    and hide the padding; discrete and observed sites keep the model's own draw."""
    from fedbayes.introspect import _spread_value

    with pytest.raises(fb.ModelError, match="drift"):
        fb.FedModel(slope_times_sum, ragged)
    site = {"type": "sample", "name": "s", "fn": dist.HalfNormal(1.0).expand([3]), "is_observed": False}
    first, again = np.asarray(_spread_value(site)), np.asarray(_spread_value(dict(site)))
    np.testing.assert_array_equal(first, again)  # the same values for the same site name
    assert first.shape == (3,) and np.all(first > 0) and np.ptp(first) > 0  # in the support, spread
    u = np.log(first)  # HalfNormal's support (0, inf): exp of the unconstrained value
    assert np.all(np.abs(u) < 2)
    assert _spread_value({**site, "fn": dist.Bernoulli(0.5)}) is None
    assert _spread_value({**site, "is_observed": True}) is None
    assert _spread_value({"type": "deterministic", "name": "d"}) is None
