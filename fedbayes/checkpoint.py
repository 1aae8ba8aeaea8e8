"""Checkpoints of a federated fit and saved results: one file each, written atomically, verified when read.

A checkpoint holds everything a fit needs to continue: the specification of the fit (model,
data, algorithm, options, seed), the round reached, the full round state (server state, every
client's state, the last broadcast), and the history (ledger included) of the rounds done. Round
keys are a function of the seed and the round, so no random state needs saving.

Format: an uncompressed ``.npz`` (a zip of ``.npy`` arrays, readable without pickle) with

* ``meta``: JSON (format version, library / JAX / NumPy versions, float width, round, the fit's
  fingerprints: model structure, data digest, options, and a digest of the initial round state);
* ``spec``: the pickled fit specification (model function, data, algorithm, options) when it pickles,
  so that ``fb.resume(path)`` needs nothing else; otherwise empty, and ``fb.resume`` asks for them;
* ``carry/NNNN`` and ``history/<name>``: the arrays;
* ``digest``: SHA-256 of all the above, so a truncated or altered file is refused.

The file is written to a temporary name in the same directory, flushed to disk and renamed over the
previous checkpoint (``os.replace`` is atomic), so a crash at any moment leaves either the old
checkpoint or the new one, never a mix.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from .errors import CheckpointError, ConfigError

FORMAT = 1


def weak_array(value: np.ndarray, dtype: Any) -> jax.Array:
    """A weakly-typed array (as a Python scalar would give), so a restored carry traces like the saved one."""
    try:
        from jax._src.lax.lax import _convert_element_type  # no public API makes a weak-typed array
    except ImportError:  # pragma: no cover - a JAX without it: a 0-d weak value, as a Python scalar gives
        return jnp.asarray(value.item()) if value.ndim == 0 else jnp.asarray(value)
    return _convert_element_type(jnp.asarray(value), np.dtype(dtype), weak_type=True)


def _plain(value: Any) -> Any:
    """NumPy scalars (accepted wherever a number is) as Python numbers for JSON."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def tree_digest(tree: Any) -> str:
    """SHA-256 of a pytree's leaves (dtype, shape and bytes, in order)."""
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        a = np.asarray(leaf)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _entries_digest(entries: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(entries):
        a = entries[name]
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _remove_stale_temporaries(directory: str, name: str) -> None:
    """Remove ``.<name>.tmp-<pid>`` files left by writers that were killed mid-write (their process is gone).

    A temporary of a live process (another writer of the same path, now) is left alone; so is anything
    that cannot be checked or removed: a stale temporary only costs disk space."""
    prefix = f".{name}.tmp-"
    try:
        candidates = [f for f in os.listdir(directory) if f.startswith(prefix)]
    except OSError:
        return
    for f in candidates:
        pid = f[len(prefix) :]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)  # signal 0: does the process exist?
            continue
        except ProcessLookupError:
            pass
        except (OSError, OverflowError):  # PermissionError: it exists under another user; or cannot tell
            continue
        try:
            os.remove(os.path.join(directory, f))
        except OSError:
            pass


def write_sealed(path: str | os.PathLike, entries: dict[str, np.ndarray], what: str = "checkpoint") -> None:
    """Write ``entries`` as an uncompressed ``.npz`` sealed by a ``digest`` entry (SHA-256 of the others),
    atomically: temporary file in the same directory, fsync, rename. Shared by checkpoints and saved
    results (:meth:`fedbayes.Result.save`); ``what`` names the file in error messages.

    Raises
    ------
    CheckpointError
        If the file cannot be written (disk full, read-only file system, no permission: the
        ``OSError`` is the ``__cause__``); the previous file at ``path``, if any, is unchanged and no
        temporary file is left behind.
    """
    path = os.fspath(path)
    entries = dict(entries)
    entries["digest"] = np.frombuffer(_entries_digest(entries).encode(), np.uint8)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    _remove_stale_temporaries(directory, os.path.basename(path))
    try:
        with open(tmp, "wb") as f:
            # as Any: numpy's stub has an ``allow_pickle: bool`` keyword that a ``**dict[str, ndarray]`` could
            # fill; no entry has that name
            np.savez(f, **cast(dict[str, Any], entries))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise CheckpointError(
            f"cannot write the {what} {path!r} ({type(err).__name__}: {err}); the previous "
            f"{what} there, if any, is unchanged. Free disk space, make {directory!r} "
            f"writable, or choose another {what} path"
        ) from err
    finally:
        try:
            if os.path.exists(tmp):
                os.remove(tmp)
        except OSError:  # pragma: no cover - the write error above says what is wrong
            pass
    try:  # make the rename itself durable
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def meta_entry(meta: dict[str, Any]) -> np.ndarray:
    """A file's JSON metadata as the ``meta`` entry of :func:`write_sealed` (NumPy scalars as numbers)."""
    return np.frombuffer(json.dumps(meta, sort_keys=True, default=_plain).encode(), np.uint8)


def weak_flags(leaves: list[Any]) -> list[bool]:
    """Which of a state's leaves are weakly typed (a Python scalar, or an array made from one), for
    :meth:`Checkpoint.restore_carry` to restore them so."""
    return [isinstance(x, (int, float)) or bool(getattr(x, "weak_type", False)) for x in leaves]


def save(
    path: str | os.PathLike, meta: dict[str, Any], spec: bytes, carry: Any, history: dict[str, np.ndarray]
) -> None:
    """Write a checkpoint atomically (:func:`write_sealed`).

    Raises
    ------
    CheckpointError
        If the file cannot be written (disk full, read-only file system, no permission: the
        ``OSError`` is the ``__cause__``); the previous checkpoint at ``path``, if any, is unchanged
        and no temporary file is left behind.
    """
    leaves = jax.tree_util.tree_leaves(carry)
    meta = dict(meta, format=FORMAT, weak=weak_flags(leaves))
    entries = {
        "meta": meta_entry(meta),
        "spec": np.frombuffer(spec, np.uint8),
    }
    entries.update({f"carry/{i:05d}": np.asarray(x) for i, x in enumerate(leaves)})
    entries.update({f"history/{k}": np.asarray(v) for k, v in history.items()})
    write_sealed(path, entries)


class Checkpoint:
    """A verified checkpoint: ``meta`` (dict), ``spec`` (pickled bytes, possibly empty), ``leaves``
    (the carry's arrays in order), ``history`` (dict of arrays)."""

    def __init__(self, meta: dict[str, Any], spec: bytes, leaves: list[np.ndarray], history: dict[str, np.ndarray]):
        self.meta, self.spec, self.leaves, self.history = meta, spec, leaves, history

    @property
    def round(self) -> int:
        return int(self.meta["round"])

    def unpickle_spec(self) -> dict[str, Any] | None:
        """The fit specification (a dict), or None if the checkpoint has none; unpickling runs code
        named in the file, so resume only checkpoints you trust."""
        if not self.spec:
            return None
        spec = pickle.loads(self.spec)
        if not isinstance(spec, dict) or not all(isinstance(k, str) for k in spec):
            raise CheckpointError(
                f"the checkpoint's fit specification is a {type(spec).__name__}, not a dict of "
                "the fit's arguments; it was not written by fedbayes"
            )
        return spec

    def restore_carry(self, template: Any) -> Any:
        """The saved carry in the structure of ``template`` (a freshly initialised carry of the same fit)."""
        leaves, treedef = jax.tree_util.tree_flatten(template)
        if len(leaves) != len(self.leaves):
            raise CheckpointError(
                f"checkpoint has {len(self.leaves)} state arrays, the fit has {len(leaves)}: "
                "it was written by a different model, algorithm or version"
            )
        out = []
        for i, (fresh, saved, weak) in enumerate(zip(leaves, self.leaves, self.meta["weak"])):
            fresh = np.asarray(fresh)
            if fresh.shape != saved.shape or fresh.dtype != saved.dtype:
                raise CheckpointError(
                    f"checkpoint state array {i} is {saved.dtype}{list(saved.shape)}, the fit's is "
                    f"{fresh.dtype}{list(fresh.shape)}: it was written by a different fit"
                )
            out.append(weak_array(saved, saved.dtype) if weak else jnp.asarray(saved))
        return jax.tree_util.tree_unflatten(treedef, out)


_META_TYPES = {
    "format": int,
    "round": int,
    "num_rounds": int,
    "seed": int,
    "algorithm": str,
    "versions": dict,
    "plain": dict,
    "fingerprints": dict,
    "init_digest": str,
    "weak": list,
}
_NESTED_KEYS = {
    "plain": ("clients_per_round", "chunk_size", "faults", "fault_policy"),
    "fingerprints": ("model", "data", "options"),
}


def _check_meta(meta: dict[str, Any], num_leaves: int) -> str | None:
    """What is wrong with a checkpoint's (digest-verified) metadata dict, or None."""
    for field, kind in _META_TYPES.items():
        if not isinstance(meta.get(field), kind) or isinstance(meta.get(field), bool):
            return f"metadata field {field!r} is missing or not of type {kind.__name__}"
    for field, keys in _NESTED_KEYS.items():
        absent = [k for k in keys if k not in meta[field]]
        if absent:
            return f"metadata field {field!r} lacks {absent}"
    if not all(isinstance(meta["fingerprints"][k], str) for k in _NESTED_KEYS["fingerprints"]):
        return "its fingerprints are not strings"
    if not all(v is None or isinstance(v, dict) for v in (meta["plain"]["faults"], meta["plain"]["fault_policy"])):
        return "its fault settings are not dicts"
    if len(meta["weak"]) != num_leaves or not all(isinstance(w, bool) for w in meta["weak"]):
        return f"it lists {len(meta['weak'])} state flags for {num_leaves} state arrays"
    return None


def read_sealed(
    path: str | os.PathLike, fmt: int, what: str = "checkpoint"
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read and verify a file of :func:`write_sealed`: its JSON ``meta`` (a dict of format ``fmt``) and its
    other entries (digest removed). ``what`` names the file in error messages.

    Raises
    ------
    CheckpointError
        If it is missing, unreadable, truncated, altered, not written by fedbayes, or of another format.
    ConfigError
        If ``path`` is not a path.
    """
    try:
        path = os.fspath(path)
    except TypeError:
        raise ConfigError(f"a {what} path must be a str or os.PathLike, got {path!r}") from None
    if not os.path.exists(path):
        raise CheckpointError(f"no {what} at {path!r}")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as err:
        raise CheckpointError(f"{what} {path!r} cannot be read ({type(err).__name__}: {err})") from err
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as z:
            entries = {name: z[name] for name in z.files}
    except Exception as err:
        # an unknown compression, zlib.error, EOFError, ValueError, MemoryError for an absurd size, ...)
        raise CheckpointError(
            f"{what} {path!r} is corrupted or incomplete ({type(err).__name__}: {err}); it cannot be used"
        ) from err
    digest = entries.pop("digest", None)
    if (
        digest is None
        or "meta" not in entries
        or np.asarray(digest).tobytes().decode(errors="replace") != _entries_digest(entries)
    ):
        raise CheckpointError(f"{what} {path!r} fails its integrity check (altered or corrupted); it cannot be used")
    try:
        meta = json.loads(entries.pop("meta").tobytes().decode())
    except ValueError as err:  # UnicodeDecodeError and JSONDecodeError
        raise CheckpointError(
            f"{what} {path!r} has unreadable metadata ({err}); it was not written by fedbayes"
        ) from err
    if not isinstance(meta, dict) or meta.get("format") != fmt:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{what} {path!r} has format {found}, this version reads {fmt}")
    return meta, entries


def load(path: str | os.PathLike) -> Checkpoint:
    """Read and verify a checkpoint (:func:`read_sealed`).

    Raises
    ------
    CheckpointError
        If it is missing, unreadable, truncated, altered, not a fedbayes checkpoint, or of another format.
    ConfigError
        If ``path`` is not a path.
    """
    meta, entries = read_sealed(path, FORMAT)
    path = os.fspath(path)
    spec = entries.pop("spec", np.zeros(0, np.uint8)).tobytes()
    leaves = [entries[k] for k in sorted(k for k in entries if k.startswith("carry/"))]
    problem = _check_meta(meta, len(leaves))
    if problem:
        raise CheckpointError(f"checkpoint {path!r} is not a valid fedbayes checkpoint: {problem}")
    history = {k[len("history/") :]: v for k, v in entries.items() if k.startswith("history/")}
    return Checkpoint(meta, spec, leaves, history)


def info(path: str | os.PathLike) -> dict[str, Any]:
    """What a checkpoint holds: round reached, planned rounds, algorithm, seed, versions (verified)."""
    meta = load(path).meta
    return {k: meta[k] for k in ("round", "num_rounds", "algorithm", "seed", "versions") if k in meta}


RESULT_FORMAT = 1
"""Version of the file format of :meth:`fedbayes.Result.save`; :func:`load_result` (``fb.load``) reads this version
only."""


def versions() -> dict[str, Any]:
    """Library versions, float width and backend, as checkpoints and saved results record them."""
    from . import __version__

    return {
        "fedbayes": __version__,
        "jax": jax.__version__,
        "numpy": np.__version__,
        "x64": bool(cast(Any, jax.config).jax_enable_x64),  # config options are dynamic attributes
        "backend": jax.default_backend(),
    }


def load_result(path: Any) -> Any:
    """Load a result saved by :meth:`fedbayes.Result.save` (``fb.load``).

    The file is verified (format version, SHA-256 seal) before anything is unpickled. Unpickling runs
    code from the file: load only files you trust. A model function defined in an importable module
    is imported here by the name it had when saved; one defined in ``__main__`` (a notebook, a script),
    a lambda or a closure was saved by value, with its code, and loads in any process.

    Raises
    ------
    CheckpointError
        If the file is missing, truncated, altered, of another format or kind, or its model function
        cannot be imported here.
    ConfigError
        If ``path`` is not a path.

    Warns
    -----
    CheckpointWarning
        If it was saved with other library versions or float width: it loads, but predictions may
        differ in the last bits.
    """
    import warnings

    from .errors import CheckpointWarning
    from .result import Result  # result imports this module: import at call time

    meta, entries = read_sealed(path, RESULT_FORMAT, what="saved result")
    path = os.fspath(path)
    if meta.get("kind") != "fedbayes.Result" or "result" not in entries:
        raise CheckpointError(
            f"{path!r} is not a saved fedbayes result (kind {meta.get('kind')!r}); a fit's "
            "checkpoint is read by fb.resume"
        )
    if meta.get("versions") != versions():
        warnings.warn(
            f"{path!r} was saved with {meta.get('versions')}, this process has {versions()}; predictions "
            "may differ in the last bits",
            CheckpointWarning,
            stacklevel=2,
        )
    try:
        res = pickle.loads(entries["result"].tobytes())
    except Exception as err:
        raise CheckpointError(
            f"the saved result {path!r} cannot be loaded here ({type(err).__name__}: {err}); a "
            "model function (or algorithm) saved from a module must be importable here under the "
            "name it had when it was saved"
        ) from err
    if not isinstance(res, Result):
        raise CheckpointError(f"{path!r} holds a {type(res).__name__}, not a fedbayes Result")
    return res


def save_result(result: Any, path: Any) -> None:
    """Write a :class:`~fedbayes.Result` to one sealed file (:meth:`fedbayes.Result.save` documents it)."""
    import cloudpickle  # functions of __main__ (a notebook, a script), lambdas and closures by value

    try:
        blob = cloudpickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as err:
        raise CheckpointError(
            f"this result cannot be saved: part of it does not pickle, even by value ({type(err).__name__}: "
            f"{err}). The model function, the values it closes over and the algorithm's options must "
            "pickle: an open file, a lock or a live connection does not (pass such things as data, or "
            "build them inside the model)"
        ) from err
    meta = {
        "format": RESULT_FORMAT,
        "kind": "fedbayes.Result",
        "versions": versions(),
        "algorithm": result.algorithm,
        "seed": result.seed,
    }
    write_sealed(
        path,
        {
            "meta": np.frombuffer(json.dumps(meta, sort_keys=True).encode(), np.uint8),
            "result": np.frombuffer(blob, np.uint8),
        },
        what="saved result",
    )
