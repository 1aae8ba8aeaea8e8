"""fedbayes.privacy: clipping bounds, the noise's variance, and the accountant against exact and
independent references (the Gaussian mechanism's closed form, the PRV accountant)."""

import dataclasses
import math
import warnings

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


def _renyi_of_a_mixture(gamma, sigma, order, reverse=False):
    """D_order(P || Q) (or Q || P) for P = (1 - gamma) N(0, sigma^2) + gamma N(2, sigma^2), Q = N(0, sigma^2), by
    adaptive quadrature in log space (relative error 1e-12); no accounting library involved."""
    from scipy import integrate

    def integrand(x):
        log_q = -0.5 * (x / sigma) ** 2
        log_p = np.logaddexp(np.log1p(-gamma) + log_q, np.log(gamma) - 0.5 * ((x - 2) / sigma) ** 2)
        a, b = (log_q, log_p) if reverse else (log_p, log_q)
        return np.exp(order * a + (1 - order) * b - 0.5 * np.log(2 * np.pi * sigma**2))

    value, _ = integrate.quad(integrand, -60 * sigma - 5, 60 * sigma + 5, points=[0, 1, 2], limit=500, epsabs=0,
                              epsrel=1e-12)
    return math.log(value) / (order - 1)


@pytest.mark.parametrize("cohort", [1, 10, 50])
@pytest.mark.parametrize("sigma", [1.0, 2.0, 4.0])
def test_fixed_cohort_rdp_bounds_an_attainable_neighbouring_pair(cohort, sigma):
    """An independent check of the replace-one accountant for fixed-size cohorts (no second library
    implements Wang, Balle and Kasiviswanathan's bound): its Renyi DP must be at least the Renyi divergence
    of every pair of outputs that neighbouring federations produce, here one computed by quadrature.

    The pair: n = 100 clients with clip C = 1 and noise sd sigma, cohorts of m drawn without replacement
    (gamma = m / n). Every client but k uploads -1; client k uploads +1 in D and -1 in D'. Without k in the
    cohort both sums are -m; with k they are -m + 2 and -m. Shifted by m, D gives P = (1 - gamma) N(0, sigma^2)
    + gamma N(2, sigma^2) and D' gives Q = N(0, sigma^2). The accountant's RDP (the event the library
    composes, a Gaussian at sigma / 2 for the sum's sensitivity 2C) must be above both divergences at every
    order, and, to show the bound is not vacuous, within WBK's known factor (at most about 4 here at the
    low orders, where their min(4 (e^eps - 1), ...) term binds; about 1 at the high ones)."""
    dpa = privacy._accounting()
    n, orders = 100, [2.0, 4.0, 8.0]
    acc = dpa.rdp.RdpAccountant(orders=orders, neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    acc.compose(privacy._event(sigma, 1, n, cohort, "fixed", 0))  # one round, as fed_fit's accountant sees it
    gamma = cohort / n
    for order, bound in zip(orders, acc.rdp):
        attained = max(_renyi_of_a_mixture(gamma, sigma, order), _renyi_of_a_mixture(gamma, sigma, order, True))
        assert attained * (1 - 1e-9) <= bound <= 4.2 * attained, (order, attained, bound)


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


def _private_lmc_step(noise_seed: int):
    """A private LMC run on the Gaussian clients with sigma 3 times the step's own multiplier, and its
    server state after set-up: ``(problem, gamma, clip, sigma, run, server)``."""
    data, P, _ = gaussian_clients()
    gamma, clip = 0.1 / np.linalg.eigvalsh(P).max(), 0.5
    sigma = 3 * privacy.langevin_noise_multiplier(gamma, clip)
    problem = Problem(fb.FedModel(gauss_model, data), data, 10)
    run = fb.LMC(step_size=gamma, num_chains=2, init="prior",
                 privacy=privacy.DP(clip=clip, noise_multiplier=sigma, noise_seed=noise_seed)).build(problem)
    return problem, gamma, clip, sigma, run, run.init(jax.random.PRNGKey(0), problem)[0]


def test_private_lmc_clips_each_upload_and_adds_only_the_missing_noise():
    # The server's step by hand: x' = x - gamma (sum_i clip(g_i) + s e + grad(-log prior)(x)) + sqrt(2 gamma) z
    # with the keys the run splits, e drawn from the secret key (noise_seed) folded with the public one;
    # uploads far above the clip are cut to it, one below it is kept. The server adds the prior's gradient
    # (the clients send their likelihood's alone).
    problem, gamma, clip, sigma, run, server = _private_lmc_step(noise_seed=11)
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
    # the step's own noise counts towards the mechanism, so it too comes from the secret key
    z = np.asarray(jax.random.normal(privacy.folded(secret, jax.random.split(k_move)[0]), (2, D)))
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
    # ... and then the step's noise is all the protection there is: it must be secret (not from the public
    # seed), so two noise seeds give two chains from the same public seed
    a, b = (fb.fed_fit(gauss_model, problem.data, dataclasses.replace(weak, privacy=privacy.DP(
        clip=clip, noise_multiplier=0.1, noise_seed=k)), num_rounds=3, seed=0) for k in (1, 2))
    assert np.abs(a.global_samples["x"] - b.global_samples["x"]).min() > 0


def test_private_lmc_noise_follows_the_rounds_fault_weight():
    # A round where client 4 of 5 failed sums the four others' clipped uploads times w = 5/4 (unbiased
    # under random faults), so its sensitivity is w C and the noise must grow with it: with zero uploads,
    # x' - x + gamma grad(-log prior)(x) = -gamma s e + sqrt(2 gamma) z has variance
    # gamma^2 s^2 + 2 gamma = (gamma sigma w C)^2 per coordinate. Monte Carlo over 4 000 server keys x 2 chains
    # x D coordinates: 5 standard errors of a variance's relative error, sqrt(2 / N).
    _, gamma, clip, sigma, run, server = _private_lmc_step(noise_seed=7)
    faulty = jnp.arange(5) == 4
    info = RoundInfo(jnp.asarray(0), jnp.arange(5), ~faulty, 5, faulty=faulty)
    zeros = Message(jnp.zeros((5, 2, D)), jnp.asarray(0))
    moves = jax.vmap(lambda k: run.server_step(k, server, zeros, info)[0].x)(
        jax.random.split(jax.random.PRNGKey(3), 4000))
    prior_grad = np.asarray(server.x) / PRIOR_SD**2
    centred = np.asarray(moves) - (np.asarray(server.x) - gamma * prior_grad)
    w = 5 / 4
    ratio = centred.var() / (gamma * sigma * w * clip) ** 2
    assert abs(ratio - 1) < 5 * np.sqrt(2 / centred.size), ratio
    assert abs(centred.var() / (gamma * sigma * clip) ** 2 - 1) > 0.4  # not the variance of a full round


def test_private_p_elf_is_private_lmc_with_a_compressed_downlink():
    # P-ELF's uplink is LMC's: with the identity downlink (w = x) a private P-ELF gives private LMC's draws
    # (the same clipping and secret noise); with a compressed downlink the mechanism, and so the report,
    # is the same (the downlink sends functions of the released iterates only).
    data, P, _ = gaussian_clients()
    gamma, clip = 0.1 / np.linalg.eigvalsh(P).max(), 0.5
    dp = privacy.DP(clip=clip, noise_multiplier=3 * privacy.langevin_noise_multiplier(gamma, clip), noise_seed=2)
    kw = dict(step_size=gamma, num_chains=2, init="prior", privacy=dp)
    lmc = fb.fed_fit(gauss_model, data, fb.LMC(**kw), num_rounds=30, seed=1)
    pelf = fb.fed_fit(gauss_model, data, fb.PELF(**kw), num_rounds=30, seed=1)
    np.testing.assert_allclose(pelf.global_samples["x"], lmc.global_samples["x"], rtol=1e-10, atol=1e-12)
    topk = fb.fed_fit(gauss_model, data, fb.PELF(downlink=fb.compress.top_k(2), **kw), num_rounds=30, seed=1)
    assert topk.privacy == lmc.privacy and topk.bits_down < lmc.bits_down
    with pytest.raises(ConfigError, match="P-ELF with privacy needs a given step_size"):
        fb.fed_fit(gauss_model, data, fb.PELF(init="prior", privacy=dp), num_rounds=5)


def test_private_d_elf_clips_each_clients_memory_at_the_server():
    # Under error feedback the released sum is that of the clients' memories g^i (each the sum of the client's
    # messages, which the server sees): the server keeps every g^i and releases sum_i clip(g^i, C). The server
    # step by hand with top-1 messages: memories <- memories + messages, then
    # x' = x - gamma (sum_i clip(g^i) + s e + grad(-log prior)(x)) + sqrt(2 gamma) z, with s = 0 here (sigma at
    # the step's own multiplier). With the identity uplink (memory = gradient) private D-ELF is private LMC.
    data, P, _ = gaussian_clients()
    gamma, clip = 0.1 / np.linalg.eigvalsh(P).max(), 0.5
    problem = Problem(fb.FedModel(gauss_model, data), data, 10)
    dp = privacy.DP(clip=clip, noise_multiplier=0.0, noise_seed=4)
    run = fb.DELF(uplink=fb.compress.top_k(1), step_size=gamma, num_chains=2, init="prior", privacy=dp).build(problem)
    server, _, _ = run.init(jax.random.PRNGKey(0), problem)
    memories = np.asarray(server.up)
    assert memories.shape == (5, 2, D) and float(run._dp.added_std()) == 0
    rows = np.zeros((5, 2, D))
    rows[:, :, 0] = np.asarray([20.0, -20.0, 20.0, 0.0, 1e-3])[:, None]  # top-1 messages; client 3 sent nothing
    key = jax.random.PRNGKey(2)
    info = RoundInfo(jnp.asarray(0), jnp.arange(5), jnp.ones(5, bool), 5)
    new, _, _ = run.server_step(key, server, Message(jnp.asarray(rows), jnp.asarray(0)), info)
    after = memories + rows
    np.testing.assert_allclose(new.up, after, rtol=1e-15)
    norms = np.linalg.norm(after.reshape(5, -1), axis=1)
    assert (norms > clip).sum() >= 3
    g = np.sum(after * np.minimum(1.0, clip / norms * (1 - 2.0**-20))[:, None, None], 0)
    prior_grad = np.asarray(server.x) / PRIOR_SD**2
    z = np.asarray(jax.random.normal(privacy.folded(privacy.secret_key(4), jax.random.split(jax.random.split(key)[0])[0]),
                                     (2, D)))
    np.testing.assert_allclose(new.x, np.asarray(server.x) - gamma * (g + prior_grad) + np.sqrt(2 * gamma) * z,
                               rtol=1e-6, atol=1e-9)  # the clip's own margin: 2^-20 relative on g
    dp = privacy.DP(clip=clip, noise_multiplier=3 * privacy.langevin_noise_multiplier(gamma, clip), noise_seed=4)
    kw = dict(step_size=gamma, num_chains=2, init="prior", privacy=dp)
    lmc = fb.fed_fit(gauss_model, data, fb.LMC(**kw), num_rounds=30, seed=1)
    delf = fb.fed_fit(gauss_model, data, fb.DELF(**kw), num_rounds=30, seed=1)
    np.testing.assert_allclose(delf.global_samples["x"], lmc.global_samples["x"], rtol=1e-9, atol=1e-10)
    assert delf.privacy == lmc.privacy
    for algo in (fb.DELF, fb.BELF):
        with pytest.raises(ConfigError, match="privacy is central"):
            fb.fed_fit(gauss_model, data, algo(step_size=gamma, init="prior", privacy=privacy.DP(
                clip=clip, noise_multiplier=1.0, mode="distributed")), num_rounds=5)


def test_distributed_lmc_reports_the_epsilon_of_the_rounds_as_they_went():
    # A client that drops out takes its share of the noise with it: a round with a of n answering is a
    # Gaussian mechanism with multiplier sigma sqrt(a / n). The report's epsilon_realised composes exactly
    # those rounds (and the set-up's, with every client) with dp-accounting, recomputed here from the
    # history; with 30% dropouts it exceeds the planned epsilon, and without faults it equals it.
    import dp_accounting as dpa

    data, P, _ = gaussian_clients()
    gamma, clip = 0.1 / np.linalg.eigvalsh(P).max(), 0.5
    dp = privacy.DP(clip=clip, noise_multiplier=8.0, mode="distributed", noise_seed=1)
    algo = fb.LMC(step_size=gamma, num_chains=2, init="prior", privacy=dp)
    with pytest.warns(UserWarning, match="no secure aggregation"):
        res = fb.fed_fit(gauss_model, data, algo, num_rounds=40, seed=0, faults=fb.Faults(drop=0.3))
    answered = np.asarray(res.history["active"])
    assert answered.min() < 5
    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.ComposedDpEvent([dpa.GaussianDpEvent(8.0 * np.sqrt(a / 5)) for a in [5, *answered] if a > 0]))
    rep = res.privacy
    assert rep["epsilon_realised"] == pytest.approx(acc.get_epsilon(rep["delta"]), rel=1e-9)
    assert rep["epsilon_realised"] > rep["epsilon"] and rep["relation"] == "zero-out"
    with pytest.warns(UserWarning, match="no secure aggregation"):
        full = fb.fed_fit(gauss_model, data, algo, num_rounds=40, seed=0)
    assert full.privacy["epsilon_realised"] == pytest.approx(full.privacy["epsilon"], rel=1e-9)


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


def test_privacy_audit_of_a_private_d_elf_round_and_unclipped_memories_are_caught():
    # A round of private D-ELF releases x' = x - gamma (sum_i clip(g^i, C) + s e + grad(-log prior)(x)) +
    # sqrt(2 gamma) z, g^i the error-feedback memories the server keeps. The audit of the set-up's release
    # (above) on a round: client 0's memory holds a canary 10 C u (D) or nothing (D'), the others' memories
    # and this round's (empty) messages are the same; 200 000 server steps each, the statistic x''s
    # projection on u. The measured lower bound stays below the exact epsilon of one release; with the
    # memories summed unclipped (the mechanism one would get by clipping the messages instead) it exceeds
    # the accountant's epsilon for the whole fit.
    data, P, _ = gaussian_clients()
    gamma, clip, sigma, delta, n = 0.1 / np.linalg.eigvalsh(P).max(), 20.0, 2.0, 1e-5, 200_000
    problem = Problem(fb.FedModel(gauss_model, data), data, 1)
    run = fb.DELF(uplink=fb.compress.top_k(1), step_size=gamma, num_chains=1, init="prior",
                  privacy=privacy.DP(clip=clip, noise_multiplier=sigma, delta=delta)).build(problem)
    server = run.init(jax.random.PRNGKey(0), problem)[0]
    u = jnp.ones(D) / np.sqrt(D)
    others = jax.random.normal(jax.random.PRNGKey(3), (4, 1, D))
    with_canary = jnp.concatenate([10 * clip * u[None, None], others])
    without = jnp.concatenate([jnp.zeros((1, 1, D)), others])
    info = RoundInfo(jnp.asarray(0), jnp.arange(5), jnp.ones(5, bool), 5)
    empty = Message(jnp.zeros((5, 1, D)), jnp.asarray(0))

    def releases(memories, seed):
        state = server._replace(x=jnp.zeros((1, D)), up=memories)
        keys = jax.random.split(jax.random.PRNGKey(seed), n)
        step = jax.jit(jax.vmap(lambda k: run.server_step(k, state, empty, info)[0].x[0]))
        return np.asarray(step(keys) @ u) / (gamma * clip)

    pos, neg = -releases(with_canary, 0), -releases(without, 1)
    thresholds = np.linspace(-1, 4, 21) * np.std(neg) + neg.mean()
    measured = _epsilon_lower_bound(pos, neg, delta, thresholds)
    exact_one = privacy.epsilon(sigma, delta=delta, rounds=1, num_clients=5, accountant="pld")
    assert 0.3 * exact_one < measured <= exact_one <= run._dp.epsilon
    run.up = dataclasses.replace(run.up, clip=1e30)  # broken: the memories summed as they are
    broken = _epsilon_lower_bound(-releases(with_canary, 0), neg, delta,
                                  np.linspace(-1, 12, 53) * np.std(neg) + neg.mean())
    assert broken > run._dp.epsilon


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
    with pytest.raises(ConfigError, match="distributed DP sends each client's gradient clipped and noised in full"):
        fb.FedSOUL(privacy=privacy.DP(clip=1.0, noise_multiplier=1.0, mode="distributed"), compressor=fb.compress.qsgd(4))
    with pytest.raises(ConfigError, match="FedRep has no privacy"):
        fb.FedRep(privacy=dp)


# ----------------------------------------------------------------------------- FedMM with central DP
K_GMM, D_GMM = 3, 2


@pytest.fixture(scope="module")
def gmm():
    data, _ = fb.models.make_gaussian_mixture(6, num_components=K_GMM, dim=D_GMM, sizes=(30, 90), concentration=0.3,
                                              seed=3)
    y = np.asarray(data.pooled()["y"])
    init = {"weights": np.ones(K_GMM) / K_GMM, "means": y[[0, 100, 200]],
            "covs": np.broadcast_to(np.eye(D_GMM), (K_GMM, D_GMM, D_GMM)).copy()}
    return data, init, fb.models.gaussian_mixture(K_GMM, D_GMM)


def test_private_fedmm_with_a_loose_clip_and_no_noise_is_fedmm_without_control_variates(gmm):
    # sigma = 0 and a clip no upload reaches: the private fit is the plain fit with the settings privacy
    # implies (no control variates, no final exchange, the average over the last half), up to the
    # rounding of n mu_i x / n (a few ulps per round over 40 rounds of EM)
    data, init, model = gmm
    plain = fb.fed_fit(model, data, fb.FedMM(init=init, alpha=0, uncertainty=False, average_from=0.5), num_rounds=40,
                       seed=0)
    private = fb.fed_fit(model, data, fb.FedMM(init=init, privacy=privacy.DP(clip=1e8, noise_multiplier=0.0)),
                         num_rounds=40, seed=0)
    for k in plain.params:
        np.testing.assert_allclose(private.params[k], plain.params[k], rtol=1e-10, atol=1e-12)
    assert private.settings["alpha"] == 0 and private.settings["uncertainty"] is False
    assert private.privacy["relation"] == "zero-out"  # the weights use the clients' sizes, which are public
    assert not private.standard_errors and sum(private.final_bits) == 0


def _fedmm_run(algo, data, model):
    problem = Problem(fb.FedModel(model, data), data, 10)
    run = algo.build(problem)
    return run, run.init(jax.random.PRNGKey(0), problem)[0]


def _fedmm_step(run, server, rows, active, key=1):
    """S_{t+1} - S_t of one server step of ``run`` (FedEM: no projection; gamma = 1) on uploads ``rows``."""
    n = rows.shape[0]
    info = RoundInfo(jnp.asarray(0), jnp.arange(n), jnp.asarray(active), n)
    new = run.server_step(jax.random.PRNGKey(key), server, Message(jnp.asarray(rows), jnp.asarray(0)), info)[0]
    return np.asarray(new.s - server.s)


def test_private_fedmm_clips_each_weighted_upload_and_noises_the_mean(gmm):
    # The server's estimate of the mean statistic, (1/p) sum_i mu_i Q_i, under privacy is
    # (1/(n p)) sum_i clip(n mu_i Q_i, C) + N(0, (sigma C / (n p))^2): by hand with sigma = 0 (FedEM: the
    # step adds the estimate to S unprojected; a client that did not answer has mu_i = 0), and the noise's
    # variance by Monte Carlo (200 server steps x q coordinates; 5 standard errors of the relative error
    # of a variance, sqrt(2 / N))
    data, init, model = gmm
    clip, n = 0.3, data.num_clients
    run, server = _fedmm_run(fb.FedEM(init=init, privacy=privacy.DP(clip=clip, noise_multiplier=0.0)), data, model)
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(n, run.q)) * np.where(np.arange(n) == 0, 1e-3, 0.5)[:, None]  # client 0 under the clip
    active = np.arange(n) != 2
    step = _fedmm_step(run, server, rows, active)
    mu = np.asarray(data.sizes, float) / np.sum(data.sizes) * active
    shares = n * mu[:, None] * rows
    norms = np.linalg.norm(shares, axis=1)
    assert (norms > clip).sum() >= 3 and norms[0] < clip
    by_hand = np.sum(shares * np.minimum(1.0, clip / np.maximum(norms, 1e-300))[:, None], 0) / n
    np.testing.assert_allclose(step, by_hand, rtol=1e-6, atol=1e-12)  # the clip's own margin: 2^-20 relative
    run, server = _fedmm_run(fb.FedEM(init=init, privacy=privacy.DP(clip=clip, noise_multiplier=1.7)), data, model)
    noise = np.stack([_fedmm_step(run, server, np.zeros((n, run.q)), np.ones(n, bool), key=k) for k in range(200)])
    ratio = noise.var() / (1.7 * clip / n) ** 2
    assert abs(ratio - 1) < 5 * np.sqrt(2 / noise.size), ratio


def test_private_fedmm_reports_its_epsilon_and_refuses_unaccounted_releases(gmm):
    data, init, model = gmm
    dp = privacy.DP(clip=2.0, noise_multiplier=3.0, delta=1e-4)
    res = fb.fed_fit(model, data, fb.FedMM(init=init, privacy=dp), num_rounds=20, clients_per_round=3, seed=0)
    rep = res.privacy
    # 20 sampled rounds and the set-up's E-step of every client
    assert rep["releases"] == 21 and rep["relation"] == "replace" and rep["cohort"] == 3 and "N_i" in rep["public"]
    assert rep["epsilon"] == privacy.epsilon(3.0, delta=1e-4, rounds=20, num_clients=6, cohort_size=3,
                                             extra_rounds=1)
    assert res.idata.fed_params.attrs["privacy_epsilon"] == rep["epsilon"]  # no posterior group: the estimate's
    bad = [dict(compressor=fb.compress.qsgd(levels=4)), dict(alpha=0.5), dict(uncertainty=True),
           dict(population_start=True), dict(init="map")]
    for kw in bad:
        with pytest.raises(ConfigError, match="privacy"):
            fb.FedMM(**{"privacy": dp, **kw})
    with pytest.raises(ConfigError, match="distributed DP needs participation=1.0"):
        fb.FedMM(participation=0.5, privacy=privacy.DP(clip=1.0, noise_multiplier=1.0, mode="distributed"))
    with pytest.raises(ConfigError, match="ParamAveragingEM has no privacy"):
        fb.ParamAveragingEM(privacy=dp)


def test_private_fedmm_on_flower_equals_fed_fit(float32, gmm):
    # the server clips and noises with the same secret noise_seed on Flower as in fed_fit: the same
    # estimates (FedMM's server step compiled alone differs from the fused rounds in the last float32
    # bits, tests/test_flower.py; 1e-4 relative is ~800 ulps after 8 rounds, while another draw of the
    # noise moves the estimate by far more). The noise is small, sd sigma C / n = 8e-5: a mixture component
    # at mean (8, -10) with variances ~0.6 has raw second moments ~100 x its covariance, so noise on the
    # statistic reaches the covariance amplified ~200 times (see FedMM's ``privacy``), and the clip is
    # above every upload (|n mu_i s_i| reaches 180 at the start).
    flower = pytest.importorskip("fedbayes.flower")
    data, init, model = gmm
    init32 = {k: np.asarray(v, np.float32) for k, v in init.items()}
    algo = fb.FedMM(init=init32, privacy=privacy.DP(clip=500.0, noise_multiplier=1e-6, noise_seed=5))
    ref = fb.fed_fit(model, data, algo, num_rounds=8, seed=2)
    res = flower.simulate(model, data, algo, num_rounds=8, seed=2, backend="local")
    for k in ref.params:
        np.testing.assert_allclose(res.params[k], ref.params[k], rtol=1e-4, atol=1e-5)
    assert res.privacy == ref.privacy
    other = fb.fed_fit(model, data, dataclasses.replace(algo, privacy=privacy.DP(clip=500.0, noise_multiplier=1e-6,
                                                                                  noise_seed=6)), num_rounds=8, seed=2)
    moved = max(np.max(np.abs(other.params[k] - ref.params[k]) / (1e-5 + 1e-4 * np.abs(ref.params[k])))
                for k in ref.params)
    assert moved > 10, moved  # another draw of the noise is 10x beyond the tolerance


# ----------------------------------------------------------------------------- secure aggregation (SecAgg+)
def _secagg_lmc(**kw):
    data, _ = fb.models.make_glm_clients(5, 3, 20, seed=0)
    algo = fb.LMC(step_size=0.01, num_chains=2, init="prior",
                  privacy=privacy.DP(clip=0.5, noise_multiplier=30.0, mode="distributed", noise_seed=3, **kw))
    return fb.models.logistic_regression(), data, algo


@pytest.mark.parametrize("dropped", [None, 2])
def test_lmc_with_secure_aggregation_equals_the_plain_run_and_shows_the_server_sums_only(float32, dropped):
    # Flower's SecAgg+ gives the server the sum of the clients' uploads (here the gradients, clipped and
    # noised by each client), never an upload. The sum is exact to the quantisation, 2 n R / Q per
    # coordinate: R = C + 8 s / sqrt(n) = 54, Q = 2^30, n = 5: 5e-7 on the gradient sum, 5e-9 on a move
    # of step 0.01; over 6 rounds that is far below float32's rounding of x (ulp 6e-8 at |x| ~ 0.6), so
    # the draws agree to 1e-6 (16 ulps). With client 2 unreachable in round 2 (all four SecAgg+ stages),
    # the sum of the four others is what the plain run's server sums.
    flower = pytest.importorskip("fedbayes.flower")
    model, data, algo = _secagg_lmc()
    unreachable = None if dropped is None else (lambda k, client: k == 2 and client == dropped)
    with pytest.warns(UserWarning, match="no secure aggregation"):
        plain = flower.simulate(model, data, algo, num_rounds=6, seed=4, backend="local", unreachable=unreachable)
    with pytest.warns(UserWarning, match="noise_seed") as caught:  # the test's seed is known to the server
        res = flower.simulate(model, data, algo, num_rounds=6, seed=4, backend="local", unreachable=unreachable,
                              secure_aggregation=flower.SecAggPlus())
    assert not [w for w in caught if "no secure aggregation" in str(w.message)]  # the server sees only sums
    np.testing.assert_allclose(res.global_samples["w"], plain.global_samples["w"], rtol=0, atol=1e-6)
    assert not np.array_equal(res.global_samples["w"], plain.global_samples["w"])  # the quantisation's own mark
    kinds = {kind for kind, *_ in res.flower_messages}
    assert not kinds & {"upload", "setup-reply"}  # no upload reached the server as itself
    assert {"secagg:collect_masked_vectors-reply", "secagg:unmask-reply"} <= kinds
    assert res.history["active"][2] == (4 if dropped is not None else 5)  # the sum is over those who answered
    assert res.faults.equals(plain.faults)
    assert res.privacy["secure_aggregation"] == "SecAgg+ (Flower)" and res.privacy["epsilon"] == plain.privacy["epsilon"]
    assert res.bits_up == plain.bits_up  # the ledger counts what the algorithm sends, SecAgg+ adds its own messages


def test_secure_aggregation_refuses_servers_that_need_each_upload(float32):
    flower = pytest.importorskip("fedbayes.flower")
    model, data, _ = _secagg_lmc()
    central = fb.LMC(step_size=0.01, init="prior", privacy=privacy.DP(clip=0.5, noise_multiplier=30.0))
    cases = [(central, "central DP clips each upload"),
             (fb.DELF(uplink=fb.compress.top_k(1), init="prior"), "compressed"),
             (fb.TAMUNA(s=2, local_steps=2), "secure aggregation runs the TAMUNA family with distributed DP"),
             (fb.LMC(step_size=0.01, init="prior"), "needs clipping_range")]
    for algo, match in cases:
        with pytest.raises(ConfigError, match=match):
            flower.simulate(model, data, algo, num_rounds=2, backend="local", secure_aggregation=flower.SecAggPlus())
    for bad in (dict(num_shares=0), dict(num_shares=2), dict(num_shares=1.5), dict(reconstruction_threshold=0.0),
                dict(num_shares=5, reconstruction_threshold=5), dict(clipping_range=-1.0), dict(modulus_range=1000),
                dict(quantization_range=1.5), dict(quantization_range=2**31)):
        with pytest.raises(ConfigError, match="SecAggPlus"):
            flower.SecAggPlus(**bad)
    with pytest.raises(ConfigError, match="max_abs"):  # a bound on one upload cannot screen their sum
        flower.simulate(model, data, fb.LMC(step_size=0.01, init="prior"), num_rounds=2, backend="local",
                        fault_policy=fb.FaultPolicy(max_abs=10.0),
                        secure_aggregation=flower.SecAggPlus(clipping_range=10.0))
    # a client whose upload is not finite (gradients overflowing float32 on huge covariates) sends zeros and
    # a flag instead of a NaN that Flower would quantise to a finite integer: the server counts it as failed,
    # which at set-up stops the fit
    xs = [np.asarray(data.client(i)["x"], np.float32) for i in range(5)]
    xs[2] = xs[2] * (np.float32(1e38) / np.abs(xs[2]).max())
    bad = fb.FederatedData({"x": xs, "y": [np.asarray(data.client(i)["y"]) for i in range(5)]})
    with pytest.raises(fb.FedbayesError, match="non-finite"):
        flower.simulate(model, bad, fb.LMC(step_size=0.01, init="prior"), num_rounds=2, backend="local",
                        secure_aggregation=flower.SecAggPlus(clipping_range=10.0))
    with pytest.raises(ConfigError, match="overflows"):
        flower.simulate(model, data, fb.LMC(step_size=0.01, init="prior"), num_rounds=2, backend="local",
                        secure_aggregation=flower.SecAggPlus(clipping_range=10.0, quantization_range=2**30,
                                                             modulus_range=2**32))


def test_p_elf_without_privacy_runs_with_secure_aggregation(float32):
    # P-ELF's uplink is uncompressed, so its server, too, needs only the sum of the gradients; without DP the
    # clipping range is given (50: every gradient coordinate here is below 10). 2 n R / Q = 1e-6 on the sum,
    # 1e-8 on a move: the draws agree to float32 rounding (1e-6 is 16 ulps at |x| ~ 0.6).
    flower = pytest.importorskip("fedbayes.flower")
    model, data, _ = _secagg_lmc()
    algo = fb.PELF(downlink=fb.compress.top_k(2), num_chains=2, init="prior", step_size=0.01)
    plain = flower.simulate(model, data, algo, num_rounds=6, seed=4, backend="local")
    res = flower.simulate(model, data, algo, num_rounds=6, seed=4, backend="local",
                          secure_aggregation=flower.SecAggPlus(clipping_range=50.0))
    np.testing.assert_allclose(res.global_samples["w"], plain.global_samples["w"], rtol=0, atol=1e-6)
    assert not {kind for kind, *_ in res.flower_messages} & {"upload", "setup-reply"}


# ----------------------------------------------------------------------------- GD and FedAvg with central DP
def _glm(n=6, seed=0):
    return fb.models.make_glm_clients(n, 3, 25, family="linear", seed=seed)[0]


def _tamuna_step(run, rows, active, key=1):
    """The server step of a built GD / FedAvg run from its start x_bar on uploaded iterates ``rows`` (c, d)."""
    state, _ = run.setup_server(jax.random.PRNGKey(0))
    state = run.setup_done(state, ())
    c = rows.shape[0]
    info = RoundInfo(jnp.asarray(0), jnp.arange(c), jnp.asarray(active), c, jax.random.PRNGKey(7),
                     jnp.asarray(~np.asarray(active)))
    payload = jnp.where(jnp.asarray(active)[:, None], jnp.asarray(rows), 0.0)  # faulty rows arrive zeroed
    new, _, _ = run.server_step(jax.random.PRNGKey(key), state, Message(payload, jnp.asarray(0)), info)
    return np.asarray(state.x), np.asarray(new.x)


def test_private_gd_clips_each_update_and_noises_the_mean_update():
    # x_bar' = x_bar + (1/c) sum_{i active} clip(x_i - x_bar, C) + N(0, (sigma C / c)^2): by hand with sigma = 0
    # (one member inactive, one under the clip), and the noise's variance by Monte Carlo (300 server steps x d
    # coordinates; 5 standard errors of a variance's relative error sqrt(2 / N))
    data = _glm()
    problem = Problem(fb.FedModel(fb.models.linear_regression(), data), data, 20)
    clip, n = 0.4, data.num_clients
    run = fb.GD(step_size=0.1, privacy=privacy.DP(clip=clip, noise_multiplier=0.0)).build(problem)
    assert not run.final_exchange and not run.safeguard and not run.precondition
    rng = np.random.default_rng(0)
    d = run.dim
    start = _tamuna_step(run, np.zeros((n, d)), np.ones(n, bool))[0]
    updates = rng.normal(size=(n, d)) * np.where(np.arange(n) == 0, 1e-2, 1.0)[:, None]
    active = np.arange(n) != 3
    x0, x1 = _tamuna_step(run, start + updates, active)
    norms = np.linalg.norm(updates, axis=1)
    assert (norms[active] > clip).sum() >= 3 and norms[0] < clip
    clipped = updates * np.minimum(1.0, clip / norms)[:, None]
    by_hand = x0 + np.sum(clipped[active], 0) / n
    np.testing.assert_allclose(x1, by_hand, rtol=1e-6, atol=1e-12)  # the clip's own margin: 2^-20 relative
    run = fb.GD(step_size=0.1, privacy=privacy.DP(clip=clip, noise_multiplier=1.7)).build(problem)
    noise = np.stack([np.subtract(*_tamuna_step(run, np.tile(start, (n, 1)), np.ones(n, bool), key=k)[::-1])
                      for k in range(300)])
    ratio = noise.var() / (1.7 * clip / n) ** 2
    assert abs(ratio - 1) < 5 * np.sqrt(2 / noise.size), ratio


def test_private_gd_with_a_loose_clip_and_no_noise_is_gd():
    data = _glm()
    model = fb.models.linear_regression()
    plain = fb.fed_fit(model, data, fb.GD(step_size=0.005), num_rounds=40, seed=0, progress=False)
    private = fb.fed_fit(model, data, fb.GD(step_size=0.005, privacy=privacy.DP(clip=1e6, noise_multiplier=0.0)),
                         num_rounds=40, seed=0, progress=False)
    for k in plain.params:  # x + (1/n) sum (x_i - x) against (1/n) sum x_i: equal up to rounding
        np.testing.assert_allclose(private.params[k], plain.params[k], rtol=1e-12, atol=1e-14)
    assert private.final_bits == (0, 0) and plain.final_bits[0] > 0


def test_private_fedavg_reports_its_epsilon_and_gd_tamuna_refuse_unaccounted_releases():
    data = _glm()
    model = fb.models.linear_regression()
    dp = privacy.DP(clip=1.0, noise_multiplier=2.0, delta=1e-4)
    res = fb.fed_fit(model, data, fb.FedAvg(step_size=0.005, local_steps=3, privacy=dp), num_rounds=25,
                     clients_per_round=3, seed=0, progress=False)
    rep = res.privacy
    assert rep["relation"] == "replace" and rep["cohort"] == 3 and rep["releases"] == 25 and "cohort" in rep["public"]
    assert rep["epsilon"] == privacy.epsilon(2.0, delta=1e-4, rounds=25, num_clients=6, cohort_size=3)
    full = fb.fed_fit(model, data, fb.GD(step_size=0.005, privacy=dp), num_rounds=25, seed=0, progress=False)
    assert full.privacy["relation"] == "zero-out" and full.idata.fed_params.attrs["privacy_epsilon"] > 0
    assert full.information is None and "gradient" not in full._convergence  # no final exchange
    target = fb.fed_fit(model, data, fb.GD(step_size=0.005, privacy=privacy.DP(clip=1.0, epsilon=3.0, delta=1e-4)),
                        num_rounds=25, seed=0, progress=False)
    assert target.privacy["epsilon"] <= 3.0
    for kw in (dict(step_size=None), dict(precondition=True), dict(safeguard=True), dict(aggregation="median")):
        with pytest.raises(ConfigError, match="privacy"):
            fb.GD(**{"step_size": 0.05, "privacy": dp, **kw})
    for algorithm in (fb.TAMUNA, fb.Scaffnew):
        with pytest.raises(ConfigError, match="control variates"):
            algorithm(step_size=0.005, privacy=dp)


def test_private_fedavg_on_flower_equals_fed_fit(float32):
    # the server clips and noises with the same secret noise_seed on Flower as in fed_fit: the same estimate
    # (1e-5 relative in float32 after 10 rounds: the server step compiled alone against the fused rounds),
    # while another draw of the noise moves it by far more
    flower = pytest.importorskip("fedbayes.flower")
    data, model = _glm(), fb.models.linear_regression()
    algo = fb.FedAvg(step_size=0.005, local_steps=3, privacy=privacy.DP(clip=1.0, noise_multiplier=0.5, noise_seed=5))
    ref = fb.fed_fit(model, data, algo, num_rounds=10, clients_per_round=4, seed=2, progress=False)
    res = flower.simulate(model, data, algo, num_rounds=10, clients_per_round=4, seed=2, backend="local")
    for k in ref.params:
        np.testing.assert_allclose(res.params[k], ref.params[k], rtol=1e-5, atol=1e-6)
    assert res.privacy == ref.privacy
    other = fb.fed_fit(model, data, dataclasses.replace(algo, privacy=privacy.DP(clip=1.0, noise_multiplier=0.5,
                                                                                  noise_seed=6)),
                       num_rounds=10, clients_per_round=4, seed=2, progress=False)
    moved = max(np.max(np.abs(other.params[k] - ref.params[k]) / (1e-6 + 1e-5 * np.abs(ref.params[k])))
                for k in ref.params)
    assert moved > 10, moved


# ----------------------------------------------------------------------------- GD and FedAvg with distributed DP
def _distributed(clip, sigma, **kw):
    return privacy.DP(clip=clip, noise_multiplier=sigma, mode="distributed", **kw)


def test_distributed_gd_members_clip_their_updates_and_the_shares_carry_the_central_noise():
    # A member uploads clip(x_i - x_bar, C) + N(0, (sigma C)^2 / c): the clip's bound on every upload (sigma = 0),
    # the share's variance by Monte Carlo (2000 shares x d coordinates; 5 standard errors of a variance's relative
    # error sqrt(2 / N)), and the server's step x_bar + (1/c) sum_{i active} upload_i by hand.
    data = _glm()
    problem = Problem(fb.FedModel(fb.models.linear_regression(), data), data, 20)
    clip, n = 0.4, data.num_clients
    with pytest.warns(UserWarning, match="no secure aggregation"):
        run = fb.GD(step_size=0.1, privacy=_distributed(clip, 0.0)).build(problem)
    assert run.sums_uploads is True and not run.final_exchange
    rng = np.random.default_rng(0)
    d = run.dim
    updates = rng.normal(size=(n, d)) * np.where(np.arange(n) == 0, 1e-2, 1.0)[:, None]
    shares = np.stack([np.asarray(run._dp.share(jax.random.PRNGKey(i), jnp.asarray(u))) for i, u in enumerate(updates)])
    norms = np.linalg.norm(updates, axis=1)
    assert (norms > clip).sum() >= 3 and norms[0] < clip
    np.testing.assert_allclose(shares, updates * np.minimum(1.0, clip / norms)[:, None], rtol=1e-6, atol=1e-12)
    assert np.all(np.linalg.norm(shares, axis=1) <= clip * (1 + 1e-6))
    active = np.arange(n) != 3
    start = _tamuna_step(run, np.zeros((n, d)), np.ones(n, bool))[0]
    x0, x1 = _tamuna_step(run, shares, active)
    np.testing.assert_allclose(x1, x0 + shares[active].sum(0) / n, rtol=1e-12, atol=1e-14)
    with pytest.warns(UserWarning, match="no secure aggregation"):
        noisy = fb.GD(step_size=0.1, privacy=_distributed(clip, 1.7)).build(problem)
    zero = jnp.zeros(d)
    draws = np.stack([np.asarray(noisy._dp.share(jax.random.PRNGKey(k), zero)) for k in range(2000)])
    ratio = draws.var() / (1.7 * clip) ** 2 * n  # one share's variance is (sigma C)^2 / c, here c = n
    assert abs(ratio - 1) < 5 * np.sqrt(2 / draws.size), ratio
    assert start.shape == (d,)


def test_distributed_gd_with_a_loose_clip_and_no_noise_is_gd_and_reports_the_rounds_as_they_went():
    data = _glm()
    model = fb.models.linear_regression()
    plain = fb.fed_fit(model, data, fb.GD(step_size=0.005), num_rounds=40, seed=0, progress=False)
    with pytest.warns(UserWarning, match="no secure aggregation"):
        private = fb.fed_fit(model, data, fb.GD(step_size=0.005, privacy=_distributed(1e6, 0.0)), num_rounds=40,
                             seed=0, progress=False)
    for k in plain.params:  # x + (1/n) sum (x_i - x) against (1/n) sum x_i: equal up to rounding
        np.testing.assert_allclose(private.params[k], plain.params[k], rtol=1e-12, atol=1e-14)
    # every member answers: the rounds as they went are the planned ones; a member that drops takes its share of
    # the noise with it, and the realised epsilon of those rounds is larger
    dp = _distributed(1.0, 2.0, delta=1e-4)
    kw = dict(num_rounds=25, clients_per_round=4, seed=0, progress=False)
    with pytest.warns(UserWarning, match="no secure aggregation"):
        full = fb.fed_fit(model, data, fb.FedAvg(step_size=0.005, local_steps=3, privacy=dp), **kw)
        faulty = fb.fed_fit(model, data, fb.FedAvg(step_size=0.005, local_steps=3, privacy=dp),
                            faults=fb.Faults(drop=0.2), fault_policy=fb.FaultPolicy(min_clients=1), **kw)
    planned = privacy.epsilon(2.0, delta=1e-4, rounds=25, num_clients=6, cohort_size=4)
    assert full.privacy["epsilon"] == faulty.privacy["epsilon"] == planned
    assert full.privacy["epsilon_realised"] == pytest.approx(planned, rel=1e-9)
    assert (faulty.history["active"] < 4).any() and faulty.privacy["epsilon_realised"] > planned
    assert "distributed" in full.privacy["mechanism"]
    with pytest.raises(ConfigError, match="secure aggregation runs the TAMUNA family with distributed DP"):
        fb.flower.SecAggPlus(clipping_range=1.0).check(
            fb.GD(step_size=0.1).build(Problem(fb.FedModel(model, data), data, 5)), data.num_clients)


def test_distributed_fedavg_with_secure_aggregation_on_flower_equals_fed_fit(float32):
    # Each member's clipped, noised update reaches the server only summed (SecAgg+); with the same noise seed the
    # estimate is fed_fit's up to the quantisation (2 c R / Q per coordinate of the sum, R = C + 8 sigma C /
    # sqrt(c): about 1e-8 here) and float32 rounding of a separately compiled server step (1e-5 relative).
    algo = fb.FedAvg(step_size=0.005, local_steps=3, privacy=_distributed(1.0, 0.5, noise_seed=5))
    res = _secagg_equals_fed_fit(fb.models.linear_regression(), _glm(), algo, 8, rtol=1e-5, atol=1e-6)
    assert res.privacy["secure_aggregation"] == "SecAgg+ (Flower)"


# ----------------------------------------------------------------------------- TAMUNA and Scaffnew with distributed DP
def test_distributed_tamuna_keeps_its_control_variates_summing_to_zero_through_the_noise():
    # Each member sends x_bar + clip(q_i (x_i - x_bar)) + N(0, sigma^2 C^2 / s) on its s-of-c coordinates and
    # corrects h_i with what it sent: over each coordinate's holders the corrections sum to zero, noise included,
    # so sum_i h_i = 0 after every round (float64 rounding), as without privacy (tests/test_tamuna.py)
    from fedbayes.engine import make_round, stack_clients

    data = _glm()
    problem = Problem(fb.FedModel(fb.models.linear_regression(), data), data, 40, 4)
    with pytest.warns(UserWarning, match="no secure aggregation"):
        run = fb.TAMUNA(s=2, p=0.4, step_size=0.005, privacy=_distributed(0.5, 1.0, noise_seed=1)).build(problem)
    assert run.sums_uploads is True and run._dp.share_std() == pytest.approx(0.5 / np.sqrt(2))  # 1/s of the noise
    carry = run.init(jax.random.PRNGKey(0), problem)
    round_fn = jax.jit(make_round(run, stack_clients(data), data.num_clients, 4, jax.random.PRNGKey(1)))
    moved = []
    for k in range(40):
        before = np.asarray(carry[0].x)
        carry, rec = round_fn(carry, jnp.asarray(k))
        assert float(jnp.abs(carry[1].sum(0)).max()) < 1e-10  # sum_i h_i = 0 after every round
        assert int(rec["dp_holders"]) == 2  # every coordinate's noise from its s = 2 holders' shares
        moved.append(np.asarray(carry[0].x) - before)
    assert int(jnp.sum(jnp.any(carry[1] != 0, axis=1))) > 4  # several cohorts have updated their h_i
    # the noise is there: x_bar moves by the shares' sd / sqrt(s) = sigma C / s = 0.25 per coordinate and round,
    # far beyond the gradient steps (0.005 x a few)
    assert np.std(moved) > 0.1


@pytest.mark.filterwarnings("ignore::fedbayes.ConvergenceWarning")  # the iterates carry the noise: no trace settles
def test_distributed_tamuna_fluctuates_around_the_map_without_drift():
    # With noise each round (x_bar moves by sigma C / s = 1.25 per coordinate) the iterates fluctuate around the
    # MAP x* = (X'X + I / 10^2)^-1 X'y and do not drift: over 3000 rounds after 1000 of burn-in, the mean of each
    # coordinate is within its batch-means standard error (10 batches of 300 rounds) times t_9's two-sided
    # 1e-3 / 5 quantile (5.9; Bonferroni over the 5 coordinates). (The invariant itself, sum_i h_i = 0 under the
    # noise, is checked directly above; this checks the iterates' law around the MAP.)
    from scipy import stats

    data, _ = fb.models.make_glm_clients(10, 5, (20, 60), family="linear", heterogeneity=1.5, seed=1)
    pooled = data.pooled()
    X, y = pooled["x"], pooled["y"]
    xstar = np.linalg.solve(X.T @ X + np.eye(5) / 100, X.T @ y)
    algo = fb.TAMUNA(s=2, local_steps=5, step_size=0.002, privacy=_distributed(50.0, 0.05, noise_seed=0))
    with pytest.warns(UserWarning, match="no secure aggregation"):
        res = fb.fed_fit(fb.models.linear_regression(1.0, 10.0), data, algo, num_rounds=4000, clients_per_round=5,
                         seed=0, progress=False)
    w = np.asarray(res.history["theta/w"])[1000:]
    assert w.std(0).min() > 1.0  # the noise is there
    batches = w.reshape(10, 300, 5).mean(1)
    se = batches.std(0, ddof=1) / np.sqrt(10)
    assert np.all(np.abs(w.mean(0) - xstar) < stats.t.isf(1e-3 / 10, 9) * se), (w.mean(0) - xstar) / se


@pytest.mark.filterwarnings("ignore::fedbayes.ConvergenceWarning")  # 10-30 rounds: the point is the arithmetic
def test_distributed_tamuna_without_noise_is_tamuna_and_reports_the_rounds_as_they_went():
    # sigma = 0 and a clip no update reaches: each member sends x_bar + (x_i - x_bar), its iterate to rounding, so the
    # fit is TAMUNA's (to 1e-10); the central mode is refused (noise the server adds would unbalance sum_i h_i); every
    # member answering the rounds as they went are the planned ones, and a member that drops takes its shares
    data = _glm()
    model = fb.models.linear_regression()
    kw = dict(num_rounds=30, clients_per_round=4, seed=0, progress=False)
    base = dict(s=2, local_steps=3, step_size=0.005, safeguard=False, precondition=False)
    plain = fb.fed_fit(model, data, fb.TAMUNA(**base), **kw)
    with pytest.warns(UserWarning, match="no secure aggregation"):
        private = fb.fed_fit(model, data, fb.TAMUNA(**base, privacy=_distributed(1e6, 0.0)), **kw)
    for k in plain.params:
        np.testing.assert_allclose(private.params[k], plain.params[k], rtol=1e-10, atol=1e-12)
    for algorithm in (fb.TAMUNA, fb.Scaffnew):
        with pytest.raises(ConfigError, match="privacy is distributed"):
            algorithm(step_size=0.005, local_steps=3, privacy=privacy.DP(clip=1.0, noise_multiplier=1.0))
        with pytest.raises(ConfigError, match="needs p, local_steps or kappa"):  # the default p reads the curvatures
            algorithm(step_size=0.005, privacy=_distributed(1.0, 1.0))
    dp = _distributed(1.0, 2.0, delta=1e-4)
    with pytest.warns(UserWarning, match="no secure aggregation"):
        full = fb.fed_fit(model, data, fb.TAMUNA(**base, privacy=dp), **kw)
        faulty = fb.fed_fit(model, data, fb.TAMUNA(**base, privacy=dp), faults=fb.Faults(drop=0.2),
                            fault_policy=fb.FaultPolicy(min_clients=1), **kw)
        scaffnew = fb.fed_fit(model, data, fb.Scaffnew(local_steps=3, step_size=0.005, privacy=dp), num_rounds=10,
                              seed=0, progress=False)
    planned = privacy.epsilon(2.0, delta=1e-4, rounds=30, num_clients=6, cohort_size=4)
    assert full.privacy["epsilon"] == faulty.privacy["epsilon"] == planned
    assert full.privacy["epsilon_realised"] == pytest.approx(planned, rel=1e-9)
    assert (faulty.history["dp_holders"] == 1).any() and faulty.privacy["epsilon_realised"] > planned
    assert "distributed" in full.privacy["mechanism"] and "holders" in full.privacy["public"]
    assert scaffnew.privacy["epsilon"] == privacy.epsilon(2.0, delta=1e-4, rounds=10, num_clients=6)


def test_distributed_tamuna_with_secure_aggregation_on_flower_equals_fed_fit(float32):
    # each coordinate's mean over its holders needs only the sum of the masked uploads (the holders are public):
    # with SecAgg+ the estimate is fed_fit's up to the quantisation and float32 rounding. The iterate is far
    # beyond SecAgg+'s range R = C + 8 sigma C / sqrt(s) = 3.8 (it starts at 50): the members send their
    # clipped, noised updates, not their iterates, so nothing is clipped by the range
    algo = fb.TAMUNA(s=2, local_steps=3, step_size=0.005, init={"w": np.full(3, 50.0, np.float32)},
                     privacy=_distributed(1.0, 0.5, noise_seed=5))
    res = _secagg_equals_fed_fit(fb.models.linear_regression(), _glm(), algo, 8, rtol=1e-5, atol=1e-5)
    assert res.privacy["secure_aggregation"] == "SecAgg+ (Flower)"


def _secagg_equals_fed_fit(model, data, algo, rounds, rtol, atol):
    """``algo`` (distributed DP) on Flower with SecAgg+ against fed_fit, cohorts of 4: the estimate within
    rtol / atol, and no single upload among Flower's messages; the Flower result."""
    flower = pytest.importorskip("fedbayes.flower")
    with pytest.warns(UserWarning, match="no secure aggregation"):
        ref = fb.fed_fit(model, data, algo, num_rounds=rounds, clients_per_round=4, seed=2, progress=False)
    res = flower.simulate(model, data, algo, num_rounds=rounds, clients_per_round=4, seed=2, backend="local",
                          secure_aggregation=flower.SecAggPlus())
    for k in ref.params:
        np.testing.assert_allclose(res.params[k], ref.params[k], rtol=rtol, atol=atol)
    kinds = {kind for kind, *_ in res.flower_messages}
    assert "upload" not in kinds and any(kind.startswith("secagg:") for kind in kinds)
    return res


def test_distributed_fedsoul_without_noise_is_the_central_one_and_reports_the_rounds_as_they_went():
    # sigma = 0 and a clip no gradient reaches: clipping at the client or at the server is the identity, so the
    # distributed fit is the central one to rounding; with noise and dropouts the realised epsilon is larger
    data = _lme()
    kw = dict(num_rounds=12, clients_per_round=3, seed=0, progress=False)
    model = fb.models.linear_mixed_effects
    central = fb.fed_fit(model, data, fb.FedSOUL(server_lr=0.05, privacy=privacy.DP(clip=1e6, noise_multiplier=0.0)),
                         **kw)
    with pytest.warns(UserWarning, match="no secure aggregation"):
        dist = fb.fed_fit(model, data, fb.FedSOUL(server_lr=0.05, privacy=_distributed(1e6, 0.0)), **kw)
    for k in central.params:
        np.testing.assert_allclose(dist.params[k], central.params[k], rtol=1e-12, atol=1e-14)
    assert np.isnan(dist.history["objective"]).all() and "distributed" in dist.privacy["mechanism"]
    dp = _distributed(5.0, 0.8, delta=1e-4)
    with pytest.warns(UserWarning, match="no secure aggregation"):
        faulty = fb.fed_fit(model, data, fb.FedSOUL(server_lr=0.05, privacy=dp), faults=fb.Faults(drop=0.2),
                            **{**kw, "clients_per_round": 4})
    planned = privacy.epsilon(0.8, delta=1e-4, rounds=12, num_clients=6, cohort_size=4)
    assert faulty.privacy["epsilon"] == planned
    assert (faulty.history["active"] < 4).any() and faulty.privacy["epsilon_realised"] > planned


def test_distributed_fedmm_members_clip_their_weighted_statistics_and_the_shares_carry_the_central_noise(gmm):
    # A member uploads clip(n mu_i Q_i, C) + N(0, (sigma C)^2 / c) (the set-up: every client, / n): the clip by hand
    # (sigma = 0), the server's estimate (1/n) sum_{i active} upload_i (FedEM: gamma = 1, no projection), and the
    # shares' variance by Monte Carlo (2000 shares x q coordinates; 5 standard errors of a variance's relative error
    # sqrt(2 / N))
    from fedbayes.engine import stack_clients

    data, init, model = gmm
    clip, n = 0.3, data.num_clients
    with pytest.warns(UserWarning, match="no secure aggregation"):
        run, server = _fedmm_run(fb.FedEM(init=init, privacy=_distributed(clip, 0.0)), data, model)
    assert run.sums_uploads is True and not run.final_exchange and run.alpha == 0
    clients = stack_clients(data)
    client = lambda i: jax.tree_util.tree_map(lambda a: a[i], clients)  # noqa: E731
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(n, run.q)) * np.where(np.arange(n) == 0, 1e-3, 0.5)[:, None]  # client 0 under the clip
    shares = np.stack([np.asarray(run._share(jax.random.PRNGKey(i), jnp.asarray(r), client(i))) for i, r in
                       enumerate(rows)])
    weighted = n * (np.asarray(data.sizes, float) / np.sum(data.sizes))[:, None] * rows
    norms = np.linalg.norm(weighted, axis=1)
    assert (norms > clip).sum() >= 3 and norms[0] < clip
    np.testing.assert_allclose(shares, weighted * np.minimum(1.0, clip / norms)[:, None], rtol=1e-6, atol=1e-12)
    active = np.arange(n) != 2
    np.testing.assert_allclose(_fedmm_step(run, server, shares, active), shares[active].sum(0) / n, rtol=1e-12,
                               atol=1e-14)
    with pytest.warns(UserWarning, match="no secure aggregation"):  # cohorts of c = 3 of the n = 6 clients
        noisy = fb.FedEM(init=init, privacy=_distributed(clip, 1.7)).build(Problem(fb.FedModel(model, data), data,
                                                                                 10, 3))
    zero = jnp.zeros(run.q)
    for members, count in ((None, 3), (n, n)):  # a round's share (1/c of the noise) and the set-up's (1/n)
        draws = np.stack([np.asarray(noisy._share(jax.random.PRNGKey(k), zero, client(k % n), members))
                          for k in range(2000)])
        ratio = draws.var() / (1.7 * clip) ** 2 * count
        assert abs(ratio - 1) < 5 * np.sqrt(2 / draws.size), (members, ratio)


def test_distributed_fedmm_without_noise_is_the_central_one_and_reports_the_rounds_as_they_went(gmm):
    # sigma = 0 and a clip no upload reaches: clipping at the client or at the server is the identity, so the
    # distributed fit is the central one to rounding (n mu_i Q_i summed then divided, either way); every member
    # answering, the rounds as they went (and the set-up, which waits for every client) are the planned ones; a
    # member that drops takes its share with it and the realised epsilon is larger
    data, init, model = gmm
    kw = dict(num_rounds=20, clients_per_round=4, seed=0, progress=False)
    central = fb.fed_fit(model, data, fb.FedMM(init=init, privacy=privacy.DP(clip=1e8, noise_multiplier=0.0)), **kw)
    with pytest.warns(UserWarning, match="no secure aggregation"):
        dist = fb.fed_fit(model, data, fb.FedMM(init=init, privacy=_distributed(1e8, 0.0)), **kw)
    for k in central.params:
        np.testing.assert_allclose(dist.params[k], central.params[k], rtol=1e-10, atol=1e-12)
    assert "distributed" in dist.privacy["mechanism"] and dist.privacy["releases"] == 21
    dp = _distributed(500.0, 2.0, delta=1e-4)
    with pytest.warns(UserWarning, match="no secure aggregation"):
        full = fb.fed_fit(model, data, fb.FedMM(init=init, privacy=dp), **kw)
        faulty = fb.fed_fit(model, data, fb.FedMM(init=init, privacy=dp), faults=fb.Faults(drop=0.2),
                            fault_policy=fb.FaultPolicy(min_clients=1), **kw)
    planned = privacy.epsilon(2.0, delta=1e-4, rounds=20, num_clients=6, cohort_size=4, extra_rounds=1)
    assert full.privacy["epsilon"] == faulty.privacy["epsilon"] == planned
    assert full.privacy["epsilon_realised"] == pytest.approx(planned, rel=1e-9)
    assert (faulty.history["active"] < 4).any() and faulty.privacy["epsilon_realised"] > planned


def test_distributed_fedmm_with_secure_aggregation_on_flower_equals_fed_fit(float32, gmm):
    # the set-up's and the rounds' clipped, weighted, noised statistics reach the server only summed (SecAgg+);
    # with the same noise seed the estimate is fed_fit's up to the quantisation (2 c R / Q per coordinate of the
    # sum, R = C + 8 sigma C / sqrt(c): about 3e-7 here) and float32 rounding of separately compiled steps. The
    # noise is small (the mixture's raw moments amplify it, test_private_fedmm_on_flower_equals_fed_fit)
    data, init, model = gmm
    init32 = {k: np.asarray(v, np.float32) for k, v in init.items()}
    algo = fb.FedMM(init=init32, privacy=_distributed(500.0, 1e-6, noise_seed=5))
    res = _secagg_equals_fed_fit(model, data, algo, 6, rtol=1e-4, atol=1e-4)
    assert res.privacy["secure_aggregation"] == "SecAgg+ (Flower)" and "distributed" in res.privacy["mechanism"]


def test_distributed_fedsoul_with_secure_aggregation_on_flower_equals_fed_fit(float32):
    # the clients' clipped, noised gradients reach the server only summed (SecAgg+); with the same noise seed
    # the estimate is fed_fit's up to the quantisation and float32 rounding of separately compiled steps
    algo = fb.FedSOUL(server_lr=0.05, uncertainty=False, privacy=_distributed(5.0, 0.5, noise_seed=5))
    res = _secagg_equals_fed_fit(fb.models.linear_mixed_effects, _lme(), algo, 5, rtol=1e-4, atol=1e-5)
    assert res.privacy["secure_aggregation"] == "SecAgg+ (Flower)" and "distributed" in res.privacy["mechanism"]


def test_dp_options_are_numbers_of_the_right_kind():
    """Issue 53 (7): NumPy scalars are numbers (clip=np.float32(1) was refused as not finite); bools, strings and
    infinities are not (clip=True was taken as 1; string multipliers gave bare TypeErrors; an infinite multiplier
    was accepted and the fit then blamed its step size); a noise seed past 2**64 is refused (it crashed in JAX),
    and seeds below 2**32 draw the same noise as before."""
    assert privacy.DP(clip=np.float32(1.0), noise_multiplier=np.float64(0.5)).clip == 1.0
    bad = [dict(clip=True, noise_multiplier=1.0), dict(clip="1", noise_multiplier=1.0),
           dict(clip=1.0, noise_multiplier="1"), dict(clip=1.0, epsilon="3"), dict(clip=1.0, epsilon=1.0, delta="x"),
           dict(clip=1.0, noise_multiplier=math.inf), dict(clip=1.0, epsilon=math.inf),
           dict(clip=1.0, noise_multiplier=1.0, noise_seed=2**70), dict(clip=1.0, noise_multiplier=1.0, noise_seed=-1)]
    for kw in bad:
        with pytest.raises(ConfigError):
            privacy.DP(**kw)
    np.testing.assert_array_equal(privacy.secret_key(7), jax.random.PRNGKey(7))
    assert not np.array_equal(privacy.secret_key(2**40 + 7), privacy.secret_key(7))  # distinct past 32 bits
