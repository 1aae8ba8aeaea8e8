"""What running on Flower costs against the vectorised simulation: seconds per round and bytes per round.

The same fit three ways, same seed, float32 (what crosses the wire):

* ``fed_fit``: every client step vectorised (``jax.vmap``), rounds inside ``jax.lax.scan``: the plain
  computation of the algorithm's math, the reference;
* ``simulate(backend="local")``: Flower's messages (``fb.flower.LocalGrid``): the ServerApp and the
  ClientApp exchange real ``flwr.app.Message`` objects, one per client per round, delivered in this
  process one after another, each client step a separate jitted call on one client's data;
* ``simulate(backend="ray")``: Flower's simulation engine, one SuperNode per client, ClientApps in Ray
  workers (one CPU each).

Algorithm: D-ELF (top-1 uplink, 2 chains) on logistic regression with d = 3 (``make_glm_clients``, 20
points per client), ``num_clients`` clients, every client every round. Seconds per round: wall time
of the rounds (fed_fit: ``history["seconds"]`` of chunks after the first two, compilation excluded; Flower:
``history["seconds"]``, which on Flower is the loop over rounds after set-up, so the first round's
compilation of the client step is in it: the fit is long enough that this is a small share, and the
Ray rows include each worker's own compilation, which is what a user waits for). The time ratio is
Flower's seconds per round over fed_fit's. Bytes per round: the payload bytes Flower counted
(``ArrayRecord.count_bytes``) over the rounds, against the ledger's bits / 8 (they differ by the
rounding of each message to whole bytes).

    python benchmarks/bench_flower.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("FLWR_HOME", tempfile.mkdtemp(prefix="fedbayes-flwr-bench-"))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import fedbayes as fb  # noqa: E402
import fedbayes.flower  # noqa: E402,F401


def per_round(res, skip: int = 0) -> float:
    """Mean seconds per round after the first ``skip`` rounds (the engine spreads a chunk's time evenly
    over its rounds; Flower records each round's own)."""
    return float(np.mean(np.asarray(res.history["seconds"], float)[skip:]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sizes = [5, 10] if args.quick else [10, 50]
    rounds = 40 if args.quick else 200
    ray = not args.quick
    print(f"{platform.machine()}, {os.cpu_count()} CPU cores, jax {jax.__version__}, Python {platform.python_version()}; "
          f"D-ELF (top-1, 2 chains), d = 3, {rounds} rounds")
    print()
    print("| clients | fed_fit s/round | Flower local s/round | ratio | Flower Ray s/round | ratio | "
          "payload bytes/round | ledger bits/8 per round |")
    print("|---|---|---|---|---|---|---|---|")
    model = fb.models.logistic_regression()
    for n in sizes:
        data, _ = fb.models.make_glm_clients(n, 3, 20, seed=0)
        algo = fb.DELF(uplink=fb.compress.top_k(1), num_chains=2, warmup=rounds // 4)
        chunk = rounds // 10
        ref = fb.fed_fit(model, data, algo, num_rounds=rounds, seed=0, chunk_size=chunk, progress=False)
        t_ref = per_round(ref, skip=2 * chunk)
        local = fb.flower.simulate(model, data, algo, num_rounds=rounds, seed=0, backend="local", progress=False)
        t_local = per_round(local)
        msgs = [m for m in local.flower_messages if m[0] in ("broadcast", "upload")]
        payload = sum(m[3] for m in msgs) / rounds
        ledger = (local.history["bits_up"].sum() + local.history["bits_down"].sum()) / 8 / rounds
        ray_cells = "—", "—"
        if ray:
            t0 = time.perf_counter()
            res_ray = fb.flower.simulate(model, data, algo, num_rounds=rounds, seed=0, backend="ray",
                                         num_cpus_per_client=1, progress=False)
            t_ray = per_round(res_ray)
            ray_cells = f"{t_ray:.4f}", f"{t_ray / t_ref:.0f}"
            print(f"(Ray run of {n} clients: {time.perf_counter() - t0:.0f} s in all, start-up included)", flush=True)
        print(f"| {n} | {t_ref:.5f} | {t_local:.4f} | {t_local / t_ref:.0f} | {ray_cells[0]} | {ray_cells[1]} | "
              f"{payload:.1f} | {ledger:.1f} |", flush=True)


if __name__ == "__main__":
    main()
