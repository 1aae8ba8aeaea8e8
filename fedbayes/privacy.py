"""Client-level differential privacy: the Gaussian mechanism's parts and its privacy accountant.

What is protected. A fit with client-level DP bounds how much everything the server sees during the
rounds (hence the estimate it publishes) can depend on any one client's whole data set. Each round
the server releases an aggregate of the cohort's uploads; with every upload clipped to an L2 norm of
at most ``clip`` (:func:`clip_norm`) and Gaussian noise of standard deviation
``noise_multiplier * clip`` added to their sum (:func:`gaussian_noise`), the round is a Gaussian
mechanism, and the rounds compose. The accountant turns (noise multiplier, cohort sampling, rounds)
into epsilon at a given delta with Google's ``dp-accounting`` library (the optional extra
``fedbayes[privacy]``): Renyi DP (Mironov 2017; sampling without replacement by Wang, Balle and
Kasiviswanathan 2019) for every setting, and privacy loss distributions (PLD, tight) where that
library has them (no sampling, or Poisson sampling).

Neighbouring data sets. The engine draws a cohort of a fixed size m of the n clients uniformly without
replacement (:func:`fedbayes.engine.sample_cohort`). Amplification by such sampling is proved for
data sets that differ by *replacing* one client's data (``relation="replace"``): a sum of uploads
clipped to C then changes by at most 2C, so the accountant is given the noise multiplier relative to
that sensitivity, sigma / 2. With every client in every round (m = n) nothing is sampled and the
usual relation, *adding or removing* a client (sensitivity C), is used (``relation="add-remove"``).
:func:`epsilon` and :func:`noise_multiplier_for` take the relation from the sampling, and the report
names it.

Langevin samplers. A step x' = x - gamma sum_i g_i + sqrt(2 gamma) xi with clipped gradients
||g_i|| <= C releases a Gaussian mechanism of sensitivity gamma C and noise sd sqrt(2 gamma): its
noise multiplier is sqrt(2 / gamma) / C already (:func:`langevin_noise_multiplier`), before any noise
is added for privacy.
"""

from __future__ import annotations

import math
import secrets
import warnings
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

import jax
import jax.numpy as jnp
import numpy as np

from .errors import ConfigError, is_real, require_choice, require_int
from .seeds import require_seed, seed_key

ACCOUNTANTS = ("rdp", "pld")
RELATIONS = ("add-remove", "replace")


def _accounting() -> Any:
    try:
        import dp_accounting
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise ConfigError(
            'privacy accounting needs the dp-accounting package: pip install "fedbayes[privacy]"'
        ) from None
    return dp_accounting


# ----------------------------------------------------------------------------------- the mechanism
def clip_norm(tree: Any, clip: float) -> tuple[Any, jax.Array]:
    """``(tree * min(1, clip / ||tree||), ||tree||)``: the pytree scaled so that the L2 norm over all of
    its leaves is at most ``clip`` (unchanged, bit for bit, when it already is), and the norm before
    clipping. The scale is computed in float64 where enabled, else float32, and rounded down by
    one part in 2^20 below the bound, which covers the rounding of the norm's sum for up to about 10^5
    float32 coordinates (far more in float64). A non-finite upload has a NaN norm and passes as it is
    (the fault screen rejects it before any aggregation)."""
    leaves = [jnp.asarray(leaf, jnp.result_type(float)) for leaf in jax.tree_util.tree_leaves(tree)]
    # the norm of tree / m times m, m the largest |value|: no overflow of the squares (1e20 in float32)
    m = jnp.max(jnp.stack([jnp.max(jnp.abs(leaf), initial=0.0) for leaf in leaves]))
    m = jnp.where(m > 0, m, 1.0)
    norm = m * jnp.sqrt(sum(jnp.sum(jnp.square(leaf / m)) for leaf in leaves))
    over = norm > clip
    scale = (clip / jnp.where(over, norm, 1.0)) * (1 - 2.0**-20)
    return jax.tree_util.tree_map(lambda leaf: jnp.where(over, (leaf * scale).astype(leaf.dtype), leaf), tree), norm


def gaussian_noise(key: jax.Array, tree: Any, std: Any) -> Any:
    """Independent N(0, std^2) noise shaped like ``tree`` (one normal per coordinate of every leaf)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(key, max(len(leaves), 1))
    noisy = [std * jax.random.normal(k, jnp.shape(leaf), jnp.result_type(leaf)) for k, leaf in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, noisy)


def secret_key(seed: int | None) -> jax.Array:
    """The key of a fit's privacy noise: from the operating system's entropy (``secrets``) by default, or
    from ``seed`` (reproducible, for tests and audits; the noise is then only as secret as the seed).
    The fit's own ``seed`` is public (it is in ``res.seed`` and every Flower node holds it), so noise
    drawn from it could be recomputed and subtracted."""
    return seed_key(secrets.randbits(64) if seed is None else seed, "noise_seed")


def folded(secret: jax.Array, public: jax.Array) -> jax.Array:
    """``secret`` with the words of a public key folded in: a distinct secret key for each round and
    client that the public key names, computable only with the secret."""
    data = jax.random.key_data(public) if jnp.issubdtype(public.dtype, jax.dtypes.prng_key) else public
    for i in range(data.shape[-1]):
        secret = jax.random.fold_in(secret, data[..., i])
    return secret


def langevin_noise_multiplier(step_size: float, clip: float) -> float:
    """sqrt(2 / gamma) / C: the noise multiplier of one Langevin step with clipped client gradients
    (sensitivity gamma C of the drift, noise sd sqrt(2 gamma))."""
    if not (step_size > 0 and clip > 0):
        raise ConfigError(
            f"a Langevin step's noise multiplier needs step_size > 0 and clip > 0, got {step_size} and {clip}"
        )
    return math.sqrt(2.0 / step_size) / clip


# ----------------------------------------------------------------------------------- the accountant
def relation_for(num_clients: int, cohort_size: int) -> str:
    """The neighbouring relation the accountant uses: ``"add-remove"`` with every client in every
    round, ``"replace"`` with a fixed-size cohort drawn without replacement (see the module notes)."""
    return "add-remove" if cohort_size >= num_clients else "replace"


class _Setting(TypedDict):
    """The keyword arguments of :func:`epsilon` and :func:`noise_multiplier_for` that a mechanism fixes."""

    delta: float
    rounds: int
    num_clients: int
    cohort_size: NotRequired[int | None]
    extra_rounds: int
    accountant: str


def _setting(
    delta: float,
    rounds: int,
    num_clients: int,
    cohort_size: int | None,
    sampling: str,
    extra_rounds: int,
    accountant: str,
) -> tuple[int, str]:
    """The checks :func:`epsilon` and :func:`noise_multiplier_for` share: ``(cohort, relation)``."""
    require_int(rounds, "rounds", 0)
    require_int(extra_rounds, "extra_rounds", 0)
    num_clients = require_int(num_clients, "num_clients")
    cohort = require_int(num_clients if cohort_size is None else cohort_size, "cohort_size")
    if cohort > num_clients:
        raise ConfigError(f"cohort_size must be an integer in 1..num_clients={num_clients}, got {cohort_size}")
    if not 0 < delta < 1:
        raise ConfigError(f"delta must be in (0, 1), got {delta}")
    if sampling not in ("fixed", "poisson"):
        raise ConfigError(f"sampling must be 'fixed' (the engine's cohorts) or 'poisson', got {sampling!r}")
    if accountant not in ACCOUNTANTS:
        raise ConfigError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    relation = "add-remove" if sampling == "poisson" else relation_for(num_clients, cohort)
    if accountant == "pld" and relation == "replace":
        raise ConfigError(
            "the PLD accountant of dp-accounting has no sampling without replacement: use "
            "accountant='rdp' for fixed-size cohorts (clients_per_round < num_clients)"
        )
    return cohort, relation


def _event(noise_multiplier: float, rounds: int, num_clients: int, cohort: int, sampling: str, extra: int) -> Any:
    """The DpEvent of ``rounds`` sampled rounds and ``extra`` rounds with every client (set-up, final)."""
    dpa = _accounting()
    if sampling == "poisson":
        one = dpa.PoissonSampledDpEvent(cohort / num_clients, dpa.GaussianDpEvent(noise_multiplier))
        full = dpa.GaussianDpEvent(noise_multiplier)
    elif cohort >= num_clients:
        one = full = dpa.GaussianDpEvent(noise_multiplier)
    else:  # replace-one: the sum's sensitivity is 2C, so the multiplier relative to it is sigma / 2
        one = dpa.SampledWithoutReplacementDpEvent(num_clients, cohort, dpa.GaussianDpEvent(noise_multiplier / 2))
        full = dpa.GaussianDpEvent(noise_multiplier / 2)
    events = [dpa.SelfComposedDpEvent(one, int(rounds))] if rounds else []
    if extra:
        events.append(dpa.SelfComposedDpEvent(full, int(extra)))
    return dpa.ComposedDpEvent(events)


def _accountant(name: str, relation: str) -> Any:
    dpa = _accounting()
    rel = dpa.NeighboringRelation.ADD_OR_REMOVE_ONE if relation == "add-remove" else dpa.NeighboringRelation.REPLACE_ONE
    return (dpa.rdp.RdpAccountant if name == "rdp" else dpa.pld.PLDAccountant)(neighboring_relation=rel)


def epsilon(
    noise_multiplier: float,
    *,
    delta: float,
    rounds: int,
    num_clients: int,
    cohort_size: int | None = None,
    sampling: str = "fixed",
    extra_rounds: int = 0,
    accountant: str = "rdp",
) -> float:
    """Epsilon at ``delta`` of ``rounds`` Gaussian mechanisms with noise multiplier sigma (noise sd /
    clip) on a cohort of ``cohort_size`` of ``num_clients`` clients (``sampling="fixed"``: uniformly
    without replacement, as the engine draws it; ``"poisson"``: each client independently with
    probability cohort_size / num_clients), composed with ``extra_rounds`` unsampled ones (exchanges
    with every client, such as a set-up or final exchange). ``inf`` for sigma = 0."""
    cohort, relation = _setting(delta, rounds, num_clients, cohort_size, sampling, extra_rounds, accountant)
    if not noise_multiplier >= 0:
        raise ConfigError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    if rounds + extra_rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    return _epsilon(noise_multiplier, delta, rounds, num_clients, cohort, sampling, extra_rounds, accountant, relation)


RDP_ONLY_ABOVE = 64.0
"""Beyond this epsilon (no meaningful protection) the PLD accountant is not run: its grid of privacy
losses would need gigabytes; the Renyi DP bound is reported instead (an upper bound too)."""


def _epsilon(
    sigma: float,
    delta: float,
    rounds: int,
    n: int,
    cohort: int,
    sampling: str,
    extra: int,
    accountant: str,
    relation: str,
) -> float:
    rdp = _accountant("rdp", relation)
    rdp.compose(_event(sigma, rounds, n, cohort, sampling, extra))
    eps = float(rdp.get_epsilon(delta))
    if relation == "replace":
        # Sampling cannot cost privacy (couple the two samples: they differ by one replacement at most),
        # so the unsampled mechanism's epsilon bounds it too; the bound for sampling without replacement
        # is the larger of the two for large cohorts.
        dpa = _accounting()
        plain = _accountant("rdp", relation)  # every round unsampled: the Gaussian at sigma / 2 (2C)
        plain.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma / 2), rounds + extra))
        eps = min(eps, float(plain.get_epsilon(delta)))
    if accountant == "rdp" or eps > RDP_ONLY_ABOVE:
        return eps
    pld = _accountant("pld", relation)
    pld.compose(_event(sigma, rounds, n, cohort, sampling, extra))
    return float(pld.get_epsilon(delta))


def noise_multiplier_for(
    target_epsilon: float,
    *,
    delta: float,
    rounds: int,
    num_clients: int,
    cohort_size: int | None = None,
    sampling: str = "fixed",
    extra_rounds: int = 0,
    accountant: str = "rdp",
) -> float:
    """The smallest noise multiplier whose :func:`epsilon` is at most ``target_epsilon``, to about 1e-6
    relative (Brent's method on the accountant's epsilon, which falls as the multiplier grows), solved
    before a fit."""
    if not target_epsilon > 0:
        raise ConfigError(f"the target epsilon must be > 0, got {target_epsilon}")
    cohort, relation = _setting(delta, rounds, num_clients, cohort_size, sampling, extra_rounds, accountant)
    if rounds + extra_rounds == 0:
        return 0.0

    def eps(s):
        return _epsilon(s, delta, rounds, num_clients, cohort, sampling, extra_rounds, accountant, relation)

    # Brent's method on log sigma (epsilon falls as sigma grows) in a bracket found by doubling, then
    # the root moved up by parts in 10^6 until the budget holds.
    low, high = 1.0, 1.0
    while eps(high) > target_epsilon:
        low, high = high, high * 2
        if high > 1e6:
            raise ConfigError(f"no noise multiplier up to 1e6 reaches epsilon {target_epsilon} at delta {delta}")
    while eps(low) <= target_epsilon:
        if low < 1e-6:
            return float(low)
        low, high = low / 2, low
    from scipy.optimize import brentq

    root = brentq(lambda t: eps(math.exp(t)) - target_epsilon, math.log(low), math.log(high), xtol=1e-8)
    sigma = min(math.exp(root), high)
    while eps(sigma) > target_epsilon:
        sigma *= 1 + 1e-6
    return float(sigma)


@dataclass(frozen=True)
class DP:
    """Client-level differential privacy for a fit (the option ``privacy=`` of an algorithm).

    ``clip``: the L2 bound of every upload. Either ``noise_multiplier`` (noise sd / clip) or a target
    ``epsilon`` (the multiplier is then solved for before the fit with :func:`noise_multiplier_for`);
    ``delta`` is the delta of the reported epsilon (by default min(1e-5, 1 / n^1.1) for n clients,
    well below the 1 / n at which a mechanism may publish one client's data whole). ``mode``:
    ``"central"`` (the server adds the noise to the aggregate) or ``"distributed"`` (each of the n
    clients adds N(0, sigma^2 C^2 / n), so that the sum carries the noise without the server's help;
    against the server itself this needs secure aggregation: on Flower, ``fb.flower.SecAggPlus``).
    ``accountant``: ``"rdp"`` or ``"pld"`` (see the module notes). ``noise_seed``: None (default)
    draws the noise from the operating system's entropy; an int makes it reproducible, and exactly as
    secret as that int (:func:`secret_key`): whoever holds the algorithm's configuration (on Flower every
    node and the server) holds it, so use it for tests and audits only."""

    clip: float
    noise_multiplier: float | None = None
    epsilon: float | None = None
    delta: float | None = None
    mode: str = "central"
    accountant: str = "rdp"
    noise_seed: int | None = None

    def __post_init__(self) -> None:
        if not (is_real(self.clip) and math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError(f"DP needs a finite clip > 0 (the L2 bound of an upload), got {self.clip!r}")
        for name in ("noise_multiplier", "epsilon", "delta"):
            value = getattr(self, name)
            if value is not None and not (is_real(value) and math.isfinite(value)):
                raise ConfigError(f"DP {name} must be a finite number or None, got {value!r}")
        if (self.noise_multiplier is None) == (self.epsilon is None):
            raise ConfigError(
                "DP takes exactly one of noise_multiplier (noise sd / clip) and epsilon (a target "
                f"budget), got noise_multiplier={self.noise_multiplier} and epsilon={self.epsilon}"
            )
        if self.noise_multiplier is not None and not self.noise_multiplier >= 0:
            raise ConfigError(f"noise_multiplier must be >= 0, got {self.noise_multiplier}")
        if self.epsilon is not None and not self.epsilon > 0:
            raise ConfigError(f"epsilon must be > 0, got {self.epsilon}")
        if self.delta is not None and not 0 < self.delta < 1:
            raise ConfigError(f"delta must be in (0, 1), got {self.delta}")
        require_choice(self.mode, "DP mode", ("central", "distributed"))
        require_choice(self.accountant, "DP accountant", tuple(ACCOUNTANTS))
        if self.noise_seed is not None:
            require_seed(self.noise_seed, "noise_seed")

    def resolved_delta(self, num_clients: int) -> float:
        """``delta``, or min(1e-5, 1 / n^1.1) for n clients."""
        return self.delta if self.delta is not None else min(1e-5, 1.0 / num_clients**1.1)


def check_dp(privacy: Any, name: str) -> None:
    """An algorithm's ``privacy`` option is a :class:`DP` or None (``ConfigError`` otherwise)."""
    if privacy is not None and not isinstance(privacy, DP):
        raise ConfigError(f"{name} privacy must be a fb.privacy.DP or None, got {type(privacy).__name__}")


def _asked_multiplier(dp: DP, setting: _Setting) -> float:
    """``dp``'s noise multiplier, or the one solved for its target epsilon in ``setting``."""
    if dp.noise_multiplier is not None:
        return dp.noise_multiplier
    if dp.epsilon is None:  # refused by DP.__post_init__: exactly one of the two is set
        raise ConfigError("DP takes exactly one of noise_multiplier and epsilon, got neither")
    return noise_multiplier_for(dp.epsilon, **setting)


def sums_only(dp: Any, applies: bool, reason: str) -> bool | str:
    """A run's ``sums_uploads`` (:class:`fedbayes.protocol.FederatedRun`): True where its distributed DP leaves the
    server only sums of the uploads to need (``applies``: the run is one whose distributed mode does), else
    ``reason``, why secure aggregation cannot run it."""
    return True if applies and dp is not None and dp.distributed else reason


def _answer_counts(answered: Any) -> dict[int, int]:
    """How many rounds had each number a > 0 of answering clients (``answered``: one count per round); a round
    nobody answered released nothing."""
    values, counts = np.unique(np.asarray(answered, int).ravel(), return_counts=True)
    return {int(a): int(k) for a, k in zip(values, counts) if a > 0}


class _Mechanism:
    """What the mechanisms share: each client's upload clipped as one vector, and the report's common
    part. Subclasses set ``dp``, ``sigma``, ``epsilon`` and ``delta``."""

    dp: DP
    sigma: float
    epsilon: float
    delta: float
    secret: jax.Array

    @property
    def distributed(self) -> bool:
        """Whether each client clips its own upload and adds its share of the noise (the subclass's ``share``)."""
        return self.dp.mode == "distributed"

    def _warn_distributed(self, shares: int) -> None:
        """In the distributed mode, the warning that without secure aggregation the server sees each upload."""
        if self.distributed:
            warnings.warn(
                "distributed DP with no secure aggregation (fed_fit, or Flower without fb.flower.SecAggPlus): the "
                f"server sees each client's upload with 1/{shares} of the noise; the reported epsilon holds for "
                "what the server releases (the iterates), not against the server itself",
                UserWarning,
                stacklevel=3,
            )

    def clipped(self, rows: Any) -> Any:
        """Each client's upload (the leaves' axis 0) clipped to C as one vector."""
        return jax.vmap(lambda r: clip_norm(r, self.dp.clip)[0])(rows)

    def _report(self, **extra: Any) -> dict[str, Any]:
        """``res.privacy``: epsilon at delta, sigma and C, then ``extra``, then the accountant."""
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "noise_multiplier": self.sigma,
            "clip": float(self.dp.clip),
            **extra,
            "accountant": self.dp.accountant,
        }


class LangevinPrivacy(_Mechanism):
    """Client-level DP of a Langevin sampler's rounds (LMC): each client's upload, the gradients of all
    its chains, is clipped to L2 norm C (at the server, or by the client in the distributed mode,
    :meth:`share`), and the (re-weighted) sum g is given the noise that the step's own noise lacks. A released iterate
    x' = x - gamma g + sqrt(2 gamma) z (and
    so everything computed from the iterates) then is a Gaussian mechanism of sensitivity gamma w C, w
    the round's fault weight (1 when every client answers), with noise multiplier sigma:

        x' = x - gamma (g + s e) + sqrt(2 gamma) z,   s^2 = max(0, sigma^2 w^2 C^2 - 2 / gamma),

    since (2 gamma + gamma^2 s^2) / (gamma w C)^2 = sigma^2. Where the step's noise alone, whose
    multiplier is sqrt(2 / gamma) / C (:func:`langevin_noise_multiplier`), is enough, nothing is added
    and sigma is that multiplier. With a target epsilon, sigma is solved for over the fit's releases: the
    set-up's first move and one per round, every client in each (the samplers' full participation).

    On a Gaussian target the added noise widens the stationary law of the chain by the factor
    1 + gamma s^2 / 2 (``tests/test_privacy.py``): privacy costs the posterior its accuracy, by an
    amount this formula gives before the fit."""

    def __init__(self, dp: DP, step_size: float, num_rounds: int, num_clients: int):
        self.dp, self.gamma, self.num_clients = dp, float(step_size), int(num_clients)
        self.releases = int(num_rounds) + 1
        self.inherent = langevin_noise_multiplier(self.gamma, dp.clip)
        self.delta = dp.resolved_delta(self.num_clients)
        kw = _Setting(
            delta=self.delta,
            rounds=int(num_rounds),
            num_clients=self.num_clients,
            extra_rounds=1,
            accountant=dp.accountant,
        )
        asked = _asked_multiplier(dp, kw)
        # centrally the step's own noise gives at least its multiplier; in the distributed mode that noise
        # is the server's own and does not count against it
        self.sigma = float(asked) if self.distributed else max(float(asked), self.inherent)
        self.epsilon = epsilon(self.sigma, **kw)
        self.secret = secret_key(dp.noise_seed)
        self._warn_distributed(self.num_clients)

    def share(self, key: jax.Array, grad: jax.Array) -> jax.Array:
        """Distributed DP: a client's upload clipped to C, plus N(0, s^2 / n) noise, n the number of
        clients (all take part in every round), so that the sum of the n uploads carries N(0, s^2) as in
        the central mode while each upload alone is barely noised (meant for secure aggregation, where
        the server sees only the sum). A client that drops out takes its share with it: the sum of a
        round with f of n missing has (n - f) / n of the variance, and the guarantee is weaker that
        round (the accountant assumes every client answers)."""
        clipped = clip_norm(grad, self.dp.clip)[0]
        std = self.share_std()
        return clipped + std.astype(grad.dtype) * jax.random.normal(folded(self.secret, key), grad.shape, grad.dtype)

    def share_std(self) -> jax.Array:
        """The standard deviation of one client's share of the noise, s / sqrt(n) (distributed mode)."""
        return self.added_std() / math.sqrt(self.num_clients)

    def clipped_sum(self, rows: jax.Array) -> jax.Array:
        """The sum over clients (axis 0) of their uploads, each clipped to the L2 bound as a whole."""
        return jnp.sum(self.clipped(rows), 0)

    def added_std(self, weight: Any = 1.0) -> Any:
        """s: the standard deviation of the noise added to each coordinate of g (distributed: sigma C,
        all of it from the clients)."""
        if self.distributed:
            return jnp.asarray(self.sigma * weight * self.dp.clip)
        s2 = (self.sigma * weight * self.dp.clip) ** 2 - 2.0 / self.gamma
        return jnp.sqrt(jnp.maximum(s2, 0.0))

    def noisy(self, key: jax.Array, g: jax.Array, weight: jax.Array) -> jax.Array:
        """g + s e, e standard normal from the secret key, s = :meth:`added_std` at the round's fault weight."""
        e = jax.random.normal(folded(self.secret, key), g.shape, g.dtype)
        return g + self.added_std(weight).astype(g.dtype) * e

    def realised_epsilon(self, answered: Any) -> float:
        """Distributed mode: epsilon at delta for the rounds as they went, ``answered[t]`` clients of n having
        sent their share in round t. The sum of the shares of a round with a answering carries a / n of the
        noise's variance, and the fault weight n / a scales noise and sensitivity alike, so the round is a
        Gaussian mechanism with multiplier sigma sqrt(a / n) (weaker than planned); a round nobody answered
        released nothing about anyone. The set-up has every client."""
        dpa = _accounting()
        counts = _answer_counts(answered)
        if self.sigma == 0:  # no noise: no guarantee (as epsilon() reports)
            return math.inf
        counts[self.num_clients] = counts.get(self.num_clients, 0) + 1  # the set-up's first move
        events = [
            dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(self.sigma * math.sqrt(a / self.num_clients)), k)
            for a, k in sorted(counts.items())
        ]
        acc = _accountant(self.dp.accountant, "add-remove")
        acc.compose(dpa.ComposedDpEvent(events))
        return float(acc.get_epsilon(self.delta))

    def report(self, answered: Any = None) -> dict[str, Any]:
        """``res.privacy``; in the distributed mode with ``answered`` (the clients that sent their share, per
        round) also ``epsilon_realised``, for the rounds as they went (:meth:`realised_epsilon`)."""
        extra = {}
        if self.distributed and answered is not None:
            extra["epsilon_realised"] = self.realised_epsilon(answered)
        return self._report(
            step_noise_multiplier=self.inherent,
            added_noise_std=float(self.added_std()),
            releases=self.releases,
            **extra,
            # distributed: a client's data zeroed while it still sends its share of the noise (removing the
            # client would take its share too, and the others' (n - 1) / n of the variance would be left)
            relation="zero-out" if self.distributed else "add-remove",
            mechanism=(
                "central: uploads clipped at the server, the Langevin step's noise counted, Gaussian "
                "noise added to the gradient sum where it falls short"
                if not self.distributed
                else "distributed: each client clips its upload and adds 1/n of the noise the gradient sum "
                "needs; the server sees each upload unless secure aggregation sums them"
            ),
        )


class SumPrivacy(_Mechanism):
    """Central client-level DP of a server that releases (functions of) a re-weighted sum of the cohort's
    uploads, w sum_i g_i with w = n / |A| (FedSOUL's gradient estimate): each client's upload, as one
    vector over every leaf, is clipped to C at the server and the sum is given N(0, (sigma w C)^2) noise
    per coordinate, the Gaussian mechanism with noise multiplier sigma at the round's sensitivity w C
    (the estimator stays unbiased for the clipped uploads: the noise has mean zero). A round releases
    the new iterate, its diagnostics computed from the noisy sum; sigma is given or solved for the fit's
    rounds with a cohort of m of the n clients drawn without replacement (:func:`epsilon`), plus
    ``extra_rounds`` releases of every client (a set-up exchange by the same mechanism). FedMM's
    weighted mean of statistics uses it with w = 1 / (n p) (see ``fb.FedMM``'s ``privacy``)."""

    def __init__(
        self,
        dp: DP,
        num_rounds: int,
        num_clients: int,
        cohort_size: int,
        extra_rounds: int = 0,
        mechanism: str | None = None,
        public: str | None = None,
        share_members: int | None = None,
    ):
        self.dp, self.num_clients, self.cohort = dp, int(num_clients), int(cohort_size)
        # distributed mode: the members whose shares make up each coordinate's noise (the cohort; TAMUNA's s holders)
        self.members = self.cohort if share_members is None else int(share_members)
        if mechanism is None:  # FedSOUL's central mode
            mechanism = (
                "central: each client's gradient upload clipped at the server, Gaussian noise on the re-weighted "
                "sum; the clients' objectives are not used, and no standard errors"
            )
        self.rounds, self.extra, self.mechanism = int(num_rounds), int(extra_rounds), mechanism
        self.public = public
        self.delta = dp.resolved_delta(self.num_clients)
        kw = _Setting(
            delta=self.delta,
            rounds=self.rounds,
            num_clients=self.num_clients,
            cohort_size=self.cohort,
            extra_rounds=self.extra,
            accountant=dp.accountant,
        )
        self.sigma = float(_asked_multiplier(dp, kw))
        self.epsilon = epsilon(self.sigma, **kw)
        self.secret = secret_key(dp.noise_seed)
        self._warn_distributed(self.members)

    def share_std(self, members: int | None = None) -> float:
        """The standard deviation of one member's share of the noise, sigma C / sqrt(c) (distributed mode; c the
        cohort size, TAMUNA's number s of holders of a coordinate, or ``members``)."""
        return self.sigma * self.dp.clip / math.sqrt(self.members if members is None else members)

    def share(self, key: jax.Array, tree: Any, members: int | None = None) -> Any:
        """Distributed DP: a member's upload (a pytree, as one vector) clipped to C, plus N(0, sigma^2 C^2 / c) per
        coordinate, c the cohort size (or ``members``: FedMM's set-up, where all n clients take part), so that the
        sum over the c members carries the central mode's N(0, sigma^2 C^2) while each upload alone is barely
        noised (meant for secure aggregation: the server sees only the sum). A member that does not answer takes
        its share with it (:meth:`realised_epsilon`)."""
        clipped = clip_norm(tree, self.dp.clip)[0]
        noise = gaussian_noise(folded(self.secret, key), clipped, 1.0)
        std = self.share_std(members)
        return jax.tree_util.tree_map(lambda t, e: t + (std * e).astype(t.dtype), clipped, noise)

    def realised_epsilon(self, answered: Any) -> float:
        """Distributed mode: epsilon at delta for the rounds as they went, ``answered[t]`` of the c cohort members
        having sent their share in round t. The shares of a round with a answering carry a / c of the planned
        variance while the sensitivity stays (a member's update enters the fixed-denominator sum alone), so the
        round is the planned mechanism with multiplier sigma sqrt(a / c); a round nobody answered released nothing.
        With ``share_members`` m (TAMUNA: each coordinate's noise is the shares of its m = s holders)
        ``answered[t]`` is the fewest holders that answered for any coordinate some holder answered for, and
        the multiplier sigma sqrt(a / m).
        With a sampled cohort the bound is the smaller of the sampled and unsampled ones, as in :func:`epsilon`.
        The ``extra_rounds`` set-up releases (FedMM's) are counted as planned: the set-up waits for every client."""
        dpa = _accounting()
        counts = _answer_counts(answered)
        if not counts and not self.extra:
            return 0.0
        if self.sigma == 0:  # no noise: no guarantee (as epsilon() reports)
            return math.inf
        n, c = self.num_clients, self.cohort
        relation = relation_for(n, c)

        def bound(sampled: bool) -> float:
            acc = _accountant("rdp", relation)
            for a, k in sorted(counts.items()):
                sigma = self.sigma * math.sqrt(a / self.members)
                if sampled:
                    acc.compose(_event(sigma, k, n, c, "fixed", 0))
                else:  # every round unsampled: replace-one moves the sum by 2C
                    acc.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma / 2), k))
            if self.extra:  # the set-up's releases (FedMM's): every client answers them, as planned
                acc.compose(_event(self.sigma, 0, n, c, "fixed", self.extra))
            return float(acc.get_epsilon(self.delta))

        return bound(True) if relation == "add-remove" else min(bound(True), bound(False))

    def noisy(self, key: jax.Array, total: Any, weight: Any) -> Any:
        """``total`` (a pytree: the re-weighted sum) plus N(0, (sigma weight C)^2) per coordinate."""
        noise = gaussian_noise(folded(self.secret, key), total, 1.0)
        std = self.sigma * weight * self.dp.clip
        return jax.tree_util.tree_map(lambda t, e: t + (std * e).astype(t.dtype), total, noise)

    def report(self, answered: Any = None) -> dict[str, Any]:
        """``res.privacy``; in the distributed mode with ``answered`` (the members that sent their share, per
        round) also ``epsilon_realised``, for the rounds as they went (:meth:`realised_epsilon`)."""
        relation = relation_for(self.num_clients, self.cohort)
        extra: dict[str, Any] = {}
        if self.distributed and answered is not None:
            extra["epsilon_realised"] = self.realised_epsilon(answered)
        if self.public is not None:  # weights that depend on the clients' sizes: those are public, a client is
            # zeroed rather than removed (with full participation; a cohort's replace-one covers it)
            relation = "zero-out" if relation == "add-remove" else relation
            extra["public"] = self.public
        return self._report(
            releases=self.rounds + self.extra, cohort=self.cohort, relation=relation, mechanism=self.mechanism, **extra
        )
