"""FedMM / FedEM against exact references: centralised EM, scikit-learn, statsmodels, Louis' identity."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from jax.flatten_util import ravel_pytree
from jax.scipy.special import logsumexp
from jax.scipy.stats import multivariate_normal as mvn
from numpyro.distributions import constraints

import em_reference as R
import fedbayes as fb
from fedbayes.wire import decode_tree
from fedbayes.engine import Problem, fault_counts, make_round, stack_clients
from fedbayes.introspect import FedModel

K, D = 3, 2


@pytest.fixture(scope="module")
def gmm():
    data, _ = fb.models.make_gaussian_mixture(6, num_components=K, dim=D, sizes=(30, 90), concentration=0.3, seed=3)
    y = np.asarray(data.pooled()["y"])
    init = {"weights": np.ones(K) / K, "means": y[[0, 100, 200]], "covs": np.broadcast_to(np.eye(D), (K, D, D)).copy()}
    return data, y, init, fb.models.gaussian_mixture(K, D)


@pytest.fixture(scope="module")
def centralised(gmm):
    """FedMM with gamma = 1, p = 1, no compression: must be centralised EM."""
    data, y, init, model = gmm
    return fb.fed_fit(model, data, fb.FedMM(init=init), num_rounds=150, seed=0)


def _match(a, b):
    """Permutation-invariant max distance between component means."""
    from itertools import permutations
    return min(np.max(np.abs(a[list(p)] - b)) for p in permutations(range(len(a))))


def test_fedmm_is_centralised_em_iterate_by_iterate(gmm, centralised):
    data, y, init, _ = gmm
    params, iterates = R.run_em(lambda **p: R.gmm_em_step(y, **p), init, 152)
    # init: a federated E-step at theta_0 and T give theta_1; round t reports theta_{t+2}
    for key in ("weights", "means", "covs"):
        ref = np.stack([it[key] for it in iterates[2:152]])
        np.testing.assert_allclose(centralised.history[f"theta/{key}"], ref, rtol=1e-10, atol=1e-12)


def test_fedmm_fixed_point_is_sklearns(gmm, centralised):
    from sklearn.mixture import GaussianMixture

    data, y, init, _ = gmm
    gm = GaussianMixture(K, covariance_type="full", reg_covar=0.0, tol=1e-14, max_iter=5000,
                         weights_init=init["weights"], means_init=init["means"],
                         precisions_init=np.linalg.inv(init["covs"])).fit(y)
    np.testing.assert_allclose(centralised.params["weights"], gm.weights_, atol=1e-6)
    np.testing.assert_allclose(centralised.params["means"], gm.means_, atol=1e-6)
    np.testing.assert_allclose(centralised.params["covs"], gm.covariances_, atol=1e-6)


def test_louis_information_equals_autodiff_marginal_hessian(gmm, centralised):
    """Louis' identity (exact for enumerated latents) vs -Hessian of the pooled log marginal likelihood."""
    data, y, _, model = gmm
    fm = FedModel(model, data)
    theta_u = fm.unconstrain(centralised.params)
    flat, unravel = ravel_pytree(theta_u)

    def loglik(x):
        p = fm.constrain(unravel(x))
        comp = jnp.stack([mvn.logpdf(y, p["means"][k], p["covs"][k]) for k in range(K)], -1)
        return jnp.sum(logsumexp(comp + jnp.log(p["weights"]), -1))

    ref = -jax.jit(jax.hessian(loglik))(flat)
    np.testing.assert_allclose(centralised.information, ref, rtol=1e-7, atol=1e-7 * np.max(np.abs(ref)))
    cov = np.linalg.inv(np.asarray(ref))
    assert np.all(np.linalg.eigvalsh(cov) > 0)
    # standard errors of the means by the delta method (means are unconstrained: identity Jacobian)
    offset = len(ravel_pytree({k: theta_u[k] for k in sorted(theta_u) if k < "means"})[0])
    se_means = np.sqrt(np.diag(cov))[offset:offset + K * D].reshape(K, D)
    np.testing.assert_allclose(centralised.standard_errors["means"], se_means, rtol=1e-6)
    approx = fb.result.group(centralised.idata, "fed_normal_approx")  # the globals' N(theta_hat, I^-1) draws
    assert approx["means"].shape == (1, 500, K, D) and not hasattr(centralised.idata, "posterior")
    resp = centralised.local_info["responsibilities"]
    assert resp.shape == (6, data.padded["y"].shape[1], K)
    np.testing.assert_allclose(resp.sum(-1), np.asarray(data.mask, float), atol=1e-12)


@pytest.mark.parametrize("alpha, converges", [(None, True), (0.0, False)])
def test_control_variates_under_partial_participation_and_quantisation(gmm, centralised, alpha, converges):
    """p = 0.5 and QSGD: with control variates the exact centralised fixed point, without them a noise ball.

    Exact local E-steps, so the only randomness is participation and quantisation; Theorem 1 (B) with
    alpha > 0 drives the field h to 0, while alpha = 0 keeps an O(gamma) floor (the digest's T5b).
    """
    data, y, init, model = gmm
    algo = fb.FedMM(init=init, participation=0.5, compressor=fb.compress.qsgd(7), step_size=0.2, alpha=alpha,
                    uncertainty=False)
    res = fb.fed_fit(model, data, algo, num_rounds=800, seed=1)
    gap = max(np.max(np.abs(res.params[k] - centralised.params[k])) for k in ("weights", "means", "covs"))
    if converges:
        assert gap < 1e-8
    else:
        assert gap > 1e-3
    assert 0 < res.history["participants"].mean() < 6  # Bernoulli(0.5) of 6 clients
    per_round = res.history["bits_up"] / np.maximum(res.history["participants"], 1)
    q = K * (2 + D + D * D)
    assert np.all(per_round[res.history["participants"] > 0] == fb.compress.qsgd(7).bits(q))


def test_server_v_is_weighted_sum_of_client_v(gmm):
    """Proposition 5: V = sum_i mu_i V_i after every round (one compiled round, stepped by hand)."""
    data, _, init, model = gmm
    fm = FedModel(model, data)
    algo = fb.FedMM(init=init, participation=0.5, compressor=fb.compress.qsgd(3), step_size=0.3, uncertainty=False)
    problem = Problem(fm, data, 8, data.num_clients)
    run = algo.build(problem)
    carry = run.init(jax.random.PRNGKey(0), problem)
    round_fn = jax.jit(make_round(run, stack_clients(data), data.num_clients, data.num_clients, jax.random.PRNGKey(1)))
    mu = np.asarray(data.sizes) / np.sum(data.sizes)
    active = []
    for t in range(8):
        carry, record = round_fn(carry, t)
        server, clients, _ = carry
        np.testing.assert_allclose(server.v, mu @ np.asarray(clients.v), rtol=1e-12, atol=1e-14)
        active.append(int(fault_counts({"_fault_kind": np.asarray(record["_fault_kind"])[None]})["active"][0]))
    assert min(active) < data.num_clients  # the invariant was exercised under partial participation


def test_uploads_are_statistics_not_data(gmm):
    """What crosses the network is one q-vector per client, the same size for every client size."""
    data, _, init, model = gmm
    fm = FedModel(model, data)
    problem = Problem(fm, data, 1, data.num_clients)
    run = fb.FedMM(init=init, uncertainty=False).build(problem)
    server, states, broadcast = run.init(jax.random.PRNGKey(0), problem)
    clients = stack_clients(data)
    for i in range(data.num_clients):
        one = jax.tree_util.tree_map(lambda a: a[i], (states, clients))
        _, up = run.client_step(jax.random.PRNGKey(i), decode_tree(broadcast.payload), *one)
        up = up._replace(payload=decode_tree(up.payload))
        assert up.payload.shape == (K * (2 + D + D * D),)  # counts, sums and second moments per component
        assert int(up.bits) == 32 * up.payload.size


def _exponential(y):
    rate = numpyro.param("rate", 1.0, constraint=constraints.positive)
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Exponential(rate), obs=y)


def test_remark_1_statistics_vs_parameter_averaging():
    """FedMM Remark 1's phenomenon: averaging surrogates is centralised ML, averaging parameters is not.

    Exponential(rate): T(s) = s0 / s1, so the centralised (and FedMM) answer is 1 / pooled mean, while
    parameter averaging returns sum_i mu_i / mean_i.
    """
    rng = np.random.default_rng(0)
    ys = [rng.exponential(m, size=n) for m, n in ((0.5, 40), (2.0, 60), (8.0, 100))]
    data = fb.FederatedData({"y": ys})
    res = fb.fed_fit(_exponential, data, fb.FedMM(uncertainty=False), num_rounds=2, seed=0)
    pooled = np.concatenate(ys)
    np.testing.assert_allclose(res.params["rate"], 1.0 / pooled.mean(), rtol=1e-12)
    avg = fb.fed_fit(_exponential, data, fb.ParamAveragingEM(uncertainty=False), num_rounds=2, seed=0)
    mu = np.array([len(y) for y in ys]) / len(pooled)
    np.testing.assert_allclose(avg.params["rate"], mu @ np.array([1.0 / y.mean() for y in ys]), rtol=1e-12)
    assert abs(avg.params["rate"] / res.params["rate"] - 1) > 0.5


def test_custom_statistics_protocol():
    """Hand-written S and T plug in through fb.CustomStatistics and give the derived answer."""
    rng = np.random.default_rng(1)
    ys = [rng.exponential(m, size=n) for m, n in ((0.5, 40), (2.0, 60))]
    data = fb.FederatedData({"y": ys})
    custom = fb.CustomStatistics(
        e_step=lambda theta, d, mask: {"n": jnp.sum(mask), "sum": jnp.sum(jnp.where(mask, d["y"], 0.0))},
        m_step=lambda s: {"rate": s["n"] / s["sum"]},
    )
    res = fb.fed_fit(_exponential, data, fb.FedMM(statistics=custom), num_rounds=2, seed=0)
    np.testing.assert_allclose(res.params["rate"], 1.0 / np.concatenate(ys).mean(), rtol=1e-12)


@pytest.mark.slow  # second tier (make test-slow): ~18 s
def test_linear_mixed_effects_em_matches_statsmodels():
    import statsmodels.api as sm

    data, _ = fb.models.make_linear_mixed_effects(30, seed=2)
    res = fb.fed_fit(fb.models.linear_mixed_effects, data, fb.FedMM(), num_rounds=700, seed=0, chunk_size=350)
    pooled = data.pooled()
    groups = data.pooled_client_ids()
    sm_fit = sm.MixedLM(np.asarray(pooled["y"]), np.asarray(pooled["x"]), groups, exog_re=np.asarray(pooled["z"])).fit(
        reml=False, method="bfgs", maxiter=2000, gtol=1e-10)
    np.testing.assert_allclose(res.params["beta"], sm_fit.fe_params, atol=1e-5)
    np.testing.assert_allclose(res.params["sigma"] ** 2, sm_fit.scale, rtol=1e-5)
    L = res.params["scale_tril"]
    np.testing.assert_allclose(L @ L.T, sm_fit.cov_re, atol=1e-4)
    # Louis (exact for per-client Gaussian latents) vs autodiff of the closed-form marginal likelihood
    from lme_reference import marginal_loglik

    fm = FedModel(fb.models.linear_mixed_effects, data)
    flat, unravel = ravel_pytree(fm.unconstrain(res.params))
    ref = -jax.jit(jax.hessian(lambda x: marginal_loglik(fm.constrain(unravel(x)), data)))(flat)
    np.testing.assert_allclose(res.information, ref, rtol=1e-6, atol=1e-6 * np.max(np.abs(ref)))
    assert fb.result.group(res.idata, "posterior")["b"].shape[:3] == (1, 500, 30)  # exact local posterior draws


def test_bad_configurations_are_refused():
    with pytest.raises(fb.ConfigError, match="participation"):
        fb.FedMM(participation=0.0)
    with pytest.raises(fb.ConfigError, match="step_size"):
        fb.FedMM(step_size=1.5)
    with pytest.raises(fb.ConfigError, match="alpha"):
        fb.FedMM(alpha=2.0)
    with pytest.raises(fb.ConfigError):
        fb.FedMM(compressor=fb.compress.top_k(2))
    with pytest.raises(fb.ConfigError, match="baseline"):
        fb.ParamAveragingEM(participation=0.5)


def test_monte_carlo_e_step_reaches_the_marginal_mle():
    """Stochastic EM with Langevin E-steps for a non-conjugate random effect vs quadrature ML.

    log p(y_i | mu, tau) = log int prod_j Poisson(y_ij; e^b) N(b; mu, tau^2) db by 80-node Gauss-Hermite
    quadrature, maximised by scipy. The fit averages S over the last half of the rounds. Its error has
    two parts: Monte Carlo noise of the averaged statistic and ULA's O(step) inflation of the local
    posterior variance (step 0.1 / L_i), which biases tau upwards. Over seeds 0-3 the errors were
    -0.021..-0.003 (mu) and +0.017..+0.045 (tau), i.e. at most 0.18 and 0.45 of the estimates' own
    standard errors (0.116 and 0.100, from the quadrature Hessian). The test asserts half a standard
    error: the statistical precision of the data, which a wrong E-step or M-step would exceed.
    """
    import scipy.optimize as so
    from scipy.special import gammaln as lg

    rng = np.random.default_rng(0)
    b = 0.3 + 0.6 * rng.normal(size=25)
    ys = [rng.poisson(np.exp(bi), size=int(rng.integers(4, 12))).astype(float) for bi in b]
    data = fb.FederatedData({"y": ys})
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)

    def negloglik(x):
        mu, tau = x[0], np.exp(x[1])
        total = 0.0
        for y in ys:
            bb = mu + tau * nodes
            lp = np.sum(y[:, None] * bb - np.exp(bb) - lg(y + 1)[:, None], 0)
            total += np.log(np.sum(weights * np.exp(lp - lp.max())) / np.sqrt(2 * np.pi)) + lp.max()
        return -total

    opt = so.minimize(negloglik, np.array([0.0, 0.0]), method="Nelder-Mead", options={"xatol": 1e-10, "fatol": 1e-12})
    mu_hat, tau_hat = opt.x[0], np.exp(opt.x[1])
    f = lambda mu, tau: negloglik(np.array([mu, np.log(tau)]))  # noqa: E731
    h = 1e-4
    se_mu = 1 / np.sqrt((f(mu_hat + h, tau_hat) - 2 * f(mu_hat, tau_hat) + f(mu_hat - h, tau_hat)) / h**2)
    se_tau = 1 / np.sqrt((f(mu_hat, tau_hat + h) - 2 * f(mu_hat, tau_hat) + f(mu_hat, tau_hat - h)) / h**2)
    res = fb.fed_fit(R.poisson_random_effects, data, fb.FedMM(step_size=0.5, uncertainty=False), num_rounds=300, seed=0)
    assert abs(res.params["mu"] - mu_hat) < 0.5 * se_mu
    assert abs(res.params["tau"] - tau_hat) < 0.5 * se_tau


def test_a_start_that_makes_the_model_invalid_is_named_as_for_every_algorithm():
    """The prior's centre a = 0 makes log(a) an invalid location: FedMM said it diverged at round 0 and blamed
    its step (found by the fuzzing harness's start-validity class); it now refuses as GD and LMC do."""

    def log_of_centre(y):
        a = numpyro.sample("a", dist.Normal(0.0, 1.0))
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(jnp.log(a), 1.0), obs=y)

    data = fb.FederatedData({"y": [np.zeros(3), np.ones(2)]})
    for algo in (fb.FedMM(), fb.GD()):
        with pytest.raises(fb.ModelError, match="invalid at its starting values"):
            fb.fed_fit(log_of_centre, data, algo, num_rounds=2, progress=False)
