"""Tests of fedbayes.compress: Monte Carlo unbiasedness, variance and contraction, exact bit
counts, validation.

Monte Carlo tolerances: with N = 20000 independent draws, a sample mean lies within Z = 5 of its
standard errors (empirical std / sqrt(N)) of its expectation except with probability about 6e-7
(normal approximation by the CLT); seeds are fixed, so the tests are deterministic. Draws of all
compressors on one vector come from a single jitted vmap with the same N keys for every compressor
and are shared between tests, because compiling the vmapped PRNG dominates the runtime; equal keys
also let a test compare two compressors draw by draw (rand_k against rand_k_unscaled, a scaled
compressor against its unbiased base).
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import fedbayes.compress as fb_compress
from fedbayes import prng
from fedbayes.compress import (
    Compressor,
    compress_tree,
    identity,
    natural,
    qsgd,
    rand_k,
    rand_k_unscaled,
    require_contractive,
    require_unbiased,
    scale_to_contractive,
    top_k,
)
from fedbayes.errors import ConfigError

N = 20_000
Z = 5.0
UNBIASED = (
    identity(),
    rand_k(1),
    rand_k(3),
    rand_k(fraction=0.5),
    rand_k(fraction=1.0),
    qsgd(1),
    qsgd(4),
    qsgd(16),
    natural(),
)
RAND_K = UNBIASED[1:5]
QSGD = UNBIASED[5:8]
CONTRACTIVE = (
    top_k(1),
    top_k(3),
    top_k(fraction=0.5),
    rand_k_unscaled(3),
    rand_k_unscaled(fraction=0.5),
    natural(contractive=True),
    qsgd(4, contractive=True),
)
TOP_K = CONTRACTIVE[:3]
UNSCALED = CONTRACTIVE[3:5]
ALL = UNBIASED + CONTRACTIVE


def _float_bits(c: Compressor) -> int:
    return getattr(getattr(c, "base", c), "float_bits", 32)


def _vector(d: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(d).normal(size=d))


@functools.cache
def _draws(d: int) -> dict[Compressor, tuple[np.ndarray, np.ndarray]]:
    """N draws of (C(x), bits) for every c in ALL on x = _vector(d), in one compilation."""
    run = jax.jit(lambda keys, x: [jax.vmap(c, in_axes=(0, None))(keys, x) for c in ALL])
    draws = run(jax.random.split(jax.random.key(d), N), _vector(d))
    return {c: (np.asarray(x_hat), np.asarray(bits)) for c, (x_hat, bits) in zip(ALL, draws)}


def _mean_se(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return samples.mean(0), samples.std(0, ddof=1) / math.sqrt(samples.shape[0])


def _sq_err(x_hat: np.ndarray, x: jax.Array) -> tuple[float, float]:
    """Sample mean of ||C(x) - x||^2 and its standard error."""
    return _mean_se(np.sum((x_hat - np.asarray(x)) ** 2, axis=1))


def _qsgd_variance(x: np.ndarray, s: int) -> float:
    """Exact E||Q(x) - x||^2 = (||x|| / s)^2 sum_j p_j (1 - p_j), p_j = frac(s |x_j| / ||x||)."""
    norm = np.linalg.norm(x)
    p = s * np.abs(x) / norm % 1.0
    return float((norm / s) ** 2 * np.sum(p * (1 - p)))


def _natural_variance(x: np.ndarray) -> float:
    """Exact E||C_nat(x) - x||^2 = sum_j (2 a_j - |x_j|)(|x_j| - a_j), a_j = 2^floor(log2 |x_j|)."""
    a = 2.0 ** np.floor(np.log2(np.abs(x)))
    return float(np.sum((2 * a - np.abs(x)) * (np.abs(x) - a)))


@dataclass(frozen=True)
class _TopOne(Compressor):
    """A biased, contractive compressor (keeps the largest coordinate) to exercise the helpers."""

    unbiased: ClassVar[bool] = False
    contractive: ClassVar[bool] = True
    name: ClassVar[str] = "top_one"

    def bits(self, d: int) -> int:
        return 32 + max(1, math.ceil(math.log2(d)))

    def omega(self, d: int) -> None:
        return None

    def alpha(self, d: int) -> float:
        return 1.0 / d

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        j = jnp.argmax(jnp.abs(x))
        return jnp.zeros_like(x).at[j].set(x[j])


@dataclass(frozen=True)
class _Doubling(Compressor):
    """C(x) = 2x: biased and not contractive (||C(x) - x||^2 = ||x||^2), for the refusals."""

    unbiased: ClassVar[bool] = False
    contractive: ClassVar[bool] = False
    name: ClassVar[str] = "doubling"

    def bits(self, d: int) -> int:
        return 32 * d

    def omega(self, d: int) -> None:
        return None

    def alpha(self, d: int) -> None:
        return None

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        return 2 * x


@pytest.mark.parametrize("d", [10, 50])
@pytest.mark.parametrize("c", UNBIASED, ids=repr)
def test_monte_carlo_mean_and_variance_bound(c: Compressor, d: int) -> None:
    x = _vector(d)
    x_hat, bits = _draws(d)[c]
    assert bits.shape == (N,) and bits.dtype == np.int32 and np.all(bits == c.bits(d))
    # Coordinate-wise |mean - x| <= Z SE; the 1e-12 absorbs rounding on coordinates with zero
    # spread (identity, rand_k with k = d).
    mean, se = _mean_se(x_hat)
    assert np.all(np.abs(mean - np.asarray(x)) <= Z * se + 1e-12)
    # E||C(x) - x||^2 <= omega ||x||^2, up to Z SE of the mean squared error.
    err, err_se = _sq_err(x_hat, x)
    assert err <= c.omega(d) * float(x @ x) + Z * err_se + 1e-12


@pytest.mark.parametrize("d", [10, 50])
@pytest.mark.parametrize("c", RAND_K, ids=repr)
def test_rand_k_variance_equals_omega(c: Compressor, d: int) -> None:
    # Scaled rand-k has E||C(x) - x||^2 = (d/k - 1) ||x||^2 exactly: the MC mean is within Z SE.
    # For k = d/2 the error is ||x||^2 on every draw (SE = 0): the 1e-9 relative term is rounding.
    x = _vector(d)
    err, err_se = _sq_err(_draws(d)[c][0], x)
    assert abs(err - c.omega(d) * float(x @ x)) <= Z * err_se + 1e-9 * float(x @ x)


@pytest.mark.parametrize("d", [10, 50])
@pytest.mark.parametrize("c", RAND_K, ids=repr)
def test_rand_k_keeps_exactly_k_scaled_coordinates(c: Compressor, d: int) -> None:
    x = np.asarray(_vector(d))  # Gaussian: no zero coordinates
    x_hat = _draws(d)[c][0]
    k = {rand_k(1): 1, rand_k(3): 3, rand_k(fraction=0.5): d // 2, rand_k(fraction=1.0): d}[c]
    kept = x_hat != 0
    assert np.all(kept.sum(1) == k)
    scaled = np.broadcast_to(x * d / k, x_hat.shape)
    np.testing.assert_allclose(x_hat[kept], scaled[kept], rtol=1e-12)
    assert kept.any(0).all()  # every coordinate is selected in some draw


@pytest.mark.parametrize("d", [10, 50])
@pytest.mark.parametrize("c", QSGD, ids=repr)
def test_qsgd_variance_matches_closed_form(c: Compressor, d: int) -> None:
    x = _vector(d)
    exact = _qsgd_variance(np.asarray(x), c.levels)
    assert exact <= c.omega(d) * float(x @ x)
    err, err_se = _sq_err(_draws(d)[c][0], x)
    assert abs(err - exact) <= Z * err_se


@pytest.mark.parametrize("d", [10, 50])
@pytest.mark.parametrize("c", QSGD, ids=repr)
def test_qsgd_outputs_lie_on_grid(c: Compressor, d: int) -> None:
    x = np.asarray(_vector(d))
    x_hat, s = _draws(d)[c][0], c.levels
    levels = x_hat * s / np.linalg.norm(x)
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-9)
    assert np.all(np.abs(np.round(levels)) <= s)
    assert np.all((x_hat == 0) | (np.sign(x_hat) == np.sign(x)))


def test_qsgd_variance_in_bound_regimes() -> None:
    # sqrt(d)/s regime (d = 50, s = 1 < sqrt d): all |x_j| equal gives p_j = 1/sqrt(d), so
    # E||Q - x||^2 = (sqrt(d) - 1) ||x||^2 / s^2 = (1 - 1/sqrt(d)) omega ||x||^2, near the bound.
    # d/s^2 regime (d = 4, s = 3 > sqrt d): s|x_j|/||x|| = 1.5 gives p_j = 1/2, the largest
    # per-coordinate variance: ||Q - x||^2 = d ||x||^2 / (4 s^2) = omega ||x||^2 / 4 on every draw
    # (SE = 0, so the 1e-12 relative term covers rounding).
    cases = [(50, 1, 1 - 1 / math.sqrt(50)), (4, 3, 0.25)]
    xs = [jnp.asarray(np.where(np.arange(d) % 2 == 0, 1.0, -1.0)) for d, _, _ in cases]
    draw = jax.jit(
        lambda keys: [jax.vmap(qsgd(s), (0, None))(keys, x)[0] for (_, s, _), x in zip(cases, xs)]
    )
    for (d, s, ratio), x, x_hat in zip(cases, xs, draw(jax.random.split(jax.random.key(1), N))):
        bound = qsgd(s).omega(d) * float(x @ x)
        err, err_se = _sq_err(np.asarray(x_hat), x)
        assert abs(err - ratio * bound) <= Z * err_se + 1e-12 * bound


@pytest.mark.parametrize("d", [10, 50])
@pytest.mark.parametrize("c", [c for c in ALL if c.contractive], ids=repr)
def test_monte_carlo_contraction_bound(c: Compressor, d: int) -> None:
    # E||C(x) - x||^2 <= (1 - alpha) ||x||^2, up to Z SE of the mean squared error; the 1e-12
    # relative term covers rounding where the error is the same on every draw (SE = 0: identity,
    # top_k).
    x = _vector(d)
    x_hat, bits = _draws(d)[c]
    assert bits.shape == (N,) and bits.dtype == np.int32 and np.all(bits == c.bits(d))
    assert 0.0 < c.alpha(d) <= 1.0
    err, err_se = _sq_err(x_hat, x)
    norm2 = float(x @ x)
    assert err <= (1 - c.alpha(d)) * norm2 + Z * err_se + 1e-12 * norm2


@pytest.mark.parametrize("d", [10, 50])
@pytest.mark.parametrize("c", TOP_K, ids=repr)
def test_top_k_keeps_the_largest_coordinates(c: Compressor, d: int) -> None:
    x = np.asarray(_vector(d))  # Gaussian: no ties, so the k largest |x_j| are unique
    x_hat = _draws(d)[c][0]
    k = c.kept(d)
    assert k == {top_k(1): 1, top_k(3): 3, top_k(fraction=0.5): d // 2}[c]
    assert np.all(x_hat == x_hat[0])  # deterministic: the key is unused
    largest = np.argsort(-np.abs(x))[:k]
    expected = np.zeros(d)
    expected[largest] = x[largest]  # kept unscaled
    np.testing.assert_array_equal(x_hat[0], expected)
    # ||C(x) - x||^2 is the sum of the d - k smallest squares (exactly, up to summation order) and
    # at most (1 - k/d) ||x||^2 on every draw, not just on average.
    err = np.sum((x_hat - x) ** 2, axis=1)
    np.testing.assert_allclose(err, np.sort(x**2)[: d - k].sum(), rtol=1e-13)
    assert np.all(err <= (1 - c.alpha(d)) * float(x @ x))


@pytest.mark.parametrize("d", [10, 50])
@pytest.mark.parametrize("c", UNSCALED, ids=repr)
def test_rand_k_unscaled_error_and_support(c: Compressor, d: int) -> None:
    x = np.asarray(_vector(d))
    x_hat = _draws(d)[c][0]
    k = {rand_k_unscaled(3): 3, rand_k_unscaled(fraction=0.5): d // 2}[c]
    assert c.alpha(d) == k / d
    # E||C(x) - x||^2 = (1 - k/d) ||x||^2 exactly (the dropped squares): MC mean within Z SE.
    err, err_se = _sq_err(x_hat, x)
    assert abs(err - (1 - k / d) * float(x @ x)) <= Z * err_se
    # Biased: E[C(x)] = (k/d) x, coordinate-wise within Z SE.
    mean, se = _mean_se(x_hat)
    assert np.all(np.abs(mean - k / d * x) <= Z * se)
    kept = x_hat != 0
    assert np.all(kept.sum(1) == k)
    np.testing.assert_array_equal(x_hat[kept], np.broadcast_to(x, x_hat.shape)[kept])
    # Same keys as rand_k with the same size: the same coordinates, there scaled by d/k.
    scaled = {rand_k_unscaled(3): rand_k(3), rand_k_unscaled(fraction=0.5): rand_k(fraction=0.5)}
    np.testing.assert_allclose(x_hat * (d / k), _draws(d)[scaled[c]][0], rtol=1e-15)


@pytest.mark.parametrize("d", [10, 50])
def test_natural_rounds_to_bracketing_powers_of_two(d: int) -> None:
    # Unbiasedness and E||C(x) - x||^2 <= ||x||^2 / 8 are checked for natural() in
    # test_monte_carlo_mean_and_variance_bound; here: the output grid and the exact variance.
    x = np.asarray(_vector(d))  # Gaussian: nonzero and well inside the float32 exponent range
    x_hat = _draws(d)[natural()][0]
    assert np.all(x_hat != 0) and np.all(np.sign(x_hat) == np.sign(x))
    exponent = np.log2(np.abs(x_hat))
    np.testing.assert_array_equal(exponent, np.round(exponent))  # signed powers of two
    low = 2.0 ** np.floor(np.log2(np.abs(x)))
    assert np.all((np.abs(x_hat) == low) | (np.abs(x_hat) == 2 * low))  # bracketing |x_j|
    assert ((np.abs(x_hat) == 2 * low).any(0) & (np.abs(x_hat) == low).any(0)).all()
    exact = _natural_variance(x)
    assert exact <= float(x @ x) / 8
    err, err_se = _sq_err(x_hat, x)
    assert abs(err - exact) <= Z * err_se


@pytest.mark.parametrize("d", [10, 50])
@pytest.mark.parametrize("c", [natural(contractive=True), qsgd(4, contractive=True)], ids=repr)
def test_scaled_compressors_rescale_their_unbiased_base(c: Compressor, d: int) -> None:
    # Same keys: each draw is the base draw divided by 1 + omega (8/9 of it for natural).
    base = {natural(contractive=True): natural(), qsgd(4, contractive=True): qsgd(4)}[c]
    assert c.alpha(d) == 1 / (1 + base.omega(d)) and not c.unbiased and c.contractive
    expected = _draws(d)[base][0] / (1 + base.omega(d))
    np.testing.assert_allclose(_draws(d)[c][0], expected, rtol=1e-15, atol=0)
    if base == natural():
        np.testing.assert_allclose(_draws(d)[c][0], _draws(d)[base][0] * 8 / 9, rtol=1e-15)


def _bracket_check(draws: np.ndarray, x: np.ndarray, low: np.ndarray, high: np.ndarray) -> None:
    """Every draw of coordinate j is low_j or high_j, and the mean is x_j within Z SE (unbiased).

    high_j is a nonzero power of two: draws and x_j are divided by it (exactly) so that huge or
    subnormal values keep their precision in the sample mean and SE."""
    assert np.all((draws == low) | (draws == high))
    mean, se = _mean_se(draws.astype(np.float64) / np.abs(high))
    assert np.all(np.abs(mean - x / np.abs(high)) <= Z * se)


def test_natural_edge_cases_and_top_k_ties() -> None:
    # N draws, one compilation, of natural on: float32 subnormals (which XLA's CPU flushes to zero
    # in arithmetic), the top binade of float32 with +-inf and NaN, natural(16) on float64 vectors
    # beyond float16's range, a vector where the variance bound 1/8 is attained; top_k on tied and
    # on subnormal magnitudes.
    sub = np.asarray([0.0, -0.0, 1e-40, -(2.0**-140), 2.0**-149, 3e-41], np.float32)
    top = np.asarray([3.4e38, -3.0e38, 1.5, -np.inf, np.nan], np.float32)
    x16 = np.asarray([1e5, 2.0**15, -4e4, 2.0**-16, 0.3, 0.0])
    far = np.asarray([1e300, -1e-300, 0.0])
    tight = jnp.asarray(4 / 3 * 2.0 ** np.arange(-3, 5) * np.where(np.arange(8) % 3, 1, -1))
    ties = jnp.asarray([1.0, -1.0, 1.0, 0.5, -1.0])
    tiny = jnp.asarray([0.0, 1e-40, -3e-40, 2e-40], jnp.float32)

    @jax.jit
    def run(keys):
        draw = lambda c, x: jax.vmap(c, (0, None))(keys, x)[0]  # noqa: E731
        cases = [(natural(), sub), (natural(), top), (natural(16), x16), (natural(16), far),
                 (natural(), tight), (top_k(2), ties), (top_k(1), tiny)]
        return [draw(c, jnp.asarray(x)) for c, x in cases]

    n_sub, n_top, n16, n_far, nt, tk, tk_tiny = map(np.asarray, run(jax.random.split(jax.random.key(6), N)))
    # The grid is anchored at the largest |x_j| (binade -133 here): subnormals round between their
    # bracketing powers of two, unbiased, and powers of two are kept; zeros stay zero.
    assert n_sub.dtype == np.float32 and np.all(n_sub[:, :2] == 0)
    np.testing.assert_array_equal(n_sub[:, 3:5], np.broadcast_to(sub[3:5], (N, 2)))
    _bracket_check(n_sub[:, [2, 5]], sub[[2, 5]].astype(np.float64), 2.0 ** np.asarray([-133, -135]),
                   2.0 ** np.asarray([-132, -134]))
    # Top binade of float32: rounding up would give 2^128, which saturates to the largest float32
    # (finite, biased there); 1.5 -> 1 or 2 as usual; -inf and NaN pass.
    big = np.finfo(np.float32).max
    assert np.all((n_top[:, 0] == 2.0**127) | (n_top[:, 0] == big))
    assert np.all((n_top[:, 1] == -(2.0**127)) | (n_top[:, 1] == -big))
    assert np.isin(n_top[:, 2], [1.0, 2.0]).all() and np.all(n_top[:, 3] == -np.inf) and np.isnan(n_top[:, 4]).all()
    # natural(16) on float64: the grid 2^-12 .. 2^17 (30 binades below 2^(b + 1), b = 16) holds 1e5,
    # which rounds unbiased (no saturation at float16's top); 2^-16 is below it and goes to 0 or
    # 2^-12 with probability 1/16, unbiased; 0.3 to 0.25 or 0.5.
    assert np.all(n16[:, 1] == 2.0**15) and np.all(n16[:, 5] == 0)
    _bracket_check(n16[:, [0, 2, 3, 4]], x16[[0, 2, 3, 4]], np.asarray([2.0**16, -(2.0**15), 0.0, 0.25]),
                   np.asarray([2.0**17, -(2.0**16), 2.0**-12, 0.5]))
    # ... and far beyond: 1e300 keeps its binade, -1e-300 (2^-1993 of it) is rounded to 0.
    _bracket_check(n_far[:, :1], far[:1], np.asarray([2.0**996]), np.asarray([2.0**997]))
    assert np.all(n_far[:, 1:] == 0)
    # |x_j| = (4/3) 2^e: E(C(x)_j - x_j)^2 = x_j^2 / 8, so the MC error matches omega ||x||^2.
    err, err_se = _sq_err(nt, tight)
    assert abs(err - float(tight @ tight) / 8) <= Z * err_se
    # Ties: the same two of the four coordinates with |x_j| = 1 on every draw; error 1 + 1 + 1/4.
    assert np.all(tk == tk[0]) and np.count_nonzero(tk[0]) == 2
    assert np.all(np.abs(tk[0][tk[0] != 0]) == 1.0)
    assert np.sum((tk[0] - np.asarray(ties)) ** 2) == 2.25
    # Subnormal magnitudes are ranked on their bits: the largest, -3e-40, is kept exactly.
    np.testing.assert_array_equal(tk_tiny[0], np.where(np.arange(4) == 2, np.asarray(tiny), 0).astype(np.float32))


@pytest.mark.parametrize("float_bits", [16, 32, 64])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_natural_integer_decoding_equals_exact_float_scaling(float_bits: int, dtype) -> None:
    # natural's encode and decode work on integers (``_power_bits``); the generic exact scalings on
    # the floats' bits (``_ldexp``, ``_rescaled``, tested against NumPy in test_ldexp_*) must give the
    # same numbers bit for bit: C(x) = y 2^(b + 1 - hi) and C(x) / (1 + omega), over vectors spanning
    # the whole range of the dtype (subnormals, the top binade, zeros, +-inf and NaN).
    rng = np.random.default_rng(float_bits)
    info = np.finfo(dtype)
    span = np.arange(int(info.minexp) - int(info.nmant), int(info.maxexp))
    x = np.concatenate([rng.choice([-1.0, 1.0], span.size) * rng.uniform(1, 2, span.size) * 2.0**span,
                        [0.0, -0.0, np.inf, -np.inf, np.nan, float(info.max), -float(info.max)]]).astype(dtype)
    nat, contractive = natural(float_bits), natural(float_bits, contractive=True)
    lo, hi = nat._grid(x.dtype)

    @jax.jit
    def run(keys, x):
        def one(key):
            b, y = nat.encode(key, x)
            scale = 1.0 + nat.omega(x.shape[0])
            return (nat.decode((b, y), x.shape[0]), fb_compress._ldexp(y, b + 1 - hi),
                    contractive.decode((b, y), x.shape[0]),
                    fb_compress._rescaled(lambda v: v / scale, fb_compress._ldexp(y, b + 1 - hi)))
        return jax.vmap(one)(keys)

    # a window of x (the whole span of float64 is 2 100 binades: each window is a vector's range)
    for start in range(0, x.size, 40):
        window = jnp.asarray(np.concatenate([x[start:start + 40], x[-7:]]))
        dec, ref, dec_c, ref_c = map(np.asarray, run(jax.random.split(jax.random.key(start), 64), window))
        width = dec.dtype.itemsize * 8
        # A value rounded up from the top binade saturates to the largest finite number, and is then
        # divided: the quotient is IEEE's (NumPy's). XLA computes a float16 division by a constant as a
        # product with the rounded reciprocal, one unit lower there (58 208 for 58 240); float32 and
        # float64 divide exactly, and there the two agree anyway.
        top = np.abs(ref) == info.max
        ref_c = np.where(top, np.sign(ref) * (np.asarray(info.max, dtype) / np.asarray(1 + nat.omega(window.shape[0]), dtype)), ref_c)
        for a, b in ((dec, ref), (dec_c, ref_c)):
            same = (a.view(f"uint{width}") == b.view(f"uint{width}")) | (np.isnan(a) & np.isnan(b))
            assert same.all(), (start, a[~same][:3], b[~same][:3])


def _natural_reference(x: np.ndarray, k: np.ndarray, float_bits: int) -> tuple[int, np.ndarray]:
    """natural's (b, y) by exact rational arithmetic, one coordinate at a time, given the integers k of
    the uniforms u_j = k_j 2^-nmant: b = floor(log2 max |x_j|) over the finite nonzero x_j (0 if none);
    y_j = x_j 2^(hi - 1 - b) rounded to 2^e or 2^(e + 1) (e = floor(log2 |y_j|)) with P(up) = (|y_j| - 2^e) / 2^e
    on the grid (e >= lo), below it to 0 or 2^lo with P(up) = ceil(q 2^nmant) 2^-nmant, q = |y_j| / 2^lo:
    rounded up exactly when u_j < P(up)."""
    from fractions import Fraction

    lo, hi = natural(float_bits)._grid(x.dtype)
    nmant = int(np.finfo(x.dtype).nmant)
    finite = [float(v) for v in x if np.isfinite(v) and v != 0]
    b = max(math.frexp(v)[1] - 1 for v in finite) if finite else 0
    y = []
    for v, kj in zip(x.tolist(), k.tolist()):
        if not math.isfinite(v) or v == 0:
            y.append(v)
            continue
        size = abs(Fraction(v)) * Fraction(2) ** (hi - 1 - b)
        u = Fraction(int(kj), 2**nmant)
        e = math.frexp(abs(v))[1] - 1 + (hi - 1 - b)
        if e >= lo:
            low = Fraction(2) ** e
            power = 2 * low if u < (size - low) / low else low
        else:
            q = size / Fraction(2) ** lo
            power = Fraction(2) ** lo if u < Fraction(math.ceil(q * 2**nmant), 2**nmant) else Fraction(0)
        y.append(math.copysign(float(power), v))  # powers of two of the grid: exact as floats
    return b, np.asarray(y, x.dtype)


@pytest.mark.parametrize("float_bits,dtype", [(16, np.float16), (16, np.float32), (32, np.float32), (64, np.float64)])
def test_natural_encode_is_the_exact_rounding_of_its_uniforms(float_bits: int, dtype) -> None:
    # natural's encode works on the floats' bits and integers (the shared binade from the largest bit
    # pattern, the uniforms as integers); an exact rational reference rounds each coordinate given the
    # same uniforms. Vectors of random bit patterns of the dtype (zeros, subnormals, normals, +-inf,
    # NaN) and vectors spanning the whole range (coordinates below the grid), the same numbers bit for bit.
    rng = np.random.default_rng(float_bits)
    width = np.dtype(dtype).itemsize * 8
    info = np.finfo(dtype)
    span = np.arange(int(info.minexp) - int(info.nmant), int(info.maxexp))
    vectors = [rng.integers(0, 2**width, size=30, dtype=np.uint64).astype(f"uint{width}").view(dtype) for _ in range(6)]
    vectors += [(rng.choice([-1.0, 1.0], 30) * rng.uniform(1, 2, 30) * 2.0 ** rng.choice(span, 30)).astype(dtype)
                for _ in range(6)]
    # the largest binade next to the smallest ones: those lie just below the grid (t = lo - ey small),
    # where the probability of going up to 2^lo is far from 0 and 1
    low = np.arange(int(info.minexp) - int(info.nmant), int(info.minexp) + 3)
    edge = np.concatenate([[1.5 * 2.0 ** (int(info.maxexp) - 1)], rng.uniform(1, 2, low.size) * 2.0**low])
    vectors += [np.tile(edge, 4).astype(dtype),
                np.asarray([float(info.max), float(info.smallest_subnormal), -float(info.tiny), 0.0, -0.0], dtype),
                np.zeros(4, dtype)]
    nat = natural(float_bits)
    encode = jax.jit(nat.encode)
    for i, x in enumerate(vectors):
        key = jax.random.key(i)
        k = prng.uniform_grid(key, x.shape, x.dtype)
        # the integers are jax.random.uniform's draws: u = k 2^-nmant exactly
        np.testing.assert_array_equal(np.asarray(k, np.float64) * 2.0 ** -int(info.nmant),
                                      np.asarray(jax.random.uniform(key, x.shape, x.dtype), np.float64))
        b, y = map(np.asarray, encode(key, jnp.asarray(x)))
        b_ref, y_ref = _natural_reference(x, np.asarray(k), float_bits)
        assert int(b) == b_ref, (i, int(b), b_ref)
        same = (y.view(f"uint{width}") == y_ref.view(f"uint{width}")) | (np.isnan(y) & np.isnan(y_ref))
        assert same.all(), (i, x[~same][:3], y[~same][:3], y_ref[~same][:3])


@pytest.mark.parametrize("c", [natural(), natural(contractive=True), qsgd(4), rand_k(2), top_k(2)], ids=repr)
def test_coded_rows_codes_every_row_independently(c: Compressor) -> None:
    # Two equal rows of x with every |x_j| = 1.5 2^e: a rounding goes up with probability 1/2, so two
    # independent draws agree with probability 1/2 (1 were the rows' draws shared); each row's draw
    # has the law of c's own draw (its mean is c's, x for the unbiased ones). N draws: the standard
    # error of a rate near 1/2 is 0.5 / sqrt(N) = 0.0035; Z = 5 of them.
    d = 8
    x = jnp.asarray(1.5 * 2.0 ** np.arange(-3, d - 3) * np.where(np.arange(d) % 2, 1, -1), jnp.float32)
    rows = jnp.stack([x, x])
    coded, decoded, bits = jax.jit(jax.vmap(c.coded_rows, (0, None)))(jax.random.split(jax.random.key(3), N), rows)
    np.testing.assert_array_equal(np.asarray(bits), c.bits(d))
    np.testing.assert_array_equal(np.asarray(coded.decoded()), np.asarray(decoded))
    draws = np.asarray(decoded, np.float64)
    single = np.asarray(jax.jit(jax.vmap(c, (0, None)))(jax.random.split(jax.random.key(4), N), x)[0], np.float64)
    for r in range(2):
        mean, se = _mean_se(draws[:, r] - single)
        assert np.all(np.abs(mean) <= Z * se + 1e-12), (r, mean, se)
    if c.name == top_k(2).name:  # deterministic: equal rows, equal messages
        np.testing.assert_array_equal(draws[:, 0], draws[:, 1])
        return
    agree = np.mean(draws[:, 0] == draws[:, 1], axis=0)
    if c.name.startswith("natural"):
        assert np.all(np.abs(agree - 0.5) <= Z * 0.5 / math.sqrt(N)), agree
    else:  # qsgd, rand_k: not 1, as shared draws would give
        assert np.all(agree < 0.95), agree
    if c.name == rand_k(2).name:  # the default: row r coded with the r-th key split from the row key
        keys = jax.random.split(jax.random.key(5), 2)
        expected = jax.vmap(c.coded)(keys, rows)[1]
        np.testing.assert_array_equal(np.asarray(c.coded_rows(jax.random.key(5), rows)[1]), np.asarray(expected))


@pytest.mark.parametrize("c", [natural(), natural(contractive=True), qsgd(4, contractive=True)], ids=repr)
def test_kept_codes_are_the_codes(c: Compressor) -> None:
    # A quantiser's codes are computed once in a loop of one iteration (``_kept``, on a CPU); the loop's
    # count depends on whether x's first entry is NaN: the codes are encode's either way, under jit and vmap.
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 9)), jnp.float32)
    x_nan = x.at[:, 0].set(jnp.nan)
    keys = jax.random.split(jax.random.key(1), 3)
    for v in (x, x_nan):
        coded = jax.jit(jax.vmap(c.coded))(keys, v)[0]
        for got, want in zip(coded.codes, jax.jit(jax.vmap(c.encode))(keys, v)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        rows = jax.jit(c.coded_rows)(keys[0], v)[0]
        for got, want in zip(rows.codes, jax.jit(c._row_codes)(keys[0], v)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_natural_is_unbiased_where_the_rounding_gap_is_subnormal() -> None:
    # |x_j| = 1.3 2^-110 next to 1.5 2^126: y_j = x_j, and |y_j| - 2^-110 is a subnormal number, which
    # XLA's CPU flushes to zero; rounding on the integer mantissa keeps the probability 0.3 (a float
    # computation of (|y| - low) / low would round it down every time).
    x = jnp.asarray([1.5 * 2.0**126, 1.3 * 2.0**-110, -1.7 * 2.0**-120, 1.25 * 2.0**-125], jnp.float32)
    draws = np.asarray(jax.jit(jax.vmap(natural(), (0, None)))(jax.random.split(jax.random.key(2), N), x)[0])
    low = np.asarray([2.0**126, 2.0**-110, -(2.0**-120), 2.0**-125])
    _bracket_check(draws[:, 1:], np.asarray(x, np.float64)[1:], low[1:], 2 * low[1:])
    up = np.mean(np.abs(draws[:, 1:]) == 2 * np.abs(low[1:]), axis=0)
    assert np.all(up > 0.1)  # rounded up at rates 0.3, 0.7, 0.25, not never


def test_require_unbiased_and_contractive_with_the_new_compressors() -> None:
    for c in (*CONTRACTIVE, top_k(2), scale_to_contractive(rand_k(2))):
        assert require_contractive(c, "EF21") is c
        with pytest.raises(ConfigError, match=r"QLSD.*is biased.*rand_k.*qsgd.*natural\(\)"):
            require_unbiased(c, "QLSD")
    c = natural()
    assert require_unbiased(c, "QLSD") is c
    suggestion = (
        r"use top_k\(\.\.\.\), rand_k_unscaled\(\.\.\.\), natural\(contractive=True\), "
        r"qsgd\(s, contractive=True\) or scale_to_contractive\("
    )
    for c in (rand_k(3), rand_k(fraction=0.9), qsgd(4), natural(16)):
        with pytest.raises(ConfigError, match="EF21.*" + suggestion + re.escape(c.name) + r"\)"):
            require_contractive(c, "EF21")
    with pytest.raises(ConfigError, match="EF21"):
        require_contractive(_Doubling(), "EF21")


def test_scale_to_contractive() -> None:
    for c in (*CONTRACTIVE, identity(), _TopOne()):
        assert scale_to_contractive(c) is c
    d, k = 10, 2
    c = scale_to_contractive(rand_k(k))
    assert c.name == "scale_to_contractive(rand_k(k=2))" and c.contractive and not c.unbiased
    # omega = d/k - 1, so alpha = 1 / (1 + d/k - 1) = k/d, and the message is rand_k's.
    assert c.alpha(d) == pytest.approx(k / d) and c.omega(d) is None
    assert c.bits(d) == rand_k(k).bits(d)
    assert scale_to_contractive(natural()) == natural(contractive=True)
    assert scale_to_contractive(qsgd(4, float_bits=16)) == qsgd(4, float_bits=16, contractive=True)
    assert natural(16, contractive=True).name == "natural(float_bits=16, contractive=True)"
    assert repr(qsgd(4, float_bits=16, contractive=True)) == (
        "qsgd(levels=4, float_bits=16, contractive=True)"
    )
    assert repr(natural(contractive=True)) == "natural(contractive=True)" and (
        repr(natural()) == "natural()" and repr(top_k(fraction=0.5)) == "top_k(fraction=0.5)"
    )
    x, key = _vector(d), jax.random.key(7)
    scaled, plain, unscaled = jax.jit(
        lambda key, x: [f(key, x) for f in (c, rand_k(k), rand_k_unscaled(k))]
    )(key, x)
    assert int(scaled[1]) == int(plain[1]) == c.bits(d)
    # Same key: rand_k's output times k/d, i.e. the unscaled rand-k output, k coordinates of x.
    np.testing.assert_allclose(scaled[0], plain[0] * k / d, rtol=1e-15)
    np.testing.assert_allclose(scaled[0], unscaled[0], rtol=1e-15)
    assert np.count_nonzero(scaled[0]) == k
    with pytest.raises(ConfigError, match="doubling"):
        scale_to_contractive(_Doubling())
    with pytest.raises(ConfigError):
        scale_to_contractive("rand_k")


def _expected_bits(d: int) -> dict[Compressor, int]:
    """Bits of the unbiased compressors: 16-bit floats come with one 12-bit shared binade."""
    index_bits = max(1, math.ceil(math.log2(d)))
    return {
        identity(): 32 * d,
        identity(16): 12 + 16 * d,
        rand_k(1): 32 + index_bits,
        rand_k(fraction=0.5): max(1, round(0.5 * d)) * (32 + index_bits),
        rand_k(fraction=1.0, float_bits=64): d * (64 + index_bits),
        qsgd(1): 32 + d * 2,
        qsgd(4): 32 + d * (1 + 3),
        qsgd(16, float_bits=16): 12 + 16 + d * (1 + 5),
    }


def _expected_contractive_bits(d: int) -> dict[Compressor, int]:
    """Bits of the contractive compressors and of natural: sparsifiers send k values and indices,
    natural a 12-bit shared binade, then a sign bit and a 5, 8 or 11-bit exponent per coordinate,
    scaling keeps the message."""
    index_bits = max(1, math.ceil(math.log2(d)))
    return {
        top_k(1): 32 + index_bits,
        top_k(fraction=0.5, float_bits=16): 12 + max(1, round(0.5 * d)) * (16 + index_bits),
        rand_k_unscaled(1, float_bits=64): 64 + index_bits,
        rand_k_unscaled(fraction=0.3): max(1, round(0.3 * d)) * (32 + index_bits),
        natural(): 12 + 9 * d,
        natural(16): 12 + 6 * d,
        natural(64): 12 + 12 * d,
        natural(contractive=True): 12 + 9 * d,
        natural(16, contractive=True): 12 + 6 * d,
        qsgd(4, contractive=True): 32 + d * (1 + 3),
        scale_to_contractive(rand_k(1)): 32 + index_bits,
    }


@pytest.mark.parametrize("d", [1, 2, 3, 7, 8, 9, 10, 50, 1000, 1024, 1025])
def test_bits_match_documented_formulas(d: int) -> None:
    for c, bits in {**_expected_bits(d), **_expected_contractive_bits(d)}.items():
        assert c.bits(d) == bits, c


@pytest.mark.parametrize("d", [1, 1025])
def test_message_bits_equal_bits(d: int) -> None:
    expected = {**_expected_bits(d), **_expected_contractive_bits(d)}
    x = _vector(d)
    results = jax.jit(lambda key, x: [c(key, x) for c in expected])(jax.random.key(0), x)
    for (c, bits), (x_hat, message_bits) in zip(expected.items(), results):
        assert x_hat.shape == (d,) and message_bits.shape == () and message_bits.dtype == jnp.int32
        assert int(message_bits) == bits, c
        if d == 1 and "natural" not in c.name:
            # Every other unbiased compressor is exact on one coordinate (k = d, s|x_1|/||x|| = s)
            # and every other contractive one returns alpha(1) x: alpha = k/d = 1 for the
            # sparsifiers, 1 / (1 + omega(1)) for the rescaled ones.
            # A 16-bit wire sends x rounded to float16 (then scaled by the receiver).
            scale = 1.0 if c.unbiased else c.alpha(1)
            sent = np.asarray(x).astype(np.float16).astype(np.float64) if _float_bits(c) == 16 else np.asarray(x)
            np.testing.assert_allclose(x_hat, scale * sent, rtol=1e-15, err_msg=repr(c))


@given(d=st.integers(1, 10**6), k=st.integers(1, 10**6), s=st.integers(1, 10**4))
def test_bits_formulas_property(d: int, k: int, s: int) -> None:
    index_bits = max(1, math.ceil(math.log2(d)))
    assert rand_k(min(k, d)).bits(d) == min(k, d) * (32 + index_bits)
    assert qsgd(s).bits(d) == 32 + d * (1 + math.ceil(math.log2(s + 1)))
    k = min(k, d)
    assert top_k(k).bits(d) == rand_k_unscaled(k).bits(d) == rand_k(k).bits(d)
    assert qsgd(s, contractive=True).bits(d) == qsgd(s).bits(d)
    assert natural().bits(d) == 12 + 9 * d and natural(64, contractive=True).bits(d) == 12 + 12 * d
    assert rand_k(k, float_bits=16).bits(d) == 12 + k * (16 + index_bits)
    assert qsgd(s, float_bits=16).bits(d) == 12 + 16 + d * (1 + math.ceil(math.log2(s + 1)))


def test_constants_and_flags() -> None:
    for c in (*ALL, _TopOne()):
        for d in (3, 10):
            assert (c.omega(d) is not None) == c.unbiased
            assert (c.alpha(d) is not None) == c.contractive
    assert identity().omega(7) == 0.0 and identity().alpha(7) == 1.0
    assert rand_k(2).omega(10) == pytest.approx(4.0)
    assert qsgd(1).omega(16) == pytest.approx(4.0) and qsgd(8).omega(16) == pytest.approx(0.25)
    # k = max(1, round(fraction * d)): 3, 1 and 10 coordinates of 10, 4 index bits each.
    bits = [rand_k(fraction=f).bits(10) for f in (0.3, 0.01, 1.0)]
    assert bits == [k * (32 + 4) for k in (3, 1, 10)]
    assert top_k(3).alpha(10) == 0.3 and rand_k_unscaled(fraction=0.5).alpha(7) == 4 / 7
    assert natural().omega(5) == 0.125 and natural(contractive=True).alpha(5) == 8 / 9
    # Coordinates below natural's grid (2^29 times smaller than the largest at 16 bits, 2^253 at 32
    # and 64) add at most 4^(lo - hi) ||x||^2 each: invisible in omega at 32 and 64 bits.
    assert natural(64).omega(10**9) == 0.125 and natural(16).omega(1) == 0.125
    assert natural(16).omega(10**6) == 0.125 + (10**6 - 1) * 2.0**-58
    # omega = min(16 / 1, 4 / 1) = 4 for s = 1, d = 16; min(50 / 16, sqrt(50) / 4) for s = 4,
    # d = 50.
    assert qsgd(1, contractive=True).alpha(16) == pytest.approx(0.2)
    assert qsgd(4, contractive=True).alpha(50) == pytest.approx(1 / (1 + math.sqrt(50) / 4))


def test_zero_vector_maps_to_zero_and_dtype_is_kept() -> None:
    run = jax.jit(lambda key, x: [c(key, x)[0] for c in ALL])
    for x_hat, c in zip(run(jax.random.key(2), jnp.zeros(10, jnp.float32)), ALL):
        assert x_hat.shape == (10,) and x_hat.dtype == jnp.float32, c
        assert np.all(np.asarray(x_hat) == 0.0), c


def test_jit_with_static_compressor() -> None:
    apply = jax.jit(lambda c, key, x: c(key, x), static_argnums=0)
    x, key = _vector(10), jax.random.key(3)
    assert rand_k(3) == rand_k(3) and hash(rand_k(3)) == hash(rand_k(3)) and rand_k(3) != rand_k(4)
    assert natural(contractive=True) == scale_to_contractive(natural()) != natural()
    assert hash(qsgd(4, contractive=True)) == hash(qsgd(4, contractive=True))
    assert top_k(3) != rand_k_unscaled(3) != rand_k(3)
    for c in (rand_k(3), qsgd(4), top_k(3), natural(contractive=True)):
        x_hat, bits = apply(c, key, x)
        x_again, _ = apply(type(c)(**vars(c)), key, x)  # equal compressor: same trace and draw
        assert int(bits) == c.bits(10) and np.array_equal(x_hat, x_again)


@pytest.mark.parametrize(
    "make",
    [
        lambda: rand_k(),
        lambda: rand_k(2, fraction=0.5),
        lambda: rand_k(0),
        lambda: rand_k(-3),
        lambda: rand_k(2.0),
        lambda: rand_k(True),
        lambda: rand_k(fraction=0.0),
        lambda: rand_k(fraction=1.5),
        lambda: rand_k(fraction=float("nan")),
        lambda: rand_k(fraction="0.5"),
        lambda: rand_k(2, float_bits=24),
        lambda: qsgd(0),
        lambda: qsgd(2.5),
        lambda: qsgd(4, float_bits=128),
        lambda: identity(8),
        lambda: identity(32.0),
        lambda: top_k(),
        lambda: top_k(0),
        lambda: top_k(2, fraction=0.5),
        lambda: top_k(2.0),
        lambda: top_k(fraction=1.5),
        lambda: top_k(3, float_bits=8),
        lambda: rand_k_unscaled(),
        lambda: rand_k_unscaled(-1),
        lambda: rand_k_unscaled(fraction=0.0),
        lambda: rand_k_unscaled(fraction="0.5"),
        lambda: rand_k_unscaled(fraction=0.5, float_bits=128),
        lambda: natural(24),
        lambda: natural(32.0),
        lambda: natural(contractive=1),
        lambda: natural(contractive="yes"),
        lambda: qsgd(4, contractive=None),
        lambda: qsgd(0, contractive=True),
    ],
)
def test_invalid_constructor_arguments(make) -> None:
    with pytest.raises(ConfigError):
        make()


def test_invalid_call_arguments() -> None:
    key, x = jax.random.key(0), _vector(10)
    with pytest.raises(ConfigError, match="k <= 10"):
        rand_k(11)(key, x)
    with pytest.raises(ConfigError, match="k <= 10"):
        jax.jit(rand_k(11))(key, x)
    with pytest.raises(ConfigError):
        rand_k(11).bits(10)
    with pytest.raises(ConfigError, match="compress_tree"):
        qsgd(2)(key, x.reshape(2, 5))
    with pytest.raises(ConfigError):
        identity()(key, jnp.arange(10))
    with pytest.raises(ConfigError):
        identity().bits(0)
    for c in (top_k(11), rand_k_unscaled(11), scale_to_contractive(rand_k(11))):
        with pytest.raises(ConfigError, match="k <= 10"):
            c(key, x)
        with pytest.raises(ConfigError, match="k <= 10"):
            c.alpha(10)
        with pytest.raises(ConfigError, match="k <= 10"):
            c.bits(10)
    with pytest.raises(ConfigError, match="k <= 10"):
        jax.jit(top_k(11))(key, x)
    with pytest.raises(ConfigError, match="compress_tree"):
        natural(contractive=True)(key, x.reshape(2, 5))
    with pytest.raises(ConfigError):
        natural().bits(0)


def test_require_unbiased_and_contractive() -> None:
    for c in UNBIASED:
        assert require_unbiased(c, "QLSD") is c
    with pytest.raises(ConfigError, match=r"QLSD.*rand_k.*qsgd"):
        require_unbiased(_TopOne(), "QLSD")
    for c in (identity(), _TopOne()):
        assert require_contractive(c, "EF21") is c
    for c in (rand_k(3), rand_k(fraction=0.9), qsgd(4)):
        with pytest.raises(ConfigError, match=r"EF21.*top_k"):
            require_contractive(c, "EF21")
    with pytest.raises(ConfigError):
        require_unbiased("rand_k", "QLSD")


def test_compress_tree() -> None:
    tree = {"a": jnp.arange(6.0).reshape(2, 3), "b": jnp.asarray(-1.5), "c": {"d": _vector(4)}}
    tree_hat, bits = compress_tree(identity(), jax.random.key(4), tree)
    assert jax.tree.structure(tree_hat) == jax.tree.structure(tree)
    for leaf, leaf_hat in zip(jax.tree.leaves(tree), jax.tree.leaves(tree_hat)):
        assert leaf_hat.shape == leaf.shape and np.array_equal(leaf_hat, leaf)
    assert int(bits) == 11 * 32
    tree_hat, bits = jax.jit(lambda key: compress_tree(rand_k(2), key, tree))(jax.random.key(5))
    assert [leaf.shape for leaf in jax.tree.leaves(tree_hat)] == [(2, 3), (), (4,)]
    assert sum(int(np.count_nonzero(leaf)) for leaf in jax.tree.leaves(tree_hat)) <= 2
    assert int(bits) == 2 * (32 + 4)


@pytest.mark.parametrize("comp", [
    fb_compress.top_k(3), fb_compress.rand_k(3), fb_compress.rand_k_unscaled(3), fb_compress.qsgd(4),
    fb_compress.qsgd(4, contractive=True), fb_compress.natural(), fb_compress.natural(contractive=True),
], ids=str)
def test_compressors_are_odd(comp):
    # C(-x) has the law of -C(x); with a shared key the draws are exactly opposite. Error feedback's
    # exact stationary mean on Gaussian targets rests on this.
    x = jax.random.normal(jax.random.PRNGKey(0), (12,))
    keys = jax.random.split(jax.random.PRNGKey(1), 50)
    plus = jax.vmap(lambda k: comp(k, x)[0])(keys)
    minus = jax.vmap(lambda k: comp(k, -x)[0])(keys)
    np.testing.assert_array_equal(minus, -plus)


WIRE = ALL + (identity(16), identity(64), rand_k(3, float_bits=16), top_k(2, float_bits=64), qsgd(16, float_bits=16),
              natural(16), natural(64), scale_to_contractive(rand_k(2)))


@pytest.mark.parametrize("d", [1, 7, 1025])
def test_wire_format_round_trip(d: int) -> None:
    """pack writes exactly bits(d) bits (ceil(bits / 8) bytes), and unpack + decode gives C(x) bit for bit
    (float32 arithmetic: the exact case of the wire)."""
    from fedbayes.compress import BitReader, BitWriter

    x = _vector(d).astype(jnp.float32) * 3.0
    x = x.at[0].set(0.0) if d > 1 else x  # a zero coordinate (QSGD level 0, natural's code 0)
    for c in WIRE:
        if d == 1 and getattr(getattr(c, "base", c), "k", None) not in (None, 1):
            continue  # keeps more coordinates than there are
        assert c.has_wire_format, c
        key = jax.random.key(d)
        message, x_hat, bits = c.coded(key, x)
        np.testing.assert_array_equal(x_hat, c(key, x)[0], err_msg=repr(c))
        writer = BitWriter()
        c.pack(writer, tuple(np.asarray(v) for v in message.codes), d)
        data = writer.tobytes()
        assert writer.bits == int(bits) == c.bits(d), c
        assert len(data) == -(-c.bits(d) // 8), c
        codes = c.unpack(BitReader(data), d, np.float32)
        np.testing.assert_array_equal(np.asarray(c.decode(tuple(jnp.asarray(v) for v in codes), d)), np.asarray(x_hat),
                                      err_msg=repr(c))


def test_wire_format_of_a_compressor_without_one() -> None:
    from fedbayes.compress import BitWriter

    c = _TopOne()
    assert not c.has_wire_format
    message, _, _ = c.coded(jax.random.key(0), jnp.ones(3))
    with pytest.raises(ConfigError, match="no wire format"):
        c.pack(BitWriter(), message.codes, 3)


# ------------------------------------------------------------------ range: huge, tiny, subnormal
# Every compressor maps finite vectors to finite ones, and a vector with a nonzero coordinate to a
# nonzero one where its definition allows: identity, top_k and natural (and their rescaled
# versions) always; the sparsifiers rand_k and rand_k_unscaled exactly when a kept coordinate is
# nonzero (they may drop all of them); qsgd sends a positive norm, and keeps a nonzero level where
# levels^2 >= 2d (the largest coordinate then has s r_j >= sqrt 2). XLA on CPU flushes subnormal
# numbers to zero in arithmetic, so these are checked on vectors of any scale, subnormals included.

RANGE = (identity(), identity(16), identity(64), rand_k(1), rand_k(fraction=0.5, float_bits=16),
         rand_k_unscaled(1, float_bits=16), top_k(1), top_k(1, float_bits=16), top_k(fraction=0.5, float_bits=64),
         qsgd(1), qsgd(3, float_bits=16), qsgd(16), qsgd(4, contractive=True), natural(), natural(16), natural(64),
         natural(16, contractive=True), scale_to_contractive(rand_k(1)), scale_to_contractive(rand_k(1, float_bits=16)))
RANGE_DIMS = (1, 6)

# CI runs a fixed set of examples (derandomised); FB_PROP_EXAMPLES=1000 explores afresh.
_EXPLORE = os.environ.get("FB_PROP_EXAMPLES")
RANGE_PROPS = settings(max_examples=int(_EXPLORE or 100), deadline=None, derandomize=_EXPLORE is None,
                       suppress_health_check=[HealthCheck.too_slow])


def _guarantee(c: Compressor) -> str:
    base = getattr(c, "base", c)
    if isinstance(base, (fb_compress._RandK, fb_compress._RandKUnscaled)):
        return "kept"
    return "levels" if isinstance(base, fb_compress._QSGD) else "always"


def _exact_wire(c: Compressor, dtype: np.dtype) -> bool:
    """Whether the message carries the codes bit for bit: always in float32; in float64 where no float
    crosses at 32 bits (natural sends exponents; 16-bit floats are float16 with a shared binade)."""
    return dtype == np.float32 or _float_bits(c) != 32 or "natural" in c.name


@functools.cache
def _range_program(d: int, dtype: np.dtype):
    return jax.jit(lambda key, x: [c.coded(key, x) for c in RANGE])


def _floats(width: int) -> st.SearchStrategy[float]:
    """Finite floats of a width: hypothesis's (zeros, subnormals, the largest, ...) and m 2^e with e
    spread over the whole exponent range, so that one vector mixes scales."""
    e_lo, e_hi = {32: (-150, 127), 64: (-1075, 1023)}[width]
    spread = st.builds(math.ldexp, st.floats(-1.99, 1.99), st.integers(e_lo, e_hi))
    return st.one_of(st.just(0.0), st.floats(width=width, allow_nan=False, allow_infinity=False), spread)


def _check_range(dtype: type, x: np.ndarray, seed: int) -> None:
    """The range guarantees on C(x) (see above), and the message: exactly bits(d) bits, from which
    unpack reads the codes that were sent (decode, a function of the codes, then gives C(x))."""
    from fedbayes.compress import BitReader, BitWriter

    d = x.shape[0]
    x = x.astype(dtype)
    assert np.all(np.isfinite(x))
    nonzero = bool(np.any(x != 0))
    results = _range_program(d, np.dtype(dtype))(jax.random.key(seed), jnp.asarray(x))
    for c, (message, x_hat, bits) in zip(RANGE, results):
        x_hat, codes = np.asarray(x_hat), tuple(np.asarray(v) for v in message.codes)
        assert x_hat.dtype == dtype and np.all(np.isfinite(x_hat)), (c, x, x_hat)
        guarantee = _guarantee(c)
        if guarantee == "always":
            assert np.any(x_hat != 0) == nonzero, (c, x, x_hat)
        elif guarantee == "kept":
            assert np.any(x_hat != 0) == bool(np.any(x[codes[0]] != 0)), (c, x, x_hat)
        else:
            sent = codes[-2]  # the norm (at 16 bits its float16 number, the norm / 2^(b - 14))
            assert (sent > 0) == nonzero and np.isfinite(sent), (c, x, codes)
            if getattr(c, "base", c).levels ** 2 >= 2 * d:
                assert np.any(x_hat != 0) == nonzero, (c, x, x_hat)
        writer = BitWriter()
        with np.errstate(over="ignore"):  # float64 values beyond float32 cross at 32 bits as inf
            c.pack(writer, codes, d)
        assert writer.bits == int(bits) == c.bits(d), c
        back = c.unpack(BitReader(writer.tobytes()), d, dtype)
        assert [(np.shape(v), np.asarray(v).dtype) for v in back] == [(v.shape, v.dtype) for v in codes], c
        if _exact_wire(c, np.dtype(dtype)):
            for sent, received in zip(codes, back):
                np.testing.assert_array_equal(received, sent, err_msg=repr(c))


# Besides the random ones, every run checks: all zeros, one nonzero (subnormal) coordinate, d = 1 at
# the dtype's largest and smallest numbers, and a vector mixing both ends of the range.
_F32, _F64 = np.finfo(np.float32), np.finfo(np.float64)
RANGE_EXAMPLES = {
    32: ([0.0] * 6, [0.0, 0.0, 0.0, -1e-45, 0.0, 0.0], [float(_F32.max)], [1e-45],
         [float(_F32.max), -1e-45, 1.0, 3e-39, -float(_F32.max), 65520.0]),
    64: ([0.0] * 6, [0.0, 0.0, 0.0, -5e-324, 0.0, 0.0], [float(_F64.max)], [5e-324],
         [float(_F64.max), -5e-324, 1.0, 1e-300, -1e300, 65520.0]),
}


def _with_examples(width: int):
    def decorate(test):
        for x in RANGE_EXAMPLES[width]:
            test = example(x=x, seed=0)(test)
        return test
    return decorate


@RANGE_PROPS
@given(x=st.sampled_from(RANGE_DIMS).flatmap(lambda d: st.lists(_floats(32), min_size=d, max_size=d)),
       seed=st.integers(0, 2**16))
@_with_examples(32)
def test_range_float32(x: list[float], seed: int) -> None:
    _check_range(np.float32, np.asarray(x, np.float32), seed)


@RANGE_PROPS
@given(x=st.sampled_from(RANGE_DIMS).flatmap(lambda d: st.lists(_floats(64), min_size=d, max_size=d)),
       seed=st.integers(0, 2**16))
@_with_examples(64)
def test_range_float64(x: list[float], seed: int) -> None:
    _check_range(np.float64, np.asarray(x), seed)


def test_ldexp_and_binade_match_numpy_on_every_kind_of_float() -> None:
    # fb_compress._ldexp (x 2^n on the bits) against numpy's ldexp, which the CPU does not flush:
    # random bit patterns (zeros, subnormals, normals, inf, NaN) and shifts across the whole range,
    # rounding included; a finite result beyond the range saturates. _binade against floor(log2).
    rng = np.random.default_rng(0)
    for dtype, span in ((np.float16, 40), (np.float32, 300), (np.float64, 2200)):
        width = np.dtype(dtype).itemsize * 8
        x = rng.integers(0, 2**width, size=20_000, dtype=np.uint64).astype(f"uint{width}").view(dtype)
        n = rng.integers(-span, span, size=x.size).astype(np.int32)
        n[::2] = rng.integers(-3, 4, size=n[::2].size)
        got = np.asarray(jax.jit(fb_compress._ldexp)(jnp.asarray(x), jnp.asarray(n)))
        with np.errstate(all="ignore"):  # float64 holds every float16 or float32 times 2^n exactly here
            exact = np.ldexp(x.astype(np.float64), n) if dtype != np.float64 else np.ldexp(x, n)
            expected = exact.astype(dtype)
            expected = np.where(np.isfinite(x) & np.isinf(expected), np.copysign(np.finfo(dtype).max, x), expected)
        same = (got.view(f"uint{width}") == expected.astype(dtype).view(f"uint{width}")) | (np.isnan(got) & np.isnan(x))
        assert same.all(), (dtype, x[~same][:3], n[~same][:3])
        b = np.asarray(jax.jit(fb_compress._binade)(jnp.asarray(x)))
        finite = np.isfinite(x) & (x != 0)
        np.testing.assert_array_equal(b[finite], np.floor(np.log2(np.abs(x[finite].astype(np.float64)))))
        assert np.all(b[~finite] == fb_compress._NO_BINADE)


def test_range_exact_references() -> None:
    # Float32 vectors beyond float16's range, beyond float32's squares, at float32's top and among
    # its subnormals, with the expected codes and outputs computed in numpy (which does not flush).
    f32 = np.float32
    big = np.finfo(f32).max
    key = jax.random.key(0)

    def run(c, x):
        message, x_hat, bits = jax.jit(c.coded)(key, jnp.asarray(x, f32))
        assert int(bits) == c.bits(len(x))
        return tuple(np.asarray(v) for v in message.codes), np.asarray(x_hat)

    # identity(16): b = 16 for 1e5, sent as float16(x / 4); 1e-10 / 4 is below float16: 0.
    x = np.asarray([1e5, -3.0, 1e-10, 0.0], f32)
    (b, h), x_hat = run(identity(16), x)
    assert b == 16
    np.testing.assert_array_equal(h, (x / f32(4)).astype(np.float16).astype(f32))
    np.testing.assert_array_equal(x_hat, h * f32(4))
    assert x_hat[0] == 99_968 and x_hat[1] == -3 and x_hat[2] == 0  # 25000 is a tie: to even, 24992
    # ... at float32's top: b = 127, the largest float32 rounds up to 2^15 2^113 = 2^128, which
    # saturates to the largest float32 (not inf).
    (b, h), x_hat = run(identity(16), np.asarray([big, -1.0], f32))
    assert b == 127 and h[0] == 2.0**15 and h[1] == 0
    np.testing.assert_array_equal(x_hat, [big, 0.0])
    # top_k(1, float_bits=16) on tiny normal and subnormal vectors: the kept value survives.
    for x in (np.asarray([5e-31, -1e-30, 0.0], f32), np.asarray([0.0, 3e-44, 1e-45], f32)):
        (idx, b, h), x_hat = run(top_k(1, float_bits=16), x)
        j = int(np.argmax(np.abs(x)))
        assert idx.tolist() == [j] and b == np.floor(np.log2(abs(float(x[j]))))
        assert h[0] == np.float16(np.ldexp(float(x[j]), 14 - int(b)))
        expected = np.where(np.arange(3) == j, np.ldexp(float(h[0]), int(b) - 14), 0).astype(f32)
        np.testing.assert_array_equal(x_hat, expected)
        assert x_hat[j] != 0
    # qsgd: ||(1e20, 1e20)|| overflows float32 squares; it is computed on x 2^-66 (b = 66) and sent
    # exactly as numpy's float32 arithmetic gives it. Beyond float32 it saturates, and so do the outputs.
    x = np.asarray([1e20, -1e20], f32)
    y = x * f32(2.0**-66)
    (norm, signed), x_hat = run(qsgd(1), x)
    assert norm == np.sqrt(y[0] * y[0] + y[1] * y[1]) * f32(2.0**66)
    np.testing.assert_array_equal(x_hat, norm * np.sign(signed).astype(f32) * np.abs(signed).astype(f32))
    (norm, signed), x_hat = run(qsgd(1), np.asarray([3e38, 3e38], f32))
    assert norm == big and np.all(np.isin(x_hat, [0.0, big]))
    # qsgd(16): the norm 1e5 (beyond float16; 1e5 in float32, as 1e10 + 9 is 1e10) is sent as
    # b = 16 and float16(norm / 4) = 24992 (25000 is a tie: to even).
    (b, h, signed), x_hat = run(qsgd(4, float_bits=16), np.asarray([1e5, 3.0], f32))
    assert b == 16 and h == 24_992
    assert signed[0] == 4 and x_hat[0] == f32(h) * 4
    # rand_k(1) on d = 2 sends 2 x_j: beyond float32 it saturates.
    (idx, values), x_hat = run(rand_k(1), np.asarray([3e38, -3e38], f32))
    np.testing.assert_array_equal(values, [np.copysign(big, [3e38, -3e38][int(idx[0])])])
    # rand_k(fraction=1.0) and natural(contractive=True) on subnormals: kept, not flushed (the
    # division by 9/8 is done at 2^0, then scaled to 2^-140).
    x = np.asarray([0.0, 1e-40, -(2.0**-140)], f32)
    np.testing.assert_array_equal(run(rand_k(fraction=1.0), x)[1], x)
    shrunk = run(natural(contractive=True), np.asarray([2.0**-140], f32))[1]
    np.testing.assert_array_equal(shrunk, [np.ldexp(f32(1) / f32(9 / 8), -140).astype(f32)])
    assert shrunk[0] != 0


@pytest.mark.parametrize("dtype, shifts", [(np.float32, (-110, 110)), (np.float64, (-1000, 1000))],
                         ids=["float32", "float64"])
def test_compressors_commute_with_powers_of_two(dtype, shifts) -> None:
    # With the same key, C(2^e x) = 2^e C(x) bit for bit for every compressor (16-bit floats and
    # natural's grid follow the vector's binade; qsgd's norm is computed on x 2^-b): at these far
    # scales the Monte Carlo tests of omega and alpha, run on x, hold draw for draw.
    x = np.asarray(_vector(10), dtype)
    keys = jax.random.split(jax.random.key(8), 4)
    scaled = np.stack([x] + [np.ldexp(x, e) for e in shifts])
    run = jax.jit(lambda keys, xs: [jax.vmap(lambda x: jax.vmap(c, (0, None))(keys, x)[0])(xs) for c in WIRE])
    for c, out in zip(WIRE, run(keys, jnp.asarray(scaled))):
        out = np.asarray(out)
        assert out.dtype == dtype and np.all(np.isfinite(out)), c
        for i, e in enumerate(shifts, start=1):
            np.testing.assert_array_equal(out[i], np.ldexp(out[0], e), err_msg=f"{c} at 2^{e}")
