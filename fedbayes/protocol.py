"""The federated algorithm protocol: the message and state types, and the base class of every run.

A fit has three phases, each a set of pure (traceable) functions of pytrees; the engine
(:mod:`fedbayes.engine`) runs them vectorised over clients in one process, the Flower adapter
(:mod:`fedbayes.flower`) message by message over a network, and both call exactly the methods below:

::

    set-up       setup_server(key)                                      -> server_state, payload
    (stages s)   setup_client(s, key, payload, client_state, client)    -> client_state, upload
                 setup_server_step(s, key, server_state, uploads)       -> server_state, payload
                                                        (the last stage's payload: the first broadcast)
                 setup_done(server_state, last uploads)                 -> server_state (host side: the settings)
                 client_settings(server_state)                          -> settings, sent once to every client

    round k      client_step(key, broadcast, client_state, client)      -> client_state, upload
                 server_step(key, server_state, uploads, round_info)    -> server_state, broadcast, diagnostics
                 client_finish(reply, client_state, client, upload)     -> client_state, bits   (``replies``)
                 resync_message(server_state) / resync(client_state, payload)                (``resyncs``)

    final        final_message(key, server_state)                       -> payload       (``final_exchange``)
                 final_client(key, payload, client_state, client)       -> local, upload
                 final_server(key, server_state, payload, uploads, locals) -> FitParts of the Result
                 finalize(key, carry, problem, history)                 -> FitParts of the Result

Only :class:`Message` objects cross the network during the rounds: the payload as the receiver decodes
it and its exact size in bits. A run declares what it takes part in with class attributes
(``setup_stages``, ``replies``, ``resyncs``, ``final_exchange``, ``participation``); the optional
stages have documented no-op defaults, so neither the engine nor the Flower adapter asks an algorithm
what it has. An algorithm's user-facing configuration (a frozen dataclass such as
:class:`fedbayes.FedSOUL`) builds its run with ``build(problem)``; the run is never changed after that.

Settings the set-up exchange resolves (step sizes, probabilities, a preconditioner) live in the server
state, put there by ``setup_done``; the part the clients need, ``client_settings(server_state)``, is
sent to every client once and reaches the client's stages as ``client.settings`` (a field of
:class:`ClientData`). So every stage reads its settings from its arguments, as BlackJAX's kernels take
their step size and Optax keeps its count in the optimiser state, and no order of tracing can matter.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, NamedTuple
from collections.abc import Mapping

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
    must agree on, such as TAMUNA's number of local steps and compression mask. After the set-up,
    ``settings`` holds what the server sent every client once (:meth:`FederatedRun.client_settings`;
    None during the set-up itself).
    """

    data: dict[str, jax.Array]
    mask: jax.Array
    size: jax.Array
    index: jax.Array  # type: ignore[assignment]  # public field name; shadowing tuple.index is intended
    slot: jax.Array | None = None
    shared_key: jax.Array | None = None
    settings: Any = None


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


@dataclasses.dataclass
class FitParts:
    """What a run hands the :class:`fedbayes.Result` after its last round (``finalize``, and the final
    exchange's ``final_server``). Only ``params`` and ``params_last`` are required; every other field is
    optional and documented here, so a misspelt or unknown part is an error instead of a silent omission.
    For reading it also behaves as a mapping of the fields that are set (``parts["theta"]``, ``.get``).
    """

    params: dict[str, Any]
    """Point estimate of the global sites, constrained (a posterior mean for the samplers)."""
    params_last: dict[str, Any]
    """The estimate of the last round alone (the samplers: the last draws' mean over chains)."""
    params_averaged: dict[str, Any] | None = None
    """The averaged iterate, where ``params`` is its one Newton step (FedSOUL's ``one_step``)."""
    theta: PyTree = None
    """The estimate in unconstrained coordinates (a dict of arrays), where the algorithm has one."""
    global_samples: dict[str, Any] | None = None
    """Posterior draws of the global sites, constrained, (chains, draws, ...) (the samplers)."""
    local_samples: dict[str, Any] | None = None
    """Draws of each client's local latents, unconstrained, (clients, chains, draws, ...)."""
    local_point: bool | None = None
    """True when ``local_samples`` hold one fitted point per client, repeated over chains and draws, not
    posterior draws (FedRep, FineTune, LocalOnly): ``res.idata`` then has them in ``fed_client_params``
    and no ``posterior``, and no chain checks run on them."""
    client_info: dict[str, Any] | None = None
    """Per-client numbers of the final exchange (FedSOUL: local step size and acceptance rate)."""
    local_info: dict[str, Any] | None = None
    """Per-client summaries of closed-form local posteriors (FedMM: means, covariances, responsibilities)."""
    se: dict[str, Any] | None = None
    """Standard errors of the globals (constrained), from the observed information."""
    global_approx: dict[str, Any] | None = None
    """Draws of the normal approximation of the globals' posterior, constrained, (chains, draws, ...)."""
    information: PyTree = None
    """Observed information of the log posterior at the estimate (unconstrained, flat)."""
    cov_unconstrained: PyTree = None
    """Its inverse, the approximate posterior covariance (unconstrained, flat)."""
    gradient: PyTree = None
    """Gradient of the log posterior at the estimate (unconstrained, flat): the convergence checks' input."""
    gradient_cov: PyTree = None
    """The Monte Carlo noise covariance of ``gradient``, where it is an average over draws."""
    statistic: PyTree = None
    """FedMM's final expected complete-data statistic (summed over clients)."""
    settings: dict[str, Any] | None = None
    """Hyper-parameters the run resolved (steps, probabilities, warm-up, start), for ``res.settings``."""
    final_state: PyTree = None
    """The server state after the last round."""
    privacy: dict[str, Any] | None = None
    """The privacy report of a fit with client-level DP (:mod:`fedbayes.privacy`), for ``res.privacy``."""
    init_bits: tuple[int, int] = (0, 0)
    """(up, down) bits before the first round: set by the engine from the set-up and ``start_bits``."""
    start_bits: tuple[int, int] = (0, 0)
    """(up, down) bits of exchanges the run made while it was built (the samplers' search for the mode)."""
    final_bits: tuple[int, int] = (0, 0)
    """(up, down) bits of the final exchange (set by the engine)."""

    @classmethod
    def of(cls, parts: FitParts | Mapping[str, Any]) -> FitParts:
        """``parts`` itself, or a mapping's entries as FitParts (an unknown name is a TypeError)."""
        if isinstance(parts, FitParts):
            return parts
        missing = [f for f in ("params", "params_last") if f not in parts]
        if missing:
            raise TypeError(f"a run's result parts need {missing}; got {sorted(parts)}")
        return cls(params=parts["params"], params_last=parts["params_last"]).update(
            {k: v for k, v in parts.items() if k not in ("params", "params_last")}
        )

    def update(self, parts: Mapping[str, Any] | FitParts) -> FitParts:
        """Set the given fields (a mapping, or another FitParts' set fields); an unknown name is an error."""
        items = parts.items() if isinstance(parts, (Mapping, FitParts)) else parts
        for name, value in items:
            if name not in _FIT_FIELDS:
                raise TypeError(f"FitParts has no field {name!r}; the fields are {sorted(_FIT_FIELDS)}")
            setattr(self, name, value)
        return self

    def items(self) -> list[tuple[str, Any]]:
        """The fields that are set (not None), as (name, value) pairs."""
        return [(f, getattr(self, f)) for f in _FIT_FIELDS if getattr(self, f) is not None]

    def keys(self) -> list[str]:
        """The names of the fields that are set (so ``dict(parts)`` and ``d.update(parts)`` work)."""
        return [name for name, _ in self.items()]

    def __iter__(self) -> Any:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())

    def __getitem__(self, name: str) -> Any:
        if name not in _FIT_FIELDS or getattr(self, name) is None:
            raise KeyError(name)
        return getattr(self, name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.update({name: value})

    def __contains__(self, name: object) -> bool:
        return name in _FIT_FIELDS and getattr(self, str(name)) is not None

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if name in self else default


_FIT_FIELDS = tuple(f.name for f in dataclasses.fields(FitParts))


def dense_bits(tree: PyTree, element_bits: int = FLOAT_BITS) -> int:
    """Bits of a dense payload on the wire (:func:`fedbayes.wire.pack`: 32 per float or int element;
    ``element_bits=SETTING_BITS`` for the client settings, sent as float64)."""
    return int(sum(element_bits * int(np.prod(np.shape(x), dtype=np.int64)) for x in jax.tree_util.tree_leaves(tree)))


def dense_message(tree: PyTree) -> Message:
    """``tree`` sent dense, with its :func:`dense_bits`."""
    return Message(tree, jnp.asarray(dense_bits(tree), jnp.int32))


def with_final_parts(parts: FitParts, final: FitParts | Mapping[str, Any]) -> FitParts:
    """``parts`` (from the round records, :meth:`FederatedRun.record_parts`) with the final exchange's set fields
    added; the final exchange's ``params`` / ``params_last`` are placeholders there and are left out, and its
    ``settings`` are added to the records' (not put in their place)."""
    extra = {k: v for k, v in FitParts.of(final).items() if k not in ("params", "params_last")}
    if "settings" in extra and parts.settings:
        extra["settings"] = {**parts.settings, **extra["settings"]}
    return parts.update(extra)


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
    * ``setup_stages`` (1): the number of set-up exchanges.
    * ``sums_uploads`` (False): True when the server uses the uploads of every exchange only through their
      sum over the clients, so that secure aggregation can hide them (Flower's SecAgg+,
      :class:`fedbayes.flower.SecAggPlus`); otherwise False or a string saying why not.
    * ``pads_freely`` (False): True when a client step's new state and upload do not depend on how far the
      client's rows are padded, beyond the order of sums (no per-row axis in them, no random draw over its
      rows, padded rows masked out): in a round of every client the engine may then run the clients in
      buckets of similar size, each padded to its own largest (:func:`fedbayes.engine.round_buckets`).
    * ``kept_on_fault`` (()): fields of a client's state (a NamedTuple) that a faulty member keeps from its
      round instead of rolling them back: records the round made that its catch-up would make again, identical
      (the joint exact samplers' buffers of kept draws, which a select with the old state would copy whole every
      round).

    * ``common_client_fields`` (()): fields of a client's state (a NamedTuple) that every client holds alike at
      every round: each client's new value depends on the broadcast and its old value only, every client starts
      from the same one, and a faulty member's :meth:`resync` restores the value the members in step hold
      (P-/B-ELF's copies of w). The vectorised engine keeps one copy of them, without a client axis (no copy per
      client to store, and a client step computes with the one value, as a hand-written loop would), and
      refuses them where some clients could fall behind (a cohort drawn each round, ``participation`` < 1). On
      a network each client keeps its own.

    Runs are built by their configuration's ``build(problem)``. All stage functions are pure; the
    client's ``client`` argument is its own data only, and ``key`` arguments follow the engine's key
    streams, so a fit is a function of its seed. A run is immutable once built: what the set-up resolves
    travels in the states (:meth:`setup_done`, :meth:`client_settings`).
    """

    name: str = "FederatedRun"
    setup_stages: int = 1
    participation: float = 1.0
    final_exchange: bool = False
    replies: bool = False
    resyncs: bool = False
    kept_on_fault: tuple[str, ...] = ()
    common_client_fields: tuple[str, ...] = ()
    pads_freely: bool = False
    sums_uploads: bool | str = False
    divergence_hint: str = ""
    """Likely fixes named in the error when the fit diverges (empty: a generic hint)."""

    # ------------------------------------------------------------------ set-up
    def init(self, key: jax.Array, problem: Problem) -> tuple[PyTree, PyTree, Message]:
        """``(server_state, client_states, first broadcast)``: the set-up exchange with every client at
        once (:func:`fedbayes.engine.staged_init`, which also returns its bits)."""
        from .engine import staged_init

        return staged_init(self, key, problem)[0]

    @abc.abstractmethod
    def setup_server(self, key: jax.Array) -> tuple[PyTree, PyTree]:
        """The server's start, without any client's data: ``(server_state, payload to every client)``."""

    @abc.abstractmethod
    def setup_client(
        self, stage: int, key: jax.Array, payload: PyTree, client_state: PyTree, client: ClientData
    ) -> tuple[PyTree, PyTree]:
        """Set-up stage ``stage`` on one client (``client_state`` is None at stage 0): its state and upload."""

    @abc.abstractmethod
    def setup_server_step(
        self, stage: int, key: jax.Array, server_state: PyTree, uploads: PyTree
    ) -> tuple[PyTree, PyTree]:
        """The server's answer to stage ``stage``'s uploads (stacked over all clients in index order): its
        state and the next stage's payload, or after the last stage the first round's :class:`Message`."""

    def setup_done(self, server_state: PyTree, uploads: PyTree) -> PyTree:
        """Host side, once after the last set-up stage: the server state with the settings resolved from
        the last stage's ``uploads`` (steps, probabilities, curvature; NumPy and warnings allowed). Default:
        the state unchanged."""
        return server_state

    def client_settings(self, server_state: PyTree) -> PyTree:
        """What every client needs of the settings in ``server_state``, sent to each once after the set-up
        (:data:`SETTING_BITS` per element) and read by the client's stages as ``client.settings``. It must not
        change over the rounds. Default: nothing."""
        return ()

    # ------------------------------------------------------------------ a round
    @abc.abstractmethod
    def client_step(
        self, key: jax.Array, broadcast: PyTree, client_state: PyTree, client: ClientData
    ) -> tuple[PyTree, Message]:
        """One client's work in a round: its new state and its upload."""

    @abc.abstractmethod
    def server_step(
        self, key: jax.Array, server_state: PyTree, uploads: Message, info: RoundInfo
    ) -> tuple[PyTree, Message, dict[str, jax.Array]]:
        """The server's step from the cohort's uploads: its state, the next broadcast, diagnostics.

        ``key`` is the round's server key. A step that splits it in two can take the halves with
        ``fedbayes.engine.split_server_key(key)``: the bits of ``jax.random.split(key)``, hashed ahead with the
        chunk's other keys inside ``fed_fit``'s rounds (one key hash fewer a round on a CPU)."""

    def finish_message(self, payload: PyTree) -> PyTree:
        """The reply a cohort member receives after the server step (``replies``), from the new
        broadcast's decoded payload (default: the broadcast itself)."""
        return payload

    def client_finish(
        self, reply: PyTree, client_state: PyTree, client: ClientData, upload: PyTree
    ) -> tuple[PyTree, jax.Array]:
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

    def final_client(
        self, key: jax.Array, payload: PyTree, client_state: PyTree, client: ClientData
    ) -> tuple[PyTree, PyTree]:
        """``(what stays with the client, its upload)`` in the final exchange (default: nothing)."""
        return (), ()

    def final_server(
        self, key: jax.Array, server_state: PyTree, payload: PyTree, uploads: PyTree, locals_: PyTree | None
    ) -> FitParts | dict[str, Any]:
        """:class:`FitParts` of the Result from the final exchange (default: none). ``uploads`` is None when a client
        did not answer on a network, ``locals_`` None where personal posteriors stay on their clients."""
        return {}

    def record_parts(
        self, key: jax.Array, server_state: PyTree, problem: Problem, history: Mapping[str, np.ndarray]
    ) -> FitParts | None:
        """:class:`FitParts` read off the server's round records (``history``: the samplers' draws) by a run that
        also has a final exchange (``final_exchange``), merged with :meth:`final_server`'s by
        :func:`with_final_parts` (default: none). The Flower server calls it; a run's :meth:`finalize` does
        the same in simulation."""
        return None

    def finalize_ahead(self, key: jax.Array, carry: tuple[PyTree, PyTree, Message], problem: Problem) -> None:
        """Compile ahead what :meth:`finalize` will compile (:meth:`fedbayes.engine.FitJitted.ahead`), for a
        carry shaped like ``carry``, while the rounds compile and run (``fedbayes.engine.run_rounds``'s
        ``prepare``); default: with a ``final_exchange``, its computations
        (:func:`fedbayes.engine.final_exchange_ahead`). Nothing it does may change what :meth:`finalize` returns."""
        if self.final_exchange:
            from .engine import final_exchange_ahead  # (the engine imports this module)

            final_exchange_ahead(self, key, carry, problem)

    @abc.abstractmethod
    def finalize(
        self,
        key: jax.Array,
        carry: tuple[PyTree, PyTree, Message],
        problem: Problem,
        history: Mapping[str, np.ndarray] | None = None,
    ) -> FitParts:
        """:class:`FitParts` of the Result after the last round, in simulation (every client's state in ``carry``). The
        set-up's bits are the engine's to count; exchanges the run made before it (a search for a start
        during ``build``) go in ``start_bits``, added to ``res.init_bits``. A plain dict is accepted and checked field
        by field."""
