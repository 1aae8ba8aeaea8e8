"""The template Flower App (examples/flower_app) under `flwr run`: Flower's CLI starts a local SuperLink,
installs the app, runs it with the simulation runtime (Ray), and the ServerApp prints its result, which
is fed_fit's for the same spec.

Skipped with its reason when Flower's CLI is not installed (the `fedbayes[flower]` extra brings it), is
older than 1.28 (the Flower configuration and `--federation-config` of this command), or when a
SuperLink already listens on the local port `flwr run` uses (it would take the run).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install "fedbayes[flower]" to run the Flower tests')

import fedbayes as fb  # noqa: E402
import fedbayes.flower  # noqa: E402,F401

APP = Path(__file__).resolve().parent.parent / "examples" / "flower_app"
BIN = Path(sys.executable).parent


def _stop_superlinks(home: str) -> None:
    """End the SuperLink that `flwr run` started in the background for this FLWR_HOME (and only it)."""
    try:
        found = subprocess.run(["pgrep", "-f", f"flower-superlink.*{home}"], capture_output=True, text=True)
    except FileNotFoundError:  # no pgrep: read the process table
        found = subprocess.CompletedProcess([], 0, stdout="\n".join(
            p.name for p in Path("/proc").iterdir() if p.name.isdigit() and
            "flower-superlink" in (p / "cmdline").read_bytes().decode(errors="replace") and
            home in (p / "cmdline").read_bytes().decode(errors="replace")))
    for pid in found.stdout.split():
        try:
            os.kill(int(pid), signal.SIGTERM)
        except ProcessLookupError:
            pass


LOCAL_PORT = 39091  # the port of Flower's managed local SuperLink (Flower 1.42)


def _port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64:UserWarning")
def test_template_app_under_flwr_run_equals_fed_fit():
    flwr = shutil.which("flwr", path=str(BIN))
    if flwr is None or shutil.which("flower-superlink", path=str(BIN)) is None:
        pytest.skip("Flower's CLI (flwr, flower-superlink) is not next to this interpreter")
    from flwr import __version__ as flwr_version

    if tuple(int(p) for p in flwr_version.split(".")[:2]) < (1, 28):
        pytest.skip(f"the template's flwr run command needs Flower >= 1.28 (installed: {flwr_version})")
    if _port_in_use(LOCAL_PORT):
        pytest.skip(f"a SuperLink already listens on 127.0.0.1:{LOCAL_PORT}; flwr run would submit to it")
    num_clients, num_rounds = 3, 12
    home = tempfile.mkdtemp(prefix="fedbayes-flwr-run-")
    env = dict(os.environ, FLWR_HOME=home, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
               FLWR_TELEMETRY_ENABLED="0", RAY_USAGE_STATS_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1",
               # fedbayes is installed here: run the app in this environment, not in a fresh one
               FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION="1", JAX_ENABLE_X64="0")
    cmd = [flwr, "run", ".", "--stream", "--run-config", f"num-rounds={num_rounds} num-clients={num_clients}",
           "--federation-config", f"num-supernodes={num_clients} client-resources-num-cpus=1"]
    try:
        out = subprocess.run(cmd, cwd=APP, env=env, capture_output=True, text=True, timeout=300)
    finally:
        _stop_superlinks(home)
        shutil.rmtree(home, ignore_errors=True)
    lines = [line for line in out.stdout.splitlines() if line.startswith("fedbayes result:")]
    assert lines, f"no result printed by the ServerApp\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    got = json.loads(lines[-1].split(":", 1)[1])

    sys.path.insert(0, str(APP))
    try:
        from fedbayes_app import task
    finally:
        sys.path.remove(str(APP))
    spec = task.spec({"num-clients": num_clients, "num-rounds": num_rounds})
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)  # the app's processes run in float32, JAX's default
    try:
        ref = fb.fed_fit(spec.model, spec.data, spec.algorithm, num_rounds=num_rounds, seed=spec.seed,
                         progress=False)
    finally:
        jax.config.update("jax_enable_x64", before)
    # D-ELF on Flower is fed_fit bit for bit in float32 (tests/test_flower.py); printed via float64 repr
    for site, value in ref.params.items():
        np.testing.assert_array_equal(np.asarray(got["params"][site], np.float32), value, err_msg=site)
    assert got["ledger_bits"] == ref.bits_up + ref.bits_down
    # Flower's bytes: the in-process run of the same messages (each ceil(ledger bits / 8): test_flower)
    jax.config.update("jax_enable_x64", False)
    try:
        local = fb.flower.simulate(spec.model, spec.data, spec.algorithm, num_rounds=num_rounds, seed=spec.seed,
                                   backend="local", progress=False)
    finally:
        jax.config.update("jax_enable_x64", before)
    assert got["payload_bytes"] == sum(m[3] for m in local.flower_messages)
