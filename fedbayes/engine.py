"""The federated round loop shared by every algorithm.

An algorithm is a :class:`fedbayes.protocol.FederatedRun`: pure functions over pytrees for its set-up
exchange, its rounds and its final exchange (the protocol, declared once in :mod:`fedbayes.protocol`):

    init(key, problem)                                   -> server_state, client_states, broadcast
    client_step(key, broadcast, client_state, client)    -> client_state, upload
    server_step(key, server_state, uploads, round_info)  -> server_state, broadcast, diagnostics

``init`` is the set-up exchange: the server starts without any client's data, each client starts its
state from its own data, and what the server needs of the clients (sums of statistics, curvature)
comes back as messages; :func:`staged_init` runs it vectorised, :mod:`fedbayes.flower` message by
message; the settings it resolves (:meth:`~fedbayes.protocol.FederatedRun.setup_done`) stay in the server
state, and the part every client needs (``client_settings``, sent once) reaches the client steps as
``ClientData.settings``. An algorithm whose result needs every client's data at the final estimate (FedSOUL's personal
posteriors, FedMM's observed information) ends with a final exchange (``final_exchange``), run the same
two ways (:func:`final_exchange` vectorised).

``upload`` and ``broadcast`` are :class:`Message` objects: exactly what crosses the network, already
compressed, with their exact size in bits. Nothing else passes between clients and server. A payload
may hold compressed parts as their codes (:class:`fedbayes.compress.Coded`, :class:`fedbayes.wire.Masked`);
the engine hands the receiver the decoded payload (:func:`fedbayes.wire.decode_tree`), as a network
receiver would reconstruct it from the bytes of :func:`fedbayes.wire.pack`.

One round: the server's broadcast goes to a cohort of ``cohort_size`` clients drawn uniformly
without replacement (a fixed size keeps shapes static); the cohort's client steps run under
``jax.vmap``; the server step aggregates the uploads. An algorithm with a ``participation``
probability p < 1 (FedMM's Bernoulli participation) has each cohort member take part independently
with probability p: only active clients' new states are kept, only their messages are counted, and
the server sees who answered in ``RoundInfo.active``. Each member also gets its slot in the cohort
and the round's public key (``ClientData.slot``, ``ClientData.shared_key``) for randomness the
cohort must share. An algorithm that ``replies`` gets a second half-round (``client_finish``): after the
server step, each member receives the server's reply (the new broadcast, of which it is charged
only the bits ``client_finish`` reports) and updates its state. Every upload is screened for
faults (dropped, non-finite, absurdly large: :mod:`fedbayes.faults`); a faulty member is left out of
the server step (``RoundInfo.faulty``) and its round rolled back. Rounds run in chunks, each a call of one
compiled loop whose number of rounds is an argument (:func:`_compiled_chunk`, :class:`ChunkSchedule`);
between chunks the host records the ledger and updates the progress bar.
Randomness is a pure function of ``(seed, round, client id)``, so a fit is reproducible.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import numbers
import os
import re
import sys
import threading
import time
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .data import FederatedData
from .errors import ConfigError, FedbayesError, StalledError
from .faults import ABSENT, DROPPED, KIND_NAMES, NONFINITE, OK, TOO_LARGE, FaultPolicy, Faults, screen
from .protocol import (
    FLOAT_BITS,  # noqa: F401 (re-exported: fedbayes.engine.FLOAT_BITS)
    SETTING_BITS,
    ClientData,
    FederatedRun,
    FitParts,
    Message,
    Problem,
    PyTree,
    RoundInfo,
    dense_bits,
)
from . import prng
from .wire import decode_tree

_JITTED: weakref.WeakKeyDictionary[Any, dict] = weakref.WeakKeyDictionary()

FAST_COMPILE_CLIENTS = 20_000
"""A computation a fit runs once (the set-up and final exchanges, the server's last steps) over at most this many
clients compiles for compilation speed on a CPU (:func:`fit_jit`'s ``once``): XLA's backend optimisation at level 0.
It compiles in about half the time and runs about twice as long (FedSOUL's final exchange on FedPop's model: 1.8 s
-> 1.0 s to compile, 0.25 s -> 0.50 s to run at 10 000 clients; ``benchmarks/README.md``, the start-up profile),
so beyond this many clients the longer run may cost more than the compilation saves, and it compiles as usual."""


class FitJitted:
    """``jax.jit(fn)`` as every computation of a fit is compiled: traced and lowered within
    :func:`fedbayes.prng.unrolled_hash` (the same random bits, a cheaper compilation on a CPU), optionally with
    XLA options (``compiler_options``). Calls and ``lower`` go through the context; anything else is the jitted
    function's.

    :meth:`ahead` compiles for given arguments before they exist: it traces and lowers at once, in the calling
    thread, and leaves XLA's compilation to the worker thread (:func:`compile_worker`). A later call with arguments
    of the same structure, shapes and dtypes runs that executable (waiting for it where it is not done), so a fit
    compiles what comes after its rounds while the rounds compile and run."""

    def __init__(self, fn: Callable, compiler_options: dict[str, Any] | None = None):
        self._jitted = jax.jit(fn, compiler_options=compiler_options)
        self._compiled: dict[Any, Any] = {}  # signature -> a Future of jax.stages.Compiled, then the Compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled:
            signature = _signature(args, kwargs)
            compiled = self._compiled.get(signature)
            if isinstance(compiled, Future):
                try:
                    compiled = self._compiled[signature] = compiled.result()
                except Exception:  # it failed ahead: the plain call below compiles and raises as usual
                    compiled = self._compiled[signature] = None
            if compiled is not None:
                try:
                    return compiled(*args, **kwargs)
                except (TypeError, ValueError):  # laid out otherwise than foreseen (e.g. over devices): compiled below
                    self._compiled[signature] = None
        with prng.unrolled_hash():
            return self._jitted(*args, **kwargs)

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        with prng.unrolled_hash():
            return self._jitted.lower(*args, **kwargs)

    def ahead(self, *args: Any) -> Any:
        """Trace and lower for ``args`` (arrays or ``jax.ShapeDtypeStruct``), start the compilation on a worker
        thread, and return the outputs' shapes (``jax.ShapeDtypeStruct``); None where it cannot be lowered (the
        call itself then compiles and says why). Arguments whose signature was compiled ahead before are not
        compiled again."""
        signature = _signature(args, {})
        try:
            shapes = self._jitted.eval_shape(*args)
            if signature not in self._compiled:
                self._compiled[signature] = compile_worker().submit(self.lower(*args).compile)
        except Exception:
            return None
        return shapes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)


def _signature(args: Any, kwargs: Any) -> tuple[Any, tuple]:
    """What a compiled program is specific to: the arguments' tree structure and each leaf's shape, dtype and weak
    typing (``jax.ShapeDtypeStruct`` leaves as the arrays they stand for)."""
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    avals = (x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x) for x in leaves)
    return tree, tuple((a.shape, a.dtype, a.weak_type) for a in avals)


_WORKER: list[ThreadPoolExecutor] = []

COMPILE_AHEAD_ENV = "FEDBAYES_COMPILE_AHEAD"


THREADED_COMPILE_JAX = (0, 10, 0)
"""The first JAX whose lowering is safe to run beside a compilation on another thread: one MLIR context per Python
thread (jax-ml/jax, July 2026) after the race on dialect registration fixed for jax-ml/jax#32354 (October 2025)."""


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


def compile_ahead() -> bool:
    """Whether ``fed_fit`` compiles ahead (:meth:`FitJitted.ahead`, ``run_rounds(prepare=...)``): XLA compiles a fit's
    next computation on a worker thread (:func:`compile_worker`) while the calling thread traces and lowers the one
    after it, or runs the rounds. The environment variable ``FEDBAYES_COMPILE_AHEAD`` decides where it is ``0``
    (off) or ``1`` (on); by default it is on with a JAX from :data:`THREADED_COMPILE_JAX` on, where lowering and
    compiling on two threads is supported, and off with an older one. On two CPU cores it takes 0.6-0.7 s off
    FedSOUL's first call of 3.85 s (``benchmarks/README.md``, the start-up profile); the results are the same, bit
    for bit (``tests/test_compile_ahead.py``)."""
    value = os.environ.get(COMPILE_AHEAD_ENV)
    if value in ("0", "1"):
        return value == "1"
    return _version(jax.__version__) >= THREADED_COMPILE_JAX


def compile_worker() -> ThreadPoolExecutor:
    """The thread that compiles a fit's computations ahead (:meth:`FitJitted.ahead`), one after another, while the
    calling thread traces the next ones and runs the rounds: XLA releases Python's lock while it compiles. One:
    a second worker compiling the final exchange beside the round chunk gave nothing on two cores (5.54-6.32 s
    against 5.95-6.02 s for FedSOUL's first call, 2026-11-28, ``benchmarks/README.md``), and fedbayes then never
    runs two of XLA's compilations at once."""
    if not _WORKER:
        _WORKER.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedbayes-compile"))
    return _WORKER[0]


CPU_COMPILER_OPTIONS: dict[str, Any] = {"xla_cpu_use_fusion_emitters": False}
"""XLA options every computation of a fit compiles with on a CPU (:func:`fit_jit`): XLA:CPU's elemental emitters
for fusions instead of its newer MLIR fusion emitters. The same programs compile in about half the time and run
as fast or faster (jaxlib 0.10, two cores: FedSOUL's final exchange on FedPop's model at 1 000 clients compiled in
0.45 s instead of 0.86 s; its round ran at 465 instead of 366 rounds/s at 1 000 clients and 51 instead of 49 at
10 000; FedMM's first chunk of a 5-component mixture at 1 000 clients compiled in 1.7 instead of 2.4 s for the
same 18 ms rounds; ``benchmarks/README.md``, the start-up profile). Rounds measured slower: P-ELF at 1 000
clients by about 4% (2 828 against 2 936 iterations/s on an Intel Xeon; B-ELF with natural compression both ways
and LMC the same either way). Left out where this jaxlib does not know an option (:func:`cpu_compiler_options`);
clearing this dict before a process's first fit compiles with JAX's defaults."""


@functools.cache
def cpu_compiler_options() -> dict[str, Any]:
    """:data:`CPU_COMPILER_OPTIONS` that this jaxlib accepts (each tried once on a trivial computation: an XLA that
    no longer has an option refuses it at compilation)."""
    kept = {}
    for name, value in CPU_COMPILER_OPTIONS.items():
        try:
            jax.jit(lambda x: x + 1, compiler_options={name: value}).lower(np.float32(0)).compile()
        except Exception:  # not an option of this XLA
            continue
        kept[name] = value
    return kept


def fit_jit(fn: Callable, once: int | None = None) -> FitJitted:
    """``fn`` compiled as a fit's computation (:class:`FitJitted`). On a CPU with :func:`cpu_compiler_options`.
    ``once``: the computation runs once per fit, over this many clients (0: the server's alone); up to
    :data:`FAST_COMPILE_CLIENTS` on a CPU it then also compiles for compilation speed (XLA's backend optimisation
    level 0), as a program run once spends more time compiling than running. Untested on GPUs, where it compiles
    as usual."""
    if jax.default_backend() != "cpu":
        return FitJitted(fn)
    options = dict(cpu_compiler_options())
    if once is not None and once <= FAST_COMPILE_CLIENTS:
        options["xla_backend_optimization_level"] = 0
    return FitJitted(fn, options or None)


def run_jit(run: Any, key: Any, make: Callable[[], Callable], once: int | None = None) -> FitJitted:
    """``fit_jit(make(), once)``, made once per run and ``key`` and kept with the run (weakly: it goes with it).

    ``jax.jit`` caches its traces and executables per function object, so a jitted closure built afresh
    in every call is traced and compiled afresh. Every computation of a fit that closes over the run
    (the set-up exchange, the chunk of rounds, the final exchange) is made here instead: a run is immutable
    after ``build``, so a second fit with the same built run (``fed_fit``'s cache of builds, a resumed
    or continued run) compiles nothing again. ``key`` names the computation and whatever else ``make``
    closes over (a stage, the cohort size, ...); ``once``: see :func:`fit_jit` (a run's clients are fixed, so a
    key's ``once`` is too)."""
    cache = _JITTED.setdefault(run, {})
    if key not in cache:
        cache[key] = fit_jit(make(), once)
    return cache[key]


@functools.cache
def _split_jit(num: int) -> FitJitted:
    return fit_jit(lambda key: tuple(jax.random.split(key, num)), once=0)


@functools.cache
def _fold_in_jit() -> FitJitted:
    return fit_jit(jax.random.fold_in, once=0)


def split_key(key: jax.Array, num: int = 2) -> tuple[jax.Array, ...]:
    """``jax.random.split(key, num)`` as ``num`` keys, the same bits, computed as a fit's computation
    (:func:`fit_jit`): outside ``jit`` JAX would compile the hash as a loop with its default options, 50 ms of a
    fit's first call each time (``benchmarks/README.md``, the start-up profile); here once per process."""
    return _split_jit(num)(key)


def fold_in_key(key: jax.Array, data: int) -> jax.Array:
    """``jax.random.fold_in(key, data)``, the same bits, compiled as :func:`split_key` is."""
    return _fold_in_jit()(key, np.uint32(data))


def setup_keys(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(server key, clients' key)`` of the set-up: client ``i`` at stage ``s`` uses
    :func:`setup_client_key` (computable by the client alone)."""
    k_server, k_clients = split_key(key)
    return k_server, k_clients


def setup_client_key(k_clients: jax.Array, index: jax.typing.ArrayLike, stage: int) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(k_clients, index), stage)


def staged_setup(
    run: FederatedRun, key: jax.Array, num_clients: int, exchange: Callable[[int, jax.Array, PyTree], PyTree]
) -> tuple[PyTree, Message, tuple[int, int]]:
    """The server's side of the set-up exchange: ``exchange(stage, clients_key, payload)`` delivers
    the payload to every client and returns their uploads stacked in client order (vectorised in
    :func:`staged_init`, messages on a network). Returns ``(server_state, first broadcast, (up, down))``
    with the state's settings resolved (:meth:`~fedbayes.protocol.FederatedRun.setup_done`) and the
    set-up's bits: every client's uploads, and the payloads and client settings sent to every client,
    as a network carries them."""
    k_server, k_clients = setup_keys(key)
    state, payload = run_jit(run, "setup_server", lambda: run.setup_server, once=0)(k_server)
    up, down, uploads = 0, 0, None
    for stage in range(run.setup_stages):
        uploads = exchange(stage, k_clients, payload)
        down += num_clients * dense_bits(payload)
        up += dense_bits(uploads)

        def make_step(s: int = stage) -> Callable:
            return lambda k, st, u: run.setup_server_step(s, k, st, u)

        server_step = run_jit(run, ("setup_server_step", stage), make_step, once=0)
        state, payload = server_step(fold_in_key(k_server, stage + 1), state, uploads)
    state = run.setup_done(state, uploads)
    down += num_clients * setting_bits(run.client_settings(state))
    return state, payload, (int(up), int(down))


def setting_bits(settings: PyTree) -> int:
    """Bits of the client settings sent once after set-up: :data:`SETTING_BITS` per element."""
    return dense_bits(settings, SETTING_BITS)


def with_init_bits(parts: FitParts | dict[str, Any], setup_bits: tuple[int, int]) -> FitParts:
    """A run's :class:`~fedbayes.protocol.FitParts` (a plain dict is checked field by field) with ``init_bits``:
    the set-up exchange's bits plus any the run spent before it (``start_bits``, e.g. a search for the
    samplers' start)."""
    parts = FitParts.of(parts)
    start = parts.start_bits
    parts.init_bits = (int(setup_bits[0]) + int(start[0]), int(setup_bits[1]) + int(start[1]))
    return parts


def client_key(key: jax.Array, index: jax.Array, num_clients: int) -> jax.Array:
    """Client ``index``'s key of ``num_clients`` split from ``key`` (``jax.random.split(key, n)[index]``),
    computable by that client alone."""
    return jax.random.split(key, num_clients)[index]


def final_bits(payload: PyTree, uploads: PyTree, num_clients: int) -> tuple[int, int]:
    """``(up, down)`` bits of a final exchange: the uploads that arrived (stacked), the payload to every
    one of ``num_clients`` clients."""
    return dense_bits(uploads), num_clients * dense_bits(payload)


def final_exchange(
    run: Any, key: jax.Array, server_state: PyTree, client_states: PyTree, clients: ClientData
) -> FitParts:
    """The final exchange (:class:`fedbayes.protocol.FederatedRun`) with every client at once (vectorised), local parts
    collected;
    the parts carry ``final_bits``."""
    payload = _final_message(run)(key, server_state)
    clients = clients._replace(settings=run.client_settings(server_state))
    locals_, uploads = _final_clients(run, clients.index.shape[0])(key, payload, client_states, clients)
    parts = run.final_server(key, server_state, payload, uploads, locals_)
    parts["final_bits"] = final_bits(payload, uploads, clients.index.shape[0])
    return parts


def final_exchange_ahead(
    run: Any, key: jax.Array, carry: tuple[PyTree, PyTree, Message], problem: Problem
) -> tuple[PyTree, PyTree] | None:
    """Compile :func:`final_exchange`'s computations ahead (:meth:`FitJitted.ahead`) for server and client
    states shaped like ``carry``'s (those of any round: the rounds keep their shapes), and return the shapes of
    the payload and of the clients' uploads (``jax.ShapeDtypeStruct``; None where it could not be lowered)
    for the server's own computations after it."""
    server_state, client_states, _ = carry
    payload = _final_message(run).ahead(key, server_state)
    if payload is None:
        return None
    clients = stack_clients(problem.data)._replace(settings=run.client_settings(server_state))
    out = _final_clients(run, clients.index.shape[0]).ahead(key, payload, client_states, clients)
    return None if out is None else (payload, out[1])


def _final_message(run: Any) -> FitJitted:
    return run_jit(run, "final_message", lambda: run.final_message, once=0)


def _final_clients(run: Any, num_clients: int) -> FitJitted:
    """The final exchange's client steps, every client at once (over the devices where they are laid out) or in
    blocks of :data:`FINAL_BLOCK`."""
    if num_clients <= FINAL_BLOCK or _MESH.get() is not None:
        make = lambda: over_clients(run.final_client, common_fields(run), (None, None, 0, _CLIENT_AXES), 2)  # noqa: E731
        return run_jit(run, "final_clients", make, num_clients)
    return run_jit(run, "final_client_blocks", lambda: _in_blocks(run.final_client, common_fields(run)), num_clients)


FINAL_BLOCK = 2048
"""Beyond this many clients the final exchange's client computations run in blocks of this many (vmapped
within a block, one block after another): their intermediates (FedSOUL's Louis terms hold a few d x d
matrices per client and draw) then take the memory of one block, not of the whole federation."""


def _in_blocks(final_client: Callable, common: tuple[str, ...] = ()) -> Callable:
    def blocks(key, payload, client_states, clients):
        settings = clients.settings  # the same for every client: not mapped over
        states, shared = _split_common(client_states, common)  # so are the common fields of the states

        def one(args):
            state, client = args
            state = state._replace(**shared) if shared else state
            return final_client(key, payload, state, client._replace(settings=settings))

        return jax.lax.map(one, (states, clients._replace(settings=None)), batch_size=FINAL_BLOCK)

    return blocks


def staged_init(
    run: FederatedRun, key: jax.Array, problem: Problem
) -> tuple[tuple[PyTree, PyTree, Message], tuple[int, int]]:
    """The set-up exchange with every client at once (vectorised): ``((server_state, client_states, first
    broadcast), (bits up, bits down))``."""
    clients = stack_clients(problem.data)
    box: dict[str, PyTree] = {"states": None}

    def exchange(stage: int, k_clients: jax.Array, payload: PyTree) -> PyTree:
        def make():
            def step(k_clients, payload, states, clients):
                one = lambda p, c, cl: run.setup_client(stage, setup_client_key(k_clients, cl.index, stage), p, c, cl)  # noqa: E731
                return over_clients(one, common_fields(run), (None, 0, 0), state_arg=1, state_out=0)(
                    payload, states, clients
                )

            return step

        box["states"], uploads = run_jit(run, ("setup_clients", stage), make, problem.data.num_clients)(
            k_clients, payload, box["states"], clients
        )
        return uploads

    state, broadcast, bits = staged_setup(run, key, problem.data.num_clients, exchange)
    return (state, box["states"], broadcast), bits


def stack_clients(data: FederatedData) -> ClientData:
    """All clients' padded data, stacked on a leading client axis (laid over the devices of
    :func:`sharded_clients` where it is active)."""
    return shard_clients(
        ClientData(dict(data.padded), data.mask, jnp.asarray(data.sizes), jnp.asarray(np.arange(data.num_clients)))
    )


# ------------------------------------------------------------------------------ clients in buckets of size

MAX_BUCKETS = 4
"""At most this many size buckets by default (:func:`size_buckets`): each is a vmap of its own in the round."""

BUCKET_ROW_ROUNDS = 3_000_000
"""What one more size bucket costs, in padded rows times rounds (:func:`size_buckets`): each bucket is a trace and
a compilation of the client step of its own, 0.4-0.6 s on a 2-core CPU for FedMM's round on a 5-component,
10-dimensional Gaussian mixture, where a padded row costs 0.18-0.22 microseconds a round (2026-11-29, after fits
began compiling with XLA's elemental fusion emitters, :data:`CPU_COMPILER_OPTIONS`; ``benchmarks/README.md``,
FedMM). Measured again the same day after the mixture's second moments became one product: 0.25-0.67 s a bucket,
0.09-0.13 microseconds a padded row at 100 clients and 0.17-0.49 at 1 000."""

_BUCKETS: contextvars.ContextVar[str | int] = contextvars.ContextVar("fedbayes_size_buckets", default="auto")


def check_size_buckets(size_buckets: Any) -> None:
    """A :class:`fedbayes.ConfigError` unless ``size_buckets`` is ``"auto"`` or a count of at least 1."""
    if size_buckets == "auto" and isinstance(size_buckets, str):
        return
    if isinstance(size_buckets, numbers.Integral) and not isinstance(size_buckets, bool) and int(size_buckets) >= 1:
        return
    raise ConfigError(f"size_buckets must be 'auto' or a number of buckets >= 1 (1: none), got {size_buckets!r}")


@contextlib.contextmanager
def bucketed_clients(size_buckets: str | int = "auto"):
    """Within this block a fit's rounds group their clients in size buckets as ``size_buckets`` says
    (:func:`round_buckets`): ``"auto"`` or at most that many (1: none)."""
    check_size_buckets(size_buckets)
    token = _BUCKETS.set(size_buckets if isinstance(size_buckets, str) else int(size_buckets))
    try:
        yield
    finally:
        _BUCKETS.reset(token)


def size_buckets(sizes: Any, limit: int = MAX_BUCKETS, rounds: int | None = None) -> list[np.ndarray] | None:
    """The clients grouped by size, each group to be padded to its own largest client only; None where one
    group (every client padded to the largest) is chosen.

    A round's client work is about proportional to its padded rows, ``rows_k = sum_b |b| max_{i in b} N_i``
    (one group: C max_i N_i). Clients of 50 to 150 rows padded to 150 compute on 1.5 times their rows; in
    four groups of similar size, on about 1.12 times. For each count k <= ``limit`` the groups are the
    contiguous runs of the clients sorted by size that minimise rows_k (dynamic programming over the distinct
    sizes, at most 256 candidate boundaries). Without ``rounds`` the best k = ``limit`` groups are taken; with
    it, the k that minimises ``rows_k * rounds + (k - 1) * BUCKET_ROW_ROUNDS``: a group saves its rows in
    every round but costs a compilation once. Each group lists its clients' indices in increasing order."""
    sizes = np.asarray(sizes, np.int64)
    if sizes.size < 2 or limit < 2:
        return None
    values, counts = np.unique(sizes, return_counts=True)
    cum = np.concatenate([[0], np.cumsum(counts)])
    if len(values) > 256:  # candidate boundaries: the sizes at 256 quantiles (the largest always one)
        ends = np.searchsorted(cum[1:], np.linspace(0, cum[-1], 257)[1:])
        picks = np.unique(np.concatenate([ends, [len(values) - 1]]))
        values, cum = values[picks], np.concatenate([[0], cum[1:][picks]])
    u = len(values)
    # best[k, j]: the least padded rows of the clients of the j smallest candidate sizes in k groups
    inf = np.iinfo(np.int64).max // 4
    best = np.full((limit + 1, u + 1), inf, np.int64)
    back = np.zeros((limit + 1, u + 1), np.int64)
    best[0, 0] = 0
    for k in range(1, limit + 1):
        for j in range(1, u + 1):
            cost = best[k - 1, :j] + (cum[j] - cum[:j]) * values[j - 1]
            at = int(np.argmin(cost))
            best[k, j], back[k, j] = cost[at], at
    rows = best[1:, u].astype(float)  # rows_k for k = 1 .. limit (inf where fewer distinct sizes than k)
    score = rows if rounds is None else rows * rounds + np.arange(limit) * BUCKET_ROW_ROUNDS
    k = 1 + int(np.argmin(score))
    if k == 1:
        return None
    bounds, j = [], u
    for kk in range(k, 0, -1):
        bounds.append(values[j - 1])
        j = int(back[kk, j])
    group = np.searchsorted(np.asarray(sorted(bounds)), sizes)  # the first group whose bound holds the client
    return [np.flatnonzero(group == g) for g in range(k) if np.any(group == g)]


class ClientBuckets(NamedTuple):
    """The clients in size buckets (:func:`bucket_clients`): ``parts``, each bucket's clients stacked as
    :func:`stack_clients` stacks all, and ``order``, the position of each client in the buckets' clients
    one after the other (what puts their results back in client order)."""

    parts: tuple[ClientData, ...]
    order: jax.Array


def bucket_clients(data: FederatedData, groups: list[np.ndarray]) -> ClientBuckets:
    """The clients of each group (:func:`size_buckets`) stacked as :func:`stack_clients` does, with rows
    padded to the group's largest client only (its first rows of the padded data: rows past a client's size
    repeat its last row, here as there)."""
    sizes = np.asarray(data.sizes)
    parts = []
    for idx in groups:
        rows = int(sizes[idx].max())
        take = jnp.asarray(idx)
        parts.append(
            ClientData(
                {k: v[take, :rows] for k, v in data.padded.items()},
                data.mask[take, :rows],
                jnp.asarray(sizes[idx]),
                take,
            )
        )
    return ClientBuckets(tuple(parts), jnp.asarray(np.argsort(np.concatenate(groups))))


def round_buckets(algorithm: FederatedRun, problem: Problem, cohort_size: int) -> ClientBuckets | None:
    """The size buckets a fit's rounds run their client steps in (:func:`bucket_clients`), as
    :func:`bucketed_clients` asks (by default ``"auto"``: :func:`size_buckets` weighing the rows saved over the
    fit's rounds against the compilations), or None. Only for an algorithm whose client step does not depend on
    its padding (``FederatedRun.pads_freely``), with every client in every round's cohort (a drawn cohort's
    sizes change each round) and the clients on one device."""
    data, setting = problem.data, _BUCKETS.get()
    if not algorithm.pads_freely or cohort_size != data.num_clients or _MESH.get() is not None:
        return None
    if setting == "auto":
        groups = size_buckets(data.sizes, MAX_BUCKETS, problem.num_rounds)
    else:
        groups = size_buckets(data.sizes, int(setting))
    return None if groups is None else bucket_clients(data, groups)


# ------------------------------------------------------------------------------ clients over devices

CLIENT_AXIS = "clients"
_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("fedbayes_client_mesh", default=None)


def resolve_devices(devices: Any, num_clients: int) -> list[Any]:
    """The devices over which a fit lays its clients: ``devices`` as given (a number: the first that many of
    ``jax.devices()``; a sequence of devices), or by default every device of the default backend.

    The client axis is split in equal parts, so the number of devices must divide the number of
    clients: a given count that does not is refused; by default the largest count of devices that
    divides it is used, with a warning when that leaves devices idle."""
    available = jax.devices()
    if devices is None:
        count = _most_devices(num_clients, len(available))
        if count < len(available):
            warnings.warn(
                f"{num_clients} clients cannot be split equally over the {len(available)} devices; the fit "
                f"uses {count} of them (pass devices= to choose, or a number of clients that "
                f"{len(available)} divides)",
                UserWarning,
                stacklevel=3,
            )
        return available[:count]
    if isinstance(devices, numbers.Integral) and not isinstance(devices, bool):
        if not 1 <= int(devices) <= len(available):
            raise ConfigError(
                f"devices={devices}: this process has {len(available)} device(s) "
                f"({available[0].platform}); give a number from 1 to {len(available)}"
            )
        chosen = available[: int(devices)]
    else:
        try:
            chosen = list(devices)
        except TypeError:
            raise ConfigError(
                f"devices must be None, a number of devices or a sequence of jax devices, got {devices!r}"
            ) from None
        if not chosen or not all(isinstance(d, jax.Device) for d in chosen) or len(set(chosen)) != len(chosen):
            raise ConfigError(
                f"devices must be a non-empty sequence of distinct jax devices (jax.devices()), got {devices!r}"
            )
    if num_clients % len(chosen):
        raise ConfigError(
            f"{num_clients} clients cannot be split equally over {len(chosen)} devices: give a number "
            f"of devices that divides the number of clients (here at most "
            f"{_most_devices(num_clients, len(chosen))})"
        )
    return chosen


def _most_devices(num_clients: int, available: int) -> int:
    """The largest count of devices, at most ``available``, over which ``num_clients`` split equally."""
    return max(n for n in range(1, available + 1) if num_clients % n == 0)


MATMUL_PRECISIONS = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")
"""The values of ``matmul_precision`` (``fed_fit``, ``fb.flower.FlowerSpec``), as ``jax.default_matmul_precision``
takes them, besides None."""


@contextlib.contextmanager
def matmul_precision(precision: str | None):
    """Within this block JAX traces matrix products (``dot_general``, so ``@``, ``einsum``, convolutions) at
    ``precision`` (``jax.default_matmul_precision``); None leaves JAX's own setting.

    The fits' default is ``"highest"``: float32 products in full float32. On NVIDIA GPUs since Ampere JAX's
    own default computes float32 products in TensorFloat-32 (about 3 significant digits); a CPU always
    computes them in full, so there the setting changes nothing. Sums of outer products (FedMM's
    sufficient statistics, Louis' information, the samplers' curvature) lose positive-definiteness in
    TF32: FedMM on a 5-component, 10-dimensional Gaussian mixture diverged after 191 rounds on an H200 with
    JAX's default and ran like the CPU with ``"highest"`` (benchmarks/README.md). ``"default"`` trades that
    accuracy for the speed of a network's large products on a GPU."""
    if precision is None:
        yield
        return
    with jax.default_matmul_precision(precision):
        yield


def check_matmul_precision(precision: Any) -> None:
    """A :class:`fedbayes.ConfigError` unless ``precision`` is None or one of :data:`MATMUL_PRECISIONS`."""
    if precision is not None and precision not in MATMUL_PRECISIONS:
        raise ConfigError(f"matmul_precision must be None or one of {MATMUL_PRECISIONS}; got {precision!r}")


@contextlib.contextmanager
def sharded_clients(devices: Sequence[Any] | None):
    """Within this block every client axis of a fit (the stacked data, the client states) is laid over
    ``devices`` as a ``jax.sharding.Mesh`` with one axis, ``"clients"``, and the server's state is
    replicated on each. XLA then runs each device's clients where their data are and sums the
    uploads across devices, so a round is the single-device round up to the order of those sums.
    With one device (or None) nothing changes."""
    mesh = Mesh(np.asarray(devices), (CLIENT_AXIS,)) if devices is not None and len(devices) > 1 else None
    token = _MESH.set(mesh)
    try:
        yield mesh
    finally:
        _MESH.reset(token)


def shard_clients(tree: PyTree) -> PyTree:
    """``tree``'s arrays laid over the active mesh along their leading (client) axis; unchanged without one."""
    mesh = _MESH.get()
    if mesh is None:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec(CLIENT_AXIS)))


def replicate(tree: PyTree) -> PyTree:
    """``tree``'s arrays copied to every device of the active mesh; unchanged without one."""
    mesh = _MESH.get()
    if mesh is None:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


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


# ------------------------------------------------------------------------------ state common to every client


def common_fields(run: Any) -> tuple[str, ...]:
    """The fields of ``run``'s client state (a NamedTuple) that every client holds alike
    (``FederatedRun.common_client_fields``): stored once, without a client axis."""
    return tuple(getattr(run, "common_client_fields", ()))


def _split_common(states: Any, common: tuple[str, ...]) -> tuple[Any, dict[str, Any]]:
    """(``states`` with the ``common`` fields emptied, those fields' values)."""
    if not common or states is None:
        return states, {}
    return states._replace(**dict.fromkeys(common)), {f: getattr(states, f) for f in common}


def over_clients(
    fn: Callable,
    common: tuple[str, ...],
    in_axes: Any,
    state_arg: int,
    state_out: int | str | None = None,
    axis_size: int | None = None,
) -> Callable:
    """``jax.vmap(fn, in_axes)`` over a cohort's clients, where argument ``state_arg`` holds their client states
    and the fields ``common`` of those (:func:`common_fields`) carry no client axis: they enter every client's
    call as they are. Where ``fn`` returns new states (``state_out``: their position in its tuple result, or
    ``"all"`` where the result is the states), their ``common`` fields come out once: vmap's ``out_axes=None``,
    so JAX refuses a new value that depends on the client (a field wrongly declared common) when it traces."""
    if not common:
        return jax.vmap(fn, in_axes=in_axes, axis_size=axis_size)

    def mapped(*args: Any) -> Any:
        args_ = list(args)
        args_[state_arg], shared = _split_common(args_[state_arg], common)

        def one(*a: Any) -> Any:
            a_ = list(a)
            if shared:
                a_[state_arg] = a_[state_arg]._replace(**shared)
            out = fn(*a_)
            if state_out is None:
                return out, ()
            new = out if state_out == "all" else out[state_out]
            new, same = _split_common(new, common)
            if state_out == "all":
                return new, same
            return tuple(new if i == state_out else o for i, o in enumerate(out)), same

        out, same = jax.vmap(one, in_axes=in_axes, out_axes=(0, None), axis_size=axis_size)(*args_)
        if state_out is None:
            return out
        if state_out == "all":
            return out._replace(**same)
        return tuple(o._replace(**same) if i == state_out else o for i, o in enumerate(out))

    return mapped


def _take_clients(states: PyTree, idx: jax.Array, common: tuple[str, ...]) -> PyTree:
    """The client states of clients ``idx`` (the common fields as they are)."""
    rest, shared = _split_common(states, common)
    taken = _take(rest, idx)
    return taken._replace(**shared) if shared else taken


_PARTICIPATION_STREAM = 0x5EED  # a key stream of its own: the other round keys are unchanged
_SHARED_STREAM = 0x5A4ED  # the round's public key (cohort-wide randomness), also a stream of its own
_FAULT_STREAM = 0xFA017  # simulated faults (fb.Faults): a stream of its own, so fault-free keys are unchanged
# vmap axes in ClientData's structure (axis numbers, not arrays): the shared key and settings are the cohort's
_CLIENT_AXES = ClientData._make((0, 0, 0, 0, 0, None, None))


def _where_active(active: jax.Array, new: PyTree, old: PyTree, whole: tuple[str, ...] = ()) -> PyTree:
    """Commit the new client states of active clients only (inactive ones keep theirs); the fields ``whole`` (of a
    NamedTuple state) taken from ``new`` whole."""
    if whole:
        rest, taken = _split_common(new, whole)
        return _where_active(active, rest, _split_common(old, whole)[0])._replace(**taken)
    return jax.tree_util.tree_map(
        lambda n, o: jnp.where(jnp.reshape(active, (-1,) + (1,) * (n.ndim - 1)), n, o), new, old
    )


def _roll_back(algorithm: FederatedRun, active: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    """The cohort's states after a round: the new where ``active``, the old elsewhere, except the fields the
    algorithm keeps from a faulty round (``kept_on_fault``) and those common to every client
    (``common_client_fields``: a faulty member's resync restores the same value), taken from the new states
    whole."""
    return _where_active(active, new, old, tuple(algorithm.kept_on_fault) + common_fields(algorithm))


def _in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (its stderr is no terminal, but it redraws a line on ``\\r``)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
    except Exception:
        return False
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class Progress:
    """Progress on stderr, in the form that suits where it goes: the fit's phases, then its rounds.

    ``enabled=None`` (default): shown on a terminal and in a Jupyter notebook, as one live line redrawn
    in place (``\\r``). ``True`` elsewhere (a log file, a CI job, a pipe): one line per phase and per chunk
    of rounds, each ending in a newline, so a log reads as lines rather than a wall of carriage returns.
    ``False``: none.

    :meth:`phase` names what the fit is doing before and after its rounds (analysing the model, compiling
    and running the set-up exchange, the final exchange, the convergence checks) with the time since the
    fit began; :meth:`update` reports the rounds. The first chunk of rounds includes the compilation of
    the round, so the rate and the time left come from the chunks after it (the first chunk's line says
    how long it took instead); they are shown from the second chunk on.

    >>> bar = Progress(100, "GD", enabled=False)
    >>> bar.phase("analysing the model"); bar.update(10); bar.update(100); bar.finish()
    """

    def __init__(self, total: int, label: str, enabled: bool | None):
        self.total, self.label = total, label
        live = sys.stderr.isatty() or _in_notebook()
        self.enabled = live if enabled is None else bool(enabled)
        self.live = live
        self.start = time.perf_counter()
        self._width = 0  # the longest live line so far (a shorter one is padded over it)
        self._first: tuple[int, float] | None = None  # (rounds, time) at the end of the first chunk seen
        self._done = False

    def _write(self, line: str, end: bool = False) -> None:
        if not self.enabled:
            return
        line = f"[fedbayes] {self.label}: {line}"
        if self.live:
            sys.stderr.write("\r" + line.ljust(self._width) + ("\n" if end else ""))
            self._width = 0 if end else max(self._width, len(line))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def phase(self, what: str) -> None:
        """Report that the fit now does ``what`` (e.g. ``"compiling the rounds"``)."""
        self._write(f"{what} ({time.perf_counter() - self.start:.1f} s)")

    def update(self, done: int) -> None:
        """Report that ``done`` of the ``total`` rounds have run."""
        now = time.perf_counter()
        head = f"round {done}/{self.total} ({100 * done / max(self.total, 1):.0f}%)"
        if self._first is None:  # this chunk compiled the round program: no rate from it
            self._first = (done, now)
            tail = f"first chunk (compilation included) in {now - self.start:.1f} s"
        else:
            rounds, then = self._first
            rate = (done - rounds) / (now - then) if now > then else float("nan")
            eta = (self.total - done) / rate if rate > 0 else float("nan")
            tail = f"{rate:.1f} rounds/s, ~{eta:.0f} s left"
        self._write(f"{head}, {tail}")

    def close(self) -> None:
        """End a live line left open (a fit that stopped with an error), so the traceback starts on its own line."""
        if self.enabled and self.live and self._width:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._width = 0

    def finish(self) -> None:
        """Report the end of the fit and its wall time (a live line ends in a newline)."""
        if not self._done:
            self._done = True
            self._write(f"done in {time.perf_counter() - self.start:.1f} s", end=True)


def _round_keys(base_key: jax.Array, k: jax.Array) -> tuple[jax.Array, ...]:
    """``(round key, cohort key, client key, server key, shared key)`` of round ``k``."""
    rk = jax.random.fold_in(base_key, k)
    k_cohort, k_clients, k_server = jax.random.split(rk, 3)
    return rk, k_cohort, k_clients, k_server, jax.random.fold_in(rk, _SHARED_STREAM)


_SERVER_HALVES: contextvars.ContextVar[tuple[Any, Any] | None] = contextvars.ContextVar(
    "fedbayes_server_halves", default=None
)


def split_server_key(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``jax.random.split(key)`` as two keys: the same bits, taken from the chunk's batched hash where ``key`` is
    the server key of the round being traced (:func:`make_round` hashes every round's split at once, in
    :func:`chunk_plans`), computed here otherwise (the set-up, Flower's server, a derived key).

    Why: on a CPU every call of JAX's key hash lowers to a loop of its own of about 75 small operations, and a
    sampler's round of a hundred clients is made of such operations; a server step that splits its key (the
    Langevin move's noise and the downlink's compression) would run one more such loop every round."""
    known = _SERVER_HALVES.get()
    halves = known[1] if known is not None and known[0] is key else jax.random.split(key)
    return halves[0], halves[1]


def _plan_from_keys(round_keys: tuple, num_clients: int, cohort_size: int, participation: float) -> tuple:
    """:func:`round_plan` from the round's keys (:func:`_round_keys`)."""
    rk, k_cohort, k_clients, k_server, k_shared = round_keys
    cohort = sample_cohort(k_cohort, num_clients, cohort_size)
    keys = jax.vmap(lambda i: jax.random.fold_in(k_clients, i))(cohort)
    if participation < 1.0:  # each cohort member takes part independently with probability p
        expected = jax.random.bernoulli(jax.random.fold_in(rk, _PARTICIPATION_STREAM), participation, (cohort_size,))
    else:
        expected = jnp.ones((cohort_size,), bool)
    return rk, cohort, keys, k_server, k_shared, expected


def round_plan(
    base_key: jax.Array,
    k: jax.Array,
    num_clients: int,
    cohort_size: int,
    participation: float = 1.0,
):
    """The public randomness of round ``k``: ``(round key, cohort, client keys, server key, shared key,
    expected)``; ``expected`` marks the cohort members that take part (all, unless ``participation`` < 1).
    It is a function of the seed and the round alone, so a chunk of rounds hashes the round keys of all
    its rounds at once (:func:`chunk_plans`)."""
    return _plan_from_keys(_round_keys(base_key, k), num_clients, cohort_size, participation)


def chunk_plans(base_key: jax.Array, ks: jax.Array) -> tuple[jax.Array, ...]:
    """The round keys of :func:`round_plan` (round, cohort, client, server and shared key) of every round in
    ``ks``, stacked; each round derives its cohort and client keys from them.

    Why: on a CPU every call of JAX's key hash (threefry) lowers to a loop of its own, a few microseconds
    each whatever its size, and a round of a hundred clients lasts tens of microseconds. Hashed here, a
    chunk's round keys cost one batched call per kind instead of one per kind and round, and so does the
    split of each round's server key (the last entry: :func:`split_server_key`). The keys are the same bits
    either way (the hash is elementwise), so the rounds do not change. The client keys stay
    in the round: a chunk of them would be rounds x cohort keys, computed even for an algorithm that does
    not use them (XLA drops unused work inside a round, not a loop's unused inputs)."""

    def keys(k):
        round_keys = _round_keys(base_key, k)
        return round_keys + (jax.random.split(round_keys[3]),)  # the server key's halves (split_server_key)

    return jax.vmap(keys)(ks)


def server_half(
    algorithm: FederatedRun,
    server_state: PyTree,
    payload: PyTree,
    upload_bits: jax.Array,
    broadcast_bits: jax.Array,
    expected: jax.Array,
    received: jax.Array,
    policy: FaultPolicy | None,
    k: jax.Array,
    cohort: jax.Array,
    num_clients: int,
    k_server: jax.Array,
    k_shared: jax.Array,
):
    """The server's half of a round, from the decoded uploads (stacked over the cohort; rows not
    ``received`` are ignored): screen, zero the faulty rows, ``server_step``. Returns
    ``(server_state, new_broadcast, zeroed payload, record)``; the record holds the round's ledger per
    cohort slot, each slot's fault kind (``_fault_kind``: ``ABSENT`` for a member not expected this round;
    :func:`host_records` counts them), and ``_active`` / ``_faulty`` for the caller to pop."""
    policy = FaultPolicy() if policy is None else policy
    kind = jnp.where(expected & ~received, DROPPED, screen(payload, received, policy))
    kind = jnp.where(expected, kind, ABSENT)
    faulty = kind > OK
    active = kind == OK
    payload = jax.tree_util.tree_map(
        lambda p: jnp.where(jnp.reshape(active, (-1,) + (1,) * (p.ndim - 1)), p, jnp.zeros_like(p)), payload
    )
    info = RoundInfo(k, cohort, active, num_clients, k_shared, faulty)
    server_state, new_broadcast, diag = algorithm.server_step(
        k_server, server_state, Message(payload, upload_bits), info
    )
    sent = expected & (kind != DROPPED)  # rejected uploads crossed the network all the same
    record = {  # the fault counts and the rejected bits follow from the kinds, on the host (host_records)
        "bits_up": jnp.where(sent, upload_bits, 0),
        "bits_down": jnp.where(expected, broadcast_bits, 0),
        "_fault_kind": kind.astype(jnp.int8),
        **diag,
        "_active": active,
        "_faulty": faulty,
    }
    return server_state, new_broadcast, payload, record


def make_round(
    algorithm: FederatedRun,
    clients: ClientData,
    num_clients: int,
    cohort_size: int,
    base_key: jax.Array,
    faults: Faults | None = None,
    policy: FaultPolicy | None = None,
    buckets: ClientBuckets | None = None,
):
    """The pure function of one round: ``(carry, k) -> (carry, record)``, where ``k`` is the round's number
    or ``(number, keys)`` with the round's keys from :func:`chunk_plans` (the same round, its keys hashed
    ahead).

    ``buckets`` (:func:`round_buckets`; every client in the cohort): the client steps run one vmap per
    bucket of clients of similar size, on rows padded to the bucket's largest client, and their states
    and uploads are put back in client order; the same round up to the order of the padded rows' sums.

    Every upload is screened (:func:`fedbayes.faults.screen`); ``faults`` injects simulated ones
    first. A faulty member's upload is zeroed before the server step, its client state is rolled back
    (and, for an algorithm that ``resyncs``, re-sent its copy of server state, the
    bits counted on the downlink) and it gets no ``client_finish`` reply.
    """

    participation = float(algorithm.participation)
    common = common_fields(algorithm)
    if common and (cohort_size != num_clients or participation < 1.0):
        raise ConfigError(
            f"{algorithm.name} keeps client state common to every client ({', '.join(common)}): it needs every "
            "client in every round (no cohort drawn, no Bernoulli participation)"
        )

    def round_fn(carry, step):
        server_state, client_states, broadcast = carry
        opening = server_state  # the state that opened the round (a faulty client's resync is built from it)
        k, round_keys = step if isinstance(step, tuple) else (step, _round_keys(base_key, step))
        halves = round_keys[5] if len(round_keys) > 5 else None
        rk, cohort, keys, k_server, k_shared, expected = _plan_from_keys(
            round_keys[:5], num_clients, cohort_size, participation
        )
        members = _take(clients, cohort)._replace(
            slot=jnp.arange(cohort_size), shared_key=k_shared, settings=algorithm.client_settings(server_state)
        )
        step = over_clients(algorithm.client_step, common, (0, None, 0, _CLIENT_AXES), state_arg=2, state_out=0)
        full = cohort_size == num_clients  # every client, in order: no gather or scatter of the client states
        old_states = client_states if full else _take(client_states, cohort)
        if buckets is None:
            new_states, uploads = step(keys, decode_tree(broadcast.payload), old_states, members)
        else:
            new_states, uploads = _bucketed_step(
                step, buckets, keys, decode_tree(broadcast.payload), old_states, members, common
            )
        payload = decode_tree(uploads.payload)  # what the server reconstructs from the messages
        injected = jnp.zeros((cohort_size,), jnp.int32)
        if faults is not None:
            injected = faults.draw(jax.random.fold_in(rk, _FAULT_STREAM), cohort_size)
            payload = faults.corrupt(payload, injected)
        received = expected & (injected != DROPPED)
        token = _SERVER_HALVES.set(None if halves is None else (k_server, halves))
        try:
            server_state, new_broadcast, payload, record = server_half(
                algorithm,
                server_state,
                payload,
                uploads.bits,
                broadcast.bits,
                expected,
                received,
                policy,
                k,
                cohort,
                num_clients,
                k_server,
                k_shared,
            )
        finally:
            _SERVER_HALVES.reset(token)
        active, faulty = record.pop("_active"), record.pop("_faulty")
        replied = resent = jnp.zeros((cohort_size,), jnp.int32)
        if algorithm.replies:  # the server's reply to this round's answering members
            finish = over_clients(algorithm.client_finish, common, (None, 0, _CLIENT_AXES, 0), state_arg=1, state_out=0)
            new_states, reply_bits = finish(decode_tree(new_broadcast.payload), new_states, members, payload)
            replied = jnp.where(active, reply_bits, 0)
        kept = _roll_back(algorithm, active, new_states, old_states)
        if algorithm.resyncs:  # a faulty member's copy of server state is re-sent
            again = algorithm.resync_message(opening)
            resynced = over_clients(algorithm.resync, common, (0, None), 0, "all", axis_size=cohort_size)(
                old_states, decode_tree(again.payload)
            )  # (a common field's resync restores what the members in step hold: theirs is kept)
            kept = _where_active(~faulty, kept, resynced, common)
            resent = jnp.where(faulty, again.bits, 0)
        client_states = kept if full else _put(client_states, cohort, kept)
        record["bits_down"] = downlink_bits(broadcast.bits, expected, replied, resent)
        return (server_state, client_states, new_broadcast), record

    return round_fn


def _bucketed_step(
    step: Callable, buckets: ClientBuckets, keys, payload, states, members: ClientData, common: tuple[str, ...] = ()
):
    """``step`` (the vmapped client step) on every client, one bucket at a time (:func:`round_buckets`): each
    bucket's clients with their own keys, states and rows, then the results in client order (the ``common``
    fields of the new states, the same from every bucket, from the first)."""
    outs: list[Any] = []
    shared: dict[str, Any] = {}
    for part in buckets.parts:
        idx = part.index
        own = part._replace(slot=idx, shared_key=members.shared_key, settings=members.settings)
        new, upload = step(keys[idx], payload, _take_clients(states, idx, common), own)
        new, same = _split_common(new, common)
        shared = shared or same
        outs.append((new, upload))
    new, uploads = jax.tree_util.tree_map(lambda *parts: jnp.concatenate(parts)[buckets.order], *outs)
    return (new._replace(**shared) if shared else new), uploads


def downlink_bits(
    broadcast_bits: Any, expected: Any, reply_bits: Any, resync_bits: Any, reached: Any = None
) -> jax.Array:
    """A round's downlink bits per cohort slot, the ledger's one rule (``fed_fit`` and Flower): to every
    expected member the broadcast (not to one a re-sent copy of server state did not reach:
    ``reached`` False), plus the server's reply (``replies``) and a re-sent copy (``resyncs``), each given
    per slot (0 where none)."""
    sent = broadcast_bits if reached is None else jnp.where(reached, broadcast_bits, 0)
    return jnp.where(expected, sent + reply_bits + resync_bits, 0)


def fault_events(
    records: dict[str, np.ndarray], base_key: jax.Array, num_clients: int, cohort_size: int, start: int = 0
) -> list[tuple[int, int, str]]:
    """``(round, client, kind)`` of every fault in the records of rounds ``start, start + 1, ...``
    (the cohort of a round is a function of the seed and the round, so it is recomputed here)."""
    kinds = np.asarray(records.get("_fault_kind", np.zeros((0, 0))))
    rows = np.flatnonzero((kinds > OK).any(axis=1)) if kinds.size else np.zeros(0, int)
    if not len(rows):
        return []
    cohort_of = jax.vmap(
        lambda r: sample_cohort(jax.random.split(jax.random.fold_in(base_key, r), 3)[0], num_clients, cohort_size)
    )
    cohorts = np.asarray(jax.jit(cohort_of)(jnp.asarray(start + rows)))
    return [
        (start + int(r), int(cohort[j]), KIND_NAMES[int(kinds[r, j])])
        for r, cohort in zip(rows, cohorts)
        for j in np.flatnonzero(kinds[r] > OK)
    ]


def chunk_plan(start: int, end: int, size: int) -> list[tuple[int, int]]:
    """``(first round, length)`` of the chunks of ``size`` rounds covering rounds ``start .. end - 1``
    (a given ``chunk_size``).

    A length dividing the rounds exactly is preferred (between ``size // 2`` and ``size``), so the chunks
    are of equal length; otherwise the last is shorter. Every chunk runs on the same compiled program
    (:func:`_compiled_chunk` takes the length as an argument), so a shorter last chunk costs no
    compilation.
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


AUTO_CHUNK_SECONDS = 0.5
"""The wall time a timed chunk aims at (``chunk_size=None``, :class:`ChunkSchedule`)."""
AUTO_CHUNK_ROUNDS = 2000
"""The most rounds a timed chunk runs."""
AUTO_RECORD_BYTES = 32 * 2**20
"""The most bytes a timed chunk's buffer of per-round records may take (an estimate: :func:`chunk_capacity`)."""


HISTORY_MEMORY_SHARE = 0.5
"""The largest share of the machine's physical memory that a fit's per-round history may take
(:func:`check_history_memory`)."""


def physical_memory() -> int | None:
    """The machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def check_history_memory(name: str, rec: dict[str, np.ndarray], length: int, rounds_left: int) -> None:
    """ConfigError if the per-round records of the fit's remaining rounds would take more than
    :data:`HISTORY_MEMORY_SHARE` of the physical memory: ``res.history`` keeps every round's records on the
    host, so a fit of 2^31 - 1 rounds would otherwise run until the OS kills it for memory, without a word.
    Measured on the first chunk's records (``length`` rounds), which are what every round records."""
    memory = physical_memory()
    if memory is None or length < 1:
        return
    per_round = sum(np.asarray(v).nbytes for v in rec.values()) / length
    need = per_round * rounds_left
    if need > HISTORY_MEMORY_SHARE * memory:
        most = int(HISTORY_MEMORY_SHARE * memory / max(per_round, 1.0))
        raise ConfigError(
            f"{name}: the history of {rounds_left:,} more rounds would take {need / 2**30:,.1f} GiB on the host "
            f"({per_round:,.0f} bytes a round), more than {HISTORY_MEMORY_SHARE:.0%} of this machine's "
            f"{memory / 2**30:,.1f} GiB; run at most {most:,} rounds per fit and continue from its result "
            "(the algorithm's init=res)"
        )


def chunk_capacity(num_rounds: int, cohort_size: int, server_state: PyTree) -> int:
    """The rounds a timed chunk can hold: at most :data:`AUTO_CHUNK_ROUNDS` and ``num_rounds``, and few enough
    that the buffer of the chunk's per-round records stays within :data:`AUTO_RECORD_BYTES`. A round records
    a few numbers per cohort slot (its bits and fault kind) and the algorithm's diagnostics (the global state,
    a draw of it, a few scalars), so a round's records are taken to be at most 16 bytes per slot and twice the
    server state."""
    leaves = jax.tree_util.tree_leaves(server_state)
    state_bytes = sum(int(np.prod(np.shape(v))) * np.dtype(v.dtype).itemsize for v in leaves)
    per_round = 16 * cohort_size + 2 * state_bytes + 256
    return int(max(1, min(num_rounds, AUTO_CHUNK_ROUNDS, AUTO_RECORD_BYTES // per_round)))


class ChunkSchedule:
    """The chunks of rounds ``start .. end - 1``, one at a time, and the compiled program's capacity.

    With a given ``size``: the chunks of :func:`chunk_plan` (of the whole fit, so that a run continued from a
    chunk boundary runs the remaining chunks of the same plan). With ``size=None`` (``fed_fit``'s default),
    timed chunks: 1 round first, then each chunk twice the previous until a chunk's time is known without
    compilation (the second chunk's), then as many rounds as :data:`AUTO_CHUNK_SECONDS` holds at the time per
    round of the last chunk measured, at most 16 times the previous chunk and at most ``capacity``. Between
    chunks the host copies the records, checks the fit and shows progress (about a millisecond), which a
    chunk of a few rounds of tens of microseconds would pay every few rounds; a long chunk pays it once.
    Where the chunks end changes no round (each runs the same compiled program on the carry the last one
    left), only how often progress, checkpoints and callbacks come."""

    def __init__(self, start: int, end: int, size: int | None, capacity: int):
        """``capacity``: the most rounds of a timed chunk (:func:`chunk_capacity`); with a given ``size`` the
        capacity is the longest chunk of the plan."""
        self.end, self.size = end, size
        if size is not None:
            plan = [c for c in chunk_plan(0, end, size) if c[0] >= start]
            if not plan or plan[0][0] != start:
                plan = chunk_plan(start, end, size)
            self._plan = plan
            self.capacity = max((length for _, length in plan), default=1)
        else:
            self._plan = []
            self.capacity = max(1, capacity)
        self._next = start
        self._last = 0
        self._timed = 0  # the chunks timed so far (the first's time includes compilation: not used)
        self._per_round: float | None = None

    def next(self) -> tuple[int, int] | None:
        """``(first round, length)`` of the next chunk to dispatch, or None when every round is planned."""
        first = self._next
        if first >= self.end:
            return None
        if self.size is not None:
            chunk = self._plan.pop(0)
            self._next = chunk[0] + chunk[1]
            return chunk
        if self._per_round is None:
            length = 1 if self._last == 0 else 2 * self._last
        else:
            length = min(16 * self._last, max(1, int(AUTO_CHUNK_SECONDS / max(self._per_round, 1e-9))))
        length = max(1, min(length, self.capacity, self.end - first))
        self._last = length
        self._next = first + length
        return first, length

    def timed(self, length: int, seconds: float) -> None:
        """The wall time of the next chunk not yet timed, in order (the first's, which includes compilation, is
        not used)."""
        if self._timed > 0 and length > 0:
            self._per_round = seconds / length
        self._timed += 1


def _compiled_chunk(
    algorithm: FederatedRun,
    num_clients: int,
    cohort_size: int,
    faults: Faults | None = None,
    policy: FaultPolicy | None = None,
):
    """The jitted loop over a chunk of rounds, cached with the run (:func:`run_jit`) so that later calls of
    :func:`run_rounds` (a run continued in segments, or a later identical ``fed_fit`` that reuses the built
    run) reuse its compilation. A run is immutable after ``build`` and its settings travel in the carry, so
    when the chunk is traced does not matter.

    Called as ``chunk(carry, ks, count, clients, base_key, buckets)`` (``buckets``: :func:`round_buckets`): it
    runs rounds ``ks[0] .. ks[count - 1]``
    (``count`` at most ``len(ks)``, a traced number) and returns the carry and the rounds' records, stacked
    in rows of ``len(ks)`` of which the first ``count`` are written (the rest are zeros). One compilation per
    capacity ``len(ks)`` serves chunks of every length up to it."""

    def make():
        def chunk(carry, ks, count, clients, base_key, buckets=None):
            # The client data enter as arguments, not closure constants, so XLA does not constant-fold them.
            # jitted so that the shape query and the loop's body share one trace of the round (a nested jit is
            # traced once per argument shapes, and XLA inlines it: the compiled loop is the same)
            round_fn = jax.jit(
                make_round(algorithm, clients, num_clients, cohort_size, base_key, faults, policy, buckets)
            )
            steps = (ks, chunk_plans(base_key, ks))
            row = lambda i: jax.tree_util.tree_map(lambda a: a[i], steps)  # noqa: E731
            shapes = jax.eval_shape(lambda c: round_fn(c, row(0))[1], carry)
            rows = jax.tree_util.tree_map(lambda s: jnp.zeros((ks.shape[0],) + s.shape, s.dtype), shapes)

            def body(i, state):
                c, written = state
                c, rec = round_fn(c, row(i))
                return c, jax.tree_util.tree_map(lambda buf, r: buf.at[i].set(r), written, rec)

            return jax.lax.fori_loop(0, count, body, (carry, rows))

        return chunk

    return run_jit(algorithm, ("chunk", num_clients, cohort_size, faults, policy), make)


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


def first_short_round(records: dict[str, np.ndarray], min_clients: int) -> int | None:
    """Index of the first round in which faults left fewer than ``min_clients`` answers, or None."""
    faults = records["dropped"] + records["nonfinite"] + records["too_large"]
    short = (faults > 0) & (records["active"] < min_clients)
    return int(np.argmax(short)) if short.any() else None


class Stopped(FedbayesError):
    """Raised by :func:`run_rounds` when a round fails a stop check: ``reason`` is ``"diverged"`` (the
    global state is not finite), ``"nonfinite_uploads"`` (the global state is finite, but no member
    answered usefully and most sent non-finite uploads: the clients' computation blew up) or
    ``"too_few_clients"``; ``round`` is the first bad round, ``carry`` the state after the last good
    round, ``history`` the records of the good rounds and ``counts`` the bad round's ``active``,
    ``dropped``, ``nonfinite`` and ``too_large`` counts."""

    def __init__(
        self, reason: str, round: int, carry: Any, history: dict[str, np.ndarray], counts: dict[str, int] | None = None
    ):
        super().__init__(f"{reason} at round {round}")
        self.reason, self.round, self.carry, self.history = reason, round, carry, history
        self.counts = counts if counts is not None else {}


def fault_counts(rec: dict[str, Any]) -> dict[str, np.ndarray]:
    """The rounds' fault counts from the cohort slots' kinds (``_fault_kind``, rounds x slots): ``active``
    (answers the server used), ``dropped``, ``nonfinite`` and ``too_large``. Counted here rather than in
    the round: each count is a reduction of its own, and a round of a small cohort is made of such small
    operations (benchmarks/README.md, the samplers)."""
    kinds = np.asarray(rec["_fault_kind"])
    return {
        "active": (kinds == OK).sum(axis=1),
        "dropped": (kinds == DROPPED).sum(axis=1),
        "nonfinite": (kinds == NONFINITE).sum(axis=1),
        "too_large": (kinds == TOO_LARGE).sum(axis=1),
    }


def host_records(rec: dict[str, Any], seconds: float, length: int | None = None) -> dict[str, np.ndarray]:
    """A chunk's device records as the history's host arrays: its first ``length`` rows (default: all), with
    per-round wall time (``seconds`` spread over the chunk's rounds), the fault counts (:func:`fault_counts`),
    and the per-client bit counts summed over the cohort (``bits_up_rejected``: those of the uploads screened
    out)."""
    rec = {name: np.asarray(v)[:length] for name, v in rec.items()}
    length = len(rec["bits_up"])
    rec["seconds"] = np.full(length, seconds / max(length, 1))  # the first chunk includes compilation
    rec.update(fault_counts(rec))
    kinds = rec["_fault_kind"]
    rec["bits_up_rejected"] = np.where((kinds == NONFINITE) | (kinds == TOO_LARGE), rec["bits_up"], 0)
    for name in ("bits_up", "bits_down", "bits_up_rejected"):
        rec[name] = rec[name].astype(np.int64).sum(axis=1)
    return rec


def concat_records(records: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {name: np.concatenate([r[name] for r in records]) for name in records[0]} if records else {}


STALL_TIMEOUT = 300.0
"""Default seconds of idleness after which an unfinished computation is declared stalled (``fed_fit``)."""

_IDLE_CPU = 0.02  # the process is idle when it uses less than 2% of one core


def stall_advice(stall_timeout: float) -> str:
    """What a :class:`StalledError` message says after naming what stalled: the likely cause, what to
    try, and what becomes of the process."""
    return (
        f"made no progress for {stall_timeout:g} s: it is unfinished and the process has used no CPU in that "
        "time, so the computation is deadlocked, not slow. The known cause is jaxlib's CPU LAPACK kernels "
        "(Cholesky, triangular solves, LU, eigh over a batch of matrices): they split a large batch over "
        "XLA's thread pool and deadlock when several such batches run at once. fedbayes' own E-steps avoid "
        "them, but a model can still reach them (e.g. a MultivariateNormal whose covariance differs per "
        "client or per row). Try fewer clients per round (clients_per_round=), which keeps the batches "
        "small; or run the process on one core (e.g. `taskset -c 0 python ...`: slower, but XLA then never "
        "splits a batch); or another jax/jaxlib version; and please report the model to the fedbayes "
        "issue tracker. If the computation is legitimately idle that long (a host callback waiting, a long "
        "accelerator kernel), raise stall_timeout or pass None. The stalled computation cannot be "
        "cancelled: its threads stay blocked in this process, which will not exit normally (the interpreter "
        "waits for them at shutdown); keep what you need and end it with os._exit(), or run fits in a "
        "subprocess."
    )


def wait_ready(
    tree: PyTree, stall_timeout: float | None, what: str, *, rounds: tuple[int, int] | None = None
) -> PyTree:
    """``tree`` once its arrays are computed; :class:`StalledError` (naming ``what``) if they are not and the
    process has been idle for ``stall_timeout`` seconds (None: wait as long as it takes).

    XLA runs a dispatched computation on its own threads, and ``jax.block_until_ready`` would wait for
    ever on one that deadlocked. Instead a daemon thread waits for it and sets an event, while this
    thread wakes every ``min(1 s, stall_timeout / 4)`` and reads the process's CPU time
    (``time.process_time``, all threads): a window in which the process used less than 2% of one core
    is idle. The event wakes this thread as soon as the computation ends, so waiting adds no latency.
    The clock starts when dispatch returned (jit compiles before that, so compilation never counts) and
    restarts at every busy window, so a computation that is slow but computing is never stopped. A
    device computation that leaves the host idle would also count as idle, so on an accelerator
    backend the watchdog is off and this simply blocks. (XLA runs programs of under 1000
    flops, and programs with host callbacks, within the dispatch call itself: those are finished before
    this is called.)
    """
    if stall_timeout is None or jax.default_backend() != "cpu":
        # On an accelerator the host is idle while a long kernel runs, so idleness is no sign of a
        # deadlock there (and the deadlock this guards against is in the CPU LAPACK kernels).
        return jax.block_until_ready(tree)
    done = threading.Event()

    def wait() -> None:
        try:
            jax.block_until_ready(tree)
        finally:
            done.set()

    threading.Thread(target=wait, name="fedbayes-wait-ready", daemon=True).start()
    window = min(1.0, stall_timeout / 4)
    busy = mark = time.monotonic()
    cpu_mark = time.process_time()
    while not done.wait(window):
        now, cpu = time.monotonic(), time.process_time()
        if cpu - cpu_mark >= _IDLE_CPU * (now - mark):
            busy = now
        mark, cpu_mark = now, cpu
        if now - busy >= stall_timeout:
            raise StalledError(f"{what} {stall_advice(stall_timeout)}", rounds=rounds)
    return jax.block_until_ready(tree)  # an error raised by the computation surfaces here


def placed(
    carry: tuple[PyTree, PyTree, Message], base_key: jax.Array, common: tuple[str, ...] = ()
) -> tuple[tuple[PyTree, PyTree, Message], jax.Array]:
    """The carry and the round key laid out as the rounds use them: the client states over the active
    mesh's devices (:func:`sharded_clients`; their ``common`` fields replicated), the server state, the
    broadcast and the key replicated."""
    server_state, client_states, broadcast = carry
    states, shared = _split_common(client_states, common)
    states = shard_clients(states)
    states = states._replace(**replicate(shared)) if shared else states
    return (replicate(server_state), states, replicate(broadcast)), replicate(base_key)


def run_rounds(
    algorithm: FederatedRun,
    problem: Problem,
    carry: tuple[PyTree, PyTree, Message],
    *,
    base_key: jax.Array,
    cohort_size: int,
    start: int = 0,
    chunk_size: int | None = None,
    progress: bool | None | Progress = None,
    stop_on_divergence: bool = False,
    faults: Faults | None = None,
    policy: FaultPolicy | None = None,
    on_chunk: Callable[[int, Any, list[dict[str, np.ndarray]]], None] | None = None,
    stall_timeout: float | None = STALL_TIMEOUT,
    prepare: Callable[[tuple[PyTree, PyTree, Message]], None] | None = None,
) -> tuple[tuple[PyTree, PyTree, Message], dict[str, np.ndarray]]:
    """Run rounds ``start .. problem.num_rounds - 1`` and return the final carry and the history.

    The history maps each recorded quantity to a numpy array with one row per round; ``bits_up``,
    ``bits_down`` and ``bits_up_rejected`` are exact int64 totals per round (summed on the host so they
    cannot overflow), and ``seconds`` is the wall time of the round's chunk divided by its rounds (from the
    end of the previous chunk to the end of this one; the first chunk's from its dispatch, compilation
    included).

    Rounds run in chunks (:class:`ChunkSchedule`): those of ``chunk_plan(0, num_rounds, chunk_size)``, or
    with ``chunk_size=None`` chunks timed to last about :data:`AUTO_CHUNK_SECONDS` each. Every chunk runs the
    same compiled program (:func:`_compiled_chunk`), so where chunks end changes no round. ``on_chunk(rounds_done,
    carry, records)`` is called after each chunk (``records``: this call's chunk records so far). A chunk idle
    for ``stall_timeout`` seconds raises :class:`fedbayes.errors.StalledError` (:func:`wait_ready`).

    With ``prepare``, the chunk's program is compiled ahead on a worker thread (:meth:`FitJitted.ahead`) and
    ``prepare(carry)`` is called meanwhile, before the first chunk runs: what the caller compiles ahead for
    after the rounds (``fed_fit``: the run's :meth:`~fedbayes.protocol.FederatedRun.finalize_ahead`), so that
    its tracing overlaps the chunk's compilation and its compilation the rounds.

    A round fails a stop check when faults leave fewer than ``policy.min_clients`` answers, or, with
    ``stop_on_divergence``, when the global state turns non-finite (``"diverged"``) or no member answered
    and at least half of them sent non-finite updates (``"nonfinite_uploads"``: a blow-up of the clients'
    computation, not random faults; with ``faults.nan > 0`` such a round counts as too few clients,
    since the NaN may be the injected ones). Then the state after the last good round is recomputed by
    replaying the chunk's good rounds from its starting state (round keys depend only on the seed and
    the round, so the replay is the same computation) and :class:`Stopped` is raised with it and the
    good rounds' history.
    """
    num_rounds = problem.num_rounds
    clients = stack_clients(problem.data)
    buckets = round_buckets(algorithm, problem, cohort_size)
    carry, base_key = placed(carry, base_key, common_fields(algorithm))
    min_clients = (FaultPolicy() if policy is None else policy).min_clients
    run_chunk = _compiled_chunk(algorithm, problem.data.num_clients, cohort_size, faults, policy)
    bar = progress if isinstance(progress, Progress) else Progress(num_rounds, algorithm.name, progress)
    schedule = ChunkSchedule(start, num_rounds, chunk_size, chunk_capacity(num_rounds, cohort_size, carry[0]))
    records: list[dict[str, np.ndarray]] = []

    def arguments(state: Any, first: int, length: int) -> tuple:
        ks = np.arange(first, first + schedule.capacity, dtype=np.int32)
        return state, ks, np.int32(length), clients, base_key, buckets

    def dispatch(state: Any, first: int, length: int) -> Any:
        return run_chunk(*arguments(state, first, length))

    # Chunk i + 1 is dispatched (on chunk i's carry, still being computed) before the host reads chunk i's
    # records, so the device never waits for the host's work between chunks (copying the records, the stop
    # checks, progress, checkpoints, callbacks). Where a check stops the fit after chunk i, chunk i + 1's
    # work is dropped unread: what the fit returns is as without it.
    t0 = time.perf_counter()
    chunk = schedule.next()
    if chunk is not None:
        bar.phase(f"compiling the rounds and running rounds {start}..{start + chunk[1] - 1}")
    if chunk is not None and prepare is not None:  # the chunk compiles on a worker while ``prepare`` traces
        if isinstance(run_chunk, FitJitted):  # (not a stand-in wrapping it)
            run_chunk.ahead(*arguments(carry, *chunk))
        prepare(carry)
    ahead = dispatch(carry, *chunk) if chunk is not None else None  # (compiles the chunk on a first call)
    while chunk is not None:
        first, length = chunk
        before, current = carry, ahead
        if current is None:  # every chunk is dispatched before its turn
            raise AssertionError(f"the chunk of rounds from {first} was not dispatched")
        following = schedule.next()
        ahead = dispatch(current[0], *following) if following is not None else None
        try:
            carry, rec = wait_ready(
                current,
                stall_timeout,
                f"{bar.label}: the chunk of rounds {first}..{first + length - 1}",
                rounds=(first, first + length - 1),
            )
        except StalledError as err:
            err.history = concat_records(records)
            raise
        t1 = time.perf_counter()
        schedule.timed(length, t1 - t0)
        rec = host_records(rec, t1 - t0, length)  # from the end of the previous chunk (the first: its dispatch)
        t0 = t1
        short = first_short_round(rec, min_clients)
        reason = "too_few_clients"
        simulated_nan = faults is not None and faults.nan > 0  # injected NaN uploads are faults, not a blow-up
        if short is not None and stop_on_divergence and rec["active"][short] == 0 and not simulated_nan:
            expected = rec["dropped"][short] + rec["nonfinite"][short] + rec["too_large"][short]
            if 2 * rec["nonfinite"][short] >= expected:  # most members blew up at once: a divergence, not faults
                reason = "nonfinite_uploads"
        checks: list[tuple[str, int | None]] = [(reason, short)]
        if stop_on_divergence:
            checks.append(("diverged", first_nonfinite_round(rec)))
        found = [(bad, reason) for reason, bad in checks if bad is not None]
        if found:  # the earliest bad round; on a tie, the fault count's verdict (it explains the other)
            bad, reason = min(found, key=lambda c: (c[0], c[1] == "diverged"))
            records.append({name: v[:bad] for name, v in rec.items()})
            good = dispatch(before, first, bad)[0] if bad else before
            counts = {name: int(rec[name][bad]) for name in ("active", "dropped", "nonfinite", "too_large")}
            raise Stopped(reason, first + bad, good, concat_records(records), counts)
        if not records:
            check_history_memory(bar.label, rec, length, num_rounds - first)
        records.append(rec)
        bar.update(first + length)
        if on_chunk is not None:
            on_chunk(first + length, carry, records)
        chunk = following
    return carry, concat_records(records)
