"""Exact references for the linear mixed model: closed-form marginal likelihood and its optimum."""

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize as so


def marginal_loglik(params, data):
    """sum_i log N(y_i; X_i beta, Z_i L L^T Z_i^T + sigma^2 I) from constrained params.

    Vectorised over the padded clients: padded rows get zero design, zero residual and unit
    variance, so they add exactly 0 to the log-determinant and the quadratic form.
    """
    beta, L, s = params["beta"], params["scale_tril"], params["sigma"]

    def one(x, z, y, m):
        mf = m.astype(y.dtype)
        Zm, r = z * mf[:, None], (y - x @ beta) * mf
        V = Zm @ L @ L.T @ Zm.T + jnp.diag(s**2 * mf + (1 - mf))
        return -0.5 * (jnp.linalg.slogdet(V)[1] + r @ jnp.linalg.solve(V, r) + jnp.sum(mf) * jnp.log(2 * jnp.pi))

    p = data.padded
    return jnp.sum(jax.vmap(one)(p["x"], p["z"], p["y"], data.mask))


def _unpack(u):
    L = jnp.array([[jnp.exp(u[2]), 0.0], [u[3], jnp.exp(u[4])]])
    return {"beta": u[:2], "scale_tril": L, "sigma": jnp.exp(u[5])}


def mml(data):
    """Maximum marginal likelihood estimates (BFGS on the closed form) and their standard errors."""
    f = jax.jit(jax.value_and_grad(lambda u: -marginal_loglik(_unpack(u), data)))
    opt = so.minimize(lambda u: [np.asarray(a) for a in f(jnp.asarray(u))], np.zeros(6), jac=True,
                      method="BFGS", options={"gtol": 1e-9})
    u = jnp.asarray(opt.x)
    params = {k: np.asarray(v) for k, v in _unpack(u).items()}
    hess = jax.hessian(lambda b: -marginal_loglik({**_unpack(u), "beta": b}, data))(u[:2])
    params["beta_se"] = np.sqrt(np.diag(np.linalg.inv(np.asarray(hess))))
    return params


def local_posterior(params, client):
    """Exact Gaussian posterior N(m, S) of the random effects b given one client's data."""
    X, Z, y = (np.asarray(client[k]) for k in ("x", "z", "y"))
    L, s = np.asarray(params["scale_tril"]), float(params["sigma"])
    prec = Z.T @ Z / s**2 + np.linalg.inv(L @ L.T)
    S = np.linalg.inv(prec)
    return S @ Z.T @ (y - X @ np.asarray(params["beta"])) / s**2, S


def component_standard_errors(data, beta, components) -> np.ndarray:
    """Standard errors of (beta, sd_0, sd_1, corr, sigma) from the exact Hessian of the closed-form marginal
    likelihood taken in those coordinates themselves (no delta method: at the maximum the inverse observed
    information transforms as a covariance), for one 2 x 2 correlated block; ``components`` is
    (sd_0, sd_1, corr, sigma) at the maximum."""
    p = len(beta)

    def params(v):
        s0, s1, r, sigma = v[p], v[p + 1], v[p + 2], v[p + 3]
        L = jnp.array([[s0, 0.0], [r * s1, s1 * jnp.sqrt(1 - r**2)]])
        return {"beta": v[:p], "scale_tril": L, "sigma": sigma}

    v = jnp.concatenate([jnp.asarray(beta, float), jnp.asarray(components, float)])
    hess = jax.hessian(lambda v: marginal_loglik(params(v), data))(v)
    return np.sqrt(np.diag(np.linalg.inv(-np.asarray(hess))))
