"""The API reference's completeness: every public name has an entry on the built site.

The public names are those of ``fedbayes.__all__`` and of the public subpackages' and modules'
``__all__`` (or, without one, their documented top-level names). An entry is an anchor that
mkdocstrings rendered (``id="fedbayes.X"``) for the name itself or for the same object under another
path (``fedbayes.Result`` for ``fedbayes.result.Result``). ``make docs`` fails through the MkDocs hook in
``docs/_ext/hooks.py``; ``tests/test_docs.py`` checks a fresh build.
"""

from __future__ import annotations

import importlib
import inspect
import re
import types
from pathlib import Path
from typing import Any

SUBMODULES = ("flower", "models", "diagnostics", "privacy", "compress")
"""The modules whose public names must each have an entry, beside ``fedbayes.__all__``."""


def public_names(module: types.ModuleType) -> list[str]:
    """``module.__all__``, or its top-level classes and functions defined in it (not imported)."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    own = []
    for name, value in vars(module).items():
        if name.startswith("_") or not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        if getattr(value, "__module__", None) == module.__name__:
            own.append(name)
    return own


def required() -> dict[str, Any]:
    """``{dotted name: object}`` of every public name the reference must have."""
    import fedbayes

    out = {f"fedbayes.{n}": getattr(fedbayes, n) for n in fedbayes.__all__}
    for sub in SUBMODULES:
        module = importlib.import_module(f"fedbayes.{sub}")
        for n in public_names(module):
            try:
                out[f"fedbayes.{sub}.{n}"] = getattr(module, n)
            except ImportError:  # a lazy name whose extra is not installed (fb.flower without flwr)
                out[f"fedbayes.{sub}.{n}"] = LAZY
    return out


LAZY = object()
"""Stands for a public name that cannot be imported here: any anchor of that name under its module counts."""


def resolve(path: str) -> Any:
    """The object at a dotted path of the fedbayes package, or None."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
            for p in parts[i:]:
                obj = getattr(obj, p)
        except (ImportError, AttributeError):
            continue
        return obj
    return None


def anchors(site: Path) -> set[str]:
    """The ``fedbayes.*`` anchors of every page of a built site."""
    found: set[str] = set()
    for page in site.rglob("*.html"):
        found.update(re.findall(r'id="(fedbayes(?:\.[A-Za-z_][A-Za-z0-9_]*)*)"', page.read_text(encoding="utf-8")))
    return found


def missing(site: Path) -> list[str]:
    """The public names without an entry on the built ``site``: an anchor of the same name that holds the
    same object (``fedbayes.Result`` and ``fedbayes.result.Result``; a Flower name of the private module
    that defines it)."""
    have = anchors(site)
    by_name: dict[str, list[str]] = {}
    for a in have:
        by_name.setdefault(a.rsplit(".", 1)[-1], []).append(a)
    absent = []
    for name, obj in required().items():
        if name in have:
            continue
        module, last = name.rsplit(".", 1)
        if obj is LAZY and any(a.startswith(module + ".") for a in by_name.get(last, [])):
            continue
        if obj is not LAZY and any(resolve(a) is obj for a in by_name.get(last, [])):
            continue
        absent.append(name)
    return sorted(absent)
