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
starting at zero. Gradients are exact (full local data) by default; ``batch_size`` (as for every
Langevin sampler) takes each client's gradient on a minibatch, stochastic-gradient QLSD (the paper's
stochastic-gradient setting, without its SVRG variant QLSD++); the memories then track noisy gradients.
All chains share each round's cohort (the engine draws one per round), so under partial
participation their errors are correlated. Ledger: per cohort client and chain, the compressor's
bits up and 32 d bits down; at init, x_0 to all b clients and nothing up.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..compress import Compressor, identity, require_unbiased
from ..errors import ConfigError
from .channels import FullDownlink, MemoryUplink
from .elf import LangevinSampler


@dataclass(frozen=True)
class QLSD(LangevinSampler):
    """QLSD with partial participation (``clients_per_round`` of ``fb.fed_fit``): the Langevin run with
    QLSD's memory uplink (:class:`fedbayes.algorithms.channels.MemoryUplink`) and a full downlink.

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

    def _channels(self, dim: int | None) -> tuple[MemoryUplink, FullDownlink]:
        comp = require_unbiased(self.compressor, self.name)
        if not self.memory or dim is None:
            return MemoryUplink(comp, 0.0), FullDownlink()
        omega = comp.omega(dim)
        if omega is None:  # unreachable: an unbiased compressor's omega is a float
            raise ConfigError(f"{self.name} needs an unbiased compressor, got {comp.name}")
        return MemoryUplink(comp, 1.0 / (1.0 + omega)), FullDownlink()
