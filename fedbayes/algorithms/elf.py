"""Federated Langevin samplers: LMC and the ELF family (Karagulyan & Richtarik, 2023).

The target is the posterior of the global sites, pi(x) proportional to exp(-U(x)) with

    U(x) = -log p(x) - sum_i log p(D_i | x) = sum_i U_i(x),   U_i(x) = -log p(D_i | x) - log p(x) / b,

in unconstrained space (with the Jacobian of the transforms). The paper writes F = (1/n) sum_i F_i;
that is F_i = n U_i, handled here so users never see it (a mis-scaled F_i would sample pi^(1/n)).
All samplers take the server step

    x_{k+1} = x_k - gamma g_k + sqrt(2 gamma) Z_k,     Z_k ~ N(0, I) drawn at the server,

with g_k an estimate of grad U kept as g_k = sum_i g^i_k:

* **LMC**: g^i = grad U_i(x_{k+1}), sent in full (or, as the *naive* baseline, compressed without
  error feedback: g^i = Q(grad U_i(x_{k+1}))).
* **D-ELF** (EF21, Algorithm 1): uplink compression of gradient differences,
  c^i = Q_D(grad U_i(x_{k+1}) - g^i_k), g^i += c^i, g += sum_i c^i; the downlink sends x in full.
* **P-ELF** (EF21-P, Algorithm 2): downlink compression of the model difference,
  v_k = Q_P(x_{k+1} - w_k), w_{k+1} = w_k + v_k on server and clients alike; clients send
  grad U_i(w_{k+1}) in full.
* **B-ELF** (Algorithm 3): both; clients compress grad U_i(w_{k+1}) - g^i_k.

Samples are the server's x, never w. Initialisation (the digest's reading of the pseudo-code):
w_0 = x_0 and g^i_0 = grad U_i(x_0), sent in full once and counted in the ledger. Error feedback
needs contractive compressors; an unbiased one is refused unless ``rescale=True`` scales it by
1/(1 + omega), which makes it contractive with alpha = 1/(1 + omega).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, Self, TypeVar
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .. import minibatch
from ..compress import Compressor, identity, require_contractive, scale_to_contractive
from ..engine import run_jit, split_server_key, stack_clients
from ..errors import ConfigError, ModelError, require_choice, require_int, require_real
from ..kernels import curvature
from ..minibatch import check_batch_size
from ..privacy import LangevinPrivacy, check_dp, folded
from ..introspect import FedModel, serialized
from ..protocol import FLOAT_BITS, ClientData, FederatedRun, FitParts, Message, Problem, RoundInfo, dense_message
from ..faults import fault_weight
from .channels import ClippedEF21Uplink, DirectUplink, EF21PDownlink, EF21Uplink, FullDownlink
from .warmstart import check_init, resolve_init

DENSE_CURVATURE = 1000
"""Up to this many coordinates a client sends its Hessian for the automatic step size (see
:meth:`LangevinRun._local_curvature`)."""


class ServerState(NamedTuple):
    x: jax.Array  # (chains, d)
    gamma: jax.Array  # () the step, resolved in the set-up
    down: Any  # the downlink channel's state (EF21-P: w, (chains, d); otherwise ())
    up: Any  # the uplink channel's state (EF21: g = sum_i g^i; QLSD: H = sum_i h_i; otherwise ())
    noise: Any = ()  # diag(sum_i E[g_i g_i']) from the set-up, for the stationary law's report (or ())


class ClientState(NamedTuple):
    down: Any  # the downlink channel's state (EF21-P: the client's copy of w)
    up: Any  # the uplink channel's state (EF21: g^i; QLSD: h_i)


class LangevinServerState(Protocol):
    """What :class:`LangevinRun`'s server step reads and replaces: :class:`ServerState`'s fields (the joint
    samplers' server states carry them too, and run the same step)."""

    @property
    def x(self) -> jax.Array: ...
    @property
    def gamma(self) -> jax.Array: ...
    @property
    def down(self) -> Any: ...
    @property
    def up(self) -> Any: ...
    def _replace(self, *, x: jax.Array = ..., down: Any = ..., up: Any = ...) -> Self: ...


_S = TypeVar("_S", bound=LangevinServerState)


@dataclass(frozen=True)
class LangevinSampler:
    """Shared options of the federated Langevin samplers.

    Parameters
    ----------
    step_size:
        gamma, multiplying grad U of the full posterior potential. None (default), up to
        ``DENSE_CURVATURE`` = 1000 coordinates: the chains start around the mode (see ``init``) and the
        server preconditions the Langevin step by S, S S' = H^-1 the inverse Hessian of U at the mode,

            x <- x - gamma S S' g + sqrt(2 gamma) S Z,

        (Langevin dynamics in y = S^-1 x, where the posterior is close to N(0, I): the same stationary
        law, scale-free, and every direction mixes at the same rate), with gamma = 0.1 / lambda_max of
        S' H S measured where the chains start (0.1 at the mode itself). Otherwise 0.1 / L with L the
        largest eigenvalue of the Hessian of U at the initial point, without preconditioning (also for a
        user-given start). A given ``step_size`` is never preconditioned.
    num_chains:
        Independent chains run side by side (each is its own federated run; the ledger counts all).
    warmup, thinning:
        Rounds dropped at the start (None: half of ``num_rounds``, as Stan and NumPyro's examples do),
        and keep every ``thinning``-th of the rest.
    init:
        Start of the chains. None (default) or ``"map"``: up to ``DENSE_CURVATURE`` = 1000 coordinates,
        the mode of the density the sampler targets (Jacobian included), found by the federated damped
        Newton method (:mod:`fedbayes.algorithms.newton`, its bits in ``init_bits``), and with several
        chains each starts at an independent draw of the Laplace approximation N(mode, H^-1), H the
        Hessian of U there, so that R-hat compares independent starts; the automatic step is then
        measured at the mode, where the chains are. Beyond 1000 coordinates None is the deterministic
        start (each prior's mean, :meth:`FedModel.init_globals`) and ``"map"`` the same solver's gradient
        steps, jittered per chain by U(-0.5, 0.5). ``"prior"``: the deterministic start without the search,
        jittered per chain by U(-0.5, 0.5) (on a network, ``fedbayes.flower``, None means ``"prior"``:
        the search needs a data-dependent number of exchanges; pass ``init=`` a MAP ``Result`` instead).
        A dict of constrained values or a previous fit ``Result`` (its ``params``) is used as given,
        jittered per chain by U(-0.5, 0.5).
    batch_size:
        B, the rows of a client's data each round's gradient sees (None, the default: all of them).
        Each client then sends the gradient of its log-likelihood on a fresh minibatch of B rows scaled
        by N_i / B (:mod:`fedbayes.minibatch`; each chain its own batch), an unbiased estimate of
        grad U_i: stochastic-gradient Langevin dynamics (SGLD, Welling and Teh 2011). It is not exact:
        the gradient noise (covariance V per round, summed over clients) adds to the injected noise,
        and on a Gaussian target with Hessian H the stationary covariance solves
        H S + S H - gamma H S H = 2 I + gamma V instead of ULA's H S + S H - gamma H S H = 2 I (the
        same mean; ``tests/test_minibatch.py`` checks the formula), so the posterior comes out wider
        by about gamma V / 2 in the precision's units: keep the full batch unless the data are too
        large, and a small step with minibatches. The set-up (the start at the mode, the step size,
        the ELF samplers' first full gradients) uses all rows. With error feedback (D-/B-ELF) the
        memories track the noisy gradients; no result covers that case. A model's
        ``numpyro.plate(..., subsample_size=B)`` sets B the same way.
    step_scale:
        The automatic step's gamma lambda_max (None: the sampler's own, 0.1 for LMC and the ELF samplers;
        ignored with a given ``step_size``). The step is unadjusted: its stationary law is wider than the
        posterior, at the mode by 1 / sqrt(1 - gamma / 2) in the preconditioned coordinates (2.6% at 0.1),
        and more with compression. The fit reports the widening (``res.settings["sd_inflation"]``, the
        ``sd_inflation`` row of ``res.diagnostics``, :mod:`fedbayes.algorithms.stationary`) and, above 5%,
        warns with the step that would meet it.
    """

    step_size: float | None = None
    num_chains: int = 4
    warmup: int | None = None
    thinning: int = 1
    init: Any = None
    batch_size: int | None = None
    step_scale: float | None = None

    partial_participation = False
    full_participation_reason = (
        "the ELF paper's setting: clients keep copies of w and the gradient sum must be complete"
    )
    partial_participation_instead = "use fb.QLSD for partial participation"
    name = "LMC"

    def __post_init__(self):
        if self.step_size is not None and (
            isinstance(self.step_size, bool) or not isinstance(self.step_size, numbers.Real) or not self.step_size > 0
        ):
            raise ConfigError(f"{self.name} step_size must be a positive number or None, got {self.step_size!r}")
        require_int(self.num_chains, f"{self.name} num_chains")
        require_real(
            self.step_scale, f"{self.name} step_scale", 0.0, 2.0, open_low=True, open_high=True, allow_none=True
        )
        if self.warmup is not None:
            require_int(self.warmup, f"{self.name} warmup", 0)
        require_int(self.thinning, f"{self.name} thinning")
        check_init(self.init, self.name)
        check_batch_size(self.batch_size, self.name)
        self._channels(None)  # refuse a compressor of the wrong kind now, not at fit time
        check_dp(getattr(self, "privacy", None), self.name)  # LMC, P-, D- and B-ELF have the option

    def _channels(self, dim: int | None) -> tuple[Any, Any]:
        """(uplink, downlink) channels (:mod:`fedbayes.algorithms.channels`) for ``dim`` coordinates (None:
        the compressors' checks only)."""
        return DirectUplink(), FullDownlink()

    def build(self, problem: Problem) -> LangevinRun:
        fm: FedModel = problem.model
        fm.require(self.name, minibatch=True)
        self._check_latents(fm)
        params = [n for n in fm.global_names if fm.sites[n].role == "param"]
        if params:
            raise ModelError(
                f"{self.name} samples a posterior, but {params} are numpyro.param sites without a prior; "
                "give them priors with numpyro.sample"
            )
        C = problem.data.num_clients
        if not self.partial_participation and problem.cohort_size not in (None, C):
            raise ConfigError(
                f"{self.name} needs every client in every round ({self.full_participation_reason}), got "
                f"clients_per_round={problem.cohort_size} of {C}; {self.partial_participation_instead}"
            )
        if self.warmup is not None and self.warmup >= problem.num_rounds:
            raise ConfigError(f"{self.name} warmup={self.warmup} leaves no draws from {problem.num_rounds} rounds")
        self._check_privacy(problem)
        return self._make_run(fm, problem)

    def _check_privacy(self, problem: Problem) -> None:
        """Client-level DP of a sampler (its ``privacy`` option, where it has one) needs every release
        accounted: a given step (the automatic one reads the clients' Hessians) and a start that asks the
        clients nothing (the mode search does). With a full-gradient uplink (LMC, P-ELF) the distributed mode
        needs it uncompressed; under error feedback (D-/B-ELF) the privacy is central only: a client's
        contribution to the released sum is its memory, which only the server, keeping every client's, can
        clip (``ClippedEF21Uplink``). A compressed downlink (P-/B-ELF) sends functions of the released
        iterates only."""
        privacy = getattr(self, "privacy", None)
        if privacy is None:
            return
        up, _ = self._channels(None)
        if isinstance(up, EF21Uplink) and privacy.mode != "central":
            raise ConfigError(
                f"{self.name}'s privacy is central: a client's contribution to the released sum is its "
                "error-feedback memory, which the server clips (it keeps every client's); in the "
                "distributed mode nobody could bound it. Use mode='central', or LMC / P-ELF"
            )
        if self.step_size is None:
            raise ConfigError(
                f"{self.name} with privacy needs a given step_size: the automatic step is computed from "
                "the clients' Hessians at set-up, a release the accountant does not cover"
            )
        if self.init is None or (isinstance(self.init, str) and self.init == "map"):
            raise ConfigError(
                f"{self.name} with privacy needs init='prior' or given values (a dict or a Result): the "
                "default start searches the mode with the clients' gradients and Hessians, releases "
                "the accountant does not cover"
            )
        if privacy.mode == "distributed" and up.compressor != identity():
            raise ConfigError(
                f"{self.name} with distributed DP sends each client's gradient clipped and noised in "
                f"full: compressing it afterwards ({up.compressor.name}) would change its norm and noise; "
                "use the identity compressor, or mode='central' (the server clips what it decodes)"
            )

    def _check_latents(self, fm: FedModel) -> None:
        """The model's local latents (and what goes with them) refused or required."""
        if fm.local_names:
            raise ModelError(
                f"{self.name} samples the global sites only, but the model has local latents "
                f"{list(fm.local_names)}; use fb.FedSOUL for personalised models (or fb.JointLMC for their joint "
                "posterior)"
            )

    def _make_run(self, fm: FedModel, problem: Problem) -> LangevinRun:
        return LangevinRun(self, fm, problem)


def theory_step_size(
    variant: str, *, L: float, Lbar: float, mu: float, alpha_up: float = 1.0, alpha_down: float = 1.0
) -> float:
    """The largest step size the ELF paper's theorems allow (in this library's convention).

    ``L`` is the smoothness constant of U = sum_i U_i, ``Lbar`` = (1/n) sum_i L_i^2 with L_i that of the
    paper's F_i = n U_i, ``mu`` the log-Sobolev constant of the posterior, ``alpha_*`` the compressors'
    contraction constants. Theorem 1 (D-/P-ELF; LMC is alpha = 1), with p = alpha / 2 and
    beta = 2 (1 - alpha) Lbar / alpha (the digest's choice s = alpha / (2 (1 - alpha))):

        gamma <= min{ sqrt(p / (1 + beta)) / 14, p / (6 mu), 1 / (2 sqrt(2) L) }

    (p = 1, beta = 0 at alpha = 1). Theorem 2 (B-ELF):

        gamma <= min{ alpha_D / (4 mu), alpha_P / (4 mu), alpha_D alpha_P / (495 sqrt((1 - alpha_D/2)(1 - alpha_P/2)
        Lbar)) }.

    The bounds are about 10^3 times conservative in practice; the samplers' default step is
    0.1 / lambda_max of the Hessian of U instead.
    """
    for name, a in (("alpha_up", alpha_up), ("alpha_down", alpha_down)):
        if not 0.0 < a <= 1.0:
            raise ConfigError(f"{name} must lie in (0, 1], got {a}")
    if min(L, Lbar, mu) <= 0:
        raise ConfigError("L, Lbar and mu must be positive")
    key = variant.lower().replace("_", "-")
    if key == "b-elf":
        return min(
            alpha_up / (4 * mu),
            alpha_down / (4 * mu),
            alpha_up * alpha_down / (495 * np.sqrt((1 - alpha_up / 2) * (1 - alpha_down / 2) * Lbar)),
        )
    alpha = {"lmc": 1.0, "d-elf": alpha_up, "p-elf": alpha_down}.get(key)
    if alpha is None:
        raise ConfigError(f"variant must be 'lmc', 'd-elf', 'p-elf' or 'b-elf', got {variant!r}")
    p, beta = (1.0, 0.0) if alpha == 1.0 else (alpha / 2, 2 * (1 - alpha) * Lbar / alpha)
    return min(np.sqrt(p / (1 + beta)) / 14, p / (6 * mu), 1 / (2 * np.sqrt(2) * L))


@serialized
def curvature_step_size(
    model,
    data,
    at: Mapping[str, Any] | None = None,
    *,
    scale: float = 0.1,
    model_kwargs: Mapping[str, Any] | None = None,
) -> float:
    """A safe Langevin step ``scale / lambda_max``, lambda_max the largest eigenvalue of the Hessian of
    the posterior potential U at ``at`` (constrained values, e.g. a MAP estimate; default: the
    samplers' default start, the mode up to 1000 coordinates), by a power iteration on Hessian-vector
    products summed over clients."""
    from ..data import FederatedData

    fd = data if isinstance(data, FederatedData) else FederatedData(data)
    problem = Problem(FedModel(model, fd, model_kwargs), fd, 1)
    if not scale > 0:
        raise ConfigError(f"scale must be positive, got {scale!r}")
    run = LMC(init=at).build(problem)
    return float(scale / jax.jit(run.max_curvature)(stack_clients(fd), run._x0))


def _compression_of(run: Any) -> str:
    """``"uplink top_k(2), downlink identity"``: the run's channels' compressors."""
    links = (("downlink", run.down), ("uplink", run.up))
    return ", ".join(f"{name} {getattr(c, 'compressor', identity()).name}" for name, c in links)


def _ef_compressor(c: Compressor, rescale: bool, who: str) -> Compressor:
    require_choice(rescale, f"{who} rescale", (True, False))
    return scale_to_contractive(c) if rescale else require_contractive(c, who)


@dataclass(frozen=True)
class LMC(LangevinSampler):
    """Federated Langevin Monte Carlo. With a ``compressor`` (any kind: unbiased such as rand_k / qsgd,
    or biased such as top_k) it is the *naive* compressed LMC baseline: each client sends
    Q(grad U_i(x)) with no error feedback. A biased Q biases the stationary law (a contractive one
    scaled by 1/(1+omega) also shrinks the drift and inflates the covariance by about 1+omega)."""

    compressor: Compressor = identity()
    privacy: Any = None
    name = "LMC"

    def _channels(self, dim):
        return DirectUplink(self.compressor), FullDownlink()


@dataclass(frozen=True)
class DELF(LangevinSampler):
    """D-ELF (Algorithm 1): EF21 error feedback on the uplink, full downlink. ``privacy``: central DP, each
    client's memory clipped at the server (see ``LangevinSampler._check_privacy``)."""

    uplink: Compressor = identity()
    rescale: bool = False
    privacy: Any = None
    name = "D-ELF"

    def _channels(self, dim):
        return EF21Uplink(_ef_compressor(self.uplink, self.rescale, self.name)), FullDownlink()


@dataclass(frozen=True)
class PELF(LangevinSampler):
    """P-ELF (Algorithm 2): EF21-P error feedback on the downlink, full uplink. ``privacy``: LMC's (its uplink
    is LMC's; the downlink sends functions of the released iterates only)."""

    downlink: Compressor = identity()
    rescale: bool = False
    privacy: Any = None
    name = "P-ELF"

    def _channels(self, dim):
        return DirectUplink(), EF21PDownlink(_ef_compressor(self.downlink, self.rescale, self.name))


@dataclass(frozen=True)
class BELF(LangevinSampler):
    """B-ELF (Algorithm 3): EF21-P on the downlink and EF21 on the uplink. ``privacy``: D-ELF's."""

    uplink: Compressor = identity()
    downlink: Compressor = identity()
    rescale: bool = False
    privacy: Any = None
    name = "B-ELF"

    def _channels(self, dim):
        return (
            EF21Uplink(_ef_compressor(self.uplink, self.rescale, self.name)),
            EF21PDownlink(_ef_compressor(self.downlink, self.rescale, self.name)),
        )


class LangevinRun(FederatedRun):
    """A federated Langevin sampler bound to a model (:class:`fedbayes.protocol.FederatedRun`): the server's
    Langevin step between an uplink and a downlink channel (:mod:`fedbayes.algorithms.channels`). P-/B-ELF's
    clients keep a copy of the server's w, which a faulty member is re-sent (``resyncs``); the other
    samplers take part in the same exchange with an empty message (0 bits), so every sampler's ledger and
    Flower messages follow one rule."""

    resyncs = True
    step_scale = 0.1
    """The automatic step's gamma * lambda_max."""
    _dp: LangevinPrivacy | None = None
    """LMC's client-level privacy (:class:`fedbayes.privacy.LangevinPrivacy`); None for the runs that
    have no privacy option (the joint samplers' runs build their own state)."""

    def __init__(self, cfg: LangevinSampler, fm: FedModel, problem: Problem):
        self.cfg, self._fm, self.name = cfg, fm, cfg.name
        if cfg.step_scale is not None:
            self.step_scale = float(cfg.step_scale)
        self._b = problem.data.num_clients
        self._batches = minibatch.resolve(cfg.batch_size, fm, problem.data.mask.shape[1], cfg.name)
        # a client's gradient is a sum over its masked rows and its state has the parameter's shape: the engine may
        # run a round's clients in size buckets (a minibatch draw spans the padded rows)
        self.pads_freely = not self._batches.active
        self.warmup = cfg.warmup if cfg.warmup is not None else problem.num_rounds // 2
        self._spread: jax.Array | None = None  # Cholesky factor of H^-1 at the mode: the chains' dispersed starts
        self._precond: jax.Array | None = None  # the same factor S as the Langevin preconditioner (automatic step)
        self.map_bits, self.map_iterations, self.start = (0, 0), 0, "given"
        self._hessian: np.ndarray | None = None  # H of U at the mode found (the stationary law's report)
        flat, self._unravel = ravel_pytree(fm.init_globals(None))
        self.up, self.down = cfg._channels(int(flat.size))
        auto = cfg.init is None or (isinstance(cfg.init, str) and cfg.init == "map")
        if auto and flat.size <= DENSE_CURVATURE:
            flat = self._start_at_mode(problem, flat)
        else:
            if auto or cfg.init == "prior":
                self.start = "map" if cfg.init == "map" else "prior-centre"
            flat = ravel_pytree(fm.init_globals(None, resolve_init(cfg.init, problem, jacobian=True)))[0]
        self._x0, self.dim = flat, flat.size
        dp = getattr(cfg, "privacy", None)
        self._dp = None
        if dp is not None:
            if cfg.step_size is None:  # refused by build (_check_privacy)
                raise ConfigError(f"{cfg.name} with privacy needs a given step_size")
            self._dp = LangevinPrivacy(dp, float(cfg.step_size), problem.num_rounds, problem.data.num_clients)
            if isinstance(self.up, EF21Uplink):  # D-/B-ELF: the memories are what is released
                self.up = ClippedEF21Uplink(self.up.compressor, clip=float(dp.clip))

    @property
    def sums_uploads(self) -> bool | str:  # type: ignore[override]  # FederatedRun's plain attribute, computed here
        """True where the server needs every exchange's uploads only summed, so that secure aggregation
        can hide them (:class:`fedbayes.protocol.FederatedRun`): LMC with the identity compressor, without
        privacy or with distributed DP; otherwise why not."""
        if type(self) is not LangevinRun:
            return "the joint samplers' rounds are not set up for secure aggregation"
        if not (isinstance(self.up, DirectUplink) and self.up.compressor == identity()):
            return (
                "its uploads are compressed: the server decodes each message, and D-/P-/B-ELF's error-feedback "
                "memories follow each client's own messages"
            )
        if self._dp is not None and not self._dp.distributed:
            return (
                "central DP clips each upload at the server; use DP(mode='distributed'), where each client clips "
                "its own upload and adds its share of the noise"
            )
        return True

    @property
    def common_client_fields(self) -> tuple[str, ...]:  # type: ignore[override]  # FederatedRun's plain attribute
        """EF21-P's copies of w (``"down"``): every client starts from x_0, adds the same broadcasts, and a faulty
        one is re-sent the server's w, so all copies are one (:class:`fedbayes.protocol.FederatedRun`)."""
        return ("down",) if isinstance(self.down, EF21PDownlink) else ()

    def _start_at_mode(self, problem: Problem, fallback: jax.Array) -> jax.Array:
        """The mode of the target by federated Newton (its bits kept in ``map_bits``) and the Cholesky
        factor of H^-1 there for the dispersed starts; the deterministic start if no finite mode is found."""
        from .warmstart import map_solve

        sol = map_solve(problem, jacobian=True)
        self.map_bits, self.map_iterations = sol.bits, sol.iterations
        if not (bool(jnp.all(jnp.isfinite(sol.x))) and np.isfinite(sol.value)):
            self.start = "prior-centre"
            return fallback
        self.start = "map"
        hess = np.asarray(sol.hessian, dtype=np.float64)
        self._hessian = hess
        try:
            chol = np.linalg.cholesky(0.5 * (hess + hess.T))
            self._spread = jnp.asarray(np.linalg.inv(chol).T, sol.x.dtype)  # S S' = H^-1
        except np.linalg.LinAlgError:  # not positive definite at the mode found: jitter as for a given start
            self._spread = None
        if self.cfg.step_size is None and self._spread is not None:
            self._precond = self._spread
            if isinstance(self.down, EF21PDownlink):  # the downlink is compressed in the whitened coordinates
                # S^-1 x (x @ L = (L' x)'); the clients need S to read it: sent once, upper triangle
                self.down = dataclasses.replace(self.down, precond=self._precond, whiten=jnp.asarray(chol, sol.x.dtype))
                d, n = int(sol.x.size), problem.data.num_clients
                self.map_bits = (self.map_bits[0], self.map_bits[1] + n * FLOAT_BITS * (d * (d + 1) // 2))
        return sol.x

    # ------------------------------------------------------------------ potentials
    def client_potential(self, x: jax.Array, client: ClientData) -> jax.Array:
        """U_i(x) = -log p(D_i | x) - log p(x) / b, in unconstrained space (Jacobian included)."""
        theta = self._unravel(x)
        loglik = self._fm.client_log_terms(theta, {}, client.data, client.mask)[1]
        return -loglik - self._fm.log_prior(theta, jacobian=True) / self._b

    def _likelihood_potential(self, x: jax.Array, client: ClientData) -> jax.Array:
        """-log p(D_i | x) alone: under privacy the server adds the prior's gradient itself, so that a
        client's upload does not depend on how many clients there are (adding or removing one would
        change every other upload's share of the prior)."""
        return -self._fm.client_log_terms(self._unravel(x), {}, client.data, client.mask)[1]

    def _prior_grad(self, x: jax.Array) -> jax.Array:
        """grad of -log p(x) (Jacobian included) at each chain's x: the server's part under privacy."""
        return jax.vmap(jax.grad(lambda v: -self._fm.log_prior(self._unravel(v), jacobian=True)))(x)

    def _grad(self, x, client, key: jax.Array | None = None):
        """grad U_i at each chain's x (rows of ``x``); with minibatches and a ``key``, each chain's on its own
        batch (:mod:`fedbayes.minibatch`). Under privacy the likelihood's gradient alone."""
        potential = self.client_potential if self._dp is None else self._likelihood_potential
        if key is None or not self._batches.active:
            return jax.vmap(jax.grad(potential), in_axes=(0, None))(x, client)  # over chains
        keys = jax.random.split(minibatch.batch_key(key), x.shape[0])
        return jax.vmap(lambda xc, kc: jax.grad(potential)(xc, self._batches.draw(kc, client)))(x, keys)

    def max_curvature(self, clients: ClientData, x: jax.Array) -> jax.Array:
        """lambda_max of the Hessian of U = sum_i U_i at x, by power iteration on summed client HVPs."""
        neg_u = lambda y: -jnp.sum(jax.vmap(self.client_potential, in_axes=(None, 0))(y, clients))  # noqa: E731
        return curvature(neg_u, x, jnp.ones_like(x), 100)[0]

    # ------------------------------------------------------------------ set-up (fedbayes.protocol)
    setup_stages = 1

    def setup_server(self, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x_0 per chain, sent to every client: with several chains, independent draws of N(mode, H^-1)
        at the mode found by Newton, otherwise the initial point jittered by U(-0.5, 0.5) per coordinate."""
        chains = self.cfg.num_chains
        jitter: float | jax.Array
        if chains == 1:
            jitter = 0.0
        elif self._spread is not None:
            jitter = jax.random.normal(key, (chains, self.dim), self._x0.dtype) @ self._spread.T
        else:
            jitter = jax.random.uniform(key, (chains, self.dim), minval=-0.5, maxval=0.5)
        x0 = self._x0[None] + jitter
        return x0, x0

    def _local_curvature(self, client: ClientData) -> Any:
        """A client's share of the automatic step size: the Hessian of U_i at the initial point (d x d,
        summed by the server), or beyond ``DENSE_CURVATURE`` coordinates the largest absolute eigenvalue
        of its own Hessian (the server sums them: an upper bound on lambda_max of the sum, so a safe
        step). Nothing with a configured ``step_size``."""
        if self.cfg.step_size is not None:
            return ()
        if self.dim <= DENSE_CURVATURE:
            return jax.hessian(self.client_potential)(self._x0, client)
        return curvature(lambda y: -self.client_potential(y, client), self._x0, jnp.ones_like(self._x0), 100)[0]

    def _step_from(self, curvatures: Any) -> jax.Array:
        """gamma: the configured step, or ``step_scale`` (0.1) / lambda_max(Hessian of U at the initial point)."""
        if self.cfg.step_size is not None:
            return jnp.asarray(self.cfg.step_size)
        total = jnp.sum(curvatures, 0)
        if self._precond is not None:  # the Hessian in the preconditioned coordinates y = S^-1 x: S' H S
            total = self._precond.T @ total @ self._precond
        lam = jnp.max(jnp.abs(jnp.linalg.eigvalsh(total))) if self.dim <= DENSE_CURVATURE else total
        return self.step_scale / lam

    def setup_client(self, stage: int, key: jax.Array, x0: jax.Array, state: Any, client: ClientData):
        """The channels' client states (w_0 = x_0 for EF21-P) and the client's curvature share; with an
        uplink that starts from the gradients (LMC, ELF), g^i_0 = grad U_i(x_0) back to the server."""
        if self.up.setup_gradient:
            g = self._grad(x0, client)
            if self._dp is not None and self._dp.distributed:
                g = self._dp.share(key, g)
            return ClientState(self.down.client_start(x0), self.up.client_start(g)), (g, self._local_curvature(client))
        return (
            ClientState(self.down.client_start(x0), self.up.client_start(jnp.zeros_like(x0))),
            ((), self._local_curvature(client)),
        )

    def setup_server_step(self, stage: int, key: jax.Array, x0: jax.Array, uploads: Any):
        """The step size, the channels' server states and, from g = sum_i g^i_0, the first Langevin move
        (QLSD: no gradients at set-up, and x_0 is the first broadcast)."""
        g, curvatures = uploads
        gamma = self._step_from(curvatures)
        noise = self._noise_inputs(g, curvatures)
        if not self.up.setup_gradient:
            zeros = jnp.zeros_like(x0)
            state = ServerState(x0, gamma, self.down.server_start(x0), self.up.server_start(zeros), noise)
            return state, dense_message(x0)
        if self._dp is not None and not self._dp.distributed:  # the first move is a release too
            key, k_dp = jax.random.split(key)
            total = self._dp.noisy(k_dp, self._dp.clipped_sum(g), jnp.ones((), g.dtype))
        else:
            total = jnp.sum(g, 0)
        if self._dp is not None:
            total = total + self._prior_grad(x0)
        start = g if isinstance(self.up, ClippedEF21Uplink) else total  # per-client memories, or their sum
        state = ServerState(x0, gamma, self.down.server_start(x0), self.up.server_start(start), noise)
        return self._move(key, state, total, gamma)

    def _noise_inputs(self, g: Any, curvatures: Any) -> Any:
        """diag(sum_i E[g_i g_i']) in x from the set-up's gradients, for an unbiased uplink compressor's share
        of the stationary law's report (:mod:`fedbayes.algorithms.stationary`); () where it cannot be measured.
        Several chains start at draws of N(mode, H^-1), so the mean over chains of sum_i g_i(x_0)^2 estimates
        it under the law; one chain starts at the mode, and the spread's diag(sum_i H_i H^-1 H_i) is added
        from the clients' Hessians (the automatic step's), without which it is not measured."""
        if isinstance(g, tuple) or self._spread is None:
            return ()
        grad_sq = jnp.sum(g**2, axis=(0, 1)) / g.shape[1]
        if g.shape[1] > 1:
            return grad_sq
        if isinstance(curvatures, tuple) or self.dim > DENSE_CURVATURE:
            return ()
        return grad_sq + jnp.sum(jnp.einsum("ijk,kl->ijl", curvatures, self._spread) ** 2, axis=(0, 2))

    def stationary_report(self, gamma: float, server: Any) -> dict[str, Any]:
        """The stationary law's sd inflation at the mode (:mod:`fedbayes.algorithms.stationary`): the largest
        over the coordinates (``sd_inflation``) and the step that keeps every one within ``INFLATION_LIMIT``
        (``sd_inflation_step``); where the mode's Hessian is unknown (a given start) or a channel's error has
        no model, only ``sd_inflation_note``, which says why."""
        from .stationary import INFLATION_LIMIT, NoiseInputs, sd_inflation, step_for_inflation

        if self._hessian is None:
            return {"sd_inflation_note": "not computed: the chains did not start at a mode found by fedbayes"}
        if self._batches.active:
            return {"sd_inflation_note": "not computed: the minibatches' gradient noise is not measured"}
        d = self._hessian.shape[0]
        s = np.eye(d) if self._precond is None else np.asarray(self._precond, dtype=np.float64)
        grad_sq = np.asarray(server.noise, dtype=np.float64) if len(server.noise) else None
        at = NoiseInputs(hessian_y=s.T @ self._hessian @ s, precond=s, grad_sq=grad_sq, dim=d)
        parts = [self.down.stationary_noise(at), self.up.stationary_noise(at)]
        links = _compression_of(self)
        if any(p is None for p in parts):
            return {
                "sd_inflation_note": (
                    f"not computed: the compressors' error ({links}) has no model here (a biased compressor "
                    "without error feedback, QLSD's memories, a clip, or an unbiased one whose set-up measured "
                    "no gradients)"
                )
            }
        terms = [t for p in parts for t in p]
        try:
            precond = None if self._precond is None else s
            inflation = sd_inflation(self._hessian, gamma, precond, terms)
            best = step_for_inflation(self._hessian, precond, terms, INFLATION_LIMIT)
        except ConfigError as err:
            return {"sd_inflation_note": f"not computed: {err}"}
        return {
            "sd_inflation": float(np.max(inflation)),
            # what to pass for it: the automatic step's gamma lambda_max, or a given (unpreconditioned) step
            "sd_inflation_step": best if self.cfg.step_size is not None else best * self.step_scale / gamma,
            "sd_inflation_note": "closed form at the mode: ULA's step"
            + (f" and the compressors' error ({links})" if terms else ""),
        }

    def _move(self, key, s: _S, g: jax.Array, gamma: jax.Array) -> tuple[_S, Message]:
        """Langevin step x -> x - gamma g + sqrt(2 gamma) Z, sent through the downlink. Under central DP the
        step's noise counts towards the mechanism, so Z, like the added noise, comes from the secret key:
        drawn from the fit's public seed it could be recomputed and subtracted from the released x."""
        k_noise, k_comp = split_server_key(key)  # jax.random.split(key), hashed ahead in a round
        if self._dp is not None and not self._dp.distributed:
            k_noise = folded(self._dp.secret, k_noise)
        z = jax.random.normal(k_noise, s.x.shape, s.x.dtype)
        if self._precond is None:
            x = s.x - gamma * g + jnp.sqrt(2 * gamma) * z
        else:  # x - gamma S S' g + sqrt(2 gamma) S z: Langevin in y = S^-1 x, the same stationary law
            x = s.x - gamma * (g @ self._precond) @ self._precond.T + jnp.sqrt(2 * gamma) * z @ self._precond.T
        down, message = self.down.send(k_comp, x, s.down)
        return s._replace(x=x, down=down), message

    def client_step(self, key, payload, state: ClientState, client: ClientData):
        """The gradient at the point the downlink delivers, sent through the uplink (with distributed DP:
        clipped, with the client's share of the noise)."""
        w, down = self.down.receive(payload, state.down)
        grad = self._grad(w, client, key)
        if self._dp is not None and self._dp.distributed:
            key, k_dp = jax.random.split(key)
            grad = self._dp.share(k_dp, grad)
        up, message = self.up.send(key, grad, state.up)
        return ClientState(down, up), message

    def resync_message(self, state: ServerState) -> Message:
        """What a client whose copy of ``w`` fell behind is re-sent: P-/B-ELF send ``w`` of the server
        state that opened the round, in full (the copy a client in step holds before that round's
        broadcast is added); LMC, D-ELF and QLSD keep no copy and send nothing (0 bits)."""
        return self.down.resync_message(state.down, state.x)

    def resync(self, state: ClientState, payload: Any) -> ClientState:
        """A faulty client keeps its uplink memory (the server did not add its message) and, under
        P-/B-ELF, takes the re-sent ``w`` as its copy."""
        return state._replace(down=self.down.resync(state.down, payload))

    def server_step(
        self, key, state: _S, uploads: Message, info: RoundInfo
    ) -> tuple[_S, Message, dict[str, jax.Array]]:
        """g from the answers through the uplink (:meth:`~fedbayes.algorithms.channels.DirectUplink.gather`:
        faulty and inactive members' uploads arrive zeroed), then the Langevin move. A round the uplink
        says holds x (nobody answered, ``FaultPolicy(min_clients=0)``, without a memory) takes the step
        with gamma = 0 (P-/B-ELF's w still moves toward x)."""
        if self._dp is None or self._dp.distributed:  # distributed DP: the clients clipped and noised
            g, up, moves = self.up.gather(state.up, jnp.sum(uploads.payload, 0), info)
        elif isinstance(self.up, ClippedEF21Uplink):  # central DP under error feedback: each memory clipped
            key, k_dp = jax.random.split(key)
            g, up, moves = self.up.gather_rows(state.up, uploads.payload, info)
            g = self._dp.noisy(k_dp, g, jnp.ones((), g.dtype))
        else:  # central DP: each upload clipped, then noise on the (re-weighted) sum
            key, k_dp = jax.random.split(key)
            total = self._dp.clipped_sum(uploads.payload)
            g, up, moves = self.up.gather(state.up, total, info)
            g = self._dp.noisy(k_dp, g, fault_weight(info, total.dtype))
        if self._dp is not None:
            g = g + self._prior_grad(state.x)
        gamma = state.gamma if moves is None else jnp.where(moves, state.gamma, jnp.zeros_like(state.gamma))
        sample = state.x  # x_{k+1}, the point the clients just used (through w for P-/B-ELF)
        new, broadcast = self._move(key, state._replace(up=up), g, gamma)
        return new, broadcast, {"_sample": sample}

    def finalize(self, key, carry, problem: Problem, history: Mapping[str, np.ndarray] | None = None) -> FitParts:
        """Posterior draws of the global sites (constrained), chains x draws, after warm-up and thinning."""
        if history is None:
            raise ValueError(f"{self.name} reads its draws from the rounds' records: history is required")
        raw = np.asarray(history["_sample"])[self.warmup :: self.cfg.thinning]  # (draws, chains, d)
        draws = np.swapaxes(raw, 0, 1)
        constrain = run_jit(
            self, "constrain_draws", lambda: jax.vmap(jax.vmap(lambda v: self._fm.constrain(self._unravel(v)))), once=0
        )
        samples = {k: np.asarray(v) for k, v in constrain(jnp.asarray(draws)).items()}
        server = carry[0]
        gamma = float(server.gamma)
        report = self.stationary_report(gamma, server)
        return FitParts(
            global_samples=samples,
            params={k: v.mean(axis=(0, 1)) for k, v in samples.items()},
            params_last={k: v[:, -1].mean(0) for k, v in samples.items()},
            start_bits=self.map_bits,
            settings={
                "step_size": gamma,
                "warmup": self.warmup,
                "start": self.start,
                "batch_size": self._batches.size if self._batches.active else None,
                "map_iterations": self.map_iterations,
                "preconditioned": self._precond is not None,
                **report,
            },
            final_state=server,
            privacy=None if self._dp is None else self._dp.report(history.get("active")),
        )


__all__ = [
    "LMC",
    "DELF",
    "PELF",
    "BELF",
    "LangevinSampler",
    "theory_step_size",
    "curvature_step_size",
    "DENSE_CURVATURE",
]
