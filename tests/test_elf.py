"""Federated Langevin samplers against exact Gaussian stationary laws and NUTS on pooled data."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedbayes as fb
from fedbayes.wire import decode_tree
from fedbayes.engine import Problem, RoundInfo, stack_clients
from fedbayes.errors import ConfigError, ModelError

D, PRIOR_SD = 4, 10.0


def gaussian_clients(n=5, seed=0):
    """Client i contributes U_i(x) = (x - m_i)^T A_i (x - m_i) / 2 (an MVN 'observation' of m_i)."""
    rng = np.random.default_rng(seed)
    ms, precs = [], []
    for _ in range(n):
        q, _ = np.linalg.qr(rng.normal(size=(D, D)))
        precs.append((q * rng.uniform(0.5, 2.0, D)) @ q.T)
        ms.append(rng.normal(0.0, 2.0, D))  # heterogeneous: grad U_i(mu*) != 0
    data = fb.FederatedData({"m": [m[None] for m in ms], "prec": [a[None] for a in precs]})
    P = sum(precs) + np.eye(D) / PRIOR_SD**2
    mu = np.linalg.solve(P, sum(a @ m for a, m in zip(precs, ms)))
    return data, P, mu


def gauss_model(m, prec):
    x = numpyro.sample("x", dist.Normal(0.0, PRIOR_SD).expand([D]).to_event(1))
    with numpyro.plate("obs", m.shape[0]):
        numpyro.sample("y", dist.MultivariateNormal(x, precision_matrix=prec), obs=m)


def last_draws(res):
    return res.global_samples["x"][:, -1]  # one draw per chain: independent draws of the chain's law


def test_identity_compressors_reproduce_lmc():
    data, P, _ = gaussian_clients()
    gamma = 0.2 / np.linalg.eigvalsh(P).max()
    kw = dict(step_size=gamma, num_chains=3)
    runs = [fb.fed_fit(gauss_model, data, a, num_rounds=60, seed=7)
            for a in (fb.LMC(**kw), fb.DELF(**kw), fb.PELF(**kw), fb.BELF(**kw))]
    for r in runs[1:]:
        # same keys, same arithmetic up to rounding (w + (x - w) and g + (grad - g) vs grad)
        np.testing.assert_allclose(r.global_samples["x"], runs[0].global_samples["x"], rtol=0, atol=1e-9)


def test_error_feedback_invariants_hold_every_round():
    data, P, _ = gaussian_clients()
    problem = Problem(fb.FedModel(gauss_model, data), data, 30)
    algo = fb.BELF(step_size=0.1 / np.linalg.eigvalsh(P).max(), num_chains=2,
                   uplink=fb.compress.top_k(2), downlink=fb.compress.natural(contractive=True))
    run = algo.build(problem)
    clients = stack_clients(data)
    server, states, broadcast = run.init(jax.random.PRNGKey(0), problem)
    np.testing.assert_allclose(server.up, states.up.sum(0), atol=1e-12)  # g_0 = sum_i grad U_i(x_0)
    C = data.num_clients
    # the engine keeps one copy of w for all clients (common_client_fields); here each client keeps its own, as
    # on a network, and the copies are checked to stay the server's w: what makes the one copy exact
    assert run.common_client_fields == ("down",) and states.down.shape == server.down.shape
    states = states._replace(down=jnp.broadcast_to(states.down, (C,) + states.down.shape))
    for k in range(30):
        keys = jax.random.split(jax.random.PRNGKey(k + 1), C)
        step = jax.vmap(run.client_step, in_axes=(0, None, 0, 0))
        states, up = step(keys, decode_tree(broadcast.payload), states, clients)
        server_w = server.down
        server, broadcast, _ = run.server_step(jax.random.PRNGKey(100 + k), server, up._replace(payload=decode_tree(up.payload)),
                                               RoundInfo(jnp.asarray(k), jnp.arange(C), jnp.ones(C, bool), C))
        # g = sum_i g^i (the paper's g = mean_i g^i with F_i = n U_i), and every client's copy of w is
        # bit-identical to the server's w_{k+1} (both computed as w_k + v_k)
        np.testing.assert_allclose(server.up, states.up.sum(0), rtol=1e-10, atol=1e-10)
        np.testing.assert_array_equal(states.down, jnp.broadcast_to(server_w, states.down.shape))


def test_lmc_stationary_law_is_exact():
    data, P, mu = gaussian_clients()
    gamma = 0.5 / np.linalg.eigvalsh(P).max()
    n_chains = 4000
    res = fb.fed_fit(gauss_model, data, fb.LMC(step_size=gamma, num_chains=n_chains, warmup=299),
                     num_rounds=300, seed=0)
    x = last_draws(res)
    cov = np.linalg.inv(P - gamma * P @ P / 2)
    np.testing.assert_array_less(np.abs(x.mean(0) - mu), 5 * np.sqrt(np.diag(cov) / n_chains))
    se_cov = np.sqrt((np.outer(np.diag(cov), np.diag(cov)) + cov**2) / n_chains)
    np.testing.assert_array_less(np.abs(np.cov(x.T) - cov), 5 * se_cov)
    # the noise scale is right: sqrt(gamma) noise would halve the covariance, far outside tolerance
    assert np.max(np.abs(np.cov(x.T) - cov / 2) / se_cov) > 10


@pytest.mark.parametrize("algo", ["DELF", "PELF", "BELF"])
def test_error_feedback_with_an_odd_compressor_has_the_exact_mean(algo):
    data, P, mu = gaussian_clients()
    gamma = 0.1 / np.linalg.eigvalsh(P).max()
    kw = {"DELF": {"uplink": fb.compress.top_k(1)}, "PELF": {"downlink": fb.compress.top_k(1)},
          "BELF": {"uplink": fb.compress.top_k(1), "downlink": fb.compress.top_k(2)}}[algo]
    n_chains = 2000
    res = fb.fed_fit(gauss_model, data, getattr(fb, algo)(step_size=gamma, num_chains=n_chains, warmup=499, **kw),
                     num_rounds=500, seed=1)
    x = last_draws(res)
    # top-k is odd, the target Gaussian: the stationary mean is exactly mu* (digest, section 5.2 E)
    np.testing.assert_array_less(np.abs(x.mean(0) - mu), 5 * x.std(0) / np.sqrt(n_chains))


def test_naive_compressed_lmc_is_visibly_biased():
    data, P, mu = gaussian_clients()
    gamma = 0.1 / np.linalg.eigvalsh(P).max()
    n_chains = 2000
    res = fb.fed_fit(gauss_model, data, fb.LMC(step_size=gamma, num_chains=n_chains, warmup=499,
                                               compressor=fb.compress.top_k(1)), num_rounds=500, seed=1)
    x = last_draws(res)
    z = np.abs(x.mean(0) - mu) / (x.std(0) / np.sqrt(n_chains))
    assert z.max() > 20  # without error feedback, heterogeneous clients bias the mean


def linreg(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, 0.5), obs=y)


@pytest.mark.parametrize("splits", [1, 2, 10])
def test_splitting_the_data_leaves_the_stationary_law_unchanged(splits):
    # Bayesian linear regression: P = I + X^T X / 0.25, mu = P^{-1} X^T y / 0.25; LMC's law is
    # N(mu, (P - gamma P^2/2)^{-1}) whatever the split. A potential mis-scaled by the number of
    # clients (sampling pi^(1/n)) would change it with the split.
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 3))
    y = X @ np.array([1.0, -0.5, 0.2]) + 0.5 * rng.normal(size=60)
    data = fb.FederatedData.from_pooled({"x": X, "y": y}, fb.partition_iid(60, splits, seed=1))
    P = np.eye(3) + X.T @ X / 0.25
    mu = np.linalg.solve(P, X.T @ y / 0.25)
    gamma = 0.5 / np.linalg.eigvalsh(P).max()
    n_chains = 3000
    res = fb.fed_fit(linreg, data, fb.LMC(step_size=gamma, num_chains=n_chains, warmup=399), num_rounds=400, seed=2)
    w = res.global_samples["w"][:, -1]
    cov = np.linalg.inv(P - gamma * P @ P / 2)
    np.testing.assert_array_less(np.abs(w.mean(0) - mu), 5 * np.sqrt(np.diag(cov) / n_chains))
    np.testing.assert_allclose(w.var(0), np.diag(cov), rtol=5 * np.sqrt(2 / n_chains))


def test_ledger_counts_initial_and_per_round_messages():
    data, P, _ = gaussian_clients()
    chains, C = 2, data.num_clients
    # a given start: no Newton search for the mode before the set-up (its exchanges would be in init_bits)
    res = fb.fed_fit(gauss_model, data, fb.BELF(step_size=0.01, num_chains=chains, uplink=fb.compress.top_k(1),
                                                downlink=fb.compress.top_k(2), init={"x": np.zeros(D)}),
                     num_rounds=10, seed=0)
    idx = int(np.ceil(np.log2(D)))
    np.testing.assert_array_equal(res.history["bits_up"], C * chains * 1 * (32 + idx))
    np.testing.assert_array_equal(res.history["bits_down"], C * chains * 2 * (32 + idx))
    assert res.init_bits == (C * chains * 32 * D, C * chains * 32 * D)
    assert res.bits_up == 10 * C * chains * (32 + idx) + C * chains * 32 * D


def test_samples_are_arviz_ready():
    data, P, _ = gaussian_clients()
    res = fb.fed_fit(gauss_model, data, fb.DELF(step_size=0.05 / np.linalg.eigvalsh(P).max(), num_chains=3,
                                                warmup=20, thinning=2, uplink=fb.compress.top_k(2)),
                     num_rounds=60, seed=0)
    from fedbayes.result import group

    post = group(res.idata, "posterior")
    assert post["x"].shape == (3, 20, D)
    stats = group(res.idata, "sample_stats")
    assert stats["bits_up"].shape == (3, 20)
    np.testing.assert_allclose(res.params["x"], res.global_samples["x"].mean((0, 1)))


def test_models_and_compressors_the_samplers_cannot_take():
    data = fb.models.make_fedpop_synthetic(4, seed=0)[0]
    with pytest.raises(ModelError, match="local latents"):
        fb.fed_fit(fb.models.fedpop_synthetic, data, "lmc", num_rounds=5)
    lme, _ = fb.models.make_linear_mixed_effects(4, seed=0)

    def params_only(x, z, y=None):
        beta = numpyro.param("beta", jnp.zeros(2))
        with numpyro.plate("obs", x.shape[0]):
            numpyro.sample("y", dist.Normal(x @ beta, 1.0), obs=y)

    with pytest.raises(ModelError, match="'beta'.*without a prior"):
        fb.fed_fit(params_only, lme, "d-elf", num_rounds=5)
    with pytest.raises(ConfigError, match="D-ELF"):
        fb.DELF(uplink=fb.compress.rand_k(1)).build(Problem(fb.FedModel(gauss_model, gaussian_clients()[0]),
                                                            gaussian_clients()[0], 5))
    with pytest.raises(ConfigError, match="every client in every round.*QLSD"):
        fb.fed_fit(gauss_model, gaussian_clients()[0], fb.BELF(), num_rounds=5, clients_per_round=2)
    assert fb.LMC(step_size=np.float32(0.01)).step_size == np.float32(0.01)  # any real number is accepted
    for bad in ({"step_size": -1.0}, {"step_size": True}, {"num_chains": 0}, {"thinning": 0}):
        with pytest.raises(ConfigError):
            fb.LMC(**bad)


def test_step_size_helpers():
    data, P, _ = gaussian_clients()
    lam = np.linalg.eigvalsh(P).max()
    # the Hessian of U is P everywhere: the power iteration recovers lambda_max
    assert fb.elf.curvature_step_size(gauss_model, data, scale=0.1) == pytest.approx(0.1 / lam, rel=1e-6)
    # theorem step sizes: LMC's is the smoothness bound here; compression only shrinks it
    lmc = fb.elf.theory_step_size("lmc", L=lam, Lbar=lam**2, mu=1.0)
    assert lmc == pytest.approx(min(1 / 14, 1 / 6, 1 / (2 * np.sqrt(2) * lam)))
    d_elf = fb.elf.theory_step_size("d-elf", L=lam, Lbar=lam**2, mu=1.0, alpha_up=0.25)
    assert d_elf == pytest.approx(min(np.sqrt(0.125 / (1 + 6 * lam**2)) / 14, 0.125 / 6, 1 / (2 * np.sqrt(2) * lam)))
    assert fb.elf.theory_step_size("b-elf", L=lam, Lbar=lam**2, mu=1.0, alpha_up=0.25, alpha_down=0.25) < d_elf < lmc
    with pytest.raises(ConfigError):
        fb.elf.theory_step_size("x-elf", L=1.0, Lbar=1.0, mu=1.0)
    with pytest.raises(ConfigError):
        fb.elf.theory_step_size("d-elf", L=1.0, Lbar=1.0, mu=1.0, alpha_up=0.0)


def logistic(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


@pytest.fixture(scope="module")
def logistic_reference():
    rng = np.random.default_rng(3)
    X = np.column_stack([np.ones(300), rng.normal(size=(300, 2))])
    y = (rng.random(300) < 1 / (1 + np.exp(-(X @ np.array([-0.5, 1.0, -1.5]))))).astype(np.int32)
    mcmc = numpyro.infer.MCMC(numpyro.infer.NUTS(logistic), num_warmup=500, num_samples=4000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), jnp.asarray(X), jnp.asarray(y))
    w = np.asarray(mcmc.get_samples()["w"])
    labels = y.copy()
    data = fb.FederatedData.from_pooled({"x": X, "y": y}, fb.partition_dirichlet(labels, 10, alpha=0.5, seed=0, min_size=5))
    return data, w.mean(0), w.std(0)


@pytest.mark.parametrize("algo", [
    fb.LMC(step_size=None), fb.DELF(uplink=fb.compress.top_k(2)), fb.PELF(downlink=fb.compress.top_k(2)),
    fb.BELF(uplink=fb.compress.natural(contractive=True), downlink=fb.compress.top_k(2)),
], ids=["lmc", "d-elf", "p-elf", "b-elf"])
def test_samplers_match_nuts_on_pooled_logistic_regression(logistic_reference, algo):
    data, mean, sd = logistic_reference
    gamma = fb.elf.curvature_step_size(logistic, data, at={"w": mean}, scale=0.05)
    cfg = type(algo)(**{**{f: getattr(algo, f) for f in algo.__dataclass_fields__}, "step_size": gamma,
                        "num_chains": 8, "warmup": 500})
    res = fb.fed_fit(logistic, data, cfg, num_rounds=4500, seed=0)
    w = res.global_samples["w"]
    # Monte Carlo error of the mean: ~8 x 4000 autocorrelated draws (ESS >= 1000) and NUTS's 4000
    # draws give < 0.05 sd together; ULA's bias at gamma * lambda_max = 0.05 inflates variances by
    # about 2.5%. Hence the issue's tolerances (0.1 sd, 10%) are met with a margin when the target is right.
    np.testing.assert_array_less(np.abs(w.mean((0, 1)) - mean) / sd, 0.1)
    np.testing.assert_allclose(w.std((0, 1)), sd, rtol=0.1)
