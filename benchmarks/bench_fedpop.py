"""FedPop's image experiment (Table 2 and Figure 3) on data available offline.

Protocol (FedPop section 5, ``fb.models.make_fedpop_images``): 100 clients holding S in {2, 5} classes
each, 500 training and 100 test images per client, a shared tanh-MLP feature extractor (64 -> 32 -> 16
on digits) with a personal linear head per client (``fb.models.fedpop_classifier``), 10 of 100 clients
per round, M = 10 local steps on minibatches of 50 rows, seeds 0-2. Algorithms, one loop:

* FedSOUL (SGLD heads, Adam on the shared sites, the library's defaults otherwise);
* FedSOUL as FedPop's released configurations run it (:data:`PAPER`: the heads' prior scale fixed at 1,
  a dense local metric);
* FedSOUL with the diagonal local metric (:data:`DIAGONAL`: heads that mix at the cost of a gradient a round);
* the same started from the non-personalised model's fit (:data:`WARM`, ``init="map"``);
* FedAvg (one shared classifier: every head at the population mean, ``local_latents="population-mean"``);
* FedAvg + fine-tuning (``fb.FineTune`` from the FedAvg fit);
* FedRep (``fb.FedRep``: personal heads by local gradient steps, no prior, no noise);
* local training (``fb.LocalOnly``: every client alone).

Scores per client on its own test images (``fb.models.classification_scores``: accuracy, top-label
ECE with 10 bins, multi-class Brier, NLL of the posterior predictive), averaged over clients, then mean
(sd) over the seeds. The small-data variant (Figure 3): S = 5, a fraction 10 / 50 / 90% of the clients
hold 5 training images, FedSOUL (both) against FedRep, accuracy over the small clients.

    python benchmarks/bench_fedpop.py                 # the full protocol (about 1 h on 2 cores, on digits)
    python benchmarks/bench_fedpop.py --quick         # 1 seed, S = 2, 150 rounds
    python benchmarks/bench_fedpop.py --jobs 8        # the (S, seed, fraction) settings in 8 processes

With ``--jobs`` each setting runs in its own process and prints a JSON line when it ends (what a run cut
short has finished is kept); on a GPU, let the processes share it (``XLA_PYTHON_CLIENT_PREALLOCATE=false``).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

import _common  # benchmarks/_common.py (the script's folder is on sys.path)
import numpy as np

import fedbayes as fb

COMMON = dict(local_steps=10, batch_size=50)
FINAL = dict(num_samples=50, warmup=100, thinning=2)  # the final exchange's local chains (per client)


PAPER = "FedSOUL (sigma = 1, dense)"
"""FedSOUL as FedPop's released image configurations set it up: the heads' prior fixed at N(0, 1) per
coordinate (``prior_scale=1``; mu still learned here), and a preconditioned local kernel
(``local_metric="dense"``: the library's default metric for 160 head coordinates is the identity, whose
chains do not mix)."""


DIAGONAL = "FedSOUL (diagonal)"
"""FedSOUL with ``local_metric="diagonal"`` (the running diagonal of the heads' curvature as the Langevin metric),
the library's defaults otherwise."""


WARM = "FedSOUL (diagonal, map start)"
"""FedSOUL with the diagonal local metric started from the non-personalised model's fit (``init="map"``: every
head at mu, FedAvg's problem solved by TAMUNA first), the library's defaults otherwise."""


def algorithms(avg: fb.Result) -> dict[str, tuple[object, object]]:
    model = fb.models.fedpop_classifier
    fixed = functools.partial(fb.models.fedpop_classifier, prior_scale=1.0)
    return {
        "FedSOUL": (fb.FedSOUL(**COMMON, **FINAL), model),
        PAPER: (fb.FedSOUL(**COMMON, **FINAL, local_metric="dense"), fixed),
        DIAGONAL: (fb.FedSOUL(**COMMON, **FINAL, local_metric="diagonal"), model),
        WARM: (fb.FedSOUL(**COMMON, **FINAL, local_metric="diagonal", init="map"), model),
        "FedAvg + FT": (fb.FineTune(init=avg, **COMMON, num_samples=5, warmup=20), model),
        "FedRep": (fb.FedRep(**COMMON, num_samples=5, warmup=20), model),
        "Local": (fb.LocalOnly(**COMMON, num_samples=5, warmup=20), model),
    }


NEW_CLIENTS = 20
"""Held-out clients of FedPop's cheap inference for a new client: 5 training images each."""


def ood_images(source: str, dim: int, n: int = 500, seed: int = 0) -> np.ndarray:
    """Out-of-distribution inputs for FedPop's Figure 4 (MNIST for a Fashion-MNIST fit, which is not available
    offline): for a Fashion-MNIST fit scikit-learn's handwritten digits upsampled to 28 x 28; for a digits fit
    grey 8 x 8 patches of scikit-learn's two bundled photographs, both in [0, 1] as the fit's images are."""
    rng = np.random.default_rng(seed)
    if source == "fashion-mnist":
        from sklearn.datasets import load_digits

        digits = load_digits().images[rng.choice(1797, n, replace=False)] / 16.0
        up = np.kron(digits, np.ones((3, 3)))  # 24 x 24, centred in 28 x 28 as MNIST's digits are
        return np.pad(up, ((0, 0), (2, 2), (2, 2))).reshape(n, -1).astype(np.float32)
    from sklearn.datasets import load_sample_images

    grey = [im.mean(-1) / 255.0 for im in load_sample_images().images]
    side = int(round(np.sqrt(dim)))
    patches = []
    for _ in range(n):
        g = grey[rng.integers(len(grey))]
        i, j = rng.integers(g.shape[0] - 4 * side), rng.integers(g.shape[1] - 4 * side)
        patches.append(g[i : i + 4 * side, j : j + 4 * side].reshape(side, 4, side, 4).mean((1, 3)))
    return np.asarray(patches, np.float32).reshape(n, -1)


def ood_auroc(res: fb.Result, test: fb.FederatedData, out: np.ndarray) -> float:
    """FedPop's Figure 4: each client's predictive entropy on its own test images against the OOD images, the
    AUROC of telling them apart, averaged over clients."""
    from fedbayes.diagnostics import ood

    k = test.num_clients
    p_in = res.predictive_probs(test, client="all", num_samples=50)
    p_out = res.predictive_probs(fb.FederatedData({"x": [out] * k}), client="all", num_samples=50)
    scores = []
    for i in range(k):
        n = int(test.sizes[i])
        a = ood.predictive_entropy(np.asarray(p_in[i])[:, :n])
        b = ood.predictive_entropy(np.asarray(p_out[i]))
        scores.append(ood.ood_auroc(a, b))
    return float(np.mean(scores))


def new_client_scores(res: fb.Result, name: str, S: int, seed: int) -> dict[str, float]:
    """FedPop's inference for a new client: NEW_CLIENTS held-out clients with 5 training images each (the same
    protocol's split, so no test image was trained on), each predicting its 100 test images from its own draws
    (``res.sample_client``, then ``predictive_probs(..., local_samples=)``): FedSOUL's posterior under the learned
    prior with the body fixed; FedRep's and FT's local training of the head from the shared body; FedAvg's one
    classifier. Accuracy and ECE averaged over the new clients (Local cannot predict for a new client)."""
    from fedbayes.diagnostics.calibration import expected_calibration_error

    if name == "Local":
        return {}
    train, test, _ = fb.models.make_fedpop_images(100 + NEW_CLIENTS, S, train_size=5, test_size=100, seed=seed)
    acc, ece = [], []
    for i in range(100, 100 + NEW_CLIENTS):
        x, y = test.client(i)["x"], np.asarray(test.client(i)["y"])
        if name == "FedAvg":
            p = res.predictive_probs({"x": x}, num_samples=1).mean(0)
        else:
            draws = res.sample_client(train.client(i), num_samples=25, warmup=100, seed=i)
            p = res.predictive_probs({"x": x}, local_samples=draws).mean(0)
        p = np.asarray(p, np.float64) / np.sum(p, -1, keepdims=True)
        acc.append(float(np.mean(p.argmax(-1) == y)))
        ece.append(expected_calibration_error(p, y, n_bins=10))
    return {"new_accuracy": float(np.mean(acc)), "new_ece": float(np.mean(ece))}


def run_setting(S: int, seed: int, rounds: int, small_fraction: float = 0.0, names=None, extras: bool = False
                ) -> dict[str, dict]:
    train, test, info = fb.models.make_fedpop_images(100, S, small_fraction=small_fraction, seed=seed)
    kw = dict(num_rounds=rounds, clients_per_round=10, seed=seed, progress=False)
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fb.ConvergenceWarning)  # short runs: the drift checks fire; scores tell
        runs, avg = {}, None
        if names is None or {"FedAvg", "FedAvg + FT"} & set(names):
            t = time.time()
            avg = fb.fed_fit(fb.models.fedpop_classifier, train, fb.FedAvg(local_latents="population-mean", **COMMON),
                             **kw)
            runs["FedAvg"] = (avg, time.time() - t)
        for name, (algo, model) in algorithms(avg).items():
            if names is not None and name not in names:
                continue
            t = time.time()
            runs[name] = (fb.fed_fit(model, train, algo, **kw), time.time() - t)
    small = np.asarray(train.sizes) < 500
    out_images = ood_images(info["source"], train.client(0)["x"].shape[-1]) if extras else None
    for name, (res, seconds) in runs.items():
        if names is not None and name not in names:
            continue
        scores = fb.models.classification_scores(res, test)
        row = scores.mean().to_dict()
        if extras:  # FedPop's Figure 4 (OOD) and its new clients
            row["ood_auroc"] = ood_auroc(res, test, out_images)
            row.update(new_client_scores(res, name, S, seed))
        if small.any():
            row["small_accuracy"] = float(scores["accuracy"][small].mean())
            row["small_ece"] = float(scores["ece"][small].mean())
        row["seconds"] = seconds
        out[name] = row
    out["_source"] = info["source"]
    return out


def _mean_sd(v: np.ndarray) -> str:
    """``mean (sd)`` over seeds (sd 0 for one seed)."""
    return f"{v.mean():.3f} ({v.std(ddof=1) if len(v) > 1 else 0.0:.3f})"


def table(results: list[dict], metrics=("accuracy", "ece", "brier", "nll")) -> str:
    names = [k for k in results[0] if not k.startswith("_")]
    lines = ["| algorithm | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for name in names:
        cells = []
        for m in metrics:
            cells.append(_mean_sd(np.array([r[name][m] for r in results])) if m in results[0][name] else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _job(args: tuple) -> dict:
    S, seed, rounds, frac, names = args
    out = run_setting(S, seed, rounds, small_fraction=frac, names=names, extras=frac == 0.0)
    out["_key"] = [S, seed, frac]
    print(json.dumps(out), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--jobs", type=int, default=1, help="settings run at once, each in its own process")
    parser.add_argument("--only", nargs="+", default=None, help="these algorithms only (FedAvg + FT needs FedAvg)")
    parser.add_argument("--S", type=int, nargs="+", default=None, help="classes per client (default 2 and 5)")
    parser.add_argument("--fractions", type=float, nargs="*", default=None,
                        help="small-data fractions (default 0.1 0.5 0.9)")
    args = parser.parse_args()
    seeds = [0] if args.quick else [0, 1, 2]
    rounds = args.rounds or (150 if args.quick else 400)
    small_names = tuple(args.only) if args.only is not None else ("FedSOUL", PAPER, DIAGONAL, WARM, "FedRep")
    settings = [(S, s, rounds, 0.0, args.only) for S in (args.S or ([2] if args.quick else [2, 5])) for s in seeds]
    fractions = tuple(args.fractions if args.fractions is not None else (() if args.quick else (0.1, 0.5, 0.9)))
    settings += [(5, s, rounds, f, small_names) for f in fractions for s in seeds]
    print(_common.machine_line(), flush=True)
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = list(pool.map(_job, settings))
    else:
        done = [_job(job) for job in settings]
    found = {tuple(r["_key"]): r for r in done}
    for S in sorted({job[0] for job in settings if job[3] == 0.0}):
        results = [found[(S, s, 0.0)] for s in seeds]
        print(f"\nS = {S} classes per client ({results[0]['_source']}; {rounds} rounds, seeds {seeds}); "
              "per-client scores averaged over clients, mean (sd) over seeds\n")
        print(table(results))
        print(f"\nOOD (FedPop's Figure 4: each client's predictive entropy on its test images against ood_images()'s"
              f" 500, AUROC averaged over clients) and {NEW_CLIENTS} new clients with 5 images each\n")
        print(table(results, metrics=("ood_auroc", "new_accuracy", "new_ece")))
        print("\nseconds per fit: " + ", ".join(f"{k} {np.mean([r[k]['seconds'] for r in results]):.0f}"
                                              for k in results[0] if not k.startswith("_")), flush=True)
    if not fractions:
        return
    for metric in ("small_accuracy", "small_ece"):
        print(f"\nSmall-data variant (S = 5; a fraction of the clients hold 5 training images): {metric[6:]} of the "
              "small clients, mean (sd) over seeds\n")
        names = [n for n in found[(5, seeds[0], fractions[0])] if not n.startswith("_")]
        print("| fraction with 5 images | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
        for frac in fractions:
            res = [found[(5, s, frac)] for s in seeds]
            cells = [_mean_sd(np.array([r[name][metric] for r in res])) for name in names]
            print(f"| {frac:.0%} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
