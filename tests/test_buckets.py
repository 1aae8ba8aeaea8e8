"""Clients in size buckets (fedbayes.engine.size_buckets), and the mixture E-step's all-components-at-once
evaluation, against exact references: brute-force partitions, padded fits, NumPyro's densities."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedbayes as fb
from fedbayes.algorithms.expfam import _components_mvn_log_probs, derive
from fedbayes.engine import BUCKET_ROW_ROUNDS, Problem, bucketed_clients, round_buckets, size_buckets
from fedbayes.introspect import FedModel

pytestmark = pytest.mark.filterwarnings("ignore::fedbayes.errors.ConvergenceWarning")  # short fits, compared only


def _rows(sizes, groups):
    return sum(len(g) * int(sizes[g].max()) for g in groups)


def _brute_force(sizes, limit, rounds=None):
    """The least objective over every split of the sorted distinct sizes into at most ``limit`` runs."""
    values = np.unique(sizes)
    best = None
    for k in range(1, min(limit, len(values)) + 1):
        for cuts in itertools.combinations(range(1, len(values)), k - 1):
            bounds = [values[c - 1] for c in cuts] + [values[-1]]
            groups = [np.flatnonzero(np.searchsorted(bounds, sizes) == g) for g in range(k)]
            rows = _rows(sizes, groups)
            score = rows if rounds is None else rows * rounds + (k - 1) * BUCKET_ROW_ROUNDS
            best = score if best is None else min(best, score)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_size_buckets_are_the_least_padding_of_any_split(seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 40, size=int(rng.integers(5, 14)))
    for limit in (2, 3, 4):
        groups = size_buckets(sizes, limit)
        got = _rows(sizes, groups) if groups is not None else len(sizes) * sizes.max()
        assert got == _brute_force(sizes, limit)
        if groups is not None:  # a partition of the clients, each group's indices increasing
            assert sorted(np.concatenate(groups).tolist()) == list(range(len(sizes)))
            assert all(np.all(np.diff(g) > 0) for g in groups)
    # with the rounds: the least rows x rounds + a compilation per group
    for rounds in (1, 20_000, 10**6):
        groups = size_buckets(sizes * 1000, 4, rounds)
        k = 1 if groups is None else len(groups)
        rows = _rows(sizes * 1000, groups) if groups is not None else len(sizes) * sizes.max() * 1000
        assert rows * rounds + (k - 1) * BUCKET_ROW_ROUNDS == _brute_force(sizes * 1000, 4, rounds)


def test_size_buckets_none_where_one_group_is_best():
    assert size_buckets(np.full(50, 7), 4) is None  # equal sizes
    assert size_buckets(np.arange(1, 50), 1) is None  # one group asked for
    assert size_buckets(np.arange(50, 151), 4, rounds=10) is None  # too few rounds to repay a compilation
    many = size_buckets(np.random.default_rng(0).integers(1, 100_000, 20_000), 4)  # > 256 distinct sizes
    assert len(many) == 4 and sum(map(len, many)) == 20_000


def test_size_buckets_setting_is_checked():
    for bad in (0, -1, True, 2.5, "none", None):
        with pytest.raises(fb.ConfigError, match="size_buckets"):
            with bucketed_clients(bad):
                pass
    data, _ = fb.models.make_gaussian_mixture(3, num_components=2, dim=1, sizes=(10, 20), seed=0)
    with pytest.raises(fb.ConfigError, match="size_buckets"):
        fb.fed_fit(fb.models.gaussian_mixture(2, 1), data, fb.FedMM(), num_rounds=2, size_buckets=0)


def _mixture():
    data, _ = fb.models.make_gaussian_mixture(9, num_components=3, dim=2, sizes=(10, 80), concentration=0.5, seed=4)
    y = np.asarray(data.pooled()["y"])
    init = {"means": y[[0, 150, 300]]}
    return fb.models.gaussian_mixture(3, 2), data, init


def test_bucketed_fedmm_is_the_padded_fit():
    """FedMM's exact E-step ignores padding: in buckets it is the fit padded to the largest client, up to the
    order of float sums (float64: EM contracts, so the difference stays at rounding level)."""
    model, data, init = _mixture()
    algo = fb.FedMM(init=init)
    run = algo.build(Problem(FedModel(model, data), data, 40))
    assert run.pads_freely
    with bucketed_clients(3):
        parts = round_buckets(run, Problem(None, data, 40), data.num_clients).parts
    assert len(parts) == 3 and sum(p.mask.shape[0] for p in parts) == data.num_clients
    assert sum(p.mask.size for p in parts) < data.mask.size  # fewer padded rows
    fits = [fb.fed_fit(model, data, algo, num_rounds=40, seed=1, size_buckets=k) for k in (1, 3)]
    for key in ("theta/weights", "theta/means", "theta/covs"):
        np.testing.assert_allclose(fits[1].history[key], fits[0].history[key], rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(fits[1].history["bits_up"], fits[0].history["bits_up"])
    np.testing.assert_allclose(fits[1].information, fits[0].information, rtol=1e-8)


def test_bucketed_gaussian_latent_e_step_is_the_padded_one():
    """A per-client Gaussian latent (linear mixed effects): the exact E-step reads only the masked rows too."""
    data, _ = fb.models.make_linear_mixed_effects(12, sizes=(3, 40), seed=5)
    fits = [
        fb.fed_fit(
            fb.models.linear_mixed_effects, data, fb.FedMM(uncertainty=False), num_rounds=30, seed=0, size_buckets=k
        )
        for k in (1, 4)
    ]
    for key in fits[0].params:
        np.testing.assert_allclose(fits[1].params[key], fits[0].params[key], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "algo", [fb.LMC(step_size=1e-3, warmup=0), fb.PELF(downlink=fb.compress.top_k(2), step_size=1e-3, warmup=0)]
)
def test_bucketed_samplers_are_the_padded_ones(algo):
    """A sampler's client gradient is a sum over its masked rows: in buckets the chain is the padded fit's up
    to the order of float sums (the same noise, keys and compression draws per client)."""
    data, _ = fb.models.make_glm_clients(10, 3, (5, 60), seed=2)
    model = fb.models.logistic_regression()
    fits = [fb.fed_fit(model, data, algo, num_rounds=30, seed=3, size_buckets=k) for k in (1, 4)]
    for site, draws in fits[0].global_samples.items():
        np.testing.assert_allclose(fits[1].global_samples[site], draws, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(fits[1].history["bits_up"], fits[0].history["bits_up"])


def test_no_buckets_where_the_client_step_depends_on_its_padding():
    import em_reference as R

    model, data, init = _mixture()
    problem = Problem(FedModel(model, data), data, 40)
    counts = fb.FederatedData({"y": [np.arange(n, dtype=float) % 3 for n in (4, 9, 30, 31)]})
    poisson = Problem(FedModel(R.poisson_random_effects, counts), counts, 40)
    glm, _ = fb.models.make_glm_clients(4, 2, (5, 30), seed=0)
    with bucketed_clients(4):
        chain = fb.FedMM().build(poisson)  # a Monte Carlo E-step: a chain over the client's latents
        assert chain.source.chain and not chain.pads_freely
        assert round_buckets(chain, poisson, counts.num_clients) is None
        batch = fb.FedMM(init=init, batch_size=5).build(problem)  # a minibatch drawn over the padded rows
        assert not batch.pads_freely and round_buckets(batch, problem, data.num_clients) is None
        full = fb.FedMM(init=init).build(problem)
        assert round_buckets(full, problem, data.num_clients) is not None
        assert round_buckets(full, problem, data.num_clients - 1) is None  # a drawn cohort
        lmc_problem = Problem(FedModel(fb.models.logistic_regression(), glm), glm, 40)
        assert round_buckets(fb.LMC(batch_size=3).build(lmc_problem), lmc_problem, glm.num_clients) is None
        assert round_buckets(fb.LMC().build(lmc_problem), lmc_problem, glm.num_clients) is not None
        schools = fb.models.eight_schools_data()
        joint_problem = Problem(FedModel(fb.models.eight_schools, schools), schools, 40)
        joint = fb.JointLMC().build(joint_problem)  # the clients' own latents move with them
        assert not joint.pads_freely and round_buckets(joint, joint_problem, schools.num_clients) is None


def _sites(x, locs, covs, mask):
    """One masked MultivariateNormal site per component, observing the same rows (as the E-step's traces)."""
    fns = [
        dist.MultivariateNormal(
            jnp.broadcast_to(loc, x.shape), covariance_matrix=jnp.broadcast_to(cov, (len(x),) + cov.shape)
        ).mask(mask)
        for loc, cov in zip(locs, covs)
    ]
    for fn in fns[1:]:
        fn._mask = fns[0]._mask
    return [{"value": x, "fn": fn} for fn in fns]


def test_components_log_probs_are_numpyros_on_raw_scale_data():
    """All K components at once, with a shift, against NumPyro's MultivariateNormal component by component:
    exact in float64. In float32, on data 10^4 from the origin (raw units), against the float64 densities of
    the same float32 inputs: as accurate as NumPyro's own float32 evaluation (measured: 0.9e-5 against
    1.4e-5; without the shift the products lose about 4 digits, 1e-2)."""
    rng = np.random.default_rng(0)
    K, D, n = 4, 3, 200
    locs = 1e4 + rng.normal(size=(K, D))
    A = rng.normal(size=(K, D, D))
    covs = A @ np.swapaxes(A, 1, 2) + 0.5 * np.eye(D)
    x = 1e4 + rng.normal(size=(n, D)) * 2
    mask = jnp.asarray(np.arange(n) < 170)

    def exact(x, locs, covs):
        lp = np.stack([np.asarray(dist.MultivariateNormal(locs[k], covs[k]).log_prob(x)) for k in range(K)], -1)
        return np.where(np.asarray(mask)[:, None], lp, 0.0)

    got = _components_mvn_log_probs(_sites(jnp.asarray(x), jnp.asarray(locs), jnp.asarray(covs), mask), 0)
    np.testing.assert_allclose(got.T, exact(x, locs, covs), rtol=1e-11, atol=1e-11)  # laid out (K, N)

    x32, locs32, covs32 = (np.asarray(a, np.float32) for a in (x, locs, covs))
    truth = exact(*(a.astype(np.float64) for a in (x32, locs32, covs32)))
    got32 = _components_mvn_log_probs(_sites(jnp.asarray(x32), jnp.asarray(locs32), jnp.asarray(covs32), mask), 0)
    own = np.stack([np.asarray(dist.MultivariateNormal(locs32[k], covs32[k]).log_prob(x32)) for k in range(K)], -1)
    own_err = np.max(np.abs(np.where(np.asarray(mask)[:, None], own, 0.0) - truth))
    assert np.max(np.abs(np.asarray(got32, np.float64).T - truth)) <= 2 * own_err
    # not of that form (a different value per component): evaluated component by component instead
    sites = _sites(jnp.asarray(x), jnp.asarray(locs), jnp.asarray(covs), mask)
    sites[1] = dict(sites[1], value=sites[1]["value"] + 0.0)
    assert _components_mvn_log_probs(sites, 0) is None


def test_mixture_statistics_at_once_are_each_components():
    """The E-step's statistics of an observed table for all components at once equal each component's own
    (complete_stats with the component's responsibilities as weights)."""
    model, data, init = _mixture()
    fm = FedModel(model, data)
    d = derive(fm)
    theta_u = fm.init_globals(jax.random.PRNGKey(0), init)
    theta_c = fm.constrain(theta_u)
    x, mask = {k: v[2] for k, v in data.padded.items()}, data.mask[2]
    stats, local = d.e_step(theta_u, x, mask)
    resp = local["responsibilities"]
    for k in range(3):
        own = d.complete_stats(theta_c, {"z": jnp.full(mask.shape, k)}, x, mask, resp[:, k] * mask, component=k)
        for site, values in own.items():
            for name, v in values.items():
                np.testing.assert_allclose(stats[site][name][k], v, rtol=1e-12, atol=1e-12)


def test_model_arguments_are_checked_eagerly_not_under_a_trace():
    """NumPyro's argument checks: kept for concrete values (an invalid model fails loudly), skipped while
    tracing (where they cannot fail, but cost a Cholesky factorisation per MultivariateNormal), and the
    setting is restored after."""
    seen = []

    def model(y):
        seen.append(dist.Distribution._validate_args)
        scale = numpyro.param("scale", 1.0)
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(0.0, scale), obs=y)

    data = fb.FederatedData({"y": [np.ones(3), np.ones(4)]})
    fm = FedModel(model, data)
    before = dist.Distribution._validate_args
    x, mask = {"y": data.padded["y"][0]}, data.mask[0]
    with pytest.raises(ValueError, match="invalid scale"):
        fm._client_trace({"scale": jnp.asarray(-1.0)}, x, mask)
    seen.clear()
    jax.jit(lambda s: fm._client_trace({"scale": s}, x, mask)["y"]["fn"].log_prob(x["y"]))(jnp.asarray(2.0))
    assert seen == [False] and dist.Distribution._validate_args == before
