"""Import ArviZ safely when several processes start at once.

ArviZ 0.23 writes a once-a-day stamp file when it is imported (``<cache>/arviz/daily_warning``,
through a temporary file of a *fixed* name and a rename). Two processes importing it at the same
instant on a new day race on that temporary file and one of them dies in ``import arviz`` with a
``FileNotFoundError`` (pytest-xdist workers, Flower's Ray workers, a job array, CI's first run).

:func:`import_arviz` serialises the import across processes with an advisory lock (``fcntl.flock``)
on a file beside the stamp: the first process writes the stamp, the others then find today's date
in it and write nothing. The lock is held only for the import; where it cannot be taken (no
``fcntl``, a read-only cache directory) ArviZ is imported as usual.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from types import ModuleType
from collections.abc import Iterator


def _cache_dir() -> str | None:
    """ArviZ's cache directory (the one its stamp file lives in), or None if it cannot be found."""
    try:
        from platformdirs import user_cache_dir
    except ImportError:
        return None
    return user_cache_dir("arviz", "arviz")


@contextlib.contextmanager
def _interprocess_lock() -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: no race-free lock available here, import as ArviZ does
        yield
        return
    directory = _cache_dir()
    fd = None
    if directory is not None:
        try:
            os.makedirs(directory, exist_ok=True)
            fd = os.open(os.path.join(directory, "daily_warning.lock"), os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # read-only or missing cache: nothing to protect
            if fd is not None:
                os.close(fd)
            fd = None
    try:
        yield
    finally:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)


def import_arviz() -> ModuleType:
    """``import arviz`` under an inter-process lock, its import-time warnings silenced."""
    with _interprocess_lock(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import arviz

    return arviz
