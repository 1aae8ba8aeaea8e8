"""Two FedSOUL fits of FedPop's synthetic model, each compiled from nothing, for the tests of how a fit is
compiled (``tests/test_prng.py``, ``tests/test_compile_ahead.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import fedbayes as fb


def fedsoul_twice(num_clients: int, num_rounds: int, between: Callable[[Any], None]) -> tuple[Any, Any]:
    """Two identical fits, each from a build of its own (nothing compiled before); ``between(first)`` runs
    between them (to check the first, and to change how the second compiles)."""
    data, _, _ = fb.models.make_fedpop_synthetic(num_clients, test_size=1, seed=0)
    algo = fb.FedSOUL(local_steps=3, num_samples=20, warmup=10)

    def fit():
        fb.clear_cache()
        return fb.fed_fit(fb.models.fedpop_synthetic, data, algo, num_rounds=num_rounds, seed=3, progress=False)

    first = fit()
    between(first)
    return first, fit()


def paired_outputs(a: Any, b: Any) -> list[tuple[Any, Any]]:
    """(a's, b's) estimate of each parameter, draws of each local posterior, and observed information."""
    pairs = [(a.params[n], b.params[n]) for n in a.params]
    pairs += [(v, b.local_samples[n]) for n, v in a.local_samples.items()]
    return pairs + [(a.information, b.information)]
