"""Messages as bytes: what an algorithm's payload puts on a network.

A message payload (see :class:`fedbayes.engine.Message`) is a pytree of three kinds of parts:

* dense arrays, sent as float32 numbers (``FLOAT_BITS`` = 32 bits each; integer leaves as int32);
* :class:`~fedbayes.compress.Coded` messages of a compressor, sent in the compressor's own encoding
  (indices and values, a norm and signed levels, sign and exponent fields: ``Compressor.pack``);
* :class:`Masked` vectors, of which only the coordinates in a mask both ends know are sent (TAMUNA's
  compression pattern, a function of the round's public key and the client's slot in the cohort).

:func:`pack` writes one payload as one bit string of exactly as many bits as the ledger charges
(rounded up to whole bytes once per message) and :func:`unpack` reads it back into a payload, given a
template of its structure (shapes, dtypes, compressors: :func:`template`). :func:`decode_tree` replaces
every coded part by what the receiver reconstructs; the simulation engine applies it to every message
it delivers, so simulation and network compute the same numbers.
"""

from __future__ import annotations

from typing import Any, NamedTuple
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .compress import BitReader, BitWriter, Coded
from .errors import ConfigError, FedbayesError

FLOAT_BITS = 32


class WireError(FedbayesError, ValueError):
    """A message's bytes do not fit the structure its receiver expects (:func:`unpack`): the two ends
    built different runs. Both must run the same fedbayes version, model, algorithm settings and data
    layout (keys, client sizes, shapes, dtypes)."""


class Masked:
    """A vector of which only the coordinates in ``mask_fn(shared_key, slot)`` are sent.

    ``values`` holds the vector with zeros off the mask (the receiver's reconstruction); ``mask_fn`` is a
    function of the round's public key and the sender's slot in the cohort, known to both ends, so the
    mask itself costs nothing. A pytree whose one leaf is ``values``.
    """

    def __init__(self, values: Any, mask_fn: Callable[[jax.Array, jax.Array], jax.Array]):
        self.values, self.mask_fn = values, mask_fn

    def __repr__(self) -> str:
        return f"Masked({getattr(self.values, 'shape', '?')})"


jax.tree_util.register_pytree_node(Masked, lambda m: ((m.values,), m.mask_fn), lambda fn, ch: Masked(ch[0], fn))


def _is_part(x: Any) -> bool:
    return isinstance(x, (Coded, Masked))


def decode_tree(payload: Any) -> Any:
    """The payload as the receiver reconstructs it: coded parts decoded, masked parts as dense vectors."""

    def decode(x):
        if isinstance(x, Coded):
            return x.decoded()
        if isinstance(x, Masked):
            return x.values
        return x

    return jax.tree_util.tree_map(decode, payload, is_leaf=_is_part)


class Context(NamedTuple):
    """What both ends know about a message besides its bytes: the round's public key and the sender's
    (or, for a reply, the receiver's) slot in the cohort."""

    shared_key: Any = None
    slot: int = 0


_MASKS: dict[Any, Callable] = {}


def _mask(part: Masked, context: Context) -> np.ndarray:
    if context.shared_key is None:
        raise ConfigError("a masked message needs the round's public key to be packed or unpacked")
    fn = _MASKS.get(part.mask_fn)
    if fn is None:
        fn = _MASKS[part.mask_fn] = jax.jit(part.mask_fn)
    return np.asarray(fn(context.shared_key, jnp.asarray(context.slot)), bool)


def _dense_width(dtype: Any) -> tuple[str, int]:
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.floating):
        return "float", FLOAT_BITS
    if np.issubdtype(dtype, np.integer) or dtype == np.bool_:
        return "int", 32
    raise ConfigError(f"cannot send an array of dtype {dtype}")


def pack(payload: Any, context: Context = Context()) -> tuple[bytes, int]:
    """``(data, bits)``: the payload's message, ``bits`` long, padded to ceil(bits / 8) bytes."""
    writer = BitWriter()
    for part in jax.tree_util.tree_leaves(payload, is_leaf=_is_part):
        if isinstance(part, Coded):  # one message per element of its batch axes (e.g. one per chain)
            batch = part.batch_shape()
            codes = [np.asarray(c).reshape((-1,) + np.shape(c)[len(batch) :]) for c in part.codes]
            for j in range(int(np.prod(batch, dtype=int))):
                part.compressor.pack(writer, tuple(c[j] for c in codes), part.d)
        elif isinstance(part, Masked):
            values = np.asarray(part.values)
            writer.put_floats(values[_mask(part, context)], FLOAT_BITS)
        else:
            arr = np.asarray(part)
            kind, width = _dense_width(arr.dtype)
            if kind == "float":
                writer.put_floats(arr.reshape(-1), width)
            else:
                writer.put(arr.reshape(-1).astype(np.int64).astype(np.uint32), width)
    return writer.tobytes(), writer.bits


def unpack(data: bytes, template: Any, context: Context = Context()) -> Any:
    """The payload a :func:`pack` message encodes; ``template`` gives its structure (a payload whose
    leaves may be ``jax.ShapeDtypeStruct``, e.g. from :func:`template`)."""
    reader = BitReader(data)
    parts, treedef = jax.tree_util.tree_flatten(template, is_leaf=_is_part)
    try:
        out = _unpack_parts(reader, parts, context)
    except FedbayesError:
        raise
    except ValueError as err:  # the reader ran out of bits
        raise WireError(
            f"a message of {len(data)} bytes is shorter than the structure its receiver expects ({err}); {_MISMATCH}"
        ) from err
    if len(data) != -(-reader.pos // 8):
        raise WireError(
            f"a message of {len(data)} bytes is longer than the structure its receiver expects "
            f"({reader.pos} bits); {_MISMATCH}"
        )
    return jax.tree_util.tree_unflatten(treedef, out)


_MISMATCH = (
    "the sender and the receiver built different runs: run the same fedbayes version, model, algorithm "
    "settings and data layout (keys, client sizes, shapes, dtypes) at both ends"
)


def _unpack_parts(reader: BitReader, parts: list[Any], context: Context) -> list[Coded | Masked | np.ndarray]:
    out: list[Coded | Masked | np.ndarray] = []
    for part in parts:
        if isinstance(part, Coded):
            batch = part.batch_shape()
            msgs = [part.compressor.unpack(reader, part.d, part.dtype) for _ in range(int(np.prod(batch, dtype=int)))]
            codes = tuple(
                np.stack([np.asarray(m[i]) for m in msgs])
                .reshape(batch + np.shape(msgs[0][i]))
                .astype(part.codes[i].dtype)
                for i in range(len(part.codes))
            )
            out.append(Coded(codes, part.compressor, part.d, part.dtype, part.layout))
        elif isinstance(part, Masked):
            mask = _mask(part, context)
            values = np.zeros(part.values.shape, part.values.dtype)
            values[mask] = reader.take_floats(int(mask.sum()), FLOAT_BITS)
            out.append(Masked(values, part.mask_fn))
        else:
            kind, width = _dense_width(part.dtype)
            size = int(np.prod(part.shape))
            if kind == "float":
                vals = reader.take_floats(size, width)
            else:
                vals = reader.take(size, width).astype(np.uint32).view(np.int32)
            out.append(np.asarray(vals, dtype=part.dtype).reshape(part.shape))
    return out


def template(payload: Any) -> Any:
    """The structure of a payload: its leaves as ``jax.ShapeDtypeStruct`` (coded parts kept as such)."""
    return jax.tree_util.tree_map(
        lambda x: (
            jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype) if not isinstance(x, jax.ShapeDtypeStruct) else x
        ),
        payload,
    )


def unbatch(payload: Any, i: int) -> Any:
    """Member ``i`` of a payload stacked over a leading axis (e.g. the cohort's uploads)."""
    return jax.tree_util.tree_map(lambda x: x[i], payload)
