"""The joint samplers of hierarchical models against NUTS on the pooled data: communication and wall time to
reach a given accuracy.

Eight schools (``fedbayes.models.eight_schools``, a school per client, non-centred). The reference is a long
NumPyro NUTS run on the pooled data (4 chains x 20 000 draws). For each sampler and number of rounds R (one
seed), the error is the largest, over the 10 coordinates (mu, tau, eta_1..8), of |mean - mean_ref| / sd_ref
and |sd / sd_ref - 1|; a fit "reaches" the accuracy when that error is at most 0.1 and every split R-hat is
below 1.01 (issue 24's bar). Columns: rounds, bits (up + down, all clients, warm-up included), wall seconds
(compilation included), the error, the smallest bulk ESS and the largest R-hat.

NUTS on the pooled data is timed the same way for 4 chains x S draws (after as many warm-up draws). Its
"rounds" are its leapfrog steps per chain (warm-up included): each would be a round trip if NUTS ran
federated, as each of JointHMC's steps is.

    python benchmarks/bench_joint.py            # the table
    python benchmarks/bench_joint.py --quick    # fewer settings
    python benchmarks/bench_joint.py --buffer   # only the round's cost against the clients' buffers of draws
"""

from __future__ import annotations

import argparse
import time
import warnings

import jax
import numpy as np
from numpyro.infer import MCMC, NUTS

import fedbayes as fb
import fedbayes.models as fbm
from fedbayes.arviz_adapter import group
from fedbayes.chain_stats import ess_bulk, rhat

from _common import machine_line

jax.config.update("jax_enable_x64", True)
Y, SIGMA = fbm.EIGHT_SCHOOLS_Y, fbm.EIGHT_SCHOOLS_SIGMA


def columns(draws) -> dict[str, np.ndarray]:
    """name -> (chains, draws) for mu, tau, eta[0..7]."""
    out = {k: np.asarray(draws[k], np.float64) for k in ("mu", "tau")}
    eta = np.asarray(draws["eta"], np.float64)
    out.update({f"eta[{j}]": eta[..., j] for j in range(eta.shape[-1])})
    return out


def nuts(samples: int, seed: int = 0) -> tuple[dict[str, np.ndarray], float, int]:
    """(draws, seconds, leapfrog steps per chain) of 4 NUTS chains on the pooled data."""
    mcmc = MCMC(NUTS(fbm.eight_schools_pooled, target_accept_prob=0.9), num_warmup=samples, num_samples=samples,
                num_chains=4, chain_method="sequential", progress_bar=False)
    start = time.perf_counter()
    mcmc.warmup(jax.random.PRNGKey(seed), Y, SIGMA, extra_fields=("num_steps",), collect_warmup=True)
    steps = int(np.sum(mcmc.get_extra_fields()["num_steps"]))
    mcmc.run(mcmc.post_warmup_state.rng_key, Y, SIGMA, extra_fields=("num_steps",))
    seconds = time.perf_counter() - start
    steps += int(np.sum(mcmc.get_extra_fields()["num_steps"]))
    return columns(mcmc.get_samples(group_by_chain=True)), seconds, steps // 4


def error(draws: dict[str, np.ndarray], ref: dict[str, np.ndarray]) -> tuple[float, float, float]:
    """(largest standardised error of a mean or an sd, smallest bulk ESS, largest R-hat)."""
    err = max(max(abs(a.mean() - ref[k].mean()) / ref[k].std(), abs(a.std() / ref[k].std() - 1))
              for k, a in draws.items())
    return err, min(ess_bulk(a) for a in draws.values()), max(rhat(a) for a in draws.values())


def samplers() -> dict[str, fb.LangevinSampler]:
    return {"JointLMC": fb.JointLMC(), "JointLMC, adapted steps": fb.JointLMC(adapt_mass_matrix=True),
            "JointLMC, adapted, top-1 uplink": fb.JointLMC(adapt_mass_matrix=True, uplink=fb.compress.top_k(1)),
            "JointMALA": fb.JointMALA(), "JointHMC (8 steps)": fb.JointHMC()}


def buffer_cost(rounds: int = 10000, clients: int = 60) -> None:
    """Seconds per round against the size of the clients' buffers of kept draws: each sampler keeping every
    round's draw (thinning 1: rounds / 2 draws per chain and client) and every 40th, in the last fifth of the rounds
    (``res.history["seconds"]``, compilation excluded). A ratio near 1: a round's cost does not grow with the buffer."""
    rng = np.random.default_rng(0)
    data = fb.FederatedData({"y": [rng.normal(rng.normal(), 1.0, size=6) for _ in range(clients)]})
    print(f"\n{clients} clients (random intercepts, 6 rows each), 4 chains, {rounds} rounds\n")
    print("| sampler | ms/round, thinning 1 | ms/round, thinning 40 | ratio |")
    print("|---|---|---|---|")
    for algo in (fb.JointLMC(), fb.JointMALA(), fb.JointHMC()):
        per = []
        for thinning in (1, 40):
            cfg = type(algo)(thinning=thinning)
            fb.fed_fit(fbm.random_intercepts, data, cfg, num_rounds=400, seed=0, progress=False)  # compiled
            res = fb.fed_fit(fbm.random_intercepts, data, cfg, num_rounds=rounds, seed=0, progress=False)
            per.append(1e3 * float(np.mean(np.asarray(res.history["seconds"])[-rounds // 5:])))
        print(f"| {algo.name} | {per[0]:.3f} | {per[1]:.3f} | {per[0] / per[1]:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--buffer", action="store_true", help="only the round's cost against the buffers' size")
    args = parser.parse_args()
    if args.buffer:
        warnings.simplefilter("ignore")
        print(machine_line())
        buffer_cost()
        return
    rounds = [2000, 8000] if args.quick else [1000, 2000, 4000, 8000, 16000, 32000]
    draws = [250, 1000] if args.quick else [250, 500, 1000, 2000, 4000]
    warnings.simplefilter("ignore")  # the short fits' convergence warnings: the table's R-hat column says it
    print(machine_line())
    ref, _, _ = nuts(20000, seed=99)
    print("| method | rounds | bits | seconds | error | min ESS | max R-hat | reached |")
    print("|---|---|---|---|---|---|---|---|")
    data = fbm.eight_schools_data()
    for name, algo in samplers().items():
        for R in rounds:
            start = time.perf_counter()
            res = fb.fed_fit(fbm.eight_schools, data, algo, num_rounds=R, seed=0, progress=False)
            seconds = time.perf_counter() - start
            post = group(res.idata, "posterior")
            err, ess, rh = error(columns({k: post[k] for k in ("mu", "tau", "eta")}), ref)
            bits = int(np.sum(res.history["bits_up"]) + np.sum(res.history["bits_down"]))
            ok = "yes" if err <= 0.1 and rh < 1.01 else "no"
            print(f"| {name} | {R} | {bits:.3g} | {seconds:.1f} | {err:.3f} | {ess:.0f} | {rh:.3f} | {ok} |", flush=True)
    for S in draws:
        d, seconds, steps = nuts(S)
        err, ess, rh = error(d, ref)
        ok = "yes" if err <= 0.1 and rh < 1.01 else "no"
        print(f"| NUTS, pooled ({S} draws) | {steps} leapfrog steps | (none) | {seconds:.1f} | {err:.3f} | {ess:.0f} | "
              f"{rh:.3f} | {ok} |", flush=True)
    buffer_cost()


if __name__ == "__main__":
    main()
