"""FedSOUL against exact references: MML of a linear mixed model (closed form and statsmodels),
unbiased aggregation under partial participation and compression, predictions, ledger, config."""

import warnings

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
import numpy as np
import pytest

import fedbayes as fb
from fedbayes.wire import decode_tree
from fedbayes.algorithms.fedsoul import Upload
from fedbayes.engine import Message, Problem, RoundInfo, sample_cohort, stack_clients
from fedbayes.errors import ConfigError
from fedbayes.optim import polynomial_decay
from lme_reference import local_posterior, mml
from real_data import poisson_glmm


@pytest.fixture(scope="module")
def lme_fit():
    data, _ = fb.models.make_linear_mixed_effects(40, seed=0)
    algo = fb.FedSOUL(local_steps=20, step_scale=0.1, server_optimizer="sgd",
                      server_lr=polynomial_decay(1e-3, 0.6, 20.0), average_from=0.3)
    res = fb.fed_fit(fb.models.linear_mixed_effects, data, algo, num_rounds=3000, seed=0)
    return data, res, mml(data)


def _batch_means_se(traj, start, n_batches=20):
    """Monte Carlo standard error of the mean of an autocorrelated trajectory (batch means)."""
    x = np.asarray(traj[start:])
    x = x[: len(x) // n_batches * n_batches].reshape(n_batches, -1, *x.shape[1:]).mean(1)
    return x.std(0, ddof=1) / np.sqrt(n_batches)


def test_reference_mml_agrees_with_statsmodels(lme_fit):
    sm = pytest.importorskip("statsmodels.api")
    data, _, ref = lme_fit
    pooled, groups = data.pooled(), data.pooled_client_ids()
    fit = sm.MixedLM(pooled["y"], pooled["x"], groups=groups, exog_re=pooled["z"]).fit(reml=False, method="lbfgs")
    np.testing.assert_allclose(fit.fe_params, ref["beta"], atol=1e-4)
    np.testing.assert_allclose(np.asarray(fit.cov_re), ref["scale_tril"] @ ref["scale_tril"].T, atol=1e-4)
    assert np.sqrt(fit.scale) == pytest.approx(float(ref["sigma"]), abs=1e-4)


def test_fedsoul_recovers_maximum_marginal_likelihood(lme_fit):
    data, res, ref = lme_fit
    start = int(0.3 * 3000)
    mcse = _batch_means_se(res.history["theta/beta"], start)
    err = np.abs(res.params["beta"] - ref["beta"])
    # The federated error must be (i) within 4 Monte Carlo standard errors of the stochastic
    # approximation plus the O(step_scale) ULA bias of the variance components it feeds back
    # (bounded by 0.1 standard errors of the estimate, measured over seeds 0-3 at 0.03-0.24 SE in
    # total), and (ii) small against the statistical uncertainty of the MML estimate itself.
    np.testing.assert_array_less(err, 4 * mcse + 0.1 * ref["beta_se"])
    np.testing.assert_array_less(err, 0.3 * ref["beta_se"])
    cov = res.params["scale_tril"] @ res.params["scale_tril"].T
    ref_cov = ref["scale_tril"] @ ref["scale_tril"].T
    # variance components carry the ULA covariance inflation (~ step_scale / 2 on the stiffest local
    # direction, i.e. <= 5%, much less on the pooled estimate): 2% of the variances.
    np.testing.assert_allclose(cov, ref_cov, atol=0.02 * np.max(np.diag(ref_cov)))
    assert res.params["sigma"] == pytest.approx(float(ref["sigma"]), rel=0.01)


def test_automatic_steps_follow_each_clients_curvature(lme_fit):
    data, res, _ = lme_fit
    # The local posterior is Gaussian, so the Hessian is constant. The default metric for 2 local coordinates
    # is the local Hessian's inverse, in which every direction has unit curvature: gamma_i = step_scale exactly.
    assert res.settings["local_metric"] == "dense"
    np.testing.assert_allclose(res.client_info["step_size"], 0.1, rtol=1e-6)
    # With the identity metric gamma_i = step_scale / lambda_max(P_i) (the MALA default step_scale is 1.0):
    # clients with more data take smaller steps.
    ident = fb.fed_fit(fb.models.linear_mixed_effects, data, fb.FedSOUL(local_metric="identity", num_samples=10,
                                                                          warmup=10), num_rounds=5, seed=0)
    assert ident.settings["step_scale"] == 1.0 and ident.settings["local_kernel"] == "mala"
    lam = np.array([np.linalg.eigvalsh(np.linalg.inv(local_posterior(ident.params, data.client(i))[1])).max()
                    for i in range(data.num_clients)])
    # The final step is a_i step_scale / lambda_max, with MALA's acceptance factor 0 < a_i <= 1
    # (fedsoul.ACCEPTANCE_TARGET): it backs off only after moves accepted below 0.574 on average, which
    # on these 2-d Gaussians with the step 1 / lambda_max is the exception (measured: 4 of 40 clients, by
    # 0.7-3%). So every ratio is at most 1, and most are 1 to float rounding.
    ratio = ident.client_info["step_size"] * lam
    assert np.all((ratio > 0) & (ratio <= 1 + 1e-4)), ratio
    assert np.mean(np.abs(ratio - 1) < 1e-4) >= 0.75, ratio
    big, small = np.argmax(data.sizes), np.argmin(data.sizes)
    assert ident.client_info["step_size"][big] < ident.client_info["step_size"][small]


def test_local_posteriors_match_the_exact_gaussian(lme_fit):
    data, res, _ = lme_fit
    b = res.local_samples["b"]  # (clients, draws, 2)
    assert b.shape == (40, 400, 2)  # 2 chains x 200 draws, pooled
    m, _ = local_posterior(res.params, data.client(0))
    # 400 thinned, autocorrelated ULA draws: a loose but failing-if-wrong check (posterior sd <= 0.9)
    np.testing.assert_allclose(b[0].mean(0), m, atol=0.35)
    means = np.array([local_posterior(res.params, data.client(i))[0] for i in range(40)])
    assert np.corrcoef(b.mean(1)[:, 0], means[:, 0])[0, 1] > 0.95


def _mixed_problem(num_clients=20):
    data, _ = fb.models.make_linear_mixed_effects(num_clients, seed=1)
    return Problem(fb.FedModel(fb.models.linear_mixed_effects, data), data, 10)


@pytest.mark.parametrize("compressor", [fb.compress.identity(), fb.compress.rand_k(2), fb.compress.qsgd(2)])
def test_partial_participation_and_compression_keep_the_server_update_unbiased(compressor):
    # E[theta_{k+1} - theta_k] under random cohorts and compression equals the full, exact update
    # sum_i G_i (sgd with lr 1, no global prior since all globals are params).
    problem = _mixed_problem()
    run = fb.FedSOUL(server_optimizer="sgd", server_lr=1.0, compressor=compressor).build(problem)
    server, _, _ = run.init(jax.random.PRNGKey(0), problem)
    C, c, T = 20, 5, 4000
    grads = jax.vmap(lambda k: {n: jax.random.normal(k, v.shape) for n, v in server.theta.items()})(
        jax.random.split(jax.random.PRNGKey(1), C))
    full = jax.tree_util.tree_map(lambda g: g.sum(0), grads)

    def one(key):
        k1, k2, k3 = jax.random.split(key, 3)
        cohort = sample_cohort(k1, C, c)
        hat, bits = jax.vmap(run._compress)(jax.random.split(k2, c), jax.tree_util.tree_map(lambda g: g[cohort], grads))
        up = Message(decode_tree(Upload(hat, jnp.zeros(c))), bits)  # as the engine delivers it
        new, _, _ = run.server_step(k3, server, up, RoundInfo(jnp.asarray(5), cohort, jnp.ones(c, bool), C))
        return jax.tree_util.tree_map(jnp.subtract, new.theta, server.theta)

    steps = jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(2), T))
    for name in full:
        s, f = np.asarray(steps[name]).reshape(T, -1), np.asarray(full[name]).reshape(-1)
        se = s.std(0) / np.sqrt(T) + 1e-12
        np.testing.assert_array_less(np.abs(s.mean(0) - f), 5 * se + 1e-9)
        assert np.any(s.std(0) > 0)  # the update really is random (the check is not vacuous)


def _poisson_score_by_quadrature(x, y, beta, tau):
    """The exact gradient of sum_i log p(y_i | beta, tau) in (beta, log tau): the Fisher identity's
    expectations over each client's one-dimensional posterior of b_i on a fine grid."""
    grid = np.linspace(-30, 30, 60001)
    eta = np.einsum("cnp,p->cn", x, beta)[:, :, None] + grid
    lp = np.sum(y[:, :, None] * eta - np.exp(eta), 1) - 0.5 * grid**2 / tau**2
    w = np.exp(lp - lp.max(1, keepdims=True))
    w /= w.sum(1, keepdims=True)
    g_beta = np.einsum("cnp,cng,cg->p", x, y[:, :, None] - np.exp(eta), w)
    g_log_tau = np.sum(np.sum(w * grid**2, 1) / tau**2 - 1)
    return np.append(g_beta, g_log_tau)


def _poisson_random_intercepts():
    """50 clients of 4 Poisson counts with random intercepts (x, y as arrays), their Problem and a built FedSOUL."""
    rng = np.random.default_rng(0)
    C, n = 50, 4
    x = np.stack([np.ones((C, n)), np.repeat(rng.normal(size=(C, 1)), n, 1), rng.integers(0, 2, (C, n))], -1)
    y = rng.poisson(np.exp(x @ np.array([2.0, 0.5, -0.2]) + rng.normal(0, 0.5, (C, 1)))).astype(float)
    data = fb.FederatedData({"x": list(x), "y": list(y)})
    problem = Problem(fb.FedModel(poisson_glmm, data), data, 10)
    return x, y, problem, fb.FedSOUL().build(problem)


def _poisson_start(problem, run, beta, tau):
    """(theta, the stacked clients, every client's set-up state) at the constrained (beta, tau)."""
    theta = problem.model.unconstrain({"beta": jnp.asarray(beta), "tau": jnp.asarray(tau)})
    clients = jax.tree_util.tree_map(jnp.asarray, stack_clients(problem.data))
    keys = jax.random.split(jax.random.PRNGKey(0), problem.data.num_clients)
    states, _ = jax.jit(jax.vmap(lambda k, c: run.setup_client(0, k, theta, None, c)))(keys, clients)
    return theta, clients, states


@pytest.mark.slow  # second tier: ~30 s
def test_fisher_gradient_is_exact_on_a_poisson_random_intercept_model():
    """At a fixed theta away from the optimum, FedSOUL's uploads averaged over 300 rounds equal the exact
    gradient of the marginal log-likelihood (quadrature), within 4 batch-means standard errors. The clients'
    kernel is taken at their anchors, not at their chains' states: taken at the state, the exp link's
    curvature makes the step depend on where the chain is, the chain lingers where its steps are small, and
    on MASS epil the intercept's gradient came out -8 against +25 (its standard error here is about 2)."""
    x, y, problem, run = _poisson_random_intercepts()
    assert run.local_metric == "dense"
    beta, tau = np.array([1.2, 0.2, 0.0]), 1.5  # the intercept 0.8 low: on the ridge against the b_i's mean
    theta, clients, states = _poisson_start(problem, run, beta, tau)
    step = jax.jit(jax.vmap(lambda k, s, c: run.client_step(k, theta, s, c)))
    rounds = []
    for r in range(320):
        states, msg = step(jax.random.split(jax.random.PRNGKey(r + 1), len(x)), states, clients)
        g = decode_tree(msg.payload).grad[1]
        rounds.append(np.append(np.asarray(g["beta"]).sum(0), np.asarray(g["tau"]).sum()))
    rounds = np.array(rounds[20:])
    exact = _poisson_score_by_quadrature(x, y, beta, tau)
    se = _batch_means_se(rounds, 0)
    np.testing.assert_array_less(np.abs(rounds.mean(0) - exact), 4 * se)
    # the check has power: the intercept's gradient (measured 14) is more than 4 of its standard errors (about 2.6)
    # from 0, and the state-dependent kernel's bias on epil was -33, over 10 of them
    assert np.abs(exact[0]) > 4 * se[0]


@pytest.fixture(scope="module")
def synthetic_fit():
    train, test, truth = fb.models.make_fedpop_synthetic(30, seed=2)
    # Adam, the server step of FedPop's experiments (the default for d <= 100 globals is Fisher scoring,
    # whose dense information upload would dominate this compressed ledger)
    algo = fb.FedSOUL(local_steps=5, num_samples=100, warmup=100, compressor=fb.compress.rand_k(fraction=0.5),
                      server_optimizer="adam")
    res = fb.fed_fit(fb.models.fedpop_synthetic, train, algo, num_rounds=300, clients_per_round=10, seed=0)
    return train, test, truth, res


def test_ledger_counts_every_message(synthetic_fit):
    train, _, _, res = synthetic_fit
    d_theta = 20 * 2 + 2 + 1  # phi, mu, sigma
    k = round(0.5 * d_theta)
    up = 10 * (k * (32 + int(np.ceil(np.log2(d_theta)))) + 32)  # rand-k values + indices, + objective
    np.testing.assert_array_equal(res.history["bits_up"], up)
    np.testing.assert_array_equal(res.history["bits_down"], 10 * 32 * d_theta)
    np.testing.assert_array_equal(res.history["active"], 10)
    # set-up: theta_0 to each of the 30 clients, nothing back (each starts its own chain and step)
    assert res.init_bits == (0, 30 * 32 * d_theta)
    # final exchange: the averaged estimate to each of the 30 clients; back, for the standard errors, each
    # client's mean score (d floats) and two d(d+1)/2 triangles (Louis' term, the score's Monte Carlo
    # covariance); the personal posteriors stay on their clients
    final_up = 30 * 32 * (d_theta + d_theta * (d_theta + 1))
    assert res.final_bits == (final_up, 30 * 32 * d_theta)
    assert res.bits_up == 300 * up + final_up and res.bits_down == 300 * 10 * 32 * d_theta + 2 * 30 * 32 * d_theta


def test_new_client_prediction_is_the_prior_predictive(synthetic_fit):
    # y | x for a new client: z ~ N(mu, sigma^2 I), y ~ N(x^T phi z, 0.1^2): mean x^T phi mu,
    # variance 0.1^2 + sigma^2 ||phi^T x||^2.
    _, test, _, res = synthetic_fit
    x = test.client(0)["x"][:5]
    S = 20000
    y = res.predict({"x": x}, num_samples=S, seed=1)["y"]
    phi, mu, sigma = res.params["phi"], res.params["mu"], res.params["sigma"]
    mean = x @ phi @ mu
    var = 0.01 + sigma**2 * np.sum((x @ phi) ** 2, axis=1)
    np.testing.assert_array_less(np.abs(y.mean(0) - mean), 5 * np.sqrt(var / S))
    # sample variance of S Gaussian draws has sd var * sqrt(2 / S)
    np.testing.assert_array_less(np.abs(y.var(0) - var), 5 * var * np.sqrt(2 / S))


def test_known_client_prediction_averages_its_local_samples(synthetic_fit):
    _, test, _, res = synthetic_fit
    x = test.client(3)["x"][:4]
    y = res.predict({"x": x}, client=3, seed=0)["y"]
    z = res.local_samples["z"][3]
    mean = (x @ res.params["phi"] @ z.T).mean(1)
    S = z.shape[0]
    spread = np.sqrt(0.01 + np.var(x @ res.params["phi"] @ z.T, axis=1))
    np.testing.assert_array_less(np.abs(y.mean(0) - mean), 5 * spread / np.sqrt(S))


def test_sample_client_runs_a_local_chain_for_new_data(synthetic_fit):
    _, test, _, res = synthetic_fit
    new = {k: v[:30] for k, v in test.client(7).items()}
    z = res.sample_client(new, num_samples=300, warmup=300, seed=0)["z"]
    phi, mu, sigma = res.params["phi"], res.params["mu"], res.params["sigma"]
    A = phi.T @ new["x"].T @ new["x"] @ phi / 0.01 + np.eye(2) / sigma**2
    m = np.linalg.solve(A, phi.T @ new["x"].T @ new["y"] / 0.01 + mu / sigma**2)
    # exact conjugate posterior mean; the posterior sd here is ~0.02, ULA mean is exact for Gaussians
    np.testing.assert_allclose(z.mean(0), m, atol=0.02)


@pytest.mark.parametrize("variant", ["stateful, rand-k", "stateless"])
def test_fedsoul_learns_the_subspace_from_the_best_of_three_starts(variant):
    """phi is recovered (principal-angle distance to the true subspace < 0.3) by the start with the best
    final objective among three seeds: the multi-start a user runs on a non-convex problem, chosen by
    the fit's own objective (the averaged log joint of the clients' chains), not by the truth.

    Why three starts: the marginal likelihood has local optima in phi. Measured over seeds 0-13 on these
    100 clients (300 rounds), single starts land either near the truth (distances 0.04-0.26) or far from
    it (0.58-0.99): stateful FedSOUL with rand-k at half the coordinates, 5 local steps, cohorts of 30:
    1 of 14 far (seed 6); stateless, 20 local steps, half the clients a round: 1 of 14 far (seed 9). The two regimes are
    separated by the 0.3 bound. In the far runs checked (one of each variant, against a near run of the
    same variant) the final objective was the lower by thousands, so the selection finds a near start
    whenever one of the three is near (all three far: under 1% at these rates; seeds 0-2 happen to be
    near in both variants). On 30 clients, 2 to 4 of 5 single starts were far, more rounds or local
    steps did not change that, so those fits are not used for phi."""
    train, _, truth = fb.models.make_fedpop_synthetic(100, seed=2)
    # measured with Adam (FedPop's server step; the default became Fisher scoring for d <= 100 globals)
    if variant == "stateless":
        algo, cohort = fb.FedSOUL(local_steps=20, stateful=False, num_samples=20, warmup=50,
                                  server_optimizer="adam", uncertainty=False), 0.5
    else:
        algo, cohort = fb.FedSOUL(local_steps=5, num_samples=20, warmup=50, server_optimizer="adam",
                                  uncertainty=False, compressor=fb.compress.rand_k(fraction=0.5)), 30
    fits = [fb.fed_fit(fb.models.fedpop_synthetic, train, algo, num_rounds=300, clients_per_round=cohort, seed=seed,
                       progress=False) for seed in range(3)]
    best = max(fits, key=lambda r: float(np.mean(r.history["objective"][-50:])))
    assert fb.models.principal_angle_distance(best.params["phi"], truth["phi"]) < 0.3


def test_a_short_fit_sends_exactly_the_ledgers_bits_and_keeps_each_clients_draws():
    """First tier: a 12-round FedSOUL fit of 6 clients, 3 a round, rand-k uplink. Every round's bits are the
    closed-form count (k values of 32 bits and their ceil(log2 d)-bit indices, plus the 32-bit objective, per
    member; the dense estimate down), and each client keeps its own local draws."""
    train, _, _ = fb.models.make_fedpop_synthetic(6, seed=3)
    algo = fb.FedSOUL(local_steps=2, num_samples=10, warmup=4, compressor=fb.compress.rand_k(fraction=0.5),
                      server_optimizer="adam", uncertainty=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fb.ConvergenceWarning)  # 12 rounds: a ledger check, not a converged fit
        res = fb.fed_fit(fb.models.fedpop_synthetic, train, algo, num_rounds=12, clients_per_round=3, seed=0,
                         progress=False)
    d = 20 * 2 + 2 + 1  # phi, mu, sigma
    k = round(0.5 * d)
    np.testing.assert_array_equal(res.history["bits_up"], 3 * (k * (32 + int(np.ceil(np.log2(d)))) + 32))
    np.testing.assert_array_equal(res.history["bits_down"], 3 * 32 * d)
    np.testing.assert_array_equal(res.history["active"], 3)
    assert res.init_bits == (0, 6 * 32 * d) and res.final_bits == (0, 6 * 32 * d)  # theta_0 and the estimate out
    assert res.local_samples["z"].shape == (6, 2 * 10, 2)  # 2 chains of 10 draws per client, pooled
    assert np.all(np.isfinite(res.local_samples["z"]))
    assert not res.local_point  # draws of the personal posteriors, not fitted points


@pytest.mark.parametrize("kwargs, match", [
    ({"local_steps": 0}, "local_steps"), ({"burn_in": 10, "local_steps": 10}, "burn_in"),
    ({"step_size": -0.1}, "step_size"), ({"step_scale": 3.0}, "step_scale"),
    ({"server_lr": 0.0}, "server_lr"), ({"server_optimizer": "rmsprop"}, "server_optimizer"),
    ({"average_from": 1.0}, "average_from"), ({"bounds": {"sigma": (1.0, 0.5)}}, "bounds"),
])
def test_invalid_configuration_is_refused(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        fb.FedSOUL(**kwargs)


def test_invalid_configuration_against_the_model():
    problem = _mixed_problem(5)
    with pytest.raises(ConfigError, match="'nope' is not a global site"):
        fb.FedSOUL(exact_sites=("nope",)).build(problem)
    with pytest.raises(ConfigError, match="3 entries for 5 clients"):
        fb.FedSOUL(step_size=[0.1, 0.1, 0.1]).build(problem)


@pytest.mark.slow  # second tier (make test-slow): ~13 s
def test_personalised_logistic_head_learns_client_specific_decisions():
    # Two groups of clients whose labels depend on the same features with opposite signs: one global
    # classifier cannot fit both, personal heads on shared features can.
    rng = np.random.default_rng(0)
    xs, ys = [], []
    for i in range(16):
        x = rng.normal(size=(40, 3))
        sign = 1.0 if i % 2 == 0 else -1.0
        ys.append((sign * (x[:, 0] + 0.5 * x[:, 1]) > 0).astype(np.int32))
        xs.append(x)
    data = fb.FederatedData({"features": xs, "y": ys})
    algo = fb.FedSOUL(local_steps=10, num_samples=50, warmup=100, server_lr=0.02, server_optimizer="adam")
    res = fb.fed_fit(fb.models.personalized_logistic, data, algo, num_rounds=300, seed=0,
                     model_kwargs={"num_classes": 2, "hidden": 4})
    acc = []
    for i in (0, 1, 2, 3):
        x = rng.normal(size=(200, 3))
        y = ((1.0 if i % 2 == 0 else -1.0) * (x[:, 0] + 0.5 * x[:, 1]) > 0).astype(int)
        pred = res.predict({"features": x}, client=i, seed=i)["y"]
        acc.append(np.mean((pred.mean(0) > 0.5) == y))
    # a single shared classifier is right on at most ~half of these points across both groups;
    # 200 test points per client: a binomial sd of <= 3.5%, so 0.8 is far above chance
    assert min(acc) > 0.8


def _poisson_marginal_by_quadrature(x, y, u):
    """sum_i log p(y_i | beta, tau) (up to a constant), u = (beta, log tau), on the same fine grid (jax, so that
    jax.hessian gives the exact observed information to the grid's accuracy)."""
    grid = jnp.linspace(-30, 30, 60001)
    beta, tau = u[:-1], jnp.exp(u[-1])
    eta = jnp.einsum("cnp,p->cn", x, beta)[:, :, None] + grid
    lp = jnp.sum(y[:, :, None] * eta - jnp.exp(eta), 1) - 0.5 * grid**2 / tau**2
    return jnp.sum(jax.scipy.special.logsumexp(lp, 1) - jnp.log(tau))


@pytest.mark.slow  # second tier: ~20 s
def test_final_exchange_gradient_and_information_on_a_poisson_random_intercept_model():
    """The final exchange's terms (fedbayes.algorithms.louis.draws_information) summed over 50 clients of a
    Poisson random-intercept model, at a fixed theta: the control-variate gradient equals the quadrature
    gradient within 4 of its Monte Carlo standard errors; the control variate divides the variance of
    the draws' plain mean score by more than 1000 for beta (measured 3900-5900: the score is linear in b
    up to the exp link's curvature) and by more than 3 for log tau (measured 6.2: its score b^2 / tau^2 is
    quadratic in b, which a linear control variate only partly removes); and Louis' information equals
    jax.hessian of the quadrature marginal log-likelihood within 2% on its diagonal (measured 0.4% at
    most)."""
    x, y, problem, run = _poisson_random_intercepts()
    beta, tau = np.array([1.9, 0.45, -0.15]), 0.6
    theta, clients, states = _poisson_start(problem, run, beta, tau)
    final = jax.jit(jax.vmap(lambda s, c: run.final_client(jax.random.PRNGKey(1), theta, s, c)))
    kept, (grads, info_tris, cov_tris) = final(states, clients)
    d = 4
    g = np.asarray(grads).sum(0)
    rows, cols = np.triu_indices(d)
    info = np.zeros((d, d))
    info[rows, cols] = np.asarray(info_tris).sum(0)
    info = info + np.triu(info, 1).T
    cov = np.zeros((d, d))
    cov[rows, cols] = np.asarray(cov_tris).sum(0)
    sd = np.sqrt(np.diag(cov))

    u = jnp.append(jnp.asarray(beta), jnp.log(tau))
    exact_g = _poisson_score_by_quadrature(x, y, beta, tau)
    exact_info = -np.asarray(jax.hessian(lambda v: _poisson_marginal_by_quadrature(x, y, v))(u))
    np.testing.assert_array_less(np.abs(g - exact_g), 4 * sd)
    np.testing.assert_allclose(np.diag(info), np.diag(exact_info), rtol=0.02)

    # the plain mean score of the same draws (batch means over the first chain, as the library's), for the
    # variance reduction
    fm = problem.model
    first = jax.tree_util.tree_map(lambda a: a[:, 0], kept["local_samples"])  # (C, S, ...)

    def plain(z, client):
        scores = jax.vmap(lambda zi: ravel_pytree(jax.grad(lambda t: fm.client_log_joint(t, zi, client.data, client.mask))(theta))[0])(z)
        batches = scores.reshape(10, -1, d).mean(1)
        return jnp.var(batches, 0, ddof=1) / 10

    plain_var = np.asarray(jax.vmap(plain)(first, clients)).sum(0)
    ratio = plain_var / sd**2
    assert np.all(ratio[:3] > 1000) and ratio[3] > 3, ratio


def test_draws_that_would_not_fit_in_memory_are_refused_before_any_computation():
    """num_samples = 2^30 is a valid count, but 3 clients' draws of it take 24 GiB (float64): refused up front,
    where the final exchange would have been killed by the OS (found by the fuzzing harness's extreme integers)."""
    import time

    import numpyro
    import numpyro.distributions as dist

    data = fb.FederatedData({"y": [np.zeros(3)] * 3})

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with fb.local():
            b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu + b, 1.0), obs=y)

    t0 = time.perf_counter()
    with pytest.raises(fb.ConfigError, match="personal posteriors' draws .* would take .* GiB"):
        fb.fed_fit(model, data, fb.FedSOUL(num_samples=2**33 // 8), num_rounds=2, progress=False)
    assert time.perf_counter() - t0 < 30
