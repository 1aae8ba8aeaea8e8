"""The calibration diagnostics' probability check allows the rounding of the input's float type, no more."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedbayes as fb
from fedbayes.diagnostics import calibration
from fedbayes.diagnostics.calibration import sum_tolerance

dg = fb.diagnostics


def test_the_tolerance_follows_the_float_type_and_the_number_of_classes():
    eps32 = float(np.finfo(np.float32).eps)
    assert sum_tolerance(np.float32, 2) == 64 * 2 * eps32  # 1.53e-5
    assert sum_tolerance(np.float32, 20) == 64 * 20 * eps32  # 1.53e-4
    assert sum_tolerance(np.float64, 2) == 1e-6 == sum_tolerance(np.float64, 1000)  # eps term 1.4e-11 < 1e-6
    assert sum_tolerance(np.int64, 3) == 1e-6 == sum_tolerance(bool, 3)  # one-hot rows: checked as float64


def test_the_readme_recipe_on_float32_draws_is_accepted():
    # posterior draws of softmax probabilities computed in float32, as res.predictive_probs gives them
    logits = jax.random.normal(jax.random.PRNGKey(0), (4000, 200, 10), jnp.float32) * 3
    draws = np.asarray(jax.nn.softmax(logits, axis=-1))
    probs = draws.mean(0)
    assert probs.dtype == np.float32
    miss = np.abs(probs.astype(np.float64).sum(1) - 1).max()
    assert miss > 1e-6  # what the former fixed tolerance refused ...
    assert miss < sum_tolerance(np.float32, 10)  # ... is float32 rounding
    y = np.asarray(jnp.argmax(probs, 1))
    assert 0 <= dg.expected_calibration_error(probs, y) < 1
    p64 = probs.astype(np.float64)
    assert dg.brier_score(probs, y) == np.mean(np.sum((p64 - np.eye(10)[y]) ** 2, 1))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_near_one_are_accepted_and_rows_clearly_off_are_refused(dtype):
    K = 4
    tol = sum_tolerance(dtype, K)
    base = np.full((3, K), 0.25)
    y = np.array([0, 1, 2])
    near = base.copy()
    near[:, 0] += 0.5 * tol  # within the allowance (float64 arithmetic, then cast)
    near = near.astype(dtype)
    p, labels = calibration._as_probs(near, y)
    np.testing.assert_array_equal(p, near.astype(np.float64))
    np.testing.assert_array_equal(labels, y)
    off = base.copy()
    off[:, 0] += 4 * tol
    with pytest.raises(fb.DataError, match=f"sum to 1 .*rounding in {np.dtype(dtype).name} explains for 4 classes"):
        dg.brier_score(off.astype(dtype), y)
    clearly = base.astype(dtype) * np.asarray(0.9, dtype)  # sums to 0.9
    with pytest.raises(fb.DataError, match="sum to 1"):
        dg.expected_calibration_error(clearly, y)
    above = base.copy()
    above[:, 0] = 1 + 4 * tol
    above[:, 1:] = 0
    with pytest.raises(fb.DataError, match=r"in \[0, 1\]"):
        dg.brier_score(above.astype(dtype), y)
