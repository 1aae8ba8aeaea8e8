"""Tests of fedbayes.compress: Monte Carlo unbiasedness and variance, exact bit counts, validation.

Monte Carlo tolerances: with N = 20000 independent draws, a sample mean lies within Z = 5 of its
standard errors (empirical std / sqrt(N)) of its expectation except with probability about 6e-7
(normal approximation by the CLT); seeds are fixed, so the tests are deterministic. Draws of all
compressors on one vector come from a single jitted vmap and are shared between tests, because
compiling the vmapped PRNG dominates the runtime.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedbayes.compress import (
    Compressor,
    compress_tree,
    identity,
    qsgd,
    rand_k,
    require_contractive,
    require_unbiased,
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
)
RAND_K = UNBIASED[1:5]
QSGD = UNBIASED[5:]


def _vector(d: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(d).normal(size=d))


@functools.cache
def _draws(d: int) -> dict[Compressor, tuple[np.ndarray, np.ndarray]]:
    """N draws of (C(x), bits) for every c in UNBIASED on x = _vector(d), in one compilation."""
    run = jax.jit(lambda keys, x: [jax.vmap(c, in_axes=(0, None))(keys, x) for c in UNBIASED])
    draws = run(jax.random.split(jax.random.key(d), N), _vector(d))
    return {c: (np.asarray(x_hat), np.asarray(bits)) for c, (x_hat, bits) in zip(UNBIASED, draws)}


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


@pytest.mark.parametrize("d", [1, 2, 3, 7, 8, 9, 10, 50, 1000, 1024, 1025])
def test_bits_match_documented_formulas(d: int) -> None:
    for c, bits in _expected_bits(d).items():
        assert c.bits(d) == bits, c


@pytest.mark.parametrize("d", [1, 1025])
def test_message_bits_equal_bits(d: int) -> None:
    expected = _expected_bits(d)
    x = _vector(d)
    results = jax.jit(lambda key, x: [c(key, x) for c in expected])(jax.random.key(0), x)
    for (c, bits), (x_hat, message_bits) in zip(expected.items(), results):
        assert x_hat.shape == (d,) and message_bits.shape == () and message_bits.dtype == jnp.int32
        assert int(message_bits) == bits, c
        if d == 1:  # every compressor is exact on one coordinate (k = d, s|x_1|/||x|| = s)
            np.testing.assert_allclose(x_hat, x, rtol=1e-15, err_msg=repr(c))


@given(d=st.integers(1, 10**6), k=st.integers(1, 10**6), s=st.integers(1, 10**4))
def test_bits_formulas_property(d: int, k: int, s: int) -> None:
    index_bits = max(1, math.ceil(math.log2(d)))
    assert rand_k(min(k, d)).bits(d) == min(k, d) * (32 + index_bits)
    assert qsgd(s).bits(d) == 32 + d * (1 + math.ceil(math.log2(s + 1)))


def test_constants_and_flags() -> None:
    for c in (*UNBIASED, _TopOne()):
        for d in (3, 10):
            assert (c.omega(d) is not None) == c.unbiased
            assert (c.alpha(d) is not None) == c.contractive
    assert identity().omega(7) == 0.0 and identity().alpha(7) == 1.0
    assert rand_k(2).omega(10) == pytest.approx(4.0)
    assert qsgd(1).omega(16) == pytest.approx(4.0) and qsgd(8).omega(16) == pytest.approx(0.25)
    # k = max(1, round(fraction * d)): 3, 1 and 10 coordinates of 10, 4 index bits each.
    bits = [rand_k(fraction=f).bits(10) for f in (0.3, 0.01, 1.0)]
    assert bits == [k * (32 + 4) for k in (3, 1, 10)]


def test_zero_vector_maps_to_zero_and_dtype_is_kept() -> None:
    run = jax.jit(lambda key, x: [c(key, x)[0] for c in UNBIASED])
    for x_hat, c in zip(run(jax.random.key(2), jnp.zeros(10, jnp.float32)), UNBIASED):
        assert x_hat.shape == (10,) and x_hat.dtype == jnp.float32, c
        assert np.all(np.asarray(x_hat) == 0.0), c


def test_jit_with_static_compressor() -> None:
    apply = jax.jit(lambda c, key, x: c(key, x), static_argnums=0)
    x, key = _vector(10), jax.random.key(3)
    assert rand_k(3) == rand_k(3) and hash(rand_k(3)) == hash(rand_k(3)) and rand_k(3) != rand_k(4)
    for c in (rand_k(3), qsgd(4)):
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
