"""Flower ServerApp / ClientApp for any fedbayes algorithm (imported by :mod:`fedbayes.flower`)."""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from .. import wire
from ..api import _fault_table, _public, _validated
from ..data import FederatedData
from ..engine import (ClientData, Problem, Progress, _host_records, first_short_round, resolve_cohort_size,
                      round_plan, server_half, stack_clients)
from ..errors import ConfigError, FedbayesError, TooFewClientsError
from ..faults import FaultPolicy
from ..model import FedModel
from ..result import Result

PAYLOAD = "p"  # the one ArrayRecord key of a message's payload (its bytes count in Flower's measure)
HEADER = "h"  # the ConfigRecord of protocol header fields (round, slot, ...), outside the ledger
NODE_UNAVAILABLE = 5  # flwr.common.constant.ErrorCode.NODE_UNAVAILABLE


@dataclasses.dataclass
class FlowerSpec:
    """Everything both ends must agree on: the model, the algorithm and its settings, and how a client
    finds its own data (``data`` holds the partitions of a simulation; a deployment's client loads its
    own). ``token`` names the run in this process's caches."""

    model: Callable
    data: FederatedData
    algorithm: Any
    num_rounds: int
    clients_per_round: int | float | None = None
    seed: int = 0
    model_kwargs: Mapping[str, Any] | None = None
    fault_policy: FaultPolicy | None = None
    timeout: float | None = 600.0
    progress: bool | None = None
    token: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)


# ------------------------------------------------------------------------------ the run, built once per process


class _Runtime:
    """The built algorithm and its jitted halves, shared by the server and the clients of a process."""

    def __init__(self, spec: FlowerSpec):
        fit = _validated(spec.model, spec.data, spec.algorithm, spec.num_rounds, spec.clients_per_round, spec.seed,
                         spec.model_kwargs, 50, None, spec.fault_policy)
        self.spec, self.data = spec, fit.data
        self.cohort = resolve_cohort_size(fit.clients_per_round, fit.data.num_clients)
        self.fm = FedModel(fit.model, fit.data, fit.model_kwargs)
        self.problem = Problem(self.fm, fit.data, fit.num_rounds, self.cohort)
        self.run = fit.algorithm.build(self.problem)
        self.k_init, self.k_rounds, self.k_final = jax.random.split(jax.random.PRNGKey(fit.seed), 3)
        self.server_state, self.client_states, self.broadcast = self.run.init(self.k_init, self.problem)
        self.clients = stack_clients(fit.data)
        self.participation = float(getattr(self.run, "participation", 1.0))
        run = self.run
        self.plan = jax.jit(lambda k: round_plan(self.k_rounds, k, self.data.num_clients, self.cohort,
                                                 self.participation))
        self.client_step = jax.jit(lambda key, payload, state, member: run.client_step(
            key, wire.decode_tree(payload), state, member))
        self.finish, self.reply_template = None, None
        if hasattr(run, "client_finish") and self.reply_payload(self.broadcast.payload) is not None:
            self.reply_template = wire.template(self.reply_payload(self.broadcast.payload))
            self.finish = jax.jit(lambda reply, state, member, upload: run.client_finish(
                wire.decode_tree(reply), state, member, wire.decode_tree(upload)))
        policy = fit.fault_policy

        def serve(server_state, payload, bits, broadcast_bits, expected, received, k, cohort, k_server, k_shared):
            return server_half(run, server_state, wire.decode_tree(payload), bits, broadcast_bits, expected, received,
                               policy, k, cohort, self.data.num_clients, k_server, k_shared)

        self.serve = jax.jit(serve)
        member0 = self.member(0, 0, jax.random.PRNGKey(0))
        shapes = jax.eval_shape(run.client_step, jax.random.PRNGKey(0), wire.decode_tree(self.broadcast.payload),
                                self.client_state(0), member0)
        self.upload_template = shapes[1].payload
        self.state_leaves, self.state_def = jax.tree_util.tree_flatten(self.client_state(0))

    def client_state(self, i: int) -> Any:
        return jax.tree_util.tree_map(lambda a: a[i], self.client_states)

    def member(self, i: int, slot: int, shared_key: jax.Array) -> ClientData:
        one = jax.tree_util.tree_map(lambda a: a[i], self.clients)
        return one._replace(slot=jnp.asarray(slot), shared_key=shared_key)

    def reply_payload(self, payload: Any) -> Any:
        fn = getattr(self.run, "finish_message", None)
        return wire.decode_tree(payload) if fn is None else fn(wire.decode_tree(payload))


_RUNTIMES: dict[str, _Runtime] = {}
_RESULTS: dict[str, Any] = {}


def _runtime(spec: FlowerSpec) -> _Runtime:
    if spec.token not in _RUNTIMES:
        _RUNTIMES[spec.token] = _Runtime(spec)
    return _RUNTIMES[spec.token]


# ------------------------------------------------------------------------------ messages


def _content(data: bytes, header: Mapping[str, Any]) -> RecordDict:
    array = Array(dtype="uint8", shape=(len(data),), stype="raw", data=data)
    return RecordDict({PAYLOAD: ArrayRecord({"": array}), HEADER: ConfigRecord(dict(header))})


def payload_bytes(message: Message | RecordDict) -> int:
    """The bytes of a message's payload as Flower counts them (``ArrayRecord.count_bytes``; its one key is
    empty, so this is the length of the encoded payload)."""
    content = message.content if isinstance(message, Message) else message
    return content.array_records[PAYLOAD].count_bytes()


def _data(message: Message) -> bytes:
    return message.content.array_records[PAYLOAD][""].data


def _header(message: Message) -> dict[str, Any]:
    return dict(message.content.config_records[HEADER])


# ------------------------------------------------------------------------------ client


_STATE, _PENDING, _META = "fedbayes.state", "fedbayes.pending", "fedbayes.meta"


def _save(context: Context, name: str, tree: Any) -> None:
    context.state[name] = ArrayRecord([np.asarray(x) for x in jax.tree_util.tree_leaves(tree)])


def _load(context: Context, name: str, rt: _Runtime) -> Any:
    arrays = context.state[name].to_numpy_ndarrays()
    return jax.tree_util.tree_unflatten(rt.state_def, [jnp.asarray(a, dtype=t.dtype) for a, t in zip(arrays, rt.state_leaves)])


def _client_index(context: Context) -> int:
    config = context.node_config
    for key in ("client-id", "partition-id"):
        if key in config:
            return int(config[key])
    raise ConfigError("a fedbayes ClientApp needs node_config 'partition-id' (simulation) or 'client-id' (deployment)")


def _settle(context: Context, rt: _Runtime, index: int, accepted: int) -> Any:
    """The client's committed state after the server's verdict on its pending upload: kept when the
    server accepted it (``accepted`` names that round), dropped when it was rejected or never arrived."""
    if _META not in context.state:  # first contact: the initial state
        _save(context, _STATE, rt.client_state(index))
        context.state[_META] = ConfigRecord({"pending": -1})
    meta = context.state[_META]
    if int(meta["pending"]) >= 0:
        if int(meta["pending"]) == accepted:
            context.state[_STATE] = context.state[_PENDING]
        meta["pending"] = -1
    return _load(context, _STATE, rt)


_SPECS: dict[Any, FlowerSpec] = {}


def _resolve(spec: FlowerSpec | Callable[[Any], FlowerSpec], context: Context) -> FlowerSpec:
    """The spec, or the spec a ``run_config -> FlowerSpec`` function gives for this run (built once)."""
    if isinstance(spec, FlowerSpec):
        return spec
    key = (id(spec), tuple(sorted((k, str(v)) for k, v in context.run_config.items())))
    if key not in _SPECS:
        _SPECS[key] = spec(context.run_config)
    return _SPECS[key]


def client_app(spec: FlowerSpec | Callable[[Any], FlowerSpec]) -> ClientApp:
    """A ClientApp running ``spec``'s algorithm on this node's client (``node_config['partition-id']`` in a
    simulation, ``node_config['client-id']`` in a deployment). Its state lives in ``context.state``: the
    committed state, and the state after its last step until the server's verdict on that upload.
    ``spec`` may be a function of the run config (``flwr run``'s ``[tool.flwr.app.config]``)."""
    app = ClientApp()
    spec_of = spec

    def _runtime_of(context: Context) -> _Runtime:
        return _runtime(_resolve(spec_of, context))

    @app.train("step")
    def step(msg: Message, context: Context) -> Message:
        rt, index = _runtime_of(context), _client_index(context)
        h = _header(msg)
        state = _settle(context, rt, index, int(h["accepted"]))
        k, slot = int(h["round"]), int(h["slot"])
        _, _, keys, _, k_shared, _ = rt.plan(jnp.asarray(k))
        key = keys[slot]  # the engine's key for this client in this round
        member = rt.member(index, slot, k_shared)
        payload = wire.unpack(_data(msg), wire.template(rt.broadcast.payload), wire.Context(k_shared, slot))
        new_state, upload = rt.client_step(key, payload, state, member)
        _save(context, _PENDING, new_state)
        context.state[_META]["pending"] = k
        data, bits = wire.pack(jax.device_get(upload.payload), wire.Context(k_shared, slot))
        if bits != int(upload.bits):
            raise FedbayesError(f"{rt.run.name}: the upload's encoding has {bits} bits, its ledger entry {int(upload.bits)}")
        context.state[_STATE + ".upload"] = ArrayRecord({"": Array(dtype="uint8", shape=(len(data),), stype="raw",
                                                                    data=data)})
        return Message(_content(data, {"bits": bits}), reply_to=msg)

    @app.train("finish")
    def finish(msg: Message, context: Context) -> Message:
        rt, index = _runtime_of(context), _client_index(context)
        h = _header(msg)
        k, slot = int(h["round"]), int(h["slot"])
        _, _, _, _, k_shared, _ = rt.plan(jnp.asarray(k))
        ctx = wire.Context(k_shared, slot)
        member = rt.member(index, slot, k_shared)
        reply = wire.unpack(_data(msg), rt.reply_template, ctx)
        own = wire.unpack(context.state[_STATE + ".upload"][""].data, rt.upload_template, ctx)
        pending = _load(context, _PENDING, rt)
        new_state, _ = rt.finish(reply, pending, member, own)
        _save(context, _STATE, new_state)  # the server accepted the upload: commit
        context.state[_META]["pending"] = -1
        return Message(_content(b"", {}), reply_to=msg)

    @app.query("state")
    def state(msg: Message, context: Context) -> Message:
        """The client's final state (collected by :func:`simulate` only, outside the ledger)."""
        rt, index = _runtime_of(context), _client_index(context)
        current = _settle(context, rt, index, int(_header(msg)["accepted"]))
        leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(current)]
        return Message(RecordDict({"state": ArrayRecord(leaves), HEADER: ConfigRecord({"client": index})}),
                       reply_to=msg)

    @app.query("hello")
    def hello(msg: Message, context: Context) -> Message:
        return Message(RecordDict({HEADER: ConfigRecord({"client": _client_index(context)})}), reply_to=msg)

    return app


# ------------------------------------------------------------------------------ server


class _Server:
    """The server loop of :func:`server_app`, round by round as in :func:`fedbayes.engine.make_round`."""

    def __init__(self, spec: FlowerSpec, grid: Grid):
        self.spec, self.grid, self.rt = spec, grid, _runtime(spec)
        self.accepted = np.full(self.rt.data.num_clients, -1)
        self.records: list[dict[str, np.ndarray]] = []
        self.message_bytes: list[tuple[str, int, int, int, int]] = []  # (kind, round, client, bytes, ledger bits)

    def _send(self, messages: list[Message]) -> dict[int, Message]:
        if not messages:
            return {}
        replies = self.grid.send_and_receive(messages, timeout=self.spec.timeout)
        out = {}
        for reply in replies:
            if not reply.has_error():
                out[reply.metadata.src_node_id] = reply
        return out

    def connect(self) -> None:
        """Wait for the clients' nodes and learn which client each hosts."""
        num = self.rt.data.num_clients
        deadline = time.monotonic() + (self.spec.timeout or 600.0)
        nodes = list(self.grid.get_node_ids())
        while len(nodes) < num and time.monotonic() < deadline:
            time.sleep(0.5)
            nodes = list(self.grid.get_node_ids())
        hello = [Message(RecordDict({}), dst_node_id=n, message_type="query.hello") for n in nodes]
        self.node_of: dict[int, int] = {}
        for node, reply in self._send(hello).items():
            self.node_of[int(_header(reply)["client"])] = node
        missing = sorted(set(range(num)) - set(self.node_of))
        if missing:
            raise FedbayesError(f"no Flower node hosts client(s) {missing[:10]}: start {num} SuperNodes, one per client")

    def round(self, k: int) -> None:
        rt, cohort_size = self.rt, self.rt.cohort
        _, cohort, _, k_server, k_shared, expected = rt.plan(jnp.asarray(k))
        cohort, expected = np.asarray(cohort), np.asarray(expected)
        data, down_bits = wire.pack(jax.device_get(rt.broadcast.payload), wire.Context(k_shared, 0))
        if down_bits != int(rt.broadcast.bits):
            raise FedbayesError(f"{rt.run.name}: the broadcast's encoding has {down_bits} bits, its ledger entry "
                                f"{int(rt.broadcast.bits)}")
        msgs, slot_of = [], {}
        for j in np.flatnonzero(expected):
            client = int(cohort[j])
            node = self.node_of[client]
            header = {"round": k, "slot": int(j), "accepted": int(self.accepted[client])}
            msgs.append(Message(_content(data, header), dst_node_id=node, message_type="train.step", group_id=str(k)))
            slot_of[node] = int(j)
            self.message_bytes.append(("broadcast", k, client, len(data), down_bits))
        replies = self._send(msgs)
        received = np.zeros(cohort_size, bool)
        bits = np.zeros(cohort_size, np.int32)
        uploads = [None] * cohort_size
        zero = jax.tree_util.tree_map(lambda t: np.zeros(t.shape, t.dtype), rt.upload_template)
        for node, reply in replies.items():
            j = slot_of[node]
            uploads[j] = wire.unpack(_data(reply), rt.upload_template, wire.Context(k_shared, j))
            bits[j] = int(_header(reply)["bits"])
            received[j] = True
            self.message_bytes.append(("upload", k, int(cohort[j]), payload_bytes(reply), int(bits[j])))
        stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *[u if u is not None else zero for u in uploads])
        state, new_broadcast, payload, record = rt.serve(
            rt.server_state, stacked, jnp.asarray(bits), rt.broadcast.bits, jnp.asarray(expected),
            jnp.asarray(received), jnp.asarray(k), jnp.asarray(cohort), k_server, k_shared)
        active = np.asarray(record.pop("_active"))
        record.pop("_faulty")
        bits_down = np.asarray(record["bits_down"]).astype(np.int64)
        for j in np.flatnonzero(active):
            self.accepted[int(cohort[j])] = k
        if rt.finish is not None:  # the server's reply to the members that answered
            reply = rt.reply_payload(new_broadcast.payload)
            msgs = []
            for j in np.flatnonzero(active):
                client = int(cohort[j])
                data, reply_bits = wire.pack(jax.device_get(reply), wire.Context(k_shared, int(j)))
                msgs.append(Message(_content(data, {"round": k, "slot": int(j)}), dst_node_id=self.node_of[client],
                                    message_type="train.finish", group_id=str(k)))
                bits_down[j] += reply_bits
                self.message_bytes.append(("reply", k, client, len(data), reply_bits))
            self._send(msgs)
        record["bits_down"] = bits_down
        rt.server_state, rt.broadcast = state, new_broadcast
        self.records.append(jax.tree_util.tree_map(lambda x: np.asarray(x)[None], record))

    def collect(self) -> Any:
        """Every client's final state (a simulation's result, outside the ledger)."""
        msgs = [Message(RecordDict({HEADER: ConfigRecord({"accepted": int(self.accepted[c])})}), dst_node_id=n,
                        message_type="query.state") for c, n in self.node_of.items()]
        rt = self.rt
        stacked = [np.array(x) for x in jax.tree_util.tree_leaves(rt.client_states)]
        for reply in self._send(msgs).values():
            client = int(_header(reply)["client"])
            for leaf, value in zip(stacked, reply.content.array_records["state"].to_numpy_ndarrays()):
                leaf[client] = value
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(rt.client_states),
                                            [jnp.asarray(x) for x in stacked])

    def run(self) -> Result:
        rt, spec = self.rt, self.spec
        self.connect()
        bar = Progress(spec.num_rounds, f"{rt.run.name} on Flower", spec.progress)
        t0 = time.perf_counter()
        min_clients = (spec.fault_policy or FaultPolicy()).min_clients
        for k in range(spec.num_rounds):
            self.round(k)
            if first_short_round(self.records[-1], min_clients) is not None:
                raise TooFewClientsError(f"{rt.run.name} on Flower: round {k} left fewer answering clients than "
                                         f"min_clients={min_clients}")
            bar.update(k + 1)
        history = {name: np.concatenate([r[name] for r in self.records]) for name in self.records[0]}
        history = _host_records(history, time.perf_counter() - t0)
        carry = (rt.server_state, self.collect(), rt.broadcast)
        parts = rt.run.finalize(rt.k_final, carry, rt.problem, history=history)
        result = Result(model=rt.fm, data=rt.data, run=rt.run, algorithm=rt.run.name, seed=spec.seed, parts=parts,
                        history=_public(history))
        result.faults = _fault_table(history, rt.k_rounds, rt.data.num_clients, rt.cohort)
        result.flower_messages = self.message_bytes
        return result


def run_server(spec: FlowerSpec, grid: Grid) -> Result:
    """Run ``spec``'s algorithm over the nodes of ``grid`` (inside a ServerApp's ``main``) and return the
    :class:`fedbayes.Result`: the global state, the ledger and ``flower_messages``. The clients' final
    states are collected too (as a simulation's result; leave them out of a deployment's reporting)."""
    return _Server(spec, grid).run()


def server_app(spec: FlowerSpec) -> ServerApp:
    """A ServerApp running ``spec``'s algorithm for ``spec.num_rounds`` rounds over the connected nodes."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        _RESULTS[spec.token] = run_server(spec, grid)

    return app


# ------------------------------------------------------------------------------ in-process grid


class LocalGrid:
    """A Flower ``Grid`` that delivers messages to ClientApps in this process, one after another: the
    message protocol of a deployment without its transport, for debugging and for tests.
    ``unreachable(round, client) -> bool`` makes a node fail to answer (Flower's NODE_UNAVAILABLE)."""

    def __init__(self, app: ClientApp, num_clients: int, unreachable: Callable[[int, int], bool] | None = None,
                 run_config: Mapping[str, Any] | None = None):
        self.app, self.unreachable = app, unreachable
        self.contexts = {i + 1: Context(run_id=0, node_id=i + 1, node_config={"partition-id": i, "num-partitions": num_clients},
                                        state=RecordDict(), run_config=dict(run_config or {})) for i in range(num_clients)}
        self._ids = itertools.count(1)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"m{next(self._ids)}"
            node = msg.metadata.dst_node_id
            client = self.contexts[node].node_config["partition-id"]
            k = msg.metadata.group_id
            if self.unreachable is not None and k not in ("", None) and self.unreachable(int(k), client):
                reply = Message(Error(code=NODE_UNAVAILABLE, reason="unreachable"), reply_to=msg)
            else:
                reply = self.app(msg, self.contexts[node])
            reply.metadata.__dict__["_src_node_id"] = node
            replies.append(reply)
        return replies


def simulate(model: Callable, data: FederatedData | Mapping[str, Any], algorithm: Any = "fedsoul", *,
             num_rounds: int = 500, clients_per_round: int | float | None = None, seed: int = 0,
             model_kwargs: Mapping[str, Any] | None = None, fault_policy: FaultPolicy | None = None,
             backend: str = "ray", num_cpus_per_client: float = 1.0, timeout: float | None = 600.0,
             progress: bool | None = None, unreachable: Callable[[int, int], bool] | None = None) -> Result:
    """Run ``algorithm`` on Flower in this process and return the :class:`fedbayes.Result` of
    :func:`fedbayes.fed_fit` with the same arguments.

    ``backend="ray"`` runs Flower's simulation engine (``flwr.simulation.run_simulation``: one SuperNode per
    client, ClientApps in Ray workers, ``num_cpus_per_client`` each). ``backend="local"`` delivers the
    same messages to the same ClientApp in this process (:class:`LocalGrid`), without Ray; it alone
    accepts ``unreachable(round, client) -> bool`` to make a node miss a round.

    Differences from ``fed_fit``: client steps run one client at a time rather than vectorised, so
    results agree to float rounding, not bit for bit; the result also has ``flower_messages``, the
    ``(kind, round, client, bytes, ledger bits)`` of every payload Flower carried. Floats cross the
    network as float32 (the ledger's 32 bits), so run in float32 (JAX's default) for the exact wire.
    """
    fit = _validated(model, data, algorithm, num_rounds, clients_per_round, seed, model_kwargs, 50, None, fault_policy)
    spec = FlowerSpec(fit.model, fit.data, fit.algorithm, fit.num_rounds, fit.clients_per_round, fit.seed,
                      fit.model_kwargs, fit.fault_policy, timeout, progress)
    if backend == "local":
        from flwr.supercore.task_identity import TaskIdentity

        saved = {name: getattr(TaskIdentity, name) for name in ("_run_id", "_node_id", "_task_id")}
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 0, 0, 0  # this process is the server
        grid = LocalGrid(client_app(spec), fit.data.num_clients, unreachable)
        try:
            return _Server(spec, grid).run()
        finally:
            _RUNTIMES.pop(spec.token, None)
            for name, value in saved.items():
                setattr(TaskIdentity, name, value)
    if backend != "ray":
        raise ConfigError(f"backend must be 'ray' or 'local', got {backend!r}")
    if unreachable is not None:
        raise ConfigError("unreachable= needs backend='local' (Ray's nodes cannot be switched off per round)")
    from flwr.simulation import run_simulation

    try:
        run_simulation(server_app=server_app(spec), client_app=client_app(spec), num_supernodes=fit.data.num_clients,
                       backend_config={"client_resources": {"num_cpus": num_cpus_per_client, "num_gpus": 0.0}})
        if spec.token not in _RESULTS:
            raise FedbayesError("the Flower simulation ended without a result; its log above says why")
        return _RESULTS.pop(spec.token)
    finally:
        _RUNTIMES.pop(spec.token, None)
