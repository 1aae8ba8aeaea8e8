"""FedMM on a label-skewed Gaussian mixture: statistics averaging against parameter averaging.

A Gaussian mixture (K = 3 components in D = 2, full covariances) over 20 heterogeneous clients:
each client's mixing weights are drawn from Dirichlet(0.3), so most clients see mostly one or two
components (``fb.models.make_gaussian_mixture``). Four fits from the same initial means (k-means++
picks from the pooled data; uniform weights and identity covariances, the model's param inits):

(a) centralised EM: ``fb.FedMM(step_size=1)`` with every client in every round and no compression.
    Its iterates ARE centralised EM's on the pooled data; the script checks this against a plain
    numpy EM (agreement to float64 rounding), and uses its last iterate as the fixed point.
(b) FedMM with participation p = 0.5 (each client takes part in a round with probability 1/2), QSGD
    quantisation of the uploads at about 4 bits per coordinate, the default control-variate step
    alpha = 1 / (1 + omega_p) and a constant step gamma.
(c) the same as (b) without control variates (alpha = 0); in the full run also (c') with a
    6x smaller step, to see whether the step size is what (c) lacks.
(d) the parameter-averaging baseline ``fb.ParamAveragingEM()``: every client runs a full local EM
    step and the server averages the parameters (not FedMM; its fixed point is not EM's on
    heterogeneous clients). If it breaks down (non-finite parameters: ``fed_fit`` raises), the
    script says so and shows it up to its last finite round.

The table gives the log-likelihood of the pooled data, the distance of the means to the centralised
EM means (components matched by the best permutation), the smallest weight and covariance
eigenvalue (a collapsed component shows there), and the total bits (one-off passes included);
then (b)'s means with their Louis standard errors next to (a)'s estimate (and, in the full run,
(a)'s standard errors). Nothing is tuned per method beyond what is listed above; see the printed
numbers for what happens.

    python examples/fedmm_mixture.py            # 2000 rounds of (a), 3000 of (b)-(d), 6000 of (c')
    python examples/fedmm_mixture.py --quick    # 1000 rounds of (a), 1500 of (b)-(d); no (c')

A round costs about a millisecond; most of the run time is compiling each fit (JAX's compilation
cache, in a temporary directory removed at the end, lets later fits reuse earlier programs).

Figure: examples/output/fedmm_mixture.png (distance of the means to the centralised fixed point
against the cumulative uplink bits of the rounds, for (b), (c) and (d); log scale).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import tempfile
import time

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
from scipy.optimize import linear_sum_assignment  # noqa: E402
from scipy.special import logsumexp  # noqa: E402
from scipy.stats import multivariate_normal  # noqa: E402

import fedbayes as fb  # noqa: E402

K, D, NUM_CLIENTS, CONCENTRATION = 3, 2, 20, 0.3
STEP = 0.3  # gamma of (b) and (c)
STEP_SMALL = 0.05  # gamma of (c') (full run only)
TARGET_BITS = 4.0  # QSGD bits per coordinate of an upload


def loglik(y: np.ndarray, weights, means, covs) -> float:
    """sum_j log sum_k w_k N(y_j; m_k, C_k) of the pooled data."""
    logs = np.stack([np.log(w) + multivariate_normal(m, c).logpdf(y) for w, m, c in zip(weights, means, covs)], 1)
    return float(logsumexp(logs, axis=1).sum())


def numpy_em(y: np.ndarray, weights, means, covs, iters: int):
    """Plain centralised EM on the pooled data; returns the means of every iterate (iters, K, D)."""
    out = []
    for _ in range(iters):
        logs = np.stack([np.log(w) + multivariate_normal(m, c).logpdf(y) for w, m, c in zip(weights, means, covs)], 1)
        r = np.exp(logs - logsumexp(logs, axis=1, keepdims=True))
        nk = r.sum(0)
        weights, means = nk / nk.sum(), (r.T @ y) / nk[:, None]
        covs = np.einsum("jk,jd,je->kde", r, y, y) / nk[:, None, None] - np.einsum("kd,ke->kde", means, means)
        out.append(means)
    return np.asarray(out)


def kmeans_pp(y: np.ndarray, k: int, seed: int = 0) -> np.ndarray:
    """k-means++ seeding: the first centre uniformly, each next one with probability ~ squared distance."""
    rng = np.random.default_rng(seed)
    centres = [y[rng.integers(len(y))]]
    for _ in range(k - 1):
        d2 = np.min(((y[:, None, :] - np.asarray(centres)[None]) ** 2).sum(-1), axis=1)
        centres.append(y[rng.choice(len(y), p=d2 / d2.sum())])
    return np.asarray(centres)


def match(means: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """The permutation of the rows of ``means`` closest to ``ref`` (Hungarian algorithm on squared distances)."""
    cost = ((means[:, None, :] - ref[None, :, :]) ** 2).sum(-1)
    rows, cols = linear_sum_assignment(cost)
    perm = np.empty(len(ref), int)
    perm[cols] = rows
    return perm


def distance(means: np.ndarray, ref: np.ndarray) -> float:
    """Frobenius distance ||M P - M_ref|| after the best matching of components."""
    return float(np.linalg.norm(means[match(means, ref)] - ref))


def qsgd_levels(d: int, target: float) -> int:
    """QSGD levels whose message is closest to ``target`` bits per coordinate (ties: more levels)."""
    best = min(range(1, 64), key=lambda s: (abs(fb.compress.qsgd(s).bits(d) / d - target), -s))
    return best


def statistic_size(res: fb.Result) -> int:
    """Length q of the flat E-step statistic (what a FedMM client uploads each round)."""
    return int(sum(np.size(v) for v in jax.tree_util.tree_leaves(res.statistic)))


def fit(name, model, data, algo, rounds, results) -> None:
    t1 = time.perf_counter()
    results[name] = fb.fed_fit(model, data, algo, num_rounds=rounds, seed=0, progress=False)
    print(f"  fitted {name}: {rounds} rounds, {time.perf_counter() - t1:.1f} s")


def share_compilations(directory: str) -> None:
    """Let the fits reuse each other's XLA programs: JAX's compilation cache in ``directory``.

    Every fit builds and compiles its own functions (10-25 s on a 2-core CPU, most of a fit's time
    here), and many of them are the same program for the same model; the cache compiles each once.
    """
    jax.config.update("jax_compilation_cache_dir", directory)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(quick: bool) -> None:
    t0 = time.perf_counter()
    data, truth = fb.models.make_gaussian_mixture(NUM_CLIENTS, num_components=K, dim=D, concentration=CONCENTRATION,
                                                  seed=0)
    y = data.pooled()["y"]
    model = fb.models.gaussian_mixture(K, D)
    init_means = kmeans_pp(y, K, seed=0)
    init = {"means": init_means}
    rounds = 1500 if quick else 3000
    em_rounds = 1000 if quick else 2000

    print(f"{NUM_CLIENTS} clients, {data.total_size} points (sizes {data.sizes.min()}-{data.sizes.max()}), "
          f"K = {K}, D = {D}; client mixing weights ~ Dirichlet({CONCENTRATION})")
    dominant = truth["client_weights"].max(1)
    print(f"label skew: the largest component weight of a client is {np.median(dominant):.2f} (median), "
          f"{dominant.min():.2f} (min)")
    print("initial means (k-means++ from the pooled data):", np.round(init_means, 3).tolist())

    results: dict[str, fb.Result] = {}
    # (a)'s Louis standard errors are a reference for (b)'s; --quick skips that pass (~15 s of compilation)
    fit("(a) centralised EM", model, data, fb.FedMM(step_size=1.0, init=init, uncertainty=not quick), em_rounds,
        results)
    q = statistic_size(results["(a) centralised EM"])
    levels = qsgd_levels(q, TARGET_BITS)
    comp = fb.compress.qsgd(levels)
    print(f"  uploaded statistic: q = {q} floats; {comp.name}: {comp.bits(q)} bits per message = "
          f"{comp.bits(q) / q:.2f} bits/coordinate (identity: 32), omega = {comp.omega(q):.2f}")
    fb_kw = dict(step_size=STEP, participation=0.5, compressor=comp, init=init)
    fit(f"(b) FedMM p=0.5 qsgd({levels}) gamma={STEP}", model, data, fb.FedMM(**fb_kw), rounds, results)
    fit("(c) (b) without control variates", model, data, fb.FedMM(**fb_kw, alpha=0.0, uncertainty=False), rounds,
        results)
    if not quick:  # is (c) a matter of the step size? the same with a 6x smaller step and twice the rounds
        fit(f"(c') (c) with gamma={STEP_SMALL}", model, data,
            fb.FedMM(**{**fb_kw, "step_size": STEP_SMALL}, alpha=0.0, uncertainty=False), 2 * rounds, results)
    try:
        fit("(d) parameter averaging", model, data, fb.ParamAveragingEM(init=init), rounds, results)
    except fb.FedbayesError as err:
        # It can break down: under label skew a client's own M-step can put a component's whole
        # responsibility on <= D of its points, a singular covariance, and the average turns NaN.
        # Report it and show the fit up to its last finite round.
        last = int(re.search(r"at round (\d+)", str(err)).group(1))
        print(f"  (d) parameter averaging broke down: {err}")
        fit(f"(d) param. averaging, {last} rounds", model, data, fb.ParamAveragingEM(init=init), last, results)

    names = list(results)
    em = results[names[0]]
    ref = em.params["means"]

    # (a) is centralised EM: compare its trajectory with a plain numpy EM from the same start.
    # FedMM's first M-step happens at init (theta_1 = T(S_0)); round t of the history holds theta_{t+2}.
    np_means = numpy_em(y, np.full(K, 1.0 / K), init_means, np.broadcast_to(np.eye(D), (K, D, D)), em_rounds + 1)
    gap = np.max(np.abs(em.history["theta/means"] - np_means[1:]))
    print(f"\n(a) against a plain numpy EM on the pooled data, iterate by iterate: max |difference| = {gap:.1e}")
    print(f"(a) last-round change of the means: "
          f"{np.max(np.abs(em.history['theta/means'][-1] - em.history['theta/means'][-2])):.1e}")
    truth_dist = distance(truth["means"], ref)
    print(f"centralised EM means vs the true means: distance {truth_dist:.3f}")

    print(f"\n{'method':<38} {'rounds':>6} {'log-lik':>10} {'|means - EM|':>12} {'min w_k':>8} {'min eig C_k':>11} "
          f"{'bits up':>11} {'bits down':>11}")
    for name, res in results.items():
        p = res.params
        min_eig = np.linalg.eigvalsh(p["covs"]).min()
        print(f"{name:<38} {len(res.history['bits_up']):>6} {loglik(y, p['weights'], p['means'], p['covs']):10.2f} "
              f"{distance(p['means'], ref):12.2e} {p['weights'].min():8.2e} {min_eig:11.2e} "
              f"{res.bits_up:>11,} {res.bits_down:>11,}")
    print("log-lik: of the pooled data at the final estimate; |means - EM|: Frobenius distance to (a)'s means after "
          "matching\ncomponents; min w_k, min eig C_k: the smallest weight and covariance eigenvalue (a component "
          "collapses when they\ngo to 0); bits: all clients, one-off messages included (FedMM: the initial E-step "
          "pass and the control-variate\npass, Result.init_bits; with uncertainty=True the final information "
          "exchange, Result.final_bits).")

    b = results[names[1]]
    perm_b = match(b.params["means"], ref)
    se_b = b.standard_errors["means"][perm_b]
    se_a = em.standard_errors.get("means")
    print("\n(b) means with Louis standard errors (components in the order of (a)), next to (a)'s estimate"
          + (" and standard errors:" if se_a is not None else ":"))
    print(f"{'k':>2} {'d':>2} {'(b) estimate':>13} {'(b) s.e.':>9} {'(a) estimate':>13}"
          + (f" {'(a) s.e.':>9}" if se_a is not None else "") + f" {'|(b) - (a)| / (b) s.e.':>23}")
    for k in range(K):
        for d in range(D):
            est = b.params["means"][perm_b][k, d]
            line = f"{k:>2} {d:>2} {est:13.4f} {se_b[k, d]:9.4f} {ref[k, d]:13.4f}"
            if se_a is not None:
                line += f" {se_a[k, d]:9.4f}"
            print(line + f" {abs(est - ref[k, d]) / se_b[k, d]:23.2e}")

    _plot(results, names[1:], ref)
    print(f"total {time.perf_counter() - t0:.0f} s")


def _plot(results, names, ref) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(__file__).parent / "output"
    out.mkdir(exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in names:
        res = results[name]
        traj = res.history["theta/means"]
        dist = [distance(m, ref) for m in traj]
        ax.plot(res.history["bits_up"].cumsum(), dist, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("cumulative uplink bits of the rounds (one-off passes not counted)")
    ax.set_ylabel("|means - centralised EM means| (matched)")
    ax.set_title(f"FedMM on a label-skewed mixture ({NUM_CLIENTS} clients)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "fedmm_mixture.png", dpi=100)
    print(f"\nfigure: {out / 'fedmm_mixture.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    quick = parser.parse_args().quick
    with tempfile.TemporaryDirectory(prefix="fedmm_mixture_xla_") as cache:  # removed at the end
        share_compilations(cache)
        main(quick)
