"""MkDocs hooks of the documentation site (``mkdocs.yml``: ``hooks``).

``on_post_build`` fails the build when a public name has no entry in the API reference
(:mod:`docs._ext.reference`), so a new public name cannot ship without its page.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

sys.path.insert(0, str(Path(__file__).parent))

import reference  # noqa: E402 - next to this file


def on_post_build(config: Any, **kwargs: Any) -> None:
    absent = reference.missing(Path(config["site_dir"]))
    if absent:
        raise PluginError(
            f"{len(absent)} public name(s) have no entry in the API reference (docs/api.md): "
            + ", ".join(absent)
        )
