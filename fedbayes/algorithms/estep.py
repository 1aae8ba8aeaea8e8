"""The E-step sources of federated EM, adapted to one interface once, when FedMM is built.

FedMM (:mod:`fedbayes.algorithms.fedmm`) needs, per client, the expected complete-data statistic
S_i(theta) = E[S(D_i, h) | D_i, theta] summed over the client's rows, and at the server the M-step
map T(s) and the projection onto the statistics' valid set. Three sources provide them:

* :class:`ExactEStep`: a model whose conditional law of the latents is known in closed form
  (enumerated discrete latents, Gaussian latents of linear-Gaussian terms), derived by
  :func:`fedbayes.algorithms.expfam.derive`;
* :class:`MonteCarloEStep`: non-Gaussian continuous per-client latents: the statistic is averaged over
  the kept draws of a ULA chain on the client's latents (stochastic EM; the chain and its step live in
  the client state);
* :class:`UserEStep`: S and T written by hand (:class:`fedbayes.CustomStatistics`), evaluated
  rather than traced when the statistic's layout is needed, and without Louis' information.

The run asks a source for what it does (``chain``, ``traceable``, ``louis``) instead of testing its type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from .expfam import CustomStatistics, Derived
from ..kernels import curvature, ula_chain
from ..introspect import FedModel, Params
from ..protocol import ClientData


@dataclass(frozen=True)
class ExactEStep:
    """The closed-form E-step of a derived model; T and the projection from the same derivation."""

    stats: Derived
    fm: FedModel

    chain = False  # no Langevin chain on the clients' latents
    traceable = True  # the statistic's layout can be traced from shapes alone
    louis = True  # Louis' information (the final exchange) is available

    def start(self, key: jax.Array, theta_u: Params, client: ClientData) -> tuple[Any, jax.Array]:
        """The client's chain state and step at set-up (none: an empty state and a zero step)."""
        return {}, jnp.zeros(())

    def e_step(
        self, theta_u: Params, client: ClientData, z: Any, step: jax.Array, key: jax.Array
    ) -> tuple[jax.Array, Any]:
        """(S_i(theta) flattened, summed over the client's rows; the chain state)."""
        total, _ = self.stats.e_step(theta_u, client.data, client.mask)
        return ravel_pytree(total)[0], z

    def template(self, theta_u: Params, client: ClientData) -> Any:
        """A statistic with the structure of S_i (its layout fixes the flattening)."""
        return self.stats.e_step(theta_u, client.data, client.mask)[0]

    def m_step(self, s: Any, theta_u: Params, prior_weight: Any = None) -> Params:
        """T(s), unconstrained (the prior counted with ``prior_weight``; None: once)."""
        if prior_weight is None:
            return self.stats.m_step(s, theta_u)
        return self.stats.m_step(s, theta_u, prior_weight=prior_weight)

    def project(self, s: Any) -> Any:
        return self.stats.project(s)

    def population_sites(self, given: set[str]) -> tuple[str, ...]:
        """Fixed-effect sites a least-squares pass on the non-personalised model can start (not ``given``)."""
        if not self.stats.has_population_start:
            return ()
        return tuple(n for lin in self.stats.linears for n in lin.coef_sites if n not in given)


@dataclass(frozen=True)
class MonteCarloEStep(ExactEStep):
    """Stochastic EM: S_i averaged over the last ``langevin_steps - burn_in`` states of a ULA chain on the
    client's latents, continued from round to round (its step: ``langevin_step``, or 0.1 / lambda_max of
    the Hessian of -log p(D_i, z | theta_0) at the chain's start)."""

    langevin_steps: int = 0
    burn_in: int = 0
    langevin_step: float | None = None

    chain = True

    def start(self, key: jax.Array, theta_u: Params, client: ClientData) -> tuple[Any, jax.Array]:
        z0 = self.fm.sample_local_prior(key, theta_u, client.data, client.mask)
        if self.langevin_step is not None:
            return z0, jnp.asarray(float(self.langevin_step))
        log_density = lambda zz: self.fm.client_log_joint(theta_u, zz, client.data, client.mask)  # noqa: E731
        lam, _ = curvature(log_density, z0, jnp.ones(ravel_pytree(z0)[0].shape), 50)
        return z0, 0.1 / lam

    def e_step(self, theta_u, client, z, step, key):
        keep = self.langevin_steps - self.burn_in
        score = lambda zz: self.fm.local_score(theta_u, zz, client.data, client.mask)  # noqa: E731
        z, states = ula_chain(key, z, score, step, self.langevin_steps)
        kept = jax.tree_util.tree_map(lambda a: a[-keep:], states)
        theta_c = self.fm.constrain(theta_u)
        per = jax.vmap(
            lambda zz: ravel_pytree(
                self.stats.complete_stats(theta_c, self.fm.constrain(zz), client.data, client.mask)
            )[0]
        )(kept)
        return jnp.mean(per, 0), z

    def template(self, theta_u, client):
        return self.stats.complete_stats(
            self.fm.constrain(theta_u), self.fm.constrain(self.fm.zeros_local()), client.data, client.mask
        )


@dataclass(frozen=True)
class UserEStep:
    """A user's S and T (:class:`fedbayes.CustomStatistics`, on constrained values)."""

    stats: CustomStatistics
    fm: FedModel

    chain = False
    traceable = False  # a user's statistics may not be traceable: the layout is evaluated
    louis = False

    def start(self, key, theta_u, client):
        return {}, jnp.zeros(())

    def e_step(self, theta_u, client, z, step, key):
        total = self.stats.e_step(self.fm.constrain(theta_u), client.data, client.mask)
        return ravel_pytree(total)[0], z

    def template(self, theta_u, client):
        return self.stats.e_step(self.fm.constrain(theta_u), client.data, client.mask)

    def m_step(self, s, theta_u, prior_weight=None):
        """The user's T; the prior is theirs to include (``prior_weight`` is not used)."""
        return self.fm.unconstrain(self.stats.m_step(s))

    def project(self, s):
        return s if self.stats.project is None else self.stats.project(s)

    def population_sites(self, given):
        return ()


def e_step_source(stats: Derived | CustomStatistics, fm: FedModel, cfg: Any) -> ExactEStep | UserEStep:
    """The source for a derivation or a user's statistics, with FedMM's chain options ``cfg``."""
    if isinstance(stats, CustomStatistics):
        return UserEStep(stats, fm)
    if stats.latent_mode == "monte_carlo":
        return MonteCarloEStep(stats, fm, cfg.langevin_steps, cfg.burn_in, cfg.langevin_step)
    return ExactEStep(stats, fm)
