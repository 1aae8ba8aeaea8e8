"""Test configuration: float64 everywhere (exactness tests compare against closed forms), and, on
request, one compilation cache shared by the fits of a test run.

JAX's persistent compilation cache is off by default. With it on, a worker process died with "Fatal
Python error: Aborted" in about half of the full runs of 2026-11-27 (jax 0.10.2), in a different test each
time (tests/run_tier.py tells the story), two of the aborts inside XLA:CPU's serialisation of an executable
for the cache (``jax._src.compilation_cache.put_executable_and_time``). Turning the cache off removes that
site, for about 45 s more in the first tier; it does not stop the crashes: the first full run without it
had two segmentation faults inside XLA's compilation itself, and tests/run_tier.py's rerun is what keeps
the suite's result.

``FEDBAYES_TEST_XLA_CACHE=on`` switches it on: every ``fed_fit`` builds and compiles its own round program;
fits of the same model, data shapes and options compile to the same program, so the cache (in a temporary
directory removed at exit) lets later fits load it instead of compiling again. Results are unchanged: the
cache keys on the whole compiled program. Under pytest-xdist the first process to load this file (the
controller) makes the directory and hands it to its workers through the environment, so a program
compiled by one worker is loaded by the other. Two processes writing one directory need JAX's locked
(LRU) cache, which needs ``filelock``; without it each process keeps its own directory.
"""

import atexit
import importlib.util
import os
import sys
import shutil
import tempfile

import jax
import pytest

jax.config.update("jax_enable_x64", True)

_ENV = "FEDBAYES_TEST_XLA_CACHE"  # unset or "off": no persistent cache; "on": one for the run; a path: that one
_shared = importlib.util.find_spec("filelock") is not None
_asked = os.environ.get(_ENV, "off")
_off = _asked == "off"
_cache = _asked if _shared and _asked not in ("on", "off") else None
if not _off:
    if _cache is None:
        _cache = tempfile.mkdtemp(prefix="fedbayes-xla-cache-")
        atexit.register(shutil.rmtree, _cache, ignore_errors=True)  # only its maker removes it
        if _shared:
            os.environ[_ENV] = _cache
    if _shared:  # a size limit turns on JAX's file lock (8 GiB: never reached by this suite)
        jax.config.update("jax_compilation_cache_max_size", 8 << 30)
    jax.config.update("jax_compilation_cache_dir", _cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# The fuzzing harness (tests/fuzz_harness.py) records its outcomes per process in one folder; the
# controller prints their sum at the end of the run.
_FUZZ_ENV = "FEDBAYES_FUZZ_REPORT_DIR"
if _FUZZ_ENV not in os.environ:
    os.environ[_FUZZ_ENV] = tempfile.mkdtemp(prefix="fedbayes-fuzz-")
    atexit.register(shutil.rmtree, os.environ[_FUZZ_ENV], ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    """The fuzzing harness' counts of the test just run reach the report folder (it writes at most twice a
    second on its own): after the test's fixtures are torn down (a test may patch ``os.replace``, e.g. to
    simulate a full disk), and only if the test counted anything."""
    yield
    harness = sys.modules.get("fuzz_harness")
    if harness is not None:
        harness.save_if_changed()


def pytest_terminal_summary(terminalreporter):
    import fuzz_harness

    lines = fuzz_harness.report(os.environ[_FUZZ_ENV])
    if lines:
        terminalreporter.section("fuzzing harness: outcome of every fuzzed call")
        for line in lines:
            terminalreporter.line(line)
    # the real federation's evidence (TLS, the refused nodes, the killed and resumed runs) in CI's log, passed or
    # not: its "[deploy]" lines, from each test's captured output (xdist carries it back from the workers)
    deploy = [
        line
        for outcome in ("passed", "failed")
        for report in terminalreporter.stats.get(outcome, [])
        if "test_deploy.py" in report.nodeid and report.when == "call"
        for _, content in report.sections
        for line in content.splitlines()
        if line.startswith("[deploy]")
    ]
    if deploy:
        terminalreporter.section("the real federation (tests/test_deploy.py)")
        for line in dict.fromkeys(deploy):  # the module fixture's lines come with each of its tests
            terminalreporter.line(line)


def pytest_collection_modifyitems(config, items):
    """The tiers of tests/tiers.py: listed tests get the ``slow`` or ``heavy`` marker (a ``heavy`` test
    is run by ``make test-heavy`` only, whatever its module marks)."""
    import pytest
    import tiers

    skip = os.environ.get(_SKIP_ENV)
    if skip:  # tests/run_tier.py's rerun: leave out the tests that passed or skipped in the first attempt
        with open(skip) as f:
            done = set(f.read().split("\n"))
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
        items[:] = [item for item in items if item.nodeid not in done]
    root = config.rootpath
    for item in items:
        path = item.path.relative_to(root).as_posix()
        name = getattr(item, "originalname", None) or item.name.split("[")[0]
        which = tiers.tier(path, name, item.name)
        if which is not None:
            item.add_marker(getattr(pytest.mark, which))


# Outcomes for tests/run_tier.py (the tiers' runner): the controller process records which tests passed or
# skipped, which failed and which crashed their worker (pytest-xdist's crash hook), each as node ids, one file
# per kind, in the folder the runner names; a rerun deselects the tests listed in the runner's skip file.
_OUTCOMES_ENV = "FEDBAYES_TEST_OUTCOMES"
_SKIP_ENV = "FEDBAYES_TEST_SKIP"
_config = None


def pytest_configure(config):
    global _config
    _config = config


def _record(kind, nodeid):
    folder = os.environ.get(_OUTCOMES_ENV)
    if folder and _config is not None and not hasattr(_config, "workerinput"):  # the controller only
        with open(os.path.join(folder, kind), "a") as f:
            f.write(nodeid + "\n")


def pytest_runtest_logreport(report):
    if report.failed:
        if report.when != "???":  # xdist's report of a crashed test; recorded by pytest_handlecrashitem
            _record("failed", report.nodeid)
    elif report.when == "call" or report.skipped:
        _record("done", report.nodeid)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent when xdist is not loaded (-p no:xdist)
def pytest_handlecrashitem(crashitem, report, sched):
    _record("crashed", crashitem)
