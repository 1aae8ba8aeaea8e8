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
which is what :mod:`fedbayes.flower` puts on the network. Floats are sent at ``float_bits``. With the
default 32 bits and float32 arithmetic the wire is exact; a float64 fit (``jax_enable_x64``) keeps
float64 values in simulation while charging 32 bits per float, and the network carries them as
float32. 64-bit floats are exact for both.

16-bit floats share a scale. A message sending floats v_1..v_m at ``float_bits=16`` starts with
b = floor(log2 max_i |v_i|) over the finite nonzero v_i (0 if there are none) in a 12-bit two's
complement field (``_BINADE_BITS``: every finite float64 has its binade in -1074..1023), and each
v_i is sent as the float16 number float16(v_i 2^(14 - b)): the largest lands in [2^14, 2^15), so
nothing overflows, and the receiver takes v_i = that number times 2^(b - 14). Every
|v_i| >= 2^(b - 28) keeps 11 significant bits, smaller ones fewer, and |v_i| < 2^(b - 39) is sent as
0, whatever the vector's scale, in float32 and float64 alike (the 16-bit wire is exact for both).
Where plain float16 was in range (b <= 14) every value it holds as a normal number is rounded as
float16 rounds it, and smaller ones keep more bits. It costs 12 bits per message (identity, the
sparsifiers and qsgd at 16 bits); natural compression sends the same field at every width (its
exponents are relative to b). The declared omega and alpha describe the
compressors on exact values; the rounding of 16-bit values (relative error at most 2^-11 per sent
value) is not counted in them.

Range. Every compressor maps a vector of finite values to one of finite values, of x's dtype, and
a vector with a nonzero coordinate never to all zeros unless its definition drops coordinates
(rand_k and rand_k_unscaled may drop every nonzero coordinate; qsgd may round every level to 0,
which it cannot where levels^2 >= 2d); the tests check both with random vectors of any scale. A
decoded value beyond the largest finite number of x's dtype saturates to +-that number: rand_k's
(d/k) x_j, qsgd's ||x||_2 (which it sends) and natural's rounding up from the top binade can exceed
it, and are unbiased only below it. +-inf and NaN coordinates are passed on (as inf or NaN) so that
a receiver can see them. XLA on CPU flushes subnormal numbers to zero in arithmetic and
comparisons; the scalings here (``_ldexp``) work on the numbers' bits (as XLA's top_k ranks them),
so a subnormal coordinate is sent and decoded as the number it is.
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

from fedbayes import prng
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
        if not 1 <= k <= _INT32_MAX:
            raise ConfigError(f"{func} keeps 1 <= k <= 2^31 - 1 coordinates (message sizes are int32), got k={k}")
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


# ---------------------------------------------------------------------- floats on their bits
_NO_BINADE = -(2**30)
"""``_binade`` of 0, inf and NaN: below every binade of a finite nonzero number."""

_BINADE_BITS = 12
"""Width of a message's shared binade field, two's complement: -2048..2047 holds floor(log2 |v|) of
every finite nonzero float64 (-1074..1023), hence of every narrower float."""

_HALF_TOP = 14
"""A 16-bit float is sent as float16(v 2^(_HALF_TOP - b)), b the binade of the message's largest
value: that value lands in [2^14, 2^15), below float16's top binade, so rounding it up (to 2^15 at
most) cannot overflow float16 (largest finite 65504)."""


def _uint(value: int, dtype: Any) -> jax.Array:
    return jnp.asarray(value, dtype)


def _split(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(sign, m, q, special)`` read from x's bits: |x| = m 2^q exactly for finite x, with m an
    unsigned integer below 2^(nmant + 1) (0 for a zero) and q an int32; ``sign`` is x's sign bit in
    place and ``special`` marks inf and NaN. Subnormal numbers are read as they are."""
    info = jnp.finfo(x.dtype)
    width, nmant, nexp = int(info.bits), int(info.nmant), int(info.nexp)
    uint = jnp.dtype(f"uint{width}")
    u = jax.lax.bitcast_convert_type(x, uint)
    field = ((u >> _uint(nmant, uint)) & _uint(2**nexp - 1, uint)).astype(jnp.int32)
    m = u & _uint(2**nmant - 1, uint)
    m = jnp.where(field > 0, m | _uint(2**nmant, uint), m)  # the implicit leading bit of a normal number
    q = jnp.maximum(field, 1) + (int(info.minexp) - 1 - nmant)  # minexp - 1 = -bias
    return u & _uint(2 ** (width - 1), uint), m, q, field == 2**nexp - 1


def _bit_length(m: jax.Array) -> jax.Array:
    return 8 * m.dtype.itemsize - jax.lax.clz(m).astype(jnp.int32)


def _kept(codes: Any, key: jax.Array, x: jax.Array) -> Any:
    """``codes(key, x)``, computed once and kept in memory on a CPU.

    XLA fuses an elementwise computation into each of its consumers and, where it deems it cheap, computes it
    again in every one of them. A quantiser's codes (the key hash of its uniforms and the rounding: some
    hundred integer operations a coordinate) are read by the sender's own state, by the server's decoding and
    by the fault screen, and were computed three times (B-ELF with natural compression, 1 000 clients: a
    third of the round). ``jax.lax.optimization_barrier`` did not prevent it on a CPU; a loop does: a
    ``while_loop`` of one iteration, whose count XLA cannot see (it depends on whether x's first entry is
    NaN), so its result is kept. On other platforms, where each iteration of a loop costs a synchronisation
    with the host, the codes are computed as they are."""
    if jax.default_backend() != "cpu" or x.size == 0:
        return codes(key, x)
    nan = jnp.isnan(jnp.ravel(x)[0]).astype(jnp.int32)
    start = (nan, jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(codes, key, x)))
    return jax.lax.while_loop(lambda c: c[0] < nan + 1, lambda c: (c[0] + 1, codes(key, x)), start)[1]


# The bit helpers are jitted: called outside jit (an eager compressor call) they compile once, not
# op by op.
@jax.jit
def _binade(x: jax.Array) -> jax.Array:
    """floor(log2 |x_j|) of each finite nonzero x_j (int32, subnormals included); _NO_BINADE for 0,
    +-inf and NaN."""
    _, m, q, special = _split(x)
    return jnp.where((m == 0) | special, _NO_BINADE, q + _bit_length(m) - 1)


@jax.jit
def _top_binade(x: jax.Array) -> jax.Array:
    """floor(log2 max_j |x_j|) over the finite nonzero x_j (an int32 scalar); 0 if there are none: the binade
    of the largest of their bit patterns (nonnegative floats are ordered as their bits), one integer
    reduction and one binade."""
    sign, _, _, special = _split(x)
    size = jax.lax.bitcast_convert_type(x, sign.dtype) ^ sign
    top = jnp.max(jnp.where(special, jnp.zeros_like(size), size))
    b = _binade(jax.lax.bitcast_convert_type(top, x.dtype))
    return jnp.where(b == _NO_BINADE, 0, b)


@jax.jit
def _ldexp(x: jax.Array, n: Any) -> jax.Array:
    """x 2^n for integers n (broadcast with x), rounded to nearest (ties to even) as IEEE arithmetic
    rounds, computed on the bits so that subnormal inputs and results are exact where representable
    (XLA on CPU would flush them to zero). A finite x whose x 2^n exceeds the dtype's range saturates
    to +-its largest finite number; +-inf and NaN are returned as they are."""
    info = jnp.finfo(x.dtype)
    width, nmant, nexp = int(info.bits), int(info.nmant), int(info.nexp)
    minexp, maxexp = int(info.minexp), int(info.maxexp)
    uint = jnp.dtype(f"uint{width}")
    sign, m, q, special = _split(x)
    t = q + jnp.asarray(n, jnp.int32)  # |x 2^n| = m 2^t
    length = _bit_length(m)
    p = t + length - 1  # the result's binade
    normal = ((p - minexp + 1).astype(uint) << _uint(nmant, uint)) | (
        (m << (nmant + 1 - length).astype(uint)) & _uint(2**nmant - 1, uint)
    )
    # A subnormal result is its mantissa field alone: m 2^(t - t_min), t_min the exponent of the
    # smallest subnormal, shifted left exactly or right with rounding to nearest even (a carry into
    # the exponent field gives the smallest normal number, as it should).
    shift = (minexp - nmant) - t
    left = m << jnp.clip(-shift, 0, width - 1).astype(uint)
    s = jnp.clip(shift, 1, width).astype(uint)  # XLA shifts by >= width give 0
    kept = m >> s
    rest, half = m - (kept << s), _uint(1, uint) << (s - _uint(1, uint))
    kept = kept + ((rest > half) | ((rest == half) & ((kept & _uint(1, uint)) == 1))).astype(uint)
    largest = _uint(((2**nexp - 2) << nmant) | (2**nmant - 1), uint)
    magnitude = jnp.where(p > maxexp - 1, largest, jnp.where(p >= minexp, normal, jnp.where(shift <= 0, left, kept)))
    out = jax.lax.bitcast_convert_type(sign | jnp.where(m == 0, _uint(0, uint), magnitude), x.dtype)
    return jnp.where(special, x, out)


def _power_bits(e: jax.Array, dtype: Any, mant: int = 0) -> jax.Array:
    """The bits (unsigned, sign bit clear) of (1 + mant 2^-nmant) 2^e in ``dtype``, for int32 binades e
    and a fixed mantissa field ``mant``, rounded to nearest (ties to even) where the number is
    subnormal and saturated to the largest finite number beyond the range: ``_ldexp`` of one fixed
    significand, computed with a few integer operations per coordinate."""
    info = jnp.finfo(dtype)
    width, nmant, nexp = int(info.bits), int(info.nmant), int(info.nexp)
    minexp, maxexp = int(info.minexp), int(info.maxexp)
    uint = jnp.dtype(f"uint{width}")
    significand = _uint(mant | 2**nmant, uint)
    normal = (jnp.clip(e - minexp + 1, 0, 2**nexp - 2).astype(uint) << _uint(nmant, uint)) | _uint(mant, uint)
    # Subnormal: the significand times 2^(e - nmant), in units of the smallest subnormal
    # 2^(minexp - nmant), i.e. shifted right by minexp - e with rounding; past nmant + 2 places it is
    # below half the smallest subnormal and rounds to 0.
    s = jnp.clip(minexp - e, 1, nmant + 2).astype(uint)
    one = _uint(1, uint)
    kept = significand >> s
    rest, half = significand - (kept << s), one << (s - one)
    kept = kept + ((rest > half) | ((rest == half) & ((kept & one) == 1))).astype(uint)
    largest = _uint(((2**nexp - 2) << nmant) | (2**nmant - 1), uint)
    return jnp.where(e > maxexp - 1, largest, jnp.where(e >= minexp, normal, kept))


def _rescaled(f: Any, x: jax.Array) -> jax.Array:
    """f(x) for a positively homogeneous f (f(2^e v) = 2^e f(v)), evaluated at x 2^-b in [1, 2), b the
    binade of x (per coordinate, or of a scalar x), and scaled back by 2^b with ``_ldexp``. Where x and
    f(x) are normal numbers this is f(x) bit for bit (scaling by a power of two commutes with
    rounding); a subnormal x is read exactly and a subnormal f(x) kept (rounded twice: at 2^0 to the
    dtype's precision, then to the subnormal's), and a result beyond the dtype's range saturates."""
    b = _binade(x)
    b = jnp.where(b == _NO_BINADE, 0, b)
    return _ldexp(f(_ldexp(x, -b)), b)


def _float_field_bits(count: int, float_bits: int) -> int:
    """Bits of ``count`` floats sent at float_bits: count float_bits, plus the shared binade at 16."""
    return count * float_bits + (_BINADE_BITS if float_bits == 16 else 0)


def _send_floats(v: jax.Array, float_bits: int) -> tuple[jax.Array, ...]:
    """The codes of floats v sent at float_bits: ``(v,)`` at 32 and 64 bits (see the module notes on
    float64 fits); at 16 bits ``(b, h)``, b the binade of the largest finite |v_i| and h the float16
    numbers v 2^(14 - b) (held in v's dtype)."""
    if float_bits != 16:
        return (v,)
    b = _top_binade(v)
    return b, _ldexp(v, _HALF_TOP - b).astype(jnp.float16).astype(v.dtype)


def _received_floats(codes: tuple[jax.Array, ...], float_bits: int) -> jax.Array:
    """The floats that ``_send_floats`` codes encode (at 16 bits h 2^(b - 14), saturating)."""
    if float_bits != 16:
        return codes[0]
    b, h = codes
    return _ldexp(h, b - _HALF_TOP)


def _put_binade(writer: BitWriter, b: Any) -> None:
    writer.put(np.reshape(np.asarray(b).astype(np.int64) & (2**_BINADE_BITS - 1), (1,)), _BINADE_BITS)


def _take_binade(reader: BitReader) -> np.ndarray:
    v = int(reader.take(1, _BINADE_BITS)[0])
    return np.asarray(v - 2**_BINADE_BITS if v >= 2 ** (_BINADE_BITS - 1) else v, np.int32)


def _pack_floats(writer: BitWriter, codes: tuple[np.ndarray, ...], float_bits: int) -> None:
    if float_bits == 16:
        _put_binade(writer, codes[0])
    writer.put_floats(np.reshape(codes[-1], (-1,)), float_bits)


def _unpack_floats(reader: BitReader, shape: tuple[int, ...], float_bits: int, dtype: Any) -> tuple[np.ndarray, ...]:
    binade = (_take_binade(reader),) if float_bits == 16 else ()
    values = reader.take_floats(math.prod(shape), float_bits).astype(dtype).reshape(shape)
    return (*binade, values)


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

    def refresh_lag(self, d: int) -> float | None:
        """Under error feedback, the mean number of rounds a memory's coordinate waits to be brought up to
        date (:mod:`fedbayes.algorithms.stationary`): (1 - alpha) / alpha, exact for coordinates chosen at
        random (a geometric wait) and for a memory that moves by a fraction alpha a round; None if not
        contractive."""
        alpha = self.alpha(d)
        return None if alpha is None else (1.0 - alpha) / alpha

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
                raise ConfigError(
                    f"{self.name} compresses 1-D floating vectors, got {type(x).__name__}: {err}"
                ) from None
        if x.ndim != 1 or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ConfigError(
                f"{self.name} compresses 1-D floating vectors, got shape {x.shape} and dtype "
                f"{x.dtype}; use compress_tree for pytrees"
            )
        bits = self.bits(x.shape[0])
        if bits > _INT32_MAX:
            raise ConfigError(f"a {self.name} message of {bits} bits overflows int32; compress smaller blocks")
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

    def _decode_divided(self, codes: tuple[jax.Array, ...], d: int, scale: float) -> jax.Array:
        """decode(codes, d) / scale, the division done on the bits' scale (``_rescaled``)."""
        return _rescaled(lambda v: v / scale, self.decode(codes, d))

    def pack(self, writer: BitWriter, codes: tuple[np.ndarray, ...], d: int) -> None:
        """Append the message of ``codes`` (host numpy arrays) to ``writer``: ``bits(d)`` bits."""
        raise ConfigError(
            f"{self.name} has no wire format (only _compress): define encode, decode, pack and unpack to send it "
            "over a network"
        )

    def unpack(self, reader: BitReader, d: int, dtype: Any) -> tuple[np.ndarray, ...]:
        """Read the codes of one message of a d-vector of ``dtype`` from ``reader`` (inverse of ``pack``)."""
        raise ConfigError(f"{self.name} has no wire format")

    def coded(self, key: jax.Array, x: jax.Array) -> tuple[Coded, jax.Array, jax.Array]:
        """``(message, C(x), bits)``: the message as a :class:`Coded` payload (its codes, what crosses the
        network), the decoded vector the sender keeps, and the bit length (as from ``__call__``)."""
        x, bits = self._checked(x)
        codes = self._computed(self.encode, key, x)
        return Coded(codes, self, x.shape[0], x.dtype), self.decode(codes, x.shape[0]), bits

    def coded_rows(self, key: jax.Array, v: jax.Array) -> tuple[Coded, jax.Array, jax.Array]:
        """``coded`` of each row of a 2-D ``v`` (one message per row, e.g. per chain), each row compressed
        independently: ``(messages with a leading row axis, C(v_r) row by row, bits per row)``.

        Default: row r coded with its own key, ``jax.random.split(key, rows)[r]``. A compressor whose only
        randomness is one uniform per coordinate (``natural``, ``qsgd``) draws the uniforms of all rows
        with ``key`` at once (``_row_codes``): the same law, one key hash instead of two (on a CPU each
        is a loop of its own, a noticeable share of a compressed sampler's round)."""
        v = jnp.asarray(v)
        if v.ndim != 2:
            raise ConfigError(f"coded_rows codes the rows of a 2-D array, got shape {v.shape}")
        _, bits = self._checked(v[0])
        codes = self._computed(self._row_codes, key, v)
        d = v.shape[1]
        decoded = jax.vmap(lambda *cs: self.decode(tuple(cs), d))(*codes)
        return Coded(codes, self, d, v.dtype), decoded, jnp.full((v.shape[0],), bits)

    def _row_codes(self, key: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
        """The codes of every row of ``v`` (leading row axis), each with its own randomness."""
        return jax.vmap(self.encode)(jax.random.split(key, v.shape[0]), v)

    _keep_codes: ClassVar[bool] = False
    """Whether ``coded`` computes its codes once and keeps them (``_kept``): for codes that are a long
    elementwise computation, which XLA would otherwise repeat in each of their consumers."""

    def _computed(self, codes: Any, key: jax.Array, x: jax.Array) -> tuple[jax.Array, ...]:
        """``codes(key, x)``, kept once computed where ``_keep_codes`` says so."""
        return _kept(codes, key, x) if self._keep_codes else codes(key, x)


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
        chunk = self._bits[self.pos : end].reshape(count, width).astype(np.uint64)
        self.pos = end
        return (chunk << np.arange(width - 1, -1, -1, dtype=np.uint64)).sum(axis=1, dtype=np.uint64)

    def take_floats(self, count: int, width: int) -> np.ndarray:
        return self.take(count, width).astype(f"uint{width}").view(f"float{width}")


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
        flat = [jnp.reshape(c, (-1,) + c.shape[len(batch) :]) for c in self.codes]
        out = jax.vmap(lambda *cs: self.compressor.decode(tuple(cs), self.d))(*flat)
        out = jnp.reshape(out, batch + (self.d,))
        if self.layout is None:
            return out
        treedef, shapes = self.layout
        leaves, start = [], 0
        for shape in shapes:
            size = math.prod(shape)
            leaves.append(jnp.reshape(out[..., start : start + size], batch + tuple(shape)))
            start += size
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def __repr__(self) -> str:
        return f"Coded({self.compressor.name}, d={self.d})"

    def with_layout(self, tree: Any) -> Coded:
        """This message, decoding to a pytree shaped like ``tree`` (whose leaves hold d values in all)."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return Coded(
            self.codes, self.compressor, self.d, self.dtype, (treedef, tuple(tuple(np.shape(x)) for x in leaves))
        )


jax.tree_util.register_pytree_node(Coded, Coded.tree_flatten, Coded.tree_unflatten)


@functools.cache
def _code_shapes(compressor: Compressor, d: int, dtype: np.dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
    x = jax.ShapeDtypeStruct((d,), dtype)
    return tuple(jax.eval_shape(compressor.encode, jax.random.key(0), x))


@dataclass(frozen=True, repr=False)
class _Identity(Compressor):
    """C(x) = x, sent as d floats: omega = 0, alpha = 1.

    bits = d float_bits, plus the 12-bit shared binade at 16 bits (12 + 16 d), where C(x) is x
    rounded to float16 on the scale of its largest coordinate (see the module notes).
    """

    float_bits: int
    unbiased: ClassVar[bool] = True
    contractive: ClassVar[bool] = True

    @property
    def name(self) -> str:
        return "identity()" if self.float_bits == 32 else f"identity(float_bits={self.float_bits})"

    def bits(self, d: int) -> int:
        return _float_field_bits(_dimension(d), self.float_bits)

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
        return _send_floats(x, self.float_bits)

    def decode(self, codes: tuple[jax.Array, ...], d: int) -> jax.Array:
        return _received_floats(codes, self.float_bits)

    def pack(self, writer: BitWriter, codes: tuple[np.ndarray, ...], d: int) -> None:
        _pack_floats(writer, codes, self.float_bits)

    def unpack(self, reader: BitReader, d: int, dtype: Any) -> tuple[np.ndarray, ...]:
        return _unpack_floats(reader, (d,), self.float_bits, dtype)


@dataclass(frozen=True, repr=False)
class _Sparsifier(Compressor):
    """Keeps k = kept(d) coordinates, sent as k indices and k values.

    Each index takes max(1, ceil(log2 d)) bits: bits = k (float_bits + max(1, ceil(log2 d))), plus
    the 12-bit shared binade of the values at 16 bits (see the module notes).
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
            if self.fraction is None:  # unreachable: the constructors' _sparsity gives exactly one of k, fraction
                raise ConfigError(f"{self.func} needs exactly one of k or fraction")
            return max(1, round(self.fraction * d))
        if self.k > d:
            raise ConfigError(f"{self.name} keeps more coordinates than the vector has (d={d}); use k <= {d}")
        return self.k

    def bits(self, d: int) -> int:
        d = _dimension(d)
        k = self.kept(d)
        return k * _index_bits(d) + _float_field_bits(k, self.float_bits)

    # The message: the k chosen indices and their (scaled) values.
    has_wire_format: ClassVar[bool] = True

    def _chosen(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(indices, values) of the kept coordinates, values as computed before rounding."""
        raise NotImplementedError

    def encode(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, ...]:
        """(indices as int32, *the codes of the values at float_bits)."""
        idx, values = self._chosen(key, x)
        return (idx.astype(jnp.int32), *_send_floats(values, self.float_bits))

    def decode(self, codes: tuple[jax.Array, ...], d: int) -> jax.Array:
        values = _received_floats(codes[1:], self.float_bits)
        return jnp.zeros((d,), values.dtype).at[codes[0]].set(values)

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        return self.decode(self.encode(key, x), x.shape[0])

    def pack(self, writer: BitWriter, codes: tuple[np.ndarray, ...], d: int) -> None:
        writer.put(codes[0], _index_bits(d))
        _pack_floats(writer, codes[1:], self.float_bits)

    def unpack(self, reader: BitReader, d: int, dtype: Any) -> tuple[np.ndarray, ...]:
        k = self.kept(d)
        idx = reader.take(k, _index_bits(d)).astype(np.int32)
        return (idx, *_unpack_floats(reader, (k,), self.float_bits, dtype))


def _uniform_subset(key: jax.Array, d: int, k: int) -> jax.Array:
    """k distinct indices of [0, d), uniform over the k-subsets."""
    return jax.random.choice(key, d, shape=(k,), replace=False)


@dataclass(frozen=True, repr=False)
class _RandK(_Sparsifier):
    """Scaled random sparsification: C(x) = (d/k) sum_{j in S} x_j e_j, S uniform of size k.

    P(j in S) = k/d gives E[C(x)] = x and E||C(x) - x||^2 = (d/k - 1) ||x||^2 exactly, so
    omega = d/k - 1. The message is k indices of max(1, ceil(log2 d)) bits and the k values
    (d/k) x_j: bits = k (float_bits + max(1, ceil(log2 d))), plus 12 at 16 bits. A value (d/k) x_j
    beyond the dtype's largest finite number is sent as that number (saturated; unbiased only for
    (d/k) ||x||_inf up to it). Not contractive: alpha is None.
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
        return chosen, _rescaled(lambda v: v * (d / k), x[chosen])


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
    as rand_k: bits = k (float_bits + max(1, ceil(log2 d))), plus 12 at 16 bits. With the same key
    it keeps the same coordinates as rand_k, so rand_k(k)(key, x) = (d/k) rand_k_unscaled(k)(key, x)
    (up to rounding at 16 bits).
    """

    func: ClassVar[str] = "rand_k_unscaled"

    def _chosen(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        chosen = _uniform_subset(key, x.shape[0], self.kept(x.shape[0]))
        return chosen, x[chosen]


@dataclass(frozen=True, repr=False)
class _TopK(_UnscaledSparsifier):
    """Greedy sparsification: keep the k coordinates of largest |x_j|, unscaled.

    C(x) = sum_{j in T} x_j e_j with T the indices of the k largest |x_j| (ties broken by
    `jax.lax.top_k`: the lower index first; XLA ranks subnormal |x_j| too, on their bits).
    Deterministic (the key is unused), and ||C(x) - x||^2 is the sum of the d - k smallest x_j^2;
    their mean is at most the mean of all d squares, so ||C(x) - x||^2 <= (1 - k/d) ||x||^2 on every
    call: alpha = k/d. Biased: omega is None. bits = k (float_bits + max(1, ceil(log2 d))), plus 12 at
    16 bits. A nonzero x keeps its largest |x_j| (nonzero after rounding: it sets the shared binade).
    """

    func: ClassVar[str] = "top_k"

    def _chosen(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        _, largest = jax.lax.top_k(jnp.abs(x), self.kept(x.shape[0]))
        return largest, x[largest]

    def refresh_lag(self, d: int) -> float:
        """(d / k - 1) / 2: the largest residuals go first, so residuals of one scale are sent in turn, as a
        round robin, each waiting d / k - 1 rounds at most (on Gaussian targets it lagged less still)."""
        return 0.5 * (d / self.kept(d) - 1.0)


class _UnbiasedQuantizer(Compressor):
    """An unbiased, not contractive quantiser whose name is its constructor call (``_signature``, which
    its contractive scaling extends with ``contractive=True``)."""

    unbiased: ClassVar[bool] = True
    contractive: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self._signature()

    @abc.abstractmethod
    def _signature(self, *extra: str) -> str:
        """The constructor call with ``extra`` arguments appended."""


@dataclass(frozen=True, repr=False)
class _QSGD(_UnbiasedQuantizer):
    """QSGD stochastic quantisation with s = levels (Alistarh et al., 2017).

    C(x)_j = ||x||_2 sign(x_j) xi_j / s, where with r_j = |x_j| / ||x||_2 and l = floor(s r_j),
    xi_j = l + 1 with probability s r_j - l and l otherwise, so E[xi_j] = s r_j and E[C(x)] = x;
    C(0) = 0. Lemma 3.1 gives omega = min(d / s^2, sqrt(d) / s). The message is the norm as one
    float, then per coordinate a sign bit and xi_j in ceil(log2(s + 1)) bits:
    bits = float_bits + d (1 + ceil(log2(s + 1))), plus the 12-bit shared binade of the norm at 16
    bits (see the module notes). Not contractive: alpha is None.

    Range: the norm and the r_j are computed on x 2^-c, c = floor(log2 max_j |x_j|) (the same numbers
    bit for bit where nothing under- or overflows), so no square overflows or underflows; a norm
    beyond the dtype's largest finite number is sent as that number (every |C(x)_j| <= the sent norm
    stays finite; unbiased for ||x||_2 up to it). A nonzero x has a positive sent norm, and where
    s^2 >= 2d its largest coordinate has s r_j >= s / sqrt(d) >= sqrt(2) (a margin over rounding),
    hence xi_j >= 1: C(x) != 0. A non-finite x gives a non-finite norm and output.
    """

    levels: int
    float_bits: int

    def _signature(self, *extra: str) -> str:
        return _call_repr("qsgd", (f"levels={self.levels}",), self.float_bits, extra)

    def bits(self, d: int) -> int:
        return _float_field_bits(1, self.float_bits) + _dimension(d) * (1 + self.levels.bit_length())

    def omega(self, d: int) -> float:
        d = _dimension(d)
        return min(d / self.levels**2, math.sqrt(d) / self.levels)

    def alpha(self, d: int) -> None:
        _dimension(d)
        return None

    has_wire_format: ClassVar[bool] = True
    _keep_codes: ClassVar[bool] = True

    def encode(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, ...]:
        """(*the codes of ||x||_2 at float_bits, sign(x_j) xi_j as int32)."""
        return self._encode_with(prng.uniform(key, x.shape, x.dtype), x)

    def _row_codes(self, key: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
        return jax.vmap(self._encode_with)(prng.uniform(key, v.shape, v.dtype), v)

    def _encode_with(self, uniform: jax.Array, x: jax.Array) -> tuple[jax.Array, ...]:
        """``encode`` with its uniforms given (one per coordinate)."""
        s = self.levels
        c = _top_binade(x)
        y = _ldexp(x, -c)  # max |y_j| in [1, 2): ||y|| in [1, 2 sqrt(d))
        norm_y = jnp.linalg.norm(y)
        scaled = s * jnp.abs(y) / jnp.where(norm_y > 0, norm_y, 1)
        low = jnp.floor(scaled)
        up = uniform < scaled - low
        # Rounding can push s|x_j|/||x|| a hair above s; clipping keeps xi_j on the grid {0..s}.
        level = jnp.nan_to_num(jnp.minimum(low + up, s))  # a non-finite x: the norm carries the NaN
        norm = _ldexp(norm_y, c)  # ||x||_2, saturated
        return (*_send_floats(norm, self.float_bits), (jnp.sign(y) * level).astype(jnp.int32))

    def decode(self, codes: tuple[jax.Array, ...], d: int) -> jax.Array:
        norm, signed = _received_floats(codes[:-1], self.float_bits), codes[-1]
        sign, level = jnp.sign(signed).astype(norm.dtype), jnp.abs(signed).astype(norm.dtype)
        return _rescaled(lambda n: n * sign * level / self.levels, norm)

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        return self.decode(self.encode(key, x), x.shape[0])

    def pack(self, writer: BitWriter, codes: tuple[np.ndarray, ...], d: int) -> None:
        signed = codes[-1]
        _pack_floats(writer, codes[:-1], self.float_bits)
        writer.put(np.asarray(signed) < 0, 1)
        writer.put(np.minimum(np.abs(signed), self.levels), self.levels.bit_length())

    def unpack(self, reader: BitReader, d: int, dtype: Any) -> tuple[np.ndarray, ...]:
        norm = _unpack_floats(reader, (), self.float_bits, dtype)
        negative = reader.take(d, 1).astype(bool)
        level = reader.take(d, self.levels.bit_length()).astype(np.int32)
        return (*norm, np.where(negative, -level, level).astype(np.int32))


@dataclass(frozen=True, repr=False)
class _Natural(_UnbiasedQuantizer):
    """Natural compression (Horvath et al., 2019): random rounding to a signed power of two.

    For x_j != 0 let e = floor(log2 |x_j|) and a = 2^e, so |x_j| in [a, 2a). Then
    C(x)_j = sign(x_j) 2a with probability p = (|x_j| - a) / a and sign(x_j) a otherwise, so
    E[C(x)_j] = x_j; C(x)_j = 0 where x_j = 0. With t = |x_j| / a in [1, 2),
    E(C(x)_j - x_j)^2 = (2a - |x_j|)(|x_j| - a) = x_j^2 (2 - t)(t - 1) / t^2 <= x_j^2 / 8
    (maximum at t = 4/3), hence omega = 1/8 (up to the grid's term below), attained when every
    |x_j| is 4/3 times a power of two.

    Message: b = floor(log2 max_j |x_j|) over the finite nonzero x_j (0 if none) in the 12-bit
    shared binade field, then per coordinate a sign bit and the E-bit biased exponent field of the
    IEEE format of float_bits bits (E = 5, 8, 11 for 16, 32, 64) of y_j = C(x)_j 2^(hi - 1 - b): an
    IEEE number with a zero mantissa, code 0 meaning zero (and the all-ones code infinity).
    bits = 12 + d (1 + E): 12 + 6d, 12 + 9d, 12 + 12d.

    Range: the rounding is done on x 2^(hi - 1 - b) (exactly, on the integers of x's bits: see
    ``encode``), whose largest |x_j| lies in [2^(hi - 1), 2^hi), on the grid 0, 2^lo..2^hi of the powers that are normal
    numbers of both the
    wire format and x's dtype (lo, hi = -14, 15 at 16 bits; -126, 127 for float32 at 32 or 64
    bits): the largest coordinate never rounds beyond the grid, and a nonzero x keeps it nonzero.
    A coordinate below 2^lo on that scale is rounded the same way between 0 and 2^lo: unbiased, with
    variance <= 4^lo / 4 <= 4^(lo - hi) ||x 2^(hi - 1 - b)||^2 instead of x_j^2 / 8, so
    omega = 1/8 + (d - 1) 4^(lo - hi) with (lo, hi) of the wire format and float32 (2^-58 (d - 1) at
    16 bits; 2^-506 (d - 1) at 32 and 64 bits, which leaves 1/8 as a float64; a float16 x has
    float16's grid, as at 16 bits). The decoded C(x)_j = y_j 2^(b + 1 - hi) saturates to the dtype's
    largest finite number where it would exceed it (rounding up from the dtype's top binade: biased
    there, but finite); +-inf is sent as +-inf and NaN as inf (decoded NaN in simulation). Not
    contractive: alpha is None; natural(contractive=True) is C / (1 + omega).
    """

    float_bits: int

    def _signature(self, *extra: str) -> str:
        return _call_repr("natural", (), self.float_bits, extra)

    def bits(self, d: int) -> int:
        return _BINADE_BITS + _dimension(d) * (1 + _IEEE_EXPONENTS[self.float_bits][0])

    def _grid(self, dtype: Any) -> tuple[int, int]:
        """(lo, hi): the powers 2^lo..2^hi that are normal numbers of the wire format and of dtype."""
        _, e_min, e_max = _IEEE_EXPONENTS[self.float_bits]
        info = jnp.finfo(dtype)
        return max(e_min, int(info.minexp)), min(e_max, int(info.maxexp) - 1)

    def omega(self, d: int) -> float:
        lo, hi = self._grid(jnp.float32)
        return 0.125 + (_dimension(d) - 1) * 4.0 ** (lo - hi)

    def alpha(self, d: int) -> None:
        _dimension(d)
        return None

    has_wire_format: ClassVar[bool] = True
    _keep_codes: ClassVar[bool] = True

    def encode(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, ...]:
        """(b, y): the shared binade and the rounded y_j = C(x)_j 2^(hi - 1 - b), signed powers of two,
        0 or +-inf (NaN stays NaN), in x's dtype.

        Computed on the bits, with integer operations only (no ``_ldexp``). The shared binade b is that of
        the largest finite |x_j|, the largest of their bit patterns (nonnegative floats are ordered as
        their bits): one integer reduction. Write |x_j| = (1 + r_j 2^-nmant) 2^e_j (subnormals normalised,
        r_j an integer) and M_j = 2^nmant + r_j its significand. Then |x_j| 2^(hi - 1 - b) has binade
        ey_j = e_j + hi - 1 - b. The uniform of ``jax.random.uniform`` is u = k 2^-nmant (``prng.uniform_grid``:
        the same draws), and k is compared as an integer. On the grid (ey_j >= lo) the coordinate is
        rounded up with probability r_j 2^-nmant: when k < r_j. Below the grid, at
        q = |x_j| 2^(hi - 1 - b - lo) = M_j 2^-(t + nmant) in (0, 1), t = lo - ey_j >= 1, it goes to 2^lo
        when u < ceil(q 2^nmant) 2^-nmant, i.e. when k < ceil(M_j 2^-t), the integer ceiling taken exactly
        on the significand's bits (probability q up to the uniform's grid of 2^-nmant; past t = nmant + 1
        the ceiling of a nonzero M_j is 1)."""
        return self._encode_with(prng.uniform_grid(key, x.shape, x.dtype), x)

    def _row_codes(self, key: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
        return jax.vmap(self._encode_with)(prng.uniform_grid(key, v.shape, v.dtype), v)

    def _encode_with(self, k: jax.Array, x: jax.Array) -> tuple[jax.Array, ...]:
        """``encode`` with its uniforms given, as the integers k of u = k 2^-nmant (``prng.uniform_grid``)."""
        lo, hi = self._grid(x.dtype)
        info = jnp.finfo(x.dtype)
        width, nmant, nexp, minexp = int(info.bits), int(info.nmant), int(info.nexp), int(info.minexp)
        uint = jnp.dtype(f"uint{width}")
        one = _uint(1, uint)
        u = jax.lax.bitcast_convert_type(x, uint)
        sign = u & _uint(2 ** (width - 1), uint)
        size = u ^ sign  # |x_j|'s bits
        special = size >= _uint((2**nexp - 1) << nmant, uint)  # +-inf, NaN
        b = _top_binade(x)
        field = (size >> _uint(nmant, uint)).astype(jnp.int32)
        frac = size & _uint(2**nmant - 1, uint)
        length = _bit_length(frac)  # of a subnormal's fraction (0 for a zero)
        e = jnp.where(field > 0, field + (minexp - 1), (minexp - 1 - nmant) + length)
        r = jnp.where(field > 0, frac, (frac << (nmant + 1 - length).astype(uint)) & _uint(2**nmant - 1, uint))
        nonzero = size > 0
        ey = e + (hi - 1) - b  # the binade of |y_j|
        on_grid = nonzero & (ey >= lo)
        # Below the grid: ceil(M 2^-t), t = lo - ey >= 1 (past nmant + 1 places it is 1 for a nonzero M).
        significand = jnp.where(nonzero, r | _uint(2**nmant, uint), _uint(0, uint))
        t = jnp.clip(lo - ey, 1, nmant + 1).astype(uint)
        ceiling = (significand >> t) + ((significand & ((one << t) - one)) > 0).astype(uint)
        up = k < jnp.where(on_grid, r, ceiling)
        binade = jnp.where(on_grid, ey + up.astype(jnp.int32), lo)  # <= hi: the largest |y_j| is below 2^hi
        magnitude = jnp.where(on_grid | up, (binade - minexp + 1).astype(uint) << _uint(nmant, uint), _uint(0, uint))
        y = jax.lax.bitcast_convert_type(jnp.where(special, u, sign | magnitude), x.dtype)
        return b, y

    def decode(self, codes: tuple[jax.Array, ...], d: int) -> jax.Array:
        return self._powers(codes, 1.0)

    def _decode_divided(self, codes: tuple[jax.Array, ...], d: int, scale: float) -> jax.Array:
        return self._powers(codes, scale)

    def _powers(self, codes: tuple[jax.Array, ...], scale: float) -> jax.Array:
        """The decoded C(x)_j = y_j 2^(b + 1 - hi), divided by ``scale`` as ``_rescaled`` divides (the
        quotient of +-1 by scale, then placed at y_j's binade with rounding where it is subnormal);
        a decoded value beyond the dtype's range saturates to its largest finite number (and that,
        divided, to the quotient of the largest finite number by scale). Integer operations only."""
        b, y = codes
        dtype = y.dtype
        info = jnp.finfo(dtype)
        width, nmant, nexp, minexp, maxexp = (
            int(info.bits),
            int(info.nmant),
            int(info.nexp),
            int(info.minexp),
            int(info.maxexp),
        )
        uint = jnp.dtype(f"uint{width}")
        npuint = np.dtype(f"uint{width}")
        # The quotient 1 / scale in dtype (IEEE division, as XLA divides): its mantissa field and binade.
        quotient = np.asarray(np.ones((), dtype) / np.asarray(scale).astype(dtype)).astype(dtype)
        qbits = int(quotient.view(npuint))
        mant, shift = qbits & (2**nmant - 1), ((qbits >> nmant) & (2**nexp - 1)) + minexp - 1
        saturated = int((np.asarray(info.max, dtype) / np.asarray(scale).astype(dtype)).astype(dtype).view(npuint))
        u = jax.lax.bitcast_convert_type(y, uint)
        sign = u & _uint(2 ** (width - 1), uint)
        field = ((u >> _uint(nmant, uint)) & _uint(2**nexp - 1, uint)).astype(jnp.int32)
        special = field == 2**nexp - 1
        e = field + (minexp - 1) + (jnp.asarray(b, jnp.int32) + 1 - self._grid(dtype)[1])  # binade of C(x)_j
        magnitude = jnp.where(e > maxexp - 1, _uint(saturated, uint), _power_bits(e + shift, dtype, mant))
        out = jnp.where(special, u, sign | jnp.where(field == 0, _uint(0, uint), magnitude))
        return jax.lax.bitcast_convert_type(out, dtype)

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        return self.decode(self.encode(key, x), x.shape[0])

    def pack(self, writer: BitWriter, codes: tuple[np.ndarray, ...], d: int) -> None:
        width, (exp_bits, _, _) = self.float_bits, _IEEE_EXPONENTS[self.float_bits]
        _put_binade(writer, codes[0])
        u = np.asarray(codes[1]).astype(f"float{width}").view(f"uint{width}").astype(np.uint64)
        mant = width - 1 - exp_bits
        writer.put(u >> np.uint64(width - 1), 1)
        writer.put((u >> np.uint64(mant)) & np.uint64(2**exp_bits - 1), exp_bits)

    def unpack(self, reader: BitReader, d: int, dtype: Any) -> tuple[np.ndarray, ...]:
        width, (exp_bits, _, _) = self.float_bits, _IEEE_EXPONENTS[self.float_bits]
        b = _take_binade(reader)
        sign = reader.take(d, 1)
        exponent = reader.take(d, exp_bits)
        u = (sign << np.uint64(width - 1)) | (exponent << np.uint64(width - 1 - exp_bits))
        return b, u.astype(f"uint{width}").view(f"float{width}").astype(dtype)


@dataclass(frozen=True, repr=False)
class _Scaled(Compressor):
    """C'(x) = C(x) / (1 + omega) for an unbiased C with variance constant omega = omega(d).

    Write lambda C(x) - x = lambda (C(x) - x) - (1 - lambda) x; as E[C(x) - x] = 0 the cross term
    vanishes, so E||lambda C(x) - x||^2 = lambda^2 E||C(x) - x||^2 + (1 - lambda)^2 ||x||^2
    <= (lambda^2 omega + (1 - lambda)^2) ||x||^2. The bracket is smallest at
    lambda = 1 / (1 + omega), where it equals omega / (1 + omega) = 1 - 1 / (1 + omega): C' is
    contractive with alpha = 1 / (1 + omega). Biased for omega > 0: omega is None. The receiver
    knows the constant, so the message is C's: same bits. The division is done on the bits' scale
    (``_rescaled``), so a subnormal C(x)_j stays nonzero where the CPU would flush it.
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
        self._base_omega(d)
        return None

    def _base_omega(self, d: int) -> float:
        """omega(d) of the base, a float: only unbiased compressors are wrapped (:func:`scale_to_contractive`)."""
        omega = self.base.omega(d)
        if omega is None:
            raise ConfigError(f"scale_to_contractive needs an unbiased compressor, but {self.base.name} is biased")
        return omega

    def alpha(self, d: int) -> float:
        return 1.0 / (1.0 + self._base_omega(d))

    def _shrunk(self, x_hat: jax.Array) -> jax.Array:
        """C(x) / (1 + omega(d)), d = len(C(x))."""
        scale = 1.0 + self._base_omega(x_hat.shape[0])
        return _rescaled(lambda v: v / scale, x_hat)

    def _compress(self, key: jax.Array, x: jax.Array) -> jax.Array:
        return self.decode(self.base.encode(key, x), x.shape[0])

    def __call__(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """C's message and bits (its own encoding, fixed-length or not), decoded and rescaled."""
        x_hat, bits = self.base(key, x)
        return self._shrunk(x_hat), bits

    @property
    def has_wire_format(self) -> bool:  # type: ignore[override]  # a ClassVar on Compressor, the base's here
        return self.base.has_wire_format

    def encode(self, key: jax.Array, x: jax.Array) -> tuple[jax.Array, ...]:
        return self.base.encode(key, x)

    def _row_codes(self, key: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
        return self.base._row_codes(key, v)

    @property
    def _keep_codes(self) -> bool:  # type: ignore[override]  # a ClassVar on Compressor, the base's here
        return self.base._keep_codes

    def decode(self, codes: tuple[jax.Array, ...], d: int) -> jax.Array:
        return self.base._decode_divided(codes, d, 1.0 + self._base_omega(d))

    def pack(self, writer: BitWriter, codes: tuple[np.ndarray, ...], d: int) -> None:
        self.base.pack(writer, codes, d)

    def unpack(self, reader: BitReader, d: int, dtype: Any) -> tuple[np.ndarray, ...]:
        return self.base.unpack(reader, d, dtype)


def identity(float_bits: int = 32) -> Compressor:
    """No compression: C(x) = x, d floats of float_bits bits each; omega = 0, alpha = 1."""
    return _Identity(_float_bits(float_bits))


def rand_k(k: int | None = None, *, fraction: float | None = None, float_bits: int = 32) -> Compressor:
    """Unbiased random-k sparsification keeping k (or max(1, round(fraction * d))) coordinates."""
    k, fraction = _sparsity("rand_k", k, fraction)
    return _RandK(k, fraction, _float_bits(float_bits))


def rand_k_unscaled(k: int | None = None, *, fraction: float | None = None, float_bits: int = 32) -> Compressor:
    """Contractive random-k sparsification without the d/k scaling: alpha = k/d, biased.

    Keeps k (or max(1, round(fraction * d))) uniformly chosen coordinates as they are.
    """
    k, fraction = _sparsity("rand_k_unscaled", k, fraction)
    return _RandKUnscaled(k, fraction, _float_bits(float_bits))


def top_k(k: int | None = None, *, fraction: float | None = None, float_bits: int = 32) -> Compressor:
    """Contractive top-k sparsification: keep the k largest |x_j|; alpha = k/d, deterministic."""
    k, fraction = _sparsity("top_k", k, fraction)
    return _TopK(k, fraction, _float_bits(float_bits))


def qsgd(levels: int, *, float_bits: int = 32, contractive: bool = False) -> Compressor:
    """QSGD quantisation of |x_j| / ||x||_2 to the grid {0, 1/s, ..., 1}, s = levels.

    Unbiased with omega = min(d / s^2, sqrt(d) / s); with contractive=True it is scaled by
    1 / (1 + omega), which is contractive with alpha = 1 / (1 + omega) and biased.
    """
    levels = _integer(levels, "levels")
    if not 1 <= levels <= _INT32_MAX:
        raise ConfigError(f"qsgd needs 1 <= levels <= 2^31 - 1 quantisation levels (int32 level indices), got {levels}")
    c = _QSGD(levels, _float_bits(float_bits))
    return _Scaled(c) if _flag(contractive, "contractive") else c


def natural(float_bits: int = 32, *, contractive: bool = False) -> Compressor:
    """Natural compression: unbiased rounding to a signed power of two, omega = 1/8 (plus
    (d - 1) 2^-58 at 16 bits, for coordinates 2^29 times smaller than the largest).

    A 12-bit shared binade, then one sign bit and one IEEE exponent field per coordinate
    (bits = 12 + 6d, 12 + 9d, 12 + 12d for float_bits 16, 32, 64). With contractive=True it returns
    C_nat(x) / (1 + omega): alpha = 1 / (1 + 1/8) = 8/9 at 32 and 64 bits.
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
        raise ConfigError(f"scale_to_contractive needs an unbiased or contractive compressor, but {c.name} is neither")
    return _Scaled(c)


def compress_tree(c: Compressor, key: jax.Array, tree: Any) -> tuple[Any, jax.Array]:
    """Compress a pytree as one vector: ravel it, apply c, unravel; returns (tree_hat, bits)."""
    flat, unravel = ravel_pytree(tree)
    flat_hat, bits = c(key, flat)
    return unravel(flat_hat), bits
