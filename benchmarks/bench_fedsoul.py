"""FedSOUL speed and memory: fed_fit against a hand-written JAX round of the same math.

Model: FedPop's synthetic regression (phi in R^{20x2}, z_i in R^2; 90% of clients with 5 points,
10% with 10), 10 ULA steps per round (``local_kernel="ula"``, the hand-written round's math), fixed
Langevin step, plain SGD server step, float32. A last column times the same fit with the default
Metropolis-adjusted kernel (``local_kernel="mala"``), against fed_fit's ULA.
Rounds per second exclude compilation: for fed_fit, the wall time of the chunks after the first two
(compilation and first execution; ``res.history["seconds"]``); for the hand-written version, a
second call of the compiled run of the same number of timed rounds.
Peak memory is the peak resident set size of a fresh process running one configuration.

    python benchmarks/bench_fedsoul.py            # prints the markdown table
    python benchmarks/bench_fedsoul.py --memory   # peak memory against the number of clients
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time

import _common  # benchmarks/_common.py (the script's folder is on sys.path)
import jax
import jax.numpy as jnp

WARM_CHUNKS, TIMED_CHUNKS = 2, 6  # chunks left out (compilation, first execution) and timed
STEP, NOISE = 1e-4, 0.1
LR_TOTAL = 1e-3  # server step = LR_TOTAL / clients x (summed client gradients)


def handwritten(data, cohort, rounds, seed=0):
    """FedSOUL rounds written directly in JAX for this model (the reference implementation)."""
    x, y, mask = data.padded["x"], data.padded["y"], data.mask.astype(jnp.float32)
    C, k = x.shape[0], x.shape[2]
    key = jax.random.PRNGKey(seed)

    def log_joint(theta, z, xi, yi, mi):
        phi, mu, log_s = theta
        r = (yi - xi @ (phi @ z)) * mi  # as fb.models.fedpop_synthetic writes it
        return -0.5 * jnp.sum(r**2) / NOISE**2 - 0.5 * jnp.sum((z - mu) ** 2) / jnp.exp(2 * log_s) - 2 * log_s

    grads = jax.grad(log_joint, argnums=(0, 1))

    def client(theta, z, kc, xi, yi, mi):
        def body(carry, kk):  # one gradient evaluation per step: grad_z drives the next move
            z, gz, acc = carry
            z = z + STEP * gz + jnp.sqrt(2 * STEP) * jax.random.normal(kk, z.shape)
            gt, gz = grads(theta, z, xi, yi, mi)
            return (z, gz, jax.tree_util.tree_map(jnp.add, acc, gt)), None

        zero = jax.tree_util.tree_map(jnp.zeros_like, theta)
        gz0 = grads(theta, z, xi, yi, mi)[1]
        (z, _, acc), _ = jax.lax.scan(body, (z, gz0, zero), jax.random.split(kc, 10))
        return z, jax.tree_util.tree_map(lambda a: a / 10, acc)

    def round_fn(carry, r):
        theta, zs = carry
        kr = jax.random.fold_in(key, r)
        idx = jax.random.choice(kr, C, (cohort,), replace=False) if cohort < C else jnp.arange(C)
        keys = jax.random.split(jax.random.fold_in(kr, 1), cohort)
        z_new, g = jax.vmap(client, in_axes=(None, 0, 0, 0, 0, 0))(theta, zs[idx], keys, x[idx], y[idx], mask[idx])
        zs = zs.at[idx].set(z_new)
        theta = jax.tree_util.tree_map(lambda t, gi: t + LR_TOTAL / C * (C / cohort) * gi.sum(0), theta, g)
        return (theta, zs), None

    theta0 = (0.3 * jax.random.normal(key, (k, 2)), jnp.zeros(2), jnp.zeros(()))
    run = jax.jit(lambda c: jax.lax.scan(round_fn, c, jnp.arange(rounds))[0])
    init = (theta0, jnp.zeros((C, 2)))
    jax.block_until_ready(run(init))  # compile
    t0 = time.perf_counter()
    jax.block_until_ready(run(init))
    return rounds / (time.perf_counter() - t0)


def chunk_for(clients: int) -> int:
    return 10 if clients >= 10000 else 50


def one(impl: str, clients: int, fraction: float) -> float:
    """Rounds per second of one implementation, compilation excluded."""
    import fedbayes as fb

    chunk = chunk_for(clients)
    rounds = chunk * (WARM_CHUNKS + TIMED_CHUNKS)
    data, _, _ = fb.models.make_fedpop_synthetic(clients, test_size=1, seed=0)
    cohort = max(1, int(round(fraction * clients)))
    if impl == "handwritten":
        return handwritten(data, cohort, chunk * TIMED_CHUNKS)
    # "fed_fit": ULA, the hand-written round's math; "fed_fit_mala": the default Metropolis-adjusted kernel
    kernel = "mala" if impl == "fed_fit_mala" else "ula"
    algo = fb.FedSOUL(local_steps=10, step_size=STEP, server_optimizer="sgd", server_lr=LR_TOTAL / clients,
                      local_kernel=kernel, num_samples=1, warmup=0, thinning=1, num_chains=1)
    res = fb.fed_fit(fb.models.fedpop_synthetic, data, algo, num_rounds=rounds, clients_per_round=cohort,
                     seed=0, chunk_size=chunk, progress=False)
    timed = res.history["seconds"][WARM_CHUNKS * chunk:]
    return len(timed) / timed.sum()


def footprint(config: str, clients: int) -> float:
    """Seconds of one fit whose peak memory is measured: ``"bench"``, this script's configuration (one
    local draw kept per client), or ``"default"``, FedSOUL's defaults (2 chains of 200 local draws kept per
    client, Louis' standard errors); 40 rounds in chunks of 10, every client each round."""
    import fedbayes as fb

    data, _, _ = fb.models.make_fedpop_synthetic(clients, test_size=1, seed=0)
    if config == "bench":
        algo = fb.FedSOUL(local_steps=10, step_size=STEP, server_optimizer="sgd", server_lr=LR_TOTAL / clients,
                          local_kernel="ula", num_samples=1, warmup=0, thinning=1, num_chains=1)
    else:
        algo = fb.FedSOUL()
    start = time.perf_counter()
    fb.fed_fit(fb.models.fedpop_synthetic, data, algo, num_rounds=40, seed=0, chunk_size=10, progress=False)
    return time.perf_counter() - start


def child(argv):
    if argv[0] == "footprint":
        seconds = footprint(argv[1], int(argv[2]))
        print(json.dumps({"seconds": seconds, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
        return
    impl, clients, fraction = argv[0], int(argv[1]), float(argv[2])
    rate = one(impl, clients, fraction)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rate": rate, "peak_mb": peak_mb}))


MEMORY_SIZES = {"bench": (10_000, 30_000, 100_000), "default": (10_000, 20_000, 40_000)}  # the defaults' fit is 10x longer


def memory(budget_gb: float = 24.0) -> None:
    """Peak memory against the number of clients, each fit in a fresh process; the slope between the two
    largest federations is the memory per client, and the largest federation within ``budget_gb`` is
    extrapolated along it."""
    print(_common.machine_line())
    print("| configuration | clients | peak MB | fit seconds |")
    print("|---|---|---|---|")
    for config, sizes in MEMORY_SIZES.items():
        peaks = {}
        for clients in sizes:
            out = run_child("footprint", config, clients)
            peaks[clients] = out["peak_mb"]
            print(f"| {config} | {clients:,} | {out['peak_mb']:.0f} | {out['seconds']:.1f} |", flush=True)
        a, b = sizes[-2], sizes[-1]
        per_client = (peaks[b] - peaks[a]) * 2**20 / (b - a)
        largest = b + (budget_gb * 2**30 - peaks[b] * 2**20) / per_client
        print(f"\n{config}: {per_client / 1024:.1f} KB per client (between {a:,} and {b:,} clients); "
              f"{budget_gb:g} GB hold about {largest:,.0f} clients\n", flush=True)


def run_child(*args) -> dict:
    return _common.run_child(__file__, *args)


def main(sizes=(100, 1000, 10000), fractions=(1.0, 0.1)):
    print(_common.machine_line())
    print("| clients | participation | fed_fit rounds/s | hand-written rounds/s | time ratio | "
          "fed_fit peak MB | hand-written peak MB | fed_fit MALA rounds/s | MALA / ULA time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for clients in sizes:
        for fraction in fractions:
            rates, peaks = {}, {}
            try:
                for impl in ("fed_fit", "handwritten", "fed_fit_mala"):
                    out = run_child(impl, clients, fraction)
                    rates[impl], peaks[impl] = out["rate"], out["peak_mb"]
                    print(f"# {impl}, {clients} clients, {fraction:.0%}: {_rate(out['rate'])} rounds/s, peak "
                          f"{out['peak_mb']:.0f} MB", file=sys.stderr, flush=True)  # kept if a later column is cut
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:  # one size failing ends its row
                why = (e.stderr or "").strip().splitlines()[-1:] if isinstance(e.stderr, str) else ["timed out"]
                print(f"| {clients} | {fraction:.0%} | {impl} failed: {why[0] if why else e} | | | | | | |", flush=True)
                continue
            fed, ref, mala = (_rate(rates[i]) for i in ("fed_fit", "handwritten", "fed_fit_mala"))
            print(f"| {clients} | {fraction:.0%} | {fed} | {ref} | {rates['handwritten'] / rates['fed_fit']:.2f} | "
                  f"{peaks['fed_fit']:.0f} | {peaks['handwritten']:.0f} | {mala} | "
                  f"{rates['fed_fit'] / rates['fed_fit_mala']:.2f} |", flush=True)


def _rate(rounds_per_second: float) -> str:
    """One decimal, or three significant digits below 10 rounds/s (a million clients on a CPU: 0.3)."""
    return f"{rounds_per_second:.1f}" if rounds_per_second >= 10 else f"{rounds_per_second:.3g}"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    elif "--memory" in sys.argv:
        memory()
    else:
        import argparse

        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
        parser.add_argument("--fractions", type=float, nargs="+", default=[1.0, 0.1])
        args = parser.parse_args()
        main(args.clients, args.fractions)
