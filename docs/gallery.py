"""The examples gallery: run every example script (short versions, ``--quick``), collect its figures into
``docs/gallery/`` and write ``docs/examples.md`` from the scripts' docstrings, their printed output and
the figures. ``make docs`` runs it before ``mkdocs build --strict``, so the gallery shows what the
scripts produce at this commit: an example that fails stops the build.

    python docs/gallery.py            # every example
    python docs/gallery.py --only tamuna_logistic
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import os
import pathlib
import shutil
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
OUTPUT = EXAMPLES / "output"
GALLERY = ROOT / "docs" / "gallery"
JOBS = 2

# (script, arguments, the figures it writes into examples/output/)
SCRIPTS = [
    ("fedpop_synthetic.py", ["--quick"], ["fedpop_synthetic.png"]),
    ("real_data_sleepstudy.py", ["--quick"], []),
    ("tamuna_logistic.py", ["--quick"], ["tamuna_logistic.png"]),
    ("elf_gaussian.py", ["--quick"], ["elf_gaussian.png"]),
    ("elf_logistic.py", ["--quick"], ["elf_logistic.png"]),
    ("fedmm_mixture.py", ["--quick"], ["fedmm_mixture.png"]),
    ("calibration_ood.py", ["--quick"], ["calibration_reliability.png", "calibration_entropy.png"]),
]


def _relative(text: str) -> str:
    """A script's output with this clone's absolute paths made relative to it (the page shows no machine's paths)."""
    return text.replace(str(ROOT) + os.sep, "").replace(str(ROOT), ".")


def _docstring(path: pathlib.Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def run(only: list[str] | None = None) -> None:
    GALLERY.mkdir(parents=True, exist_ok=True)
    page = ["# Examples", "",
            "Every script in `examples/` runs as `python examples/<name>.py` from a clone (after `make demo` or "
            "`make test` has installed the environment); `--quick` gives the short version. This page is built by "
            "`docs/gallery.py`, which ran each script's short version for this build: the figures and the "
            "printed output below are theirs.", ""]
    env = {**os.environ, "MPLBACKEND": "Agg"}
    chosen = [entry for entry in SCRIPTS if not only or entry[0][:-3] in only]
    for _, _, figures in chosen:
        for fig in figures:
            (OUTPUT / fig).unlink(missing_ok=True)

    def execute(entry):
        script, args, _ = entry
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=ROOT, env=env,
                              capture_output=True, text=True)
        return proc, time.perf_counter() - t0

    # two scripts at a time (CI has two cores; each script spends much of its time compiling, on one)
    with concurrent.futures.ThreadPoolExecutor(max_workers=JOBS) as pool:
        done = list(pool.map(execute, chosen))
    for (script, args, figures), (proc, seconds) in zip(chosen, done):
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout + proc.stderr)
            raise SystemExit(f"gallery: examples/{script} {' '.join(args)} failed (exit {proc.returncode})")
        doc = _docstring(EXAMPLES / script).split("\n")
        page += [f"## `{script}`", "", doc[0], "", *doc[1:], "",
                 f"Output of `python examples/{script} {' '.join(args)}` ({seconds:.0f} s on the machine that built "
                 "this page, beside another example):", "",
                 "```text", *_relative(proc.stdout).rstrip().split("\n")[-40:], "```", ""]
        for fig in figures:
            src = OUTPUT / fig
            if not src.exists():
                raise SystemExit(f"gallery: examples/{script} did not write {src}")
            shutil.copy(src, GALLERY / fig)
            page += [f"![{fig}](gallery/{fig})", ""]
        print(f"gallery: {script} {' '.join(args)}: {seconds:.0f} s, {len(figures)} figure(s)")
    (ROOT / "docs" / "examples.md").write_text("\n".join(page).rstrip() + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="example names (without .py) to run")
    run(parser.parse_args().only)
