"""FedPop's synthetic study: personalised low-rank regression over 100 small clients with FedSOUL.

b = 100 clients, 90% with 5 points and 10% with 10; y = x^T phi z_i + N(0, 0.1^2) with phi in
R^{20x2} shared and z_i personal. Reports the test MSE of the personalised posterior predictive,
the principal-angle distance between the learned and true column spaces of phi, and per-client
90% predictive intervals (their empirical coverage on held-out points).

    python examples/fedpop_synthetic.py            # 2 000 rounds
    python examples/fedpop_synthetic.py --quick    # 1 000 rounds, converged (make demo)
    python examples/fedpop_synthetic.py --compare  # FedPop's comparison table: 5 seeds, the baselines

``--compare`` runs FedPop's protocol against its baselines on ``--seeds`` data sets (default 5):
FedSOUL (stateful, M = 10), FedSOUL's stateless variant (chains restarted from p(z | theta) each
round, M = 50), FedRep (shared phi, personal heads by local gradient steps, no prior, no noise),
FedAvg (one shared model: every head at the population mean) and FedAvg followed by local
fine-tuning of the heads (``fb.FineTune`` from the FedAvg fit), and prints per algorithm the mean
and standard deviation over seeds of the test MSE, the principal-angle distance of phi and FedPop's
aligned l2(z) (:func:`fedbayes.models.aligned_head_error`), with the megabytes uploaded (for
FedAvg + fine-tuning, FedAvg's).
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
    # 1 000 rounds reach the exact maximum-likelihood estimate to 0.05 standard errors (of the identified
    # phi mu and sigma^2 phi phi^T; tests/test_symmetry.py), and 400 final draws keep the one Newton step's
    # Monte Carlo error below 0.1 standard error; 300 rounds stop about 1 standard error short, and warn
    rounds = 1000 if quick else 2000
    algo = fb.FedSOUL(local_steps=10, burn_in=2, num_samples=400, warmup=200)
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


def _heads(res, kind: str, num_clients: int) -> np.ndarray:
    """Each client's head as a point (clients, d): its local posterior mean, or mu for the shared model."""
    if kind == "shared":
        mu = np.asarray(res.params["mu"])
        return np.broadcast_to(mu, (num_clients, mu.size))
    return np.asarray(res.local_samples["z"]).mean(1)


def compare(seeds: int, rounds: int) -> None:
    """FedPop's comparison table (its Figure 2 / Table 1 metrics) over ``seeds`` data sets."""
    soul = dict(num_samples=100, warmup=100, uncertainty=False)
    rows: dict[str, list[tuple[float, float, float, float]]] = {}
    for seed in range(seeds):
        train, test, truth = fb.models.make_fedpop_synthetic(100, seed=seed)
        xt, yt = np.asarray(test.padded["x"]), np.asarray(test.padded["y"])
        avg = fb.fed_fit(fb.models.fedpop_synthetic, train, fb.FedAvg(local_latents="population-mean"),
                         num_rounds=rounds, seed=seed, progress=False)
        fits = {
            "FedSOUL (M=10)": (fb.FedSOUL(local_steps=10, burn_in=2, **soul), "personal"),
            "FedSOUL stateless (M=50)": (fb.FedSOUL(local_steps=50, burn_in=10, stateful=False, **soul), "personal"),
            "FedRep": (fb.FedRep(local_steps=10, num_samples=10, warmup=20), "personal"),
            "FedAvg": (None, "shared"),
            "FedAvg + fine-tuning": (fb.FineTune(init=avg, local_steps=10, num_samples=10, warmup=20), "personal"),
        }
        for name, (algorithm, kind) in fits.items():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # short runs of five algorithms: the table is the point
                res = avg if algorithm is None else fb.fed_fit(fb.models.fedpop_synthetic, train, algorithm,
                                                               num_rounds=rounds, seed=seed, progress=False)
            phi = np.asarray(res.params["phi"])
            heads = _heads(res, kind, train.num_clients)
            mse = float(np.mean((np.einsum("cnk,kd,cd->cn", xt, phi, heads) - yt) ** 2))
            rows.setdefault(name, []).append((mse, fb.models.principal_angle_distance(phi, truth["phi"]),
                                              fb.models.aligned_head_error(phi, heads, truth["phi"], truth["z"]),
                                              (res.bits_up + (avg.bits_up if name == "FedAvg + fine-tuning" else 0)) / 8e6))
        print(f"seed {seed} done", flush=True)
    print(f"\n{seeds} seeds, {rounds} rounds, 100 clients (90 with 5 points, 10 with 10); mean (sd) over seeds")
    print("| algorithm | test MSE | principal-angle distance | aligned l2(z) | MB up |")
    print("|---|---|---|---|---|")
    for name, values in rows.items():
        v = np.asarray(values)
        cells = " | ".join(f"{m:.4f} ({sd:.4f})" for m, sd in zip(v.mean(0)[:3], v.std(0)[:3]))
        print(f"| {name} | {cells} | {v[:, 3].mean():.2f} |")


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
    parser.add_argument("--compare", action="store_true", help="FedPop's comparison table against its baselines")
    parser.add_argument("--seeds", type=int, default=5, help="data sets in the comparison")
    parser.add_argument("--rounds", type=int, default=500, help="rounds of each fit in the comparison")
    args = parser.parse_args()
    if args.compare:
        compare(args.seeds, args.rounds)
    else:
        main(args.quick)
