"""Calibration, out-of-distribution and posterior-quality diagnostics (plain numpy, any source).

Every function takes arrays (predictive probabilities, predictive draws, sample sets), so it works
on a ``fed_fit`` result's predictions, on ArviZ data, or on anything else.

Calibration (classification). ``probs`` is (N, K) class probabilities (a 1-d array is read as the
probability of class 1 of a binary problem), ``labels`` is (N,) integer classes. The top-label
reliability of a prediction is its confidence ``max_k p_k`` against whether ``argmax_k p_k`` was
right. With bins B_b (equal-width, or equal-mass: quantiles of the confidences) and n_b points each,

    ECE = sum_b (n_b / N) |acc_b - conf_b|,     MCE = max_{b: n_b > 0} |acc_b - conf_b|.

A point on a bin edge belongs to the lower bin (bins are (e_{b-1}, e_b]). Classwise ECE averages over
classes k the ECE of the one-vs-rest probabilities p_k against 1[y = k].

OOD scores from S posterior draws of the class probabilities, ``draws`` (S, N, K):
predictive entropy H[mean_s p_s], expected entropy mean_s H[p_s], and their difference, the mutual
information between the label and the parameters (the epistemic part).

Posterior quality: 2-Wasserstein and KL between Gaussian fits, sliced 2-Wasserstein and MMD between
sample sets, and mean / sd errors in units of the reference sd.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import ConfigError, DataError

# ------------------------------------------------------------------------------------- inputs


def _as_probs(probs: Any, labels: Any | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim == 1:
        p = np.stack([1.0 - p, p], axis=1)
    if p.ndim != 2 or p.shape[1] < 2:
        raise DataError(f"probs must be (N, K) class probabilities with K >= 2 or (N,) for binary, got {np.shape(probs)}")
    if not np.all(np.isfinite(p)) or np.any(p < 0) or np.any(p > 1 + 1e-9):
        raise DataError("probs must be finite probabilities in [0, 1]")
    if np.any(np.abs(p.sum(1) - 1) > 1e-6):
        raise DataError("each row of probs must sum to 1")
    if labels is None:
        return p, None
    y = np.asarray(labels)
    if y.shape != (p.shape[0],):
        raise DataError(f"labels must have shape ({p.shape[0]},), got {y.shape}")
    if not np.issubdtype(y.dtype, np.integer):
        if not np.all(y == np.round(y)):
            raise DataError("labels must be integer classes")
        y = y.astype(np.int64)
    if y.min(initial=0) < 0 or y.max(initial=0) >= p.shape[1]:
        raise DataError(f"labels must lie in 0 .. {p.shape[1] - 1}")
    return p, y


def _check_bins(n_bins: int, strategy: str) -> None:
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 2:
        raise ConfigError(f"n_bins must be an integer >= 2 (one bin hides all miscalibration), got {n_bins!r}")
    if strategy not in ("uniform", "quantile"):
        raise ConfigError(f"strategy must be 'uniform' (equal width) or 'quantile' (equal mass), got {strategy!r}")


# --------------------------------------------------------------------------------- calibration


def reliability(confidence: Any, correct: Any, n_bins: int = 15, strategy: str = "uniform") -> dict[str, np.ndarray]:
    """Binned reliability of scores ``confidence`` in [0, 1] against outcomes ``correct`` in {0, 1}.

    Returns ``edges`` (n_bins + 1), and per bin ``count``, ``confidence`` (mean score) and
    ``accuracy`` (mean outcome); empty bins have NaN means. The data of a reliability diagram.
    """
    _check_bins(n_bins, strategy)
    conf = np.asarray(confidence, dtype=np.float64).ravel()
    hit = np.asarray(correct, dtype=np.float64).ravel()
    if conf.shape != hit.shape or conf.size == 0:
        raise DataError("confidence and correct must be non-empty and of the same length")
    if strategy == "uniform":
        edges = np.linspace(0.0, 1.0, n_bins + 1)
    else:
        edges = np.percentile(conf, np.linspace(0.0, 100.0, n_bins + 1))
    idx = np.searchsorted(edges[1:-1], conf)  # bins (e_{b-1}, e_b]
    count = np.bincount(idx, minlength=n_bins).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.bincount(idx, weights=conf, minlength=n_bins) / count
        acc = np.bincount(idx, weights=hit, minlength=n_bins) / count
    return {"edges": edges, "count": count, "confidence": mean_conf, "accuracy": acc}


def _top_label(probs, labels):
    p, y = _as_probs(probs, labels)
    return p.max(1), (p.argmax(1) == y).astype(np.float64)


def _ece_from(rel: dict[str, np.ndarray]) -> float:
    nz = rel["count"] > 0
    return float(np.sum(rel["count"][nz] * np.abs(rel["accuracy"][nz] - rel["confidence"][nz])) / rel["count"].sum())


def reliability_diagram(probs: Any, labels: Any, n_bins: int = 15, strategy: str = "uniform") -> dict[str, np.ndarray]:
    """Top-label reliability data (see :func:`reliability`) of class probabilities against labels."""
    return reliability(*_top_label(probs, labels), n_bins, strategy)


def expected_calibration_error(probs: Any, labels: Any, n_bins: int = 15, strategy: str = "uniform") -> float:
    """Top-label ECE = sum_b (n_b / N) |acc_b - conf_b| (default 15 equal-width bins)."""
    return _ece_from(reliability_diagram(probs, labels, n_bins, strategy))


def maximum_calibration_error(probs: Any, labels: Any, n_bins: int = 15, strategy: str = "uniform") -> float:
    """Top-label MCE = max over non-empty bins of |acc_b - conf_b|."""
    rel = reliability_diagram(probs, labels, n_bins, strategy)
    nz = rel["count"] > 0
    return float(np.max(np.abs(rel["accuracy"][nz] - rel["confidence"][nz])))


def classwise_ece(probs: Any, labels: Any, n_bins: int = 15, strategy: str = "uniform") -> float:
    """Mean over classes k of the ECE of p_k against 1[y = k] (one-vs-rest reliability)."""
    p, y = _as_probs(probs, labels)
    return float(np.mean([_ece_from(reliability(p[:, k], y == k, n_bins, strategy)) for k in range(p.shape[1])]))


def brier_score(probs: Any, labels: Any) -> float:
    """Mean squared error of the probabilities: binary (1-d ``probs``) (p - y)^2, the usual binary
    score; multiclass sum_k (p_k - 1[y = k])^2 (twice the binary score on two-column input)."""
    binary = np.ndim(probs) == 1
    p, y = _as_probs(probs, labels)
    if binary:
        return float(np.mean((p[:, 1] - y) ** 2))
    onehot = np.eye(p.shape[1])[y]
    return float(np.mean(np.sum((p - onehot) ** 2, axis=1)))


def negative_log_predictive_density(probs: Any, labels: Any, eps: float = 1e-15) -> float:
    """NLPD = -(1/N) sum_n log p(y_n), with probabilities clipped to [eps, 1] (a zero would be +inf)."""
    p, y = _as_probs(probs, labels)
    return float(-np.mean(np.log(np.clip(p[np.arange(len(y)), y], eps, 1.0))))


def accuracy_vs_confidence(probs: Any, labels: Any, thresholds: Any | None = None) -> dict[str, np.ndarray]:
    """Accuracy among the predictions with confidence >= t, and the fraction of them kept, per threshold t
    (default 0, 0.05, ..., 0.95). A calibrated, useful model's accuracy rises with t."""
    conf, hit = _top_label(probs, labels)
    t = np.arange(0.0, 1.0, 0.05) if thresholds is None else np.asarray(thresholds, dtype=np.float64)
    keep = conf[None, :] >= t[:, None]
    n = keep.sum(1)
    with np.errstate(invalid="ignore", divide="ignore"):
        acc = (keep * hit[None, :]).sum(1) / n
    return {"threshold": t, "accuracy": acc, "fraction": n / conf.size}


# ---------------------------------------------------------------------------------- regression


def interval_coverage(draws: Any, y: Any, levels: Any = (0.5, 0.8, 0.9, 0.95)) -> dict[float, float]:
    """Fraction of observations inside the central predictive interval of each level.

    ``draws`` is (S, N) predictive draws (or (chain, draw, N), flattened over the leading axes);
    the interval of level a runs between the (1 - a)/2 and (1 + a)/2 quantiles of the draws.
    """
    d, obs = _draws_and_obs(draws, y)
    out = {}
    for a in np.atleast_1d(np.asarray(levels, dtype=np.float64)):
        if not 0 < a < 1:
            raise ConfigError(f"levels must lie in (0, 1), got {a}")
        lo, hi = np.quantile(d, [(1 - a) / 2, (1 + a) / 2], axis=0)
        out[float(a)] = float(np.mean((obs >= lo) & (obs <= hi)))
    return out


def pit(draws: Any, y: Any, seed: int = 0) -> np.ndarray:
    """Probability integral transform: the predictive CDF at each observation, (#{d < y} + U #{d = y}) / S
    with U ~ Uniform(0, 1) breaking ties (discrete predictives). Uniform on [0, 1] when calibrated."""
    d, obs = _draws_and_obs(draws, y)
    below = np.mean(d < obs, axis=0)
    ties = np.mean(d == obs, axis=0)
    return below + np.random.default_rng(seed).uniform(size=obs.shape) * ties


def _draws_and_obs(draws, y):
    obs = np.asarray(y, dtype=np.float64).ravel()
    d = np.asarray(draws, dtype=np.float64)
    if obs.size == 0 or d.ndim < 2 or d.shape[-1] != obs.size or d.size // obs.size < 2:
        raise DataError(f"draws must be (S, N) predictive draws with S >= 2 for N = {obs.size} observations, "
                        f"got {d.shape}")
    return d.reshape(-1, obs.size), obs


# ------------------------------------------------------------------------------------------ OOD


def _entropy(p: np.ndarray) -> np.ndarray:
    return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=-1)


def _check_draws(draws: Any) -> np.ndarray:
    d = np.asarray(draws, dtype=np.float64)
    if d.ndim == 2:
        d = d[None]
    if d.ndim != 3 or d.shape[-1] < 2:
        raise DataError(f"draws must be (S, N, K) posterior draws of class probabilities, got {np.shape(draws)}")
    return d


def predictive_entropy(draws: Any) -> np.ndarray:
    """H[mean_s p_s] per input (total uncertainty), from (S, N, K) draws or (N, K) probabilities."""
    return _entropy(_check_draws(draws).mean(0))


def expected_entropy(draws: Any) -> np.ndarray:
    """mean_s H[p_s] per input (aleatoric part)."""
    return _entropy(_check_draws(draws)).mean(0)


def mutual_information(draws: Any) -> np.ndarray:
    """I(y; theta | x) = H[mean p] - mean H[p] >= 0 per input (epistemic part: disagreement of draws)."""
    d = _check_draws(draws)
    return np.maximum(_entropy(d.mean(0)) - _entropy(d).mean(0), 0.0)


def max_probability(draws: Any) -> np.ndarray:
    """max_k of the posterior-mean class probabilities per input (low = uncertain)."""
    return _check_draws(draws).mean(0).max(-1)


def ood_auroc(scores_in: Any, scores_out: Any) -> float:
    """Area under the ROC curve of telling OOD from in-distribution inputs by a score that is larger
    for OOD inputs (entropy, mutual information; use -max_probability): P(s_out > s_in) + P(tie) / 2."""
    a = np.asarray(scores_in, dtype=np.float64).ravel()
    b = np.asarray(scores_out, dtype=np.float64).ravel()
    if a.size == 0 or b.size == 0 or not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise DataError("scores_in and scores_out must be non-empty and finite")
    both = np.concatenate([a, b])
    ranks = _average_ranks(both)
    return float((ranks[a.size:].sum() - b.size * (b.size + 1) / 2) / (a.size * b.size))  # Mann-Whitney U


def _average_ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(x.size)
    ranks[order] = np.arange(1, x.size + 1)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    return sums[inv] / counts[inv]


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


__all__ = [
    "reliability", "reliability_diagram", "expected_calibration_error", "maximum_calibration_error",
    "classwise_ece", "brier_score", "negative_log_predictive_density", "accuracy_vs_confidence",
    "interval_coverage", "pit", "predictive_entropy", "expected_entropy", "mutual_information",
    "max_probability", "ood_auroc", "gaussian_w2", "gaussian_kl", "gaussian_fit", "mmd",
    "sliced_wasserstein", "moment_errors",
]
