"""Warm starts shared by every algorithm: ``init=`` values, a previous fit, or ``"map"``.

``init="map"`` is the federated damped Newton MAP of the global sites (:func:`map_estimate`, from
:mod:`fedbayes.algorithms.newton`), the classic warm start of a personalised model from the global one
(models with local latents: the non-personalised model, every latent at its population mean). The
samplers also start their chains at the mode it finds (:func:`map_solve`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from ..engine import stack_clients
from ..errors import ConfigError
from ..introspect import FedModel
from ..protocol import ClientData, Problem
from .newton import NewtonResult, federated_newton


def check_init(init: Any, who: str) -> None:
    """Refuse at configuration time an ``init`` that :func:`resolve_init` cannot use."""
    if init is None or isinstance(init, Mapping) or (isinstance(init, str) and init in ("map", "prior")):
        return
    if isinstance(getattr(init, "params", None), Mapping) and hasattr(init, "history"):
        return
    raise ConfigError(
        f"{who} init must be None, a dict of constrained values, a fit Result, 'map' or 'prior', got {init!r}"
    )


def resolve_init(init: Any, problem: Problem, *, jacobian: bool = False) -> Mapping[str, Any] | None:
    """Initial constrained values from ``init``: None or ``"prior"`` (the deterministic start, each prior's
    centre), a dict, a previous ``Result`` (its ``params``), or ``"map"`` (:func:`map_estimate`: the
    federated Newton MAP on the same model and data)."""
    check_init(init, "")
    if init is None or init == "prior":
        return None
    if isinstance(init, Mapping):
        return init
    if isinstance(init, str):
        return map_estimate(problem, jacobian=jacobian)
    return {k: np.asarray(v) for k, v in init.params.items()}


def map_objective(fm: FedModel, *, jacobian: bool = False):
    """``(loglik, log_prior, unravel)`` of the MAP problem over the flat unconstrained globals x:
    ``loglik(x, client)`` is the client's log-likelihood (models with local latents: the
    non-personalised model, every latent at its population mean), ``log_prior(x)`` the global prior
    (with the Jacobian of the unconstraining maps when ``jacobian``)."""
    _, unravel = ravel_pytree(fm.init_globals(None))

    def loglik(x: jax.Array, client: ClientData) -> jax.Array:
        theta = unravel(x)
        if fm.local_names:
            return fm.client_loglik_population(theta, client.data, client.mask)
        return fm.client_log_terms(theta, {}, client.data, client.mask)[1]

    def log_prior(x: jax.Array) -> jax.Array:
        return fm.log_prior(unravel(x), jacobian=jacobian)

    return loglik, log_prior, unravel


@dataclass
class MapSolution(NewtonResult):
    """The :class:`~fedbayes.algorithms.newton.NewtonResult` of :func:`map_solve`, with ``unravel``: the flat
    unconstrained ``x`` -> the pytree of the global sites."""

    unravel: Callable[[jax.Array], Any] = dataclasses.field(kw_only=True)


def map_solve(
    problem: Problem, *, jacobian: bool = False, init: Mapping[str, Any] | None = None, max_iter: int = 100
) -> MapSolution:
    """The MAP of the global sites by the federated damped Newton method
    (:func:`fedbayes.algorithms.newton.federated_newton`, every client at every iteration), from the
    deterministic start moved off a saddle (:meth:`FedModel.off_saddle`), or from the constrained values
    ``init``. Models with local latents: the non-personalised model, latents at their population mean;
    coordinates it does not depend on (a random-effect scale) stay at their start. Returns the
    :class:`~fedbayes.algorithms.newton.NewtonResult` (unconstrained flat ``x``, ``bits`` of the exchanges)
    with ``unravel`` (a :class:`MapSolution`)."""
    fm: FedModel = problem.model
    loglik, log_prior, unravel = map_objective(fm, jacobian=jacobian)
    x0 = ravel_pytree(fm.off_saddle(fm.init_globals(None, init), fixed=tuple(init or ())))[0]
    out = federated_newton(
        loglik, log_prior, x0, stack_clients(problem.data), max_iter=max_iter, freeze_unidentified=bool(fm.local_names)
    )
    fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    return MapSolution(**fields, unravel=unravel)


def map_estimate(
    problem: Problem, *, jacobian: bool = False, num_rounds: int = 300, seed: int = 0
) -> dict[str, np.ndarray]:
    """Constrained MAP of the global sites by :func:`map_solve` (federated damped Newton, every client
    at every iteration; scale-free and monotone, see :mod:`fedbayes.algorithms.newton`). Models with
    local latents: the non-personalised model, latents at their population mean, and coordinates it
    does not depend on (a random-effect scale) kept at their start. ``num_rounds`` caps the Newton
    iterations (at 100); ``seed`` is unused (the solver is deterministic), kept for compatibility.
    Raises ``ConfigError`` if the objective is not finite at the start or the solution."""
    del seed
    fm: FedModel = problem.model
    out = map_solve(problem, jacobian=jacobian, max_iter=max(1, min(int(num_rounds), 100)))
    if not (bool(jnp.all(jnp.isfinite(out.x))) and np.isfinite(out.value)):
        raise ConfigError(
            "the MAP warm start ('map') found no finite objective: the model's log-density is not "
            "finite at its start; pass init= a dict of constrained starting values"
        )
    return {k: np.asarray(v) for k, v in fm.constrain(out.unravel(out.x)).items()}
