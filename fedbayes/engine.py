"""The federated round loop shared by every algorithm.

An algorithm is a set of pure functions over pytrees (see :class:`Algorithm`):

    init(key, problem)                                   -> server_state, client_states, broadcast
    client_step(key, broadcast, client_state, client)    -> client_state, upload
    server_step(key, server_state, uploads, round_info)  -> server_state, broadcast, diagnostics

``upload`` and ``broadcast`` are :class:`Message` objects: exactly what crosses the network, already
compressed, with their exact size in bits. Nothing else passes between clients and server.

One round: the server's broadcast goes to a cohort of ``cohort_size`` clients drawn uniformly
without replacement (a fixed size keeps shapes static); the cohort's client steps run under
``jax.vmap``; the server step aggregates the uploads. An algorithm with a ``participation``
probability p < 1 (FedMM's Bernoulli participation) has each cohort member take part independently
with probability p: only active clients' new states are kept, only their messages are counted, and
the server sees who answered in ``RoundInfo.active``. Each member also gets its slot in the cohort
and the round's public key (``ClientData.slot``, ``ClientData.shared_key``) for randomness the
cohort must share. An algorithm with a ``client_finish`` method gets a second half-round: after the
server step, each member receives the server's reply (the new broadcast, of which it is charged
only the bits ``client_finish`` reports) and updates its state. Rounds run inside ``jax.lax.scan`` in
chunks compiled once; between chunks the host records the ledger and updates the progress bar.
Randomness is a pure function of ``(seed, round, client id)``, so a fit is reproducible.
"""

from __future__ import annotations

import sys
import time
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from .data import FederatedData
from .errors import ConfigError, FedbayesError

PyTree = Any

FLOAT_BITS = 32
"""Bits of one uncompressed float on the wire (float32), used by every ledger entry."""


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
    """What the server knows about a round: its index, the cohort and who answered."""

    round: jax.Array
    cohort: jax.Array
    active: jax.Array
    num_clients: int
    shared_key: jax.Array | None = None


class Problem(NamedTuple):
    """A federated problem: the analysed model, the data, the planned rounds and the cohort size."""

    model: Any
    data: FederatedData
    num_rounds: int
    cohort_size: int | None = None  # None: every client every round


class Algorithm(Protocol):
    name: str

    def init(self, key: jax.Array, problem: Problem) -> tuple[PyTree, PyTree, Message]: ...

    def client_step(
        self, key: jax.Array, broadcast: PyTree, client_state: PyTree, client: ClientData
    ) -> tuple[PyTree, Message]: ...

    def server_step(
        self, key: jax.Array, server_state: PyTree, uploads: Message, info: RoundInfo
    ) -> tuple[PyTree, Message, dict[str, jax.Array]]: ...

    # Optional: a second half of the round for the cohort, after the server step. An algorithm that
    # defines it gets ``client_finish(new_broadcast_payload, client_state, client, own_upload_payload)
    # -> (client_state, bits_received)``; the bits are added to the round's downlink for that client.


def stack_clients(data: FederatedData) -> ClientData:
    """All clients' padded data, stacked on a leading client axis."""
    return ClientData(
        dict(data.padded), data.mask, jnp.asarray(data.sizes), jnp.arange(data.num_clients)
    )


def sample_cohort(key: jax.Array, num_clients: int, cohort_size: int) -> jax.Array:
    """``cohort_size`` distinct client indices drawn uniformly (all clients, in order, when full)."""
    if cohort_size == num_clients:
        return jnp.arange(num_clients)
    return jax.random.choice(key, num_clients, (cohort_size,), replace=False)


def resolve_cohort_size(clients_per_round: int | float | None, num_clients: int) -> int:
    """Cohort size from an int count, a float fraction in (0, 1], or None (all clients)."""
    if clients_per_round is None:
        return num_clients
    if isinstance(clients_per_round, bool):
        raise ConfigError("clients_per_round must be an int, a fraction in (0, 1] or None")
    if isinstance(clients_per_round, float):
        if not 0.0 < clients_per_round <= 1.0:
            raise ConfigError(f"clients_per_round as a fraction must lie in (0, 1], got {clients_per_round}")
        return max(1, int(round(clients_per_round * num_clients)))
    if isinstance(clients_per_round, (int, np.integer)):
        if not 1 <= clients_per_round <= num_clients:
            raise ConfigError(
                f"clients_per_round={clients_per_round} must lie in [1, {num_clients}] (the number of clients)"
            )
        return int(clients_per_round)
    raise ConfigError(f"clients_per_round must be an int, a fraction in (0, 1] or None, got {clients_per_round!r}")


def _take(tree: PyTree, idx: jax.Array) -> PyTree:
    return jax.tree_util.tree_map(lambda a: a[idx], tree)


def _put(tree: PyTree, idx: jax.Array, values: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda a, v: a.at[idx].set(v), tree, values)


_PARTICIPATION_STREAM = 0x5EED  # a key stream of its own: the other round keys are unchanged
_SHARED_STREAM = 0x5A4ED  # the round's public key (cohort-wide randomness), also a stream of its own
_CLIENT_AXES = ClientData(0, 0, 0, 0, 0, None)  # vmap axes: the shared key is the same for the cohort


def _where_active(active: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """Commit the new client states of active clients only (inactive ones keep theirs)."""
    return jax.tree_util.tree_map(lambda n, o: jnp.where(jnp.reshape(active, (-1,) + (1,) * (n.ndim - 1)), n, o), new, old)


class Progress:
    """A one-line progress report on stderr, shown only on a terminal unless forced."""

    def __init__(self, total: int, label: str, enabled: bool | None):
        self.total, self.label = total, label
        self.enabled = sys.stderr.isatty() if enabled is None else bool(enabled)
        self.start = time.perf_counter()

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        rate = done / elapsed if elapsed > 0 else float("nan")
        eta = (self.total - done) / rate if rate > 0 else float("nan")
        sys.stderr.write(
            f"\r[fedbayes] {self.label}: round {done}/{self.total} ({100 * done / self.total:.0f}%), "
            f"{rate:.1f} rounds/s, ~{eta:.0f}s left "
        )
        if done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def make_round(algorithm: Algorithm, clients: ClientData, num_clients: int, cohort_size: int, base_key: jax.Array):
    """The pure function of one round: ``(carry, k) -> (carry, record)``."""

    participation = float(getattr(algorithm, "participation", 1.0))

    def round_fn(carry, k):
        server_state, client_states, broadcast = carry
        rk = jax.random.fold_in(base_key, k)
        k_cohort, k_clients, k_server = jax.random.split(rk, 3)
        k_shared = jax.random.fold_in(rk, _SHARED_STREAM)
        cohort = sample_cohort(k_cohort, num_clients, cohort_size)
        keys = jax.vmap(lambda i: jax.random.fold_in(k_clients, i))(cohort)
        members = _take(clients, cohort)._replace(slot=jnp.arange(cohort_size), shared_key=k_shared)
        step = jax.vmap(algorithm.client_step, in_axes=(0, None, 0, _CLIENT_AXES))
        old_states = _take(client_states, cohort)
        new_states, uploads = step(keys, broadcast.payload, old_states, members)
        if participation < 1.0:  # each cohort member takes part independently with probability p
            active = jax.random.bernoulli(jax.random.fold_in(rk, _PARTICIPATION_STREAM), participation, (cohort_size,))
        else:
            active = jnp.ones((cohort_size,), bool)
        info = RoundInfo(k, cohort, active, num_clients, k_shared)
        server_state, new_broadcast, diag = algorithm.server_step(k_server, server_state, uploads, info)
        bits_down = broadcast.bits
        if hasattr(algorithm, "client_finish"):  # the server's reply to this round's cohort
            finish = jax.vmap(algorithm.client_finish, in_axes=(None, 0, _CLIENT_AXES, 0))
            new_states, reply_bits = finish(new_broadcast.payload, new_states, members, uploads.payload)
            bits_down = bits_down + reply_bits
        if participation < 1.0:
            new_states = _where_active(active, new_states, old_states)
        client_states = _put(client_states, cohort, new_states)
        record = {
            "bits_up": jnp.where(active, uploads.bits, 0),
            "bits_down": jnp.where(active, bits_down, 0),
            "active": jnp.sum(active),
            **diag,
        }
        return (server_state, client_states, new_broadcast), record

    return round_fn


def chunk_plan(start: int, end: int, size: int) -> list[tuple[int, int]]:
    """``(first round, length)`` of the scan chunks covering rounds ``start .. end - 1``.

    A length dividing the rounds exactly is preferred (between ``size // 2`` and ``size``), so one
    compilation serves every chunk; otherwise a shorter last chunk is compiled once more.
    """
    remaining = end - start
    if remaining <= 0:
        return []
    size = max(1, min(size, remaining))
    for length in range(size, max(1, size // 2) - 1, -1):
        if remaining % length == 0:
            return [(start + i * length, length) for i in range(remaining // length)]
    full = remaining // size
    plan = [(start + i * size, size) for i in range(full)]
    if remaining % size:
        plan.append((start + full * size, remaining % size))
    return plan


def _compiled_chunk(algorithm: Algorithm, num_clients: int, cohort_size: int):
    """The jitted scan over a chunk of rounds, kept on the algorithm object so that later calls of
    :func:`run_rounds` (a run continued in segments) reuse its compilation. The algorithm's
    attributes (e.g. a step size set by ``init``) are read when the chunk is first traced."""
    cache = algorithm.__dict__.setdefault("_engine_chunks", {}) if hasattr(algorithm, "__dict__") else {}
    if (num_clients, cohort_size) not in cache:
        def chunk(carry, ks, clients, base_key):
            # The client data enter as arguments, not closure constants, so XLA does not constant-fold them.
            round_fn = make_round(algorithm, clients, num_clients, cohort_size, base_key)
            return jax.lax.scan(round_fn, carry, ks)

        cache[(num_clients, cohort_size)] = jax.jit(chunk)
    return cache[(num_clients, cohort_size)]


def first_nonfinite_round(records: dict[str, np.ndarray]) -> int | None:
    """Index of the first round whose global state (``theta/<site>``, the samplers' ``_sample*`` draws)
    is not finite, or None."""
    bad = None
    for key, values in records.items():
        if key.startswith(("theta/", "_sample")) and len(values):
            row_bad = ~np.all(np.isfinite(np.asarray(values, dtype=np.float64).reshape(len(values), -1)), axis=1)
            if row_bad.any():
                i = int(np.argmax(row_bad))
                bad = i if bad is None else min(bad, i)
    return bad


class Diverged(FedbayesError):
    """Raised by :func:`run_rounds` with ``stop_on_divergence``: ``round`` is the first non-finite round,
    ``carry`` the state after the last good round and ``history`` the records of the good rounds."""

    def __init__(self, round: int, carry: Any, history: dict[str, np.ndarray]):
        super().__init__(f"non-finite global state at round {round}")
        self.round, self.carry, self.history = round, carry, history


def _host_records(rec: dict[str, Any], seconds: float) -> dict[str, np.ndarray]:
    rec = {name: np.asarray(v) for name, v in rec.items()}
    length = len(rec["bits_up"])
    rec["seconds"] = np.full(length, seconds / max(length, 1))  # the first chunk includes compilation
    for name in ("bits_up", "bits_down"):
        rec[name] = rec[name].astype(np.int64).sum(axis=1)
    return rec


def _concat(records: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.concatenate([r[name] for r in records]) for name in records[0]} if records else {}


def run_rounds(
    algorithm: Algorithm,
    problem: Problem,
    carry: tuple[PyTree, PyTree, Message],
    *,
    base_key: jax.Array,
    cohort_size: int,
    start: int = 0,
    chunk_size: int = 50,
    progress: bool | None = None,
    stop_on_divergence: bool = False,
) -> tuple[tuple[PyTree, PyTree, Message], dict[str, np.ndarray]]:
    """Run rounds ``start .. problem.num_rounds - 1`` and return the final carry and the history.

    The history maps each recorded quantity to a numpy array with one row per round; ``bits_up`` and
    ``bits_down`` are exact int64 totals per round (summed on the host so they cannot overflow), and
    ``seconds`` is the wall time of the round's chunk divided by its rounds.

    With ``stop_on_divergence``, a chunk whose global state turns non-finite ends the run: the state
    after the last good round is recomputed by replaying that chunk's good rounds from its starting
    state (round keys depend only on the seed and the round, so the replay is the same computation),
    and :class:`Diverged` is raised with it and the good rounds' history.
    """
    num_rounds = problem.num_rounds
    clients = stack_clients(problem.data)

    run_chunk = _compiled_chunk(algorithm, problem.data.num_clients, cohort_size)
    bar = Progress(num_rounds, getattr(algorithm, "name", type(algorithm).__name__), progress)
    records: list[dict[str, np.ndarray]] = []
    for first, length in chunk_plan(start, num_rounds, chunk_size):
        t0 = time.perf_counter()
        before = carry
        carry, rec = run_chunk(carry, jnp.arange(first, first + length), clients, base_key)
        rec = _host_records(rec, time.perf_counter() - t0)
        bad = first_nonfinite_round(rec) if stop_on_divergence else None
        if bad is not None:
            records.append({name: v[:bad] for name, v in rec.items()})
            good = run_chunk(before, jnp.arange(first, first + bad), clients, base_key)[0] if bad else before
            raise Diverged(first + bad, good, _concat(records))
        records.append(rec)
        bar.update(first + length)
    return carry, _concat(records)
