"""The PyTorch reference of ``bench_nn.py``: the same rounds written the way FedPop's reference code runs
them, one client after another in Python, one autograd call per inner step.

Same model and math as ``bench_nn.py``: a tanh MLP 64 -> 32 -> 16 shared, a personal linear head z_i in
R^{16 x 10} with the prior N(mu, I), 500 rows per client, 10% of the clients per round, M = 10 SGLD moves
per client on minibatches of 50 rows (a permutation of the client's rows per round, consecutive
batches, log-likelihood scaled by 500 / 50), the Fisher-identity gradient in the shared parameters
averaged over the moves, a plain SGD step on the server. float32, random inputs (speed only). No data
loader: the batches are index gathers from tensors already in memory, so this is the compute of a
per-client loop, the part that FedPop's "about 7 ms per client inner step" counts.

It needs PyTorch, which is not a fedbayes dependency (the comparison runs where PyTorch is installed).

    python benchmarks/bench_nn_torch.py [--device cpu|cuda] [--threads N] [--clients 100 1000]

prints one markdown row per number of clients: us per client inner step (warm-up round excluded).
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

ROWS, BATCH, STEPS, FEATURES, CLASSES, HIDDEN = 500, 50, 10, 64, 10, 16
STEP, LR = 1e-3, 1e-4


def per_step_us(clients: int, device: str, rounds: int, seed: int = 0) -> float:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    rng = np.random.default_rng(seed)
    x = torch.randn(clients, ROWS, FEATURES, generator=gen).to(device)
    y = torch.randint(0, CLASSES, (clients, ROWS), generator=gen).to(device)
    theta = {"w1": 0.1 * torch.randn(FEATURES, 32, generator=gen), "b1": torch.zeros(32),
             "w2": 0.1 * torch.randn(32, HIDDEN, generator=gen), "b2": torch.zeros(HIDDEN),
             "mu": torch.zeros(HIDDEN, CLASSES)}
    theta = {k: v.to(device).requires_grad_(True) for k, v in theta.items()}
    zs = torch.zeros(clients, HIDDEN, CLASSES, device=device)
    cohort = max(1, clients // 10)

    def log_joint(z, xb, yb):
        h = torch.tanh(torch.tanh(xb @ theta["w1"] + theta["b1"]) @ theta["w2"] + theta["b2"])
        ll = torch.log_softmax(h @ z, dim=1).gather(1, yb[:, None]).sum()
        return (ROWS / BATCH) * ll - 0.5 * ((z - theta["mu"]) ** 2).sum()

    def one_round():
        acc = {k: torch.zeros_like(v) for k, v in theta.items()}
        for i in rng.choice(clients, cohort, replace=False):
            order = torch.randperm(ROWS, device=device)
            z = zs[i].clone()
            for m in range(STEPS):
                idx = order[(m * BATCH) % ROWS:(m * BATCH) % ROWS + BATCH]
                z.requires_grad_(True)
                grads = torch.autograd.grad(log_joint(z, x[i][idx], y[i][idx]), [z, *theta.values()])
                with torch.no_grad():
                    z = z + STEP * grads[0] + math.sqrt(2 * STEP) * torch.randn_like(z)
                    for a, g in zip(acc.values(), grads[1:]):
                        a += g / STEPS
            zs[i] = z.detach()
        with torch.no_grad():
            for t, a in zip(theta.values(), acc.values()):
                t += LR * (clients / cohort) * a

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    one_round()  # warm-up (allocations, kernel selection)
    sync()
    t0 = time.perf_counter()
    for _ in range(rounds):
        one_round()
    sync()
    return 1e6 * (time.perf_counter() - t0) / (rounds * cohort * STEPS)


def main():
    import platform

    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: PyTorch's default)")
    ap.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    print(f"# {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {args.device} ({name}), "
          f"{torch.get_num_threads()} threads")
    print("| clients | cohort | PyTorch us per client inner step |")
    print("|---|---|---|")
    for clients in args.clients:
        us = per_step_us(clients, args.device, args.rounds)
        print(f"| {clients} | {max(1, clients // 10)} | {us:.1f} |", flush=True)


if __name__ == "__main__":
    main()
