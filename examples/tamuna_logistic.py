"""Federated MAP with TAMUNA: heterogeneous L2-regularised logistic regression over 100 clients.

Each of the 100 clients has its own feature distribution and labelling rule
(``fb.models.make_glm_clients``); the model is ``fb.models.logistic_regression`` with the prior
scale that makes the clients' objectives' condition number kappa = L_max / mu = 1000
(``fb.models.prior_scale_for_kappa``). The exact MAP x* comes from Newton's method on the pooled data
(``fb.models.logistic_map``). All fits start at w = 0 with gamma = 1 / L_max (estimated from the
model), and runs until the relative error falls below 1e-10 (or a round budget ends):

* TAMUNA: every client each round, s = 2 holders per coordinate (each client uploads 2 d / n = 1
  float per round), p from ``fb.tamuna.recommended_p`` (Geometric(p) local steps per round);
* TAMUNA with partial participation: 10 clients per round, s = 2;
* Scaffnew: local steps with control variates, no compression;
* GD: one gradient step per round;
* FedAvg: 10 local steps per round without control variates (it stalls at its client-drift point).

The table gives, for each method, the rounds and floats needed to reach a relative error of 1e-8;
the figure plots the relative error |x_bar - x*| / |x*| against the floats one participating client
uploaded (the paper's UpCom) and against all floats that crossed the network in both directions
(the ledger): examples/output/tamuna_logistic.png.

    python examples/tamuna_logistic.py            # d = 50
    python examples/tamuna_logistic.py --quick    # d = 20
"""

from __future__ import annotations

import argparse
import pathlib

import jax
import numpy as np

jax.config.update("jax_enable_x64", True)  # exact convergence is visible only in float64

import fedbayes as fb  # noqa: E402

TARGET = 1e-8


def main(quick: bool) -> None:
    n, d, m, kappa = (100, 20, 40, 1e3) if quick else (100, 50, 40, 1e3)
    data, _ = fb.models.make_glm_clients(n, d, m, family="logistic", heterogeneity=1.0, seed=0)
    prior = fb.models.prior_scale_for_kappa(data, kappa)
    pooled = data.pooled()
    xstar = fb.models.logistic_map(pooled["x"], pooled["y"], prior)
    model = fb.models.logistic_regression(prior)
    zero = {"w": np.zeros(d)}
    est = fb.tamuna.estimate_condition(model, data, at=zero)
    print(f"{n} clients, d = {d}, {data.sizes.sum()} points; kappa = {est['kappa']:.0f} "
          f"(L_max = {est['L']:.3g}, mu = {est['mu']:.3g})")

    fits = {  # name: (algorithm, clients per round, round budget)
        "TAMUNA (c = n, s = 2)": (fb.TAMUNA(s=2, init=zero), None, 8000),
        "TAMUNA (c = 10, s = 2)": (fb.TAMUNA(s=2, init=zero), 10, 8000),
        "Scaffnew": (fb.Scaffnew(init=zero), None, 400),
        "GD": (fb.GD(init=zero), None, 4000),
        "FedAvg (10 local steps)": (fb.FedAvg(local_steps=10, init=zero), None, 400),
    }
    curves = {}
    print(f"\nto reach |x - x*| / |x*| <= {TARGET:g}:")
    print(f"{'method':<26}{'s':>4}{'p':>7}{'rounds':>9}{'local steps':>13}{'uplink floats/client':>22}"
          f"{'all floats':>12}{'final error':>13}")
    for name, (algo, cohort, rounds) in fits.items():
        res = fb.fed_fit(model, data, algo, num_rounds=rounds, clients_per_round=cohort, seed=1)
        c = cohort or n
        err = np.linalg.norm(res.history["theta/w"] - xstar, axis=1) / np.linalg.norm(xstar)
        up = np.cumsum(res.history["bits_up"]) / 32 / c  # every member uploads s d / c floats on average
        total = np.cumsum(res.history["bits_up"] + res.history["bits_down"]) / 32
        steps = np.cumsum(res.history["local_steps"])
        curves[name] = (up, total, err)
        cfg = res.settings
        hit = np.flatnonzero(err <= TARGET)
        if hit.size:
            r = hit[0]
            print(f"{name:<26}{cfg['s']:>4}{cfg['p']:>7.3f}{r + 1:>9}{steps[r]:>13}{up[r]:>22.0f}{total[r]:>12.3g}"
                  f"{err[-1]:>13.1e}")
        else:
            print(f"{name:<26}{cfg['s']:>4}{cfg['p']:>7.3f}{'not reached in ' + str(rounds) + ' rounds':>56}{err[-1]:>13.1e}")
    plot(curves)


def plot(curves) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'fedbayes[plot]'): no figure")
        return
    out = pathlib.Path(__file__).parent / "output"
    out.mkdir(exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for name, (up, total, err) in curves.items():
        axes[0].semilogy(up, err, label=name)
        axes[1].loglog(total, err, label=name)
    for ax in axes:
        ax.axhline(TARGET, color="grey", lw=0.8, ls=":")
    axes[0].set_xlabel("floats uploaded per participating client")
    axes[1].set_xlabel("all floats over the network (both directions)")
    axes[0].set_ylabel("|x - x*| / |x*|")
    axes[0].set_xscale("log")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("TAMUNA: error against communication (heterogeneous logistic regression, 100 clients)")
    fig.tight_layout()
    fig.savefig(out / "tamuna_logistic.png", dpi=100)
    print(f"\nfigure: {out / 'tamuna_logistic.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    main(parser.parse_args().quick)
