"""Helpers shared by the benchmark scripts: one configuration per fresh process, and the machine line."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time


def run_child(script: str, *args) -> dict:
    """Run ``script --child args...`` in a fresh Python process; its last stdout line, parsed as JSON."""
    limit = float(os.environ.get("BENCH_CHILD_TIMEOUT", "0")) or None  # seconds per child; none by default
    out = subprocess.run([sys.executable, script, "--child", *map(str, args)], capture_output=True, text=True,
                         check=True, timeout=limit)
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine_line() -> str:
    """``# date, machine, device, jax version, cores``: the first line of every table."""
    import jax

    return (f"# {time.strftime('%Y-%m-%d')}, {platform.machine()}, {jax.devices()[0].device_kind}, "
            f"jax {jax.__version__}, {os.cpu_count()} cores")
