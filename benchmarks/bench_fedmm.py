"""FedMM round throughput and bits per round, against a hand-written centralised EM iteration.

Gaussian mixture with K = 5 components in D = 10, full covariances (``fb.models.gaussian_mixture``),
heterogeneous clients from ``fb.models.make_gaussian_mixture`` (50-150 points each, Dirichlet(0.5)
mixing weights), 100 and 1 000 clients (``--clients`` for others). FedMM with step_size = 1, every client
in every round and no compression (exact federated EM), ``uncertainty=False``, JAX's default float32.

* FedMM: seconds per round of the compiled round loop, compilation excluded: the chunks after the
  first two (compilation and first execution) from ``res.history["seconds"]``, in a fit of 500 rounds
  (``fed_fit``'s default), twice: with the default ``size_buckets="auto"`` (the clients in as many size
  buckets as 500 rounds repay, ``fedbayes.engine.size_buckets``) and with ``size_buckets=4``. Each fit's
  whole wall time (compilation included) is printed too, and the table's column of the first chunk (compiling)
  plus the other rounds at the timed rate says what the buckets cost and save: a bucket costs a compilation. A fit of 2 rounds runs
  first, to warm the process (the first fit of a process also pays its one-time costs).
* Centralised EM: one EM iteration on the pooled data written directly in JAX (E-step
  responsibilities by log-sum-exp, the Mahalanobis terms through the inverse Cholesky factor of
  each component's covariance as one matrix product; closed-form M-step for the weights, means and
  full covariances), jit-compiled, warmed up, then timed over many iterations
  (``block_until_ready`` at the end).

Before timing, the script checks that the two compute the same iterates: both start from the same
parameters and FedMM's first recorded round (EM iterate 2) is compared with two hand-written steps.
"ratio" = FedMM seconds per round / centralised seconds per iteration. Bits per round are all
clients together (FedMM's statistic up, statistic + parameters down, 32-bit floats).

Each configuration runs in a fresh process, watched: jaxlib 0.10.2 on a small CPU can deadlock
inside FedMM's round (seen at 1 000 clients on 2 cores: both intra-op pool threads blocked in
batched LAPACK triangular solves, ``jax::ParallelBatchMap``, each waiting for pieces queued behind
the other; the process then uses no CPU). A child whose CPU time stops advancing for STALL seconds
is stopped and the configuration retried, up to ATTEMPTS times; every stop is printed. The first
attempt uses jaxlib's default pool (one thread per core); retries set ``NPROC`` (the pool size) to
twice the cores, which avoided the deadlock in our runs. More threads than that oversubscribe the
cores and slow FedMM's round a lot (on 2 cores at 1 000 clients: 0.07 s/round with the default pool
when it did not hang, 0.10 with 4 threads, 0.24 with 8, 2.2 with 16). The table says which pool
each row ran with; the hand-written EM is timed in the same process, under the same pool.
``--nproc N`` fixes NPROC for every attempt (0: always jaxlib's default). The watch for a stalled child is
on a CPU only: on a GPU the host may sit idle while a long kernel runs.

    python benchmarks/bench_fedmm.py [--nproc N] [--clients 100 1000 ...]
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import fedbayes as fb

K, D, SIZES = 5, 10, (50, 150)
CHUNKS = {100: 25, 1000: 10}  # rounds per scan chunk (10 for other numbers of clients)
ROUNDS = 500  # fed_fit's default number of rounds (what the default size buckets weigh their compilation against)
WARM = 2  # chunks left out (compilation, first execution); the others are timed
BUCKETS = 4  # the forced size buckets of the second FedMM column (fedbayes.engine.MAX_BUCKETS)
EM_ITERS = 200  # timed hand-written iterations
STALL, TIME_LIMIT, ATTEMPTS = 45, 900, 5  # s without CPU progress = hung; s per attempt; tries


def make_em_step(y: jax.Array):
    """One EM iteration of a full-covariance Gaussian mixture on the pooled data y (N, D)."""
    n, d = y.shape

    def step(params):
        weights, means, covs = params
        chol = jnp.linalg.cholesky(covs)  # (K, D, D)
        eye = jnp.broadcast_to(jnp.eye(d, dtype=y.dtype), chol.shape)
        inv_chol = jax.scipy.linalg.solve_triangular(chol, eye, lower=True)  # L_k^{-1}, (K, D, D)
        z = jnp.einsum("ked,nd->kne", inv_chol, y) - jnp.einsum("ked,kd->ke", inv_chol, means)[:, None, :]
        half_logdet = jnp.sum(jnp.log(jnp.diagonal(chol, axis1=1, axis2=2)), axis=1)  # (K,)
        log_joint = (jnp.log(weights)[:, None] - 0.5 * jnp.sum(z**2, axis=2) - half_logdet[:, None]
                     - 0.5 * d * math.log(2 * math.pi))  # (K, N)
        resp = jnp.exp(log_joint - jax.scipy.special.logsumexp(log_joint, axis=0, keepdims=True))
        nk = resp.sum(1)  # (K,)
        means = (resp @ y) / nk[:, None]
        second = jnp.einsum("kn,nd,ne->kde", resp, y, y) / nk[:, None, None]
        covs = second - jnp.einsum("kd,ke->kde", means, means)
        return nk / n, means, 0.5 * (covs + jnp.swapaxes(covs, 1, 2))

    return jax.jit(step)


def make_federated_em_step(y: jax.Array, mask: jax.Array):
    """One exact federated EM round written directly in JAX, in the layout a federated simulation has:
    each client's statistics from its own rows, padded to the largest client (``y`` (C, n_max, D), ``mask``
    (C, n_max)), vmapped over clients, summed at the server, then the closed-form M-step. The same math
    as :func:`make_em_step`; what it adds is the padding and the per-client batching."""
    c, n_max, d = y.shape
    total = jnp.sum(mask)

    def client(params, yi, mi):
        weights, means, covs = params
        chol = jnp.linalg.cholesky(covs)
        eye = jnp.broadcast_to(jnp.eye(d, dtype=yi.dtype), chol.shape)
        inv_chol = jax.scipy.linalg.solve_triangular(chol, eye, lower=True)
        z = jnp.einsum("ked,nd->kne", inv_chol, yi) - jnp.einsum("ked,kd->ke", inv_chol, means)[:, None, :]
        half_logdet = jnp.sum(jnp.log(jnp.diagonal(chol, axis1=1, axis2=2)), axis=1)
        log_joint = jnp.log(weights)[:, None] - 0.5 * jnp.sum(z**2, axis=2) - half_logdet[:, None]
        resp = jnp.exp(log_joint - jax.scipy.special.logsumexp(log_joint, axis=0, keepdims=True)) * mi[None]
        return resp.sum(1), resp @ yi, jnp.einsum("kn,nd,ne->kde", resp, yi, yi)

    def step(params):
        nk, s1, s2 = jax.tree_util.tree_map(lambda a: a.sum(0), jax.vmap(client, in_axes=(None, 0, 0))(params, y, mask))
        means = s1 / nk[:, None]
        covs = s2 / nk[:, None, None] - jnp.einsum("kd,ke->kde", means, means)
        return nk / total, means, 0.5 * (covs + jnp.swapaxes(covs, 1, 2))

    return jax.jit(step)


def time_em(step, params, iters: int) -> float:
    """Seconds per iteration of the compiled step, after two warm-up calls."""
    for _ in range(2):
        params = jax.block_until_ready(step(params))
    t0 = time.perf_counter()
    for _ in range(iters):
        params = step(params)
    jax.block_until_ready(params)
    return (time.perf_counter() - t0) / iters


def bench(clients: int, chunk: int) -> dict:
    data, _ = fb.models.make_gaussian_mixture(clients, num_components=K, dim=D, sizes=SIZES, seed=0)
    model = fb.models.gaussian_mixture(K, D)
    y = jnp.asarray(data.pooled()["y"], jnp.float32)
    rng = np.random.default_rng(0)
    init_means = np.asarray(y)[rng.choice(len(y), K, replace=False)]

    rounds = ROUNDS
    algo = fb.FedMM(step_size=1.0, participation=1.0, uncertainty=False, init={"means": init_means})
    fits = {}
    # a fit of 2 rounds first warms the process (imports, JAX's own start-up; the first fit of a process pays
    # them), so that both timed fits start from the same warm process and differ by what their buckets compile
    # and save; it is another run (other rounds), so it compiles none of their programs for them
    fb.fed_fit(model, data, algo, num_rounds=2, chunk_size=1, seed=1, progress=False)
    for buckets in ("auto", BUCKETS):
        t0 = time.perf_counter()
        res = fb.fed_fit(model, data, algo, num_rounds=rounds, chunk_size=chunk, seed=0, progress=False,
                         size_buckets=buckets)
        total = time.perf_counter() - t0
        timed = res.history["seconds"][WARM * chunk:]
        with fb.engine.bucketed_clients(buckets):  # the layout the fit's rounds used
            run = algo.build(fb.engine.Problem(fb.introspect.FedModel(model, data), data, rounds))
            layout = fb.engine.round_buckets(run, fb.engine.Problem(None, data, rounds), data.num_clients)
        fits[buckets] = dict(s=float(timed.sum() / len(timed)), fit_s=total,
                             first_chunk_s=float(res.history["seconds"][0] * chunk),
                             buckets=1 if layout is None else len(layout.parts),
                             padded=int(data.mask.size if layout is None else sum(p.mask.size for p in layout.parts)),
                             means=np.asarray(res.history["theta/means"][-1]))
    differ = float(np.max(np.abs(fits["auto"]["means"] - fits[BUCKETS]["means"])))
    fedmm_s = fits["auto"]["s"]

    step = make_em_step(y)
    start = (jnp.full(K, 1.0 / K, jnp.float32), jnp.asarray(init_means, jnp.float32),
             jnp.broadcast_to(jnp.eye(D, dtype=jnp.float32), (K, D, D)))
    two = step(step(start))  # FedMM's round 0 holds EM iterate 2 (the first M-step is in its init)
    agree = {"means": float(jnp.max(jnp.abs(two[1] - res.history["theta/means"][0]))),
             "covs": float(jnp.max(jnp.abs(two[2] - res.history["theta/covs"][0])))}
    em_s = time_em(step, start, EM_ITERS)
    fed_step = make_federated_em_step(jnp.asarray(data.padded["y"], jnp.float32), data.mask.astype(jnp.float32))
    fed_two = fed_step(fed_step(start))
    agree["federated means"] = float(jnp.max(jnp.abs(fed_two[1] - two[1])))
    fed_em_s = time_em(fed_step, start, EM_ITERS)
    for f in fits.values():
        f.pop("means")
    return dict(clients=clients, n=int(data.total_size), fedmm_s=fedmm_s, em_s=em_s, fed_em_s=fed_em_s,
                padded=int(data.mask.size), fits={str(k): v for k, v in fits.items()}, differ=differ,
                up=int(res.history["bits_up"][-1]), down=int(res.history["bits_down"][-1]),
                agree=agree, rounds=rounds, chunk=chunk)


def _cpu_ticks(pid: int) -> int | None:
    """User + system CPU time of a process in clock ticks (Linux /proc), None where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


def chunk_for(clients: int) -> int:
    return CHUNKS.get(clients, 10)


def run_child(clients: int, nproc: int | None) -> dict | None:
    """bench(clients) in a fresh process, retried when it hangs; None if every attempt did.

    nproc None: jaxlib's default pool first, then NPROC = 2 x cores; 0: always the default; N: NPROC=N.
    """
    watch_cpu = jax.default_backend() == "cpu"  # the deadlock is XLA:CPU's; a GPU run's host may idle for long
    for attempt in range(1, ATTEMPTS + 1):
        threads = nproc if nproc is not None else (0 if attempt == 1 else 2 * (os.cpu_count() or 1))
        env = dict(os.environ, **({"NPROC": str(threads)} if threads > 0 else {}))
        t0 = time.perf_counter()
        with tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen([sys.executable, __file__, "--child", str(clients)], stdout=subprocess.PIPE,
                                    stderr=err, text=True, env=env)
            last, since, why = None, time.perf_counter(), None
            while proc.poll() is None:
                time.sleep(2)
                ticks, now = _cpu_ticks(proc.pid), time.perf_counter()
                if ticks != last or ticks is None:
                    last, since = ticks, now
                if watch_cpu and now - since > STALL:
                    why = f"no CPU used for {STALL} s (the jaxlib deadlock described in the docstring)"
                elif now - t0 > TIME_LIMIT:
                    why = f"past the {TIME_LIMIT} s limit"
                if why:
                    proc.kill()
                    proc.wait()
                    break
            out = proc.stdout.read()
            proc.stdout.close()
            pool = f"NPROC={threads}" if threads > 0 else "default pool"
            if why:
                print(f"{clients} clients, attempt {attempt} ({pool}): stopped after {time.perf_counter() - t0:.0f} s, "
                      f"{why}", flush=True)
                continue
            if proc.returncode != 0:
                err.seek(0)
                raise RuntimeError(f"{clients} clients: the child failed:\n{err.read()[-3000:]}")
            return {**json.loads(out.strip().splitlines()[-1]), "pool": pool}
    return None


def main(nproc: int | None, sizes: tuple[int, ...] = (100, 1000)) -> None:
    dev = jax.devices()[0]
    chunks = {c: chunk_for(c) for c in sizes}
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {platform.platform()}, {platform.machine()}, "
          f"{os.cpu_count()} CPU cores, {dev.platform} ({dev.device_kind}), jax {jax.__version__}, "
          f"Python {platform.python_version()}")
    print(f"# Gaussian mixture K = {K}, D = {D}, full covariances, {SIZES[0]}-{SIZES[1]} points per client; "
          f"FedMM step 1, full participation, no compression, float32, {ROUNDS} rounds; timed: the scan chunks after "
          f"the first {WARM} ({chunks} rounds per chunk by clients), {EM_ITERS} centralised iterations\n", flush=True)
    rows = []
    for clients in sizes:
        r = run_child(clients, nproc)
        if r is None:
            rows.append(dict(clients=clients))
            continue
        rows.append(r)
        for name, f in r["fits"].items():
            print(f"{clients} clients, size_buckets={name!r}: {f['buckets']} bucket(s), fed_fit {r['rounds']} rounds in "
                  f"{f['fit_s']:.1f} s (first chunk of {r['chunk']} rounds, compilation included: "
                  f"{f['first_chunk_s']:.1f} s)", flush=True)
        print(f"{clients} clients: FedMM vs hand-written EM iterate 2: max |diff| means {r['agree']['means']:.1e}, "
              f"covs {r['agree']['covs']:.1e}; final means, default vs {BUCKETS} buckets: {r['differ']:.1e}", flush=True)
    print(f"\n| clients | N total | FedMM default: buckets (padded rows) | s/round | ratio | FedMM {BUCKETS} buckets: "
          "padded rows | s/round | ratio | centralised EM s/iteration | hand-written federated EM (padded) s/round | "
          "ratio | first chunk (compiling) + other rounds, default / 4 buckets (s) | bits up/round | bits down/round | "
          "XLA pool |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "n" not in r:
            print(f"| {r['clients']} | - | no result in {ATTEMPTS} attempts (hung) |" + " - |" * 12)
            continue
        a, b = r["fits"]["auto"], r["fits"][str(BUCKETS)]
        print(f"| {r['clients']} | {r['n']:,} | {a['buckets']} ({a['padded']:,}) | {a['s']:.2e} | "
              f"{a['s'] / r['em_s']:.2f} | {b['padded']:,} | {b['s']:.2e} | {b['s'] / r['em_s']:.2f} | "
              f"{r['em_s']:.2e} | {r['fed_em_s']:.2e} | {r['fed_em_s'] / r['em_s']:.2f} | "
              f"{_rounds_s(a, r):.2f} / {_rounds_s(b, r):.2f} | {r['up']:,} | {r['down']:,} | {r['pool']} |")


def _rounds_s(fit: dict, r: dict) -> float:
    """The first chunk's seconds (compilation included) and the other rounds' at the timed rate: what the buckets
    change in a fit's time (the fits' whole times also hold what the first fit compiles and the second reuses)."""
    return fit["first_chunk_s"] + fit["s"] * (r["rounds"] - r["chunk"])


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        n = int(sys.argv[2])
        print(json.dumps(bench(n, chunk_for(n))))
    else:
        import argparse

        parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
        parser.add_argument("--nproc", type=int, default=None,
                            help="XLA intra-op threads (NPROC) for every attempt; 0: jaxlib's default "
                                 "(without it: the default first, then 2 x cores after a hang)")
        parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
        args = parser.parse_args()
        main(args.nproc, tuple(args.clients))
