"""FedMM (Dieuleveut, Fort, Hegazy, Wai, 2025, Algorithm 2): federated EM by aggregating statistics.

The clients' EM surrogates are linear in the expected complete-data statistic (FedMM Example 2), so
the server averages *statistics*, never parameters, and applies the M-step map T to the average.
With mu_i = N_i / N, s_i(theta) = E[S(D_i, h) | D_i, theta] / N_i and h_i(s) = s_i(T(s)) - s, round t:

    active clients A_{t+1} (each independently with probability p; or a uniform cohort, p = m / n)
    client i in A:  Delta_i = s_i(theta_t) - S_t - V_i,   Q_i = Quant(Delta_i)   (unbiased),
                    V_i <- V_i + (alpha / p) Q_i,          upload Q_i
    server:         H = V + (1/p) sum_{i in A} mu_i Q_i      (E[H] = h(S_t))
                    S_{t+1} = Proj( S_t + gamma_{t+1} H ),  V <- V + (alpha / p) sum_{i in A} mu_i Q_i,
                    theta_{t+1} = T(S_{t+1}),               broadcast (S_{t+1}, theta_{t+1})

so V = sum_i mu_i V_i after every round (Proposition 5). The projection onto the statistics' valid
set (non-negative counts, PSD moment blocks; Euclidean, B = I as in the paper's experiments) keeps T
defined under compression; ``projection=False`` is FedEM (Dieuleveut et al. 2021). Initialisation
(the digest's recipe): a federated E-step at theta_0 gives S_0 = sum_i mu_i s_i(theta_0); with
``control_variates="e_step"`` one more pass sets V_i = h_i(S_0) (no heterogeneity term in Theorem 1).
With gamma = 1, p = 1, no compression and exact E-steps the iterates are centralised EM's.
For mixed models (linear-Gaussian terms, per-client latents) theta_0's fixed effects come first from
one federated least-squares pass on the non-personalised model (``population_start``): from fixed
effects far from the data the random effects absorb the misfit and EM crawls along the ridge where
fixed effects and random-effect means trade off (issue 21: sleepstudy in ms stopped at 152 for 251).
After the last round, the final exchange's statistic at theta-hat also gives the gradient of the
marginal log posterior by Fisher's identity (``parts["gradient"]``, no extra upload).

The M-step uses the prior as the MAP-EM penalty: T(s) = argmax Q(theta; N s) + log p(theta).
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .. import minibatch
from ..minibatch import check_batch_size
from ..compress import Compressor, identity, require_unbiased
from ..engine import client_key, final_exchange, run_jit, stack_clients
from ..errors import ConfigError, ModelError, require_choice, require_fraction, require_int, require_real
from ..protocol import ClientData, FederatedRun, FitParts, Message, Problem, RoundInfo, dense_message
from .expfam import CustomStatistics, Derived, derive
from ..faults import fault_weight
from ..privacy import SumPrivacy, check_dp, sums_only
from ..introspect import FedModel, Params
from ..optim import as_schedule
from . import louis
from .estep import e_step_source
from .warmstart import check_init, resolve_init


class ServerState(NamedTuple):
    s: jax.Array  # S_t, the normalised statistic (flat)
    v: jax.Array  # V = sum_i mu_i V_i
    theta: Params  # T(S_t), unconstrained
    s_sum: jax.Array  # running sum of S_t after ``average_from`` (Monte Carlo E-steps)
    count: jax.Array  # type: ignore[assignment]  # rounds summed into s_sum; the field shadows tuple.count


class ClientState(NamedTuple):
    v: jax.Array  # V_i
    z: Params  # Langevin chain of the local latents (Monte Carlo E-step only; empty otherwise)
    step: jax.Array


class Broadcast(NamedTuple):
    s: jax.Array
    theta: Params


@dataclass(frozen=True)
class FedMM:
    """FedMM (Algorithm 2) for exponential-family latent-variable models.

    Parameters
    ----------
    step_size:
        gamma_t in (0, 1]: a float or a schedule ``t -> gamma_t`` (1.0 with full participation and
        no compression is exact federated EM).
    participation:
        p, the probability that each client of the round's cohort takes part (Bernoulli, the
        paper's A5). With ``clients_per_round = m`` in ``fed_fit`` the inclusion probability is
        p m / n, which is what the 1/p weights use.
    compressor:
        Unbiased compressor of the uploads (e.g. ``fb.compress.qsgd(levels=7)`` ~ 4 bits/coordinate).
    alpha:
        Control-variate step; default 1 / (1 + omega_p) with omega_p = omega + (1 + omega)(1 - p)/p
        (Lemma 1), the largest value Theorem 1 allows; 0 disables the control variates.
    control_variates:
        "e_step" (V_i = h_i(S_0), one extra full pass at start) or "zero".
    projection:
        Project S onto its valid set each round (False: FedEM).
    init:
        Initial constrained values of global sites (others: ``param`` inits / prior medians, then the
        population start below): a dict, a previous fit ``Result`` (its ``params``), or ``"map"``: a
        TAMUNA fit of the model first (local latents at their population mean; 300 rounds), as for
        ``fb.FedSOUL``.
    population_start:
        None (default): True, except under ``privacy`` (its least-squares pass would be a release the
        accountant does not cover). For models with linear-Gaussian terms and per-client latents (mixed models): before
        the first
        E-step, one federated pass fits the coefficients of the linear terms that ``init`` does not set
        by least squares on the non-personalised model (latents at their population mean; each client
        sends ``G^T (y - o)`` and ``G^T G``, counted in ``res.init_bits``). EM started with the fixed
        effects far from the data lets the random effects absorb the misfit (their covariance starts
        huge) and then crawls along the ridge where fixed effects and random-effect means trade off;
        the population start removes that ridge from the path (see docs/guides/defaults-and-convergence.md).
        False: start at ``init`` / the model's own values.
    statistics:
        ``fb.CustomStatistics`` to supply S and T by hand; default: derived from the model.
    langevin_steps, burn_in, langevin_step:
        Monte Carlo E-step for non-Gaussian continuous local latents (stochastic EM): ULA steps per
        round, of which the first ``burn_in`` are not averaged; the step defaults to 0.1 / L_i with
        L_i the local posterior's curvature at the start.
    average_from:
        Fraction of rounds after which S_t is averaged into ``res.params`` (default: 0.5 with a
        Monte Carlo E-step, else None: the last iterate).
    louis_draws:
        Posterior draws for Louis' identity where it is not computed exactly.
    batch_size:
        B, the rows of a client's data each round's E-step sees (None, the default: all of them): the
        paper's minibatch oracle (its section 2, "large batch learning"), s_i = B^-1 sum_{j in batch}
        E[S(D_ij, h_j) | D_ij, theta_t], an unbiased estimate of the client's mean statistic over a batch
        of B distinct rows drawn each round from the client's round key (:mod:`fedbayes.minibatch`; the
        whole client when N_i <= B). It needs latents that belong to single rows (a mixture's labels, PPCA's
        factors) or none: the conditional law of a per-client latent (a random effect) depends on all the
        client's rows jointly, so its batch statistic is biased, and such models (and hand-written
        statistics, whose structure is not known) are refused, as is a model's own ``subsample_size`` (the
        statistics are derived by tracing whole plates: give B here). The oracle's noise (variance ~ 1/B) does
        not vanish at the fixed point: use a decreasing ``step_size`` or ``average_from``; the control
        variates do not remove it (they remove the clients' heterogeneity, not the oracle's noise). The
        set-up and the final exchange use all rows.
    uncertainty:
        After the fit, compute the local posteriors and Louis' standard errors: the final exchange,
        theta-hat (d floats) to every client and q + d(d+1)/2 floats back from each (``res.final_bits``);
        False skips it. None (default): True, except under ``privacy``.
    privacy:
        Client-level differential privacy, a ``fb.privacy.DP`` (None: none). Central mode: each round the server
        clips every upload, weighted by its client's share of the data, n mu_i Q_i (n clients, mu_i = N_i / N;
        1 for equal sizes), to L2 norm C, and adds N(0, (sigma C / (n p))^2) per coordinate to the estimate
        (1/p) sum mu_i Q_i, whose sensitivity to one client is then C / (n p): the Gaussian mechanism with noise
        multiplier sigma. The weights depend on the clients' sizes, which are public: the neighbouring data sets
        are those where one client's uploads are zeroed (``res.privacy["relation"]`` "zero-out"; with a
        cohort, replace-one), not those where it is removed, which would move every weight. The set-up's E-step at
        theta_0 is one more release of every client, by the same
        mechanism. What changes under privacy, and why:

        - no control variates (alpha = 0): the server's V is the sum of the clients' V_i only without noise;
          with noisy sums it would drift from it as a random walk. The uploads are then s_i - S_t, the
          clients' heterogeneity at the fixed point, so C should exceed most of |n mu_i (s_i - S_t)| there
          (a clip that binds moves the fixed point towards the clients it does not clip);
        - the identity compressor: the clip applies to the vector sent, and an unbiased compressor's output
          has no useful norm bound;
        - ``average_from`` defaults to 0.5: each iterate S_t carries the round's noise (variance
          (sigma C / (n p))^2 per coordinate at step 1), which the average over the last half of the rounds
          reduces;
        - no final exchange (``uncertainty`` None: False) and no population start: both are releases the
          accountant does not count; ``init="map"`` is refused.

        The noise falls on raw statistics (counts, sums, sums of squares), so the M-step's differences
        amplify it: a component (or random effect) whose mean is far from zero beside its spread gets its
        covariance as a small difference of large moments, with the noise multiplied by about
        |mean|^2 / variance. Centre and scale the data with public constants first; with few clients the
        noise can otherwise collapse a component (a DivergenceError in float32). The set-up's uploads are
        whole statistics s_i(theta_0), larger than the rounds' differences: a clip chosen for the rounds
        shrinks them, and the rounds then move S by at most about C / n towards the fixed point.

        A round releases S_{t+1} and theta_{t+1}, functions of the noisy estimate. The Bernoulli
        participation p within a cohort only adds amplification, which the accountant (fixed cohorts of m of
        n) leaves out. Faults do not weaken the guarantee: the noise is the server's, whoever answers.
        ``res.privacy`` reports epsilon at delta.

        ``DP(mode="distributed")``: each member clips its own weighted upload n mu_i Q_i (its size N_i and N
        are public) and adds N(0, sigma^2 C^2 / c), c the cohort size (in the set-up every client takes part:
        N(0, sigma^2 C^2 / n)), so that the sum the server forms carries the central mode's noise and the server
        needs nothing but that sum: on Flower it runs with secure aggregation (``fb.flower.SecAggPlus``), and
        without it the server sees each upload with 1/c of the noise (a warning says so). It needs
        ``participation=1.0`` (a share is sized by the number of members, which Bernoulli participation leaves
        to chance; draw cohorts with ``clients_per_round``). A member that does not answer takes its share with
        it: ``res.privacy["epsilon_realised"]`` accounts the rounds as they went (the set-up waits for every
        client).
    """

    step_size: float | Callable = 1.0
    participation: float = 1.0
    compressor: Compressor = identity()
    alpha: float | None = None
    control_variates: str = "e_step"
    projection: bool = True
    init: Any = None
    population_start: bool | None = None
    statistics: CustomStatistics | None = None
    langevin_steps: int = 20
    burn_in: int = 10
    langevin_step: float | None = None
    average_from: float | None = None
    m_step_iters: int = 200
    louis_draws: int = 500
    uncertainty: bool | None = None
    batch_size: int | None = None
    privacy: Any = None
    name = "FedMM"
    divergence_hint = (
        "lower step_size, use more quantisation levels, or start from other initial values "
        "(a mixture component may have collapsed)"
    )

    def __post_init__(self):
        as_schedule(self.step_size, f"{self.name} step_size")
        if not callable(self.step_size) and self.step_size > 1:
            raise ConfigError(f"{self.name} step_size must lie in (0, 1], got {self.step_size}")
        p = self.participation
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 < p <= 1:
            raise ConfigError(f"{self.name} participation must lie in (0, 1], got {p!r}")
        require_unbiased(self.compressor, self.name)
        if self.alpha is not None and (
            isinstance(self.alpha, bool) or not isinstance(self.alpha, numbers.Real) or not 0 <= self.alpha <= 1
        ):
            raise ConfigError(f"{self.name} alpha must lie in [0, 1], got {self.alpha!r}")
        require_choice(self.control_variates, f"{self.name} control_variates", ("e_step", "zero"))
        check_init(self.init, self.name)
        require_choice(self.projection, f"{self.name} projection", (True, False))
        require_choice(self.uncertainty, f"{self.name} uncertainty", (None, True, False))
        require_choice(self.population_start, f"{self.name} population_start", (None, True, False))
        require_int(self.langevin_steps, f"{self.name} langevin_steps", 1)
        require_real(
            self.langevin_step,
            f"{self.name} langevin_step",
            0.0,
            np.inf,
            open_low=True,
            open_high=True,
            allow_none=True,
        )
        require_int(self.burn_in, f"{self.name} burn_in", 0)
        if self.burn_in >= self.langevin_steps:
            raise ConfigError(f"{self.name} burn_in ({self.burn_in}) must be < langevin_steps ({self.langevin_steps})")
        require_fraction(self.average_from, f"{self.name} average_from", allow_none=True)
        require_int(self.m_step_iters, f"{self.name} m_step_iters", 1)
        require_int(self.louis_draws, f"{self.name} louis_draws", 2)
        check_batch_size(self.batch_size, self.name)
        self._check_privacy()

    def _check_privacy(self) -> None:
        """Central client-level DP covers the clipped, noised statistic sums (the set-up's and the rounds'):
        every other release of the clients' data is refused or switched off (see ``privacy``)."""
        if self.privacy is None:
            return
        check_dp(self.privacy, self.name)
        if type(self) not in (FedMM, FedEM):
            raise ConfigError(f"{self.name} has no privacy option (FedMM and FedEM have)")
        if self.privacy.mode == "distributed" and self.participation != 1.0:
            raise ConfigError(
                f"{self.name} with distributed DP needs participation=1.0: each member's share of the noise is "
                "sized by the number of members that take part, which Bernoulli participation leaves to chance; "
                "draw cohorts with clients_per_round instead (a fixed number each round)"
            )
        if not isinstance(self.compressor, type(identity())):
            raise ConfigError(
                f"{self.name} with privacy needs the identity compressor: the clip bounds the vector "
                "sent, and an unbiased compressor's output has no useful norm bound"
            )
        if self.alpha is not None and self.alpha != 0:
            raise ConfigError(
                f"{self.name} with privacy has no control variates (alpha=0): with noisy sums the "
                "server's V would drift from the clients' V_i as a random walk; leave alpha=None"
            )
        for name in ("uncertainty", "population_start"):
            if getattr(self, name):
                raise ConfigError(
                    f"{self.name} with privacy: {name}=True is an exchange of the clients' data the "
                    f"accountant does not cover; leave {name}=None"
                )
        if isinstance(self.init, str) and self.init == "map":
            raise ConfigError(
                f"{self.name} with privacy cannot start from init='map' (a fit of the clients' data the "
                "accountant does not cover); give values or leave init=None"
            )

    def build(self, problem: Problem) -> FedMMRun:
        fm: FedModel = problem.model
        # a model's own subsample_size is refused (the statistics are derived by tracing whole plates): batches
        # come from ``batch_size``
        fm.require(self.name, local_continuous=False, allow_obs_latent=True)
        stats = self.statistics if self.statistics is not None else derive(fm, m_step_iters=self.m_step_iters)
        try:
            init = resolve_init(self.init, problem)
        except ModelError as err:  # init="map": the TAMUNA warm start cannot fit this model
            raise ModelError(
                f"{self.name}(init='map') starts from a TAMUNA fit of the model, which fails: {err}. "
                "Pass init={site: value} (or a previous fit's Result) instead."
            ) from None
        fm.init_globals(None, init)  # eagerly: a start that makes the model invalid is a ModelError that says so
        run = FedMMRun(dataclasses.replace(self, init=init), fm, stats, problem)
        if run._batches.active and not getattr(stats, "rowwise", False):
            raise ConfigError(
                f"{self.name} batch_size: a minibatch E-step is unbiased only when every latent belongs "
                "to one row (a mixture's labels) or there is none; this model's latents are per client "
                "(their conditional law depends on all the client's rows) or its statistics are "
                "hand-written: leave batch_size=None"
            )
        return run


@dataclass(frozen=True)
class FedEM(FedMM):
    """FedEM (Dieuleveut, Fort, Moulines, Robin, 2021): FedMM without the projection step."""

    projection: bool = False
    name = "FedEM"


class FedMMRun(FederatedRun):
    """FedMM bound to a model and data: the engine's init / client_step / server_step / finalize."""

    def __init__(self, cfg: FedMM, fm: FedModel, stats: Derived | CustomStatistics, problem: Problem):
        self.cfg, self._fm, self.stats = cfg, fm, stats
        self.name = cfg.name
        self.divergence_hint = cfg.divergence_hint
        self.source = e_step_source(stats, fm, cfg)  # exact, Monte Carlo or the user's (fedbayes.algorithms.estep)
        sizes = np.asarray(problem.data.sizes, float)
        self._C = problem.data.num_clients
        self._N = float(sizes.sum())
        self._mu = jnp.asarray(sizes / sizes.sum())
        n, m = problem.data.num_clients, problem.cohort_size or problem.data.num_clients
        self.participation = float(cfg.participation)
        self._p = self.participation * m / n  # inclusion probability of a client in a round
        self._gamma = as_schedule(cfg.step_size, f"{cfg.name} step_size")
        self._num_rounds = problem.num_rounds
        self._dp = (
            None
            if cfg.privacy is None
            else SumPrivacy(
                cfg.privacy,
                problem.num_rounds,
                n,
                m,
                extra_rounds=1,
                mechanism=(
                    "distributed: each member clips its statistic upload, weighted by its share of the data, and "
                    "adds 1/c of the noise (the set-up: 1/n, every client taking part); the server sums the "
                    "shares and sees each one unless secure aggregation sums them; no control variates, no "
                    "population start, no final exchange (no standard errors)"
                    if cfg.privacy.mode == "distributed"
                    else "central: each client's statistic upload, weighted by its share of the data, clipped at "
                    "the server; Gaussian noise on the estimate of the mean statistic; no control variates, no "
                    "population start, no final exchange (no standard errors)"
                ),
                public="the clients' sizes N_i, their total N and their number n (the weights n N_i / N)",
            )
        )
        private = self._dp is not None
        self.uncertainty = not private if cfg.uncertainty is None else bool(cfg.uncertainty)
        # Louis' information needs every client's score covariance at the estimate (the final exchange)
        self.final_exchange = self.source.louis and self.uncertainty
        avg = cfg.average_from if cfg.average_from is not None else (0.5 if self.source.chain or private else None)
        self._average_from = avg
        self._avg_start = None if avg is None else int(avg * problem.num_rounds)
        self._structure(problem)
        self._m_step_jit = jax.jit(self.m_step)
        self._batches = minibatch.resolve(cfg.batch_size, fm, problem.data.mask.shape[1], cfg.name)
        # a derived exact E-step reads only the client's masked rows: its statistic and state are the same
        # whatever the padding (the engine then runs a round's clients in size buckets); a chain's state and a
        # minibatch draw span the padded rows, and a user's statistics are the user's own
        self.pads_freely = not self._batches.active and not self.source.chain and self.source.traceable

    def _structure(self, problem: Problem) -> None:
        """The statistic's layout (q numbers), theta's size and the resulting alpha, from shapes alone
        (client 0's data shapes; no data values are read except by custom statistics' template)."""
        fm, cfg = self._fm, self.cfg
        theta_shapes = jax.eval_shape(lambda k: fm.init_globals(k, cfg.init), jax.random.PRNGKey(0))
        theta = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), theta_shapes)
        example = jax.tree_util.tree_map(lambda a: a[0], stack_clients(problem.data))
        self._example_rows = (example.data, example.mask)
        if not self.source.traceable:  # a user's statistics may not be traceable: evaluate them
            template = self.source.template(theta, example)
        else:  # only the structure is needed: trace it (evaluating op by op compiles every operation)
            shapes = jax.eval_shape(self.source.template, theta, example)
            template = jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
        flat, self._unravel = ravel_pytree(template)
        self.q = int(flat.size)
        self.dim = int(ravel_pytree(theta)[0].size)
        if self.q == 0:
            raise ModelError(
                f"{cfg.name}: the model's likelihood has no sufficient statistic of its global sites "
                f"{list(fm.global_names)} (no observed site depends on them), so EM has nothing to estimate; "
                "check that the observed sites use the globals (and are not masked out)"
            )
        omega = cfg.compressor.omega(self.q)
        if omega is None:  # FedMM.__post_init__ requires an unbiased compressor
            raise AssertionError(f"{cfg.name}: the compressor {cfg.compressor.name} has no variance constant")
        self._omega = float(omega)
        omega_p = self._omega + (1 + self._omega) * (1 - self._p) / self._p
        self.alpha = (
            float(cfg.alpha) if cfg.alpha is not None else 0.0 if self._dp is not None else 1.0 / (1.0 + omega_p)
        )
        population = self._dp is None if cfg.population_start is None else cfg.population_start
        self._pop_sites = self.source.population_sites(set(cfg.init or ())) if population else ()
        self._stage0 = 1 if self._pop_sites else 0  # the population pass comes first
        self.setup_stages = self._stage0 + (2 if cfg.control_variates == "e_step" and self.alpha > 0 else 1)

    def _mean(self, key: jax.Array, rows: jax.Array, mu: jax.Array, inclusion: float) -> jax.Array:
        """sum_i mu_i rows_i / inclusion, the estimate of a mean statistic from the clients' uploads (mu_i = 0
        for a client that did not answer). Under privacy each weighted upload n mu_i rows_i is clipped to C
        and N(0, (sigma C / (n inclusion))^2) is added per coordinate: the sensitivity to one client is
        C / (n inclusion) (:class:`fedbayes.privacy.SumPrivacy`). Distributed DP: each row is already a
        member's clipped, weighted upload with its share of the noise (:meth:`_share`), and the server only
        sums them (secure aggregation can do it for the server)."""
        n = self._C
        if self._dp is not None and self._dp.distributed:
            return jnp.tensordot((mu > 0).astype(rows.dtype), rows, 1) / (n * inclusion)
        if self._dp is None:
            return jnp.tensordot(mu, rows, 1) / inclusion
        shares = self._dp.clipped(n * mu.astype(rows.dtype)[:, None] * rows)
        return self._dp.noisy(key, jnp.sum(shares, 0) / (n * inclusion), 1.0 / (n * inclusion))

    def _share(self, key: jax.Array, row: jax.Array, client: ClientData, members: int | None = None) -> jax.Array:
        """Distributed DP, at the client: its upload weighted by its share of the data, n mu_i row (mu_i =
        N_i / N, public), clipped to C, plus its share N(0, sigma^2 C^2 / members) of the noise (members: the
        cohort size c; in the set-up every client, n). Without distributed DP the row as it is."""
        if self._dp is None or not self._dp.distributed:
            return row
        weight = self._C * client.size.astype(row.dtype) / self._N
        return self._dp.share(key, weight * row, members)

    # ------------------------------------------------------------------ S and T
    def _e_step(self, theta_u: Params, client: ClientData, z=None, step=None, key=None):
        """(s_i flat = E[S(D_i, h)] / N_i, new chain state) at theta for one client."""
        total, z = self.source.e_step(theta_u, client, z, step, key)
        return total / client.size, z

    def m_step(self, s_flat: jax.Array, theta_u: Params) -> Params:
        """theta = T(s): the M-step on the summed statistic N s (prior counted once)."""
        return self.source.m_step(self._unravel(s_flat * self._N), theta_u)

    def project(self, s_flat: jax.Array) -> jax.Array:
        return ravel_pytree(self.source.project(self._unravel(s_flat)))[0]

    # ------------------------------------------------------------------ engine protocol
    # set-up (fedbayes.protocol): a federated E-step at theta_0 for S_0, and (control variates "e_step") a
    # second at theta_1 = T(S_0) for V_i = s_i(theta_1) - S_0
    def setup_server(self, key: jax.Array) -> tuple[Params, Params]:
        """theta_0: user values where given, else the model's deterministic start; sent to every client."""
        theta0 = self._fm.init_globals(key, self.cfg.init)
        return theta0, theta0

    def setup_client(self, stage: int, key: jax.Array, payload: Any, state: Any, client: ClientData):
        """With the population start, stage 0 first: the client's least-squares statistics of the
        non-personalised model at theta_0. Then: the client's chain and step (Monte Carlo E-steps) and
        s_i(theta_0) back; next V_i = s_i(theta_1) - S_0, kept and sent back."""
        if self._stage0 and stage == 0:
            stats = self._derived.population_statistics(self._fm.constrain(payload), client.data, client.mask)
            return state, ravel_pytree(stats)[0]
        stage -= self._stage0
        k_z, k_e = jax.random.split(key)
        if stage == 0:
            theta0 = payload
            z0, step = self.source.start(k_z, theta0, client)
            s_i, z = self._e_step(theta0, client, z0, step, k_e)
            return ClientState(jnp.zeros_like(s_i), z, step), self._share(k_z, s_i, client, self._C)
        s0, theta1 = payload
        s_i, z = self._e_step(theta1, client, state.z, state.step, k_e)
        v_i = s_i - s0
        return ClientState(v_i, z, state.step), v_i

    def setup_server_step(self, stage: int, key: jax.Array, state: Any, uploads: jax.Array):
        """Population stage: theta_0's coefficients from the summed least-squares statistics; then
        S_0 = Proj(sum_i mu_i s_i), theta_1 = T(S_0); then V = sum_i mu_i V_i."""
        if self._stage0 and stage == 0:
            return self._population_start(state, uploads)
        stage -= self._stage0
        if stage == 0:
            s0 = self._mean(key, uploads, self._mu, 1.0)
            if self.cfg.projection:
                s0 = self.project(s0)
            theta1 = self.m_step(s0, state)
            if self.setup_stages - self._stage0 == 2:
                return (s0, theta1), (s0, theta1)
            v = jnp.zeros_like(s0)
        else:
            s0, theta1 = state
            v = jnp.tensordot(self._mu, uploads, 1)
        server = ServerState(s0, v, theta1, jnp.zeros_like(s0), jnp.zeros((), jnp.int32))
        return server, self._broadcast(s0, theta1)

    def _population_start(self, theta0: Params, uploads: jax.Array) -> tuple[Params, Params]:
        """theta_0 with the coefficients of ``self._pop_sites`` replaced by the non-personalised model's
        least-squares fit (the statistics are sums over rows, so the clients' uploads simply add)."""
        theta_c = self._fm.constrain(theta0)
        shapes = jax.eval_shape(lambda: self._derived.population_statistics(theta_c, *self._example_rows))
        _, unravel = ravel_pytree(jax.tree_util.tree_map(lambda a: jnp.zeros(a.shape, a.dtype), shapes))
        coef = self._derived.population_coefficients(unravel(jnp.sum(uploads, 0)), theta_c)
        theta = dict(theta0)
        for n in self._pop_sites:
            theta[n] = self._fm.sites[n].transform.inv(coef[n])
        return theta, theta

    def _broadcast(self, s: jax.Array, theta: Params) -> Message:
        return dense_message(Broadcast(s, theta))

    def client_step(self, key: jax.Array, payload: Broadcast, state: ClientState, client: ClientData):
        """E-step at theta_t; upload Quant(s_i - S_t - V_i); V_i += (alpha/p) Q_i."""
        k_e, k_q = jax.random.split(key)
        batch = self._batches.draw(key, client, weighted=False)  # B rows, weight 1: the E-step's mean is the batch's
        s_i, z = self._e_step(payload.theta, batch, state.z, state.step, k_e)
        delta = self._share(k_q, s_i - payload.s - state.v, client)  # (distributed DP: clipped, noised, weighted)
        sent, q, bits = self.cfg.compressor.coded(k_q, delta)
        return ClientState(state.v + (self.alpha / self._p) * q, z, state.step), Message(sent, bits)

    def server_step(self, key: jax.Array, state: ServerState, uploads: Message, info: RoundInfo):
        """H = V + (1/p) sum mu_i Q_i;  S <- Proj(S + gamma H);  V += (alpha/p) sum mu_i Q_i;  theta = T(S).

        Under faults the sums run over the clients that answered; H's is scaled by expected / answered
        (unbiased under random faults) while V's is not, so V = sum_i mu_i V_i stays exact (a faulty
        client's V_i is rolled back)."""
        mu = self._mu[info.cohort] * info.active
        total = self._mean(key, uploads.payload, mu, self._p)
        h = state.v + total * fault_weight(info, total.dtype)
        gamma = self._gamma(info.round)
        s_new = state.s + gamma * h
        if self.cfg.projection:
            s_new = self.project(s_new)
        v_new = state.v + self.alpha * total
        theta = self.m_step(s_new, state.theta)
        take = jnp.asarray(False) if self._avg_start is None else info.round >= self._avg_start
        new = ServerState(s_new, v_new, theta, state.s_sum + jnp.where(take, s_new, 0.0), state.count + take)
        diag = {f"theta/{k}": v for k, v in self._fm.constrain(theta).items()}
        diag["field_norm"] = jnp.linalg.norm(h)
        diag["stat_change"] = jnp.sum((s_new - state.s) ** 2) / gamma**2
        diag["participants"] = jnp.sum(info.active)
        return new, self._broadcast(s_new, theta), diag

    @property
    def sums_uploads(self) -> bool | str:  # type: ignore[override]  # FederatedRun's plain attribute, computed here
        """True for FedMM / FedEM with distributed DP, whose server needs the set-up's and each round's uploads
        (the members' clipped, weighted, noised statistics) only summed, so that secure aggregation can hide
        them (:class:`fedbayes.protocol.FederatedRun`); otherwise why not."""
        return sums_only(
            self._dp,
            type(self) is FedMMRun,
            f"{self.name}'s server weighs each client's statistic by its share of the data (central DP clips each "
            "one) and keeps the control variates' sum; secure aggregation runs FedMM with distributed DP "
            "(privacy=fb.privacy.DP(..., mode='distributed')), whose server needs the sums alone",
        )

    # ------------------------------------------------------------------ results
    def final_statistic(self, state: ServerState) -> jax.Array:
        if self._avg_start is None:
            return state.s
        return jnp.where(state.count > 0, state.s_sum / jnp.maximum(state.count, 1), state.s)

    @property
    def _derived(self) -> Derived:
        """The derivation behind the statistics: the population start and Louis' final exchange need it, and
        neither runs on a user's :class:`CustomStatistics` (no population sites, no Louis' information)."""
        if not isinstance(self.stats, Derived):
            raise AssertionError(f"{self.name}: custom statistics have no population start or surrogate")
        return self.stats

    def _server_parts(self, server: ServerState, theta: Params) -> FitParts:
        return FitParts(
            theta=theta,
            params=self._fm.constrain(theta),
            params_last=self._fm.constrain(server.theta),
            statistic=self._unravel(self.final_statistic(server)),
        )

    def final_message(self, key, server: ServerState) -> Params:
        """theta-hat = T(final statistic), sent to every client."""
        return self.m_step(self.final_statistic(server), server.theta)

    def final_client(self, key, theta: Params, state: ClientState, client: ClientData):
        """The client's E-step statistic s_i(theta-hat) and the upper triangle of its score covariance go
        back; its local posterior (draws, responsibilities) stays."""
        k_e, k_louis = jax.random.split(key)
        k_clients, _ = jax.random.split(k_louis)
        s_i, _ = self._e_step(theta, client, state.z, state.step, client_key(k_e, client.index, self._C))
        tri, extra = louis.client_information(self, client_key(k_clients, client.index, self._C), theta, state, client)
        return extra, (s_i, tri)

    def final_server(self, key, server: ServerState, theta: Params, uploads, locals_) -> FitParts:
        """Louis' observed information from sum_i mu_i s_i(theta-hat) N and the clients' covariances:
        standard errors and the normal approximation of the globals (plus the collected local posteriors).
        ``uploads=None`` (a client missed the exchange on a network): the estimate and whatever local
        posteriors were collected."""
        parts = self._server_parts(server, theta)
        if uploads is not None:
            s_i, tris = uploads
            statistic = self._unravel(jnp.tensordot(self._mu, s_i, 1) * self._N)  # E-step at theta-hat
            k_global = jax.random.split(jax.random.split(key)[1])[1]
            parts.update(louis.posterior_summary(self, k_global, theta, statistic, tris))
            parts.update(run_jit(self, "gradient_parts", lambda: self._gradient_parts, once=0)(theta, statistic, tris))
        if locals_ is not None:
            parts.update(louis.local_parts(locals_))
        return parts

    def _gradient_parts(self, theta: Params, statistic, covariance_tris: jax.Array) -> dict[str, jax.Array]:
        """The gradient of the marginal log posterior at theta-hat by Fisher's identity,

            grad l(theta) = sum_i E[grad log p(D_i, h | theta) | D_i, theta]
                          = grad_theta' Q(theta'; s(theta)) at theta' = theta,

        plus grad log p(theta): Q is linear in the statistic, so the clients' expected complete-data scores
        sum to the surrogate's gradient at the summed E-step statistic s(theta-hat), which the final
        exchange already brings (no extra upload). Flat, unconstrained (``ravel_pytree`` order of theta),
        the ascent direction. On EM's slow ridge the statistic barely changes between rounds while this
        gradient, measured in the information's metric (Newton decrement g^T I^{-1} g), stays large.
        With a Monte Carlo E-step the gradient is an average over the client chains' kept draws;
        ``gradient_cov`` = sum_i Cov_i / (kept draws) is its noise covariance as if the draws were
        independent (a chain's autocorrelation makes the true noise larger)."""
        flat, unravel = ravel_pytree(theta)
        objective = lambda x: self._derived.surrogate(unravel(x), statistic) + self._fm.log_prior(unravel(x))  # noqa: E731
        out = {"gradient": jax.grad(objective)(flat)}
        if self.source.chain:
            keep = self.cfg.langevin_steps - self.cfg.burn_in
            out["gradient_cov"] = louis._symmetric(jnp.sum(covariance_tris, 0), flat.size) / keep
        return out

    def finalize(self, key, carry, problem: Problem, history: Mapping[str, np.ndarray] | None = None) -> FitParts:
        """T of the final (or averaged) statistic; with ``uncertainty``, the final exchange
        (:func:`fedbayes.engine.final_exchange`): local posteriors and Louis' asymptotic covariance."""
        server, states, _ = carry
        if self.final_exchange:
            parts = final_exchange(self, key, server, states, stack_clients(problem.data))
        else:
            parts = self._server_parts(server, self._m_step_jit(self.final_statistic(server), server.theta))
        if self._dp is not None:
            parts.privacy = self._dp.report(None if history is None else history.get("active"))
            parts["settings"] = {
                "uncertainty": self.uncertainty,
                "population_start": bool(self._pop_sites),
                "alpha": self.alpha,
                "control_variates": "zero",
                "average_from": self._average_from,
            }
        return parts


@dataclass(frozen=True)
class ParamAveragingEM(FedMM):
    """The parameter-averaging baseline (NOT FedMM): clients run a full local EM step and send T(s_i);
    the server averages the constrained parameters with weights mu_i.

    theta_{t+1} = sum_i mu_i T_i(s_i(theta_t)), T_i with the prior weighted by N_i / N. This is what
    FedAvg-style federated EM does; on heterogeneous clients its fixed point is not the centralised
    EM / MAP fixed point (FedMM Remark 1), which is why it is here: as a baseline to compare with.
    """

    name = "ParamAveragingEM"

    def __post_init__(self):
        super().__post_init__()
        if self.participation != 1.0 or not isinstance(self.compressor, type(identity())):
            raise ConfigError("ParamAveragingEM is the plain baseline: full participation, no compression")
        if self.batch_size is not None:
            raise ConfigError("ParamAveragingEM takes a full local EM step on all rows: batch_size does not apply")

    def build(self, problem: Problem) -> ParamAveragingRun:
        run = FedMM.build(dataclasses.replace(self, control_variates="zero"), problem)
        return ParamAveragingRun(run.cfg, run._fm, run.stats, problem)


class ParamAveragingRun(FedMMRun):
    """Starts, like FedMM, from T of a federated E-step at theta_0 (its pass is in the ledger)."""

    def __init__(self, cfg: FedMM, fm: FedModel, stats: Derived | CustomStatistics, problem: Problem):
        super().__init__(cfg, fm, stats, problem)
        self.final_exchange = False  # no information pass

    def _broadcast(self, s, theta):
        """theta alone: the clients run a full local EM step and need no statistic (an empty ``s`` keeps
        the message's structure, so the wire carries exactly the ledger's bits)."""
        return dense_message(Broadcast(jnp.zeros((0,), s.dtype), theta))

    def client_step(self, key, payload: Broadcast, state: ClientState, client: ClientData):
        s_i, z = self._e_step(payload.theta, client, state.z, state.step, key)
        weight = client.size / self._N
        s = self.source.project(self._unravel(s_i * client.size))  # a client's own statistic can be degenerate
        theta_i = self.source.m_step(s, payload.theta, prior_weight=weight)
        flat = ravel_pytree(self._fm.constrain(theta_i))[0]
        return ClientState(state.v, z, state.step), dense_message(flat)

    def server_step(self, key, state: ServerState, uploads: Message, info: RoundInfo):
        mu = self._mu[info.cohort] * info.active
        avg = jnp.tensordot(mu / jnp.maximum(jnp.sum(mu), jnp.finfo(mu.dtype).tiny), uploads.payload, 1)
        _, unravel = ravel_pytree(self._fm.constrain(state.theta))
        theta = self._fm.unconstrain(unravel(avg))
        theta = jax.tree_util.tree_map(lambda new, old: jnp.where(jnp.sum(mu) > 0, new, old), theta, state.theta)
        new = state._replace(theta=theta)
        diag = {f"theta/{k}": v for k, v in self._fm.constrain(theta).items()}
        diag["participants"] = jnp.sum(info.active)
        return new, self._broadcast(state.s, theta), diag

    def finalize(self, key, carry, problem, history=None):
        server, states, _ = carry
        return FitParts(
            theta=server.theta, params=self._fm.constrain(server.theta), params_last=self._fm.constrain(server.theta)
        )
