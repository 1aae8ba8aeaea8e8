"""Joint federated Langevin for hierarchical models: the posterior of the globals and of every client's
local latents together.

The target, in unconstrained coordinates (the transforms' Jacobians included), is

    pi(x, z_1, ..., z_b | D)  proportional to  p(x) prod_i p(z_i | x) p(D_i | x, z_i),

with potential U(x, z) = sum_i U_i(x, z_i), U_i(x, z_i) = -log p(D_i, z_i | x) - log p(x) / b. Each round
the server broadcasts x_k (one row per chain); client i, which holds its own z_{i,k}, evaluates both
gradients of U_i at the same point (x_k, z_{i,k}), moves its latents and uploads the gradient in x:

    z_{i,k+1} = z_{i,k} - gamma_i grad_z U_i(x_k, z_{i,k}) + sqrt(2 gamma_i) xi_{i,k}     (on the client)
    x_{k+1}   = x_k - gamma sum_i grad_x U_i(x_k, z_{i,k}) + sqrt(2 gamma) Z_k            (on the server)

This is the unadjusted Langevin algorithm (ULA) on the joint target with the block-diagonal
preconditioner M = diag(gamma I, gamma_1 I, ..., gamma_b I) (each client's step from its own curvature):
a valid ULA, whose stationary law on a Gaussian target N(m, P^-1) is N(m, Sigma) with the exact mean and
Sigma the solution of the Lyapunov equation Sigma = A Sigma A' + 2 M, A = I - M P (with one step gamma
for every block, Sigma = (P - gamma P^2 / 2)^-1). Like every ULA it is biased at a fixed step (the bias
vanishes as the steps go to 0).

The local draws never leave the clients during the rounds: each keeps its own draws (after ``warmup``,
every ``thinning``-th round, paired with the server's draws of the same rounds) and hands them to its
own result in the final exchange, as FedSOUL's personal posteriors; nothing is uploaded there.

:class:`JointMALA` (Metropolis-adjusted Langevin) and :class:`JointHMC` (Hamiltonian Monte Carlo, one leapfrog
step a round trip) make the same exchange exact: the clients upload their shares of the log acceptance ratio
with their gradients, the server decides, and the stationary law is the posterior at any step. Both adapt a
step multiplier (dual averaging) and a diagonal preconditioner (each party from its own states) in warm-up.
They also sample models without local latents.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, NamedTuple
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .. import minibatch
from ..engine import final_exchange, split_server_key, stack_clients
from ..errors import ConfigError, ConvergenceWarning, ModelError, require_choice, require_int, require_real
from ..introspect import FedModel
from ..kernels import curvature
from ..protocol import ClientData, FitParts, Message, Problem, dense_message, with_final_parts
from ..compress import Compressor, identity
from .channels import EF21PDownlink, EF21Uplink, FullDownlink
from .elf import DENSE_CURVATURE, LangevinRun, LangevinSampler, _ef_compressor
from .warmstart import resolve_init

LOCAL_STEP_SCALE = LangevinRun.step_scale
"""JointLMC's automatic steps: gamma_i = 0.1 / lambda_max(-grad_z^2 log p(D_i, z | x)) at the chain's start,
and the same scale on the globals' block (:meth:`LangevinRun._step_from`)."""


class JointClientState(NamedTuple):
    down: Any  # the downlink channel's state
    up: Any  # the uplink channel's state
    z: jax.Array  # (chains, q) the client's latents, unconstrained and flat
    gamma: jax.Array  # (chains, q) the client's own step of each coordinate
    draws: jax.Array  # (kept draws, chains, q) the client's kept states
    filled: jax.Array  # (kept draws,) bool: the slot was written (the others take the slot before's, at the end)
    count: jax.Array  # type: ignore[assignment]  # field shadows tuple.count; () int32: rounds this client moved in
    gamma0: jax.Array  # () the client's starting step
    acc: Any  # the current adaptation window's statistics (Welford)


class JointServerState(NamedTuple):
    """:class:`~fedbayes.algorithms.elf.ServerState`'s fields (so that LangevinRun's server step runs on it), with
    ``gamma`` one step per chain and coordinate, and the adaptation's."""

    x: jax.Array  # (chains, d)
    gamma: jax.Array  # (chains, d) the step of each coordinate
    down: Any
    up: Any
    gamma0: jax.Array  # () the starting step
    acc: Any  # Welford
    n: jax.Array  # () int32: moves made


@dataclass(frozen=True)
class JointLMC(LangevinSampler):
    """Joint federated Langevin (ULA) for models with global sites (with priors) and ``fb.local()``
    latents: posterior draws of the globals and of every client's latents together (the module's
    docstring has the scheme). The options are :class:`LMC`'s (``step_size``: the globals' step, and
    each client's when given; None: 0.1 / the largest curvature of each block at the start), except:

    * ``init``: None or ``"prior"`` (the globals' prior centres, jittered per chain by U(-0.5, 0.5)),
      or a dict / ``Result`` of constrained global values (jittered likewise); the local latents of
      each chain start at a draw from p(z_i | x_0). There is no search for the joint mode, by choice: a
      hierarchical model's joint density often has none worth starting at (in the centred form it grows without
      bound as the group scale goes to 0 with every latent at the mean); as NumPyro's and Stan's, the chains
      start dispersed and the warm-up brings them in, R-hat over the dispersed starts checking that it did.
    * absences: partial participation (``clients_per_round``) and lost uploads (a fault: dropped, or screened out)
      are the same event. A client that does not answer keeps its latents (its state rolls back), and the server
      keeps its last gradient in x: the uplink is EF21 with the identity compressor by default, whose memory is
      exactly that last gradient (with every client answering it is the direct uplink, the same bits). The
      broadcast carries the round's index (32 bits), so that a client that missed rounds keeps its held latents
      as its draws of those rounds, paired with the globals' draws of the same rounds, in a simulation and over
      Flower alike (where a client may be down several rounds). The stale gradients bias the law further
      (exactly computed and tested on a Gaussian model: with 2 of 4 clients a round, mu's sd 8% above full
      participation's ULA law; with each upload lost with probability 0.5, 8.5%, tested likewise; the mean stays
      exact there).
    * minibatches (``batch_size``, or the model's ``subsample_size``): each round each chain's gradients on a
      batch of B of the client's rows, the log-likelihood scaled by N_i / B (stochastic-gradient Langevin,
      SGLD). The gradient noise widens the law further; on a Gaussian model it is additive and the law is
      computed exactly (tested). The set-up's first move and curvature use all rows.

    Compression, as the ELF family's (the clients' gradients in the globals and the server's broadcast
    are the only things that travel): ``uplink`` a compressor for D-ELF's error feedback (EF21) on the
    gradients, ``downlink`` one for P-ELF's (EF21-P) on the broadcast (each client then moves at its
    copy w of the globals), ``rescale`` as theirs. None (default): sent in full.

    ``adapt_mass_matrix`` (default False; it replaces the automatic or given steps): a diagonal
    preconditioner adapted in warm-up, in Stan's windows (:func:`mass_windows`): at each window's end each
    party (the server for the globals, each client for its latents) sets each of its coordinates' steps to
    ``step_scale`` (0.1) times the variance of its own states in the window (in whitened coordinates the
    curvature is about 1, so 0.1 is the automatic step's own rule). After the warm-up the steps are fixed, and
    the chain is ULA with that block-diagonal preconditioner. Nothing more travels. Without it the automatic
    step is 0.1 / the largest curvature at the start, which on a model whose coordinates differ in scale (eight
    schools: mu, tau and the etas) barely moves the widest ones (``benchmarks/README.md``). It is not the
    default: with no Metropolis correction a chain that wanders during a window (eight schools' long left tail
    of log tau) gets a step from that window's spread that can be far too large, and then does not recover
    (measured: one chain of four in one of the benchmark's runs; its R-hat warns). JointMALA / JointHMC
    adapt the same way safely.

    Exact: on a Gaussian hierarchical model its draws have the ULA law of the joint target (tested, with
    given, automatic and adapted steps); it carries ULA's O(step) bias. With error feedback and an odd compressor
    (top-k) the stationary mean
    stays exact (tested), as for D-/P-ELF.
    """

    uplink: Compressor | None = None
    downlink: Compressor | None = None
    rescale: bool = False
    adapt_mass_matrix: bool = False
    name = "JointLMC"
    partial_participation = True

    def __post_init__(self):
        super().__post_init__()
        require_choice(self.adapt_mass_matrix, "adapt_mass_matrix", (True, False))
        require_choice(self.rescale, f"{self.name} rescale", (True, False))

    def _channels(self, dim):
        # EF21's memory even uncompressed: an absent client's last gradient (with every client answering, the
        # direct uplink's sum and bits)
        up = EF21Uplink(identity() if self.uplink is None else _ef_compressor(self.uplink, self.rescale, self.name))
        down = (
            FullDownlink()
            if self.downlink is None
            else EF21PDownlink(_ef_compressor(self.downlink, self.rescale, self.name))
        )
        return up, down

    def _check_latents(self, fm: FedModel) -> None:
        """Local latents required; a search for the mode refused (not built yet)."""
        if not fm.local_names:
            raise ModelError(
                f"{self.name} samples models with local latents (fb.local()); this model has none: "
                "use fb.LMC (or fb.JointMALA / fb.JointHMC, exact at any step)"
            )
        if isinstance(self.init, str) and self.init == "map":
            raise ConfigError(
                f"{self.name} has no search for the joint mode (a hierarchical model's joint density "
                "often has none: the funnel's neck); init=None / 'prior' (dispersed starts, as NumPyro's), "
                "or given global values, e.g. a FedSOUL fit's theta*: init=res"
            )

    def _make_run(self, fm: FedModel, problem: Problem) -> JointLangevinRun:
        return JointLangevinRun(self, fm, problem)


class JointLangevinRun(LangevinRun):
    """:class:`JointLMC` bound to a model: :class:`~fedbayes.algorithms.elf.LangevinRun`'s server step and
    channels, with clients that carry and move their own latents."""

    final_exchange = True
    cfg: JointLMC

    def __init__(self, cfg: JointLMC, fm: FedModel, problem: Problem):
        self.cfg, self._fm, self.name = cfg, fm, cfg.name
        self._b = problem.data.num_clients
        self._batches = minibatch.resolve(cfg.batch_size, fm, problem.data.mask.shape[1], cfg.name)
        self.warmup = cfg.warmup if cfg.warmup is not None else problem.num_rounds // 2
        self._spread = self._precond = None
        self.map_bits, self.map_iterations = (0, 0), 0
        self.start = "given" if isinstance(cfg.init, Mapping) or hasattr(cfg.init, "params") else "prior-centre"
        values = (
            None if cfg.init is None or isinstance(cfg.init, str) else resolve_init(cfg.init, problem, jacobian=True)
        )
        flat, self._unravel = ravel_pytree(fm.init_globals(None, values))
        self._x0, self.dim = flat, flat.size
        self.up, self.down = cfg._channels(int(flat.size))
        flat_z, self._unravel_z = ravel_pytree(fm.zeros_local())
        self._q = int(flat_z.size)  # 0 for a model without local latents (JointMALA)
        self.num_kept = len(range(self.warmup, problem.num_rounds, cfg.thinning))
        self.adapt = cfg.adapt_mass_matrix
        self.windows = mass_windows(self.warmup) if self.adapt else (0, ())

    # ------------------------------------------------------------------ potentials
    def joint_potential(self, x: jax.Array, z: jax.Array, client: ClientData) -> jax.Array:
        """U_i(x, z_i) = -log p(D_i, z_i | x) - log p(x) / b, unconstrained (Jacobians included)."""
        theta = self._unravel(x)
        local = self._fm.client_log_joint(theta, self._unravel_z(z), client.data, client.mask)
        return -local - self._fm.log_prior(theta, jacobian=True) / self._b

    def _grads(
        self, x: jax.Array, z: jax.Array, client: ClientData, key: jax.Array | None = None
    ) -> tuple[jax.Array, jax.Array]:
        """(grad_x U_i, grad_z U_i) at each chain's (x, z) (rows); with minibatches and a ``key``, each chain's on
        its own batch of the client's rows, the log-likelihood scaled by N_i / B (:mod:`fedbayes.minibatch`):
        unbiased estimates, SGLD's."""
        grads = jax.grad(self.joint_potential, argnums=(0, 1))
        if key is None or not self._batches.active:
            return jax.vmap(grads, in_axes=(0, 0, None))(x, z, client)
        keys = jax.random.split(minibatch.batch_key(key), x.shape[0])
        return jax.vmap(lambda xc, zc, kc: grads(xc, zc, self._batches.draw(kc, client)))(x, z, keys)

    @staticmethod
    def _langevin(key, z, grad, gamma):
        """z - gamma grad U(z) + sqrt(2 gamma) N(0, I): a Langevin move, or a proposal."""
        return z - gamma * grad + jnp.sqrt(2 * gamma) * jax.random.normal(key, z.shape, z.dtype)

    def _record(self, state, n: jax.Array | int, write: jax.Array | bool = True):
        """Keep the chain's current state as the draw of round (MALA, HMC: decision) ``n``, the state's first:
        written to the slot of the first kept round at or after n (after ``warmup``, every ``thinning``-th), unless
        n is past the last kept one.

        The state changes only at such writes, so a slot's last write is the state at its round: a client that
        missed rounds (absent, or its uploads lost) leaves the slots of the kept rounds it missed unwritten, and
        the final exchange gives each unwritten slot the value of the slot before (:meth:`_filled_draws`), the
        state it held. One slot is written a round (in place inside the rounds' loop), never the whole buffer."""
        w, t = self.warmup, self.cfg.thinning
        slot = jnp.clip(-((w - n) // t), 0, self.num_kept - 1)  # ceil((n - w) / t)
        write = write & (n <= w + (self.num_kept - 1) * t)
        draws = state.draws.at[slot].set(jnp.where(write, state.z, state.draws[slot]))
        return state._replace(draws=draws, filled=state.filled.at[slot].set(state.filled[slot] | write))

    @staticmethod
    def _filled_draws(state) -> jax.Array:
        """The draws, each slot never written given the value of the last one written before it (slot 0 always is)."""
        k = jnp.arange(state.filled.shape[0])
        return state.draws[jax.lax.cummax(jnp.where(state.filled, k, 0))]

    def _empty_draws(self, z: jax.Array) -> tuple[jax.Array, jax.Array]:
        return jnp.zeros((self.num_kept,) + z.shape, z.dtype), jnp.zeros((self.num_kept,), bool)

    # ------------------------------------------------------------------ set-up
    def _client_start(self, key, x0: jax.Array, client: ClientData) -> tuple[jax.Array, jax.Array, Any]:
        """``(z_0, gamma_i, share)``: each chain's latents drawn from p(z_i | x_0), the client's step (the given
        ``step_size``, or ``step_scale`` / lambda_max of -grad_z^2 log p(D_i, z | x) at chain 0's start), and its share
        of the globals' curvature for the server's step (the Hessian of U_i in x up to ``DENSE_CURVATURE``
        coordinates, else its largest eigenvalue; none with a given step)."""
        z0 = jax.vmap(
            lambda k, x: ravel_pytree(self._fm.sample_local_prior(k, self._unravel(x), client.data, client.mask))[0]
        )(jax.random.split(key, x0.shape[0]), x0).astype(x0.dtype)  # (chains, 0) without latents
        if self.cfg.step_size is not None:
            return z0, jnp.asarray(self.cfg.step_size, z0.dtype), ()
        lam = (
            curvature(lambda z: -self.joint_potential(x0[0], z, client), z0[0], jnp.ones_like(z0[0]), 50)[0]
            if self._q
            else jnp.ones((), x0.dtype)
        )  # no latents: the client's step is never used
        pot_x = lambda x: self.joint_potential(x, z0[0], client)  # noqa: E731
        share = (
            jax.hessian(pot_x)(x0[0])
            if self.dim <= DENSE_CURVATURE
            else curvature(lambda x: -pot_x(x), x0[0], jnp.ones_like(x0[0]), 100)[0]
        )
        return z0, self.step_scale / jnp.maximum(lam, 1e-12), share

    def setup_client(self, stage: int, key: jax.Array, x0: jax.Array, state: Any, client: ClientData):
        """Each chain's latents start at a draw from p(z_i | x_0); the client's step from its own curvature
        at chain 0's start; the first joint move from (x_0, z_0): z moves here, grad_x goes up (with the
        client's share of the globals' curvature for the server's step)."""
        k_z, k_move = jax.random.split(key)
        starts, gamma, share = self._client_start(k_z, x0, client)
        gx, gz = self._grads(x0, starts, client)
        z1 = self._langevin(k_move, starts, gz, gamma)
        state = JointClientState(
            self.down.client_start(x0),
            self.up.client_start(gx),
            z1,
            jnp.broadcast_to(gamma, starts.shape).astype(starts.dtype),
            *self._empty_draws(starts),
            jnp.zeros((), jnp.int32),
            gamma,
            Welford.empty(starts),
        )
        return self._record(state, 0), (gx, share)  # z1 is the latents at round 0's start

    def setup_server_step(self, stage: int, key: jax.Array, x0: jax.Array, uploads: Any):
        """LangevinRun's first move, its state carried with one step per chain and coordinate."""
        base, message = super().setup_server_step(stage, key, x0, uploads)
        gamma = jnp.broadcast_to(base.gamma, x0.shape).astype(x0.dtype)
        zero = jnp.zeros((), jnp.int32)
        return JointServerState(
            base.x, gamma, base.down, base.up, base.gamma, Welford.empty(x0), zero
        ), self._with_round(message, zero)

    @staticmethod
    def _with_round(message: Message, r: jax.Array) -> Message:
        """The broadcast with the round's index (32 bits): a client that missed rounds (absent, or its upload lost)
        fills its draws of them with its held latents."""
        return Message((message.payload, r), message.bits + 32)

    def server_step(
        self,
        key,
        state: JointServerState,  # type: ignore[override]  # the run's own state type
        uploads: Message,
        info,
    ):
        """LangevinRun's step; in warm-up, the globals' steps adapted from the server's own states."""
        new, message, diag = super().server_step(key, state, uploads, info)
        if self.adapt:
            gamma, acc, _ = _adapt_scale(new.gamma, new.acc, new.x, new.n + 1, self.windows, self.step_scale)
            new = new._replace(gamma=gamma, acc=acc)
        return new._replace(n=new.n + 1), self._with_round(message, new.n + 1), diag

    # ------------------------------------------------------------------ rounds
    def client_step(
        self,
        key,
        payload,
        state: JointClientState,  # type: ignore[override]  # the run's own state type
        client: ClientData,
    ):
        """Both gradients at (x_k, z_k): z moves, grad_x goes up; z_{k+1} is kept as the draw of round k + 1 (paired
        with x_{k+1}). A client that missed rounds has kept its held latents for them (:meth:`_record`)."""
        payload, r = payload
        if self.adapt:  # the rounds it missed, its latents held: fed to the same windows as if it had answered
            gamma, acc = _replay_held(
                state.gamma, state.acc, state.z, state.count + 1, r + 1, self.windows, self.step_scale
            )
            state = state._replace(gamma=gamma, acc=acc)
        w, down = self.down.receive(payload, state.down)
        k_move, k_up = jax.random.split(key)
        gx, gz = self._grads(w, state.z, client, key)  # the batches from the round key's own stream
        z = self._langevin(k_move, state.z, gz, state.gamma)
        up, message = self.up.send(k_up, gx, state.up)
        state = self._record(state._replace(down=down, up=up, z=z, count=r + 1), r + 1)
        if self.adapt:  # the same moves' count as the server's: both adapt at the same rounds
            gamma, acc, _ = _adapt_scale(state.gamma, state.acc, z, state.count, self.windows, self.step_scale)
            state = state._replace(gamma=gamma, acc=acc)
        return state, message

    # ------------------------------------------------------------------ the end
    def final_client(self, key, payload, state: JointClientState, client: ClientData):
        """The client's kept draws, constrained-site layout (chains, draws, ...), kept by the client; nothing up."""
        return self._final_draws(state)

    def _final_draws(self, state) -> tuple[dict[str, Any], tuple]:
        """The final exchange's client half from a state whose last change is recorded."""
        draws = jnp.swapaxes(self._filled_draws(state), 0, 1)  # (chains, draws, q)
        local = jax.vmap(jax.vmap(self._unravel_z))(draws)
        # JointLMC: its steps per chain and coordinate; JointMALA / HMC: their scales before the step multiplier
        steps = state.scale if hasattr(state, "scale") else state.gamma
        return {"local_samples": local, "step_size": getattr(state, "gamma0", state.gamma), "steps": steps}, ()

    def final_server(self, key, server_state, payload, uploads, locals_) -> FitParts:
        """The clients' own draws where collected (a simulation); the globals' come from :meth:`record_parts`."""
        parts = FitParts(params={}, params_last={})
        if locals_ is not None and self._q:
            parts.local_samples = locals_["local_samples"]
            parts.client_info = {"step_size": locals_["step_size"]}
            # each client's final steps per chain and coordinate (adapted in warm-up): (clients, chains, q)
            parts.settings = {"client_steps": np.asarray(locals_["steps"]).tolist()}
        return parts

    def record_parts(self, key, server_state, problem: Problem, history: Mapping[str, np.ndarray]) -> FitParts:
        """The globals' draws from the server's records (:meth:`LangevinRun.finalize`), and the steps."""
        steps = server_state.gamma
        report = server_state._replace(gamma=server_state.gamma0) if hasattr(server_state, "gamma0") else server_state
        parts = LangevinRun.finalize(self, key, (report, None, None), problem, history)
        parts.settings = {
            **(parts.settings or {}),
            "local_step_scale": self.step_scale,
            "mass_matrix_adapted": bool(self.adapt),
            "steps": np.asarray(steps).tolist(),
        }
        return parts

    def stationary_report(self, gamma: float, server: Any) -> dict[str, Any]:
        """No closed form here: the step's bias on the joint law of globals and latents is not modelled."""
        return {"sd_inflation_note": "not computed: the joint sampler's law over globals and latents is not modelled"}

    def finalize(self, key, carry, problem: Problem, history: Mapping[str, np.ndarray] | None = None) -> FitParts:
        """The globals' draws and each client's own draws of its latents (the final exchange)."""
        if history is None:
            raise ValueError(f"{self.name} reads its draws from the rounds' records: history is required")
        server, states, _ = carry
        return with_final_parts(
            self.record_parts(key, server, problem, history),
            final_exchange(self, key, server, states, stack_clients(problem.data)),
        )


MAX_DELTA_ENERGY = 1000.0
"""A proposal whose log-density share falls by more than this on one client (MALA: c_i < -1000; HMC: the
client's energy error above 1000 at any leapfrog step) is divergent, as NumPyro's ``max_delta_energy``: the
client flags it (any flag 0 rejects) and uploads zeros in place of its values, which would otherwise be huge
and screened out as a fault. The acceptance probability such a proposal would have had is below e^-1000
unless the other parties' terms make up for it."""

LOST_WARN_SHARE = 0.5
"""JointMALA / JointHMC warn when more than this share of their decisions were forced rejections (lost uploads)."""

MALA_STEP_SCALE = 0.5
"""JointMALA's automatic steps: gamma = MALA_STEP_SCALE / the largest curvature of each block at the start."""


class MALAServerState(NamedTuple):
    x: jax.Array  # (chains, d) the chains' current globals
    g: jax.Array  # (chains, d) sum_i grad_x U_i at (x, z)
    proposal: jax.Array  # (chains, d) the globals proposed to the clients this round
    last: jax.Array  # (chains,) int32: the index of the last accepted decision (-1: none), sent with each proposal
    gamma: jax.Array  # () the globals' base step
    log_mult: jax.Array  # (chains,) log of the step multiplier the pending proposal was made with
    da: DualAveraging  # the warm-up's step adaptation, one per chain
    scale: jax.Array  # (chains, d) each coordinate's step before the multiplier: gamma, then the window variances
    acc: Welford  # the current window's statistics
    n: jax.Array  # () int32: decisions made


class DualAveraging(NamedTuple):
    """Nesterov's dual averaging of the log step multiplier, as Hoffman & Gelman (2014, section 3.2) adapt
    NUTS's step and NumPyro its samplers': after t decisions with acceptance probabilities alpha_s,

        H_t = (1 - 1 / (t + t0)) H_{t-1} + (delta - alpha_t) / (t + t0),
        log eps_t = mu - sqrt(t) / g H_t,
        log epsbar_t = t^-kappa log eps_t + (1 - t^-kappa) log epsbar_{t-1},

    with mu = log 10 (ten times the starting multiplier 1), g = 0.05, t0 = 10, kappa = 0.75. The warm-up
    proposes with eps_t; after it the multiplier is frozen at epsbar."""

    h: jax.Array  # (chains,)
    log_bar: jax.Array  # (chains,)
    t: jax.Array  # () float: decisions since the (re)start

    @classmethod
    def start(cls, x: jax.Array) -> DualAveraging:
        none = jnp.zeros(x.shape[:1], x.dtype)
        return cls(none, none, jnp.zeros((), x.dtype))


_DA_MU, _DA_G, _DA_T0, _DA_KAPPA = float(np.log(10.0)), 0.05, 10.0, 0.75


def _dual_averaging(da: DualAveraging, alpha: jax.Array, target: float) -> tuple[DualAveraging, jax.Array]:
    """One dual-averaging update from the acceptance probabilities ``alpha`` (chains,): (new state, log eps_t)."""
    t = da.t + 1
    h = (1 - 1 / (t + _DA_T0)) * da.h + (target - alpha) / (t + _DA_T0)
    log_eps = _DA_MU - jnp.sqrt(t) / _DA_G * h
    eta = t**-_DA_KAPPA
    return DualAveraging(h, eta * log_eps + (1 - eta) * da.log_bar, t), log_eps


class MALAClientState(NamedTuple):
    z: jax.Array  # (chains, q) current latents
    u: jax.Array  # (chains,) U_i at (x, z)
    gz: jax.Array  # (chains, q) grad_z U_i at (x, z)
    z_prop: jax.Array  # (chains, q) the pending proposal
    u_prop: jax.Array  # (chains,) U_i at (x', z')
    gz_prop: jax.Array  # (chains, q) grad_z U_i at (x', z')
    gamma: jax.Array  # () the client's own base step
    draws: jax.Array  # (kept draws, chains, q)
    filled: jax.Array  # (kept draws,) bool
    count: jax.Array  # type: ignore[assignment]  # field shadows tuple.count; () int32: rounds answered (decisions)
    scale: jax.Array  # (chains, q) each coordinate's step before the multiplier: gamma, then the window variances
    acc: Welford  # the current window's statistics


def mass_windows(warmup: int) -> tuple[int, tuple[int, ...]]:
    """The warm-up's slow windows for the diagonal scale adaptation, Stan's schedule: after an initial buffer
    (75 decisions, or 15% of a warm-up over 500) windows of 25, 50, 100, ... decisions (the last one stretched
    to the terminal buffer of 50, or 10% of a warm-up over 500), buffers scaled to 15% / 10% of a warm-up
    shorter than 150. Returns ``(start, ends)``: the decisions
    ``start < n <= ends[-1]`` are accumulated, and the scales are re-estimated after each decision in ``ends``.
    A warm-up under 20 decisions has no window: ``(0, ())``."""
    if warmup < 20:
        return 0, ()
    # the buffers: Stan's 75 and 50 decisions, or 15% and 10% of a long warm-up (federated rounds are cheap and
    # warm-ups long: the dual averaging then has 10% of them to settle after the last window, not 50)
    first, last, size = max(75, int(0.15 * warmup)), max(50, int(0.1 * warmup)), 25
    if first + last + size > warmup:
        first, last = int(0.15 * warmup), int(0.1 * warmup)
        size = warmup - first - last
    stop, ends, begin = warmup - last, [], first
    while begin < stop:
        end = begin + size
        if stop - end < 2 * size:  # the next window would not fit twice: this one runs to the terminal buffer
            end = stop
        ends.append(end)
        begin, size = end, 2 * size
    return first, tuple(ends)


class Welford(NamedTuple):
    """Running mean and sum of squared deviations of each chain's states within a window."""

    n: jax.Array  # () float
    mean: jax.Array  # (chains, dim)
    m2: jax.Array  # (chains, dim)

    @classmethod
    def empty(cls, like: jax.Array) -> Welford:
        return cls(jnp.zeros((), like.dtype), jnp.zeros_like(like), jnp.zeros_like(like))

    def add(self, x: jax.Array, on: jax.Array) -> Welford:
        """Add ``x`` where ``on`` (a scalar flag)."""
        n = self.n + 1
        delta = x - self.mean
        mean = self.mean + delta / n
        new = Welford(n, mean, self.m2 + delta * (x - mean))
        return jax.tree_util.tree_map(lambda a, b: jnp.where(on, a, b), new, self)

    def scale(self) -> jax.Array:
        """The window's variances, regularised towards 1e-3 as Stan does: n / (n + 5) var + 1e-3 * 5 / (n + 5)."""
        n = self.n
        return n / (n + 5) * self.m2 / jnp.maximum(n - 1, 1) + 1e-3 * 5 / (n + 5)


def _adapt_scale(
    scale: jax.Array,
    acc: Welford,
    x: jax.Array,
    n: jax.Array,
    windows,
    factor: float = 1.0,
    on: jax.Array | bool = True,
) -> tuple[jax.Array, Welford, jax.Array]:
    """After decision (or move) ``n`` (the chain's state ``x``): accumulate it in a slow window, and at a window's
    end replace the per-coordinate scales by ``factor`` times the window's variances. Returns ``(scale, acc, ended)``;
    nothing changes where ``on`` is False."""
    start, ends = windows
    if not ends:
        return scale, acc, jnp.zeros((), bool)
    acc = acc.add(x, on & (n > start) & (n <= ends[-1]))
    ended = on & jnp.any(n == jnp.asarray(ends))
    scale = jnp.where(ended, factor * acc.scale(), scale)
    acc = jax.tree_util.tree_map(lambda e, a: jnp.where(ended, e, a), Welford.empty(x), acc)
    return scale, acc, ended


def _replay_held(
    scale: jax.Array, acc: Welford, x: jax.Array, start: jax.Array, stop: jax.Array, windows, factor: float = 1.0
) -> tuple[jax.Array, Welford]:
    """:func:`_adapt_scale` after each of the moves (decisions) ``start <= n < stop`` that a client missed, its state
    ``x`` held through them: the same windows as a client that answered. A loop over a small carry (none when
    nothing was missed), never over the client's buffer of draws."""
    return jax.lax.fori_loop(
        start, stop, lambda n, c: _adapt_scale(c[0], c[1], x, n, windows, factor)[:2], (scale, acc)
    )


def _any_lost(info) -> jax.Array:
    """Whether a cohort member's upload was lost this round (dropped, or screened out)."""
    return jnp.zeros((), bool) if info.faulty is None else jnp.any(info.faulty)


def _log_q(to: jax.Array, frm: jax.Array, grad_at_frm: jax.Array, gamma: jax.Array) -> jax.Array:
    """log of the Langevin proposal density q(to | frm), up to its constant: -|to - frm + gamma grad U(frm)|^2 / (4
    gamma)
    (summed over the last axis: one value per chain; ``gamma`` a scalar or one per chain, shape (chains, 1))."""
    return -jnp.sum((to - frm + gamma * grad_at_frm) ** 2 / (4 * gamma), -1)


@dataclass(frozen=True)
class JointMALA(JointLMC):
    """Exact federated sampling (the Metropolis-adjusted Langevin algorithm): :class:`JointLMC`'s joint
    Langevin proposal, accepted or rejected by Metropolis-Hastings, so that the chains' stationary law is the
    posterior p(theta, z_1..z_b | D) exactly, at any step. For models with ``fb.local()`` latents (their
    joint posterior with the globals) and without (the posterior of the globals, as :class:`LMC` samples it
    but without its bias).

    Each round the server broadcasts the proposal x' of the globals (with the decisions' news: each chain's
    last accepted decision and the round's index; and each chain's step multiplier). Client i proposes z_i' from its
    current state, evaluates U_i at (x', z_i'),
    and uploads two things: the gradient of U_i in x there, and one scalar per chain, its share of the log
    acceptance ratio

        c_i = U_i(x, z_i) - U_i(x', z_i') + log q_i(z_i | z_i', x') - log q_i(z_i' | z_i, x).

    The server adds the globals' proposal term, log alpha = sum_i c_i + log q(x | x') - log q(x' | x),
    accepts with probability min(1, alpha), and sends the decision with the next proposal. Each client
    then keeps z_i' or z_i. The proposal's densities factor over the blocks (the preconditioner is block
    diagonal), so no client needs another's latents.

    Communication per round and chain: d + 2 floats up per client (the gradient, c_i and a flag that is 0
    where the client's proposal is not finite: any 0 rejects), and d + 2 values down (the proposal, the index
    of the last accepted decision and the step multiplier) with the round's index. Every gradient the next proposal
    needs has been computed by the time
    of the decision, so a round costs one gradient evaluation per client, as ULA's does. The ledger's
    bits per accepted draw after warm-up are in ``res.settings["bits_per_accepted_draw"]``.

    ``step_size``: the base step of every block; None (default) gives MALA_STEP_SCALE (0.5) / the largest
    curvature of each block at the start. ``adapt_step`` (default True): during the ``warmup`` rounds each
    chain multiplies the base steps by a factor adapted by dual averaging (:class:`DualAveraging`, as
    NumPyro adapts its samplers' steps) so that the mean acceptance probability reaches ``target_accept``
    (default 0.574, the optimal rate of MALA in high dimension: Roberts & Rosenthal 1998); after it the
    factor is frozen (``res.settings["step_multiplier"]``, one per chain, and ``adaptation_rounds``).
    ``adapt_mass_matrix`` (default True): a diagonal preconditioner adapted in the same warm-up, as NumPyro's
    and Stan's diagonal mass matrix, in windows (:func:`mass_windows`): at each window's end each party
    (the server for the globals, each client for its own latents) sets its coordinates' steps before the
    multiplier to the variances of its own states in the window, and the dual averaging restarts. Nothing
    more travels: each party estimates the variances of the coordinates it moves. Only
    the draws after the warm-up are kept, so the adaptation leaves the stationary law exact. The mean
    acceptance probability after warm-up is in ``res.settings["acceptance"]``, and per round in
    ``res.history["acceptance"]``.

    Lost uploads (dropped, or screened out): a decision with a missing share is a rejection (HMC: the whole
    trajectory's), ``res.settings["decisions_lost"]`` of them. A loss that does not depend on the chain's state
    (a dropped upload, or a fault of the client's machine) makes each decision's kernel a mixture of
    Metropolis-Hastings and staying put, so the draws stay exact (tested). An upload screened out for its
    values (``fb.FaultPolicy``'s ``max_abs`` / ``relative`` bounds) depends on the proposal: rejecting those is
    Metropolis-Hastings restricted to the proposals the screen passes, exact only for the posterior restricted
    there, as NumPyro's rejection of divergent proposals; the default bound (1e6 times the cohort's median) is
    far beyond any value a proposal in the posterior's bulk produces. The client whose upload was lost rolls back and
    catches up from the next broadcast it gets
    (:meth:`JointMALARun._commit_through`), in a simulation and over Flower alike; the dual averaging skips the
    decisions a loss forced, and ``res.settings["acceptance"]`` is the others' rate. No compression (``uplink`` /
    ``downlink``: the test needs exact
    gradients). The options are otherwise :class:`JointLMC`'s.
    """

    target_accept: float = 0.574
    adapt_step: bool = True
    adapt_mass_matrix: bool = True
    name = "JointMALA"
    partial_participation = False  # the Metropolis test needs every client's share
    full_participation_reason = "its Metropolis test needs every client's share of the acceptance ratio"
    partial_participation_instead = "use fb.JointLMC, whose absent clients count with their last gradients"

    def __post_init__(self):
        super().__post_init__()
        if self.uplink is not None or self.downlink is not None:
            raise ConfigError(
                f"{self.name} needs exact messages (its Metropolis test uses the gradients sent): "
                "no uplink / downlink compressor"
            )
        require_real(self.target_accept, f"{self.name} target_accept", 0.0, 1.0, open_low=True, open_high=True)
        require_choice(self.adapt_step, "adapt_step", (True, False))
        require_choice(self.adapt_mass_matrix, "adapt_mass_matrix", (True, False))

    def _check_latents(self, fm: FedModel) -> None:
        """Models with or without local latents; minibatches (the Metropolis test needs exact densities) and a
        search for the mode (not built) refused."""
        if self.batch_size is not None or fm.subsample_size:
            raise ConfigError(
                f"{self.name} takes full-batch steps only (batch_size=None, no subsample_size in the "
                "model): its Metropolis test needs exact densities"
            )
        if fm.local_names:
            super()._check_latents(fm)
        elif isinstance(self.init, str) and self.init == "map":
            raise ConfigError(f"{self.name} has no search for the mode: init=None / 'prior', or given values")

    def _make_run(self, fm: FedModel, problem: Problem) -> JointMALARun:
        return JointMALARun(self, fm, problem)


class JointMALARun(JointLangevinRun):
    """:class:`JointMALA` bound to a model."""

    resyncs = False
    # a faulty round's only write to the draws is the commit of a decision the broadcast announced, which the
    # client's catch-up makes again identically; rolled back, the buffer would be copied whole each round
    kept_on_fault = ("draws", "filled")
    step_scale = MALA_STEP_SCALE
    L = 1  # rounds a decision (JointHMC: num_steps)
    cfg: JointMALA

    def stationary_report(self, gamma: float, server: Any) -> dict[str, Any]:
        """None: the Metropolis-Hastings correction leaves the posterior stationary at any step."""
        return {}

    def __init__(self, cfg: JointMALA, fm: FedModel, problem: Problem):
        super().__init__(cfg, fm, problem)

    def _eval(self, x, z, client):
        """(U_i, grad_x U_i, grad_z U_i) at each chain's (x, z), with a non-finite U_i as +inf."""
        u, (gx, gz) = jax.vmap(jax.value_and_grad(self.joint_potential, argnums=(0, 1)), in_axes=(0, 0, None))(
            x, z, client
        )
        return jnp.where(jnp.isfinite(u), u, jnp.inf), gx, gz

    @staticmethod
    def _candidate(state: MALAClientState) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The pending candidate's (z, U_i, grad_z U_i): MALA's proposal (HMC: its trajectory's end)."""
        return state.z_prop, state.u_prop, state.gz_prop

    def _receive(self, state, j: jax.Array, accepted: jax.Array, do: jax.Array):
        """Decision ``j``, where ``do``: the pending candidate taken where ``accepted``, the chain's state kept as the
        decision's draw, ``count`` set to j + 1, and the warm-up's scale windows fed with the state."""
        take = (accepted & do).astype(bool)
        pick = lambda new, old: jnp.where(take.reshape(take.shape + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
        z, u, gz = self._candidate(state)
        state = state._replace(z=pick(z, state.z), u=pick(u, state.u), gz=pick(gz, state.gz))
        state = self._record(state, j, do)._replace(count=jnp.where(do, j + 1, state.count))
        if self.cfg.adapt_mass_matrix:  # decision number `count` is in: the same schedule as the server's
            scale, acc, _ = _adapt_scale(state.scale, state.acc, state.z, state.count, self.windows, on=do)
            state = state._replace(scale=scale, acc=acc)
        return state

    def setup_client(self, stage: int, key: jax.Array, x0: jax.Array, state: Any, client: ClientData):
        """Each chain's latents start at a draw from p(z_i | x_0); the client's step from its own curvature;
        U_i and its gradients at (x_0, z_0); grad_x U_i goes up (with the curvature share for the server's step)."""
        z0, gamma, share = self._client_start(key, x0, client)
        u, gx, gz = self._eval(x0, z0, client)
        state = MALAClientState(
            z0,
            u,
            gz,
            z0,
            u,
            gz,
            gamma,
            *self._empty_draws(z0),
            jnp.zeros((), jnp.int32),
            jnp.broadcast_to(gamma, z0.shape).astype(z0.dtype),
            Welford.empty(z0),
        )
        return self._record(state, 0), (gx, share)  # decision 0's draw unless a commit replaces it

    @staticmethod
    def _multiplier(log_mult: jax.Array) -> jax.Array:
        """exp(log_mult) rounded to float32, as the wire carries it: the server's half of the proposal density and
        the clients' halves then use the same step, in a simulation and over Flower alike."""
        return jnp.exp(log_mult).astype(jnp.float32).astype(log_mult.dtype)

    def _broadcast(self, last, n, proposal, log_mult) -> Message:
        """The decisions' news (each chain's last accepted decision, and the round's index: 32 bits each), the
        proposal and the multipliers."""
        return dense_message(((last, n), proposal, self._multiplier(log_mult)))

    def _pending(self, state) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
        """``(first, announced)``: the client's first uncommitted decision, and the number of decisions a broadcast
        of round ``r`` announces, as a function of r (MALA: its last candidate's, round count - 1; one a round)."""
        return jnp.maximum(state.count - 1, 0), lambda r: r

    def _commit_through(self, state, news, r) -> Any:
        """Every decision announced by round ``r``'s broadcast, whose ``news`` = (each chain's last accepted decision,
        r).

        A client that answered every round commits the last decision: its pending candidate is taken where that
        decision is the chain's last accepted one. A client that missed rounds (its upload lost, its state rolled
        back; or a node down, over Flower) also commits the decisions it missed, from its own last candidate's on:
        every decision with a round it missed was a rejection (the server rejects when any upload is missing), so
        its candidate was accepted exactly where the chain's last accepted decision is that candidate's, and it keeps
        its state as the draw of the others. It then stands where a client that answered every round would, in a
        simulation and over Flower alike, however many rounds it missed."""
        last = news[0]
        first, announced = self._pending(state)
        stop = announced(r)
        # its own candidate's decision (none announced yet: round 0, or HMC within a trajectory)
        state = self._receive(state, first, last == first, first < stop)
        if self.cfg.adapt_mass_matrix:  # the missed decisions, rejections: the held state fed to the scale windows
            scale, acc = _replay_held(state.scale, state.acc, state.z, first + 2, stop + 1, self.windows)
            state = state._replace(scale=scale, acc=acc)
        return state._replace(count=jnp.maximum(state.count, stop))

    def _server_start(self, x0: jax.Array, uploads: Any) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``(gamma, g, zeros per chain, log_mult)`` at the set-up: the globals' base step, the summed gradient, and
        the first multiplier (the dual averaging's own first, mu = log 10; without adaptation, 1)."""
        gx, curvatures = uploads
        none = jnp.zeros(x0.shape[:1], x0.dtype)
        log_mult = none + (_DA_MU if self.cfg.adapt_step and self.warmup > 0 else 0.0)
        return self._step_from(curvatures), jnp.sum(gx, 0), none, log_mult

    def _adapt(self, state, x: jax.Array, alpha: jax.Array, n: jax.Array, lost: jax.Array):
        """After decision ``n`` (the chain's state ``x``, acceptance probabilities ``alpha``): the warm-up's
        adaptation. Returns ``(da, log_mult, scale, acc)`` for the next proposal: within the warm-up the dual
        averaging's eps_t, from its last decision on the frozen epsbar; at a window's end new scales and the dual
        averaging started again from multiplier 1. A decision a lost upload forced (``lost``) says nothing of the
        step: the dual averaging skips it (counted as a rejection, a fault rate f would drive the step towards the
        one whose acceptance is target / (1 - f), and to 0 when f exceeds 1 - target)."""
        da, log_mult, scale, acc = state.da, state.log_mult, state.scale, state.acc
        if self.cfg.adapt_mass_matrix:
            scale, acc, ended = _adapt_scale(scale, acc, x, n, self.windows)
        if self.cfg.adapt_step and self.warmup > 0:
            new_da, log_eps = _dual_averaging(state.da, alpha, self.cfg.target_accept)
            new_da = jax.tree_util.tree_map(lambda a, b: jnp.where(lost, b, a), new_da, state.da)
            log_eps = jnp.where(lost, state.log_mult, log_eps)
            da = jax.tree_util.tree_map(lambda a, b: jnp.where(n <= self.warmup, a, b), new_da, state.da)
            log_mult = jnp.where(n < self.warmup, log_eps, da.log_bar)
            if self.cfg.adapt_mass_matrix:
                da = jax.tree_util.tree_map(lambda a, b: jnp.where(ended, a, b), DualAveraging.start(x), da)
                log_mult = jnp.where(ended, 0.0, log_mult)
        return da, log_mult, scale, acc

    def setup_server_step(self, stage: int, key: jax.Array, x0: jax.Array, uploads: Any):
        gamma, g, none, log_mult = self._server_start(x0, uploads)
        scale = jnp.broadcast_to(gamma, x0.shape).astype(x0.dtype)
        proposal = self._langevin(key, x0, g, scale * self._multiplier(log_mult)[:, None])
        last, zero = jnp.full(x0.shape[:1], -1, jnp.int32), jnp.zeros((), jnp.int32)
        state = MALAServerState(
            x0, g, proposal, last, gamma, log_mult, DualAveraging.start(x0), scale, Welford.empty(x0), zero
        )
        return state, self._broadcast(last, zero, proposal, log_mult)

    def client_step(
        self,
        key,
        payload,
        state: MALAClientState,  # type: ignore[override]  # the run's own state type
        client: ClientData,
    ):
        """Commit the decisions announced (:meth:`_commit_through`), propose z', evaluate at (x', z'), upload
        (c_i, grad_x U_i(x', z'))."""
        news, x_prop, mult = payload
        state = self._commit_through(state, news, news[1])  # round 0: none announced
        gamma = state.scale * mult[:, None]  # (chains, q): this round's step of each coordinate
        z_prop = self._langevin(key, state.z, state.gz, gamma)
        u_prop, gx_prop, gz_prop = self._eval(x_prop, z_prop, client)
        c = state.u - u_prop + _log_q(state.z, z_prop, gz_prop, gamma) - _log_q(z_prop, state.z, state.gz, gamma)
        # a proposal where the density or a gradient is not finite, or a divergent one (MAX_DELTA_ENERGY), is
        # rejected: its flag is 0 (and c, grad 0, so that the upload stays an ordinary one for the engine's screening)
        ok = jnp.isfinite(c) & jnp.all(jnp.isfinite(gx_prop), -1) & (c > -MAX_DELTA_ENERGY)
        c, gx_prop = jnp.where(ok, c, 0.0), jnp.where(ok[:, None], gx_prop, 0.0)
        new = state._replace(z_prop=z_prop, u_prop=u_prop, gz_prop=gz_prop, count=news[1] + 1)
        return new, dense_message((c, ok.astype(c.dtype), gx_prop))

    def server_step(
        self,
        key,
        state: MALAServerState,  # type: ignore[override]  # the run's own state type
        uploads: Message,
        info,
    ):
        """Metropolis-Hastings on the joint proposal; in warm-up, the step multipliers' dual averaging; then the
        next proposal with the decisions' news and the multipliers."""
        c, ok, g_prop = uploads.payload
        # every client's flag must be 1: a client whose upload is missing (lost or screened out: it arrives zeroed)
        # or whose proposal is not finite forces a rejection. A loss independent of the chain's state leaves the
        # kernel a mixture of Metropolis-Hastings and staying put, both of which keep the posterior.
        c, ok, g_prop = jnp.sum(c, 0), jnp.min(ok, 0) > 0, jnp.sum(g_prop, 0)
        lost = _any_lost(info)
        k_u, k_prop = split_server_key(key)  # jax.random.split(key), hashed ahead in a round
        gamma = state.scale * self._multiplier(state.log_mult)[:, None]
        log_alpha = c + _log_q(state.x, state.proposal, g_prop, gamma) - _log_q(state.proposal, state.x, state.g, gamma)
        log_alpha = jnp.where(jnp.isnan(log_alpha) | ~ok, -jnp.inf, log_alpha)
        alpha = jnp.exp(jnp.minimum(log_alpha, 0.0))
        accept = jnp.log(jax.random.uniform(k_u, c.shape, c.dtype)) < log_alpha
        x = jnp.where(accept[:, None], state.proposal, state.x)
        g = jnp.where(accept[:, None], g_prop, state.g)
        n = state.n + 1  # this decision's number
        da, log_mult, scale, acc = self._adapt(state, x, alpha, n, lost)
        proposal = self._langevin(k_prop, x, g, scale * self._multiplier(log_mult)[:, None])
        last = jnp.where(accept, state.n, state.last)
        new = state._replace(
            x=x, g=g, proposal=proposal, last=last, log_mult=log_mult, da=da, scale=scale, acc=acc, n=n
        )
        diag = {
            "_sample": x,
            "acceptance": jnp.mean(alpha),
            "accepted": jnp.mean(accept.astype(x.dtype)),
            "step_multiplier": jnp.mean(self._multiplier(log_mult)),
            "lost": lost,
        }
        return new, self._broadcast(last, n, proposal, log_mult), diag

    def final_message(self, key, server) -> tuple[jax.Array, jax.Array]:
        """The decisions' news after the last round, so that every client takes its last state."""
        return server.last, server.n

    def final_client(self, key, news, state, client: ClientData):
        return self._final_draws(self._commit_through(state, news, news[1]))

    def _first_kept_round(self) -> int:
        """The round of the first kept draw (MALA: a decision a round)."""
        return self.warmup

    def record_parts(self, key, server_state, problem: Problem, history: Mapping[str, np.ndarray]) -> FitParts:
        """MALA's settings: ``history``'s acceptance records one row per decision (HMC: subsampled to them) and its
        bits one per round; the draws kept start at decision ``warmup``, round :meth:`_first_kept_round`."""
        parts = super().record_parts(key, server_state, problem, history)
        lost = np.asarray(history["lost"], bool) if "lost" in history else np.zeros(len(history["acceptance"]), bool)
        rate = np.asarray(history["acceptance"])[self.warmup :][~lost[self.warmup :]]  # decisions a loss did not force
        first = self._first_kept_round()
        bits = sum(float(np.sum(np.asarray(history[k])[first:])) for k in ("bits_up", "bits_down") if k in history)
        accepted = float(np.sum(np.asarray(history["accepted"])[self.warmup :])) * server_state.x.shape[0]  # all chains
        parts.settings = {
            **(parts.settings or {}),
            "acceptance": float(rate.mean()) if rate.size else float("nan"),
            "target_accept": self.cfg.target_accept if self.cfg.adapt_step else None,
            "adaptation_rounds": first if self.cfg.adapt_step else 0,
            "step_multiplier": np.exp(np.asarray(server_state.log_mult, np.float64)).tolist(),
            "bits_per_accepted_draw": bits / accepted if accepted > 0 else float("inf"),
            # decisions a lost upload forced to be rejections (the chain stayed put: still exact)
            "decisions_lost": int(np.sum(lost)),
        }
        share = float(np.mean(lost)) if lost.size else 0.0
        if share > LOST_WARN_SHARE:
            each = f"each of its {self.L} rounds" if self.L > 1 else "its round"
            warnings.warn(
                f"{self.name}: {share:.0%} of its decisions were rejected because an upload was lost (a decision "
                f"needs every client's answer in {each}): the chains barely move, and the "
                "warm-up's step adaptation had few decisions to learn from, so R-hat and ESS may fail for this "
                "reason rather than for too few rounds. Find why clients fail (res.faults)"
                + (
                    ", or use fewer num_steps (a trajectory survives with probability (1 - p)^(clients x num_steps)) "
                    "or fb.JointMALA"
                    if self.L > 1
                    else ""
                )
                + ".",
                ConvergenceWarning,
                stacklevel=2,
            )
        return parts


HMC_STEP_SCALE = 1.0
"""JointHMC's automatic start: inverse mass 1 / the largest curvature of each block, leapfrog step 1 (times the
adapted multiplier): about half the leapfrog's stability limit 2 on that block's stiffest direction."""


class HMCServerState(NamedTuple):
    x: jax.Array  # (chains, d) the chains' current globals (the state after the last decision)
    g: jax.Array  # (chains, d) sum_i grad_x U_i at the chain's state
    pos: jax.Array  # (chains, d) the trajectory's position (the one broadcast this round)
    rho: jax.Array  # (chains, d) the trajectory's momentum (whitened: rho ~ N(0, I) at the start)
    k0: jax.Array  # (chains,) the starting kinetic energy |rho_0|^2 / 2
    ok: jax.Array  # (chains,) bool: every client's every evaluation in this trajectory was finite
    lost: jax.Array  # () bool: a client's upload was lost in this trajectory (it is rejected)
    last: jax.Array  # (chains,) int32: the index of the last accepted trajectory (-1: none), sent every round
    gamma: jax.Array  # () the globals' base inverse mass
    log_mult: jax.Array  # (chains,) log of the adapted leapfrog step
    eps: jax.Array  # (chains,) the current trajectory's step: the adapted one, jittered, as the wire carries it
    da: DualAveraging
    scale: jax.Array  # (chains, d) the inverse mass: gamma, then the window variances
    acc: Welford
    n: jax.Array  # () int32: decisions made
    r: jax.Array  # () int32: rounds done


class HMCClientState(NamedTuple):
    z: jax.Array  # (chains, q) the chain's latents
    u: jax.Array  # (chains,) U_i at the chain's state
    gz: jax.Array  # (chains, q) grad_z U_i there
    pos: jax.Array  # (chains, q) the trajectory's position
    u_pos: jax.Array  # (chains,) U_i at the trajectory's position
    g_pos: jax.Array  # (chains, q) grad_z U_i there
    rho: jax.Array  # (chains, q) the trajectory's momentum (whitened)
    h0: jax.Array  # (chains,) U_i + |rho|^2 / 2 at the trajectory's start
    ok: jax.Array  # (chains,) bool: the trajectory has stayed finite and within MAX_DELTA_ENERGY so far
    gamma: jax.Array  # () the client's own base inverse mass
    draws: jax.Array  # (kept draws, chains, q)
    filled: jax.Array  # (kept draws,) bool
    count: jax.Array  # type: ignore[assignment]  # field shadows tuple.count; () int32: decisions committed
    r: jax.Array  # () int32: rounds answered
    scale: jax.Array  # (chains, q) the inverse mass
    acc: Welford


@dataclass(frozen=True)
class JointHMC(JointMALA):
    """Exact federated Hamiltonian Monte Carlo with ``num_steps`` leapfrog steps per proposal, each step one
    round trip, for models with ``fb.local()`` latents (their joint posterior with the globals) and without.

    With inverse mass D = diag(D_x, D_1, ..., D_b) (block diagonal: each party's own coordinates), whitened
    momenta rho ~ N(0, I) and leapfrog step eps, a step is

        rho <- rho - eps/2 D^1/2 grad U(q),   q <- q + eps D^1/2 rho,   rho <- rho - eps/2 D^1/2 grad U(q).

    Every block moves with its own gradient at the same joint point, so each round the server broadcasts the
    globals' position x_j; each client moves its latents' position z_ij by its half kick and drift, evaluates
    U_i at (x_j, z_ij), kicks its momentum, and uploads grad_x U_i there (d floats per chain; at the last step
    also its share of the energy change, c_i = U_i(start) + |rho_i,0|^2/2 - U_i(end) - |rho_i,L|^2/2; every
    round a flag, 0 once its trajectory is non-finite or divergent, :data:`MAX_DELTA_ENERGY`). The server kicks and
    drifts the globals and, after ``num_steps`` rounds, accepts with
    probability min(1, exp(sum_i c_i + |rho_x,0|^2/2 - |rho_x,L|^2/2)): Metropolis-Hastings on the joint
    trajectory, exact at any step (the leapfrog is reversible and volume-preserving for any block-diagonal D).
    The decision goes out with the next trajectory's first position; each client keeps its end point or its
    start. Each trajectory's step is the adapted one times a factor uniform on [1 - ``step_jitter``,
    1 + ``step_jitter``] (default 0.5), drawn by the server independently of the state (so exactness is kept):
    with a fixed number of steps, a fixed step makes trajectories whose length is near a multiple of half a
    period of some posterior direction, which then barely moves (Neal 2011, section 5.4.2.3); measured here,
    z_3's ESS was 24 of 4 000 draws without the jitter. A draw costs ``num_steps`` rounds: ``num_rounds`` must be a
    multiple of it, and ``warmup`` (in
    rounds, default half of them) and ``thinning`` (in draws) are counted in trajectories as
    ``warmup // num_steps`` draws.

    Steps and warm-up as :class:`JointMALA`'s: the inverse mass starts at 1 / each block's largest curvature
    (a given ``step_size``: the leapfrog step, with unit inverse mass), the step multiplier is adapted by dual
    averaging to ``target_accept`` (default 0.8, NumPyro's), and the diagonal inverse mass in Stan's windows
    from each party's own states (``adapt_mass_matrix``). ``res.settings``: ``acceptance`` (mean acceptance
    probability after warm-up), ``bits_per_accepted_draw``, ``num_steps``, ``step_multiplier``."""

    num_steps: int = 8
    target_accept: float = 0.8
    step_jitter: float = 0.5
    name = "JointHMC"

    def __post_init__(self):
        super().__post_init__()
        require_int(self.num_steps, f"{self.name} num_steps", 1)
        require_real(self.step_jitter, f"{self.name} step_jitter", 0.0, 1.0, open_high=True)

    def _make_run(self, fm: FedModel, problem: Problem) -> JointHMCRun:
        return JointHMCRun(self, fm, problem)


class JointHMCRun(JointMALARun):
    """:class:`JointHMC` bound to a model: MALA's messages, one leapfrog step a round, a decision every
    ``num_steps`` rounds."""

    step_scale = HMC_STEP_SCALE
    cfg: JointHMC

    def __init__(self, cfg: JointHMC, fm: FedModel, problem: Problem):
        L = cfg.num_steps
        if problem.num_rounds % L:
            raise ConfigError(
                f"{cfg.name}: num_rounds={problem.num_rounds} is not a multiple of num_steps={L} "
                "(a draw is num_steps rounds)"
            )
        super().__init__(cfg, fm, problem)
        self.L, self.warmup_rounds = L, self.warmup
        self.warmup = self.warmup // L  # from here on in decisions (draws)
        self.num_kept = len(range(self.warmup, problem.num_rounds // L, cfg.thinning))
        if self.num_kept == 0:
            raise ConfigError(
                f"{cfg.name}: warmup={self.warmup_rounds} rounds leaves no draw of {problem.num_rounds // L}"
            )
        self.windows = mass_windows(self.warmup) if cfg.adapt_mass_matrix else (0, ())

    def _inverse_mass(self, gamma: jax.Array, like: jax.Array) -> jax.Array:
        """The starting inverse mass per coordinate: gamma (1 / curvature), or a given step's square with eps 1."""
        d = gamma**2 if self.cfg.step_size is not None else gamma
        return jnp.broadcast_to(d, like.shape).astype(like.dtype)

    def _jittered(self, key, log_mult: jax.Array) -> jax.Array:
        """(chains,): each chain's step for a new trajectory, exp(log_mult) U(1 - j, 1 + j), as the wire carries it."""
        j = self.cfg.step_jitter
        u = jax.random.uniform(key, log_mult.shape, log_mult.dtype, 1 - j, 1 + j)
        return self._multiplier(log_mult + jnp.log(u))

    # ------------------------------------------------------------------ set-up
    def setup_client(self, stage: int, key: jax.Array, x0: jax.Array, state: Any, client: ClientData):
        z0, gamma, share = self._client_start(key, x0, client)
        u, gx, gz = self._eval(x0, z0, client)
        none = jnp.zeros(z0.shape[:1], z0.dtype)
        zero = jnp.zeros((), jnp.int32)
        state = HMCClientState(
            z0,
            u,
            gz,
            z0,
            u,
            gz,
            jnp.zeros_like(z0),
            none,
            jnp.ones(z0.shape[:1], bool),
            gamma,
            *self._empty_draws(z0),
            zero,
            zero,
            self._inverse_mass(gamma, z0),
            Welford.empty(z0),
        )
        return self._record(state, 0), (gx, share)

    def _start_trajectory(self, key, x, g, scale, log_mult):
        """A new momentum and step, the first half kick and drift: (pos, rho, k0, eps)."""
        k_rho, k_eps = jax.random.split(key)
        rho = jax.random.normal(k_rho, x.shape, x.dtype)
        k0 = 0.5 * jnp.sum(rho**2, -1)
        eps = self._jittered(k_eps, log_mult)
        root = jnp.sqrt(scale)
        rho = rho - 0.5 * eps[:, None] * root * g
        return x + eps[:, None] * root * rho, rho, k0, eps

    def setup_server_step(self, stage: int, key: jax.Array, x0: jax.Array, uploads: Any):
        gamma, g, none, log_mult = self._server_start(x0, uploads)
        scale = self._inverse_mass(gamma, x0)
        pos, rho, k0, eps = self._start_trajectory(key, x0, g, scale, log_mult)
        zero, last = jnp.zeros((), jnp.int32), jnp.full(x0.shape[:1], -1, jnp.int32)
        state = HMCServerState(
            x0,
            g,
            pos,
            rho,
            k0,
            jnp.ones(x0.shape[:1], bool),
            jnp.zeros((), bool),
            last,
            gamma,
            log_mult,
            eps,
            DualAveraging.start(x0),
            scale,
            Welford.empty(x0),
            zero,
            zero,
        )
        return state, dense_message(((last, zero), pos, eps))

    # ------------------------------------------------------------------ rounds
    @staticmethod
    def _candidate(
        state: HMCClientState,  # type: ignore[override]  # the run's own state type
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The trajectory's end point, the candidate of its decision."""
        return state.pos, state.u_pos, state.g_pos

    def _pending(self, state: HMCClientState):
        """The first trajectory not committed; a broadcast of round r announces the r // num_steps ended by then."""
        return state.count, lambda r: r // self.L

    def client_step(
        self,
        key,
        payload,
        state: HMCClientState,  # type: ignore[override]  # the run's own state type
        client: ClientData,
    ):
        """One leapfrog step of the client's latents at the broadcast position of the globals; at a trajectory's
        start the decisions announced are committed (:meth:`JointMALARun._commit_through`) and a momentum drawn; at
        its end the energy share goes up. A client that missed rounds of the trajectory under way (whose decision
        will be a rejection) answers it with flag 0."""
        news, x_pos, mult = payload
        L, r = self.L, news[1]
        first, last = r % L == 0, r % L == L - 1
        state = self._commit_through(state, news, r)._replace(ok=state.ok & (state.r == r))

        def begin(st):
            rho = jax.random.normal(key, st.z.shape, st.z.dtype)
            return st._replace(
                pos=st.z, u_pos=st.u, g_pos=st.gz, rho=rho, h0=st.u + 0.5 * jnp.sum(rho**2, -1), ok=jnp.ones_like(st.ok)
            )

        state = jax.lax.cond(first, begin, lambda st: st, state._replace(r=r))
        eps, root = mult[:, None], jnp.sqrt(state.scale)
        rho = state.rho - 0.5 * eps * root * state.g_pos
        pos = state.pos + eps * root * rho
        u, gx, gz = self._eval(x_pos, pos, client)
        rho = rho - 0.5 * eps * root * gz
        change = state.h0 - u - 0.5 * jnp.sum(rho**2, -1)  # minus the client's energy error so far
        ok = (
            state.ok
            & jnp.isfinite(change)
            & jnp.all(jnp.isfinite(gx), -1)
            & jnp.all(jnp.isfinite(gz), -1)
            & (change > -MAX_DELTA_ENERGY)
        )
        c = jnp.where(last & ok, change, 0.0)
        gx = jnp.where(ok[:, None], gx, 0.0)
        new = state._replace(pos=pos, u_pos=u, g_pos=gz, rho=rho, ok=ok, r=state.r + 1)
        return new, dense_message((c, ok.astype(c.dtype), gx))

    def server_step(
        self,
        key,
        state: HMCServerState,  # type: ignore[override]  # the run's own state type
        uploads: Message,
        info,
    ):
        """The globals' second half kick; at a trajectory's end Metropolis-Hastings (and in warm-up the
        adaptation); then the next half kick and drift, broadcast with the decision and the step."""
        c, ok, g_pos = uploads.payload
        c, ok, g_pos = jnp.sum(c, 0), state.ok & (jnp.min(ok, 0) > 0), jnp.sum(g_pos, 0)
        lost = state.lost | _any_lost(info)  # a lost upload's flag arrives 0: the trajectory is rejected
        k_u, k_rho = split_server_key(key)  # jax.random.split(key), hashed ahead in a round
        eps, root = state.eps[:, None], jnp.sqrt(state.scale)
        rho = state.rho - 0.5 * eps * root * g_pos
        last = state.r % self.L == self.L - 1
        log_alpha = c + state.k0 - 0.5 * jnp.sum(rho**2, -1)
        log_alpha = jnp.where(jnp.isnan(log_alpha) | ~ok, -jnp.inf, log_alpha)
        alpha = jnp.exp(jnp.minimum(log_alpha, 0.0))
        accept = (jnp.log(jax.random.uniform(k_u, c.shape, c.dtype)) < log_alpha) & last

        def decide(_):
            x = jnp.where(accept[:, None], state.pos, state.x)
            g = jnp.where(accept[:, None], g_pos, state.g)
            n = state.n + 1
            da, log_mult, scale, acc = self._adapt(state, x, alpha, n, lost)
            pos, rho_new, k0, eps_new = self._start_trajectory(k_rho, x, g, scale, log_mult)
            return state._replace(
                x=x,
                g=g,
                pos=pos,
                rho=rho_new,
                k0=k0,
                ok=jnp.ones_like(ok),
                lost=jnp.zeros_like(lost),
                log_mult=log_mult,
                eps=eps_new,
                da=da,
                scale=scale,
                acc=acc,
                n=n,
                last=jnp.where(accept, state.n, state.last),
            )

        def move(_):
            r = rho - 0.5 * eps * root * g_pos
            return state._replace(pos=state.pos + eps * root * r, rho=r, ok=ok, lost=lost)

        new = jax.lax.cond(last, decide, move, None)._replace(r=state.r + 1)
        diag = {
            "_sample": new.x,
            "acceptance": jnp.mean(alpha),
            "accepted": jnp.mean(accept.astype(c.dtype)),
            "step_multiplier": jnp.mean(self._multiplier(new.log_mult)),
            "lost": lost,
        }
        return new, dense_message(((new.last, new.r), new.pos, new.eps)), diag

    def final_message(self, key, server: HMCServerState) -> tuple[jax.Array, jax.Array]:
        return server.last, server.r

    def record_parts(self, key, server_state, problem: Problem, history: Mapping[str, np.ndarray]) -> FitParts:
        """The rounds' records at the decisions (every ``num_steps``-th round), then :class:`JointMALARun`'s."""
        L = self.L
        at_decisions = {
            k: (np.asarray(v)[L - 1 :: L] if k in ("_sample", "acceptance", "accepted", "lost") else v)
            for k, v in history.items()
        }
        parts = super().record_parts(key, server_state, problem, at_decisions)
        parts.settings = {
            **(parts.settings or {}),
            "num_steps": L,
            "warmup": self.warmup,
            "warmup_rounds": self.warmup_rounds,
        }
        return parts

    def _first_kept_round(self) -> int:
        """The round of the first kept draw: ``num_steps`` rounds a decision."""
        return self.warmup * self.L


__all__ = [
    "JointLMC",
    "JointMALA",
    "JointHMC",
    "LOCAL_STEP_SCALE",
    "MALA_STEP_SCALE",
    "HMC_STEP_SCALE",
    "MAX_DELTA_ENERGY",
]
