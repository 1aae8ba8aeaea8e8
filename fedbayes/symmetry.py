"""Declared symmetries of a model: transformations of the globals that leave the likelihood unchanged.

Some models identify their globals only up to a group of transformations. FedPop's low-rank model
y = x^T phi z_i with z_i ~ N(mu, sigma^2 I) is unchanged by phi -> c phi R, mu -> R^T mu / c,
sigma -> sigma / c (R orthogonal, c > 0): the data identify the column space of phi and the
predictions, not phi itself. At an estimate theta, the orbit's tangent vectors t_1..t_r (in the
unconstrained coordinates of the globals) are directions of zero curvature:

    I t_j = 0,    g . t_j = 0    (I the information, g the gradient of the marginal likelihood),

so the information is singular, the Newton decrement g' I^-1 g and Louis' standard errors do not exist,
and a trace that drifts along the orbit looks like an estimate that has not settled. A model that
declares its symmetry (:class:`Symmetry`) has all three judged on what the data identify:

* the information is restricted to the orthogonal complement of the tangents, with basis B:
  I_B = B^T I B. The normal approximation is N(theta, B I_B^-1 B^T): the gauge that moves
  orthogonally to the orbit (standard errors of a coordinate that the symmetry moves, such as an
  entry of phi, are those of that gauge);
* the decrement is g' B I_B^-1 B^T g, the distance to the optimum across the orbit;
* each round of the trace is first moved along the orbit to the estimate (Gauss-Newton on the
  group's coordinates, in standard-error units), so only drift across the orbit counts;
* the gradient's component along the tangents is checked against its Monte Carlo noise: a declared
  transformation that is not a symmetry of the likelihood shows there (the ``symmetry`` row of
  ``res.diagnostics``).

A declaration must be exact for the log-likelihood and the priors of the globals together (a prior that
breaks the symmetry identifies the globals, weakly: then declare nothing).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from .errors import ModelError

Params = dict[str, jax.Array]

ALIGN_STEPS = 12
"""Gauss-Newton steps that move each round of a trace along the orbit to the estimate."""


@dataclasses.dataclass(frozen=True)
class Symmetry:
    """A group of transformations of the global sites that leaves every client's likelihood unchanged.

    ``action(params, a)`` maps the constrained globals ``{site: value}`` and group coordinates ``a`` (a
    vector of ``dim`` numbers) to transformed globals (the sites it changes; the others are kept), with
    ``action(params, 0) == params``. ``dim`` is an int or a function of the constrained globals (e.g. of
    a latent dimension set by a model keyword). The fit differentiates the action at a = 0 for the
    orbit's tangents and uses it at other ``a`` to align the trace (:mod:`fedbayes.symmetry`).

    A ``Symmetry`` is also a decorator: it sets the model's ``symmetry`` attribute and returns the model.

    >>> import jax.numpy as jnp, numpyro, numpyro.distributions as dist
    >>> import fedbayes as fb
    >>> product = fb.Symmetry(
    ...     lambda p, t: {"a": p["a"] * jnp.exp(t[0]), "b": p["b"] * jnp.exp(-t[0])}, dim=1, name="a b fixed"
    ... )
    >>> @product
    ... def model(x, y=None):  # the data identify a * b only
    ...     a, b = numpyro.param("a", 1.0), numpyro.param("b", 2.0)
    ...     with numpyro.plate("obs", x.shape[0]):
    ...         numpyro.sample("y", dist.Normal(a * b * x, 1.0), obs=y)
    >>> model.symmetry.name
    'a b fixed'
    """

    action: Callable[[Mapping[str, Any], jax.Array], Mapping[str, Any]]
    dim: int | Callable[[Mapping[str, Any]], int]
    name: str = "the model's symmetry"

    def __post_init__(self) -> None:
        if not callable(self.action):
            raise ModelError(f"Symmetry action must be callable (params, a) -> params, got {self.action!r}")
        if not callable(self.dim) and (isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1):
            raise ModelError(f"Symmetry dim must be a positive int or a function of the globals, got {self.dim!r}")

    def __call__(self, model: Callable) -> Callable:
        """Declare this symmetry on ``model`` (sets ``model.symmetry``; the same model is returned)."""
        model.symmetry = self  # type: ignore[attr-defined]
        return model

    def size(self, params: Mapping[str, Any]) -> int:
        """The group's dimension r at these globals."""
        r = self.dim(params) if callable(self.dim) else self.dim
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 1:
            raise ModelError(f"{self.name}: dim must give a positive int, got {r!r}")
        return int(r)


def of(model: Any) -> Symmetry | None:
    """The symmetry a model declares (its ``symmetry`` attribute), or None."""
    sym = getattr(model, "symmetry", None)
    if sym is not None and not isinstance(sym, Symmetry):
        raise ModelError(
            f"the model's symmetry attribute must be a fb.Symmetry, got {type(sym).__name__}: declare it with "
            "@fb.Symmetry(action, dim)"
        )
    return sym


def _moved(fm: Any, sym: Symmetry, theta_u: Params, a: jax.Array) -> jax.Array:
    """The flat unconstrained globals after the action ``a`` (ravel_pytree order of ``theta_u``)."""
    params = fm._constrain(theta_u)
    out = dict(params)
    out.update(sym.action(params, a))
    return ravel_pytree(fm._unconstrain({k: out[k] for k in theta_u}))[0]


def validate(fm: Any, sym: Symmetry, theta_u: Params) -> None:
    """Refuse a declaration whose action fails, changes other sites or shapes, or is not the identity at 0."""
    params = fm._constrain(theta_u)
    try:
        r = sym.size(params)
        out = sym.action(params, jnp.zeros(r))
    except ModelError:
        raise
    except Exception as err:
        raise ModelError(f"{sym.name}: its action(params, a) failed on the starting globals: {err!r}") from err
    if not isinstance(out, Mapping) or set(out) - set(params):
        raise ModelError(
            f"{sym.name}: its action must return a dict of global sites {sorted(params)}, got "
            f"{sorted(out) if isinstance(out, Mapping) else type(out).__name__}"
        )
    for k, v in out.items():
        v = jnp.asarray(v)
        if v.shape != jnp.shape(params[k]):
            raise ModelError(f"{sym.name}: its action changed the shape of '{k}' to {v.shape}")
        if not np.allclose(np.asarray(v), np.asarray(params[k]), rtol=1e-6, atol=1e-9):
            raise ModelError(f"{sym.name}: action(params, 0) must return the params unchanged; '{k}' changed")


def tangents(fm: Any, sym: Symmetry, theta_u: Params) -> jax.Array:
    """The orbit's tangent vectors at ``theta_u``, (d, r), in the flat unconstrained coordinates (traceable)."""
    r = sym.size(fm._constrain(theta_u))
    return jax.jacfwd(lambda a: _moved(fm, sym, theta_u, a))(jnp.zeros(r, ravel_pytree(theta_u)[0].dtype))


def complement(tangent: jax.typing.ArrayLike) -> jax.Array:
    """An orthonormal basis (d, d - r) of the orthogonal complement of the columns of ``tangent`` (d, r):
    the eigenvectors of I - T (T^T T)^-1 T^T with eigenvalue 1 (traceable; r static)."""
    tangent = jnp.asarray(tangent)
    d, r = tangent.shape
    gram = tangent.T @ tangent
    proj = jnp.eye(d, dtype=tangent.dtype) - tangent @ jnp.linalg.solve(gram, tangent.T)
    _, vec = jnp.linalg.eigh(0.5 * (proj + proj.T))
    return vec[:, r:]


def basis(fm: Any, theta_u: Params) -> jax.Array | None:
    """The complement's basis at ``theta_u`` for a model with a declared symmetry, else None (traceable)."""
    sym = getattr(fm, "symmetry", None)
    return None if sym is None else complement(tangents(fm, sym, theta_u))


def align(fm: Any, sym: Symmetry, thetas_u: Params, reference_u: Params, scale: Any = None) -> Params:
    """Move each of ``thetas_u`` ``{site: (n, ...)}`` along the orbit to the point nearest ``reference_u``.

    For each row, a = argmin_a |(u(a) - u_ref) / scale|^2 with u(a) the flat unconstrained globals after
    the action (Gauss-Newton, :data:`ALIGN_STEPS` steps from a = 0); ``scale`` (flat, d) defaults to 1.
    Returns the moved globals, unconstrained, shaped as ``thetas_u``."""
    ref, unravel = ravel_pytree(reference_u)
    w = jnp.ones_like(ref) if scale is None else 1.0 / jnp.asarray(scale, ref.dtype)
    r = sym.size(fm._constrain(reference_u))

    def one(theta):
        def resid(a):
            return (_moved(fm, sym, theta, a) - ref) * w

        def step(a, _):
            jac = jax.jacfwd(resid)(a)
            da = jnp.linalg.lstsq(jac, resid(a))[0]
            return a - da, None

        a, _ = jax.lax.scan(step, jnp.zeros(r, ref.dtype), None, length=ALIGN_STEPS)
        return unravel(_moved(fm, sym, theta, a))

    return jax.jit(jax.vmap(one))(thetas_u)
