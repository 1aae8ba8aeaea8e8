"""FedPop's synthetic study: personalised low-rank regression over 100 small clients with FedSOUL.

b = 100 clients, 90% with 5 points and 10% with 10; y = x^T phi z_i + N(0, 0.1^2) with phi in
R^{20x2} shared and z_i personal. Reports the test MSE of the personalised posterior predictive,
the principal-angle distance between the learned and true column spaces of phi, and per-client
90% predictive intervals (their empirical coverage on held-out points).

    python examples/fedpop_synthetic.py            # the paper's 500 rounds
    python examples/fedpop_synthetic.py --quick    # a short run (make demo)
"""

from __future__ import annotations

import argparse
import pathlib
import time
import warnings

import numpy as np

import fedbayes as fb

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import arviz as az


def main(quick: bool) -> None:
    train, test, truth = fb.models.make_fedpop_synthetic(100, seed=0)
    rounds = 300 if quick else 1500
    algo = fb.FedSOUL(local_steps=10, burn_in=2, num_samples=200, warmup=200)
    t0 = time.perf_counter()
    res = fb.fed_fit(fb.models.fedpop_synthetic, train, algo, num_rounds=rounds, seed=0)
    print(f"{res}\nfit: {time.perf_counter() - t0:.1f} s for {rounds} rounds of {train.num_clients} clients")

    # Personalised predictions: average of x^T phi z_s over each client's local posterior samples.
    xt, yt = np.asarray(test.padded["x"]), np.asarray(test.padded["y"])
    draws = np.einsum("cnk,kd,csd->csn", xt, res.params["phi"], res.local_samples["z"])
    mse = np.mean((draws.mean(1) - yt) ** 2)
    pad = fb.models.principal_angle_distance(res.params["phi"], truth["phi"])
    noise = 0.1 * np.random.default_rng(1).normal(size=draws.shape)
    lo, hi = np.quantile(draws + noise, [0.05, 0.95], axis=1)
    coverage = np.mean((yt >= lo) & (yt <= hi), axis=1)
    print(f"test MSE {mse:.4f} (noise variance 0.01); principal-angle distance of phi {pad:.3f}")
    print(f"90% predictive intervals: mean coverage {coverage.mean():.3f}, "
          f"small clients {coverage[:90].mean():.3f}, large clients {coverage[90:].mean():.3f}")
    print(f"communication: {res.bits_up / 8e6:.2f} MB up, {res.bits_down / 8e6:.2f} MB down")

    print("\nArviZ summary of client 0's personal head z:")
    print(az.summary(res.idata, var_names=["z"], coords={"client": [0]}))

    one = res.predict({"x": xt[0, :3]}, client=0)["y"]
    new = res.predict({"x": xt[0, :3]})["y"]
    print("\nclient 0, first 3 test points: truth", np.round(yt[0, :3], 3))
    print("  personalised predictive mean", np.round(one.mean(0), 3), "sd", np.round(one.std(0), 3))
    print("  new-client (population) mean", np.round(new.mean(0), 3), "sd", np.round(new.std(0), 3))
    _plot(draws, noise, yt, res)


def _plot(draws, noise, yt, res) -> None:
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        print("(install fedbayes[plot] for the figure)")
        return
    out = pathlib.Path(__file__).parent / "output"
    out.mkdir(exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, c in zip(axes, (0, 45, 95)):
        order = np.argsort(draws[c].mean(0))[:30]
        pred = draws[c][:, order] + noise[c][:, order]
        lo, hi = np.quantile(pred, [0.05, 0.95], axis=0)
        idx = np.arange(len(order))
        ax.fill_between(idx, lo, hi, alpha=0.3, label="90% predictive interval")
        ax.plot(idx, pred.mean(0), label="predictive mean")
        ax.scatter(idx, yt[c, order], s=10, color="k", label="held-out y")
        ax.set_title(f"client {c} ({int(res.idata['fed_clients']['num_observations'][c])} training points)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "fedpop_synthetic.png", dpi=100)
    print(f"figure: {out / 'fedpop_synthetic.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run for the demo")
    main(parser.parse_args().quick)
