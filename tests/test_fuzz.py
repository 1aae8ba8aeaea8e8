"""Fuzzing: fit arguments, compressors and model structures end in a documented error or a correct
result, never a deep crash (see tests/fuzz_harness.py; ``make fuzz`` runs a longer random sample).

The data domain lives in tests/test_fuzz_regressions.py with the data regressions it grew from.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import pytest
import numpyro.distributions as dist
from hypothesis import given
from hypothesis import strategies as st
from numpyro.distributions import constraints

import fedbayes as fb
from fedbayes.errors import COUNT_MAX
from fuzz_harness import classify, fuzz_settings

RNG = np.random.default_rng(0)
SIZES = (2, 3, 5)
X = [RNG.normal(size=(n, 2)) for n in SIZES]
DATA = fb.FederatedData({
    "x": X,
    "y": [x @ np.array([1.0, -0.5]) + RNG.normal(size=len(x)) for x in X],
    "c": [RNG.integers(0, 2, size=len(x)) for x in X],
})


def regression(x, y, c):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


def check_fit(res: fb.Result) -> None:
    """A successful fit returns finite estimates or draws of every global site."""
    values = res.params if res.params else {k: np.asarray(v) for k, v in res.idata.posterior.items()}
    for name, v in values.items():
        assert np.all(np.isfinite(np.asarray(v))), (name, v)


# ---------------------------------------------------------------------------------- fit arguments
ALGORITHM_OPTIONS = {
    "step_size": [None, 0.01, 0.01, 0.0, -0.1, math.nan, 1e30],
    "local_steps": [1, 2, 0, -1, 2.5, 2**31],
    "num_chains": [1, 2, 0, 2**31],
    "warmup": [0, 1, -1, 2**63],
    "thinning": [1, 2, 0, 2**31],
    "p": [None, 0.5, 0.0, 1.0, 1.5],
    "s": [None, 2, 3, 1, 100],
    "eta": [None, 0.5, 0.0, 2.0],
    "participation": [1.0, 0.5, 0.0, 2.0],
    "compressor": [fb.compress.identity(), fb.compress.top_k(1), fb.compress.qsgd(2), None, "q"],
    "uplink": [fb.compress.identity(), fb.compress.top_k(1), fb.compress.rand_k(1)],
    "downlink": [fb.compress.identity(), fb.compress.natural(), "none"],
    "num_samples": [4, 0, 2**31, 2**63],
    "m_step_iters": [5, 0, 2**31],
    "louis_draws": [10, 0, 2**31],
}
ALGORITHMS = {
    "FedSOUL": (fb.FedSOUL, {"num_samples": 4, "warmup": 4, "num_chains": 1, "local_steps": 2}),
    "FedMM": (fb.FedMM, {"m_step_iters": 5, "louis_draws": 10}),
    "FedEM": (fb.FedEM, {"m_step_iters": 5, "louis_draws": 10}),
    "ParamAveragingEM": (fb.ParamAveragingEM, {"m_step_iters": 5, "louis_draws": 10}),
    "LMC": (fb.LMC, {"num_chains": 1}), "PELF": (fb.PELF, {"num_chains": 1}),
    "DELF": (fb.DELF, {"num_chains": 1}), "BELF": (fb.BELF, {"num_chains": 1}),
    "QLSD": (fb.QLSD, {"num_chains": 1}), "TAMUNA": (fb.TAMUNA, {"s": 2}), "Scaffnew": (fb.Scaffnew, {}),
    "GD": (fb.GD, {}), "FedAvg": (fb.FedAvg, {}),
}


@st.composite
def algorithm_choices(draw):
    name = draw(st.sampled_from(sorted(ALGORITHMS)))
    cls, small = ALGORITHMS[name]
    accepted = set(cls.__init__.__code__.co_varnames)
    options = dict(small)
    for key in draw(st.lists(st.sampled_from(sorted(ALGORITHM_OPTIONS)), max_size=3, unique=True)):
        if key in accepted:
            options[key] = draw(st.sampled_from(ALGORITHM_OPTIONS[key]))
    return cls, options


def mostly(valid: list, odd: list) -> st.SearchStrategy:
    """Valid values three times as likely as odd ones, so most draws reach the fit itself."""
    return st.sampled_from(valid * 3 + odd)


@fuzz_settings(examples_in_suite=8)
@given(algorithm=algorithm_choices(),
       num_rounds=mostly([1, 2], [0, -1, 2.0, None, "2", True, 2**31, 2**63]),
       clients_per_round=mostly([None, 2, 3, 0.5], [4, 0, -1, 1.5, math.nan, True, 2**63]),
       seed=mostly([0, 7, 2**32 + 7, 2**64 - 1], [-1, 2**64, 1.5, None, True]),
       chunk_size=mostly([1, 2, 50, 2**31 - 1], [0, -3, True, 2**63]),
       faults=mostly([None, fb.Faults(drop=0.3), fb.Faults(nan=0.5)], ["drop"]),
       model_kwargs=mostly([None, {}], [{"x": 1.0}, {"unused": 1.0}]),
       progress=mostly([False], ["no", 1, 0, "False"]))
def test_fuzz_fit_arguments(algorithm, num_rounds, clients_per_round, seed, chunk_size, faults, model_kwargs,
                            progress):
    cls, options = algorithm
    outcome, alg = classify("algorithm options", cls, **options)
    if outcome != "success":
        return
    outcome, res = classify("fit arguments", fb.fed_fit, regression, DATA, alg, num_rounds=num_rounds,
                            clients_per_round=clients_per_round, seed=seed, chunk_size=chunk_size, faults=faults,
                            model_kwargs=model_kwargs, progress=progress)
    if outcome == "success":
        assert len(res.history["bits_up"]) == num_rounds
        check_fit(res)


# ---------------------------------------------------------------------------------- compressors
COMPRESSORS = {
    "identity": (fb.compress.identity, {"float_bits": [32, 16, 64, 8, 0, "32"]}),
    "rand_k": (fb.compress.rand_k, {"k": [None, 1, 3, 0, -1, 10**9, 2.5], "fraction": [None, 0.5, 0.0, 1.0, 1.5, math.nan],
                                    "float_bits": [32, 16, 7]}),
    "top_k": (fb.compress.top_k, {"k": [None, 1, 3, 0, -1, 10**9], "fraction": [None, 0.25, 0.0, 2.0],
                                  "float_bits": [32, 16, 64]}),
    "qsgd": (fb.compress.qsgd, {"levels": [1, 2, 255, 0, -1, 2**20, 2**31 - 1, 2**40, 1.5], "float_bits": [32, 16],
                                "contractive": [False, True, "yes"]}),
    "natural": (fb.compress.natural, {"float_bits": [32, 16, 64, 12], "contractive": [False, True, 1]}),
}
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False, width=32),
                   st.sampled_from([0.0, 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38, 65504.0, 70000.0, 6e-8, 1e-20]))


@st.composite
def compressor_choices(draw):
    name = draw(st.sampled_from(sorted(COMPRESSORS)))
    make, pool = COMPRESSORS[name]
    kwargs = {k: draw(st.sampled_from(v)) for k, v in pool.items() if draw(st.booleans())}
    if name == "qsgd" and "levels" not in kwargs:
        kwargs["levels"] = 2
    return make, kwargs


@fuzz_settings(examples_in_suite=60)
@given(compressor=compressor_choices(), values=st.lists(FLOATS, min_size=1, max_size=40),
       seed=st.integers(0, 2**31 - 1))
def test_fuzz_compressors(compressor, values, seed):
    make, kwargs = compressor
    outcome, comp = classify("compressor options", make, **kwargs)
    if outcome != "success":
        return
    x = jnp.asarray(np.asarray(values, dtype=np.float32))
    outcome, out = classify("compressor input", comp, jax.random.PRNGKey(seed), x)
    if outcome == "success":
        x_hat, bits = out
        assert x_hat.shape == x.shape
        assert bool(jnp.all(jnp.isfinite(x_hat))), (comp, x, x_hat)  # finite in, finite out
        assert int(bits) == comp.bits(x.size)


# ---------------------------------------------------------------------------------- model structures
GLOBALS = ["w_normal", "sigma_halfnormal", "mu_param", "scale_param_positive", "mvn", "discrete"]
LOCALS = ["none", "normal", "discrete"]
LIKELIHOODS = ["plate_normal", "plate_bernoulli", "plate_factor", "factor_of_sum", "observed_mean",
               "scalar_first_row", "mixture_labels", "unobserved"]


def build_model(globals_: tuple[str, ...], local: str, likelihood: str):
    """A model assembled from the chosen blocks (some combinations are valid, some are not)."""

    def model(x, y, c):
        mean = jnp.zeros(())
        scale = 1.0
        if "w_normal" in globals_:
            mean = mean + x @ numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
        if "sigma_halfnormal" in globals_:
            scale = numpyro.sample("sigma", dist.HalfNormal(1.0))
        if "mu_param" in globals_:
            mean = mean + numpyro.param("mu", 0.0)
        if "scale_param_positive" in globals_:
            scale = numpyro.param("s", 1.0, constraint=constraints.positive)
        if "mvn" in globals_:
            mean = mean + numpyro.sample("m", dist.MultivariateNormal(jnp.zeros(2), jnp.eye(2))).sum()
        if "discrete" in globals_:
            mean = mean + numpyro.sample("k", dist.Bernoulli(0.5))
        if local != "none":
            with fb.local():
                b = numpyro.sample("b", dist.Normal(0.0, 1.0) if local == "normal" else dist.Bernoulli(0.5))
            mean = mean + b
        n = x.shape[0]
        if likelihood == "plate_normal":
            with numpyro.plate("obs", n):
                numpyro.sample("y", dist.Normal(mean, scale), obs=y)
        elif likelihood == "plate_bernoulli":
            with numpyro.plate("obs", n):
                numpyro.sample("c", dist.Bernoulli(logits=mean), obs=c)
        elif likelihood == "plate_factor":
            with numpyro.plate("obs", n):
                numpyro.factor("lik", dist.Normal(mean, scale).log_prob(y))
        elif likelihood == "factor_of_sum":
            numpyro.factor("lik", dist.Normal(mean, scale).log_prob(y).sum())
        elif likelihood == "observed_mean":
            numpyro.sample("ybar", dist.Normal(jnp.mean(mean), scale), obs=y.mean())
        elif likelihood == "scalar_first_row":
            numpyro.sample("y0", dist.Normal(jnp.broadcast_to(mean, (n,))[0], scale), obs=y[0])
        elif likelihood == "mixture_labels":
            locs = numpyro.param("locs", jnp.array([-1.0, 1.0]))
            with numpyro.plate("obs", n):
                z = numpyro.sample("z", dist.Categorical(probs=jnp.array([0.5, 0.5])))
                numpyro.sample("y", dist.Normal(locs[z] + mean, scale), obs=y)
        else:
            with numpyro.plate("obs", n):
                numpyro.sample("y", dist.Normal(mean, scale))

    return model


@fuzz_settings(examples_in_suite=10)
@given(globals_=st.lists(st.sampled_from(GLOBALS), min_size=0, max_size=2, unique=True).map(tuple),
       local=st.sampled_from(LOCALS), likelihood=st.sampled_from(LIKELIHOODS),
       algorithm=st.sampled_from(sorted(ALGORITHMS)))
def test_fuzz_model_structures(globals_, local, likelihood, algorithm):
    cls, small = ALGORITHMS[algorithm]
    model = build_model(globals_, local, likelihood)
    outcome, res = classify("model structure", fb.fed_fit, model, DATA, cls(**small), num_rounds=2, progress=False)
    if outcome == "success":
        check_fit(res)


# ---------------------------------------------------------------------------------- option types
# Every public configuration, its options read from its signature: the frozen dataclasses fedbayes exports
# (algorithms, fault models and policies, aggregation), fb.privacy.DP and the compressor factories. A new
# option is fuzzed the day it lands. (FitParts and FormulaModel are built by fedbayes, not by users;
# CustomStatistics and Symmetry take functions, checked where they are called.)
NOT_OPTIONS = {"FitParts", "FormulaModel", "CustomStatistics", "Symmetry"}
CONFIGURATIONS = {
    **{n: getattr(fb, n) for n in fb.__all__
       if isinstance(getattr(fb, n), type) and dataclasses.is_dataclass(getattr(fb, n)) and n not in NOT_OPTIONS},
    "privacy.DP": fb.privacy.DP,
    **{f"compress.{n}": getattr(fb.compress, n) for n in ("identity", "rand_k", "rand_k_unscaled", "top_k", "qsgd", "natural")},
}
REQUIRED = {"privacy.DP": {"clip": 1.0, "noise_multiplier": 1.0}, "compress.qsgd": {"levels": 2}}
# what a user passes by mistake: the wrong type, the wrong kind of number, extremes, NumPy scalars and arrays
CONFUSED = [True, False, None, "1", "", b"x", 0, 1, -1, 2, 1.5, 0.0, -0.0, math.nan, math.inf, -math.inf,
            2**31, 2**63, 2**70, -(2**70), 1e308, 5e-324, 1 + 2j, np.float32(0.5), np.float64(2.0), np.int64(3),
            np.int32(2), np.uint8(1), np.bool_(True), np.array(1.0), np.array([1.0, 2.0]), [1], (1,), {}, object()]


def option_kinds(make) -> dict[str, str]:
    """Each option of ``make``: "seed", "flag" (annotated ``bool``), "count" (an int), "number" (a float, or an int or
    float) or "other"."""
    kinds = {}
    for name, par in inspect.signature(make).parameters.items():
        if name == "name":
            continue
        ann = str(par.annotation)
        words = set(ann.replace("|", " ").split())
        if name.endswith("seed"):
            kinds[name] = "seed"
        elif words == {"bool"}:
            kinds[name] = "flag"
        elif "int" in words and words <= {"int", "None"}:
            kinds[name] = "count"
        elif words and words <= {"int", "float", "None"}:
            kinds[name] = "number"
        else:
            kinds[name] = "other"
    return kinds


def check_option(config: str, option: str, kind: str, value) -> None:
    """Construct ``config`` with ``option=value``: a documented error, or an object; a flag takes a bool only,
    a count an integer up to ``COUNT_MAX``, a seed one below 2^64, a number a real scalar only (no bool, string, complex, array or
    container)."""
    make = CONFIGURATIONS[config]
    outcome, _ = classify("option types", make, **{**REQUIRED.get(config, {}), option: value})
    if outcome == "success" and kind == "flag":
        assert isinstance(value, bool), f"{config}({option}={value!r}) accepted as a flag"
    if outcome == "success" and kind == "count":  # an integer the compiled programs can count to
        assert value is None or (isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
                                 and value <= COUNT_MAX), f"{config}({option}={value!r}) accepted as a count"
    if outcome == "success" and kind == "seed":
        assert value is None or (isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))
                                 and 0 <= value < 2**64), f"{config}({option}={value!r}) accepted as a seed"
    if outcome == "success" and kind == "number":
        assert value is None or (isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))), (
            f"{config}({option}={value!r}) accepted as a number")


def test_every_option_of_every_configuration_takes_only_its_type():
    """All of CONFUSED against every option of every public configuration (about 12 000 constructions)."""
    count = 0
    for config, make in CONFIGURATIONS.items():
        for option, kind in option_kinds(make).items():
            for value in CONFUSED:
                check_option(config, option, kind, value)
                count += 1
    assert count > 10_000 and len(CONFIGURATIONS) >= 29, (count, sorted(CONFIGURATIONS))  # none missed by the scan


@fuzz_settings(examples_in_suite=50)
@given(data=st.data(), value=st.one_of(st.integers(), st.floats(), st.text(max_size=3), st.booleans(), st.none(),
                                       st.complex_numbers(), st.lists(st.floats(), max_size=3)))
def test_fuzz_option_types(data, value):
    config = data.draw(st.sampled_from(sorted(CONFIGURATIONS)))
    kinds = option_kinds(CONFIGURATIONS[config])
    option = data.draw(st.sampled_from(sorted(kinds)))
    check_option(config, option, kinds[option], value)


# ---------------------------------------------------------------------------------- model classes
# The classes of model the 2026-12-01 campaign found defects in, each a few members, fitted by every family:
# degenerate curvature (no curvature, a flat direction, a non-identified sum, extreme scales), validity that
# depends on the start (a prior whose centre makes a later distribution invalid), and Python control flow on
# traced values (always a ModelError that names it).
def _regression_mean(x, scale=1.0):
    w = numpyro.sample("w", dist.Normal(0.0, scale).expand([2]).to_event(1))
    return x @ w


def _observe(mean, y, scale=1.0):
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(mean, scale), obs=y)


def curvature_masked(x, y, c):  # a param the likelihood never sees: no curvature at all
    w = numpyro.param("w", jnp.zeros(2))
    with numpyro.handlers.mask(mask=False):
        _observe(x @ w, y)


def curvature_unused_param(x, y, c):  # a flat direction next to an identified one
    numpyro.param("a", 0.0)
    _observe(_regression_mean(x), y)


def curvature_sum(x, y, c):  # only a + b is identified
    _observe(numpyro.param("a", 0.0) + numpyro.param("b", 0.0), y)


def curvature_stiff(x, y, c):  # curvature 1e12
    _observe(1e6 * _regression_mean(x), y)


def curvature_flat(x, y, c):  # a prior of scale 1e8 and a likelihood of curvature 1e-12
    _observe(1e-6 * _regression_mean(x, 1e8), y)


def curvature_zero_likelihood(x, y, c):  # the prior's curvature only
    _observe(0.0 * _regression_mean(x), y)


def curvature_local_flat(x, y, c):  # a local latent the likelihood does not read
    w = numpyro.param("w", jnp.zeros(2))
    with fb.local():
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    _observe(x @ w + 0.0 * b, y)


def start_negative_scale(x, y, c):  # the prior's centre 0 is an invalid scale
    _observe(0.0, y, numpyro.sample("s", dist.Normal(0.0, 1.0)))


def start_param_negative_scale(x, y, c):
    _observe(0.0, y, numpyro.param("s", -1.0))


def start_probability_outside(x, y, c):  # valid at the start, invalid past 1
    p = numpyro.sample("p", dist.Normal(0.5, 1.0))
    with numpyro.plate("obs", c.shape[0]):
        numpyro.sample("c", dist.Bernoulli(probs=p), obs=c)


def start_log_of_centre(x, y, c):  # log(0) at the start
    _observe(jnp.log(numpyro.sample("a", dist.Normal(0.0, 1.0))), y)


def start_local_negative_scale(x, y, c):
    w = numpyro.param("w", jnp.zeros(2))
    with fb.local():
        s = numpyro.sample("s", dist.Normal(0.0, 1.0))
    _observe(x @ w, y, s)


def traced_if(x, y, c):
    mean = _regression_mean(x)
    _observe(mean if mean[0] > 0 else -mean, y)


def traced_float(x, y, c):
    mean = _regression_mean(x)
    _observe(mean, y, float(mean[0]) ** 2 + 1.0)


def traced_int_of_data(x, y, c):
    _observe(_regression_mean(x) + int(jnp.sum(y > 0)), y)


def traced_numpy(x, y, c):
    _observe(np.asarray(_regression_mean(x)), y)


def traced_item(x, y, c):
    mean = _regression_mean(x)
    _observe(mean, y, 1.0 + mean.sum().item() ** 2)


def traced_range(x, y, c):
    mean = _regression_mean(x)
    total = 0.0
    for _ in range(y.shape[0] if y[0] > 0 else 1):
        total = total + mean
    _observe(total, y)


def traced_local_if(x, y, c):
    w = numpyro.param("w", jnp.zeros(2))
    with fb.local():
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    _observe(x @ w + (b if b > 0 else 0.0), y)


MODEL_CLASSES = {
    "degenerate curvature": [curvature_masked, curvature_unused_param, curvature_sum, curvature_stiff,
                             curvature_flat, curvature_zero_likelihood, curvature_local_flat],
    "start validity": [start_negative_scale, start_param_negative_scale, start_probability_outside,
                       start_log_of_centre, start_local_negative_scale],
    "traced control flow": [traced_if, traced_float, traced_int_of_data, traced_numpy, traced_item, traced_range,
                            traced_local_if],
}
FAMILIES = {**{n: ALGORITHMS[n] for n in ("GD", "TAMUNA", "Scaffnew", "FedAvg", "LMC", "DELF", "FedSOUL", "FedMM")},
            "JointLMC": (fb.JointLMC, {"num_chains": 1})}


@pytest.mark.filterwarnings("ignore::fedbayes.ConvergenceWarning")  # three rounds: only the outcome is judged
@fuzz_settings(examples_in_suite=12)
@given(domain=st.sampled_from(sorted(MODEL_CLASSES)), data=st.data(), family=st.sampled_from(sorted(FAMILIES)))
def test_fuzz_model_classes(domain, data, family):
    model = data.draw(st.sampled_from(MODEL_CLASSES[domain]), label="model")
    cls, small = FAMILIES[family]
    outcome, res = classify(domain, fb.fed_fit, model, DATA, cls(**small), num_rounds=3, progress=False)
    if domain == "traced control flow":  # never a fit, and the error says why
        assert outcome == "error" and isinstance(res, fb.ModelError), (model.__name__, family, res)
    elif outcome == "success":
        check_fit(res)


# ---------------------------------------------------------------------------------- private fits
@pytest.mark.filterwarnings("ignore::fedbayes.ConvergenceWarning")  # a noisy fit's warning is the point
@fuzz_settings(examples_in_suite=3)
@given(noise=st.sampled_from([0.0, 0.1, 1.0, 10.0, 1e3, 1e6]), clip=st.sampled_from([0.1, 1.0, 10.0]),
       noise_seed=st.integers(0, 2**32), family=st.sampled_from(["GD", "FedAvg", "LMC", "DELF"]))
def test_fuzz_private_fits(noise, clip, noise_seed, family):
    """A private fit ends in a documented error or a fit whose convergence verdict covers its noise: a point
    estimate's table holds the privacy-noise row (a converged fit passed it); its epsilon is finite wherever
    noise is added (a sampler's step noise counts, so a private sampler's always is)."""
    cls, small = ALGORITHMS[family]
    dp = fb.privacy.DP(clip=clip, noise_multiplier=noise, noise_seed=noise_seed)
    start = {} if family in ("GD", "FedAvg") else {"init": "prior"}  # the automatic step and start are releases
    outcome, algo = classify("private fits", cls, **small, **start, step_size=0.05, privacy=dp)
    if outcome != "success":
        return
    outcome, res = classify("private fits", fb.fed_fit, regression, DATA, algo, num_rounds=20, progress=False)
    if outcome == "success":
        check_fit(res)
        noisy = noise > 0 or family in ("LMC", "DELF")  # a Langevin step's own noise is counted (P-/D-ELF's DP)
        assert res.privacy is not None and np.isfinite(res.privacy["epsilon"]) == noisy, res.privacy
        if family in ("GD", "FedAvg") and noise > 0:
            row = res.diagnostics.set_index("check").loc["privacy_noise"]
            assert bool(row["ok"]) == (row["value"] <= 1.0) and (res.converged <= bool(row["ok"]))
