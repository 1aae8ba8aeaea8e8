"""Rank-normalised split R-hat and bulk / tail effective sample sizes, vectorised over elements.

The definitions are those of Vehtari, Gelman, Simpson, Carpenter and Buerkner (2021), "Rank-normalization,
folding, and localization: an improved R-hat", as ArviZ 0.23 computes them (``az.rhat`` with
``method="rank"``, ``az.ess`` with ``method="bulk"`` / ``"tail"``), on arrays ``(chain, draw, *shape)``:

* split: each chain's first and last ``draw // 2`` draws become two chains;
* rank normalisation: the ranks r of all split draws of an element (ties averaged) mapped to
  z = Phi^-1((r - 3/8) / (S + 1/4)), S the number of draws (Blom's offsets);
* R-hat = max(R(z), R(z of |x - median(x)|)), R(y) = sqrt((B / W + n - 1) / n) with n draws per split
  chain, B = n Var(chain means), W = mean(chain variances) (unbiased variances);
* ESS = C n / tau, tau = -1 + 2 sum_{t <= T} rho_t + rho_{T + 1}: the autocorrelations rho_t pooled over
  chains (FFT autocovariances, Geyer's initial positive sequence truncating at T, then his initial
  monotone sequence), tau at least 1 / log10(C n); bulk: of z; tail: the smaller of the ESS of the
  indicators x <= q_0.05 and x <= q_0.95 (type-7 quantiles); an element with a single value has ESS C n.

ArviZ evaluates them element by element in Python, which takes minutes for the local chains of
thousands of clients with a hundred coordinates each (the convergence table of a personalised network);
here every element is evaluated at once, in NumPy, and each loop runs over lags, not elements.
``tests/test_chain_stats.py`` checks them against ArviZ on autocorrelated, tied, constant, odd-length
and single-chain draws.
"""

from __future__ import annotations

import numpy as np
from scipy import stats
from scipy.fft import next_fast_len

__all__ = ["rhat", "ess_bulk", "ess_tail"]


def _flat(draws: np.ndarray) -> tuple[np.ndarray, tuple[int, ...]]:
    a = np.asarray(draws, dtype=np.float64)
    if a.ndim < 2:
        raise ValueError(f"draws must be shaped (chain, draw, ...), got shape {a.shape}")
    return a.reshape(a.shape[0], a.shape[1], -1), a.shape[2:]


def _split(a: np.ndarray) -> np.ndarray:
    half = a.shape[1] // 2
    return np.concatenate([a[:, :half], a[:, a.shape[1] - half :]], axis=0)


def _z_scale(a: np.ndarray) -> np.ndarray:
    c, n, m = a.shape
    ranks = stats.rankdata(a.reshape(c * n, m), method="average", axis=0)
    return stats.norm.ppf((ranks - 0.375) / (c * n + 0.25)).reshape(a.shape)


def _rhat(a: np.ndarray) -> np.ndarray:
    n = a.shape[1]
    between = n * np.var(a.mean(axis=1), axis=0, ddof=1)
    within = np.mean(np.var(a, axis=1, ddof=1), axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.sqrt((between / within + n - 1) / n)


def _larger(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Python's ``max(first, second)`` elementwise (NaN in ``first`` wins, NaN in ``second`` loses)."""
    return np.where(second > first, second, first)


def _ess(a: np.ndarray) -> np.ndarray:
    """The ESS of each element of ``a`` (chain, draw, m), already split."""
    c, n, m = a.shape
    size = c * n
    out = np.full(m, np.nan)
    const = (a.max(axis=(0, 1)) - a.min(axis=(0, 1))) < np.finfo(float).resolution
    out[const] = size
    work = ~const
    if not work.any():
        return out
    x = a[:, :, work]
    k = x.shape[2]
    centred = x - x.mean(axis=1, keepdims=True)
    length = next_fast_len(2 * n)
    spec = np.fft.rfft(centred, n=length, axis=1)
    acov = np.fft.irfft(spec * np.conjugate(spec), n=length, axis=1)[:, :n] / n  # (c, n, k)
    mean_var = acov[:, 0].mean(axis=0) * n / (n - 1.0)
    var_plus = mean_var * (n - 1.0) / n
    if c > 1:
        var_plus = var_plus + np.var(x.mean(axis=1), axis=0, ddof=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = 1.0 - (mean_var - acov.mean(axis=0)) / var_plus  # (n, k): rho at every lag
    rho_t = np.zeros((n, k))
    rho_t[0] = 1.0
    rho_t[1] = rho[1]
    even, odd = np.ones(k), rho[1].copy()
    active = (even + odd) > 0.0
    t_end = np.ones(k, dtype=np.int64)
    t = 1
    while t < n - 3 and active.any():  # Geyer's initial positive sequence
        even = np.where(active, rho[t + 1], even)
        odd = np.where(active, rho[t + 2], odd)
        keep = active & (even + odd >= 0)
        rho_t[t + 1] = np.where(keep, even, rho_t[t + 1])
        rho_t[t + 2] = np.where(keep, odd, rho_t[t + 2])
        t += 2
        t_end = np.where(active, t, t_end)
        active &= (even + odd) > 0.0
    max_t = t_end - 2
    cols = np.arange(k)
    rho_t[max_t + 1, cols] = np.where(even > 0, even, rho_t[max_t + 1, cols])
    t = 1
    while t <= max_t.max() - 2:  # Geyer's initial monotone sequence
        todo = t <= max_t - 2
        up = (rho_t[t + 1] + rho_t[t + 2]) > (rho_t[t - 1] + rho_t[t])
        fix = todo & up
        mid = (rho_t[t - 1] + rho_t[t]) / 2.0
        rho_t[t + 1] = np.where(fix, mid, rho_t[t + 1])
        rho_t[t + 2] = np.where(fix, mid, rho_t[t + 2])
        t += 2
    lags = np.arange(n)[:, None]
    tau = -1.0 + 2.0 * np.sum(np.where(lags <= max_t, rho_t, 0.0), axis=0) + rho_t[max_t + 1, cols]
    tau = np.maximum(tau, 1.0 / np.log10(size))
    with np.errstate(divide="ignore", invalid="ignore"):
        ess = size / tau
    ess[np.isnan(rho_t).any(axis=0)] = np.nan
    out[work] = ess
    return out


def _finish(value: np.ndarray, a: np.ndarray, shape: tuple[int, ...], min_chains: int) -> np.ndarray | float:
    bad = np.isnan(a).any(axis=(0, 1)) | (a.shape[1] < 4) | (a.shape[0] < min_chains)
    value = np.where(bad, np.nan, value)
    return value.reshape(shape) if shape else float(value[0])


def rhat(draws: np.ndarray) -> np.ndarray | float:
    """Rank-normalised split R-hat of every element of ``draws`` (chain, draw, ...): NaN with fewer than 2
    chains or 4 draws, or a NaN draw."""
    a, shape = _flat(draws)
    if a.shape[0] < 2 or a.shape[1] < 4:
        return _finish(np.full(a.shape[2], np.nan), a, shape, 2)
    split = _split(np.where(np.isnan(a), 0.0, a))
    bulk = _rhat(_z_scale(split))
    folded = np.abs(split - np.median(split, axis=(0, 1)))
    return _finish(_larger(bulk, _rhat(_z_scale(folded))), a, shape, 2)


def ess_bulk(draws: np.ndarray) -> np.ndarray | float:
    """Bulk effective sample size (of the rank-normalised split draws) of every element of ``draws``."""
    a, shape = _flat(draws)
    if a.shape[1] < 4:
        return _finish(np.full(a.shape[2], np.nan), a, shape, 1)
    return _finish(_ess(_z_scale(_split(np.where(np.isnan(a), 0.0, a)))), a, shape, 1)


def ess_tail(draws: np.ndarray) -> np.ndarray | float:
    """Tail effective sample size (the smaller of the 5% and 95% quantiles' indicator ESS) of every element."""
    a, shape = _flat(draws)
    if a.shape[1] < 4:
        return _finish(np.full(a.shape[2], np.nan), a, shape, 1)
    clean = np.where(np.isnan(a), 0.0, a)
    low, high = (_ess(_split((clean <= np.quantile(clean, p, axis=(0, 1))).astype(float))) for p in (0.05, 0.95))
    smaller = np.where(np.isnan(low), np.nan, np.where(high < low, high, low))
    return _finish(smaller, a, shape, 1)
