"""TAMUNA (Algorithm 1) against exact references: closed-form and Newton minimisers, Theorem 1's rate,
the sparsifier's unbiasedness and variance, the zero-sum control variates, the special cases, the ledger."""

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.linear_model import LogisticRegression

import fedbayes as fb
from fedbayes.algorithms import tamuna as tm
from fedbayes.engine import Problem, make_round, sample_cohort, stack_clients
from fedbayes.errors import ConfigError, ModelError

N, D, C = 10, 5, 5  # clients, dimension, cohort
PRIOR = 1.0
ZERO = {"w": np.zeros(D)}  # start at w = 0, as the paper does (the default is the prior median)


@pytest.fixture(scope="module")
def quad():
    """Heterogeneous quadratics: Bayesian linear regression, x* = (X'X + I/prior^2)^-1 X'y in closed form."""
    data, _ = fb.models.make_glm_clients(N, D, (20, 60), family="linear", heterogeneity=1.5, seed=1)
    pooled = data.pooled()
    X, y = pooled["x"], pooled["y"]
    xstar = np.linalg.solve(X.T @ X + np.eye(D) / PRIOR**2, X.T @ y)
    return fb.models.linear_regression(1.0, PRIOR), data, xstar


@pytest.fixture(scope="module")
def logit():
    data, _ = fb.models.make_glm_clients(N, D, (30, 80), family="logistic", heterogeneity=1.5, seed=2)
    pooled = data.pooled()
    xstar = fb.models.logistic_map(pooled["x"], pooled["y"], PRIOR)
    # the Newton reference is itself checked against scikit-learn (C = prior^2, no intercept)
    sk = LogisticRegression(C=PRIOR**2, fit_intercept=False, tol=1e-12, max_iter=10_000).fit(pooled["x"], pooled["y"])
    np.testing.assert_allclose(sk.coef_[0], xstar, atol=1e-6)
    return fb.models.logistic_regression(PRIOR), data, xstar


def trajectory(res):
    return np.asarray(res.history["theta/w"])


# --------------------------------------------------------------------------------- the mask


def paper_template(d, c, s):
    """Figure 1's (d x c) pattern, transcribed from the paper's 1-indexed formulas in plain numpy."""
    t = np.zeros((d, c), int)
    if d >= c / s:
        for k in range(1, d + 1):
            for col in range(s * (k - 1), s * k):  # columns mod(s(k-1), c) + 1 .. mod(sk - 1, c) + 1
                t[k - 1, col % c] = 1
    else:
        for i in range(1, d * s + 1):
            t[(i - 1) % d, i - 1] = 1
    return t


@settings(max_examples=20, deadline=None)
@given(d=st.integers(1, 40), c=st.integers(2, 30), s_frac=st.floats(0, 1), seed=st.integers(0, 2**31 - 1))
def test_mask_has_s_ones_per_row_and_balanced_columns(d, c, s_frac, seed):
    s = 2 + int(s_frac * (c - 2))
    q = np.asarray(tm.mask(jax.random.PRNGKey(seed), d, c, s))  # (c, d): row j is cohort member j
    assert q.shape == (c, d)
    np.testing.assert_array_equal(q.sum(axis=0), s)  # every coordinate has exactly s holders
    per_client = q.sum(axis=1)
    lo, hi = tm.expected_uplink_floats(d, c, s)
    assert per_client.min() >= lo and per_client.max() <= hi
    # a column permutation of the paper's template
    template = paper_template(d, c, s).T
    assert sorted(map(bytes, q.astype(np.uint8))) == sorted(map(bytes, template.astype(np.uint8)))


def test_paper_template_examples():
    # Figure 1, (d, c, s) = (5, 6, 2): row k has ones at columns 2k mod 6 and 2k+1 mod 6
    t = np.stack([np.asarray(tm.template_column(jnp.asarray(j), 5, 6, 2)) for j in range(6)]).T.astype(int)
    np.testing.assert_array_equal(t, [[1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1],
                                      [1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0]])
    # (d, c, s) = (3, 10, 2): columns 1..6 hold one entry each at row (i - 1) mod 3, columns 7..10 are empty
    t = np.stack([np.asarray(tm.template_column(jnp.asarray(j), 3, 10, 2)) for j in range(10)]).T.astype(int)
    np.testing.assert_array_equal(t[:, :6], np.tile(np.eye(3, dtype=int), 2))
    assert t[:, 6:].sum() == 0
    for d, c, s in ((5, 6, 2), (5, 7, 2), (3, 10, 2), (7, 7, 3)):
        t = np.stack([np.asarray(tm.template_column(jnp.asarray(j), d, c, s)) for j in range(c)]).T.astype(int)
        np.testing.assert_array_equal(t, paper_template(d, c, s))


def test_compressed_aggregate_is_unbiased_with_the_sampling_variance():
    """E[x_bar] = mean_i x_i and E|x_bar - mean|^2 = nu (1/n) sum_i |x_i - mean|^2, nu = (n-s)/(s(n-1)) (eq. 25),
    over the random cohort and mask, by Monte Carlo through the library's own cohort sampler and mask."""
    n, d, c, s, T = 12, 7, 6, 3, 200_000
    x = jax.random.normal(jax.random.PRNGKey(0), (n, d)) * jnp.arange(1, n + 1)[:, None]
    mean = x.mean(0)

    def draw(key):
        k1, k2 = jax.random.split(key)
        cohort = sample_cohort(k1, n, c)
        return tm.aggregate(x[cohort], tm.mask(k2, d, c, s), s)

    xbar = jax.jit(jax.vmap(draw))(jax.random.split(jax.random.PRNGKey(1), T))
    err = np.asarray(xbar - mean)
    sq = (err**2).sum(1)
    nu = (n - s) / (s * (n - 1))
    expected = nu * float(((x - mean) ** 2).sum(1).mean())
    # Monte Carlo: each mean is within 5 standard errors (sd / sqrt(T)) of its exact value
    np.testing.assert_array_less(np.abs(err.mean(0)), 5 * err.std(0) / np.sqrt(T))
    assert abs(sq.mean() - expected) < 5 * sq.std() / np.sqrt(T)
    # consensus is exact: equal iterates are reproduced bit for bit
    same = jnp.broadcast_to(jnp.arange(d, dtype=float), (c, d))
    np.testing.assert_array_equal(tm.aggregate(same, tm.mask(jax.random.PRNGKey(3), d, c, s), s), same[0])


# ----------------------------------------------------------------------- exact convergence


def measured_rate(res, xstar, lo=1e-22, hi=1e-4):
    """Per-local-step contraction of |x_bar - x*|^2, a least-squares slope of its log against local steps."""
    err2 = ((trajectory(res) - xstar) ** 2).sum(1)
    t = np.cumsum(res.history["local_steps"])
    keep = (err2 < hi) & (err2 > lo)
    slope = np.polyfit(t[keep], np.log(err2[keep]), 1)[0]
    return float(np.exp(slope))


@pytest.mark.parametrize("case", ["quad", "logit"])
def test_exact_convergence_with_compression_and_partial_participation(case, request):
    """s = 2 of a cohort c = 5 < n = 10: the error to the centralised minimiser falls below 1e-10, with the
    linear rate of Theorem 1 (eq. 10). The bound is on E[Psi]; the error decays at least as fast."""
    model, data, xstar = request.getfixturevalue(case)
    p = 0.5
    res = fb.fed_fit(model, data, fb.TAMUNA(s=2, p=p, init=ZERO), num_rounds=1600, clients_per_round=C, seed=3)
    err = np.abs(trajectory(res)[-1] - xstar).max()
    assert err < 1e-10
    cfg = res.settings
    # global constants: quadratics have constant Hessians; for logistic regression the Hessian is largest at
    # w = 0 (the start, where L_max was estimated) and mu is at least the prior's share 1 / (n prior^2)
    mu = cfg["mu_min"] if case == "quad" else 1 / (N * PRIOR**2)
    tau = tm.theorem1_rate(gamma=cfg["gamma"], mu=mu, L=cfg["L_max"], p=p, s=2, n=N)
    rate = measured_rate(res, xstar)
    assert rate <= tau, (rate, tau)


def test_without_control_variates_it_converges_to_a_wrong_point(quad):
    """eta = 0 (FedAvg with the same geometric local steps, no compression): client drift leaves a gap of
    order |x*| on heterogeneous clients, while TAMUNA on the same random stream is exact."""
    model, data, xstar = quad
    with pytest.raises(ConfigError, match="FedAvg"):
        fb.TAMUNA(eta=0.0)
    drift = fb.fed_fit(model, data, fb.FedAvg(p=0.2, init=ZERO), num_rounds=800, seed=4)
    exact = fb.fed_fit(model, data, fb.TAMUNA(p=0.2, s=N, init=ZERO), num_rounds=800, seed=4)
    gap = np.linalg.norm(trajectory(drift)[-50:] - xstar, axis=1)
    assert gap.min() > 1e-2 * np.linalg.norm(xstar)
    assert np.abs(trajectory(exact)[-1] - xstar).max() < 1e-10


def test_default_settings_reach_the_map_by_name(logit):
    """fed_fit(..., "tamuna"): every setting from the model (start at the prior median, gamma = 1 / L_max,
    s from Theorem 3, p from the threshold rule) and the MAP in res.params; the fit converts to ArviZ."""
    model, data, xstar = logit
    res = fb.fed_fit(model, data, "tamuna", num_rounds=1500, clients_per_round=C)
    assert res.algorithm == "TAMUNA" and res.settings["s"] == 2
    np.testing.assert_allclose(res.params["w"], xstar, atol=1e-10)
    hist = fb.result.group(res.idata, "fed_history")
    assert "local_steps" in hist and hist.sizes["round"] == 1500
    np.testing.assert_allclose(fb.result.group(res.idata, "fed_params")["w"], xstar, atol=1e-10)


def test_default_settings_with_every_client_reach_the_map(logit):
    """Every client in every round turns the monotonicity safeguard on. TAMUNA's F at x_bar rises while
    the control variates settle (each coordinate is a mean over s < n clients' local iterates): the
    safeguard must wait rather than halve gamma at once (which once halved it every round until it
    underflowed and the fit diverged)."""
    model, data, xstar = logit
    res = fb.fed_fit(model, data, fb.TAMUNA(), num_rounds=1500)
    assert res.settings["safeguard"] and res.settings["s"] < N
    assert res.settings["step_halvings"] <= 2
    np.testing.assert_allclose(res.params["w"], xstar, atol=1e-10)


# ------------------------------------------------------------------- invariants and ledger


def test_control_variates_sum_to_zero_and_ledger_matches_the_formula(quad):
    model, data, _ = quad
    s = 2
    fm = fb.FedModel(model, data)
    problem = Problem(fm, data, 40, C)
    run = fb.TAMUNA(s=s, p=0.4).build(problem)
    carry = run.init(jax.random.PRNGKey(0), problem)
    round_fn = jax.jit(make_round(run, stack_clients(data), N, C, jax.random.PRNGKey(1)))
    lo, hi = tm.expected_uplink_floats(D, C, s)
    for k in range(40):
        carry, rec = round_fn(carry, jnp.asarray(k))
        h = carry[1]
        assert float(jnp.abs(h.sum(0)).max()) < 1e-10  # sum_i h_i = 0 after every round
        floats_up = np.asarray(rec["bits_up"]) // 32  # per cohort member
        assert floats_up.sum() == s * D and floats_up.min() >= lo and floats_up.max() <= hi
        # downlink: x_bar to each member (d floats) and the reply on its own s d / c entries
        np.testing.assert_array_equal(np.asarray(rec["bits_down"]) // 32, D + floats_up)
    assert int(jnp.sum(jnp.any(carry[1] != 0, axis=1))) > C  # several cohorts have updated their h_i


def test_ledger_of_a_fit(quad):
    model, data, _ = quad
    rounds, s = 30, 3
    # precondition=False: the set-up's ledger of the eigenvalue exchange (test_precondition.py: S's)
    res = fb.fed_fit(model, data, fb.TAMUNA(s=s, p=0.5, precondition=False), num_rounds=rounds, clients_per_round=C)
    np.testing.assert_array_equal(res.history["bits_up"], 32 * s * D)
    np.testing.assert_array_equal(res.history["bits_down"], 32 * (C * D + s * D))
    avg = fb.fed_fit(model, data, fb.FedAvg(local_steps=3), num_rounds=rounds, clients_per_round=C)
    np.testing.assert_array_equal(avg.history["bits_up"], 32 * C * D)  # no compression, no reply
    np.testing.assert_array_equal(avg.history["bits_down"], 32 * C * D)
    np.testing.assert_array_equal(avg.history["local_steps"], 3)
    # set-up, with all N clients: x_0 to each; (mu_i, L_i) back, for gamma = 1 / L_max; gamma, p, eta to each
    assert res.init_bits == (N * 2 * 32, N * 32 * D + N * 3 * 64)
    # final exchange: x to every client; its log-likelihood's gradient and Hessian (upper triangle) back
    assert res.final_bits == (N * 32 * (D + D * (D + 1) // 2), N * 32 * D)
    assert res.bits_up == rounds * 32 * s * D + N * 2 * 32 + res.final_bits[0]


# --------------------------------------------------------------------------- special cases


def grad_f(data):
    """Hand-written gradients of f_i(w) = |X_i w - y_i|^2 / 2 + |w|^2 / (2 n prior^2) (unit noise)."""
    Xs = [np.asarray(data.client(i)["x"]) for i in range(N)]
    ys = [np.asarray(data.client(i)["y"]) for i in range(N)]
    return lambda i, w: Xs[i].T @ (Xs[i] @ w - ys[i]) + w / (N * PRIOR**2)


def test_gd_is_gradient_descent(quad):
    model, data, _ = quad
    rounds, gamma = 60, 0.004
    res = fb.fed_fit(model, data, fb.GD(step_size=gamma, init=ZERO), num_rounds=rounds)
    g = grad_f(data)
    w, ref = np.zeros(D), []
    for _ in range(rounds):
        w = w - gamma * np.mean([g(i, w) for i in range(N)], axis=0)
        ref.append(w)
    np.testing.assert_allclose(trajectory(res), ref, atol=1e-13, rtol=0)


def test_scaffnew_is_proxskip_with_the_same_local_steps(quad):
    """c = s = n, eta = p: a plain ProxSkip / Scaffnew loop fed the fit's own numbers of local steps."""
    model, data, _ = quad
    rounds, gamma, p = 60, 0.004, 0.3
    res = fb.fed_fit(model, data, fb.Scaffnew(step_size=gamma, p=p, init=ZERO), num_rounds=rounds, seed=5)
    assert res.settings["eta"] == p and res.settings["s"] == N
    g = grad_f(data)
    xbar, h, ref = np.zeros(D), np.zeros((N, D)), []
    for L in res.history["local_steps"]:
        xs = []
        for i in range(N):
            x = xbar.copy()
            for _ in range(int(L)):
                x = x - gamma * (g(i, x) - h[i])
            xs.append(x)
        xbar = np.mean(xs, axis=0)
        h = h + (p / gamma) * (xbar - np.asarray(xs))
        ref.append(xbar)
    assert res.history["local_steps"].max() > 1
    np.testing.assert_allclose(trajectory(res), ref, atol=1e-12, rtol=0)


# ------------------------------------------------------------------------- configuration


def test_parameter_helpers_follow_the_theorems():
    # the digest's worked numbers (Theorem 3, eq. 14; p of eq. 12)
    assert tm.recommended_s(1000, 300) == 3
    assert tm.recommended_s(1000, 300, downlink_cost=0.1) == 100
    assert tm.recommended_s(100, 300) == 2
    assert tm.recommended_s(5, 1) == 5  # capped at c
    assert tm.recommended_p(1e4, 1000, 3, rule="eq12") == pytest.approx(np.sqrt(1000 / 3e4))
    assert tm.recommended_p(1.0, 10, 2, rule="eq12") == 1.0
    # the threshold rule: p^2 chi (s-1)/(n-1) = 1 - (1 - 1/kappa)^2, i.e. tau equals gradient descent's
    p = tm.recommended_p(1e4, 100, 2)
    chi = 100 / 198
    assert p**2 * chi / 99 == pytest.approx(1 - (1 - 1e-4) ** 2)
    assert tm.theorem1_rate(gamma=1.0, mu=1e-4, L=1.0, p=p, s=2, n=100) == pytest.approx((1 - 1e-4) ** 2)
    assert tm.theorem1_rate(gamma=1.0, mu=1e-4, L=1.0, p=0.9 * p, s=2, n=100) > (1 - 1e-4) ** 2
    assert tm.recommended_p(1e4, 100, 100) == pytest.approx(np.sqrt(1 - (1 - 1e-4) ** 2))  # Scaffnew: chi = 1
    assert tm.recommended_p(2.0, 10, 2) == 1.0
    assert tm.max_eta(0.2, 10, 2) == pytest.approx(0.2 * 10 / 18)
    assert tm.theorem1_rate(gamma=0.1, mu=1.0, L=10.0, p=0.5, s=2, n=10) == pytest.approx(
        max(0.81, 0.0, 1 - 0.25 * (10 / 18) / 9))


def test_kappa_is_estimated_from_the_model(quad):
    model, data, _ = quad
    est = tm.estimate_condition(model, data, at=ZERO)
    Hs = [np.asarray(data.client(i)["x"]).T @ np.asarray(data.client(i)["x"]) + np.eye(D) / (N * PRIOR**2)
          for i in range(N)]
    ev = np.concatenate([np.linalg.eigvalsh(H) for H in Hs])
    assert est["L"] == pytest.approx(ev.max(), rel=1e-10) and est["mu"] == pytest.approx(ev.min(), rel=1e-10)
    # precondition=False: gamma and p from the model's own Hessians (preconditioned: from S^T H_i S)
    res = fb.fed_fit(model, data, fb.TAMUNA(s=2, init=ZERO, precondition=False), num_rounds=2, clients_per_round=C)
    cfg = res.settings
    assert cfg["gamma"] == pytest.approx(1 / ev.max())
    assert cfg["p"] == pytest.approx(tm.recommended_p(ev.max() / ev.min(), N, 2))
    assert cfg["eta"] == pytest.approx(tm.max_eta(cfg["p"], N, 2))


def test_bad_settings_are_refused_with_clear_errors(quad):
    model, data, _ = quad
    with pytest.raises(ConfigError, match=r"outside Theorem 1's range"):
        fb.fed_fit(model, data, fb.TAMUNA(s=2, p=0.5, eta=0.3), num_rounds=2, clients_per_round=C)
    with pytest.raises(ConfigError, match="exceeds the cohort"):
        fb.fed_fit(model, data, fb.TAMUNA(s=6), num_rounds=2, clients_per_round=C)
    with pytest.raises(ConfigError, match="full-participation"):
        fb.fed_fit(model, data, fb.Scaffnew(p=0.5), num_rounds=2, clients_per_round=C)
    for bad in (dict(p=0.0), dict(p=1.5), dict(s=1), dict(step_size=-1.0), dict(p=0.5, local_steps=3),
                dict(downlink_cost=2.0), dict(kappa=0.5), dict(local_latents="mode")):
        with pytest.raises(ConfigError):
            fb.TAMUNA(**bad)
    with pytest.raises(ConfigError):
        fb.GD(local_steps=2)
    with pytest.raises(ConfigError, match="not both"):
        fb.FedAvg(p=0.2, local_steps=5)
    assert fb.FedAvg().local_steps == 10 and fb.FedAvg(p=0.2).local_steps is None
    with pytest.raises(ConfigError):
        fb.Scaffnew(s=2)


def test_models_with_local_latents_need_the_population_mean_option():
    data = fb.models.make_linear_mixed_effects(num_clients=6, seed=0)[0]
    with pytest.raises(ModelError, match="population-mean"):
        fb.fed_fit(fb.models.linear_mixed_effects, data, "tamuna", num_rounds=2)
    res = fb.fed_fit(fb.models.linear_mixed_effects, data, fb.Scaffnew(local_latents="population-mean", p=0.5),
                     num_rounds=150)
    # with b_i at its mean 0 the model is ordinary least squares on the pooled data
    pooled = data.pooled()
    beta = np.linalg.lstsq(pooled["x"], pooled["y"], rcond=None)[0]
    np.testing.assert_allclose(res.params["beta"], beta, atol=1e-8)


# ----------------------------------------------------------------------------- warm starts


def test_samplers_start_at_the_tamuna_map(quad):
    """init='map' puts the chains at the posterior mode (closed form for the Gaussian posterior); a
    TAMUNA Result works the same way and costs no extra rounds."""
    model, data, xstar = quad
    fm = fb.FedModel(model, data)
    problem = Problem(fm, data, 10)
    run = fb.LMC(init="map", num_chains=1).build(problem)
    np.testing.assert_allclose(run._x0, xstar, atol=1e-8)
    fit = fb.fed_fit(model, data, fb.TAMUNA(s=2, p=0.5, init=ZERO), num_rounds=400, clients_per_round=C)
    run = fb.DELF(init=fit, num_chains=1).build(problem)
    np.testing.assert_allclose(run._x0, fit.params["w"], atol=0)
    with pytest.raises(ConfigError, match="init"):
        fb.LMC(init="mode")


def test_fedsoul_warm_starts_from_the_global_model():
    """FedSOUL(init='map') starts from the TAMUNA fit of the non-personalised model (latents at their
    population mean): a near-stationary point of that model's objective."""
    data = fb.models.make_fedpop_synthetic(8, seed=0)[0]
    fm = fb.FedModel(fb.models.fedpop_synthetic, data)
    problem = Problem(fm, data, 2)
    server, _, _ = fb.FedSOUL(init="map").build(problem).init(jax.random.PRNGKey(0), problem)
    start = fm.unconstrain(tm.map_estimate(problem))
    for k in start:
        np.testing.assert_allclose(server.theta[k], start[k], atol=1e-12)
    run = fb.TAMUNA(local_latents="population-mean", p=0.2).build(problem)
    grad = jax.jit(jax.grad(run.objective))
    clients = stack_clients(data)
    # 300 rounds take the gradient norm down by more than 1e4 from the default start (it is about 3e-6 here)
    assert np.linalg.norm(grad(ravel_pytree(start)[0], clients)) < 1e-4 * np.linalg.norm(grad(run._x0, clients))
    with pytest.raises(ConfigError, match="FedSOUL init"):
        fb.FedSOUL(init=3)


def _intercept(y):
    import numpyro
    import numpyro.distributions as dist

    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@pytest.mark.slow  # three fits of 200 rounds, about 20 s
@pytest.mark.parametrize("algo", [fb.TAMUNA, fb.Scaffnew, fb.GD])
def test_a_perfectly_conditioned_problem_is_solved_not_refused(algo):
    """Issue 53 (1): an intercept with a prior on equal clients has kappa = 1 exactly; the separately estimated
    L_max and mu_min made it 0.9999999999999999 here (3 clients of 2 rows each), which recommended_p refused.
    The exact posterior mode of N(0, 1) x prod N(0.7 | mu, 1) over the 6 rows is 6 * 0.7 / 7 = 0.6."""
    with jax.enable_x64(False):  # in float32, the users' default (the suite runs in float64, where it is exact)
        data = fb.FederatedData({"y": [np.full(2, 0.7)] * 3})
        res = fb.fed_fit(_intercept, data, algo(), num_rounds=200, progress=False, seed=0)
    np.testing.assert_allclose(float(res.params["mu"]), 0.6, rtol=1e-5)


def test_an_objective_without_curvature_is_refused_with_the_fix():
    """Issue 53 (2): a numpyro.param whose likelihood is masked out has L_max = 0: a ConfigError naming the
    cause and the fix, not a ZeroDivisionError."""
    import numpyro
    import numpyro.distributions as dist

    def flat(y):
        mu = numpyro.param("mu", 0.0)
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0).mask(False), obs=y)

    data = fb.FederatedData({"y": [np.ones(3)] * 4})
    with pytest.raises(ConfigError, match="no curvature.*Give it a prior, or pass step_size"):
        fb.fed_fit(flat, data, fb.GD(), num_rounds=5, progress=False)
