"""Several processes importing fedbayes at the same instant on a machine that never imported ArviZ.

ArviZ 0.23 writes a once-a-day stamp through a temporary file of a fixed name and a rename; two
processes importing it at once race on that file. The window is microseconds wide, so the tests
widen it (``Path.replace`` sleeps 1 s in every process: at 0.3 s the control once missed the race, its
processes reaching the rename more than 0.3 s apart on a busy machine) and start the processes together with a
file barrier: plain ``import arviz`` then fails (the control, showing the race is real), while
``import fedbayes`` must succeed every time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

arviz = pytest.importorskip("arviz")
pytestmark = pytest.mark.skipif(int(arviz.__version__.split(".")[0]) >= 1,
                                reason="the daily stamp race is specific to the ArviZ 0.x line")

PROCESSES = 4


def _script(statement: str, barrier: str, widen: bool) -> str:
    return textwrap.dedent(f"""
        import os, pathlib, time
        import matplotlib, xarray, jax, numpyro  # the slow imports happen before the barrier
        if {widen}:
            _replace = pathlib.Path.replace
            def _slow(self, target):
                time.sleep(1.0)
                return _replace(self, target)
            pathlib.Path.replace = _slow
        open(os.path.join({barrier!r}, str(os.getpid())), "w").close()
        deadline = time.time() + 120
        while len(os.listdir({barrier!r})) < {PROCESSES} and time.time() < deadline:
            time.sleep(0.001)
        {statement}
    """)


def _run_at_once(tmp_path, statement: str, widen: bool) -> list[subprocess.CompletedProcess]:
    home = tmp_path / "home"
    barrier = tmp_path / "barrier"
    home.mkdir()
    barrier.mkdir()
    env = {**os.environ, "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"), "MPLBACKEND": "Agg",
           "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", _script(statement, str(barrier), widen)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(PROCESSES)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


def test_plain_arviz_import_races_when_the_window_is_widened(tmp_path):
    """The control: without fedbayes' lock, simultaneous first imports fail."""
    runs = _run_at_once(tmp_path, "import arviz", widen=True)
    failed = [r for r in runs if r.returncode != 0]
    assert failed, "the widened race should make plain ArviZ imports fail"
    assert all("daily_warning" in r.stderr for r in failed)


@pytest.mark.parametrize("widen", [False, True, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["plain", "widened-1", "widened-2"])
def test_simultaneous_first_imports_of_fedbayes_all_succeed(tmp_path, widen):
    runs = _run_at_once(tmp_path, "import fedbayes; print(fedbayes.__version__)", widen=widen)
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.strip() == __import__("fedbayes").__version__
    assert (tmp_path / "home" / ".cache" / "arviz" / "daily_warning").exists()
