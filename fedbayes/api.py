"""``fed_fit``: a NumPyro model of one client + federated data + an algorithm -> :class:`Result`."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import numpy as np

from .algorithms import ALGORITHMS
from .data import FederatedData
from .engine import Diverged, Problem, resolve_cohort_size, run_rounds
from .errors import ConfigError, DataError, DivergenceError, require_int
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


def _public(history: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The history without the private records (keys starting with "_", e.g. the samplers' raw draws)."""
    return {k: v for k, v in history.items() if not k.startswith("_")}


def _diverged(err: Diverged, run: Any, problem: Problem, fm: FedModel, data: FederatedData, seed: int,
              key: jax.Array) -> DivergenceError:
    """The user-facing error of a diverged fit, with the fit finalised at the last good round."""
    hint = getattr(getattr(run, "cfg", None), "divergence_hint", None)
    message = (f"{run.name} diverged: the global parameters became non-finite at round {err.round}. "
               + (f"Likely fixes: {hint}." if hint else _DEFAULT_HINT)
               + (f" err.result holds the fit at round {err.round - 1}, the last good one." if err.round else ""))
    result, history = None, _public(err.history)
    if err.round > 0:
        try:
            parts = run.finalize(key, err.carry, problem._replace(num_rounds=err.round), history=err.history)
            result = Result(model=fm, data=data, run=run, algorithm=run.name, seed=seed, parts=parts, history=history)
            if not all(np.all(np.isfinite(v)) for v in result.params.values()):
                result = None
        except Exception:  # noqa: BLE001 - an algorithm may need more rounds than were good to finalise
            result = None
    return DivergenceError(message, round=err.round, history=history, result=result)


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
    try:
        carry, history = run_rounds(run, problem, carry, base_key=k_rounds, cohort_size=cohort,
                                    chunk_size=chunk_size, progress=progress, stop_on_divergence=True)
    except Diverged as err:
        raise _diverged(err, run, problem, fm, data, seed, k_final) from None
    parts = run.finalize(k_final, carry, problem, history=history)
    return Result(model=fm, data=data, run=run, algorithm=run.name, seed=seed, parts=parts, history=_public(history))
