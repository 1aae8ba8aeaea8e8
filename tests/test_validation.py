"""Property tests of input validation: malformed inputs raise the documented error type (never a crash
deep inside JAX or NumPy), valid ones never raise."""

import dataclasses
import numbers
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedbayes as fb
from fedbayes.errors import ConfigError, DataError

# CI runs a fixed set of 60 examples per property (derandomised); FB_PROP_EXAMPLES=500 explores afresh
EXPLORE = os.environ.get("FB_PROP_EXAMPLES")
PROPS = settings(max_examples=int(EXPLORE or 60), deadline=None, derandomize=EXPLORE is None,
                 suppress_health_check=[HealthCheck.too_slow])

# anything a user might pass by mistake
ANYTHING = st.one_of(
    st.none(), st.booleans(), st.integers(-10, 10**7), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4), st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.just(object()), st.just(np.array([1.0, np.nan])), st.just(np.float32(0.5)), st.just(np.int64(3)),
)

CONFIGS = [fb.FedSOUL, fb.TAMUNA, fb.Scaffnew, fb.GD, fb.FedAvg, fb.LMC, fb.DELF, fb.PELF, fb.BELF, fb.QLSD, fb.FedMM,
           fb.FedEM, fb.ParamAveragingEM, fb.Faults, fb.FaultPolicy, fb.Aggregation]


@PROPS
@given(cls=st.sampled_from(CONFIGS), data=st.data())
def test_any_bad_option_raises_a_config_error(cls, data):
    """Every option of every algorithm and policy, set to anything: ConfigError or a valid object."""
    fields = {f.name: f.default for f in dataclasses.fields(cls) if f.name != "name"}
    name = data.draw(st.sampled_from(sorted(fields)))
    value = data.draw(ANYTHING)
    try:
        cls(**{name: value})
    except ConfigError:
        return
    if isinstance(fields[name], bool):  # a flag takes True or False only
        assert isinstance(value, bool), f"{cls.__name__}({name}={value!r}) accepted"


VALID = {
    "FedSOUL": dict(local_steps=st.integers(1, 50), burn_in=st.just(0), step_scale=st.floats(0.01, 1.99),
                    server_lr=st.floats(1e-6, 1.0), average_from=st.floats(0.0, 0.99), num_samples=st.integers(1, 500),
                    warmup=st.integers(0, 500), thinning=st.integers(1, 10), num_chains=st.integers(1, 8),
                    aggregation=st.sampled_from(["mean", "median", "trimmed", 0.2])),
    "TAMUNA": dict(step_size=st.floats(1e-6, 10.0), p=st.floats(1e-3, 1.0), s=st.integers(2, 100),
                   eta=st.floats(1e-6, 1.0), kappa=st.floats(1.0, 1e6), downlink_cost=st.floats(0.0, 1.0)),
    "DELF": dict(step_size=st.floats(1e-8, 1.0), num_chains=st.integers(1, 100), warmup=st.integers(0, 100),
                 thinning=st.integers(1, 10), uplink=st.sampled_from([fb.compress.top_k(1), fb.compress.identity(),
                                                                      fb.compress.rand_k_unscaled(2)])),
    "FedMM": dict(step_size=st.floats(1e-3, 1.0), participation=st.floats(1e-3, 1.0),
                  compressor=st.sampled_from([fb.compress.qsgd(3), fb.compress.rand_k(2), fb.compress.identity()])),
    "Faults": dict(drop=st.floats(0.0, 0.3), nan=st.floats(0.0, 0.3), large=st.floats(0.0, 0.3),
                   large_scale=st.one_of(st.floats(1.01, 1e30), st.floats(-1e30, -1.01))),
    "FaultPolicy": dict(min_clients=st.integers(0, 1000), max_abs=st.one_of(st.none(), st.floats(1e-3, 1e30)),
                        relative=st.one_of(st.none(), st.floats(1.01, 1e12))),
}


@PROPS
@given(data=st.data())
def test_valid_options_never_raise(data):
    name = data.draw(st.sampled_from(sorted(VALID)))
    kwargs = {k: data.draw(v) for k, v in VALID[name].items() if data.draw(st.booleans())}
    config = getattr(fb, name)(**kwargs)
    assert {k: getattr(config, k) for k in kwargs} == kwargs  # kept as given


COMPRESSORS = {"identity": fb.compress.identity, "rand_k": fb.compress.rand_k, "top_k": fb.compress.top_k,
               "rand_k_unscaled": fb.compress.rand_k_unscaled, "qsgd": fb.compress.qsgd, "natural": fb.compress.natural}


def _is_count(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1


@PROPS
@given(name=st.sampled_from(sorted(COMPRESSORS)), value=ANYTHING, keyword=st.booleans())
def test_compressor_settings_are_validated(name, value, keyword):
    """One argument set to anything: ConfigError, or a compressor that works on a vector."""
    import jax

    factory = COMPRESSORS[name]
    arg = {"identity": "float_bits", "natural": "float_bits", "qsgd": "levels"}.get(name, "k")
    try:
        c = factory(**{arg: value}) if keyword or arg != "k" else factory(value)
    except ConfigError:
        valid = _is_count(value) and (arg != "float_bits" or value in (16, 32, 64))
        assert not valid, f"{name}({arg}={value!r}) is valid but was refused"
        return
    assert _is_count(value) and (arg != "float_bits" or value in (16, 32, 64)), f"{name}({arg}={value!r}) accepted"
    d = 12 if arg != "k" else max(value, 1)
    if d > 10**4:
        return
    out, bits = c(jax.random.PRNGKey(0), np.linspace(-1, 1, d))
    assert out.shape == (d,) and int(bits) == c.bits(d)


@PROPS
@given(name=st.sampled_from(sorted(COMPRESSORS)),
       x=st.one_of(st.just(np.zeros((2, 3))), st.just(np.arange(4)), st.just(np.zeros(0)), st.just("abc"),
                   st.just(np.ones((1,), bool))))
def test_compressors_refuse_what_is_not_a_float_vector(name, x):
    import jax

    c = COMPRESSORS[name](1) if name in ("rand_k", "top_k", "rand_k_unscaled", "qsgd") else COMPRESSORS[name]()
    with pytest.raises(ConfigError):
        c(jax.random.PRNGKey(0), x)


# ----------------------------------------------------------------------------- federated data

CLIENT_VALUE = st.one_of(
    st.none(), st.integers(), st.text(max_size=3), st.just(np.zeros((0, 2))), st.just(np.ones((3, 2))),
    st.just(np.ones(4)), st.just(np.array(["a", "b"])), st.just(np.array([1 + 2j])), st.just(np.array([np.nan])),
    st.just([[1.0, 2.0], [3.0]]), st.just(np.ones((2, 2), dtype=object)), st.just({"a": 1}),
)


@PROPS
@given(st.one_of(
    st.dictionaries(st.text(max_size=3), st.lists(CLIENT_VALUE, max_size=3), max_size=3),
    st.lists(ANYTHING, max_size=2), ANYTHING,
))
def test_malformed_federated_data_raises_data_error(raw):
    try:
        data = fb.FederatedData(raw)
    except DataError:
        return
    # accepted: it must be a usable data set
    assert data.num_clients >= 1 and np.all(data.sizes >= 1)
    for key in data.keys:
        assert np.all(np.isfinite(np.asarray(data.padded[key], dtype=float)))


@PROPS
@given(num_rounds=ANYTHING, seed=ANYTHING, clients_per_round=ANYTHING, chunk_size=ANYTHING, algorithm=ANYTHING)
def test_fit_arguments_are_validated_before_any_computation(num_rounds, seed, clients_per_round, chunk_size,
                                                            algorithm):
    data = fb.FederatedData({"y": [np.ones(3), np.zeros(2)]})

    def model(y):
        pass

    kwargs = dict(num_rounds=num_rounds, seed=seed, clients_per_round=clients_per_round, chunk_size=chunk_size)
    valid = (_is_count(num_rounds) and isinstance(seed, numbers.Integral) and not isinstance(seed, bool) and seed >= 0
             and _is_count(chunk_size))
    from fedbayes.api import validate_fit

    try:
        validate_fit(model, data, algorithm, faults=None, fault_policy=None, model_kwargs=None, **kwargs)
    except (ConfigError, DataError):
        return
    assert valid
