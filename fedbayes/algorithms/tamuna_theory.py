"""TAMUNA's compression masks and the theory of its parameters (Condat, Agarsky, Malinovsky, Richtarik,
"TAMUNA: doubly accelerated federated learning with local training, compression, and partial
participation"): the paper's fixed (d x c) pattern of s holders per coordinate permuted each round
(Figure 1), the server's aggregate of masked iterates, Theorems 1 and 3's rate, largest eta and
recommended p and s (pure functions of sizes and constants), and the condition estimates they need
(the clients' extreme Hessian eigenvalues, the preconditioner S). The run
(:mod:`fedbayes.algorithms.tamuna`) uses them and re-exports them as ``fb.tamuna.*``.
"""

from __future__ import annotations

import math
import numbers
from typing import Any
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from ..engine import stack_clients
from ..errors import ConfigError, ModelError, require_int
from ..introspect import FedModel, serialized
from ..kernels import power_iteration
from ..protocol import ClientData, Problem


def _real(value: object) -> bool:
    """A finite real scalar, not a bool."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


# ---------------------------------------------------------------------------------------- masks


def template_column(col: jax.Array, d: int, c: int, s: int) -> jax.Array:
    """Column ``col`` of the paper's fixed (d x c) pattern with exactly s ones per row (Figure 1).

    If s d >= c, row k holds ones at columns (s k + j) mod c, j = 0..s-1 (s cyclically consecutive
    columns; every column then holds floor(s d / c) or ceil(s d / c) ones). Otherwise column
    col < d s holds a single one at row col mod d and the other c - d s columns are empty.
    """
    col = jnp.asarray(col, jnp.int32)
    if s * d >= c:
        diff = col - jnp.asarray(np.arange(d) * s % c, jnp.int32)  # in (-c, c): one add, no integer division
        return jnp.where(diff < 0, diff + c, diff) < s
    return (col < d * s) & (jnp.arange(d, dtype=jnp.int32) == col % d)


def mask_column(key: jax.Array, slot: jax.Array, d: int, c: int, s: int) -> jax.Array:
    """Client ``slot``'s column of the round's mask: the template with its c columns permuted by ``key``."""
    return template_column(jax.random.permutation(key, c)[slot], d, c, s)


def mask(key: jax.Array, d: int, c: int, s: int) -> jax.Array:
    """The whole (c, d) boolean mask of a round (row j: the coordinates cohort member j uploads)."""
    _check_mask_sizes(d, c, s)
    return jax.vmap(lambda j: mask_column(key, j, d, c, s))(jnp.arange(c))


def _check_mask_sizes(d: int, c: int, s: int) -> None:
    require_int(d, "d")
    require_int(c, "c (cohort size)", 2)
    require_int(s, "s", 1)
    if not s <= c:
        raise ConfigError(f"s={s} coordinate holders cannot exceed the cohort size c={c}")


def aggregate(x: jax.Array, q: jax.Array, s: int) -> jax.Array:
    """The server's estimate (1/s) sum_j q_j * x_j of the cohort's mean, from masked iterates (c, d)."""
    return jnp.sum(jnp.where(q, x, 0.0), axis=0) / s


# ---------------------------------------------------------------------------------- theory helpers


def recommended_p(kappa: float, n: int, s: int, *, gamma_L: float = 1.0, rule: str = "threshold") -> float:
    """The probability p of communicating after a local step (E[L] = 1/p local steps per round).

    ``rule="threshold"`` (the default): the smallest p at which Theorem 1's rate equals gradient
    descent's, tau = tau# = max(1 - gamma mu, gamma L - 1)^2. The paper notes that local training,
    compression and partial participation "do not harm convergence at all, until some threshold":
    the control-variate term 1 - p^2 chi (s - 1) / (n - 1) of eq. 10 stays below tau# when

        p >= sqrt((1 - tau#) (n - 1) / (chi (s - 1))),   chi = n (s - 1) / (s (n - 1)) (the largest),

    and every larger p only adds rounds. ``gamma_L`` is gamma * L (1 for the default step 1 / L).
    ``rule="eq12"``: p = min(sqrt(n / (s kappa)), 1), Theorem 3's order with its constant set to 1
    (the same order in kappa, but on the bound's constants about 4 times too small at s = 2, which
    leaves the control-variate term dominant and costs rounds).
    """
    if not _real(kappa) or kappa < 1:
        raise ConfigError(f"kappa = L / mu must be >= 1, got {kappa!r}")
    require_int(n, "n (clients)", 2)
    require_int(s, "s", 2)
    if rule == "eq12":
        return float(min(1.0, math.sqrt(n / (s * kappa))))
    if rule != "threshold":
        raise ConfigError(f"rule must be 'threshold' or 'eq12', got {rule!r}")
    if not _real(gamma_L) or not 0 < gamma_L < 2:
        raise ConfigError(f"gamma_L = gamma * L must lie in (0, 2) (Theorem 1), got {gamma_L!r}")
    tau_sharp = max(1 - gamma_L / kappa, gamma_L - 1) ** 2
    chi = n * (s - 1) / (s * (n - 1))
    return float(min(1.0, math.sqrt((1 - tau_sharp) * (n - 1) / (chi * (s - 1)))))


def recommended_s(c: int, d: int, downlink_cost: float = 0.0) -> int:
    """s = max(2, floor(c / d), floor(alpha c)) capped at c (Theorem 3, eq. 14); alpha in [0, 1] is the
    cost of a downlink float relative to an uplink float (0: uplink only, 1: symmetric)."""
    require_int(c, "c (cohort size)", 2)
    require_int(d, "d")
    if not 0.0 <= downlink_cost <= 1.0:
        raise ConfigError(f"downlink_cost (alpha) must lie in [0, 1], got {downlink_cost!r}")
    return int(min(c, max(2, c // d, math.floor(downlink_cost * c))))


def max_eta(p: float, n: int, s: int) -> float:
    """The largest eta of Theorem 1: p n (s - 1) / (s (n - 1)) (eq. 5 and 11)."""
    return p * n * (s - 1) / (s * (n - 1))


def theorem1_rate(*, gamma: float, mu: float, L: float, p: float, s: int, n: int, eta: float | None = None) -> float:
    """tau of Theorem 1 (eq. 10), the contraction per local step of E[Psi]:
    max((1 - gamma mu)^2, (gamma L - 1)^2, 1 - p^2 chi (s - 1) / (n - 1)) with chi = eta / p."""
    chi = (max_eta(p, n, s) if eta is None else eta) / p
    return float(max((1 - gamma * mu) ** 2, (gamma * L - 1) ** 2, 1 - p * p * chi * (s - 1) / (n - 1)))


def expected_uplink_floats(d: int, c: int, s: int) -> tuple[int, int]:
    """(fewest, most) floats one cohort member uploads per round: floor/ceil(s d / c), or (0, 1) if s d < c."""
    if s * d >= c:
        return (s * d) // c, -(-s * d // c)
    return 0, 1


# ------------------------------------------------------------------------------ condition number


def preconditioner(hess: np.ndarray) -> tuple[np.ndarray, float]:
    """``(S, lambda)``: the upper-triangular S = L^{-T} with L L^T = H + lambda I (Cholesky), so that
    S S^T = (H + lambda I)^{-1} and S^T H S = I when lambda = 0. lambda = 0 when H is positive definite
    (numerically: its Cholesky factor exists and is finite); otherwise the smallest of
    1e-10 * scale * 10^k (k = 0, 1, ...; scale the largest |diagonal| entry, or 1) that makes it so
    (Levenberg's shift: the directions in which H is flat or concave get the step of curvature lambda)."""
    import scipy.linalg

    hess = 0.5 * (np.asarray(hess, np.float64) + np.asarray(hess, np.float64).T)
    d = hess.shape[0]
    scale = float(np.max(np.abs(np.diag(hess)))) if d else 1.0
    scale = scale if np.isfinite(scale) and scale > 0 else 1.0
    shift = 0.0
    for k in range(40):
        try:
            chol = np.linalg.cholesky(hess + shift * np.eye(d))
            if np.all(np.isfinite(chol)) and np.all(np.diag(chol) > 0):
                S = scipy.linalg.solve_triangular(chol, np.eye(d), lower=True, trans="T")
                if np.all(np.isfinite(S)):
                    return S, shift
        except np.linalg.LinAlgError:
            pass
        shift = 1e-10 * scale * 10.0**k
    raise ModelError(
        "the Hessian of the negative log posterior at the start is not finite; pass init= a "
        "dict of constrained starting values, or precondition=False"
    )


def estimate_condition_at(
    run: Any, clients: ClientData, x: jax.Array, dense_max: int = 1000, iters: int = 300
) -> tuple[float, float]:
    """(mu_min, L_max): the smallest and largest eigenvalue of any client's Hessian of f_i at x.

    Dense Hessians (exact eigenvalues) for d <= ``dense_max``; beyond, power iterations on
    Hessian-vector products (L_i, then L_i - mu_i from the shifted operator).
    """
    lo, hi = jax.jit(lambda cl: jax.lax.map(lambda c: client_extremes(run, c, x, dense_max, iters), cl))(clients)
    return float(jnp.min(lo)), float(jnp.max(hi))


def client_extremes(
    run: Any, client: ClientData, x: jax.Array, dense_max: int = 1000, iters: int = 300
) -> tuple[jax.Array, jax.Array]:
    """(mu_i, L_i): the smallest and largest eigenvalue of one client's Hessian of f_i at x (dense for
    d <= ``dense_max``, else power iterations on Hessian-vector products)."""
    if x.size <= dense_max:
        ev = jnp.linalg.eigvalsh(jax.hessian(run.client_objective)(x, client))
        return ev[0], ev[-1]
    g = lambda y: jax.grad(run.client_objective)(y, client)  # noqa: E731
    hvp = lambda v: jax.jvp(g, (x,), (v,))[1]  # noqa: E731
    v0 = jnp.ones_like(x)
    big, _ = power_iteration(hvp, v0, iters)
    gap, _ = power_iteration(lambda v: big * v - hvp(v), v0, iters)
    return big - gap, big


@serialized
def estimate_condition(
    model,
    data,
    *,
    at: Mapping[str, Any] | None = None,
    model_kwargs=None,
    local_latents: str | None = None,
    jacobian: bool = False,
) -> dict[str, float]:
    """``{"L": L_max, "mu": mu_min, "kappa": L_max / mu_min}`` of the clients' TAMUNA objectives
    f_i = -log p(D_i | x) - log p(x) / n at ``at`` (constrained values; default: the initial point).

    These are local constants (Theorem 1 needs them along the whole path); for logistic regression
    with a Gaussian prior the Hessian is largest at x = 0, so L_max there is the global constant.
    """
    from ..data import FederatedData

    fd = data if isinstance(data, FederatedData) else FederatedData(data)
    fm = FedModel(model, fd, model_kwargs)
    from .tamuna import TAMUNA

    run = TAMUNA(step_size=1.0, p=1.0, local_latents=local_latents, jacobian=jacobian, init=at).build(
        Problem(fm, fd, 1)
    )
    mu, L = estimate_condition_at(run, stack_clients(fd), run._x0)
    return {"L": L, "mu": mu, "kappa": L / mu if mu > 0 else float("inf")}
