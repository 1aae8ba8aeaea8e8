"""Where a fit's time goes before and after its rounds: the start-up profile of issue 25, item 3.

FedSOUL on FedPop's synthetic model (1 000 clients, every client each round, 200 rounds, the round math of
``bench_fedsoul.py``: 10 ULA steps, fixed step, plain SGD server step, float32), called twice in one fresh
process, each call's wall time split into its phases by timing the functions ``fb.fed_fit`` calls
(``fedbayes.api``): the model's analysis (``FedModel``), the set-up exchange (``staged_init``, its compilation
included), the rounds (``run_rounds``: compilation of the round chunk and the rounds), the final exchange
(``finalize_parts``), the fault table, and the convergence report (the idata and the diagnostics), the rest
(argument checks, ``build``, ``Result``) as "other". The reference is the hand-fused loop of
``bench_fedsoul.py`` (the same math as one ``jax.jit`` of a ``lax.scan``): its first call, compilation
included, in the same process before the fits.

    python benchmarks/bench_startup.py
"""

from __future__ import annotations

import time
import warnings

import _common  # noqa: F401 - benchmarks/_common.py: the script's folder is on sys.path
import jax

import bench_fedsoul as bf
import fedbayes as fb
import fedbayes.api as api
from _common import machine_line

CLIENTS, ROUNDS = 1000, 200
PHASES = {"FedModel": "model analysis (FedModel)", "staged_init": "set-up exchange (compile + run)",
          "run_rounds": "rounds (compile + run)", "finalize_parts": "final exchange (finalize_parts)",
          "fault_table": "fault table", "report": "convergence report (idata, diagnostics)"}


def timed(table: dict[str, float], name: str, fn):
    """``fn`` wrapped to add its wall time (its outputs waited for) to ``table[name]``."""

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        table[name] = table.get(name, 0.0) + time.perf_counter() - start
        return out

    return wrapper


def main() -> None:
    warnings.simplefilter("ignore")  # a 200-round fit's convergence warnings are not what is measured
    print(machine_line())
    data, _, _ = fb.models.make_fedpop_synthetic(CLIENTS, test_size=1, seed=0)

    start = time.perf_counter()
    rate = bf.handwritten(data, CLIENTS, ROUNDS)  # compiles and runs once, then times a second run
    first_hand = time.perf_counter() - start - ROUNDS / rate
    print(f"\nhand-fused loop, {CLIENTS} clients, {ROUNDS} rounds: first call {first_hand:.2f} s (compilation "
          f"included), a compiled call {ROUNDS / rate:.2f} s\n")

    table: dict[str, float] = {}
    for name in ("FedModel", "staged_init", "run_rounds", "finalize_parts", "fault_table"):
        setattr(api, name, timed(table, name, getattr(api, name)))
    api.convergence.report = timed(table, "report", api.convergence.report)
    algo = fb.FedSOUL(local_steps=10, step_size=bf.STEP, server_optimizer="sgd", server_lr=bf.LR_TOTAL / CLIENTS,
                      local_kernel="ula", num_samples=1, warmup=0, thinning=1, num_chains=1)
    calls = []
    for _ in range(2):
        table.clear()
        start = time.perf_counter()
        fb.fed_fit(fb.models.fedpop_synthetic, data, algo, num_rounds=ROUNDS, seed=0, progress=False)
        total = time.perf_counter() - start
        calls.append(dict(table, total=total, other=total - sum(table.values())))
    print("| phase | first call (s) | second call (s) |")
    print("|---|---|---|")
    for key, label in list(PHASES.items()) + [("other", "other (checks, build, Result)"), ("total", "total")]:
        print(f"| {label} | {calls[0].get(key, 0.0):.2f} | {calls[1].get(key, 0.0):.2f} |")
    rounds_run = calls[1].get("run_rounds", 0.0)
    print(f"\nfirst call / hand-fused first call: {calls[0]['total'] / first_hand:.2f}; second call / hand-fused "
          f"compiled call: {calls[1]['total'] / (ROUNDS / rate):.2f}; second call / its own rounds: "
          f"{calls[1]['total'] / rounds_run:.2f}")
    # fed_fit lowers its key hashes unrolled (fedbayes.prng.unrolled_hash); the reference above is compiled as one
    # writes it, with JAX's CPU loop. The same loop compiled with the unrolled hash, for the comparison of like with like
    start = time.perf_counter()
    with fb.prng.unrolled_hash():
        rate_u = bf.handwritten(data, CLIENTS, ROUNDS)
    first_u = time.perf_counter() - start - ROUNDS / rate_u
    print(f"hand-fused loop compiled with the unrolled hash: first call {first_u:.2f} s; fed_fit's first call / it: "
          f"{calls[0]['total'] / first_u:.2f}")
    cached(first_hand)


def one_fit_seconds() -> float:
    """The wall time of one ``fb.fed_fit`` of the benchmark's configuration (the process's first)."""
    data, _, _ = fb.models.make_fedpop_synthetic(CLIENTS, test_size=1, seed=0)
    algo = fb.FedSOUL(local_steps=10, step_size=bf.STEP, server_optimizer="sgd", server_lr=bf.LR_TOTAL / CLIENTS,
                      local_kernel="ula", num_samples=1, warmup=0, thinning=1, num_chains=1)
    start = time.perf_counter()
    fb.fed_fit(fb.models.fedpop_synthetic, data, algo, num_rounds=ROUNDS, seed=0, progress=False)
    return time.perf_counter() - start


def cached(first_hand: float) -> None:
    """The first call of a new process, with the persistent compilation cache (``FEDBAYES_COMPILATION_CACHE``)
    empty and then filled by an earlier process; the first against the hand-fused loop's first call
    ``first_hand`` (each the first computation of its process, so each pays JAX's own first-use work)."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, FEDBAYES_COMPILATION_CACHE=cache)
        seconds = []
        for _ in range(2):
            out = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                                 check=True)
            seconds.append(json.loads(out.stdout.strip().splitlines()[-1])["seconds"])
    print(f"\nfirst call of a new process with fb.compilation_cache(): {seconds[0]:.2f} s with the cache empty "
          f"({seconds[0] / first_hand:.2f}x the hand-fused first call), {seconds[1]:.2f} s with the entries an "
          "earlier process wrote")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--child"]:
        import json

        warnings.simplefilter("ignore")
        print(json.dumps({"seconds": one_fit_seconds()}))
    else:
        main()
