"""A new federated algorithm written against fedbayes' protocol (fedbayes.protocol.FederatedRun).

Federated gradient ascent on the log posterior of a model's global sites: each round every client
sends grad log p(D_i | theta), the server adds the prior's gradient and steps,

    theta_{k+1} = theta_k + step_size * (grad log p(theta_k) + sum_i grad log p(D_i | theta_k)).

The same class runs vectorised in ``fb.fed_fit`` and message by message on Flower
(``fb.flower.simulate``), with its ledger, faults and convergence checks, and no change to either
(tests/test_protocol.py). Run ``python examples/protocol_toy.py`` to fit a Bayesian linear regression
and compare with its closed-form posterior mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

import fedbayes as fb
from fedbayes.protocol import FederatedRun, FitParts, Problem, dense_message


@dataclass(frozen=True)
class FedGradientAscent:
    """The user-facing configuration: its options, and ``build`` binding them to a problem."""

    step_size: float = 1e-3
    name: str = "FedGradientAscent"

    def build(self, problem: Problem) -> "FedGradientAscentRun":
        problem.model.require(self.name)
        return FedGradientAscentRun(self, problem.model)


class FedGradientAscentRun(FederatedRun):
    """The run: pure functions of pytrees for the set-up, the round and the end."""

    def __init__(self, cfg: FedGradientAscent, fm: fb.FedModel):
        self.cfg, self.fm, self.name = cfg, fm, cfg.name

    # set-up: theta_0 (the prior's centre) to every client; the clients keep no state and send nothing
    def setup_server(self, key):
        theta = self.fm.init_globals(key)
        return theta, theta

    def setup_client(self, stage, key, theta, state, client):
        return (), ()

    def setup_server_step(self, stage, key, theta, uploads):
        return theta, dense_message(theta)

    # a round: the client's gradient up (dense, 32 bits a float), the new theta down
    def client_step(self, key, theta, state, client):
        loglik = lambda t: self.fm.client_log_terms(t, {}, client.data, client.mask)[1]  # noqa: E731
        return state, dense_message(jax.grad(loglik)(theta))

    def server_step(self, key, theta, uploads, info):
        weight = jnp.where(info.active, info.num_clients / jnp.maximum(jnp.sum(info.active), 1), 0.0)
        total = jax.tree_util.tree_map(lambda g: jnp.tensordot(weight, g, axes=1), uploads.payload)
        grad = jax.tree_util.tree_map(jnp.add, jax.grad(self.fm.log_prior)(theta), total)
        theta = jax.tree_util.tree_map(lambda t, g: t + self.cfg.step_size * g, theta, grad)
        diagnostics = {f"theta/{n}": v for n, v in self.fm.constrain(theta).items()}
        return theta, dense_message(theta), diagnostics

    # the end: the estimate (unconstrained and constrained) for fb.Result
    def finalize(self, key, carry, problem, history=None):
        theta = carry[0]
        return FitParts(theta=theta, params=self.fm.constrain(theta), params_last=self.fm.constrain(theta))


def main() -> None:
    import numpy as np

    data, _ = fb.models.make_glm_clients(8, 3, 40, family="linear", seed=0)
    res = fb.fed_fit(fb.models.linear_regression(), data, FedGradientAscent(step_size=1e-3), num_rounds=300)
    pooled = data.pooled()
    x, y = np.asarray(pooled["x"], np.float64), np.asarray(pooled["y"], np.float64)
    exact = np.linalg.solve(x.T @ x + np.eye(3), x.T @ y)  # the posterior mode: prior N(0, I), noise sd 1
    print(res)
    print("federated gradient ascent:", np.round(res.params["w"], 5))
    print("closed-form posterior mode:", np.round(exact, 5))


if __name__ == "__main__":
    main()
