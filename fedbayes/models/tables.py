"""A mixed model's fit as lme4 and statsmodels print it: fixed effects and variance components.

A model declares where its fixed effects and random-effect covariances live with a :class:`MixedLayout`
(``model.mixed_layout(data)``: :class:`fedbayes.FormulaModel` has one, and so has
:func:`fedbayes.models.linear_mixed_effects`). ``res.fixed_effects`` and ``res.variance_components``
then read the fit through it.

The variance components are functions of the global sites, c = f(theta): for a correlated block with
Cholesky factor L, Omega = L L^T, the standard deviations sqrt(Omega_jj) and the correlations
Omega_jk / sqrt(Omega_jj Omega_kk); for an uncorrelated block the sds themselves; for the gaussian family
the residual sd. Their standard errors are the delta method's,

    Var(c_hat) ~= J I^{-1} J^T,    J = d f(constrain(u)) / d u   at the estimate u_hat,

with I the observed information in the unconstrained coordinates u of the globals (``res.information``,
prior included) and the Jacobian by ``jax.jacfwd``. Sampling fits report the draws' mean and standard
deviation of c instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

__all__ = ["CovarianceBlock", "MixedLayout"]


@dataclass(frozen=True)
class CovarianceBlock:
    """One block of random effects: its covariance site, the design columns it covers, correlated or not.

    ``site`` holds the lower Cholesky factor of a dense ``q x q`` covariance (``correlated``), or the
    standard deviations of independent effects (a scalar or a vector of ``q``).
    """

    site: str
    columns: tuple[str, ...]
    correlated: bool


@dataclass(frozen=True)
class MixedLayout:
    """Where a mixed model keeps its fixed effects and variance components, with the names to print.

    Attributes
    ----------
    group:
        The grouping factor's name (the clients: ``"Subject"``).
    fixed:
        The fixed effects' term names, in the order of ``fixed_site``'s entries.
    blocks:
        The random effects' covariance blocks (:class:`CovarianceBlock`).
    fixed_site:
        The global site of the fixed-effect coefficients.
    residual:
        The global site of the residual standard deviation (gaussian family), or None.

    >>> import fedbayes as fb
    >>> block = fb.models.CovarianceBlock("scale_tril", ("Intercept", "Days"), correlated=True)
    >>> layout = fb.models.MixedLayout("Subject", ("Intercept", "Days"), (block,), residual="sigma")
    >>> layout.component_names()
    [('Subject', 'sd(Intercept)'), ('Subject', 'sd(Days)'), ('Subject', 'cor(Intercept, Days)'), ('Residual', 'sd')]
    """

    group: str
    fixed: tuple[str, ...]
    blocks: tuple[CovarianceBlock, ...]
    fixed_site: str = "beta"
    residual: str | None = None

    def component_names(self) -> list[tuple[str, str]]:
        """``(group, term)`` per variance component: each block's sds, then its correlations, then the
        residual sd."""
        names = []
        for block in self.blocks:
            names += [(self.group, f"sd({c})") for c in block.columns]
            if block.correlated:
                cols = block.columns
                names += [(self.group, f"cor({cols[k]}, {cols[j]})") for j in range(len(cols)) for k in range(j)]
        if self.residual is not None:
            names.append(("Residual", "sd"))
        return names

    def components(self, params: Mapping[str, Any]) -> jnp.ndarray:
        """The variance components of the constrained globals ``params``, in :meth:`component_names`'
        order (traceable: the delta method differentiates it)."""
        out = []
        for block in self.blocks:
            q = len(block.columns)
            value = jnp.asarray(params[block.site])
            if block.correlated:
                cov = value @ value.T
                sd = jnp.sqrt(jnp.diag(cov))
                corr = cov / jnp.outer(sd, sd)
                rows, cols = jnp.tril_indices(q, -1)  # (1, 0), (2, 0), (2, 1), ...: component_names' order
                out += [sd, corr[rows, cols]]
            else:
                out.append(jnp.broadcast_to(value, (q,)))
        if self.residual is not None:
            out.append(jnp.reshape(jnp.asarray(params[self.residual]), (1,)))
        return jnp.concatenate([jnp.ravel(o) for o in out])

    def fixed_values(self, params: Mapping[str, Any]) -> jnp.ndarray:
        """The fixed-effect coefficients of the constrained globals ``params``."""
        return jnp.ravel(jnp.asarray(params[self.fixed_site]))


def column_labels(data: Any, key: str, width: int) -> tuple[str, ...]:
    """The names of ``key``'s columns in ``data`` (its DataFrame's, :attr:`FederatedData.column_names`), or
    ``key[0]``, ``key[1]``, ... when it has none of the right number."""
    names = getattr(data, "column_names", {}).get(key, ())
    return tuple(names) if len(names) == width else tuple(f"{key}[{j}]" for j in range(width))
