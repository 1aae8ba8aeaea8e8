"""Clients laid over several devices (``fed_fit(..., devices=...)``) give the one-device fit.

The checks run in a child process with two CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=2``,
which must be set before JAX starts) and float64: ``tests/sharding_check.py`` fits each problem once on
one device and once with its clients split over both, and reports the largest differences.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import fedbayes as fb

HERE = Path(__file__).parent


def run_check(*which: str) -> dict[str, dict]:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, str(HERE / "sharding_check.py"), *which], env=env, cwd=HERE,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {row["name"]: row for row in rows}


def check_equal(row: dict) -> None:
    # The data, and the client states where an algorithm keeps any, were on both devices in the second fit.
    assert row["devices"][0][0] == 1 and row["devices"][1][0] == 2
    assert row["devices"][1][1] in (None, 2)
    # Identical ledgers: the same messages crossed the network.
    assert row["bits"] == [0, 0]
    # The only change is the order of the float64 sums over clients (per device, then across devices):
    # rounding of about 1e-16 relative per sum, carried through contracting iterations; measured
    # 1e-16 to 2e-12 relative. 1e-9 relative is far below any statistical difference and far above that.
    scale = max(1.0, row["scale"])
    for what in ("params", "draws", "locals"):
        if what in row:
            assert row[what] <= 1e-9 * scale, (row["name"], what, row[what])


def test_lmc_over_two_devices_is_the_one_device_fit():
    check_equal(run_check("lmc")["lmc"])


@pytest.mark.slow
def test_every_family_over_two_devices_is_the_one_device_fit():
    """FedSOUL (all clients, and a cohort with dropped uploads: gathers across devices), compressed B-ELF and
    FedMM."""
    rows = run_check("fedsoul", "fedsoul-cohort", "belf", "fedmm", "refusals")
    for name in ("fedsoul", "fedsoul-cohort", "belf", "fedmm"):
        check_equal(rows[name])
    refused = rows["refusals"]
    assert "21 clients cannot be split equally over 2 devices" in refused["explicit"]
    assert len(refused["default_warning"]) == 1 and refused["default_devices"] == [[1, None]]


@pytest.mark.parametrize("bad, match", [(len(jax.devices()) + 1, "give a number from 1"), (0, "give a number from 1"),
                                        ("gpu", "distinct jax devices"), ([], "non-empty sequence"),
                                        (3.5, "must be None, a number")])
def test_bad_devices_are_refused_before_any_computation(bad, match):
    data, _ = fb.models.make_glm_clients(4, 2, 10, family="logistic", seed=0)
    with pytest.raises(fb.ConfigError, match=match):
        fb.fed_fit(fb.models.logistic_regression(1.0), data, fb.LMC(), num_rounds=4, devices=bad, progress=False)
