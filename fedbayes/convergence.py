"""Convergence checks of a finished fit: ``res.diagnostics``, ``res.converged`` and ``fb.ConvergenceWarning``.

A federated fit cannot be checked by eye: nobody sees the clients' data. Every fit therefore checks
itself at the end of ``fb.fed_fit`` (and ``fb.resume``) with what the algorithm reports, and warns
once per failed check. The table (:func:`diagnose`) has a row per check and site with columns
``check``, ``site``, ``value``, ``threshold``, ``ok`` and ``note``.

Point estimates (TAMUNA / Scaffnew / GD / FedAvg, FedSOUL's theta*, FedMM / FedEM):

``newton_decrement``
    lambda^2 = g' I^-1 g with g the gradient of the maximised objective and I its negative Hessian at
    the estimate (``parts["gradient"]`` / ``parts["information"]`` of the algorithm's ``finalize``).
    The Newton step to the optimum is delta = I^-1 g and the estimate's asymptotic covariance is I^-1,
    so lambda^2 = delta' I delta is the squared distance to the optimum in standard-error units; by
    Cauchy-Schwarz every linear contrast a'theta is then within sqrt(lambda^2) of its own standard
    errors of the optimum. Per site the row holds delta_s' (I^-1)_ss^-1 delta_s: the shift of that
    site alone, in its marginal standard-error units. Tolerance :data:`DECREMENT_TOL` = 0.01, i.e.
    0.1 standard error: an optimisation error ten times smaller than the statistical one changes no
    interval noticeably. Where the reported estimate is that Newton step itself (FedSOUL's
    ``one_step``: ``res.params_averaged`` holds the iterate the gradient was taken at), the row measures
    the averaged iterate, with threshold :data:`ONE_STEP_MAX` (the step's domain), and a row
    ``one_step_noise`` checks the step's Monte Carlo error, E[eps' I^-1 eps] = tr(I^-1 Sigma_g) (the
    expected squared error of the step in standard errors, per site its own block), against
    :data:`DECREMENT_TOL`. When g is a Monte Carlo estimate with covariance Sigma_g
    (``parts["gradient_cov"]``, FedSOUL) the measured value carries the noise term
    E[eps' I^-1 eps] = tr(I^-1 Sigma_g) even at the optimum; its law is a weighted sum of chi^2_1
    variables (weights: eigenvalues of I^-1 Sigma_g), whose upper :data:`NOISE_LEVEL` quantile
    (Satterthwaite's scaled chi^2 with matched mean and variance) is added to the tolerance: the check
    fails only when the gradient is larger than its noise can explain *and* than the tolerance.
``trace``
    From the per-round history ``theta/<site>``: over the last quarter of the rounds (at least
    :data:`MIN_ROUNDS`; the end of the run, so a fit that settled earlier is not blamed for its
    approach), the change of the linear trend of ten batch means (slope times window length) per
    coordinate, in standard errors (``res.standard_errors`` where the fit has them; tolerance
    :data:`TRACE_TOL_SE` = 0.1 as above) or
    else relative to the coordinate's scale max(|mean|, distance travelled from the first round)
    (tolerance :data:`TRACE_TOL_REL` = 1e-3). The threshold is raised to the Monte Carlo noise of that
    change: the Student-t quantile (8 degrees of freedom, two-sided level :data:`NOISE_LEVEL` divided
    by the number of coordinates, Bonferroni) times its batch-means standard error. A constrained site (a
    scale, a probability, a simplex) is also checked in the unconstrained coordinates its estimate moves in
    (its bijection to R^n; scale at least 1 there, a log-unit being already relative), and the worse of
    the two is its row (both count in Bonferroni's number of coordinates), where the change in its own units
    exceeds the tolerance and passes only as noise: a scale that runs away grows geometrically, and in its
    own units the window's batch means curve away from a line so that the curvature passes for noise, while
    in log units the growth is a line. (A change within the tolerance is not judged again: a scale settling
    near its boundary 0 keeps moving in log units.) A move of more than :data:`RUNAWAY` there is reported as
    running away. This catches a
    fit still drifting (a capped step, a too small learning rate); it cannot see a very slow linear
    convergence whose change over the window is small against its remaining distance (that is what
    the decrement is for). With fewer than :data:`MIN_ROUNDS` rounds a ``rounds`` row takes its place
    (failed where no decrement can decide instead).
``statistic_change`` (FedMM / FedEM)
    The EM mean field h(S) = s(T(S)) - S (``field_norm`` per round) relative to |S|. EM converges
    linearly: when |h| decays at the rate rho per round over the last quarter of the rounds (a
    log-linear fit), the statistic is still gamma |h| rho / (1 - rho) from its fixed point (Aitken's
    extrapolation, the classic EM stopping rule); tolerance :data:`STATISTIC_TOL` = 1e-3 relative. A
    field that does not decay significantly is at its Monte Carlo noise floor (stochastic E-step,
    compression, partial participation) and the row only reports it; the trace decides.

``privacy_noise`` (point estimates of a private fit, ``res.privacy``)
    Whether the privacy noise leaves the data anything to say. A round's noise on the cohort's mean
    update has norm about z C sqrt(d) / m (noise multiplier z, clip C, d coordinates, m answering
    members; the same for a re-weighted sum, whose weight scales noise and signal alike), and the clipped
    signal is at most C. Averaged over the W rounds of the trace's window the noise falls to
    z C sqrt(d) / (m sqrt(W)); the row holds that over C, with threshold 1: above it even the largest
    signal the clients could send is below the noise the window averages, so the estimate is set by the
    noise draws, not by the data, and a random walk of the iterate passes the trace check as noise. It
    is a necessary condition, not a sufficient one: below it the trace and decrement still judge.

Samplers (LMC, D-/P-/B-ELF, QLSD) and the clients' local chains:

``rhat`` / ``ess_bulk`` / ``ess_tail``
    ArviZ's rank-normalised split R-hat and bulk / tail effective sample sizes (Vehtari, Gelman,
    Simpson, Carpenter, Buerkner 2021), per site (the worst element), by :mod:`fedbayes.chain_stats`
    (ArviZ 0.23's definitions, tail ESS at the 5% / 95% quantiles, evaluated for every element at once:
    ArviZ's element-by-element loop took minutes on thousands of clients' heads), so both ArviZ lines
    give the same numbers. Thresholds as the paper, Stan and ArviZ use:
    R-hat <= 1.01 and ESS >= 100 per chain (400 for 4 chains): below 100 per chain the Monte Carlo
    error of the tail quantiles and of R-hat itself is too large to trust them. A single chain is
    split in halves (so R-hat still compares its beginning with its end).
    Fewer than 8 draws per chain give one failed ``draws`` row instead.
``sd_inflation`` (LMC, D-/P-/B-ELF started at the mode)
    Chains that mix still sample the unadjusted step's own stationary law, wider than the posterior by
    the step's discretisation and the compressors' error. ``res.settings["sd_inflation"]`` is its widest
    sd over the posterior's at the mode, in closed form (:mod:`fedbayes.algorithms.stationary`: ULA's
    exact Gaussian law, the compressors' error from their declared constants); threshold
    1 + :data:`fedbayes.algorithms.stationary.INFLATION_LIMIT` = 1.05. The note gives the step that keeps
    every sd within it (``res.settings["sd_inflation_step"]``). The default step (0.1 in the
    preconditioned coordinates) gives 1 / sqrt(1 - 0.05) = 1.026 without compression.
``local_rhat``
    R-hat of each client's local chains from the final exchange (FedSOUL's personal posteriors;
    ``num_chains`` chains per client), the worst client per site. Threshold 1.01, raised to what chance
    alone gives at the client's ESS (each chain's own, summed) over that many clients
    (:func:`local_rhat_limit`): the largest of a hundred clients' R-hats of well-mixed chains with 200
    effective draws each is above 1.01 by chance alone, and would otherwise warn on every fit.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from types import FrameType
from typing import Any
from collections.abc import Mapping

import numpy as np

from . import chain_stats
from .errors import ConvergenceWarning

# A check that cannot run on a fit's outputs (an unexpected shape, say) gives one failed ``checks`` row
# and its warning rather than an exception: the fit is kept, its convergence is unknown (report()).

DECREMENT_TOL = 0.01
"""Newton decrement tolerance: 0.1 standard error, squared."""
ONE_STEP_MAX = 0.25
"""The largest Newton decrement of FedSOUL's averaged iterate from which its one Newton step is taken
(half a standard error, squared)."""
TRACE_TOL_SE = 0.1
"""Largest drift of the estimate over the last quarter of the rounds, in standard errors."""
TRACE_TOL_REL = 1e-3
"""Largest relative drift over the last quarter of the rounds when the fit has no standard errors."""
STATISTIC_TOL = 1e-3
"""Largest extrapolated remaining change of FedMM's statistic, relative to its norm."""
NOISE_LEVEL = 1e-3
"""False-alarm probability of a converged fit's Monte Carlo noise alone, per check."""
RHAT_MAX = 1.01
"""Largest split R-hat (Vehtari et al. 2021)."""
ESS_PER_CHAIN = 100
"""Smallest bulk / tail ESS per chain (Vehtari et al. 2021: 400 for 4 chains)."""
RUNAWAY = 1.0
"""A constrained site's trend change over the trace window, in its unconstrained units, beyond which the
``trace`` row calls the estimate running away (a log scale that grew e-fold within the window)."""
BATCHES = 10
"""Batch means of the trace check (the window's trend is fitted to them)."""
MIN_ROUNDS = 2 * BATCHES
"""Fewest rounds the trace check can judge."""

COLUMNS = ["check", "site", "value", "threshold", "ok", "note"]
JOINT = "(all)"
"""The site name of a row about all global sites together."""

_SAMPLERS = ("LMC", "D-ELF", "P-ELF", "B-ELF", "QLSD")


# ------------------------------------------------------------------------------ the criteria


def chi2_mix_quantile(weights: np.ndarray, level: float = NOISE_LEVEL) -> float:
    """Upper ``level`` quantile of sum_j w_j chi^2_1 (w_j >= 0): Satterthwaite's c chi^2_nu with the same
    mean and variance (c = sum w^2 / sum w, nu = (sum w)^2 / sum w^2); exact when the w_j are equal."""
    from scipy import stats

    w = np.clip(np.asarray(weights, dtype=np.float64).ravel(), 0.0, None)
    s1, s2 = float(np.sum(w)), float(np.sum(w**2))
    if s1 <= 0.0:
        return 0.0
    c, nu = s2 / s1, s1**2 / s2
    return float(c * stats.chi2.isf(level, nu))


def newton_decrement(
    gradient: Any,
    information: Any,
    gradient_cov: Any = None,
    blocks: Mapping[str, np.ndarray] | None = None,
    basis: Any = None,
) -> dict[str, dict[str, float]]:
    """Newton decrements of the estimate, jointly and per block of coordinates.

    ``{name: {"value", "noise_mean", "noise_quantile", "threshold", "min_eig"}}`` with ``name``
    :data:`JOINT` for g' I^-1 g and each block's delta_b' ((I^-1)_bb)^-1 delta_b (delta = I^-1 g);
    ``noise_mean`` is what the gradient's Monte Carlo noise (covariance ``gradient_cov``) alone gives on
    average (tr(I^-1 Sigma_g) jointly), ``noise_quantile`` its upper :data:`NOISE_LEVEL` quantile and
    ``threshold`` = :data:`DECREMENT_TOL` + that quantile. ``min_eig`` is the smallest eigenvalue of
    I relative to its largest: <= 0 means the estimate is not at a strict maximum and the value is NaN.

    With ``basis`` B (d, k; orthonormal: the complement of a declared symmetry's orbit,
    :func:`fedbayes.symmetry.basis`), I^-1 is B (B^T I B)^-1 B^T: the distance across the orbit, where
    the data identify the estimate, and ``min_eig`` is that of B^T I B. A block whose coordinates the
    orbit moves has a singular (I^-1)_bb; its decrement is taken in the block's identified directions.
    """
    g = np.asarray(gradient, dtype=np.float64).ravel()
    info = np.asarray(information, dtype=np.float64)
    d = g.size
    if info.shape != (d, d):
        raise ValueError(f"information must be ({d}, {d}) for a gradient of {d} coordinates, got {info.shape}")
    names = {JOINT: np.arange(d)}
    names.update({k: np.asarray(v) for k, v in (blocks or {}).items()})
    if not (np.all(np.isfinite(info)) and np.all(np.isfinite(g))):
        nan = float("nan")
        return {
            n: {"value": nan, "noise_mean": nan, "noise_quantile": nan, "threshold": DECREMENT_TOL, "min_eig": nan}
            for n in names
        }
    info = (info + info.T) / 2
    if basis is None:
        eig, vec = np.linalg.eigh(info)
    else:
        b = np.asarray(basis, dtype=np.float64)
        eig, v = np.linalg.eigh(b.T @ info @ b)
        vec = b @ v
    scale = float(np.max(np.abs(eig))) if eig.size else 0.0
    rel_min = float(eig[0] / scale) if d and scale > 0 else 0.0
    if eig.size == 0 or rel_min <= d * np.finfo(np.float64).eps:
        nan = float("nan")
        return {
            n: {"value": nan, "noise_mean": nan, "noise_quantile": nan, "threshold": DECREMENT_TOL, "min_eig": rel_min}
            for n in names
        }
    cov = (vec / eig) @ vec.T  # I^-1
    delta = cov @ g
    sigma_g = None if gradient_cov is None else np.asarray(gradient_cov, dtype=np.float64)
    noise_delta = None if sigma_g is None else cov @ ((sigma_g + sigma_g.T) / 2) @ cov  # Cov(delta) from the noise
    out = {}
    for name, idx in names.items():
        block = cov[np.ix_(idx, idx)]
        if basis is None:
            root = np.linalg.cholesky(np.linalg.inv(block))  # root root^T = (I^-1)_bb^-1
        else:  # (I^-1)_bb may be singular along the orbit: its identified directions, whitened
            s_b, u_b = np.linalg.eigh(block)
            keep = s_b > max(float(s_b[-1]), 0.0) * len(idx) * np.finfo(np.float64).eps * 1e3
            root = u_b[:, keep] / np.sqrt(s_b[keep])
        value = float(np.sum((root.T @ delta[idx]) ** 2))
        if noise_delta is None:
            mean = quant = 0.0
        else:
            # eps_b ~ N(0, C_bb): eps' P eps has the law sum_j w_j chi^2_1, w = eig(P^1/2 C_bb P^1/2)
            w = np.linalg.eigvalsh(root.T @ noise_delta[np.ix_(idx, idx)] @ root)
            mean, quant = float(np.sum(np.clip(w, 0, None))), chi2_mix_quantile(w)
        out[name] = {
            "value": value,
            "noise_mean": mean,
            "noise_quantile": quant,
            "threshold": DECREMENT_TOL + quant,
            "min_eig": rel_min,
        }
    return out


def trend_change(trace: Any, batches: int = BATCHES) -> tuple[np.ndarray, np.ndarray]:
    """(change, standard error) per coordinate of the linear trend of ``trace`` (rounds, ...) over its length.

    The rounds are cut into ``batches`` contiguous batches; the batch means are regressed on the batch
    centres (ordinary least squares), the change is slope * rounds and its standard error comes from the
    residuals of the batch means (batch means: nearly independent when a batch is longer than the
    trace's autocorrelation, so the Monte Carlo noise of an autocorrelated trace is not underestimated
    as a per-round regression would)."""
    x = np.asarray(trace, dtype=np.float64)
    n = x.shape[0]
    x = x.reshape(n, -1)
    parts = np.array_split(np.arange(n), batches)
    means = np.stack([x[p].mean(0) for p in parts])
    centres = np.array([p.mean() for p in parts])
    tc = centres - centres.mean()
    sxx = float(np.sum(tc**2))
    slope = tc @ (means - means.mean(0)) / sxx
    resid = means - means.mean(0) - np.outer(tc, slope)
    s2 = np.sum(resid**2, 0) / (batches - 2)
    return slope * n, np.sqrt(s2 / sxx) * n


def trace_check(
    trace: Any, se: Any = None, first: Any = None, num_coords: int = 1, floor: float = 0.0
) -> dict[str, Any]:
    """The trace criterion for one site's trajectory over the window (rounds, ...).

    Returns the worst coordinate's ``value`` (|change| in standard errors ``se``, or relative to
    max(|mean|, |mean - first|, ``floor``) without them), its ``threshold`` (the tolerance, raised to the
    noise allowance t * se(change) in the same units) and ``ok``."""
    from scipy import stats

    x = np.asarray(trace, dtype=np.float64)
    change, change_se = trend_change(x)
    flat = x.reshape(len(x), -1)
    if se is not None:
        scale, tol, unit = np.asarray(se, dtype=np.float64).ravel(), TRACE_TOL_SE, "standard errors"
    else:
        mean = flat.mean(0)
        start = mean if first is None else np.asarray(first, dtype=np.float64).ravel()
        scale = np.maximum(np.maximum(np.abs(mean), np.abs(mean - start)), floor)
        tol, unit = TRACE_TOL_REL, "relative"
    tcrit = float(stats.t.isf(NOISE_LEVEL / (2 * max(num_coords, 1)), BATCHES - 2))
    with np.errstate(divide="ignore", invalid="ignore"):
        value = np.where(change == 0, 0.0, np.abs(change) / scale)
        noise = np.where(change_se == 0, 0.0, tcrit * change_se / scale)
    value = np.where(np.isnan(value), np.inf, value)
    threshold = np.maximum(tol, np.nan_to_num(noise, nan=np.inf))
    j = int(np.argmax(value / threshold))
    return {
        "value": float(value[j]),
        "threshold": float(threshold[j]),
        "ok": bool(np.all(value <= threshold)),
        "unit": unit,
        "coordinate": j,
        "change": float(change[j]),
    }


def statistic_check(field_norm: Any, statistic_norm: float, gamma: float = 1.0) -> dict[str, Any]:
    """FedMM's mean-field criterion from ``field_norm`` |h(S_t)| over the window and |S|.

    With log(|h_t| / |S|) = a + b t fitted by least squares and b significantly negative (one-sided
    t test at :data:`NOISE_LEVEL`), rho = e^b and the remaining relative change of S is
    gamma r_T rho / (1 - rho), r_T the fitted relative field at the last round (value; threshold
    :data:`STATISTIC_TOL`). Otherwise the field is at its noise floor: value r_T, ok."""
    from scipy import stats

    r = np.asarray(field_norm, dtype=np.float64).ravel() / max(float(statistic_norm), np.finfo(np.float64).tiny)
    if np.all(r == 0):
        return {"value": 0.0, "threshold": STATISTIC_TOL, "ok": True, "note": "the EM mean field is exactly 0"}
    lr = np.log(np.maximum(r, np.finfo(np.float64).tiny))
    t = np.arange(len(lr), dtype=np.float64)
    tc = t - t.mean()
    b = float(tc @ (lr - lr.mean()) / (tc @ tc))
    resid = lr - lr.mean() - b * tc
    se_b = float(np.sqrt(np.sum(resid**2) / (len(lr) - 2) / (tc @ tc)))
    tcrit = float(stats.t.isf(NOISE_LEVEL, len(lr) - 2))
    r_last = float(np.exp(lr.mean() + b * tc[-1]))
    if b < 0 and b + tcrit * se_b < 0:
        rho = math.exp(b)
        remaining = gamma * r_last * rho / (1 - rho)
        return {
            "value": remaining,
            "threshold": STATISTIC_TOL,
            "ok": remaining <= STATISTIC_TOL,
            "note": (
                f"the EM mean field |h|/|S| = {r_last:.3g} decays by {rho:.6g} per round: S is still about "
                f"{remaining:.3g} (relative) from its fixed point (Aitken extrapolation)"
            ),
        }
    return {
        "value": r_last,
        "threshold": STATISTIC_TOL,
        "ok": True,
        "note": (
            f"the EM mean field |h|/|S| = {r_last:.3g} no longer decays: its Monte Carlo noise floor "
            "(stochastic E-step, compression or partial participation); the trace check decides"
        ),
    }


def _chain_stats(draws: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """``{site: {"rhat", "ess_bulk", "ess_tail": array}}`` of ``{site: (chain, draw, ...)}``
    (:mod:`fedbayes.chain_stats`: ArviZ's definitions, every element at once). One chain is split in two."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, a in draws.items():
        a = np.asarray(a, dtype=np.float64)
        if a.shape[0] == 1:
            half = a.shape[1] // 2
            a = np.stack([a[0, :half], a[0, half : 2 * half]])
        out[name] = {
            "rhat": np.asarray(chain_stats.rhat(a)),
            "ess_bulk": np.asarray(chain_stats.ess_bulk(a)),
            "ess_tail": np.asarray(chain_stats.ess_tail(a)),
        }
    return out


# ------------------------------------------------------------------------------ the table


def _row(check: str, site: str, value: float, threshold: float, ok: bool, note: str) -> dict[str, Any]:
    return {
        "check": check,
        "site": site,
        "value": float(value),
        "threshold": float(threshold),
        "ok": bool(ok),
        "note": note,
    }


def _site_blocks(theta: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The flat indices of each site in ravel_pytree order of the unconstrained ``theta`` (sorted keys)."""
    blocks, start = {}, 0
    for name in sorted(theta):
        size = int(np.size(theta[name]))
        blocks[name] = np.arange(start, start + size)
        start += size
    return blocks


def _symmetry_frame(res: Any) -> tuple[Any, np.ndarray, np.ndarray] | None:
    """``(symmetry, tangents (d, r), basis (d, d - r))`` at the estimate of a model that declares a
    symmetry (:mod:`fedbayes.symmetry`), else None."""
    fm = getattr(res, "_fm", None)
    sym = getattr(fm, "symmetry", None)
    theta = getattr(res, "_theta_u", None)
    if sym is None or not theta:
        return None
    from . import symmetry

    tangent = np.asarray(symmetry.tangents(fm, sym, theta), dtype=np.float64)
    return sym, tangent, np.asarray(symmetry.complement(tangent), dtype=np.float64)


def _symmetry_rows(frame: Any, grad: Any, gradient_cov: Any) -> list[dict[str, Any]]:
    """The gradient along the declared orbit against its Monte Carlo noise: g_T' Sigma_T^-1 g_T, chi^2_r
    when the declaration is a symmetry of the marginal likelihood (g . t = 0 exactly then)."""
    from scipy import stats

    if frame is None or gradient_cov is None:
        return []
    sym, tangent, _ = frame
    q, _ = np.linalg.qr(tangent)
    g_t = q.T @ np.asarray(grad, dtype=np.float64).ravel()
    sigma_t = q.T @ np.asarray(gradient_cov, dtype=np.float64) @ q
    try:
        value = float(g_t @ np.linalg.solve(0.5 * (sigma_t + sigma_t.T), g_t))
    except np.linalg.LinAlgError:
        return []
    r = tangent.shape[1]
    threshold = float(stats.chi2.isf(NOISE_LEVEL, r))
    note = (
        f"the gradient along the orbit of {sym.name} ({r} directions), squared, in units of its Monte Carlo "
        "noise: a symmetry of the likelihood gives a chi^2 draw"
    )
    if value > threshold:
        note += (
            "; it is beyond its noise, so the declared transformation changes the likelihood (or a prior of the "
            "globals): the checks, standard errors and normal approximation that project it out are not valid. "
            "Fix the model's fb.Symmetry (its action must leave every client's likelihood and the priors "
            "unchanged), or remove it"
        )
    return [_row("symmetry", JOINT, value, threshold, value <= threshold, note)]


def _decrement_rows(res: Any, frame: Any = None) -> list[dict[str, Any]]:
    inputs = getattr(res, "_convergence", None) or {}
    grad, info = inputs.get("gradient"), inputs.get("information")
    if info is None:
        info = getattr(res, "information", None)
    if grad is None or info is None:
        return []
    theta = getattr(res, "_theta_u", None) or {}
    blocks = _site_blocks(theta) if sum(int(np.size(v)) for v in theta.values()) == np.size(grad) else {}
    frame = frame if blocks else None
    out = newton_decrement(
        grad, info, inputs.get("gradient_cov"), blocks if len(blocks) > 1 else None, None if frame is None else frame[2]
    )
    stepped = getattr(res, "params_averaged", None) is not None
    rows = _symmetry_rows(frame, grad, inputs.get("gradient_cov"))
    for name, r in out.items():
        if not np.isfinite(r["value"]):
            why = (
                "the gradient or the information matrix is not finite"
                if not np.isfinite(r["min_eig"])
                else f"the information matrix is not positive definite (smallest eigenvalue {r['min_eig']:.3g} of the "
                "largest): the estimate is not at a strict maximum (a saddle, a flat direction or a parameter "
                "the data do not identify; a known symmetry of the model, e.g. a rotation of a latent subspace, "
                "declared with fb.Symmetry is projected out of this check)"
            )
            rows.append(_row("newton_decrement", name, r["value"], r["threshold"], False, why))
            continue
        note = (
            "g' I^-1 g: squared distance to the optimum in standard errors"
            if name == JOINT
            else "the site's Newton step in its marginal standard errors, squared"
        )
        if r["noise_quantile"] > 0:
            note += (
                f"; the gradient's Monte Carlo noise alone gives {r['noise_mean']:.3g} on average, "
                f"{r['noise_quantile']:.3g} at its {1 - NOISE_LEVEL:.1%} quantile (in the threshold)"
            )
            if r["noise_quantile"] > 10 * DECREMENT_TOL:
                note += (
                    f", so this check can only see a distance above about {math.sqrt(r['threshold']):.2g} "
                    "standard errors: more Monte Carlo draws in the final exchange sharpen it"
                )
        if stepped:
            threshold = ONE_STEP_MAX + r["noise_quantile"]
            rows.append(
                _row(
                    "newton_decrement",
                    name,
                    r["value"],
                    threshold,
                    r["value"] <= threshold,
                    note + "; at the averaged iterate, from which the reported estimate is one Newton step",
                )
            )
            rows.append(
                _row(
                    "one_step_noise",
                    name,
                    r["noise_mean"],
                    DECREMENT_TOL,
                    r["noise_mean"] <= DECREMENT_TOL,
                    "the Newton step's expected squared Monte Carlo error in standard errors"
                    + (
                        ""
                        if r["noise_mean"] <= DECREMENT_TOL
                        else ": more draws in the final exchange (num_samples) reduce it"
                    ),
                )
            )
            continue
        rows.append(_row("newton_decrement", name, r["value"], r["threshold"], r["value"] <= r["threshold"], note))
    return rows


def _trace_rows(res: Any, decrement_available: bool, frame: Any = None) -> list[dict[str, Any]]:
    history = res.history
    sites = [k[len("theta/") :] for k in history if k.startswith("theta/")]
    if not sites:
        return []
    rounds = len(history[f"theta/{sites[0]}"])
    if rounds < MIN_ROUNDS:
        note = f"{rounds} rounds are too few to judge the trace (it needs {MIN_ROUNDS})"
        if decrement_available:
            return [_row("rounds", JOINT, rounds, MIN_ROUNDS, True, note + "; the Newton decrement decides")]
        return [_row("rounds", JOINT, rounds, MIN_ROUNDS, False, note)]
    window = max(MIN_ROUNDS, rounds // 4)
    traces = {s: np.asarray(history[f"theta/{s}"], dtype=np.float64) for s in sites}
    if frame is not None:  # each round moved along the declared orbit to the estimate: drift across it counts
        traces = _aligned_traces(res, frame, traces)
    transforms = {s: t for s in sites if (t := _site_transform(res, s)) is not None}
    free = {s: u for s, t in transforms.items() if (u := _unconstrained_trace(t, traces[s])) is not None}
    coords = sum(int(np.prod(t.shape[1:])) for t in (*traces.values(), *free.values()))
    ses = getattr(res, "standard_errors", None) or {}
    rows = []
    for s, trace in traces.items():
        if trace[0].size == 0:
            continue
        se = ses.get(s)
        if se is not None:
            # a structural zero (the upper triangle of a Cholesky factor) has se 0 and a constant trace: it is
            # not a coordinate, and must not take the site's standard errors away from the others
            se = np.asarray(se, dtype=np.float64)
            valid = np.isfinite(se) & (se > 0)
            constant = np.all(trace[-window:] == trace[-1], axis=0).reshape(se.shape)
            se = np.where(valid, se, 1.0) if np.all(valid | constant) else None
        r = trace_check(trace[-window:], se=se, first=trace[0], num_coords=coords)
        change = "standard errors" if r["unit"] == "standard errors" else "units of the estimate's scale"
        where = ""
        tol = TRACE_TOL_SE if se is not None else TRACE_TOL_REL
        if s in free and r["value"] > tol:
            # the change is beyond the tolerance and passes (if it does) only as Monte Carlo noise, whose estimate
            # the curvature of a geometric run-away inflates: the unconstrained coordinates arbitrate. (A change
            # within the tolerance, e.g. a scale settling near its boundary 0, is not judged again in log units,
            # where it would keep moving.)
            u = free[s]
            se_u = None if se is None else _unconstrained_se(transforms[s], u[-window:].mean(0), se)
            carried = se is None or se_u is not None  # standard errors that a simplex's transform cannot carry
            ru = trace_check(u[-window:], se=se_u, first=u[0], num_coords=coords, floor=1.0) if carried else r
            if ru["value"] / ru["threshold"] > r["value"] / r["threshold"]:
                r = ru
                change = "standard errors" if se_u is not None else "units of the estimate's scale (at least 1)"
                where = " in the unconstrained coordinates (e.g. log sigma)"
        note = (
            f"change of the estimate's trend over the last {window} rounds{where}, in {change} (worst "
            f"coordinate {r['coordinate']}: {r['change']:.3g}); the threshold allows for its Monte Carlo noise "
            "(batch means)"
        )
        if where and not r["ok"] and abs(r["change"]) > RUNAWAY:
            toward = "growing without bound" if r["change"] > 0 else "shrinking toward the boundary of its support"
            note += _RUNAWAY_MARK + (
                f"{toward}, a move of {abs(r['change']):.3g} in unconstrained units over the window (a factor of "
                f"{math.exp(min(abs(r['change']), 700.0)):.3g} for a log scale), not an estimate converging "
                "slowly: more rounds will not help. E.g. a population scale on nearly separable classes, whose "
                "marginal likelihood keeps rising with it (fix the scale or give it a prior in the model), or a "
                "variance whose estimate is 0 (a singular fit: drop the effect or give it a prior)"
            )
        rows.append(_row("trace", s, r["value"], r["threshold"], r["ok"], note))
    return rows


def _aligned_traces(res: Any, frame: Any, traces: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The global sites' traces with every round moved along the declared symmetry's orbit to the estimate
    (:func:`fedbayes.symmetry.align`, in the unconstrained standard errors across the orbit when the
    information gives them)."""
    import jax

    from . import symmetry

    fm, theta = res._fm, res._theta_u
    if set(traces) != set(theta):
        return traces
    sym, _, basis = frame
    scale = None
    info = (getattr(res, "_convergence", None) or {}).get("information")
    if info is not None:
        info = np.asarray(info, dtype=np.float64)
        lam, v = np.linalg.eigh(basis.T @ (0.5 * (info + info.T)) @ basis)
        if np.all(lam > 0):
            sd = np.sqrt(np.einsum("ij,j,ij->i", basis @ v, 1.0 / lam, basis @ v))
            scale = sd if np.all(np.isfinite(sd) & (sd > 0)) else None
    with np.errstate(all="ignore"):
        thetas = jax.vmap(fm._unconstrain)(traces)
        moved = jax.vmap(fm._constrain)(symmetry.align(fm, sym, thetas, theta, scale))
    return {k: np.asarray(moved[k], dtype=np.float64) for k in traces}


_RUNAWAY_MARK = "; running away: "  # :func:`messages` repeats what follows it for every site that runs away


def _site_transform(res: Any, site: str) -> Any:
    """The bijection from R^n onto a constrained global site's support, or None (an unconstrained site)."""
    fm = getattr(res, "_fm", None)
    info = getattr(fm, "sites", {}).get(site) if fm is not None else None
    transform = getattr(info, "transform", None)
    if transform is None or getattr(info, "discrete", False):
        return None
    from numpyro.distributions.transforms import IdentityTransform

    return None if isinstance(transform, IdentityTransform) else transform


def _unconstrained_trace(transform: Any, trace: np.ndarray) -> np.ndarray | None:
    """A constrained site's trace (a scale, a probability, a simplex) in the coordinates its estimate moves in.

    A scale that runs away grows geometrically: in its own units the batch means of the window curve away
    from any straight line, and the curvature is mistaken for Monte Carlo noise (a sigma that grew from 1
    to 4e6 in 300 rounds passed the check); in log units the growth is a straight line and fails it."""
    import jax.numpy as jnp

    with np.errstate(all="ignore"):
        u = np.asarray(transform.inv(jnp.asarray(trace)), dtype=np.float64)
    if u.shape[0] != trace.shape[0] or not np.all(np.isfinite(u)):
        return None
    return u


def _unconstrained_se(transform: Any, u: np.ndarray, se: Any) -> np.ndarray | None:
    """Standard errors of an elementwise-constrained site carried to its unconstrained coordinates by the
    delta method, se / |dc/du| at ``u``; None for a transform that mixes coordinates (a simplex)."""
    import jax.numpy as jnp

    if getattr(transform, "domain", None) is None or transform.domain.event_dim or transform.codomain.event_dim:
        return None
    x = jnp.asarray(u)
    slope = np.exp(np.asarray(transform.log_abs_det_jacobian(x, transform(x)), dtype=np.float64)).ravel()
    se_u = np.asarray(se, dtype=np.float64).ravel() / slope
    return se_u if se_u.shape == u.ravel().shape and np.all(np.isfinite(se_u) & (se_u > 0)) else None


def _statistic_rows(res: Any) -> list[dict[str, Any]]:
    history = res.history
    if "field_norm" not in history or getattr(res, "statistic", None) is None:
        return []
    field = np.asarray(history["field_norm"], dtype=np.float64)
    if len(field) < MIN_ROUNDS:
        return []
    leaves = [np.asarray(v, dtype=np.float64).ravel() for v in _leaves(res.statistic)]
    norm = float(np.linalg.norm(np.concatenate(leaves))) if leaves else 0.0
    gamma = 1.0
    try:
        step = res._algorithm_config().step_size
        gamma = float(step(len(field) - 1)) if callable(step) else float(step)
    except Exception:
        gamma = 1.0
    r = statistic_check(field[-max(MIN_ROUNDS, len(field) // 4) :], norm, gamma)
    return [_row("statistic_change", JOINT, r["value"], r["threshold"], r["ok"], r["note"])]


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, Mapping):
        return [leaf for k in sorted(tree) for leaf in _leaves(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [leaf for t in tree for leaf in _leaves(t)]
    return [tree]


def _sampler_rows(res: Any) -> list[dict[str, Any]]:
    draws = res.global_samples
    if not draws:
        return []
    chains, n = next(iter(draws.values())).shape[:2]
    if n < 8:
        return [_row("draws", JOINT, n, 8, False, f"{n} draws per chain are too few for R-hat and ESS (8 at least)")]
    stats = _chain_stats(draws)
    need = ESS_PER_CHAIN * max(chains, 1)
    rows = []
    for s, st in stats.items():
        rhat = float(np.max(st["rhat"])) if st["rhat"].size else float("nan")
        rows.append(
            _row(
                "rhat",
                s,
                rhat,
                RHAT_MAX,
                bool(rhat <= RHAT_MAX),
                f"rank-normalised split R-hat of {chains} chain(s) x {n} draws (worst element)",
            )
        )
        for key, what in (("ess_bulk", "bulk"), ("ess_tail", "tail")):
            ess = float(np.min(st[key])) if st[key].size else float("nan")
            rows.append(
                _row(
                    key,
                    s,
                    ess,
                    need,
                    bool(ess >= need),
                    f"{what} effective sample size (smallest element); {ESS_PER_CHAIN} per chain",
                )
            )
    return rows + _inflation_rows(res)


def _inflation_rows(res: Any) -> list[dict[str, Any]]:
    """The ``sd_inflation`` row of a Langevin sampler whose fit computed it (see the module docstring)."""
    from .algorithms.stationary import INFLATION_LIMIT

    settings = getattr(res, "settings", None) or {}
    value = settings.get("sd_inflation")
    if not isinstance(value, float):
        return []
    step = settings.get("sd_inflation_step", float("nan"))
    cfg = res._algorithm_config() if hasattr(res, "_algorithm_config") else None
    option = "step_size" if getattr(cfg, "step_size", None) is not None else "step_scale"
    note = (
        f"{settings.get('sd_inflation_note', 'closed form at the mode')}; {option}={step:.3g} keeps every sd within "
        f"{INFLATION_LIMIT:.0%}"
    )
    return [_row("sd_inflation", JOINT, value, 1.0 + INFLATION_LIMIT, bool(value <= 1.0 + INFLATION_LIMIT), note)]


LOCAL_BLOCK = 2048
"""Clients whose local chains' statistics are computed together (the result does not depend on it)."""


def _local_rows(res: Any) -> list[dict[str, Any]]:
    if getattr(res, "local_point", False):  # FedRep / FineTune / LocalOnly: fitted points, not chains
        return []
    chains_by_site = getattr(res, "_local_chains", None) or {}
    # the sampled local latents only (fb.LocalOnly also keeps each client's fitted shared sites there: one
    # value repeated, not a chain)
    local_names = set(getattr(res._fm, "local_names", chains_by_site))
    chains_by_site = {s: v for s, v in chains_by_site.items() if s in local_names}
    if not chains_by_site:
        return []
    first = next(iter(chains_by_site.values()))
    num_clients, chains, n = first.shape[:3]
    if n < 8:
        return []
    # R-hat of each client's chains, and each chain's own ESS, a block of clients at a time: the statistics
    # are per client, and their rank-normalised float64 copies of every client's draws at once would take
    # several times the draws' memory
    rhats: dict[str, list[np.ndarray]] = {s: [] for s in chains_by_site}
    esss: dict[str, list[np.ndarray]] = {s: [] for s in chains_by_site}
    for start in range(0, num_clients, LOCAL_BLOCK):
        draws = {
            s: np.moveaxis(v[start : start + LOCAL_BLOCK], 0, 2) for s, v in chains_by_site.items()
        }  # (chain, draw, client, ...)
        size = next(iter(draws.values())).shape[2]
        stats = _chain_stats(draws)
        within = _chain_stats(_per_chain(draws))
        for s, st in stats.items():
            rhats[s].append(np.where(np.isnan(st["rhat"]), np.inf, st["rhat"]).reshape(size, -1))
            # the chance level of R-hat from each chain's own ESS (the pooled ESS of a stuck chain is low)
            esss[s].append(np.nan_to_num(within[s]["ess_bulk"], nan=0.0).sum(axis=1).reshape(size, -1))
    names = [n.item() if isinstance(n, np.generic) else n for n in res._data.client_coordinate()]
    halves = 2 * max(chains, 2)  # ArviZ splits each chain (one chain was split in two first)
    rows = []
    for s in chains_by_site:
        rhat, ess = np.concatenate(rhats[s]), np.concatenate(esss[s])
        limit = local_rhat_limit(ess, halves, num_clients * rhat.shape[1])
        ratio = rhat / limit
        c, j = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        bad = int(np.sum(np.any(ratio > 1, axis=1)))
        rows.append(
            _row(
                "local_rhat",
                s,
                rhat[c, j],
                limit[c, j],
                bad == 0,
                f"split R-hat of each client's {chains} local chain(s) x {n} draws: worst client "
                f"{names[c]!r} (bulk ESS {ess[c, j]:.0f}); {bad} of {num_clients} clients above "
                f"their threshold (1.01, or the R-hat that chance alone reaches at the client's ESS)",
            )
        )
    return rows


def _per_chain(draws: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``{site: (chain, draw, client, ...)}`` -> each chain's halves as two chains and the chains as a dim
    after ``client``: ``(2, draw // 2, client, chain, ...)``, for ESS within each chain."""
    out = {}
    for s, a in draws.items():
        half = a.shape[1] // 2
        b = a[:, : 2 * half].reshape((a.shape[0], 2, half) + a.shape[2:])  # (chain, 2, half, client, ...)
        out[s] = np.moveaxis(b, 0, 3)  # (2, half, client, chain, ...)
    return out


def local_rhat_limit(ess: Any, halves: int, tests: int) -> np.ndarray:
    """The R-hat threshold of many clients' chains: :data:`RHAT_MAX`, raised to what chance alone gives.

    For ``halves`` split chains at stationarity with n_eff = ESS / halves effective draws each, the
    between-half variance is W chi^2_{m-1} / ((m - 1) n_eff), so R-hat^2 - 1 ~ (chi^2_{m-1} / (m - 1) - 1) / n_eff.
    With hundreds of clients the largest R-hat of perfectly mixed chains of a few hundred effective
    draws exceeds 1.01 by chance; the limit is the upper NOISE_LEVEL / (2 ``tests``) quantile of that law
    (Bonferroni over clients and elements, and ArviZ's two R-hats, bulk and folded), or 1.01 if larger.
    """
    from scipy import stats

    m = max(int(halves), 2)
    q = float(stats.chi2.isf(NOISE_LEVEL / (2 * max(int(tests), 1)), m - 1)) / (m - 1)
    n_eff = np.maximum(np.asarray(ess, dtype=np.float64) / m, 1e-12)
    return np.maximum(RHAT_MAX, np.sqrt(1.0 + (q - 1.0) / n_eff))


def _privacy_rows(res: Any) -> list[dict[str, Any]]:
    """The ``privacy_noise`` row of a private point-estimate fit (see the module docstring)."""
    report = getattr(res, "privacy", None) or {}
    z = report.get("noise_multiplier")
    active = np.asarray(res.history.get("active", []), dtype=np.float64)
    if not isinstance(z, (int, float)) or not math.isfinite(z) or z <= 0 or not active.size:
        return []
    d = sum(int(np.size(v)) for v in res.params.values())
    window = max(MIN_ROUNDS, len(active) // 4)
    m = max(float(np.mean(active[-window:])), 1.0)
    per_round = z * math.sqrt(d) / m
    value = per_round / math.sqrt(window)
    note = (
        f"privacy noise on the cohort's mean update: z sqrt(d) / m = {z:.3g} x sqrt({d}) / {m:.3g} = "
        f"{per_round:.3g} clips per round, {value:.3g} averaged over the last {window} rounds, against a clipped "
        "signal of at most 1 clip"
    )
    return [_row("privacy_noise", JOINT, value, 1.0, value <= 1.0, note)]


def diagnose(res: Any) -> Any:
    """The convergence table of a fit (pandas DataFrame, columns :data:`COLUMNS`): every check that the
    fit's outputs allow (see the module docstring)."""
    import pandas as pd

    rows: list[dict[str, Any]] = []
    if res.global_samples:
        rows += _sampler_rows(res)
    else:
        frame = _symmetry_frame(res)  # the declared symmetry's tangents, once for both checks
        decrement = _decrement_rows(res, frame)
        rows += decrement
        rows += _trace_rows(res, bool(decrement), frame)
        rows += _statistic_rows(res)
        rows += _privacy_rows(res)
    rows += _local_rows(res)
    return pd.DataFrame(rows, columns=COLUMNS)


# ------------------------------------------------------------------------------ the warnings


def _fix(algorithm: str, check: str) -> str:
    if check == "privacy_noise":
        return (
            "more clients per round (clients_per_round: the noise on their mean falls as 1 / m), a smaller "
            "noise_multiplier (a larger epsilon), fewer global coordinates, or more rounds; the estimate is "
            "the privacy noise's, not the data's, until the signal can exceed it"
        )
    if check == "sd_inflation":
        return (
            "the step the note gives (the closed form's for 5% at the mode: step_scale for the automatic, "
            "preconditioned step, step_size for a given one), or compressors that keep more; more rounds do not "
            "narrow a step's stationary law"
        )
    if check == "local_rhat":
        return (
            "longer local chains after the last round: more num_samples, warmup or thinning (e.g. "
            "fb.FedSOUL(num_samples=1000, warmup=500)), or more num_chains to see it; with many local "
            "coordinates (a network's head) on the identity metric, local_metric='diagonal' (one gradient a "
            "round) or local_metric='dense' (chains whose directions have very different spreads mix at the "
            "pace of the narrowest)"
        )
    if algorithm in _SAMPLERS:
        return (
            "more num_rounds (more draws), a warmup that drops the chains' transient, or a smaller step_size "
            "if R-hat stays high; thinning does not raise the ESS"
        )
    if algorithm == "FedSOUL":
        return (
            "more num_rounds, a start nearer the optimum (init=res.params continues from this fit, or "
            "init='map'), or a larger server_lr; more local_steps lower the gradient's noise"
        )
    if algorithm in ("FedMM", "FedEM", "ParamAveragingEM"):
        return (
            "more num_rounds (EM converges linearly, slowly where much information is missing), a start "
            "nearer the optimum (init=res.params continues from this fit, or init='map'), or step_size=1.0 "
            "with full participation"
        )
    fix = (
        "more num_rounds, a start nearer the optimum (init=res.params continues from this fit), or a step "
        "that suits the curvature (step_size <= 1 / L)"
    )
    if algorithm == "FedAvg":
        fix += (
            "; FedAvg's fixed point is not the optimum when clients differ (client drift): fb.Scaffnew or "
            "fb.TAMUNA converge to it"
        )
    return fix


_POINT_CHECKS = ("newton_decrement", "trace", "rounds", "statistic_change")
_CRITERIA = {
    "newton_decrement": "the Newton decrement g' I^-1 g (squared distance to the optimum in standard errors)",
    "trace": "the drift of the estimate over the last quarter of the rounds",
    "rounds": "the number of rounds (too few to check the trace)",
    "statistic_change": "the EM statistic's extrapolated remaining change (relative)",
    "rhat": "split R-hat",
    "draws": "the number of draws",
    "ess_bulk": "the bulk effective sample size",
    "ess_tail": "the tail effective sample size",
    "local_rhat": "split R-hat of the clients' local chains",
    "privacy_noise": "the privacy noise against the clipped signal",
    "sd_inflation": "its widest stationary sd over the posterior's",
    "checks": "any check",
}


def messages(res: Any, table: Any) -> list[str]:
    """One message per failed check (its failing sites together): criterion, values against thresholds, fix."""
    failed = table[~table["ok"]]
    if failed.empty:
        return []
    point = any(c in _POINT_CHECKS for c in failed["check"])
    se_note = ""
    if point and (getattr(res, "standard_errors", None) or getattr(res, "global_approx", None)):
        se_note = (
            " The standard errors (res.standard_errors) and the normal approximation (res.idata's "
            "fed_normal_approx) were "
            "computed at this non-converged point and are not reliable."
        )
    out = []
    for check, rows in failed.groupby("check", sort=False):
        below = check.startswith("ess") or check in ("rounds", "draws")
        worst = rows.sort_values("value", ascending=below)
        items = "; ".join(
            f"{r.site}: {r.value:.4g} {'<' if below else '>'} {r.threshold:.4g}" for r in worst.head(5).itertuples()
        )
        more = f" (and {len(rows) - 5} more sites)" if len(rows) > 5 else ""
        note = worst.iloc[0]["note"]
        runaway = [r for r in worst.iloc[1:].itertuples() if _RUNAWAY_MARK in r.note]
        note += "".join(f"; {r.site} is{r.note[r.note.index(_RUNAWAY_MARK) + 1 :]}" for r in runaway)
        verb = "samples a law wider than the posterior, by" if check == "sd_inflation" else "has not converged by"
        out.append(
            f"{res.algorithm} {verb} {_CRITERIA.get(check, check)}: {items}{more} ({note}). "
            f"Fix: {_fix(res.algorithm, check)}.{se_note if check in _POINT_CHECKS else ''} "
            "res.diagnostics has the full table."
        )
    return out


def _stacklevel() -> int:
    """The stack level of the first frame outside the fedbayes package (the user's call)."""
    root = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
        frame, level = frame.f_back, level + 1
    return level


def report(res: Any) -> Any:
    """Compute ``res.diagnostics`` and emit one :class:`fb.ConvergenceWarning` per failed check.

    A check that cannot run on this fit's outputs does not lose the fit: the table gets one failed
    ``checks`` row saying why (so ``res.converged`` is False) and the warning says so."""
    try:
        table = res.diagnostics
    except Exception as err:
        import pandas as pd

        table = pd.DataFrame(
            [
                _row(
                    "checks",
                    JOINT,
                    float("nan"),
                    float("nan"),
                    False,
                    f"the convergence checks failed ({type(err).__name__}: {err}); convergence is unknown",
                )
            ],
            columns=COLUMNS,
        )
        res._diagnostics = table
    for message in messages(res, table):
        warnings.warn(message, ConvergenceWarning, stacklevel=_stacklevel())
    return table
