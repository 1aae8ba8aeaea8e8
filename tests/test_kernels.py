"""ULA against its exact stationary law, the power iteration, and the NumPyro kernel wrapper."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedbayes as fb
from fedbayes.errors import ConfigError
from fedbayes.kernels import curvature, ula_chain


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
    # mean: exact; standard error from the known stationary covariance
    se_mean = np.sqrt(np.diag(sigma_gamma) / n_chains)
    np.testing.assert_array_less(np.abs(x.mean(0) - np.asarray(m)), 5 * se_mean)
    # covariance: Var(S_jk) = (S_jj S_kk + S_jk^2) / n for Gaussian samples
    emp = np.cov(x.T)
    se_cov = np.sqrt((np.outer(np.diag(sigma_gamma), np.diag(sigma_gamma)) + sigma_gamma**2) / n_chains)
    np.testing.assert_array_less(np.abs(emp - sigma_gamma), 5 * se_cov)
    # and the test can tell the biased law from the target: P^{-1} is many standard errors away
    assert np.max(np.abs(np.linalg.inv(np.asarray(P)) - sigma_gamma) / se_cov) > 20


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
