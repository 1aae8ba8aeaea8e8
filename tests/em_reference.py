"""Plain-numpy (float64) centralised EM on pooled data: exact references for federated EM tests.

Every ``*_em_step`` performs one exact EM iteration from the current parameters and returns
``(new_params, stats)``: ``new_params`` is a dict whose keys are the step's own keyword
arguments (so steps can be chained with :func:`run_em`), and ``stats`` holds the pooled
expected sufficient statistics of the E-step, from which the M-step was computed.  Those
statistics are sums over data points, i.e. exactly what a federated EM aggregates across
clients.  ``*_loglik`` give the observed-data log-likelihood, which EM never decreases.
"""

import numpy as np
from scipy.special import logsumexp

LOG_2PI = np.log(2.0 * np.pi)


def _as_float(*arrays):
    return tuple(np.asarray(a, dtype=np.float64) for a in arrays)


def _log_gauss(y, mean, cov):
    """log N(y_j; mean, cov) for each row y_j of y (N, D), through a Cholesky factor of cov."""
    L = np.linalg.cholesky(cov)
    z = np.linalg.solve(L, (y - mean).T)  # (D, N): L^{-1} (y_j - mean)
    return -0.5 * (np.sum(z**2, axis=0) + y.shape[1] * LOG_2PI) - np.sum(np.log(np.diag(L)))


# ----------------------------------------------------------------------------------------------
# Gaussian mixtures
# ----------------------------------------------------------------------------------------------

def _gmm_log_joint(y, weights, means, covs):
    """(N, K) matrix log w_k + log N(y_j; m_k, C_k)."""
    return np.stack([np.log(w) + _log_gauss(y, m, C) for w, m, C in zip(weights, means, covs)], axis=1)


def gmm_responsibilities(y, weights, means, covs):
    """r_jk = w_k N(y_j; m_k, C_k) / sum_l w_l N(y_j; m_l, C_l), computed by log-sum-exp. (N, K)."""
    lj = _gmm_log_joint(*_as_float(y, weights, means, covs))
    return np.exp(lj - logsumexp(lj, axis=1, keepdims=True))


def gmm_loglik(y, weights, means, covs):
    """sum_j log sum_k w_k N(y_j; m_k, C_k)."""
    return float(np.sum(logsumexp(_gmm_log_joint(*_as_float(y, weights, means, covs)), axis=1)))


def gmm_em_step(y, weights, means, covs):
    """One ML EM step of a full-covariance Gaussian mixture.

    y (N, D), weights (K,), means (K, D), covs (K, D, D).
    E-step: r_jk (see :func:`gmm_responsibilities`); statistics
        N_k = sum_j r_jk,  S1_k = sum_j r_jk y_j,  S2_k = sum_j r_jk y_j y_j^T.
    M-step: w_k = N_k / sum_l N_l,  m_k = S1_k / N_k,  C_k = S2_k / N_k - m_k m_k^T.
    Returns (dict(weights, means, covs), dict(N, S1, S2)).
    """
    y = _as_float(y)[0]
    r = gmm_responsibilities(y, weights, means, covs)
    N = r.sum(axis=0)
    S1 = r.T @ y
    S2 = np.einsum("jk,jd,je->kde", r, y, y)
    m = S1 / N[:, None]
    C = S2 / N[:, None, None] - np.einsum("kd,ke->kde", m, m)
    return dict(weights=N / N.sum(), means=m, covs=C), dict(N=N, S1=S1, S2=S2)


def gmm_diag_em_step(y, weights, means, sds):
    """One ML EM step of a diagonal-covariance Gaussian mixture; sds (K, D) standard deviations.

    Statistics N_k = sum_j r_jk, S1_k = sum_j r_jk y_j, S2_k = sum_j r_jk y_j**2 (elementwise).
    M-step: w = N / sum N, m_k = S1_k / N_k, sd_k = sqrt(S2_k / N_k - m_k**2).
    Returns (dict(weights, means, sds), dict(N, S1, S2)).
    """
    y, sds = _as_float(y, sds)
    covs = np.stack([np.diag(s**2) for s in sds])
    r = gmm_responsibilities(y, weights, means, covs)
    N = r.sum(axis=0)
    S1, S2 = r.T @ y, r.T @ y**2
    m = S1 / N[:, None]
    return dict(weights=N / N.sum(), means=m, sds=np.sqrt(S2 / N[:, None] - m**2)), dict(N=N, S1=S1, S2=S2)


# ----------------------------------------------------------------------------------------------
# Mixture of linear regressions
# ----------------------------------------------------------------------------------------------

def _mlr_log_joint(x, y, weights, coefs, sigmas):
    """(N, K) matrix log w_k + log N(y_j; x_j . coefs_k, sigma_k^2)."""
    res = y[:, None] - x @ coefs.T
    return np.log(weights) - 0.5 * (res / sigmas) ** 2 - np.log(sigmas) - 0.5 * LOG_2PI


def mlr_loglik(x, y, weights, coefs, sigmas):
    """sum_j log sum_k w_k N(y_j; x_j . coefs_k, sigma_k^2)."""
    return float(np.sum(logsumexp(_mlr_log_joint(*_as_float(x, y, weights, coefs, sigmas)), axis=1)))


def mlr_em_step(x, y, weights, coefs, sigmas):
    """One ML EM step of a mixture of K linear regressions y_j = x_j . coefs_k + N(0, sigma_k^2).

    x (N, p), y (N,), weights (K,), coefs (K, p), sigmas (K,).
    E-step: r_jk proportional to w_k N(y_j; x_j . coefs_k, sigma_k^2); statistics
        N_k = sum r_jk, Sxx_k = sum r_jk x_j x_j^T, Sxy_k = sum r_jk x_j y_j, Syy_k = sum r_jk y_j^2.
    M-step: coefs_k = Sxx_k^{-1} Sxy_k,
        sigma_k^2 = (Syy_k - 2 coefs_k . Sxy_k + coefs_k^T Sxx_k coefs_k) / N_k,  w = N / sum N.
    Returns (dict(weights, coefs, sigmas), dict(N, Sxx, Sxy, Syy)).
    """
    x, y = _as_float(x, y)
    lj = _mlr_log_joint(x, y, *_as_float(weights, coefs, sigmas))
    r = np.exp(lj - logsumexp(lj, axis=1, keepdims=True))
    N = r.sum(axis=0)
    Sxx = np.einsum("jk,jp,jq->kpq", r, x, x)
    Sxy = r.T @ (x * y[:, None])
    Syy = r.T @ y**2
    b = np.linalg.solve(Sxx, Sxy[:, :, None])[:, :, 0]
    s2 = (Syy - 2 * np.sum(b * Sxy, axis=1) + np.einsum("kp,kpq,kq->k", b, Sxx, b)) / N
    return dict(weights=N / N.sum(), coefs=b, sigmas=np.sqrt(s2)), dict(N=N, Sxx=Sxx, Sxy=Sxy, Syy=Syy)


# ----------------------------------------------------------------------------------------------
# Probabilistic PCA
# ----------------------------------------------------------------------------------------------

def ppca_loglik(y, W, mu, sigma):
    """sum_j log N(y_j; mu, W W^T + sigma^2 I_D)."""
    y, W, mu = _as_float(y, W, mu)
    return float(np.sum(_log_gauss(y, mu, W @ W.T + sigma**2 * np.eye(y.shape[1]))))


def ppca_em_step(y, W, mu, sigma):
    """One EM step of probabilistic PCA y_j = W z_j + mu + eps_j, z_j ~ N(0, I_q), eps_j ~ N(0, sigma^2 I_D).

    (W, mu) are updated jointly as the regression of y on u_j = (z_j, 1), A = [W mu] (D, q+1).
    E-step: M = W^T W + sigma^2 I_q, E z_j = M^{-1} W^T (y_j - mu), E z_j z_j^T = sigma^2 M^{-1} + E z_j E z_j^T,
        so E u_j = (E z_j, 1) and E u_j u_j^T = [[E z_j z_j^T, E z_j], [E z_j^T, 1]]; statistics
        Syy = sum ||y_j||^2,  SyU = sum y_j E u_j^T (D, q+1),  SUU = sum E u_j u_j^T (q+1, q+1).
    M-step: A = SyU SUU^{-1},  sigma^2 = (Syy - 2 tr(A^T SyU) + tr(A^T A SUU)) / (N D)
        (= (1/(N D)) sum_j ||y_j||^2 - 2 E u_j^T A^T y_j + tr(A^T A E u_j u_j^T)).
    Returns (dict(W, mu, sigma), dict(N, Syy, SyU, SUU)).
    """
    y, W, mu = _as_float(y, W, mu)
    n, D = y.shape
    q = W.shape[1]
    Minv = np.linalg.inv(W.T @ W + sigma**2 * np.eye(q))
    Ez = (y - mu) @ W @ Minv  # (N, q); Minv is symmetric
    Eu = np.hstack([Ez, np.ones((n, 1))])
    SUU = Eu.T @ Eu
    SUU[:q, :q] += n * sigma**2 * Minv
    SyU = y.T @ Eu
    Syy = float(np.sum(y**2))
    A = np.linalg.solve(SUU, SyU.T).T  # SUU symmetric
    s2 = (Syy - 2 * np.sum(A * SyU) + np.trace(A.T @ A @ SUU)) / (n * D)
    return dict(W=A[:, :q], mu=A[:, q], sigma=float(np.sqrt(s2))), dict(N=n, Syy=Syy, SyU=SyU, SUU=SUU)


# ----------------------------------------------------------------------------------------------
# Linear mixed model
# ----------------------------------------------------------------------------------------------

def lme_loglik(clients, beta, cov_b, sigma):
    """sum_i log N(y_i; X_i beta, Z_i cov_b Z_i^T + sigma^2 I_{n_i}) over clients (X_i, Z_i, y_i)."""
    beta, cov_b = _as_float(beta, cov_b)
    total = 0.0
    for X, Z, y in clients:
        X, Z, y = _as_float(X, Z, y)
        V = Z @ cov_b @ Z.T + sigma**2 * np.eye(len(y))
        total += float(_log_gauss(y[None, :], X @ beta, V)[0])
    return total


def lme_em_step(clients, beta, cov_b, sigma):
    """One ML EM step of the linear mixed model y_i = X_i beta + Z_i b_i + eps_i,
    b_i ~ N(0, cov_b), eps_i ~ N(0, sigma^2 I), with the random effects b_i as missing data.

    clients: list of (X_i (n_i, p), Z_i (n_i, q), y_i (n_i,)).
    E-step: b_i | y_i ~ N(m_i, V_i), V_i = (Z_i^T Z_i / sigma^2 + cov_b^{-1})^{-1},
        m_i = V_i Z_i^T (y_i - X_i beta) / sigma^2.
    M-step (exact joint maximiser of the expected complete log-likelihood):
        beta = (sum_i X_i^T X_i)^{-1} sum_i X_i^T (y_i - Z_i m_i),
        sigma^2 = sum_i [||y_i - X_i beta - Z_i m_i||^2 + tr(Z_i^T Z_i V_i)] / sum_i n_i   (new beta),
        cov_b = sum_i (m_i m_i^T + V_i) / n_clients.
    Returns (dict(beta, cov_b, sigma), dict(m=[m_i], V=[V_i])).
    """
    beta, cov_b = _as_float(beta, cov_b)
    clients = [_as_float(*c) for c in clients]
    s2 = sigma**2
    P = np.linalg.inv(cov_b)
    ms, Vs = [], []
    for X, Z, y in clients:
        V = np.linalg.inv(Z.T @ Z / s2 + P)
        ms.append(V @ Z.T @ (y - X @ beta) / s2)
        Vs.append(V)
    XtX = sum(X.T @ X for X, _, _ in clients)
    Xtr = sum(X.T @ (y - Z @ m) for (X, Z, y), m in zip(clients, ms))
    new_beta = np.linalg.solve(XtX, Xtr)
    rss = sum(np.sum((y - X @ new_beta - Z @ m) ** 2) + np.trace(Z.T @ Z @ V)
              for (X, Z, y), m, V in zip(clients, ms, Vs))
    n_total = sum(len(y) for _, _, y in clients)
    new_cov = sum(np.outer(m, m) + V for m, V in zip(ms, Vs)) / len(clients)
    return dict(beta=new_beta, cov_b=new_cov, sigma=float(np.sqrt(rss / n_total))), dict(m=ms, V=Vs)


# ----------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------

def run_em(step, params, n_iter, tol=None):
    """Iterate ``params, _ = step(**params)`` n_iter times.

    ``step`` takes the parameters as keyword arguments (bind the data first, e.g.
    ``functools.partial(gmm_em_step, y)``).  If ``tol`` is given, stop early once the largest
    absolute change of any parameter entry is below ``tol``.
    Returns (final params, iterates) with iterates[0] the initial params and iterates[-1] the final.
    """
    iterates = [params]
    for _ in range(n_iter):
        new, _stats = step(**params)
        iterates.append(new)
        change = max(float(np.max(np.abs(np.asarray(new[k]) - np.asarray(params[k])))) for k in new)
        params = new
        if tol is not None and change < tol:
            break
    return params, iterates


def poisson_random_effects(y):
    """A non-conjugate random-effects model (NumPyro): b_i ~ N(mu, tau^2), y_ij ~ Poisson(exp(b_i))."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist
    from numpyro.distributions import constraints

    import fedbayes as fb

    mu = numpyro.param("mu", 0.0)
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    with fb.local():
        b = numpyro.sample("b", dist.Normal(mu, tau))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(b)), obs=y)
