"""Fuzzing: fit arguments, compressors and model structures end in a documented error or a correct
result, never a deep crash (see tests/fuzz_harness.py; ``make fuzz`` runs a longer random sample).

The data domain lives in tests/test_fuzz_regressions.py with the data regressions it grew from.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from hypothesis import given
from hypothesis import strategies as st
from numpyro.distributions import constraints

import fedbayes as fb
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
    "local_steps": [1, 2, 0, -1, 2.5],
    "num_chains": [1, 2, 0],
    "warmup": [0, 1, -1],
    "thinning": [1, 2, 0],
    "p": [None, 0.5, 0.0, 1.0, 1.5],
    "s": [None, 2, 3, 1, 100],
    "eta": [None, 0.5, 0.0, 2.0],
    "participation": [1.0, 0.5, 0.0, 2.0],
    "compressor": [fb.compress.identity(), fb.compress.top_k(1), fb.compress.qsgd(2), None, "q"],
    "uplink": [fb.compress.identity(), fb.compress.top_k(1), fb.compress.rand_k(1)],
    "downlink": [fb.compress.identity(), fb.compress.natural(), "none"],
    "num_samples": [4, 0],
    "m_step_iters": [5, 0],
    "louis_draws": [10, 0],
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
       num_rounds=mostly([1, 2], [0, -1, 2.0, None, "2"]),
       clients_per_round=mostly([None, 2, 3, 0.5], [4, 0, -1, 1.5, math.nan]),
       seed=mostly([0, 7, 2**32 + 7], [-1, 2**64, 1.5, None]),
       chunk_size=mostly([1, 2, 50], [0, -3]),
       faults=mostly([None, fb.Faults(drop=0.3), fb.Faults(nan=0.5)], ["drop"]),
       model_kwargs=mostly([None, {}], [{"x": 1.0}, {"unused": 1.0}]))
def test_fuzz_fit_arguments(algorithm, num_rounds, clients_per_round, seed, chunk_size, faults, model_kwargs):
    cls, options = algorithm
    outcome, alg = classify("algorithm options", cls, **options)
    if outcome != "success":
        return
    outcome, res = classify("fit arguments", fb.fed_fit, regression, DATA, alg, num_rounds=num_rounds,
                            clients_per_round=clients_per_round, seed=seed, chunk_size=chunk_size, faults=faults,
                            model_kwargs=model_kwargs, progress=False)
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
    "qsgd": (fb.compress.qsgd, {"levels": [1, 2, 255, 0, -1, 2**20, 2**40, 1.5], "float_bits": [32, 16],
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
