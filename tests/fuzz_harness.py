"""The fuzzing harness: every fuzzed call ends in a documented error, a success, or a deep crash.

A *documented error* is an ``fb.FedbayesError`` (its message says what to fix); a *success* returns
and passes the caller's checks; anything else is a *deep crash* (an exception from inside NumPy,
JAX or NumPyro) and fails the test. :func:`classify` records each outcome; the counts of all test
processes are gathered in a folder named by ``FEDBAYES_FUZZ_REPORT_DIR`` (set by ``conftest.py``)
and printed at the end of the run.

The suite runs a small, fixed (derandomized) sample of each domain. ``make fuzz`` sets
``FEDBAYES_FUZZ_EXAMPLES`` for a longer random run: every domain then draws that many examples.
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any, Callable

from hypothesis import HealthCheck, settings

import fedbayes as fb

EXAMPLES = int(os.environ.get("FEDBAYES_FUZZ_EXAMPLES", "0") or 0)
REPORT_ENV = "FEDBAYES_FUZZ_REPORT_DIR"
OUTCOMES: collections.Counter = collections.Counter()


def fuzz_settings(examples_in_suite: int) -> settings:
    """Hypothesis settings: a fixed sample in the suite, ``FEDBAYES_FUZZ_EXAMPLES`` random ones in ``make fuzz``."""
    return settings(max_examples=EXAMPLES or examples_in_suite, deadline=None, derandomize=not EXAMPLES,
                    database=None, suppress_health_check=list(HealthCheck), print_blob=True)


_SAVED_AT = [0.0]


def _record(domain: str, outcome: str) -> None:
    """Count one outcome; written to the report folder at most twice a second (and by :func:`save_if_changed`
    after each test's teardown, conftest.py), as the option-type scan makes some 12 000 calls in one test."""
    OUTCOMES[(domain, outcome)] += 1
    if time.monotonic() - _SAVED_AT[0] > 0.5:
        save()


_SAVED_COUNTS: collections.Counter = collections.Counter()


def save_if_changed() -> None:
    """:func:`save` if anything was counted since the last save."""
    if OUTCOMES != _SAVED_COUNTS:
        save()


def save() -> None:
    """Write this process' counts to the report folder (replacing its previous file)."""
    _SAVED_AT[0] = time.monotonic()
    _SAVED_COUNTS.clear()
    _SAVED_COUNTS.update(OUTCOMES)
    folder = os.environ.get(REPORT_ENV)
    if folder and os.path.isdir(folder):
        rows = [[d, o, n] for (d, o), n in OUTCOMES.items()]
        path = os.path.join(folder, f"{os.getpid()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(rows, f)
        os.replace(path + ".tmp", path)


def classify(domain: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """Call ``fn``; return ``("error", err)`` or ``("success", value)``, or fail on a deep crash."""
    try:
        value = fn(*args, **kwargs)
    except fb.FedbayesError as err:
        _record(domain, "documented error")
        return "error", err
    except Exception as err:  # noqa: BLE001 - this is what the harness is for
        _record(domain, "deep crash")
        save()
        raise AssertionError(f"deep crash in {domain}: {type(err).__name__}: {err}") from err
    _record(domain, "success")
    return "success", value


def report(folder: str) -> list[str]:
    """The summary table of every process' counts in ``folder`` (lines to print)."""
    total: collections.Counter = collections.Counter()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                for domain, outcome, n in json.load(f):
                    total[(domain, outcome)] += n
    if not total:
        return []
    outcomes = ("documented error", "success", "deep crash")
    lines = [f"{'domain':<18}" + "".join(f"{o:>18}" for o in outcomes)]
    for domain in sorted({d for d, _ in total}):
        lines.append(f"{domain:<18}" + "".join(f"{total[(domain, o)]:>18}" for o in outcomes))
    return lines
