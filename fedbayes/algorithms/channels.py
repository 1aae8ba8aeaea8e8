"""The uplink and downlink channels of the federated Langevin samplers, composed into one run.

Every sampler of :mod:`fedbayes.algorithms.elf` and :mod:`fedbayes.algorithms.qlsd` is the same server
step, x <- x - gamma g + sqrt(2 gamma) Z, between two channels (as Optax chains gradient transforms):

* a **downlink** carries x to the clients, who compute their gradients at what they received:

  - :class:`FullDownlink`: x itself, dense (LMC, D-ELF, QLSD);
  - :class:`EF21PDownlink`: EF21-P (P-/B-ELF). Server and clients keep w; the server sends
    v = Q(x - w) and both set w <- w + v; clients use w. With a preconditioner S (S S' = H^-1) the
    difference is compressed in the whitened coordinates S^-1 (x - w), where every coordinate has the
    posterior's scale, and mapped back with S.

* an **uplink** carries each client's gradient g^i = grad U_i back, and the server forms g:

  - :class:`DirectUplink`: Q(g^i) with no memory (LMC; the naive compressed baseline with a Q), the
    sum of the answers scaled by expected / answered;
  - :class:`EF21Uplink`: EF21 (D-/B-ELF). The client keeps g^i_k and sends c = Q(grad - g^i_k),
    both sides add c; the server's g is the sum of the memories (a faulty client's stale one included);
    under central DP :class:`ClippedEF21Uplink` keeps each client's memory and sums them clipped;
  - :class:`MemoryUplink`: QLSD's memories (Vono et al., 2022). The client keeps h_i and sends
    Q(grad - h_i), h_i <- h_i + alpha Q; the server keeps H = sum_i h_i and uses
    G = H + (b / |A|) sum_{i in A} Q_i, unbiased under uniform partial participation.

Each channel is a frozen dataclass of pure functions of its own state (a pytree: () when it keeps
none), so the run carries ``(down, up)`` states and adds no flag of its own. Each also declares its
error's model for the stationary law's report (``stationary_noise``: its share of the gradient error's
covariance at the mode, :mod:`fedbayes.algorithms.stationary`, or None where it has none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from ..compress import Coded, Compressor, identity
from ..faults import fault_weight
from ..protocol import Message, RoundInfo, dense_message
from .stationary import LagTerm, NoiseInputs, NoiseTerm


def compress_rows(comp: Compressor, key: jax.Array, v: jax.Array) -> tuple[Coded, jax.Array, jax.Array]:
    """Compress each chain's row of ``v`` independently (``Compressor.coded_rows``): (the coded rows as
    sent, the decoded rows, total bits)."""
    coded, out, bits = comp.coded_rows(key, v)
    return coded, out, jnp.sum(bits)


def _lag(comp: Compressor, d: int) -> list[NoiseTerm | LagTerm] | None:
    """Error feedback's lag with a contractive compressor (:meth:`fedbayes.compress.Compressor.refresh_lag`;
    [] for the identity; None if not contractive; :mod:`fedbayes.algorithms.stationary`)."""
    if comp == identity():
        return []
    lag = comp.refresh_lag(d)
    return None if lag is None else [LagTerm(lag)]


# ----------------------------------------------------------------------------------------- downlinks


@dataclass(frozen=True)
class FullDownlink:
    """x sent dense; the clients keep no copy, and a faulty one is re-sent nothing (0 bits)."""

    def server_start(self, x0: jax.Array) -> Any:
        return ()

    def client_start(self, x0: jax.Array) -> Any:
        return ()

    def send(self, key: jax.Array, x: jax.Array, state: Any) -> tuple[Any, Message]:
        """(the server's new channel state, the broadcast) after the server moved to ``x``."""
        return (), dense_message(x)

    def receive(self, payload: jax.Array, state: Any) -> tuple[jax.Array, Any]:
        """(the point the client computes its gradient at, its new channel state)."""
        return payload, ()

    def resync_message(self, state: Any, x: jax.Array) -> Message:
        return Message(jnp.zeros((0,), x.dtype), jnp.asarray(0, jnp.int32))

    def stationary_noise(self, at: NoiseInputs) -> list[NoiseTerm | LagTerm] | None:
        """No error: the clients compute at x itself."""
        return []

    def resync(self, state: Any, payload: Any) -> Any:
        return state


@dataclass(frozen=True)
class EF21PDownlink:
    """EF21-P: v = Q(x - w) sent (in the whitened coordinates when ``precond`` S is given, ``whiten`` = L
    with H = L L', S^-1 = L'); w <- w + v on both sides. A faulty client is re-sent w in full."""

    compressor: Compressor = identity()
    precond: jax.Array | None = None
    whiten: jax.Array | None = None

    def server_start(self, x0: jax.Array) -> jax.Array:
        return x0  # w_0 = x_0

    def client_start(self, x0: jax.Array) -> jax.Array:
        return x0

    def send(self, key: jax.Array, x: jax.Array, w: jax.Array) -> tuple[jax.Array, Message]:
        if self.precond is None:
            sent, v, bits = compress_rows(self.compressor, key, x - w)
            return w + v, Message(sent, bits)
        if self.whiten is None:
            raise ValueError("EF21PDownlink: a precond S needs its whiten L (S^-1 = L') too")
        sent, v, bits = compress_rows(self.compressor, key, (x - w) @ self.whiten)
        return w + v @ self.precond.T, Message(sent, bits)

    def receive(self, payload: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
        w = w + (payload if self.precond is None else payload @ self.precond.T)
        return w, w

    def resync_message(self, w: jax.Array, x: jax.Array) -> Message:
        """``w`` of the server state that opened the round, in full: the copy a client in step holds
        before that round's broadcast is added."""
        return dense_message(w)

    def resync(self, w: jax.Array, payload: jax.Array) -> jax.Array:
        return payload

    def stationary_noise(self, at: NoiseInputs) -> list[NoiseTerm | LagTerm] | None:
        """The clients' copy w lags x by (1 - alpha) / alpha rounds on average (:class:`LagTerm`)."""
        return _lag(self.compressor, at.dim)


# ------------------------------------------------------------------------------------------- uplinks


@dataclass(frozen=True)
class DirectUplink:
    """Q(grad U_i) with no memory (Q the identity: the gradient in full). The set-up sends
    grad U_i(x_0) in full for the first move. A round nobody answered holds x (``moves``)."""

    compressor: Compressor = identity()
    setup_gradient = True

    def client_start(self, g0: jax.Array) -> Any:
        return ()

    def server_start(self, g0_sum: jax.Array) -> Any:
        return ()

    def send(self, key: jax.Array, grad: jax.Array, state: Any) -> tuple[Any, Message]:
        sent, _, bits = compress_rows(self.compressor, key, grad)
        return (), Message(sent, bits)

    def gather(self, state: Any, total: jax.Array, info: RoundInfo) -> tuple[jax.Array, Any, jax.Array | None]:
        """(g, the new server state, whether x moves this round or None when it always does) from the sum
        of the answers: scaled by expected / answered (unbiased under random faults). With no answer a
        noise step without drift would widen the stationary law by a factor that does not vanish with
        the step, while holding x keeps it."""
        return total * fault_weight(info, total.dtype), (), jnp.any(info.active)

    def stationary_noise(self, at: NoiseInputs) -> list[NoiseTerm | LagTerm] | None:
        """An unbiased Q adds white noise, omega times each coordinate's mean square in x (rand_k's exact
        diagonal): V_y = S' omega diag(sum_i E[g_i g_i']) S. None for a biased Q (it shifts the law, see
        :class:`fedbayes.LMC`)."""
        if self.compressor == identity():
            return []
        omega = self.compressor.omega(at.dim)
        if omega is None or at.grad_sq is None:
            return None
        return [NoiseTerm(0, omega * (at.precond.T * at.grad_sq) @ at.precond)]


class _MemoryStart:
    """An uplink whose client memory and the server's sum of them start at what the set-up gives."""

    def client_start(self, value: jax.Array) -> jax.Array:
        return value

    def server_start(self, value: jax.Array) -> jax.Array:
        return value


@dataclass(frozen=True)
class EF21Uplink(_MemoryStart):
    """EF21: c = Q(grad - g^i) sent, g^i <- g^i + c on both sides (the server keeps their sum), starting
    from g^i_0 = grad U_i(x_0) sent in full at set-up. A faulty client counts with its stale memory."""

    compressor: Compressor = identity()
    setup_gradient = True  # g^i_0 = grad U_i(x_0); the server's sum starts at sum_i g^i_0

    def send(self, key: jax.Array, grad: jax.Array, g: jax.Array) -> tuple[jax.Array, Message]:
        sent, c, bits = compress_rows(self.compressor, key, grad - g)
        return g + c, Message(sent, bits)

    def gather(self, g: jax.Array, total: jax.Array, info: RoundInfo) -> tuple[jax.Array, jax.Array, None]:
        g = g + total
        return g, g, None

    def stationary_noise(self, at: NoiseInputs) -> list[NoiseTerm | LagTerm] | None:
        """The memories lag the clients' gradients by (1 - alpha) / alpha rounds on average (:class:`LagTerm`)."""
        return _lag(self.compressor, at.dim)


@dataclass(frozen=True)
class ClippedEF21Uplink(EF21Uplink):
    """EF21 under central client-level DP (D-/B-ELF with ``privacy``). Under error feedback a client's
    contribution to the released sum is its memory g^i, not its message: a message clipped alone would
    bound nothing, since the memories add up the messages. The server sees every message, so it keeps each
    client's memory g^i (the sum of that client's messages, n x the gradient's size) instead of their sum,
    and releases sum_i clip(g^i, C): one client moves it by at most C, whatever its memory holds. The
    clients' own memories stay EF21's, unclipped, so the error feedback is unchanged; the clip biases the
    drift only where a memory's norm exceeds C. A faulty client counts with its stale memory (no fault
    weight: the sensitivity stays C)."""

    clip: float = 1.0

    def server_start(self, rows: jax.Array) -> jax.Array:
        """Each client's g^i_0 = grad U_i(x_0), as sent at set-up (the rows of the uploads)."""
        return rows

    def gather_rows(self, memories: jax.Array, rows: jax.Array, info: RoundInfo) -> tuple[jax.Array, jax.Array, None]:
        """(sum_i clip(g^i, C), the memories) after adding each client's message to its memory (a faulty or
        inactive member's row arrives zeroed, so its memory stays)."""
        from ..privacy import clip_norm

        memories = memories + rows
        return jnp.sum(jax.vmap(lambda m: clip_norm(m, self.clip)[0])(memories), 0), memories, None

    def stationary_noise(self, at: NoiseInputs) -> list[NoiseTerm | LagTerm] | None:
        """None: the clip shrinks the drift wherever a memory exceeds it, which no error model covers."""
        return None


@dataclass(frozen=True)
class MemoryUplink(_MemoryStart):
    """QLSD's memories with rate ``alpha`` (0: plain QLSD, h_i = H = 0 throughout): Q(grad - h_i) sent,
    h_i <- h_i + alpha Q. Nothing is sent at set-up (h_i = 0), and the first broadcast is x_0. Without
    memory a round nobody answered holds x; with it G = H still carries the last gradients."""

    compressor: Compressor = identity()
    alpha: float = 0.0
    setup_gradient = False  # h_i = 0 and H = 0: the set-up gives zeros

    def send(self, key: jax.Array, grad: jax.Array, h: jax.Array) -> tuple[jax.Array, Message]:
        sent, q, bits = compress_rows(self.compressor, key, grad - h)
        return h + self.alpha * q, Message(sent, bits)

    def gather(self, h: jax.Array, total: jax.Array, info: RoundInfo) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """(G, H_new) = (H + (b/|A|) sum_{i in A} Q_i, H + alpha sum_{i in A} Q_i) over the clients A that
        answered: a faulty client is left out of both (its memory h_i is rolled back with it)."""
        weight = info.num_clients / jnp.maximum(jnp.sum(info.active), 1)
        moves = None if self.alpha else jnp.any(info.active)
        return h + weight * total, h + self.alpha * total, moves

    def stationary_noise(self, at: NoiseInputs) -> list[NoiseTerm | LagTerm] | None:
        """None: the cohort's sampling adds an error that depends on who is drawn, which no model here covers."""
        return None
