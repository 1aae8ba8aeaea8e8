"""fedbayes.chain_stats against ArviZ's own R-hat and ESS (the exact reference: the same definitions)."""

from __future__ import annotations

import numpy as np
import pytest

from fedbayes import chain_stats
from fedbayes.arviz_adapter import az, group, to_arviz


def _arviz(draws, **kw):
    """ArviZ's statistic of every element, through the installed line's own data structure (0.23's
    InferenceData, 1.x's DataTree)."""
    import xarray as xr

    data = to_arviz({"posterior": xr.Dataset({"x": (["chain", "draw", "x_dim_0"], draws)})})
    res = az.rhat(data) if not kw else az.ess(data, **kw)
    ds = res.to_dataset() if hasattr(res, "to_dataset") else res
    if "posterior" in getattr(ds, "groups", ()):
        ds = group(res, "posterior")
    return np.asarray(ds["x"].values, dtype=float)


def _ar1(rng, chains, draws, m, phi):
    x = np.zeros((chains, draws, m))
    x[:, 0] = rng.normal(size=(chains, m))
    for t in range(1, draws):
        x[:, t] = phi * x[:, t - 1] + np.sqrt(1 - phi**2) * rng.normal(size=(chains, m))
    return x


def _cases():
    rng = np.random.default_rng(0)
    yield "iid", rng.normal(size=(4, 100, 6))
    yield "ar1", _ar1(rng, 3, 101, 5, np.array([0.0, 0.5, 0.9, 0.99, -0.6]))  # odd draws, anticorrelated
    shifted = rng.normal(size=(4, 60, 3))
    shifted[0] += np.array([0.0, 1.0, 5.0])  # one chain apart: R-hat > 1
    yield "shifted", shifted
    yield "ties", rng.integers(0, 3, size=(2, 40, 4)).astype(float)  # discrete draws: tied ranks
    const = rng.normal(size=(2, 30, 3))
    const[..., 1] = 2.5  # a constant element: R-hat NaN, ESS = draws
    yield "constant", const
    yield "one_chain", rng.normal(size=(1, 50, 2))
    yield "short", rng.normal(size=(2, 7, 2))
    nan = rng.normal(size=(2, 20, 2))
    nan[1, 3, 0] = np.nan
    yield "nan", nan


@pytest.mark.parametrize("name,draws", list(_cases()), ids=[c[0] for c in _cases()])
def test_rhat_and_ess_equal_arviz(name, draws):
    ref_rhat, ref_bulk, ref_tail = _arviz(draws), _arviz(draws, method="bulk"), _arviz(draws, method="tail", prob=(0.05, 0.95))
    # the same arithmetic up to the order of floating-point sums. The tail's quantiles are given: ArviZ 1.x's
    # default is its credible-interval setting (0.94: the 6% and 94% quantiles), 0.23's and the paper's 5% / 95%
    np.testing.assert_allclose(chain_stats.rhat(draws), ref_rhat, rtol=1e-10, equal_nan=True)
    np.testing.assert_allclose(chain_stats.ess_bulk(draws), ref_bulk, rtol=1e-9, equal_nan=True)
    np.testing.assert_allclose(chain_stats.ess_tail(draws), ref_tail, rtol=1e-9, equal_nan=True)


def test_shapes_are_kept_and_a_scalar_is_a_float():
    rng = np.random.default_rng(1)
    draws = rng.normal(size=(2, 30, 3, 4))
    assert chain_stats.rhat(draws).shape == (3, 4) and chain_stats.ess_tail(draws).shape == (3, 4)
    assert isinstance(chain_stats.ess_bulk(draws[..., 0, 0]), float)
