"""The federated algorithm protocol: the message and state types, and the base class of every run.

A fit has three phases, each a set of pure (traceable) functions of pytrees; the engine
(:mod:`fedbayes.engine`) runs them vectorised over clients in one process, the Flower adapter
(:mod:`fedbayes.flower`) message by message over a network, and both call exactly the methods below:

::

    set-up       setup_server(key)                                      -> server_state, payload
    (stages s)   setup_client(s, key, payload, client_state, client)    -> client_state, upload
                 setup_server_step(s, key, server_state, uploads)       -> server_state, payload
                                                        (the last stage's payload: the first broadcast)
                 setup_done(server_state, last uploads)                 (host side, optional)

    round k      client_step(key, broadcast, client_state, client)      -> client_state, upload
                 server_step(key, server_state, uploads, round_info)    -> server_state, broadcast, diagnostics
                 client_finish(reply, client_state, client, upload)     -> client_state, bits   (``replies``)
                 resync_message(server_state) / resync(client_state, payload)                (``resyncs``)

    final        final_message(key, server_state)                       -> payload       (``final_exchange``)
                 final_client(key, payload, client_state, client)       -> local, upload
                 final_server(key, server_state, payload, uploads, locals) -> parts of the Result
                 finalize(key, carry, problem, history)                 -> parts of the Result

Only :class:`Message` objects cross the network during the rounds: the payload as the receiver decodes
it and its exact size in bits. A run declares what it takes part in with class attributes
(``setup_stages``, ``replies``, ``resyncs``, ``final_exchange``, ``participation``,
``shared_settings``); the optional stages have documented no-op defaults, so neither the engine nor
the Flower adapter asks an algorithm what it has. An algorithm's user-facing configuration (a frozen
dataclass such as :class:`fedbayes.FedSOUL`) builds its run with ``build(problem)``.
"""

from __future__ import annotations

import abc
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .data import FederatedData
from .wire import FLOAT_BITS as WIRE_FLOAT_BITS

PyTree = Any

FLOAT_BITS = WIRE_FLOAT_BITS
"""Bits of one uncompressed float on the wire (float32), used by every ledger entry."""

SETTING_BITS = 64
"""Bits of one shared setting (a float64 sent once to each client after set-up)."""


class Message(NamedTuple):
    """A message on the wire: its (decoded) payload and its exact size in bits."""

    payload: PyTree
    bits: jax.Array


class ClientData(NamedTuple):
    """One client's padded data as the client step sees it (stacked over clients in the engine).

    Inside a round two more fields are set: ``slot``, the client's position in the round's cohort
    (0 .. cohort_size - 1, assigned by the server), and ``shared_key``, the round's public random key,
    the same for every member of the cohort and the server (a function of the seed and the round
    number, so it costs nothing on the wire). Algorithms use them for randomness the whole cohort
    must agree on, such as TAMUNA's number of local steps and compression mask.
    """

    data: dict[str, jax.Array]
    mask: jax.Array
    size: jax.Array
    index: jax.Array
    slot: jax.Array | None = None
    shared_key: jax.Array | None = None


class RoundInfo(NamedTuple):
    """What the server knows about a round: its index, the cohort, who answered usefully (``active``)
    and which expected members failed (``faulty``: dropped, or an upload rejected by the screen of
    :mod:`fedbayes.faults`; their uploads arrive zeroed)."""

    round: jax.Array
    cohort: jax.Array
    active: jax.Array
    num_clients: int
    shared_key: jax.Array | None = None
    faulty: jax.Array | None = None


class Problem(NamedTuple):
    """A federated problem: the analysed model, the data, the planned rounds and the cohort size."""

    model: Any
    data: FederatedData
    num_rounds: int
    cohort_size: int | None = None  # None: every client every round


def dense_bits(tree: PyTree) -> int:
    """Bits of a dense payload on the wire (:func:`fedbayes.wire.pack`: 32 per float or int element)."""
    return int(sum(FLOAT_BITS * int(np.prod(np.shape(x), dtype=np.int64)) for x in jax.tree_util.tree_leaves(tree)))


def dense_message(tree: PyTree) -> Message:
    """``tree`` sent dense, with its :func:`dense_bits`."""
    return Message(tree, jnp.asarray(dense_bits(tree), jnp.int32))


class FederatedRun(abc.ABC):
    """An algorithm bound to a problem: the base class of every run the engine and Flower execute.

    Required: the set-up exchange (:meth:`setup_server`, :meth:`setup_client`,
    :meth:`setup_server_step`), the round (:meth:`client_step`, :meth:`server_step`) and
    :meth:`finalize`. Optional, each declared by a class attribute and otherwise a no-op:

    * ``replies`` (False): after the server step each answering cohort member receives the server's
      reply (:meth:`finish_message` of the new broadcast) and updates its state (:meth:`client_finish`),
      a second half-round whose bits the client reports (TAMUNA's uncompressed model to the cohort).
    * ``resyncs`` (False): clients keep a copy of server state (P-/B-ELF's w); a faulty member is sent
      :meth:`resync_message` of the state that opened the round and applies it with :meth:`resync`.
    * ``final_exchange`` (False): after the last round the estimate goes to every client, each computes
      what stays with it and what goes back (:meth:`final_message`, :meth:`final_client`,
      :meth:`final_server`; :func:`fedbayes.engine.final_exchange` runs it vectorised).
    * ``participation`` (1.0): each cohort member takes part in a round independently with this
      probability (FedMM's Bernoulli participation).
    * ``shared_settings`` (()): names of run attributes the server computes at set-up and a network
      sends to every client once (:data:`SETTING_BITS` per float), set by :meth:`setup_done`.
    * ``setup_stages`` (1): the number of set-up exchanges.

    Runs are built by their configuration's ``build(problem)``. All stage functions are pure; the
    client's ``client`` argument is its own data only, and ``key`` arguments follow the engine's key
    streams, so a fit is a function of its seed.
    """

    name: str = "FederatedRun"
    setup_stages: int = 1
    shared_settings: tuple[str, ...] = ()
    participation: float = 1.0
    final_exchange: bool = False
    replies: bool = False
    resyncs: bool = False

    # ------------------------------------------------------------------ set-up
    def init(self, key: jax.Array, problem: Problem) -> tuple[PyTree, PyTree, Message]:
        """``(server_state, client_states, first broadcast)``: the set-up exchange with every client at
        once (:func:`fedbayes.engine.staged_init`)."""
        from .engine import staged_init

        return staged_init(self, key, problem)

    @abc.abstractmethod
    def setup_server(self, key: jax.Array) -> tuple[PyTree, PyTree]:
        """The server's start, without any client's data: ``(server_state, payload to every client)``."""

    @abc.abstractmethod
    def setup_client(self, stage: int, key: jax.Array, payload: PyTree, client_state: PyTree,
                     client: ClientData) -> tuple[PyTree, PyTree]:
        """Set-up stage ``stage`` on one client (``client_state`` is None at stage 0): its state and upload."""

    @abc.abstractmethod
    def setup_server_step(self, stage: int, key: jax.Array, server_state: PyTree,
                          uploads: PyTree) -> tuple[PyTree, PyTree]:
        """The server's answer to stage ``stage``'s uploads (stacked over all clients in index order): its
        state and the next stage's payload, or after the last stage the first round's :class:`Message`."""

    def setup_done(self, server_state: PyTree, uploads: PyTree) -> None:
        """Host-side hook after set-up: set the ``shared_settings`` on the run (default: nothing)."""

    # ------------------------------------------------------------------ a round
    @abc.abstractmethod
    def client_step(self, key: jax.Array, broadcast: PyTree, client_state: PyTree,
                    client: ClientData) -> tuple[PyTree, Message]:
        """One client's work in a round: its new state and its upload."""

    @abc.abstractmethod
    def server_step(self, key: jax.Array, server_state: PyTree, uploads: Message,
                    info: RoundInfo) -> tuple[PyTree, Message, dict[str, jax.Array]]:
        """The server's step from the cohort's uploads: its state, the next broadcast, diagnostics."""

    def finish_message(self, payload: PyTree) -> PyTree:
        """The reply a cohort member receives after the server step (``replies``), from the new
        broadcast's decoded payload (default: the broadcast itself)."""
        return payload

    def client_finish(self, reply: PyTree, client_state: PyTree, client: ClientData,
                      upload: PyTree) -> tuple[PyTree, jax.Array]:
        """A cohort member's update from the reply (``replies``): its state and the reply's bits
        (default: unchanged, 0 bits)."""
        return client_state, jnp.zeros((), jnp.int32)

    def resync_message(self, server_state: PyTree) -> Message:
        """The server's copy-of-state message to a faulty member (``resyncs``; default: empty)."""
        return Message((), jnp.zeros((), jnp.int32))

    def resync(self, client_state: PyTree, payload: PyTree) -> PyTree:
        """A faulty member's state brought back in step with the server (``resyncs``; default: unchanged)."""
        return client_state

    # ------------------------------------------------------------------ the end
    def final_message(self, key: jax.Array, server_state: PyTree) -> PyTree:
        """The payload to every client in the final exchange (``final_exchange``; default: nothing)."""
        return ()

    def final_client(self, key: jax.Array, payload: PyTree, client_state: PyTree,
                     client: ClientData) -> tuple[PyTree, PyTree]:
        """``(what stays with the client, its upload)`` in the final exchange (default: nothing)."""
        return (), ()

    def final_server(self, key: jax.Array, server_state: PyTree, payload: PyTree, uploads: PyTree,
                     locals_: PyTree | None) -> dict[str, Any]:
        """Parts of the Result from the final exchange (default: none). ``uploads`` is None when a client
        did not answer on a network, ``locals_`` None where personal posteriors stay on their clients."""
        return {}

    @abc.abstractmethod
    def finalize(self, key: jax.Array, carry: tuple[PyTree, PyTree, Message], problem: Problem,
                 history: Mapping[str, np.ndarray] | None = None) -> dict[str, Any]:
        """Parts of the Result after the last round, in simulation (every client's state in ``carry``)."""
