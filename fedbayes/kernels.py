"""Unadjusted Langevin algorithm (ULA): pure step functions and a NumPyro ``MCMCKernel``.

For a target density pi(x) proportional to exp(-U(x)), one ULA step with step size gamma is

    x' = x + gamma * grad log pi(x) + sqrt(2 gamma) * xi,      xi ~ N(0, I)

(FedPop Algorithm 1 line 14; the paper's prose has the sign of the drift wrong). ULA has no
Metropolis correction, so its stationary law pi_gamma is biased: for a Gaussian target
N(m, P^{-1}) it is exactly N(m, (P - gamma P^2 / 2)^{-1}) when gamma < 2 / lambda_max(P).
The mean is exact; the covariance is inflated by O(gamma).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel
from numpyro.infer.util import initialize_model
from numpyro.util import is_prng_key

from .errors import ConfigError

PyTree = Any


def tree_normal(key: jax.Array, tree: PyTree) -> PyTree:
    """Standard normal noise with the structure and dtypes of ``tree``."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    keys = jax.random.split(key, max(len(leaves), 1))
    noise = [jax.random.normal(k, jnp.shape(x), jnp.result_type(x)) for k, x in zip(keys, leaves)]
    return jax.tree_util.tree_unflatten(treedef, noise)


def ula_step(key: jax.Array, x: PyTree, grad_log_density: PyTree, step_size: jax.Array | float) -> PyTree:
    """One ULA move: ``x + step * grad log pi(x) + sqrt(2 step) * xi``, given the gradient at x."""
    noise = tree_normal(key, x)
    scale = jnp.sqrt(2.0 * step_size)
    return jax.tree_util.tree_map(lambda a, g, e: a + step_size * g + scale * e, x, grad_log_density, noise)


def ula_chain(
    key: jax.Array,
    x0: PyTree,
    grad_log_density: Callable[[PyTree], PyTree],
    step_size: jax.Array | float,
    num_steps: int,
) -> tuple[PyTree, PyTree]:
    """Run ``num_steps`` ULA moves from ``x0``; return the last state and the states x_1..x_n stacked."""

    def body(x, k):
        x = ula_step(k, x, grad_log_density(x), step_size)
        return x, x

    return jax.lax.scan(body, x0, jax.random.split(key, num_steps))


def preconditioned_ula_step(key: jax.Array, x: PyTree, grad_log_density: PyTree, step_size: jax.Array | float,
                            root: jax.Array) -> PyTree:
    """One ULA move with the constant preconditioner M = R R^T (``root`` R, (q, q) on the flattened x):

        x' = x + gamma M grad log pi(x) + sqrt(2 gamma) R xi,      xi ~ N(0, I_q),

    i.e. plain ULA on u with x = x_0 + R u, whose target's Hessian is R^T (grad^2 -log pi) R. For a
    Gaussian target N(m, P^{-1}) and R R^T = P^{-1} every direction has unit curvature, so the chain
    mixes in about 1 / gamma moves whatever P's condition number, and its stationary covariance is
    P^{-1} / (1 - gamma / 2) (the scalar case's bias, in the whitened coordinates)."""
    flat, unravel = ravel_pytree(x)
    g = ravel_pytree(grad_log_density)[0]
    xi = jax.random.normal(key, flat.shape, flat.dtype)
    return unravel(flat + step_size * (root @ (root.T @ g)) + jnp.sqrt(2.0 * step_size) * (root @ xi))


def power_iteration(
    hvp: Callable[[jax.Array], jax.Array], v0: jax.Array, num_iters: int
) -> tuple[jax.Array, jax.Array]:
    """Largest absolute eigenvalue of a symmetric operator given by its matrix-vector product.

    Returns ``(|lambda_max| estimate, unit eigenvector estimate)``; warm-start with the previous
    eigenvector to track a slowly changing Hessian with few iterations.
    """
    def body(_, carry):
        v, _lam = carry
        hv = hvp(v)
        lam = jnp.linalg.norm(hv)
        return jnp.where(lam > 0, hv / jnp.where(lam > 0, lam, 1.0), v), lam

    v0 = v0 / jnp.maximum(jnp.linalg.norm(v0), jnp.finfo(v0.dtype).tiny)
    v, lam = jax.lax.fori_loop(0, num_iters, body, (v0, jnp.zeros((), v0.dtype)))
    return lam, v


def curvature(log_density: Callable[[PyTree], jax.Array], x: PyTree, v0: jax.Array, num_iters: int):
    """``(lambda_max, v)`` of the Hessian of ``-log_density`` at ``x`` (flattened), by power iteration."""
    flat, unravel = ravel_pytree(x)
    grad_flat = lambda f: ravel_pytree(jax.grad(log_density)(unravel(f)))[0]  # noqa: E731

    def hvp(v):
        return -jax.jvp(grad_flat, (flat,), (v,))[1]

    return power_iteration(hvp, v0, num_iters)


class ULAState(NamedTuple):
    """State of :class:`ULA`: iteration, position, potential energy, its gradient and the PRNG key."""

    i: jax.Array
    z: PyTree
    potential_energy: jax.Array
    z_grad: PyTree
    rng_key: jax.Array


class ULA(MCMCKernel):
    """Unadjusted Langevin kernel for ``numpyro.infer.MCMC``.

    ``MCMC(fb.ULA(model, step_size=1e-3), num_warmup=..., num_samples=...)`` samples the model's
    latent sites in unconstrained space with the fixed step ``step_size`` (no adaptation, no
    Metropolis correction); ``arviz.from_numpyro`` converts the run.

    Parameters
    ----------
    model:
        A NumPyro model (or give ``potential_fn`` instead).
    potential_fn:
        ``U(x) = -log pi(x)`` on unconstrained values.
    step_size:
        gamma > 0.
    """

    sample_field = "z"

    def __init__(
        self,
        model: Callable | None = None,
        potential_fn: Callable | None = None,
        step_size: float = 1e-3,
        init_strategy: Callable = init_to_uniform,
    ):
        if (model is None) == (potential_fn is None):
            raise ConfigError("give exactly one of `model` or `potential_fn` to fb.ULA")
        if not (isinstance(step_size, (int, float)) and step_size > 0):
            raise ConfigError(f"ULA step_size must be a positive number, got {step_size!r}")
        self._model = model
        self._potential_fn = potential_fn
        self._step_size = float(step_size)
        self._init_strategy = init_strategy
        self._postprocess_fn = None

    @property
    def model(self) -> Callable | None:
        return self._model

    @property
    def default_fields(self) -> tuple[str, ...]:
        return ("z", "potential_energy")

    def _init_one(self, rng_key, init_params, model_args, model_kwargs):
        key_init, key = jax.random.split(rng_key)
        if self._model is not None:
            info, potential_fn_gen, postprocess_fn, _ = initialize_model(
                key_init, self._model, init_strategy=self._init_strategy, dynamic_args=True,
                model_args=model_args, model_kwargs=model_kwargs,
            )
            potential_fn = potential_fn_gen(*model_args, **model_kwargs)
            self._postprocess_fn = postprocess_fn
            z = info.z if init_params is None else init_params
        else:
            if init_params is None:
                raise ConfigError("fb.ULA with a potential_fn needs init_params")
            potential_fn = self._potential_fn
            z = init_params
        pe, grad = jax.value_and_grad(potential_fn)(z)
        return ULAState(jnp.zeros((), jnp.int32), z, pe, grad, key), potential_fn

    def init(self, rng_key, num_warmup, init_params, model_args, model_kwargs):
        if is_prng_key(rng_key):
            state, self._potential = self._init_one(rng_key, init_params, model_args, model_kwargs)
            return state
        # vectorised chains: one key per chain
        states = []
        for c in range(rng_key.shape[0]):
            p = None if init_params is None else jax.tree_util.tree_map(lambda a: a[c], init_params)
            st, self._potential = self._init_one(rng_key[c], p, model_args, model_kwargs)
            states.append(st)
        return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *states)

    def sample(self, state: ULAState, model_args, model_kwargs) -> ULAState:
        key, sub = jax.random.split(state.rng_key)
        drift = jax.tree_util.tree_map(jnp.negative, state.z_grad)
        z = ula_step(sub, state.z, drift, self._step_size)
        pe, grad = jax.value_and_grad(self._potential)(z)
        return ULAState(state.i + 1, z, pe, grad, key)

    def postprocess_fn(self, model_args, model_kwargs):
        if self._postprocess_fn is None:
            return lambda x: x
        return self._postprocess_fn(*model_args, **model_kwargs)

    def get_diagnostics_str(self, state: ULAState) -> str:
        return f"step size {self._step_size:.2e}"
