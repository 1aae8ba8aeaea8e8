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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from ..engine import final_exchange, stack_clients
from ..errors import ConfigError, ModelError
from ..introspect import FedModel
from ..kernels import curvature
from ..protocol import ClientData, FitParts, Problem, with_final_parts
from ..compress import Compressor
from .channels import DirectUplink, EF21PDownlink, EF21Uplink, FullDownlink
from .elf import DENSE_CURVATURE, LangevinRun, LangevinSampler, _ef_compressor
from .warmstart import resolve_init

LOCAL_STEP_SCALE = 0.1
"""gamma_i = LOCAL_STEP_SCALE / lambda_max(-grad_z^2 log p(D_i, z | x)) at the chain's start (the server's
step uses the same 0.1 on the globals' block)."""


class JointClientState(NamedTuple):
    down: Any  # the downlink channel's state
    up: Any  # the uplink channel's state
    z: jax.Array  # (chains, q) the client's latents, unconstrained and flat
    gamma: jax.Array  # () the client's own step
    draws: jax.Array  # (kept draws, chains, q) the client's kept states
    count: jax.Array  # () int32: rounds this client has moved in (its next state's round)


@dataclass(frozen=True)
class JointLMC(LangevinSampler):
    """Joint federated Langevin (ULA) for models with global sites (with priors) and ``fb.local()``
    latents: posterior draws of the globals and of every client's latents together (the module's
    docstring has the scheme). The options are :class:`LMC`'s (``step_size``: the globals' step, and
    each client's when given; None: 0.1 / the largest curvature of each block at the start), except:

    * ``init``: None or ``"prior"`` (the globals' prior centres, jittered per chain by U(-0.5, 0.5)),
      or a dict / ``Result`` of constrained global values (jittered likewise); the local latents of
      each chain start at a draw from p(z_i | x_0). There is no search for the joint mode yet.
    * every client in every round (each moves its own latents every round); minibatches
      (``batch_size``) are not supported yet.

    Compression, as the ELF family's (the clients' gradients in the globals and the server's broadcast
    are the only things that travel): ``uplink`` a compressor for D-ELF's error feedback (EF21) on the
    gradients, ``downlink`` one for P-ELF's (EF21-P) on the broadcast (each client then moves at its
    copy w of the globals), ``rescale`` as theirs. None (default): sent in full.

    Exact: on a Gaussian hierarchical model its draws have the ULA law of the joint target (tested); it
    carries ULA's O(step) bias. With error feedback and an odd compressor (top-k) the stationary mean
    stays exact (tested), as for D-/P-ELF.
    """

    uplink: Compressor | None = None
    downlink: Compressor | None = None
    rescale: bool = False
    name = "JointLMC"

    def _channels(self, dim):
        up = DirectUplink() if self.uplink is None else EF21Uplink(_ef_compressor(self.uplink, self.rescale, self.name))
        down = (FullDownlink() if self.downlink is None
                else EF21PDownlink(_ef_compressor(self.downlink, self.rescale, self.name)))
        return up, down

    def build(self, problem: Problem) -> "JointLangevinRun":
        fm: FedModel = problem.model
        fm.require(self.name)
        if not fm.local_names:
            raise ModelError(f"{self.name} samples models with local latents (fb.local()); this model has none: "
                             "use fb.LMC")
        params = [n for n in fm.global_names if fm.sites[n].role == "param"]
        if params:
            raise ModelError(f"{self.name} samples a posterior, but {params} are numpyro.param sites without a "
                             "prior; give them priors with numpyro.sample")
        if self.batch_size is not None:
            raise ConfigError(f"{self.name} takes full-batch steps only (batch_size=None)")
        if isinstance(self.init, str) and self.init == "map":
            raise ConfigError(f"{self.name} has no search for the joint mode: init=None / 'prior', or given values")
        C = problem.data.num_clients
        if problem.cohort_size not in (None, C):
            raise ConfigError(f"{self.name} needs every client in every round (each moves its own latents), got "
                              f"clients_per_round={problem.cohort_size} of {C}")
        if self.warmup is not None and self.warmup >= problem.num_rounds:
            raise ConfigError(f"{self.name} warmup={self.warmup} leaves no draws from {problem.num_rounds} rounds")
        return JointLangevinRun(self, fm, problem)


class JointLangevinRun(LangevinRun):
    """:class:`JointLMC` bound to a model: :class:`~fedbayes.algorithms.elf.LangevinRun`'s server step and
    channels, with clients that carry and move their own latents."""

    final_exchange = True

    def __init__(self, cfg: JointLMC, fm: FedModel, problem: Problem):
        from .. import minibatch

        self.cfg, self._fm, self.name = cfg, fm, cfg.name
        self._b = problem.data.num_clients
        self._batches = minibatch.resolve(None, fm, problem.data.mask.shape[1], cfg.name)
        self.warmup = cfg.warmup if cfg.warmup is not None else problem.num_rounds // 2
        self._spread = self._precond = None
        self.map_bits, self.map_iterations = (0, 0), 0
        self.start = "given" if isinstance(cfg.init, Mapping) or hasattr(cfg.init, "params") else "prior-centre"
        values = None if cfg.init is None or isinstance(cfg.init, str) else resolve_init(cfg.init, problem, jacobian=True)
        flat, self._unravel = ravel_pytree(fm.init_globals(None, values))
        self._x0, self.dim = flat, flat.size
        self.up, self.down = cfg._channels(int(flat.size))
        z_flat, self._unravel_z = ravel_pytree(fm.zeros_local())
        self.local_dim = int(z_flat.size)
        self.num_kept = len(range(self.warmup, problem.num_rounds, cfg.thinning))

    # ------------------------------------------------------------------ potentials
    def joint_potential(self, x: jax.Array, z: jax.Array, client: ClientData) -> jax.Array:
        """U_i(x, z_i) = -log p(D_i, z_i | x) - log p(x) / b, unconstrained (Jacobians included)."""
        theta = self._unravel(x)
        local = self._fm.client_log_joint(theta, self._unravel_z(z), client.data, client.mask)
        return -local - self._fm.log_prior(theta, jacobian=True) / self._b

    def _grads(self, x: jax.Array, z: jax.Array, client: ClientData) -> tuple[jax.Array, jax.Array]:
        """(grad_x U_i, grad_z U_i) at each chain's (x, z) (rows)."""
        return jax.vmap(jax.grad(self.joint_potential, argnums=(0, 1)), in_axes=(0, 0, None))(x, z, client)

    def _move_z(self, key, z, gz, gamma):
        return z - gamma * gz + jnp.sqrt(2 * gamma) * jax.random.normal(key, z.shape, z.dtype)

    def _record(self, state: JointClientState) -> JointClientState:
        """Keep the current state if its round is a kept one (after warm-up, every ``thinning``-th)."""
        k = state.count - self.warmup
        keep = (k >= 0) & (k % self.cfg.thinning == 0)
        slot = jnp.clip(k // self.cfg.thinning, 0, self.num_kept - 1)
        draws = jnp.where(keep, state.draws.at[slot].set(state.z), state.draws)
        return state._replace(draws=draws)

    # ------------------------------------------------------------------ set-up
    def setup_client(self, stage: int, key: jax.Array, x0: jax.Array, state: Any, client: ClientData):
        """Each chain's latents start at a draw from p(z_i | x_0); the client's step from its own curvature
        at chain 0's start; the first joint move from (x_0, z_0): z moves here, grad_x goes up (with the
        client's share of the globals' curvature for the server's step)."""
        k_z, k_move = jax.random.split(key)
        chains = x0.shape[0]
        starts = jax.vmap(lambda k, x: ravel_pytree(self._fm.sample_local_prior(k, self._unravel(x), client.data,
                                                                               client.mask))[0])(
            jax.random.split(k_z, chains), x0)
        if self.cfg.step_size is not None:
            gamma = jnp.asarray(self.cfg.step_size, starts.dtype)
            share: Any = ()
        else:
            lam, _ = curvature(lambda z: -self.joint_potential(x0[0], z, client), starts[0], jnp.ones_like(starts[0]), 50)
            gamma = LOCAL_STEP_SCALE / jnp.maximum(lam, 1e-12)
            pot_x = lambda x: self.joint_potential(x, starts[0], client)  # noqa: E731
            share = (jax.hessian(pot_x)(x0[0]) if self.dim <= DENSE_CURVATURE
                     else curvature(lambda x: -pot_x(x), x0[0], jnp.ones_like(x0[0]), 100)[0])
        gx, gz = self._grads(x0, starts, client)
        z1 = self._move_z(k_move, starts, gz, gamma)
        draws = jnp.zeros((self.num_kept,) + starts.shape, starts.dtype)
        state = JointClientState(self.down.client_start(x0), self.up.client_start(gx), z1, gamma, draws,
                                 jnp.zeros((), jnp.int32))
        return state, (gx, share)

    # ------------------------------------------------------------------ rounds
    def client_step(self, key, payload, state: JointClientState, client: ClientData):
        """Keep (x_k, z_k)'s z when the round is kept, then both gradients at (x_k, z_k): z moves, grad_x goes up."""
        w, down = self.down.receive(payload, state.down)
        state = self._record(state)
        k_move, k_up = jax.random.split(key)
        gx, gz = self._grads(w, state.z, client)
        z = self._move_z(k_move, state.z, gz, state.gamma)
        up, message = self.up.send(k_up, gx, state.up)
        return state._replace(down=down, up=up, z=z, count=state.count + 1), message

    # ------------------------------------------------------------------ the end
    def final_client(self, key, payload, state: JointClientState, client: ClientData):
        """The client's kept draws, constrained-site layout (chains, draws, ...), kept by the client; nothing up."""
        draws = jnp.swapaxes(state.draws, 0, 1)  # (chains, draws, q)
        local = jax.vmap(jax.vmap(self._unravel_z))(draws)
        return {"local_samples": local, "step_size": state.gamma}, ()

    def final_server(self, key, server_state, payload, uploads, locals_) -> FitParts:
        """The clients' own draws where collected (a simulation); the globals' come from :meth:`record_parts`."""
        parts = FitParts(params={}, params_last={})
        if locals_ is not None:
            parts.local_samples = locals_["local_samples"]
            parts.client_info = {"step_size": locals_["step_size"]}
        return parts

    def record_parts(self, key, server_state, problem: Problem, history: Mapping[str, np.ndarray]) -> FitParts:
        """The globals' draws from the server's records (:meth:`LangevinRun.finalize`)."""
        parts = LangevinRun.finalize(self, key, (server_state, None, None), problem, history)
        parts.settings = {**(parts.settings or {}), "local_step_scale": LOCAL_STEP_SCALE}
        return parts

    def finalize(self, key, carry, problem: Problem, history: Mapping[str, np.ndarray]) -> FitParts:
        """The globals' draws and each client's own draws of its latents (the final exchange)."""
        server, states, _ = carry
        return with_final_parts(self.record_parts(key, server, problem, history),
                                final_exchange(self, key, server, states, stack_clients(problem.data)))


__all__ = ["JointLMC", "LOCAL_STEP_SCALE"]
