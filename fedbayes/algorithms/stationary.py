"""The stationary law of an unadjusted Langevin sampler near the mode, in closed form.

Near the mode m the potential is quadratic, U(x) ~ U(m) + (x - m)' H (x - m) / 2, and every sampler of
:mod:`fedbayes.algorithms.elf` takes the step

    x' = x - gamma P (H (x - m) + e) + sqrt(2 gamma) S z,     P = S S',  z ~ N(0, I),

with S the preconditioner (the identity without one) and e the error of the server's gradient (the
compressors'), of mean 0 and covariance V per round. In the whitened coordinates y = S^-1 x, with
H_y = S' H S and V_y = S' V S, this is the linear recursion y' = (I - gamma H_y) y - gamma e_y +
sqrt(2 gamma) z, whose stationary law is Gaussian with the covariance Sigma_y that solves the
discrete Lyapunov equation

    Sigma_y = A Sigma_y A' + 2 gamma I + gamma^2 V_y,     A = I - gamma H_y,

exactly (it is stable for 0 < gamma < 2 / lambda_max(H_y)). In the eigenbasis H_y = Q diag(lambda) Q'
it is elementwise: (Q' Sigma_y Q)_jk = (Q' R Q)_jk / (1 - (1 - gamma lambda_j)(1 - gamma lambda_k)),
R = 2 gamma I + gamma^2 V_y. The posterior's Laplace covariance is H^-1 = S H_y^-1 S', and the
*sd inflation* of coordinate i is sqrt((S Sigma_y S')_ii / (H^-1)_ii). Without gradient error and with
the samplers' default preconditioner (S S' = H^-1, so H_y = I) it is 1 / sqrt(1 - gamma / 2) for every
coordinate: 2.6% at the default gamma = 0.1.

The compressors' error comes from their declared constants (:mod:`fedbayes.compress`), each channel
giving its own term (``stationary_noise`` of :mod:`fedbayes.algorithms.channels`), evaluated at the
quadratic approximation (models of the error, checked on Gaussian targets in
``tests/test_stationary.py``, not bounds):

* an unbiased compressor with variance constant omega on each client's gradient (LMC's naive baseline)
  adds white noise, each coordinate's variance omega times its mean square (rand_k's exact diagonal):
  V = omega diag(sum_i E[g_i g_i']) (:class:`NoiseTerm`);
* error feedback (EF21 on the uplink, D-/B-ELF; EF21-P on the downlink, P-/B-ELF) with a contractive
  compressor (alpha) makes the server's gradient a *lagged* one: a coordinate of a memory (or of the
  clients' copy w) is brought up to date when it is sent, so the gradient is taken at the point of
  tau rounds ago, tau geometric with mean tau_bar = (1 - alpha) / alpha when the k of d coordinates
  sent are drawn at random (rand_k_unscaled; top_k sends the largest residuals first and lags less,
  so for it the model is conservative). To first order in gamma the lag adds
  E[x_k (x_k - x_{k-tau})] = gamma tau_bar Var(x) per eigen-direction, and the stationary variance
  is 1 / (lambda (1 - gamma lambda (tau_bar + 1/2))) instead of ULA's 1 / (lambda (1 - gamma lambda / 2))
  (:class:`LagTerm`; the lags of both links add).

A channel whose error has no such model (a biased compressor without error feedback, QLSD's
memories under partial participation, a clip) gives None, and so does the report.

>>> import numpy as np
>>> from fedbayes.algorithms.stationary import sd_inflation
>>> H = np.diag([4.0, 1.0])
>>> np.round(sd_inflation(H, 0.1), 4)  # no preconditioner: 1 / sqrt(1 - gamma lambda / 2)
array([1.118, 1.026])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence

import numpy as np

from ..errors import ConfigError

INFLATION_LIMIT = 0.05
"""The relative widening of the stationary sds over the posterior's that the samplers' report accepts."""


@dataclass(frozen=True)
class NoiseTerm:
    """White gradient error of covariance ``gamma ** power * matrix`` per round (whitened coordinates)."""

    power: int
    matrix: np.ndarray


@dataclass(frozen=True)
class LagTerm:
    """A gradient taken ``tau`` rounds late on average (error feedback's memories; see the module docstring)."""

    tau: float


@dataclass(frozen=True)
class NoiseInputs:
    """What the channels' error models read, at the mode, in the whitened coordinates y = S^-1 x.

    ``hessian_y``: H_y = S' H S; ``precond``: S; ``grad_sq``: diag(sum_i E[g_i g_i']) in x, the clients'
    gradients' mean squares over the stationary law (None where the set-up did not measure it);
    ``dim``: d."""

    hessian_y: np.ndarray
    precond: np.ndarray
    grad_sq: np.ndarray | None
    dim: int


class _Whitened:
    """The eigenbasis of H_y and the map back to x, computed once for every step tried."""

    def __init__(self, hessian: np.ndarray, precond: np.ndarray | None):
        h = np.asarray(hessian, dtype=np.float64)
        d = h.shape[0]
        if h.shape != (d, d) or not np.all(np.isfinite(h)):
            raise ConfigError(f"the Hessian must be a finite square matrix, got shape {h.shape}")
        self.s = np.eye(d) if precond is None else np.asarray(precond, dtype=np.float64)
        hy = self.s.T @ (0.5 * (h + h.T)) @ self.s
        self.lam, self.q = np.linalg.eigh(0.5 * (hy + hy.T))
        if not self.lam[0] > 0:
            raise ConfigError("the Hessian at the mode is not positive definite: the stationary law has no closed form")
        self.back = self.s @ self.q  # x = S Q u
        self.laplace_var = np.einsum("ij,j,ij->i", self.back, 1.0 / self.lam, self.back)  # diag(H^-1)

    def stable_limit(self) -> float:
        return 2.0 / float(self.lam[-1])

    def variances(self, step: float, noise: Sequence[NoiseTerm | LagTerm] = ()) -> np.ndarray:
        """diag of the stationary covariance in x at ``step`` (inf where the recursion is unstable).

        A lag enters as the white term of the same stationary variance, 2 lambda tau / (1 - gamma lambda
        (tau + 1/2)) per eigen-direction (with it R / (1 - (1 - gamma lambda)^2) is the variance of the
        module docstring)."""
        d = self.lam.size
        tau = sum(t.tau for t in noise if isinstance(t, LagTerm))
        room = 1.0 - step * self.lam * (tau + 0.5)
        if not 0 < step < self.stable_limit() or np.any(room <= 0):
            return np.full(d, np.inf)
        r = np.diag(2.0 * step + step**2 * 2.0 * self.lam * tau / room)
        for term in noise:
            if isinstance(term, NoiseTerm):
                r = r + step ** (2 + term.power) * (self.q.T @ term.matrix @ self.q)
        a = 1.0 - step * self.lam
        cov_u = r / (1.0 - np.outer(a, a))
        return np.einsum("ij,jk,ik->i", self.back, cov_u, self.back)


def sd_inflation(
    hessian: np.ndarray,
    step: float,
    precond: np.ndarray | None = None,
    noise: Sequence[NoiseTerm | LagTerm] = (),
) -> np.ndarray:
    """Per coordinate, the stationary sd of the Langevin step at the mode over the posterior's Laplace sd.

    sqrt(diag(S Sigma_y S') / diag(H^-1)) with Sigma_y the discrete Lyapunov solution of the module
    docstring: exact for a Gaussian target. ``precond`` is S (S S' = P; None: the identity), ``noise``
    the gradient error's terms (:class:`NoiseTerm`, :class:`LagTerm`; whitened); inf where ``step`` is past
    the stability limit 2 / lambda_max(S' H S).

    >>> import numpy as np
    >>> H = np.array([[2.0, 0.5], [0.5, 1.0]])
    >>> S = np.linalg.inv(np.linalg.cholesky(H)).T  # S S' = H^-1: the samplers' default preconditioner
    >>> np.round(sd_inflation(H, 0.1, S), 4)  # 1 / sqrt(1 - 0.05) everywhere
    array([1.026, 1.026])
    """
    w = _Whitened(hessian, precond)
    return np.sqrt(w.variances(float(step), noise) / w.laplace_var)


def step_for_inflation(
    hessian: np.ndarray,
    precond: np.ndarray | None = None,
    noise: Sequence[NoiseTerm | LagTerm] = (),
    limit: float = INFLATION_LIMIT,
) -> float:
    """The largest step whose stationary sds are all within ``limit`` (relative) of the posterior's.

    Bisection on the step (the widest coordinate's inflation grows with it) between 0 and the stability
    limit, for the gradient error's terms ``noise``. With the default preconditioner and no error it is
    2 (1 - 1 / (1 + limit)^2) = 0.186 for ``limit`` = 0.05.

    >>> import numpy as np
    >>> round(step_for_inflation(np.diag([4.0, 1.0])), 4)  # 0.186 / lambda_max
    0.0465
    """
    w = _Whitened(hessian, precond)
    target = math.log1p(limit)
    lo, hi = 0.0, w.stable_limit()
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if float(np.max(0.5 * np.log(w.variances(mid, noise) / w.laplace_var))) <= target:
            lo = mid
        else:
            hi = mid
    return lo


__all__ = ["INFLATION_LIMIT", "LagTerm", "NoiseInputs", "NoiseTerm", "sd_inflation", "step_for_inflation"]
