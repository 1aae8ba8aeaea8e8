"""A federated damped Newton method: the robust, scale-free MAP solver behind warm starts.

The problem, in the unconstrained coordinates x of the global sites,

    min_x F(x),   F(x) = -log p(x) - sum_i l_i(x),   l_i(x) = log p(D_i | x),

(``log p(x)`` with or without the Jacobian of the unconstraining maps). The prior is public, so the
server evaluates it and its derivatives itself; the clients evaluate their own log-likelihoods.

One iteration at the current point x_k (d <= ``DENSE_CURVATURE`` = 1000 coordinates):

    every client sends l_i(x_k), grad l_i(x_k) and the upper triangle of its Hessian,
    the server forms g = grad F(x_k), H = Hess F(x_k) and the Newton direction
        p = -(H + lambda I)^{-1} g,   lambda = 0 if H is positive definite, otherwise the
        Levenberg shift lambda = -lambda_min(H) + 1e-8 |lambda|_max (a descent direction),
    backtracking (Armijo): t = 1, 1/2, 1/4, ... until F(x_k + t p) <= F(x_k) + 1e-4 t g'p, each
        trial point broadcast and the clients' l_i(x_k + t p) sent back,
    x_{k+1} = x_k + t p.

F decreases at every accepted step, and F is exactly what the clients report, so no step size needs
a curvature bound. With H positive definite the iterates are affine invariant: a model written in
raw units (a coefficient near 250, a residual sd near 25) and its standardised version, started at
corresponding points, give corresponding iterates, and near the optimum the convergence is
quadratic. It stops when the Newton decrement g' (H + lambda I)^{-1} g, the squared distance to the
optimum in the metric of the curvature (standard-error units at a posterior mode), is below
``tol``, or after the step taken at a decrement below F's rounding error (64 eps |F|), or when no step
decreases F any more (rounding level).

Coordinates on which no client's likelihood depends (identically zero gradient and Hessian rows at
the start, e.g. a random-effect scale in the non-personalised model with every latent at its
population mean) can be frozen at their start (``freeze_unidentified=True``): their only term would
be the prior, whose mode (for a scale, often 0) is no sensible start.

Beyond ``DENSE_CURVATURE`` coordinates the clients send l_i and grad l_i only, and the server takes
gradient steps with the same backtracking (the step doubles after every accepted step and halves
until Armijo's condition holds): still monotone, but not scale-free.

The ledger (``bits = (up, down)``) counts every message at 32 bits a float: x to every client at
each trial point (d floats), a one-float accept flag after each accepted step, and from every client
its l_i at each trial point and (l_i, grad l_i, upper triangle of the Hessian) at each new iterate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..protocol import FLOAT_BITS, ClientData

DENSE_CURVATURE = 1000
"""Up to this many coordinates the clients send their Hessians (Newton); beyond, gradients only."""


@dataclass
class NewtonResult:
    """The outcome of :func:`federated_newton`.

    ``x``: the minimiser (flat, unconstrained); ``value``: F(x); ``gradient``: grad F(x);
    ``hessian``: Hess F(x) (d x d; None beyond ``DENSE_CURVATURE``); ``decrement``: the Newton
    decrement g' (H + lambda I)^{-1} g at x (the squared gradient norm beyond ``DENSE_CURVATURE``);
    ``iterations``; ``converged`` (decrement below ``tol``); ``bits``: ``(up, down)``; ``frozen``:
    the coordinates held at their start.
    """

    x: jax.Array
    value: float
    gradient: jax.Array
    hessian: jax.Array | None
    decrement: float
    iterations: int
    converged: bool
    bits: tuple[int, int]
    frozen: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))


def _sums(loglik: Callable[[jax.Array, ClientData], jax.Array], dense: bool):
    """Sum over clients of (l_i, grad l_i[, Hess l_i]) at x: a scan (memory of one client's Hessian)."""

    def one(x, client):
        if dense:
            value, grad = jax.value_and_grad(loglik)(x, client)
            return value, grad, jax.hessian(loglik)(x, client)
        value, grad = jax.value_and_grad(loglik)(x, client)
        return value, grad

    def total(x, clients):
        first = jax.tree_util.tree_map(lambda a: a[0], clients)
        zero = jax.tree_util.tree_map(jnp.zeros_like, jax.eval_shape(one, x, first))

        def body(acc, client):
            return jax.tree_util.tree_map(jnp.add, acc, one(x, client)), None

        return jax.lax.scan(body, zero, clients)[0]

    return jax.jit(total)


def federated_newton(
    loglik: Callable[[jax.Array, ClientData], jax.Array],
    log_prior: Callable[[jax.Array], jax.Array],
    x0: jax.Array,
    clients: ClientData,
    *,
    max_iter: int = 100,
    tol: float = 1e-20,
    freeze_unidentified: bool = False,
    dense_max: int = DENSE_CURVATURE,
) -> NewtonResult:
    """Minimise F(x) = -log_prior(x) - sum_i loglik(x, client_i) from ``x0`` (see the module docstring).

    ``loglik(x, client)`` is one client's log-likelihood at flat unconstrained x; ``clients`` are
    stacked on a leading axis. The loop runs on the host: each iteration is one exchange of
    curvature and a few exchanges of objective values (the line search).
    """
    x = jnp.asarray(x0)
    d = int(x.size)
    n = int(clients.index.shape[0])
    dense = d <= dense_max
    sums = _sums(loglik, dense)
    values = jax.jit(lambda x, cl: jnp.sum(jax.vmap(loglik, in_axes=(None, 0))(x, cl)))
    prior_f = jax.jit(log_prior)
    prior_g = jax.jit(jax.grad(log_prior))
    prior_h = jax.jit(jax.hessian(log_prior)) if dense else None
    up = down = 0
    per_iterate = FLOAT_BITS * (1 + d + (d * (d + 1) // 2 if dense else 0))

    def evaluate(x):
        """F, grad F, Hess F at x (clients' sums plus the server's prior)."""
        parts = sums(x, clients)
        f = -(float(parts[0]) + float(prior_f(x)))
        g = -(parts[1] + prior_g(x))
        h = -(parts[2] + prior_h(x)) if dense else None
        return f, g, h, parts

    down += n * FLOAT_BITS * d  # x_0 to every client
    up += n * per_iterate
    f, g, h, parts = evaluate(x)
    frozen = np.zeros(d, bool)
    if freeze_unidentified:
        lik_g = np.asarray(parts[1])
        lik_h = np.asarray(parts[2]) if dense else None
        frozen = (lik_g == 0) & (np.all(lik_h == 0, axis=1) if dense else True)
    free = jnp.asarray(~frozen)
    step = 1.0  # gradient descent's step (beyond dense_max), adapted
    decrement, iterations, converged = float("inf"), 0, False
    for iterations in range(1, max_iter + 1):  # noqa: B007 (the count is reported after the loop)
        if not np.isfinite(f):
            break
        g = jnp.where(free, g, 0.0)
        if dense:
            hm = jnp.where(free[:, None] & free[None, :], h, 0.0) + jnp.diag(jnp.where(free, 0.0, 1.0))
            hm = 0.5 * (hm + hm.T)
            ev, vecs = np.linalg.eigh(np.asarray(hm))
            scale = max(float(np.max(np.abs(ev))), np.finfo(ev.dtype).tiny)
            shift = 0.0 if ev[0] > 1e-10 * scale else -ev[0] + 1e-8 * scale
            coef = (vecs.T @ np.asarray(g)) / (ev + shift)
            p = jnp.where(free, -jnp.asarray(vecs @ coef), 0.0)  # a degenerate eigenspace may mix in frozen ones
            decrement = float(np.dot(np.asarray(g), -np.asarray(p)))
            t = 1.0
        else:
            p = -g
            decrement = float(jnp.dot(g, g))
            t = step
        rounding = 64 * float(jnp.finfo(x.dtype).eps) * max(1.0, abs(f))  # F's rounding error, about
        if decrement <= tol:
            converged = True
            break
        last = decrement <= rounding  # quadratic convergence: after this step the decrement is ~ its square
        slope = float(jnp.dot(g, p))
        accepted = False
        for _ in range(60):
            trial = x + t * p
            down += n * FLOAT_BITS * d
            up += n * FLOAT_BITS
            f_trial = -(float(values(trial, clients)) + float(prior_f(trial)))
            if np.isfinite(f_trial) and f_trial <= f + 1e-4 * t * slope:
                accepted = True
                break
            t *= 0.5
        if not accepted or float(jnp.max(jnp.abs(t * p))) == 0.0:
            # no decrease at rounding level: x is the minimiser to working precision
            converged = decrement <= 1e3 * rounding
            break
        x = trial
        down += n * FLOAT_BITS  # the accept flag
        up += n * per_iterate
        f, g, h, parts = evaluate(x)
        step = 2.0 * t
        if last and dense:
            converged = True
            break
    g = jnp.where(free, g, 0.0)
    return NewtonResult(
        x=x,
        value=f,
        gradient=g,
        hessian=h,
        decrement=decrement,
        iterations=iterations,
        converged=converged,
        bits=(int(up), int(down)),
        frozen=frozen,
    )


__all__ = ["DENSE_CURVATURE", "NewtonResult", "federated_newton"]
