"""Message compressors for federated communication.

A compressor C maps a vector x in R^d to a random C(x) that is cheap to transmit and reports the
exact length, in bits, of the message it sends. Algorithms rely on one of two properties:

* unbiased with variance constant omega >= 0:  E[C(x)] = x  and  E||C(x) - x||^2 <= omega ||x||^2;
* contractive with constant alpha in (0, 1]:   E||C(x) - x||^2 <= (1 - alpha) ||x||^2.

Unbiased: identity, rand_k, qsgd, natural. Contractive (biased, for error feedback such as EF21):
top_k, rand_k_unscaled, natural(contractive=True), qsgd(s, contractive=True), and
scale_to_contractive(c) = C / (1 + omega) for any unbiased c.

Compressors are frozen dataclasses, hence hashable and usable as static arguments of `jax.jit`.
Calling one is pure JAX (the vector length d is static) and works under `jit` and `vmap`.

Wire format. Every built-in compressor is an encoder and a decoder: ``encode(key, x)`` gives the
codes that are sent (indices and values, a norm and signed levels, ...), ``decode(codes, d)`` the
vector the receiver reconstructs, and C(x) = decode(encode(key, x)). ``pack`` / ``unpack`` turn codes
into the message's bits and back (exactly ``bits(d)`` of them, so a message is ceil(bits / 8) bytes),
which is what :mod:`fedbayes.flower` puts on the network. Floats are sent at ``float_bits``: with
``float_bits=16`` the sent values are rounded to float16 in the simulation as on the wire (values
beyond float16's range become +-inf). With the default 32 bits and float32 arithmetic the wire is
exact; a float64 fit (``jax_enable_x64``) keeps float64 values in simulation while charging 32 bits
per float, and the network carries them as float32.
"""

from __future__ import annotations

import abc
import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from fedbayes.errors import ConfigError

__all__ = [
    "Coded",
    "Compressor",
    "compress_tree",
    "identity",
    "natural",
    "qsgd",
    "rand_k",
    "rand_k_unscaled",
    "require_contractive",
    "require_unbiased",
    "scale_to_contractive",
    "top_k",
]

_INT32_MAX = 2**31 - 1

_IEEE_EXPONENTS = {16: (5, -14, 15), 32: (8, -126, 127), 64: (11, -1022, 1023)}
"""float_bits -> (exponent field bits, e_min, e_max): the normal powers of two 2^e_min..2^e_max."""


def _integer(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer, got {value!r}")
    return int(value)


def _float_bits(value: object) -> int:
    bits = _integer(value, "float_bits")
    if bits not in (16, 32, 64):
        raise ConfigError(f"float_bits (bits per sent float) must be 16, 32 or 64, got {bits}")
    return bits


def _flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")
    return value


def _sparsity(func: str, k: object, fraction: object) -> tuple[int | None, float | None]:
    """Check a sparsifier's (k, fraction): exactly one given, k >= 1 or 0 < fraction <= 1."""
    if (k is None) == (fraction is None):
        raise ConfigError(f"{func} needs exactly one of k (coordinates kept) or fraction (share)")
    if k is not None:
        k = _integer(k, "k")
        if k < 1:
            raise ConfigError(f"{func} keeps k >= 1 coordinates, got k={k}")
        return k, None
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise ConfigError(f"fraction must be a number in (0, 1], got {fraction!r}")
    fraction = float(fraction)
    if not 0.0 < fraction <= 1.0:
        raise ConfigError(f"fraction (share of d kept) must be in (0, 1], got {fraction}")
    return None, fraction


def _dimension(d: object) -> int:
    d = _integer(d, "the vector length d")
    if d < 1:
        raise ConfigError(f"cannot compress a vector of length {d}; it needs a coordinate")
    return d


def _call_repr(func: str, args: tuple[str, ...], float_bits: int, extra: tuple[str, ...]) -> str:
    """``func(args, float_bits=..., extra)``, leaving out the default 32-bit floats."""
    bits = () if float_bits == 32 else (f"float_bits={float_bits}",)
    return f"{func}({', '.join((*args, *bits, *extra))})"


def _index_bits(d: int) -> int:
    """Bits of one coordinate index in [0, d): max(1, ceil(log2 d))."""
    return max(1, (d - 1).bit_length())


class Compressor(abc.ABC):
    """A random map C: R^d -> R^d with the exact bit length of its message.

    `unbiased` is True exactly when `omega(d)` is a float (not None) for every valid d, and
    `contractive` exactly when `alpha(d)` is. Unbiased compressors report alpha = None even where
    omega < 1; C / (1 + omega) is contractive with alpha = 1 / (1 + omega), see
    `scale_to_contractive` (identity is both). Subclasses implement
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
        x, bits = self._checked(x)
        return self._compress(key, x), bits

    def _checked(self, x: Any) -> tuple[jax.Array, jax.Array]:
        """x as a JAX array and the int32 bit length of its message, after the checks of a call."""
        if not (hasattr(x, "dtype") and hasattr(x, "ndim")):  # a list, a string, ...: look at it as numpy does
            try:
                x = np.asarray(x)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"{self.name} compresses 1-D floating vectors, got {type(x).__name__}: {err}") from None
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
        return jnp.asarray(x), jnp.asarray(bits, dtype=jnp.int32)

    def __repr__(self) -> str:
        return self.name

    # ------------------------------------------------------------------ wire format
    has_wire_format: ClassVar[bool] = False
    """True when ``pack`` / ``unpack`` implement the encoding whose length ``bits`` reports."""

    def encode(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, ...]:
        """The codes of C(x) for a 1-D floating x. Default (a compressor with only ``_compress``): the
        decoded vector itself, which has no packed form (``has_wire_format`` is False)."""
        return (self._compress(key, x),)

    def decode(self, codes: tuple[jax.Array, ...], d: int) -> jax.Array:
        """The vector C(x) that ``codes`` encode (d coordinates)."""
        return codes[0]

    def pack(self, writer: BitWriter, codes: tuple[np.ndarray, ...], d: int) -> None:
        """Append the message of ``codes`` (host numpy arrays) to ``writer``: ``bits(d)`` bits."""
        raise ConfigError(
            f"{self.name} has no wire format (only _compress): define encode, decode, pack and unpack to send it "
            "over a network")

    def unpack(self, reader: BitReader, d: int, dtype: Any) -> tuple[np.ndarray, ...]:
        """Read the codes of one message of a d-vector of ``dtype`` from ``reader`` (inverse of ``pack``)."""
        raise ConfigError(f"{self.name} has no wire format")

    def coded(self, key: jax.Array, x: jax.Array) -> tuple[Coded, jax.Array, jax.Array]:
        """``(message, C(x), bits)``: the message as a :class:`Coded` payload (its codes, what crosses the
        network), the decoded vector the sender keeps, and the bit length (as from ``__call__``)."""
        x, bits = self._checked(x)
        codes = self.encode(key, x)
        return Coded(codes, self, x.shape[0], x.dtype), self.decode(codes, x.shape[0]), bits


class BitWriter:
    """Fields of fixed bit widths appended to one bit string (most significant bit first)."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []
        self.bits = 0

    def put(self, values: np.ndarray, width: int) -> None:
        """Append each of ``values`` (unsigned integers below 2**width) in ``width`` bits."""
        v = np.asarray(values).astype(np.uint64).reshape(-1)
        shifts = np.arange(width - 1, -1, -1, dtype=np.uint64)
        self._parts.append(((v[:, None] >> shifts) & np.uint64(1)).astype(np.uint8).reshape(-1))
        self.bits += v.size * width

    def put_floats(self, values: np.ndarray, width: int) -> None:
        """Append floats as IEEE numbers of ``width`` (16, 32, 64) bits."""
        self.put(np.asarray(values).astype(f"float{width}").view(f"uint{width}"), width)

    def tobytes(self) -> bytes:
        """The bit string padded with zeros to whole bytes: ceil(bits / 8) bytes."""
        return np.packbits(np.concatenate(self._parts) if self._parts else np.zeros(0, np.uint8)).tobytes()


class BitReader:
    """Reads the fields a :class:`BitWriter` wrote, in the same order."""

    def __init__(self, data: bytes) -> None:
        self._bits = np.unpackbits(np.frombuffer(data, np.uint8))
        self.pos = 0

    def take(self, count: int, width: int) -> np.ndarray:
        """The next ``count`` unsigned integers of ``width`` bits each (uint64)."""
        end = self.pos + count * width
        if end > self._bits.size:
            raise ValueError(f"message too short: needs {end} bits, has {self._bits.size}")
        chunk = self._bits[self.pos:end].reshape(count, width).astype(np.uint64)
        self.pos = end
        return (chunk << np.arange(width - 1, -1, -1, dtype=np.uint64)).sum(axis=1, dtype=np.uint64)

    def take_floats(self, count: int, width: int) -> np.ndarray:
        return self.take(count, width).astype(f"uint{width}").view(f"float{width}")


def _wire_round(v: jax.Array, float_bits: int) -> jax.Array:
    """A value as the receiver gets it: rounded to float16 for 16-bit floats; wider floats are left as
    computed (exact for float32 arithmetic; see the module notes on float64 fits)."""
    return v.astype(jnp.float16).astype(v.dtype) if float_bits < 32 else v


class Coded:
    """A compressed message in a payload: the compressor's codes (what is sent) and what the receiver
    needs to decode them (the compressor and the vector length, fixed by the protocol).

    A pytree whose leaves are the codes, so it passes through ``jit``, ``vmap`` and ``scan``; the codes
    may carry leading batch axes (one message per chain, per cohort member). ``decoded()`` is C(x),
    with the same batch axes. Optionally ``layout = (treedef, shapes)`` unflattens the decoded vector
    into a pytree (a compressed gradient of several sites).
    """

    def __init__(self, codes: tuple[Any, ...], compressor: Compressor, d: int, dtype: Any, layout: Any = None):
        self.codes, self.compressor, self.d, self.layout = tuple(codes), compressor, int(d), layout
        self.dtype = np.dtype(dtype)

    def tree_flatten(self):
        return self.codes, (self.compressor, self.d, self.dtype, self.layout)

    @classmethod
    def tree_unflatten(cls, aux, codes):
        return cls(tuple(codes), *aux)

    def code_shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The shapes and dtypes of one message's codes (no batch axes)."""
        return _code_shapes(self.compressor, self.d, self.dtype)

    def batch_shape(self) -> tuple[int, ...]:
        one = self.code_shapes()[0]
        first = self.codes[0]
        return tuple(first.shape[: first.ndim - len(one.shape)])

    def decoded(self) -> Any:
        batch = self.batch_shape()
        flat = [jnp.reshape(c, (-1,) + c.shape[len(batch):]) for c in self.codes]
        out = jax.vmap(lambda *cs: self.compressor.decode(tuple(cs), self.d))(*flat)
        out = jnp.reshape(out, batch + (self.d,))
        if self.layout is None:
            return out
        treedef, shapes = self.layout
        leaves, start = [], 0
        for shape in shapes:
            size = math.prod(shape)
            leaves.append(jnp.reshape(out[..., start:start + size], batch + tuple(shape)))
            start += size
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def __repr__(self) -> str:
        return f"Coded({self.compressor.name}, d={self.d})"

    def with_layout(self, tree: Any) -> Coded:
        """This message, decoding to a pytree shaped like ``tree`` (whose leaves hold d values in all)."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return Coded(self.codes, self.compressor, self.d, self.dtype, (treedef, tuple(tuple(np.shape(x)) for x in leaves)))


jax.tree_util.register_pytree_node(Coded, Coded.tree_flatten, Coded.tree_unflatten)


@functools.lru_cache(maxsize=None)
def _code_shapes(compressor: Compressor, d: int, dtype: np.dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
    x = jax.ShapeDtypeStruct((d,), dtype)
    return tuple(jax.eval_shape(compressor.encode, jax.random.key(0), x))


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

    has_wire_format: ClassVar[bool] = True

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        return self.decode(self.encode(key, x), x.shape[0])

    def encode(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, ...]:
        return (_wire_round(x, self.float_bits),)

    def pack(self, writer: BitWriter, codes: tuple[np.ndarray, ...], d: int) -> None:
        writer.put_floats(codes[0], self.float_bits)

    def unpack(self, reader: BitReader, d: int, dtype: Any) -> tuple[np.ndarray, ...]:
        return (reader.take_floats(d, self.float_bits).astype(dtype),)


@dataclass(frozen=True, repr=False)
class _Sparsifier(Compressor):
    """Keeps k = kept(d) coordinates, sent as k values and k indices.

    Each index takes max(1, ceil(log2 d)) bits: bits = k (float_bits + max(1, ceil(log2 d))).
    """

    k: int | None
    fraction: float | None
    float_bits: int
    func: ClassVar[str]

    @property
    def name(self) -> str:
        size = f"k={self.k}" if self.k is not None else f"fraction={self.fraction}"
        extra = "" if self.float_bits == 32 else f", float_bits={self.float_bits}"
        return f"{self.func}({size}{extra})"

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
        d = _dimension(d)
        return self.kept(d) * (self.float_bits + _index_bits(d))

    # The message: the k chosen indices and their (scaled) values.
    has_wire_format: ClassVar[bool] = True

    def _chosen(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(indices, values) of the kept coordinates, values as computed before rounding."""
        raise NotImplementedError

    def encode(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, ...]:
        idx, values = self._chosen(key, x)
        return idx.astype(jnp.int32), _wire_round(values, self.float_bits)

    def decode(self, codes: tuple[jax.Array, ...], d: int) -> jax.Array:
        idx, values = codes
        return jnp.zeros((d,), values.dtype).at[idx].set(values)

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        return self.decode(self.encode(key, x), x.shape[0])

    def pack(self, writer: BitWriter, codes: tuple[np.ndarray, ...], d: int) -> None:
        writer.put(codes[0], _index_bits(d))
        writer.put_floats(codes[1], self.float_bits)

    def unpack(self, reader: BitReader, d: int, dtype: Any) -> tuple[np.ndarray, ...]:
        k = self.kept(d)
        idx = reader.take(k, _index_bits(d)).astype(np.int32)
        return idx, reader.take_floats(k, self.float_bits).astype(dtype)


def _uniform_subset(key: jax.Array, d: int, k: int) -> jax.Array:
    """k distinct indices of [0, d), uniform over the k-subsets."""
    return jax.random.choice(key, d, shape=(k,), replace=False)


@dataclass(frozen=True, repr=False)
class _RandK(_Sparsifier):
    """Scaled random sparsification: C(x) = (d/k) sum_{j in S} x_j e_j, S uniform of size k.

    P(j in S) = k/d gives E[C(x)] = x and E||C(x) - x||^2 = (d/k - 1) ||x||^2 exactly, so
    omega = d/k - 1. The message is k values and k indices of max(1, ceil(log2 d)) bits each:
    bits = k (float_bits + max(1, ceil(log2 d))). Not contractive: alpha is None.
    """

    unbiased: ClassVar[bool] = True
    contractive: ClassVar[bool] = False
    func: ClassVar[str] = "rand_k"

    def omega(self, d: int) -> float:
        return d / self.kept(d) - 1.0

    def alpha(self, d: int) -> None:
        self.kept(d)
        return None

    def _chosen(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        d = x.shape[0]
        k = self.kept(d)
        chosen = _uniform_subset(key, d, k)
        return chosen, x[chosen] * (d / k)


class _UnscaledSparsifier(_Sparsifier):
    """Keeps k coordinates unscaled: biased (omega is None), contractive with alpha = k/d."""

    unbiased: ClassVar[bool] = False
    contractive: ClassVar[bool] = True

    def omega(self, d: int) -> None:
        self.kept(d)
        return None

    def alpha(self, d: int) -> float:
        return self.kept(d) / d


@dataclass(frozen=True, repr=False)
class _RandKUnscaled(_UnscaledSparsifier):
    """Unscaled random sparsification: C(x) = sum_{j in S} x_j e_j, S uniform of size k.

    Coordinate j is dropped with probability 1 - k/d, so E||C(x) - x||^2 = (1 - k/d) ||x||^2
    exactly: contractive with alpha = k/d. Biased (E[C(x)] = (k/d) x): omega is None. Same message
    as rand_k: bits = k (float_bits + max(1, ceil(log2 d))). With the same key it keeps the same
    coordinates as rand_k, so rand_k(k)(key, x) = (d/k) rand_k_unscaled(k)(key, x).
    """

    func: ClassVar[str] = "rand_k_unscaled"

    def _chosen(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        chosen = _uniform_subset(key, x.shape[0], self.kept(x.shape[0]))
        return chosen, x[chosen]


@dataclass(frozen=True, repr=False)
class _TopK(_UnscaledSparsifier):
    """Greedy sparsification: keep the k coordinates of largest |x_j|, unscaled.

    C(x) = sum_{j in T} x_j e_j with T the indices of the k largest |x_j| (ties broken by
    `jax.lax.top_k`: the lower index first). Deterministic (the key is unused), and
    ||C(x) - x||^2 is the sum of the d - k smallest x_j^2; their mean is at most the mean of all d
    squares, so ||C(x) - x||^2 <= (1 - k/d) ||x||^2 on every call: alpha = k/d. Biased: omega is
    None. bits = k (float_bits + max(1, ceil(log2 d))).
    """

    func: ClassVar[str] = "top_k"

    def _chosen(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        _, largest = jax.lax.top_k(jnp.abs(x), self.kept(x.shape[0]))
        return largest, x[largest]


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
        return self._signature()

    def _signature(self, *extra: str) -> str:
        return _call_repr("qsgd", (f"levels={self.levels}",), self.float_bits, extra)

    def bits(self, d: int) -> int:
        return self.float_bits + _dimension(d) * (1 + self.levels.bit_length())

    def omega(self, d: int) -> float:
        d = _dimension(d)
        return min(d / self.levels**2, math.sqrt(d) / self.levels)

    def alpha(self, d: int) -> None:
        _dimension(d)
        return None

    has_wire_format: ClassVar[bool] = True

    def encode(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, ...]:
        """(||x||_2 as sent, sign(x_j) xi_j as int32)."""
        s = self.levels
        norm = jnp.linalg.norm(x)
        scaled = s * jnp.abs(x) / jnp.where(norm > 0, norm, 1)
        low = jnp.floor(scaled)
        up = jax.random.uniform(key, x.shape, x.dtype) < scaled - low
        # Rounding can push s|x_j|/||x|| a hair above s; clipping keeps xi_j on the grid {0..s}.
        level = jnp.nan_to_num(jnp.minimum(low + up, s))  # a non-finite x: the norm carries the NaN
        return _wire_round(norm, self.float_bits), (jnp.sign(x) * level).astype(jnp.int32)

    def decode(self, codes: tuple[jax.Array, ...], d: int) -> jax.Array:
        norm, signed = codes
        return norm * jnp.sign(signed).astype(norm.dtype) * jnp.abs(signed).astype(norm.dtype) / self.levels

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        return self.decode(self.encode(key, x), x.shape[0])

    def pack(self, writer: BitWriter, codes: tuple[np.ndarray, ...], d: int) -> None:
        norm, signed = codes
        writer.put_floats(np.reshape(norm, (1,)), self.float_bits)
        writer.put(np.asarray(signed) < 0, 1)
        writer.put(np.minimum(np.abs(signed), self.levels), self.levels.bit_length())

    def unpack(self, reader: BitReader, d: int, dtype: Any) -> tuple[np.ndarray, ...]:
        norm = reader.take_floats(1, self.float_bits).astype(dtype)[0]
        negative = reader.take(d, 1).astype(bool)
        level = reader.take(d, self.levels.bit_length()).astype(np.int32)
        return norm, np.where(negative, -level, level).astype(np.int32)


@dataclass(frozen=True, repr=False)
class _Natural(Compressor):
    """Natural compression (Horvath et al., 2019): random rounding to a signed power of two.

    For x_j != 0 let e = floor(log2 |x_j|) and a = 2^e, so |x_j| in [a, 2a). Then
    C(x)_j = sign(x_j) 2a with probability p = (|x_j| - a) / a and sign(x_j) a otherwise, so
    E[C(x)_j] = x_j; C(x)_j = 0 where x_j = 0. With t = |x_j| / a in [1, 2),
    E(C(x)_j - x_j)^2 = (2a - |x_j|)(|x_j| - a) = x_j^2 (2 - t)(t - 1) / t^2 <= x_j^2 / 8
    (maximum at t = 4/3), hence omega = 1/8, attained when every |x_j| is 4/3 times a power of two.

    Message: per coordinate a sign bit and the E-bit biased exponent field of the IEEE format of
    float_bits bits (E = 5, 8, 11 for 16, 32, 64): C(x)_j is that IEEE number with a zero
    mantissa, code 0 meaning zero (and the all-ones code infinity). bits = d (1 + E): 6d, 9d, 12d.

    Range: the grid is 0 and the powers 2^e_lo..2^e_hi that are normal numbers of both the wire
    format and x's dtype (float32: 2^-126..2^127). A |x_j| < 2^e_lo is rounded the same way between
    0 and 2^e_lo (still unbiased; its variance |x_j| (2^e_lo - |x_j|) <= 4^e_lo / 4 is the only
    excess over omega ||x||^2, e.g. 2^-254 per coordinate for float32). A finite |x_j| >= 2^e_hi
    saturates to 2^e_hi (biased, but finite: no overflow to inf or NaN); +-inf is sent as +-inf
    and NaN stays NaN. Not contractive: alpha is None; natural(contractive=True) is C / (1 + 1/8).
    """

    float_bits: int
    unbiased: ClassVar[bool] = True
    contractive: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self._signature()

    def _signature(self, *extra: str) -> str:
        return _call_repr("natural", (), self.float_bits, extra)

    def bits(self, d: int) -> int:
        return _dimension(d) * (1 + _IEEE_EXPONENTS[self.float_bits][0])

    def omega(self, d: int) -> float:
        _dimension(d)
        return 0.125

    def alpha(self, d: int) -> None:
        _dimension(d)
        return None

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        _, e_min, e_max = _IEEE_EXPONENTS[self.float_bits]
        info = jnp.finfo(x.dtype)
        tiny = 2.0 ** max(e_min, int(info.minexp))
        huge = 2.0 ** min(e_max, int(info.maxexp) - 1)
        size = jnp.minimum(jnp.abs(x), huge)
        small = size < tiny  # x = 0 and subnormals: bracket [0, tiny]
        # 2^floor(log2 size) for normal size: clear the mantissa bits of its IEEE encoding.
        width = 8 * x.dtype.itemsize
        uint = jnp.dtype(f"uint{width}")
        keep = jnp.asarray((2**width - 1) ^ (2 ** int(info.nmant) - 1), uint)
        power = jax.lax.bitcast_convert_type(
            jax.lax.bitcast_convert_type(size, uint) & keep, x.dtype
        )
        low = jnp.where(small, 0.0, power)
        high = jnp.where(small, tiny, jnp.minimum(2 * power, huge))  # 2 power may overflow: inf
        gap = high - low
        p = jnp.where(gap > 0, (size - low) / jnp.where(gap > 0, gap, 1.0), 0.0)
        up = jax.random.uniform(key, x.shape, x.dtype) < p
        return jnp.where(jnp.isinf(x), x, jnp.sign(x) * jnp.where(up, high, low))

    # The codes are the rounded values themselves (signed powers of two, 0 or +-inf); the message holds
    # each one's sign bit and IEEE exponent field at float_bits (its mantissa is zero). NaN goes as inf.
    has_wire_format: ClassVar[bool] = True

    def encode(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, ...]:
        return (self._compress(key, x),)

    def pack(self, writer: BitWriter, codes: tuple[np.ndarray, ...], d: int) -> None:
        width, (exp_bits, _, _) = self.float_bits, _IEEE_EXPONENTS[self.float_bits]
        u = np.asarray(codes[0]).astype(f"float{width}").view(f"uint{width}").astype(np.uint64)
        mant = width - 1 - exp_bits
        writer.put(u >> np.uint64(width - 1), 1)
        writer.put((u >> np.uint64(mant)) & np.uint64(2**exp_bits - 1), exp_bits)

    def unpack(self, reader: BitReader, d: int, dtype: Any) -> tuple[np.ndarray, ...]:
        width, (exp_bits, _, _) = self.float_bits, _IEEE_EXPONENTS[self.float_bits]
        sign = reader.take(d, 1)
        exponent = reader.take(d, exp_bits)
        u = (sign << np.uint64(width - 1)) | (exponent << np.uint64(width - 1 - exp_bits))
        return (u.astype(f"uint{width}").view(f"float{width}").astype(dtype),)


@dataclass(frozen=True, repr=False)
class _Scaled(Compressor):
    """C'(x) = C(x) / (1 + omega) for an unbiased C with variance constant omega = omega(d).

    Write lambda C(x) - x = lambda (C(x) - x) - (1 - lambda) x; as E[C(x) - x] = 0 the cross term
    vanishes, so E||lambda C(x) - x||^2 = lambda^2 E||C(x) - x||^2 + (1 - lambda)^2 ||x||^2
    <= (lambda^2 omega + (1 - lambda)^2) ||x||^2. The bracket is smallest at
    lambda = 1 / (1 + omega), where it equals omega / (1 + omega) = 1 - 1 / (1 + omega): C' is
    contractive with alpha = 1 / (1 + omega). Biased for omega > 0: omega is None. The receiver
    knows the constant, so the message is C's: same bits.
    """

    base: Compressor
    unbiased: ClassVar[bool] = False
    contractive: ClassVar[bool] = True

    @property
    def name(self) -> str:
        if isinstance(self.base, (_Natural, _QSGD)):
            return self.base._signature("contractive=True")
        return f"scale_to_contractive({self.base.name})"

    def bits(self, d: int) -> int:
        return self.base.bits(d)

    def omega(self, d: int) -> None:
        self.base.omega(d)
        return None

    def alpha(self, d: int) -> float:
        return 1.0 / (1.0 + self.base.omega(d))

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        return self.base._compress(key, x) / (1.0 + self.base.omega(x.shape[0]))

    def __call__(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """C's message and bits (its own encoding, fixed-length or not), decoded and rescaled."""
        x_hat, bits = self.base(key, x)
        return x_hat / (1.0 + self.base.omega(x_hat.shape[0])), bits

    @property
    def has_wire_format(self) -> bool:  # type: ignore[override]
        return self.base.has_wire_format

    def encode(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, ...]:
        return self.base.encode(key, x)

    def decode(self, codes: tuple[jax.Array, ...], d: int) -> jax.Array:
        return self.base.decode(codes, d) / (1.0 + self.base.omega(d))

    def pack(self, writer: BitWriter, codes: tuple[np.ndarray, ...], d: int) -> None:
        self.base.pack(writer, codes, d)

    def unpack(self, reader: BitReader, d: int, dtype: Any) -> tuple[np.ndarray, ...]:
        return self.base.unpack(reader, d, dtype)


def identity(float_bits: int = 32) -> Compressor:
    """No compression: C(x) = x, d floats of float_bits bits each; omega = 0, alpha = 1."""
    return _Identity(_float_bits(float_bits))


def rand_k(
    k: int | None = None, *, fraction: float | None = None, float_bits: int = 32
) -> Compressor:
    """Unbiased random-k sparsification keeping k (or max(1, round(fraction * d))) coordinates."""
    k, fraction = _sparsity("rand_k", k, fraction)
    return _RandK(k, fraction, _float_bits(float_bits))


def rand_k_unscaled(
    k: int | None = None, *, fraction: float | None = None, float_bits: int = 32
) -> Compressor:
    """Contractive random-k sparsification without the d/k scaling: alpha = k/d, biased.

    Keeps k (or max(1, round(fraction * d))) uniformly chosen coordinates as they are.
    """
    k, fraction = _sparsity("rand_k_unscaled", k, fraction)
    return _RandKUnscaled(k, fraction, _float_bits(float_bits))


def top_k(
    k: int | None = None, *, fraction: float | None = None, float_bits: int = 32
) -> Compressor:
    """Contractive top-k sparsification: keep the k largest |x_j|; alpha = k/d, deterministic."""
    k, fraction = _sparsity("top_k", k, fraction)
    return _TopK(k, fraction, _float_bits(float_bits))


def qsgd(levels: int, *, float_bits: int = 32, contractive: bool = False) -> Compressor:
    """QSGD quantisation of |x_j| / ||x||_2 to the grid {0, 1/s, ..., 1}, s = levels.

    Unbiased with omega = min(d / s^2, sqrt(d) / s); with contractive=True it is scaled by
    1 / (1 + omega), which is contractive with alpha = 1 / (1 + omega) and biased.
    """
    levels = _integer(levels, "levels")
    if levels < 1:
        raise ConfigError(f"qsgd needs levels >= 1 quantisation levels, got {levels}")
    c = _QSGD(levels, _float_bits(float_bits))
    return _Scaled(c) if _flag(contractive, "contractive") else c


def natural(float_bits: int = 32, *, contractive: bool = False) -> Compressor:
    """Natural compression: unbiased rounding to a signed power of two, omega = 1/8.

    One sign bit and one IEEE exponent field per coordinate (bits = 6d, 9d, 12d for float_bits
    16, 32, 64). With contractive=True it returns (8/9) C_nat(x): alpha = 1 / (1 + 1/8) = 8/9.
    """
    c = _Natural(_float_bits(float_bits))
    return _Scaled(c) if _flag(contractive, "contractive") else c


def _check_compressor(c: object, algorithm: str) -> None:
    if not isinstance(c, Compressor):
        raise ConfigError(f"{algorithm} needs a fedbayes Compressor, got {type(c).__name__}")


def require_unbiased(c: Compressor, algorithm: str) -> Compressor:
    """Return c if it is unbiased (E[C(x)] = x); otherwise raise ConfigError."""
    _check_compressor(c, algorithm)
    if not c.unbiased:
        raise ConfigError(
            f"{algorithm} needs an unbiased compressor (E[C(x)] = x), but {c.name} is biased; "
            "use rand_k(...), qsgd(...) or natural()"
        )
    return c


def require_contractive(c: Compressor, algorithm: str) -> Compressor:
    """Return c if it is contractive (E||C(x) - x||^2 <= (1 - alpha) ||x||^2); else ConfigError."""
    _check_compressor(c, algorithm)
    if not c.contractive:
        raise ConfigError(
            f"{algorithm} needs a contractive compressor (E||C(x) - x||^2 <= (1 - alpha) ||x||^2), "
            f"but {c.name} is not; use top_k(...), rand_k_unscaled(...), "
            "natural(contractive=True), qsgd(s, contractive=True) or "
            f"scale_to_contractive({c.name})"
        )
    return c


def scale_to_contractive(c: Compressor) -> Compressor:
    """A contractive version of c: c itself if contractive, else C / (1 + omega) if unbiased.

    For an unbiased C with variance constant omega(d), C(x) / (1 + omega(d)) has
    alpha = 1 / (1 + omega(d)) and the same bits (e.g. rand_k(k) becomes alpha = k/d). A biased,
    non-contractive compressor raises ConfigError.
    """
    _check_compressor(c, "scale_to_contractive")
    if c.contractive:
        return c
    if not c.unbiased:
        raise ConfigError(
            f"scale_to_contractive needs an unbiased or contractive compressor, but {c.name} is "
            "neither"
        )
    return _Scaled(c)


def compress_tree(c: Compressor, key: jax.Array, tree: Any) -> tuple[Any, jax.Array]:
    """Compress a pytree as one vector: ravel it, apply c, unravel; returns (tree_hat, bits)."""
    flat, unravel = ravel_pytree(tree)
    flat_hat, bits = c(key, flat)
    return unravel(flat_hat), bits
