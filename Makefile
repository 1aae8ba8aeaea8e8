# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
# Test files run on this many processes (module fixtures stay within one process: --dist loadfile).
TEST_WORKERS ?= 2
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fedbayes-installed

.PHONY: demo test test-slow test-heavy test-arviz1 lint typecheck dist-check docs bench fuzz clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev,plot,formula,flower,nn,privacy,docs]"
	@touch $(STAMP)

demo: $(STAMP)
	MPLBACKEND=Agg $(PY) examples/fedpop_synthetic.py --quick

# The longest test files are listed first so that the two processes finish together (pytest collects
# each file once; the rest of tests/ follows in name order).
SLOW_TESTS := tests/test_fedmm.py tests/test_flower.py tests/test_flower_app.py tests/test_fedsoul.py tests/test_expfam.py tests/test_elf.py tests/test_faults.py \
	tests/test_tamuna.py tests/test_fuzz.py

# The suite in three tiers (tests/tiers.py says which test is where, by measured duration):
# `make test` (under 10 minutes on 2 cores) runs every test not marked slow or heavy; `make test-slow`
# runs the heavier end-to-end and statistical checks marked slow; `make test-heavy` runs the third tier
# (Flower's Ray engine and `flwr run`, FedSOUL and FedMM on Flower, the real-data samplers, the LAPACK
# structure checks, the longest FedSOUL fault, save/load and run-immutability checks; tests/tiers.py lists
# them). .ci/run runs all three: every test in the repository (within its 60 minutes on 2 cores).
#
# Each tier runs through tests/run_tier.py: a worker that crashes (or a test that hangs past pytest-timeout's
# limit) ends the run at once, and if no test failed by itself the tests not yet passed run once more; the
# tier passes only if that rerun passes. The crash and the rerun are printed (see that file for why).
test: $(STAMP)
	MPLBACKEND=Agg $(PY) tests/run_tier.py -q -n $(TEST_WORKERS) --dist loadfile --durations=15 -m "not slow and not heavy" $(SLOW_TESTS) tests

test-slow: $(STAMP)
	MPLBACKEND=Agg $(PY) tests/run_tier.py -q -n $(TEST_WORKERS) --dist loadfile --durations=15 -m "slow and not heavy" $(SLOW_TESTS) tests

test-heavy: $(STAMP)
	FEDBAYES_TIER_TIMEOUT=7200 MPLBACKEND=Agg $(PY) tests/run_tier.py -q -n $(TEST_WORKERS) --dist loadfile --durations=10 -m heavy tests

# ruff's lint rules and formatting (pyproject.toml's [tool.ruff]) on the package.
lint: $(STAMP)
	$(VENV)/bin/ruff check fedbayes
	$(VENV)/bin/ruff format --check fedbayes

# mypy on the package (pyproject.toml's [tool.mypy]).
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# The sdist and the wheel, built from the source tree; the wheel installed alone in a fresh virtual environment
# (build/dist-venv), imported from there and used for one fit (tests/wheel_smoke.py, run outside the tree).
dist-check: $(STAMP)
	rm -rf build/dist build/dist-venv
	$(PY) -m build --sdist --wheel --outdir build/dist .
	$(PYTHON) -m venv build/dist-venv
	build/dist-venv/bin/python -m pip install --quiet --disable-pip-version-check build/dist/fedbayes-*.whl
	cd build && MPLBACKEND=Agg dist-venv/bin/python ../tests/wheel_smoke.py

# The documentation site into build/site: the examples gallery first (every example's short version, its
# output and figures: docs/gallery.py), then MkDocs with warnings as errors (mkdocs.yml: strict).
docs: $(STAMP)
	MPLBACKEND=Agg $(PY) docs/gallery.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The ArviZ 1.x line (DataTree) needs Python >= 3.12: run the ArviZ-facing tests there.
# Usage: make test-arviz1 PYTHON=python3.12
test-arviz1: .venv312/.fedbayes-installed
	MPLBACKEND=Agg .venv312/bin/python tests/run_tier.py -q -n $(TEST_WORKERS) --dist loadfile tests/test_result.py tests/test_diagnostics.py

.venv312/.fedbayes-installed: pyproject.toml
	@test -x .venv312/bin/python || $(PYTHON) -m venv .venv312
	.venv312/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev,plot]"
	@touch $@

# A longer random run of the fuzzing harness (tests/fuzz_harness.py): FUZZ_EXAMPLES examples per domain,
# the outcome counts (documented error / success / deep crash) printed at the end.
FUZZ_EXAMPLES ?= 300
fuzz: $(STAMP)
	FEDBAYES_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) MPLBACKEND=Agg $(PY) -m pytest -q -n $(TEST_WORKERS) tests/test_fuzz.py tests/test_fuzz_regressions.py

bench: $(STAMP)
	for b in fedsoul nn langevin joint fedmm tamuna flower faults privacy secagg; do $(PY) benchmarks/bench_$$b.py || exit 1; done

clean:
	rm -rf $(VENV) .venv312 build *.egg-info .pytest_cache
