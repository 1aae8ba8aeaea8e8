#!/usr/bin/env bash
# A local Flower federation with TLS and SuperNode authentication, running the template app
# (examples/flower_app) as separate processes on 127.0.0.1, then checking its result against fed_fit.
#
#   bash examples/deploy_local.sh                 # from the repository root
#
# Settings (environment variables):
#   NUM_ROUNDS=3       rounds of the run (each costs seconds: Flower starts a ClientApp process per message)
#   WORKDIR=<folder>   where certificates, keys, state and logs go (default: a new temporary folder, kept)
#   SHOW_REFUSALS=1    also start an unregistered SuperNode and a plain-text one, and show both refused
#                      (0 skips this)
# It needs Flower 1.42 (`pip install "fedbayes[flower]"`; a .venv/ at the repository root is used when
# there is one), openssl, and ssh-keygen (or Python's cryptography package) for the node keys.
#
# What it does (tests/test_deploy.py does the same and checks more, including a SuperNode killed mid-run):
#  1. A CA and a server certificate it signs for 127.0.0.1 and localhost (both in the subjectAltName:
#     clients check the name they dial there), and one SuperNode key pair per node: ECDSA P-384 in
#     OpenSSH format (`ssh-keygen -t ecdsa -b 384`), the format Flower 1.42 reads.
#  2. flower-superlink with TLS (--ssl-ca-certfile/--ssl-certfile/--ssl-keyfile) and
#     --enable-supernode-auth. Flower 1.42 serves its Fleet, Control and Runtime APIs on one HTTPS port
#     (--host 127.0.0.1 --port <free port>); it opens no gRPC port, and no health port unless
#     --health-server-address is given. Its state is a SQLite file in WORKDIR.
#  3. The flwr CLI's configuration (FLWR_HOME=WORKDIR/cli-home) with one SuperLink connection,
#     "local-tls" (address and root certificates); each node's public key is registered with
#     `flwr supernode register <node>.key.pub local-tls`.
#  4. One flower-supernode per client, each with its own FLWR_HOME and Runtime API port on 127.0.0.1,
#     --root-certificates, --auth-supernode-private-key and --node-config "client-id=<i> fedbayes-state=<dir>"
#     (the folder where the node keeps snapshots of its client state, for a resumed run). The template
#     generates the same synthetic data on every node and each ClientApp reads only its client's part.
#  5. (SHOW_REFUSALS=1) A SuperNode with an unregistered key (refused: "No SuperNode found with the given
#     public key", exit code 305) and one with --insecure (plain text; the TLS server drops it).
#  6. `flwr run examples/flower_app local-tls --stream`: the ServerApp prints `fedbayes result: {...}`,
#     which is compared with fb.fed_fit on the same data, bit for bit in float32.
# Every process started here is stopped on exit (SIGTERM, then SIGKILL after 10 s), and so is any
# process Flower started for them (found by an environment tag they inherit).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -x "$REPO/.venv/bin/flwr" ]]; then
    export PATH="$REPO/.venv/bin:$PATH"
fi
for tool in flwr flower-superlink flower-supernode python openssl; do
    if ! command -v "$tool" >/dev/null; then
        echo "deploy_local.sh: $tool not found (pip install 'fedbayes[flower]')" >&2
        exit 2
    fi
done

# Flower's SuperNode does not wait for the SuperExec it starts; once the SuperNode exits, that child is
# reparented. Under an init that does not reap (some containers) it would stay a zombie: run this script
# as a child subreaper (Linux; the setting survives exec), so that bash reaps it.
if [[ -z "${_DEPLOY_LOCAL_REAPER:-}" && "$(uname -s)" == Linux ]]; then
    export _DEPLOY_LOCAL_REAPER=1
    exec python -c 'import ctypes, os, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
os.execvp("bash", ["bash", *sys.argv[1:]])' "${BASH_SOURCE[0]}" "$@"
fi

NUM_CLIENTS=3
NUM_ROUNDS="${NUM_ROUNDS:-3}"
SHOW_REFUSALS="${SHOW_REFUSALS:-1}"
WORKDIR="${WORKDIR:-$(mktemp -d "${TMPDIR:-/tmp}/fedbayes-deploy-XXXXXX")}"
WORKDIR="$(mkdir -p "$WORKDIR" && cd "$WORKDIR" && pwd)"
PKI="$WORKDIR/pki"
CONNECTION=local-tls
TAG="deploy-local-$$-$RANDOM"  # given to the started processes only (not to this shell)
PIDS=()
mkdir -p "$PKI"

log() { printf '[deploy_local] %s\n' "$*"; }

alive() {  # a running process (not a zombie)
    [[ -r "/proc/$1/stat" ]] && [[ "$(sed -E 's/.*\) ([A-Z]).*/\1/' "/proc/$1/stat" 2>/dev/null)" != Z ]]
}

stop_pid() {  # SIGTERM, then SIGKILL after 10 s
    local pid=$1 i
    kill -TERM "$pid" 2>/dev/null || return 0
    for i in $(seq 50); do alive "$pid" || break; sleep 0.2; done
    if alive "$pid"; then kill -KILL "$pid" 2>/dev/null || true; fi
    wait "$pid" 2>/dev/null || true
}

tagged() {  # pids whose environment carries the tag (Flower's SuperExec, ServerApp, ClientApp children)
    local f
    for f in /proc/[0-9]*/environ; do
        grep -qzx "FEDBAYES_DEPLOY_TAG=$TAG" "$f" 2>/dev/null && { f=${f#/proc/}; echo "${f%/environ}"; }
    done
    return 0
}

cleanup() {
    local rc=$? pid i
    trap - EXIT INT TERM
    for (( i=${#PIDS[@]}-1; i>=0; i-- )); do stop_pid "${PIDS[i]}"; done  # SuperNodes, then the SuperLink
    for i in $(seq 50); do [[ -z "$(tagged)" ]] && break; sleep 0.2; done  # they exit after their parent
    for pid in $(tagged); do stop_pid "$pid"; done
    wait 2>/dev/null || true
    log "stopped every process; files and logs in $WORKDIR"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start() {  # start NAME CMD...: in the background, with the tag and its own FLWR_HOME; logs to WORKDIR/NAME.log
    local name=$1; shift
    mkdir -p "$WORKDIR/$name-home"
    (cd "$WORKDIR/$name-home" && exec env FEDBAYES_DEPLOY_TAG="$TAG" FLWR_HOME="$WORKDIR/$name-home" \
        FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 JAX_ENABLE_X64=0 "$@") \
        >"$WORKDIR/$name.log" 2>&1 &
    PIDS+=("$!")
    LAST_PID=$!
}

wait_log() {  # wait_log FILE REGEX SECONDS [PID]: until the file has a matching line (or the process ends)
    local file=$1 regex=$2 secs=$3 pid=${4:-} i
    for i in $(seq $((secs * 5))); do
        grep -Eq "$regex" "$file" 2>/dev/null && return 0
        if [[ -n "$pid" ]] && ! alive "$pid"; then break; fi
        sleep 0.2
    done
    grep -Eq "$regex" "$file" 2>/dev/null && return 0
    echo "deploy_local.sh: no /$regex/ in $file:" >&2; tail -20 "$file" >&2; return 1
}

flwr_cli() { env FLWR_HOME="$WORKDIR/cli-home" FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1 flwr "$@"; }

free_ports() {
    python -c 'import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks: s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))' "$1"
}

# ---------------------------------------------------------------- 1. certificates and node keys
log "1. CA, server certificate (127.0.0.1, localhost) and SuperNode keys in $PKI"
EC=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
openssl req -x509 "${EC[@]}" -keyout "$PKI/ca.key" -out "$PKI/ca.crt" -days 2 -subj "/CN=fedbayes test CA" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
openssl req -new "${EC[@]}" -keyout "$PKI/server.key" -out "$PKI/server.csr" -subj "/CN=127.0.0.1" 2>/dev/null
printf '%s\n' "subjectAltName=IP:127.0.0.1,DNS:localhost" "basicConstraints=critical,CA:FALSE" \
    "keyUsage=critical,digitalSignature" "extendedKeyUsage=serverAuth" >"$PKI/server.ext"
openssl x509 -req -in "$PKI/server.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial -sha256 \
    -out "$PKI/server.pem" -days 2 -extfile "$PKI/server.ext" 2>/dev/null
openssl verify -CAfile "$PKI/ca.crt" "$PKI/server.pem"
node_key() {  # node_key NAME: NAME.key (OpenSSH EC P-384 private key) and NAME.key.pub
    if command -v ssh-keygen >/dev/null; then
        ssh-keygen -q -t ecdsa -b 384 -N "" -C "$1" -f "$PKI/$1.key"
    else
        python - "$PKI/$1.key" "$1" <<'EOF'
import sys
from cryptography.hazmat.primitives import serialization as s
from cryptography.hazmat.primitives.asymmetric import ec
key = ec.generate_private_key(ec.SECP384R1())
open(sys.argv[1], "wb").write(key.private_bytes(s.Encoding.PEM, s.PrivateFormat.OpenSSH, s.NoEncryption()))
open(sys.argv[1] + ".pub", "wb").write(
    key.public_key().public_bytes(s.Encoding.OpenSSH, s.PublicFormat.OpenSSH) + f" {sys.argv[2]}\n".encode())
EOF
        chmod 600 "$PKI/$1.key"
    fi
}
for i in $(seq 0 $((NUM_CLIENTS - 1))); do node_key "node-$i"; done
node_key stranger  # a well-formed key that is never registered

# ---------------------------------------------------------------- 2. the SuperLink
read -r PORT <<<"$(free_ports 1)"
ADDRESS="127.0.0.1:$PORT"
log "2. flower-superlink with TLS and SuperNode authentication on https://$ADDRESS"
start superlink flower-superlink \
    --ssl-ca-certfile "$PKI/ca.crt" --ssl-certfile "$PKI/server.pem" --ssl-keyfile "$PKI/server.key" \
    --enable-supernode-auth --host 127.0.0.1 --port "$PORT" \
    --database "$WORKDIR/superlink-home/state.db" --disable-runtime-dependency-installation
SUPERLINK_PID=$LAST_PID
wait_log "$WORKDIR/superlink.log" "Uvicorn running on https://" 60 "$SUPERLINK_PID"
grep -h "Uvicorn running on" "$WORKDIR/superlink.log"
# the certificate chain and the name 127.0.0.1 verify against the CA (a TLS 1.3 handshake)
openssl s_client -connect "$ADDRESS" -CAfile "$PKI/ca.crt" -verify_ip 127.0.0.1 -verify_return_error \
    </dev/null 2>/dev/null | grep -E "^(Verify return code|New, TLS)" || { echo "TLS check failed" >&2; exit 1; }

# ---------------------------------------------------------------- 3. the CLI's connection; registration
mkdir -p "$WORKDIR/cli-home"
cat >"$WORKDIR/cli-home/config.toml" <<EOF
[superlink]
default = "$CONNECTION"

[superlink.$CONNECTION]
address = "$ADDRESS"
root-certificates = "$PKI/ca.crt"
EOF
log "3. registering the SuperNodes' public keys (flwr supernode register)"
for i in $(seq 0 $((NUM_CLIENTS - 1))); do
    flwr_cli supernode register "$PKI/node-$i.key.pub" "$CONNECTION"
done

# ---------------------------------------------------------------- 4. the SuperNodes
log "4. starting $NUM_CLIENTS SuperNodes"
read -r -a NODE_PORTS <<<"$(free_ports "$NUM_CLIENTS")"
NODE_PIDS=()
for i in $(seq 0 $((NUM_CLIENTS - 1))); do
    start "supernode-$i" flower-supernode --superlink "$ADDRESS" --root-certificates "$PKI/ca.crt" \
        --auth-supernode-private-key "$PKI/node-$i.key" \
        --node-config "client-id=$i fedbayes-state=\"$WORKDIR/state-$i\"" \
        --host 127.0.0.1 --port "${NODE_PORTS[i]}"
    NODE_PIDS+=("$LAST_PID")
done
for i in $(seq 0 $((NUM_CLIENTS - 1))); do
    wait_log "$WORKDIR/supernode-$i.log" "SuperNode ID: [0-9]+" 120 "${NODE_PIDS[i]}"
    grep -h -o "SuperNode ID: [0-9]*" "$WORKDIR/supernode-$i.log" | sed "s/^/client $i: /"
done
flwr_cli supernode ls "$CONNECTION"

# ---------------------------------------------------------------- 5. refused SuperNodes
if [[ "$SHOW_REFUSALS" == 1 ]]; then
    log "5. a SuperNode with an unregistered key, and a plain-text (--insecure) one"
    read -r -a EXTRA_PORTS <<<"$(free_ports 2)"
    start supernode-unregistered flower-supernode --superlink "$ADDRESS" --root-certificates "$PKI/ca.crt" \
        --auth-supernode-private-key "$PKI/stranger.key" --node-config "client-id=0" \
        --host 127.0.0.1 --port "${EXTRA_PORTS[0]}" --max-retries 1
    STRANGER_PID=$LAST_PID
    start supernode-plaintext flower-supernode --superlink "$ADDRESS" --insecure --node-config "client-id=0" \
        --host 127.0.0.1 --port "${EXTRA_PORTS[1]}" --max-retries 1
    PLAIN_PID=$LAST_PID
    # both exit with Flower's exit code 305 (no connection to the SuperLink); neither gets a node id
    wait_log "$WORKDIR/supernode-unregistered.log" "Exit Code: 305" 120 "$STRANGER_PID"
    wait_log "$WORKDIR/supernode-plaintext.log" "Exit Code: 305" 120 "$PLAIN_PID"
    wait "$STRANGER_PID" "$PLAIN_PID" || true
    if grep -q "SuperNode ID" "$WORKDIR/supernode-unregistered.log" "$WORKDIR/supernode-plaintext.log"; then
        echo "a refused SuperNode got a node id" >&2; exit 1
    fi
    grep -h "Failed to activate SuperNode" "$WORKDIR/supernode-unregistered.log"
    grep -h -o "No SuperNode found with the given public key" "$WORKDIR/superlink.log" | head -1 |
        sed 's/^/SuperLink: /'
    # the TLS server closes a plain-text connection: the node reports a reset or an empty response
    grep -h -E "Server disconnected without sending a response|Connection reset by peer" \
        "$WORKDIR/supernode-plaintext.log" | sed 's/^/plain text: /'
fi

# ---------------------------------------------------------------- 6. the run, and fed_fit
log "6. flwr run examples/flower_app $CONNECTION ($NUM_ROUNDS rounds; one ClientApp process per message)"
flwr_cli run "$REPO/examples/flower_app" "$CONNECTION" --stream \
    --run-config "num-rounds=$NUM_ROUNDS num-clients=$NUM_CLIENTS" | tee "$WORKDIR/run.log"
RESULT="$(grep -h "^fedbayes result:" "$WORKDIR/run.log" | tail -1)"
[[ -n "$RESULT" ]] || { echo "the ServerApp printed no result" >&2; exit 1; }
log "comparing with fb.fed_fit on the same data (float32)"
RESULT="$RESULT" NUM_ROUNDS="$NUM_ROUNDS" NUM_CLIENTS="$NUM_CLIENTS" JAX_ENABLE_X64=0 \
    python - "$REPO/examples/flower_app" <<'EOF'
import json, os, sys, warnings
import numpy as np
import fedbayes as fb

warnings.simplefilter("ignore", fb.ConvergenceWarning)  # a few rounds: this compares results, not convergence

sys.path.insert(0, sys.argv[1])
from fedbayes_app import task

got = json.loads(os.environ["RESULT"].split(":", 1)[1])
rounds, clients = int(os.environ["NUM_ROUNDS"]), int(os.environ["NUM_CLIENTS"])
spec = task.spec({"num-clients": clients, "num-rounds": rounds})
ref = fb.fed_fit(spec.model, spec.data, spec.algorithm, num_rounds=rounds, seed=spec.seed, progress=False)
same = all(np.array_equal(np.asarray(got["params"][k], np.float32), np.asarray(v)) for k, v in ref.params.items())
same &= got["ledger_bits"] == ref.bits_up + ref.bits_down
print("fed_fit:", {k: np.asarray(v).tolist() for k, v in ref.params.items()},
      "ledger bits", ref.bits_up + ref.bits_down)
print("the deployment's result is fed_fit's bit for bit" if same else "the deployment's result differs from fed_fit")
sys.exit(0 if same else 1)
EOF
