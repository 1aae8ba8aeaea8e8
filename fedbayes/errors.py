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
