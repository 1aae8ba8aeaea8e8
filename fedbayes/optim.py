"""Server optimisers with optax's ``(init, update)`` interface, so an optax optimiser plugs in too.

Updates are *added* to the parameters and ``update`` receives the gradient of the quantity to
*minimise* (optax's convention); algorithms that maximise a log-density pass its negative gradient.
``lr`` may be a float or a schedule ``k -> lr_k`` of the step count k = 0, 1, ...
"""

from __future__ import annotations

from typing import Any, NamedTuple
from collections.abc import Callable

import jax
import jax.numpy as jnp

from .errors import ConfigError

Schedule = Callable[[jax.Array], jax.Array]


class GradientTransformation(NamedTuple):
    init: Callable[[Any], Any]
    update: Callable[..., tuple[Any, Any]]


def as_schedule(lr: float | Schedule, what: str = "learning rate") -> Schedule:
    """A constant or callable step size as a schedule ``k -> lr_k``; validates constants."""
    if callable(lr):
        return lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ConfigError(f"{what} must be a positive number or a callable k -> step, got {lr!r}")
    value = float(lr)
    return lambda k: jnp.asarray(value)


def polynomial_decay(lr0: float, power: float = 0.5, offset: float = 1.0) -> Schedule:
    """``lr_k = lr0 / (1 + k / offset)^power``: Robbins-Monro steps (sum infinite for power <= 1)."""
    as_schedule(lr0)
    return lambda k: lr0 / (1.0 + k / offset) ** power


def sgd(lr: float | Schedule) -> GradientTransformation:
    """Plain (stochastic-approximation) steps ``-lr_k * grad``."""
    schedule = as_schedule(lr)

    def init(params):
        return jnp.zeros((), jnp.int32)

    def update(grads, count, params=None):
        step = schedule(count)
        return jax.tree_util.tree_map(lambda g: -step * g, grads), count + 1

    return GradientTransformation(init, update)


class AdamState(NamedTuple):
    count: jax.Array  # type: ignore[assignment]  # field shadows tuple.count on purpose (optax's state layout)
    mu: Any
    nu: Any


def adam(lr: float | Schedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam (Kingma & Ba 2015) with bias correction."""
    schedule = as_schedule(lr)

    def init(params):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        return AdamState(jnp.zeros((), jnp.int32), zeros, zeros)

    def update(grads, state, params=None):
        count = state.count + 1
        mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
        nu = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
        c1, c2 = 1 - b1**count, 1 - b2**count
        step = schedule(state.count)
        updates = jax.tree_util.tree_map(lambda m, v: -step * (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
        return updates, AdamState(count, mu, nu)

    return GradientTransformation(init, update)


def resolve(optimizer: str | Any, lr: float | Schedule) -> Any:
    """``"sgd"``, ``"adam"`` or any object with optax's ``init`` / ``update``."""
    if isinstance(optimizer, str) and optimizer == "sgd":
        return sgd(lr)
    if isinstance(optimizer, str) and optimizer == "adam":
        return adam(lr)
    if hasattr(optimizer, "init") and hasattr(optimizer, "update"):
        return optimizer
    raise ConfigError(f"server_optimizer must be 'sgd', 'adam' or an optax GradientTransformation, got {optimizer!r}")


# ------------------------------------------------------------------------------ Fisher scoring
def newton_direction(
    information: jax.Array,
    grad: jax.Array,
    radius: float | jax.Array | None = None,
    floor: float = 1e-8,
    nonlinear: jax.Array | None = None,
    max_nonlinear_step: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The safeguarded Newton (Fisher-scoring) step ``delta`` of an ascent on l with gradient ``grad`` and
    (estimated) information ``information`` ~ -grad^2 l, and the Newton decrement of the full step.

    With D = diag(|I_jj|) (Jacobi scaling: the result does not depend on the units of the coordinates)
    and the eigendecomposition D^-1/2 I D^-1/2 = V diag(lambda) V^T, the curvature used is

        lambda_c = max(|lambda|, floor * max |lambda|)

    (negative eigenvalues, e.g. Monte Carlo noise in a nearly flat direction or a saddle, are taken by
    their size: the step still ascends, as in saddle-free Newton; ``floor`` bounds the condition
    number), I_c = D^1/2 V diag(lambda_c) V^T D^1/2 and the full step g -> I_c^-1 g. Its Newton
    decrement nu = sqrt(g^T I_c^-1 g) is the length of the step in the metric of the information, i.e.
    in standard-error units; the step is shortened to length ``radius`` in that metric when nu > radius
    (a trust region in the metric of I, so it is affine-invariant too):

        delta = min(1, radius / nu) I_c^-1 g   (radius None: no such bound).

    ``nonlinear`` marks the coordinates on which a constrained value depends non-linearly (the log of a
    scale, a logit): the step is shortened as a whole so that none of them moves by more than
    ``max_nonlinear_step`` (a log-scale changes by at most that factor's exponential per step). Such a
    coordinate is unit-free (the log of a scale only shifts when the data are rescaled), so the bound is
    too, while the quadratic model of a log-scale is poor far from the optimum: from a scale far above
    its estimate the full Newton step of log sigma is unbounded below.

    Every operation commutes with a rescaling of the coordinates (x -> S x, S diagonal) and a shift of the
    nonlinear ones, so raw and standardised units give the same iterates mapped into each other.
    Returns ``(delta, nu)``.
    """
    h = 0.5 * (information + information.T)
    dg = jnp.abs(jnp.diag(h))
    tiny = jnp.finfo(h.dtype).tiny
    s = jnp.where(dg > tiny, 1.0 / jnp.sqrt(jnp.where(dg > tiny, dg, 1.0)), 1.0)
    lam, vec = jnp.linalg.eigh(s[:, None] * h * s[None, :])
    lam = jnp.abs(lam)
    lam = jnp.maximum(lam, floor * jnp.max(lam) + tiny)
    gs = s * grad
    y = vec @ ((vec.T @ gs) / lam)
    nu = jnp.sqrt(jnp.maximum(jnp.dot(gs, y), 0.0))
    delta = s * y
    if radius is not None:
        delta = delta * jnp.minimum(1.0, radius / jnp.maximum(nu, tiny))
    if nonlinear is not None and max_nonlinear_step is not None:
        biggest = jnp.max(jnp.where(nonlinear, jnp.abs(delta), 0.0))
        delta = delta * jnp.minimum(1.0, max_nonlinear_step / jnp.maximum(biggest, tiny))
    return delta, nu
