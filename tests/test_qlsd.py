"""QLSD: an unbiased gradient estimate, private memories, LMC as a special case, the stationary mean."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_elf import D, gauss_model, gaussian_clients

import fedbayes as fb
from fedbayes.wire import decode_tree
from fedbayes.algorithms.elf import ClientState, ServerState
from fedbayes.algorithms.qlsd import QLSD
from fedbayes.engine import (FLOAT_BITS, Message, Problem, RoundInfo, make_round, run_rounds, sample_cohort,
                             setup_keys, stack_clients)
from fedbayes.errors import ConfigError


def build(algo, data, num_rounds=10):
    return algo.build(Problem(fb.FedModel(gauss_model, data), data, num_rounds))


def test_gradient_estimate_is_unbiased_under_compression_and_partial_participation():
    data, P, mu = gaussian_clients()
    b, c, chains, n = data.num_clients, 2, 2, 20000
    run = build(QLSD(step_size=0.01, num_chains=chains, compressor=fb.compress.qsgd(1)), data)
    clients = stack_clients(data)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(chains, D)))
    h = jnp.asarray(3.0 * rng.normal(size=(b, chains, D)))  # arbitrary nonzero memories
    truth = (x - mu) @ P  # sum_i grad U_i(x) = P (x - mu*) for the Gaussian clients

    def draw(key):
        k_cohort, k_q = jax.random.split(key)
        cohort = sample_cohort(k_cohort, b, c)
        step = jax.vmap(run.client_step, in_axes=(0, None, 0, 0))
        _, up = step(jax.random.split(k_q, c), x, ClientState((), h[cohort]),
                     jax.tree_util.tree_map(lambda a: a[cohort], clients))
        sent = decode_tree(up.payload)
        g = run.up.gather(h.sum(0), sent.sum(0), RoundInfo(jnp.asarray(0), cohort, jnp.ones(c, bool), b))[0]
        return g, sent.sum(0)

    g, q = jax.jit(jax.vmap(draw))(jax.random.split(jax.random.PRNGKey(0), n))
    se = g.std(0) / np.sqrt(n)  # i.i.d. draws: the CLT error of the mean
    np.testing.assert_array_less(np.abs(g.mean(0) - truth), 5 * se)
    # the test has power: without the b/|A| weight the estimate is off by (1 - c/b) sum_i (grad U_i - h_i)
    assert np.max(np.abs(h.sum(0) + q.mean(0) - truth) / se) > 20


def test_memories_are_private_start_at_zero_and_sum_to_the_server_memory():
    data, P, _ = gaussian_clients()
    b, c = data.num_clients, 2
    algo = QLSD(step_size=0.1 / np.linalg.eigvalsh(P).max(), num_chains=2, compressor=fb.compress.rand_k(2))
    problem = Problem(fb.FedModel(gauss_model, data), data, 30)
    run = algo.build(problem)
    assert run.up.alpha == 1 / (1 + fb.compress.rand_k(2).omega(D)) == 0.5  # omega = d/k - 1
    assert build(QLSD(memory=False), data).up.alpha == 0.0
    carry = run.init(jax.random.PRNGKey(0), problem)
    assert not np.any(carry[0].up) and not np.any(carry[1].up)
    round_fn = jax.jit(make_round(run, stack_clients(data), b, c, jax.random.PRNGKey(1)))
    for k in range(30):
        before = carry[1].up
        carry, _ = round_fn(carry, k)
        server, states = carry[0], carry[1]
        np.testing.assert_allclose(server.up, states.up.sum(0), rtol=1e-10, atol=1e-12)
        # exactly the cohort's memories move (rand_k of a continuous vector is nonzero almost surely)
        assert np.sum(np.any(states.up != before, axis=(1, 2))) == c
    flat = np.asarray(states.up).reshape(b, -1)
    assert np.all(np.any(flat != 0, axis=1))  # every client has taken part by now
    assert len({row.tobytes() for row in flat}) == b  # no two clients share a memory


def test_identity_compressor_and_full_participation_is_lmc():
    data, P, _ = gaussian_clients()
    b, chains, rounds, seed = data.num_clients, 3, 60, 7
    # a given start and no warm-up: the default Newton search for the mode would add its exchanges to
    # init_bits, and the default warm-up (half the rounds) would drop the draws compared below
    kw = dict(step_size=0.2 / np.linalg.eigvalsh(P).max(), num_chains=chains, warmup=0, init={"x": np.zeros(D)})
    res = fb.fed_fit(gauss_model, data, QLSD(**kw), num_rounds=rounds, seed=seed)
    # fb.LMC spends its init key on a first step from x_0 with exact gradients, so fed_fit's LMC draws
    # start one step later on other noise keys. Run LMC's rounds from x_0 on the fit's round keys instead:
    # both then take every step through LangevinRun._move with the same server keys.
    k_init, k_rounds, _ = jax.random.split(jax.random.PRNGKey(seed), 3)
    problem = Problem(fb.FedModel(gauss_model, data), data, rounds)
    lmc = fb.LMC(**kw).build(problem)
    _, states, _ = lmc.init(k_init, problem)
    x0 = lmc.setup_server(setup_keys(k_init)[0])[0]  # LMC's x_0
    np.testing.assert_array_equal(res.global_samples["x"][:, 0], x0)
    carry = (ServerState(x0, jnp.asarray(kw["step_size"]), (), ()), states, Message(x0, jnp.asarray(0)))
    _, history = run_rounds(lmc, problem, carry, base_key=k_rounds, cohort_size=b)
    # memories hold last round's gradients; H + sum_i (grad U_i - h_i) equals sum_i grad U_i up to rounding
    np.testing.assert_allclose(res.global_samples["x"], np.swapaxes(history["_sample"], 0, 1), rtol=0, atol=1e-9)
    full = b * chains * FLOAT_BITS * D
    np.testing.assert_array_equal(res.history["bits_up"], full)
    assert res.init_bits == (0, full)


def batch_means(series, batches=20):
    """Mean of a (rounds, ...) series and its batch-means standard error (batches of 50 rounds, far longer
    than the series' correlation time of about 1 / (gamma lambda_min(P)) ~ 7 rounds)."""
    means = series.reshape(batches, -1, *series.shape[1:]).mean(1)
    return means.mean(0), means.std(0, ddof=1) / np.sqrt(batches)


def test_stationary_mean_is_exact_and_memory_reduces_the_variance():
    data, P, mu = gaussian_clients()
    gamma = 0.2 / np.linalg.eigvalsh(P).max()
    n_chains, c, warmup = 100, 2, 300
    comp = fb.compress.qsgd(4)
    trace = {}
    for memory in (True, False):
        algo = QLSD(step_size=gamma, num_chains=n_chains, warmup=warmup, compressor=comp, memory=memory,
                    init={"x": np.zeros(D)})  # a given start: the set-up's bits alone in init_bits
        res = fb.fed_fit(gauss_model, data, algo, num_rounds=warmup + 1000, clients_per_round=c, seed=3)
        x = res.global_samples["x"]  # (chains, rounds, d)
        # All chains share each round's cohort, so they are not independent draws: the error of their mean
        # has a part common to all chains, correlated over rounds. Average over chains and rounds, with the
        # standard error from batch means over rounds.
        # U is quadratic, so grad U(x) = P (x - mu*) and x_{k+1} - mu* = (I - gamma P)(x_k - mu*) - gamma e_k
        # + sqrt(2 gamma) Z_k with E[e_k | past] = 0 (G is unbiased): E[x_k] - mu* = (I - gamma P)^k (E[x_0]
        # - mu*) -> 0. The estimate's noise e_k inflates the covariance only; the mean is exactly mu*.
        mean, se = batch_means(x.mean(0))
        np.testing.assert_array_less(np.abs(mean - mu), 5 * se)
        trace[memory] = batch_means(np.sum((x - mu) ** 2, axis=-1).mean(0))  # E||x - mu*||^2 = tr Cov
        np.testing.assert_array_equal(res.history["bits_up"], c * n_chains * comp.bits(D))
        np.testing.assert_array_equal(res.history["bits_down"], c * n_chains * FLOAT_BITS * D)
        assert res.init_bits == (0, data.num_clients * n_chains * FLOAT_BITS * D)
    # heterogeneous clients (grad U_i(mu*) != 0): without memory, the cohort sampling and the quantisation
    # of grad U_i add variance; the memories h_i -> grad U_i remove most of it. The two runs are independent:
    # the standard error of the difference is the root sum of squares of the two.
    (with_memory, se1), (without, se0) = trace[True], trace[False]
    assert with_memory + 5 * np.hypot(se1, se0) < without


def test_biased_compressors_and_bad_options_are_refused():
    with pytest.raises(ConfigError, match="QLSD needs an unbiased compressor"):
        QLSD(compressor=fb.compress.top_k(1))
    with pytest.raises(ConfigError, match="QLSD memory"):
        QLSD(memory=1)
    with pytest.raises(ConfigError, match="QLSD num_chains"):
        QLSD(num_chains=0)
