"""A Griffe extension: the docstrings' Sphinx roles rendered as links of the API reference.

The package's docstrings cross-reference with Sphinx roles (``:class:`~fedbayes.Result```,
``:meth:`extend_idata```), which mkdocstrings prints as written. This extension rewrites each role, as
Griffe loads the package, into an optional autorefs link to the object's canonical path: a link where the
reference renders that object, plain code where it does not (an external name such as ``jax.jit``, or
a private helper). A leading ``~`` shows the last component only, as in Sphinx.
"""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any

import griffe

sys.path.insert(0, str(Path(__file__).parent))

from reference import resolve  # noqa: E402 - next to this file: the object at a dotted path of the package

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _canonical(path: str, obj: Any) -> str:
    if inspect.ismodule(obj):
        return obj.__name__
    if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "").startswith("fedbayes"):
        return f"{obj.__module__}.{obj.__qualname__}"
    return path


def _candidates(owner: griffe.Object, target: str) -> list[str]:
    target = target.lstrip(".")
    if target.startswith("fb."):
        target = "fedbayes." + target[3:]
    if target.startswith("fedbayes.") or target == "fedbayes":
        return [target]
    out = []
    here: Any = owner
    while here is not None:  # the owner, its class, its module, ..., the package
        if here.is_class or here.is_module:
            out.append(f"{here.path}.{target}")
        here = here.parent
    return out + [f"fedbayes.{target}"]


def rewrite(owner: griffe.Object, text: str) -> str:
    """``text`` with every role replaced by an optional autorefs link (or plain code)."""

    def one(match: re.Match) -> str:
        short, target = match.group(1), match.group(2).strip()
        label = target
        if "<" in target and target.endswith(">"):  # :class:`text <target>`
            label, target = target[: target.index("<")].strip(), target[target.index("<") + 1 : -1]
        elif short:
            label = target.split(".")[-1]
        label = label.removeprefix("fb.") if not short else label
        for path in _candidates(owner, target):
            obj = resolve(path)
            if obj is not None:
                ident = _canonical(path, obj)
                return f'<autoref identifier="{ident}" optional><code>{label}</code></autoref>'
        return f"`{label}`"

    return ROLE.sub(one, text)


class SphinxRoles(griffe.Extension):
    """Rewrite the roles of every docstring of the loaded package (:func:`rewrite`)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        seen: set[int] = set()

        def walk(obj: griffe.Object) -> None:
            if id(obj) in seen:
                return
            seen.add(id(obj))
            if obj.docstring is not None and ":" in obj.docstring.value:
                obj.docstring.value = rewrite(obj, obj.docstring.value)
            for member in obj.members.values():
                if not member.is_alias:
                    walk(member)  # type: ignore[arg-type]

        walk(pkg)
