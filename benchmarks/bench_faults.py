"""Client faults at 30% and 60% per round: does each family still reach its fault-free answer?

Every expected member of every round independently drops out (``fb.Faults(drop=q)``) or sends a NaN
upload (``fb.Faults(nan=q)``), q = 0.3 and 0.6. Each family runs on a small problem with an exact
reference (the references of the test suite), float64:

* TAMUNA (s = 2, p = 0.5, cohort 5 of 10), Scaffnew with p = 1 (gradient descent with control
  variates) and GD on Bayesian linear regression (heterogeneity 1.5): the closed-form minimiser x*.
  Deterministic solvers, so the noise is rounding (1e-15) and the verdict is max |x - x*| < 1e-10; the
  round from which the error stays below 1e-10 shows how much faults slow convergence.
* FedMM (step 1, 6 clients) on a 3-component Gaussian mixture in 2-d: the fixed point of centralised
  EM on the pooled data (numpy, 3 000 iterations, ``tests/em_reference.py``); tolerance 1e-10.
* LMC and D-ELF (top-2 uplink) on the Gaussian clients of ``tests/test_elf.py`` (5 clients, d = 4),
  16 chains x 20 000 rounds, step 0.1 / lambda_max: the closed-form posterior mean mu. Noise: the batch
  means Monte Carlo standard error (20 batches) of the chain-averaged trajectory, which also carries
  the part of the error the chains share (every chain of a fit sees the same faults). For LMC the
  exact stationary covariance under faults is known (``lmc_moments_under_faults`` in
  ``tests/test_faults.py``); the table gives the largest ratio of a posterior variance to fault-free
  LMC's (exact: inv(P - gamma P^2 / 2)), measured and exact.
* FedSOUL (the linear mixed model of ``tests/test_fedsoul.py``, 40 clients, 3 000 rounds): the
  closed-form maximum marginal likelihood (``tests/lme_reference.py``). Error: the largest |beta_j -
  beta_j*| in units of the MML standard error of beta_j (seed 0); noise: the batch-means MCSE of the
  fit's own Polyak-averaged trajectory (same units) and the root-mean-square error over seeds 0-3.

Each configuration first runs under the default policy (``FaultPolicy()``, min_clients = 1): the
"default policy" column says whether it completes or stops with ``TooFewClientsError`` (at which
round). A fit that stops is then run with ``FaultPolicy(min_clients=0)``, which never stops (a round
without answers takes the algorithm's fallback); the policy changes nothing else, so a completed
default fit is the min_clients = 0 fit. Each NaN fit is compared with its drop twin (same seed and
rate): a NaN upload is zeroed and rolled back like a lost one, so the fits should be bit-identical;
the table then shows one row for both ("drop, NaN"), and two rows otherwise.

    python benchmarks/bench_faults.py [--quick]

``--quick`` runs fewer rounds and seeds (a smoke test; its numbers are not the README's).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402

import fedbayes as fb  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import em_reference as R  # noqa: E402
from lme_reference import mml  # noqa: E402
from test_elf import PRIOR_SD, gauss_model, gaussian_clients  # noqa: E402
from test_faults import batch_means, lmc_moments_under_faults  # noqa: E402

RATES = (0.3, 0.6)
KINDS = ("drop", "nan")
NEVER_STOP = fb.FaultPolicy(min_clients=0)
ROWS: list[list[str]] = []


def configs():
    yield None, "none", 0.0
    for q in RATES:
        for kind in KINDS:
            yield fb.Faults(**{kind: q}), kind, q


def fit(model, data, make, faults, **kw):
    """The fit under the default policy, or (when it stops) under min_clients = 0; and what happened."""
    try:
        return fb.fed_fit(model, data, make(), faults=faults, **kw), "completes"
    except fb.TooFewClientsError as err:
        return fb.fed_fit(model, data, make(), faults=faults, fault_policy=NEVER_STOP, **kw), \
            f"TooFewClientsError at round {err.round}"


def row(family, kind, q, error, noise, verdict, policy, same=None):
    """A drop row waits for its NaN twin: one row "drop, NaN" when the fits are bit-identical, two otherwise."""
    cells = [family, kind, f"{q:.0%}", error, noise, verdict, policy]
    if kind == "drop":
        ROWS.append(cells)
        return
    if kind == "nan":
        drop = ROWS.pop()
        if same and drop[3] == cells[3] and drop[5:] == cells[5:]:  # the drop row's noise may say more (seeds)
            cells = drop[:1] + ["drop, NaN (bit-identical fits)"] + drop[2:]
        else:
            print("| " + " | ".join(drop) + " |")
    print("| " + " | ".join(cells) + " |", flush=True)


# ----------------------------------------------------------------------------- optimisation


def optimisation(quick: bool):
    N, D = 10, 5
    data, _ = fb.models.make_glm_clients(N, D, (20, 60), family="linear", heterogeneity=1.5, seed=1)
    X, y = data.pooled()["x"], data.pooled()["y"]
    model, xstar = fb.models.linear_regression(1.0, 1.0), np.linalg.solve(X.T @ X + np.eye(D), X.T @ y)
    zero = {"w": np.zeros(D)}
    families = [
        ("TAMUNA (s=2, p=0.5, 5 of 10)", lambda: fb.TAMUNA(s=2, p=0.5, init=zero),
         dict(num_rounds=2000 if quick else 5000, clients_per_round=5)),
        ("Scaffnew p=1 (GD + control variates)", lambda: fb.Scaffnew(p=1.0, init=zero), dict(num_rounds=300)),
        ("GD", lambda: fb.GD(init=zero), dict(num_rounds=300)),
    ]
    for family, make, kw in families:
        drop_params = {}
        for faults, kind, q in configs():
            res, policy = fit(model, data, make, faults, seed=3, **kw)
            path = np.abs(res.history["theta/w"] - xstar).max(axis=1)
            err = float(np.abs(res.params["w"] - xstar).max())
            below = np.flatnonzero(path >= 1e-10)
            reached = len(path) if not len(below) else below[-1] + 1
            if err < 1e-10:
                verdict = f"reaches x* (< 1e-10 from round {reached})"
            else:
                spread = float(path[-100:].max() / np.abs(xstar).max())
                verdict = (f"does not reach x*: {err / np.abs(xstar).max():.0%} of max abs x* "
                           f"(last 100 rounds: up to {spread:.0%})")
            same = None if kind != "nan" else bool(np.array_equal(res.params["w"], drop_params[q]))
            if kind == "drop":
                drop_params[q] = res.params["w"]
            row(family, kind, q, f"max abs {err:.1e}", "rounding (1e-15)", verdict, policy, same)


# ----------------------------------------------------------------------------- FedMM


def fedmm(quick: bool):
    K, D = 3, 2
    data, _ = fb.models.make_gaussian_mixture(6, num_components=K, dim=D, sizes=(30, 90), concentration=0.3, seed=3)
    y = np.asarray(data.pooled()["y"])
    init = {"weights": np.ones(K) / K, "means": y[[0, 100, 200]], "covs": np.broadcast_to(np.eye(D), (K, D, D)).copy()}
    ref, _ = R.run_em(lambda **p: R.gmm_em_step(y, **p), init, 3000)
    model = fb.models.gaussian_mixture(K, D)
    drop_params = {}
    for faults, kind, q in configs():
        res, policy = fit(model, data, lambda: fb.FedMM(init=init, uncertainty=False), faults,
                          num_rounds=200 if quick else 400, seed=0)
        err = max(float(np.abs(res.params[k] - ref[k]).max()) for k in ("weights", "means", "covs"))
        verdict = "reaches the EM fixed point" if err < 1e-10 else "does not reach the EM fixed point"
        same = None if kind != "nan" else all(np.array_equal(res.params[k], drop_params[q][k]) for k in ref)
        if kind == "drop":
            drop_params[q] = res.params
        row("FedMM (6 clients, GMM)", kind, q, f"max abs {err:.1e}", "rounding (1e-15)", verdict, policy, same)


# ----------------------------------------------------------------------------- Langevin


def langevin(quick: bool):
    data, P, mu = gaussian_clients()
    gamma = 0.1 / np.linalg.eigvalsh(P).max()
    rounds, chains = (5000, 8) if quick else (20000, 16)
    lmc_var = np.diag(np.linalg.inv(P - gamma * P @ P / 2))  # fault-free LMC's exact stationary variances
    for name, make in (("LMC", lambda: fb.LMC(step_size=gamma, num_chains=chains, warmup=200)),
                       ("D-ELF (top-2 uplink)", lambda: fb.DELF(step_size=gamma, num_chains=chains, warmup=200,
                                                                uplink=fb.compress.top_k(2)))):
        drop_draws, free_var = {}, None
        for faults, kind, q in configs():
            res, policy = fit(gauss_model, data, make, faults, num_rounds=rounds, seed=1, chunk_size=1000)
            x = res.global_samples["x"]  # (chains, draws, d)
            mean, se = batch_means(x.mean(0))
            z = float(np.max(np.abs(mean - mu) / se))
            var, var_se = batch_means(((x - mu) ** 2).mean(0))
            ratio = var / lmc_var
            j = int(np.argmax(ratio))
            if name == "LMC":
                _, S = lmc_moments_under_faults(data, PRIOR_SD, gamma, q, empty="stay")
                exact = np.diag(S) / lmc_var
                vz = float(np.max(np.abs(var - np.diag(S)) / var_se))
                cov_note = (f"variance up to {ratio[j]:.2f} x fault-free (exact {exact[j]:.2f}; "
                            f"{vz:.1f} MCSE from exact)")
            else:
                free_var = var if q == 0 else free_var
                cov_note = f"variance up to {ratio[j]:.2f} x fault-free LMC (fault-free D-ELF {np.max(free_var / lmc_var):.2f})"
            verdict = ("mean within noise" if z < 4 else "mean NOT within noise") + "; " + cov_note
            same = None if kind != "nan" else bool(np.array_equal(x, drop_draws[q]))
            if kind == "drop":
                drop_draws[q] = x
            row(name, kind, q, f"mean: {z:.1f} MCSE", f"MCSE {np.max(se):.4f} (post. sd {np.sqrt(lmc_var.max()):.2f})",
                verdict, policy, same)


# ----------------------------------------------------------------------------- FedSOUL


def fedsoul(quick: bool):
    data, _ = fb.models.make_linear_mixed_effects(40, seed=0)
    ref = mml(data)
    rounds = 1000 if quick else 3000
    seeds = range(2) if quick else range(4)

    def make():
        return fb.FedSOUL(local_steps=20, step_scale=0.1, server_optimizer="sgd",
                          server_lr=fb.optim.polynomial_decay(1e-3, 0.6, 20.0), average_from=0.3, num_samples=20,
                          warmup=20)

    drop_beta = {}
    for faults, kind, q in configs():
        errs = []
        for seed in (seeds if kind != "nan" else [0]):
            res, policy = fit(fb.models.linear_mixed_effects, data, make, faults, num_rounds=rounds, seed=seed)
            errs.append((res.params["beta"] - ref["beta"]) / ref["beta_se"])
            if seed == 0:
                res0, policy0 = res, policy
        err0 = float(np.max(np.abs(errs[0])))
        _, mcse = batch_means(res0.history["theta/beta"][int(0.3 * rounds):])
        mcse = float(np.max(mcse / ref["beta_se"]))
        # the existing tests' criterion: 4 MCSE plus 0.1 SE of O(step_scale) ULA bias
        verdict = "within noise" if err0 < 4 * mcse + 0.1 else "NOT within noise"
        if kind == "nan":
            same = bool(np.array_equal(res0.params["beta"], drop_beta[q]))
            noise = f"MCSE {mcse:.3f} SE"
        else:
            same = None
            drop_beta[q] = res0.params["beta"]
            rms = np.sqrt(np.mean(np.square(errs), axis=0)).max()
            noise = f"MCSE {mcse:.3f} SE; RMS over {len(errs)} seeds {rms:.3f} SE"
        row("FedSOUL (40 clients, LME)", kind, q, f"beta: {err0:.3f} SE", noise, verdict, policy0, same)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    t0 = time.time()
    print(f"{platform.machine()}, {os.cpu_count()} CPU cores, jax {jax.__version__}, Python {platform.python_version()}")
    print("| family | fault | rate | error vs reference | its noise | verdict | default policy (min_clients=1) |")
    print("|---|---|---|---|---|---|---|")
    optimisation(args.quick)
    fedmm(args.quick)
    langevin(args.quick)
    fedsoul(args.quick)
    print(f"\n{time.time() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
