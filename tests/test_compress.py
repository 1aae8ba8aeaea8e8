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
import re
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fedbayes.compress as fb_compress
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


def test_natural_edge_cases_and_top_k_ties() -> None:
    # N draws, one compilation, of: natural on float32 zeros, subnormals, the normal bottom and
    # the overflowing top of float32; natural(16) on float64 values outside the float16 range;
    # natural on a vector where the variance bound 1/8 is attained; top_k on tied magnitudes.
    x32 = jnp.asarray(
        [0.0, -0.0, 1e-40, 2.0**-130, 2.0**-126, 1.5, -3.0e38, 3.4e38, -jnp.inf], jnp.float32
    )
    x16 = jnp.asarray([1e5, 2.0**15, -4e4, 2.0**-16, 1e-300, 0.3, -1e300, 0.0])
    tight = jnp.asarray(4 / 3 * 2.0 ** np.arange(-3, 5) * np.where(np.arange(8) % 3, 1, -1))
    ties = jnp.asarray([1.0, -1.0, 1.0, 0.5, -1.0])

    @jax.jit
    def run(keys):
        draw = lambda c, x: jax.vmap(c, (0, None))(keys, x)[0]  # noqa: E731
        cases = [(natural(), x32), (natural(16), x16), (natural(), tight), (top_k(2), ties)]
        return [draw(c, x) for c, x in cases]

    n32, n16, nt, tk = map(np.asarray, run(jax.random.split(jax.random.key(6), N)))
    # float32 wire: grid 0, 2^-126 .. 2^127. Zeros stay zero; a subnormal goes to 0 or 2^-126
    # (the CPU may treat subnormal inputs as zero, so only membership is checked); 2^-126 is on
    # the grid; the top binade saturates to 2^127 instead of overflowing; -inf stays -inf.
    assert n32.dtype == np.float32 and not np.isnan(n32).any()
    assert np.all(n32[:, :2] == 0)
    assert np.isin(n32[:, 2:4], [0.0, 2.0**-126]).all() and np.all(n32[:, 4] == 2.0**-126)
    assert np.isin(n32[:, 5], [1.0, 2.0]).all()
    assert np.all(n32[:, 6] == -(2.0**127)) and np.all(n32[:, 7] == 2.0**127)
    assert np.all(n32[:, 8] == -np.inf)
    # float16 wire on float64 input: grid 0, 2^-14 .. 2^15; values at or above 2^15 saturate and
    # 0 stays 0; 2^-16 goes to 2^-14 with probability 1/4 and 0.3 to 0.5 with probability 0.2,
    # both unbiased (mean within Z SE).
    saturated = [2.0**15, 2.0**15, -(2.0**15), -(2.0**15), 0.0]
    np.testing.assert_array_equal(n16[:, [0, 1, 2, 6, 7]], np.broadcast_to(saturated, (N, 5)))
    assert np.isin(n16[:, 3], [0.0, 2.0**-14]).all() and np.isin(n16[:, 4], [0.0, 2.0**-14]).all()
    assert np.isin(n16[:, 5], [0.25, 0.5]).all()
    mean, se = _mean_se(n16[:, [3, 5]])
    assert np.all(np.abs(mean - [2.0**-16, 0.3]) <= Z * se)
    # |x_j| = (4/3) 2^e: E(C(x)_j - x_j)^2 = x_j^2 / 8, so the MC error matches omega ||x||^2.
    err, err_se = _sq_err(nt, tight)
    assert abs(err - float(tight @ tight) / 8) <= Z * err_se
    # Ties: the same two of the four coordinates with |x_j| = 1 on every draw; error 1 + 1 + 1/4.
    assert np.all(tk == tk[0]) and np.count_nonzero(tk[0]) == 2
    assert np.all(np.abs(tk[0][tk[0] != 0]) == 1.0)
    assert np.sum((tk[0] - np.asarray(ties)) ** 2) == 2.25


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
    index_bits = max(1, math.ceil(math.log2(d)))
    return {
        identity(): 32 * d,
        identity(16): 16 * d,
        rand_k(1): 32 + index_bits,
        rand_k(fraction=0.5): max(1, round(0.5 * d)) * (32 + index_bits),
        rand_k(fraction=1.0, float_bits=64): d * (64 + index_bits),
        qsgd(1): 32 + d * 2,
        qsgd(4): 32 + d * (1 + 3),
        qsgd(16, float_bits=16): 16 + d * (1 + 5),
    }


def _expected_contractive_bits(d: int) -> dict[Compressor, int]:
    """Bits of the contractive compressors and of natural: sparsifiers send k values and indices,
    natural a sign bit and a 5, 8 or 11-bit exponent per coordinate, scaling keeps the message."""
    index_bits = max(1, math.ceil(math.log2(d)))
    return {
        top_k(1): 32 + index_bits,
        top_k(fraction=0.5, float_bits=16): max(1, round(0.5 * d)) * (16 + index_bits),
        rand_k_unscaled(1, float_bits=64): 64 + index_bits,
        rand_k_unscaled(fraction=0.3): max(1, round(0.3 * d)) * (32 + index_bits),
        natural(): 9 * d,
        natural(16): 6 * d,
        natural(64): 12 * d,
        natural(contractive=True): 9 * d,
        natural(16, contractive=True): 6 * d,
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
    assert natural().bits(d) == 9 * d and natural(64, contractive=True).bits(d) == 12 * d


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
