"""Flower ServerApp / ClientApp for any fedbayes algorithm (imported by :mod:`fedbayes.flower`)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import os
import time
import uuid
import warnings
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast
from collections.abc import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from .. import engine, wire
from . import _resume, _secagg
from ._secagg import SecAggPlus  # noqa: F401 (fedbayes.flower's SecAggPlus comes from here)
from ._resume import STATE_KEY  # noqa: F401 (fedbayes.flower's STATE_KEY comes from here)
from ..seeds import seed_key
from ..algorithms.elf import LangevinSampler
from ..api import _data_digest, _fingerprints, check_progress, fault_table, public_history, validate_fit
from ..data import FederatedData
from ..engine import (
    Progress,
    host_records,
    fault_counts,
    first_short_round,
    resolve_cohort_size,
    round_plan,
    server_half,
    setup_client_key,
    setup_keys,
    stack_clients,
)
from ..errors import CheckpointError, ConfigError, FedbayesError, TooFewClientsError, is_real
from ..faults import FaultPolicy
from ..introspect import FedModel
from ..protocol import ClientData, FitParts, Problem, with_final_parts
from ..result import Result

PAYLOAD = "p"  # the one ArrayRecord key of a message's payload (its bytes count in Flower's measure)
HEADER = "h"  # the ConfigRecord of protocol header fields (round, slot, ...), outside the ledger
NODE_UNAVAILABLE = 5  # flwr.common.constant.ErrorCode.NODE_UNAVAILABLE


@dataclasses.dataclass
class FlowerSpec:
    """Everything both ends must agree on: the model, the algorithm and its settings, and how a client
    finds its own data (``data`` holds the partitions of a simulation; a deployment's client loads its
    own). ``token`` names the run in this process's caches.

    ``checkpoint`` (the server's side only) is a file the server rewrites atomically after the set-up
    exchange and after every round; ``resume=True`` continues the run that wrote it, after its last
    completed round, with the clients' states from their nodes' snapshots (node config ``fedbayes-state``,
    :data:`STATE_KEY`). A run stopped by :class:`fedbayes.TooFewClientsError` (a node died and the fault
    policy's ``min_clients`` was not met), or by the server's own crash, resumes to what the uninterrupted
    run gives, bit for bit."""

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
    secure_aggregation: Any = None
    matmul_precision: str | None = "highest"  # as fed_fit's (fedbayes.engine.matmul_precision), at both ends
    checkpoint: str | None = None  # the server's checkpoint file, written after the set-up and every round
    resume: bool = False  # start from ``checkpoint`` (the nodes restore their snapshots: fedbayes.flower._resume)
    token: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)


# ------------------------------------------------------------------------------ the run, built once per process


class _Runtime:
    """The built algorithm and its jitted halves, for one end of the federation.

    ``role="server"``: built on ``spec.data.blank()`` (the layout: keys, sizes, shapes; every value
    zero), so nothing the server computes can read a client's data; it learns what it needs from
    the set-up exchange. ``role="client"``: the halves a client runs, each given one client's data
    only. The structure of every message (to unpack its bytes) comes from ``jax.eval_shape`` of the
    algorithm's own functions, so neither end needs the other's state to read a message.
    """

    # the server's round state and the broadcast that opens its next round (server only: set by _Server.setup)
    server_state: Any
    broadcast: engine.Message

    def __init__(self, spec: FlowerSpec, role: str):
        fit = validate_fit(
            spec.model,
            spec.data,
            spec.algorithm,
            spec.num_rounds,
            spec.clients_per_round,
            spec.seed,
            spec.model_kwargs,
            50,
            None,
            spec.fault_policy,
        )
        if isinstance(fit.algorithm, LangevinSampler) and fit.algorithm.init is None:
            # the samplers' default search for the mode takes a data-dependent number of exchanges, which
            # the set-up protocol does not have: on a network they start at the prior centre
            fit = fit._replace(algorithm=dataclasses.replace(fit.algorithm, init="prior"))
        if callable(getattr(fit.algorithm, "resolved_init", None)):  # FedSOUL's init="auto", as fed_fit resolves it
            start = fit.algorithm.resolved_init(FedModel(fit.model, fit.data, fit.model_kwargs))
            fit = fit._replace(algorithm=dataclasses.replace(fit.algorithm, init=start))
        if isinstance(getattr(fit.algorithm, "init", None), str) and fit.algorithm.init != "prior":
            raise ConfigError(
                f"{fit.algorithm.name}: init={fit.algorithm.init!r} runs a fit over every client's data "
                "before the start; on a network, fit the MAP first (e.g. fb.flower.simulate or run_server "
                "with fb.TAMUNA) and pass init=<that result>"
            )
        self.spec, self.role, self.fit = spec, role, fit
        self.data = data = fit.data.blank() if role == "server" else fit.data
        self.cohort = resolve_cohort_size(fit.clients_per_round, data.num_clients)
        problem = Problem(FedModel(fit.model, data, fit.model_kwargs), data, fit.num_rounds, self.cohort)
        self.model = problem.model  # the analysed model (constrains a node's personal posterior)
        with warnings.catch_warnings():
            if spec.secure_aggregation is not None:  # the distributed mode's warning is for a server that sees uploads
                warnings.filterwarnings("ignore", message="distributed DP with no secure aggregation")
            self.run = run = fit.algorithm.build(problem)
        self.k_init, self.k_rounds, self.k_final = jax.random.split(seed_key(fit.seed), 3)
        self.k_server, self.k_clients = setup_keys(self.k_init)
        self.clients = stack_clients(data)
        self.participation = float(run.participation)
        self._templates: dict[str, Any] = {}  # the round's message structures, traced when first needed
        self.plan = engine.fit_jit(
            lambda k: round_plan(self.k_rounds, k, data.num_clients, self.cohort, self.participation)
        )
        self._setup_templates()
        if role == "server":
            policy = fit.fault_policy
            if spec.secure_aggregation is not None:  # the server sees sums: a screen of single uploads cannot apply
                policy = policy or FaultPolicy()
                if policy.max_abs is not None:
                    raise ConfigError(
                        "FaultPolicy(max_abs=...) bounds one upload; under secure aggregation the server "
                        "sees only their sum: leave max_abs=None (clients flag their own non-finite uploads)"
                    )
                policy = dataclasses.replace(policy, relative=None)

            def serve(server_state, payload, bits, broadcast_bits, expected, received, k, cohort, k_server, k_shared):
                return server_half(
                    run,
                    server_state,
                    wire.decode_tree(payload),
                    bits,
                    broadcast_bits,
                    expected,
                    received,
                    policy,
                    k,
                    cohort,
                    data.num_clients,
                    k_server,
                    k_shared,
                )

            self.serve = engine.fit_jit(serve)
            if run.resyncs:
                self.resync_message = engine.fit_jit(run.resync_message)
            if run.final_exchange:
                self.final_message = engine.fit_jit(run.final_message, once=0)
            return
        # compiled as fed_fit compiles them (fedbayes.engine.fit_jit: the unrolled hash; what runs once, as the
        # simulation's set-up and final exchanges over a federation of n clients), so that a node's floats are
        # the simulation's
        n = data.num_clients
        self.setup_step = [
            engine.fit_jit(
                lambda key, payload, state, member, s=s: run.setup_client(s, key, payload, state, member), once=n
            )
            for s in range(run.setup_stages)
        ]
        self.client_step = engine.fit_jit(
            lambda key, payload, state, member: run.client_step(key, wire.decode_tree(payload), state, member)
        )
        if run.resyncs:
            self.resync = engine.fit_jit(lambda state, payload: run.resync(state, wire.decode_tree(payload)))
        if run.final_exchange:
            self.final_client = engine.fit_jit(
                lambda key, payload, state, member: run.final_client(key, wire.decode_tree(payload), state, member),
                once=n,
            )
        self.finish: Callable[..., Any] | None = None
        if run.replies:
            self.finish = engine.fit_jit(
                lambda reply, state, member, upload: run.client_finish(
                    wire.decode_tree(reply), state, member, wire.decode_tree(upload)
                )
            )

    def _setup_templates(self) -> None:
        """Every set-up message's structure, the client state's and the first broadcast's, by
        ``jax.eval_shape`` along the set-up (shapes only: nothing is computed)."""
        run, n = self.run, self.data.num_clients
        member = self.member(0)
        key = jax.random.PRNGKey(0)
        server_state, payload = jax.eval_shape(run.setup_server, key)
        state = None
        self.setup_payloads, self.setup_states, self.setup_uploads = [], [], []
        for s in range(run.setup_stages):
            self.setup_payloads.append(payload)
            state, upload = jax.eval_shape(
                lambda k, p, c, m, s=s: run.setup_client(s, k, p, c, m), key, payload, state, member
            )
            self.setup_states.append(jax.tree_util.tree_structure(state))
            self.setup_uploads.append(upload)
            stacked = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((n, *a.shape), a.dtype), upload)
            server_state, payload = jax.eval_shape(
                lambda k, st, u, s=s: run.setup_server_step(s, k, st, u), key, server_state, stacked
            )
        self.state_template, self.server_template = state, server_state
        # what the clients receive once after set-up (the server state's structure is fixed at set-up)
        self.settings_template = jax.eval_shape(run.client_settings, server_state)
        self.broadcast_template = payload.payload
        self.resync_template = None  # an algorithm whose clients keep a copy of server state
        if run.resyncs:
            self.resync_template = jax.eval_shape(run.resync_message, server_state).payload

    def state_def(self, stage: int | None = None) -> Any:
        return self.setup_states[-1 if stage is None else stage]

    def upload_template(self) -> Any:
        """A round's upload structure (traced when first needed; the client settings enter as a template)."""
        if "upload" not in self._templates:
            member = self.member(0, 0, jax.random.PRNGKey(0))
            shapes = jax.eval_shape(
                lambda k, b, c, m: self.run.client_step(k, wire.decode_tree(b), c, m),
                jax.random.PRNGKey(0),
                self.broadcast_template,
                self.state_template,
                member._replace(settings=self.settings_template),
            )
            self._templates["upload"] = shapes[1].payload
        return self._templates["upload"]

    def final_templates(self) -> tuple[Any, Any, Any]:
        """The final exchange's structures: (payload, what the client keeps, its upload)."""
        if "final" not in self._templates:
            key = jax.random.PRNGKey(0)
            payload = jax.eval_shape(self.run.final_message, key, self.server_template)
            local, upload = jax.eval_shape(
                self.run.final_client,
                key,
                payload,
                self.state_template,
                self.member(0, settings=self.settings_template),
            )
            self._templates["final"] = payload, local, upload
        return self._templates["final"]

    def reply_template(self) -> Any:
        """The structure of the server's reply to a cohort member (None: no reply)."""
        if "reply" not in self._templates:
            self._templates["reply"] = (
                jax.eval_shape(self.reply_payload, self.broadcast_template) if self.run.replies else None
            )
        return self._templates["reply"]

    def member(
        self, i: int, slot: int | None = None, shared_key: jax.Array | None = None, settings: Any = None
    ) -> ClientData:
        """Client ``i``'s data (and, in a round, its slot and the round's public key; after set-up the
        client settings it received)."""
        one = jax.tree_util.tree_map(lambda a: a[i], self.clients)
        return one._replace(slot=None if slot is None else jnp.asarray(slot), shared_key=shared_key, settings=settings)

    def settings_of(self, context: Context) -> Any:
        """The client settings this node received after set-up (kept in its ``context.state``)."""
        if not jax.tree_util.tree_leaves(self.settings_template):
            return self.settings_template
        return _load(context, _SETTINGS, jax.tree_util.tree_structure(self.settings_template))

    def reply_payload(self, payload: Any) -> Any:
        return self.run.finish_message(wire.decode_tree(payload))


_RUNTIMES: dict[tuple[str, str], _Runtime] = {}
_RESULTS: dict[str, Any] = {}


def _runtime(spec: FlowerSpec, role: str) -> _Runtime:
    if (spec.token, role) not in _RUNTIMES:
        _RUNTIMES[(spec.token, role)] = _Runtime(spec, role)
    return _RUNTIMES[(spec.token, role)]


def _forget(token: str) -> None:
    for role in ("server", "client"):
        _RUNTIMES.pop((token, role), None)


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


_STATE, _PENDING, _META, _LOCAL = "fedbayes.state", "fedbayes.pending", "fedbayes.meta", "fedbayes.local"
_UPLOAD = _STATE + ".upload"  # a client's last upload, kept until the server's reply
_SETTINGS = "fedbayes.settings"


def pack_settings(settings: Any) -> bytes:
    """The client settings on the wire: every element as a float64 (:data:`fedbayes.protocol.SETTING_BITS`);
    also the vector a client hands to secure aggregation."""
    flat = [np.ravel(np.asarray(x, np.float64)) for x in jax.tree_util.tree_leaves(settings)]
    return (np.concatenate(flat) if flat else np.zeros(0)).tobytes()


def unpack_settings(data: bytes, template: Any) -> Any:
    """The settings of ``template``'s structure, shapes and dtypes from :func:`pack_settings`' bytes."""
    values, start, leaves = np.frombuffer(data, dtype=np.float64), 0, []
    for t in jax.tree_util.tree_leaves(template):
        size = int(np.prod(t.shape, dtype=np.int64))
        leaves.append(jnp.asarray(values[start : start + size].reshape(t.shape), dtype=t.dtype))
        start += size
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(template), leaves)


def _save(context: Context, name: str, tree: Any) -> None:
    context.state[name] = ArrayRecord([np.asarray(x) for x in jax.tree_util.tree_leaves(tree)])


_R = TypeVar("_R", ArrayRecord, ConfigRecord)


def _stored(context: Context, name: str, kind: type[_R]) -> _R:
    """The record ``name`` of this node's ``context.state``, of the kind fedbayes keeps there."""
    record = context.state[name]
    if not isinstance(record, kind):
        raise FedbayesError(f"context.state[{name!r}] is a {type(record).__name__}, not a {kind.__name__}")
    return record


def _load(context: Context, name: str, treedef: Any) -> Any:
    leaves = _stored(context, name, ArrayRecord).to_numpy_ndarrays()
    return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a) for a in leaves])


def _client_index(context: Context) -> int:
    config = context.node_config
    for key in ("client-id", "partition-id"):
        if key in config:
            return int(config[key])
    raise ConfigError("a fedbayes ClientApp needs node_config 'partition-id' (simulation) or 'client-id' (deployment)")


def _settle(context: Context, rt: _Runtime, accepted: int) -> Any:
    """The client's committed state after the server's verdict on its pending upload: kept when the
    server accepted it (``accepted`` names that round), dropped when it was rejected or never arrived."""
    if _META not in context.state:
        raise FedbayesError("a round reached a client before its set-up: the server must run the set-up exchange first")
    meta = _stored(context, _META, ConfigRecord)
    pending = int(cast(int, meta["pending"]))  # a round, or -1: fedbayes stores an int there
    if pending >= 0:
        if pending == accepted:
            context.state[_STATE] = context.state[_PENDING]
        meta["pending"] = -1
    return _load(context, _STATE, rt.state_def())


def _snapshot(context: Context, index: int, round_: int, tag: str | None = None) -> None:
    """Write this client's state records to its node's snapshot folder (node config ``fedbayes-state``), in the
    run's own subfolder (``tag``: the server's checkpoint's, from the set-up; default: as the set-up stored
    it), as after a message of round ``round_`` (-1: the set-up); nothing without that folder or a tag (a run
    whose server keeps no checkpoint)."""
    folder = context.node_config.get(_resume.STATE_KEY)
    if tag is None:
        tag = str(_stored(context, _META, ConfigRecord).get("tag", "")) if _META in context.state else ""
    if not folder or not tag:
        return
    records = {
        name: _stored(context, name, ArrayRecord).to_numpy_ndarrays()
        for name in (_STATE, _PENDING, _SETTINGS)
        if name in context.state
    }
    upload = _stored(context, _UPLOAD, ArrayRecord)[""].data if _UPLOAD in context.state else None
    pending = int(cast(int, _stored(context, _META, ConfigRecord)["pending"])) if _META in context.state else -1
    _resume.write_snapshot(_resume.snapshot_folder(str(folder), tag), index, round_, records, upload, pending)


def _restore(context: Context, index: int, at_most: int, tag: str) -> int:
    """Replace this client's state records by its node's newest snapshot of a round <= ``at_most``; its round."""
    folder = context.node_config.get(_resume.STATE_KEY)
    if not folder:
        raise CheckpointError(
            f"client {index}'s node keeps no state snapshots: start its SuperNode with --node-config "
            f"'{_resume.STATE_KEY}=\"<folder>\"' (the same folder as in the interrupted run) to resume"
        )
    where = _resume.snapshot_folder(str(folder), tag)
    round_, records, upload, pending = _resume.read_snapshot(where, index, at_most)
    _resume.drop_after(where, index, at_most)  # the stopped run's later rounds: replayed, never to be restored
    for name in (_STATE, _PENDING, _SETTINGS, _UPLOAD):
        if name in context.state:
            del context.state[name]
    for name, arrays in records.items():
        context.state[name] = ArrayRecord(arrays)
    if upload is not None:
        context.state[_UPLOAD] = ArrayRecord({"": Array(dtype="uint8", shape=(len(upload),), stype="raw", data=upload)})
    context.state[_META] = ConfigRecord({"pending": pending, "tag": tag})
    return round_


OUTPUT_KEY = "fedbayes-output"
"""The node-config key of a folder where a SuperNode writes its personal posterior
(:func:`write_personal_posterior`), e.g. ``flower-supernode --node-config 'fedbayes-output="/data/out"'``."""


def write_personal_posterior(folder: str, index: int, fm: FedModel, local: Any) -> Path:
    """Write client ``index``'s part of the final exchange (its personal posterior) to
    ``folder/client-<index>.npz`` on its own node, atomically: sample sites constrained to the model's
    space (FedSOUL's ``local_samples/<site>`` as (chains, draws, ...), FedMM's ``draws/<site>`` as
    (draws, ...)), the rest as computed (``step_size``, ``responsibilities``, ``mean``, ``cov``)."""
    out: dict[str, np.ndarray] = {}
    for name, value in dict(local).items():
        if name in ("local_samples", "draws"):
            constrain = jax.vmap(fm.constrain)
            if name == "local_samples":
                constrain = jax.vmap(constrain)
            value = constrain(value)
        if isinstance(value, Mapping):
            out.update({f"{name}/{site}": np.asarray(v) for site, v in value.items()})
        else:
            out[name] = np.asarray(value)
    path = Path(folder) / f"client-{index}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        # as Any: numpy's stub has an ``allow_pickle: bool`` keyword that a ``**dict[str, ndarray]`` could fill
        np.savez(fh, **cast(dict[str, Any], out))
    os.replace(tmp, path)
    return path


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
    ``spec`` may be a function of the run config (``flwr run``'s ``[tool.flwr.app.config]``). A node whose
    config names a folder under ``"fedbayes-output"`` (``flower-supernode --node-config
    "client-id=3 fedbayes-output='/data/out'"``) also writes its personal posterior there after the
    final exchange (:func:`write_personal_posterior`): it never leaves the node, and outlives the run."""
    app = ClientApp()
    spec_of = spec

    def _runtime_of(context: Context) -> _Runtime:
        return _runtime(_resolve(spec_of, context), "client")

    def _precise(handler: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
        """``handler`` with its computations traced at the spec's matmul precision."""

        @functools.wraps(handler)
        def run(msg: Message, context: Context) -> Message:
            with engine.matmul_precision(_resolve(spec_of, context).matmul_precision):
                return handler(msg, context)

        return run

    def _setup_stage(stage: int, data: bytes, context: Context, h: Mapping[str, Any]) -> Any:
        """One set-up stage on this client: its state started from its own data and saved; its upload."""
        rt, index = _runtime_of(context), _client_index(context)
        payload = wire.unpack(data, rt.setup_payloads[stage])
        state = None if stage == 0 else _load(context, _STATE, rt.state_def(stage - 1))
        key = setup_client_key(rt.k_clients, jnp.asarray(index), stage)
        state, upload = rt.setup_step[stage](key, payload, state, rt.member(index))
        _save(context, _STATE, state)
        context.state[_META] = ConfigRecord({"pending": -1, "tag": str(h.get("tag", ""))})
        if not h.get("resume"):  # a resumed run's set-up rebuilds the state's structure; the node's snapshots stand
            _snapshot(context, index, -1)
        return jax.device_get(upload)

    def _step(h: Mapping[str, Any], data: bytes, context: Context) -> tuple[Any, bytes, int]:
        """A round's client step: the committed state after the server's verdict, the step on the
        broadcast, the new state kept pending; ``(upload payload, its bytes, its bits)``."""
        rt, index = _runtime_of(context), _client_index(context)
        state = _settle(context, rt, int(h["accepted"]))
        k, slot = int(h["round"]), int(h["slot"])
        _, _, keys, _, k_shared, _ = rt.plan(jnp.asarray(k))
        key = keys[slot]  # the engine's key for this client in this round
        member = rt.member(index, slot, k_shared, rt.settings_of(context))
        payload = wire.unpack(data, rt.broadcast_template, wire.Context(k_shared, slot))
        new_state, upload = rt.client_step(key, payload, state, member)
        _save(context, _PENDING, new_state)
        _stored(context, _META, ConfigRecord)["pending"] = k
        payload = jax.device_get(upload.payload)
        data, bits = wire.pack(payload, wire.Context(k_shared, slot))
        if bits != int(upload.bits):
            raise FedbayesError(
                f"{rt.run.name}: the upload's encoding has {bits} bits, its ledger entry {int(upload.bits)}"
            )
        context.state[_UPLOAD] = ArrayRecord({"": Array(dtype="uint8", shape=(len(data),), stype="raw", data=data)})
        _snapshot(context, index, k)
        return payload, data, bits

    @app.train("setup")
    @_precise
    def setup(msg: Message, context: Context) -> Message:
        """One set-up stage: the server's payload in, this client's state started from its own data,
        its upload back. After the last stage, the client settings (e.g. TAMUNA's step size), kept in
        ``context.state`` for the client's later stages."""
        rt, h = _runtime_of(context), _header(msg)
        stage = int(h["stage"])
        if stage == rt.run.setup_stages:
            _save(context, _SETTINGS, unpack_settings(_data(msg), rt.settings_template))
            if not h.get("resume"):
                _snapshot(context, _client_index(context), -1, str(h.get("tag", "")))
            return Message(_content(b"", {}), reply_to=msg)
        data, _ = wire.pack(_setup_stage(stage, _data(msg), context, h))
        return Message(_content(data, {}), reply_to=msg)

    @app.train("step")
    @_precise
    def step(msg: Message, context: Context) -> Message:
        _, data, bits = _step(_header(msg), _data(msg), context)
        return Message(_content(data, {"bits": bits}), reply_to=msg)

    @app.train(mods=[secaggplus_mod])
    @_precise
    def secure(msg: Message, context: Context) -> Message:
        """A set-up stage or a round's step whose upload the server receives only summed (secure
        aggregation, :mod:`fedbayes.flower._secagg`): Flower's ``secaggplus_mod`` runs SecAgg+ around this
        handler, which it calls with fedbayes' message in the FitIns config and whose upload (decoded,
        flattened, float64) it masks."""
        from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
        from flwr.compat.common import recorddict_compat

        cfg = msg.content.config_records["fitins.config"]
        # fedbayes' message fields (header, "kind", "stage", "data": see _Server._secure_sum)
        h: dict[str, Any] = {
            k[len(_secagg.CONFIG) + 1 :]: v for k, v in cfg.items() if k.startswith(_secagg.CONFIG + ".")
        }
        if h["kind"] == "setup":
            upload = _setup_stage(int(h["stage"]), h["data"], context, h)
            bits = engine.dense_bits(upload)
        else:
            payload, _, bits = _step(h, h["data"], context)
            upload = wire.decode_tree(payload)
        vector = np.frombuffer(pack_settings(upload), np.float64)
        # Flower would quantise a NaN to a finite integer and spoil the sum unseen: a non-finite upload is
        # sent as zeros (adding nothing) and flagged, and the server counts this client as failed
        nonfinite = not np.all(np.isfinite(vector))
        res = FitRes(
            status=Status(Code.OK, ""),
            parameters=ndarrays_to_parameters([np.where(nonfinite, 0.0, vector)]),
            num_examples=1,
            metrics={f"{_secagg.CONFIG}.bits": int(bits), f"{_secagg.CONFIG}.nonfinite": int(nonfinite)},
        )
        return Message(recorddict_compat.fitres_to_recorddict(res, False), reply_to=msg)

    @app.train("resync")
    @_precise
    def resync(msg: Message, context: Context) -> Message:
        """The server's copy of its state (P-/B-ELF's w), re-sent after this client's fault, before its
        next step: the committed state takes it (``resync``)."""
        rt, h = _runtime_of(context), _header(msg)
        state = _settle(context, rt, int(h["accepted"]))
        state = rt.resync(state, wire.unpack(_data(msg), rt.resync_template))
        _save(context, _STATE, state)
        _snapshot(context, _client_index(context), int(h["round"]))
        return Message(_content(b"", {}), reply_to=msg)

    @app.train("finish")
    @_precise
    def finish(msg: Message, context: Context) -> Message:
        rt, index = _runtime_of(context), _client_index(context)
        h = _header(msg)
        k, slot = int(h["round"]), int(h["slot"])
        _, _, _, _, k_shared, _ = rt.plan(jnp.asarray(k))
        ctx = wire.Context(k_shared, slot)
        member = rt.member(index, slot, k_shared, rt.settings_of(context))
        reply = wire.unpack(_data(msg), rt.reply_template(), ctx)
        own = wire.unpack(_stored(context, _UPLOAD, ArrayRecord)[""].data, rt.upload_template(), ctx)
        pending = _load(context, _PENDING, rt.state_def())
        if rt.finish is None:  # the server sends "finish" only to a run with replies
            raise FedbayesError(f"{rt.run.name}: a reply reached a client of a run without replies")
        new_state, _ = rt.finish(reply, pending, member, own)
        _save(context, _STATE, new_state)  # the server accepted the upload: commit
        _stored(context, _META, ConfigRecord)["pending"] = -1
        _snapshot(context, index, k)
        return Message(_content(b"", {}), reply_to=msg)

    @app.train("final")
    @_precise
    def final(msg: Message, context: Context) -> Message:
        """The final exchange (:class:`fedbayes.protocol.FederatedRun`): the server's estimate in, this client's
        personal posterior computed from its own data and kept in ``context.state``, its upload back."""
        rt, index = _runtime_of(context), _client_index(context)
        state = _settle(context, rt, int(_header(msg)["accepted"]))
        payload_t = rt.final_templates()[0]
        local, upload = rt.final_client(
            rt.k_final, wire.unpack(_data(msg), payload_t), state, rt.member(index, settings=rt.settings_of(context))
        )
        _save(context, _LOCAL, local)
        if context.node_config.get(OUTPUT_KEY):
            write_personal_posterior(str(context.node_config[OUTPUT_KEY]), index, rt.model, local)
        data, bits = wire.pack(jax.device_get(upload))
        return Message(_content(data, {"bits": bits}), reply_to=msg)

    @app.query("local")
    @_precise
    def local(msg: Message, context: Context) -> Message:
        """What the final exchange left on this client (its personal posterior): collected by
        :func:`simulate` only, outside the ledger; a deployment's server never asks for it."""
        leaves = _stored(context, _LOCAL, ArrayRecord).to_numpy_ndarrays() if _LOCAL in context.state else []
        return Message(
            RecordDict({"local": ArrayRecord(leaves), HEADER: ConfigRecord({"client": _client_index(context)})}),
            reply_to=msg,
        )

    @app.query("hello")
    @_precise
    def hello(msg: Message, context: Context) -> Message:
        return Message(RecordDict({HEADER: ConfigRecord({"client": _client_index(context)})}), reply_to=msg)

    @app.query("restore")
    def restore(msg: Message, context: Context) -> Message:
        """A resumed run (after its set-up exchange): this client's state as its node's newest snapshot of a
        round <= the server checkpoint's; the reply names that round, or why there is none."""
        index = _client_index(context)
        reply: dict[str, int | str] = {"client": index}
        h = _header(msg)
        try:
            reply["round"] = _restore(context, index, int(h["round"]), str(h["tag"]))
        except CheckpointError as err:
            reply["error"] = str(err)
        return Message(RecordDict({HEADER: ConfigRecord(cast(Any, reply))}), reply_to=msg)

    return app


# ------------------------------------------------------------------------------ server


class _Grid(Protocol):
    """What the server loop uses of a Flower ``Grid`` (also :class:`LocalGrid`'s)."""

    def get_node_ids(self) -> Iterable[int]: ...

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]: ...


class _Server:
    """The server loop of :func:`server_app`, round by round as in :func:`fedbayes.engine.make_round`."""

    def __init__(self, spec: FlowerSpec, grid: _Grid):
        if spec.resume is not True and spec.resume is not False:
            raise ConfigError(f"resume must be True or False, got {spec.resume!r}")
        if spec.checkpoint is not None and not isinstance(spec.checkpoint, (str, os.PathLike)):
            raise ConfigError(f"checkpoint must be a file path or None, got {spec.checkpoint!r}")
        if spec.resume and spec.checkpoint is None:
            raise ConfigError("resume=True needs checkpoint=<the server's checkpoint file> to resume from")
        self.spec, self.grid, self.rt = spec, grid, _runtime(spec, "server")
        # names this run's snapshots on the nodes: new for a run with a checkpoint, the checkpoint's on a resume
        self.tag = (
            "" if spec.checkpoint is None else _resume.run_tag(spec.checkpoint, spec.resume, self._fingerprints())
        )
        self.accepted = np.full(self.rt.data.num_clients, -1)
        # Clients whose copy of server state is behind (a fault), to be re-sent it before their next step,
        # and the state that opened the previous round, from which that copy is built.
        self.stale: set[int] = set()
        self.opened: Any = None
        self.records: list[dict[str, np.ndarray]] = []
        self.seconds: list[float] = []  # each round's wall time
        self.message_bytes: list[tuple[str, int, int, int, int]] = []  # (kind, round, client, bytes, ledger bits)
        self.secure: _secagg.SecureSum | None = None
        cfg = spec.secure_aggregation
        if cfg is not None:
            if not isinstance(cfg, _secagg.SecAggPlus):
                raise ConfigError(
                    f"secure_aggregation must be a fb.flower.SecAggPlus or None, got {type(cfg).__name__}"
                )
            num = self.rt.data.num_clients
            cfg.check(self.rt.run, num)
            self.secure = _secagg.SecureSum(cfg, cfg.resolved_range(self.rt.run, num), spec.timeout)
            dp = getattr(self.rt.run, "_dp", None)
            if dp is not None and dp.dp.noise_seed is not None:
                warnings.warn(
                    "secure aggregation with DP(noise_seed=...): the server holds the noise seed (it is in "
                    "the algorithm's configuration), so it can recompute every client's noise share and "
                    "remove it from the sum; leave noise_seed=None outside tests",
                    UserWarning,
                    stacklevel=2,
                )

    def _secure_sum(self, k: int, configs: dict[int, dict[str, Any]]) -> tuple[np.ndarray | None, dict[int, int]]:
        """The sum of the uploads of the nodes in ``configs`` (node -> fedbayes' message fields) by SecAgg+,
        and the ledger bits each node in it reported."""
        client_of = {node: client for client, node in self.node_of.items()}
        if self.secure is None:  # called only with secure aggregation on
            raise FedbayesError("a secure sum was asked of a run without secure aggregation")
        fields = {node: {f"{_secagg.CONFIG}.{k_}": v for k_, v in cfg.items()} for node, cfg in configs.items()}
        return self.secure(self.grid, k, fields, client_of, self.message_bytes.append)

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
            raise FedbayesError(
                f"no Flower node hosts client(s) {missing[:10]}: start {num} SuperNodes, one per client"
            )

    def _to_every_client(
        self,
        kind: str,
        k: int,
        data: bytes,
        bits: int,
        reply_template: Any,
        header: Mapping[str, Any] | Callable[[int], Mapping[str, Any]],
    ) -> list[Any]:
        """One payload to every client (message type ``train.<kind>``, group ``k``, or ``"setup"`` when k
        is -1) and their replies, unpacked with ``reply_template`` in client order (None: no answer).
        Both directions go into ``message_bytes`` as ``kind`` and ``kind-reply``."""
        num = self.rt.data.num_clients
        msgs = []
        for client in range(num):
            head = header(client) if callable(header) else header
            msgs.append(
                Message(
                    _content(data, head),
                    dst_node_id=self.node_of[client],
                    message_type=f"train.{kind}",
                    group_id="setup" if k < 0 else str(k),
                )
            )
            self.message_bytes.append((kind, k, client, len(data), bits))
        client_of = {node: client for client, node in self.node_of.items()}
        uploads: list[Any] = [None] * num
        for node, reply in self._send(msgs).items():
            client = client_of[node]
            uploads[client] = wire.unpack(_data(reply), reply_template)
            self.message_bytes.append(
                (f"{kind}-reply", k, client, payload_bytes(reply), engine.dense_bits(reply_template))
            )
        return uploads

    def setup(self) -> None:
        """The algorithm's set-up exchange with every client (:func:`fedbayes.engine.staged_setup`), then
        the client settings (``client_settings``, float64 each); every message's bytes go into ``message_bytes``
        as kind ``"setup"``."""
        rt, run, num = self.rt, self.rt.run, self.rt.data.num_clients
        # with a checkpoint, the run's tag names the nodes' snapshot folders; a resumed run's set-up leaves them
        resuming = ({"tag": self.tag} if self.tag else {}) | ({"resume": 1} if self.spec.resume else {})

        def exchange(stage: int, k_clients: jax.Array, payload: Any) -> Any:
            data, bits = wire.pack(jax.device_get(payload))
            if self.secure is not None:  # the server needs the sum alone
                for client in range(num):
                    self.message_bytes.append(("setup", -1, client, len(data), bits))
                total, answered = self._secure_sum(
                    -1,
                    {self.node_of[c]: {"kind": "setup", "stage": stage, "data": data, **resuming} for c in range(num)},
                )
                if total is None or len(answered) < num:
                    raise FedbayesError(
                        f"{run.name}: {num - len(answered)} client(s) did not answer set-up stage {stage} "
                        "(secure aggregation), or sent non-finite values; the set-up needs every client"
                    )
                return _summed(rt.setup_uploads[stage], total, num, 0)
            uploads = self._to_every_client(
                "setup", -1, data, bits, rt.setup_uploads[stage], {"stage": stage, **resuming}
            )
            missing = [c for c in range(num) if uploads[c] is None]
            if missing:
                raise FedbayesError(
                    f"{run.name}: client(s) {missing[:10]} did not answer set-up stage {stage}; the "
                    "set-up needs every client (it starts their states and sums their statistics)"
                )
            return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *uploads)

        rt.server_state, rt.broadcast, self.setup_bits = engine.staged_setup(run, rt.k_init, num, exchange)
        settings = jax.device_get(run.client_settings(rt.server_state))
        if jax.tree_util.tree_leaves(settings):
            data = pack_settings(settings)
            acks = self._to_every_client(
                "setup", -1, data, engine.setting_bits(settings), (), {"stage": run.setup_stages, **resuming}
            )  # empty acknowledgements
            if any(ack is None for ack in acks):
                raise FedbayesError(f"{run.name}: a client did not acknowledge the client settings")

    def round(self, k: int) -> None:
        rt, cohort_size = self.rt, self.rt.cohort
        _, cohort, _, k_server, k_shared, expected = rt.plan(jnp.asarray(k))
        cohort, expected = np.asarray(cohort), np.asarray(expected)
        data, down_bits = wire.pack(jax.device_get(rt.broadcast.payload), wire.Context(k_shared, 0))
        if down_bits != int(rt.broadcast.bits):
            raise FedbayesError(
                f"{rt.run.name}: the broadcast's encoding has {down_bits} bits, its ledger entry "
                f"{int(rt.broadcast.bits)}"
            )
        resync_bits, missed = self._resync(k, cohort, expected)
        msgs, slot_of = [], {}
        for j in np.flatnonzero(expected & ~missed):
            client = int(cohort[j])
            node = self.node_of[client]
            header = {"round": k, "slot": int(j), "accepted": int(self.accepted[client])}
            msgs.append(Message(_content(data, header), dst_node_id=node, message_type="train.step", group_id=str(k)))
            slot_of[node] = int(j)
            self.message_bytes.append(("broadcast", k, client, len(data), down_bits))
        received = np.zeros(cohort_size, bool)
        bits = np.zeros(cohort_size, np.int32)
        upload_template = rt.upload_template()
        zero = jax.tree_util.tree_map(lambda t: np.zeros(t.shape, t.dtype), upload_template)
        if self.secure is not None:  # SecAgg+: the sum of the uploads, in the first answering slot's row
            total, answered = self._secure_sum(
                k, {m.metadata.dst_node_id: {**_header(m), "kind": "step", "data": data} for m in msgs}
            )
            for node, b in answered.items():
                received[slot_of[node]], bits[slot_of[node]] = True, b
            first = int(np.flatnonzero(received)[0]) if received.any() else 0
            stacked = _summed(wire.decode_tree(zero), total if total is not None else 0.0, cohort_size, first)
        else:
            replies = self._send(msgs)
            uploads = [None] * cohort_size
            for node, reply in replies.items():
                slot = slot_of[node]
                uploads[slot] = wire.unpack(_data(reply), upload_template, wire.Context(k_shared, slot))
                bits[slot] = int(_header(reply)["bits"])
                received[slot] = True
                self.message_bytes.append(("upload", k, int(cohort[slot]), payload_bytes(reply), int(bits[slot])))
            stacked = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *[u if u is not None else zero for u in uploads])
        state, new_broadcast, payload, record = rt.serve(
            rt.server_state,
            stacked,
            jnp.asarray(bits),
            rt.broadcast.bits,
            jnp.asarray(expected),
            jnp.asarray(received),
            jnp.asarray(k),
            jnp.asarray(cohort),
            k_server,
            k_shared,
        )
        active, faulty = np.asarray(record.pop("_active")), np.asarray(record.pop("_faulty"))
        reply_bits = np.zeros(cohort_size, np.int64)
        if rt.run.resyncs:
            self.stale |= {int(cohort[j]) for j in np.flatnonzero(faulty)}
            self.opened = rt.server_state  # this round's opening state: later resyncs are built from it
        for j in np.flatnonzero(active):
            self.accepted[int(cohort[j])] = k
        if rt.reply_template() is not None:  # the server's reply to the members that answered
            reply = rt.reply_payload(new_broadcast.payload)
            msgs = []
            for j in np.flatnonzero(active):
                client = int(cohort[j])
                data, reply_bits[j] = wire.pack(jax.device_get(reply), wire.Context(k_shared, int(j)))
                msgs.append(
                    Message(
                        _content(data, {"round": k, "slot": int(j)}),
                        dst_node_id=self.node_of[client],
                        message_type="train.finish",
                        group_id=str(k),
                    )
                )
                self.message_bytes.append(("reply", k, client, len(data), int(reply_bits[j])))
            self._send(msgs)
        # the ledger's rule (engine.downlink_bits); re-sent copies are charged when sent (fed_fit charges them in
        # the round of the fault), and a member whose copy did not arrive was sent no broadcast
        record["bits_down"] = np.asarray(
            engine.downlink_bits(down_bits, expected, reply_bits, resync_bits, reached=~missed)
        ).astype(np.int64)
        rt.server_state, rt.broadcast = state, new_broadcast
        self.records.append(jax.tree_util.tree_map(lambda x: np.asarray(x)[None], record))

    def _resync(self, k: int, cohort: np.ndarray, expected: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Re-send the stale members of round ``k`` their copy of server state, before the round's step.
        Returns the bits sent to each slot and the slots it did not reach (they get no step this round)."""
        bits = np.zeros(len(cohort), np.int64)
        missed = np.zeros(len(cohort), bool)
        todo = [int(j) for j in np.flatnonzero(expected) if int(cohort[j]) in self.stale]
        if not todo:
            return bits, missed
        again = self.rt.resync_message(self.opened)
        data, r_bits = wire.pack(jax.device_get(again.payload))
        if r_bits != int(again.bits):
            raise FedbayesError(
                f"{self.rt.run.name}: the resync's encoding has {r_bits} bits, its ledger entry {int(again.bits)}"
            )
        if not r_bits:  # LMC and D-ELF keep no copy: nothing to re-send
            self.stale.clear()
            return bits, missed
        msgs, slot_of = [], {}
        for j in todo:
            client = int(cohort[j])
            header = {"round": k, "accepted": int(self.accepted[client])}
            msgs.append(
                Message(
                    _content(data, header),
                    dst_node_id=self.node_of[client],
                    message_type="train.resync",
                    group_id=str(k),
                )
            )
            slot_of[self.node_of[client]] = j
            bits[j] = r_bits
            self.message_bytes.append(("resync", k, client, len(data), r_bits))
        arrived = {slot_of[node] for node in self._send(msgs)}
        for j in todo:
            if j in arrived:
                self.stale.discard(int(cohort[j]))
            else:
                missed[j] = True
        return bits, missed

    def final(self, collect_locals: bool) -> FitParts | dict[str, Any]:
        """The final exchange (:class:`fedbayes.protocol.FederatedRun`) with every client: the estimate out, the
        uploads back (kinds ``"final"`` / ``"final-reply"`` in ``message_bytes``, the run's ``final_bits``).
        With ``collect_locals`` (a simulation) each client's personal posterior is then fetched, outside
        the ledger. A client that does not answer costs the result what needs every upload (FedMM's
        information) and its own personal posterior (NaN), with a warning; the rest is kept."""
        rt, run, num = self.rt, self.rt.run, self.rt.data.num_clients
        k = rt.fit.num_rounds  # the final exchange's group: the round after the last
        payload_t, local_t, upload_t = rt.final_templates()
        data, bits = wire.pack(jax.device_get(rt.final_message(rt.k_final, rt.server_state)))
        sent = wire.decode_tree(wire.unpack(data, payload_t))  # the estimate as the clients read it
        uploads = self._to_every_client(
            "final", k, data, bits, upload_t, lambda client: {"accepted": int(self.accepted[client])}
        )
        missing = [c for c in range(num) if uploads[c] is None]
        if missing:
            warnings.warn(
                f"{run.name}: client(s) {missing[:10]} did not answer the final exchange; the result has "
                "neither what needs every client (FedMM's information) nor their personal posteriors",
                RuntimeWarning,
                stacklevel=3,
            )
        answered = [c for c in range(num) if uploads[c] is not None]
        locals_ = self._collect_locals(local_t, answered) if collect_locals else None
        arrived = jax.tree_util.tree_map(lambda *xs: np.stack(xs), *[uploads[c] for c in answered]) if answered else ()
        parts = run.final_server(rt.k_final, rt.server_state, sent, None if missing else arrived, locals_)
        parts["final_bits"] = engine.final_bits(sent, arrived, num)  # sent to all, back from those answering
        return parts

    def _collect_locals(self, local_t: Any, clients: list[int]) -> Any:
        """The personal posteriors the final exchange left on ``clients`` (a simulation's result only,
        outside the ledger), stacked over all clients; a client not asked or not answering: NaN."""
        msgs = [Message(RecordDict({}), dst_node_id=self.node_of[c], message_type="query.local") for c in clients]
        leaves_t, treedef = jax.tree_util.tree_flatten(local_t)
        num = self.rt.data.num_clients
        stacked = [
            np.full((num, *t.shape), np.nan, t.dtype)
            if np.issubdtype(t.dtype, np.floating)
            else np.zeros((num, *t.shape), t.dtype)
            for t in leaves_t
        ]
        got = set()
        for reply in self._send(msgs).values():
            client = int(_header(reply)["client"])
            for leaf, value in zip(stacked, reply.content.array_records["local"].to_numpy_ndarrays()):
                leaf[client] = value
            got.add(client)
        if set(clients) - got:
            warnings.warn(
                f"client(s) {sorted(set(clients) - got)[:10]} did not return their personal posteriors "
                "(NaN in the result)",
                RuntimeWarning,
                stacklevel=3,
            )
        return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(x) for x in stacked])

    def _fingerprints(self) -> dict[str, Any]:
        rt = self.rt
        return _fingerprints(rt.fit, rt.model, rt.cohort, _data_digest(rt.data))

    def _history(self, records: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The rounds' host history, with each round's own wall time (a resumed run's earlier rounds' from the
        checkpoint)."""
        history = host_records(records, 0.0)
        history["seconds"] = np.asarray(self.seconds[: len(history["seconds"])], dtype=np.float64)
        return history

    def checkpoint(self, k: int) -> None:
        """Write the server's checkpoint after round ``k`` (-1: the set-up), where the spec names one."""
        if self.spec.checkpoint is None:
            return
        rt = self.rt
        opened = self.opened if self.opened is not None else rt.server_state
        extra = {
            "accepted": self.accepted.tolist(),
            "stale": sorted(self.stale),
            "opened": self.opened is not None,
            "message_bytes": [list(m) for m in self.message_bytes],
            "seconds": self.seconds,
            "tag": self.tag,
        }
        trees = (rt.server_state, rt.broadcast, opened)  # on the device: their weak types are recorded
        _resume.save_server(self.spec.checkpoint, k, self._fingerprints(), trees, _concatenated(self.records), extra)

    def resume(self) -> int:
        """After the set-up exchange: the server's state from its checkpoint, every client's from its node's
        snapshots (:mod:`fedbayes.flower._resume`); the round the checkpoint was written after."""
        rt, path = self.rt, cast(str, self.spec.checkpoint)
        template = (rt.server_state, rt.broadcast, rt.server_state)
        k, trees, history, extra = _resume.load_server(path, self._fingerprints(), template)
        rt.server_state, rt.broadcast, opened = trees
        self.opened = opened if extra["opened"] else None
        self.accepted = np.asarray(extra["accepted"], dtype=self.accepted.dtype)
        self.stale = set(extra["stale"])
        self.records = [history] if history else []
        self.message_bytes = [tuple(m) for m in extra["message_bytes"]]  # the set-up's were counted once
        self.seconds = [float(x) for x in extra["seconds"]]
        msgs = [
            Message(_content(b"", {"round": k, "tag": self.tag}), dst_node_id=node, message_type="query.restore")
            for node in self.node_of.values()
        ]
        replies = {int(_header(r)["client"]): _header(r) for r in self._send(msgs).values()}
        problems = [
            f"client {c}: " + str(replies[c]["error"] if c in replies else "no answer")
            for c in range(rt.data.num_clients)
            if c not in replies or "error" in replies[c]
        ]
        if problems:
            raise CheckpointError(
                f"{rt.run.name} on Flower cannot resume after {_after(k)}: " + "; ".join(problems[:5])
            )
        return k

    def run(self, collect_locals: bool = False) -> Result:
        rt, spec = self.rt, self.spec
        self.connect()
        self.setup()
        start = self.resume() + 1 if spec.resume else 0
        if not spec.resume:
            self.checkpoint(-1)
        bar = Progress(spec.num_rounds, f"{rt.run.name} on Flower", spec.progress)
        min_clients = (spec.fault_policy or FaultPolicy()).min_clients
        for k in range(start, spec.num_rounds):
            t0 = time.perf_counter()
            self.round(k)
            if first_short_round(fault_counts(self.records[-1]), min_clients) is not None:
                done = self.records[:-1]
                before = self._history(_concatenated(done)) if done else {}
                raise TooFewClientsError(
                    f"{rt.run.name} on Flower: round {k} left fewer answering clients than min_clients={min_clients}"
                    + (f"; resume from the checkpoint after {_after(k - 1)} (resume=True)" if spec.checkpoint else ""),
                    round=k,
                    history=public_history(before) if done else {},
                )
            self.seconds.append(time.perf_counter() - t0)
            self.checkpoint(k)
            bar.update(k + 1)
        history = self._history(_concatenated(self.records))
        problem = Problem(FedModel(rt.fit.model, rt.data, rt.fit.model_kwargs), rt.data, rt.fit.num_rounds, rt.cohort)
        parts: FitParts | dict[str, Any]
        if rt.run.final_exchange:
            parts = self.final(collect_locals)
            records = rt.run.record_parts(rt.k_final, rt.server_state, problem, history)
            if records is not None:  # a run with both (JointLMC: the globals' draws, the clients' own draws)
                parts = with_final_parts(records, parts)
        else:  # the result is the server's alone (the samplers' draws, TAMUNA's x): no client state is read
            parts = rt.run.finalize(rt.k_final, (rt.server_state, None, rt.broadcast), problem, history=history)
        parts = engine.with_init_bits(parts, self.setup_bits)
        if self.secure is not None and parts.privacy:
            parts.privacy = {**parts.privacy, "secure_aggregation": "SecAgg+ (Flower)"}
        fm = FedModel(rt.fit.model, rt.fit.data, rt.fit.model_kwargs)
        result = Result(
            model=fm,
            data=rt.fit.data,
            run=rt.run,
            algorithm=rt.run.name,
            seed=spec.seed,
            parts=parts,
            history=public_history(history),
        )
        result.faults = fault_table(history, rt.k_rounds, rt.data.num_clients, rt.cohort)
        # a Flower run's extra attribute (Result declares it, unset elsewhere)
        result.flower_messages = self.message_bytes
        return result


def _after(k: int) -> str:
    """What a checkpoint written after round ``k`` follows: that round, or (-1) the set-up."""
    return "the set-up" if k < 0 else f"round {k}"


def _concatenated(records: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """The per-round records joined along the rounds (empty for no round)."""
    return {name: np.concatenate([r[name] for r in records]) for name in records[0]} if records else {}


def _summed(template: Any, total: Any, n: int, row: int) -> Any:
    """Uploads of ``template``'s structure stacked for ``n`` clients, zero but for row ``row``, which holds
    ``total`` (the flat sum of the uploads that secure aggregation returns): the server step sums its
    uploads, so it sees the same sum."""
    size = sum(int(np.prod(t.shape, dtype=np.int64)) for t in jax.tree_util.tree_leaves(template))
    one = unpack_settings(np.broadcast_to(np.asarray(total, np.float64), (size,)).tobytes(), template)

    def stacked(t, v):
        rows = np.zeros((n,) + tuple(t.shape), t.dtype)
        rows[row] = np.asarray(v)
        return rows

    return jax.tree_util.tree_map(stacked, template, one)


def run_server(spec: FlowerSpec, grid: Grid | LocalGrid, collect_locals: bool = False) -> Result:
    """Run ``spec``'s algorithm over the nodes of ``grid`` (inside a ServerApp's ``main``) and return the
    :class:`fedbayes.Result`: the global estimate (and the samplers' draws), the ledger and
    ``flower_messages``. The clients' personal posteriors (FedSOUL's local samples, FedMM's local
    posteriors) are computed in the final exchange and stay on their nodes, in ``context.state``;
    ``collect_locals=True`` fetches them into the result, outside the ledger, as a simulation does
    (:func:`simulate`); leave it off in a deployment."""
    with engine.matmul_precision(spec.matmul_precision):
        return _Server(spec, grid).run(collect_locals)


def server_app(spec: FlowerSpec, collect_locals: bool = False) -> ServerApp:
    """A ServerApp running ``spec``'s algorithm for ``spec.num_rounds`` rounds over the connected nodes
    (``collect_locals``: see :func:`run_server`)."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        _RESULTS[spec.token] = run_server(spec, grid, collect_locals)

    return app


# ------------------------------------------------------------------------------ in-process grid


class LocalGrid:
    """A Flower ``Grid`` that delivers messages to ClientApps in this process, one after another: the
    message protocol of a deployment without its transport, for debugging and for tests.
    ``unreachable(round, client) -> bool`` makes a node fail to answer (Flower's NODE_UNAVAILABLE) in a
    round, or with ``round == num_rounds`` in the final exchange (the set-up always reaches every node).
    ``node_config`` is added to every node's (e.g. ``{"fedbayes-output": folder}``)."""

    def __init__(
        self,
        app: ClientApp,
        num_clients: int,
        unreachable: Callable[[int, int], bool] | None = None,
        run_config: Mapping[str, Any] | None = None,
        node_config: Mapping[str, Any] | None = None,
    ):
        self.app, self.unreachable = app, unreachable
        self.contexts = {
            i + 1: Context(
                run_id=0,
                node_id=i + 1,
                node_config={**dict(node_config or {}), "partition-id": i, "num-partitions": num_clients},
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for i in range(num_clients)
        }
        self._ids = itertools.count(1)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = f"m{next(self._ids)}"
            node = msg.metadata.dst_node_id
            client = int(self.contexts[node].node_config["partition-id"])
            k = msg.metadata.group_id
            if self.unreachable is not None and (k or "").isdigit() and self.unreachable(int(k), client):
                reply = Message(Error(code=NODE_UNAVAILABLE, reason="unreachable"), reply_to=msg)
            else:
                reply = self.app(msg, self.contexts[node])
            reply.metadata.__dict__["_src_node_id"] = node
            replies.append(reply)
        return replies


@contextlib.contextmanager
def _server_identity():
    """Flower's task identity of this process set to the server's while a :class:`LocalGrid` runs."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = {name: getattr(TaskIdentity, name) for name in ("_run_id", "_node_id", "_task_id")}
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 0, 0, 0
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(TaskIdentity, name, value)


def _check_simulate_options(
    backend: object, num_cpus_per_client: object, timeout: object, progress: object, unreachable: object
) -> None:
    """ConfigError, before anything runs, for a ``simulate`` option of the wrong kind."""
    if backend not in ("ray", "local"):
        raise ConfigError(f"backend must be 'ray' or 'local', got {backend!r}")
    if unreachable is not None and not callable(unreachable):
        raise ConfigError(
            f"unreachable must be a function (round, client) -> bool, got {unreachable!r}; e.g. "
            "unreachable=lambda r, c: c == 3 makes client 3 miss every round"
        )
    if unreachable is not None and backend != "local":
        raise ConfigError("unreachable= needs backend='local' (Ray's nodes cannot be switched off per round)")
    for name, value, allow_none in (("num_cpus_per_client", num_cpus_per_client, False), ("timeout", timeout, True)):
        if value is None and allow_none:
            continue
        if not (is_real(value) and math.isfinite(value) and value > 0):
            kind = "a positive finite number" + (" or None" if allow_none else "")
            raise ConfigError(f"{name} must be {kind}, got {value!r}")
    check_progress(progress)


def simulate(
    model: Callable,
    data: FederatedData | Mapping[str, Any],
    algorithm: Any = "fedsoul",
    *,
    num_rounds: int = 500,
    clients_per_round: int | float | None = None,
    seed: int = 0,
    model_kwargs: Mapping[str, Any] | None = None,
    fault_policy: FaultPolicy | None = None,
    backend: str = "ray",
    num_cpus_per_client: float = 1.0,
    timeout: float | None = 600.0,
    progress: bool | None = None,
    unreachable: Callable[[int, int], bool] | None = None,
    secure_aggregation: Any = None,
    matmul_precision: str | None = "highest",
) -> Result:
    """Run ``algorithm`` on Flower in this process and return the :class:`fedbayes.Result` of
    :func:`fedbayes.fed_fit` with the same arguments.

    ``backend="ray"`` runs Flower's simulation engine (``flwr.simulation.run_simulation``: one SuperNode per
    client, ClientApps in Ray workers, ``num_cpus_per_client`` each). ``backend="local"`` delivers the
    same messages to the same ClientApp in this process (:class:`LocalGrid`), without Ray; it alone
    accepts ``unreachable(round, client) -> bool`` to make a node miss a round (``round == num_rounds``:
    the final exchange).

    Differences from ``fed_fit``: client steps run one client at a time rather than vectorised, so
    results agree to float rounding, not bit for bit; the result also has ``flower_messages``, the
    ``(kind, round, client, bytes, ledger bits)`` of every payload Flower carried. Floats cross the
    network as float32 (the ledger's 32 bits), so run in float32 (JAX's default) for the exact wire.

    ``secure_aggregation=fb.flower.SecAggPlus(...)``: every exchange's uploads reach the server only summed,
    by Flower's SecAgg+ (for the algorithms whose server needs no more: ``run.sums_uploads``; LMC and
    P-ELF with full uploads, e.g. LMC with distributed DP; the TAMUNA family, FedSOUL and FedMM with distributed
    DP).
    Its messages are in ``flower_messages`` as
    ``secagg:<stage>`` and ``secagg:<stage>-reply``; the sums are exact to the quantisation's
    2 n R / Q per coordinate, with a random rounding from NumPy's global generator (not the fit's seed).
    ``matmul_precision`` as in ``fed_fit``, at the server and at every client.
    """
    engine.check_matmul_precision(matmul_precision)
    _check_simulate_options(backend, num_cpus_per_client, timeout, progress, unreachable)
    fit = validate_fit(
        model, data, algorithm, num_rounds, clients_per_round, seed, model_kwargs, 50, None, fault_policy
    )
    spec = FlowerSpec(
        fit.model,
        fit.data,
        fit.algorithm,
        fit.num_rounds,
        fit.clients_per_round,
        fit.seed,
        fit.model_kwargs,
        fit.fault_policy,
        timeout,
        progress,
        secure_aggregation,
        matmul_precision,
    )
    if backend == "local":
        grid = LocalGrid(client_app(spec), fit.data.num_clients, unreachable)
        try:
            with _server_identity():
                return run_server(spec, grid, collect_locals=True)
        finally:
            _forget(spec.token)
    from flwr.simulation import run_simulation

    try:
        run_simulation(
            server_app=server_app(spec, collect_locals=True),
            client_app=client_app(spec),
            num_supernodes=fit.data.num_clients,
            backend_config={"client_resources": {"num_cpus": num_cpus_per_client, "num_gpus": 0.0}},
        )
        if spec.token not in _RESULTS:
            raise FedbayesError("the Flower simulation ended without a result; its log above says why")
        return _RESULTS.pop(spec.token)
    finally:
        _forget(spec.token)
