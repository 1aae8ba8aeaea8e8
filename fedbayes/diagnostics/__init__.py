"""Uncertainty diagnostics for federated fits: calibration, OOD, posterior quality, communication.

``calibration``: ECE / MCE / classwise ECE, reliability and PAV curves, Brier, NLPD, coverage, PIT.
``ood``: entropy-based scores, AUROC, a fit's OOD report and a new client's novelty.
``posterior``: distances to a reference posterior, ``compare_to_reference``, per-client PSIS-LOO.
``communication``: error against rounds and bits for several fits. ``plots``: matplotlib figures
of all of them (imported on first use of a plot).

The functions take plain arrays (or a ``fed_fit`` result where they say so), so they also work on
predictions from anywhere else.
"""

from .calibration import (
    accuracy_vs_confidence,
    brier_score,
    classwise_ece,
    expected_calibration_error,
    interval_coverage,
    maximum_calibration_error,
    negative_log_predictive_density,
    pav,
    pav_reliability,
    pit,
    reliability,
    reliability_diagram,
)
from .communication import communication_table, communication_to_reach
from .ood import (
    client_novelty,
    expected_entropy,
    max_probability,
    mutual_information,
    novelty_score,
    ood_auroc,
    ood_report,
    ood_scores,
    predictive_entropy,
)
from .posterior import (
    compare_to_reference,
    gaussian_fit,
    gaussian_kl,
    gaussian_w2,
    loo_per_client,
    mmd,
    moment_errors,
    sliced_wasserstein,
)

_PLOTS = (
    "plot_fit",
    "plot_reliability",
    "plot_score_histograms",
    "plot_pit",
    "plot_communication",
    "plot_arviz_pit",
    "plot_arviz_pava",
)


def __getattr__(name: str):
    if name in _PLOTS:  # matplotlib is optional: import the plots on first use
        from . import plots

        return getattr(plots, name)
    raise AttributeError(f"module 'fedbayes.diagnostics' has no attribute '{name}'")


__all__ = [
    "reliability",
    "reliability_diagram",
    "expected_calibration_error",
    "maximum_calibration_error",
    "classwise_ece",
    "brier_score",
    "negative_log_predictive_density",
    "accuracy_vs_confidence",
    "pav",
    "pav_reliability",
    "interval_coverage",
    "pit",
    "predictive_entropy",
    "expected_entropy",
    "mutual_information",
    "max_probability",
    "ood_auroc",
    "ood_scores",
    "ood_report",
    "novelty_score",
    "client_novelty",
    "gaussian_w2",
    "gaussian_kl",
    "gaussian_fit",
    "mmd",
    "sliced_wasserstein",
    "moment_errors",
    "compare_to_reference",
    "loo_per_client",
    "communication_table",
    "communication_to_reach",
    *_PLOTS,
]
