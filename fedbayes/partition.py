"""Splits of a pooled data set into simulated clients: i.i.d., label-skewed by Dirichlet proportions,
and by shards of classes (FedPop's and FedAvg's benchmark partitions). Each returns the client of every
item, for :meth:`fedbayes.FederatedData.from_pooled` or ``FederatedData.from_dataframe``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from .errors import ConfigError


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{name} must be an int; got {value!r}.")
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum}; got {value}.")
    return int(value)


def _check_labels(labels: ArrayLike) -> np.ndarray:
    array = np.asarray(labels)
    if array.ndim != 1 or array.size == 0 or array.dtype.kind not in "iu":
        raise ConfigError(
            f"labels must be a non-empty 1-D integer array; got shape {array.shape} and dtype "
            f"{array.dtype}. Encode classes with np.unique(labels, return_inverse=True)[1]."
        )
    return array


def partition_iid(num_items: int, num_clients: int, *, seed: int = 0) -> np.ndarray:
    """Split items uniformly at random into clients of near-equal size.

    Parameters
    ----------
    num_items
        Number of items ``N``.
    num_clients
        Number of clients ``C``; at most ``N`` so that no client is empty.
    seed
        Seed of ``np.random.default_rng``.

    Returns
    -------
    np.ndarray
        int64 client id per item; client sizes differ by at most one.
    """
    num_items = _check_int("num_items", num_items, 1)
    num_clients = _check_int("num_clients", num_clients, 1)
    if num_clients > num_items:
        raise ConfigError(
            f"num_clients={num_clients} exceeds num_items={num_items}; some clients would be empty. Lower num_clients."
        )
    rng = np.random.default_rng(_check_int("seed", seed, 0))
    ids = np.empty(num_items, dtype=np.int64)
    ids[rng.permutation(num_items)] = np.arange(num_items) % num_clients
    return ids


def partition_dirichlet(
    labels: ArrayLike,
    num_clients: int,
    *,
    alpha: float,
    seed: int = 0,
    min_size: int = 1,
    max_tries: int = 100,
) -> np.ndarray:
    """Label-skewed split: each class is divided among clients by Dirichlet proportions.

    Parameters
    ----------
    labels
        1-D integer class label per item.
    num_clients
        Number of clients ``C``.
    alpha
        Dirichlet concentration; small values give strong label skew, large values near-IID.
    seed
        Seed of ``np.random.default_rng``.
    min_size
        Minimum number of items per client; proportions are redrawn until it holds.
    max_tries
        Number of draws before giving up.

    Returns
    -------
    np.ndarray
        int64 client id per item.

    Raises
    ------
    ConfigError
        On invalid arguments, or if no draw in ``max_tries`` meets ``min_size``.
    """
    labels = _check_labels(labels)
    num_clients = _check_int("num_clients", num_clients, 1)
    min_size = _check_int("min_size", min_size, 0)
    max_tries = _check_int("max_tries", max_tries, 1)
    try:
        conc = float(alpha)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"alpha must be a positive float; got {alpha!r}.") from err
    if not (np.isfinite(conc) and conc > 0):
        raise ConfigError(f"alpha must be a positive finite float; got {alpha!r}.")
    if min_size * num_clients > labels.size:
        raise ConfigError(
            f"min_size={min_size} for {num_clients} clients needs {min_size * num_clients} items "
            f"but there are {labels.size}; lower min_size or num_clients."
        )
    rng = np.random.default_rng(_check_int("seed", seed, 0))
    classes = [np.flatnonzero(labels == k) for k in np.unique(labels)]
    for _ in range(max_tries):
        ids = np.empty(labels.size, dtype=np.int64)
        for items in classes:
            shares = np.cumsum(rng.dirichlet(np.full(num_clients, conc)))[:-1]
            bounds = np.minimum((shares * items.size).astype(np.int64), items.size)
            counts = np.diff(bounds, prepend=0, append=items.size)
            ids[rng.permutation(items)] = np.repeat(np.arange(num_clients), counts)
        if np.bincount(ids, minlength=num_clients).min() >= min_size:
            return ids
    raise ConfigError(
        f"no Dirichlet(alpha={conc}) draw gave every one of {num_clients} clients at least "
        f"{min_size} items in {max_tries} tries; lower min_size, raise alpha or raise max_tries."
    )


def shard_classes(num_classes: int, num_clients: int, classes_per_client: int, rng: np.random.Generator) -> np.ndarray:
    """The shard rule of :func:`partition_shards` (FedPop's and FedAvg's): with ``perm`` a random permutation
    of the ``K`` class indices (from ``rng``), client ``i`` holds classes ``perm[(i * S + j) % K]``, ``j < S``.
    Returns the class indices held, ``(num_clients, S)``."""
    perm = rng.permutation(num_classes)
    return np.array(
        [
            [perm[(i * classes_per_client + j) % num_classes] for j in range(classes_per_client)]
            for i in range(num_clients)
        ],
        dtype=np.int64,
    ).reshape(num_clients, classes_per_client)


def partition_shards(
    labels: ArrayLike,
    num_clients: int,
    *,
    classes_per_client: int,
    seed: int = 0,
    sizes: Sequence[int] | None = None,
) -> np.ndarray:
    """Give each client a fixed number of classes ("S classes per client").

    The ``K`` classes are randomly permuted; client ``i`` gets classes
    ``perm[(i * S + j) % K]`` for ``j < S``, so each class is held by about ``C * S / K``
    clients. Each class's items are split evenly at random among its holders.

    Parameters
    ----------
    labels
        1-D integer class label per item.
    num_clients
        Number of clients ``C``.
    classes_per_client
        Number ``S`` of distinct classes per client, ``1 <= S <= K``.
    seed
        Seed of ``np.random.default_rng``.
    sizes
        Optional number of items per client; client ``i`` keeps ``sizes[i]`` items drawn at
        random from its share and the rest become unassigned.

    Returns
    -------
    np.ndarray
        int64 client id per item, ``-1`` for unassigned items (classes nobody holds, or items
        dropped by ``sizes``).

    Raises
    ------
    ConfigError
        On invalid arguments, if a class has fewer items than holders, or if a client's share is
        smaller than its requested size.
    """
    labels = _check_labels(labels)
    num_clients = _check_int("num_clients", num_clients, 1)
    per_client = _check_int("classes_per_client", classes_per_client, 1)
    classes, inverse = np.unique(labels, return_inverse=True)
    num_classes = classes.size
    if per_client > num_classes:
        raise ConfigError(
            f"classes_per_client={per_client} exceeds the {num_classes} classes in labels; use at most {num_classes}."
        )
    if sizes is not None:
        if len(sizes) != num_clients:
            raise ConfigError(f"sizes has {len(sizes)} entries but num_clients={num_clients}.")
        sizes = [_check_int(f"sizes[{i}]", s, 1) for i, s in enumerate(sizes)]
    rng = np.random.default_rng(_check_int("seed", seed, 0))
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    for i, held in enumerate(shard_classes(num_classes, num_clients, per_client, rng)):
        for k in held:
            holders[k].append(i)
    ids = np.full(labels.size, -1, dtype=np.int64)
    for k, owners in enumerate(holders):
        if not owners:
            continue
        items = np.flatnonzero(inverse == k)
        if items.size < len(owners):
            raise ConfigError(
                f"class {classes[k]} has {items.size} items but is held by {len(owners)} "
                "clients; lower num_clients or classes_per_client."
            )
        owners_shuffled = rng.permutation(np.asarray(owners, dtype=np.int64))
        ids[rng.permutation(items)] = owners_shuffled[np.arange(items.size) % len(owners)]
    if sizes is not None:
        for i, size in enumerate(sizes):
            share = np.flatnonzero(ids == i)
            if share.size < size:
                raise ConfigError(
                    f"client {i} has {share.size} items in its share but sizes[{i}]={size}; "
                    "lower sizes[i] or num_clients."
                )
            ids[rng.choice(share, share.size - size, replace=False)] = -1
    return ids
