"""Secure aggregation of the uploads with Flower's SecAgg+ (imported by :mod:`fedbayes.flower._apps`).

Flower's ``SecAggPlusWorkflow`` (server) and ``secaggplus_mod`` (client) sum integer vectors so that the
server learns the sum and nothing else about the summands (Bell et al., 2020): in four exchanges the
clients advertise keys, share their secrets by Shamir's scheme with their neighbours, upload their
vectors masked by pairwise and private masks, and reveal the shares needed to remove the masks of
the clients that answered. Floats are clipped to ``[-clipping_range, clipping_range]`` and quantised
to ``quantization_range`` levels by stochastic rounding before masking; the sum comes back as floats,
exact to about n x 2 clipping_range / quantization_range per coordinate for n clients.

fedbayes drives the workflow's four stages from its own message loop (:class:`SecureSum`) for every
exchange whose uploads the server needs only summed: the algorithm says so with ``sums_uploads``
(:class:`fedbayes.protocol.FederatedRun`). Each client uploads its vector once, as float64 (Flower
quantises in the vector's own dtype, and float32 would cap the levels at 2^24), weighted 1 (so that
Flower's weighted mean times the number of clients is the plain sum).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
from typing import Any, cast
from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import FitIns, Parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
from flwr.serverapp import Grid

from ..errors import ConfigError

GENERIC = (
    "fedbayes runs secure aggregation only for the algorithms whose server needs every exchange's uploads "
    "summed and nothing else (LMC and P-ELF with full uploads, e.g. LMC with distributed DP; the TAMUNA family, "
    "FedSOUL and FedMM with distributed DP)"
)
CONFIG = "fedbayes"  # the prefix of fedbayes' fields in the FitIns config a secure exchange sends


@dataclasses.dataclass(frozen=True)
class SecAggPlus:
    """Secure aggregation of the uploads on Flower (``fb.flower.simulate(..., secure_aggregation=SecAggPlus())``
    or ``FlowerSpec(secure_aggregation=...)``): the server sees the sum of a round's uploads, not the
    uploads (Flower's SecAgg+, :mod:`fedbayes.flower._secagg`).

    ``num_shares`` / ``reconstruction_threshold``: Flower's SecAgg+ settings (an int, or a float: a
    fraction of the cohort, resp. of the shares); the sum survives the clients that drop out as long as
    ``reconstruction_threshold`` shares of each secret arrive. ``clipping_range`` R: every uploaded
    coordinate is clipped to [-R, R] before quantisation; None (default) takes it from the algorithm's
    distributed DP, C + 8 s' (the clip C bounds the clipped upload's coordinates, and s' is the sd of a
    client's share of the noise: s / sqrt(n) for LMC's n clients, s / sqrt(c) for GD's cohorts of c);
    without DP it must be given. ``quantization_range`` Q and
    ``modulus_range`` M: the levels of the quantisation and the masks' modulus (n Q < M, M a power of
    two): the sum of n uploads is exact to about 2 n R / Q per coordinate.

    The threat model is Flower's SecAgg+: a server that follows the protocol but would read what it
    receives (honest but curious). With ``reconstruction_threshold`` t of k shares, a server that lied
    about which clients dropped out could ask for both kinds of share of one client and unmask its upload
    when t <= k / 2 (the default 0.5); a threshold above one half closes that, at the price of tolerating
    fewer dropouts."""

    num_shares: int | float = 1.0
    reconstruction_threshold: int | float = 0.5
    clipping_range: float | None = None
    quantization_range: int = 2**30
    modulus_range: int = 2**40

    def __post_init__(self) -> None:
        # Flower's own rules (SecAggPlusWorkflow._check_init_params), checked here as a ConfigError: an int
        # counts (1 meaning all), a float is a fraction in (0, 1]
        for name in ("num_shares", "reconstruction_threshold"):
            v: int | float = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise ConfigError(f"SecAggPlus {name} must be an int or a fraction, got {v!r}")
            if isinstance(v, numbers.Integral) and not (v == 1 or v > 2 - (name == "reconstruction_threshold")):
                raise ConfigError(
                    f"SecAggPlus {name} as an int must be 1 (all) or > {2 - (name != 'num_shares')}, got {v!r}"
                )
            if not isinstance(v, numbers.Integral) and not 0 < v <= 1:
                raise ConfigError(f"SecAggPlus {name} as a float is a fraction in (0, 1], got {v!r}")
        t, k = self.reconstruction_threshold, self.num_shares
        if isinstance(t, numbers.Integral) and isinstance(k, numbers.Integral) and 1 < t >= k > 1:
            raise ConfigError(f"SecAggPlus reconstruction_threshold ({t}) must be less than num_shares ({k})")
        r = self.clipping_range
        if r is not None and (isinstance(r, bool) or not isinstance(r, numbers.Real) or not 0 < r < np.inf):
            raise ConfigError(f"SecAggPlus clipping_range must be a finite number > 0 or None, got {r!r}")
        for name in ("quantization_range", "modulus_range"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 2:
                raise ConfigError(f"SecAggPlus {name} must be an integer >= 2, got {v!r}")
        if self.quantization_range >= 2**31:  # Flower rounds to int32
            raise ConfigError(
                f"SecAggPlus quantization_range must be below 2^31 (Flower rounds to int32), got "
                f"{self.quantization_range}"
            )
        if self.modulus_range & (self.modulus_range - 1):
            raise ConfigError(f"SecAggPlus modulus_range must be a power of two, got {self.modulus_range}")

    def resolved_range(self, run: Any, num_clients: int) -> float:
        """R: ``clipping_range``, or from the run's distributed DP (see the class)."""
        if self.clipping_range is not None:
            return float(self.clipping_range)
        dp = getattr(run, "_dp", None)
        if dp is None or not getattr(dp, "distributed", False):
            raise ConfigError(
                "SecAggPlus needs clipping_range (a bound on every uploaded coordinate) when the "
                "algorithm has no distributed DP to take it from"
            )
        return float(dp.dp.clip + 8.0 * float(dp.share_std()))

    def check(self, run: Any, num_clients: int) -> None:
        """Refuse a run whose server needs more than the sum of the uploads, and settings that cannot hold
        the sum of ``num_clients`` quantised uploads."""
        reason = getattr(run, "sums_uploads", None)
        if reason is not True:
            raise ConfigError(f"{run.name} cannot run with secure aggregation: {reason or GENERIC}")
        if num_clients * self.quantization_range >= self.modulus_range:
            raise ConfigError(
                f"SecAggPlus: the sum of {num_clients} uploads quantised to {self.quantization_range} levels "
                f"overflows modulus_range {self.modulus_range}; raise modulus_range (a power of two)"
            )
        self.resolved_range(run, num_clients)


class _Proxy(ClientProxy):
    """The legacy client handle the workflow reads a node id from."""

    def __init__(self, node_id: int):
        super().__init__(str(node_id))
        self.node_id = node_id

    def get_properties(self, *a, **k):
        raise NotImplementedError  # noqa: E704

    def get_parameters(self, *a, **k):
        raise NotImplementedError  # noqa: E704

    def fit(self, *a, **k):
        raise NotImplementedError  # noqa: E704

    def evaluate(self, *a, **k):
        raise NotImplementedError  # noqa: E704

    def reconnect(self, *a, **k):
        raise NotImplementedError  # noqa: E704


class _Sum(Strategy):
    """The strategy the workflow calls: who takes part and with what fedbayes message (``configure_fit``),
    and the unmasked aggregate (``aggregate_fit``: Flower's weighted mean with every weight 1, in every
    result, times the number of results is the sum)."""

    def __init__(self, configs: Mapping[int, Mapping[str, Any]]):
        self.configs = configs
        self.total: np.ndarray | None = None
        self.bits: dict[int, int] = {}

    def initialize_parameters(self, client_manager):
        return None

    def configure_fit(self, server_round, parameters, client_manager):
        empty = Parameters(tensors=[], tensor_type="numpy.ndarray")
        return [(_Proxy(node), FitIns(empty, dict(cfg))) for node, cfg in self.configs.items()]

    def aggregate_fit(self, server_round, results, failures):
        if results:
            mean = parameters_to_ndarrays(results[0][1].parameters)[0]
            self.total = np.asarray(mean, np.float64) * len(results)
            # a client whose upload was not finite sent zeros (they add nothing) and says so: not counted
            self.bits = {
                int(proxy.node_id): int(res.metrics[f"{CONFIG}.bits"])
                for proxy, res in results
                if not int(res.metrics.get(f"{CONFIG}.nonfinite", 0))
            }
        return None, {}

    def configure_evaluate(self, *a):
        return []

    def aggregate_evaluate(self, *a):
        return None, {}

    def evaluate(self, *a):
        return None


class _Nodes:
    """The one client-manager method the workflow calls (for a log line)."""

    def __init__(self, n: int):
        self.n = n

    def num_available(self) -> int:
        return self.n


class _Recorded:
    """The grid seen by the workflow: every message's content is serialised and read back (as a network
    would: the workflow sends one content object to every node, which an in-process grid would share)
    and its bytes recorded, ``(kind, round, client, bytes, 0)``, ``kind`` = ``secagg:<stage>`` and
    ``secagg:<stage>-reply``."""

    def __init__(self, grid: Any, record: Callable[[tuple], None], k: int, client_of: Mapping[int, int]):
        self.grid, self.record, self.k, self.client_of = grid, record, k, client_of

    def send_and_receive(self, messages, *, timeout=None):
        sent, stage_of = [], {}
        for msg in messages:
            proto = recorddict_to_proto(msg.content)
            node = msg.metadata.dst_node_id
            cfg = msg.content.config_records.get(RECORD_KEY_CONFIGS)
            stage = str(cfg[Key.STAGE]) if cfg is not None and Key.STAGE in cfg else "fit"
            stage_of[node] = stage
            self.record((f"secagg:{stage}", self.k, self.client_of[node], proto.ByteSize(), 0))
            sent.append(
                Message(
                    recorddict_from_proto(proto),
                    dst_node_id=node,
                    message_type=msg.metadata.message_type,
                    group_id=msg.metadata.group_id,
                )
            )
        replies = list(self.grid.send_and_receive(sent, timeout=timeout))
        for reply in replies:
            if not reply.has_error():
                node = reply.metadata.src_node_id
                self.record(
                    (
                        f"secagg:{stage_of.get(node, 'fit')}-reply",
                        self.k,
                        self.client_of[node],
                        recorddict_to_proto(reply.content).ByteSize(),
                        0,
                    )
                )
        return replies


@contextlib.contextmanager
def _quiet():
    """Flower's workflow logs every stage at INFO: one line per stage and round is noise in a fit's log."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


class SecureSum:
    """One SecAgg+ exchange per call, driven stage by stage: the sum of the uploads of the nodes given,
    over those that answered. After the first two stages the nodes that dropped out are forgotten: they
    shared no secret, and Flower 1.42's unmasking would otherwise ask the others for shares of it."""

    def __init__(self, cfg: SecAggPlus, clipping_range: float, timeout: float | None):
        self.workflow = SecAggPlusWorkflow(
            cfg.num_shares,
            cfg.reconstruction_threshold,
            max_weight=1.0,
            clipping_range=clipping_range,
            quantization_range=cfg.quantization_range,
            modulus_range=cfg.modulus_range,
            timeout=timeout,
        )

    def __call__(
        self,
        grid: Any,
        k: int,
        configs: Mapping[int, Mapping[str, Any]],
        client_of: Mapping[int, int],
        record: Callable[[tuple], None],
    ) -> tuple[np.ndarray | None, dict[int, int]]:
        """``configs``: node -> the FitIns config it gets (fedbayes' message). Returns the sum (float64; None
        when the protocol halted) and, per node whose upload is in it, the ledger bits it reported."""
        strategy = _Sum(configs)
        context = LegacyContext(
            Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={}),
            strategy=strategy,
            client_manager=cast(ClientManager, _Nodes(len(configs))),  # the workflow calls only num_available
        )
        # the round names the messages' group, as fedbayes' own messages: the round, or -1 for the set-up
        context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({WorkflowKey.CURRENT_ROUND: int(k)})
        context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
        state, wf = WorkflowState(), self.workflow
        recorded = cast(Grid, _Recorded(grid, record, k, client_of))  # the stages call only send_and_receive
        with _quiet():
            for i, stage in enumerate(
                (wf.setup_stage, wf.share_keys_stage, wf.collect_masked_vectors_stage, wf.unmask_stage)
            ):
                if not stage(recorded, context, state):
                    return None, {}
                if i < 2:
                    state.sampled_node_ids = set(state.active_node_ids)
        return strategy.total, strategy.bits
