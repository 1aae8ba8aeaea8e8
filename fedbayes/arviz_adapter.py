"""The one adapter between fedbayes and ArviZ's two lines.

ArviZ 0.x (Python 3.11 here) keeps a fit in ``az.InferenceData``; ArviZ 1.x (Python >= 3.12) in an
``xarray.DataTree``. Everything fedbayes builds is a mapping of named ``xarray.Dataset`` groups, and
only the functions of this module know which container and which ``loo`` output the installed ArviZ
has, so no other module branches on the version.
"""

from __future__ import annotations

import warnings
from typing import Any
from collections.abc import Mapping

import numpy as np
import xarray as xr

from ._arviz_import import import_arviz

az = import_arviz()

ARVIZ_1 = int(az.__version__.split(".")[0]) >= 1
"""True on the ArviZ 1.x line (``xarray.DataTree``), False on 0.x (``InferenceData``)."""


def to_arviz(groups: Mapping[str, xr.Dataset | None]) -> Any:
    """The one adapter between fedbayes and ArviZ: named xarray groups -> InferenceData or DataTree (groups
    that are None are left out)."""
    present = {k: v for k, v in groups.items() if v is not None}
    if ARVIZ_1:
        return xr.DataTree.from_dict(present)
    return az.InferenceData(**present, warn_on_custom_groups=False)


def group(data: Any, name: str) -> xr.Dataset:
    """Group ``name`` of ArviZ data as an xarray Dataset, on either ArviZ line."""
    node = data[name]
    return node.to_dataset() if hasattr(node, "to_dataset") else node


def group_names(data: Any) -> list[str]:
    """The names of the groups of ArviZ data (``InferenceData.groups()`` or a DataTree's children)."""
    if ARVIZ_1:
        return list(data.children)
    return list(data.groups())


def loo_summary(data: Any) -> dict[str, float]:
    """``az.loo`` of ArviZ data on either line: elpd_loo, se, p_loo and the largest Pareto k."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ArviZ warns on large Pareto k: it is reported in the row instead
        out = az.loo(data, pointwise=True)
    if ARVIZ_1:
        return {
            "elpd_loo": float(out.elpd),
            "se": float(out.se),
            "p_loo": float(out.p),
            "max_pareto_k": float(np.max(np.asarray(out.pareto_k))),
        }
    return {
        "elpd_loo": float(out["elpd_loo"]),
        "se": float(out["se"]),
        "p_loo": float(out["p_loo"]),
        "max_pareto_k": float(np.max(np.asarray(out["pareto_k"]))),
    }


def site_dims(name: str, shape: tuple[int, ...]) -> list[str]:
    """ArviZ's default dimension names of a site's event shape: ``<name>_dim_0``, ``<name>_dim_1``, ..."""
    return [f"{name}_dim_{i}" for i in range(len(shape))]
