"""Posterior quality against a reference posterior.

2-Wasserstein and KL between Gaussian fits (closed forms), sliced 2-Wasserstein and MMD between
sample sets, mean / sd errors in units of the reference sd, and ``compare_to_reference``: all of
them for every global site of a fit against reference draws (e.g. ``fb.reference.nuts`` on pooled
data) in one table.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import DataError


# ------------------------------------------------------------------------------ posterior quality


def _mean_cov(m: Any, c: Any) -> tuple[np.ndarray, np.ndarray]:
    m = np.atleast_1d(np.asarray(m, dtype=np.float64))
    c = np.atleast_2d(np.asarray(c, dtype=np.float64))
    if c.shape != (m.size, m.size):
        raise DataError(f"covariance must be ({m.size}, {m.size}), got {c.shape}")
    return m, c


def _sqrtm_psd(a: np.ndarray) -> np.ndarray:
    w, v = np.linalg.eigh((a + a.T) / 2)
    return (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T


def gaussian_w2(mean1: Any, cov1: Any, mean2: Any, cov2: Any) -> float:
    """2-Wasserstein distance between N(m1, C1) and N(m2, C2):
    W2^2 = |m1 - m2|^2 + tr(C1 + C2 - 2 (C2^{1/2} C1 C2^{1/2})^{1/2})."""
    m1, c1 = _mean_cov(mean1, cov1)
    m2, c2 = _mean_cov(mean2, cov2)
    r2 = _sqrtm_psd(c2)
    cross = _sqrtm_psd(r2 @ c1 @ r2)
    w2sq = np.sum((m1 - m2) ** 2) + np.trace(c1) + np.trace(c2) - 2 * np.trace(cross)
    return float(np.sqrt(max(w2sq, 0.0)))


def gaussian_kl(mean1: Any, cov1: Any, mean2: Any, cov2: Any) -> float:
    """KL(N(m1, C1) || N(m2, C2)) = (tr(C2^-1 C1) + (m2-m1)' C2^-1 (m2-m1) - d + log det C2 - log det C1) / 2."""
    m1, c1 = _mean_cov(mean1, cov1)
    m2, c2 = _mean_cov(mean2, cov2)
    l2 = np.linalg.cholesky(c2)
    a = np.linalg.solve(l2, c1)
    a = np.linalg.solve(l2, a.T)  # L2^-1 C1 L2^-T (C1 symmetric)
    diff = np.linalg.solve(l2, m2 - m1)
    logdet = 2 * np.sum(np.log(np.diag(l2))) - np.linalg.slogdet(c1)[1]
    return float(0.5 * (np.trace(a) + diff @ diff - m1.size + logdet))


def gaussian_fit(samples: Any) -> tuple[np.ndarray, np.ndarray]:
    """Mean and covariance of (S, d) samples (a 1-d array is S draws of a scalar)."""
    x = _samples(samples)
    return x.mean(0), np.atleast_2d(np.cov(x, rowvar=False))


def _samples(x: Any) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    x = x[:, None] if x.ndim == 1 else x.reshape(x.shape[0], -1)
    if x.shape[0] < 2 or not np.all(np.isfinite(x)):
        raise DataError("samples must be finite, with at least 2 draws (rows)")
    return x


def mmd(x: Any, y: Any, bandwidth: float | None = None) -> float:
    """Maximum mean discrepancy with a Gaussian kernel k(a, b) = exp(-|a - b|^2 / (2 h^2)): the
    V-statistic sqrt(mean k(x, x') + mean k(y, y') - 2 mean k(x, y)), exactly 0 for identical sets.
    h defaults to the median pairwise distance of the pooled samples (the median heuristic)."""
    a, b = _samples(x), _samples(y)
    if a.shape[1] != b.shape[1]:
        raise DataError(f"sample sets have different dimensions {a.shape[1]} and {b.shape[1]}")
    z = np.concatenate([a, b])
    sq = np.sum(z**2, 1)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2 * z @ z.T, 0.0)
    if bandwidth is None:
        off = d2[np.triu_indices(len(z), 1)]
        bandwidth = float(np.sqrt(np.median(off))) if np.any(off > 0) else 1.0
    k = np.exp(-d2 / (2 * bandwidth**2))
    n = len(a)
    val = k[:n, :n].mean() + k[n:, n:].mean() - 2 * k[:n, n:].mean()
    return float(np.sqrt(max(val, 0.0)))


def sliced_wasserstein(x: Any, y: Any, num_projections: int = 200, seed: int = 0) -> float:
    """Sliced 2-Wasserstein distance: sqrt of the mean over random unit directions u of W2^2 between the
    projected samples u'x and u'y (1-d W2 from matched quantiles; sets of different sizes are compared
    at the quantiles of the larger one)."""
    a, b = _samples(x), _samples(y)
    if a.shape[1] != b.shape[1]:
        raise DataError(f"sample sets have different dimensions {a.shape[1]} and {b.shape[1]}")
    u = np.random.default_rng(seed).normal(size=(a.shape[1], num_projections))
    u /= np.linalg.norm(u, axis=0)
    pa, pb = np.sort(a @ u, axis=0), np.sort(b @ u, axis=0)
    m = max(len(pa), len(pb))
    q = (np.arange(m) + 0.5) / m
    qa = np.stack([np.quantile(pa[:, j], q) for j in range(num_projections)], 1) if len(pa) != m else pa
    qb = np.stack([np.quantile(pb[:, j], q) for j in range(num_projections)], 1) if len(pb) != m else pb
    return float(np.sqrt(np.mean((qa - qb) ** 2)))


def moment_errors(samples: Any, reference: Any) -> dict[str, np.ndarray]:
    """Per coordinate: (mean - ref mean) / ref sd and (sd - ref sd) / ref sd."""
    a, b = _samples(samples), _samples(reference)
    if a.shape[1] != b.shape[1]:
        raise DataError(f"sample sets have different dimensions {a.shape[1]} and {b.shape[1]}")
    sd = b.std(0, ddof=1)
    return {"mean": (a.mean(0) - b.mean(0)) / sd, "sd": (a.std(0, ddof=1) - sd) / sd}


# ------------------------------------------------------------------------------- against a reference


def _draw_sets(obj: Any) -> dict[str, tuple[np.ndarray, bool]]:
    """``{site: (draws, is_local)}``: globals (S, ...) and locals (S, C, ...), constrained, chains pooled.
    A fit whose globals are a point estimate gives them as one draw (S = 1)."""
    from ..arviz_adapter import group
    from ..result import Result

    out: dict[str, tuple[np.ndarray, bool]] = {}
    if isinstance(obj, Result):
        glob = obj.global_samples or obj.global_approx
        for k, v in glob.items():
            out[k] = (v.reshape((-1,) + v.shape[2:]), False)
        if not glob:
            out.update({k: (v[None], False) for k, v in obj.params.items()})
        out.update({k: (np.moveaxis(v, 0, 1), True) for k, v in obj.local_samples.items()})
        return out
    post = group(obj, "posterior")
    for k, da in post.data_vars.items():
        if da.dims[:2] != ("chain", "draw"):
            continue
        v = np.asarray(da.values)
        out[str(k)] = (v.reshape((-1,) + v.shape[2:]), "client" in da.dims)
        if "client" in da.dims and da.dims.index("client") != 2:
            raise DataError(f"posterior variable '{k}' must have dims (chain, draw, client, ...)")
    return out


def _metrics(a: np.ndarray, b: np.ndarray, max_draws: int, seed: int) -> dict[str, float]:
    """Fit draws a (S, d) against reference draws b (R, d)."""
    sd = b.std(0, ddof=1)
    row = {"mean_err": float(np.max(np.abs(a.mean(0) - b.mean(0)) / sd))}
    nan = float("nan")
    if len(a) < 2:  # a point estimate: only its position is comparable
        return {**row, "sd_err": nan, "w2_gauss": nan, "kl_gauss": nan, "sliced_w2": nan, "mmd": nan}
    row["sd_err"] = float(np.max(np.abs(a.std(0, ddof=1) - sd) / sd))
    (ma, ca), (mb, cb) = gaussian_fit(a), gaussian_fit(b)
    jitter = 1e-10 * np.eye(len(ma)) * max(np.trace(cb) / len(ma), 1e-300)
    row["w2_gauss"] = gaussian_w2(ma, ca, mb, cb)
    try:
        row["kl_gauss"] = gaussian_kl(ma, ca + jitter, mb, cb + jitter)
    except np.linalg.LinAlgError:
        row["kl_gauss"] = nan
    row["sliced_w2"] = sliced_wasserstein(a, b, seed=seed)
    rng = np.random.default_rng(seed)
    sub = lambda x: x[rng.choice(len(x), max_draws, replace=False)] if len(x) > max_draws else x  # noqa: E731
    row["mmd"] = mmd(sub(a), sub(b))
    return row


def compare_to_reference(
    fit: Any, reference: Any, *, var_names: Any = None, max_draws: int = 1000, seed: int = 0
) -> Any:
    """One table (pandas DataFrame, a row per site) of a fit's posterior against reference draws.

    ``fit`` is a ``fed_fit`` result or ArviZ data; ``reference`` ArviZ data such as
    ``fb.reference.nuts(model, data)``. Columns: ``mean_err`` and ``sd_err`` (largest absolute error of
    the marginal means and sds over the site's coordinates, in reference sds), ``w2_gauss`` and
    ``kl_gauss`` (2-Wasserstein and KL(fit || reference) between Gaussian fits), ``sliced_w2`` and
    ``mmd`` (sample-based, MMD on at most ``max_draws`` draws per side). Local sites are compared client
    by client; their row holds the mean over clients (``mean_err`` / ``sd_err``: the largest). A site
    whose fit is a point estimate (e.g. FedSOUL's theta*) gets ``mean_err`` only.
    """
    import pandas as pd

    a_sets, b_sets = _draw_sets(fit), _draw_sets(reference)
    names = [n for n in a_sets if n in b_sets] if var_names is None else list(np.atleast_1d(var_names))
    missing = [n for n in names if n not in a_sets or n not in b_sets]
    if missing or not names:
        raise DataError(
            f"sites {missing or '(none in common)'} are not in both the fit ({sorted(a_sets)}) "
            f"and the reference ({sorted(b_sets)})"
        )
    rows = []
    for n in names:
        (a, a_local), (b, b_local) = a_sets[n], b_sets[n]
        if a_local != b_local or a.shape[1:] != b.shape[1:]:
            raise DataError(f"site '{n}' has shape {a.shape[1:]} in the fit and {b.shape[1:]} in the reference")
        if not a_local:
            rows.append(
                {"site": n, "clients": 0, **_metrics(a.reshape(len(a), -1), b.reshape(len(b), -1), max_draws, seed)}
            )
            continue
        per = [
            _metrics(a[:, i].reshape(len(a), -1), b[:, i].reshape(len(b), -1), max_draws, seed)
            for i in range(a.shape[1])
        ]
        row = {k: float(np.mean([p[k] for p in per])) for k in per[0]}
        row.update(mean_err=max(p["mean_err"] for p in per), sd_err=max(p["sd_err"] for p in per))
        rows.append({"site": n, "clients": a.shape[1], **row})
    return pd.DataFrame(rows).set_index("site")


def loo_per_client(data: Any) -> Any:
    """PSIS-LOO (``az.loo``) of each client's observations: a DataFrame with ``n`` (observations),
    ``elpd_loo``, ``se``, ``p_loo`` and ``max_pareto_k`` per client (k > 0.7: unreliable for that client).

    ``data`` is a result (its ``idata`` has the group by default where the fit has a posterior; an EM
    fit's after ``res.extend_idata()``) or ArviZ data whose ``log_likelihood`` group has an ``obs`` dim
    with a ``client`` coordinate. Each client's LOO uses its own posterior draws (an EM fit's: the
    independent draws of its normal approximation, ``fed_normal_approx``).
    """
    import pandas as pd

    from ..arviz_adapter import group, loo_summary, to_arviz
    from ..result import NORMAL_APPROX, Result

    idata = data.idata if isinstance(data, Result) else data
    try:
        ll = group(idata, "log_likelihood")
    except (KeyError, AttributeError):
        raise DataError(
            "no log_likelihood group: the fit has no posterior draws to evaluate it at by default "
            "(an EM fit: call res.extend_idata() first; a point estimate has none)"
        ) from None
    try:
        post = group(idata, "posterior")
    except (KeyError, AttributeError):
        post = group(idata, NORMAL_APPROX)
    clients = np.asarray(ll["client"].values)
    rows = []
    for c in np.unique(clients):
        sub_post = post.sel(client=c) if "client" in post.dims else post
        sub = to_arviz({"posterior": sub_post, "log_likelihood": ll.isel(obs=np.flatnonzero(clients == c))})
        name = c.item() if isinstance(c, np.generic) else c  # the client's name (an int by default)
        rows.append({"client": name, "n": int(np.sum(clients == c)), **loo_summary(sub)})
    return pd.DataFrame(rows).set_index("client")
