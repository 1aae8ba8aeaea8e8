"""Federated data containers.

:class:`FederatedData` holds one dictionary of arrays per client. Clients have ragged sizes, so the
arrays are also stored padded to a common length with a boolean mask, letting algorithms
``jax.vmap`` over clients. The partitioners that split a pooled data set into clients (IID, Dirichlet
label skew, or a fixed number of classes per client) are in :mod:`fedbayes.partition`; their client
ids are ready for :meth:`FederatedData.from_pooled`.
"""

from __future__ import annotations

import operator
import sys
import types
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, SupportsIndex, cast

import jax
import jax.numpy as jnp
import numpy as np
from numpy.typing import ArrayLike

from fedbayes.errors import ClientIndexError, DataError, PrecisionWarning

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["FederatedData"]


def _check_keys(data: Mapping[str, object]) -> None:
    if not isinstance(data, Mapping) or len(data) == 0:
        raise DataError(
            "federated data needs at least one key; got an empty or non-mapping value. "
            "Pass e.g. {'x': [x_client0, x_client1]}."
        )
    for key in data:
        if not isinstance(key, str):
            raise DataError(
                f"data keys must be str; got {key!r} of type {type(key).__name__}. Rename the key to a string."
            )


_ENABLE_X64 = "enable 64-bit JAX (jax.config.update('jax_enable_x64', True))"


def _x64_enabled() -> bool:
    """Whether 64-bit JAX is on (``jax_enable_x64``)."""
    return bool(cast(Any, jax.config).jax_enable_x64)  # config options are dynamic attributes


def _pandas_type(value: object, *names: str) -> bool:
    """Whether ``value`` is an instance of one of the pandas classes ``names`` ("ExtensionArray": any
    pandas array); False when pandas is not imported (then ``value`` cannot be a pandas object)."""
    pd = sys.modules.get("pandas")
    if pd is None:
        return False
    classes = tuple(pd.api.extensions.ExtensionArray if n == "ExtensionArray" else getattr(pd, n) for n in names)
    return isinstance(value, classes)


def _as_array(value: ArrayLike, where: str) -> np.ndarray:
    """``value`` as a NumPy array, refusing what would silently become wrong data: masked entries of
    a masked array, and missing values (``pd.NA``, ``NaN``, ``None``) of a pandas object."""
    if type(value) is np.ndarray:  # the common case, neither masked nor pandas: nothing to check
        return value
    if isinstance(value, np.ma.MaskedArray):
        masked = int(np.count_nonzero(np.ma.getmaskarray(value)))
        if masked:
            raise DataError(
                f"{where}: masked array with {masked} masked entries, whose hidden values would be "
                "used as data; fill them (a.filled(value)) or drop the rows holding them "
                "(a[~np.ma.getmaskarray(a).reshape(len(a), -1).any(axis=1)].data)."
            )
        value = np.ma.getdata(value)
    if _pandas_type(value, "Series", "DataFrame", "Index", "ExtensionArray"):
        import pandas as pd

        missing = int(np.count_nonzero(pd.isna(value)))
        if missing:
            raise DataError(
                f"{where}: {missing} missing values (pd.NA, NaN or None) in a pandas "
                f"{type(value).__name__}; drop those rows (.dropna()) or impute them."
            )
        if isinstance(value, pd.DataFrame):  # column by column: nullable dtypes would give object
            names = [f"{where}, column {c!r}" for c in value.columns]
            columns = [_to_numpy(value.iloc[:, j], name) for j, name in enumerate(names)]
            if not columns:
                return np.empty((len(value), 0))
            dtype = _target_dtype(columns)
            return np.stack([_cast(a, dtype, name) for a, name in zip(columns, names)], axis=1)
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as err:
        raise DataError(f"{where}: cannot be converted to an array ({err}); pass a rectangular numeric array.") from err


def _to_numpy(value: ArrayLike, where: str) -> np.ndarray:
    """Convert one array to numpy, checking it is numeric with a leading observation axis."""
    array = _as_array(value, where)
    if array.dtype.kind == "V":  # JAX's extra types (ml_dtypes: bfloat16, float8_*, int4, ...) are exact in these
        if jnp.issubdtype(array.dtype, jnp.floating):
            array = array.astype(np.float32)
        elif jnp.issubdtype(array.dtype, jnp.integer):
            array = array.astype(np.int64)
    if array.dtype.kind not in "biuf":
        raise DataError(
            f"{where}: dtype {array.dtype} is not numeric; pass float, integer or bool arrays "
            "(encode categories as integers)."
        )
    if array.ndim == 0:
        raise DataError(
            f"{where}: got a 0-d array; every array needs a leading observation axis "
            "(wrap a scalar as np.atleast_1d(value))."
        )
    return array


def _target_dtype(arrays: Sequence[np.ndarray]) -> np.dtype:
    """JAX default float if any array is float, bool if all are bool, else JAX default int."""
    kinds = {a.dtype.kind for a in arrays}
    if "f" in kinds:
        return np.dtype(jnp.result_type(float))
    if kinds == {"b"}:
        return np.dtype(bool)
    return np.dtype(jnp.result_type(int))


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of a warning issued here that names the first caller outside this module."""
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level


def _warn_if_rounded(array: np.ndarray, dtype: np.dtype, where: str) -> None:
    """A :class:`PrecisionWarning` if the integers of ``array`` are not all exact in float ``dtype``."""
    if array.dtype.kind not in "iu" or dtype.kind != "f" or not array.size:
        return
    limit = 2 ** (np.finfo(dtype).nmant + 1)  # every integer up to this is exact
    if -limit <= int(array.min()) and int(array.max()) <= limit:
        return
    big = array[(array > limit) | (array < -limit)]
    # Python int == float compares exactly
    rounded = big[big.astype(object) != big.astype(dtype).astype(object)]
    if rounded.size:
        example = rounded[0]
        warnings.warn(
            f"{where}: {rounded.size} integer values are not exactly representable as {dtype} and "
            f"were rounded (e.g. {int(example)} -> {int(example.astype(dtype))}): integers and floats "
            f"of one key all become {dtype}. To keep them exact, "
            + ("" if _x64_enabled() else f"{_ENABLE_X64}, where float64 holds integers exactly up to 2**53, or ")
            + "pass the key as integers in every client.",
            PrecisionWarning,
            stacklevel=_caller_stacklevel(),
        )


def _cast(array: np.ndarray, dtype: np.dtype, where: str) -> np.ndarray:
    """Cast to ``dtype``: integer overflow and non-finite floats are refused, integers that a float
    ``dtype`` rounds give a :class:`PrecisionWarning`."""
    if dtype.kind == "i" and array.dtype.kind in "iu" and array.size:
        info = np.iinfo(dtype)
        if int(array.min()) < info.min or int(array.max()) > info.max:
            raise DataError(
                f"{where}: integer values outside the {dtype} range [{info.min}, {info.max}]; "
                + ("rescale or re-encode the values." if _x64_enabled() else f"{_ENABLE_X64} or rescale the values.")
            )
    _warn_if_rounded(array, dtype, where)
    with np.errstate(over="ignore"):
        out = array.astype(dtype)
    if dtype.kind == "f":
        bad = int(np.count_nonzero(~np.isfinite(out)))
        if bad:
            raise DataError(
                f"{where}: {bad} NaN/inf entries (as {dtype}); remove or impute them before building federated data."
            )
    return out


def _cast_pooled(arrays: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray | None:
    """The clients' ``arrays`` of one key (one trailing shape) cast to ``dtype`` and concatenated, checked at once:
    None where :func:`_cast` would refuse a value of some client, or where the clients' arrays are of several
    kinds or integer dtypes (then integers may meet a float ``dtype``, whose rounding :func:`_cast` warns about),
    so that the caller casts client by client and its messages name the client.

    Floats are cast as they are concatenated (no copy at their own precision first); integers and booleans
    (whose ``dtype`` is then of their kind) are concatenated, their range checked, then cast."""
    kinds = {a.dtype.kind for a in arrays}
    if kinds == {"f"}:
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow becomes inf, refused below
            out = np.concatenate(arrays, dtype=dtype, casting="same_kind")
        return out if np.isfinite(out).all() else None
    if len({a.dtype for a in arrays}) != 1:
        return None
    pooled = np.concatenate(arrays)
    if dtype.kind == "i" and pooled.dtype.kind in "iu" and pooled.size:
        info = np.iinfo(dtype)
        if int(pooled.min()) < info.min or int(pooled.max()) > info.max:
            return None
    return pooled.astype(dtype, copy=False)


def _padded(pooled: np.ndarray, starts: np.ndarray, sizes: np.ndarray, max_size: int) -> np.ndarray:
    """The clients' rows as ``(C, max_size, ...)``, each client's padded with its last row, gathered from ``pooled``
    (client i's rows at ``starts[i] : starts[i] + sizes[i]``) a block of clients at a time (each block's index
    within :data:`GATHER_ENTRIES` entries)."""
    out = np.empty((len(sizes), max_size, *pooled.shape[1:]), dtype=pooled.dtype)
    index = np.int32 if len(pooled) < 2**31 else np.int64
    columns = np.arange(max_size, dtype=index)[None, :]
    first, last = starts.astype(index), (sizes - 1).astype(index)
    block = max(1, GATHER_ENTRIES // max_size)
    for lo in range(0, len(sizes), block):
        rows = first[lo : lo + block, None] + np.minimum(columns, last[lo : lo + block, None])
        out[lo : lo + block] = pooled[rows]
    return out


GATHER_ENTRIES = 2**22
"""The most entries of the row index :func:`_padded` gathers a block of clients with (16 MB as int32)."""


def _check_index(value: object, size: int) -> int:
    """``value`` as a client index in ``0..size-1`` (negative counts from the end)."""
    if isinstance(value, (bool, np.bool_)):
        i = None
    else:
        try:
            i = operator.index(cast(SupportsIndex, value))  # anything else raises the TypeError caught here
        except TypeError:
            i = None
    if i is None:
        raise ClientIndexError(f"a client index must be an integer; got {value!r} of type {type(value).__name__}.")
    if not -size <= i < size:
        raise ClientIndexError(f"client index {i} out of range for {size} clients; use -{size}..{size - 1}.")
    return i % size


def _common_count(counts: dict[str, int], message: str) -> int:
    """The one value of ``counts``, or a DataError listing them (``message`` has ``{listing}``)."""
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"{key!r} has {n}" for key, n in counts.items())
        raise DataError(message.format(listing=listing))
    return next(iter(counts.values()))


def _check_names(names: object, num_clients: int) -> tuple:
    """``names`` as a tuple of ``num_clients`` distinct hashable client names."""
    try:
        # a non-iterable ``names`` raises the TypeError caught here
        items = None if isinstance(names, (str, bytes)) or hasattr(names, "keys") else tuple(cast(Iterable[Any], names))
    except TypeError:
        items = None
    if items is None:
        raise DataError(
            f"client_names must be a sequence with one name per client, such as ['a', 'b']; got "
            f"{names!r} of type {type(names).__name__}."
        )
    if len(items) != num_clients:
        raise DataError(
            f"client_names has {len(items)} names but there are {num_clients} clients; give one name per client."
        )
    seen: dict = {}
    for i, name in enumerate(items):
        try:
            j = seen.setdefault(name, i)
        except TypeError as err:
            raise DataError(
                f"client_names[{i}] = {name!r} is not hashable ({type(name).__name__}); use str or int names."
            ) from err
        if j != i:
            raise DataError(
                f"client_names[{j}] and client_names[{i}] are both {name!r}; client names must be distinct."
            )
    return items


def _factorize(ids: object) -> tuple[np.ndarray, tuple]:
    """Integer codes ``0..C-1`` of client ids of any hashable kind, and the ``C`` names they stand for,
    in sorted order (a pandas categorical: in the order of its categories, unused ones left out)."""
    import pandas as pd

    try:
        codes, uniques = pd.factorize(ids, sort=True)
    except TypeError as err:
        raise DataError(f"client ids cannot be used as names ({err}); use str or int ids.") from err
    return codes.astype(np.int64), tuple(uniques.tolist())


def _edge_pad_into(out: np.ndarray, a: np.ndarray) -> np.ndarray:
    """``out`` (rows, ...) filled with ``a``'s rows, then ``a``'s last row repeated: a client padded the one way."""
    out[: len(a)] = a
    out[len(a) :] = a[-1]
    return out


class FederatedData:
    """Per-client data dictionaries, stored both ragged and padded with a mask.

    Parameters
    ----------
    clients
        Mapping from key to a sequence with one array per client, e.g.
        ``{"x": [x1, x2], "y": [y1, y2]}``. All arrays of one client share a leading observation
        axis; a key's trailing shape is the same for every client.
    client_names
        Optional distinct hashable name of each client (e.g. county names), used as the ``client``
        coordinate of a fit's ArviZ data; defaults to the positions ``0..C-1``.

    Attributes
    ----------
    keys : tuple of str
        Data keys in insertion order.
    num_clients : int
        Number of clients ``C``.
    client_names : tuple
        Name of each client, ``(0, 1, ..., C-1)`` unless given.
    padded : dict of str to jax.Array
        Arrays of shape ``(C, max_size, *trailing)``. Rows past a client's size repeat its last
        real row, so per-row log-densities stay finite there.
    mask : jax.Array
        Boolean ``(C, max_size)``, True on real rows.

    Raises
    ------
    DataError
        If keys, shapes, dtypes or values are invalid (NaN/inf, integers outside JAX's int range,
        masked entries of a masked array, missing values of a pandas object); the message names
        the key and client. Also if ``client_names`` has the wrong length, repeats a name or holds an
        unhashable one.

    Warns
    -----
    PrecisionWarning
        If integers are rounded by the conversion to JAX's float (a key mixing integer and float
        arrays across clients, with integers beyond 2**24 for float32 or 2**53 for float64).

    Notes
    -----
    Float arrays become JAX's default float (float64 only under ``jax_enable_x64``), integer
    arrays JAX's default int, and bool arrays stay bool. A key mixing kinds across clients is
    promoted in that order. A per-client array may be a NumPy array (a masked one without masked
    entries), a list, or a pandas Series / DataFrame (nullable dtypes included) without missing
    values; JAX's bfloat16, float8 and int4 arrays are converted exactly. Trailing dimensions of
    size 0 are kept.
    """

    def __init__(
        self, clients: Mapping[str, Sequence[ArrayLike]], client_names: Sequence[object] | None = None
    ) -> None:
        _check_keys(clients)
        for key, value in clients.items():
            if isinstance(value, (str, bytes)) or hasattr(value, "shape") or not isinstance(value, Sequence):
                raise DataError(
                    f"key {key!r}: expected a list with one array per client, got "
                    f"{type(value).__name__}. Wrap a single client's array as [array], or use "
                    "FederatedData.from_pooled for pooled arrays with client ids."
                )
        num_clients = _common_count(
            {key: len(value) for key, value in clients.items()},
            "keys have different numbers of clients ({listing}); every key needs exactly one array per client.",
        )
        if num_clients == 0:
            raise DataError("federated data has zero clients; pass at least one array per key.")
        self._client_names = (
            tuple(range(num_clients)) if client_names is None else _check_names(client_names, num_clients)
        )
        self._labels: tuple[str | None, dict[str, tuple[str, ...]]] = (None, {})  # from_dataframe's column names

        raw = {
            key: [_to_numpy(a, f"key {key!r}, client {i}") for i, a in enumerate(value)]
            for key, value in clients.items()
        }
        keys = tuple(raw)
        lengths = np.stack([np.fromiter((len(a) for a in raw[key]), np.int64, count=num_clients) for key in keys])
        sizes = lengths[0]
        bad = np.flatnonzero((lengths != sizes).any(axis=0) | (sizes == 0))
        if bad.size:  # the first client with a problem, its keys in order (as a client-by-client check finds it)
            i = int(bad[0])
            for key, n in zip(keys[1:], lengths[1:, i]):
                if n != sizes[i]:
                    raise DataError(
                        f"client {i}: {keys[0]!r} has {sizes[i]} rows but {key!r} has "
                        f"{n}; all arrays of a client must share the leading "
                        "observation axis."
                    )
            raise DataError(
                f"client {i} has 0 rows (keys {list(keys)}); drop the client or give it at least one observation."
            )
        for key in keys:
            trailing = raw[key][0].shape[1:]
            for i, a in enumerate(raw[key]):
                if a.shape[1:] != trailing:
                    raise DataError(
                        f"key {key!r}: client 0 has trailing shape {trailing} but client {i} has "
                        f"{a.shape[1:]}; the shape after the observation axis must match across "
                        "clients."
                    )

        # every key cast and checked before anything is padded
        self._data: dict[str, list[np.ndarray]] = {}
        pooled: dict[str, np.ndarray] = {}
        ends = np.cumsum(sizes)
        starts = ends - sizes
        for key in keys:
            dtype = _target_dtype(raw[key])
            one = _cast_pooled(raw[key], dtype)
            if one is None:  # a value to refuse or warn about, or dtypes of several kinds: client by client
                self._data[key] = [_cast(a, dtype, f"key {key!r}, client {i}") for i, a in enumerate(raw[key])]
                pooled[key] = np.concatenate(self._data[key])
            else:
                pooled[key] = one
                self._data[key] = [one[a:b] for a, b in zip(starts.tolist(), ends.tolist())]  # views of one array
        self._sizes = sizes
        max_size = int(sizes.max())
        self._padded = {key: jnp.asarray(_padded(pooled[key], starts, sizes, max_size)) for key in keys}
        self._mask = jnp.asarray(np.arange(max_size)[None, :] < sizes[:, None])

    @classmethod
    def from_pooled(
        cls,
        data: Mapping[str, ArrayLike] | pd.DataFrame,
        client_ids: ArrayLike,
        num_clients: int | None = None,
    ) -> FederatedData:
        """Split pooled arrays into clients by a per-row client id.

        Parameters
        ----------
        data
            Mapping from key to an array with leading axis ``N``, or a pandas DataFrame (one key
            per column).
        client_ids
            1-D array of length ``N``. Integer ids are positions: row ``r`` goes to client
            ``client_ids[r]``, and rows with id ``-1`` are dropped. String (or other object) ids
            are names: each distinct id is a client, in sorted order, and becomes its entry of
            :attr:`client_names`. Rows keep their relative order within a client.
        num_clients
            Number of clients; defaults to ``max(client_ids) + 1``. Only for integer ids.

        Returns
        -------
        FederatedData
            With the default :attr:`client_names` ``0..C-1`` for integer ids, the sorted distinct
            ids for string ids.

        Raises
        ------
        DataError
            If the arrays or ids are malformed (float ids, missing ids), ``num_clients`` is given
            with string ids, or a client in ``0..num_clients-1`` has no rows (checked before
            anything of size ``num_clients`` is allocated).

        See Also
        --------
        from_dataframe : a long-format DataFrame with a client-id column.
        """
        if _pandas_type(data, "DataFrame"):
            frame = cast("pd.DataFrame", data)
            if not frame.columns.is_unique:
                duplicated = sorted(set(frame.columns[frame.columns.duplicated()]))
                raise DataError(
                    f"the DataFrame has duplicate column names {duplicated}; rename them so that "
                    "each key is one column."
                )
            data = {key: frame[key] for key in frame.columns}
        _check_keys(data)
        arrays = {key: _to_numpy(value, f"pooled key {key!r}") for key, value in data.items()}
        n = _common_count(
            {key: len(a) for key, a in arrays.items()},
            "pooled arrays have different leading lengths ({listing}); each needs one row per observation.",
        )
        ids = _as_array(client_ids, "client_ids")
        names = None
        if ids.ndim == 1 and ids.dtype.kind in "USO" and len(ids) == n:  # ids are names
            if num_clients is not None:
                raise DataError(
                    "num_clients is only for integer client_ids; with string ids every distinct "
                    "id is a client. Leave num_clients None."
                )
            ids, names = _factorize(ids)
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) != n:
            raise DataError(
                f"client_ids must be a 1-D integer array of length {n} (one id per pooled row), or "
                f"of string names; got shape {ids.shape} and dtype {ids.dtype}."
            )
        if n and int(ids.min()) < -1:
            row = int(np.argmax(ids < -1))
            raise DataError(f"client_ids[{row}] is {ids[row]}; ids must be >= 0, or -1 for unassigned rows.")
        needed = int(ids.max()) + 1 if n else 0
        if num_clients is None:
            num_clients = needed
        elif isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)):
            raise DataError(f"num_clients must be an int or None; got {num_clients!r}.")
        elif needed and num_clients < needed:
            raise DataError(
                f"num_clients={num_clients} but client_ids contains id {needed - 1}; pass "
                f"num_clients >= {needed} or leave it None."
            )
        num_clients = int(num_clients)
        if num_clients < 1:
            raise DataError(
                "federated data has zero clients: every client id is -1 or num_clients < 1; "
                "assign rows to clients 0..C-1."
            )
        present, counts = np.unique(ids[ids >= 0], return_counts=True)
        if present.size < num_clients:  # without allocating anything of size num_clients
            first = min(num_clients, present.size + 5)
            shown = np.setdiff1d(np.arange(first), present[present < first].astype(np.int64))[:5]
            missing = num_clients - present.size
            raise DataError(
                f"client {shown[0]} has no rows in client_ids ({missing} of {num_clients} clients "
                f"have none: {', '.join(map(str, shown.tolist()))}{', ...' if missing > shown.size else ''}); "
                "renumber the clients (np.unique(client_ids, return_inverse=True)[1]) or lower "
                "num_clients."
            )
        # here the ids are exactly 0..num_clients-1, each with counts[id] rows
        order = np.argsort(ids, kind="stable")[n - int(counts.sum()) :]
        splits = np.cumsum(counts)[:-1]
        return cls({key: np.split(a[order], splits) for key, a in arrays.items()}, client_names=names)

    @classmethod
    def from_dataframe(
        cls,
        df: object,
        client: object,
        columns: Sequence[str] | Mapping[str, str | Sequence[str]] | None = None,
    ) -> FederatedData:
        """Split a long-format pandas DataFrame (one row per observation) into clients by a column.

        Parameters
        ----------
        df
            pandas DataFrame with unique column names.
        client
            Name of the column holding each row's client id: any hashable values (str, int,
            categories). Each distinct id is a client, its name in :attr:`client_names`. Clients
            are in sorted id order (as ``df.groupby(client)``; a categorical column: in the order
            of its categories, unused ones left out), and rows keep their order within a client.
        columns
            The data keys. None: every other column is a key of shape ``(n,)``. A list of column
            names: those, each a key. A dict ``{key: column}`` or ``{key: [column, ...]}``: a list
            stacks its columns as the key's trailing dimension, e.g.
            ``{"x": ["days", "age"], "y": "reaction"}`` gives ``x`` of shape ``(n, 2)``.

        Returns
        -------
        FederatedData
            As :meth:`from_pooled` with the client column's codes, plus :attr:`client_names`.

        Raises
        ------
        DataError
            If ``df`` is not a DataFrame, a column is missing or duplicated, the client column or
            a data column has missing values, a data column is not numeric, or no data column is
            left (and as :meth:`from_pooled`).
        """
        import pandas as pd

        if not isinstance(df, pd.DataFrame):
            raise DataError(f"from_dataframe needs a pandas DataFrame; got {type(df).__name__}.")
        if not df.columns.is_unique:
            duplicated = sorted(set(df.columns[df.columns.duplicated()]), key=str)
            raise DataError(f"the DataFrame has duplicate column names {duplicated}; rename them.")
        if columns is None:
            spec: Mapping[str, object] = {c: c for c in df.columns if c != client}
        elif isinstance(columns, Mapping):
            spec = columns
        elif isinstance(columns, (str, bytes)):
            raise DataError(
                f"columns must be a list or dict of column names; got the string {columns!r} "
                f"(for one column pass [{columns!r}])."
            )
        else:
            spec = {c: c for c in columns}
        if not spec:
            raise DataError(
                f"the DataFrame has no data column besides the client column {client!r}; "
                "pass columns with at least one."
            )
        wanted = [client] + [c for v in spec.values() for c in (v if isinstance(v, (list, tuple)) else [v])]
        missing = [c for c in dict.fromkeys(wanted) if c not in df.columns]
        if missing:
            raise DataError(f"columns {missing} are not in the DataFrame; its columns are {list(df.columns)}.")
        for c in wanted[1:]:
            if not (pd.api.types.is_numeric_dtype(df[c]) or pd.api.types.is_bool_dtype(df[c])):
                raise DataError(
                    f"column {c!r} has dtype {df[c].dtype}, which is not numeric. A factor needs one 0/1 "
                    "column per level but the first (treatment coding; integer codes would make it a linear "
                    "trend): fb.from_formula('y ~ ... + factor + (1 | client)', df) codes it for you, or "
                    f"pd.get_dummies(df[{c!r}], drop_first=True, dtype=float) does by hand."
                )
        _as_array(df[client], f"client column {client!r}")  # refuses missing ids
        codes, names = _factorize(df[client])
        out = cls.from_pooled(
            {
                key: _as_array(df[list(col)], f"key {key!r}")
                if isinstance(col, (list, tuple))
                else _as_array(df[col], f"column {col!r}")
                for key, col in spec.items()
            },
            codes,
        )
        out._client_names = names
        out._labels = (
            str(client),
            {key: tuple(map(str, col)) if isinstance(col, (list, tuple)) else (str(col),) for key, col in spec.items()},
        )
        return out

    @property
    def keys(self) -> tuple[str, ...]:
        """Data keys in insertion order."""
        return tuple(self._data)

    @property
    def num_clients(self) -> int:
        """Number of clients."""
        return len(self._sizes)

    @property
    def sizes(self) -> np.ndarray:
        """Number of rows of each client, int64 of shape ``(C,)``."""
        return self._sizes.copy()

    @property
    def max_size(self) -> int:
        """Largest client size (the padded length)."""
        return int(self._sizes.max())

    @property
    def total_size(self) -> int:
        """Number of rows over all clients."""
        return int(self._sizes.sum())

    @property
    def padded(self) -> dict[str, jax.Array]:
        """Edge-padded arrays of shape ``(C, max_size, *trailing)``."""
        return dict(self._padded)

    @property
    def mask(self) -> jax.Array:
        """Boolean ``(C, max_size)`` mask, True on real rows."""
        return self._mask

    @property
    def client_names(self) -> tuple:
        """Name of each client in client order: ``(0, 1, ..., C-1)`` unless given to the constructor,
        taken from string ids by :meth:`from_pooled` or from the client column by
        :meth:`from_dataframe`."""
        return self._client_names

    @property
    def client_column(self) -> str | None:
        """The DataFrame column that named the clients (:meth:`from_dataframe`), None otherwise."""
        return self._labels[0]

    @property
    def column_names(self) -> dict[str, tuple[str, ...]]:
        """Each key's DataFrame columns, in the order of its trailing dimension (:meth:`from_dataframe`:
        ``{"x": ("Intercept", "Days"), "y": ("Reaction",)}``); empty for data not built from a DataFrame.
        Tables of a fit name coefficients by them (``res.fixed_effects``)."""
        return dict(self._labels[1])

    def client_index(self, name: object) -> int:
        """Position of the client named ``name`` (for :meth:`client`, :meth:`subset` and the
        algorithms' per-client outputs).

        Parameters
        ----------
        name
            An entry of :attr:`client_names`.

        Returns
        -------
        int
            The ``i`` with ``client_names[i] == name``.

        Raises
        ------
        ClientIndexError
            If no client has that name.
        """
        try:
            i = {known: i for i, known in enumerate(self._client_names)}.get(name)
        except TypeError:  # an unhashable name
            i = None
        if i is not None:
            return i
        shown = ", ".join(map(repr, self._client_names[:5])) + (", ..." if self.num_clients > 5 else "")
        raise ClientIndexError(f"no client is named {name!r}; the client names are {shown}.")

    def client_coordinate(self) -> np.ndarray:
        """:attr:`client_names` as the ``(C,)`` array of an xarray ``client`` coordinate: ints
        ``0..C-1`` by default, a str or int array for names of one such type, else object."""
        names = self._client_names
        kinds = {type(n) for n in names}
        if kinds <= {int} or kinds <= {str}:
            return np.asarray(names)
        out = np.empty(len(names), dtype=object)
        for i, name in enumerate(names):
            out[i] = name
        return out

    def client(self, i: int) -> dict[str, np.ndarray]:
        """Unpadded arrays of client ``i``, a position (negative counts from the end); for a client's
        name use ``client(data.client_index(name))``.

        Raises
        ------
        ClientIndexError
            If ``i`` is not an integer or is out of range (a DataError, IndexError and TypeError).
        """
        i = _check_index(i, self.num_clients)
        return {key: arrays[i].copy() for key, arrays in self._data.items()}

    def padded_client(self, i: int) -> dict[str, np.ndarray]:
        """Client ``i``'s row of :attr:`padded` as host arrays (its last row repeated to :attr:`max_size`, in the
        padded arrays' dtypes), read from the host copy: no device computation.

        Raises
        ------
        ClientIndexError
            As :meth:`client`.
        """
        i = _check_index(i, self.num_clients)
        out = {}
        for key, arrays in self._data.items():
            a = arrays[i]
            row = np.empty((self.max_size, *a.shape[1:]), dtype=self._padded[key].dtype)
            out[key] = _edge_pad_into(row, a)
        return out

    def pooled(self) -> dict[str, np.ndarray]:
        """Arrays of all clients concatenated in client order."""
        return {key: np.concatenate(arrays) for key, arrays in self._data.items()}

    def pooled_client_ids(self) -> np.ndarray:
        """Client id of each row of :meth:`pooled`, int64."""
        return np.repeat(np.arange(self.num_clients, dtype=np.int64), self._sizes)

    def subset(self, indices: Sequence[int]) -> FederatedData:
        """New data with the clients at positions ``indices``, in that order (negative indices
        allowed), keeping their :attr:`client_names`.

        Raises
        ------
        ClientIndexError
            If ``indices`` is not a sequence of integers, or one is out of range.
        DataError
            If ``indices`` is empty.
        """
        try:
            items = None if isinstance(indices, (str, bytes)) else list(indices)
        except TypeError:
            items = None
        if items is None:
            raise ClientIndexError(
                f"subset needs a sequence of client indices such as [0, 2]; got {indices!r} of type "
                f"{type(indices).__name__} (for one client pass [i])."
            )
        if not items:
            raise DataError("subset needs at least one client index; got an empty sequence.")
        idx = [_check_index(i, self.num_clients) for i in items]
        out = FederatedData(
            {key: [arrays[i] for i in idx] for key, arrays in self._data.items()},
            client_names=[self._client_names[i] for i in idx],
        )
        out._labels = self._labels
        return out

    def blank(self) -> FederatedData:
        """The same layout (keys, client sizes, trailing shapes, dtypes) with every value zero: what
        a federation's server knows of the data (:mod:`fedbayes.flower` builds its server on it)."""
        out = FederatedData(
            {key: [np.zeros_like(a) for a in arrays] for key, arrays in self._data.items()},
            client_names=self._client_names,
        )
        out._labels = self._labels
        return out

    def __setstate__(self, state: dict) -> None:
        """Unpickling; data pickled before client names existed gets the default names ``0..C-1``."""
        self.__dict__.update(state)
        self.__dict__.setdefault("_client_names", tuple(range(len(self._sizes))))
        self.__dict__.setdefault("_labels", (None, {}))

    def __len__(self) -> int:
        return self.num_clients

    def __repr__(self) -> str:
        s = self._sizes
        return (
            f"FederatedData(keys={self.keys}, num_clients={self.num_clients}, "
            f"sizes min/median/max={s.min()}/{np.median(s):g}/{s.max()})"
        )
