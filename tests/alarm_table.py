"""The convergence checks' false and missed alarms, as two Markdown tables for ``docs/checks.md``.

Each row is a test of the suite that pins one case, so the table is the suite's own verdict:

* a **false-alarm** test fits with the defaults, checks the estimate against an independent reference
  (statsmodels, quadrature, NUTS, a closed form), and fails if the fit raised any ``fb.ConvergenceWarning``
  or reports ``converged=False``;
* a **missed-alarm** test under-runs a fit (or plants a fault) and fails unless the checks warn.

A passed row is "0 warnings" (false-alarm set) or "warned" (missed-alarm set). Every row runs whatever its
tier (``-m`` selects all of them).

    python tests/alarm_table.py            # about 10 minutes on 2 cores
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FALSE_ALARMS = [  # (test, the fit, its reference)
    ("tests/test_symmetry.py::test_the_demo_fit_equals_the_exact_mle_and_says_converged",
     "`make demo`: FedSOUL, FedPop's synthetic model (rotation symmetry declared)", "closed-form MLE"),
    ("tests/test_real_data.py::test_sleepstudy_fedsoul_defaults", "FedSOUL, sleepstudy (ms)", "statsmodels MixedLM"),
    ("tests/test_real_data.py::test_sleepstudy_fedmm_defaults", "FedMM, sleepstudy (ms)", "statsmodels MixedLM"),
    ("tests/test_real_data.py::test_contraception_logistic_glmm_fedsoul_defaults",
     "FedSOUL, Contraception logistic GLMM", "adaptive quadrature MLE"),
    ("tests/test_real_data.py::test_epil_poisson_glmm_fedsoul_defaults", "FedSOUL, epil Poisson GLMM",
     "adaptive quadrature MLE"),
    ("tests/test_real_data.py::test_contraception_logistic_samplers_defaults[lmc]", "LMC, Contraception",
     "NUTS, pooled data"),
    ("tests/test_real_data.py::test_contraception_logistic_samplers_defaults[d-elf]", "D-ELF, Contraception",
     "NUTS, pooled data"),
    ("tests/test_real_data.py::test_contraception_logistic_tamuna_defaults", "TAMUNA, Contraception",
     "Newton MAP"),
    ("tests/test_formula.py::test_sleepstudy_correlated_slopes_equal_statsmodels_and_the_fb_models_fit",
     "formula `Reaction ~ Days + (Days | Subject)`, FedMM", "statsmodels MixedLM"),
    ("tests/test_formula.py::test_oats_three_level_factor_equals_statsmodels", "formula, Oats (3-level factor)",
     "statsmodels MixedLM"),
    ("tests/test_formula.py::test_uncorrelated_slopes_equal_the_closed_form_mle", "formula `(Days || Subject)`",
     "exact marginal likelihood (BFGS)"),
    ("tests/test_formula.py::test_cbpp_binomial_with_trials_equals_quadrature", "formula, cbpp binomial, FedSOUL",
     "adaptive quadrature MLE"),
    ("tests/test_formula.py::test_orthodont_factor_and_correlated_slopes_equal_statsmodels",
     "formula, Orthodont (factor, correlated slopes)", "statsmodels MixedLM"),
    ("tests/test_docs.py::test_real_data_guide_runs_as_written", "real-data guide's first snippet",
     "lme4's estimates"),
]

MISSED_ALARMS = [  # (test, the fault)
    ("tests/test_convergence.py::test_gradient_descent_under_run_warns_and_converged_does_not", "GD, too few rounds"),
    ("tests/test_convergence.py::test_sampler_under_run_warns", "LMC, too few rounds"),
    ("tests/test_convergence.py::test_fedsoul_under_run_warns", "FedSOUL, too few rounds"),
    ("tests/test_convergence.py::test_fedmm_under_run_warns", "FedMM, too few rounds"),
    ("tests/test_convergence.py::test_local_rhat_limit_lets_well_mixed_clients_pass_and_catches_a_stuck_chain",
     "a client's chain stuck 0.5 sd away"),
    ("tests/test_convergence.py::test_a_private_fit_drowned_in_its_noise_reports_not_converged_and_says_why",
     "GD under DP noise 1e6"),
    ("tests/test_symmetry.py::test_an_under_run_fit_of_the_demo_warns_and_is_off_the_exact_mle",
     "the demo at 300 rounds"),
    ("tests/test_symmetry.py::test_a_false_declaration_fails_the_symmetry_row", "a false fb.Symmetry declaration"),
]


def outcomes(tests: list[str]) -> dict[str, str]:
    """``{test id: "passed" | "failed" | "skipped" | "not run"}`` from one pytest run of every tier."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", os.environ.get("WORKERS", "2"),
               "-m", "slow or heavy or not slow", f"--junitxml={report}", *tests]
        # pytest's own report goes to stderr: stdout is the tables
        subprocess.run(cmd, cwd=ROOT, env={**os.environ, "MPLBACKEND": "Agg"}, check=False, stdout=sys.stderr)
        found: dict[str, str] = {}
        for case in ET.parse(report).getroot().iter("testcase"):
            module = case.get("classname", "").replace(".", "/") + ".py"
            state = "passed"
            if case.find("failure") is not None or case.find("error") is not None:
                state = "failed"
            elif case.find("skipped") is not None:
                state = "skipped"
            found[f"{module}::{case.get('name')}"] = state
    return {t: found.get(t, "not run") for t in tests}


def main() -> None:
    got = outcomes([t for t, *_ in FALSE_ALARMS] + [t for t, _ in MISSED_ALARMS])
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    print(f"{stamp}, {platform.machine()}, {os.cpu_count()} CPU cores, Python {platform.python_version()}\n")
    print("| fit (defaults) | reference | matches it, warnings raised |\n|---|---|---|")
    for test, what, ref in FALSE_ALARMS:
        print(f"| {what} | {ref} | {'yes, 0' if got[test] == 'passed' else got[test].upper()} |")
    quiet = sum(got[t] == "passed" for t, *_ in FALSE_ALARMS)
    print(f"\nFalse alarms: {len(FALSE_ALARMS) - quiet} of {len(FALSE_ALARMS)} fits that match their references.\n")
    print("| fault | warned |\n|---|---|")
    for test, what in MISSED_ALARMS:
        print(f"| {what} | {'yes' if got[test] == 'passed' else got[test].upper()} |")
    warned = sum(got[t] == "passed" for t, _ in MISSED_ALARMS)
    print(f"\nMissed alarms: {len(MISSED_ALARMS) - warned} of {len(MISSED_ALARMS)} faults.")


if __name__ == "__main__":
    main()
