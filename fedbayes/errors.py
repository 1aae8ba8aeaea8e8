"""Exception types raised by fedbayes.

Every error a user can trigger with bad input is one of these, raised before any computation,
with a message that says what is wrong and how to fix it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    import numpy as np


class FedbayesError(Exception):
    """Base class of all fedbayes errors."""


class DataError(FedbayesError, ValueError):
    """Federated data is malformed (shapes, keys, dtypes, NaN/inf, empty clients)."""


class ModelError(FedbayesError, ValueError):
    """A model has a structure the chosen algorithm cannot handle; the message names the site."""


class ConfigError(FedbayesError, ValueError):
    """An algorithm, compressor or fit option has an invalid value."""


class _StoppedFit(FedbayesError):
    """A fit stopped early. ``round`` is the first bad round; ``history`` holds the per-round records of
    the rounds before it and ``result`` the fit finalised at the last good round (None when no round
    was good or the algorithm could not finalise so early)."""

    def __init__(self, message: str, *, round: int, history: dict[str, np.ndarray], result: object = None):
        super().__init__(message)
        self.round, self.history, self.result = round, history, result


class DivergenceError(_StoppedFit, FedbayesError, FloatingPointError):
    """A fit's global state became non-finite (see ``round``, ``history``, ``result``)."""


class TooFewClientsError(_StoppedFit, FedbayesError, RuntimeError):
    """Faults left fewer answering clients in a round than ``FaultPolicy.min_clients`` (see ``round``,
    ``history``, ``result``)."""


class StalledError(FedbayesError, RuntimeError):
    """A compiled computation (a chunk of rounds, or the set-up exchange) made no progress for
    ``fed_fit(stall_timeout=...)`` seconds: unfinished while the process used no CPU, i.e. deadlocked.

    ``rounds`` is ``(first, last)`` of the stalled chunk (None for the set-up) and ``history`` the
    records of the rounds finished before it. The computation cannot be cancelled: its threads stay
    blocked, and the interpreter waits for them at exit (end the process with ``os._exit``)."""

    def __init__(self, message: str, *, rounds: tuple[int, int] | None = None):
        super().__init__(message)
        self.rounds = rounds
        self.history: dict[str, np.ndarray] = {}


class CheckpointError(FedbayesError, ValueError):
    """A checkpoint file is corrupted, incomplete, or does not match the fit it is resumed with, or it
    cannot be written (the ``OSError`` is the ``__cause__``)."""


class ClientIndexError(DataError, IndexError, TypeError):
    """A client index (``FederatedData.client``, ``FederatedData.subset``) is not an integer or is out of
    range; also an ``IndexError`` and a ``TypeError``, as Python's own indexing raises."""


class CallbackError(FedbayesError, RuntimeError):
    """The ``callback`` of ``fed_fit`` / ``resume`` raised; ``round`` is the number of rounds done when it
    was called and the callback's exception is the ``__cause__``. A checkpoint due at that round was
    written before the callback ran."""

    def __init__(self, message: str, *, round: int):
        super().__init__(message)
        self.round = round


class PrecisionWarning(UserWarning):
    """Data values were rounded when converted to JAX's float type (e.g. integers above 2**24 in a key
    that becomes float32); the message names the key, the client and how to keep them exact."""


class CheckpointWarning(UserWarning):
    """A checkpoint could not be written (disk full, read-only, ...): the fit goes on in memory, the
    previous checkpoint is kept, and the next checkpoint due is tried again."""


class ConvergenceWarning(UserWarning):
    """A fit has not converged by a check fedbayes makes at its end: the message names the criterion,
    the measured value against its threshold, and the fix (more rounds, a start, a step). The whole
    table is ``res.diagnostics``; ``res.converged`` is False. Estimates and standard errors of such a
    fit are not to be trusted as they are."""


COUNT_MAX = 2**31 - 1
"""The largest count an option takes (rounds, steps, draws, chains, iterations, ...): fedbayes' compiled programs
count in JAX's default 32-bit integers. Seeds are not counts (:func:`fedbayes.seeds.require_seed`)."""


def require_int(value: object, what: str, minimum: int = 1, maximum: int | None = COUNT_MAX) -> int:
    """``value`` as an int, or ConfigError if it is not an integer in ``[minimum, maximum]`` (bools refused;
    ``maximum`` :data:`COUNT_MAX` unless given, None for no bound)."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{what} must be an integer >= {minimum}, got {value!r}")
    count = int(value)
    if maximum is not None and count > maximum:
        bound = "2^31 - 1: counts are 32-bit integers in the compiled programs" if maximum == COUNT_MAX else "its bound"
        raise ConfigError(f"{what} must be at most {maximum:,} ({bound}), got {count:,}")
    return count


def is_real(value: object) -> TypeGuard[float]:
    """A real scalar (Python or NumPy), not a bool, not an array."""
    import numbers

    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def require_real(
    value: object,
    what: str,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    open_low: bool = False,
    open_high: bool = False,
    allow_none: bool = False,
) -> object:
    """``value`` a real scalar (not a bool, a string or an array) in the interval from ``low`` to ``high``
    (closed ends unless ``open_low`` / ``open_high``; NaN is in no interval), or ConfigError naming it."""
    if allow_none and value is None:
        return value
    inside = (
        is_real(value)
        and (low < value if open_low else low <= value)
        and (value < high if open_high else value <= high)
    )
    if not inside:
        ends = f"{'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        raise ConfigError(f"{what} must be a number in {ends}{' or None' if allow_none else ''}, got {value!r}")
    return value


def require_fraction(value: object, what: str, *, closed_high: bool = False, allow_none: bool = False) -> object:
    """``value`` in [0, 1) (or [0, 1]), or ConfigError."""
    if allow_none and value is None:
        return value
    if not is_real(value) or not (0 <= value <= 1 if closed_high else 0 <= value < 1):
        raise ConfigError(f"{what} must be a number in [0, 1{']' if closed_high else ')'}, got {value!r}")
    return value


def require_choice(value: object, what: str, choices: tuple) -> object:
    """``value`` one of ``choices`` (strings / None / bools), compared without NumPy broadcasting."""
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ConfigError(f"{what} must be one of {list(choices)}, got {value!r}")
    return value
