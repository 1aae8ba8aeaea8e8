"""Compiled computations kept across processes: JAX's persistent compilation cache, switched on in one call.

Within a process, ``fed_fit`` already reuses what it compiled for an earlier call with the same model
function, data, algorithm, number of rounds and cohort size (:func:`fedbayes.clear_cache`). A new
process (a script run again, a restarted notebook kernel) traces the model again but, with this cache
on, loads each computation XLA compiled before from disk instead of compiling it: the key is the
computation itself (its HLO, with every constant in it, the backend and the library versions), so a
changed model, data shape or option compiles afresh, and a stale entry can never be used.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from .errors import ConfigError

ENV = "FEDBAYES_COMPILATION_CACHE"
"""Set to a directory (or ``1`` for the default one) to switch the cache on when fedbayes is imported."""


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/fedbayes/jax`` (``~/.cache/fedbayes/jax`` when ``XDG_CACHE_HOME`` is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fedbayes" / "jax"


def compilation_cache(directory: str | os.PathLike | None = None) -> Path:
    """Keep every computation XLA compiles in ``directory`` (default :func:`default_directory`) and load it
    from there in later processes. Returns the directory.

    This sets JAX's ``jax_compilation_cache_dir`` and caches every computation, however short its
    compilation (``jax_persistent_cache_min_compile_time_secs = 0``: a fit compiles many small ones).
    The same as ``FEDBAYES_COMPILATION_CACHE=<directory>`` (or ``=1``) in the environment before import.
    Entries are never stale (see the module's docstring); delete the directory to reclaim the space.

    With jax 0.10.2 on the CPU, writing an entry has aborted the process inside XLA's serialisation of the
    compiled executable, intermittently (docs/guides/performance.md): leave the cache off for a job that must
    not die.
    """
    path = default_directory() if directory is None else Path(os.fspath(directory)).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"compilation_cache: cannot create the directory {str(path)!r} ({err})") from None
    if not os.access(path, os.W_OK):
        raise ConfigError(f"compilation_cache: the directory {str(path)!r} is not writable")
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def _from_environment() -> None:
    value = os.environ.get(ENV, "").strip()
    if value and value.lower() not in ("0", "false", "no", "off"):
        compilation_cache(None if value.lower() in ("1", "true", "yes", "on") else value)
