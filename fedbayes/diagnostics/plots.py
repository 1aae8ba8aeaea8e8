"""Plots of the diagnostics (matplotlib; ``pip install fedbayes[plot]``). Headless-safe: pass ``path``
to save a PNG (the Agg backend needs no display). Each plot draws data from a tested function of
this package, so what a figure shows is what the tables report.
"""

from __future__ import annotations

import os
from typing import Any
from collections.abc import Mapping

import numpy as np

from ..errors import DataError, FedbayesError
from .calibration import expected_calibration_error, pav_reliability, pit, reliability_diagram
from .communication import communication_table


def _pyplot():
    try:
        import matplotlib

        if os.environ.get("MPLBACKEND") is None and not os.environ.get("DISPLAY"):
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FedbayesError("plots need matplotlib: pip install 'fedbayes[plot]'") from None
    return plt


def _axes(ax: Any, ncols: int = 1, size: tuple[float, float] = (4.5, 4.0)):
    plt = _pyplot()
    if ax is not None:
        return ax.figure, np.atleast_1d(ax)
    fig, axes = plt.subplots(1, ncols, figsize=(size[0] * ncols, size[1]), squeeze=False)
    return fig, axes[0]


def _finish(fig: Any, path: str | os.PathLike | None) -> Any:
    if path is not None:
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        fig.savefig(path, dpi=120, bbox_inches="tight")
    return fig


def _named(x: Any) -> dict[str, Any]:
    return dict(x) if isinstance(x, Mapping) else {"": x}


def plot_reliability(
    probs: Any,
    labels: Any,
    *,
    n_bins: int = 15,
    strategy: str = "uniform",
    pav: bool = True,
    ax: Any = None,
    path: str | os.PathLike | None = None,
) -> Any:
    """Top-label reliability diagram: bin accuracy against bin confidence (markers sized by bin count)
    and, with ``pav``, the binning-free PAV (CORP) curve; the diagonal is perfect calibration.

    ``probs`` (N, K) or ``{name: probs}`` to overlay several models; the legend gives each ECE.
    Data: :func:`reliability_diagram`, :func:`pav_reliability`. Returns the figure.
    """
    fig, (ax,) = _axes(ax)
    ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--", label="perfect calibration")
    for i, (name, p) in enumerate(_named(probs).items()):
        colour = f"C{i}"
        rel = reliability_diagram(p, labels, n_bins, strategy)
        nz = rel["count"] > 0
        ece = expected_calibration_error(p, labels, n_bins, strategy)
        size = 15 + 200 * rel["count"][nz] / rel["count"].sum()
        ax.scatter(
            rel["confidence"][nz],
            rel["accuracy"][nz],
            s=size,
            color=colour,
            alpha=0.8,
            label=f"{name + ': ' if name else ''}bins (ECE {ece:.3f})",
        )
        if pav:
            curve = pav_reliability(p, labels)
            ax.step(
                curve["confidence"],
                curve["calibrated"],
                where="post",
                color=colour,
                lw=1.5,
                label=f"{name + ': ' if name else ''}PAV",
            )
    ax.set(xlabel="confidence (max probability)", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1.02), title="reliability")
    ax.legend(fontsize=7, loc="lower right")
    return _finish(fig, path)


def plot_score_histograms(
    scores: Any,
    *,
    bins: int = 30,
    xlabel: str = "predictive entropy",
    ax: Any = None,
    path: str | os.PathLike | None = None,
) -> Any:
    """Histograms of an OOD score on in- and out-of-distribution inputs, one panel per method:
    ``scores`` is ``(in, out)`` or ``{name: (in, out)}`` (e.g. :func:`predictive_entropy` values)."""
    named = _named(scores)
    for name, pair in named.items():
        if len(pair) != 2:
            raise DataError(f"scores for {name or 'the fit'} must be a pair (in-distribution, OOD)")
    fig, axes = _axes(ax, len(named))
    for a, (name, (s_in, s_out)) in zip(axes, named.items()):
        s_in, s_out = np.ravel(s_in), np.ravel(s_out)
        edges = np.histogram_bin_edges(np.concatenate([s_in, s_out]), bins=bins)
        a.hist(s_in, edges, density=True, alpha=0.6, label="in-distribution")
        a.hist(s_out, edges, density=True, alpha=0.6, label="OOD")
        a.set(xlabel=xlabel, ylabel="density", title=name or None)
        a.legend(fontsize=8)
    return _finish(fig, path)


def plot_pit(draws: Any, y: Any, *, bins: int = 20, ax: Any = None, path: str | os.PathLike | None = None) -> Any:
    """Histogram of PIT values (:func:`pit`) with the 99% band of a uniform histogram (binomial counts
    per bin): bars outside the band suggest miscalibration (U shape: over-confident; hump: under-)."""
    from math import comb

    u = pit(draws, y)
    n = u.size
    fig, (ax,) = _axes(ax)
    ax.hist(u, bins=bins, range=(0, 1), color="C0", alpha=0.8)
    cdf = (
        np.cumsum([comb(n, k) * (1 / bins) ** k * (1 - 1 / bins) ** (n - k) for k in range(n + 1)])
        if n <= 1000
        else None
    )
    if cdf is not None:
        lo, hi = int(np.searchsorted(cdf, 0.005)), int(np.searchsorted(cdf, 0.995))
    else:  # normal approximation of the binomial
        m, s = n / bins, np.sqrt(n * (1 / bins) * (1 - 1 / bins))
        lo, hi = m - 2.576 * s, m + 2.576 * s
    ax.axhspan(lo, hi, color="0.85", zorder=0, label="99% band (uniform)")
    ax.axhline(n / bins, color="0.5", lw=1)
    ax.set(xlabel="PIT", ylabel="count", xlim=(0, 1), title="probability integral transform")
    ax.legend(fontsize=8)
    return _finish(fig, path)


def plot_communication(
    results: Any,
    *,
    reference: Mapping[str, Any] | None = None,
    error: Any = None,
    logy: bool = True,
    path: str | os.PathLike | None = None,
) -> Any:
    """Error against rounds, cumulative bits up and cumulative bits down, every method on the same
    three panels (data: :func:`communication_table`). ``results``: a Result, ``{name: Result}``, or a
    table from :func:`communication_table`."""
    import pandas as pd

    table = (
        results if isinstance(results, pd.DataFrame) else communication_table(results, reference=reference, error=error)
    )
    fig, axes = _axes(None, 3, (4.2, 3.6))
    for name, t in table.groupby("method", sort=False):
        for a, col in zip(axes, ("round", "bits_up", "bits_down")):
            a.plot(t[col], t["error"], label=name)
    for a, xlabel in zip(axes, ("rounds", "bits up (cumulative)", "bits down (cumulative)")):
        a.set(xlabel=xlabel, ylabel="error")
        if logy:
            a.set_yscale("log")
        if xlabel != "rounds":
            a.set_xscale("log")
    axes[0].legend(fontsize=8)
    return _finish(fig, path)


def plot_fit(
    res: Any,
    *,
    sites: Any = None,
    max_coords: int = 10,
    path: str | os.PathLike | None = None,
) -> Any:
    """A fit in one figure: the trajectory of each global site over the rounds (``res.history["theta/<site>"]``;
    the first ``max_coords`` coordinates of a larger site, the reported estimate ``res.params`` dashed
    in the same colour), the objective per round where the algorithm reports a finite one
    (``history["objective"]``: FedSOUL's and FedMM's complete-data log-likelihood, TAMUNA's log
    posterior), and the cumulative bits up and down over the rounds (``history["bits_up"]`` /
    ``["bits_down"]``; the set-up and final exchanges are in the title). Every line is the history's
    values as they are. ``sites``: the global sites to show (default: all)."""
    history = res.history
    names = [k[len("theta/") :] for k in history if k.startswith("theta/")]
    if sites is not None:
        wanted = [sites] if isinstance(sites, str) else list(sites)
        unknown = [s for s in wanted if s not in names]
        if unknown:
            raise DataError(f"plot_fit: no trajectory for {unknown}; the fit's global sites are {names}")
        names = wanted
    objective = np.asarray(history.get("objective", []), dtype=np.float64)
    show_objective = objective.size > 0 and bool(np.any(np.isfinite(objective)))
    panels = len(names) + show_objective + 1
    ncols = min(3, panels)
    nrows = -(-panels // ncols)
    plt = _pyplot()
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    axes = axes.ravel()
    for a in axes[panels:]:
        a.set_visible(False)
    for a, name in zip(axes, names):
        trace = np.asarray(history[f"theta/{name}"], dtype=np.float64)
        rounds = np.arange(1, trace.shape[0] + 1)
        flat = trace.reshape(trace.shape[0], -1)
        estimate = np.asarray(res.params.get(name, np.full(flat.shape[1:], np.nan)), dtype=np.float64).reshape(-1)
        for j in range(min(max_coords, flat.shape[1])):
            (line,) = a.plot(rounds, flat[:, j], lw=1, label=f"{name}[{j}]" if flat.shape[1] > 1 else name)
            if j < estimate.size:
                a.axhline(estimate[j], color=line.get_color(), ls="--", lw=0.8)
        shown = "" if flat.shape[1] <= max_coords else f" (first {max_coords} of {flat.shape[1]})"
        a.set(xlabel="round", ylabel=name, title=f"{name}{shown}")
        if 1 < flat.shape[1] <= 6:
            a.legend(fontsize=7)
    k = len(names)
    if show_objective:
        a = axes[k]
        a.plot(np.arange(1, objective.size + 1), objective, lw=1)
        a.set(xlabel="round", ylabel="objective", title="objective per round")
        k += 1
    a = axes[k]
    up = np.cumsum(np.asarray(history.get("bits_up", []), dtype=np.float64))
    down = np.cumsum(np.asarray(history.get("bits_down", []), dtype=np.float64))
    a.plot(np.arange(1, up.size + 1), up, label="up")
    a.plot(np.arange(1, down.size + 1), down, label="down")
    a.set(
        xlabel="round",
        ylabel="bits (cumulative)",
        title=f"set-up {res.init_bits[0]:,} / {res.init_bits[1]:,} bits, "
        f"final {res.final_bits[0]:,} / {res.final_bits[1]:,}",
    )
    a.title.set_fontsize(8)
    a.legend(fontsize=8)
    fig.suptitle(f"{res.algorithm}: {up.size} rounds, {'converged' if res.converged else 'NOT converged'}")
    fig.tight_layout()
    return _finish(fig, path)


# ----------------------------------------------------------------------------- ArviZ's own plots


def _arviz_fig(out: Any) -> Any:
    if hasattr(out, "savefig"):  # ArviZ 1.x PlotCollection
        return out
    return np.ravel(out)[0].figure  # ArviZ 0.x: matplotlib axes


def _save_arviz(out: Any, path: str | os.PathLike | None) -> Any:
    fig = _arviz_fig(out)
    if path is not None:
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        fig.savefig(path)
    return fig


def plot_arviz_pit(data: Any, *, path: str | os.PathLike | None = None, **kwargs: Any) -> Any:
    """ArviZ's PIT plot of the posterior predictive against the observed data (``res.extend_idata()``):
    ``plot_ppc_pit`` (PIT ECDF with simultaneous band) on ArviZ 1.x, ``plot_bpv(kind="u_value")`` on 0.x."""
    from ..arviz_adapter import ARVIZ_1, az
    from ..result import Result

    _pyplot()
    idata = data.idata if isinstance(data, Result) else data
    out = az.plot_ppc_pit(idata, **kwargs) if ARVIZ_1 else az.plot_bpv(idata, kind="u_value", **kwargs)
    return _save_arviz(out, path)


def plot_arviz_pava(
    data: Any, *, data_type: str = "categorical", path: str | os.PathLike | None = None, **kwargs: Any
) -> Any:
    """PAV-adjusted calibration of a discrete posterior predictive: ArviZ's ``plot_ppc_pava`` on ArviZ
    1.x. ArviZ 0.x has none; there the top-label PAV reliability of the posterior predictive class
    frequencies is drawn by :func:`plot_reliability` instead."""
    from ..arviz_adapter import ARVIZ_1, az, group
    from ..result import Result

    _pyplot()
    idata = data.idata if isinstance(data, Result) else data
    if ARVIZ_1:
        return _save_arviz(az.plot_ppc_pava(idata, data_type=data_type, **kwargs), path)
    pp, obs = group(idata, "posterior_predictive"), group(idata, "observed_data")
    name = next(iter(obs.data_vars))
    y = np.asarray(obs[name].values).astype(np.int64)
    draws = np.asarray(pp[name].values).reshape(-1, y.size).astype(np.int64)
    k = int(max(draws.max(), y.max())) + 1
    probs = np.stack([(draws == c).mean(0) for c in range(k)], axis=1)
    return plot_reliability(probs, y, path=path)
