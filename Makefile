# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
# Test files run on this many processes (module fixtures stay within one process: --dist loadfile).
TEST_WORKERS ?= 2
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fedbayes-installed

.PHONY: demo test test-arviz1 bench clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev,plot,flower]"
	@touch $(STAMP)

demo: $(STAMP)
	MPLBACKEND=Agg $(PY) examples/fedpop_synthetic.py --quick

# The longest test files are listed first so that the two processes finish together (pytest collects
# each file once; the rest of tests/ follows in name order).
SLOW_TESTS := tests/test_fedmm.py tests/test_flower.py tests/test_flower_app.py tests/test_fedsoul.py tests/test_expfam.py tests/test_elf.py tests/test_faults.py \
	tests/test_tamuna.py

test: $(STAMP)
	MPLBACKEND=Agg $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 $(SLOW_TESTS) tests

# The ArviZ 1.x line (DataTree) needs Python >= 3.12: run the ArviZ-facing tests there.
# Usage: make test-arviz1 PYTHON=python3.12
test-arviz1: .venv312/.fedbayes-installed
	MPLBACKEND=Agg .venv312/bin/python -m pytest -q tests/test_result.py tests/test_diagnostics.py

.venv312/.fedbayes-installed: pyproject.toml
	@test -x .venv312/bin/python || $(PYTHON) -m venv .venv312
	.venv312/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev,plot]"
	@touch $@

bench: $(STAMP)
	for b in fedsoul langevin fedmm tamuna flower; do $(PY) benchmarks/bench_$$b.py || exit 1; done

clean:
	rm -rf $(VENV) .venv312 build *.egg-info .pytest_cache
