"""Unadjusted Langevin algorithm (ULA): pure step functions and a NumPyro ``MCMCKernel``.

For a target density pi(x) proportional to exp(-U(x)), one ULA step with step size gamma is

    x' = x + gamma * grad log pi(x) + sqrt(2 gamma) * xi,      xi ~ N(0, I)

(FedPop Algorithm 1 line 14; the paper's prose has the sign of the drift wrong). ULA has no
Metropolis correction, so its stationary law pi_gamma is biased: for a Gaussian target
N(m, P^{-1}) it is exactly N(m, (P - gamma P^2 / 2)^{-1}) when gamma < 2 / lambda_max(P).
The mean is exact; the covariance is inflated by O(gamma).
"""

from __future__ import annotations

from typing import Any, NamedTuple
from collections.abc import Callable

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


TAME = 4.0
"""The taming threshold kappa of :func:`langevin_move` with ``tame=True``: the drift gamma R^T grad log pi
is shortened to at most ``TAME * sqrt(2 gamma q)`` (q coordinates), a tamed Langevin move (Brosse,
Durmus, Moulines and Sabanis 2019) whose threshold sits where the drift is many times longer than the
noise. At a step where ULA is stable the threshold is reached only far from the mode (for a Gaussian
target with unit curvature in the coordinates u, at |u - m| > TAME sqrt(2 q / gamma), beyond
18 sqrt(q) standard deviations at gamma = 0.1 and 5.7 sqrt(q) at gamma = 1, FedSOUL's MALA default; MALA's
stationary law is exact whatever the threshold, since the taming is a function of the state), so the
stationary law is unchanged; far out, where a
gradient growing faster than linearly (an exp link: Poisson rates, log-normal scales) would make the
move overshoot and overflow (or, under MALA, be rejected again and again), each move goes at most that
far towards the mode. The price: a chain started hundreds of standard deviations out (a random effect
in ms drawn from a unit-scale prior) crawls there at about 2.5 whitened units per move at gamma = 0.1 (5.7 at gamma =
1). Tried: 50,
which lets such chains jump but leaves MALA chains under an exp link stuck on rejected overshoots."""


def _tame_factor(drift: jax.Array, step_size: jax.Array | float, kappa: float) -> jax.Array:
    """The factor in (0, 1] that shortens the flat ``drift`` to at most ``kappa`` times the typical
    length of the move's noise, ``kappa sqrt(2 gamma q)`` (q coordinates; both measured in the
    coordinates where the noise is N(0, 2 gamma I)); 1 for a non-finite drift (the caller rejects it)."""
    norm = jnp.sqrt(jnp.sum(drift * drift))
    cap = kappa * jnp.sqrt(2.0 * step_size * drift.size)
    return jnp.where(jnp.isfinite(norm) & (norm > cap), cap / jnp.where(norm > 0, norm, 1.0), 1.0)


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


class LangevinPoint(NamedTuple):
    """A Langevin chain's state with what the next move needs: ``log_density`` log pi(x) (up to a
    constant), ``grad`` grad log pi(x), and ``aux``, anything else the caller evaluated at x."""

    x: PyTree
    log_density: jax.Array
    grad: PyTree
    aux: Any = ()


class MoveKeys(NamedTuple):
    """The two keys a Langevin move splits its key into (the noise's, the acceptance's), split ahead."""

    noise: jax.Array
    accept: jax.Array


def move_keys(keys: jax.Array) -> MoveKeys:
    """``jax.random.split`` of each key of ``keys`` (a chain's moves' keys, stacked) as the moves' pairs of
    keys, for :func:`langevin_move`: the same bits, in one batched key hash for the whole chain where each move
    would hash its own (on a CPU every call of JAX's key hash is a loop of its own of some 75 small operations,
    and a local chain makes ten or more moves a round)."""
    halves = jax.vmap(jax.random.split)(keys)
    return MoveKeys(halves[:, 0], halves[:, 1])


def apply_root(root: jax.Array, u: jax.Array, transpose: bool = False) -> jax.Array:
    """R u (R^T u with ``transpose``) for a metric's root R given as a (q, q) matrix or as the (q,) diagonal
    of a diagonal one."""
    if root.ndim == 1:
        return root * u
    return root.T @ u if transpose else root @ u


def langevin_move(
    key: jax.Array | MoveKeys,
    point: LangevinPoint,
    evaluate: Callable[[PyTree], tuple[Any, PyTree, Any]],
    step_size: jax.Array | float,
    root: jax.Array | None = None,
    *,
    adjusted: bool = False,
    tame: bool = False,
    noise: bool = True,
    noise_factor: jax.Array | None = None,
) -> tuple[LangevinPoint, jax.Array]:
    """One Langevin move from ``point``, Metropolis-adjusted (MALA) or not (ULA).

    The proposal is, in the coordinates u with x = x_0 + R u (R = ``root``: a (q, q) matrix, a (q,) vector
    standing for the diagonal matrix diag(root), or the identity when None),

        u' = u + D(x) + sqrt(2 gamma) xi,     D(x) = gamma R^T grad log pi(x),     xi ~ N(0, I_q),

    with D shortened to at most ``TAME * sqrt(2 gamma q)`` when ``tame`` (see :data:`TAME`). ULA
    (``adjusted=False``) takes it; MALA accepts it with probability

        min(1, pi(x') q(x | x') / (pi(x) q(x' | x))),   log q(x' | x) = -|u' - u - D(x)|^2 / (4 gamma) + c,

    whose stationary law is pi exactly, whatever gamma (the taming is a deterministic function of the
    state, so the ratio stays exact). ``evaluate(x')`` returns ``(log pi(x'), grad log pi(x'), aux)``. A
    proposal at which anything is non-finite is rejected in both cases (the chain stays). Returns the
    new point and the acceptance probability (1 for an accepted ULA move, 0 for a non-finite one).

    ``noise=False`` drops the noise term: the move is a (preconditioned) gradient-ascent step
    u' = u + D(x), taken unadjusted (FedRep's local training, :class:`fedbayes.FedRep`).

    ``noise_factor`` (ULA only): f, per coordinate of u (a scalar or a (q,) vector), the injected noise
    becomes sqrt(2 gamma) f xi. A caller that knows the move's own excess variance (ULA's discretisation, a
    stochastic gradient's error) shrinks the noise by it (:class:`fedbayes.FedSOUL`'s rounds).

    ``key`` is split in two, the noise's and the acceptance's; a :class:`MoveKeys` (:func:`move_keys`) gives
    the two halves split ahead, the same bits."""
    flat, unravel = ravel_pytree(point.x)
    k_noise, k_accept = (key.noise, key.accept) if isinstance(key, MoveKeys) else jax.random.split(key)

    def drift(grad):
        g = ravel_pytree(grad)[0]
        d = step_size * (g if root is None else apply_root(root, g, transpose=True))
        return d * _tame_factor(d, step_size, TAME) if tame else d

    xi = jax.random.normal(k_noise, flat.shape, flat.dtype)
    if noise_factor is not None and adjusted:
        raise ValueError("noise_factor changes an unadjusted move (ULA): MALA's proposal density assumes 2 gamma")
    scale = jnp.sqrt(2.0 * step_size) if noise_factor is None else jnp.sqrt(2.0 * step_size) * noise_factor
    du = drift(point.grad) + scale * xi if noise else drift(point.grad)
    x_new = unravel(flat + (du if root is None else apply_root(root, du)))
    new = LangevinPoint(x_new, *evaluate(x_new))
    finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in jax.tree_util.tree_leaves(new)]))
    if adjusted:
        back = du + drift(new.grad)
        log_ratio = (
            new.log_density - point.log_density - jnp.sum(back * back) / (4.0 * step_size) + 0.5 * jnp.sum(xi * xi)
        )
        prob = jnp.where(finite & ~jnp.isnan(log_ratio), jnp.exp(jnp.minimum(log_ratio, 0.0)), 0.0)
        accept = jax.random.uniform(k_accept, (), flat.dtype) < prob
    else:
        prob = finite.astype(flat.dtype)
        accept = finite
    return jax.tree_util.tree_map(lambda a, b: jnp.where(accept, a, b), new, point), prob


def backtrack(
    f: Callable[[jax.Array], jax.Array], x: jax.Array, d: jax.Array, fx: jax.Array, num: int = 11
) -> jax.Array:
    """x + 2^-j d for the first j in 0..num-1 at which f is finite and no lower than ``fx`` = f(x); x
    itself if there is none (or ``fx`` is not finite). Flat x and d; the candidates are evaluated at once."""
    alphas = 2.0 ** -jnp.arange(num, dtype=x.dtype)
    cand = x + alphas[:, None] * d
    fc = jax.vmap(f)(cand)
    good = jnp.isfinite(fc) & (fc >= fx) & jnp.all(jnp.isfinite(cand), axis=1)
    j = jnp.argmax(good)
    return jnp.where(good[j] & jnp.isfinite(fx), cand[j], x)


def newton_root(f: Callable[[jax.Array], jax.Array], x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """At flat x: ``(R, d, ok)`` with R R^T = H^{-1}, H = -grad^2 f(x) (LAPACK-free Cholesky; R is the
    identity where H is not positive definite, ``ok`` False), and the Newton direction d = H^{-1} grad f(x)
    (where H is not positive definite: the gradient divided by ||H||_F, a step no longer than the inverse of
    the largest curvature)."""
    from .linalg import lapack_free_cholesky, lapack_free_tril_inverse

    g = jax.grad(f)(x)
    h = -jax.hessian(f)(x)
    chol = lapack_free_cholesky(0.5 * (h + h.T))
    ok = jnp.all(jnp.isfinite(chol)) & jnp.all(jnp.diagonal(chol) > 0)
    eye = jnp.eye(x.size, dtype=x.dtype)
    root = jnp.where(ok, lapack_free_tril_inverse(jnp.where(ok, chol, eye)).T, eye)
    frob = jnp.sqrt(jnp.sum(h * h))
    d = jnp.where(ok, root @ (root.T @ g), g / jnp.where(frob > 0, frob, 1.0))
    return root, jnp.where(jnp.isfinite(d), d, 0.0), ok


def newton_mode(log_density: Callable[[PyTree], jax.Array], x0: PyTree, num_iters: int = 20) -> PyTree:
    """The mode of a (locally log-concave) density from ``x0`` by damped Newton iterations: each moves
    along :func:`newton_root`'s direction by :func:`backtrack` (halving until the log-density is finite
    and no lower). Dense Hessians, for small q: O(q^3) per iteration."""
    flat0, unravel = ravel_pytree(x0)
    f = lambda flat: log_density(unravel(flat))  # noqa: E731

    def body(x, _):
        _, d, _ = newton_root(f, x)
        return backtrack(f, x, d, f(x)), None

    x, _ = jax.lax.scan(body, flat0, None, length=num_iters)
    return unravel(x)


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


def hvp(f: Callable[[jax.Array], jax.Array], x: jax.Array, u: jax.Array) -> jax.Array:
    """H u for H = -grad^2 f(x) (flat x), by forward-over-reverse differentiation."""
    return -jax.jvp(jax.grad(f), (x,), (u,))[1]


def curvature(log_density: Callable[[PyTree], jax.Array], x: PyTree, v0: jax.Array, num_iters: int):
    """``(lambda_max, v)`` of the Hessian of ``-log_density`` at ``x`` (flattened), by power iteration."""
    flat, unravel = ravel_pytree(x)
    return power_iteration(lambda v: hvp(lambda f: log_density(unravel(f)), flat, v), v0, num_iters)


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
                key_init,
                self._model,
                init_strategy=self._init_strategy,
                dynamic_args=True,
                model_args=model_args,
                model_kwargs=model_kwargs,
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
