"""Federated Langevin samplers: speed, bits per iteration, and bits to reach an accurate posterior mean.

Bayesian logistic regression, d = 50 (N(0, 1) prior), 20 points per client, heterogeneous clients
(client-specific covariate shifts), 100 and 1 000 clients. For each sampler: iterations per second
(compilation excluded: chunks after the first two, from ``res.history["seconds"]``), bits per
iteration (up + down, all clients), next to a hand-written JAX LMC of the same math in the same
run; and, for 100 clients, the bits sent until the running posterior mean of 4 chains is within
0.1 posterior sd of a NumPyro NUTS reference on the pooled data (every coordinate).

    python benchmarks/bench_langevin.py                # both tables
    python benchmarks/bench_langevin.py --throughput   # the speed table only
    python benchmarks/bench_langevin.py --unrolled-reference   # B-ELF nat/nat against a reference with the unrolled hash
    python benchmarks/bench_langevin.py --throughput --same-hash   # every reference compiled with the unrolled hash
    python benchmarks/bench_langevin.py --throughput --clients 1000 10000 100000 --repeats 1   # other sizes

fed_fit lowers every key hash of its computations unrolled (``fedbayes.prng.unrolled_hash``: JAX's own lowering on
other platforms, the same bits); the hand-written references are compiled as one writes them, with JAX's CPU loop.
``--same-hash`` compiles the references inside ``fedbayes.prng.unrolled_hash()`` too: what is left of a ratio then
is fed_fit's own work, not the hash's lowering.
"""

from __future__ import annotations

import contextlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

import fedbayes as fb

D, PER_CLIENT, WARM = 50, 20, 2
TIMED_ROUNDS = {100: 6000, 1000: 1000}  # about 0.2-2 s of rounds each: long enough to time (300 rounds of 30 us were not)
# other numbers of clients: timed_rounds()
LONG_CHUNK = 1000  # chunks this long leave the per-chunk host work (records, stop checks, progress) out of the rate
RAMP = 2000  # the default timed chunks' first rounds (chunks of 1, 2, 4, 64, ... rounds), left out of the timed rate


def timed_rounds(clients: int) -> int:
    """Rounds timed per rate: :data:`TIMED_ROUNDS`, else about 10^6 client iterations (at least 100 rounds)."""
    return TIMED_ROUNDS.get(clients, max(100, 1_000_000 // clients))


def ramp_rounds(clients: int) -> int:
    """The default timed chunks' first rounds left out of the timed rate: :data:`RAMP`, or as many as are timed
    where that is fewer (a large federation's rounds are long enough to time from the start)."""
    return min(RAMP, timed_rounds(clients))


def long_chunk(clients: int) -> int:
    """The long chunks' rounds: :data:`LONG_CHUNK`, or the timed rounds where those are fewer."""
    return min(LONG_CHUNK, timed_rounds(clients))


def model(x, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[1]]).to_event(1))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def make_data(clients: int, seed: int = 0) -> fb.FederatedData:
    rng = np.random.default_rng(seed)
    w_true = rng.normal(size=D) / np.sqrt(D)
    xs, ys = [], []
    for _ in range(clients):
        x = rng.normal(size=(PER_CLIENT, D)) + rng.normal(scale=0.5, size=D)
        xs.append(x)
        ys.append((rng.random(PER_CLIENT) < 1 / (1 + np.exp(-x @ w_true))).astype(np.int32))
    return fb.FederatedData({"x": xs, "y": ys})


def handwritten_lmc(data: fb.FederatedData, gamma: float, rounds: int) -> float:
    """Iterations per second of LMC written directly in JAX (full gradients, vmap over clients)."""
    x, y, m = data.padded["x"], data.padded["y"].astype(jnp.float32), data.mask.astype(jnp.float32)
    b = x.shape[0]

    def u_i(w, xi, yi, mi):
        logits = xi @ w
        return -jnp.sum(mi * (yi * logits - jnp.logaddexp(0.0, logits))) + 0.5 * jnp.sum(w**2) / b

    grad = jax.vmap(jax.grad(u_i), in_axes=(None, 0, 0, 0))

    def step(w, k):
        g = grad(w, x, y, m).sum(0)
        return w - gamma * g + jnp.sqrt(2 * gamma) * jax.random.normal(jax.random.PRNGKey(k), w.shape), None

    run = jax.jit(lambda w: jax.lax.scan(step, w, jnp.arange(rounds))[0])
    w0 = jnp.zeros(D)
    jax.block_until_ready(run(w0))
    t0 = time.perf_counter()
    jax.block_until_ready(run(w0))
    return rounds / (time.perf_counter() - t0)


def topk_rows(k: int):
    """Hand-written top-k of each row of a (rows, d) batch, dense: the k largest |v_j| kept, the rest zeroed."""
    def compress(key, v):
        _, idx = jax.lax.top_k(jnp.abs(v), k)
        rows = jnp.arange(v.shape[0])[:, None]
        return jnp.zeros_like(v).at[rows, idx].set(v[rows, idx])
    return compress


def natural_rows(key, v, uniform=jax.random.uniform):
    """Hand-written contractive natural compression of a (rows, d) batch: each v_j rounded at random to
    sign(v_j) 2^floor(log2 |v_j|) or twice that, unbiased, then scaled by 1 / (1 + 1/8)."""
    size = jnp.abs(v)
    low = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(size, jnp.uint32) & jnp.uint32(0xFF800000),
                                       jnp.float32)  # 2^floor(log2 |v_j|): the mantissa cleared
    up = uniform(key, v.shape) * low < size - low
    return jnp.sign(v) * jnp.where(up, 2 * low, low) * (8.0 / 9.0)


def natural_rows_unrolled(key, v):
    """``natural_rows`` drawing the same uniforms with ``fedbayes.prng.uniform`` (JAX's hash without its CPU loop),
    as fed_fit's natural compression does."""
    return natural_rows(key, v, lambda k, shape: fb.prng.uniform(k, shape, jnp.float32))


def unrolled_reference(clients: int, repeats: int = 3) -> None:
    """B-ELF nat/nat's hand-written reference with ``natural_rows_unrolled``, against fed_fit's default: how much
    of fed_fit's rate is the unrolled hash alone."""
    data = make_data(clients)
    gamma = fb.elf.curvature_step_size(model, data, scale=0.1)
    timed = timed_rounds(clients)
    nat = fb.compress.natural(contractive=True)
    refs, feds = [], []
    for _ in range(repeats):
        refs.append(handwritten_elf(data, gamma, timed, up=natural_rows_unrolled, down=natural_rows_unrolled))
        feds.append(rate(data, fb.BELF(uplink=nat, downlink=nat), gamma, None, timed)[0])
    print(f"| {clients} | {max(refs):.1f} | {max(feds):.1f} | {max(refs) / max(feds):.2f} |", flush=True)


def handwritten_elf(data: fb.FederatedData, gamma: float, rounds: int, up=None, down=None, naive=False) -> float:
    """Iterations per second of a compressed Langevin sampler written directly in JAX, one chain:
    ``up`` compresses the clients' gradient differences (EF21: D-ELF, B-ELF) or, with ``naive``, the
    gradients themselves; ``down`` the server's x - w (EF21-P: P-ELF, B-ELF)."""
    x_, y_, m_ = data.padded["x"], data.padded["y"].astype(jnp.float32), data.mask.astype(jnp.float32)
    b = x_.shape[0]

    def u_i(w, xi, yi, mi):
        logits = xi @ w
        return -jnp.sum(mi * (yi * logits - jnp.logaddexp(0.0, logits))) + 0.5 * jnp.sum(w**2) / b

    grads = jax.jit(jax.vmap(jax.grad(u_i), in_axes=(None, 0, 0, 0)))

    def step(carry, k):
        x, w, gi, g = carry
        k_noise, k_up, k_down = jax.random.split(jax.random.PRNGKey(k), 3)
        x = x - gamma * g + jnp.sqrt(2 * gamma) * jax.random.normal(k_noise, x.shape)
        if down is not None:
            w = w + down(k_down, (x - w)[None])[0]
        new = grads(x if down is None else w, x_, y_, m_)
        if naive:
            g = up(k_up, new).sum(0)
        else:
            c = up(k_up, new - gi)
            gi, g = gi + c, g + c.sum(0)
        return (x, w, gi, g), None

    x0 = jnp.zeros(D)
    g0 = grads(x0, x_, y_, m_)
    start = (x0, x0, g0, g0.sum(0))
    run = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(rounds))[0])
    jax.block_until_ready(run(start))
    t0 = time.perf_counter()
    jax.block_until_ready(run(start))
    return rounds / (time.perf_counter() - t0)


def samplers(k: int):
    top = fb.compress.top_k(k)
    return {
        "LMC": fb.LMC(),
        "naive top-k LMC": fb.LMC(compressor=top),
        "D-ELF top-k": fb.DELF(uplink=top),
        "P-ELF top-k": fb.PELF(downlink=top),
        "B-ELF top-k/top-k": fb.BELF(uplink=top, downlink=top),
        "B-ELF nat/nat": fb.BELF(uplink=fb.compress.natural(contractive=True),
                                downlink=fb.compress.natural(contractive=True)),
    }


def with_options(algo, **kw):
    return type(algo)(**{**{f: getattr(algo, f) for f in algo.__dataclass_fields__}, **kw})


def rate(data, algo, gamma: float, chunk: int | None, timed: int) -> tuple[float, int]:
    """(iterations per second over the last ``timed`` rounds, bits per iteration): after two warm-up chunks of
    ``chunk`` rounds, or with the default timed chunks (``chunk=None``) after their first :func:`ramp_rounds`."""
    warm = ramp_rounds(data.num_clients) if chunk is None else WARM * chunk
    res = fb.fed_fit(model, data, with_options(algo, step_size=gamma, num_chains=1), num_rounds=warm + timed,
                     chunk_size=chunk, seed=0, progress=False)
    seconds = res.history["seconds"][warm:]
    return len(seconds) / seconds.sum(), int(res.history["bits_up"][-1] + res.history["bits_down"][-1])


def throughput(clients: int, repeats: int = 3, same_hash: bool = False) -> None:
    """Each rate is the best of ``repeats`` runs (the reference's too), the runs of a row interleaved: on a
    shared 2-core machine single runs of a few seconds vary by up to 30%. ``same_hash``: the references compiled
    inside ``fedbayes.prng.unrolled_hash()``, as fed_fit's computations are."""
    data = make_data(clients)
    gamma = fb.elf.curvature_step_size(model, data, scale=0.1)
    timed = timed_rounds(clients)
    k = max(1, D // 10)
    print(f"\n{clients} clients, d = {D}, step {gamma:.2e}, {timed} timed rounds, best of {repeats} runs\n")
    print(f"| sampler | hand-written it/s | fed_fit it/s (timed chunks, the default) | time ratio | fed_fit it/s "
          f"(chunks of {long_chunk(clients)}) | time ratio | bits/iteration (up + down) |")
    print("|---|---|---|---|---|---|---|")
    algos = samplers(k)
    for name in algos:
        refs, shorts, longs = [], [], []
        for _ in range(repeats):  # interleaved, so that the machine's drift during a row hits every column alike
            with fb.prng.unrolled_hash() if same_hash else contextlib.nullcontext():
                refs.append(references_one(name, data, gamma, timed, k))
            shorts.append(rate(data, algos[name], gamma, None, timed)[0])
            longs.append(rate(data, algos[name], gamma, long_chunk(clients), timed))
        ref, short, (long, per_it) = max(refs), max(shorts), max(longs)
        print(f"| {name} | {ref:.1f} | {short:.1f} | {ref / short:.2f} | {long:.1f} | {ref / long:.2f} | {per_it:,} |",
              flush=True)


def references_one(name, data, gamma, timed, k) -> float:
    top, nat, none = topk_rows(k), natural_rows, lambda key, v: v
    if name == "LMC":
        return handwritten_lmc(data, gamma, timed)
    return {"naive top-k LMC": lambda: handwritten_elf(data, gamma, timed, up=top, naive=True),
            "D-ELF top-k": lambda: handwritten_elf(data, gamma, timed, up=top),
            "P-ELF top-k": lambda: handwritten_elf(data, gamma, timed, up=none, down=top),
            "B-ELF top-k/top-k": lambda: handwritten_elf(data, gamma, timed, up=top, down=top),
            "B-ELF nat/nat": lambda: handwritten_elf(data, gamma, timed, up=nat, down=nat)}[name]()


def bits_to_accuracy(clients: int = 100, max_rounds: int = 20000) -> None:
    data = make_data(clients)
    pooled = data.pooled()
    mcmc = numpyro.infer.MCMC(numpyro.infer.NUTS(model), num_warmup=500, num_samples=2000, progress_bar=False)
    mcmc.run(jax.random.PRNGKey(0), jnp.asarray(pooled["x"]), jnp.asarray(pooled["y"]))
    ref = np.asarray(mcmc.get_samples()["w"])
    mean, sd = ref.mean(0), ref.std(0)
    gamma = fb.elf.curvature_step_size(model, data, at={"w": mean}, scale=0.1)
    print(f"\nbits until the running mean of 4 chains is within 0.1 posterior sd of NUTS ({clients} clients, "
          f"step {gamma:.2e}, warm-up 200 rounds dropped)\n")
    print("| sampler | rounds | bits up | bits down | final max error (sd) |")
    print("|---|---|---|---|---|")
    for name, algo in samplers(max(1, D // 10)).items():
        res = fb.fed_fit(model, data, with_options(algo, step_size=gamma, num_chains=4, warmup=200),
                         num_rounds=max_rounds, seed=1, progress=False)
        w = res.global_samples["w"]  # (chains, draws, D)
        running = np.cumsum(w.sum(0), axis=0) / (4 * np.arange(1, w.shape[1] + 1))[:, None]
        err = np.max(np.abs(running - mean) / sd, axis=1)
        ok = np.nonzero(err < 0.1)[0]
        if len(ok):
            r = 200 + ok[0] + 1
            up = res.init_bits[0] + res.history["bits_up"][:r].sum()
            down = res.init_bits[1] + res.history["bits_down"][:r].sum()
            print(f"| {name} | {r} | {up:,} | {down:,} | {err[-1]:.3f} |", flush=True)
        else:
            print(f"| {name} | not within {max_rounds} | - | - | {err[-1]:.3f} |", flush=True)


def main() -> None:
    import argparse
    import warnings

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--throughput", action="store_true", help="the speed table only")
    parser.add_argument("--same-hash", action="store_true", help="the references compiled with the unrolled hash")
    parser.add_argument("--unrolled-reference", action="store_true",
                        help="B-ELF nat/nat against a reference drawing its uniforms with the unrolled hash")
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1000], help="federation sizes timed")
    parser.add_argument("--repeats", type=int, default=3, help="runs per rate (the best is kept)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # the timed fits are short chains: their convergence warnings are expected
    print(f"# {time.strftime('%Y-%m-%d')}, {platform.machine()}, {jax.devices()[0].device_kind}, jax {jax.__version__}")
    if args.unrolled_reference:
        print(f"\nB-ELF nat/nat, the hand-written reference drawing its uniforms with fedbayes.prng.bits (best of "
              f"{args.repeats})\n")
        print("| clients | hand-written (unrolled hash) it/s | fed_fit it/s (timed chunks) | time ratio |")
        print("|---|---|---|---|")
        for clients in args.clients:
            unrolled_reference(clients, args.repeats)
        return
    if args.same_hash:
        print("\nthe hand-written references compiled with the unrolled hash (fedbayes.prng.unrolled_hash)")
    for clients in args.clients:
        throughput(clients, repeats=args.repeats, same_hash=args.same_hash)
    if not args.throughput:
        bits_to_accuracy()


if __name__ == "__main__":
    main()
