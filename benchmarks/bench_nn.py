"""Speed of a real model: FedSOUL with a neural feature extractor and minibatch SGLD heads.

Model (the network of FedPop's digits experiment, issue 23 item 4): a flax MLP feature extractor
64 -> 32 -> 16 (tanh) shared by all clients, a personal linear head z_i in R^{16 x 10} per client
with a population prior N(mu, I), 10 classes, 500 rows per client. Each round 10% of the clients
take M = 10 SGLD moves on their heads with minibatches of B = 50 rows (``batch_size``; log-likelihood
scaled by 500 / 50), fixed step, and upload the Fisher-identity gradient in the shared sites averaged
over the moves; the server takes a plain SGD step. float32, inputs random (speed only).

The hand-written reference is the same math in plain JAX (no flax, no NumPyro): the same MLP, the
same minibatches (a random permutation of the client's rows per round, consecutive batches), the same
SGLD moves and gradient averages, the same server step, in one ``lax.scan`` over rounds.

Per client inner step: the round's time divided by (cohort x M). Rounds per second exclude
compilation: fed_fit's chunks after the first two (``res.history["seconds"]``); the reference's
second call of its compiled run.

    python benchmarks/bench_nn.py            # prints the markdown table (100 and 1000 clients)
    python benchmarks/bench_nn.py 100 10000  # other numbers of clients
"""

from __future__ import annotations

import json
import sys
import time

import _common  # benchmarks/_common.py (the script's folder is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np

ROWS, BATCH, STEPS, FEATURES, CLASSES, HIDDEN = 500, 50, 10, 64, 10, 16
STEP, LR = 1e-3, 1e-4
WARM_CHUNKS, TIMED_CHUNKS, CHUNK = 2, 4, 10


def make_data(clients: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(clients, ROWS, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(clients, ROWS)).astype(np.int32)
    return x, y


def model(x, y):
    import flax.linen as nn
    import numpyro
    import numpyro.distributions as dist
    from numpyro.contrib.module import flax_module

    import fedbayes as fb

    class Features(nn.Module):
        @nn.compact
        def __call__(self, h):
            return nn.tanh(nn.Dense(HIDDEN)(nn.tanh(nn.Dense(32)(h))))

    net = flax_module("net", Features(), input_shape=(1, FEATURES))
    mu = numpyro.param("mu", jnp.zeros((HIDDEN, CLASSES)))
    with fb.local():
        head = numpyro.sample("head", dist.Normal(mu, 1.0).to_event(2))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=net(x) @ head), obs=y)


def handwritten(x, y, cohort: int, rounds: int, seed: int = 0) -> float:
    """Rounds per second of the same rounds written directly in JAX."""
    C = x.shape[0]
    x, y = jnp.asarray(x), jnp.asarray(y)
    key = jax.random.PRNGKey(seed)
    k1, k2 = jax.random.split(key)
    theta0 = {"w1": 0.1 * jax.random.normal(k1, (FEATURES, 32)), "b1": jnp.zeros(32),
              "w2": 0.1 * jax.random.normal(k2, (32, HIDDEN)), "b2": jnp.zeros(HIDDEN),
              "mu": jnp.zeros((HIDDEN, CLASSES))}

    def log_joint(theta, z, xb, yb):
        h = jnp.tanh(jnp.tanh(xb @ theta["w1"] + theta["b1"]) @ theta["w2"] + theta["b2"])
        logits = h @ z
        ll = jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), yb[:, None], 1))
        return (ROWS / BATCH) * ll - 0.5 * jnp.sum((z - theta["mu"]) ** 2)

    grads = jax.grad(log_joint, argnums=(0, 1))

    def client(theta, z, kc, xi, yi):
        k_perm, k_moves = jax.random.split(kc)
        order = jax.random.permutation(k_perm, ROWS)

        def batch(m):
            idx = jax.lax.dynamic_slice(order, ((m * BATCH) % ROWS,), (BATCH,))
            return xi[idx], yi[idx]

        def body(carry, xs):
            z, gz, acc = carry
            kk, m = xs
            z = z + STEP * gz + jnp.sqrt(2 * STEP) * jax.random.normal(kk, z.shape)
            gt, gz = grads(theta, z, *batch(m + 1))
            return (z, gz, jax.tree_util.tree_map(jnp.add, acc, gt)), None

        zero = jax.tree_util.tree_map(jnp.zeros_like, theta)
        gz0 = grads(theta, z, *batch(0))[1]
        (z, _, acc), _ = jax.lax.scan(body, (z, gz0, zero), (jax.random.split(k_moves, STEPS), jnp.arange(STEPS)))
        return z, jax.tree_util.tree_map(lambda a: a / STEPS, acc)

    def round_fn(carry, r):
        theta, zs = carry
        kr = jax.random.fold_in(key, r)
        idx = jax.random.choice(kr, C, (cohort,), replace=False)
        keys = jax.random.split(jax.random.fold_in(kr, 1), cohort)
        z_new, g = jax.vmap(client, in_axes=(None, 0, 0, 0, 0))(theta, zs[idx], keys, x[idx], y[idx])
        zs = zs.at[idx].set(z_new)
        theta = jax.tree_util.tree_map(lambda t, gi: t + LR * (C / cohort) * gi.sum(0), theta, g)
        return (theta, zs), None

    run = jax.jit(lambda c: jax.lax.scan(round_fn, c, jnp.arange(rounds))[0])
    init = (theta0, jnp.zeros((C, HIDDEN, CLASSES)))
    jax.block_until_ready(run(init))  # compile
    t0 = time.perf_counter()
    jax.block_until_ready(run(init))
    return rounds / (time.perf_counter() - t0)


def one(impl: str, clients: int) -> float:
    """Rounds per second of one implementation at 10% participation, compilation excluded."""
    import fedbayes as fb

    x, y = make_data(clients)
    cohort = max(1, clients // 10)
    if impl == "handwritten":
        return handwritten(x, y, cohort, CHUNK * TIMED_CHUNKS)
    data = fb.FederatedData({"x": list(x), "y": list(y)})
    algo = fb.FedSOUL(local_steps=STEPS, step_size=STEP, batch_size=BATCH, local_metric="identity",
                      server_optimizer="sgd", server_lr=LR, uncertainty=False, num_samples=1, warmup=0,
                      thinning=1, num_chains=1)
    res = fb.fed_fit(model, data, algo, num_rounds=CHUNK * (WARM_CHUNKS + TIMED_CHUNKS), clients_per_round=cohort,
                     seed=0, chunk_size=CHUNK, progress=False)
    timed = res.history["seconds"][WARM_CHUNKS * CHUNK:]
    return len(timed) / timed.sum()


def run_child(*args) -> dict:
    return _common.run_child(__file__, *args)


def main(clients_list=(100, 1000)):
    print(_common.machine_line())
    print("| clients | cohort | fed_fit rounds/s | hand-written rounds/s | time ratio | "
          "fed_fit us per client inner step | hand-written us per client inner step |")
    print("|---|---|---|---|---|---|---|")
    for clients in clients_list:
        cohort = clients // 10
        rates = {impl: run_child(impl, clients)["rate"] for impl in ("fed_fit", "handwritten")}
        per_step = {k: 1e6 / (v * cohort * STEPS) for k, v in rates.items()}
        print(f"| {clients} | {cohort} | {rates['fed_fit']:.2f} | {rates['handwritten']:.2f} | "
              f"{rates['handwritten'] / rates['fed_fit']:.2f} | {per_step['fed_fit']:.1f} | "
              f"{per_step['handwritten']:.1f} |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps({"rate": one(sys.argv[2], int(sys.argv[3]))}))
    else:
        main(tuple(int(a) for a in sys.argv[1:]) or (100, 1000))
