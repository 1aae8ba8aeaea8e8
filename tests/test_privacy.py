"""fedbayes.privacy: clipping bounds, the noise's variance, and the accountant against exact and
independent references (the Gaussian mechanism's closed form, the PRV accountant)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm

import fedbayes as fb
from fedbayes import privacy
from fedbayes.engine import Problem, RoundInfo
from fedbayes.errors import ConfigError
from fedbayes.protocol import Message

pytest.importorskip("dp_accounting", reason='privacy accounting needs pip install "fedbayes[privacy]"')


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-2.0**100, 2.0**100, allow_nan=False, width=32), min_size=1, max_size=12),
       st.floats(1e-3, 1e3), st.sampled_from([jnp.float32, jnp.float64]))
def test_clip_norm_bounds_every_upload_and_keeps_small_ones(values, clip, dtype):
    x = jnp.asarray(values, dtype)
    tree = {"a": x, "b": (x[:1] * 2, jnp.zeros((2, 2), dtype))}
    clipped, before = privacy.clip_norm(tree, clip)
    leaves = jax.tree_util.tree_leaves(clipped)
    after = math.sqrt(sum(float(np.sum(np.asarray(leaf, np.float64) ** 2)) for leaf in leaves))
    exact = math.sqrt(sum(float(np.sum(np.asarray(leaf, np.float64) ** 2)) for leaf in jax.tree_util.tree_leaves(tree)))
    assert after <= clip  # never above the bound, rounding included
    assert abs(float(before) - exact) <= 1e-6 * exact + 1e-30
    for got, orig in zip(leaves, jax.tree_util.tree_leaves(tree)):
        assert got.dtype == orig.dtype
        if exact <= clip * (1 - 2.0**-20):
            np.testing.assert_array_equal(got, orig)  # below the bound: unchanged, bit for bit
        else:  # the same direction, shrunk to the bound (up to the one part in 2^20 and the dtype's rounding)
            np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(orig, np.float64) * clip / exact,
                                       rtol=2.0**-20 + (1e-6 if dtype == jnp.float32 else 1e-12), atol=1e-30)


def test_gaussian_noise_has_the_calibrated_variance():
    # 400 000 draws: the sample variance's relative standard error is sqrt(2 / n) = 0.0022, so 5 of them
    # (0.011) bounds it; the mean's standard error is std / sqrt(n).
    std = 0.37
    tree = {"w": jnp.zeros((1000, 200)), "s": jnp.zeros((200_000,))}
    noise = privacy.gaussian_noise(jax.random.key(0), tree, std)
    for leaf in jax.tree_util.tree_leaves(noise):
        v = np.asarray(leaf, np.float64).ravel()
        assert abs(v.mean()) <= 5 * std / math.sqrt(v.size)
        assert abs(v.var() / std**2 - 1) <= 5 * math.sqrt(2 / v.size)
    w, s = noise["w"].ravel()[:1000], noise["s"][:1000]
    assert abs(np.corrcoef(w, s)[0, 1]) < 5 / math.sqrt(1000)  # leaves draw independent noise


def test_langevin_step_is_a_gaussian_mechanism():
    # x' = x - gamma sum g_i + sqrt(2 gamma) xi: sensitivity gamma C, noise sd sqrt(2 gamma)
    gamma, clip = 1e-3, 2.5
    assert privacy.langevin_noise_multiplier(gamma, clip) == pytest.approx(math.sqrt(2 * gamma) / (gamma * clip), rel=1e-15)
    with pytest.raises(ConfigError, match="step_size > 0"):
        privacy.langevin_noise_multiplier(0.0, 1.0)


def _gaussian_delta(eps: float, mu: float) -> float:
    """Exact delta(eps) of a Gaussian mechanism with sensitivity / noise sd = mu (Balle and Wang 2018,
    Theorem 8); T compositions of noise multiplier sigma are mu = sqrt(T) / sigma (Dong, Roth, Su 2019)."""
    return float(norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2))


@pytest.mark.parametrize("sigma,rounds", [(1.0, 1), (4.0, 50), (20.0, 1000)])
def test_full_participation_epsilon_is_the_gaussian_mechanisms(sigma, rounds):
    delta, mu = 1e-5, math.sqrt(rounds) / sigma
    pld = privacy.epsilon(sigma, delta=delta, rounds=rounds, num_clients=10, accountant="pld")
    # tight: the exact delta at the PLD's epsilon is delta, within the PLD's discretisation (1e-4 in the
    # privacy loss, pessimistic: its epsilon is never below the exact one)
    assert _gaussian_delta(pld, mu) <= delta * (1 + 1e-6)
    assert _gaussian_delta(pld - 2e-3, mu) > delta
    rdp = privacy.epsilon(sigma, delta=delta, rounds=rounds, num_clients=10, accountant="rdp")
    assert rdp >= pld  # Renyi DP's conversion is an upper bound, looser than the PLD
    assert _gaussian_delta(rdp, mu) <= delta
    # set-up and final exchanges count as unsampled rounds: two more rounds are two more compositions
    both = privacy.epsilon(sigma, delta=delta, rounds=rounds, num_clients=10, extra_rounds=2, accountant="pld")
    assert _gaussian_delta(both, math.sqrt(rounds + 2) / sigma) <= delta * (1 + 1e-6) and both > pld


@pytest.mark.parametrize("q,sigma,rounds", [(0.01, 1.1, 3000), (0.1, 2.0, 500), (0.3, 5.0, 100)])
def test_poisson_sampling_agrees_with_the_prv_accountant(q, sigma, rounds):
    # An independent implementation (Gopi, Lee, Wutschitz 2021), which bounds the true epsilon from
    # both sides within its eps_error: the tight PLD lies within those bounds (plus the PLD's own
    # pessimistic discretisation), and the RDP upper bound is above the lower one.
    prv = pytest.importorskip("prv_accountant")
    delta, n = 1e-5, 1000
    cohort = int(round(q * n))
    mech = prv.PoissonSubsampledGaussianMechanism(noise_multiplier=sigma, sampling_probability=cohort / n)
    acc = prv.PRVAccountant(prvs=mech, max_self_compositions=rounds, eps_error=0.01, delta_error=1e-10)
    low, _, high = acc.compute_epsilon(delta=delta, num_self_compositions=rounds)
    pld = privacy.epsilon(sigma, delta=delta, rounds=rounds, num_clients=n, cohort_size=cohort, sampling="poisson",
                          accountant="pld")
    rdp = privacy.epsilon(sigma, delta=delta, rounds=rounds, num_clients=n, cohort_size=cohort, sampling="poisson")
    assert low - 0.01 <= pld <= high + 0.01
    assert rdp >= low


def test_fixed_cohorts_use_replacement_and_amplify():
    delta, sigma, rounds, n = 1e-5, 1.5, 200, 100
    full = privacy.epsilon(sigma, delta=delta, rounds=rounds, num_clients=n)
    assert privacy.relation_for(n, n) == "add-remove" and privacy.relation_for(n, 10) == "replace"
    # replace-one without sampling: sensitivity 2C, i.e. the Gaussian with sigma / 2, for every round
    unsampled = privacy.epsilon(sigma / 2, delta=delta, rounds=rounds, num_clients=n)
    eps = [privacy.epsilon(sigma, delta=delta, rounds=rounds, num_clients=n, cohort_size=m) for m in (50, 20, 10, 5)]
    # sampling never costs privacy: at half the clients the bound for sampling without replacement is
    # above the unsampled one, which is then reported; smaller cohorts amplify
    assert eps[0] == unsampled and full < unsampled
    assert all(a > b for a, b in zip(eps[1:], eps[2:])) and eps[1] < unsampled
    with pytest.raises(ConfigError, match="PLD accountant.*without replacement"):
        privacy.epsilon(sigma, delta=delta, rounds=rounds, num_clients=n, cohort_size=10, accountant="pld")


@pytest.mark.parametrize("cohort,sampling,accountant", [(None, "fixed", "pld"), (10, "fixed", "rdp"),
                                                        (10, "poisson", "pld")])
def test_noise_multiplier_for_a_target_epsilon(cohort, sampling, accountant):
    kw = dict(delta=1e-5, rounds=300, num_clients=100, cohort_size=cohort, sampling=sampling, accountant=accountant)
    for target in (1.0, 8.0):
        sigma = privacy.noise_multiplier_for(target, **kw)
        assert privacy.epsilon(sigma, **kw) <= target
        assert privacy.epsilon(sigma * (1 - 1e-3), **kw) > target  # the smallest such multiplier, to 1e-3


def test_dp_options_are_checked():
    dp = fb.privacy.DP(clip=1.0, noise_multiplier=1.2)
    assert dp.resolved_delta(100) == 1e-5 and dp.resolved_delta(10**6) == pytest.approx(1e-6**1.1)
    assert privacy.epsilon(0.0, delta=1e-5, rounds=3, num_clients=4) == math.inf
    assert privacy.epsilon(1.0, delta=1e-5, rounds=0, num_clients=4) == 0.0
    bad = [dict(clip=0.0, noise_multiplier=1.0), dict(clip=1.0), dict(clip=1.0, noise_multiplier=1.0, epsilon=3.0),
           dict(clip=1.0, epsilon=-1.0), dict(clip=1.0, epsilon=1.0, delta=1.5),
           dict(clip=1.0, noise_multiplier=1.0, mode="local"), dict(clip=1.0, noise_multiplier=1.0, accountant="gdp"),
           dict(clip=float("inf"), noise_multiplier=1.0), dict(clip=1.0, noise_multiplier=1.0, noise_seed=1.5)]
    for kw in bad:
        with pytest.raises(ConfigError):
            privacy.DP(**kw)
    with pytest.raises(ConfigError, match="cohort_size"):
        privacy.epsilon(1.0, delta=1e-5, rounds=3, num_clients=4, cohort_size=5)
    with pytest.raises(ConfigError, match="sampling"):
        privacy.epsilon(1.0, delta=1e-5, rounds=3, num_clients=4, sampling="shuffle")


# ------------------------------------------------------------------------------- LMC with central DP
from test_elf import D, PRIOR_SD, gauss_model, gaussian_clients, last_draws  # noqa: E402


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_private_lmc_has_the_widened_exact_stationary_law(mode):
    # Every upload below the clip (the 5 clients' gradients of 4000 chains have norms of a few hundred),
    # and sigma twice the step's own multiplier sqrt(2 / gamma) / C. Centrally the sum gets
    # s^2 = sigma^2 C^2 - 2 / gamma = 6 / gamma; distributed, the clients add all of s^2 = sigma^2 C^2 =
    # 8 / gamma (the step's noise is the server's own). The chain x' - mu = (I - gamma P)(x - mu) +
    # N(0, (2 gamma + gamma^2 s^2) I) then has 1 + gamma s^2 / 2 = 4 (central) or 5 (distributed) times
    # ULA's stationary covariance (P - gamma P P / 2)^-1. Tolerances as in test_elf: 5 Monte Carlo
    # standard errors of independent chains' last draws.
    data, P, mu = gaussian_clients()
    gamma, clip, n_chains = 0.5 / np.linalg.eigvalsh(P).max(), 1e4, 4000
    sigma = 2 * privacy.langevin_noise_multiplier(gamma, clip)
    # distributed: each of the 5 clients adds N(0, s^2 / 5) to its clipped upload
    dp = privacy.DP(clip=clip, noise_multiplier=sigma, mode=mode)
    s2, factor = {"central": (6 / gamma, 4), "distributed": (8 / gamma, 5)}[mode]
    res = fb.fed_fit(gauss_model, data, fb.LMC(step_size=gamma, num_chains=n_chains, warmup=299, init="prior",
                                               privacy=dp), num_rounds=300, seed=0)
    x = last_draws(res)
    cov = factor * np.linalg.inv(P - gamma * P @ P / 2)
    np.testing.assert_array_less(np.abs(x.mean(0) - mu), 5 * np.sqrt(np.diag(cov) / n_chains))
    se_cov = np.sqrt((np.outer(np.diag(cov), np.diag(cov)) + cov**2) / n_chains)
    np.testing.assert_array_less(np.abs(np.cov(x.T) - cov), 5 * se_cov)
    assert np.max(np.abs(np.cov(x.T) - cov / factor) / se_cov) > 10  # without the added noise: far outside
    # the report: sigma, the noise added, and the accountant's epsilon over 300 rounds and the set-up move
    rep = res.privacy
    assert rep["noise_multiplier"] == sigma and rep["releases"] == 301
    assert rep["added_noise_std"] == pytest.approx(np.sqrt(s2), rel=1e-12)
    assert rep["epsilon"] == privacy.epsilon(sigma, delta=rep["delta"], rounds=300, num_clients=5, extra_rounds=1)
    assert rep["delta"] == 1e-5  # min(1e-5, 1 / n^1.1)
    assert res.idata.posterior.attrs["privacy_epsilon"] == rep["epsilon"]


def test_private_lmc_clips_each_upload_and_adds_only_the_missing_noise():
    # The server's step by hand: x' = x - gamma (sum_i clip(g_i) + s e + grad(-log prior)(x)) + sqrt(2 gamma) z
    # with the keys the run splits, e drawn from the secret key (noise_seed) folded with the public one;
    # uploads far above the clip are cut to it, one below it is kept. The server adds the prior's gradient
    # (the clients send their likelihood's alone).
    data, P, _ = gaussian_clients()
    gamma, clip = 0.1 / np.linalg.eigvalsh(P).max(), 0.5
    sigma = 3 * privacy.langevin_noise_multiplier(gamma, clip)
    problem = Problem(fb.FedModel(gauss_model, data), data, 10)
    run = fb.LMC(step_size=gamma, num_chains=2, init="prior",
                 privacy=privacy.DP(clip=clip, noise_multiplier=sigma, noise_seed=11)).build(problem)
    server, _, _ = run.init(jax.random.PRNGKey(0), problem)
    rows = jax.random.normal(jax.random.PRNGKey(1), (5, 2, D)) * jnp.asarray([10.0, 10.0, 10.0, 10.0, 0.01])[:, None, None]
    key = jax.random.PRNGKey(2)
    new, _, _ = run.server_step(key, server, Message(rows, jnp.asarray(0)), RoundInfo(jnp.asarray(0), jnp.arange(5),
                                                                                        jnp.ones(5, bool), 5))
    k_move, k_dp = jax.random.split(key)
    norms = np.linalg.norm(np.asarray(rows).reshape(5, -1), axis=1)
    clipped = np.asarray(rows) * np.minimum(1, clip / norms * (1 - 2.0**-20))[:, None, None]
    clipped[4] = np.asarray(rows[4])  # below the bound: as sent
    s = np.sqrt(sigma**2 * clip**2 - 2 / gamma)
    secret = privacy.secret_key(11)
    prior_grad = np.asarray(server.x) / PRIOR_SD**2  # -log N(0, PRIOR_SD^2 I): its gradient is x / PRIOR_SD^2
    g = clipped.sum(0) + s * np.asarray(jax.random.normal(privacy.folded(secret, k_dp), (2, D))) + prior_grad
    z = np.asarray(jax.random.normal(jax.random.split(k_move)[0], (2, D)))
    np.testing.assert_allclose(new.x, np.asarray(server.x) - gamma * g + np.sqrt(2 * gamma) * z, rtol=1e-12, atol=1e-12)
    # distributed: the client clips its own upload and adds N(0, sigma^2 C^2 / 5) (all of the noise: the
    # step's own is the server's); the server adds only the prior's gradient. Over 20 000 keys the share's
    # variance is that within 5 standard errors (relative sqrt(2 / n) each).
    s = sigma * clip
    with pytest.warns(UserWarning, match="no secure aggregation"):
        dist_run = fb.LMC(step_size=gamma, num_chains=2, init="prior",
                          privacy=privacy.DP(clip=clip, noise_multiplier=sigma, mode="distributed")).build(problem)
    keys = jax.random.split(jax.random.PRNGKey(5), 20_000)
    shares = np.asarray(jax.vmap(lambda k: dist_run._dp.share(k, rows[0]))(keys))
    clipped0 = clipped[0]
    noise = shares - clipped0
    assert abs(noise.var() / (s**2 / 5) - 1) < 5 * np.sqrt(2 / noise.size) and abs(noise.mean()) < 5 * s / np.sqrt(5 * noise.size)
    np.testing.assert_allclose(shares.mean(0), clipped0, atol=5 * s / np.sqrt(5 * keys.shape[0]))
    plain, _, _ = dist_run.server_step(key, server, Message(rows, jnp.asarray(0)), RoundInfo(jnp.asarray(0), jnp.arange(5),
                                                                                           jnp.ones(5, bool), 5))
    z0 = np.asarray(jax.random.normal(jax.random.split(key)[0], (2, D)))  # no key split for DP at the server
    np.testing.assert_allclose(plain.x, np.asarray(server.x) - gamma * (np.asarray(rows).sum(0) + prior_grad)
                               + np.sqrt(2 * gamma) * z0, rtol=1e-12, atol=1e-12)
    # sigma below the step's own multiplier: nothing is added, and the step's multiplier is reported
    weak = fb.LMC(step_size=gamma, num_chains=2, init="prior", privacy=privacy.DP(clip=clip, noise_multiplier=0.1))
    weak_run = weak.build(problem)
    assert weak_run._dp.sigma == privacy.langevin_noise_multiplier(gamma, clip) and float(weak_run._dp.added_std()) == 0


def test_private_lmc_meets_a_target_epsilon_and_refuses_unaccounted_releases():
    data, P, _ = gaussian_clients()
    gamma = 0.1 / np.linalg.eigvalsh(P).max()
    res = fb.fed_fit(gauss_model, data, fb.LMC(step_size=gamma, num_chains=2, init="prior",
                                               privacy=privacy.DP(clip=1.0, epsilon=3.0, delta=1e-3)),
                     num_rounds=50, seed=1)
    rep = res.privacy
    assert rep["epsilon"] <= 3.0 and rep["delta"] == 1e-3
    assert rep["noise_multiplier"] == pytest.approx(
        max(privacy.noise_multiplier_for(3.0, delta=1e-3, rounds=50, num_clients=5, extra_rounds=1),
            privacy.langevin_noise_multiplier(gamma, 1.0)), rel=1e-12)
    assert fb.fed_fit(gauss_model, data, fb.LMC(step_size=gamma, num_chains=2, init="prior"), num_rounds=5).privacy is None
    for kw, match in ((dict(init="prior"), "given step_size"), (dict(step_size=gamma), "init='prior'"),
                      (dict(step_size=gamma, init="map"), "init='prior'")):
        with pytest.raises(ConfigError, match=match):
            fb.fed_fit(gauss_model, data, fb.LMC(privacy=privacy.DP(clip=1.0, noise_multiplier=1.0), **kw), num_rounds=5)
    with pytest.raises(ConfigError, match="distributed DP.*identity compressor"):
        fb.fed_fit(gauss_model, data, fb.LMC(step_size=gamma, init="prior", compressor=fb.compress.top_k(2),
                                             privacy=privacy.DP(clip=1.0, noise_multiplier=1.0, mode="distributed")),
                   num_rounds=5)
    with pytest.raises(ConfigError, match="fb.privacy.DP"):
        fb.LMC(privacy=3.0)


def _epsilon_lower_bound(pos, neg, delta, thresholds, confidence=0.95):
    """A lower bound on epsilon from samples of a statistic under two neighbouring data sets: for each
    threshold t, (TPR - delta) / FPR <= e^epsilon for every (epsilon, delta)-DP mechanism (both
    directions of the test), with TPR's lower and FPR's upper Clopper-Pearson bound at ``confidence``
    after a Bonferroni correction over the thresholds and the two directions."""
    from scipy.stats import beta

    alpha = (1 - confidence) / (2 * 2 * len(thresholds))  # two bounds per test, two directions
    best = 0.0
    for a, b in ((pos, neg), (-neg, -pos)):
        for t in (thresholds if a is pos else -np.asarray(thresholds)):
            k_tp, k_fp, n_a, n_b = int(np.sum(a > t)), int(np.sum(b > t)), a.size, b.size
            tpr = beta.ppf(alpha, k_tp, n_a - k_tp + 1) if k_tp > 0 else 0.0
            fpr = beta.ppf(1 - alpha, k_fp + 1, n_b - k_fp) if k_fp < n_b else 1.0
            if tpr - delta > 0:
                best = max(best, math.log((tpr - delta) / fpr))
    return best


def test_privacy_audit_of_private_lmc_and_a_broken_mechanism_is_caught():
    # The set-up's release x_1 = x_0 - gamma (sum_i clip(g_i) + s e) + sqrt(2 gamma) z, drawn 200 000 times
    # (vectorised over keys) with the run's own server step, for two neighbouring data sets: client 0
    # sends a canary 10 C u (D) or nothing, 0 (D'); the other clients' uploads are the same. The
    # statistic is x_1's projection on u (the optimal test for one release). The measured lower bound
    # stays below the accountant's epsilon; without clipping (a broken mechanism) it exceeds it.
    data, P, _ = gaussian_clients()
    gamma, clip, sigma, delta, n = 0.1 / np.linalg.eigvalsh(P).max(), 20.0, 2.0, 1e-5, 200_000
    problem = Problem(fb.FedModel(gauss_model, data), data, 1)
    run = fb.LMC(step_size=gamma, num_chains=1, init="prior",
                 privacy=privacy.DP(clip=clip, noise_multiplier=sigma, delta=delta)).build(problem)
    x0 = jnp.zeros((1, D))
    u = jnp.ones(D) / np.sqrt(D)
    others = jax.random.normal(jax.random.PRNGKey(3), (4, 1, D))
    with_canary = jnp.concatenate([10 * clip * u[None, None], others])
    without = jnp.concatenate([jnp.zeros((1, 1, D)), others])
    curv = jnp.zeros((5,))

    def releases(rows, seed):
        keys = jax.random.split(jax.random.PRNGKey(seed), n)
        step = jax.jit(jax.vmap(lambda k: run.setup_server_step(0, k, x0, (rows, curv))[0].x[0]))
        return np.asarray(step(keys) @ u) / (gamma * clip)  # in units of the canary's clipped shift

    pos, neg = -releases(with_canary, 0), -releases(without, 1)  # the step moves against the gradient
    thresholds = np.linspace(-1, 4, 21) * np.std(neg) + neg.mean()
    claimed = run._dp.epsilon  # both releases of a one-round fit: an upper bound for the first alone
    measured = _epsilon_lower_bound(pos, neg, delta, thresholds)
    assert run._dp.sigma == sigma and float(run._dp.added_std()) > 0  # the step's own multiplier is below sigma
    exact_one = privacy.epsilon(sigma, delta=delta, rounds=1, num_clients=5, accountant="pld")
    assert 0.3 * exact_one < measured <= exact_one <= claimed  # a real distinguisher, below the guarantee
    run._dp.clipped_sum = lambda rows: jnp.sum(rows, 0)  # broken: the canary's 10 C goes through
    broken = _epsilon_lower_bound(-releases(with_canary, 0), neg, delta,
                                  np.linspace(-1, 12, 53) * np.std(neg) + neg.mean())
    assert broken > claimed


@pytest.fixture
def float32():
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    yield
    jax.config.update("jax_enable_x64", before)


@pytest.mark.parametrize("mode", ["central", "distributed"])
def test_private_lmc_on_flower_equals_fed_fit(float32, mode):
    # Flower's ServerApp runs the same server step: the clipping, the noise (from the same secret
    # noise_seed) and the prior's gradient happen on the server, so a run on Flower (local grid; float32,
    # as the wire is exact there: tests/test_flower.py) gives fed_fit's draws and privacy report. The
    # server's step compiled alone rounds the prior's gradient differently from the fused rounds of
    # fed_fit (as FedSOUL's does, tests/test_flower.py): 1.5e-7 relative at most after 6 rounds here;
    # 1e-5 is 70 float32 ulps, and a different noise draw moves the draws by orders of magnitude more.
    flower = pytest.importorskip("fedbayes.flower")
    data, _ = fb.models.make_glm_clients(5, 3, 20, seed=0)
    model = fb.models.logistic_regression()
    algo = fb.LMC(step_size=0.01, num_chains=2, init="prior",
                  privacy=privacy.DP(clip=0.5, noise_multiplier=30.0, mode=mode, noise_seed=3))
    ref = fb.fed_fit(model, data, algo, num_rounds=6, seed=4)
    res = flower.simulate(model, data, algo, num_rounds=6, seed=4, backend="local")
    np.testing.assert_allclose(res.global_samples["w"], ref.global_samples["w"], rtol=1e-5, atol=1e-6)
    assert res.privacy == ref.privacy and ref.privacy["added_noise_std"] > 0


# ----------------------------------------------------------------------------- FedSOUL with central DP
def _lme(n=6, seed=0):
    return fb.models.make_linear_mixed_effects(n, seed=seed)[0]


def _fedsoul_round(run, problem, rows):
    """The server step of ``run`` on uploads whose gradients are ``rows`` (dict of (n, ...) arrays)."""
    from fedbayes.algorithms.fedsoul import Upload

    server, _, _ = run.init(jax.random.PRNGKey(0), problem)
    n = problem.data.num_clients
    upload = Upload(({}, rows), jnp.zeros(n), ())
    info = RoundInfo(jnp.asarray(0), jnp.arange(n), jnp.ones(n, bool), n)
    return server, run.server_step(jax.random.PRNGKey(1), server, Message(upload, jnp.asarray(0)), info)[0]


def test_private_fedsoul_clips_each_upload_and_noises_the_sum():
    # With sigma = 0 the private server step on raw uploads is the plain (Adam) step on the uploads
    # clipped by hand, bit for bit; the noise itself is N(0, (sigma w C)^2) per coordinate (Monte Carlo,
    # 5 standard errors of the variance's relative error sqrt(2 / n)).
    data = _lme()
    problem = Problem(fb.FedModel(fb.models.linear_mixed_effects, data), data, 20)
    clip = 0.7
    rng = np.random.default_rng(0)
    private = fb.FedSOUL(privacy=privacy.DP(clip=clip, noise_multiplier=0.0)).build(problem)
    theta = private.init(jax.random.PRNGKey(0), problem)[0].theta  # the unconstrained globals, as uploaded
    small = np.where(np.arange(6) == 5, 0.05, 1.0)  # the last client's upload stays below the clip
    rows = {k: jnp.asarray(rng.normal(size=(6,) + np.shape(v)) * small.reshape((6,) + (1,) * np.ndim(v)))
            for k, v in theta.items()}
    plain = fb.FedSOUL(server_optimizer="adam", uncertainty=False).build(problem)
    norms = np.sqrt(sum(np.sum(np.asarray(v).reshape(6, -1) ** 2, axis=1) for v in rows.values()))
    scale = np.where(norms > clip, clip / norms * (1 - 2.0**-20), 1.0)
    by_hand = {k: jnp.asarray(np.asarray(v) * scale.reshape((6,) + (1,) * (v.ndim - 1))) for k, v in rows.items()}
    assert (norms > clip).sum() >= 3 and (norms <= clip).sum() >= 1
    _, new_private = _fedsoul_round(private, problem, rows)
    _, new_plain = _fedsoul_round(plain, problem, by_hand)
    for k in rows:
        np.testing.assert_allclose(new_private.theta[k], new_plain.theta[k], rtol=1e-12, atol=1e-14)
    sp = privacy.SumPrivacy(privacy.DP(clip=clip, noise_multiplier=1.3), 20, 6, 3)
    zeros = {"a": jnp.zeros((100_000,)), "b": jnp.zeros((50, 20))}
    noisy = sp.noisy(jax.random.PRNGKey(2), zeros, 2.0)  # the weight b / |A| = 2: half the clients answered
    v = np.concatenate([np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(noisy)])
    assert abs(v.var() / (1.3 * 2.0 * clip) ** 2 - 1) < 5 * np.sqrt(2 / v.size)


def test_private_fedsoul_fit_reports_its_epsilon_and_releases_nothing_else():
    data = _lme()
    dp = privacy.DP(clip=5.0, noise_multiplier=0.8, delta=1e-4)
    res = fb.fed_fit(fb.models.linear_mixed_effects, data, fb.FedSOUL(server_lr=0.05, privacy=dp), num_rounds=30,
                     clients_per_round=3, seed=0)
    rep = res.privacy
    assert rep["relation"] == "replace" and rep["cohort"] == 3 and rep["releases"] == 30
    assert rep["epsilon"] == privacy.epsilon(0.8, delta=1e-4, rounds=30, num_clients=6, cohort_size=3)
    assert np.isnan(res.history["objective"]).all() and not res.standard_errors
    assert res.settings["server_optimizer"] == "adam" and res.settings["uncertainty"] is False
    assert res.idata.posterior.attrs["privacy_epsilon"] == rep["epsilon"]
    target = fb.fed_fit(fb.models.linear_mixed_effects, data,
                        fb.FedSOUL(server_lr=0.05, privacy=privacy.DP(clip=5.0, epsilon=2.0, delta=1e-4)),
                        num_rounds=30, clients_per_round=3, seed=0)
    assert target.privacy["epsilon"] <= 2.0
    bad = [dict(server_optimizer="fisher"), dict(uncertainty=True), dict(aggregation="median"), dict(init="map")]
    for kw in bad:
        with pytest.raises(ConfigError, match="privacy"):
            fb.FedSOUL(privacy=dp, **kw)
    with pytest.raises(ConfigError, match="distributed"):
        fb.FedSOUL(privacy=privacy.DP(clip=1.0, noise_multiplier=1.0, mode="distributed"))
    with pytest.raises(ConfigError, match="FedRep has no privacy"):
        fb.FedRep(privacy=dp)
