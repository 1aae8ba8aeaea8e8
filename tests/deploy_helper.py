"""A Flower 1.42 deployment on 127.0.0.1 as separate processes, for tests/test_deploy.py.

What it builds, step by step (``examples/deploy_local.sh`` does the same in bash):

* a PKI (:func:`make_pki`): a CA and a server certificate for ``127.0.0.1`` / ``localhost`` (both in its
  subjectAltName) made with ``openssl``, and one SuperNode key pair per node: ECDSA on NIST P-384 in
  OpenSSH format, what ``ssh-keygen -t ecdsa -b 384`` writes and Flower 1.42 reads
  (``flower-supernode --auth-supernode-private-key`` loads an OpenSSH EC private key,
  ``flwr supernode register`` an OpenSSH EC public key on a NIST curve);
* ``flower-superlink`` with TLS and SuperNode authentication. In Flower 1.42 one HTTPS server (uvicorn)
  serves the Fleet, Control and Runtime APIs on ``--host``/``--port``; no gRPC port is opened (the
  ``--fleet-api-address``/``--control-api-address`` flags are deprecated), and the health server runs
  only when ``--health-server-address`` is given (it is not). The SuperLink starts a ``flower-superexec``
  child that starts the ServerApp of each run;
* the ``flwr`` CLI's configuration (``$FLWR_HOME/config.toml``) with one SuperLink connection (address
  and root certificates), through which the nodes' public keys are registered
  (``flwr supernode register <key.pub> <connection>``) and runs are submitted;
* ``flower-supernode`` processes, each with its own ``FLWR_HOME``, its own Runtime API port on
  127.0.0.1 (its SuperExec and ClientApp processes connect there), ``--root-certificates`` and
  ``--auth-supernode-private-key``.

Every process is started with an environment variable naming this deployment, which Flower's own
children (SuperExec, ``flwr-serverapp``, ``flwr-clientapp``) inherit; :meth:`Deployment.close` stops the
processes it started by their pids (SIGTERM, then SIGKILL after a timeout), then any process still
carrying the tag, by pid. While a deployment is open, this process is a child subreaper (Linux), so that
the children Flower leaves behind when their parent exits are reparented here and reaped, not left as
zombies under an init that may not reap them.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

BIN = Path(sys.executable).parent
HOST = "127.0.0.1"
TAG_VAR = "FEDBAYES_DEPLOY_TAG"
CONNECTION = "fedbayes-tls"  # the SuperLink connection's name in the CLI's config.toml
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PR_SET_CHILD_SUBREAPER = 36


def missing_tools() -> str | None:
    """Why the deployment cannot run here (a missing program), or None."""
    for name in ("flwr", "flower-superlink", "flower-supernode", "flower-superexec"):
        if shutil.which(name, path=str(BIN)) is None:
            return f"Flower's CLI ({name}) is not next to this interpreter: pip install 'fedbayes[flower]'"
    if shutil.which("openssl") is None:
        return "openssl is not on PATH (it makes the test's CA and server certificate)"
    return None


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 (held open together while chosen)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# ------------------------------------------------------------------------------ certificates and keys


@dataclasses.dataclass(frozen=True)
class NodeKey:
    private: Path  # OpenSSH EC private key: flower-supernode --auth-supernode-private-key
    public: Path  # OpenSSH EC public key: flwr supernode register


@dataclasses.dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path
    nodes: list[NodeKey]
    stranger: NodeKey  # a well-formed key pair that is never registered


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(folder: Path, num_nodes: int) -> Pki:
    """A CA, a server certificate it signs for 127.0.0.1 and localhost, and ``num_nodes`` + 1 node keys."""
    folder.mkdir(parents=True, exist_ok=True)
    ec_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec_key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "2",
             "-subj", "/CN=fedbayes test CA", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=folder)
    _openssl("req", "-new", *ec_key, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1",
             cwd=folder)
    # Clients check the name they dial against the subjectAltName (the CN is not read): 127.0.0.1 as an IP
    (folder / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
    )
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "2", "-sha256", "-extfile", "server.ext", cwd=folder)
    keys = [_node_key(folder, f"node-{i}") for i in range(num_nodes)]
    return Pki(folder / "ca.crt", folder / "server.pem", folder / "server.key", keys, _node_key(folder, "stranger"))


def _node_key(folder: Path, name: str) -> NodeKey:
    """An ECDSA P-384 key pair in OpenSSH format (``ssh-keygen -t ecdsa -b 384 -N ''``)."""
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = folder / f"{name}.key", folder / f"{name}.key.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                          serialization.NoEncryption()))
    private.chmod(0o600)
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH) + f" {name}\n".encode())
    return NodeKey(private, public)


def public_key_pem(key: NodeKey) -> str:
    """The key as the SuperLink logs it (SubjectPublicKeyInfo PEM)."""
    loaded = serialization.load_ssh_public_key(key.public.read_bytes())
    return loaded.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def tls_handshake(port: int, ca: Path | None) -> dict[str, Any]:
    """A TLS handshake with 127.0.0.1:``port`` that verifies the certificate chain and the name
    127.0.0.1 against ``ca`` (None: the system's trust store); what was negotiated."""
    ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    with socket.create_connection((HOST, port), timeout=10) as raw, ctx.wrap_socket(raw, server_hostname=HOST) as tls:
        cert: dict[str, Any] = dict(tls.getpeercert() or {})
        cipher = tls.cipher()
        return {"version": tls.version(), "cipher": cipher[0] if cipher else None,
                "subject": dict(x[0] for x in cert["subject"]), "issuer": dict(x[0] for x in cert["issuer"]),
                "subjectAltName": cert.get("subjectAltName")}


def plain_http(port: int) -> bytes:
    """What a plain-text HTTP request to 127.0.0.1:``port`` gets back before the server closes
    (b"" for a close or a reset without a byte)."""
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(b"POST /v1/fleet/activate-node HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n")
        chunks = []
        try:
            while chunk := sock.recv(4096):
                chunks.append(chunk)
        except (ConnectionResetError, TimeoutError):
            pass
        return b"".join(chunks)


# ------------------------------------------------------------------------------ processes


class Proc:
    """A started process, its output (ANSI colours removed) read line by line into ``lines`` with the
    time each arrived, and copied to ``log``."""

    def __init__(self, name: str, cmd: Sequence[str], env: dict[str, str], cwd: Path, log: Path):
        self.name, self.cmd, self.log = name, list(cmd), log
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self.popen = subprocess.Popen(self.cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1)
        self._reader = threading.Thread(target=self._read, name=f"read-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        assert self.popen.stdout is not None
        with open(self.log, "w", encoding="utf-8") as fh:
            for raw in self.popen.stdout:
                line = _ANSI.sub("", raw.rstrip("\n"))
                with self._lock:
                    self.lines.append((time.monotonic(), line))
                fh.write(line + "\n")
                fh.flush()

    def snapshot(self, start: int = 0) -> list[str]:
        with self._lock:
            return [line for _, line in self.lines[start:]]

    def text(self, start: int = 0) -> str:
        return "\n".join(self.snapshot(start))

    def time_of(self, index: int) -> float:
        """When line ``index`` arrived (``time.monotonic()``)."""
        with self._lock:
            return self.lines[index][0]

    def mark(self) -> int:
        """The index of the next line (a start for :meth:`wait_for`)."""
        with self._lock:
            return len(self.lines)

    def find(self, pattern: str, start: int = 0) -> tuple[int, re.Match[str]] | None:
        """The index and match of the first line from index ``start`` on that matches ``pattern``."""
        regex = re.compile(pattern)
        for i, line in enumerate(self.snapshot(start), start):
            if (m := regex.search(line)) is not None:
                return i, m
        return None

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> tuple[int, re.Match[str]]:
        """:meth:`find`, waiting for the line; raises when the process ends or ``timeout`` passes first."""
        deadline = time.monotonic() + timeout
        while True:
            if (found := self.find(pattern, start)) is not None:
                return found
            if self.popen.poll() is not None:
                self._reader.join(timeout=5)
                if (found := self.find(pattern, start)) is not None:
                    return found
                raise RuntimeError(f"{self.name} exited ({self.popen.returncode}) before /{pattern}/:\n"
                                   f"{self.text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no /{pattern}/ within {timeout:.0f} s:\n{self.text()[-3000:]}")
            time.sleep(0.1)

    def wait(self, timeout: float) -> int:
        rc = self.popen.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return rc

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout``; reaped either way."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=timeout)
        self._reader.join(timeout=5)


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries ``TAG_VAR=tag`` (Flower's children inherit it)."""
    needle = f"{TAG_VAR}={tag}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            pass
    return found


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _reap_orphans(ours: set[int]) -> None:
    """Reap the zombies of Flower's processes that were reparented to this subreaper (not ``ours``,
    whose Popen objects reap them)."""
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in ours:
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        comm, rest = stat.split("(", 1)[1].rsplit(")", 1)
        state, ppid = rest.split()[:2]
        if state == "Z" and ppid == me and comm.startswith(("flower-", "flwr")):
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(int(entry.name), os.WNOHANG)


def _subreaper(on: bool) -> None:
    """Make this process the child subreaper of its descendants (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)


# ------------------------------------------------------------------------------ the deployment


class Deployment:
    """A SuperLink with TLS and SuperNode authentication, the CLI configured for it, and SuperNodes."""

    def __init__(self, root: Path, num_nodes: int):
        self.root, self.tag = root, uuid.uuid4().hex
        self.procs: list[Proc] = []
        self.pki = make_pki(root / "pki", num_nodes)
        self.port = free_ports(1)[0]
        self.cli_home = root / "cli-home"
        self.address = f"{HOST}:{self.port}"
        self.superlink: Proc | None = None
        _subreaper(True)

    def env(self, home: Path) -> dict[str, str]:
        home.mkdir(parents=True, exist_ok=True)
        return dict(os.environ, FLWR_HOME=str(home), PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
                    FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1", JAX_ENABLE_X64="0",
                    JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", **{TAG_VAR: self.tag})

    def start(self, name: str, cmd: Sequence[str], home: Path) -> Proc:
        proc = Proc(name, cmd, self.env(home), home, self.root / f"{name}.log")
        self.procs.append(proc)
        return proc

    def start_superlink(self, timeout: float = 60) -> Proc:
        pki = self.pki
        self.superlink = self.start("superlink", [
            str(BIN / "flower-superlink"),
            "--ssl-ca-certfile", str(pki.ca), "--ssl-certfile", str(pki.cert), "--ssl-keyfile", str(pki.key),
            "--enable-supernode-auth",
            "--host", HOST, "--port", str(self.port),
            "--database", str(self.root / "superlink-home" / "state.db"),
            # fedbayes is installed here: run the ServerApp in this environment, not in one `uv sync` builds
            "--disable-runtime-dependency-installation",
        ], self.root / "superlink-home")
        self.superlink.wait_for(r"Uvicorn running on https://", timeout)
        self._write_cli_config()
        return self.superlink

    def _write_cli_config(self) -> None:
        self.cli_home.mkdir(parents=True, exist_ok=True)
        (self.cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{self.address}"\nroot-certificates = "{self.pki.ca}"\n'
        )

    def flwr(self, *args: str, timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """A short ``flwr`` CLI command against this deployment's connection (output without colours)."""
        out = subprocess.run([str(BIN / "flwr"), *args], cwd=cwd or self.cli_home, env=self.env(self.cli_home),
                             capture_output=True, text=True, timeout=timeout)
        return subprocess.CompletedProcess(out.args, out.returncode, _ANSI.sub("", out.stdout),
                                           _ANSI.sub("", out.stderr))

    def register(self, key: NodeKey) -> int:
        """``flwr supernode register``: the node id the SuperLink gives the key."""
        out = self.flwr("supernode", "register", "--format", "json", str(key.public), CONNECTION)
        if out.returncode != 0:
            raise RuntimeError(f"flwr supernode register failed:\n{out.stdout}\n{out.stderr}")
        reply = json.loads(out.stdout[out.stdout.index("{"):])
        assert reply["success"], reply
        return int(reply["node-id"])

    def nodes(self) -> dict[int, str]:
        """``flwr supernode ls``: node id -> status (registered, online, offline, ...)."""
        out = self.flwr("supernode", "ls", "--format", "json", CONNECTION)
        if out.returncode != 0:
            raise RuntimeError(f"flwr supernode ls failed:\n{out.stdout}\n{out.stderr}")
        reply = json.loads(out.stdout[out.stdout.index("{"):])
        return {int(n["node-id"]): n["status"] for n in reply["nodes"]}

    def start_supernode(self, name: str, client_id: int, key: NodeKey | None, *, insecure: bool = False,
                        max_retries: int | None = None) -> Proc:
        port = free_ports(1)[0]
        # each client's state snapshots in a folder of its own, the same for a restarted node of that client
        state = self.root / f"state-{client_id}"
        cmd = [str(BIN / "flower-supernode"), "--superlink", self.address,
               "--node-config", f'client-id={client_id} fedbayes-state="{state}"',
               # the node's Runtime API, where its SuperExec and ClientApp processes connect: loopback only
               "--host", HOST, "--port", str(port)]
        cmd += ["--insecure"] if insecure else ["--root-certificates", str(self.pki.ca)]
        if key is not None:
            cmd += ["--auth-supernode-private-key", str(key.private)]
        if max_retries is not None:
            cmd += ["--max-retries", str(max_retries)]
        return self.start(name, cmd, self.root / f"{name}-home")

    def flwr_run(self, app: Path, run_config: str) -> Proc:
        """``flwr run <app> <connection> --stream`` in the background (the ServerApp's output streams back)."""
        return self.start(f"flwr-run-{len(self.procs)}", [
            str(BIN / "flwr"), "run", str(app), CONNECTION, "--stream", "--run-config", run_config,
        ], self.cli_home)

    def close(self, timeout: float = 10.0) -> list[int]:
        """Stop every process this deployment started (flwr runs and SuperNodes first, the SuperLink last),
        then any process left with its tag; returns the pids of those left over."""
        try:
            for proc in sorted(self.procs, key=lambda p: p is self.superlink):
                with contextlib.suppress(Exception):
                    proc.stop(timeout)
            deadline = time.monotonic() + timeout
            left = [pid for pid in tagged_pids(self.tag) if _alive(pid)]
            # Flower's children (SuperExec, flwr-serverapp/clientapp) watch their parent and exit soon after it
            while left and time.monotonic() < deadline:
                time.sleep(0.2)
                left = [pid for pid in tagged_pids(self.tag) if _alive(pid)]
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in left:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                end = time.monotonic() + timeout
                while (left := [pid for pid in left if _alive(pid)]) and time.monotonic() < end:
                    time.sleep(0.2)
                if not left:
                    break
            _reap_orphans({p.pid for p in self.procs})
            return [pid for pid in tagged_pids(self.tag) if _alive(pid)]
        finally:
            _subreaper(False)


@contextlib.contextmanager
def deployment(root: Path, num_nodes: int) -> Iterator[Deployment]:
    dep = Deployment(root, num_nodes)
    try:
        yield dep
    finally:
        left = dep.close()
        if left:
            raise RuntimeError(f"processes left running after the deployment: {left}")
