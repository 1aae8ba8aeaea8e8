"""Every ``>>>`` example in the package's docstrings runs and prints what it shows (doctest, as a user would
paste it: each example imports what it uses)."""

import doctest
import importlib
import pkgutil
import warnings

import pytest

import fedbayes as fb


def _modules() -> list[str]:
    names = ["fedbayes"] + [m.name for m in pkgutil.walk_packages(fb.__path__, "fedbayes.")]
    return [n for n in names if not n.rsplit(".", 1)[-1].startswith("__")]


def _examples(name: str) -> list[doctest.DocTest]:
    module = importlib.import_module(name)
    tests = doctest.DocTestFinder(exclude_empty=True).find(module, name)
    # a name re-exported from another module is that module's example: counted once, where it is defined
    return [t for t in tests if t.examples and t.filename == getattr(module, "__file__", None)]


WITH_EXAMPLES = [n for n in _modules() if _examples(n)]
# modules whose examples fit real data (fedbayes.result: two FedMM fits on sleepstudy, 20 s on 2 cores): second tier
FITTING = {"fedbayes.result"}


def test_the_package_has_examples_to_run():
    assert len(WITH_EXAMPLES) >= 4, WITH_EXAMPLES


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in FITTING else n for n in WITH_EXAMPLES])
def test_docstring_examples_run(name, capsys):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an example's short fit may warn; the output is what is checked
        for test in _examples(name):
            runner.run(test)
    out = capsys.readouterr().out
    assert runner.summarize(verbose=False).failed == 0, out
