"""Random bits as ``jax.random.bits`` draws them, without its loop on a CPU.

JAX draws random bits by hashing a counter with the key (Threefry-2x32, 20 rounds: Salmon et al., 2011,
"Parallel random numbers: as easy as 1, 2, 3"). On a CPU it lowers that hash to a loop of five iterations
of four rounds each, which XLA does not fuse with anything and whose state it copies on every iteration;
when each client draws with its own key (a compressor's uniforms in a federated round: a batch of keys,
one per client) the loop's state is as large as the draws. :func:`bits` computes the same hash as one
sequence of elementwise integer operations, which XLA fuses into one vectorised loop: the same bits as
``jax.random.bits`` (tested for every width, for typed and raw keys, under ``vmap``), about 5x faster
for 1 000 clients drawing 50 uniforms each on two CPU cores (``benchmarks/README.md``, the samplers).

The same hash also decides how long a fit takes to compile. :func:`unrolled_hash` is a context in which JAX's own
Threefry primitive, wherever it is lowered (``jax.random.split``, ``fold_in``, ``normal``, NumPyro's ``seed``
handler), lowers on a CPU as JAX lowers it on every other platform: unrolled, one fused sequence of integer
operations, instead of the CPU's loop of five iterations. Every computation ``fedbayes`` compiles for a fit is
lowered inside it (:func:`fedbayes.engine.fit_jit`). The bits are the same (the same hash; JAX's GPU and TPU
lowering); what changes is XLA's work: a round of FedSOUL hashes keys a dozen times, each loop a while of its own
with its own kernels, and XLA compiled FedSOUL's chunk of rounds in 1.4 s instead of 2.4 s with the unrolled hash
(``benchmarks/README.md``, the start-up profile). Outside the context (a user's own JAX code) nothing changes.

:func:`bits` applies to JAX's default key implementation (``threefry2x32``) in its default layout
(``jax_threefry_partitionable``, where the i-th draw hashes the counter i); for any other implementation or
layout it calls ``jax.random.bits``. The first call checks the layout against ``jax.random.bits`` on a few
draws and falls back to it for good if they differ (a JAX version that changed it).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["bits", "threefry2x32", "uniform", "uniform_grid", "unrolled_hash"]

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = 0x1BD11BDA  # Threefry's key-schedule constant


def threefry2x32(k0: Any, k1: Any, x0: Any, x1: Any) -> tuple[Any, Any]:
    """Threefry-2x32 with 20 rounds of the counter words ``(x0, x1)`` under the key words ``(k0, k1)`` (uint32
    arrays, broadcast together): the hash of ``jax.extend.random.threefry_2x32``, unrolled. On JAX arrays, or on
    NumPy arrays (the known-answer vectors of Random123 in the tests)."""
    xp = jnp if any(isinstance(a, jax.Array) for a in (k0, k1, x0, x1)) else np
    u32 = xp.uint32
    ks = (k0, k1, k0 ^ k1 ^ u32(_PARITY))
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = ((x1 << u32(r)) | (x1 >> u32(32 - r))) ^ x0
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + u32(i + 1)
    return x0, x1


def _unrolled(words: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """``jax.random.bits`` in the partitionable layout, from a threefry key's two words: draw i (row-major)
    hashes the 64-bit counter i, split as (high word, low word); 32 bits are the two output words xor-ed,
    narrower ones the low bits of that, 64 bits the two words side by side."""
    lo = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
    b1, b2 = threefry2x32(words[..., 0], words[..., 1], jnp.zeros_like(lo), lo)
    width = jnp.dtype(dtype).itemsize * 8
    if width == 64:
        return (b1.astype(dtype) << jnp.asarray(32, dtype)) | b2.astype(dtype)
    return (b1 ^ b2).astype(dtype)


def _option(name: str) -> Any:
    """A ``jax.config`` option (dynamic attributes, not in its type)."""
    return getattr(jax.config, name)


@functools.cache
def _layout_matches() -> bool:
    """Whether ``jax.random.bits`` draws in the layout :func:`_unrolled` reproduces (checked once, eagerly,
    on a few draws of each width this JAX can hold)."""
    with jax.ensure_compile_time_eval():
        key = jax.random.key(20_261_128)
        words = jax.random.key_data(key)
        widths = (jnp.uint8, jnp.uint16, jnp.uint32) + ((jnp.uint64,) if _option("jax_enable_x64") else ())
        for dtype in widths:
            for shape in ((5,), (3, 4)):
                want = np.asarray(jax.random.bits(key, shape, dtype))
                got = np.asarray(_unrolled(words, shape, dtype))
                if want.dtype != got.dtype or not np.array_equal(want, got):
                    return False
    return True


def _threefry_words(key: jax.Array) -> jax.Array | None:
    """The key's two uint32 words when it is a Threefry key drawn in the partitionable layout; else None."""
    if not _option("jax_threefry_partitionable"):
        return None
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        if str(jax.random.key_impl(key)) != "threefry2x32":  # a name, or a spec whose str is its name
            return None
        return jax.random.key_data(key)
    if key.dtype != jnp.uint32 or key.shape[-1:] != (2,) or _option("jax_default_prng_impl") != "threefry2x32":
        return None
    return key


def bits(key: jax.Array, shape: tuple[int, ...], dtype: Any = None) -> jax.Array:
    """``jax.random.bits(key, shape, dtype)`` for one key (typed or raw), the same bits, computed as one
    fused sequence of integer operations where the key is a Threefry key (see the module docstring). The
    default dtype is JAX's: uint32, or uint64 with ``jax_enable_x64``."""
    shape = tuple(int(s) for s in shape)
    dtype = jax.dtypes.canonicalize_dtype(jnp.uint64 if dtype is None else dtype)
    words = _threefry_words(key)
    if words is None or math.prod(shape) >= 2**32 or not _layout_matches():
        return jax.random.bits(key, shape, dtype)
    return _unrolled(words, shape, dtype)


def uniform_grid(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """The integers k of ``jax.random.uniform(key, shape, dtype)`` = k 2^-nmant on [0, 1) (unsigned, below
    2^nmant): the random bits shifted right by width - nmant, as ``jax.random.uniform`` builds its floats."""
    info = jnp.finfo(dtype)
    uint = jnp.dtype(f"uint{int(info.bits)}")
    return bits(key, shape, uint) >> jnp.asarray(int(info.bits) - int(info.nmant), uint)


def uniform(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """``jax.random.uniform(key, shape, dtype)`` on [0, 1), the same numbers: k 2^-nmant (:func:`uniform_grid`),
    exact in ``dtype`` (k has at most nmant bits). Only [0, 1): JAX computes another range with a scaling whose
    rounding the compiler may place differently."""
    return uniform_grid(key, shape, dtype).astype(dtype) * jnp.asarray(2.0 ** -int(jnp.finfo(dtype).nmant), dtype)


# ------------------------------------------------------------------------------ the hash's lowering in a fit

_UNROLLED: contextvars.ContextVar[bool] = contextvars.ContextVar("fedbayes_unrolled_hash", default=False)


@functools.cache
def _install_lowering() -> bool:
    """Registers, once, a CPU lowering of JAX's Threefry primitive that is JAX's own CPU rule (the loop) outside
    :func:`unrolled_hash` and JAX's own rule for the other platforms (unrolled) inside it. Returns whether it
    could: the two rules are JAX internals, and a JAX without them keeps its own lowering (the same bits either
    way, only the compilation's time differs)."""
    try:
        from jax._src.interpreters import mlir
        from jax._src.random import threefry2x32 as threefry

        rolled = threefry._threefry2x32_cpu_lowering_rule
        unrolled = threefry._threefry2x32_lowering_rule
        primitive = threefry.threefry2x32_p
    except (ImportError, AttributeError):  # pragma: no cover - a JAX that moved them
        return False

    def lowering(ctx: Any, *args: Any, **params: Any) -> Any:
        return (unrolled if _UNROLLED.get() else rolled)(ctx, *args, **params)

    mlir.register_lowering(primitive, lowering, platform="cpu")
    return True


@contextlib.contextmanager
def unrolled_hash() -> Iterator[None]:
    """Within: JAX's Threefry hash lowers unrolled on a CPU too (the module docstring). Only the lowering changes,
    so it matters where a computation is traced and compiled, and a computation compiled once keeps its lowering;
    its bits are those of the loop."""
    _install_lowering()
    token = _UNROLLED.set(True)
    try:
        yield
    finally:
        _UNROLLED.reset(token)
