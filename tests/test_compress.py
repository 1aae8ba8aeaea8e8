"""Tests of fedbayes.compress: unbiasedness and variance by Monte Carlo, exact bit counts, validation.

Monte Carlo tolerances: with N = 20000 independent draws, a sample mean is within Z = 5 of its
standard errors (empirical std / sqrt(N)) of its expectation except with probability about 6e-7
(normal approximation by the CLT); seeds are fixed, so the tests are deterministic.
"""

from __future__ import annotations

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
UNBIASED = [
    identity(),
    rand_k(1),
    rand_k(3),
    rand_k(fraction=0.5),
    rand_k(fraction=1.0),
    qsgd(1),
    qsgd(4),
    qsgd(16),
]


def _vector(d: int, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=d))


def _draws(c: Compressor, x: jax.Array, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    keys = jax.random.split(jax.random.key(seed), N)
    x_hat, bits = jax.jit(jax.vmap(lambda key: c(key, x)))(keys)
    return np.asarray(x_hat), np.asarray(bits)


def _mean_se(samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return samples.mean(0), samples.std(0, ddof=1) / math.sqrt(samples.shape[0])


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
    x_hat, bits = _draws(c, x)
    assert np.all(bits == c.bits(d))
    # Coordinate-wise |mean - x| <= Z SE; the 1e-12 absorbs rounding on coordinates with zero
    # spread (identity, rand_k with k = d).
    mean, se = _mean_se(x_hat)
    assert np.all(np.abs(mean - np.asarray(x)) <= Z * se + 1e-12)
    # E||C(x) - x||^2 <= omega ||x||^2, up to Z SE of the mean squared error.
    sq_err = np.sum((x_hat - np.asarray(x)) ** 2, axis=1)
    err_mean, err_se = _mean_se(sq_err)
    assert err_mean <= c.omega(d) * float(x @ x) + Z * err_se + 1e-12


@pytest.mark.parametrize("d", [10, 50])
@pytest.mark.parametrize("c", [rand_k(1), rand_k(3), rand_k(fraction=0.5)], ids=repr)
def test_rand_k_variance_equals_omega(c: Compressor, d: int) -> None:
    # For scaled rand-k, E||C(x) - x||^2 = (d/k - 1) ||x||^2 exactly: the MC mean is within Z SE.
    x = _vector(d, seed=2)
    x_hat, _ = _draws(c, x)
    err_mean, err_se = _mean_se(np.sum((x_hat - np.asarray(x)) ** 2, axis=1))
    assert abs(err_mean - c.omega(d) * float(x @ x)) <= Z * err_se


@pytest.mark.parametrize("d", [10, 50])
@pytest.mark.parametrize("s", [1, 4, 16])
def test_qsgd_variance_matches_closed_form(s: int, d: int) -> None:
    x = _vector(d, seed=3)
    exact = _qsgd_variance(np.asarray(x), s)
    assert exact <= qsgd(s).omega(d) * float(x @ x)
    x_hat, _ = _draws(qsgd(s), x)
    err_mean, err_se = _mean_se(np.sum((x_hat - np.asarray(x)) ** 2, axis=1))
    assert abs(err_mean - exact) <= Z * err_se


@pytest.mark.parametrize(
    ("d", "s", "ratio"),
    [
        # sqrt(d)/s regime (s < sqrt d): |x_j| all equal gives p_j = 1/sqrt(d), so
        # E||Q - x||^2 = (sqrt(d) - 1) ||x||^2 / s^2 = (1 - 1/sqrt(d)) omega ||x||^2.
        (50, 1, 1 - 1 / math.sqrt(50)),
        # d/s^2 regime (s > sqrt d): s|x_j|/||x|| = 1.5 gives p_j = 1/2, the largest per-coordinate
        # variance, E||Q - x||^2 = d ||x||^2 / (4 s^2) = omega ||x||^2 / 4.
        (4, 3, 0.25),
    ],
)
def test_qsgd_variance_in_bound_regimes(d: int, s: int, ratio: float) -> None:
    x = jnp.asarray(np.where(np.arange(d) % 2 == 0, 1.0, -1.0))
    bound = qsgd(s).omega(d) * float(x @ x)
    x_hat, _ = _draws(qsgd(s), x)
    err_mean, err_se = _mean_se(np.sum((x_hat - np.asarray(x)) ** 2, axis=1))
    assert abs(err_mean - ratio * bound) <= Z * err_se


def _index_bits(d: int) -> int:
    return max(1, math.ceil(math.log2(d))) if d > 1 else 1


@pytest.mark.parametrize("d", [1, 2, 3, 7, 8, 9, 10, 50, 1000, 1024, 1025])
def test_bits_match_documented_formulas(d: int) -> None:
    expected = {
        identity(): 32 * d,
        identity(16): 16 * d,
        rand_k(1): 32 + _index_bits(d),
        rand_k(fraction=0.5): max(1, round(0.5 * d)) * (32 + _index_bits(d)),
        rand_k(fraction=1.0, float_bits=64): d * (64 + _index_bits(d)),
        qsgd(1): 32 + d * 2,
        qsgd(4): 32 + d * (1 + 3),
        qsgd(16, float_bits=16): 16 + d * (1 + 5),
    }
    for c, bits in expected.items():
        assert c.bits(d) == bits, c
    if d in (1, 3, 10, 1025):
        x = _vector(d)
        for c, bits in expected.items():
            _, message_bits = c(jax.random.key(0), x)
            assert message_bits.shape == () and message_bits.dtype == jnp.int32
            assert int(message_bits) == bits, c


@given(d=st.integers(1, 10**6), k=st.integers(1, 10**6), s=st.integers(1, 10**4))
def test_bits_formulas_property(d: int, k: int, s: int) -> None:
    index_bits = max(1, math.ceil(math.log2(d)))
    assert rand_k(min(k, d)).bits(d) == min(k, d) * (32 + index_bits)
    assert qsgd(s).bits(d) == 32 + d * (1 + math.ceil(math.log2(s + 1)))


def test_flags_agree_with_constants() -> None:
    for c in [*UNBIASED, _TopOne()]:
        for d in (3, 10):
            assert (c.omega(d) is not None) == c.unbiased
            assert (c.alpha(d) is not None) == c.contractive
    assert identity().omega(7) == 0.0 and identity().alpha(7) == 1.0
    assert rand_k(2).omega(10) == pytest.approx(4.0)
    assert qsgd(1).omega(16) == pytest.approx(4.0) and qsgd(8).omega(16) == pytest.approx(0.25)


def test_rand_k_fraction_resolves_k() -> None:
    assert [rand_k(fraction=0.3).bits(10), rand_k(fraction=0.01).bits(10), rand_k(fraction=1.0).bits(10)] == [
        k * (32 + 4) for k in (3, 1, 10)
    ]


@pytest.mark.parametrize(("d", "k"), [(1, 1), (10, 1), (10, 4), (10, 10), (50, 7)])
def test_rand_k_keeps_exactly_k_scaled_coordinates(d: int, k: int) -> None:
    x = _vector(d) + 10.0  # no zero coordinates
    keys = jax.random.split(jax.random.key(4), 200)
    x_hat = np.asarray(jax.vmap(lambda key: rand_k(k)(key, x)[0])(keys))
    kept = x_hat != 0
    assert np.all(kept.sum(1) == k)
    np.testing.assert_allclose(x_hat[kept], np.broadcast_to(np.asarray(x) * d / k, x_hat.shape)[kept], rtol=1e-12)
    assert kept.any(0).all()  # every coordinate gets selected at some point


@pytest.mark.parametrize("s", [1, 4, 16])
def test_qsgd_outputs_lie_on_grid(s: int) -> None:
    x = _vector(50, seed=5)
    norm = float(jnp.linalg.norm(x))
    keys = jax.random.split(jax.random.key(6), 200)
    x_hat = np.asarray(jax.vmap(lambda key: qsgd(s)(key, x)[0])(keys))
    levels = x_hat * s / norm
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-9)
    assert np.all(np.abs(np.round(levels)) <= s)
    assert np.all((x_hat == 0) | (np.sign(x_hat) == np.sign(np.asarray(x))))


@pytest.mark.parametrize("c", UNBIASED, ids=repr)
def test_zero_vector_maps_to_zero(c: Compressor) -> None:
    x_hat, _ = c(jax.random.key(7), jnp.zeros(10))
    assert np.all(np.asarray(x_hat) == 0.0)


def test_preserves_dtype_and_shape() -> None:
    x = _vector(10).astype(jnp.float32)
    for c in UNBIASED:
        x_hat, _ = c(jax.random.key(8), x)
        assert x_hat.shape == x.shape and x_hat.dtype == jnp.float32


def test_jit_static_compressor_and_vmap_bits() -> None:
    apply = jax.jit(lambda c, key, x: c(key, x), static_argnums=0)
    x = _vector(10)
    assert rand_k(3) == rand_k(3) and hash(rand_k(3)) == hash(rand_k(3))
    for c in UNBIASED:
        x_jit, bits_jit = apply(c, jax.random.key(9), x)
        x_eager, bits_eager = c(jax.random.key(9), x)
        np.testing.assert_allclose(x_jit, x_eager, rtol=1e-12)
        assert int(bits_jit) == int(bits_eager) == c.bits(10)
        x_hat, bits = jax.vmap(c, in_axes=(0, None))(jax.random.split(jax.random.key(10), 5), x)
        assert x_hat.shape == (5, 10) and bits.shape == (5,) and bits.dtype == jnp.int32
        assert np.all(np.asarray(bits) == c.bits(10))


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
    tree_hat, bits = compress_tree(identity(), jax.random.key(11), tree)
    assert jax.tree.structure(tree_hat) == jax.tree.structure(tree)
    for leaf, leaf_hat in zip(jax.tree.leaves(tree), jax.tree.leaves(tree_hat)):
        assert leaf_hat.shape == leaf.shape and np.array_equal(leaf_hat, leaf)
    assert int(bits) == 11 * 32
    tree_hat, bits = jax.jit(lambda key: compress_tree(rand_k(2), key, tree))(jax.random.key(12))
    assert [leaf.shape for leaf in jax.tree.leaves(tree_hat)] == [(2, 3), (), (4,)]
    assert sum(int(np.count_nonzero(leaf)) for leaf in jax.tree.leaves(tree_hat)) <= 2
    assert int(bits) == 2 * (32 + 4)
