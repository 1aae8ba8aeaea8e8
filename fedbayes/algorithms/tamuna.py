"""TAMUNA: federated MAP with local training, compression and partial participation.

Condat, Agarsky, Malinovsky and Richtarik, "TAMUNA: Doubly accelerated distributed optimization with
local training, compression, and partial participation" (Algorithm 1, Theorems 1 and 3). The problem

    min_x f(x) = (1/n) sum_i f_i(x),   f_i(x) = -log p(D_i | x) - log p(x) / n,

in unconstrained coordinates: the minimiser is the MAP of the global sites (maximum likelihood for
``numpyro.param`` sites, which have no prior). The prior is shared out equally, so every f_i carries
its share of the prior's strong convexity, as Theorem 1 requires of each f_i. Round r:

    draw the cohort Omega (c of the n clients, uniformly) and L ~ Geometric(p) on {1, 2, ...},
        common to the cohort (both from the round's public key)
    every i in Omega starts from the broadcast x_bar and takes L local steps
        x_i <- x_i - gamma (grad f_i(x_i) - h_i)
    mask q in {0,1}^{d x c} with exactly s ones per row (the paper's template, columns permuted)
    client i uploads q_i * x_i:   ceil(s d / c) or floor(s d / c) floats (s d in all)
    x_bar <- (1/s) sum_{i in Omega} q_i * x_i          (each coordinate: the mean of its s holders)
    i in Omega: h_i <- h_i + (eta / gamma) q_i * (x_bar - x_i)   (the server's reply: q_i * x_bar)

The control variates h_i start at zero and keep sum_i h_i = 0 (each coordinate's correction sums to
zero over its s holders), so at the solution x* they are h_i* = grad f_i(x*) and local steps no
longer drift (the Scaffnew property). Theorem 1: with 0 < gamma < 2 / L_max and
0 < eta <= p n (s - 1) / (s (n - 1)), E[Psi^t] <= tau^t Psi^0 with, per local step,

    tau = max((1 - gamma mu)^2, (gamma L - 1)^2, 1 - p^2 chi (s - 1) / (n - 1)),   chi = eta / p.

Theorem 3 (communication-optimal choices): p of order min(sqrt(n / (s kappa)), 1) and
s = max(2, floor(c / d), floor(alpha c)), alpha the relative cost of the downlink. The default p
makes the control-variate term of tau no larger than gradient descent's (see ``recommended_p``).

Special cases, all the same code: ``Scaffnew`` (c = s = n, eta = p), ``GD`` (one local step,
c = s = n: the server iterate is exactly gradient descent on f) and ``FedAvg`` (local steps, no
control variates, no compression: it converges to a wrong point on heterogeneous clients).

Preconditioning (``precondition=None``: on for the automatic step and d <= 1000, off for FedAvg): the
set-up exchange collects every client's Hessian of f_i at x_0, the server sends S with S S^T = H^{-1}
(H = sum_i H_i), and the algorithm above runs on g_i(y) = f_i(x_0 + S y): affine invariant, so globals
in raw units need no standardising. Masks act on y; every result is mapped back to x = x_0 + S y.

The ledger counts what crosses the wire: each cohort member receives x_bar (d floats) and uploads
its q_i entries; with control variates it then receives x_bar on those entries (the reply it needs
for its h_i update; a member of the next cohort gets all of x_bar again at the next round).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .. import minibatch
from ..engine import final_exchange, stack_clients
from ..wire import Masked
from ..errors import ConfigError, ModelError, require_choice, require_int
from ..faults import as_aggregation
from ..introspect import FedModel
from ..minibatch import check_batch_size
from ..privacy import SumPrivacy, check_dp, sums_only
from ..protocol import FLOAT_BITS, ClientData, FederatedRun, FitParts, Message, Problem, RoundInfo
from .tamuna_theory import (  # noqa: F401 - the masks and theory helpers, re-exported as fb.tamuna.*
    _real,
    aggregate,
    client_extremes,
    estimate_condition,
    estimate_condition_at,
    expected_uplink_floats,
    mask,
    mask_column,
    max_eta,
    preconditioner,
    recommended_p,
    recommended_s,
    template_column,
    theorem1_rate,
)
from .warmstart import check_init, map_estimate, map_objective, map_solve, resolve_init

POPULATION_MEAN = "population-mean"

# ------------------------------------------------------------------------------------- config


class Settings(NamedTuple):
    """What TAMUNA's set-up resolves (the server's copy)."""

    gamma: jax.Array  # () the step size (the clients' step is gamma 2^-halvings with the safeguard)
    p: jax.Array  # () the probability of communicating (Geometric(p) local steps)
    eta: jax.Array  # () the control variates' rate
    cv_rate: jax.Array  # () eta / gamma, computed on the host in double precision
    factor: Any  # (d, d) S with S S^T = H^{-1} with preconditioning, otherwise ()


class ClientSettings(NamedTuple):
    """What every client receives once after the set-up (``client.settings``): 3 floats (and S)."""

    gamma: jax.Array  # () the step size
    p: jax.Array  # () the probability of communicating
    cv: jax.Array  # () the control variates' coefficient: eta / gamma; with the safeguard eta itself, which
    #                the client divides by its halved step gamma 2^-halvings
    factor: Any  # (d, d) S with preconditioning, otherwise ()


class Estimates(NamedTuple):
    """The server's record of what the set-up measured (NaN where it measured nothing), for the report."""

    L_max: jax.Array
    mu_min: jax.Array
    mu_mean: jax.Array
    levenberg_shift: jax.Array


class ServerState(NamedTuple):
    x: jax.Array  # (d,) the server model x_bar
    halvings: jax.Array  # () times the safeguard halved gamma (the clients' step is gamma 2^-halvings)
    best: jax.Array  # () the smallest objective F reported so far (inf before the first report)
    stall: jax.Array  # () rounds since F last fell below ``best``
    first: jax.Array  # () F at the start (NaN before the first report)
    settings: Settings  # resolved in the set-up (:meth:`TAMUNARun.setup_done`)
    patience: jax.Array  # () rounds the safeguard waits: ceil(SAFEGUARD_PATIENCE / p)
    estimates: Estimates


SAFEGUARD_PATIENCE = 10
"""Local steps (10 / p rounds: 10 for GD) the safeguard waits, with F above its best value, before it
halves gamma (it halves at once when F rises above its value at the start)."""


@dataclass(frozen=True)
class TAMUNA:
    """TAMUNA (Algorithm 1): federated MAP of the global sites.

    Parameters
    ----------
    step_size:
        gamma, the local step; Theorem 1 needs gamma < 2 / L_max. None: 1 / L_max, with L_max the
        largest eigenvalue of any client's Hessian of f_i at the initial point.
    p:
        Probability of communicating after each local step: L ~ Geometric(p), E[L] = 1/p. None:
        ``recommended_p(kappa, n, s, gamma_L=gamma L_max)``, the fewest rounds at gradient descent's
        rate under Theorem 1.
    s:
        Holders per coordinate (2 <= s <= c; c is ``clients_per_round``). None: ``recommended_s(c, d,
        downlink_cost)``.
    eta:
        Control-variate step; Theorem 1 needs 0 < eta <= p n (s - 1) / (s (n - 1)). None: the largest.
    local_steps:
        None (the theory): L ~ Geometric(p) each round. An int: exactly that many local steps (then
        p means 1 / local_steps in eta's range, the paper's Remark 2).
    kappa:
        Condition number L / mu, for the default p; None: estimated from the clients' Hessians at the
        initial point (dense up to d = 1000, power iterations beyond).
    downlink_cost:
        alpha in TotalCom = UpCom + alpha DownCom, for the default s.
    local_latents:
        Models with per-client latents (``fb.local()``) have no finite-sum MAP objective over the
        global sites. ``"population-mean"`` fits the non-personalised model instead, every client's
        latents at their population mean (the usual warm start of a personalised fit).
    jacobian:
        Add the log-Jacobian of the unconstraining transforms to the prior (the mode of the density a
        Langevin sampler targets) instead of the MAP in the model's own parametrisation.
    init:
        Initial constrained values of global sites (a dict, or a previous ``Result``). None: the
        deterministic start (each prior's mean, :meth:`FedModel.init_globals`).
    safeguard:
        Monotonicity safeguard (full participation only). Every member also sends f_i at the broadcast
        point (one float), so the server knows F = sum_i f_i at each iterate; when F rises above the
        best value so far by more than rounding (1e3 eps (|F| + 1)) and has not improved for
        ceil(10 / p) rounds (``SAFEGUARD_PATIENCE``: TAMUNA's F need not fall every round, GD's does),
        or (GD) rises above its starting value, the server halves gamma
        (the broadcast carries the number of halvings: one float). gamma = 1 / L_max is measured at
        the start, and the curvature may be larger along the path (a start where a logistic likelihood
        is flat); GD then oscillates instead of converging. None (default): on when the step is
        automatic (``step_size=None``) and every client takes part in every round (except for
        ``FedAvg``, the baseline, whose client drift would only be halved away).
    precondition:
        Run on affinely reparametrised coordinates y = S^{-1} (x - x_0), i.e. on the clients' objectives
        g_i(y) = f_i(x_0 + S y), with S S^T = H^{-1} and H = sum_i Hessian of f_i at the start x_0 (the
        Hessian of the negative log posterior). The set-up exchange then collects every client's dense
        Hessian at x_0 (its upper triangle, in ``init_bits``), the server factors H (Cholesky; a
        Levenberg shift H + lambda I if H is not positive definite) and sends S to every client once
        (d^2 floats, in ``init_bits``). This is TAMUNA itself on the functions g_i, so Theorem 1 holds with
        their constants, and gamma = 1 / L_max is measured on the transformed Hessians S^T H_i S (at
        y = 0 they sum to the identity). The default p then takes kappa = L_max / mu_f with mu_f the
        curvature of the average f (1/n at the start), not Theorem 1's worst client mu_min: a client
        with fewer observations than globals is strongly convex only through its 1/n share of the
        prior, so mu_min (and p) can be orders of magnitude smaller than the problem needs (mlmRev's
        Contraception, districts of 2 to 118 women: kappa 1.7e5 against 11). Theorem 1 still
        guarantees linear convergence for that p (every p in (0, 1] with eta <= p n (s-1) / (s (n-1))
        does); only the rate bound is then the worst client's. Pass ``kappa`` or ``p`` to override. The method becomes
        affine invariant: a global in raw units
        (an age in years, a price in cents) gives the same iterates, mapped, as its standardised
        version. Masks (compression) and robust aggregation act on the y coordinates; results
        (``params``, the history, the final gradient and information, the safeguard's objective) are in
        the model's coordinates. None (default): on when the step is automatic (``step_size=None``) and
        d <= 1000 (dense Hessians), for any participation (the set-up exchange reaches every client
        anyway), except for ``FedAvg`` (the baseline as users know it).
    aggregation:
        How the server averages each coordinate over its holders that answered: ``"mean"`` (the
        algorithm), or ``"median"`` / ``"trimmed"`` / a trim fraction for a coordinate-wise robust
        centre against Byzantine clients (``fb.faults.Aggregation``; a robust centre breaks
        sum_i h_i = 0 and moves the fixed point on heterogeneous clients: see its docstring).
    batch_size:
        B, the rows of a client's data each local step sees (None, the default: all of them): local step
        m of a round takes the gradient of f_i on the round's batch m, its log-likelihood scaled by
        N_i / B (:mod:`fedbayes.minibatch`), an unbiased estimate of grad f_i (stochastic local steps;
        FedAvg with minibatches is the classic FedAvg of SGD steps). Theorem 1 is for exact gradients:
        with stochastic ones the iterates do not converge to x* but fluctuate about it, with a spread of
        order gamma times the gradients' variance (``tests/test_minibatch.py`` checks GD's exact
        stationary variance on a Gaussian mean), so keep the full batch when the exact MAP is wanted
        and lower the step with batches. The set-up (the curvature, the safeguard's objective at the
        broadcast point) uses all rows. A model's ``numpyro.plate(..., subsample_size=B)`` sets B the
        same way.
    privacy:
        Client-level differential privacy, a ``fb.privacy.DP`` (None: none). ``fb.GD`` and ``fb.FedAvg``,
        central mode: the server clips each cohort member's update, Delta_i = x_i - x_bar (its local
        iterate minus the broadcast), to L2 norm C, and steps x_bar <- x_bar + (1/c) sum_i clip(Delta_i) +
        N(0, (sigma C / c)^2 I): DP-FedAvg's fixed-denominator mean (McMahan et al., 2018), c the cohort
        size (a member that did not answer adds nothing, so the step shrinks rather than reweights), each
        round a Gaussian mechanism with noise multiplier sigma (:class:`fedbayes.privacy.SumPrivacy`; the
        denominator c is public, so with full participation the neighbouring relation is zero-out, and
        replace-one with a sampled cohort). The fixed point moves with the clip: clipped updates are a
        biased estimate of the mean update when C binds. Every other release of the clients' data is
        refused: the automatic step and preconditioning (the clients' Hessians in the set-up exchange:
        give ``step_size``), the safeguard (the clients' objectives every round) and the final exchange
        (the gradient and information of the convergence check and of standard errors: a private fit's
        convergence rests on its trace). ``DP(mode="distributed")``: each member clips its own update and
        adds N(0, sigma^2 C^2 / c), so that the sum of the c shares carries the central mode's noise; the
        server adds nothing and needs only the sum (``fb.flower.SecAggPlus`` hides the single uploads on
        Flower). A member that does not answer takes its share with it: ``res.privacy["epsilon_realised"]``
        accounts the rounds as they went (:meth:`fedbayes.privacy.SumPrivacy.realised_epsilon`).

        ``fb.TAMUNA`` and ``fb.Scaffnew`` take the distributed mode only. Their control variates h_i keep
        sum_i h_i = 0, and with it the fixed point x*, only while each coordinate of x_bar is the exact mean of
        what its holders sent: noise the server added would move that sum, and the fit, by a random walk.
        So each member clips its update on the s coordinates it holds, u_i = clip(q_i (x_i - x_bar), C), sends
        v_i = u_i + N(0, sigma^2 C^2 / s) there, and corrects h_i with x_bar + v_i instead of its local iterate
        (h_i += (eta / gamma) q_i (x_bar_new - x_bar - v_i)); the server adds to each coordinate of x_bar the mean
        of the v_i over its holders that answered. Over
        each coordinate's holders the corrections sum to zero, noise included, so sum_i h_i = 0 stays exact,
        and the noise in each h_i decays with its own correction (as in DP-SCAFFOLD, Noble, Bellet and
        Dieuleveut 2022). s x_bar_new - s x_bar is then sum_i u_i + N(0, sigma^2 C^2) per coordinate: the
        Gaussian mechanism with multiplier sigma, as for GD. The server needs the sum of the uploads alone
        (zero off each member's coordinates; the holders are public), so ``fb.flower.SecAggPlus`` runs it. A
        holder that does not answer takes its share: the round's realised multiplier is sigma sqrt(a / s), a
        the fewest holders that answered for any coordinate released (``res.history["dp_holders"]``).
    """

    step_size: float | None = None
    p: float | None = None
    s: int | None = None
    eta: float | None = None
    local_steps: int | None = None
    kappa: float | None = None
    downlink_cost: float = 0.0
    local_latents: str | None = None
    jacobian: bool = False
    init: Any = None
    aggregation: Any = "mean"
    safeguard: bool | None = None
    precondition: bool | None = None
    batch_size: int | None = None
    privacy: Any = None

    name = "TAMUNA"
    control_variates = True
    compression = True  # False: every cohort member uploads everything (s = c)
    full_participation = False  # True: the special case needs c = n
    auto_safeguard = True  # safeguard=None turns it on (automatic step, every client every round)
    monotone = False  # F may rise for a while (local steps, control variates settling, shared coordinates)
    auto_precondition = True  # precondition=None turns it on (automatic step, d <= DENSE_CURVATURE)
    divergence_hint = (
        "lower step_size below 2 / L_max (or leave it None for 1 / L_max at the start); the objective "
        "must be smooth and strongly convex near the path"
    )

    def __post_init__(self):
        n = self.name
        if self.step_size is not None and (not _real(self.step_size) or self.step_size <= 0):
            raise ConfigError(f"{n} step_size must be a positive number or None, got {self.step_size!r}")
        if self.p is not None and (not _real(self.p) or not 0 < self.p <= 1):
            raise ConfigError(f"{n} p (probability of communicating) must lie in (0, 1], got {self.p!r}")
        if self.s is not None:
            if not self.compression:
                raise ConfigError(f"{n} does not compress (s = c); leave s unset or use fb.TAMUNA")
            require_int(self.s, f"{n} s", 2)
        if self.eta is not None and (not _real(self.eta) or self.eta < 0):
            raise ConfigError(f"{n} eta must be a non-negative number or None, got {self.eta!r}")
        if self.eta == 0 and self.control_variates:
            raise ConfigError(
                f"{n} eta must be > 0 (Theorem 1); eta = 0 switches the control variates off, which is "
                "fb.FedAvg (it converges to a wrong point on heterogeneous clients)"
            )
        if self.local_steps is not None:
            require_int(self.local_steps, f"{n} local_steps")
            if self.p is not None:
                raise ConfigError(f"{n}: give p (geometric local steps) or local_steps (a fixed number), not both")
        if self.kappa is not None and (not _real(self.kappa) or self.kappa < 1):
            raise ConfigError(f"{n} kappa must be a number >= 1, got {self.kappa!r}")
        if not _real(self.downlink_cost) or not 0 <= self.downlink_cost <= 1:
            raise ConfigError(f"{n} downlink_cost must lie in [0, 1], got {self.downlink_cost!r}")
        check_init(self.init, n)
        if self.init == "map":
            raise ConfigError(f"{n} computes the MAP itself; init='map' is for the samplers and FedSOUL")
        require_choice(self.local_latents, f"{n} local_latents", (None, POPULATION_MEAN))
        require_choice(self.jacobian, f"{n} jacobian", (True, False))
        require_choice(self.safeguard, f"{n} safeguard", (None, True, False))
        require_choice(self.precondition, f"{n} precondition", (None, True, False))
        as_aggregation(self.aggregation)
        check_batch_size(self.batch_size, self.name)
        self._check_privacy()

    def _check_privacy(self) -> None:
        """Central DP covers the clipped, noised mean update only (``privacy``): every other release of the
        clients' data is refused, and so are the control variates that noise would unbalance."""
        if self.privacy is None:
            return
        n = self.name
        check_dp(self.privacy, n)
        if self.control_variates and self.privacy.mode != "distributed":
            raise ConfigError(
                f"{n}'s privacy is distributed (DP(..., mode='distributed')): its control variates h_i keep "
                "sum_i h_i = 0, and with it the fixed point, only while each coordinate of x_bar is the exact mean of "
                "what its holders sent; noise the server adds to it would move that sum, and the fit, by a random "
                "walk, while noise each member adds to what it sends (and corrects its h_i with) keeps it"
            )
        if self.step_size is None:
            raise ConfigError(
                f"{n} with privacy needs a step_size: the automatic step is measured from every client's Hessian "
                "in the set-up exchange, a release the accountant does not cover"
            )
        if self.p is None and self.local_steps is None and self.kappa is None:
            raise ConfigError(
                f"{n} with privacy needs p, local_steps or kappa: the default p is computed from every client's "
                "curvature (mu_i, L_i) in the set-up exchange, a release the accountant does not cover"
            )
        if self.precondition:
            raise ConfigError(
                f"{n} with privacy cannot precondition: the set-up exchange would collect every client's Hessian, "
                "a release the accountant does not cover"
            )
        if self.safeguard:
            raise ConfigError(
                f"{n} with privacy has no safeguard: it needs every client's objective each round, a release the "
                "accountant does not cover"
            )
        if not (isinstance(self.aggregation, str) and self.aggregation == "mean"):
            raise ConfigError(f"{n} with privacy needs aggregation='mean': the noise is calibrated to a sum")

    def build(self, problem: Problem) -> TAMUNARun:
        fm: FedModel = problem.model
        fm.require(self.name, local_continuous=False, minibatch=True)
        if fm.local_names and self.local_latents != POPULATION_MEAN:
            raise ModelError(
                f"{self.name} optimises the global sites of a finite sum, but the model has per-client latents "
                f"{list(fm.local_names)} (their marginal likelihood has no closed form). Use fb.FedSOUL or fb.FedMM "
                f"for the personalised model, or local_latents='{POPULATION_MEAN}' to fit the non-personalised model"
            )
        n = problem.data.num_clients
        if n < 2:
            raise ConfigError(f"{self.name} needs at least 2 clients, got {n}")
        c = problem.cohort_size or n
        if self.full_participation and c != n:
            raise ConfigError(
                f"{self.name} is the full-participation special case (c = s = n = {n}); "
                f"got clients_per_round={c}. Use fb.TAMUNA for partial participation"
            )
        if self.control_variates and c < 2:
            raise ConfigError(f"{self.name} needs a cohort of at least 2 clients (s >= 2 holders per coordinate)")
        if self.s is not None and self.s > c:
            raise ConfigError(f"{self.name} s={self.s} exceeds the cohort size c={c} (clients_per_round)")
        if self.safeguard and c != n:
            raise ConfigError(
                f"{self.name} safeguard=True needs every client in every round (the server compares the "
                f"objective F = sum_i f_i between rounds); got clients_per_round={c} of {n}"
            )
        return TAMUNARun(self, fm, problem)


@dataclass(frozen=True)
class Scaffnew(TAMUNA):
    """Scaffnew / ProxSkip: TAMUNA with full participation and no compression (c = s = n, eta = p)."""

    name = "Scaffnew"
    compression = False
    full_participation = True


@dataclass(frozen=True)
class GD(TAMUNA):
    """Gradient descent x <- x - gamma (1/n) sum_i grad f_i(x): TAMUNA with one local step, c = s = n.

    With one step and every client uploading everything, the control variates cancel in the average
    (sum_i h_i = 0), so they are left out: the iterates are exactly gradient descent's, without the
    floating-point drift of sum_i h_i (see docs/design.md) and without the reply message.
    """

    local_steps: int | None = 1
    name = "GD"
    control_variates = False
    compression = False
    full_participation = True
    monotone = True  # with a step below 2 / L, F falls every round: a rise above the start halves at once

    def __post_init__(self):
        super().__post_init__()
        if self.local_steps != 1:
            raise ConfigError("GD takes exactly one local step per round; use fb.Scaffnew or fb.TAMUNA for more")


@dataclass(frozen=True)
class FedAvg(TAMUNA):
    """FedAvg: local steps without control variates and without compression.

    ``local_steps`` per round (10 when neither it nor ``p`` is given), or Geometric(p) steps with ``p``.

    The baseline users know. With heterogeneous clients and more than one local step its fixed point
    is not the minimiser of f (client drift): compare with TAMUNA / Scaffnew.
    """

    name = "FedAvg"
    control_variates = False
    compression = False
    auto_safeguard = False  # the baseline as users know it: its drift is the point (safeguard=True halves it away)
    auto_precondition = False  # the baseline as users know it (precondition=True turns it on)

    def __post_init__(self):
        if self.p is None and self.local_steps is None:
            object.__setattr__(self, "local_steps", 10)  # neither given: 10 local steps (p given: Geometric(p))
        super().__post_init__()
        if self.eta not in (None, 0):
            raise ConfigError("FedAvg has no control variates (eta = 0); use fb.TAMUNA for eta > 0")


# ---------------------------------------------------------------------------------------- run


class TAMUNARun(FederatedRun):
    """TAMUNA bound to a model and data (:class:`fedbayes.protocol.FederatedRun`): the cohort gets the
    server's reply after each round (``replies``)."""

    replies = True

    def __init__(self, cfg: TAMUNA, fm: FedModel, problem: Problem):
        self.cfg, self._fm, self.name = cfg, fm, cfg.name
        self._batches = minibatch.resolve(cfg.batch_size, fm, problem.data.mask.shape[1], cfg.name)
        self.divergence_hint = cfg.divergence_hint
        self._aggregate = as_aggregation(cfg.aggregation)
        self.n = problem.data.num_clients
        self.c = problem.cohort_size or self.n
        init = resolve_init(cfg.init, problem)
        theta0 = fm.off_saddle(fm.init_globals(jax.random.PRNGKey(0), init), fixed=tuple(init or ()))
        self._x0, self._unravel = ravel_pytree(theta0)
        self.dim = d = self._x0.size
        self.s = self._s_value(d) if cfg.compression else self.c
        self.safeguard = bool(
            cfg.safeguard
            if cfg.safeguard is not None
            else cfg.auto_safeguard and cfg.step_size is None and self.c == self.n
        )
        from .newton import DENSE_CURVATURE

        pre = cfg.precondition
        if pre is None:
            pre = cfg.auto_precondition and cfg.step_size is None and d <= DENSE_CURVATURE
        elif pre and d > DENSE_CURVATURE:
            raise ConfigError(
                f"{self.name} precondition=True needs dense Hessians, d <= {DENSE_CURVATURE}; got d={d}. "
                "Leave precondition=None (off for large d)"
            )
        self.precondition = bool(pre)
        dp = cfg.privacy
        self._dp = None
        if dp is not None:
            if cfg.control_variates:  # TAMUNA, Scaffnew: distributed only (TAMUNA._check_privacy)
                mechanism = (
                    "distributed: each cohort member clips its update x_i - x_bar on the s coordinates it holds and "
                    "sends x_bar plus it plus 1/s of the noise, and corrects its control variate h_i with what it "
                    "sent; the server takes each coordinate's mean over its holders that answered, which needs "
                    "only the sum of the uploads (secure aggregation can do it); no set-up curvature, no "
                    "safeguard, no final exchange"
                )
                public = "the cohort size c, the holders of each coordinate (the round's mask) and who answered"
            elif dp.mode == "distributed":
                mechanism = (
                    "distributed: each cohort member clips its update x_i - x_bar and adds 1/c of the noise; the "
                    "server sums the shares (fixed denominator c) and sees each one unless secure aggregation "
                    "sums them; no set-up curvature, no safeguard, no final exchange"
                )
                public = "the cohort size c, the mean update's denominator"
            else:
                mechanism = (
                    "central: each cohort member's update x_i - x_bar clipped at the server, Gaussian noise "
                    "on the mean update over the cohort (fixed denominator c); no set-up curvature, no safeguard, "
                    "no final exchange"
                )
                public = "the cohort size c, the mean update's denominator"
            self._dp = SumPrivacy(
                dp, problem.num_rounds, self.n, self.c, mechanism=mechanism, public=public, share_members=self.s
            )
            self.final_exchange = False  # its gradient and information would be releases the accountant does not cover
        need_p = cfg.p is None and cfg.local_steps is None
        self._estimate = cfg.step_size is None or (need_p and cfg.kappa is None) or self.precondition
        if not self._estimate:
            self._resolve(None, None, None)  # refuse an eta outside Theorem 1's range now

    @property
    def sums_uploads(self) -> bool | str:  # type: ignore[override]  # FederatedRun's plain attribute, computed here
        """True with distributed DP, whose server needs each round's uploads (the members' clipped, noised updates,
        or TAMUNA's noised iterates on their coordinates) only summed, so that secure aggregation can hide them
        (:class:`fedbayes.protocol.FederatedRun`); otherwise why not."""
        return sums_only(
            self._dp,
            True,
            f"{self.name}'s server averages the members' iterates over the holders of each coordinate and screens "
            "each upload; secure aggregation runs the TAMUNA family with distributed DP "
            "(privacy=fb.privacy.DP(..., mode='distributed')), whose server needs the sum of the uploads alone",
        )

    def _resolve(self, L_max: float | None, mu_min: float | None, mu_mean: float | None) -> tuple[float, float, float]:
        """(gamma, p, eta) from the configuration and, when estimated, (mu_min, L_max) (host side)."""
        cfg = self.cfg
        if cfg.step_size is not None:
            gamma = float(cfg.step_size)
        elif L_max is None:  # step_size None: estimated at the set-up (self._estimate)
            raise AssertionError(f"{self.name}: the step size needs L_max, estimated at the set-up")
        elif not L_max > 0:
            raise ConfigError(
                f"{self.name}: the objective has no curvature at the initial point (the largest Hessian eigenvalue "
                f"L_max is {L_max:.3g}), so the automatic step 1 / L_max is undefined and the objective has no "
                "unique minimiser there: a parameter that neither a prior nor an observation constrains (e.g. a "
                "numpyro.param whose likelihood is masked out). Give it a prior, or pass step_size"
            )
        else:
            gamma = 1.0 / L_max
        if L_max is not None and not gamma < 2.0 / L_max:
            warnings.warn(
                f"{self.name} step_size={gamma:.3g} is not below 2 / L_max = {2 / L_max:.3g} "
                "(L_max estimated at the initial point); Theorem 1 needs gamma < 2 / L_max",
                stacklevel=5,
            )
        if cfg.local_steps is not None:
            p = 1.0 / cfg.local_steps
        elif cfg.p is not None:
            p = float(cfg.p)
        else:
            if cfg.kappa is not None:
                kappa: float | None = cfg.kappa
            elif L_max is None or mu_min is None:  # p and kappa None: estimated at the set-up (self._estimate)
                raise AssertionError(f"{self.name}: kappa needs L_max and mu_min, estimated at the set-up")
            else:
                kappa = self._kappa_estimate(L_max, mu_min, mu_mean)
            gamma_L = gamma * L_max if L_max is not None else 1.0
            p = recommended_p(kappa, self.n, self.s, gamma_L=min(gamma_L, 1.999)) if kappa is not None else 0.1
        bound = max_eta(p, self.n, self.s)
        if not cfg.control_variates:
            eta = 0.0
        elif cfg.eta is None:
            eta = bound
        else:
            eta = float(cfg.eta)
            if eta > bound * (1 + 1e-12):
                raise ConfigError(
                    f"{self.name} eta={eta:.6g} is outside Theorem 1's range (0, p n (s-1) / (s (n-1))] = "
                    f"(0, {bound:.6g}] for p={p:.6g}, n={self.n}, s={self.s}; leave eta=None for the largest"
                )
        return gamma, p, eta

    def _s_value(self, d: int) -> int:
        return int(self.cfg.s) if self.cfg.s is not None else recommended_s(self.c, d, self.cfg.downlink_cost)

    def _kappa_estimate(self, L_max: float, mu_min: float, mu_mean: float | None) -> float | None:
        """L_max / mu_min (Theorem 1's kappa, the worst client's); with preconditioning L_max / mu_f, mu_f
        the smallest eigenvalue of the transformed f = (1/n) sum_i g_i at the start (1/n without a
        Levenberg shift, since sum_i S^T H_i S = I)."""
        mu = mu_mean if self.precondition else mu_min
        if mu is None or not mu > 1e-12 * L_max:
            warnings.warn(
                f"{self.name}: the objective is not strongly convex at the initial point (smallest Hessian eigenvalue "
                f"{mu:.3g}), so kappa and Theorem 1's p are undefined; using p = 0.1. Pass p or kappa",
                stacklevel=6,
            )
            return None
        # kappa >= 1 by definition; L_max and mu are estimated apart, so on a perfectly conditioned problem
        # (kappa = 1) their ratio can round to just below 1
        return max(float(L_max / mu), 1.0)

    def settings(self, state: ServerState) -> dict[str, Any]:
        """The resolved hyper-parameters in ``state`` (after the set-up): gamma, p, eta, s, c, n, d (and
        L_max, mu_min when estimated; with the safeguard the halvings so far and the step they leave)."""
        st, est = state.settings, state.estimates
        # the shortest decimal that identifies each value in the fit's float width (0.6, not 0.6000000238)
        num = lambda a: float(str(np.asarray(a)[()]))  # noqa: E731
        out = {
            "gamma": num(st.gamma),
            "p": num(st.p),
            "eta": num(st.eta),
            "s": self.s,
            "c": self.c,
            "n": self.n,
            "d": self.dim,
            "local_steps": self.cfg.local_steps,
            "safeguard": self.safeguard,
            "precondition": self.precondition,
        }
        if self.precondition:
            out.update(levenberg_shift=num(est.levenberg_shift), mu_mean=num(est.mu_mean))
        if np.isfinite(float(est.L_max)):
            out.update(L_max=num(est.L_max), mu_min=num(est.mu_min))
        if self.safeguard:
            out.update(step_halvings=int(state.halvings), gamma_final=num(st.gamma * 2.0 ** -float(state.halvings)))
        return out

    # ------------------------------------------------------------------ objective
    def client_objective(self, x: jax.Array, client: ClientData) -> jax.Array:
        """f_i(x) = -log p(D_i | x) - log p(x) / n (unconstrained x)."""
        fm, theta = self._fm, self._unravel(x)
        if fm.local_names:
            loglik = fm.client_loglik_population(theta, client.data, client.mask)
        else:
            loglik = fm.client_log_terms(theta, {}, client.data, client.mask)[1]
        return -loglik - fm.log_prior(theta, jacobian=self.cfg.jacobian) / self.n

    def client_loglik(self, x: jax.Array, client: ClientData) -> jax.Array:
        """log p(D_i | x) (models with local latents: every latent at its population mean)."""
        fm, theta = self._fm, self._unravel(x)
        if fm.local_names:
            return fm.client_loglik_population(theta, client.data, client.mask)
        return fm.client_log_terms(theta, {}, client.data, client.mask)[1]

    def objective(self, x: jax.Array, clients: ClientData) -> jax.Array:
        """f(x) = (1/n) sum_i f_i(x) over all clients (a reference for tests and benchmarks)."""
        return jnp.mean(jax.vmap(self.client_objective, in_axes=(None, 0))(x, clients))

    def to_model(self, y: jax.Array, settings: Settings | ClientSettings) -> jax.Array:
        """The model's unconstrained coordinates x = x_0 + S y of the iterate y the protocol runs on
        (x = y without preconditioning)."""
        if not self.precondition:
            return y
        return self._x0 + jnp.asarray(settings.factor, y.dtype) @ y

    def run_objective(self, y: jax.Array, client: ClientData) -> jax.Array:
        """g_i(y) = f_i(x_0 + S y): the function TAMUNA minimises (f_i itself without preconditioning)."""
        return self.client_objective(self.to_model(y, client.settings), client)

    def _grad(self, x, client):
        return jax.grad(self.run_objective)(x, client)

    # ------------------------------------------------------------------ protocol
    def num_local_steps(self, shared_key: jax.Array | None, settings: Settings | ClientSettings) -> jax.Array:
        """L of the round, common to the cohort: Geometric(p) on {1, 2, ...} or the fixed number."""
        if self.cfg.local_steps is not None:
            return jnp.asarray(self.cfg.local_steps)
        if shared_key is None:
            raise AssertionError(f"{self.name}: a random number of local steps needs the round's shared key")
        steps = jax.random.geometric(jax.random.fold_in(shared_key, 0), settings.p)
        return jnp.where(settings.p >= 1.0, jnp.ones_like(steps), steps)

    def column(self, shared_key: jax.Array | None, slot: jax.Array | None) -> jax.Array:
        """The coordinates the cohort member in ``slot`` uploads this round (both are set inside a round)."""
        if self.s == self.c:
            return jnp.ones((self.dim,), bool)
        if shared_key is None or slot is None:
            raise AssertionError(f"{self.name}: the upload mask needs the round's shared key and the member's slot")
        return mask_column(jax.random.fold_in(shared_key, 1), slot, self.dim, self.c, self.s)

    # set-up (fedbayes.protocol): x_0 to every client; when gamma or p is estimated, each client's extreme
    # Hessian eigenvalues back (with preconditioning: its dense Hessian's upper triangle), from which the
    # server sets gamma, p and eta (and S) and sends them to all
    setup_stages = 1

    def setup_server(self, key: jax.Array) -> tuple[ServerState, jax.Array]:
        """x_0 to every client; the settings are placeholders (NaN, S = I) until :meth:`setup_done`."""
        dt = self._x0.dtype
        nan = jnp.asarray(jnp.nan, dt)
        factor = jnp.eye(self.dim, dtype=dt) if self.precondition else ()
        state = ServerState(
            self._x0,
            jnp.zeros((), dt),
            jnp.asarray(jnp.inf, dt),
            jnp.zeros((), jnp.int32),
            nan,
            Settings(nan, nan, nan, nan, factor),
            jnp.zeros((), jnp.int32),
            Estimates(nan, nan, nan, nan),
        )
        return state, self._x0

    def setup_client(self, stage: int, key: jax.Array, x0: jax.Array, state: Any, client: ClientData):
        """h_i = 0 (so sum_i h_i = 0), and (mu_i, L_i) of f_i at x_0 when the server needs them; with
        preconditioning, the upper triangle of the Hessian of f_i at x_0 instead."""
        h = jnp.zeros((self.dim,), x0.dtype)
        if self.precondition:
            rows, cols = np.triu_indices(self.dim)
            return h, jax.hessian(self.client_objective)(x0, client)[rows, cols]
        return h, (client_extremes(self, client, x0) if self._estimate else ())

    def setup_server_step(self, stage: int, key: jax.Array, state: ServerState, uploads: Any):
        """With preconditioning the protocol runs on y = S^{-1} (x - x_0): it starts at y = 0."""
        if self.precondition:
            state = state._replace(x=jnp.zeros_like(state.x))
        return state, self._broadcast(state.x, state.halvings)

    def setup_done(self, state: ServerState, uploads: Any) -> ServerState:
        """mu_min = min_i mu_i, L_max = max_i L_i, then gamma, p, eta (:meth:`_resolve`) into the state's
        settings; with preconditioning first S from H = sum_i H_i (:func:`preconditioner`), and (mu_i, L_i)
        are the extreme eigenvalues of the transformed Hessians S^T H_i S."""
        L_max = mu_min = mu_mean = shift = None
        factor = state.settings.factor
        if self.precondition:
            d = self.dim
            rows, cols = np.triu_indices(d)
            up = np.zeros((uploads.shape[0], d, d))
            up[:, rows, cols] = np.asarray(uploads, np.float64)
            hess = up + np.transpose(np.triu(up, 1), (0, 2, 1))
            S, shift = preconditioner(hess.sum(0))
            # S^T H_i S for every client as two batched matrix products (2 n d^3 flops; a three-operand einsum
            # without a contraction order summed over both indices at once, n d^4: 15 min at d = 300, n = 100)
            ev = np.linalg.eigvalsh(S.T @ hess @ S)
            factor = jnp.asarray(S, self._x0.dtype)
            mu_min, L_max = float(ev[:, 0].min()), float(ev[:, -1].max())
            mu_mean = float(np.linalg.eigvalsh(S.T @ hess.sum(0) @ S)[0]) / self.n
        elif self._estimate:
            lo, hi = uploads
            mu_min, L_max = float(jnp.min(lo)), float(jnp.max(hi))
        gamma, p, eta = self._resolve(L_max, mu_min, mu_mean)
        dt = self._x0.dtype
        real = lambda v: jnp.asarray(np.nan if v is None else v, dt)  # noqa: E731
        settings = Settings(real(gamma), real(p), real(eta), real(eta / gamma), factor)
        return state._replace(
            settings=settings,
            patience=jnp.asarray(math.ceil(SAFEGUARD_PATIENCE / p), jnp.int32),
            estimates=Estimates(real(L_max), real(mu_min), real(mu_mean), real(shift)),
        )

    def client_settings(self, state: ServerState) -> ClientSettings:
        """gamma, p, eta / gamma (eta with the safeguard) and, with preconditioning, S: every client's local
        steps and control-variate updates use them."""
        st = state.settings
        return ClientSettings(st.gamma, st.p, st.eta if self.safeguard else st.cv_rate, st.factor)

    def _broadcast(self, x, halvings):
        """x_bar to a cohort member (d floats); with the safeguard also the number of halvings (one float)."""
        if self.safeguard:
            return Message((x, halvings), jnp.asarray(FLOAT_BITS * (self.dim + 1)))
        return Message(x, jnp.asarray(FLOAT_BITS * self.dim))

    def _unpack(self, payload, settings: Settings | ClientSettings):
        """(x_bar, the step gamma 2^-halvings) from a broadcast payload."""
        if self.safeguard:
            x_bar, halvings = payload
            return x_bar, settings.gamma * jnp.exp2(-halvings)
        return payload, settings.gamma

    def client_step(self, key, payload, h, client: ClientData):
        x_bar, gamma = self._unpack(payload, client.settings)
        steps = self.num_local_steps(client.shared_key, client.settings)
        if self._batches.active:  # local step m on the round's batch m (stochastic local steps)
            order = self._batches.order(key, client)
            x = jax.lax.fori_loop(
                0, steps, lambda m, x: x - gamma * (self._grad(x, self._batches.take(order, client, m)) - h), x_bar
            )
        else:
            x = jax.lax.fori_loop(0, steps, lambda _, x: x - gamma * (self._grad(x, client) - h), x_bar)
        q = self.column(client.shared_key, client.slot)
        if self._dp is not None and self._dp.distributed:  # the update on the member's s coordinates, clipped, noised
            x = self._dp.share(key, jnp.where(q, x - x_bar, 0.0))  # sent as it is (bounded: SecAgg+'s range)
            if self.cfg.control_variates:
                # TAMUNA / Scaffnew: h_i is corrected with what was sent, x_bar + share, rather than with the local
                # iterate: over each coordinate's holders the corrections then sum to zero, noise included, so
                # sum_i h_i = 0 and the fixed point stay. Its part known now is taken here; client_finish adds
                # the new x_bar's (a member that gets no reply keeps its h_i: the engine and Flower roll back)
                h = h - client.settings.cv * jnp.where(q, x_bar + x, 0.0)
        sent = Masked(jnp.where(q, x, 0.0), self.column)
        if self.safeguard:  # f_i at the broadcast point, for the server's monotonicity check
            return h, Message((sent, self.run_objective(x_bar, client)), FLOAT_BITS * (jnp.sum(q) + 1))
        return h, Message(sent, FLOAT_BITS * jnp.sum(q))

    def server_step(self, key, state: ServerState, uploads: Message, info: RoundInfo):
        """x_bar: each coordinate's mean over its holders that answered (all s of them without faults);
        a coordinate none of whose holders answered keeps its value. Faulty members get no reply and
        keep their h_i, so sum_i h_i = 0 still holds."""
        masked = uploads.payload[0] if self.safeguard else uploads.payload
        diag: dict[str, jax.Array] = {}
        if self._dp is not None and self._dp.distributed and self.cfg.control_variates:
            # TAMUNA / Scaffnew: each coordinate's mean over its holders that answered, from the sum of the uploads
            # alone (zero off each member's coordinates; the holders are public), so secure aggregation can form it
            q = jax.vmap(self.column, in_axes=(None, 0))(info.shared_key, jnp.arange(self.c)) & info.active[:, None]
            holders = jnp.sum(q, axis=0)
            total = jnp.sum(jnp.where(info.active[:, None], masked, 0.0), axis=0)  # the updates' sum
            x = jnp.where(holders > 0, state.x + total / jnp.maximum(holders, 1).astype(total.dtype), state.x)
            # the fewest shares behind any coordinate released this round (SumPrivacy.realised_epsilon)
            fewest = jnp.min(jnp.where(holders > 0, holders, self.s + 1))
            diag["dp_holders"] = jnp.where(fewest > self.s, 0, fewest)  # 0: nothing released
        elif self._dp is not None and self._dp.distributed:  # the members' clipped, noised updates: their sum alone
            x = state.x + jnp.sum(jnp.where(info.active[:, None], masked, 0.0), axis=0) / self.c
        elif self._dp is not None:  # central DP (GD, FedAvg: s = c): the clipped mean update, noised
            updates = jnp.where(info.active[:, None], self._dp.clipped(masked - state.x), 0.0)
            x = state.x + self._dp.noisy(key, jnp.sum(updates, axis=0) / self.c, 1.0 / self.c)
        elif info.faulty is None and not self._aggregate.robust:
            x = jnp.sum(masked, axis=0) / self.s
        else:
            q = jax.vmap(self.column, in_axes=(None, 0))(info.shared_key, jnp.arange(self.c)) & info.active[:, None]
            holders = jnp.sum(q, axis=0)
            x = jnp.where(holders > 0, self._aggregate(masked, q), state.x)
        diag.update(
            {f"theta/{k}": v for k, v in self._fm.constrain(self._unravel(self.to_model(x, state.settings))).items()}
        )
        diag["local_steps"] = self.num_local_steps(info.shared_key, state.settings)
        state = state._replace(x=x)
        if self.safeguard:
            state, objective = self._safeguard(state, uploads.payload[1], info)
            diag["objective"] = objective
            diag["step_halvings"] = state.halvings
        return state, self._broadcast(state.x, state.halvings), diag

    def _safeguard(self, state: ServerState, f: jax.Array, info: RoundInfo) -> tuple[ServerState, jax.Array]:
        """The monotonicity check on F = sum_i f_i at the round's broadcast point (every client answered;
        a round with faults is skipped): F above its best value by more than rounding for
        ``SAFEGUARD_PATIENCE`` rounds, or above its value at the start, halves gamma."""
        complete = jnp.all(info.active)
        F = jnp.sum(f)
        eps = jnp.finfo(state.x.dtype).eps
        first = jnp.where(jnp.isnan(state.first), F, state.first)
        tol = 1e3 * eps * (jnp.abs(F) + 1.0)
        stall = jnp.where(F < state.best, 0, state.stall + 1)
        rise = (F > state.best + tol) | ~jnp.isfinite(F)
        patience = state.patience  # ceil(10 / p): local steps and control variates, F need not fall every round
        # GD falls every round from a good step, so a rise above the start halves at once; TAMUNA's F rises
        # while its control variates settle (with s < n each coordinate is a mean of s clients' local
        # iterates), and halving then would only slow them down: it waits for the patience to run out
        above_start = (F > first + tol) if self.cfg.monotone else jnp.zeros((), bool)
        trigger = complete & rise & ((stall >= patience) | above_start | ~jnp.isfinite(F))
        new = state._replace(
            halvings=state.halvings + jnp.where(trigger, 1.0, 0.0).astype(state.halvings.dtype),
            best=jnp.where(complete & (F < state.best), F, state.best),
            stall=jnp.where(complete, jnp.where(trigger, 0, stall), state.stall).astype(state.stall.dtype),
            first=jnp.where(complete, first, state.first),
        )
        return new, jnp.where(complete, F, jnp.nan)

    def finish_message(self, payload: Any) -> Any:
        """The server's reply to a cohort member on a network: x_bar on the member's own coordinates
        (the ones ``client_finish`` is charged for), and with the safeguard the number of halvings (the
        step of the h_i update); None without control variates (no reply)."""
        if not self.cfg.control_variates:
            return None
        if self.safeguard:
            x_bar, halvings = payload
            return Masked(x_bar, self.column), halvings
        return Masked(payload, self.column)

    def client_finish(self, payload, h, client: ClientData, upload):
        """h_i += (eta / gamma) q_i * (x_bar_new - x_i): the client receives x_bar on its own q_i entries.
        (In a round where the safeguard halves gamma the correction uses the new gamma: each coordinate's
        corrections still sum to zero over its holders, so sum_i h_i = 0 and the fixed point are kept.)"""
        if not self.cfg.control_variates:
            return h, jnp.asarray(0)
        x_bar, gamma = self._unpack(payload, client.settings)
        q = self.column(client.shared_key, client.slot)
        rate = client.settings.cv / gamma if self.safeguard else client.settings.cv
        if self._dp is not None and self._dp.distributed:  # the sent part was taken in client_step (no safeguard)
            return h + rate * jnp.where(q, x_bar, 0.0), FLOAT_BITS * jnp.sum(q)
        mine = upload[0] if self.safeguard else upload
        h = h + rate * jnp.where(q, x_bar - mine, 0.0)
        return h, FLOAT_BITS * (jnp.sum(q) + (1 if self.safeguard else 0))

    # final exchange (fedbayes.protocol): the estimate to every client, its log-likelihood's gradient and
    # Hessian (upper triangle; d <= DENSE_CURVATURE) back, so the result carries the convergence material
    final_exchange = True

    def final_message(self, key: jax.Array, state: ServerState) -> jax.Array:
        """The estimate in the model's coordinates (x_0 + S y with preconditioning)."""
        return self.to_model(state.x, state.settings)

    def final_client(self, key: jax.Array, x: jax.Array, h: Any, client: ClientData):
        """grad log p(D_i | x) and, for d <= DENSE_CURVATURE, the upper triangle of its Hessian."""
        from .newton import DENSE_CURVATURE

        g = jax.grad(self.client_loglik)(x, client)
        if self.dim > DENSE_CURVATURE:
            return (), (g,)
        rows, cols = np.triu_indices(self.dim)
        return (), (g, jax.hessian(self.client_loglik)(x, client)[rows, cols])

    def final_server(
        self, key: jax.Array, state: ServerState, x: jax.Array | None, uploads: Any, locals_: Any
    ) -> FitParts:
        """The estimate (read from ``state``; ``x``, the final message, may be None); with every client's
        upload, ``gradient`` = grad of the log posterior (the objective TAMUNA maximises, -n f) at the
        estimate and ``information`` = its negative Hessian (unconstrained, flat)."""
        x_model = self.to_model(state.x, state.settings)
        theta = self._unravel(x_model)
        params = self._fm.constrain(theta)
        settings = self.settings(state)
        parts = FitParts(theta=theta, params=params, params_last=params, settings=settings, final_state=state)
        if self._dp is not None:
            parts.privacy = self._dp.report()
        if uploads is None:
            return parts
        log_prior = lambda y: self._fm.log_prior(self._unravel(y), jacobian=self.cfg.jacobian)  # noqa: E731
        parts["gradient"] = jnp.sum(uploads[0], axis=0) + jax.grad(log_prior)(x_model)
        if len(uploads) > 1:
            rows, cols = np.triu_indices(self.dim)
            upper = jnp.zeros((self.dim, self.dim), x_model.dtype).at[rows, cols].set(jnp.sum(uploads[1], axis=0))
            hess = upper + jnp.triu(upper, 1).T + jax.hessian(log_prior)(x_model)
            parts["information"] = -hess
        return parts

    def finalize(self, key, carry, problem: Problem, history=None) -> FitParts:
        """The estimate, with the final exchange's gradient and information (``final_bits``); under privacy
        the estimate alone (no final exchange)."""
        if not self.final_exchange:
            parts = self.final_server(key, carry[0], None, None, None)
            if self._dp is not None and history is not None:  # with the rounds as they went (distributed mode)
                parts.privacy = self._dp.report(history.get("dp_holders" if self.cfg.control_variates else "active"))
            return parts
        return final_exchange(self, key, carry[0], carry[1], stack_clients(problem.data))


__all__ = [
    "TAMUNA",
    "Scaffnew",
    "GD",
    "FedAvg",
    "mask",
    "mask_column",
    "template_column",
    "aggregate",
    "recommended_p",
    "recommended_s",
    "max_eta",
    "theorem1_rate",
    "expected_uplink_floats",
    "estimate_condition",
    "check_init",
    "resolve_init",
    "map_estimate",
    "map_solve",
    "map_objective",
    "POPULATION_MEAN",
]
