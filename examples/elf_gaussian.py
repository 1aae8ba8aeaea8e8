"""Federated Langevin samplers on a Gaussian target whose posterior is known in closed form.

Ten heterogeneous clients each hold one Gaussian "observation" m_i of x in R^10 with precision A_i
(different eigenvectors, scales and centres); with a N(0, 10^2 I) prior the posterior is
N(mu, P^-1), P = sum_i A_i + I / 100, mu = P^-1 sum_i A_i m_i. Two studies:

(a) The bias of LMC against its step size gamma. On a Gaussian, LMC's stationary law is
    N(mu, Sigma_gamma) with Sigma_gamma = (P - gamma P^2 / 2)^-1, exactly: the mean is right and the
    variance is inflated by 1 / (1 - gamma lambda / 2) along each eigenvector of P. The script
    compares Sigma_gamma with the empirical covariance of many chains (started near mu, so that a
    short warm-up reaches the stationary law) and prints the exact KL(N(mu, Sigma_gamma) || posterior),
    which grows like gamma^2 for small gamma.

(b) The bias of compression at a fixed step: naive compressed LMC (each client sends Q(grad U_i),
    no error feedback), D-ELF (EF21 on the uplink), P-ELF (EF21-P on the downlink) and B-ELF (both),
    with identity, top_k(1), top_k(3) and natural(contractive=True): the error of the mean (in
    posterior standard deviations), of the covariance, and the KL from the Gaussian fitted to the
    draws to the posterior, against the bits each round costs one chain.

    python examples/elf_gaussian.py            # 5 step sizes, 4 compressors: about 1.5 min on two cores
    python examples/elf_gaussian.py --quick    # 3 step sizes, identity and top_k(1): about 40 s

Figure: examples/output/elf_gaussian.png ((a) bias against gamma, (b) KL against bits per round).
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

import fedbayes as fb

D, NUM_CLIENTS, PRIOR_SD = 10, 10, 10.0


def gaussian_clients(seed: int = 0):
    """Client i: U_i(x) = (x - m_i)^T A_i (x - m_i) / 2, A_i = s_i Q_i diag(u_i) Q_i^T.

    Heterogeneous: random rotations Q_i, eigenvalues u_i in [0.5, 2], overall scales s_i
    log-uniform in [0.2, 5], centres m_i ~ N(0, 2^2 I) (so grad U_i(mu) != 0 for every client).
    """
    rng = np.random.default_rng(seed)
    ms, precs = [], []
    for _ in range(NUM_CLIENTS):
        q, _ = np.linalg.qr(rng.normal(size=(D, D)))
        scale = np.exp(rng.uniform(np.log(0.2), np.log(5.0)))
        precs.append(scale * (q * rng.uniform(0.5, 2.0, D)) @ q.T)
        ms.append(rng.normal(0.0, 2.0, D))
    data = fb.FederatedData({"m": [m[None] for m in ms], "prec": [a[None] for a in precs]})
    P = sum(precs) + np.eye(D) / PRIOR_SD**2
    mu = np.linalg.solve(P, sum(a @ m for a, m in zip(precs, ms)))
    return data, P, mu


def gauss_model(m, prec):
    """One client's model: the MVN log-density of its observation m, written as a factor.

    Equal to dist.MultivariateNormal(x, precision_matrix=prec).log_prob(m) up to a constant in x;
    the explicit quadratic form avoids a Cholesky factorisation per chain, client and round.
    """
    x = numpyro.sample("x", dist.Normal(0.0, PRIOR_SD).expand([D]).to_event(1))
    with numpyro.plate("obs", m.shape[0]):
        r = m - x
        numpyro.factor("y", -0.5 * jnp.einsum("ni,nij,nj->n", r, prec, r))


def gauss_kl(mean, cov, mu, P) -> float:
    """KL(N(mean, cov) || N(mu, P^-1))."""
    diff = mean - mu
    _, logdet = np.linalg.slogdet(P @ cov)
    return 0.5 * (np.trace(P @ cov) + diff @ P @ diff - len(mu) - logdet)


def rel_fro(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def fro_floor(cov, n) -> float:
    """Root-mean-square relative Frobenius error of a sample covariance of n independent draws."""
    return math.sqrt((np.trace(cov) ** 2 + np.trace(cov @ cov)) / n) / np.linalg.norm(cov)


def step_study(data, P, mu, ratios, chains):
    """(a) LMC at gamma = r / lambda_max: the last draw of each of `chains` chains."""
    lam = np.linalg.eigvalsh(P)
    lam_min, lam_max = lam[0], lam[-1]
    top = np.linalg.eigh(P)[1][:, -1]
    post = np.linalg.inv(P)
    print(f"(a) LMC bias against the step size: {chains} chains from near mu, "
          f"warm-up 4 / (gamma lambda_min) rounds, the last draw of each chain")
    print(f"    lambda(P) in [{lam_min:.1f}, {lam_max:.1f}]; variance inflation along P's top eigenvector: "
          "exact 1 / (1 - gamma lambda_max / 2)")
    print(f"{'gamma*lmax':>10} {'rounds':>6} {'KL exact':>9} {'KL/gamma^2':>10} {'infl exact':>10} "
          f"{'infl emp':>13} {'|C-Sg|/|Sg|':>11} {'|C-S|/|S|':>9} {'|Sg-S|/|S|':>10} {'MC floor':>8}")
    rows = []
    for i, r in enumerate(ratios):
        gamma = r / lam_max
        rounds = math.ceil(4.0 / (gamma * lam_min))
        algo = fb.LMC(step_size=gamma, num_chains=chains, warmup=rounds - 1, init={"x": mu})
        # one chunk of every round: the host reads the records once (the chunks change no round)
        res = fb.fed_fit(gauss_model, data, algo, num_rounds=rounds, seed=i, chunk_size=rounds)
        x = res.global_samples["x"][:, -1]
        emp = np.cov(x.T)
        sig_g = np.linalg.inv(P - gamma * P @ P / 2)
        kl = gauss_kl(mu, sig_g, mu, P)
        infl_exact = 1.0 / (1.0 - gamma * lam_max / 2)
        infl_emp = top @ emp @ top * lam_max
        row = dict(r=r, gamma=gamma, rounds=rounds, kl=kl, infl_exact=infl_exact, infl_emp=infl_emp,
                   err_g=rel_fro(emp, sig_g), err_post=rel_fro(emp, post), exact_err=rel_fro(sig_g, post),
                   floor=fro_floor(sig_g, chains))
        rows.append(row)
        se = infl_exact * math.sqrt(2.0 / chains)
        print(f"{r:10.2f} {rounds:6d} {kl:9.2e} {kl / gamma**2:10.3g} {infl_exact:10.4f} "
              f"{infl_emp:7.4f}+-{se:.3f} {row['err_g']:11.3f} {row['err_post']:9.3f} "
              f"{row['exact_err']:10.3f} {row['floor']:8.3f}")
    print("    C: empirical covariance, Sg: (P - gamma P^2/2)^-1, S: P^-1 (the posterior); MC floor: the rms "
          "relative error of\n    a sample covariance of this many independent draws. C matches Sg at every "
          "step; it departs from S once\n    the exact gap |Sg - S| exceeds the floor.")
    return rows


def compression_study(data, P, mu, ratio, chains, draws, compressor_names):
    """(b) naive compressed LMC and D-/P-/B-ELF at gamma = ratio / lambda_max."""
    lam = np.linalg.eigvalsh(P)
    gamma = ratio / lam[-1]
    mix = math.ceil(1.0 / (gamma * lam[0]))  # rounds per e-fold of the slowest mode
    warmup = 12 * mix
    rounds = warmup + mix * draws
    post = np.linalg.inv(P)
    sd = np.sqrt(np.diag(post))
    C = fb.compress
    compressors = {"identity": C.identity(), "top_k(1)": C.top_k(1), "top_k(3)": C.top_k(3),
                   "natural(c=True)": C.natural(contractive=True)}
    compressors = {k: v for k, v in compressors.items() if k in compressor_names}
    samplers = {
        "naive LMC": lambda c, **kw: fb.LMC(compressor=c, **kw),
        "D-ELF": lambda c, **kw: fb.DELF(uplink=c, **kw),
        "P-ELF": lambda c, **kw: fb.PELF(downlink=c, **kw),
        "B-ELF": lambda c, **kw: fb.BELF(uplink=c, downlink=c, **kw),
    }
    kw = dict(step_size=gamma, num_chains=chains, warmup=warmup, thinning=mix)
    n_eff = chains * draws
    print(f"\n(b) bias of compression at gamma = {ratio} / lambda_max: {chains} chains x {draws} draws "
          f"(warm-up {warmup} rounds, thinning {mix})")
    print("    mean error: max_j |mean_j - mu_j| / sd_j (posterior sd); cov error: |C - S|_F / |S|_F; "
          "bits per round for one chain (all 10 clients)")
    sig_g = np.linalg.inv(P - gamma * P @ P / 2)
    kl_lmc, kl_floor = gauss_kl(mu, sig_g, mu, P), (D + D * (D + 1) / 2) / (2 * n_eff)
    print("    KL: KL(N(mean, C) || posterior) of the Gaussian fitted to the draws (mean and covariance together)")
    print(f"    exact LMC bias at this step: mean error 0, cov error {rel_fro(sig_g, post):.3f}, KL {kl_lmc:.4f}; "
          f"Monte Carlo floor: mean ~{2.5 / math.sqrt(n_eff):.3f}, cov {fro_floor(post, n_eff):.3f}, KL {kl_floor:.4f}")
    print(f"{'compressor':<16} {'sampler':<15} {'mean err':>8} {'cov err':>8} {'KL':>8} {'bits up':>8} {'bits down':>9} "
          f"{'up+down':>8}")
    rows = []
    for cname, comp in compressors.items():
        for sname, make in samplers.items():
            if cname == "identity" and sname != "naive LMC":
                continue  # with identity all four are LMC (tests/test_elf.py checks it to rounding)
            res = fb.fed_fit(gauss_model, data, make(comp, **kw), num_rounds=rounds, seed=1, chunk_size=rounds)
            x = res.global_samples["x"].reshape(-1, D)
            mean_err = float(np.max(np.abs(x.mean(0) - mu) / sd))
            cov_err = rel_fro(np.cov(x.T), post)
            kl = gauss_kl(x.mean(0), np.cov(x.T), mu, P)
            up = res.history["bits_up"][-1] / chains
            down = res.history["bits_down"][-1] / chains
            label = "all four (=LMC)" if cname == "identity" else sname
            rows.append(dict(compressor=cname, sampler=sname, kl=kl, bits=up + down))
            print(f"{cname:<16} {label:<15} {mean_err:8.3f} {cov_err:8.3f} {kl:8.4f} {up:8.0f} {down:9.0f} "
                  f"{up + down:8.0f}")
    notes = ["Naive LMC with top_k has no error feedback: the clients' compressed gradients do not sum to zero at",
             "mu, so its mean is off by whole standard deviations."]
    if "natural(c=True)" in compressors:
        notes += ["With natural(contractive=True) = natural / (9/8) its drift is shrunk by 8/9 on average, which",
                  "inflates its covariance by about 9/8."]
    notes += ["With error feedback the mean is right to Monte Carlo error for every compressor (top_k is odd and",
              "the target Gaussian); the covariance pays for a coarse compressor (top_k(1) keeps alpha = 1/10 of",
              "each message)."]
    if len(compressors) > 2:
        notes += ["The covariance is close to LMC's for top_k(3) and natural, which B-ELF delivers for a third",
                  "or less of LMC's bits."]
    print("\n".join("    " + line for line in notes))
    return rows, gamma, kl_lmc, kl_floor


def plot(step_rows, comp_rows, gamma_b, lam_max, kl_lmc, kl_floor) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = pathlib.Path(__file__).parent / "output"
    out.mkdir(exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    r = np.array([row["r"] for row in step_rows])
    ax1.loglog(r, [row["kl"] for row in step_rows], "o-", label="KL(N(mu, Sigma_gamma) || posterior), exact")
    ax1.loglog(r, [row["exact_err"] for row in step_rows], "s-", label="|Sigma_gamma - P^-1| / |P^-1|, exact")
    ax1.loglog(r, [row["err_post"] for row in step_rows], "x", ms=9, mew=2,
               label="|C_emp - P^-1| / |P^-1|, empirical")
    ax1.loglog(r, [row["err_g"] for row in step_rows], "+", ms=9, mew=2,
               label="|C_emp - Sigma_gamma| / |Sigma_gamma|, empirical")
    ax1.loglog(r, [row["floor"] for row in step_rows], "k:", label="Monte Carlo floor")
    ax1.set_xlabel("gamma * lambda_max")
    ax1.set_title("(a) LMC: bias against the step size")
    ax1.legend(fontsize=7)
    markers = {"naive LMC": "o", "D-ELF": "s", "P-ELF": "^", "B-ELF": "D"}
    colors = {"identity": "k", "top_k(1)": "C3", "top_k(3)": "C1", "natural(c=True)": "C0"}
    for row in comp_rows:
        ax2.scatter(row["bits"], row["kl"], marker=markers[row["sampler"]], color=colors[row["compressor"]],
                    s=50, alpha=0.85)
    ax2.axhline(kl_lmc + kl_floor, color="k", lw=0.8, label="LMC: exact KL + Monte Carlo floor")
    ax2.axhline(kl_floor, color="k", ls=":", label="Monte Carlo floor")
    for s, m in markers.items():
        ax2.scatter([], [], marker=m, color="gray", label=s)
    for c, col in colors.items():
        ax2.scatter([], [], marker="o", color=col, label=c)
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("bits per round for one chain (uplink + downlink)")
    ax2.set_ylabel("KL(Gaussian fit of the draws || posterior)")
    ax2.set_title(f"(b) compression at gamma = {gamma_b * lam_max:.2g} / lambda_max")
    ax2.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "elf_gaussian.png", dpi=100)
    print(f"\nfigure: {out / 'elf_gaussian.png'}")


def main(quick: bool) -> None:
    t0 = time.perf_counter()
    data, P, mu = gaussian_clients(seed=0)
    # Each fit compiles its own round (a few seconds on a CPU), which dominates these runs: --quick
    # runs fewer fits rather than shorter ones.
    if quick:
        ratios, chains_a, chains_b = [0.05, 0.3, 1.0], 2000, 400
        compressors = ["identity", "top_k(1)"]
    else:
        ratios, chains_a, chains_b = [0.02, 0.05, 0.1, 0.3, 1.0], 2000, 500
        compressors = ["identity", "top_k(1)", "top_k(3)", "natural(c=True)"]
    step_rows = step_study(data, P, mu, ratios, chains=chains_a)
    comp_rows, gamma_b, kl_lmc, kl_floor = compression_study(data, P, mu, ratio=0.1, chains=chains_b, draws=8,
                                           compressor_names=compressors)
    plot(step_rows, comp_rows, gamma_b, np.linalg.eigvalsh(P)[-1], kl_lmc, kl_floor)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer step sizes and compressors")
    main(parser.parse_args().quick)
