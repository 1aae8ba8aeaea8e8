"""Client faults: injection (for simulation), detection, and robust aggregation.

A federated round expects an upload from every *expected* member of its cohort (every member, or
those that drew participation). A member is **faulty** when its upload

* never arrives (``dropped``: the client went offline, timed out, crashed);
* contains NaN or inf (``nonfinite``: a bug, an overflow, an attack);
* is absurdly large (``too_large``): its largest absolute entry exceeds ``FaultPolicy.max_abs``,
  or ``FaultPolicy.relative`` times the median of that quantity over the round's other answers.

The engine (:func:`fedbayes.engine.make_round`) checks every upload, zeroes faulty ones before the
server step and tells the server who they were (``RoundInfo.faulty``); the faulty member's client
state is **not** committed (its round is rolled back), so error-feedback memories and control
variates stay exactly in step with the server's mirrors of them. Each algorithm then does what its
estimator needs (stated in its docstring and in docs/guides/errors-faults-checkpoints.md):

* averages over the cohort (FedSOUL, QLSD, parameter-averaging EM) already divide by the number of
  members that answered: a uniform random subset of a uniform cohort is a uniform cohort;
* plain sums over the expected members (LMC, P-ELF's uplink, FedMM's H) are scaled by
  ``expected / answered``, which is unbiased conditional on the number of answers when faults
  strike members at random (a round nobody answered has no estimate: FedMM steps along its mirror
  V, LMC and P-ELF hold x). Unbiased is not exact for a sampler: the re-weighting adds gradient
  noise that widens LMC's stationary law by O(step size), as in SGLD (computed exactly for a
  Gaussian target in ``tests/test_faults.py``); the EF21 mirrors below do not add it;
* memories mirrored on the server (D-/B-ELF's g = sum_i g_i, FedMM's V, QLSD's H) keep the faulty
  client's stale memory, the EF21 / control-variate fallback;
* TAMUNA averages each coordinate over the holders that answered (a coordinate no holder answered
  keeps its previous value), which keeps sum_i h_i = 0 exactly. GD and FedAvg keep no control
  variates, so the same mean makes them their stochastic, partial-participation versions: GD then
  hovers around x* at a distance of order step size x the spread of the clients' gradients (Scaffnew
  with p = 1, GD with control variates, stays exact);
* a client that keeps a copy of a compressed downlink (P-/B-ELF's w) is re-sent the server's copy in
  full after a fault, and the bits are counted.

Every fault is recorded: per-round counts in ``res.history`` (``dropped``, ``nonfinite``,
``too_large``, and ``bits_up_rejected``, the bits of rejected uploads) and one row per event in
``res.faults``. A round in which faults leave fewer than ``FaultPolicy.min_clients`` answers stops
the fit with :class:`fedbayes.TooFewClientsError`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from .errors import ConfigError, is_real, require_choice, require_fraction, require_int

OK, DROPPED, NONFINITE, TOO_LARGE = 0, 1, 2, 3
ABSENT = -1  # a round's record for a cohort slot whose member was not expected (participation < 1)
KIND_NAMES = {DROPPED: "dropped", NONFINITE: "nonfinite", TOO_LARGE: "too_large"}


@dataclass(frozen=True)
class Faults:
    """Simulated client faults, drawn independently for each expected cohort member and round.

    ``drop``: the upload is lost; ``nan``: every float of the upload becomes NaN; ``large``: the upload
    is multiplied by ``large_scale`` (finite and absurd by default; a moderate negative scale such as
    -10 is a simple Byzantine attack that passes the screen, for testing robust aggregation). The draws use a key stream
    of their own, a
    function of the seed and the round, so a fit with faults is reproducible and the fault-free key
    streams (cohort, client, server) are unchanged.
    """

    drop: float = 0.0
    nan: float = 0.0
    large: float = 0.0
    large_scale: float = 1e20

    def __post_init__(self):
        total = sum(
            float(require_fraction(getattr(self, n), f"Faults.{n} (a probability)", closed_high=True))
            for n in ("drop", "nan", "large")
        )
        if total > 1.0:
            raise ConfigError(f"Faults probabilities sum to {total:g} > 1; each member has one fault at most")
        if not is_real(self.large_scale) or not abs(self.large_scale) > 1:
            raise ConfigError(f"Faults.large_scale must be a number with |large_scale| > 1, got {self.large_scale!r}")

    def draw(self, key: jax.Array, size: int) -> jax.Array:
        """The injected fault kind of each of ``size`` members (OK, DROPPED, NONFINITE or TOO_LARGE)."""
        u = jax.random.uniform(key, (size,))
        edges = jnp.cumsum(jnp.asarray([self.drop, self.nan, self.large]))
        return jnp.where(
            u < edges[0], DROPPED, jnp.where(u < edges[1], NONFINITE, jnp.where(u < edges[2], TOO_LARGE, OK))
        )

    def corrupt(self, payload: Any, kind: jax.Array) -> Any:
        """The uploads as the server receives them: NaN or scaled rows where injected."""

        def one(leaf):
            if not jnp.issubdtype(leaf.dtype, jnp.inexact):
                return leaf
            k = jnp.reshape(kind, (-1,) + (1,) * (leaf.ndim - 1))
            return jnp.where(k == NONFINITE, jnp.nan, jnp.where(k == TOO_LARGE, leaf * self.large_scale, leaf))

        return jax.tree_util.tree_map(one, payload)


@dataclass(frozen=True)
class FaultPolicy:
    """How the server screens uploads and when it gives up.

    Parameters
    ----------
    min_clients:
        A round in which faults leave fewer answering clients than this stops the fit with
        ``fb.TooFewClientsError`` (the fit up to the last good round is kept on the error). Rounds
        with few members by design (Bernoulli participation) never stop a fit; 0 never stops (a round
        without answers then leaves the server state as the algorithm's fallback says).
    max_abs:
        Reject an upload whose largest absolute entry exceeds this (None: no absolute bound).
    relative:
        Reject an upload whose largest absolute entry exceeds ``relative`` times the (upper) median
        of that quantity over the round's finite answers (None: off). The default flags only absurd values;
        with cohorts of fewer than 3 members the median is not robust, so set ``max_abs`` there.
    """

    min_clients: int = 1
    max_abs: float | None = None
    relative: float | None = 1e6

    def __post_init__(self):
        require_int(self.min_clients, "FaultPolicy.min_clients", 0)
        for name in ("max_abs", "relative"):
            v = getattr(self, name)
            if v is not None and (not is_real(v) or not v > 0):
                raise ConfigError(f"FaultPolicy.{name} must be a positive number or None, got {v!r}")
        if self.relative is not None and self.relative <= 1:
            raise ConfigError(f"FaultPolicy.relative must exceed 1 (it multiplies the median), got {self.relative!r}")


def upper_median(values: jax.Array, mask: jax.Array) -> jax.Array:
    """The upper median of the non-negative ``values[mask]`` (NaN where ``mask`` is empty), without a sort.

    With k masked values it is the smallest v among them with #{x <= v} >= floor(k/2) + 1: the middle
    value for odd k, the larger middle one for even k (so a cohort of two never flags its larger
    member). Non-negative floats order as their bit patterns read as integers, so the answer is found
    by bisection over those integers: 31 (float32) or 63 (float64) counting passes over the values,
    O(k) each, where a sort-based median costs a sort of the cohort every round (10-15x slower at
    10 000 clients on a CPU; see benchmarks/README.md).
    """
    itype = {2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[values.dtype.itemsize]
    top = jnp.iinfo(itype).max  # read back as a float: NaN
    bits = jnp.where(mask, jax.lax.bitcast_convert_type(values, itype), top)
    target = jnp.sum(mask) // 2 + 1

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        enough = jnp.sum(bits <= mid) >= target
        return jnp.where(enough, lo, mid + 1), jnp.where(enough, mid, hi)

    _, hi = jax.lax.fori_loop(0, 8 * values.dtype.itemsize - 1, halve, (itype(0), itype(top)))
    return jax.lax.bitcast_convert_type(hi, values.dtype)


def _beyond_median(size: jax.Array, usable: jax.Array, relative: float) -> jax.Array:
    """``(m > 0) & (size > relative * m)`` with m the upper median of ``size[usable]``, computed only when
    some row could be flagged. No row can be when ``max(size) <= relative * min(size[usable])``: the
    median is at least that minimum, and a float product is monotone in its factor, so every
    ``size_i <= relative * min <= relative * m``. That holds in nearly every round (uploads within a
    factor ``relative``, 1e6 by default, of each other), and the median's 31 or 63 counting passes,
    most of a small cohort's round (benchmarks/README.md, the samplers' table), are skipped."""
    smallest = jnp.min(jnp.where(usable, size, jnp.inf))
    quiet = jnp.max(size) <= relative * smallest

    def flagged(size, usable):
        median = upper_median(size, usable)
        return (median > 0) & (size > relative * median)

    return jax.lax.cond(quiet, lambda s, u: jnp.zeros(s.shape, bool), flagged, size, usable)


def screen(payload: Any, received: jax.Array, policy: FaultPolicy) -> jax.Array:
    """The fault kind of each received upload: NONFINITE, TOO_LARGE or OK (not-received rows: OK)."""
    leaves = [
        jnp.reshape(x, (x.shape[0], -1))
        for x in jax.tree_util.tree_leaves(payload)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if not leaves:
        return jnp.zeros(received.shape, jnp.int32)
    flat = jnp.concatenate(leaves, axis=1)
    # One reduction per row: the largest |x_j|, NaN counted as inf, is finite exactly when the row is, and is
    # then the row's size. (Two reductions, all(isfinite) and the largest finite |x_j|, gave the same kinds but
    # cost P-ELF's round at 100 clients a third of its time: benchmarks/README.md, the samplers.)
    largest = jnp.max(jnp.where(jnp.isnan(flat), jnp.inf, jnp.abs(flat)), axis=1)
    finite = jnp.isfinite(largest)
    size = jnp.where(finite, largest, 0.0)  # a non-finite row's kind does not depend on its size
    large = jnp.zeros(received.shape, bool)
    if policy.max_abs is not None:
        large = large | (size > policy.max_abs)
    if policy.relative is not None:
        usable = received & finite
        large = large | _beyond_median(size, usable, policy.relative)
    return jnp.where(~finite, NONFINITE, jnp.where(large, TOO_LARGE, OK))


# ------------------------------------------------------------------------------ robust aggregation


@dataclass(frozen=True)
class Aggregation:
    """How a server averages the answers: ``"mean"``, ``"median"`` (coordinate-wise) or
    ``"trimmed"`` (coordinate-wise trimmed mean dropping a ``trim`` fraction at each end).

    The statistical cost: the median's variance is pi/2 ~ 1.57 times the mean's for Gaussian noise
    (a 10% trimmed mean's about 1.06 times), and with heterogeneous clients the median and trimmed
    mean estimate a *different* centre than the mean, so the algorithm's fixed point moves away from
    the federated target by up to the spread of the clients' updates. Use them only against
    Byzantine clients, which the mean cannot survive.
    """

    rule: str = "mean"
    trim: float = 0.1

    def __post_init__(self):
        require_choice(self.rule, "aggregation rule", ("mean", "median", "trimmed"))
        if not is_real(self.trim) or not 0.0 <= self.trim < 0.5:
            raise ConfigError(f"trimmed-mean trim must lie in [0, 0.5), got {self.trim!r}")

    @property
    def robust(self) -> bool:
        return self.rule != "mean"

    def __call__(self, values: jax.Array, include: jax.Array) -> jax.Array:
        """Coordinate-wise centre of the included rows of ``values`` (axis 0); ``include`` broadcasts
        against ``values``. Coordinates with no included row give 0."""
        include = jnp.broadcast_to(
            jnp.reshape(include, include.shape + (1,) * (values.ndim - include.ndim)), values.shape
        )
        k = jnp.sum(include, axis=0)
        if self.rule == "mean":
            return jnp.sum(jnp.where(include, values, 0.0), axis=0) / jnp.maximum(k, 1)
        ordered = jnp.sort(jnp.where(include, values, jnp.inf), axis=0)
        rank = jnp.reshape(jnp.arange(values.shape[0]), (-1,) + (1,) * (values.ndim - 1))
        if self.rule == "median":
            lo, hi = (k - 1) // 2, k // 2
        else:
            lo = jnp.floor(self.trim * k).astype(k.dtype)
            hi = k - 1 - lo
        keep = (rank >= lo) & (rank <= hi)
        return jnp.where(k > 0, jnp.sum(jnp.where(keep, ordered, 0.0), axis=0) / jnp.maximum(hi - lo + 1, 1), 0.0)


def as_aggregation(value: Any) -> Aggregation:
    """``"mean"``, ``"median"``, ``"trimmed"``, a float (a trimmed mean with that trim) or an Aggregation."""
    if isinstance(value, Aggregation):
        return value
    if isinstance(value, str):
        return Aggregation(value)
    if is_real(value):
        return Aggregation("trimmed", float(value))
    raise ConfigError(
        f"aggregation must be 'mean', 'median', 'trimmed', a trim fraction or fb.Aggregation, got {value!r}"
    )


def fault_weight(info: Any, dtype: Any) -> jax.Array:
    """``expected / answered`` for a round (1 without faults), in ``dtype``: the factor that keeps a
    sum over the expected members unbiased when random members fail. With no answer the sum it
    scales is 0, so the caller needs a fallback for such rounds (they occur only under
    ``FaultPolicy(min_clients=0)``)."""
    if info.faulty is None:
        return jnp.asarray(1.0, dtype)
    answered = jnp.sum(info.active)
    return ((answered + jnp.sum(info.faulty)) / jnp.maximum(answered, 1)).astype(dtype)
