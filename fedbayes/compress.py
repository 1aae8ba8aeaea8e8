"""Message compressors for federated communication.

A compressor C maps a vector x in R^d to a random C(x) that is cheap to transmit and reports the
exact length, in bits, of the message it sends. Algorithms rely on one of two properties:

* unbiased with variance constant omega >= 0:  E[C(x)] = x  and  E||C(x) - x||^2 <= omega ||x||^2;
* contractive with constant alpha in (0, 1]:   E||C(x) - x||^2 <= (1 - alpha) ||x||^2.

Compressors are frozen dataclasses, hence hashable and usable as static arguments of `jax.jit`.
Calling one is pure JAX (the vector length d is static) and works under `jit` and `vmap`.
"""

from __future__ import annotations

import abc
import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from fedbayes.errors import ConfigError

__all__ = [
    "Compressor",
    "compress_tree",
    "identity",
    "qsgd",
    "rand_k",
    "require_contractive",
    "require_unbiased",
]

_INT32_MAX = 2**31 - 1


def _integer(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _float_bits(value: object) -> int:
    bits = _integer(value, "float_bits")
    if bits not in (16, 32, 64):
        raise ConfigError(f"float_bits (bits per sent float) must be 16, 32 or 64, got {bits}")
    return bits


def _dimension(d: object) -> int:
    d = _integer(d, "the vector length d")
    if d < 1:
        raise ConfigError(f"cannot compress a vector of length {d}; it needs a coordinate")
    return d


def _index_bits(d: int) -> int:
    """Bits of one coordinate index in [0, d): max(1, ceil(log2 d))."""
    return max(1, (d - 1).bit_length())


class Compressor(abc.ABC):
    """A random map C: R^d -> R^d with the exact bit length of its message.

    `unbiased` is True exactly when `omega(d)` is a float (not None) for every valid d, and
    `contractive` exactly when `alpha(d)` is. Unbiased compressors report alpha = None even where
    omega < 1; C / (1 + omega) is contractive with alpha = 1 / (1 + omega). Subclasses implement
    `name`, `bits`, `omega`, `alpha` and `_compress`; a variable-length encoding overrides
    `__call__`.
    """

    unbiased: ClassVar[bool]
    contractive: ClassVar[bool]

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The constructor call that builds this compressor, e.g. ``rand_k(k=5)``."""

    @abc.abstractmethod
    def bits(self, d: int) -> int:
        """Exact number of bits of one message encoding a d-vector."""

    @abc.abstractmethod
    def omega(self, d: int) -> float | None:
        """Variance constant: E[C(x)] = x, E||C(x) - x||^2 <= omega ||x||^2; None if biased."""

    @abc.abstractmethod
    def alpha(self, d: int) -> float | None:
        """Contraction constant: E||C(x) - x||^2 <= (1 - alpha) ||x||^2; None if not contractive."""

    @abc.abstractmethod
    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        """The decoded message C(x) of a 1-D floating vector x (same shape and dtype)."""

    def __call__(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Return (C(x), bits): the decoded vector and the int32 bit length of its message.

        Every encoding here has a fixed length, so bits == self.bits(d).
        """
        x = jnp.asarray(x)
        if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ConfigError(
                f"{self.name} compresses 1-D floating vectors, got shape {x.shape} and dtype "
                f"{x.dtype}; use compress_tree for pytrees"
            )
        bits = self.bits(x.shape[0])
        if bits > _INT32_MAX:
            raise ConfigError(
                f"a {self.name} message of {bits} bits overflows int32; compress smaller blocks"
            )
        return self._compress(key, x), jnp.asarray(bits, dtype=jnp.int32)

    def __repr__(self) -> str:
        return self.name


@dataclass(frozen=True, repr=False)
class _Identity(Compressor):
    """C(x) = x, sent as d floats: bits = d * float_bits, omega = 0, alpha = 1."""

    float_bits: int
    unbiased: ClassVar[bool] = True
    contractive: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return "identity()" if self.float_bits == 32 else f"identity(float_bits={self.float_bits})"

    def bits(self, d: int) -> int:
        return _dimension(d) * self.float_bits

    def omega(self, d: int) -> float:
        _dimension(d)
        return 0.0

    def alpha(self, d: int) -> float:
        _dimension(d)
        return 1.0

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        return x


@dataclass(frozen=True, repr=False)
class _RandK(Compressor):
    """Scaled random sparsification: C(x) = (d/k) sum_{j in S} x_j e_j, S uniform of size k.

    P(j in S) = k/d gives E[C(x)] = x and E||C(x) - x||^2 = (d/k - 1) ||x||^2 exactly, so
    omega = d/k - 1. The message is k values and k indices of max(1, ceil(log2 d)) bits each:
    bits = k (float_bits + max(1, ceil(log2 d))). Not contractive: alpha is None.
    """

    k: int | None
    fraction: float | None
    float_bits: int
    unbiased: ClassVar[bool] = True
    contractive: ClassVar[bool] = False

    @property
    def name(self) -> str:
        size = f"k={self.k}" if self.k is not None else f"fraction={self.fraction}"
        extra = "" if self.float_bits == 32 else f", float_bits={self.float_bits}"
        return f"rand_k({size}{extra})"

    def kept(self, d: int) -> int:
        """k, or max(1, round(fraction * d)) (Python's round: halves go to even)."""
        d = _dimension(d)
        if self.k is None:
            return max(1, round(self.fraction * d))
        if self.k > d:
            raise ConfigError(
                f"{self.name} keeps more coordinates than the vector has (d={d}); use k <= {d}"
            )
        return self.k

    def bits(self, d: int) -> int:
        return self.kept(d) * (self.float_bits + _index_bits(d))

    def omega(self, d: int) -> float:
        return d / self.kept(d) - 1.0

    def alpha(self, d: int) -> None:
        self.kept(d)
        return None

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        d = x.shape[0]
        k = self.kept(d)
        chosen = jax.random.choice(key, d, shape=(k,), replace=False)
        return jnp.zeros_like(x).at[chosen].set(x[chosen] * (d / k))


@dataclass(frozen=True, repr=False)
class _QSGD(Compressor):
    """QSGD stochastic quantisation with s = levels (Alistarh et al., 2017).

    C(x)_j = ||x||_2 sign(x_j) xi_j / s, where with r_j = |x_j| / ||x||_2 and l = floor(s r_j),
    xi_j = l + 1 with probability s r_j - l and l otherwise, so E[xi_j] = s r_j and E[C(x)] = x;
    C(0) = 0. Lemma 3.1 gives omega = min(d / s^2, sqrt(d) / s). The message is the norm as one
    float, then per coordinate a sign bit and xi_j in ceil(log2(s + 1)) bits:
    bits = float_bits + d (1 + ceil(log2(s + 1))). Not contractive: alpha is None.
    """

    levels: int
    float_bits: int
    unbiased: ClassVar[bool] = True
    contractive: ClassVar[bool] = False

    @property
    def name(self) -> str:
        extra = "" if self.float_bits == 32 else f", float_bits={self.float_bits}"
        return f"qsgd(levels={self.levels}{extra})"

    def bits(self, d: int) -> int:
        return self.float_bits + _dimension(d) * (1 + self.levels.bit_length())

    def omega(self, d: int) -> float:
        d = _dimension(d)
        return min(d / self.levels**2, math.sqrt(d) / self.levels)

    def alpha(self, d: int) -> None:
        _dimension(d)
        return None

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        s = self.levels
        norm = jnp.linalg.norm(x)
        scaled = s * jnp.abs(x) / jnp.where(norm > 0, norm, 1)
        low = jnp.floor(scaled)
        up = jax.random.uniform(key, x.shape, x.dtype) < scaled - low
        # Rounding can push s|x_j|/||x|| a hair above s; clipping keeps xi_j on the grid {0..s}.
        level = jnp.minimum(low + up, s)
        return norm * jnp.sign(x) * level / s


def identity(float_bits: int = 32) -> Compressor:
    """No compression: C(x) = x, d floats of float_bits bits each; omega = 0, alpha = 1."""
    return _Identity(_float_bits(float_bits))


def rand_k(
    k: int | None = None, *, fraction: float | None = None, float_bits: int = 32
) -> Compressor:
    """Unbiased random-k sparsification keeping k (or max(1, round(fraction * d))) coordinates."""
    if (k is None) == (fraction is None):
        raise ConfigError("rand_k needs exactly one of k (coordinates kept) or fraction (share)")
    if k is not None:
        k = _integer(k, "k")
        if k < 1:
            raise ConfigError(f"rand_k keeps k >= 1 coordinates, got k={k}")
    else:
        if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
            raise ConfigError(f"fraction must be a number in (0, 1], got {fraction!r}")
        fraction = float(fraction)
        if not 0.0 < fraction <= 1.0:
            raise ConfigError(f"fraction (share of d kept) must be in (0, 1], got {fraction}")
    return _RandK(k, fraction, _float_bits(float_bits))


def qsgd(levels: int, *, float_bits: int = 32) -> Compressor:
    """Unbiased QSGD quantisation of |x_j| / ||x||_2 to the grid {0, 1/s, ..., 1}, s = levels."""
    levels = _integer(levels, "levels")
    if levels < 1:
        raise ConfigError(f"qsgd needs levels >= 1 quantisation levels, got {levels}")
    return _QSGD(levels, _float_bits(float_bits))


def _check_compressor(c: object, algorithm: str) -> None:
    if not isinstance(c, Compressor):
        raise ConfigError(f"{algorithm} needs a fedbayes Compressor, got {type(c).__name__}")


def require_unbiased(c: Compressor, algorithm: str) -> Compressor:
    """Return c if it is unbiased (E[C(x)] = x); otherwise raise ConfigError."""
    _check_compressor(c, algorithm)
    if not c.unbiased:
        raise ConfigError(
            f"{algorithm} needs an unbiased compressor (E[C(x)] = x), but {c.name} is biased; "
            "use rand_k(...) or qsgd(...)"
        )
    return c


def require_contractive(c: Compressor, algorithm: str) -> Compressor:
    """Return c if it is contractive (E||C(x) - x||^2 <= (1 - alpha) ||x||^2); else ConfigError."""
    _check_compressor(c, algorithm)
    if not c.contractive:
        raise ConfigError(
            f"{algorithm} needs a contractive compressor (E||C(x) - x||^2 <= (1 - alpha) ||x||^2), "
            f"but {c.name} is not; use top_k or unscaled rand_k"
        )
    return c


def compress_tree(c: Compressor, key: jax.Array, tree: Any) -> tuple[Any, jax.Array]:
    """Compress a pytree as one vector: ravel it, apply c, unravel; returns (tree_hat, bits)."""
    flat, unravel = ravel_pytree(tree)
    flat_hat, bits = c(key, flat)
    return unravel(flat_hat), bits
