"""fb.JointLMC: joint federated Langevin on a Gaussian hierarchical model, against its closed form.

The model: mu ~ N(0, 10^2) global, z_i ~ N(mu, 1) per client, y_ij ~ N(z_i, 1). The joint posterior of
(mu, z_1..z_b) is Gaussian with precision P and mean m = P^-1 h (below). ULA with the block-diagonal
preconditioner M = diag(gamma, gamma_1, ..., gamma_b) has the stationary law N(m, Sigma), Sigma the
solution of Sigma = A Sigma A' + 2 M, A = I - M P (scipy's discrete Lyapunov solver): the exact mean, and a
covariance that differs from P^-1 by O(step), visibly at the steps used here.

Monte Carlo tolerances: each coordinate's draws (4 chains) have a bulk ESS n_eff (fedbayes.chain_stats,
ArviZ's definition); a mean is off by about sd / sqrt(n_eff) and a Gaussian sample sd by about
sd / sqrt(2 n_eff) (relative), so 4 such standard errors bound every check at any seed but one in
several thousand.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
import scipy.linalg as sl

import fedbayes as fb
from fedbayes.arviz_adapter import group
from fedbayes.chain_stats import ess_bulk
from resume_helper import interrupted_and_resumed
from test_flower import _dropped
from test_minibatch import random_intercepts as hierarchical  # mu ~ N(0, 10^2), z_i ~ N(mu, 1), y_ij ~ N(z_i, 1)

SIZES = [3, 5, 8, 4]


def _data():
    rng = np.random.default_rng(0)
    ys = [rng.normal(1.0 + rng.normal(), 1.0, size=n) for n in SIZES]
    return fb.FederatedData({"y": ys}), ys


def _precision(ys):
    """(P, m): the joint posterior's precision and mean over (mu, z_1, ..., z_b)."""
    b = len(ys)
    P, h = np.zeros((b + 1, b + 1)), np.zeros(b + 1)
    P[0, 0] = 1 / 100 + b
    for i, y in enumerate(ys):
        P[0, i + 1] = P[i + 1, 0] = -1.0
        P[i + 1, i + 1] = 1.0 + len(y)
        h[i + 1] = y.sum()
    return P, np.linalg.solve(P, h)


def _ula_sd(P, steps):
    M = np.diag(steps)
    A = np.eye(len(steps)) - M @ P
    return np.sqrt(np.diag(sl.solve_discrete_lyapunov(A, 2 * M)))


def _draws(res) -> np.ndarray:
    """(coordinates, chains, draws): mu, then each client's z."""
    mu = np.asarray(res.global_samples["mu"], np.float64)
    z = np.asarray(group(res.idata, "posterior")["z"], np.float64)  # (chain, draw, client)
    return np.concatenate([mu[None], np.moveaxis(z, -1, 0)], 0)


def _check_law(draws, mean, sd):
    n_eff = np.array([ess_bulk(d) for d in draws])
    flat = draws.reshape(draws.shape[0], -1)
    assert np.all(np.abs(flat.mean(1) - mean) <= 4 * sd / np.sqrt(n_eff)), (flat.mean(1), mean, n_eff)
    assert np.all(np.abs(flat.std(1) / sd - 1) <= 4 / np.sqrt(2 * n_eff)), (flat.std(1), sd, n_eff)
    return n_eff


@pytest.fixture(scope="module")
def given_step_fit():
    data, ys = _data()
    res = fb.fed_fit(hierarchical, data, fb.JointLMC(step_size=0.05), num_rounds=20000, seed=0, progress=False)
    return res, ys


def test_joint_lmc_has_the_ula_law_of_the_joint_target(given_step_fit):
    res, ys = given_step_fit
    P, m = _precision(ys)
    ula = _ula_sd(P, [0.05] * (len(ys) + 1))  # one step: Sigma = (P - gamma P^2 / 2)^-1
    np.testing.assert_allclose(ula ** 2, np.diag(np.linalg.inv(P - 0.05 * P @ P / 2)), rtol=1e-10)
    n_eff = _check_law(_draws(res), m, ula)
    # the check can tell ULA's law from the posterior: z_3 (8 points) has posterior sd 0.339 and ULA sd 0.384
    post = np.sqrt(np.diag(np.linalg.inv(P)))
    assert np.abs(post[3] / ula[3] - 1) > 4 / np.sqrt(2 * n_eff[3])


def test_joint_draws_are_one_posterior_in_idata_with_converged_chains(given_step_fit):
    res, ys = given_step_fit
    post = group(res.idata, "posterior")
    assert post["mu"].dims == ("chain", "draw") and post["z"].dims == ("chain", "draw", "client")
    assert post["z"].shape == (4, 10000, len(ys))
    assert res.local_samples["z"].shape == (len(ys), 4 * 10000)
    table = res.diagnostics
    assert not table.empty and bool(table["ok"].all()), table
    assert res.bits_up > 0 and res.settings["step_size"] == pytest.approx(0.05)


@pytest.mark.slow
def test_each_client_s_own_step_gives_the_block_diagonal_ula_law():
    """Automatic steps: gamma = 0.1 / L for the globals' block and gamma_i = 0.1 / L_i for each client's, a
    block-diagonal preconditioner; the draws have its Lyapunov law with the resolved steps."""
    data, ys = _data()
    res = fb.fed_fit(hierarchical, data, fb.JointLMC(), num_rounds=20000, seed=1, progress=False)
    steps = [res.settings["step_size"], *np.asarray(res.client_info["step_size"], np.float64)]
    assert len(set(np.round(steps, 8))) > 2  # the clients' steps differ (their data sizes do)
    P, m = _precision(ys)
    _check_law(_draws(res), m, _ula_sd(P, steps))


@pytest.mark.slow
def test_adapted_steps_give_each_chain_the_ula_law_of_its_own_preconditioner():
    """adapt_mass_matrix=True: each party's steps adapted in warm-up to 0.1 x the variance of its own states. After it
    chain c is ULA with its own diagonal steps M_c (the server's for mu, each client's for its z), so the pooled
    draws have the exact mean and, per coordinate, the average over the chains of the Lyapunov variances."""
    data, ys = _data()
    res = fb.fed_fit(hierarchical, data, fb.JointLMC(adapt_mass_matrix=True), num_rounds=20000, seed=2,
                     progress=False)
    server = np.asarray(res.settings["steps"], np.float64)  # (chains, 1)
    clients = np.asarray(res.settings["client_steps"], np.float64)  # (clients, chains, 1)
    P, m = _precision(ys)
    var = np.mean([_ula_sd(P, [server[c, 0], *clients[:, c, 0]]) ** 2 for c in range(server.shape[0])], 0)
    _check_law(_draws(res), m, np.sqrt(var))
    # the adapted steps are about 0.1 x the posterior variances (each window's variance estimate of a few
    # hundred to a few thousand correlated states: within 30%)
    post = np.diag(np.linalg.inv(P))
    np.testing.assert_allclose(server[:, 0], 0.1 * post[0], rtol=0.3)
    np.testing.assert_allclose(clients[:, :, 0], 0.1 * post[1:, None] * np.ones_like(clients[:, :, 0]), rtol=0.3)


@pytest.mark.slow
@pytest.mark.parametrize("step", [0.05, None])
def test_joint_mala_samples_the_exact_posterior_where_ula_is_biased(step):
    """JointMALA at the step where JointLMC's law is visibly off (test above: z_3's sd 0.384 against the
    posterior's 0.339), held fixed, and with its defaults (automatic per-block steps, adapted in warm-up to
    the target acceptance rate): the exact joint posterior N(m, P^-1)."""
    data, ys = _data()
    algo = fb.JointMALA(step_size=0.05, adapt_step=False, adapt_mass_matrix=False) if step else fb.JointMALA()
    res = fb.fed_fit(hierarchical, data, algo, num_rounds=20000, seed=0, progress=False)
    P, m = _precision(ys)
    _check_law(_draws(res), m, np.sqrt(np.diag(np.linalg.inv(P))))
    assert res.diagnostics["ok"].all()
    mult = np.asarray(res.history["step_multiplier"])
    if step:
        assert 0.5 < res.settings["acceptance"] < 0.99 and np.all(mult == 1.0)
        return
    # dual averaging: the multiplier moves in the 10 000 warm-up rounds and is frozen after them; the rate after
    # warm-up is the target's (the average of 4 x 10 000 acceptance probabilities: its Monte Carlo error is
    # below 0.01; dual averaging's frozen average step lands within a few hundredths of the target)
    assert res.settings["adaptation_rounds"] == 10000 and len(set(mult[:10000].round(6))) > 100
    assert np.all(mult[9999:] == mult[-1])
    assert abs(res.settings["acceptance"] - 0.574) < 0.05
    assert np.isfinite(res.settings["bits_per_accepted_draw"]) and res.settings["bits_per_accepted_draw"] > 0


@pytest.mark.parametrize("fixed", [True, False])
def test_joint_hmc_samples_the_exact_posterior(fixed):
    """JointHMC, one leapfrog step a round: with a fixed step (0.3, 4 steps, no adaptation; the step of
    every coordinate 0.3, where ULA's law is off by more than the tolerance) and with its defaults (8 steps,
    the inverse mass and the step adapted in warm-up, the step jittered per trajectory): the exact joint
    posterior N(m, P^-1) within 4 Monte Carlo standard errors from the draws' ESS."""
    data, ys = _data()
    algo = (fb.JointHMC(step_size=0.3, num_steps=4, adapt_step=False, adapt_mass_matrix=False) if fixed
            else fb.JointHMC())
    res = fb.fed_fit(hierarchical, data, algo, num_rounds=16000, seed=0, progress=False)
    P, m = _precision(ys)
    n_eff = _check_law(_draws(res), m, np.sqrt(np.diag(np.linalg.inv(P))))
    L = 4 if fixed else 8
    assert res.settings["num_steps"] == L and res.global_samples["mu"].shape == (4, 16000 // L // 2)
    assert res.diagnostics["ok"].all() and np.all(n_eff > 1000)
    assert 0.6 < res.settings["acceptance"] < 0.99
    if fixed:
        # ULA's law with a step giving the same per-step drift (gamma = 0.3^2 / 2): z_3's sd visibly too large
        ula = _ula_sd(P, [0.045] * (len(ys) + 1))
        post = np.sqrt(np.diag(np.linalg.inv(P)))
        assert np.abs(post[3] / ula[3] - 1) > 4 / np.sqrt(2 * n_eff[3])


def linreg(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)


@pytest.mark.filterwarnings("ignore:Joint(MALA|HMC) has not converged")  # one kept draw per chain, by design
@pytest.mark.parametrize("sampler", ["JointMALA", "JointHMC"])
@pytest.mark.parametrize("splits", [1, 2, 50])
def test_exact_samplers_without_latents_sample_the_posterior_however_the_data_are_split(splits, sampler):
    """A model without local latents (Bayesian linear regression, posterior N(mu, P^-1) with
    P = I + X'X / 0.25): JointMALA (and JointHMC, 3 leapfrog steps of eps = sqrt(2 gamma), the same drift
    per step) at a step where LMC's law (P - gamma P^2 / 2)^-1 is visibly wider samples the posterior
    itself, whether the 60 rows sit on 1, 2 or 50 clients (a potential mis-scaled by the number of clients
    would change the law with the split).

    Tolerances: the last draws of 2000 independent chains (after 300 rounds, tens of autocorrelation times):
    a mean within 5 standard errors sd / sqrt(2000), a variance within 5 sqrt(2 / 2000) relative."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 3))
    y = X @ np.array([1.0, -0.5, 0.2]) + 0.5 * rng.normal(size=60)
    data = fb.FederatedData.from_pooled({"x": X, "y": y}, fb.partition_iid(60, splits, seed=1))
    P = np.eye(3) + X.T @ X / 0.25
    mu, cov = np.linalg.solve(P, X.T @ y / 0.25), np.linalg.inv(P)
    gamma, n = 0.9 / np.linalg.eigvalsh(P).max(), 2000
    if sampler == "JointMALA":
        algo, rounds = fb.JointMALA(step_size=gamma, adapt_step=False, num_chains=n, warmup=299), 300
    else:
        algo = fb.JointHMC(step_size=np.sqrt(2 * gamma), num_steps=3, adapt_step=False, adapt_mass_matrix=False,
                           num_chains=n, warmup=897)
        rounds = 900
    res = fb.fed_fit(linreg, data, algo, num_rounds=rounds, seed=2, progress=False)
    w = np.asarray(res.global_samples["w"], np.float64)[:, -1]
    tol = 5 * np.sqrt(2 / n)
    np.testing.assert_array_less(np.abs(w.mean(0) - mu), 5 * np.sqrt(np.diag(cov) / n))
    np.testing.assert_allclose(w.var(0), np.diag(cov), rtol=tol)
    ula = np.diag(np.linalg.inv(P - gamma * P @ P / 2))
    assert np.max(ula / np.diag(cov) - 1) > 2 * tol  # the check would see LMC's bias at this step
    assert res.local_samples == {} and 0.3 < res.settings["acceptance"] < 0.95


def _partial_participation_law(ys, gamma: float, c: int | None, batch: int | None = None,
                               lost: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """The exact stationary law of JointLMC (one step gamma) on the Gaussian model when each round a uniform
    cohort of ``c`` of the b clients takes part (None: all b, each of whose uploads is lost independently with
    probability ``lost``, which is the same as its absence): (mean, covariance) of (mu, z_1..z_b) at the
    rounds' starts.

    The state s = (x, z_1..z_b, m_1..m_b), m_i the server's memory of client i's last gradient in x (EF21 with
    the identity compressor), moves by an affine map with a random cohort S: for i in S,
    z_i' = z_i - gamma ((1 + n_i) z_i - x - sum_j y_ij) + sqrt(2 gamma) xi_i and m_i' = (1 + 1 / (100 b)) x - z_i;
    the others keep theirs; then x' = x - gamma sum_i m_i' + sqrt(2 gamma) zeta. So s' = A_S s + c_S + noise
    with S independent of s, and the stationary mean and second moment solve
    mu = E[A] mu + E[c] and M = E[A M A' + A mu c' + c mu' A' + c c' + Q] (vectorised with Kronecker products,
    the expectation an average over the C(b, c) cohorts, or over the 2^b sets of answering clients weighted by
    their probabilities). With c = b it is the full ULA law above.

    With minibatches of ``batch`` rows (SGLD), client i's gradient in z_i has the data term's estimate
    (N_i / B) sum_{j in S} y_ij, S a uniform B-subset drawn afresh each round: state-independent noise of
    variance N_i s_i^2 (N_i - B) / B (sampling without replacement; s_i^2 the rows' sample variance), so
    z_i's move gains gamma^2 times that variance (the gradient in x has no data term)."""
    b = len(ys)
    n, sy = np.array([len(y) for y in ys]), np.array([y.sum() for y in ys])
    D, a = 1 + 2 * b, 1 + 1 / (100 * b)
    maps, weights = [], []
    sets = (itertools.combinations(range(b), c) if c is not None
            else itertools.chain.from_iterable(itertools.combinations(range(b), k) for k in range(b + 1)))
    for S in sets:
        weights.append(1.0 if c is not None else (1 - lost) ** len(S) * lost ** (b - len(S)))
        A, cc, Q = np.zeros((D, D)), np.zeros(D), np.zeros((D, D))
        for i in range(b):
            zi, mi = 1 + i, 1 + b + i
            if i in S:
                A[zi, zi], A[zi, 0], cc[zi], Q[zi, zi] = 1 - gamma * (1 + n[i]), gamma, gamma * sy[i], 2 * gamma
                if batch is not None and n[i] > batch:
                    Q[zi, zi] += gamma ** 2 * n[i] * np.var(ys[i], ddof=1) * (n[i] - batch) / batch
                A[mi, 0], A[mi, zi] = a, -1.0
            else:
                A[zi, zi] = A[mi, mi] = 1.0
        A[0, 0] = 1.0
        A[0] -= gamma * A[1 + b:].sum(0)
        cc[0] -= gamma * cc[1 + b:].sum()
        Q[0, 0] = 2 * gamma
        maps.append((A, cc, Q))
    w = np.asarray(weights) / np.sum(weights)
    E = lambda terms: np.tensordot(w, np.asarray(terms), 1)  # noqa: E731
    EA, Ec = E([m[0] for m in maps]), E([m[1] for m in maps])
    mean = np.linalg.solve(np.eye(D) - EA, Ec)
    EAA = E([np.kron(A, A) for A, _, _ in maps])
    rest = E([np.outer(A @ mean, cc) + np.outer(cc, A @ mean) + np.outer(cc, cc) + Q for A, cc, Q in maps])
    M = np.linalg.solve(np.eye(D * D) - EAA, rest.reshape(-1)).reshape(D, D)
    return mean[:1 + b], (M - np.outer(mean, mean))[:1 + b, :1 + b]


@pytest.mark.slow
def test_partial_participation_has_the_exact_law_of_its_stale_gradients():
    """JointLMC with 2 of the 4 clients a round: absent clients keep their latents and the server their last
    gradient (EF21's memory). The draws have that scheme's exact stationary law (above; with c = b it is the
    full ULA law, checked), including the pairing of each client's draws with the globals' (the mu-z_i
    correlations). The bias it adds is measured: mu's sd is 8% above full participation's ULA law, and 13%
    above the posterior's; the mean stays exact (the map is linear in a Gaussian model)."""
    data, ys = _data()
    P, m = _precision(ys)
    full_mean, full_cov = _partial_participation_law(ys, 0.05, len(ys))
    np.testing.assert_allclose(np.sqrt(np.diag(full_cov)), _ula_sd(P, [0.05] * (len(ys) + 1)), rtol=1e-8)
    mean, cov = _partial_participation_law(ys, 0.05, 2)
    np.testing.assert_allclose(mean, m, rtol=1e-8)  # the stationary mean is the posterior mean
    sd = np.sqrt(np.diag(cov))
    assert sd[0] / np.sqrt(full_cov[0, 0]) - 1 > 0.07 and sd[0] / np.sqrt(np.linalg.inv(P)[0, 0]) - 1 > 0.12

    res = fb.fed_fit(hierarchical, data, fb.JointLMC(step_size=0.05), num_rounds=40000, clients_per_round=2,
                     seed=0, progress=False)
    draws = _draws(res)
    n_eff = _check_law(draws, mean, sd)
    assert np.abs(sd[0] / np.sqrt(full_cov[0, 0]) - 1) > 4 / np.sqrt(2 * n_eff[0])  # the check sees the bias
    # the pairing: each client's draw at a round it sat out is the latents it held then, next to that round's mu
    flat = draws.reshape(draws.shape[0], -1)
    rho = cov[0] / np.sqrt(cov[0, 0] * np.diag(cov))
    for i in range(1, len(ys) + 1):
        r = np.corrcoef(flat[0], flat[i])[0, 1]
        assert abs(r - rho[i]) <= 4 * (1 - rho[i] ** 2) / np.sqrt(min(n_eff[0], n_eff[i])), (i, r, rho[i])
    assert res.history["bits_down"][1] == 2 * (4 * 32 + 32)  # 4 chains' mu in full and the round's index, to 2 clients
    # through Flower's messages (float32, the wire's precision) the same cohorts give the same fit
    short = dict(num_rounds=60, seed=3, progress=False, clients_per_round=2)
    with jax.enable_x64(False):
        algo = fb.JointLMC(num_chains=2, warmup=20)
        direct = fb.fed_fit(hierarchical, data, algo, **short)
        flower = fb.flower.simulate(hierarchical, data, algo, backend="local", **short)
    np.testing.assert_allclose(flower.global_samples["mu"], direct.global_samples["mu"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flower.local_samples["z"], direct.local_samples["z"], rtol=1e-5, atol=1e-6)
    assert int(np.sum(flower.history["bits_down"])) == int(np.sum(direct.history["bits_down"]))


@pytest.mark.slow
def test_a_lost_upload_is_an_absence_with_its_exact_law():
    """JointLMC with each upload lost with probability 0.5 (dropped, or non-finite and screened out): the client
    keeps its latents and the server its last gradient, as for an absent client, so the draws have the exact law
    of that scheme with independent absences (above), visibly wider than full participation's ULA law.
    FaultPolicy(min_clients=0): a round whose every upload is lost (0.5^4 of them) moves with the memories.
    (At a loss of 0.2 the law is 2% wider in mu than full participation's, too little for the check to see.)"""
    data, ys = _data()
    mean, cov = _partial_participation_law(ys, 0.05, None, lost=0.5)
    _, full = _partial_participation_law(ys, 0.05, len(ys))
    res = fb.fed_fit(hierarchical, data, fb.JointLMC(step_size=0.05), num_rounds=40000, seed=0, progress=False,
                     faults=fb.Faults(drop=0.4, nan=0.1), fault_policy=fb.FaultPolicy(min_clients=0))
    sd = np.sqrt(np.diag(cov))
    n_eff = _check_law(_draws(res), mean, sd)
    widened = sd / np.sqrt(np.diag(full)) - 1
    assert widened[0] > 4 / np.sqrt(2 * n_eff[0]), widened  # mu's sd: 8.5% above full participation's
    # the faults' counts: 4 clients x 40 000 rounds, each lost w.p. 0.5 (binomial: sd 200)
    lost = res.history["dropped"].sum() + res.history["nonfinite"].sum()
    assert abs(lost - 0.5 * 160000) < 4 * np.sqrt(160000 * 0.5 * 0.5) and res.history["nonfinite"].sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["JointMALA", "JointHMC"])
def test_lost_uploads_leave_the_exact_samplers_exact(sampler):
    """A decision with a lost upload (each client's upload lost w.p. 0.05 a round) is a rejection, whatever the
    state: the kernel is a mixture of Metropolis-Hastings and staying put, and the draws keep the exact
    posterior. Clients whose uploads were lost (their states rolled back) catch up from the broadcast's news.
    The dual averaging skips the lost decisions (18% of MALA's, 56% of HMC's trajectories here), so the step
    is adapted to the others. Counted as rejections instead, they made the target unreachable for HMC (its step
    fell to 3e-42, acceptance 1.0) and MALA's rate 0.70 (measured with the skip disabled)."""
    data, ys = _data()
    L = 1 if sampler == "JointMALA" else 4
    algo = fb.JointMALA() if sampler == "JointMALA" else fb.JointHMC(num_steps=L)
    res = fb.fed_fit(hierarchical, data, algo, num_rounds=20000, seed=1, progress=False,
                     faults=fb.Faults(drop=0.04, nan=0.01), fault_policy=fb.FaultPolicy(min_clients=0))
    P, m = _precision(ys)
    _check_law(_draws(res), m, np.sqrt(np.diag(np.linalg.inv(P))))
    # a decision is lost when any of its L rounds loses any of the 4 uploads (binomial count, 4 sd)
    decisions, p = 20000 // L, 1 - 0.95 ** (4 * L)
    assert abs(res.settings["decisions_lost"] - p * decisions) < 4 * np.sqrt(decisions * p * (1 - p))
    # the rate of the decisions not lost. MALA: within a few hundredths of the target, as without faults (the
    # test above). HMC's dual averaging, restarted after each scale window, ends above its target even without
    # faults (0.87 on this fit; its test allows 0.6-0.99); here it ends at 0.90, its step not collapsed
    if L == 1:
        assert abs(res.settings["acceptance"] - algo.target_accept) < 0.05
    else:
        assert res.settings["acceptance"] < 0.95 and min(res.settings["step_multiplier"]) > 0.3
    assert res.diagnostics["ok"].all()


def test_a_fit_whose_faults_ate_most_decisions_says_so():
    """JointHMC with 8 steps over 4 clients, each upload lost w.p. 0.1: a trajectory survives w.p. 0.9^32 = 3%, so
    the chains barely move and the warm-up adapts on a few decisions. The fit warns, naming the cause and the
    remedies; JointMALA with uploads lost w.p. 0.01 (4% of its decisions lost) does not."""
    import warnings

    data, _ = _data()
    kw = dict(seed=0, progress=False, fault_policy=fb.FaultPolicy(min_clients=0))
    with pytest.warns(fb.ConvergenceWarning, match=r"of its decisions were rejected because an upload was lost"
                                                   r" .a decision needs every client's answer in each of its 8 rounds.*fewer num_steps.*fb.JointMALA"):
        res = fb.fed_fit(hierarchical, data, fb.JointHMC(), num_rounds=1600, faults=fb.Faults(drop=0.1), **kw)
    assert res.settings["decisions_lost"] > 0.8 * 200  # of 200 trajectories (binomial mean 193)
    with pytest.warns(fb.ConvergenceWarning, match=r"JointMALA: .* of its decisions were rejected because an upload "
                                                   r"was lost .a decision needs every client's answer in its round"):
        fb.fed_fit(hierarchical, data, fb.JointMALA(), num_rounds=400, faults=fb.Faults(drop=0.3), **kw)  # 76% lost
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fb.fed_fit(hierarchical, data, fb.JointMALA(), num_rounds=400, faults=fb.Faults(drop=0.01), **kw)
    assert not any("upload was lost" in str(w.message) for w in caught)


@pytest.mark.slow
def test_minibatch_joint_lmc_has_the_exact_law_of_its_gradient_noise():
    """JointLMC with batches of 2 rows (SGLD): on the Gaussian model the batch noise is additive, and the draws
    have the exact law computed with it (above); the check sees its widening over full-batch ULA's law."""
    data, ys = _data()
    mean, cov = _partial_participation_law(ys, 0.05, len(ys), batch=2)
    _, full = _partial_participation_law(ys, 0.05, len(ys))
    res = fb.fed_fit(hierarchical, data, fb.JointLMC(step_size=0.05, batch_size=2), num_rounds=20000, seed=0,
                     progress=False)
    sd = np.sqrt(np.diag(cov))
    n_eff = _check_law(_draws(res), mean, sd)
    widened = sd / np.sqrt(np.diag(full)) - 1
    assert np.any(widened > 4 / np.sqrt(2 * n_eff)), widened  # at least one coordinate visibly wider
    assert res.settings["batch_size"] == 2


def test_given_global_values_start_the_chains_there():
    """init= constrained global values (or a Result, e.g. a FedSOUL fit's theta*): every chain's globals start there,
    jittered by U(-0.5, 0.5) in unconstrained coordinates, and the first draw lies one move from it. mu's posterior
    mean is about 1.6, so a start at 20 is seen; the move's sd is sqrt(2 gamma), gamma = 0.5 / 4.01 (MALA's
    automatic step on the globals' curvature 4.01, multiplier 1 without a warm-up): 0.5, so 0.5 + 4 x 0.5 bounds it."""
    data, _ = _data()
    res = fb.fed_fit(hierarchical, data, fb.JointMALA(init={"mu": 20.0}, warmup=0, num_chains=3), num_rounds=10,
                     seed=0, progress=False)
    assert res.settings["start"] == "given"
    first = np.asarray(res.global_samples["mu"])[:, 0]
    assert np.all(np.abs(first - 20.0) < 2.5) and len(set(first.round(6))) == 3, first


def test_joint_lmc_refuses_what_it_cannot_sample():
    data, _ = _data()

    def no_locals(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    def with_param(y):
        mu = numpyro.param("mu", 0.0)
        with fb.local():
            z = numpyro.sample("z", dist.Normal(mu, 1.0))
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(z, 1.0), obs=y)

    kw = dict(num_rounds=5, progress=False)
    with pytest.raises(fb.ModelError, match="has none: use fb.LMC"):
        fb.fed_fit(no_locals, data, fb.JointLMC(), **kw)
    with pytest.raises(fb.ModelError, match="without a prior"):
        fb.fed_fit(with_param, data, fb.JointLMC(), **kw)
    with pytest.raises(fb.ConfigError, match="every client in every round .its Metropolis test.*use fb.JointLMC"):
        fb.fed_fit(hierarchical, data, fb.JointMALA(), clients_per_round=2, **kw)
    with pytest.raises(fb.ConfigError, match="full-batch"):
        fb.fed_fit(hierarchical, data, fb.JointMALA(batch_size=2), **kw)
    with pytest.raises(fb.ConfigError, match="joint mode"):
        fb.fed_fit(hierarchical, data, fb.JointLMC(init="map"), **kw)
    with pytest.raises(fb.ConfigError, match="target_accept must be a number in"):
        fb.JointMALA(target_accept=1.0)
    with pytest.raises(fb.ConfigError, match="step_jitter must be a number in"):
        fb.JointHMC(step_jitter=1.0)
    with pytest.raises(fb.ConfigError, match="not a multiple of num_steps=8"):
        fb.fed_fit(hierarchical, data, fb.JointHMC(), **kw)
    with pytest.raises(fb.ConfigError, match="needs exact messages"):
        fb.fed_fit(hierarchical, data, fb.JointMALA(uplink=fb.compress.top_k(1)), **kw)


@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["JointLMC", "JointMALA", "JointHMC"])
def test_joint_samplers_on_flower_and_resumed_from_a_checkpoint_are_the_same_fit(tmp_path, sampler):
    """Through Flower's messages (every client a node, its latents and draws kept there) and interrupted
    and resumed from a checkpoint (JointHMC: in the middle of a trajectory), the fit is fed_fit's: the same
    draws, locals included, and ledger."""
    data, _ = _data()
    algo = getattr(fb, sampler)(num_chains=2, warmup=20, **({"num_steps": 4} if sampler == "JointHMC" else {}))
    kw = dict(num_rounds=60, seed=3, progress=False)
    # in float32, the wire's precision (these tests otherwise run in float64, and a float32 wire's rounding of
    # the proposals would then part the two fits by a few 1e-5 over 60 rounds of accept / reject)
    with jax.enable_x64(False):
        direct = fb.fed_fit(hierarchical, data, algo, **kw)
        flower = fb.flower.simulate(hierarchical, data, algo, backend="local", **kw)
    np.testing.assert_allclose(flower.global_samples["mu"], direct.global_samples["mu"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flower.local_samples["z"], direct.local_samples["z"], rtol=1e-5, atol=1e-6)
    assert int(np.sum(flower.history["bits_up"])) == int(np.sum(direct.history["bits_up"]))

    # a node down in some rounds (Flower's NODE_UNAVAILABLE) is fed_fit's dropped client: its state rolled back, it
    # catches up from the next broadcast it gets, however many rounds it missed
    faults = fb.Faults(drop=0.25)
    with jax.enable_x64(False):  # the fault stream's uniforms in float32, as the fit draws them
        off = _dropped(algo, hierarchical, data, kw["num_rounds"], data.num_clients, kw["seed"], faults)
    assert any((k + 1, c) in off for k, c in off)  # a node down two rounds in a row
    with jax.enable_x64(False):
        direct = fb.fed_fit(hierarchical, data, algo, faults=faults, **kw)
        flower = fb.flower.simulate(hierarchical, data, algo, backend="local", **kw,
                                    unreachable=lambda k, client: (k, client) in off)
    assert int(direct.history["dropped"].sum()) == int(flower.history["dropped"].sum()) == len(off)
    np.testing.assert_allclose(flower.global_samples["mu"], direct.global_samples["mu"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(flower.local_samples["z"], direct.local_samples["z"], rtol=1e-5, atol=1e-6)

    direct = fb.fed_fit(hierarchical, data, algo, **kw)
    resumed = interrupted_and_resumed(hierarchical, data, algo, tmp_path / "joint.ckpt", 30, **kw)
    np.testing.assert_array_equal(resumed.global_samples["mu"], direct.global_samples["mu"])
    np.testing.assert_array_equal(resumed.local_samples["z"], direct.local_samples["z"])


def three_means(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0).expand([3]).to_event(1))
    with fb.local():
        z = numpyro.sample("z", dist.Normal(mu, 1.0).to_event(1))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(z, 1.0).to_event(1), obs=y)


@pytest.mark.slow
@pytest.mark.parametrize("link", ["uplink", "downlink"])
def test_error_feedback_with_top_k_keeps_the_exact_joint_mean(link):
    """D-ELF's (uplink) and P-ELF's (downlink) error feedback with top-1 of 3 coordinates: the joint chain's
    stationary mean is still the posterior mean (top-k is odd and the target Gaussian, as for the ELF
    samplers), and the uplink's bits fall to a third of the gradients'."""
    rng = np.random.default_rng(0)
    ys = [rng.normal(2 * rng.normal(size=3), 1.0, size=(n, 3)) for n in (3, 5, 8, 4, 6)]
    data = fb.FederatedData({"y": ys})
    P, _ = _precision([y[:, 0] for y in ys])  # the three coordinates are independent, each with this precision
    m = np.linalg.solve(P, np.stack([np.zeros(3)] + [y.sum(0) for y in ys]))  # (1 + clients, 3)
    n_chains = 1000
    res = fb.fed_fit(three_means, data, fb.JointLMC(step_size=0.05, num_chains=n_chains, warmup=399,
                                                    **{link: fb.compress.top_k(1)}),
                     num_rounds=400, seed=1, progress=False)
    last = np.concatenate([np.asarray(res.global_samples["mu"])[:, -1, None],
                           np.asarray(group(res.idata, "posterior")["z"])[:, -1]], 1)  # (chains, 1 + clients, 3)
    # the last draws of 1000 independent chains (400 rounds, about 40 autocorrelation times of the slowest
    # direction): 5 standard errors of their mean over the 18 coordinates
    np.testing.assert_array_less(np.abs(last.mean(0) - m), 5 * last.std(0) / np.sqrt(n_chains))
    full = 32 * 3 * n_chains * len(ys) * 400  # every gradient in full: float32 x 3 coordinates
    if link == "uplink":
        assert np.sum(res.history["bits_up"]) < full / 2
    else:
        assert np.sum(res.history["bits_up"]) == full


def slope_and_intercepts(x, y=None):
    """y_ij ~ N(w x_ij + z_i, 1): a global slope and each client's intercept, s = w + z_i recorded."""
    w = numpyro.sample("w", dist.Normal(0.0, 10.0))
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with fb.local():
        z = numpyro.sample("z", dist.Normal(mu, 1.0))
    numpyro.deterministic("s", w + z)
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(w * x + z, 1.0), obs=y)


def test_predictions_for_a_known_client_use_the_joint_draws_in_pairs():
    """res.predict for a known client averages p(y | x, theta_s, z_s) over the joint sampler's pairs (theta_s, z_s),
    not over independently drawn globals and locals: the deterministic w + z_i is the paired draws' sum, draw
    by draw, with and without a subsample; a new client's draws come from the population prior."""
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=n) for n in SIZES]
    data = fb.FederatedData({"x": xs, "y": [2 * x + rng.normal() for x in xs]})
    res = fb.fed_fit(slope_and_intercepts, data, fb.JointMALA(num_chains=2), num_rounds=400, seed=0, progress=False)
    w = np.asarray(res.global_samples["w"]).reshape(-1)
    z = np.asarray(res.local_samples["z"])  # (clients, chains x draws)
    assert z.shape == (len(SIZES), w.size)
    # the same pairing in the posterior group: chain c, draw d of w goes with chain c, draw d of z
    post = group(res.idata, "posterior")
    np.testing.assert_array_equal(np.asarray(post["z"])[..., 2].reshape(-1), z[2])
    pred = res.predict({"x": np.zeros(3)}, client=2)
    np.testing.assert_allclose(pred["s"], w + z[2], rtol=1e-12)
    sub = res.predict({"x": np.zeros(3)}, client=2, num_samples=50, seed=4)
    idx = np.random.default_rng(4).choice(w.size, 50, replace=False)
    np.testing.assert_allclose(sub["s"], w[idx] + z[2, idx], rtol=1e-12)
    new = res.predict({"x": np.zeros(3)})
    assert new["s"].shape == (1000,) and not np.isin(new["s"], w + z).any()
    # the model-checking groups evaluate the data at the same pairs: log N(y_2j | w_s x_2j + z_2,s, 1)
    ll = np.asarray(group(res.extend_idata(), "log_likelihood")["y"])  # (chain, draw, obs), clients in order
    first = sum(SIZES[:2])  # client 2's first observation
    x2, y2 = xs[2][0], np.asarray(data.client(2)["y"])[0]
    expected = -0.5 * (y2 - w * x2 - z[2]) ** 2 - 0.5 * np.log(2 * np.pi)
    np.testing.assert_allclose(ll[..., first].reshape(-1), expected, rtol=1e-10)
