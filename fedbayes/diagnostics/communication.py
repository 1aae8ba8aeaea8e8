"""Convergence against communication: error or objective per round, per bit up and per bit down.

From a result's ``history`` (the per-round ledger ``bits_up`` / ``bits_down`` and the trajectory
``theta/<site>``), for one fit or several on one table:

    error_t = || theta_t - theta_ref || / || theta_ref ||   (all sites of ``reference`` stacked)

or a user function of the round's parameters, or the history's ``objective``. Cumulative bits count
the one-off initial messages (``res.init_bits``) in round 0, so methods with costly starts are not
flattered. A final exchange after the last round (``res.final_bits``: FedSOUL's personal posteriors,
FedMM's information pass) buys no error along the path and is left out of the curves; ``res.bits_up``
and ``res.bits_down`` include it.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable, Mapping

import numpy as np

from ..errors import ConfigError, DataError


def _as_named(results: Any) -> dict[str, Any]:
    from ..result import Result

    if isinstance(results, Result):
        return {results.algorithm: results}
    if isinstance(results, Mapping) and results and all(isinstance(r, Result) for r in results.values()):
        return dict(results)
    raise DataError("results must be a Result or a non-empty dict {name: Result}")


def _trajectory(res: Any) -> dict[str, np.ndarray]:
    return {k[len("theta/") :]: v for k, v in res.history.items() if k.startswith("theta/")}


def _error_curve(res: Any, reference: Mapping[str, Any] | None, error: Callable | None) -> np.ndarray:
    traj = _trajectory(res)
    rounds = len(res.history["bits_up"])
    if error is not None:
        if not traj:
            raise DataError(f"{res.algorithm} records no parameter trajectory (theta/<site>) for error()")
        return np.array([float(error({k: v[t] for k, v in traj.items()})) for t in range(rounds)])
    if reference is not None:
        missing = [k for k in reference if k not in traj]
        if missing:
            raise DataError(f"{res.algorithm} records no trajectory of {missing}; it has {sorted(traj)}")
        diff = np.concatenate([(traj[k] - np.asarray(v)[None]).reshape(rounds, -1) for k, v in reference.items()], 1)
        scale = np.sqrt(sum(np.sum(np.asarray(v, dtype=np.float64) ** 2) for v in reference.values()))
        return np.linalg.norm(diff, axis=1) / (scale if scale > 0 else 1.0)
    if "objective" in res.history:
        return np.asarray(res.history["objective"], dtype=np.float64)
    raise ConfigError(
        "give reference={site: value} or error=fn(params), or fit with an algorithm that records an objective"
    )


def communication_table(
    results: Any,
    *,
    reference: Mapping[str, Any] | None = None,
    error: Callable[[dict[str, np.ndarray]], float] | None = None,
    every: int = 1,
) -> Any:
    """Long table (pandas DataFrame) of convergence against communication, one row per method and round.

    ``results``: a Result or ``{name: Result}``. The ``error`` column is the relative distance of the
    round's parameters to ``reference`` ``{site: value}``, or ``error(params)`` of the round's
    constrained parameters ``{site: array}``, or the recorded ``objective``. ``bits_up`` / ``bits_down``
    are cumulative (initial messages included), ``every`` keeps every n-th round (and the last).
    """
    import pandas as pd

    if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 1:
        raise ConfigError(f"every must be a positive integer, got {every!r}")
    frames = []
    for name, res in _as_named(results).items():
        err = _error_curve(res, reference, error)
        up = np.cumsum(res.history["bits_up"], dtype=np.int64) + res.init_bits[0]
        down = np.cumsum(res.history["bits_down"], dtype=np.int64) + res.init_bits[1]
        keep = np.unique(np.append(np.arange(0, len(err), every), len(err) - 1))
        frames.append(
            pd.DataFrame(
                {"method": name, "round": keep + 1, "bits_up": up[keep], "bits_down": down[keep], "error": err[keep]}
            )
        )
    return pd.concat(frames, ignore_index=True)


def communication_to_reach(table: Any, tolerance: float) -> Any:
    """First round and cumulative bits at which each method's error falls to ``tolerance`` (NaN: never)."""
    import pandas as pd

    rows = []
    for name, t in table.groupby("method", sort=False):
        hit = t[t["error"] <= tolerance]
        first = hit.iloc[0] if len(hit) else None
        rows.append(
            {
                "method": name,
                "round": np.nan if first is None else int(first["round"]),
                "bits_up": np.nan if first is None else int(first["bits_up"]),
                "bits_down": np.nan if first is None else int(first["bits_down"]),
            }
        )
    return pd.DataFrame(rows).set_index("method")
