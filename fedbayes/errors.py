"""Exception types raised by fedbayes.

Every error a user can trigger with bad input is one of these, raised before any computation,
with a message that says what is wrong and how to fix it.
"""

from __future__ import annotations


class FedbayesError(Exception):
    """Base class of all fedbayes errors."""


class DataError(FedbayesError, ValueError):
    """Federated data is malformed (shapes, keys, dtypes, NaN/inf, empty clients)."""


class ModelError(FedbayesError, ValueError):
    """A model has a structure the chosen algorithm cannot handle; the message names the site."""


class ConfigError(FedbayesError, ValueError):
    """An algorithm, compressor or fit option has an invalid value."""


class _StoppedFit:
    """A fit stopped early. ``round`` is the first bad round; ``history`` holds the per-round records of
    the rounds before it and ``result`` the fit finalised at the last good round (None when no round
    was good or the algorithm could not finalise so early)."""

    def __init__(self, message: str, *, round: int, history: dict, result: object = None):
        super().__init__(message)
        self.round, self.history, self.result = round, history, result


class DivergenceError(_StoppedFit, FedbayesError, FloatingPointError):
    """A fit's global state became non-finite (see ``round``, ``history``, ``result``)."""


class TooFewClientsError(_StoppedFit, FedbayesError, RuntimeError):
    """Faults left fewer answering clients in a round than ``FaultPolicy.min_clients`` (see ``round``,
    ``history``, ``result``)."""


class CheckpointError(FedbayesError, ValueError):
    """A checkpoint file is corrupted, incomplete, or does not match the fit it is resumed with."""


def require_int(value: object, what: str, minimum: int = 1) -> int:
    """``value`` as an int, or ConfigError if it is not an integer >= ``minimum`` (bools refused)."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"{what} must be an integer >= {minimum}, got {value!r}")
    return int(value)
