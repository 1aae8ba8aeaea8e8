"""Calibration and out-of-distribution checks of a personalised classifier on scikit-learn's digits.

Digits 0-7 are spread over 20 clients with label skew (Dirichlet(0.5) class proportions); digits 8
and 9 never appear in training and serve as OOD inputs. Two federated fits of the same network
(a tanh layer of 16 shared features and a softmax head):

* FedSOUL on ``fb.models.personalized_logistic``: shared features, a personal head per client with a
  learned population prior; predictions average over each client's local posterior.
* FedAvg on the same network with one shared head: a point estimate (the usual federated baseline).

Each client's held-out digits are scored by its own model. The script prints accuracy, ECE, Brier,
NLL and the OOD AUROC of each score, then saves a reliability diagram and entropy histograms.

    python examples/calibration_ood.py            # 600 rounds
    python examples/calibration_ood.py --quick    # 150 rounds
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from sklearn.datasets import load_digits

import fedbayes as fb
from fedbayes import diagnostics as dg

IN_CLASSES, HIDDEN, NUM_CLIENTS = 8, 16, 20


def shared_logistic(features, y=None, *, num_classes: int = IN_CLASSES, hidden: int = HIDDEN):
    """The FedAvg baseline: ``personalized_logistic``'s network with one head shared by all clients."""
    k = features.shape[-1]
    w_phi = numpyro.sample("w_phi", dist.Normal(0, 1 / np.sqrt(k)).expand([k, hidden]).to_event(2))
    c_phi = numpyro.sample("c_phi", dist.Normal(0, 1).expand([hidden]).to_event(1))
    w = numpyro.sample("w", dist.Normal(0, 1).expand([hidden, num_classes]).to_event(2))
    b = numpyro.sample("b", dist.Normal(0, 1).expand([num_classes]).to_event(1))
    with numpyro.plate("obs", features.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=jnp.tanh(features @ w_phi + c_phi) @ w + b), obs=y)


def make_data(seed: int = 0):
    x, y = load_digits(return_X_y=True)
    x = x / 16.0
    rng = np.random.default_rng(seed)
    inside = y < IN_CLASSES
    owner = fb.partition_dirichlet(y[inside], NUM_CLIENTS, alpha=0.5, seed=seed, min_size=20)
    xi, yi = x[inside], y[inside]
    train, test = {"features": [], "y": []}, []
    for c in range(NUM_CLIENTS):
        idx = rng.permutation(np.flatnonzero(owner == c))
        cut = int(0.7 * len(idx))
        train["features"].append(xi[idx[:cut]])
        train["y"].append(yi[idx[:cut]])
        test.append((xi[idx[cut:]], yi[idx[cut:]]))
    ood = x[~inside]
    ood_split = np.array_split(rng.permutation(len(ood)), NUM_CLIENTS)  # every client meets some OOD digits
    return fb.FederatedData(train), test, [ood[i] for i in ood_split]


def main(quick: bool) -> None:
    train, test, ood = make_data()
    rounds = 150 if quick else 600
    print(f"{train.num_clients} clients, {train.total_size} training digits (classes 0-{IN_CLASSES - 1}), "
          f"sizes {train.sizes.min()}-{train.sizes.max()}; {sum(len(o) for o in ood)} OOD digits (8, 9)")
    clients = list(range(NUM_CLIENTS))
    x_in = [{"features": t[0]} for t in test]
    x_out = [{"features": o} for o in ood]
    labels = np.concatenate([t[1] for t in test])

    t0 = time.perf_counter()
    soul = fb.fed_fit(fb.models.personalized_logistic, train,
                      fb.FedSOUL(local_steps=10, server_lr=0.01, num_samples=100, warmup=200, thinning=5),
                      num_rounds=rounds, model_kwargs={"num_classes": IN_CLASSES, "hidden": HIDDEN}, seed=0)
    print(f"FedSOUL: {time.perf_counter() - t0:.1f} s; {soul.bits_up / 8e6:.2f} MB up")
    t0 = time.perf_counter()
    # the network's weights at their prior centre (all 0) are a saddle that gradient steps never leave:
    # FedAvg's default start moves them off it (FedModel.off_saddle)
    avg = fb.fed_fit(shared_logistic, train, fb.FedAvg(local_steps=10), num_rounds=rounds, seed=0)
    print(f"FedAvg:  {time.perf_counter() - t0:.1f} s; {avg.bits_up / 8e6:.2f} MB up")

    rows, probs, entropy = [], {}, {}
    for name, fit in (("FedSOUL (posterior)", soul), ("FedAvg (point)", avg)):
        own = clients if fit is soul else [None] * NUM_CLIENTS  # personalised: each client's own posterior
        d_in = np.concatenate([fit.predictive_probs(x, c) for x, c in zip(x_in, own)], axis=1)
        d_out = np.concatenate([fit.predictive_probs(x, c) for x, c in zip(x_out, own)], axis=1)
        p = d_in.mean(0)
        probs[name] = p
        scores = dg.ood_scores(d_in, d_out)
        entropy[name] = (dg.predictive_entropy(d_in), dg.predictive_entropy(d_out))
        rows.append((name, np.mean(p.argmax(1) == labels), dg.expected_calibration_error(p, labels),
                     dg.brier_score(p, labels), dg.negative_log_predictive_density(p, labels),
                     scores.loc["predictive_entropy", "auroc"], scores.loc["neg_max_probability", "auroc"],
                     scores.loc["mutual_information", "auroc"]))
    print(f"\n{'method':22s} {'acc':>6s} {'ECE':>6s} {'Brier':>6s} {'NLL':>6s}  OOD AUROC: {'entropy':>8s} "
          f"{'-maxp':>6s} {'MI':>6s}")
    for r in rows:
        print(f"{r[0]:22s} {r[1]:6.3f} {r[2]:6.3f} {r[3]:6.3f} {r[4]:6.3f}             {r[5]:8.3f} {r[6]:6.3f} {r[7]:6.3f}")
    print("(MI of a point estimate is 0 for every input: its AUROC is 0.5 by construction)")

    out = pathlib.Path(__file__).parent / "output"
    try:
        dg.plot_reliability(probs, labels, path=out / "calibration_reliability.png")
        dg.plot_score_histograms(entropy, path=out / "calibration_entropy.png")
        print(f"figures: {out / 'calibration_reliability.png'}, {out / 'calibration_entropy.png'}")
    except fb.FedbayesError as err:
        print(f"(no figures: {err})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run")
    main(parser.parse_args().quick)
