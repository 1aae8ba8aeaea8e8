"""QLSD: quantised Langevin stochastic dynamics (Vono, Plassier, Durmus, Dieuleveut, Moulines, 2022).

The target is pi(x) proportional to exp(-U(x)), U = sum_i U_i, with the client potentials of
:mod:`fedbayes.algorithms.elf`. Round k, with cohort A_k of the b clients drawn uniformly:

* client i in A_k computes its exact gradient grad U_i(x_k) on all its data and sends
  Q_i = Q(grad U_i(x_k) - h_i), Q an unbiased compressor (E[Q(v)] = v), then updates its private
  memory h_i <- h_i + alpha Q_i with the same, once-quantised, message;
* the server keeps H = sum_i h_i over all clients (it sees every message), forms

      G = H + (b / |A_k|) sum_{i in A_k} Q_i,        H <- H + alpha sum_{i in A_k} Q_i,

  and takes the Langevin step x_{k+1} = x_k - gamma G + sqrt(2 gamma) Z_k, Z_k ~ N(0, I), broadcast
  in full. Since E[Q_i] = grad U_i(x_k) - h_i and a uniform cohort gives
  E[(b / |A|) sum_{i in A} v_i] = sum_i v_i, E[G] = sum_i grad U_i(x_k): G is unbiased.

The memories h_i start at zero. ``memory=True`` (the paper's QLSD* memory mechanism, DIANA-style)
uses alpha = 1 / (omega + 1) with omega the compressor's variance constant for the d-vector; then
h_i tracks grad U_i and the variance of G no longer grows with the clients' heterogeneity.
``memory=False`` is plain QLSD: alpha = 0, so h_i = H = 0 throughout.

Unlike the public code, each message is quantised once, and every client has its own memory,
starting at zero. Gradients are exact (full local data): no mini-batches and no SVRG (QLSD++).
All chains share each round's cohort (the engine draws one per round), so under partial
participation their errors are correlated. Ledger: per cohort client and chain, the compressor's
bits up and 32 d bits down; at init, x_0 to all b clients and nothing up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..compress import Compressor, identity, require_unbiased
from ..protocol import ClientData, Message, Problem, RoundInfo, dense_message
from ..errors import ConfigError
from ..model import FedModel
from .elf import LangevinRun, ServerState, LangevinSampler


class QLSDServer(NamedTuple):
    x: jax.Array  # (chains, d)
    h: jax.Array  # (chains, d): H = sum_i h_i over all clients


class QLSDClient(NamedTuple):
    h: jax.Array  # (chains, d): the client's memory h_i


@dataclass(frozen=True)
class QLSD(LangevinSampler):
    """QLSD with partial participation (``clients_per_round`` of ``fb.fed_fit``).

    Parameters (besides those of the Langevin samplers)
    ----------
    compressor:
        The unbiased uplink compressor Q, applied to each chain's d-vector with its own key.
    memory:
        Memory terms h_i with alpha = 1 / (omega(d) + 1) (QLSD*); False: plain QLSD (h_i = 0).
    """

    compressor: Compressor = identity()
    memory: bool = True
    partial_participation = True
    name = "QLSD"

    def __post_init__(self):
        if not isinstance(self.memory, bool):
            raise ConfigError(f"{self.name} memory must be True or False, got {self.memory!r}")
        super().__post_init__()

    def _compressors(self) -> tuple[Compressor, Compressor]:
        return require_unbiased(self.compressor, self.name), identity()

    def _make_run(self, fm: FedModel, problem: Problem) -> "QLSDRun":
        return QLSDRun(self, fm, problem)


class QLSDRun(LangevinRun):
    """QLSD bound to a model: the Langevin run with memory terms in place of gradient states."""

    def __init__(self, cfg: QLSD, fm: FedModel, problem: Problem):
        super().__init__(cfg, fm, problem)
        self.alpha = 1.0 / (1.0 + self._up.omega(self.dim)) if cfg.memory else 0.0

    def setup_client(self, stage: int, key: jax.Array, x0: jax.Array, state, client: ClientData):
        """Memories h_i = 0; only the curvature share of the automatic step goes back."""
        return QLSDClient(jnp.zeros_like(x0)), ((), self._local_curvature(client))

    def setup_server_step(self, stage: int, key: jax.Array, x0: jax.Array, uploads):
        """x_0 (prior medians, jittered per chain as in LMC) is the first broadcast; H = 0."""
        return QLSDServer(x0, jnp.zeros_like(x0)), dense_message(x0)

    def client_step(
        self, key: jax.Array, payload: jax.Array, state: QLSDClient, client: ClientData
    ) -> tuple[QLSDClient, Message]:
        """Send Q_i = Q(grad U_i(x) - h_i) and keep h_i + alpha Q_i."""
        sent, q, bits = self._compress(self._up, key, self._grad(payload, client) - state.h)
        return QLSDClient(state.h + self.alpha * q), Message(sent, bits)

    def gradient_estimate(self, h: jax.Array, payload: jax.Array, info: RoundInfo) -> tuple[jax.Array, jax.Array]:
        """(G, H_new) = (H + (b/|A|) sum_{i in A} Q_i, H + alpha sum_{i in A} Q_i) over the clients A that
        answered: a faulty client is left out of both (its memory h_i is rolled back with it)."""
        total = jnp.sum(payload, 0)  # faulty and inactive members' uploads arrive zeroed
        weight = info.num_clients / jnp.maximum(jnp.sum(info.active), 1)
        return h + weight * total, h + self.alpha * total

    def server_step(
        self, key: jax.Array, state: QLSDServer, uploads: Message, info: RoundInfo
    ) -> tuple[QLSDServer, Message, dict[str, jax.Array]]:
        """x_{k+1} = x_k - gamma G + sqrt(2 gamma) Z_k (LangevinRun._move), recording x_k as the draw.

        Without memory a round nobody answered (``FaultPolicy(min_clients=0)``) has no gradient at all and
        leaves x where it is, as LMC does (a noise step without drift would widen the stationary law);
        with memory, G = H still carries the clients' last gradients and the step is taken."""
        g, h = self.gradient_estimate(state.h, uploads.payload, info)
        gamma = None if self.cfg.memory else jnp.where(jnp.any(info.active), self._gamma, jnp.zeros_like(self._gamma))
        moved, broadcast = self._move(key, ServerState(state.x, state.x, g), gamma)
        return QLSDServer(moved.x, h), broadcast, {"_sample": state.x}
