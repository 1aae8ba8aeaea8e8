"""NumPyro model introspection: site roles, per-client log joint, Fisher-identity gradients.

A user writes a NumPyro model of *one* client's data and calls it as ``model(**client_data)``.
Tracing it once classifies every site:

* ``global`` -- an unobserved ``sample`` site outside ``fb.local()`` and outside any data plate:
  a global parameter with a prior ``p(theta)``;
* ``param`` -- a ``numpyro.param`` site: a global parameter without prior;
* ``local`` -- an unobserved ``sample`` site under ``fb.local()``: a per-client latent ``z_i``
  with population prior ``p(z_i | theta)``; it never leaves the client;
* ``obs_latent`` -- an unobserved ``sample`` site inside a data plate (e.g. mixture labels);
* ``observed`` -- an observed site (including ``numpyro.factor``): the client's likelihood.

``numpyro.deterministic`` sites are none of these: they record values the model computes
(:class:`Deterministic`), never enter a log-density, and may have the data's length anywhere.

A *data plate* is a plate whose size follows the number of observations; it is found by tracing
the model at two data lengths. Clients are padded to a common length and the padded rows are
masked out of every site inside a data plate, so padding never changes a log-density.

Everything works in unconstrained space (NumPyro's ``biject_to`` transforms). For a client,

    log p(D_i, z_i | theta) = log p(z_i | theta) + log p(D_i | theta, z_i)

and the Fisher identity (FedPop eqs. 8-11) gives the marginal-likelihood gradient as a posterior
expectation,

    grad_theta log p(D_i | theta) = E_{z ~ p(z | D_i, theta)} [ grad_theta log p(D_i, z | theta) ].

The global prior ``log p(theta)`` is kept apart and counted once overall by the algorithms.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import types
import warnings
import zlib
import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar, cast
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal
import numpyro
import numpyro.distributions as dist
from numpyro import handlers
from numpyro.distributions import biject_to
from numpyro.distributions.transforms import IdentityTransform, Transform
from numpyro.primitives import Messenger

from .data import FederatedData
from .engine import fit_jit
from .errors import ModelError
from . import symmetry as _symmetry

Params = dict[str, jax.Array]

_F = TypeVar("_F", bound=Callable[..., Any])
_NUMPYRO_LOCK = threading.RLock()


def serialized(fn: _F) -> _F:
    """Run ``fn`` holding the lock that serialises fedbayes' use of NumPyro across threads.

    NumPyro keeps its effect-handler stack in one module-level list, so two threads running models
    at once see each other's handlers (``all sites must have unique names``). Every public entry
    point that runs a model (``fed_fit``, ``resume``, predictions, references) holds this re-entrant
    lock: fits started from several threads run one after another and each gives its serial result.
    Run fits in parallel in separate processes.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with _NUMPYRO_LOCK:
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


_LOCAL_FLAG = "fedbayes_local"


class local(Messenger):
    """Context manager marking the sample sites inside it as per-client latents.

    Such sites are sampled on the client (e.g. by Langevin steps) and never sent to the server.

    >>> import numpy as np, numpyro, numpyro.distributions as dist, fedbayes as fb
    >>> def model(y):
    ...     tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    ...     with fb.local():
    ...         b = numpyro.sample("b", dist.Normal(0.0, tau))
    ...     with numpyro.plate("obs", y.shape[0]):
    ...         numpyro.sample("y", dist.Normal(b, 1.0), obs=y)
    >>> fm = fb.FedModel(model, fb.FederatedData({"y": [np.zeros(3), np.ones(2)]}))
    >>> fm.global_names, fm.local_names
    (('tau',), ('b',))
    """

    def process_message(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "sample":
            msg["infer"] = {**(msg.get("infer") or {}), _LOCAL_FLAG: True}


class _BernoulliLogits(dist.BernoulliLogits):
    """``Bernoulli(logits=x)`` with NumPyro's log-density, evaluated so that its derivatives are right
    at x = 0.

    NumPyro computes ``-(clip(x, 0) + log1p(exp(-|x|)) - x y)``, whose autodiff gradient at x = 0 is
    ``y`` instead of ``y - 1/2`` (``clip`` and ``abs`` take one-sided derivatives there). Every logit of
    a logistic model is exactly 0 at the deterministic start (coefficients at their prior mean 0), so a
    gradient there would be off by half a count per observation: Newton's and gradient descent's first
    step would go uphill. ``x y - logaddexp(x, 0)`` is the same value (the same operations, to rounding)
    and ``logaddexp`` carries the exact derivative (sigmoid).
    """

    def log_prob(self, value):
        x = self.logits
        finite = jnp.isfinite(x)
        safe = jnp.where(finite, x, 0.0)
        smooth = safe * value - jnp.logaddexp(safe, 0.0)
        return jnp.where(finite, smooth, super().log_prob(value))


def _smooth_logits(fn: Any) -> Any:
    """``fn`` with every ``Bernoulli(logits=...)`` in it (through expand / to_event / mask) replaced by
    :class:`_BernoulliLogits`; any other distribution unchanged."""
    if type(fn) is dist.BernoulliLogits:
        return _BernoulliLogits(logits=fn.logits, validate_args=fn._validate_args)
    if isinstance(fn, dist.ExpandedDistribution):
        base = _smooth_logits(fn.base_dist)
        return fn if base is fn.base_dist else base.expand(fn.batch_shape)
    if isinstance(fn, dist.Independent):
        base = _smooth_logits(fn.base_dist)
        return fn if base is fn.base_dist else base.to_event(fn.reinterpreted_batch_ndims)
    if isinstance(fn, dist.MaskedDistribution):
        base = _smooth_logits(fn.base_dist)
        return fn if base is fn.base_dist else base.mask(fn._mask)
    return fn


class _SmoothLogits(Messenger):
    """Evaluate the model's Bernoulli-logit sites with exact derivatives at logit 0 (:class:`_BernoulliLogits`)."""

    def process_message(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "sample":
            msg["fn"] = _smooth_logits(msg["fn"])


class DataMask(Messenger):
    """Mask padded observations out of every sample site inside a data plate.

    A boolean ``mask`` keeps the rows where it is True. A float ``mask`` holds row weights (a minibatch,
    :mod:`fedbayes.minibatch`: N_i / B on the batch's rows, 0 on padding): rows of weight 0 are masked
    out and the others' log-densities are scaled by their weight (the site's ``scale``, which every
    density of :class:`FedModel` multiplies in, :func:`sum_log_prob`)."""

    def __init__(self, fn: Callable, mask: jax.Array, data_plates: frozenset[str]):
        self.mask = mask
        self.data_plates = data_plates
        super().__init__(fn)

    def process_message(self, msg: dict[str, Any]) -> None:
        if msg["type"] != "sample":
            return
        weighted = jnp.issubdtype(jnp.result_type(self.mask), jnp.floating)
        for frame in msg["cond_indep_stack"]:
            if frame.name in self.data_plates:
                m = jnp.reshape(self.mask, (-1,) + (1,) * (-frame.dim - 1))
                msg["fn"] = msg["fn"].mask(m > 0 if weighted else m)
                if weighted:
                    msg["scale"] = m if msg.get("scale") is None else msg["scale"] * m


PYTREE_SEP = "/"

SADDLE_JITTER = 0.1
"""How far a site at a saddle of the likelihood starts from it, as a fraction of a prior draw's distance from it
in unconstrained space (:meth:`FedModel.off_saddle`)."""
"""Separator of a pytree-valued ``param`` site's name and its leaf's path: ``net$params/Dense_0/kernel``."""


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey / FlattenedIndexKey, GetAttrKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def pytree_leaf_names(name: str, tree: Any) -> tuple[list[str], Any]:
    """``(leaf site names, treedef)`` of a pytree-valued ``param`` site ``name``: one name per leaf,
    ``name/<path>`` with the path's keys joined by :data:`PYTREE_SEP` (flattening order)."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [PYTREE_SEP.join([name, *(_key_name(k) for k in path)]) for path, _ in with_paths]
    if len(set(names)) != len(names):
        raise ModelError(f"param site '{name}' holds a pytree whose leaf paths do not name its leaves uniquely")
    return names, treedef


class _LeafParams(Messenger):
    """A ``numpyro.param`` whose value is a pytree of arrays (a flax module's parameters through
    ``numpyro.contrib.module.flax_module``, an equinox module's arrays through ``eqx_module``, which gives
    them by an init function, or any dict / tuple of arrays) becomes one ``param`` site per
    leaf, named by :func:`pytree_leaf_names`, so that every part of fedbayes that handles a site by name
    (substitution, transforms, flattening for compression and the ledger, checkpoints, idata, Flower's
    wire format) handles a network's weights as ordinary array sites. The model still receives the
    pytree: the leaves' values (substituted where fedbayes gives them) are assembled into it, and the
    pytree's own message is retyped ``"pytree_param"`` so that no handler treats it as a site.

    ``known`` maps a pytree site's name to its ``(leaf names, treedef)``: a ``param(name)`` without an
    initial value (flax_module asks for its parameters so before it initialises them) is then answered
    from the leaves when fedbayes substitutes all of them."""

    def __init__(self, fn: Callable, known: Mapping[str, tuple[list[str], Any]]):
        self.known = known
        super().__init__(fn)

    def process_message(self, msg: dict[str, Any]) -> None:
        if msg["type"] != "param":
            return
        from_function = not msg["args"]  # numpyro keeps a callable init_value in fn and no args
        if msg["name"] in self.known and (from_function or msg["args"][0] is None):
            names, treedef = self.known[msg["name"]]
            leaves = [numpyro.param(n, **msg["kwargs"]) for n in names]
            if all(v is not None for v in leaves):
                msg["value"] = jax.tree_util.tree_unflatten(treedef, leaves)
                msg["type"] = "pytree_param"
                return
            if not from_function:
                return  # not all substituted: the model initialises its pytree and calls param again
        # The initial value: given, or built by the init function (equinox's eqx_module declares its module's
        # arrays as param(name, lambda key: arrays); numpyro calls it with a key from the seed handler)
        init = msg["fn"](**msg["kwargs"]) if from_function else msg["args"][0]
        if init is None or jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(init)):
            return
        names, treedef = pytree_leaf_names(msg["name"], init)
        leaves = [numpyro.param(n, v, **msg["kwargs"]) for n, v in zip(names, jax.tree_util.tree_leaves(init))]
        msg["value"] = jax.tree_util.tree_unflatten(treedef, leaves)
        msg["type"] = "pytree_param"


class _WholePlates(Messenger):
    """Every ``numpyro.plate`` with a ``subsample_size`` runs over all its rows (indices 0..size-1, scale 1):
    fedbayes draws minibatches itself (:mod:`fedbayes.minibatch`) and hands the model the batch's rows,
    so NumPyro's own subsampling (its key, its size / subsample_size scale) is switched off.
    ``subsampled`` records ``{plate: subsample_size}`` of the plates it switched off."""

    def __init__(self, fn: Callable):
        self.subsampled: dict[str, int] = {}
        super().__init__(fn)

    def process_message(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "plate" and msg["value"] is None:
            size, subsample = msg["args"]
            self.subsampled[msg["name"]] = int(subsample)
            msg["value"] = jnp.arange(size)
            msg["args"] = (size, None)


class _Unobserve(Messenger):
    """Turn the named observed sites into ordinary sample sites (posterior predictive replicates)."""

    def __init__(self, fn: Callable, names: tuple[str, ...]):
        self.names = frozenset(names)
        super().__init__(fn)

    def process_message(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "sample" and msg["name"] in self.names and msg["is_observed"]:
            msg["is_observed"], msg["value"] = False, None


@dataclass(frozen=True)
class Site:
    """One latent site of the model: its role, constrained shape and bijection to R^n."""

    name: str
    role: str
    shape: tuple[int, ...]
    transform: Transform
    discrete: bool = False

    @property
    def unconstrained_shape(self) -> tuple[int, ...]:
        return tuple(self.transform.inverse_shape(self.shape))


@dataclass(frozen=True)
class Deterministic:
    """A ``numpyro.deterministic`` site: a value the model computes and records, not a parameter.

    * ``shape`` -- its shape on client 0's padded data;
    * ``per_client`` -- its value depends on the client's data or local latents (read from the data
      flow of the model's program); otherwise it is a function of the globals alone;
    * ``row_axis`` -- the axis of its value that runs over the client's rows (a per-observation value
      such as a linear predictor ``x @ w``), None when its shape does not follow the data;
    * ``paddable`` -- its value on a client's real rows is the same when the client's data are padded
      (false for e.g. ``x.mean()`` or ``x.shape[0]``), so it can be computed on the padded stack of
      clients, all at once;
    * ``obs_latent`` -- it depends on per-observation latents (mixture labels), whose posterior draws
      are not kept: it is then left out of ``idata.posterior`` (predictions draw those latents afresh);
    * ``note`` -- why it is left out of ``idata`` / of predictions for all clients at once, if it is.
    """

    name: str
    shape: tuple[int, ...]
    per_client: bool
    row_axis: int | None
    paddable: bool = True
    obs_latent: bool = False
    note: str = ""

    @property
    def from_draws(self) -> bool:
        """Whether ``idata.posterior`` holds it (computed at the fit's draws on the padded clients)."""
        return self.paddable and not self.obs_latent


def _row_axis(shape: tuple[int, ...], longer: tuple[int, ...] | None) -> tuple[int | None, bool]:
    """The axis of a value that follows the client's row count, from its shapes traced at n and n + 1
    rows: ``(axis, True)``; ``(None, True)`` when the shape does not follow the rows; ``(None, False)``
    when it follows them otherwise (several axes, or not one entry per row)."""
    if longer is None or len(shape) != len(longer):
        return None, longer is None
    grown = [i for i, (a, b) in enumerate(zip(shape, longer)) if a != b]
    if not grown:
        return None, True
    if len(grown) == 1 and longer[grown[0]] == shape[grown[0]] + 1:
        return grown[0], True
    return None, False


def _user_stacklevel() -> int:
    """The ``stacklevel`` of a warning issued by the calling function that names the first frame outside
    the fedbayes package (the user's call)."""
    root = os.path.dirname(os.path.abspath(__file__))
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(root + os.sep):
        frame, level = frame.f_back, level + 1
    return level


def _input_dependence(closed: Any, labels: Sequence[str]) -> list[frozenset[str]]:
    """For each output of a jaxpr, the labels of the inputs it depends on (a forward data-flow pass).

    An equation holding a sub-program (``pjit``, ``scan``, ``cond``, a custom derivative) makes each
    of its outputs depend on all of its inputs: dependence can be over-stated, never missed.
    """
    jaxpr = closed.jaxpr
    env: dict[Any, frozenset[str]] = {v: frozenset([label]) for v, label in zip(jaxpr.invars, labels)}

    def read(v: Any) -> frozenset[str]:
        return frozenset() if isinstance(v, Literal) else env.get(v, frozenset())

    for eqn in jaxpr.eqns:
        dep = frozenset().union(*(read(v) for v in eqn.invars))
        for out in eqn.outvars:
            env[out] = dep
    return [read(v) for v in jaxpr.outvars]


_VALIDATION_LOCK = threading.Lock()
_VALIDATION_OFF = {"depth": 0, "saved": True}


class _UnvalidatedUnderTrace:
    """Within this block, while any of ``trees``' arrays is a JAX tracer, NumPyro distributions are built
    without checking their arguments (``Distribution.set_default_validate_args(False)``), as
    ``numpyro.enable_validation`` says they are under ``jit`` anyway: a check of a tracer cannot fail, yet it
    is traced, and a MultivariateNormal's is a Cholesky factorisation per distribution (a mixture's E-step
    builds one per component and round: a quarter of tracing FedMM's round). With concrete arrays (a model
    evaluated eagerly) the checks run as NumPyro's settings say. Nested and threaded uses keep one count, and
    the setting in force before the first is restored after the last."""

    def __init__(self, *trees: Any):
        self.active = any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree_util.tree_leaves(trees))

    def __enter__(self) -> None:
        if self.active:
            with _VALIDATION_LOCK:
                if _VALIDATION_OFF["depth"] == 0:
                    _VALIDATION_OFF["saved"] = bool(dist.Distribution._validate_args)
                    dist.Distribution.set_default_validate_args(False)
                _VALIDATION_OFF["depth"] += 1

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            with _VALIDATION_LOCK:
                _VALIDATION_OFF["depth"] -= 1
                if _VALIDATION_OFF["depth"] == 0:
                    dist.Distribution.set_default_validate_args(_VALIDATION_OFF["saved"])


def _python_control_flow(what: str, err: Exception) -> str:
    """The message for a model that branches in Python (``if``, ``while``, ``bool()``) on a traced value."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return (
        f"the model takes a Python decision (if / while / bool / int) on a value that depends on {what}, which "
        f"fedbayes traces with JAX as NumPyro's inference does ({type(err).__name__}: {first}). Write the choice "
        "with jnp.where(cond, a, b) or jax.lax.cond, or make it depend on a static value (a keyword argument of "
        "the model, passed through fed_fit's model_kwargs)."
    )


def _is_improper(fn: Any) -> bool:
    """Whether a site's distribution is NumPyro's ImproperUniform (possibly expanded, masked or made independent),
    which has a log density but no sampler."""
    while True:
        if isinstance(fn, dist.ImproperUniform):
            return True
        inner = getattr(fn, "base_dist", None)
        if inner is None or inner is fn:
            return False
        fn = inner


def _improper_start(site: dict) -> jax.Array | None:
    """A value for an ImproperUniform site, which cannot be drawn: spread in its support as NumPyro's
    ``init_to_uniform`` would place it (:func:`_spread_value`); None (draw) for every other site."""
    if site["type"] == "sample" and not site.get("is_observed") and _is_improper(site["fn"]):
        return _spread_value(site)
    return None


def _trace(model: Callable, kwargs: Mapping[str, Any], substitutions=None, substitute_fn=None, seed=0):
    fn = handlers.seed(model, seed)
    if substitutions is not None or substitute_fn is not None:
        fn = handlers.substitute(fn, data=substitutions, substitute_fn=substitute_fn)
    # innermost: a site no substitution gave a value to and that cannot be drawn gets a start in its support
    fn = handlers.substitute(fn, substitute_fn=_improper_start)
    return handlers.trace(fn).get_trace(**kwargs)


def _spread_value(site: dict) -> jax.Array | None:
    """A value in the support of a continuous latent sample site, ``biject_to(support)(u)`` with ``u`` uniform on
    (-2, 2) in the unconstrained space (numpyro's ``init_to_uniform``), drawn with NumPy from a seed of the site's
    name: spread like a random draw, so that no term of a model vanishes by coincidence, yet compiled as a constant
    (compiling a draw from the prior was most of the padding check's compilation on a CPU). None (the
    model's own draw) for observed and discrete sites and supports without a bijection."""
    if site["type"] != "sample" or site.get("is_observed") or site["fn"].support.is_discrete:
        return None
    fn = site["fn"]
    try:
        transform = biject_to(fn.support)
        shape = transform.inverse_shape(fn.shape())
    except NotImplementedError:
        return None
    u = np.random.default_rng(zlib.crc32(site["name"].encode())).uniform(-2.0, 2.0, shape)
    return transform(jnp.asarray(u, jnp.result_type(float)))


def _abstract_trace(model: Callable, kwargs: Mapping[str, Any]):
    """The model's trace evaluated abstractly (shapes, supports, plates; nothing compiled or computed)."""
    box = {}

    def run():
        box["trace"] = _trace(model, kwargs)
        return 0

    jax.make_jaxpr(run)()
    return box["trace"]


def _as_jax(data: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v) for k, v in data.items()}


def _support_transform(site: dict[str, Any]) -> Transform:
    if site["type"] == "param":
        constraint = site["kwargs"].get("constraint")
        if constraint is None:
            from numpyro.distributions import constraints

            constraint = constraints.real
        return biject_to(constraint)
    return biject_to(site["fn"].support)


def sum_log_prob(site: dict[str, Any]) -> jax.Array:
    """A traced sample site's log-density summed over its elements, times its scale (if any)."""
    lp = site["fn"].log_prob(site["value"])
    if site.get("scale") is not None:
        lp = site["scale"] * lp
    return jnp.sum(lp)


def _event_ok(fn: Any, value: jax.Array, transform: Transform) -> jax.Array:
    """Per element of ``value`` (broadcast to its shape): True where the value's event is finite,
    inside the support and maps to a finite unconstrained point."""
    value = jnp.broadcast_to(value, tuple(fn.batch_shape) + tuple(fn.event_shape))
    event_axes = tuple(range(value.ndim - len(fn.event_shape), value.ndim))
    ok = jnp.all(jnp.isfinite(value), axis=event_axes)
    ok = ok & jnp.asarray(fn.support(value), bool)
    u = transform.inv(value)
    u_axes = tuple(range(len(fn.batch_shape), jnp.ndim(u)))
    ok = ok & jnp.all(jnp.isfinite(u), axis=u_axes)
    return jnp.reshape(ok, ok.shape + (1,) * len(fn.event_shape))


def _median(fn: Any) -> jax.Array | None:
    """The prior's median where it is known exactly (``icdf(0.5)``, or a symmetric law's location;
    ``ExpandedDistribution`` / ``Independent`` wrappers are looked through), else None."""
    base, shape = fn, tuple(fn.batch_shape) + tuple(fn.event_shape)
    while type(base).__name__ in ("ExpandedDistribution", "Independent", "MaskedDistribution"):
        base = base.base_dist
    if base.event_shape:
        return None
    name = type(base).__name__
    try:
        if name == "HalfCauchy":
            med = base.scale
        elif name in ("StudentT", "Cauchy", "Laplace", "Logistic", "SoftLaplace") and hasattr(base, "loc"):
            med = base.loc
        else:
            med = base.icdf(jnp.full(base.batch_shape, 0.5))
    except Exception:
        return None
    return jnp.broadcast_to(jnp.asarray(med, jnp.result_type(float)), shape)


def prior_centre(fn: Any, transform: Transform | None = None) -> jax.Array:
    """A deterministic centre of the prior ``fn``, elementwise: its mean where finite and inside the
    support (Normal: loc; HalfNormal(s): s sqrt(2 / pi); LogNormal(m, s): exp(m + s^2 / 2);
    Gamma(a, b): a / b; Beta(a, b): a / (a + b); Dirichlet(alpha): alpha / sum(alpha)); where the mean
    is infinite or undefined, its median (HalfCauchy(s): s; Cauchy / StudentT: loc; others by
    ``icdf(0.5)``); otherwise ``transform(0)``, the image of the unconstrained origin (e.g. 1 for a
    positive site without either). Works under ``jit`` (the choice is made elementwise with ``where``).
    """
    transform = biject_to(fn.support) if transform is None else transform
    shape = tuple(fn.batch_shape) + tuple(fn.event_shape)
    dtype = jnp.result_type(float)
    fallback = jnp.broadcast_to(transform(jnp.zeros(transform.inverse_shape(shape), dtype)), shape)
    if getattr(fn.support, "is_discrete", False):  # discrete globals are refused by FedModel.require
        try:
            return jnp.broadcast_to(jnp.asarray(fn.enumerate_support(expand=False)[0], dtype), shape)
        except Exception:
            return fallback
    out = fallback
    for candidate in (_median, lambda f: f.mean):  # the later candidate wins where it is valid
        try:
            value = candidate(fn)
        except Exception:
            value = None
        if value is None:
            continue
        value = jnp.broadcast_to(jnp.asarray(value, dtype), shape)
        out = jnp.where(_event_ok(fn, value, transform), value, out)
    return out


class FedModel:
    """A NumPyro model of one client's data, analysed for federated inference.

    Parameters
    ----------
    model:
        ``model(**client_data, **model_kwargs)`` for one client's data.
    data:
        The federated data; its first client is used to trace the model.
    model_kwargs:
        Extra keyword arguments passed to every model call (not data: same on every client).
    """

    @property
    def model(self) -> Callable:
        """The user's model as fedbayes evaluates it: Bernoulli-logit sites with exact derivatives at logit 0
        (:class:`_BernoulliLogits`; the same values) and plates over all their rows (:class:`_WholePlates`:
        minibatches are drawn by the algorithm). ``user_model`` is the function as given."""
        # set by __init__ (user_model) or, in results pickled before user_model, as model
        user = cast(Callable, self.__dict__.get("user_model", self.__dict__.get("model")))
        return _SmoothLogits(_WholePlates(_LeafParams(user, self.__dict__.get("pytree_params", {}))))

    @serialized
    def __init__(self, model: Callable, data: FederatedData, model_kwargs: Mapping[str, Any] | None = None):
        if not callable(model):
            raise ModelError(f"model must be a callable NumPyro model, got {type(model).__name__}")
        self.user_model = model
        self.model_kwargs = dict(model_kwargs or {})
        clash = set(self.model_kwargs) & set(data.keys)
        if clash:
            raise ModelError(f"model_kwargs {sorted(clash)} clash with data keys of the same names")
        self.data_keys = data.keys
        example = data.padded_client(0)  # from the host copy: indexing the device arrays would compile a slice each
        longer = {k: np.concatenate([v, v[-1:]], axis=0) for k, v in example.items()}
        try:
            # JAX arrays, as the model sees its data in a fit (NumPy arrays cannot be indexed by tracers)
            whole = _WholePlates(_LeafParams(model, {}))
            tr = _abstract_trace(whole, {**_as_jax(example), **self.model_kwargs})
            tr_longer = _abstract_trace(_WholePlates(_LeafParams(model, {})), {**_as_jax(longer), **self.model_kwargs})
        except jax.errors.ConcretizationTypeError as err:  # traced abstractly: every value is a tracer here
            raise ModelError(_python_control_flow("the data or a parameter", err)) from err
        except Exception as err:  # the user's model failed on a client's data
            raise ModelError(
                f"calling the model on client 0's data failed with {type(err).__name__}: {err}. "
                f"The model is called as model(**client_data, **model_kwargs) with data keys {list(data.keys)}."
            ) from err
        self.subsample_size = self._subsample_size(whole.subsampled)
        self.pytree_params = {
            name: pytree_leaf_names(name, site["value"]) for name, site in tr.items() if site["type"] == "pytree_param"
        }
        self.data_plates = self._find_data_plates(tr, tr_longer)
        self._check_subsampled_plates(whole.subsampled)
        self.sites: dict[str, Site] = {}
        self.observed: tuple[str, ...] = ()
        self._classify(tr, tr_longer)
        self._example = {k: jnp.asarray(v) for k, v in example.items()}
        self._example_size = int(data.sizes[0])  # client 0's real rows (the rest of _example is padding)
        self._drop_inert_leaves(tr)
        self._classify_deterministic(tr, tr_longer)
        self._check_padding_invariance({k: v[: data.sizes[0]] for k, v in example.items()}, tr)
        self._warn_left_out_deterministic()
        self.global_names = tuple(n for n, s in self.sites.items() if s.role in ("global", "param"))
        self.local_names = tuple(n for n, s in self.sites.items() if s.role == "local")
        self.obs_latent_names = tuple(n for n, s in self.sites.items() if s.role == "obs_latent")
        self.symmetry = _symmetry.of(model)  # the symmetry the model declares (fb.Symmetry), or None
        if self.symmetry is not None:
            _symmetry.validate(self, self.symmetry, self.init_globals())

    # ----------------------------------------------------------------------------- introspection
    @staticmethod
    def _subsample_size(subsampled: Mapping[str, int]) -> int | None:
        """B of ``numpyro.plate(name, N, subsample_size=B)`` with B < N (None if no plate subsamples;
        ``subsampled`` as :class:`_WholePlates` records it): the model asks for minibatches of B rows,
        which the algorithms that take them draw themselves (:mod:`fedbayes.minibatch`); the others
        refuse the model (:meth:`require`)."""
        if len(set(subsampled.values())) > 1:
            raise ModelError(
                f"plates {sorted(subsampled)} subsample different numbers of rows ({dict(subsampled)}); "
                "fedbayes draws one minibatch of each client's rows per step: give one subsample_size"
            )
        return next(iter(subsampled.values()), None)

    def _check_subsampled_plates(self, subsampled: Mapping[str, int]) -> None:
        """A plate with ``subsample_size`` must run over the client's rows (a data plate)."""
        for name, size in subsampled.items():
            if name not in self.data_plates:
                raise ModelError(
                    f"plate '{name}' has subsample_size={size} but does not run over the "
                    "client's rows; fedbayes draws minibatches of a client's rows only (subsample the "
                    "plate over the observations)"
                )

    @staticmethod
    def _find_data_plates(tr, tr_longer) -> frozenset[str]:
        plates = set()
        for name, site in tr.items():
            other = tr_longer.get(name)
            if other is None:
                continue
            sizes = {f.name: f.size for f in other.get("cond_indep_stack", ())}
            for frame in site.get("cond_indep_stack", ()):
                if frame.name in sizes and sizes[frame.name] != frame.size:
                    plates.add(frame.name)
        return frozenset(plates)

    def _classify(self, tr, tr_longer) -> None:
        observed = []
        for name, site in tr.items():
            if site["type"] == "mutable":
                raise ModelError(
                    f"site '{name}' is mutable state (numpyro.mutable, e.g. a flax module's batch_stats through "
                    "flax_module(..., mutable=[...])), which fedbayes does not carry between clients and rounds; "
                    "use a module without mutable collections (e.g. LayerNorm instead of BatchNorm)"
                )
            if site["type"] not in ("sample", "param"):
                continue
            in_data_plate = any(f.name in self.data_plates for f in site["cond_indep_stack"])
            if not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(site["value"])):
                raise ModelError(
                    f"{site['type']} site '{name}' holds a pytree of arrays, which fedbayes handles only as a "
                    "numpyro.param with an initial value (one site per leaf, e.g. flax_module's parameters): give a "
                    "sample site one array each, and a param its initial value rather than an init function"
                )
            shape = tuple(jnp.shape(site["value"]))
            grows = tuple(jnp.shape(tr_longer[name]["value"])) != shape if name in tr_longer else False
            if site["type"] == "sample" and site["is_observed"]:
                if grows and not in_data_plate:
                    raise ModelError(
                        f"observed site '{name}' has a dimension of the client's data size but is not inside "
                        "a numpyro.plate; wrap it in `with numpyro.plate('obs', n):` so padded rows can be masked"
                    )
                observed.append(name)
                continue
            if site["type"] == "param":
                if in_data_plate or grows:
                    raise ModelError(f"param site '{name}' depends on the data size; params must be global")
                role = "param"
            elif in_data_plate:
                role = "obs_latent"
            elif site["infer"].get(_LOCAL_FLAG, False):
                role = "local"
            else:
                role = "global"
            if grows and role != "obs_latent":
                raise ModelError(
                    f"latent site '{name}' changes shape with the client's data size but is not inside a "
                    "numpyro.plate over observations; put per-observation latents inside the data plate"
                )
            discrete = bool(site["type"] == "sample" and getattr(site["fn"].support, "is_discrete", False))
            transform = IdentityTransform() if discrete else _support_transform(site)
            self.sites[name] = Site(name, role, shape, transform, discrete)
        if not observed:
            raise ModelError("the model has no observed site: condition at least one sample site on the data (obs=...)")
        self.observed = tuple(observed)

    def _drop_inert_leaves(self, tr) -> None:
        """Leave out the leaves of pytree params that nothing in the model depends on (no sample site's
        log-density, no deterministic value), found by data flow through the model's program.

        ``numpyro.contrib.module.random_flax_module`` is the case: it declares the module's parameters
        with ``flax_module`` (a pytree param) and then replaces every one of them by a ``sample`` site
        with the prior; as sites those params would be estimated for ever at zero gradient, and they would
        make the samplers refuse the model as one with params."""
        leaves = sorted(n for names, _ in self.pytree_params.values() for n in names if n in self.sites)
        if not leaves:
            return
        example = {**self._example, **self.model_kwargs}

        def density(values):
            t = _trace(self.model, example, substitutions=values)
            terms = [jnp.sum(site["fn"].log_prob(site["value"])) for site in t.values() if site["type"] == "sample"]
            terms += [
                jnp.sum(jnp.asarray(site["value"], float)) for site in t.values() if site["type"] == "deterministic"
            ]
            return sum(terms, jnp.zeros(()))

        shapes = {n: jax.ShapeDtypeStruct(jnp.shape(tr[n]["value"]), jnp.result_type(tr[n]["value"])) for n in leaves}
        used = _input_dependence(jax.make_jaxpr(density)(shapes), leaves)[0]  # dict inputs flatten by sorted key
        inert = [n for n in leaves if n not in used]
        for n in inert:
            del self.sites[n]
        self.pytree_params = {
            name: (names, treedef)
            for name, (names, treedef) in self.pytree_params.items()
            if any(n in used for n in names)
        }

    def _classify_deterministic(self, tr, tr_longer) -> None:
        """Record the ``numpyro.deterministic`` sites (:attr:`deterministic`) and the row axis of every
        observed and deterministic site (:attr:`row_axes`).

        Deterministic sites are not parameters: they are never classified as globals or locals and never
        enter a log-density, so a data-length one (a linear predictor) is fine inside or outside a plate.
        Which inputs a site's value depends on (globals, local latents, per-observation latents, the
        client's data) is read from the data flow of the model's program (:func:`_input_dependence`,
        abstractly: nothing is computed); its row axis from its shapes at two data lengths.
        """
        self.row_axes: dict[str, int | None] = {}
        for name in self.observed:
            longer = tuple(jnp.shape(tr_longer[name]["value"])) if name in tr_longer else None
            self.row_axes[name] = _row_axis(tuple(jnp.shape(tr[name]["value"])), longer)[0]
        self.deterministic: dict[str, Deterministic] = {}
        names = [n for n, site in tr.items() if site["type"] == "deterministic"]
        if not names:
            return
        leaf = lambda n: jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(tr[n]["value"]))  # noqa: E731
        arrays = [n for n in names if leaf(n)]
        latents = {
            n: jax.ShapeDtypeStruct(jnp.shape(tr[n]["value"]), jnp.result_type(tr[n]["value"])) for n in self.sites
        }
        example = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in self._example.items()}

        def values(latents, data):
            t = _trace(self.model, {**data, **self.model_kwargs}, substitutions=latents)
            return [t[n]["value"] for n in arrays]

        labels = jax.tree_util.tree_leaves(({n: self.sites[n].role for n in latents}, {k: "data" for k in example}))
        try:
            deps = dict(zip(arrays, _input_dependence(jax.make_jaxpr(values)(latents, example), labels)))
        except Exception:
            deps = {n: frozenset(["data", "local"] + (["obs_latent"] if self.obs_latent_names else [])) for n in arrays}
        for name in names:
            if name not in deps:
                self.deterministic[name] = Deterministic(
                    name, (), True, None, False, False, "it holds a pytree, not one array"
                )
                continue
            shape = tuple(jnp.shape(tr[name]["value"]))
            longer = tuple(jnp.shape(tr_longer[name]["value"])) if name in tr_longer else None
            axis, regular = _row_axis(shape, longer)
            dep = deps[name]
            per_client = bool(dep & {"data", "local", "obs_latent"}) or axis is not None or not regular
            obs_latent = "obs_latent" in dep
            note = (
                (
                    "its shape follows the client's row count in another way than one entry per row, so a "
                    "padded client cannot be cut back to its rows"
                )
                if not regular
                else (
                    "it depends on per-observation latent sites, whose posterior draws are not kept"
                    if obs_latent
                    else ""
                )
            )
            self.row_axes[name] = axis
            self.deterministic[name] = Deterministic(name, shape, per_client, axis, regular, obs_latent, note)

    def _warn_left_out_deterministic(self) -> None:
        left_out = {n: d for n, d in self.deterministic.items() if not d.from_draws}
        if not left_out:
            return
        warnings.warn(
            "deterministic sites "
            + "; ".join(f"'{n}': {d.note}" for n, d in left_out.items())
            + ". They are left out of res.idata.posterior"
            + (" and of predictions for all clients at once" if any(not d.paddable for d in left_out.values()) else "")
            + "; res.predict(new_data) for one client returns them. To have them in idata, compute them from "
            "per-row values inside the data plate, and pass data-size constants through model_kwargs.",
            UserWarning,
            stacklevel=_user_stacklevel(),
        )

    def _deterministic_rows(self, tr, rows: int) -> dict[str, jax.Array]:
        """The paddable deterministic sites' values, cut to the first ``rows`` rows along their row axis."""
        out = {}
        for name, d in self.deterministic.items():
            if not d.paddable:
                continue
            value = jnp.asarray(tr[name]["value"])
            out[name] = value if d.row_axis is None else jnp.take(value, jnp.arange(rows), axis=d.row_axis)
        return out

    def _site_terms(self, tr, rows: int) -> dict[str, jax.Array]:
        """Each sample site's log-density over the first ``rows`` rows of its data plate (the whole
        log-density for sites outside data plates)."""
        out = {}
        for name, site in tr.items():
            if site["type"] != "sample":
                continue
            lp = site["fn"].log_prob(site["value"])
            if site.get("scale") is not None:
                lp = site["scale"] * lp
            frame = next((f for f in site["cond_indep_stack"] if f.name in self.data_plates), None)
            if frame is not None and jnp.ndim(lp) >= -frame.dim and jnp.shape(lp)[frame.dim] > 1:
                lp = jnp.take(lp, jnp.arange(rows), axis=frame.dim)
            out[name] = jnp.sum(lp)
        return out

    def _check_padding_invariance(self, rows: Mapping[str, np.ndarray], tr) -> None:
        """Refuse a model whose log-density changes when a client's data are padded.

        Clients are padded to a common length by repeating their last row, and the padded rows are
        masked out of the sites inside a data plate. Any other use of the rows (a ``numpyro.factor``
        of a sum over the data, ``obs=y.mean()``, a prior scaled by ``x.shape[0]``, a per-row site
        whose parameters reduce over the rows) would silently count the padding. The model is
        evaluated on client 0's real rows and on the same rows padded to about twice their length, at
        the same latent values (per-observation latents padded like the data); every site's
        log-density over the real rows must agree up to rounding. The continuous latents take spread
        values fixed on the host (:func:`_spread_value`), the discrete ones a draw from the model. Each
        evaluation is one compiled program (two compilations in all, instead of one per eager operation).
        ``tr`` is the model's trace on client 0 (for the sites' plates).
        """
        n = len(next(iter(rows.values())))
        extra = max(n, 3)
        padded = {k: np.concatenate([v, np.repeat(v[-1:], extra, axis=0)]) for k, v in rows.items()}

        def latents(tr) -> Params:
            return {
                name: site["value"]
                for name, site in tr.items()
                if site["type"] in ("sample", "param") and not site.get("is_observed")
            }

        def base(data):
            tr = _trace(self.model, {**data, **self.model_kwargs}, substitute_fn=_spread_value)
            return self._site_terms(tr, n), latents(tr), self._deterministic_rows(tr, n)

        def again(data, values):
            def pad_latent(site):  # the base's latent values; per-observation ones padded like the data
                if site["type"] not in ("sample", "param") or site.get("is_observed") or site["name"] not in values:
                    return None
                value = values[site["name"]]
                frame = next((f for f in site["cond_indep_stack"] if f.name in self.data_plates), None)
                if site["type"] == "param" or frame is None:
                    return value
                axis = jnp.ndim(value) - site["fn"].event_dim + frame.dim
                last = jnp.take(value, jnp.array([-1]), axis=axis)
                return jnp.concatenate([value, jnp.repeat(last, extra, axis=axis)], axis=axis)

            tr = _trace(self.model, {**data, **self.model_kwargs}, substitute_fn=pad_latent)
            return self._site_terms(tr, n), self._deterministic_rows(tr, n)

        try:
            terms, values, recorded = fit_jit(base, once=1)(rows)
        except Exception as err:  # the model fails on client 0's own rows
            raise ModelError(
                f"calling the model on client 0's data ({n} rows) failed with {type(err).__name__}: {err}"
            ) from err
        try:  # the first trace with the parameters and latents as traced values, as every algorithm runs it
            terms_padded, recorded_padded = fit_jit(again, once=1)(padded, values)
        except jax.errors.ConcretizationTypeError as err:
            raise ModelError(_python_control_flow("a parameter or latent", err)) from err
        tol = 1e-4 if jnp.result_type(float) == jnp.float32 else 1e-9
        for name, value in terms.items():
            value, got = float(value), terms_padded.get(name)
            if got is None or np.isclose(value, float(got), rtol=tol, atol=tol, equal_nan=True):
                continue
            in_plate = any(f.name in self.data_plates for f in tr[name]["cond_indep_stack"])
            where = (
                "its log-density on the real rows depends on the other rows (e.g. a parameter computed "
                "from a reduction over the data)"
                if in_plate
                else "it is outside the data plate but its log-density depends on the client's rows "
                "(e.g. numpyro.factor of a sum over the data, obs=y.mean(), or a term using x.shape[0])"
            )
            raise ModelError(
                f"site '{name}': {where}. Clients are padded to a common length and only sites inside a "
                f"data plate are masked, so this term would silently count padded rows (client 0: "
                f"{value:.6g} on its {n} rows, {float(got):.6g} once padded). Write the likelihood per "
                "observation inside `with numpyro.plate('obs', n):` (e.g. numpyro.sample('y', dist.Normal(mu, s), "
                "obs=y) or numpyro.factor('lik', per_row_log_lik) inside the plate), and pass data-size constants "
                "through model_kwargs."
            )
        for name, value in recorded.items():  # deterministic sites: not refused, but not computed padded
            got = recorded_padded[name]
            if jnp.shape(got) == jnp.shape(value) and np.allclose(
                np.asarray(value, float), np.asarray(got, float), rtol=tol, atol=tol, equal_nan=True
            ):
                continue
            self.deterministic[name] = dataclasses.replace(
                self.deterministic[name],
                paddable=False,
                note="its value on a client's real rows changes when the client's data are padded (e.g. a mean "
                "over the rows, or x.shape[0])",
            )

    def require(
        self, algorithm: str, *, local_continuous: bool = True, allow_obs_latent: bool = False, minibatch: bool = False
    ) -> None:
        """Raise ModelError if the model has sites ``algorithm`` cannot handle, naming the site, or asks for
        minibatches (a plate's ``subsample_size``) that ``algorithm`` does not draw (``minibatch=False``)."""
        if self.subsample_size is not None and not minibatch:
            raise ModelError(
                f"the model's data plate subsamples {self.subsample_size} rows (subsample_size={self.subsample_size}), "
                f"but {algorithm} evaluates every client's likelihood on all of its rows; remove subsample_size, or "
                "use an algorithm that takes minibatch steps "
                "(fb.FedSOUL, FedRep, the Langevin samplers, TAMUNA, GD, FedAvg)"
            )
        for site in self.sites.values():
            if site.role == "obs_latent" and not allow_obs_latent:
                raise ModelError(
                    f"{algorithm} does not support the per-observation latent site '{site.name}' "
                    "(an unobserved sample site inside the data plate); marginalise it in the model "
                    "or use an algorithm with an E-step for it"
                )
            if site.role == "local" and site.discrete and local_continuous:
                raise ModelError(
                    f"{algorithm} samples local latents with Langevin steps, but local site '{site.name}' "
                    "is discrete; enumerate or marginalise it in the model"
                )
            if site.role == "global" and site.discrete:
                raise ModelError(f"global site '{site.name}' is discrete; {algorithm} needs continuous globals")
        if not any(s.role in ("global", "param") for s in self.sites.values()):
            raise ModelError(
                f"{algorithm} needs at least one global site to estimate or sample, and the model has none "
                f"(its latent sites: {sorted(self.sites) or 'none'}); add a global sample site with a prior "
                "outside fb.local() or a numpyro.param"
            )

    # ----------------------------------------------------------------------------- transforms
    def _constrain(self, u: Params) -> Params:
        return {n: self.sites[n].transform(v) for n, v in u.items()}

    def _unconstrain(self, c: Mapping[str, Any]) -> Params:
        return {n: self.sites[n].transform.inv(jnp.asarray(v)) for n, v in c.items()}

    def constrain(self, u: Params) -> Params:
        """Map unconstrained values (globals and/or locals) to the model's constrained space (compiled once
        per structure of ``u``, so that a call outside ``jit`` is one program, not one per operation)."""
        return self._jitted("_constrain")(u)

    def unconstrain(self, c: Mapping[str, Any]) -> Params:
        """Map constrained values to unconstrained space (compiled, as :meth:`constrain`)."""
        return self._jitted("_unconstrain")(c)

    def __getstate__(self) -> dict[str, Any]:
        """Pickling: the compiled helpers are rebuilt on first use."""
        state = dict(self.__dict__)
        state.pop("_jit_cache", None)
        return state

    def _jitted(self, name: str):
        cache = self.__dict__.setdefault("_jit_cache", {})
        if name not in cache:
            cache[name] = jax.jit(getattr(self, name))
        return cache[name]

    def _log_jacobian(self, u: Params) -> jax.Array:
        total = jnp.zeros(())
        for n, v in u.items():
            t = self.sites[n].transform
            total = total + jnp.sum(t.log_abs_det_jacobian(v, t(v)))
        return total

    def init_globals(self, key: jax.Array | None = None, values: Mapping[str, Any] | None = None) -> Params:
        """The deterministic start: unconstrained globals, one site at a time in the model's order.

        For each global site: the user's ``values`` where given; a ``numpyro.param`` site's own initial
        value; otherwise the exact centre of its prior (:func:`prior_centre`: the prior's mean where it
        is finite and inside the support, else its median, else the image of 0 under the site's
        unconstraining bijection). Sites are filled in trace order with the earlier ones already set,
        so a hierarchical prior (``sigma ~ HalfNormal(tau)`` with ``tau`` global) is centred at the
        earlier sites' start values. No random draw is made: ``key`` is kept for compatibility and
        does not change the result. The deterministic optimisers move it off a saddle of the likelihood
        first (:meth:`off_saddle`).
        """
        del key  # the start is deterministic
        values = dict(values or {})
        unknown = set(values) - set(self.global_names)
        if unknown:
            raise ModelError(
                f"initial values given for {sorted(unknown)}, which are not global sites {list(self.global_names)}"
            )
        dtype = jnp.result_type(float)
        given = {}
        for n, v in values.items():
            v = jnp.asarray(v, dtype=dtype)
            if v.shape != self.sites[n].shape:
                raise ModelError(f"initial value of '{n}' has shape {v.shape}, expected {self.sites[n].shape}")
            given[n] = v
        globals_ = frozenset(n for n in self.global_names if self.sites[n].role == "global")

        def centre(site):
            name = site["name"]
            if name in given:
                return given[name]
            if site["type"] == "sample" and name in globals_:
                return prior_centre(site["fn"], self.sites[name].transform)
            return None

        try:
            tr = _trace(self.model, {**self._example, **self.model_kwargs}, substitute_fn=centre, seed=0)
        except ValueError as err:  # NumPyro's argument validation of a distribution built from the start values
            centred = "its prior's centre"
            start = {n: np.asarray(given[n]).tolist() if n in given else centred for n in self.global_names}
            raise ModelError(
                f"the model is invalid at its starting values ({err}): the start of each global site is "
                f"{start}, and a distribution built from them got an invalid argument (e.g. a scale given by a "
                "site whose prior allows values <= 0). Give the site a prior on the right support (e.g. "
                "dist.HalfNormal for a scale), or pass a valid start (the algorithm's init={...})"
            ) from err
        out = {}
        for n in self.global_names:
            v = jnp.asarray(given.get(n, tr[n]["value"]), dtype=dtype)
            if v.shape != self.sites[n].shape:
                raise ModelError(f"initial value of '{n}' has shape {v.shape}, expected {self.sites[n].shape}")
            out[n] = self.sites[n].transform.inv(v)
        return out

    def off_saddle(self, theta_u: Params, fixed: Sequence[str] = ()) -> Params:
        """The start ``theta_u`` (unconstrained globals) with the sites that sit at a saddle of the likelihood
        moved off it: the start of the deterministic optimisers (GD, FedAvg, Scaffnew, TAMUNA, the MAP warm start).

        A network's weights with N(0, s) priors are all 0 at their prior centre. There tanh(0) = 0 and a
        zero head pass each other no gradient, and gradient steps never leave the point (a sampler's noise
        does). A global ``sample`` site not in ``fixed`` (the user's start values) whose objective gradient,
        log p(theta) + log p(D_0 | theta) with client 0's data and the locals at their population mean, is
        exactly 0 in every entry is moved to

            u_n + SADDLE_JITTER (T_n^-1(x_n) - u_n),   x_n a draw of its prior with key fold_in(0, n's index),

        so the start stays deterministic. The move is kept where the log-likelihood's gradient at the moved
        point is no longer 0 (the site is coupled to the data through the other moved sites), and undone where
        it stays 0 (a site that client 0's data do not inform, or a hyperparameter that enters only the
        prior). A start with a non-zero gradient everywhere is returned unchanged. Traceable (the choice is
        made with ``where``).

        >>> import numpy as np, numpyro, numpyro.distributions as dist, jax.numpy as jnp, fedbayes as fb
        >>> def net(x, y=None):
        ...     w1 = numpyro.sample("w1", dist.Normal(0, 1).expand([2, 3]).to_event(2))
        ...     w2 = numpyro.sample("w2", dist.Normal(0, 1).expand([3]).to_event(1))
        ...     with numpyro.plate("obs", x.shape[0]):
        ...         numpyro.sample("y", dist.Normal(jnp.tanh(x @ w1) @ w2, 1.0), obs=y)
        >>> rng = np.random.default_rng(0)
        >>> data = fb.FederatedData({"x": [rng.normal(size=(20, 2))], "y": [rng.normal(size=20)]})
        >>> fm = fb.FedModel(net, data)
        >>> start = fm.off_saddle(fm.init_globals())
        >>> bool(np.all(np.asarray(start["w1"]) != 0))
        True
        """
        if self.obs_latent_names:  # no log-likelihood with the per-observation latents summed out
            return theta_u
        given = set(fixed)
        centred = [n for n in self.global_names if self.sites[n].role == "global" and n not in given]
        if not centred:
            return theta_u
        start = dict(theta_u)
        tr = _trace(self.model, {**self._example, **self.model_kwargs}, substitutions=self._constrain(start))
        key = jax.random.PRNGKey(0)
        proposal = {}
        for i, n in enumerate(centred):
            try:
                draw = tr[n]["fn"].sample(jax.random.fold_in(key, i))
            except NotImplementedError:  # a prior without a sampler (ImproperUniform): not moved
                continue
            u = self.sites[n].transform.inv(jnp.asarray(draw, start[n].dtype))
            proposal[n] = start[n] + SADDLE_JITTER * (u - start[n])
        if not proposal:
            return start
        if any(isinstance(v, jax.core.Tracer) for v in jax.tree_util.tree_leaves(start)):
            return self._saddle_start(start, proposal)  # traced already (jax.eval_shape of the start)
        cache = self.__dict__.setdefault("_jit_cache", {})
        if "_saddle_start" not in cache:  # run once per fit: compiled for compilation speed
            cache["_saddle_start"] = fit_jit(self._saddle_start, once=0)
        return cache["_saddle_start"](start, proposal)

    def _saddle_start(self, start: Params, proposal: Params) -> Params:
        """:meth:`off_saddle`'s choice: ``proposal[n]`` where site n is stuck at ``start`` and coupled to the
        data once moved, else ``start[n]``."""
        grad = jax.grad(lambda t: self._start_loglik(t) + self.log_prior(t))(start)
        stuck = {n: jnp.all(grad[n] == 0) for n in proposal}
        moved = {n: jnp.where(stuck[n], proposal[n], v) if n in proposal else v for n, v in start.items()}
        coupled = jax.grad(self._start_loglik)(moved)
        keep = {n: stuck[n] & jnp.any(coupled[n] != 0) for n in stuck}
        return {n: jnp.where(keep[n], proposal[n], v) if n in keep else v for n, v in start.items()}

    def _start_loglik(self, theta_u: Params) -> jax.Array:
        """Client 0's log-likelihood with the locals at their population mean (the saddle check's data term)."""
        rows = next(iter(self._example.values())).shape[0]
        mask = jnp.arange(rows) < getattr(self, "_example_size", rows)
        return self.client_loglik_population(theta_u, self._example, mask)

    # ----------------------------------------------------------------------------- densities
    def _client_trace(self, values_c: Params, data: Mapping[str, jax.Array], mask: jax.Array):
        fn = DataMask(handlers.substitute(handlers.seed(self.model, 0), data=values_c), mask, self.data_plates)
        with _UnvalidatedUnderTrace(values_c, data, mask):
            return handlers.trace(fn).get_trace(**data, **self.model_kwargs)

    def log_prior(self, theta_u: Params, jacobian: bool = False) -> jax.Array:
        """log p(theta) of the global ``sample`` sites, counted once for the whole federation.

        With ``jacobian=False`` (estimation: MAP in the model's own parametrisation) the density is
        that of the constrained values; ``jacobian=True`` adds log|det J| of the unconstrained map
        (sampling in unconstrained space).
        """
        prior_sites = [n for n in self.global_names if self.sites[n].role == "global"]
        if not prior_sites:
            return jnp.zeros(())
        values = self._constrain(theta_u)
        fn = handlers.substitute(handlers.seed(self.model, 0), data=values)
        # Only the prior sites are read; client 0's data stand in (they do not enter the prior, and
        # the unused likelihood terms are dropped by XLA under jit).
        tr = handlers.trace(fn).get_trace(**self._example, **self.model_kwargs)
        lp = cast(jax.Array, sum(sum_log_prob(tr[n]) for n in prior_sites))  # prior_sites is non-empty
        if jacobian:
            lp = lp + self._log_jacobian({n: theta_u[n] for n in prior_sites})
        return lp

    def client_log_terms(
        self, theta_u: Params, z_u: Params, data: Mapping[str, jax.Array], mask: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """``(log p(z_i | theta) + log|J(z_i)|, log p(D_i | theta, z_i))`` for one padded client.

        The first term is the local prior density of the *unconstrained* local latents (so it includes
        the Jacobian of their transform); the second is the client's log-likelihood, a sum over its
        real (unmasked) observations.
        """
        values = {**self._constrain(theta_u), **self._constrain(z_u)}
        tr = self._client_trace(values, data, mask)
        local_lp = sum((sum_log_prob(tr[n]) for n in self.local_names), jnp.zeros(()))
        local_lp = local_lp + self._log_jacobian(z_u)
        loglik = sum((sum_log_prob(tr[n]) for n in self.observed), jnp.zeros(()))
        return local_lp, loglik

    def client_loglik_population(self, theta_u: Params, data: Mapping[str, jax.Array], mask: jax.Array) -> jax.Array:
        """log p(D_i | theta, z_i = E[z_i | theta]): the client's log-likelihood with every local latent
        set to its population mean (the non-personalised "global model" of a personalised model).

        It is the objective of warm starts (e.g. ``fb.FedSOUL(init="map")``): theta fitted as if every
        client were the average client. Parameters that enter only the population prior's spread
        (a random-effect scale) do not enter it and keep their initial values.
        """
        theta_c = self._constrain(theta_u)

        def at_mean(site):
            if site["name"] in self.local_names:
                return site["fn"].mean
            return None

        fn = handlers.substitute(handlers.substitute(handlers.seed(self.model, 0), data=theta_c), substitute_fn=at_mean)
        tr = handlers.trace(DataMask(fn, mask, self.data_plates)).get_trace(**data, **self.model_kwargs)
        return sum((sum_log_prob(tr[n]) for n in self.observed), jnp.zeros(()))

    def pointwise_loglik(
        self, values_c: Mapping[str, Any], data: Mapping[str, jax.Array], mask: jax.Array
    ) -> jax.Array:
        """log p(y_ij | theta, z_i) per observation j of one padded client, (max_size,), padded rows 0.

        ``values_c`` are constrained values of the globals and locals. Every observed site must sit in
        the data plate (their log-densities are summed per observation); models with per-observation
        latents (mixture labels) have no such per-draw term: call :meth:`require_pointwise` first.
        """
        tr = self._client_trace(dict(values_c), data, mask)
        total = jnp.zeros(mask.shape)
        for name in self.observed:
            site = tr[name]
            lp = site["fn"].log_prob(site["value"])
            frame = next(f for f in site["cond_indep_stack"] if f.name in self.data_plates)
            lp = jnp.moveaxis(lp, lp.ndim + frame.dim, 0)
            total = total + lp.reshape(lp.shape[0], -1).sum(1)
        return jnp.where(mask, total, 0.0)

    def require_pointwise(self) -> None:
        """Raise ModelError unless every observed site has one log-density term per observation."""
        if self.obs_latent_names:
            raise ModelError(
                f"per-observation log-likelihoods need the latent sites {list(self.obs_latent_names)} summed out, "
                "which is not derived for this model; they are available for models without per-observation latents"
            )
        tr = self._client_trace({}, self._example, jnp.ones(next(iter(self._example.values())).shape[0], bool))
        for name in self.observed:
            if not any(f.name in self.data_plates for f in tr[name]["cond_indep_stack"]):
                raise ModelError(
                    f"observed site '{name}' is not inside the data plate, so it has no value per "
                    "observation; put it under numpyro.plate over the client's rows"
                )

    def sample_observed(self, key: jax.Array, values_c: Mapping[str, Any], data: Mapping[str, jax.Array]) -> Params:
        """Draw the observed sites afresh at the client's inputs given constrained ``values_c``
        (posterior predictive replicates y_rep ~ p(y | x, theta, z)); ``{site: (max_size, ...)}``."""
        fn = handlers.seed(_Unobserve(handlers.substitute(self.model, data=dict(values_c)), self.observed), key)
        tr = handlers.trace(fn).get_trace(**data, **self.model_kwargs)
        return {n: tr[n]["value"] for n in self.observed}

    def trace_values(
        self,
        values_c: Mapping[str, Any],
        data: Mapping[str, jax.Array],
        names: Sequence[str],
        key: jax.Array | int = 0,
        locals_at_mean: bool = False,
    ) -> Params:
        """The named sites' values when the model runs on ``data`` with the constrained latent values
        ``values_c`` substituted and ``key`` for every other random choice (observed sites whose data are
        not given, a new client's locals drawn from p(z | theta), per-observation latents): one draw of
        NumPyro's ``Predictive``. Deterministic sites are recomputed, never substituted. With
        ``locals_at_mean`` the local latents not in ``values_c`` take their population mean E[z | theta]
        instead of a draw (the non-personalised model: :meth:`substitution`)."""
        recorded = getattr(self, "deterministic", {})  # a FedModel pickled before it recorded them has none
        values = {k: v for k, v in values_c.items() if k not in recorded}
        tr = handlers.trace(handlers.seed(self.substituted(values, locals_at_mean), key)).get_trace(
            **data, **self.model_kwargs
        )
        return {n: tr[n]["value"] for n in names}

    def substituted(self, values_c: Mapping[str, Any], locals_at_mean: bool = False) -> Callable:
        """The model with the constrained ``values_c`` substituted; with ``locals_at_mean`` also every local
        latent not among them at its population mean E[z | theta] (the model a fit with
        ``local_latents="population-mean"`` estimated: every client the average client)."""
        if not locals_at_mean:
            return handlers.substitute(self.model, data=values_c)
        local_names = set(self.local_names)

        def value(site):
            if site["name"] in values_c:
                return values_c[site["name"]]
            return site["fn"].mean if site["name"] in local_names else None

        return handlers.substitute(self.model, substitute_fn=value)

    def observed_values(self, data: Mapping[str, jax.Array]) -> Params:
        """The observed values of one padded client as the model sees them, ``{site: (max_size, ...)}``."""
        tr = _trace(self.model, {**data, **self.model_kwargs})
        return {n: tr[n]["value"] for n in self.observed}

    def client_log_joint(self, theta_u: Params, z_u: Params, data, mask) -> jax.Array:
        """log p(D_i, z_i | theta) in unconstrained z (global prior excluded)."""
        a, b = self.client_log_terms(theta_u, z_u, data, mask)
        return a + b

    def local_score(self, theta_u: Params, z_u: Params, data, mask) -> Params:
        """grad_z log p(z | D_i, theta): the drift of the client's Langevin chain."""
        return jax.grad(lambda z: self.client_log_joint(theta_u, z, data, mask))(z_u)

    def joint_grads(self, theta_u: Params, z_u: Params, data, mask) -> tuple[jax.Array, Params, Params]:
        """``(log p(D_i, z | theta), grad_theta, grad_z)`` from one reverse pass."""
        val, (g_theta, g_z) = jax.value_and_grad(self.client_log_joint, argnums=(0, 1))(theta_u, z_u, data, mask)
        return val, g_theta, g_z

    def fisher_gradient(self, theta_u: Params, z_samples_u: Params, data, mask) -> Params:
        """Monte Carlo Fisher-identity estimate of grad_theta log p(D_i | theta) (FedPop eqs. 8-11).

        ``z_samples_u`` holds samples of the local posterior p(z | D_i, theta) stacked on a leading
        axis; the estimate is the mean over samples of grad_theta log p(D_i, z | theta).
        """
        g = jax.vmap(jax.grad(self.client_log_joint), in_axes=(None, 0, None, None))(theta_u, z_samples_u, data, mask)
        return jax.tree_util.tree_map(lambda a: jnp.mean(a, axis=0), g)

    def sample_local_prior(self, key: jax.Array, theta_u: Params, data, mask) -> Params:
        """Draw unconstrained local latents from the population prior p(z | theta)."""
        fn = handlers.substitute(handlers.seed(self.model, key), data=self._constrain(theta_u))
        tr = handlers.trace(fn).get_trace(**data, **self.model_kwargs)
        return self._unconstrain({n: tr[n]["value"] for n in self.local_names})

    def zeros_local(self) -> Params:
        """Unconstrained zero local latents (shapes of one client)."""
        dtype = jnp.result_type(float)  # zeros made on the host: no computation compiled outside jit
        return {n: jnp.asarray(np.zeros(self.sites[n].unconstrained_shape, dtype)) for n in self.local_names}

    def federated_log_density(self, theta_u: Params, z_u_stacked: Params, data: FederatedData) -> jax.Array:
        """log p(theta) + sum_i log p(D_i, z_i | theta): the federated target over all clients."""
        per_client = jax.vmap(self.client_log_joint, in_axes=(None, 0, 0, 0))(
            theta_u, z_u_stacked, data.padded, data.mask
        )
        return self.log_prior(theta_u) + jnp.sum(per_client)
