"""Minibatch clients: a local step on B of a client's N_i rows, its log-likelihood scaled by N_i / B.

A client's minibatch log-likelihood

    (N_i / B) sum_{j in S} log p(y_ij | theta, z_i),      S a uniformly random B-subset of its rows,

is an unbiased estimate of its full log-likelihood sum_j log p(y_ij | theta, z_i), and so are its
gradients (in theta and z_i). This is what stochastic-gradient Langevin dynamics (SGLD; Welling and
Teh 2011) and FedPop's own experiments use for each local Langevin step.

How a batch is drawn (:class:`Minibatch`): each round, a client orders its real rows by a random
permutation drawn from its own round key (reproducible, and independent of every other random choice
of the round); its m-th batch of the round is B consecutive rows of that order, wrapping around. So the
rows of one batch are distinct (drawn without replacement), and consecutive batches of a round cover
every row once before any row is used again (an epoch without replacement); each batch on its own is a
uniformly random B-subset, so each estimate is unbiased. (FedSOUL's Langevin moves draw each batch
independently instead, :meth:`Minibatch.sample`: its noise correction needs errors that do not cancel over
an epoch.) A client with N_i <= B rows uses all of them with weight 1. A batch is a
:class:`~fedbayes.protocol.ClientData` of B rows whose ``mask`` holds the weights (N_i / B on the chosen
rows, 0 on padding): every density of :class:`~fedbayes.FedModel` honours such a weighted mask
(:class:`~fedbayes.introspect.DataMask` scales the observation sites), so an
algorithm evaluates a batch exactly as it evaluates a whole client, on B rows instead of all of them.

The batch size comes from an algorithm's ``batch_size`` option or from the model itself,
``numpyro.plate("obs", len(y), subsample_size=B)`` (the algorithm then draws the batches, and the model
sees its B rows as a whole plate: NumPyro's own subsampling is switched off, so nothing is rescaled
twice). A batch size of at least every client's row count is the full batch, evaluated as such: the fit
is then the full-batch fit bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .errors import ConfigError, require_int
from .protocol import ClientData

BATCH_STREAM = 0x6D62
"""The constant folded into a client's round key for its batches (:func:`batch_key`), so that drawing
batches leaves every other random choice of the round unchanged."""


def batch_key(key: jax.Array) -> jax.Array:
    """The key of a client's batches in a round, derived from the client's round key."""
    return jax.random.fold_in(key, BATCH_STREAM)


@dataclass(frozen=True)
class Minibatch:
    """Batches of ``size`` rows from clients padded to ``rows`` rows (``size`` None: the full batch).

    Attributes
    ----------
    size:
        B, the rows of one batch; None for the full batch.
    rows:
        The padded row count of every client (the data's ``max_size``).
    """

    size: int | None
    rows: int

    @property
    def active(self) -> bool:
        """True when batches are drawn (B below the padded row count); False: every step sees all rows."""
        return self.size is not None and self.size < self.rows

    def order(self, key: jax.Array, client: ClientData) -> jax.Array:
        """The round's order of the client's rows: its real rows in a uniformly random order, then the
        padding. ``key`` is the client's round key (:func:`batch_key` is applied here)."""
        u = jax.random.uniform(batch_key(key), client.mask.shape)
        return jnp.argsort(jnp.where(client.mask, u, 2.0))

    def take(self, order: jax.Array, client: ClientData, m: Any) -> ClientData:
        """The client's ``m``-th batch of the round (``order`` from :meth:`order`): rows
        ``order[(m B + j) mod N_i]``, j < B, with weight N_i / B (all N_i rows with weight 1 when
        N_i <= B); the client itself when batches are not :attr:`active`."""
        B = self.size
        if B is None or not self.active:
            return client
        return self._rows(client, B, lambda n, j: (jnp.asarray(m, jnp.int32) * B + j) % jnp.maximum(n, 1), order)

    def sample(self, key: jax.Array, client: ClientData) -> ClientData:
        """A batch of B rows drawn uniformly with replacement from the client's N_i real rows (the first N_i
        rows of a padded client), weight N_i / B: an unbiased estimate independent of every other batch drawn
        with another key. All N_i rows with weight 1 when N_i <= B; the client itself when batches are not
        :attr:`active`. FedSOUL's noise-corrected SGLD moves draw their batches so (an epoch's batches, whose
        errors cancel over the epoch, would make the error's effect on the chain depend on its mixing speed)."""
        B = self.size
        if B is None or not self.active:
            return client
        return self._rows(client, B, lambda n, j: jax.random.randint(batch_key(key), j.shape, 0, jnp.maximum(n, 1)))

    @staticmethod
    def _rows(client: ClientData, B: int, pick: Any, order: jax.Array | None = None) -> ClientData:
        """The batch of positions ``pick(N_i, arange(B))`` (``arange(B)`` when N_i <= B) of ``order`` (None: of
        the rows themselves), weight N_i / B, or 1 on all N_i rows when N_i <= B (padding rows weigh 0)."""
        n = client.size.astype(jnp.int32)
        small = n <= B
        j = jnp.arange(B, dtype=jnp.int32)
        pos = jnp.where(small, j, pick(n, j))
        idx = pos if order is None else order[pos]
        dtype = jnp.result_type(float)
        weight = jnp.where(small, jnp.ones((), dtype), n.astype(dtype) / B)
        mask = jnp.where(client.mask[idx], weight, jnp.zeros((), dtype))
        return client._replace(data={k: v[idx] for k, v in client.data.items()}, mask=mask)

    def draw(self, key: jax.Array, client: ClientData, weighted: bool = True) -> ClientData:
        """One batch (the first of a fresh order): for algorithms that take one step per round. With
        ``weighted=False`` the batch is a client of its own: mask 1 on its rows and ``size`` their number
        (for an estimate that is the batch's mean, FedMM's E-step, rather than a sum scaled by N_i / B)."""
        if not self.active:
            return client
        batch = self.take(self.order(key, client), client, 0)
        if weighted:
            return batch
        real = batch.mask > 0
        return batch._replace(mask=real, size=jnp.sum(real).astype(client.size.dtype))


def resolve(batch_size: int | None, model: Any, rows: int, algorithm: str) -> Minibatch:
    """The :class:`Minibatch` of a fit: the algorithm's ``batch_size`` or the model's plate
    ``subsample_size`` (they must agree when both are given); None for both is the full batch."""
    from_model = getattr(model, "subsample_size", None)
    if batch_size is not None and from_model is not None and batch_size != from_model:
        raise ConfigError(
            f"{algorithm} batch_size={batch_size} but the model's plate has subsample_size={from_model}; "
            "give the batch size in one place"
        )
    size = batch_size if batch_size is not None else from_model
    return Minibatch(None if size is None else int(size), int(rows))


def check_batch_size(value: Any, algorithm: str) -> None:
    """Refuse a ``batch_size`` that is not None or a positive integer."""
    if value is not None:
        require_int(value, f"{algorithm} batch_size (rows per local step; None: the full batch)")
