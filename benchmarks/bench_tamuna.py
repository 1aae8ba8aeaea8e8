"""Floats communicated to reach a relative error of 1e-8 on logistic regression: TAMUNA, Scaffnew, GD, FedAvg.

The problem (the paper's Section 5 task, synthetic data): L2-regularised logistic regression,
d = 300, n = 100 heterogeneous clients of 50 points each (``fb.models.make_glm_clients``: client-specific
feature shifts and scales and labelling weights), prior scale chosen so that kappa = L_max / mu = 1e4
(L_max: the largest client Hessian eigenvalue, at w = 0 where the logistic Hessian is largest;
mu = 1 / (n prior^2), each client's share of the prior). The reference minimiser x* comes from
Newton's method on the pooled data (float64). Every method starts at w = 0 with gamma = 1 / L_max.

* TAMUNA, c = n: s = 2 (Theorem 3 with alpha = 0), p from ``recommended_p`` (GD's rate under Theorem 1).
* TAMUNA, c = n / 10: partial participation, s = 2, same rule for p.
* TAMUNA, c = n, alpha = 0.1: s from Theorem 3 for a downlink float costing 0.1 uplink float (s = 10).
* Scaffnew: c = s = n, p from the same rule (chi = 1).
* GD: one local step, c = s = n.
* FedAvg: 10 local steps, no control variates; it stalls at its drift point (reported, not reached).
* TAMUNA, c = n, with its defaults' preconditioning by the federated Hessian at the start (the rows above set
  ``precondition=False``, as the paper runs them): its steps are in transformed coordinates, each client also
  multiplying by a d x d factor, so it has no ratio to the plain pooled step.

Each method runs in segments of rounds (``run_rounds`` continues the same run, compiled once) until
|x_bar - x*| / |x*| <= 1e-8 or a round limit. "uplink/client" is the paper's UpCom: cumulative
floats uploaded by one participating client (ceil(s d / c) per round); "TotalCom a=0.1" adds 0.1 x the
d floats it receives per round. "ledger floats" is everything that crossed the network in both
directions (all clients; TAMUNA's reply of x_bar on each member's own coordinates included).

Wall time: seconds per round from the engine's history (segments after the first, so compilation is
excluded), and per local step (a round of TAMUNA takes L ~ Geometric(p) steps on every cohort member),
against a hand-written JAX gradient-descent step on the pooled data (the same f, its gradient written
by hand: (X'(sigmoid(Xw) - y) + w / prior^2) / n, jitted inside a scan, timed after a warm-up).
"ratio" = seconds per local step / hand-written seconds per step (for c = n both touch every point once).

    python benchmarks/bench_tamuna.py [--quick]      # --quick: d = 100, kappa = 1e3
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

import fedbayes as fb  # noqa: E402
from fedbayes.algorithms import tamuna as tm  # noqa: E402
from fedbayes.engine import Problem, run_rounds  # noqa: E402

TARGET = 1e-8


def problem_data(n: int, d: int, m: int, kappa: float, seed: int = 0):
    data, _ = fb.models.make_glm_clients(n, d, m, family="logistic", heterogeneity=1.0, seed=seed)
    prior = fb.models.prior_scale_for_kappa(data, kappa)
    pooled = data.pooled()
    return data, prior, fb.models.logistic_map(pooled["x"], pooled["y"], prior)


def run_until(cfg, fm, data, cohort, xstar, segment, max_rounds, seed=0):
    """Run ``cfg`` in segments until the relative error reaches TARGET; returns the resolved settings and
    per-round arrays."""
    problem = Problem(fm, data, segment, cohort)
    run = cfg.build(problem)
    carry = run.init(jax.random.PRNGKey(seed), problem)
    key = jax.random.PRNGKey(seed + 1)
    errs, up, down, steps, secs = [], [], [], [], []
    done = 0
    while done < max_rounds:
        problem = problem._replace(num_rounds=done + segment)
        carry, h = run_rounds(run, problem, carry, base_key=key, cohort_size=cohort, start=done,
                              chunk_size=min(segment, 500), progress=False)
        e = np.linalg.norm(np.asarray(h["theta/w"]) - xstar, axis=1) / np.linalg.norm(xstar)
        errs.append(e)
        up.append(h["bits_up"] // 32)
        down.append(h["bits_down"] // 32)
        steps.append(h["local_steps"])
        secs.append(h["seconds"] if done else np.full(len(e), np.nan))  # first segment: compilation
        done += segment
        if e.min() <= TARGET or not np.isfinite(e[-1]):
            break
    cat = lambda xs: np.concatenate(xs)  # noqa: E731
    return run.settings(carry[0]), cat(errs), cat(up), cat(down), cat(steps), cat(secs)


def pooled_gd_seconds(X, y, prior, gamma, n, steps=2000):
    """Seconds per hand-written GD step w <- w - gamma grad f(w), f = U / n, on the pooled data (jitted
    scan, compiled and warmed up first)."""
    X, y = jnp.asarray(X), jnp.asarray(y)

    @jax.jit
    def many(w):
        def step(w, _):
            g = X.T @ (jax.nn.sigmoid(X @ w) - y) + w / prior**2
            return w - (gamma / n) * g, None
        return jax.lax.scan(step, w, None, length=steps)[0]

    w = many(jnp.zeros(X.shape[1])).block_until_ready()
    t = time.perf_counter()
    many(w).block_until_ready()
    return (time.perf_counter() - t) / steps


def main(quick: bool) -> None:
    n, d, m, kappa = (100, 100, 50, 1e3) if quick else (100, 300, 50, 1e4)
    data, prior, xstar = problem_data(n, d, m, kappa)
    model = fb.models.logistic_regression(prior)
    fm = fb.FedModel(model, data)
    zero = {"w": np.zeros(d)}
    est = tm.estimate_condition(model, data, at=zero)
    gd_rounds = int(1.3 * kappa * np.log(1 / TARGET))  # GD's error contracts by about 1 - 1/kappa per round
    plain = dict(init=zero, precondition=False)  # the paper's methods: steps in the original coordinates
    methods = [
        ("TAMUNA c=n", fb.TAMUNA(s=2, **plain), n, 2000),
        ("TAMUNA c=n/10", fb.TAMUNA(s=2, **plain), n // 10, 2000),
        ("TAMUNA c=n, alpha=0.1", fb.TAMUNA(downlink_cost=0.1, **plain), n, 1000),
        ("Scaffnew", fb.Scaffnew(**plain), n, 50),
        ("GD", fb.GD(**plain), n, 1000),
        ("FedAvg (10 local steps)", fb.FedAvg(local_steps=10, init=zero), n, 500),
        ("TAMUNA c=n, preconditioned (the default)", fb.TAMUNA(s=2, init=zero), n, 2000),
    ]
    limits = {"GD": gd_rounds, "FedAvg (10 local steps)": 2000}
    pooled = data.pooled()
    hand = pooled_gd_seconds(pooled["x"], pooled["y"], prior, 1.0 / est["L"], n)

    print(f"{time.strftime('%Y-%m-%d')}, {platform.machine()}, {jax.device_count()} {jax.default_backend().upper()} "
          f"device(s), jax {jax.__version__}, float64")
    print(f"logistic regression d={d}, n={n} clients x {m} points, kappa={est['L'] / est['mu']:.3g} "
          f"(L_max={est['L']:.4g}, mu={est['mu']:.3g}); target |x - x*| / |x*| <= {TARGET:g}")
    print(f"hand-written pooled GD step: {hand * 1e3:.3f} ms\n")
    print("| method | s | p | rounds | local steps | uplink/client | TotalCom a=0.1 | ledger floats | final rel. error "
          "| ms/round | ms/local step | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, cfg, cohort, segment in methods:
        limit = limits.get(name, 400_000)
        cfgs, err, up, down, steps, secs = run_until(cfg, fm, data, cohort, xstar, segment, limit)
        hit = np.flatnonzero(err <= TARGET)
        r = int(hit[0]) + 1 if hit.size else len(err)
        per_client_up = np.cumsum(up)[r - 1] / cohort  # every member uploads s d / c floats on average
        total_01 = per_client_up + 0.1 * d * r
        ledger = int(np.cumsum(up + down)[r - 1])
        timed = np.isfinite(secs)
        ms = secs[timed].mean() * 1e3
        ms_step = secs[timed].sum() * 1e3 / steps[timed].sum()
        reached = f"{r}" if hit.size else f"{r} (not reached)"
        # a pooled step touches all n clients; a preconditioned step also multiplies by a d x d factor per client
        ratio = f"{ms_step / (hand * 1e3):.2f}" if cohort == n and "preconditioned" not in name else "-"
        print(f"| {name} | {cfgs['s']} | {cfgs['p']:.3g} | {reached} | {int(steps[:r].sum())} | {per_client_up:.3g} "
              f"| {total_01:.3g} | {ledger:.3g} | {err[r - 1]:.2e} | {ms:.3f} | {ms_step:.3f} | {ratio} |",
              flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
