"""FedSOUL: FedPop's Algorithm 1 (FedSOUK) with unadjusted Langevin local kernels.

Personalised federated learning as empirical Bayes (Kotelevskii, Vono, Durmus, Moulines, 2022).
Clients hold local latents z_i with population prior p(z_i | theta); the server estimates the global
parameters theta by maximising the marginal posterior

    log p(theta) + sum_i log p(D_i | theta),   p(D_i | theta) = int p(D_i | theta, z) p(z | theta) dz

with a stochastic-approximation scheme whose gradient comes from the Fisher identity (eqs. 8-11).
Round k, for each client i of the cohort A_{k+1} (in parallel, on the device):

    Z^{(i,0)} = last state of the client's chain (stateful) or a draw from p(z | theta_k) (stateless)
    Z^{(i,m+1)} = Z^{(i,m)} + gamma_i grad_z log p(Z^{(i,m)} | D_i, theta_k) + sqrt(2 gamma_i) xi   (ULA)
    G_i = mean_{m = B+1..M} grad_theta log p(D_i, Z^{(i,m)} | theta_k)          (I_k and J_k together)
    upload C(G_i) (unbiased compression; sites in ``exact_sites`` go uncompressed)

and the server (eqs. 6-7, one projected step on all global sites)

    theta_{k+1} = Pi( theta_k + eta_{k+1} [ grad log p(theta_k) + (b / |A|) sum_{i in A} C(G_i) ] ).

The global prior's gradient is added once, at the server. The algorithm's estimate is the weighted
average theta_bar = sum eta_k theta_k / sum eta_k over the last rounds (Theorem 1's iterate);
``res.params`` reports it, or with ``uncertainty`` its one Newton step from the final exchange
(``one_step``, below).

Default server step (``server_optimizer="auto"``, at most ``information_max_dim`` global coordinates):
Fisher scoring, the same step preconditioned by a running average H_k of the clients' complete-data
information, theta_{k+1} = theta_k + eta_k H_k^-1 g_k (affine-invariant: no learning rate caps how far a
global moves, and raw and standardised units give the same fit); ``"sgd"`` is eqs. 6-7 as written. The
final exchange also returns Louis' observed information I at theta_bar (standard errors, the globals'
normal approximation) and the gradient g there, from every client's long final chain with a Stein
control variate (:func:`louis.draws_information`); the reported estimate is Le Cam's one-step estimator
theta_bar + I^-1 g when theta_bar is within half a standard error of the optimum. This removes the
averaged iterate's Monte Carlo error, which the rounds' short chains make large where the fraction of
missing information is large (random intercepts of well-measured clients: 0.1 standard error after
2000 rounds on MASS epil, 0.007 after the step).

Corrections to the paper and its public code: the Langevin drift is +gamma grad log p (the text's
sign is wrong), the server broadcasts theta_k (not theta_{k+1}), the Monte Carlo average excludes
Z^{(i,0)}, the cohort is aggregated before one server step (not stepped client by client), and
log p(D_i | theta, z) is a sum over the client's points.
"""

from __future__ import annotations

import numbers
import warnings
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .. import minibatch, optim
from ..compress import Compressor, identity, require_unbiased
from ..engine import FitJitted, client_key, final_exchange, final_exchange_ahead, fit_jit, run_jit, stack_clients
from ..privacy import SumPrivacy, check_dp, sums_only
from ..convergence import ONE_STEP_MAX
from ..errors import ConfigError, ConvergenceWarning, is_real, require_choice, require_fraction, require_int
from ..faults import as_aggregation
from ..wire import decode_tree
from ..minibatch import check_batch_size
from ..kernels import (
    LangevinPoint,
    apply_root,
    backtrack,
    curvature,
    hvp,
    langevin_move,
    move_keys,
    newton_mode,
    newton_root,
)
from ..introspect import FedModel, Params
from ..protocol import FLOAT_BITS, ClientData, FederatedRun, FitParts, Message, Problem, RoundInfo, dense_message
from . import louis
from .. import symmetry
from .louis import _symmetric
from .warmstart import check_init, resolve_init


def start_spread(q: int) -> float:
    """How far the final draws' fresh chains start from the anchor, in the metric's units: s = min(2, sqrt(1 +
    4 / sqrt(q))) for q local coordinates. An overdispersed start lets R-hat compare chains that began apart,
    but at s its log-density lies about (s^2 - 1) q / 2 below the bulk's: at s = 2 that is 1.5 q, over 200 nats
    for a 136-coordinate head, far out in the tails. On scikit-learn's digits over 20 clients (the personal
    softmax heads of ``examples/calibration_ood.py``, the dense metric, float32) two clients' fresh chains then
    accepted 26-27% of their moves, against 50-58% for the rest, and the local R-hat was 2.4; with this rule
    they accepted 52-54% and the check passed (1.10 against 1.14). The rule keeps s = 2 for one coordinate and
    a deficit of 2 sqrt(q) (about three sds of the bulk's own log-density, sqrt(q / 2)) beyond."""
    return float(min(2.0, np.sqrt(1.0 + 4.0 / np.sqrt(max(q, 1)))))


class ServerState(NamedTuple):
    theta: Params
    opt_state: Any
    avg_sum: Params
    avg_weight: jax.Array
    information: jax.Array  # Fisher scoring: the running average H_k (d, d); (0, 0) otherwise


class ClientState(NamedTuple):
    z: Params  # the chain's state
    v: jax.Array  # the power iteration's vector (automatic step)
    step: jax.Array  # the round's Langevin step
    anchor: Params  # where the kernel's metric and step are taken (FedSOULRun._adapt)
    metric: Any = ()  # the diagonal metric's running mean V of the curvature's diagonal (q,); () otherwise
    visits: Any = ()  # the rounds the client took part in (the diagonal metric's and the step's average weights)
    log_scale: Any = ()  # MALA with the automatic step: log of the step's factor from the acceptance (<= 0); ()
    noise: Any = ()  # noise-corrected SGLD: (running mean of the minibatch gradient error's variance (q,), moves)


class Upload(NamedTuple):
    grad: Params
    objective: jax.Array
    information: Any = ()  # Fisher scoring: the upper triangle of the client's complete-data information


LOCAL_DENSE_MAX = 10
"""``local_metric="auto"`` preconditions a client's Langevin moves by its local Hessian (dense) when it
has at most this many local coordinates."""

METRIC_WINDOW = 20
"""The diagonal metric's running mean V of curvature estimates forgets at rate 1 / METRIC_WINDOW once the
client has taken part in that many rounds (before, every estimate weighs the same: rho_k = 1 / (k + 2))."""

METRIC_FLOOR = 1e-3
"""The diagonal metric uses max(V, METRIC_FLOOR * mean|V|): no coordinate's step exceeds that of a curvature
a thousandth of the average one (a coordinate whose running estimate happens to be near zero or negative)."""

ACCEPTANCE_TARGET = 0.574
"""The mean acceptance probability that MALA's automatic local step aims at when it falls short of it: the
optimal rate of MALA in high dimension (Roberts and Rosenthal 1998). Each round the step's factor
a_i <= 1 on ``step_scale / L_i`` moves as log a_i <- min(0, log a_i + (k + 1)^-0.6 (acc_k - target)), acc_k the
mean acceptance probability of the client's k-th round (a diminishing adaptation: every round's kernel is still
MALA with a fixed step, which leaves the local posterior invariant at any step). The final draws' chains adapt
their own factor the same way during their warm-up, per move, and keep it fixed for the draws."""

NOISE_WINDOW = 100
"""Noise-corrected SGLD (minibatch rounds): the running mean of the minibatch gradient error's variance forgets at
rate 1 / NOISE_WINDOW once the client has made that many moves (before, every estimate weighs the same)."""

METRIC_BATCH = 64
"""The set-up's exact Hessian diagonal (one Hessian-vector product per local coordinate) is taken this many
coordinates at a time (``jax.lax.map``'s batch): its memory stays that of 64 products whatever q is."""


@dataclass(frozen=True)
class FedSOUL:
    """FedSOUL (FedPop Algorithm 1; MALA or ULA local moves): personalised empirical-Bayes federated learning.

    Parameters
    ----------
    local_steps:
        M, ULA steps per client and round.
    burn_in:
        B, first steps of each round's chain left out of the gradient average (0 <= B < M).
    stateful:
        Warm-start each client's chain from its last state (True) or restart it from
        p(z | theta_k) every round (False; use more ``local_steps``, e.g. 50).
    step_size:
        Langevin step gamma_i: a float for every client, a sequence with one per client, or None
        for the automatic default gamma_i = step_scale / L_i, where L_i is the largest eigenvalue of
        -grad_z^2 log p(z | D_i, theta) tracked by a warm-started power iteration (clients with more
        data have larger L_i and get smaller steps; ULA needs gamma_i < 2 / L_i).
    step_scale:
        gamma_i * L_i for the automatic step. None (default): 1.0 for "mala", 0.1 for "ula". ULA's
        covariance bias is about step_scale / 2, so its steps must be small; MALA has no such bias and a
        longer step mixes faster: on a Gaussian local posterior with the dense metric each move is an
        AR(1) step with coefficient 1 - step_scale, accepted 65-80% of the time at 1.0 on the real-data
        tests (one or two random effects per client; 92% at 0.5), and the Fisher gradient's Monte Carlo
        error is about half of that at 0.1 (MASS epil's final exchange) (sleepstudy's Days slope: 10.19 at
        0.1, 10.41-10.58 over four seeds at 1.0, against statsmodels' 10.47). With "mala" and the automatic
        step the client's step is ``a_i step_scale / L_i``, its factor a_i <= 1 lowered where the moves'
        mean acceptance falls short of :data:`ACCEPTANCE_TARGET` (0.574) and raised back towards 1 where it
        exceeds it, round by round with a diminishing gain, and kept for the final draws: on a network's head
        (hundreds of local coordinates, the identity metric) step_scale / L_i accepted 1e-4 of the moves
        and the chains did not move; the adapted factor is about 1.6 q^(-1/3) there, MALA's optimal scaling.
        A chain of one or two random effects with the dense metric accepts 65-80% at 1.0 and keeps a_i near 1.
    local_kernel:
        The clients' Markov kernel. None (default): "mala" with the full batch, "ula" with minibatches
        (``batch_size``). "mala": each Langevin proposal is accepted or rejected by
        Metropolis-Hastings (:func:`fedbayes.kernels.langevin_move`; the log-density and gradient at the
        proposal are the ones the next move and the Fisher gradient need anyway, so the test costs no
        extra evaluation), and each chain's stationary law is the local posterior p(z | D_i, theta)
        exactly (FedPop's FedSOUK covers adjusted kernels). "ula": FedPop's FedSOUL, whose local
        stationary law is off by O(gamma); that bias reaches the estimate through the Fisher gradient
        (on MASS epil at step_scale 0.1 it is within the gradient's Monte Carlo error). With the dense or
        diagonal metric the rounds' ULA injects noise of variance 2 gamma (1 - gamma / 2) per whitened
        coordinate, which makes its law exact on a Gaussian local posterior whose whitened curvature is
        diagonal (``FedSOULRun._noise_factor``): a learned population scale reads the draws' spread, and
        ULA's 1 / (1 - gamma / 2) widening made it grow by that factor round after round. Both are tamed
        (:data:`fedbayes.kernels.TAME`): far from the local posterior's bulk no
        move overshoots, and a move to a point where the log-density or a gradient is not finite is
        rejected. The mean acceptance probability of the final draws is in
        ``res.client_info["acceptance"]``.
    batch_size:
        B, the rows of a client's data each local move sees (None, the default: all of them). Each move
        then evaluates the client's log-likelihood on a fresh minibatch of B rows scaled by N_i / B
        (:meth:`fedbayes.minibatch.Minibatch.sample`: B rows drawn independently for each move from the
        client's round key), so its drift and its Fisher-gradient term are unbiased estimates: the local
        chain is stochastic-gradient Langevin dynamics (SGLD, Welling and Teh 2011; FedPop's own setting).
        Plain SGLD's stationary law is the local posterior only as gamma -> 0: the gradient's error adds a
        variance gamma^2 s per move (s its variance in the metric's coordinates, about N_i / B times the
        curvature) on top of ULA's O(gamma) bias. FedSOUL's rounds remove it: each move also evaluates the
        batch's two halves, whose difference estimates the error (a running mean of s per client), injects
        only 2 gamma - gamma^2 (c + s) of noise (noise-corrected SGLD, as Ahn et al. 2012 and Chen et al.
        2014 correct for B), and caps the step at 1 / (1 + max s) so that there is always noise left to
        remove. On a Gaussian posterior the law's variances are then within about 10-20% of the
        posterior's where plain SGLD's were 1.2 to 8 times wider (``tests/test_fedsoul_metric.py``). A
        Metropolis test cannot fix it (a minibatch log-density is not the log-density), so minibatches take
        the "ula" kernel and ``local_kernel="mala"`` with batches is refused. The kernel's step and metric
        are adapted on the round's first batch (an unbiased estimate of the client's curvature); the set-up (starts)
        and the final exchange (personal posteriors, Louis' standard errors, by MALA) use all rows. A
        model's ``numpyro.plate(..., subsample_size=B)`` sets B the same way. B at least every client's
        row count is the full batch, and the fit the full-batch fit bit for bit.
    local_metric:
        The clients' Langevin preconditioner. "diagonal": M_i = diag(1 / V_i), V_i = P_i + max(L_i, 0):
        P_i the exact diagonal of the population prior's curvature -grad^2_z log p(z | theta) at the
        client's anchor (below; q Hessian-vector products of the prior alone, which costs no likelihood
        evaluation), and L_i a running mean over the client's rounds of unbiased estimates of the
        diagonal of the likelihood's curvature -grad^2_z log p(D_i | theta, z) at the anchor: Hutchinson's
        u * (H R u) / r with a Rademacher u and R = diag(r) the current metric's root (probed in the
        whitened coordinates, the estimate's relative noise is that of the correlations, not of the
        scales: a plain u * (H u) is swamped where a coordinate of curvature 1 is correlated with one of
        curvature 1e4), one Hessian-vector product (about two gradients) a round, started at the set-up
        from the exact diagonal (q products, once). The clip at 0 is where the estimate's noise is: a
        log-concave likelihood's diagonal is never negative, and without it a 500-image client's softmax
        head had a running estimate near 0 in a coordinate correlated with stiffer ones, its V floored
        there, and the step of every coordinate fell to 2e-4 (the 500-image clients' median on FedPop's
        digits model; 0.028 with the clip). Each coordinate moves on the scale of its own spread, as
        preconditioned SGLD (Li et al. 2016) and a diagonal Laplace metric do, at the cost of a gradient
        where "dense" costs q of them
        and a q x q factorisation. Only V's relative sizes matter: the step is gamma_i =
        step_scale / the largest curvature of the whitened target at the anchor. V is updated at the
        start of a round (rho_k = max(1 / (k + 2), 1 / ``METRIC_WINDOW``) on the k-th visit) from the
        anchor, never from the chain's state, and is constant during the round's moves: each round's
        kernel is MALA (or ULA) with a fixed preconditioner, so the drift correction sum_j d_j M_ij(z) of
        a position-dependent metric is zero, and a round's moves leave the local posterior invariant
        (MALA) or have ULA's law for that metric (``tests/test_fedsoul_metric.py`` checks both against
        the closed forms on a Gaussian target). (A running mean of the chain's squared scores, RMSprop's
        statistic, is cheaper still and equals E[diag H] at stationarity, but from a chain started far
        out its transient inflates the stiff coordinates' V by orders of magnitude for many rounds.)
        "dense": each round (and for the final draws) the client
        computes the Hessian H_i of -log p(D_i, z | theta) in z at its anchor (:meth:`FedSOULRun._adapt`,
        a point that follows the local mode, not the chain's state) and moves with
        M_i = H_i^{-1} (gamma_i = step_scale / the largest curvature of the whitened target, about
        step_scale for a Gaussian local posterior), falling back to the identity where H_i is not
        positive definite: the chain mixes in about 1 / step_scale moves whatever the scales of the
        local coordinates. "identity": the scalar step gamma_i = step_scale / L_i; a local posterior
        whose directions have very different spreads (random effects on different scales, e.g. an
        intercept in ms and a slope in ms/day) then mixes at the pace of its narrowest direction, and
        FedSOUL's estimate of the random effects' spread is biased by the chains' transient; a network's
        personal head (FedPop's image model: 160 coordinates) does not mix on it at all in a fit's few
        hundred moves per client (Fashion-MNIST, S = 5: accuracy 0.68 against 0.87 with "dense";
        benchmarks/README.md), and the fit's local R-hat check says so. "auto"
        (default): "dense" when a client has at most ``LOCAL_DENSE_MAX`` (10) local coordinates (a
        q x q Hessian per round, at most as many gradients as the round's 10 moves) and the step is
        automatic, else "diagonal" for FedSOUL's Langevin chains and "identity" for FedRep's and
        LocalOnly's gradient steps (a given ``step_size`` is the identity metric's; with "dense" or
        "diagonal" it is the step in the whitened coordinates).
    server_lr:
        eta_k: a float or a schedule ``k -> eta_k``; None (default): 1.0 for Fisher scoring, 0.05 for
        "adam" / "sgd" / an optax optimiser.
    server_optimizer:
        "auto" (default): "fisher" when the globals have at most ``information_max_dim`` unconstrained
        coordinates, else "adam". "fisher": the stochastic-approximation step preconditioned by a
        federated estimate of the information (below; scale-free: raw and standardised units give the
        same iterates). "adam" (FedPop's experiments; its step moves each coordinate by about
        ``server_lr`` per round whatever the scale of the parameter), "sgd" (the plain Robbins-Monro
        step of eqs. 6-7) or any optax GradientTransformation.

        Fisher scoring: each client also uploads, as its d(d+1)/2-float upper triangle, the complete-data
        information of its round's draws, H_i = mean_m[-grad^2 log p(D_i, Z_m | theta_k)]; the server keeps
        the stochastic-approximation average H_k = H_{k-1} + rho_k (-grad^2 log p(theta_k) + (b/|A|) sum_i H_i -
        H_{k-1}),
        rho_k = max(1 / (k + 1), 1 / information_window), and steps
        theta_{k+1} = theta_k + eta_k H_k^-1 g_k (:func:`fedbayes.optim.newton_direction`: Jacobi-scaled,
        negative curvatures by their size, the step shortened so that no log-scale coordinate moves by more
        than ``max_log_step``). This is Fisher scoring with the complete-data information (the EM
        gradient algorithm, Lange 1995): it treats the clients' current draws as data, as their
        gradients do, so it never steps further than EM would (Louis' covariance term, which would make
        it Newton's method, is left out during the rounds: estimated from a stateful chain's few moves
        of one round it measures the chain's drift rather than the posterior's spread, and made the
        steps unstable). Affine-invariant: raw and standardised units give the same iterates.
    information_max_dim:
        The largest number d of unconstrained global coordinates for which the information is estimated
        (the "auto" optimiser's Fisher scoring, and the standard errors of the final exchange): d(d+1)/2
        floats per client and round, and d Hessian-vector products per draw.
    max_log_step:
        The longest Fisher-scoring step of a coordinate on which its constrained value depends
        non-linearly (the log of a scale, the logit of a probability): 1.0 lets a scale change by at most
        a factor e per round (unit-free; location coordinates are not bounded).
    trust_radius:
        r, the longest Fisher-scoring step in the metric of the information (standard-error units);
        None (default): no such bound.
    information_window:
        The running average of the information forgets at rate 1 / information_window once k exceeds it.
    uncertainty:
        Standard errors by Louis' identity from the final exchange's draws (each client uploads its mean
        score, its Louis estimate and the Monte Carlo covariance of its mean score: d + d(d+1) floats;
        :func:`louis.draws_information`): ``res.standard_errors``, ``res.information``, and the normal
        approximation N(theta_hat, I^-1) in ``res.idata.posterior``. None (default): when d <=
        ``information_max_dim``.
    one_step:
        With ``uncertainty``, report theta_hat = theta_bar + I^-1 g, one Newton step from the averaged
        iterate with the final exchange's gradient g and information I (Le Cam's one-step estimator; no
        further exchange), when theta_bar is within ``ONE_STEP_MAX`` (0.25) of the optimum in squared
        standard errors (g' I^-1 g <= 0.25: there the log-likelihood is quadratic to the accuracy of its
        normal approximation, and the step leaves a distance of the order of I's relative error times
        the step). The step's own Monte Carlo error is the control-variate gradient's, checked by the
        ``one_step_noise`` row of ``res.diagnostics``. ``res.params_averaged`` keeps theta_bar, at which
        the clients' personal posteriors were drawn. False: theta_bar, the paper's estimate.
    compressor:
        Unbiased compressor of the uploaded gradient (default: none).
    exact_sites:
        Global sites whose gradient is uploaded uncompressed (FedPop compresses only the
        likelihood parameters phi; pass the prior hyper-parameters beta here).
    bounds:
        ``{site: (low, high)}`` box in constrained space for the projection Pi.
    average_from:
        Fraction of the rounds after which iterates enter the reported average.
    init:
        Initial constrained values of global sites (others: param inits / prior medians): a dict, a
        previous fit ``Result``, ``"map"``: the MAP of the non-personalised model first (every client's
        latents at their population mean; :func:`fedbayes.algorithms.warmstart.map_estimate`, at most 100
        iterations of every client's gradient, Newton's step up to 1 000 coordinates), the classic warm
        start of a personalised model from the global one, or None (the cold start). "auto" (default):
        "map" when the globals have more than ``information_max_dim`` unconstrained coordinates (a
        network's shared sites, which the "auto" optimiser moves by Adam) and the fit is not private,
        else None. From a cold start a network's personal heads begin as prior draws around mu = 0, the
        shared body fits features to those random heads, and the population mean stays near 0 (FedPop's
        image model on digits, S = 5, half the clients with 5 images: the small clients' accuracy 0.68
        with a cold start, 0.97 from the MAP; ``benchmarks/README.md``). FedRep and LocalOnly keep the
        cold start their papers use.
    num_samples, warmup, thinning, num_chains:
        After the last round each client runs ``num_chains`` ULA chains of ``warmup`` +
        ``num_samples * thinning`` steps at the averaged theta, keeping every ``thinning``-th state:
        its local posterior in ``res.idata`` (chain, draw). The first chain continues the client's
        training chain; the others start from prior draws, so R-hat compares independent starts.
    aggregation:
        ``"mean"`` (the algorithm: b / |A| times the sum of the answers), or ``"median"`` /
        ``"trimmed"`` / a trim fraction: b times a coordinate-wise robust centre of the answers, for
        Byzantine clients (``fb.faults.Aggregation`` states the statistical cost).
    privacy:
        Central client-level differential privacy, a ``fb.privacy.DP`` (None: none). The server clips each
        client's gradient upload to L2 norm C (all sites as one vector) and adds N(0, (sigma w C)^2) to
        the re-weighted sum w sum_i g_i (w = b / |A|), so that each round is a Gaussian mechanism with
        noise multiplier sigma (:class:`fedbayes.privacy.SumPrivacy`); sigma is given or solved from a
        target epsilon over the rounds and the cohort sampling. Every other release of the clients'
        data is switched off or refused: the default server step is Adam (Fisher scoring's
        information uploads are refused), there are no standard errors (Louis' terms), the clients'
        objectives are not used (``history["objective"]`` is NaN), and ``init="map"`` is refused.
        Give ``server_lr`` on the parameters' scale: Adam moves each coordinate by about that much
        per round. The personal posteriors stay on the clients; ``res.privacy`` reports epsilon.
        ``DP(mode="distributed")``: each cohort member clips its own gradient and adds N(0, sigma^2 C^2 / b)
        (so the b shares carry the central noise), sends no objective, and the server re-weights the sum:
        it needs only the sum, so ``fb.flower.SecAggPlus`` hides each upload on Flower (no compressor or
        exact sites then). A member that does not answer takes its share with it:
        ``res.privacy["epsilon_realised"]`` accounts the rounds as they went.
    """

    local_steps: int = 10
    burn_in: int = 0
    stateful: bool = True
    step_size: float | Sequence[float] | None = None
    step_scale: float | None = None
    local_metric: str = "auto"
    local_kernel: str | None = None
    batch_size: int | None = None
    power_iters: int = 2
    server_lr: float | Callable | None = None
    server_optimizer: Any = "auto"
    information_max_dim: int = 100
    max_log_step: float = 1.0
    trust_radius: float | None = None
    information_window: int = 10
    uncertainty: bool | None = None
    one_step: bool = True
    compressor: Compressor = identity()
    exact_sites: tuple[str, ...] = ()
    bounds: Mapping[str, tuple[float, float]] | None = None
    average_from: float = 0.5
    init: Any = "auto"
    num_samples: int = 200
    warmup: int = 200
    thinning: int = 5
    num_chains: int = 2
    aggregation: Any = "mean"
    privacy: Any = None
    name: str = "FedSOUL"

    def _run_class(self) -> type:
        return FedSOULRun

    local_prior: ClassVar[bool] = True  # the local chain's target includes log p(z | theta) (FedRep: not)
    local_noise: ClassVar[bool] = True  # Langevin moves (FedRep: gradient-ascent steps)

    def __post_init__(self):
        require_int(self.local_steps, "FedSOUL local_steps")
        require_int(self.burn_in, "FedSOUL burn_in", 0)
        if self.burn_in >= self.local_steps:
            raise ConfigError(f"FedSOUL burn_in={self.burn_in} must be smaller than local_steps={self.local_steps}")
        require_int(self.power_iters, "FedSOUL power_iters")
        require_choice(self.local_metric, "FedSOUL local_metric", ("auto", "identity", "dense", "diagonal"))
        require_choice(self.local_kernel, "FedSOUL local_kernel", (None, "mala", "ula"))
        if not isinstance(self.exact_sites, (tuple, list)) or not all(isinstance(n, str) for n in self.exact_sites):
            raise ConfigError(
                f"{self.name} exact_sites must be a tuple of global site names, e.g. ('beta',), "
                f"got {self.exact_sites!r}"
            )
        check_batch_size(self.batch_size, self.name)
        require_int(self.num_samples, "FedSOUL num_samples")
        require_int(self.warmup, "FedSOUL warmup", 0)
        require_int(self.thinning, "FedSOUL thinning")
        require_int(self.num_chains, "FedSOUL num_chains")
        if self.step_scale is not None and (
            isinstance(self.step_scale, bool)
            or not isinstance(self.step_scale, numbers.Real)
            or not 0 < self.step_scale < 2
        ):
            raise ConfigError(
                f"FedSOUL step_scale must lie in (0, 2) (ULA is unstable beyond 2), got {self.step_scale!r}"
            )
        if self.step_size is not None:
            if not _positive_steps(self.step_size):
                raise ConfigError(
                    "FedSOUL step_size must be a positive float or a 1-d sequence of them (one per client)"
                )
        require_fraction(self.average_from, "FedSOUL average_from")
        require_choice(self.stateful, "FedSOUL stateful", (True, False))
        require_choice(self.one_step, "FedSOUL one_step", (True, False))
        if not (isinstance(self.init, str) and self.init == "auto"):  # resolved at build: resolved_init
            check_init(self.init, self.name)
        if self.server_lr is not None:
            optim.as_schedule(self.server_lr, "FedSOUL server_lr")
        if not (isinstance(self.server_optimizer, str) and self.server_optimizer in ("auto", "fisher")):
            optim.resolve(self.server_optimizer, 0.05 if self.server_lr is None else self.server_lr)
        require_int(self.information_max_dim, "FedSOUL information_max_dim", 0)
        require_int(self.information_window, "FedSOUL information_window")
        for name in ("max_log_step", "trust_radius"):
            v = getattr(self, name)
            if (v is not None or name == "max_log_step") and (not is_real(v) or not v > 0):
                raise ConfigError(f"FedSOUL {name} must be a positive number, got {v!r}")
        require_choice(self.uncertainty, "FedSOUL uncertainty", (None, True, False))
        require_unbiased(self.compressor, "FedSOUL")
        as_aggregation(self.aggregation)
        self._check_privacy()
        if self.bounds is not None and not isinstance(self.bounds, Mapping):
            raise ConfigError(f"FedSOUL bounds must be a dict {{site: (low, high)}}, got {self.bounds!r}")
        for site, box in (self.bounds or {}).items():
            if (
                not isinstance(box, (tuple, list))
                or len(box) != 2
                or not all(is_real(b) for b in box)
                or not box[0] < box[1]
            ):
                raise ConfigError(f"FedSOUL bounds for '{site}' must be (low, high) with low < high, got {box!r}")

    def _check_privacy(self) -> None:
        """Central client-level DP (``privacy=fb.privacy.DP(...)``) covers the clipped, noised gradient sum
        only: every other release of the clients' data is refused or switched off."""
        if self.privacy is None:
            return
        check_dp(self.privacy, self.name)
        if type(self) is not FedSOUL:
            raise ConfigError(f"{self.name} has no privacy option yet (FedSOUL has)")
        if self.privacy.mode == "distributed" and (self.compressor != identity() or self.exact_sites):
            raise ConfigError(
                "FedSOUL with distributed DP sends each client's gradient clipped and noised in full: a compressed "
                "code would carry the noise share only in part; leave compressor and exact_sites at their defaults"
            )
        if isinstance(self.server_optimizer, str) and self.server_optimizer == "fisher":
            raise ConfigError(
                "FedSOUL with privacy cannot use Fisher scoring: its information uploads are a release "
                "the accountant does not cover; use server_optimizer='adam' (or 'auto', which is adam "
                "under privacy) with a server_lr on the parameters' scale"
            )
        if self.uncertainty:
            raise ConfigError(
                "FedSOUL with privacy has no standard errors: Louis' terms of the final exchange are a "
                "release the accountant does not cover; leave uncertainty=None"
            )
        if not (isinstance(self.aggregation, str) and self.aggregation == "mean"):
            raise ConfigError("FedSOUL with privacy needs aggregation='mean': the noise is calibrated to a sum")
        if isinstance(self.init, str) and self.init == "map":
            raise ConfigError(
                "FedSOUL with privacy cannot start from init='map' (a fit of the clients' data the "
                "accountant does not cover); give values or leave init=None"
            )

    def build(self, problem: Problem) -> FedSOULRun:
        """Bind the configuration to a problem: the object that runs the round protocol."""
        fm: FedModel = problem.model
        fm.require(self.name, minibatch=True)
        if not fm.local_names:
            raise ConfigError(f"{self.name} needs at least one local latent (a sample site under fb.local())")
        for site in (*self.exact_sites, *(self.bounds or {})):
            if site not in fm.global_names:
                raise ConfigError(
                    f"'{site}' is not a global site of the model; global sites are {list(fm.global_names)}"
                )
        n = problem.data.num_clients
        if self.step_size is not None and np.ndim(self.step_size) == 1 and np.size(self.step_size) != n:
            raise ConfigError(f"FedSOUL step_size has {np.size(self.step_size)} entries for {n} clients")
        batches = minibatch.resolve(self.batch_size, fm, problem.data.mask.shape[1], self.name)
        if batches.active and self.local_kernel == "mala":
            raise ConfigError(
                "FedSOUL local_kernel='mala' cannot take minibatch steps: a Metropolis test on a "
                "minibatch estimate of the log-density does not leave the local posterior invariant; "
                "leave local_kernel=None (ULA, i.e. SGLD, with minibatches) or use the full batch"
            )
        self._check_draws_memory(fm, n)
        return self._run_class()(
            self,
            fm,
            self._averaging_start(problem),
            resolve_init(self.resolved_init(fm), problem),
            n,
            batches,
            (problem.num_rounds, problem.cohort_size or n),
        )

    def resolved_init(self, fm: FedModel) -> Any:
        """``init`` with "auto" resolved: "map" when the globals have more than ``information_max_dim``
        unconstrained coordinates (a network's shared sites) and the fit is not private, else None."""
        if not (isinstance(self.init, str) and self.init == "auto"):
            return self.init
        wide = ravel_pytree(fm.init_globals(None))[0].size > self.information_max_dim
        return "map" if wide and self.privacy is None else None

    def _check_draws_memory(self, fm: FedModel, num_clients: int) -> None:
        """ConfigError before any computation if the personal posteriors' draws (``res.local_samples``: clients x
        chains x draws x local coordinates) would take more than half the machine's memory."""
        from ..engine import HISTORY_MEMORY_SHARE, physical_memory

        memory = physical_memory()
        q = int(ravel_pytree(fm.zeros_local())[0].size)
        need = num_clients * self.num_chains * self.num_samples * q * np.dtype(jnp.result_type(float)).itemsize
        if memory is not None and need > HISTORY_MEMORY_SHARE * memory:
            raise ConfigError(
                f"{self.name}: the personal posteriors' draws ({num_clients:,} clients x {self.num_chains} chains x "
                f"{self.num_samples:,} draws x {q} local coordinates) would take {need / 2**30:,.1f} GiB, more than "
                f"{HISTORY_MEMORY_SHARE:.0%} of this machine's {memory / 2**30:,.1f} GiB; "
                "lower num_samples or num_chains"
            )

    def _averaging_start(self, problem: Problem) -> int:
        """The round after which iterates enter the reported average."""
        return int(self.average_from * problem.num_rounds)


@dataclass(frozen=True)
class FedRep(FedSOUL):
    """FedRep (Collins, Hassani, Mokhtari and Shakkottai 2021) as FedSOUL's limit sigma -> infinity without
    noise: FedPop's baseline with a shared representation and personal heads trained locally.

    Each client trains its ``fb.local()`` sites (the head) by ``local_steps`` gradient-ascent steps on its
    own log-likelihood log p(D_i | theta, z_i), with no population prior (the prior's spread taken to
    infinity) and no Langevin noise, from where its previous round ended; it sends the gradient of the
    same log-likelihood in the shared sites theta (the representation) at its head, which the server
    averages and follows with FedSOUL's optimiser. So FedRep is FedSOUL with the local target
    p(D_i | theta, z) instead of p(D_i, z | theta) and the local moves u' = u + gamma R^T grad (the same
    metric and automatic step, ``step_scale`` 1: the 1 / L gradient step, or with the dense metric a
    Newton step). Sites that enter only the population prior (its mean and scale) receive no gradient and
    keep their start. Its joint fixed point maximises sum_i log p(D_i | theta, z_i) over theta and every
    z_i (``tests/test_fedrep.py``: the within-client least-squares solution of a random-intercept
    regression). Minibatches (``batch_size``) make the local steps stochastic gradient steps. The final
    exchange returns each client's trained head (chains of gradient steps converge to it: its "samples"
    are that point), with no standard errors.
    """

    step_scale: float | None = 1.0
    local_kernel: str | None = "ula"
    uncertainty: bool | None = False
    num_chains: int = 1
    init: Any = None
    name: str = "FedRep"

    local_prior: ClassVar[bool] = False
    local_noise: ClassVar[bool] = False


@dataclass(frozen=True)
class FineTune(FedRep):
    """A shared model fitted first, then each client's head fine-tuned locally: FedPop's "FedAvg + FT"
    baseline.

    The shared sites are fitted by the warm start ``init`` (default ``"map"``: TAMUNA's federated MAP of
    the non-personalised model, every client's latents at their population mean, which is FedAvg's
    target without its client drift; or pass ``init=`` a ``fb.FedAvg`` ``Result`` for FedAvg itself) and
    then frozen: each round every client takes ``local_steps`` of FedRep's gradient steps on its head
    (its log-likelihood at the frozen shared sites, no population prior, no noise). Nothing crosses the
    network in the rounds: the shared sites reach the clients once after the set-up (as client
    settings), and the clients send nothing back, so the ledger holds the warm start's bits, the set-up
    and that one message.
    """

    init: Any = "map"
    name: str = "FineTune"

    def _run_class(self) -> type:
        return FineTuneRun


@dataclass(frozen=True)
class LocalOnly(FedRep):
    """Each client fits the whole model on its own data alone: FedPop's "Local" baseline.

    No site is shared: every client keeps its own copy theta_i of the global sites, started at the common
    theta_0 of the set-up, and each of its rounds is one FedRep round on its own, with itself as the only
    client: ``local_steps`` gradient steps on its head z_i (log p(D_i | theta_i, z), no population prior,
    no noise), then one step of FedSOUL's server optimiser on theta_i with its own gradient,

        theta_i <- theta_i + eta_k step(grad log p(theta_i) + grad_theta log p(D_i | theta_i, z_i)),

    taken on the client. So each client converges to its own maximum a posteriori
    argmax_{theta, z} log p(theta) + log p(D_i | theta, z) (``tests/test_fedrep.py``: per-client least
    squares), and nothing crosses the network after the set-up: the ledger holds the set-up and nothing
    else. A client's rounds are the rounds it takes part in; ``average_from`` counts them (about
    ``num_rounds * clients_per_round / num_clients``). ``res.local_samples`` holds each client's own fitted
    global sites beside its head (a client's predictions use them), and ``res.params`` their average over
    the clients, a summary that no client's model uses. A client unseen in training has no model:
    ``res.sample_client`` refuses. Compression and robust aggregation do not apply and are refused.
    """

    name: str = "LocalOnly"

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.compressor, type(identity())) or self.exact_sites or self.aggregation != "mean":
            raise ConfigError(
                "LocalOnly sends nothing after the set-up: compressor, exact_sites and aggregation do not apply"
            )

    def _run_class(self) -> type:
        return LocalOnlyRun

    def _averaging_start(self, problem: Problem) -> int:
        """A fraction of a client's own rounds (it takes part in cohort / n of them)."""
        share = (problem.cohort_size or problem.data.num_clients) / problem.data.num_clients
        return int(self.average_from * problem.num_rounds * share)


class FedSOULRun(FederatedRun):
    """FedSOUL bound to a model: ``init``, ``client_step``, ``server_step`` of the engine protocol."""

    final_exchange = True  # personal posteriors at the estimate

    def __init__(
        self,
        cfg: FedSOUL,
        fm: FedModel,
        avg_start: int,
        init_values: Mapping[str, Any] | None,
        num_clients: int,
        batches: minibatch.Minibatch,
        rounds_cohort: tuple[int, int] | None = None,
    ):
        self.cfg, self._fm, self._avg_start, self._init_values = cfg, fm, avg_start, init_values
        self._batches = batches
        self.num_clients = num_clients
        self.name = cfg.name
        self.dim = int(sum(int(np.prod(fm.sites[n].unconstrained_shape, dtype=np.int64)) for n in fm.global_names))
        small = self.dim <= cfg.information_max_dim
        opt = cfg.server_optimizer
        dp = getattr(cfg, "privacy", None)
        self._dp: SumPrivacy | None = None
        if dp is not None:
            if rounds_cohort is None:  # FedSOUL.build always passes them
                raise AssertionError(f"{self.name} with privacy needs the number of rounds and the cohort size")
            mechanism = (
                "distributed: each cohort member clips its gradient upload and adds 1/b of the noise; the server "
                "re-weights the sum of the shares and sees each one unless secure aggregation sums them; the "
                "clients' objectives are not sent, and no standard errors"
            )
            self._dp = SumPrivacy(
                dp,
                rounds_cohort[0],
                num_clients,
                rounds_cohort[1],
                mechanism=mechanism if dp.mode == "distributed" else None,
            )
        self._fisher = isinstance(opt, str) and (opt == "fisher" or (opt == "auto" and small)) and dp is None
        self.optimizer = "fisher" if self._fisher else ("adam" if isinstance(opt, str) and opt == "auto" else opt)
        lr = cfg.server_lr if cfg.server_lr is not None else (1.0 if self._fisher else 0.05)
        self.server_lr = lr
        self._opt = None if self._fisher else optim.resolve(self.optimizer, lr)  # optax's init / update
        self._schedule = optim.as_schedule(lr)
        self.uncertainty = (small and dp is None) if cfg.uncertainty is None else bool(cfg.uncertainty)
        # the one-step estimator needs the marginal likelihood's gradient and information: FedSOUL's own
        # chains (FedRep's noise-free, prior-free chains have neither)
        self._one_step = bool(cfg.one_step and cfg.local_prior and cfg.local_noise)
        self._nonlinear = self._nonlinear_coordinates(fm) if self._fisher else None
        q = ravel_pytree(fm.zeros_local())[0].size
        auto = cfg.local_metric == "auto" and cfg.step_size is None
        self._dense = cfg.local_metric == "dense" or (auto and 0 < q <= LOCAL_DENSE_MAX)
        # a Langevin chain over more coordinates: the diagonal metric (FedRep's and LocalOnly's noise-free
        # gradient steps keep the identity's 1 / L step, as those methods are defined)
        self._diagonal = cfg.local_metric == "diagonal" or (auto and q > LOCAL_DENSE_MAX and cfg.local_noise)
        self.local_metric = "dense" if self._dense else ("diagonal" if self._diagonal else "identity")
        self.local_kernel = cfg.local_kernel or ("ula" if batches.active else "mala")
        mala = self.local_kernel == "mala"
        self.step_scale = cfg.step_scale if cfg.step_scale is not None else (1.0 if mala else 0.1)
        # the rounds' kernel, and the final exchange's (all rows: MALA when training took batches); a
        # noise-free move (FedRep) is never adjusted
        self._adjusted = mala and cfg.local_noise
        self._final_adjusted = (mala or batches.active) and cfg.local_noise
        # MALA's automatic step backs off where its moves are rejected (ACCEPTANCE_TARGET): at step_scale / L_i a
        # chain over a network's head (hundreds of coordinates) accepted 1e-4 of its moves and did not move
        self._adapt_acceptance = self._adjusted and self._auto_step
        # the rounds' unadjusted moves inject only the noise that keeps their law's variance the target's
        # (_noise_factor): ULA's own excess under the dense or diagonal metric, and with minibatches the batch
        # gradient's error, estimated from the batch's two halves (_halves_evaluator)
        ula = cfg.local_noise and not self._adjusted
        self._exact_variance = ula and (self._dense or self._diagonal)
        self._noise_correct = ula and batches.active

    @staticmethod
    def _nonlinear_coordinates(fm: FedModel) -> jax.Array:
        """The flat unconstrained coordinates on which a constrained value depends non-linearly (log-scales,
        logits, a Cholesky factor's diagonal; not its off-diagonal): a nonzero second derivative of the
        constraining map at two generic points."""
        zeros = {n: jnp.zeros(fm.sites[n].unconstrained_shape) for n in fm.global_names}
        flat, unravel = ravel_pytree(zeros)
        f = lambda x: ravel_pytree(fm.constrain(unravel(x)))[0]  # noqa: E731

        def curved(points):
            second = jax.vmap(jax.jacfwd(jax.jacfwd(f)))(points)  # (2, D, d, d)
            return jnp.any(jnp.diagonal(second, axis1=2, axis2=3) != 0, axis=(0, 1))

        return fit_jit(curved, once=0)(jnp.stack([jnp.full(flat.shape, 0.3), jnp.full(flat.shape, -0.7)]))

    # ------------------------------------------------------------------ helpers
    @property
    def _auto_step(self) -> bool:
        return self.cfg.step_size is None

    def _project(self, fm: FedModel, theta: Params) -> Params:
        if not self.cfg.bounds:
            return theta
        out = dict(theta)
        for site, (lo, hi) in self.cfg.bounds.items():
            t = fm.sites[site].transform
            out[site] = t.inv(jnp.clip(t(theta[site]), lo, hi))
        return out

    def _client_log_joint(self, theta: Params, z: Params, data, mask) -> jax.Array:
        """The local chain's log-density: log p(D_i, z | theta), or for FedRep (no population prior) the
        log-likelihood log p(D_i | theta, z) alone."""
        if self.cfg.local_prior:
            return self._fm.client_log_joint(theta, z, data, mask)
        return self._fm.client_log_terms(theta, z, data, mask)[1]

    def _log_joint_fn(self, fm: FedModel, theta: Params, client: ClientData):
        return lambda z: self._client_log_joint(theta, z, client.data, client.mask)

    def _flat_log_joint(self, theta: Params, like: Params, client: ClientData) -> Callable[[jax.Array], jax.Array]:
        """The local chain's log-density as a function of flat local latents shaped like ``like``."""
        unravel = ravel_pytree(like)[1]
        return lambda x: self._client_log_joint(theta, unravel(x), client.data, client.mask)

    def _flat_term(
        self, theta: Params, like: Params, client: ClientData, which: int
    ) -> Callable[[jax.Array], jax.Array]:
        """One term of the local chain's log-density as a function of flat local latents shaped like ``like``:
        ``which`` 0 the population prior log p(z | theta) (with the latents' Jacobian; 0 for FedRep, whose
        chains have no prior), 1 the log-likelihood log p(D_i | theta, z)."""
        unravel = ravel_pytree(like)[1]
        fm, prior = self._fm, self.cfg.local_prior

        def term(x):
            terms = fm.client_log_terms(theta, unravel(x), client.data, client.mask)
            return terms[which] if (which == 1 or prior) else jnp.zeros((), x.dtype)

        return term

    def _diagonal_metric(self, theta: Params, anchor: Params, client: ClientData, likelihood: jax.Array) -> jax.Array:
        """The diagonal metric's V at the anchor: the prior's curvature diagonal exactly (its q Hessian-vector
        products cost q evaluations of the prior alone, not of the likelihood) plus the running mean
        ``likelihood`` of the likelihood's, clipped at 0. The clip is where an estimate's noise is: a
        log-concave likelihood's curvature diagonal is never negative, and a single probe's running mean
        of it, in a coordinate strongly correlated with stiffer ones, fell to near 0, so that V floored
        there and the step of every coordinate shrank with the whitened curvature's growth (FedPop's digits
        model: the 500-image clients' median step 2e-4, 0.028 with the clip)."""
        prior = _exact_diagonal(self._flat_term(theta, anchor, client, 0), ravel_pytree(anchor)[0])
        return prior + jnp.maximum(likelihood, 0.0)

    def _run_chain(
        self,
        fm,
        key,
        theta,
        z0,
        step,
        client,
        num_steps,
        keep_from,
        information: bool = False,
        root: jax.Array | None = None,
        order: jax.Array | None = None,
        noise: Any = (),
    ):
        """A chain of ``num_steps`` local moves (:meth:`_move`) from z0; averages grad_theta log p(D, z | theta)
        (and the log joint) over the states after move ``keep_from``. With ``information``, also the complete-data
        information mean_m(-grad^2_theta log p(D, Z_m | theta)) over the same states (flat, unconstrained;
        None otherwise), ``noise`` updated, and last the moves' mean acceptance probability (1 for ULA).

        With minibatches (``order``, the round's order of the client's rows, :mod:`fedbayes.minibatch`), the
        chain's start is evaluated on batch 0 and move m's proposal on batch m + 1: each drift and each
        Fisher-gradient term is an unbiased estimate on a batch drawn independently of the state it is
        evaluated at (SGLD). Noise-corrected (``noise`` the client's running estimate, see ClientState): each
        evaluation also estimates the batch gradient's error (:meth:`_halves_evaluator`), whose variance in the
        metric's coordinates enters the running mean, and each move injects only the noise that the gradient
        does not already carry (:func:`fedbayes.kernels.langevin_move`'s ``gradient_noise``)."""
        flat, unravel = ravel_pytree(theta)
        d = flat.size if information else 0
        correct = self._noise_correct and order is not None
        evaluator = self._halves_evaluator if correct else self._evaluator
        if correct:  # independent batches (Minibatch.sample), the errors the noise correction assumes
            k_batches = jax.random.fold_in(key, 11)
            batch = lambda m: self._batches.sample(jax.random.fold_in(k_batches, m), client)  # noqa: E731
        else:
            batch = lambda m: self._batches.take(order, client, m) if order is not None else client  # noqa: E731

        def hess(x, z, c):
            return jax.hessian(lambda x, z: self._client_log_joint(unravel(x), z, c.data, c.mask))(x, z)

        def split(point, noise, moved=True):
            """The point with the Fisher gradient alone as its aux, and the noise estimate updated by its error
            (not by a rejected, non-finite proposal's)."""
            if not correct:
                return point, noise
            aux, error = point.aux
            whitened = error if root is None else apply_root(root, error, transpose=True)
            mean, count = noise
            rho = jnp.maximum(1.0 / (count + 1.0), 1.0 / NOISE_WINDOW)
            ok = jnp.all(jnp.isfinite(whitened)) & moved
            noise = (jnp.where(ok, mean + rho * (whitened * whitened - mean), mean), count + ok.astype(count.dtype))
            return point._replace(aux=aux), noise

        start, noise = split(LangevinPoint(z0, *evaluator(theta, batch(0))(z0)), noise)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, start.aux)

        def body(carry, xs):
            point, acc, acc_val, acc_h, noise = carry
            k, m = xs
            c = batch(m + 1)
            if correct:
                point = point._replace(aux=(point.aux, jnp.zeros_like(noise[0])))
            point, prob = self._move(
                k,
                point,
                evaluator(theta, c),
                step,
                root,
                noise_factor=self._noise_factor(step, noise[0] if correct else None),
            )
            point, noise = split(point, noise, prob > 0)
            keep = m >= keep_from
            acc = jax.tree_util.tree_map(lambda a, g: a + jnp.where(keep, g, 0.0), acc, point.aux)
            if information:
                acc_h = acc_h - jnp.where(keep, hess(flat, point.x, c), 0.0)
            return (point, acc, acc_val + jnp.where(keep, point.log_density, 0.0), acc_h, noise), prob

        xs = (move_keys(jax.random.split(key, num_steps)), jnp.arange(num_steps))  # each move's pair, hashed ahead
        init = (start, zeros, jnp.zeros_like(start.log_density), jnp.zeros((d, d), flat.dtype), noise)
        (end, acc, acc_val, acc_h, noise), probs = jax.lax.scan(body, init, xs)
        z = end.x
        n = num_steps - keep_from
        mean = jax.tree_util.tree_map(lambda a: a / n, acc)
        return z, mean, acc_val / n, (acc_h / n if information else None), noise, jnp.mean(probs)

    def _evaluator(self, theta: Params, client: ClientData):
        """z -> (log p(D, z | theta), grad_z of it, grad_theta of it): what a local move needs, and the
        Fisher-identity gradient at the new state as the point's ``aux``."""

        def evaluate(z):
            val, (g_theta, g_z) = jax.value_and_grad(self._client_log_joint, argnums=(0, 1))(
                theta, z, client.data, client.mask
            )
            return val, g_z, g_theta

        return evaluate

    def _halves_evaluator(self, theta: Params, batch: ClientData):
        """:meth:`_evaluator` on a minibatch, with an estimate of its gradient's error as the aux's second part.

        The batch's n real rows are dealt alternately into halves A and B (n_A + n_B = n), each evaluated with
        its rows re-weighted to stand for the whole client (N_i / n_A, N_i / n_B). The batch's own value and
        gradients are the exact mixture (n_A X_A + n_B X_B) / n (every term but the likelihood's is the same in
        both halves, and the likelihood is linear in the rows' weights). Their difference e = g_A - g_B in z has
        E e e^T = (n / n_A + n / n_B) Cov(g_hat) for the batch's estimate g_hat (rows drawn independently,
        :meth:`fedbayes.minibatch.Minibatch.sample`), so sqrt(n_A n_B) / n * e has the covariance of g_hat's
        error; 0 for a batch that is the whole client."""
        mask = batch.mask
        real = mask > 0
        first = real & (jnp.cumsum(real) % 2 == 1)
        second = real & ~first
        dtype = mask.dtype
        n_a, n_b = jnp.sum(first).astype(dtype), jnp.sum(second).astype(dtype)
        n = n_a + n_b
        masks = jnp.stack(
            [
                jnp.where(first, mask * n / jnp.maximum(n_a, 1.0), 0.0),
                jnp.where(second, mask * n / jnp.maximum(n_b, 1.0), 0.0),
            ]
        )
        share = jnp.stack([n_a, n_b]) / jnp.maximum(n, 1.0)
        drawn = (n < batch.size.astype(dtype)).astype(dtype)  # 0: the batch is the client, its gradient exact
        scale = jnp.sqrt(n_a * n_b * drawn) / jnp.maximum(n, 1.0)
        grad = jax.value_and_grad(self._client_log_joint, argnums=(0, 1))

        def evaluate(z):
            vals, (g_theta, g_z) = jax.vmap(lambda w: grad(theta, z, batch.data, w))(masks)
            mix = lambda t: jnp.tensordot(share.astype(t.dtype), t, axes=1)  # noqa: E731
            error = ravel_pytree(jax.tree_util.tree_map(lambda t: t[0] - t[1], g_z))[0] * scale
            return mix(vals), jax.tree_util.tree_map(mix, g_z), (jax.tree_util.tree_map(mix, g_theta), error)

        return evaluate

    def _move(
        self, key, point: LangevinPoint, evaluate, step, root, adjusted: bool | None = None, noise_factor=None
    ) -> tuple[LangevinPoint, jax.Array]:
        """One local move (:func:`fedbayes.kernels.langevin_move`, tamed): MALA with ``local_kernel="mala"``,
        plain ULA with ``"ula"`` (``adjusted`` overrides); ``root`` the local metric's root (None: the identity);
        ``noise_factor`` the rounds' noise correction (:meth:`_noise_factor`; None: none)."""
        adjusted = self._adjusted if adjusted is None else adjusted
        return langevin_move(
            key,
            point,
            evaluate,
            step,
            root,
            adjusted=adjusted,
            tame=True,
            noise=self.cfg.local_noise,
            noise_factor=noise_factor,
        )

    def _noise_factor(self, step: jax.Array, gradient_noise: jax.Array | None) -> jax.Array | None:
        """The rounds' ULA noise factor f (``langevin_move``'s ``noise_factor``; None: the plain 2 gamma).

        In the metric's coordinates u a move is u' = u + gamma (grad + e) + sqrt(2 gamma) f xi, e the
        gradient's error. On a Gaussian target whose whitened curvature is c along u_j (c = 1 where the metric
        is the curvature's, at the anchor: exactly for "dense", up to the estimate and the floor for
        "diagonal"), the stationary variance of u_j is (2 gamma f^2 + gamma^2 s_j) / (gamma c (2 - gamma c)),
        s_j the variance of e_j. It is the target's 1 / c when 2 gamma f^2 = 2 gamma - gamma^2 c - gamma^2 s_j:

            f_j^2 = max(1 - gamma c / 2 - gamma s_j / 2, 0).

        f_j^2 > 0 needs gamma (c + s_j) < 2: with minibatches the round's moves take the step
        min(gamma, 1 / (1 + max_j s_j)) (:meth:`_local_chain`; s from the client's running estimate at the
        round's start), at which f_j^2 >= 1 / 2 - gamma c / 2 > 0. (Stretching the metric per coordinate
        instead, as pSGLD's RMSprop does, was measured worse: the correction is diagonal in the metric's
        coordinates and the stretch made the gradient error's correlations there matter.)

        Without it the law is wider than the target by ULA's 1 / (1 - gamma c / 2) and by the minibatch
        gradient's noise, and a population scale learned from the draws grows by that factor round after
        round (the scale's update sets sigma^2 to the draws' spread, which the widening then exceeds again).
        With the identity metric (c unknown) only the gradient's noise is corrected."""
        if not (self._exact_variance or gradient_noise is not None):
            return None
        excess = step if self._exact_variance else jnp.zeros_like(step)
        if gradient_noise is not None:
            excess = excess + step * gradient_noise
        return jnp.sqrt(jnp.maximum(1.0 - excess / 2.0, 0.0))

    def _adapt(self, theta: Params, anchor: Params, v, step, client: ClientData, iters: int, metric=()):
        """The round's kernel at theta_k: ``(anchor', v, gamma, R)``, R the metric's root (None: identity; a
        vector: the diagonal of a diagonal root).

        The metric and the step are taken at the client's anchor a, a point that follows the local mode
        of p(z | D_i, theta) from round to round, never at the chain's state: a kernel whose step depends
        on the state it starts from is no longer invariant (with an exp link the curvature, so the step,
        changes across the local posterior, and the chain lingers where its steps are small; on a
        Poisson random-intercept model this biased the Fisher gradient of the intercept by more than its
        size and the fit drifted away). With a metric fixed by theta_k and the anchor, each round's
        moves are MALA (or ULA) for a fixed target and preconditioner.

        "dense": R R^T = H^{-1}, H = -grad^2_z log p(D_i, z | theta_k) at a (the identity where H is not
        positive definite), gamma = step_scale / the largest curvature of the whitened target at a (1
        for a positive-definite H), and a' = a + a damped Newton step. "identity": R = None, gamma =
        step_scale / L_i with L_i the largest curvature at a (power iteration from ``v``), a' = a + a
        damped gradient step of length 1 / L_i. "diagonal": R = diag(V, floored)^{-1/2} from the client's
        running mean ``metric`` of the curvature's diagonal (:data:`METRIC_FLOOR`), gamma = step_scale / the
        largest curvature of the whitened target at a, a' = a + a damped whitened gradient step of length
        1 / that curvature. A given ``step_size`` is kept."""
        log_joint = self._log_joint_fn(self._fm, theta, client)
        flat, unravel = ravel_pytree(anchor)
        f = self._flat_log_joint(theta, anchor, client)
        if self._dense:
            root, d, _ = newton_root(f, flat)
            moved = backtrack(f, flat, d, f(flat))
            if self._auto_step:
                lam, v = curvature(lambda u: f(flat + root @ u), jnp.zeros_like(flat), v, iters)
                step = self.step_scale / jnp.maximum(lam, 1e-12)
            return unravel(moved), v, step, root
        if self._diagonal:
            root = diagonal_root(self._diagonal_metric(theta, anchor, client, metric))
            if not self._auto_step:
                return anchor, v, step, root
            lam, v = curvature(lambda u: f(flat + root * u), jnp.zeros_like(flat), v, iters)
            lam = jnp.maximum(lam, 1e-12)
            fa, g = jax.value_and_grad(f)(flat)
            moved = backtrack(f, flat, root * root * g / lam, fa, num=3)
            return unravel(moved), v, self.step_scale / lam, root
        if not self._auto_step:
            return anchor, v, step, None
        lam, v = curvature(log_joint, anchor, v, iters)
        lam = jnp.maximum(lam, 1e-12)
        fa, g = jax.value_and_grad(f)(flat)
        moved = backtrack(f, flat, g / lam, fa, num=3)
        return unravel(moved), v, self.step_scale / lam, None

    # ------------------------------------------------------------------ protocol
    # set-up (fedbayes.protocol): theta_0 to every client, which starts its own chain and step size
    setup_stages = 1

    def setup_server(self, key: jax.Array) -> tuple[Params, Params]:
        """theta_0: user values where given, else prior medians (projected on ``bounds``)."""
        theta = self._project(self._fm, self._fm.init_globals(key, self._init_values))
        return theta, theta

    def setup_client(self, stage: int, key: jax.Array, theta: Params, state: Any, client: ClientData):
        """The client's first state (:meth:`_initial_state`)."""
        steps = jnp.asarray(0.0 if self._auto_step else self.cfg.step_size, dtype=jnp.result_type(float))
        k_z, k_v = jax.random.split(key)
        return self._initial_state(k_z, k_v, theta, client, steps[client.index] if steps.ndim else steps), ()

    def _initial_state(self, k_z, k_v, theta: Params, client: ClientData, step) -> ClientState:
        """The chain's start z_0 and first anchor (:meth:`_start`), the diagonal metric's first V (the exact
        diagonal of -grad^2_z log p(D_i, z | theta) at the anchor) and the Langevin step (50 power iterations
        from a random start)."""
        fm = self._fm
        z0, anchor = self._start(k_z, theta, client)
        v0 = jax.random.normal(k_v, (ravel_pytree(fm.zeros_local())[0].size,))
        metric: Any = ()
        visits: Any = ()
        if self._diagonal:  # the likelihood's part of the curvature's diagonal, exactly (q products, once)
            metric = _exact_diagonal(self._flat_term(theta, anchor, client, 1), ravel_pytree(anchor)[0])
        if self._diagonal or self._adapt_acceptance:
            visits = jnp.zeros((), jnp.int32)
        log_scale: Any = jnp.zeros((), v0.dtype) if self._adapt_acceptance else ()
        noise: Any = (jnp.zeros_like(v0), jnp.zeros((), jnp.int32)) if self._noise_correct else ()
        _, v0, step, _ = self._adapt(theta, anchor, v0, step, client, 50, metric)
        return ClientState(z0, v0, step, anchor, metric, visits, log_scale, noise)

    def _start(self, key, theta: Params, client: ClientData) -> tuple[Params, Params]:
        """A client's chain start, a draw from p(z | theta) (FedPop's), and its first anchor: with the
        dense local metric the local mode of p(z | D_i, theta) (:func:`fedbayes.kernels.newton_mode` from
        the better of z = 0 and the draw, in unconstrained space), so that the metric is the local
        posterior's from the first round, wherever the chain starts; else the draw."""
        fm = self._fm
        draw = fm.sample_local_prior(key, theta, client.data, client.mask)
        if not self._dense:
            return draw, draw
        log_joint = self._log_joint_fn(fm, theta, client)
        zero = jax.tree_util.tree_map(jnp.zeros_like, draw)
        f0, f1 = log_joint(zero), log_joint(draw)
        better = jnp.isfinite(f0) & ~(f1 > f0)
        start = jax.tree_util.tree_map(lambda a, b: jnp.where(better, a, b), zero, draw)
        return draw, newton_mode(log_joint, start)

    def setup_server_step(self, stage: int, key: jax.Array, theta: Params, uploads: Any):
        zeros = jax.tree_util.tree_map(jnp.zeros_like, theta)
        d = self.dim if self._fisher else 0
        opt_state = () if self._fisher else self._first_order.init(theta)
        info = jnp.zeros((d, d), ravel_pytree(theta)[0].dtype)
        return ServerState(theta, opt_state, zeros, jnp.zeros(()), info), self._broadcast(theta)

    @property
    def _first_order(self) -> Any:
        """The first-order server optimiser (optax's ``init`` / ``update``); Fisher scoring has none."""
        if self._opt is None:
            raise AssertionError(f"{self.name}: Fisher scoring has no first-order server optimiser")
        return self._opt

    def _broadcast(self, theta: Params) -> Message:
        return dense_message(theta)

    def client_step(self, key, theta: Params, state: ClientState, client: ClientData):
        state, (sent, objective, tri), bits = self._local_round(key, theta, state, client)
        return state, Message(Upload(sent, objective, tri), bits)

    def _warm_rounds(self, key, theta: Params, state: ClientState, client: ClientData, num: int) -> ClientState:
        """``num`` rounds of the client's local chain at a fixed theta (:meth:`_local_chain`), nothing sent: the
        kernel's adaptation (anchor, step, diagonal metric) for a client outside the training rounds."""

        def body(st, k):
            return self._local_chain(k, theta, st, client)[0], None

        return jax.lax.scan(body, state, jax.random.split(key, num))[0]

    def _local_round(self, key, theta: Params, state: ClientState, client: ClientData):
        """A client's round: the kernel adapted, M local moves (:meth:`_local_chain`), and what it would upload
        with its bits: ``(state, (compressed gradient, objective, information triangle), bits)``."""
        k_comp = jax.random.split(key, 3)[2]
        state, grad, objective, info = self._local_chain(key, theta, state, client)
        if self._dp is not None and self._dp.distributed:  # the gradient clipped and noised here; no objective sent
            grad = self._dp.share(k_comp, grad)
            objective = jnp.zeros_like(objective)
        sent, bits = self._compress(k_comp, grad)
        tri = ()
        if self._fisher:  # the complete-data information as its upper triangle, uncompressed
            tri = info[jnp.triu_indices(self.dim)]
            bits = bits + FLOAT_BITS * tri.size
        return state, (sent, objective, tri), bits + FLOAT_BITS

    def _local_chain(self, key, theta: Params, state: ClientState, client: ClientData):
        """The kernel adapted at theta_k (:meth:`_adapt`), M local moves (:meth:`_run_chain`) and the diagonal
        metric's running mean updated: ``(state, Fisher gradient, objective, information)``."""
        fm: FedModel = self._fm
        k_init, k_chain, _ = jax.random.split(key, 3)
        z0 = state.z if self.cfg.stateful else fm.sample_local_prior(k_init, theta, client.data, client.mask)
        order = self._batches.order(key, client) if self._batches.active else None
        # the kernel is adapted on the round's batch 0 (the curvature of an unbiased estimate of the client's
        # log-density; the whole client without minibatches), which none of the moves' drifts uses
        adapt_on = self._batches.take(order, client, 0) if order is not None else client
        metric, visits, log_scale = state.metric, state.visits, state.log_scale
        if self._diagonal:  # one more estimate of the likelihood's curvature diagonal at the anchor into its mean
            f = self._flat_term(theta, state.anchor, adapt_on, 1)
            flat = ravel_pytree(state.anchor)[0]
            u = jax.random.rademacher(jax.random.fold_in(key, 7), flat.shape, flat.dtype)
            # probed in the current metric's coordinates: see local_metric
            r = diagonal_root(self._diagonal_metric(theta, state.anchor, adapt_on, metric))
            estimate = u * hvp(f, flat, r * u) / r
            rho = jnp.maximum(1.0 / (visits + 2.0), 1.0 / METRIC_WINDOW)
            metric = jnp.where(jnp.all(jnp.isfinite(estimate)), metric + rho * (estimate - metric), metric)
        anchor, v, step, root = self._adapt(
            theta, state.anchor, state.v, state.step, adapt_on, self.cfg.power_iters, metric
        )
        moves_step = self._scaled(step, log_scale)
        if self._noise_correct and order is not None:
            # the noise correction injects 2 gamma f^2 = 2 gamma - gamma^2 (c + s): at gamma <= 1 / (1 + max s)
            # there is always noise left to remove (_noise_factor), s the batch gradient's error (whitened)
            moves_step = jnp.minimum(moves_step, 1.0 / (1.0 + jnp.max(state.noise[0])))
        z, grad, objective, info, noise, accepted = self._run_chain(
            fm,
            k_chain,
            theta,
            z0,
            moves_step,
            client,
            self.cfg.local_steps,
            self.cfg.burn_in,
            self._fisher,
            root,
            order,
            state.noise,
        )
        if self._adapt_acceptance:  # ACCEPTANCE_TARGET: the next round's factor from this round's acceptance
            gain = (visits + 1.0) ** -0.6
            log_scale = jnp.minimum(0.0, log_scale + gain * (accepted - ACCEPTANCE_TARGET))
        if self._diagonal or self._adapt_acceptance:
            visits = visits + 1
        return ClientState(z, v, step, anchor, metric, visits, log_scale, noise), grad, objective, info

    def _scaled(self, step: jax.Array, log_scale: Any) -> jax.Array:
        """The moves' step: the automatic step times the acceptance's factor (:data:`ACCEPTANCE_TARGET`)."""
        return step * jnp.exp(log_scale) if self._adapt_acceptance else step

    def _compress(self, key, grad: Params) -> tuple[tuple[Params, Any], jax.Array]:
        """(exact sites, the other sites compressed as one vector) as sent, and the bits."""
        exact = {n: g for n, g in grad.items() if n in self.cfg.exact_sites}
        rest = {n: g for n, g in grad.items() if n not in self.cfg.exact_sites}
        bits = jnp.asarray(FLOAT_BITS * ravel_pytree(exact)[0].size, jnp.int32)
        if not rest:
            return (exact, rest), bits
        flat, _ = ravel_pytree(rest)
        coded, _, rest_bits = self.cfg.compressor.coded(key, flat)
        return (exact, coded.with_layout(rest)), bits + rest_bits

    @staticmethod
    def _gradients(grad: tuple[Params, Params]) -> Params:
        """The uploaded gradients as one dict (the exact sites and the decoded compressed ones)."""
        exact, rest = grad
        return {**exact, **rest}

    def server_step(self, key, state: ServerState, uploads: Message, info: RoundInfo):
        fm: FedModel = self._fm
        theta = state.theta
        n_active = jnp.sum(info.active)
        weight = info.num_clients / jnp.maximum(n_active, 1)  # b / |A|: unbiased for uniform cohorts
        w = jnp.where(info.active, weight, 0.0)
        rule = as_aggregation(self.cfg.aggregation)
        grads = self._gradients(uploads.payload.grad)
        central = self._dp if self._dp is not None and not self._dp.distributed else None
        if central is not None:  # central DP: each upload clipped (robust rules are refused under DP)
            grads = central.clipped(grads)
        if rule.robust:
            agg = jax.tree_util.tree_map(lambda g: info.num_clients * rule(g, info.active), grads)
        else:
            agg = jax.tree_util.tree_map(lambda g: jnp.tensordot(w, g, axes=1), grads)
        if central is not None:  # ... and Gaussian noise on the re-weighted sum (distributed: the shares carry it)
            agg = central.noisy(jax.random.split(key)[1], agg, weight)
        prior_lp, prior_grad = jax.value_and_grad(fm.log_prior)(theta)
        grad = jax.tree_util.tree_map(jnp.add, prior_grad, agg)
        any_active = n_active > 0
        eta = self._schedule(info.round)
        extra = {}
        information = state.information
        if self._fisher:
            flat, unravel = ravel_pytree(theta)
            tris = uploads.payload.information
            total = info.num_clients * rule(tris, info.active) if rule.robust else jnp.tensordot(w, tris, axes=1)
            round_info = _symmetric(total, self.dim) - jax.hessian(lambda x: fm.log_prior(unravel(x)))(flat)
            rho = jnp.maximum(1.0 / (info.round + 1.0), 1.0 / self.cfg.information_window)
            information = jnp.where(
                any_active, state.information + rho * (round_info - state.information), state.information
            )
            delta, nu = optim.newton_direction(
                information,
                ravel_pytree(grad)[0],
                self.cfg.trust_radius,
                nonlinear=self._nonlinear,
                max_nonlinear_step=self.cfg.max_log_step,
            )
            updates, opt_state = unravel(eta * delta), ()
            extra["newton_decrement"] = nu
        else:
            updates, opt_state = self._first_order.update(
                jax.tree_util.tree_map(jnp.negative, grad), state.opt_state, theta
            )
        stepped = self._project(fm, jax.tree_util.tree_map(jnp.add, theta, updates))
        new_theta = jax.tree_util.tree_map(lambda a, b: jnp.where(any_active, a, b), stepped, theta)
        opt_state = jax.tree_util.tree_map(lambda a, b: jnp.where(any_active, a, b), opt_state, state.opt_state)
        in_avg = (info.round >= self._avg_start) & any_active
        a = jnp.where(in_avg, eta, 0.0)
        avg_sum = jax.tree_util.tree_map(lambda s, t: s + a * t, state.avg_sum, new_theta)
        objective = prior_lp + jnp.sum(w * uploads.payload.objective)
        diag = {
            # under DP the clients' objectives are not used: they are not part of the noised release
            "objective": objective if self._dp is None else jnp.full_like(objective, jnp.nan),
            "grad_norm": jnp.linalg.norm(ravel_pytree(grad)[0]),
            **extra,
            **{f"theta/{n}": v for n, v in fm.constrain(new_theta).items()},
        }
        new = ServerState(new_theta, opt_state, avg_sum, state.avg_weight + a, information)
        return new, self._broadcast(new_theta), diag

    def averaged_theta(self, state: ServerState) -> Params:
        """The weighted average of the iterates (the last iterate if no round was averaged)."""
        w = state.avg_weight
        return jax.tree_util.tree_map(
            lambda s, t: jnp.where(w > 0, s / jnp.where(w > 0, w, 1.0), t), state.avg_sum, state.theta
        )

    def _sample_one(self, key, theta: Params, state: ClientState, client: ClientData, num_samples: int, warmup: int):
        """One client's local posterior samples at ``theta``: ``num_chains`` chains of the local kernel (the
        client's own chain state, and fresh starts: with the dense or diagonal metric the anchor plus
        :func:`start_spread` (q) times the metric's root times N(0, I) draws, overdispersed about the bulk;
        otherwise draws from p(z | theta)),
        ``({site: (chains, S, ...)}, step size, mean acceptance probability after warm-up)``. The kernel is
        :meth:`_adapt`'s at the anchor, moved to the mode at ``theta`` first (5 Newton steps) when dense. With
        MALA and the automatic step each chain's warm-up also backs its step off towards
        :data:`ACCEPTANCE_TARGET` (log a <- min(0, log a + (m + 1)^-0.6 (acc_m - target)) per move m), and the
        kept draws use the step it ends with: a fresh start that landed where the client's step was rejected
        (a 136-coordinate head's chain started 150 nats below the bulk accepted none of its moves) comes back.
        The returned step is the client's, before that factor."""
        fm, cfg = self._fm, self.cfg
        n_steps = warmup + num_samples * cfg.thinning
        k_starts, k_chains = jax.random.split(key)
        anchor = state.anchor
        if self._dense:
            anchor = newton_mode(self._log_joint_fn(fm, theta, client), anchor, 5)
        anchor, _, step, root = self._adapt(theta, anchor, state.v, state.step, client, 20, state.metric)
        step = self._scaled(step, state.log_scale)
        if self._dense or self._diagonal:
            flat, unravel = ravel_pytree(anchor)
            noise = jax.random.normal(k_starts, (cfg.num_chains - 1, flat.size), flat.dtype)
            spread = start_spread(flat.size)
            fresh = jax.vmap(lambda e: unravel(flat + spread * apply_root(root, e)))(noise)
        else:
            fresh = jax.vmap(fm.sample_local_prior, in_axes=(0, None, None, None))(
                jax.random.split(k_starts, cfg.num_chains - 1), theta, client.data, client.mask
            )
        starts = jax.tree_util.tree_map(lambda a, b: jnp.concatenate([a[None], b]), state.z, fresh)
        log_joint = self._log_joint_fn(fm, theta, client)
        evaluate = lambda z: (*jax.value_and_grad(log_joint)(z), ())  # noqa: E731

        adapt = self._final_adjusted and self._auto_step  # each chain's warm-up backs off to ACCEPTANCE_TARGET

        def chain(kc, z0):
            def body(carry, xs):
                point, log_a = carry
                k, m = xs
                point, prob = self._move(k, point, evaluate, step * jnp.exp(log_a), root, self._final_adjusted)
                if adapt:  # during the warm-up only: the kept draws' kernel has one fixed step
                    moved = log_a + (m + 1.0) ** -0.6 * (prob - ACCEPTANCE_TARGET)
                    log_a = jnp.where(m < warmup, jnp.minimum(0.0, moved), log_a)
                return (point, log_a), (point.x, prob)

            init = (LangevinPoint(z0, *evaluate(z0)), jnp.zeros((), step.dtype))
            xs = (move_keys(jax.random.split(kc, n_steps)), jnp.arange(n_steps))
            return jax.lax.scan(body, init, xs)[1]

        zs, probs = jax.vmap(chain)(jax.random.split(k_chains, cfg.num_chains), starts)
        keep = lambda a: a[:, warmup + cfg.thinning - 1 :: cfg.thinning]  # noqa: E731
        return jax.tree_util.tree_map(keep, zs), step, jnp.mean(probs[:, warmup:])

    def sample_locals(
        self, key, theta: Params, states: ClientState, clients: ClientData, num_samples=None, warmup=None
    ):
        """Local posterior samples of every client at ``theta``: ``({site: (C, chains, S, ...)}, steps (C,),
        mean acceptance probabilities after warm-up (C,))``."""
        num_samples = self.cfg.num_samples if num_samples is None else num_samples
        warmup = self.cfg.warmup if warmup is None else warmup
        one = lambda k, s, c: self._sample_one(k, theta, s, c, num_samples, warmup)  # noqa: E731
        keys = jax.random.split(key, clients.index.shape[0])
        return jax.jit(jax.vmap(one))(keys, states, clients)

    # ------------------------------------------------------------------ final exchange (fedbayes.protocol)
    def final_message(self, key, server: ServerState) -> Params:
        """The estimate theta_bar (the averaged iterate), sent to every client."""
        return self.averaged_theta(server)

    def final_client(self, key, theta: Params, state: ClientState, client: ClientData):
        """The client's local posterior samples at theta_bar and its step size: kept by the client. With
        ``uncertainty``, its Louis terms from the same draws go back (:func:`louis.draws_information`: the
        mean score, d floats, and two upper triangles, d(d+1)/2 floats each); otherwise nothing."""
        k = client_key(key, client.index, self.num_clients)
        zs, step, acceptance = self._sample_one(k, theta, state, client, self.cfg.num_samples, self.cfg.warmup)
        # Louis' terms from the first chain only: it continues the client's training chain, at stationarity
        # after the rounds, while the others start overdispersed (for R-hat) and may still be on their way
        first = jax.tree_util.tree_map(lambda a: a[:1], zs)
        upload = louis.draws_information(self._fm, theta, first, client) if self.uncertainty else ()
        return {"local_samples": zs, "step_size": step, "acceptance": acceptance}, upload

    def final_server(self, key, server: ServerState, theta: Params, uploads, locals_) -> FitParts:
        """Averaged estimate, last iterate, (when collected) every client's local posterior samples, and
        with ``uncertainty`` Louis' observed information at theta_bar,

            I = -grad^2 log p(theta_bar) + sum_i (mean_m h_im - Cov_m g_im),

        its standard errors and normal approximation (draws shaped like the local chains), the
        Fisher-identity gradient g = grad log p(theta_bar) + sum_i G_i and its Monte Carlo covariance
        sum_i Var(G_i) (``uploads=None``, a client missing on a network: none of these)."""
        fm = self._fm
        parts = FitParts(
            theta=theta,
            params=fm.constrain(theta),
            params_last=fm.constrain(server.theta),
            settings={
                "server_optimizer": self.optimizer
                if isinstance(self.optimizer, str)
                else type(self.optimizer).__name__,
                "uncertainty": self.uncertainty,
                "local_metric": self.local_metric,
                "local_kernel": self.local_kernel,
                "batch_size": self._batches.size if self._batches.active else None,
                "step_scale": self.step_scale,
                **({} if callable(self.server_lr) else {"server_lr": self.server_lr}),
            },
        )
        if locals_ is not None:
            parts.local_samples = locals_["local_samples"]
            parts.client_info = {"step_size": locals_["step_size"], "acceptance": locals_["acceptance"]}
            if not self.cfg.local_noise:  # gradient steps: each client's "samples" are its fitted point
                parts.local_point = True
        if self.uncertainty and uploads is not None:
            out = self._uncertainty(key, theta, *uploads)
            stepped = out.pop("theta")
            if out.pop("one_step"):
                parts.update({"params_averaged": parts.params, "theta": stepped, "params": fm.constrain(stepped)})
            parts.update(out)
        if self._dp is not None:
            parts.privacy = self._dp.report()
        return parts

    def _uncertainty_jit(self) -> FitJitted:
        return run_jit(self, "uncertainty", lambda: self._uncertainty_arrays, once=0)

    def _uncertainty(self, key, theta: Params, grads, info_tris, cov_tris) -> dict[str, Any]:
        out = louis.finish_normal_approximation(self._uncertainty_jit()(key, theta, grads, info_tris, cov_tris))
        out["one_step"] = bool(out["one_step"])
        if not out.pop("positive_definite"):
            warnings.warn(
                f"FedSOUL: Louis' observed information at the estimate is not positive definite (smallest "
                f"eigenvalue {louis.smallest_eigenvalue(out['information']):.3g}), so the globals have no "
                "standard errors or normal approximation: the estimate is not at a maximum of the marginal "
                "likelihood (run more rounds) or the model is not identified there (e.g. a rotation of a "
                "latent subspace); the local posteriors are unaffected",
                ConvergenceWarning,
                stacklevel=2,
            )
        return out

    def _uncertainty_arrays(self, key, theta: Params, grads, info_tris, cov_tris) -> dict[str, Any]:
        """The traceable part of :meth:`_uncertainty` (one compilation, not one per operation): the
        information, the gradient at theta_bar with its noise, the one-step estimate ``theta`` (theta_bar
        itself where the step is not taken: ``one_step`` false) and the normal approximation about it."""
        fm, d = self._fm, self.dim
        flat, unravel = ravel_pytree(theta)
        prior_grad = ravel_pytree(jax.grad(fm.log_prior)(theta))[0]
        prior_info = -jax.hessian(lambda x: fm.log_prior(unravel(x)))(flat)
        information = prior_info + _symmetric(jnp.sum(info_tris, 0), d)
        gradient = prior_grad + jnp.sum(grads, 0)
        # a declared symmetry: the step and the approximation act across its orbit only (fedbayes.symmetry)
        _, lam, vec, pd = louis.information_eigen(information, symmetry.basis(fm, theta))
        pd = pd & jnp.all(jnp.isfinite(gradient))
        step = vec @ ((vec.T @ gradient) / jnp.where(pd, lam, 1.0))
        take = pd & (gradient @ step <= ONE_STEP_MAX) & self._one_step
        stepped = self._project(fm, unravel(jnp.where(take, flat + step, flat)))
        k_approx = jax.random.fold_in(key, 21)
        shape = (self.cfg.num_chains, self.cfg.num_samples)
        out = louis.normal_approximation_arrays(fm, k_approx, stepped, information, shape, symmetry.basis(fm, stepped))
        out.update(gradient=gradient, gradient_cov=_symmetric(jnp.sum(cov_tris, 0), d), theta=stepped, one_step=take)
        return out

    def finalize_ahead(self, key, carry, problem: Problem) -> None:
        """The final exchange's computations and, with ``uncertainty``, the server's Louis information compiled
        ahead (:func:`fedbayes.engine.final_exchange_ahead`)."""
        shapes = final_exchange_ahead(self, key, carry, problem)
        if shapes is not None and self.uncertainty:
            theta, uploads = shapes
            self._uncertainty_jit().ahead(key, theta, *uploads)

    def finalize(self, key, carry, problem: Problem, history: Mapping[str, np.ndarray] | None = None) -> FitParts:
        """The final exchange with every client (:func:`fedbayes.engine.final_exchange`)."""
        server, states, _ = carry
        parts = final_exchange(self, key, server, states, stack_clients(problem.data))
        if self._dp is not None and history is not None:  # with the rounds as they went (distributed mode)
            parts.privacy = self._dp.report(history.get("active"))
        return parts

    @property
    def sums_uploads(self) -> bool | str:  # type: ignore[override]  # FederatedRun's plain attribute, computed here
        """True for FedSOUL with distributed DP, whose server needs each round's uploads (the clipped, noised
        gradients) only summed, so that secure aggregation can hide them; otherwise why not."""
        return sums_only(
            self._dp,
            type(self) is FedSOULRun,
            f"{self.name}'s server reads each client's gradient (central DP clips each one), objective and, with "
            "Fisher scoring, information; secure aggregation runs FedSOUL with distributed DP "
            "(privacy=fb.privacy.DP(..., mode='distributed')), whose server needs the sum of the gradients alone",
        )

    def sample_new_client(self, key, theta: Params, client: ClientData, num_samples: int, warmup: int) -> Params:
        """Local posterior samples for a client unseen in training, from :meth:`_initial_state` (no server round
        trip). With the diagonal metric the client first adapts its kernel as a training client does, in
        ``warmup // local_steps`` rounds of its own (V, the anchor and the step; no upload), so that its
        metric is its posterior's and not the pilot draws' from the prior."""
        k_z, k_v, k_run = jax.random.split(key, 3)
        step = jnp.asarray(np.mean(self.cfg.step_size) if self.cfg.step_size is not None else 0.0)
        state = self._initial_state(k_z, k_v, theta, client, step)
        if self._diagonal and warmup >= self.cfg.local_steps:
            rounds = warmup // self.cfg.local_steps
            warm = jax.jit(self._warm_rounds, static_argnums=4)
            state = warm(jax.random.fold_in(k_run, 3), theta, state, client, rounds)
        batch = lambda t: jax.tree_util.tree_map(lambda a: a[None], t)  # noqa: E731
        zs, _, _ = self.sample_locals(k_run, theta, batch(state), batch(client), num_samples, warmup)
        return jax.tree_util.tree_map(lambda a: a[0].reshape((-1,) + a.shape[3:]), zs)


class FineTuneRun(FedSOULRun):
    """:class:`FineTune` bound to a model: FedRep's local rounds at shared sites that never move."""

    def client_settings(self, server_state: ServerState) -> Params:
        """The frozen shared sites, sent to every client once."""
        return server_state.theta

    def _broadcast(self, theta: Params) -> Message:
        return dense_message(())  # the clients hold the shared sites: nothing to send in a round

    def client_step(self, key, payload, state: ClientState, client: ClientData):
        """FedRep's local steps on the head at the frozen shared sites; nothing goes back."""
        state, _, _ = self._local_round(key, client.settings, state, client)
        return state, dense_message(())

    def server_step(self, key, state: ServerState, uploads: Message, info: RoundInfo):
        """Nothing to aggregate: the shared sites stay where the warm start put them."""
        return (
            state,
            self._broadcast(state.theta),
            {f"theta/{n}": v for n, v in self._fm.constrain(state.theta).items()},
        )


class LocalOnlyState(NamedTuple):
    """A :class:`LocalOnly` client's state: its chain, its own copy of the global sites with their
    optimiser (a :class:`ServerState` of its own), and the rounds it has taken part in."""

    chain: ClientState
    own: ServerState
    rounds: jax.Array


class LocalOnlyRun(FedSOULRun):
    """:class:`LocalOnly` bound to a model: each client runs FedRep with itself as the only client."""

    def setup_client(self, stage: int, key: jax.Array, theta: Params, state: Any, client: ClientData):
        """FedRep's chain start, and the client's own copy of theta_0 with a fresh optimiser; nothing back."""
        chain, _ = super().setup_client(stage, key, theta, state, client)
        own, _ = FedSOULRun.setup_server_step(self, stage, key, theta, None)
        return LocalOnlyState(chain, own, jnp.zeros((), jnp.int32)), ()

    def _broadcast(self, theta: Params) -> Message:
        return dense_message(())  # nothing is shared after the set-up

    def client_step(  # type: ignore[override]  # a LocalOnly client's state is its own (setup_client's)
        self, key, payload, state: LocalOnlyState, client: ClientData
    ):
        """One FedRep round at the client's own theta_i, then one optimiser step on theta_i (FedSOUL's
        server step with this client as the only, active, one); nothing goes back."""
        k_round, k_own = jax.random.split(key)
        chain, (sent, objective, tri), _ = self._local_round(k_round, state.own.theta, state.chain, client)
        one = lambda a: jnp.asarray(a)[None]  # noqa: E731
        uploads = Message(
            Upload(jax.tree_util.tree_map(one, decode_tree(sent)), one(objective), jax.tree_util.tree_map(one, tri)),
            jnp.zeros((), jnp.int32),
        )
        info = RoundInfo(
            round=state.rounds, cohort=jnp.zeros((1,), jnp.int32), active=jnp.ones((1,), bool), num_clients=1
        )
        own, _, _ = FedSOULRun.server_step(self, k_own, state.own, uploads, info)
        return LocalOnlyState(chain, own, state.rounds + 1), dense_message(())

    def server_step(self, key, state: ServerState, uploads: Message, info: RoundInfo):
        """Nothing to aggregate: the clients train alone."""
        return state, self._broadcast(state.theta), {}

    def final_message(self, key, server: ServerState) -> Any:
        """Nothing (an empty pytree): each client holds its own global sites."""
        return ()

    def final_client(  # type: ignore[override]  # a LocalOnly client's state is its own (setup_client's)
        self, key, theta: Any, state: LocalOnlyState, client: ClientData
    ):
        """The client's trained head at its own averaged theta_i, and theta_i itself as a local "sample"
        (repeated over chains and draws); both kept by the client, nothing back."""
        own = self.averaged_theta(state.own)
        kept, _ = super().final_client(key, own, state.chain, client)
        shape = jax.tree_util.tree_leaves(kept["local_samples"])[0].shape[:2]
        copies = jax.tree_util.tree_map(lambda a: jnp.broadcast_to(a, shape + a.shape), own)
        return {**kept, "local_samples": {**kept["local_samples"], **copies}}, ()

    def final_server(self, key, server: ServerState, theta: Params, uploads, locals_) -> FitParts:
        """``params``: the clients' own global sites averaged (in unconstrained space), a summary; each
        client's own in the local samples."""
        mean = server.theta
        if locals_ is not None:
            mean = {n: jnp.mean(locals_["local_samples"][n][:, 0, 0], 0) for n in self._fm.global_names}
        return super().final_server(key, server._replace(theta=mean), mean, None, locals_)

    def sample_new_client(self, key, theta: Params, client: ClientData, num_samples: int, warmup: int) -> Params:
        raise ConfigError(
            "LocalOnly fits each client alone: a client unseen in training has no model (fit it on "
            "its own data, e.g. fb.fed_fit on a FederatedData of that one client)"
        )


def _positive_steps(value: object) -> bool:
    """``value`` a finite positive real, or a non-empty 1-d sequence / array of them (no bools, no strings)."""
    if is_real(value):
        return 0 < value < np.inf
    if not (isinstance(value, (list, tuple)) or hasattr(value, "__array__")):
        return False
    try:
        entries = np.asarray(value, dtype=object)
    except (TypeError, ValueError):  # a ragged sequence
        return False
    return entries.ndim == 1 and entries.size > 0 and all(is_real(v) and 0 < v < np.inf for v in entries.tolist())


def _exact_diagonal(f: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
    """diag(-grad^2 f(x)) by one Hessian-vector product per coordinate (batches of ``METRIC_BATCH``)."""
    basis = jnp.eye(x.size, dtype=x.dtype)
    return jax.lax.map(lambda e: e @ hvp(f, x, e), basis, batch_size=METRIC_BATCH)


def diagonal_root(metric: jax.Array) -> jax.Array:
    """The diagonal metric's root R = diag(V)^{-1/2}, V floored at ``METRIC_FLOOR`` times its mean size."""
    return jax.lax.rsqrt(jnp.maximum(metric, METRIC_FLOOR * jnp.mean(jnp.abs(metric)) + 1e-30))
