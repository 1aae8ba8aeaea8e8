"""Server optimisers with optax's ``(init, update)`` interface, so an optax optimiser plugs in too.

Updates are *added* to the parameters and ``update`` receives the gradient of the quantity to
*minimise* (optax's convention); algorithms that maximise a log-density pass its negative gradient.
``lr`` may be a float or a schedule ``k -> lr_k`` of the step count k = 0, 1, ...
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

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
    count: jax.Array
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
