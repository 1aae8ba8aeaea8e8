"""Checks of the plain-numpy EM references (tests/em_reference.py) against independent implementations."""

import functools
import warnings

import numpy as np
import pytest
from sklearn.mixture import GaussianMixture
from statsmodels.regression.mixed_linear_model import MixedLM

from em_reference import (
    gmm_diag_em_step,
    gmm_em_step,
    gmm_loglik,
    gmm_responsibilities,
    lme_em_step,
    lme_loglik,
    mlr_em_step,
    mlr_loglik,
    ppca_em_step,
    ppca_loglik,
    run_em,
)


def assert_monotone(ll, rtol=1e-9):
    """EM never decreases the observed-data log-likelihood (up to rounding)."""
    ll = np.asarray(ll)
    assert np.all(np.diff(ll) >= -rtol * np.abs(ll[:-1])), np.min(np.diff(ll))


@pytest.fixture(scope="module")
def gmm_data():
    rng = np.random.default_rng(0)
    means = np.array([[0.0, 0.0], [4.0, 1.0], [1.0, 5.0]])
    covs = np.array([[[1.0, 0.3], [0.3, 0.6]], [[0.5, -0.2], [-0.2, 1.2]], [[0.8, 0.0], [0.0, 0.4]]])
    z = rng.choice(3, size=600, p=[0.3, 0.4, 0.3])
    y = np.stack([rng.multivariate_normal(means[k], covs[k]) for k in z])
    init_means = y[rng.choice(600, 3, replace=False)]
    return y, init_means


def _sklearn_gmm(y, covariance_type, weights, means, precisions, max_iter=5000):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning when max_iter is deliberately small
        return GaussianMixture(n_components=3, covariance_type=covariance_type, reg_covar=0.0, tol=1e-14,
                               max_iter=max_iter, weights_init=weights, means_init=means,
                               precisions_init=precisions).fit(y)


def test_gmm_full_matches_sklearn(gmm_data):
    y, m0 = gmm_data
    p0 = dict(weights=np.full(3, 1 / 3), means=m0.copy(), covs=np.stack([np.eye(2)] * 3))
    step = functools.partial(gmm_em_step, y)
    p, its = run_em(step, p0, 2000, tol=1e-13)
    assert len(its) < 2001  # converged
    gm = _sklearn_gmm(y, "full", p0["weights"], p0["means"], np.linalg.inv(p0["covs"]))
    assert gm.converged_
    np.testing.assert_allclose(p["weights"], gm.weights_, atol=1e-6)
    np.testing.assert_allclose(p["means"], gm.means_, atol=1e-6)
    np.testing.assert_allclose(p["covs"], gm.covariances_, atol=1e-6)
    # Same EM sequence: after sklearn's iteration count the iterates agree to rounding.
    np.testing.assert_allclose(its[gm.n_iter_]["covs"], gm.covariances_, atol=1e-10)
    # A few steps only (far from the fixed point) still agree to rounding.
    gm3 = _sklearn_gmm(y, "full", p0["weights"], p0["means"], np.linalg.inv(p0["covs"]), max_iter=3)
    np.testing.assert_allclose(its[3]["means"], gm3.means_, atol=1e-10)
    np.testing.assert_allclose(its[3]["covs"], gm3.covariances_, atol=1e-10)

    ll = [gmm_loglik(y, **q) for q in its]
    assert_monotone(ll)
    np.testing.assert_allclose(ll[-1], gm.score(y) * len(y), rtol=1e-12)
    np.testing.assert_allclose(gmm_responsibilities(y, **p), gm.predict_proba(y), atol=1e-6)


def test_gmm_stats_consistent(gmm_data):
    y, m0 = gmm_data
    p0 = dict(weights=np.array([0.2, 0.3, 0.5]), means=m0.copy(), covs=np.stack([np.eye(2)] * 3))
    new, st = gmm_em_step(y, **p0)
    r = gmm_responsibilities(y, **p0)
    np.testing.assert_allclose(r.sum(axis=1), 1.0, atol=1e-14)
    np.testing.assert_allclose(st["N"].sum(), len(y), rtol=1e-13)
    k = 1
    np.testing.assert_allclose(st["S2"][k], (r[:, k, None] * y).T @ y, rtol=1e-12)
    np.testing.assert_allclose(new["covs"][k], np.cov(y.T, aweights=r[:, k], bias=True), atol=1e-12)


def test_gmm_diag_matches_sklearn(gmm_data):
    y, m0 = gmm_data
    p0 = dict(weights=np.full(3, 1 / 3), means=m0.copy(), sds=np.ones((3, 2)))
    p, its = run_em(functools.partial(gmm_diag_em_step, y), p0, 2000, tol=1e-13)
    assert len(its) < 2001
    gm = _sklearn_gmm(y, "diag", p0["weights"], p0["means"], 1 / p0["sds"] ** 2)
    assert gm.converged_
    np.testing.assert_allclose(p["weights"], gm.weights_, atol=1e-6)
    np.testing.assert_allclose(p["means"], gm.means_, atol=1e-6)
    np.testing.assert_allclose(p["sds"] ** 2, gm.covariances_, atol=1e-6)
    covs = lambda q: dict(weights=q["weights"], means=q["means"], covs=np.stack([np.diag(s**2) for s in q["sds"]]))
    assert_monotone([gmm_loglik(y, **covs(q)) for q in its])


def test_mlr_monotone():
    rng = np.random.default_rng(1)
    n = 400
    x = np.column_stack([np.ones(n), rng.normal(size=n)])
    first = rng.random(n) < 0.4
    y = np.where(first, x @ [1.0, 2.0] + 0.5 * rng.normal(size=n), x @ [-1.0, -1.0] + rng.normal(size=n))
    p0 = dict(weights=np.array([0.5, 0.5]), coefs=np.array([[0.0, 1.0], [0.0, -0.5]]), sigmas=np.ones(2))
    p, its = run_em(functools.partial(mlr_em_step, x, y), p0, 500)
    assert_monotone([mlr_loglik(x, y, **q) for q in its])
    np.testing.assert_allclose(p["coefs"], [[1.0, 2.0], [-1.0, -1.0]], atol=0.2)
    # The sigma update equals the weighted residual variance at the new coefficients.
    lj = np.log(its[-2]["weights"]) - 0.5 * ((y[:, None] - x @ its[-2]["coefs"].T) / its[-2]["sigmas"]) ** 2 \
        - np.log(its[-2]["sigmas"])
    resp = np.exp(lj - lj.max(axis=1, keepdims=True))
    resp /= resp.sum(axis=1, keepdims=True)
    s2 = np.sum(resp * (y[:, None] - x @ p["coefs"].T) ** 2, axis=0) / resp.sum(axis=0)
    np.testing.assert_allclose(p["sigmas"] ** 2, s2, rtol=1e-10)


def test_ppca_matches_tipping_bishop():
    rng = np.random.default_rng(1)
    n, D, q = 500, 5, 2
    W_true = rng.normal(size=(D, q)) * np.array([3.0, 1.5])
    y = rng.normal(size=(n, q)) @ W_true.T + np.array([1.0, -2.0, 0.0, 0.5, 3.0]) + 0.5 * rng.normal(size=(n, D))
    p0 = dict(W=rng.normal(size=(D, q)), mu=np.zeros(D), sigma=1.0)
    p, its = run_em(functools.partial(ppca_em_step, y), p0, 5000, tol=1e-13)
    assert len(its) < 5001
    assert_monotone([ppca_loglik(y, **a) for a in its])

    lam, U = np.linalg.eigh(np.cov(y.T, bias=True))  # ML (1/N) sample covariance
    lam, U = lam[::-1], U[:, ::-1]
    s2 = lam[q:].mean()
    C_ml = U[:, :q] @ np.diag(lam[:q] - s2) @ U[:, :q].T + s2 * np.eye(D)
    np.testing.assert_allclose(p["W"] @ p["W"].T + p["sigma"] ** 2 * np.eye(D), C_ml, atol=1e-6)
    np.testing.assert_allclose(p["sigma"] ** 2, s2, atol=1e-6)
    np.testing.assert_allclose(p["mu"], y.mean(axis=0), atol=1e-6)


@pytest.fixture(scope="module")
def lme_data():
    rng = np.random.default_rng(2)
    beta, cov_b, sigma = np.array([1.0, -0.5]), np.array([[1.0, 0.3], [0.3, 0.5]]), 0.7
    clients = []
    for _ in range(30):
        n = int(rng.integers(5, 21))
        t = np.sort(rng.uniform(0.0, 2.0, n))
        X = np.column_stack([np.ones(n), t])
        b = rng.multivariate_normal(np.zeros(2), cov_b)
        clients.append((X, X.copy(), X @ beta + X @ b + sigma * rng.normal(size=n)))
    return clients


def test_lme_matches_statsmodels(lme_data):
    clients = lme_data
    p0 = dict(beta=np.zeros(2), cov_b=np.eye(2), sigma=1.0)
    p, its = run_em(functools.partial(lme_em_step, clients), p0, 3000, tol=1e-12)
    assert len(its) < 3001
    ll = [lme_loglik(clients, **q) for q in its]
    assert_monotone(ll)

    X = np.vstack([c[0] for c in clients])
    y = np.concatenate([c[2] for c in clients])
    groups = np.concatenate([np.full(len(c[2]), i) for i, c in enumerate(clients)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # ML (not REML); statsmodels' default lbfgs tolerance leaves ~1e-4 error on cov_re, so
        # use BFGS with a tight gradient tolerance (then agreement is ~1e-10).
        res = MixedLM(y, X, groups, exog_re=X).fit(reml=False, method="bfgs", maxiter=2000, gtol=1e-10)
    assert res.converged
    np.testing.assert_allclose(p["beta"], res.fe_params, atol=1e-6)
    np.testing.assert_allclose(p["cov_b"], res.cov_re, atol=1e-6)  # cov_re is on the data scale
    np.testing.assert_allclose(p["sigma"] ** 2, res.scale, atol=1e-6)
    np.testing.assert_allclose(ll[-1], res.llf, atol=1e-5)
    # At the fixed point beta is the GLS estimate under the fitted marginal covariance.
    Sig = [Z @ p["cov_b"] @ Z.T + p["sigma"] ** 2 * np.eye(len(yi)) for _, Z, yi in clients]
    A = sum(Xi.T @ np.linalg.solve(S, Xi) for (Xi, _, _), S in zip(clients, Sig))
    c = sum(Xi.T @ np.linalg.solve(S, yi) for (Xi, _, yi), S in zip(clients, Sig))
    np.testing.assert_allclose(p["beta"], np.linalg.solve(A, c), atol=1e-8)


def test_lme_posterior_and_mstep(lme_data):
    """E-step moments equal the Gaussian conditional of b_i given y_i (via the marginal covariance)."""
    clients = lme_data
    params = dict(beta=np.array([0.8, -0.3]), cov_b=np.array([[0.7, 0.2], [0.2, 0.6]]), sigma=0.6)
    _, st = lme_em_step(clients, **params)
    X, Z, y = clients[3]
    G, s2 = params["cov_b"], params["sigma"] ** 2
    Sigma = Z @ G @ Z.T + s2 * np.eye(len(y))
    np.testing.assert_allclose(st["m"][3], G @ Z.T @ np.linalg.solve(Sigma, y - X @ params["beta"]), atol=1e-12)
    np.testing.assert_allclose(st["V"][3], G - G @ Z.T @ np.linalg.solve(Sigma, Z @ G), atol=1e-12)
