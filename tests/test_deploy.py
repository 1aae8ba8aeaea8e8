"""The template Flower App (examples/flower_app) on a real Flower deployment: separate processes on
127.0.0.1, TLS on, SuperNodes authenticated by their keys (tests/deploy_helper.py builds it; the same
steps for a user: examples/deploy_local.sh).

It shows, with Flower 1.42:

* TLS is on: the SuperLink serves HTTPS only (one port for its Fleet, Control and Runtime APIs); a
  handshake that verifies the chain against the test's CA and the name 127.0.0.1 succeeds, one against
  the system's trust store fails;
* three SuperNodes whose public keys were registered with ``flwr supernode register`` come online under
  the node ids the registration gave; a SuperNode with a well-formed but unregistered key is refused
  (the SuperLink answers its activation with "No SuperNode found with the given public key", the node
  exits with Flower's exit code 305 and never appears among the nodes), and a plain-text
  (``--insecure``) SuperNode cannot connect (the TLS server closes the connection: "Server disconnected
  without sending a response" or "Connection reset by peer", exit code 305), and a plain-text HTTP
  request to the port gets no HTTP answer;
* ``flwr run`` of the template app over this federation (two rounds) prints fed_fit's estimate bit for
  bit (float32), the ledger's bits exactly, and the payload bytes of the in-process run of the same
  messages;
* in a second run (three rounds), a SuperNode killed with SIGKILL right after it sent its round-0
  upload does not stop the fit: Flower marks the node offline once its heartbeat is overdue (at most
  2 x 30 s, Flower's fixed patience and interval), answers the messages to it with NODE_UNAVAILABLE,
  and fedbayes counts the client as dropped in every later round (the default
  ``FaultPolicy(min_clients=1)`` keeps going while one client answers). The printed result is, bit for
  bit, ``fb.flower.simulate(..., backend="local", unreachable=<that client from round 1 on>)``;
* in a third run, under ``min-clients=3`` with the server's checkpoint on, the same kill stops the run with
  the documented TooFewClientsError after round 0; the SuperNode is restarted (its key, its snapshot folder,
  ``fedbayes-state``) and ``resume=true`` finishes the run to the uninterrupted run's result, bit for bit.

Flower 1.42 starts one ``flwr-clientapp`` process per message (it imports JAX and fedbayes and traces the
algorithm each time), so a round costs seconds of CPU per node: the runs are two and three rounds
long. The template generates the same synthetic data set on every node (task.load_data) and each ClientApp reads
only the partition of its ``client-id``; nothing else places data on the nodes.

Skipped with its reason when Flower's CLI or openssl is missing, or Flower is older than 1.42 (the
single HTTPS port, ``--host``/``--port``, of its SuperLink and SuperNode).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import ssl
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install "fedbayes[flower]" to run the Flower tests')

import fedbayes as fb  # noqa: E402
import fedbayes.flower  # noqa: E402,F401

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
import deploy_helper as dh  # noqa: E402

APP = Path(__file__).resolve().parent.parent / "examples" / "flower_app"
NUM_CLIENTS = 3
FIT_ROUNDS = 2  # the run compared with fed_fit
KILL_ROUNDS = 3  # the run with a SuperNode killed after round 0: it misses rounds 1 and 2
VICTIM = 2  # the client whose SuperNode is killed in the second run
pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64:UserWarning"),
              # runs of two or three rounds are for the equality of the results, not for convergence
              pytest.mark.filterwarnings("ignore::fedbayes.ConvergenceWarning")]


def _log(*parts: object) -> None:
    print("[deploy]", *parts, flush=True)


def _skip_reason() -> str | None:
    if (reason := dh.missing_tools()) is not None:
        return reason
    from flwr import __version__ as flwr_version

    if tuple(int(p) for p in flwr_version.split(".")[:2]) < (1, 42):
        return f"the deployment uses Flower 1.42's SuperLink and SuperNode options (installed: {flwr_version})"
    return None


class Federation:
    """The running deployment: the SuperLink, the three SuperNodes (client i on node i) and their ids."""

    def __init__(self, dep: dh.Deployment, node_ids: list[int]):
        self.dep, self.node_ids = dep, node_ids
        self.nodes: list[dh.Proc] = []


@pytest.fixture(scope="module")
def fed(request: pytest.FixtureRequest) -> Iterator[Federation]:
    if (reason := _skip_reason()) is not None:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="fedbayes-deploy-"))
    failed_before = request.session.testsfailed
    t0 = time.monotonic()
    with dh.deployment(root, NUM_CLIENTS) as dep:
        dep.start_superlink()
        ids = [dep.register(key) for key in dep.pki.nodes]
        _log(f"registered {NUM_CLIENTS} SuperNode keys (flwr supernode register): node ids {ids}")
        assert dep.nodes() == {i: "registered" for i in ids}
        federation = Federation(dep, ids)
        for client, key in enumerate(dep.pki.nodes):
            federation.nodes.append(dep.start_supernode(f"supernode-{client}", client, key))
        for client, proc in enumerate(federation.nodes):
            _, m = proc.wait_for(r"SuperNode ID: (\d+)", 120)
            assert int(m.group(1)) == ids[client], "a SuperNode took a node id other than its key's"
        _wait(lambda: dep.nodes() == {i: "online" for i in ids}, 60, "every registered SuperNode online")
        _log(f"federation up in {time.monotonic() - t0:.1f} s: SuperLink https://{dep.address}, "
             f"SuperNodes {ids} online")
        yield federation
    if request.session.testsfailed == failed_before:
        shutil.rmtree(root, ignore_errors=True)
        _log("every process stopped by pid")
    else:  # the processes' logs tell what went wrong
        _log(f"every process stopped by pid; logs kept in {root}")


def _wait(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.5)


def test_the_superlink_serves_tls_only(fed: Federation) -> None:
    dep = fed.dep
    assert dep.superlink is not None
    _, m = dep.superlink.wait_for(r"Uvicorn running on (https://\S+)", 1)
    assert m.group(1) == f"https://{dep.address}"
    _log(f"SuperLink log: {m.string.strip()}")
    tls = dh.tls_handshake(dep.port, dep.pki.ca)
    _log(f"TLS handshake with {dep.address}, verified against the test CA: {tls}")
    assert tls["version"] in ("TLSv1.2", "TLSv1.3")
    assert ("IP Address", "127.0.0.1") in tls["subjectAltName"]
    assert tls["issuer"] == {"commonName": "fedbayes test CA"}
    with pytest.raises(ssl.SSLCertVerificationError) as err:
        dh.tls_handshake(dep.port, None)  # the system's trust store does not know the test's CA
    _log(f"the same handshake against the system's trust store: {err.value.verify_message}")


def test_unregistered_and_plaintext_supernodes_are_refused(fed: Federation) -> None:
    dep = fed.dep
    assert dep.superlink is not None
    mark = dep.superlink.mark()
    stranger = dep.start_supernode("supernode-unregistered", 0, dep.pki.stranger, max_retries=1)
    plain = dep.start_supernode("supernode-plaintext", 0, None, insecure=True, max_retries=1)
    rc = stranger.wait(timeout=120)
    _, refused = dep.superlink.wait_for(r"\[ApiError:2004\].*No SuperNode found with the given public key", 10, mark)
    # the SuperLink names the refused key: the stranger's, and no other
    assert dh.public_key_pem(dep.pki.stranger).replace("\n", "\\n") in refused.string
    _, failed = stranger.wait_for(r"Failed to activate SuperNode", 1)
    assert "Exit Code: 305" in stranger.text()
    assert rc != 0 and stranger.find(r"SuperNode ID:") is None
    _log(f"unregistered key: SuperNode exited with rc={rc}, {failed.string.strip()!r}; SuperLink: "
         f"{refused.string[refused.string.index('[ApiError'):][:60]!r}... {refused.group(0)[-44:]!r}")

    rc = plain.wait(timeout=120)
    assert rc != 0 and "Exit Code: 305" in plain.text() and plain.find(r"SuperNode ID:") is None
    # the TLS server closes a plain-text connection: the node sees a reset or an empty response (either,
    # depending on when the close reaches it)
    _, closed = plain.wait_for(r"Server disconnected without sending a response|Connection reset by peer", 1)
    _log(f"plain-text SuperNode (--insecure): rc={rc}, {closed.group(0)!r}, Exit Code: 305")
    answer = dh.plain_http(dep.port)
    assert not answer.startswith(b"HTTP/"), answer
    _log(f"a plain-text HTTP request to the SuperLink's port gets no HTTP answer: {answer[:16]!r}")
    assert dep.nodes() == {i: "online" for i in fed.node_ids}, "a refused SuperNode joined the federation"


def _start_run(fed: Federation, num_rounds: int) -> tuple[dh.Proc, str]:
    """``flwr run`` of the template app over the federation, in the background; the run's id."""
    run = fed.dep.flwr_run(APP, f"num-rounds={num_rounds} num-clients={NUM_CLIENTS}")
    _, m = run.wait_for(r"Successfully started run (\d+)", 120)
    return run, m.group(1)


def _result(run: dh.Proc) -> dict[str, Any]:
    """What the ServerApp printed, once the run is over."""
    rc = run.wait(timeout=400)
    lines = [line for line in run.snapshot() if line.startswith("fedbayes result:")]
    assert rc == 0 and lines, f"no result printed by the ServerApp (rc={rc})\n{run.text()[-4000:]}"
    return json.loads(lines[-1].split(":", 1)[1])


def _spec(num_rounds: int) -> Any:
    sys.path.insert(0, str(APP))
    try:
        from fedbayes_app import task
    finally:
        sys.path.remove(str(APP))
    return task.spec({"num-clients": NUM_CLIENTS, "num-rounds": num_rounds})


def _float32(fn: Callable[[], Any]) -> Any:
    """``fn()`` in float32, JAX's default and what the app's processes run in."""
    before = bool(jax.config.read("jax_enable_x64"))
    jax.config.update("jax_enable_x64", False)
    try:
        return fn()
    finally:
        jax.config.update("jax_enable_x64", before)


def _local(spec: Any, unreachable: Callable[[int, int], bool] | None = None) -> Any:
    """The same ServerApp and ClientApp exchanging the same messages in this process."""
    return _float32(lambda: fb.flower.simulate(spec.model, spec.data, spec.algorithm, num_rounds=spec.num_rounds,
                                               seed=spec.seed, backend="local", unreachable=unreachable,
                                               progress=False))


def _assert_same(got: dict[str, Any], ref: Any, payload_bytes: int) -> None:
    for site, value in ref.params.items():
        np.testing.assert_array_equal(np.asarray(got["params"][site], np.float32), value, err_msg=site)
    assert got["ledger_bits"] == ref.bits_up + ref.bits_down
    assert got["payload_bytes"] == payload_bytes


def _steps_received(proc: dh.Proc, run_id: str, start: int) -> list[int]:
    """The rounds of the ``train.step`` messages a SuperNode received in run ``run_id``."""
    rounds, current = [], None
    for line in proc.snapshot(start):
        if (m := re.search(rf"\[RUN {run_id}, ROUND (\w+)\]", line)) is not None:
            current = m.group(1)
        elif "Receiving: train.step" in line and current is not None:
            rounds.append(int(current))
    return rounds


def _timeline(proc: dh.Proc, run_id: str, start: int, t0: float) -> str:
    """When a SuperNode received each message of a run (seconds from ``t0``): one ClientApp process each."""
    out, current = [], None
    for i, line in enumerate(proc.snapshot(start), start):
        if (m := re.search(rf"\[RUN {run_id}(?:, ROUND (\w+))?\]", line)) is not None:
            current = m.group(1)
        elif (m := re.search(r"Receiving: (\S+) message", line)) is not None:
            out.append(f"{m.group(1)}{'' if current is None else '@' + current} {proc.time_of(i) - t0:.0f}s")
    return ", ".join(out)


def test_template_app_over_tls_equals_fed_fit(fed: Federation) -> None:
    marks = [p.mark() for p in fed.nodes]
    t0 = time.monotonic()
    run, run_id = _start_run(fed, FIT_ROUNDS)
    got = _result(run)
    _log(f"run {run_id} ({FIT_ROUNDS} rounds) over TLS in {time.monotonic() - t0:.1f} s: {got}")
    _log(f"messages received by {fed.nodes[0].name}: {_timeline(fed.nodes[0], run_id, marks[0], t0)}")
    for proc, mark in zip(fed.nodes, marks):  # every node took part in every round
        assert _steps_received(proc, run_id, mark) == list(range(FIT_ROUNDS)), proc.name
    spec = _spec(FIT_ROUNDS)
    ref = _float32(lambda: fb.fed_fit(spec.model, spec.data, spec.algorithm, num_rounds=FIT_ROUNDS,
                                      seed=spec.seed, progress=False))
    local = _local(spec)
    # D-ELF on Flower is fed_fit bit for bit in float32 (tests/test_flower.py); printed via float64 repr
    _assert_same(got, ref, sum(m[3] for m in local.flower_messages))
    _log(f"= fed_fit bit for bit (float32): params {ref.params['w'].tolist()}, "
         f"ledger {ref.bits_up + ref.bits_down} bits")


def _kill_after_round_0(fed: Federation, run_id: str, mark: int, t0: float) -> float:
    """SIGKILL to the victim's SuperNode once its round-0 upload is on the SuperLink (the node is gone from round
    1 on, whatever the timing); when."""
    victim = fed.nodes[VICTIM]
    i, _ = victim.wait_for(rf"\[RUN {run_id}, ROUND 0\]", 300, mark)
    i, _ = victim.wait_for(r"Sending: train\.step", 300, i)
    victim.wait_for(r"Sent successfully", 60, i)
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    victim.wait(timeout=30)
    _log(f"SIGKILL to SuperNode {fed.node_ids[VICTIM]} (client {VICTIM}, pid {victim.pid}) after its round-0 "
         f"upload, {killed_at - t0:.1f} s into run {run_id}: rc={victim.popen.returncode}")
    assert victim.popen.returncode == -signal.SIGKILL
    return killed_at


def _restart_victim(fed: Federation, label: str) -> None:
    """A new SuperNode process for the victim's client, with its registered key and its snapshot folder."""
    proc = fed.dep.start_supernode(f"supernode-{VICTIM}-{label}", VICTIM, fed.dep.pki.nodes[VICTIM])
    fed.nodes[VICTIM] = proc
    _wait(lambda: fed.dep.nodes() == {i: "online" for i in fed.node_ids}, 120, "the restarted SuperNode online")
    _log(f"SuperNode {fed.node_ids[VICTIM]} (client {VICTIM}) restarted as pid {proc.pid}: every node online")


def test_a_supernode_killed_mid_run_is_a_dropped_client(fed: Federation) -> None:
    from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE

    victim, survivors = fed.nodes[VICTIM], [p for c, p in enumerate(fed.nodes) if c != VICTIM]
    marks = {p.name: p.mark() for p in fed.nodes}
    t0 = time.monotonic()
    run, run_id = _start_run(fed, KILL_ROUNDS)
    killed_at = _kill_after_round_0(fed, run_id, marks[victim.name], t0)

    # the references, while the SuperLink waits for the dead node's heartbeat
    spec = _spec(KILL_ROUNDS)
    dropped = _local(spec, unreachable=lambda k, client: client == VICTIM and k >= 1)
    full = _local(spec)

    got = _result(run)
    _log(f"run {run_id} with client {VICTIM} killed, {time.monotonic() - t0:.1f} s: {got}")
    _log(f"messages received by {survivors[0].name}: "
         f"{_timeline(survivors[0], run_id, marks[survivors[0].name], t0)}")
    # Flower reports the node offline (its heartbeat is overdue); the other two stay online
    status = fed.dep.nodes()
    assert status == {n: ("offline" if c == VICTIM else "online") for c, n in enumerate(fed.node_ids)}, status
    # the survivors got every round, the victim round 0 only
    for proc in survivors:
        assert _steps_received(proc, run_id, marks[proc.name]) == list(range(KILL_ROUNDS)), proc.name
    assert _steps_received(victim, run_id, marks[victim.name]) == [0]
    # round 1 closed (round 2 reached the survivors) when Flower answered for the dead node: its heartbeat,
    # every 30 s, was overdue by Flower's patience (2 intervals)
    i, _ = survivors[0].wait_for(rf"\[RUN {run_id}, ROUND 2\]", 1, marks[survivors[0].name])
    waited = survivors[0].time_of(i) - killed_at
    _log(f"round 1 closed {waited:.1f} s after the kill (Flower marks a node offline after "
         f"{HEARTBEAT_PATIENCE} x {HEARTBEAT_DEFAULT_INTERVAL} s without a heartbeat); node status {status}")
    assert waited < HEARTBEAT_PATIENCE * HEARTBEAT_DEFAULT_INTERVAL + 30

    upload = {m[4] for m in full.flower_messages if m[0] == "upload"}
    assert len(upload) == 1  # top-k(2) uploads have one size
    # what the ledger lost: the victim's uploads of rounds 1 and 2, and nothing else
    assert got["ledger_bits"] == full.bits_up + full.bits_down - (KILL_ROUNDS - 1) * upload.pop()
    _assert_same(got, dropped, sum(m[3] for m in dropped.flower_messages))
    faults = sorted(map(tuple, dropped.faults[["round", "client"]].to_numpy().tolist()))
    assert faults == [(k, VICTIM) for k in range(1, KILL_ROUNDS)]
    _log(f"= simulate(unreachable=client {VICTIM} from round 1) bit for bit: dropped (round, client) "
         f"{faults}; the fit went on with {NUM_CLIENTS - 1} clients (FaultPolicy min_clients=1)")


def test_a_run_stopped_by_a_killed_supernode_resumes_from_its_checkpoint(fed: Federation, tmp_path: Path) -> None:
    """The same kill under ``min-clients=3``: round 1 cannot close, and the ServerApp stops with the documented
    TooFewClientsError, naming the checkpoint it wrote after round 0. The victim's SuperNode is restarted (its
    key, its snapshot folder), and ``flwr run ... resume=true`` continues from the server's checkpoint and the
    nodes' snapshots: its result is the uninterrupted run's, bit for bit, ledger and payload bytes included."""
    if fed.nodes[VICTIM].popen.poll() is not None:  # the previous test's kill
        _restart_victim(fed, "restarted")
    ckpt = tmp_path / "server.ckpt"
    config = f'num-rounds={KILL_ROUNDS} num-clients={NUM_CLIENTS} min-clients={NUM_CLIENTS} checkpoint="{ckpt}"'
    mark = fed.nodes[VICTIM].mark()
    t0 = time.monotonic()
    run = fed.dep.flwr_run(APP, config)
    _, m = run.wait_for(r"Successfully started run (\d+)", 120)
    run_id = m.group(1)
    _kill_after_round_0(fed, run_id, mark, t0)
    run.wait(timeout=400)
    _, stopped = run.wait_for(r"fedbayes stopped: (.*)", 1)
    error = json.loads(stopped.group(1))
    _log(f"run {run_id} stopped after {time.monotonic() - t0:.1f} s: {error}")
    assert error["error"] == "TooFewClientsError"
    assert "round 1 left fewer answering clients than min_clients=3" in error["message"]
    assert "resume from the checkpoint after round 0" in error["message"] and ckpt.exists()

    _restart_victim(fed, "resumed")
    t1 = time.monotonic()
    resumed = fed.dep.flwr_run(APP, config + " resume=true")
    got = _result(resumed)
    _log(f"resumed run ({KILL_ROUNDS - 1} rounds after the checkpoint) in {time.monotonic() - t1:.1f} s: {got}")
    full = _local(_spec(KILL_ROUNDS))
    _assert_same(got, full, sum(m[3] for m in full.flower_messages))
    _log(f"= the uninterrupted run bit for bit: params {full.params['w'].tolist()}, "
         f"ledger {full.bits_up + full.bits_down} bits")
