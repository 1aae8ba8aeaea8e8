"""Seeds to JAX PRNG keys: the one place where a user's ``seed`` becomes a key.

``jax.random.PRNGKey(seed)`` keeps only the low 32 bits of ``seed`` when ``jax_enable_x64`` is off
(seeds ``s`` and ``s + 2**32`` give the same fit) and overflows above ``2**63``. :func:`seed_key`
builds the key from both 32-bit halves of any seed in ``[0, 2**64)``: for the default threefry PRNG
that is exactly ``PRNGKey(seed)``'s ``[seed >> 32, seed & 0xFFFFFFFF]`` wherever ``PRNGKey`` is
correct (every seed below 2**63 under x64, below 2**32 without), so earlier fits are unchanged.
"""

from __future__ import annotations

from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from .errors import ConfigError, require_int

SEED_LIMIT = 2**64
"""Seeds are integers in ``[0, SEED_LIMIT)``."""


def require_seed(seed: object, what: str = "seed") -> int:
    """``seed`` as an int in ``[0, 2**64)``, or a JAX PRNG key (``jax.random.PRNGKey(s)`` or ``jax.random.key(s)``)
    as the int whose key it is (:func:`seed_key` gives the key back, so the fit is the one of that int).

    Raises
    ------
    ConfigError
        If ``seed`` is not an integer (bools refused), is negative, or is ``2**64`` or more; or a key of a PRNG
        other than JAX's default threefry, or a batch of keys.
    """
    seed = _key_as_int(seed, what)
    value = require_int(seed, what, 0, maximum=None)
    if value >= SEED_LIMIT:
        raise ConfigError(f"{what} must be below 2**64, got {seed!r}; reduce it, e.g. {what} % 2**64")
    return value


def _key_as_int(seed: object, what: str) -> object:
    """A single threefry key (raw uint32[2] or typed) as the int ``high * 2**32 + low``; anything else as it is."""
    if not isinstance(seed, jax.Array):
        return seed
    data = seed
    if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        impl = str(jax.random.key_impl(seed))
        if "threefry" not in impl or seed.shape != ():
            raise ConfigError(f"{what} as a key must be one threefry key (jax.random.key(s)), got {impl} {seed.shape}")
        data = jax.random.key_data(seed)
    elif cast(Any, jax.config).jax_default_prng_impl != "threefry2x32":
        raise ConfigError(f"{what} as a raw key needs JAX's default threefry PRNG; pass an int seed")
    if data.shape != (2,) or data.dtype != jnp.uint32:
        raise ConfigError(f"{what} must be an int or one PRNG key (uint32 of shape (2,)), got {data.dtype}{data.shape}")
    high, low = (int(v) for v in np.asarray(data))
    return (high << 32) | low


def seed_key(seed: object, what: str = "seed") -> jax.Array:
    """The raw (uint32) PRNG key of ``seed``, distinct for every seed in ``[0, 2**64)``.

    Raises
    ------
    ConfigError
        As :func:`require_seed`.
    """
    value = require_seed(seed, what)
    high, low = value >> 32, value & 0xFFFFFFFF
    # jax.config's options are dynamic attributes (not in its type); this one has no ``config.read``
    if cast(Any, jax.config).jax_default_prng_impl == "threefry2x32":
        return jnp.array([high, low], dtype=jnp.uint32)
    key = jax.random.PRNGKey(low)  # another PRNG: its own seeding of the low half, the high half folded in
    return key if high == 0 else jax.random.fold_in(key, high)
