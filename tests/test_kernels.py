"""ULA against its exact stationary law, the power iteration, and the NumPyro kernel wrapper."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedbayes as fb
from fedbayes.errors import ConfigError
from fedbayes.kernels import TAME, LangevinPoint, curvature, langevin_move, move_keys, ula_chain


def test_ula_gaussian_stationary_law_is_exact():
    # Target N(m, P^{-1}); ULA's stationary law is N(m, (P - gamma P^2 / 2)^{-1}) exactly.
    P = jnp.array([[3.0, 1.0, 0.0], [1.0, 2.0, 0.5], [0.0, 0.5, 1.0]])
    m = jnp.array([1.0, -2.0, 0.5])
    lam_max = float(jnp.linalg.eigvalsh(P).max())
    gamma = 0.6 / lam_max  # large enough that the ULA bias is visible, small enough to be stable
    grad = lambda x: -P @ (x - m)  # noqa: E731
    n_chains, n_steps = 20000, 400  # contraction (1 - gamma lam_min)^400 < 1e-12: final states are iid
    keys = jax.random.split(jax.random.PRNGKey(0), n_chains)
    final, _ = jax.vmap(lambda k: ula_chain(k, jnp.zeros(3), grad, gamma, n_steps))(keys)
    x = np.asarray(final)
    sigma_gamma = np.linalg.inv(np.asarray(P - gamma * P @ P / 2))
    se_cov = _assert_gaussian_law(x, np.asarray(m), sigma_gamma)  # mean exact, covariance ULA's
    # and the test can tell the biased law from the target: P^{-1} is many standard errors away
    assert np.max(np.abs(np.linalg.inv(np.asarray(P)) - sigma_gamma) / se_cov) > 20


def test_preconditioned_ula_stationary_law_is_exact_and_mixes_whatever_the_scales():
    """Target N(m, P^{-1}) with condition number 1e4 (a random intercept in ms and a slope in ms/day);
    preconditioner R with R R^T = Q^{-1} for a Q near P. In u = R^{-1} x the move is plain ULA on the
    target N(R^{-1} m, (R^T P R)^{-1}), so its stationary law is N(m, R (A - gamma A^2 / 2)^{-1} R^T) with
    A = R^T P R, exactly (the scalar case's formula, whitened). 100 moves at gamma = 0.5 reach it from 0;
    plain ULA with its stable step 1 / lambda_max has then moved the wide direction by 1%."""
    rot = np.array([[np.cos(0.3), -np.sin(0.3)], [np.sin(0.3), np.cos(0.3)]])
    P = rot @ np.diag([1.0, 1e-4]) @ rot.T
    m = np.array([250.0, 10.0])
    Q = rot @ np.diag([1.1, 0.9e-4]) @ rot.T  # a near miss (curvatures 10% off): R is not the exact whitening
    R = np.linalg.cholesky(np.linalg.inv(Q))
    A = R.T @ P @ R
    gamma = 0.5 / np.linalg.eigvalsh(A).max()
    grad = lambda x: -jnp.asarray(P) @ (x - jnp.asarray(m))  # noqa: E731

    n_chains = 20000
    keys = jax.random.split(jax.random.PRNGKey(1), n_chains)
    evaluate = lambda x: (-0.5 * (x - m) @ P @ (x - m), grad(x), ())  # noqa: E731
    # langevin_move without the Metropolis test and untamed: preconditioned ULA
    x, _ = _langevin_chains(jax.random.PRNGKey(1), jnp.zeros(2), evaluate, gamma, jnp.asarray(R), n_chains, 100)
    x = np.asarray(x)
    # contraction per move: max |1 - gamma a| over A's eigenvalues a = 1 - 0.5 a_min / a_max (~0.59): 100
    # moves leave < 1e-20 of the start, so the final states are iid from the stationary law
    _assert_gaussian_law(x, m, R @ np.linalg.inv(A - gamma * A @ A / 2) @ R.T)
    # plain ULA, the same number of moves at its step 0.5 / lambda_max: the wide direction has not moved
    step = 0.5 / np.linalg.eigvalsh(P).max()
    plain = np.asarray(jax.vmap(lambda k: ula_chain(k, jnp.zeros(2), grad, step, 100)[0])(keys[:200]))
    wide = rot[:, 1]  # the direction of curvature 1e-4: plain ULA contracts it by 1 - 5e-5 per move
    assert abs(wide @ (plain.mean(0) - m)) > 0.9 * abs(wide @ m)


def _assert_gaussian_law(x, mean, cov):
    """iid draws ``x`` (n, q) of N(mean, cov): the sample mean and covariance within 5 of their standard
    errors (Var(S_jk) = (S_jj S_kk + S_jk^2) / n for Gaussian samples); returns the covariance's errors."""
    n = x.shape[0]
    np.testing.assert_array_less(np.abs(x.mean(0) - mean), 5 * np.sqrt(np.diag(cov) / n))
    se_cov = np.sqrt((np.outer(np.diag(cov), np.diag(cov)) + cov**2) / n)
    np.testing.assert_array_less(np.abs(np.cov(x.T) - cov), 5 * se_cov)
    return se_cov


def _langevin_chains(key, x0, evaluate, step, root, n_chains, n_steps, **kw):
    """Final states and mean acceptance probabilities of ``n_chains`` chains of :func:`langevin_move`."""
    def chain(k):
        def body(point, kk):
            point, prob = langevin_move(kk, point, evaluate, step, root, **kw)
            return point, prob
        end, probs = jax.lax.scan(body, LangevinPoint(x0, *evaluate(x0)), jax.random.split(k, n_steps))
        return end.x, probs.mean()
    return jax.jit(jax.vmap(chain))(jax.random.split(key, n_chains))


def test_mala_stationary_law_is_the_target_at_a_step_where_ula_is_far_off():
    """MALA (preconditioned by an R that misses the whitening by 10-30%, tamed) at gamma = 0.9 / the
    largest whitened curvature: its final states are draws of N(m, P^-1) itself, while ULA's law at the
    same step, N(m, R (A - gamma A^2 / 2)^-1 R^T) with A = R^T P R, is many standard errors away. The
    same tamed move without the test reproduces that ULA law exactly, so the taming, which binds only
    far out, leaves both laws alone."""
    P = np.array([[4.0, 1.5, 0.0], [1.5, 2.0, 0.3], [0.0, 0.3, 0.5]])
    m = np.array([1.0, -2.0, 3.0])
    R = np.linalg.cholesky(np.linalg.inv(np.diag([3.0, 1.5, 0.6]) + 0.2))
    A = R.T @ P @ R
    gamma = 0.9 / np.linalg.eigvalsh(A).max()
    Pj, mj = jnp.asarray(P), jnp.asarray(m)
    evaluate = lambda x: (-0.5 * (x - mj) @ Pj @ (x - mj), -Pj @ (x - mj), ())  # noqa: E731
    n = 20000
    target = np.linalg.inv(P)
    ula_law = R @ np.linalg.inv(A - gamma * A @ A / 2) @ R.T
    for adjusted, law in ((True, target), (False, ula_law)):
        x, acc = _langevin_chains(jax.random.PRNGKey(2), jnp.asarray(m + 2.0), evaluate, gamma, jnp.asarray(R),
                                  n, 300, adjusted=adjusted, tame=True)
        # 300 moves: ULA contracts by max |1 - gamma a| <= 1 - 0.9 a_min / a_max per move (< 1e-10 left); MALA
        # mixes at about its acceptance times that (acceptance measured 0.8 here), so the final states are iid
        se_cov = _assert_gaussian_law(np.asarray(x), m, law)
        if adjusted:
            assert 0.5 < float(acc.mean()) < 1.0
            assert np.max(np.abs(ula_law - target) / se_cov) > 20  # the check can tell the two laws apart
        else:
            assert float(acc.mean()) == 1.0


def test_tamed_mala_is_exact_on_an_exp_link_from_far_out():
    """A Poisson random intercept's posterior, log pi(b) = s b - n e^b - b^2 / 2 (s = 400 counts in n = 4
    visits: mode near log 100, sd about 0.05), from b = 7, with the step the mode's curvature sets. The
    drift there (the gradient is -4e3) is about 100 sds long and MALA rejects the overshoot; tamed,
    each move goes at most TAME noise lengths, so the chains arrive, and MALA's draws have the quadrature's
    mean and sd."""
    s, n = 400.0, 4.0
    logp = lambda b: s * b - n * jnp.exp(b) - 0.5 * b**2  # noqa: E731
    evaluate = lambda x: (jnp.sum(logp(x)), jax.grad(lambda y: jnp.sum(logp(y)))(x), ())  # noqa: E731
    grid = np.linspace(3.5, 5.5, 200001)
    w = np.exp(np.asarray(logp(jnp.asarray(grid))) - np.max(np.asarray(logp(jnp.asarray(grid)))))
    mean = np.sum(w * grid) / np.sum(w)
    sd = np.sqrt(np.sum(w * (grid - mean) ** 2) / np.sum(w))
    curv = n * np.exp(mean) + 1.0
    gamma = 0.5 / curv
    x, acc = _langevin_chains(jax.random.PRNGKey(3), jnp.array([7.0]), evaluate, gamma, None, 20000, 400,
                              adjusted=True, tame=True)
    x = np.asarray(x)[:, 0]
    assert np.all(np.isfinite(x))
    # capped moves of TAME * sqrt(2 gamma) ~ 0.2 cover the 2.4 to the mode in about 12 moves; then ~380 moves
    # at acceptance ~0.9 and contraction 1 - gamma curv = 0.5 per accepted move: iid final states
    assert abs(x.mean() - mean) < 5 * sd / np.sqrt(x.size)
    assert abs(x.std() / sd - 1) < 5 / np.sqrt(2 * x.size)
    # untamed, the first move from 7 lands about 55 sds below the mode, where the reverse move is impossible:
    # MALA rejects it, and every later one, so the chains never leave the start
    y, _ = _langevin_chains(jax.random.PRNGKey(3), jnp.array([7.0]), evaluate, gamma, None, 200, 400,
                            adjusted=True, tame=False)
    assert np.all(np.asarray(y) == 7.0)
    assert TAME == 4.0


@pytest.mark.parametrize("adjusted", [False, True])
def test_moves_with_their_keys_split_ahead_are_the_same_moves(adjusted):
    """A chain of 30 moves given its keys split ahead (``move_keys``: one batched hash for the chain) runs the
    moves of the chain that splits each key in the move, bit for bit, ULA and MALA."""
    P = jnp.asarray([[2.0, 0.5], [0.5, 1.0]])
    evaluate = lambda x: (-0.5 * x @ P @ x, -P @ x, ())  # noqa: E731
    start = LangevinPoint(jnp.asarray([3.0, -1.0]), *evaluate(jnp.asarray([3.0, -1.0])))
    keys = jax.random.split(jax.random.PRNGKey(7), 30)

    def chain(ks):
        return jax.lax.scan(lambda p, k: langevin_move(k, p, evaluate, 0.3, adjusted=adjusted, tame=True), start, ks)

    (end, probs), (end_ahead, probs_ahead) = jax.jit(chain)(keys), jax.jit(chain)(move_keys(keys))
    for a, b in zip(jax.tree_util.tree_leaves((end, probs)), jax.tree_util.tree_leaves((end_ahead, probs_ahead))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.min(probs)) < 1.0 if adjusted else float(jnp.min(probs)) == 1.0  # MALA rejected some


def test_a_noise_factor_scales_ula_s_noise_and_is_refused_by_mala():
    """``noise_factor=f``: the unadjusted move's noise is sqrt(2 gamma) f xi with the same xi (f = 1 is the plain
    move bit for bit, f = 0 the gradient step); on the Gaussian target N(0, 1 / lambda) with f^2 = 1 - gamma lambda / 2
    the AR(1) recursion's stationary variance is exactly 1 / lambda (its closed form); MALA refuses it."""
    lam, gamma = 2.0, 0.4
    evaluate = lambda x: (-0.5 * lam * jnp.sum(x * x), -lam * x, ())  # noqa: E731
    start = LangevinPoint(jnp.asarray([1.5]), *evaluate(jnp.asarray([1.5])))
    key = jax.random.PRNGKey(3)
    plain, _ = langevin_move(key, start, evaluate, gamma)
    same, _ = langevin_move(key, start, evaluate, gamma, noise_factor=jnp.ones(1))
    step, _ = langevin_move(key, start, evaluate, gamma, noise_factor=jnp.zeros(1))
    np.testing.assert_array_equal(np.asarray(plain.x), np.asarray(same.x))
    np.testing.assert_allclose(np.asarray(step.x), 1.5 - gamma * lam * 1.5, rtol=1e-6)
    f = jnp.sqrt(1.0 - gamma * lam / 2.0)

    def chain(k):
        return jax.lax.scan(lambda p, kk: (langevin_move(kk, p, evaluate, gamma, noise_factor=f)[0], None), start,
                            jax.random.split(k, 60))[0].x[0]

    draws = np.asarray(jax.jit(jax.vmap(chain))(jax.random.split(key, 4000)), np.float64)
    # 4 000 independent copies after 60 moves (the start's weight (1 - gamma lambda)^60 = 1e-24): the variance's
    # relative sd is sqrt(2 / 3999) = 0.022; plain ULA's would be 1 / (1 - 0.4) = 1.67 times wider
    assert abs(draws.var() * lam - 1.0) < 4.5 * np.sqrt(2.0 / 3999)
    with pytest.raises(ValueError, match="noise_factor"):
        langevin_move(key, start, evaluate, gamma, adjusted=True, noise_factor=f)


def test_curvature_power_iteration_finds_largest_eigenvalue():
    A = jnp.diag(jnp.array([1.0, 5.0, 40.0])) + 0.1
    log_density = lambda x: -0.5 * x["a"] @ A @ x["a"]  # noqa: E731
    lam, v = curvature(log_density, {"a": jnp.ones(3)}, jnp.ones(3), 200)
    assert lam == pytest.approx(float(jnp.linalg.eigvalsh(A).max()), rel=1e-8)
    assert float(jnp.abs(v @ jnp.linalg.eigh(A)[1][:, -1])) == pytest.approx(1.0, rel=1e-6)


def _normal_model():
    numpyro.sample("x", dist.Normal(jnp.array([1.0, -1.0]), jnp.array([0.5, 2.0])).to_event(1))
    numpyro.sample("s", dist.LogNormal(0.0, 0.5))


def test_ula_mcmc_kernel_runs_under_numpyro_mcmc_and_matches_target():
    mcmc = numpyro.infer.MCMC(fb.ULA(_normal_model, step_size=0.01), num_warmup=2000, num_samples=40000,
                              progress_bar=False)
    mcmc.run(jax.random.PRNGKey(1))
    x = np.asarray(mcmc.get_samples()["x"])
    # stationary law for x: N(m, (P - gamma P^2/2)^{-1}) with P = diag(1/sd^2), coordinate-wise
    sd2 = np.array([0.25, 4.0])
    var_gamma = 1.0 / (1.0 / sd2 - 0.01 / sd2**2 / 2)
    # chain autocorrelation: effective sample size of an AR(1) with rho = 1 - gamma / sd^2
    rho = 1 - 0.01 / sd2
    ess = 40000 * (1 - rho) / (1 + rho)
    np.testing.assert_array_less(np.abs(x.mean(0) - [1.0, -1.0]), 5 * np.sqrt(var_gamma / ess))
    assert np.all(np.asarray(mcmc.get_samples()["s"]) > 0)  # constrained site reported constrained
    fields = mcmc.get_extra_fields()
    assert "potential_energy" in fields and fields["potential_energy"].shape == (40000,)


def test_ula_kernel_with_potential_fn_and_bad_config():
    U = lambda x: 0.5 * jnp.sum(x**2)  # noqa: E731
    mcmc = numpyro.infer.MCMC(fb.ULA(potential_fn=U, step_size=0.05), num_warmup=100, num_samples=20000,
                              progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), init_params=jnp.zeros(2))
    x = np.asarray(mcmc.get_samples())
    assert np.var(x, axis=0) == pytest.approx(1 / (1 - 0.05 / 2), rel=0.1)  # ESS ~ 500: 10% is > 4 sd
    with pytest.raises(ConfigError, match="exactly one"):
        fb.ULA()
    with pytest.raises(ConfigError, match="step_size"):
        fb.ULA(_normal_model, step_size=-1.0)
