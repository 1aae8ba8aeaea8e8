"""``fed_fit``: a NumPyro model of one client + federated data + an algorithm -> :class:`Result`."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import numpy as np

from .algorithms import ALGORITHMS
from .data import FederatedData
from .engine import Problem, resolve_cohort_size, run_rounds
from .errors import ConfigError, DataError, FedbayesError, require_int
from .model import FedModel
from .result import Result


def _resolve_algorithm(algorithm: Any) -> Any:
    if isinstance(algorithm, str):
        key = algorithm.lower().replace("_", "-")
        if key not in ALGORITHMS:
            raise ConfigError(f"unknown algorithm '{algorithm}'; choose one of {sorted(ALGORITHMS)} or pass an instance")
        return ALGORITHMS[key]()
    if not hasattr(algorithm, "build"):
        raise ConfigError(f"algorithm must be a name or an algorithm instance such as fb.FedSOUL(), got {algorithm!r}")
    return algorithm


_DEFAULT_HINT = ("The likely cause is a step size: lower the Langevin step_size (or leave it None for the per-client "
                 "automatic step) or the server_lr.")


def _check_finite(history: dict[str, np.ndarray], name: str, hint: str | None = None) -> None:
    """Refuse a diverged fit with the round where the global parameters stopped being finite."""
    bad = np.zeros(len(history.get("bits_up", [])), bool)
    for key, values in history.items():
        if key.startswith(("theta/", "_sample")):
            bad |= ~np.all(np.isfinite(values.reshape(len(values), -1)), axis=1)
    if bad.any():
        raise FedbayesError(
            f"{name} diverged: the global parameters became non-finite at round {int(np.argmax(bad))}. "
            + (f"Likely fixes: {hint}." if hint else _DEFAULT_HINT)
        )


def fed_fit(
    model: Callable,
    data: FederatedData | Mapping[str, Any],
    algorithm: Any = "fedsoul",
    *,
    num_rounds: int = 500,
    clients_per_round: int | float | None = None,
    seed: int = 0,
    model_kwargs: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    chunk_size: int = 50,
) -> Result:
    """Fit ``model`` (a NumPyro model of one client's data) across the clients of ``data``.

    Parameters
    ----------
    model:
        Called as ``model(**client_data, **model_kwargs)``. Sites under ``fb.local()`` are per-client
        latents; other sample sites are global parameters with priors; ``param`` sites are global
        parameters without prior.
    data:
        ``fb.FederatedData`` (or a dict of per-client lists, converted).
    algorithm:
        An instance such as ``fb.FedSOUL(local_steps=10)`` or ``fb.DELF(uplink=fb.compress.top_k(5))``,
        or a name (``"fedsoul"``, ``"lmc"``, ``"d-elf"``, ``"p-elf"``, ``"b-elf"``) for the defaults.
    num_rounds:
        Communication rounds.
    clients_per_round:
        Cohort size per round: an int, a fraction in (0, 1], or None for all clients.
    seed:
        The fit is a deterministic function of ``seed`` on a given machine.
    progress:
        Show a progress line (default: only when stderr is a terminal).
    chunk_size:
        Rounds per compiled ``lax.scan`` chunk (progress is reported between chunks).
    """
    if not isinstance(data, FederatedData):
        if isinstance(data, Mapping):
            data = FederatedData(data)
        else:
            raise DataError(f"data must be fb.FederatedData or a dict of per-client lists, got {type(data).__name__}")
    for what, value, low in (("num_rounds", num_rounds, 1), ("seed", seed, 0), ("chunk_size", chunk_size, 1)):
        require_int(value, what, low)
    algo = _resolve_algorithm(algorithm)
    cohort = resolve_cohort_size(clients_per_round, data.num_clients)
    fm = FedModel(model, data, model_kwargs)
    problem = Problem(fm, data, int(num_rounds), cohort)
    run = algo.build(problem)
    k_init, k_rounds, k_final = jax.random.split(jax.random.PRNGKey(seed), 3)
    carry = run.init(k_init, problem)
    carry, history = run_rounds(run, problem, carry, base_key=k_rounds, cohort_size=cohort,
                                chunk_size=chunk_size, progress=progress)
    _check_finite(history, run.name, getattr(run.cfg, "divergence_hint", None) if hasattr(run, "cfg") else None)
    parts = run.finalize(k_final, carry, problem, history=history)
    history = {k: v for k, v in history.items() if not k.startswith("_")}  # private records (raw draws)
    return Result(model=fm, data=data, run=run, algorithm=run.name, seed=seed, parts=parts, history=history)
