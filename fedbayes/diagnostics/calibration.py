"""Calibration of predictive distributions (plain numpy, any source).

Every function takes arrays (predictive probabilities, predictive draws), so it works on a
``fed_fit`` result's predictions, on ArviZ data, or on anything else.

Classification. ``probs`` is (N, K) class probabilities (a 1-d array is read as the probability of
class 1 of a binary problem), ``labels`` is (N,) integer classes. The top-label reliability of a
prediction is its confidence ``max_k p_k`` against whether ``argmax_k p_k`` was right. With bins B_b
(equal-width, or equal-mass: quantiles of the confidences) and n_b points each,

    ECE = sum_b (n_b / N) |acc_b - conf_b|,     MCE = max_{b: n_b > 0} |acc_b - conf_b|.

A point on a bin edge belongs to the lower bin (bins are (e_{b-1}, e_b]). Classwise ECE averages over
classes k the ECE of the one-vs-rest probabilities p_k against 1[y = k]. The PAV (CORP) reliability
curve replaces the bins by the isotonic regression of the outcomes on the scores (Dimitriadis,
Gneiting & Jordan 2021): no binning choice at all.

Regression. ``draws`` (S, N) posterior predictive draws against ``y`` (N,): coverage of central
credible intervals and probability integral transform (PIT) values.
"""

from __future__ import annotations

from typing import Any, overload

import numpy as np

from ..errors import ConfigError, DataError

# ------------------------------------------------------------------------------------- inputs


SUM_ULPS = 64
"""Rounding allowance of a probability row, in its float type's epsilons per class (:func:`sum_tolerance`)."""


def sum_tolerance(dtype: Any, num_classes: int) -> float:
    """How far from 1 a row of ``num_classes`` probabilities of float type ``dtype`` may sum: rounding, not an error.

    ``max(1e-6, SUM_ULPS * num_classes * eps(dtype))``. Each probability computed in a float type carries a
    relative error of a few ``eps`` (``exp`` of a log-probability, a softmax), and averaging S draws
    (``probs.mean(0)``, the documentation's recipe: a running sum along axis 0) adds error growing like
    ``sqrt(S) eps`` in practice (up to ``S eps``); a row sums K such errors. Measured on float32 softmax
    draws (S = 4000, K = 10) a row misses 1 by up to 1.1 eps per class, above the former fixed 1e-6 (8.4
    float32 eps in all): 64 eps per class leaves a wide margin while a row that misses 1 by a real amount
    is still refused: float32 (eps 1.2e-7) allows 1.5e-5 for 2 classes and 1.5e-4 for 20; float64 keeps the
    former 1e-6 as a floor (its eps term is ~1e-14 per class; the floor keeps accepting what was accepted
    before). Float32 results cast up to float64 are checked as float64: pass them in their own type.
    Float16 allows 0.125 for 2 classes (its eps is 1e-3). Integer or boolean input (one-hot rows)
    is checked as float64.
    """
    dt = np.dtype(dtype)
    eps = np.finfo(dt).eps if np.issubdtype(dt, np.floating) else np.finfo(np.float64).eps
    return max(1e-6, SUM_ULPS * int(num_classes) * float(eps))


@overload
def _as_probs(probs: Any, labels: None = None) -> tuple[np.ndarray, None]: ...
@overload
def _as_probs(probs: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]: ...
def _as_probs(probs: Any, labels: Any | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    raw = np.asarray(probs)
    p = raw.astype(np.float64)
    if p.ndim == 1:
        p = np.stack([1.0 - p, p], axis=1)
    if p.ndim != 2 or p.shape[1] < 2:
        raise DataError(
            f"probs must be (N, K) class probabilities with K >= 2 or (N,) for binary, got {np.shape(probs)}"
        )
    tol = sum_tolerance(raw.dtype, p.shape[1])
    if not np.all(np.isfinite(p)) or np.any(p < 0) or np.any(p > 1 + tol):
        raise DataError("probs must be finite probabilities in [0, 1]")
    worst = np.max(np.abs(p.sum(1) - 1), initial=0.0)
    if worst > tol:
        raise DataError(
            f"each row of probs must sum to 1 (a row misses by {worst:.3g}, more than the {tol:.3g} that "
            f"rounding in {raw.dtype} explains for {p.shape[1]} classes)"
        )
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


def _top_label(probs: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
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


def pav(scores: Any, outcomes: Any, weights: Any | None = None) -> dict[str, np.ndarray]:
    """Isotonic (non-decreasing) least-squares fit of ``outcomes`` on ``scores`` by pool-adjacent-violators.

    Returns ``score`` (sorted), ``calibrated`` (the fitted non-decreasing values, one per sorted
    score: the CORP reliability curve of a probability forecast), and ``order`` (the sort permutation).
    Tied scores are pooled first (one block per distinct score), so the fit is a function of the score.
    """
    x = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(outcomes, dtype=np.float64).ravel()
    w = np.ones_like(x) if weights is None else np.asarray(weights, dtype=np.float64).ravel()
    if x.shape != y.shape or x.shape != w.shape or x.size == 0:
        raise DataError("scores, outcomes (and weights) must be non-empty and of the same length")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y)) and np.all(w > 0)):
        raise DataError("scores and outcomes must be finite and weights positive")
    order = np.argsort(x, kind="mergesort")
    xs, ys, ws = x[order], y[order], w[order]
    uniq, start = np.unique(xs, return_index=True)
    bw = np.add.reduceat(ws, start)
    bm = np.add.reduceat(ws * ys, start) / bw
    means, wts, lens = [], [], []  # the stack of pooled blocks
    for m, wt in zip(bm, bw):
        means.append(m)
        wts.append(wt)
        lens.append(1)
        while len(means) > 1 and means[-2] > means[-1]:
            m2, w2, l2 = means.pop(), wts.pop(), lens.pop()
            wsum = wts[-1] + w2
            means[-1] = (means[-1] * wts[-1] + m2 * w2) / wsum
            wts[-1], lens[-1] = wsum, lens[-1] + l2
    per_unique = np.repeat(means, lens)
    counts = np.diff(np.append(start, xs.size))
    return {"score": xs, "calibrated": np.repeat(per_unique, counts), "order": order}


def pav_reliability(probs: Any, labels: Any) -> dict[str, np.ndarray]:
    """Top-label CORP reliability: PAV fit of correctness on confidence (see :func:`pav`), and the
    CORP miscalibration MCB = mean (conf - y)^2 - mean (calibrated - y)^2 >= 0 of the confidences."""
    conf, hit = _top_label(probs, labels)
    fit = pav(conf, hit)
    y = hit[fit["order"]]
    mcb = np.mean((fit["score"] - y) ** 2) - np.mean((fit["calibrated"] - y) ** 2)
    return {"confidence": fit["score"], "calibrated": fit["calibrated"], "miscalibration": np.asarray(max(mcb, 0.0))}


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
        raise DataError(
            f"draws must be (S, N) predictive draws with S >= 2 for N = {obs.size} observations, got {d.shape}"
        )
    return d.reshape(-1, obs.size), obs


__all__ = [
    "reliability",
    "reliability_diagram",
    "expected_calibration_error",
    "maximum_calibration_error",
    "classwise_ece",
    "brier_score",
    "negative_log_predictive_density",
    "accuracy_vs_confidence",
    "pav",
    "pav_reliability",
    "interval_coverage",
    "pit",
]
