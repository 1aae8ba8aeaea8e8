"""The algorithm protocol (fedbayes.protocol): a new algorithm written against it alone (the toy in
examples/protocol_toy.py) runs through fb.fed_fit and through the Flower adapter unchanged, with the
exact ledger; the base class declares the required stages and documents no-op defaults for the rest."""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_HOME", tempfile.mkdtemp(prefix="fedbayes-flwr-"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import fedbayes as fb  # noqa: E402
from fedbayes.engine import run_rounds, staged_init  # noqa: E402
from fedbayes.protocol import FederatedRun, FitParts, Message, Problem  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from protocol_toy import FedGradientAscent  # noqa: E402

ROUNDS, CLIENTS, DIM = 300, 8, 3


@pytest.fixture(scope="module")
def problem():
    data, _ = fb.models.make_glm_clients(CLIENTS, DIM, 40, family="linear", seed=0)
    pooled = data.pooled()
    x, y = np.asarray(pooled["x"], np.float64), np.asarray(pooled["y"], np.float64)
    mode = np.linalg.solve(x.T @ x + np.eye(DIM), x.T @ y)  # prior N(0, I), noise sd 1: the posterior mode
    return data, mode


def _ledger_ok(res):
    # every round each client sends its gradient and receives theta (3 floats of 32 bits each way); the
    # set-up sends theta_0 to every client and nothing back
    floats = ROUNDS * CLIENTS * DIM
    assert res.bits_up == 32 * floats
    assert res.bits_down == 32 * (floats + CLIENTS * DIM)


def test_a_toy_algorithm_runs_through_fed_fit_to_the_exact_posterior_mode(problem):
    data, mode = problem
    res = fb.fed_fit(fb.models.linear_regression(), data, FedGradientAscent(step_size=1e-3), num_rounds=ROUNDS,
                     seed=0, progress=False)
    # gradient ascent on a quadratic contracts by (1 - step * lambda_min) per round; 300 rounds take the
    # error below float32 rounding of the iterate (about 1e-7 relative), so 1e-5 is rounding, not tolerance
    np.testing.assert_allclose(res.params["w"], mode, rtol=1e-5, atol=1e-6)
    _ledger_ok(res)


def test_the_same_toy_runs_on_flower_unchanged(problem):
    pytest.importorskip("flwr")
    data, _ = problem
    algo = FedGradientAscent(step_size=1e-3)
    ref = fb.fed_fit(fb.models.linear_regression(), data, algo, num_rounds=ROUNDS, seed=0, progress=False)
    res = fb.flower.simulate(fb.models.linear_regression(), data, algo, num_rounds=ROUNDS, seed=0, backend="local",
                             progress=False)
    # client steps one at a time on Flower and vectorised in fed_fit: equal to float32 rounding
    np.testing.assert_allclose(res.params["w"], ref.params["w"], rtol=1e-5)
    _ledger_ok(res)
    assert res.bits_up == ref.bits_up and res.bits_down == ref.bits_down


def test_the_base_class_requires_the_stages_and_defaults_the_rest():
    class Incomplete(FederatedRun):
        def client_step(self, key, broadcast, state, client):
            return state, Message((), jnp.zeros((), jnp.int32))

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()
    assert {"setup_server", "setup_client", "setup_server_step", "client_step", "server_step", "finalize"} == set(
        FederatedRun.__abstractmethods__)
    for flag, default in (("replies", False), ("resyncs", False), ("final_exchange", False), ("participation", 1.0),
                          ("setup_stages", 1), ("divergence_hint", "")):
        assert getattr(FederatedRun, flag) == default
    state = {"a": jnp.ones(2)}
    base = FederatedRun.__dict__
    assert base["client_finish"](None, None, state, None, None)[0] is state
    assert int(base["client_finish"](None, None, state, None, None)[1]) == 0
    assert base["resync"](None, state, None) is state
    assert int(base["resync_message"](None, state).bits) == 0
    assert base["final_server"](None, jax.random.PRNGKey(0), None, None, None, None) == {}
    assert base["finish_message"](None, state) is state
    # settings: the set-up's server state unchanged, and nothing sent to the clients
    assert base["setup_done"](None, state, None) is state and base["client_settings"](None, state) == ()


def test_fit_parts_are_typed_and_read_as_a_mapping():
    parts = FitParts(params={"w": 1.0}, params_last={"w": 2.0})
    assert parts["params"] == {"w": 1.0} and parts.get("se") is None and "se" not in parts
    parts["se"] = {"w": 0.5}
    assert parts.se == {"w": 0.5} and dict(parts.items())["se"] == {"w": 0.5}
    copied = {}
    copied.update(parts)  # reads as a mapping of the fields that are set
    assert set(copied) == set(dict(parts)) == {"params", "params_last", "se", "init_bits", "start_bits", "final_bits"}
    with pytest.raises(TypeError, match="no field 'standard_error'"):
        parts.update({"standard_error": {}})  # a misspelt part is an error, not a silent omission
    with pytest.raises(KeyError):
        parts["information"]
    # a run may return a plain dict: the engine checks it field by field (fedbayes.engine.with_init_bits)
    assert FitParts.of({"params": {}, "params_last": {}, "se": {"w": 1.0}}).se == {"w": 1.0}
    with pytest.raises(TypeError, match="no field 'step'"):
        FitParts.of({"params": {}, "params_last": {}, "step": 0.1})
    with pytest.raises(TypeError, match="need \\['params_last'\\]"):
        FitParts.of({"params": {}})


def _glm():
    data, _ = fb.models.make_glm_clients(5, 2, 20, family="logistic", seed=3)
    return fb.models.logistic_regression(), data


def _lme():
    data, _ = fb.models.make_linear_mixed_effects(6, seed=1)
    return fb.models.linear_mixed_effects, data


def _gmm():
    data, _ = fb.models.make_gaussian_mixture(4, num_components=2, dim=2, sizes=(20, 30), seed=3)
    return fb.models.gaussian_mixture(2, 2), data


_SLOW = pytest.mark.slow  # second tier (make test-slow): 10-60 s each, FedSOUL's and FedMM's final exchanges


@pytest.mark.parametrize("case", [
    (fb.LMC(num_chains=2), _glm), (fb.BELF(uplink=fb.compress.top_k(1), downlink=fb.compress.top_k(1)), _glm),
    (fb.TAMUNA(precondition=True), _glm),
    pytest.param((fb.QLSD(compressor=fb.compress.rand_k(1)), _glm), marks=_SLOW),
    pytest.param((fb.TAMUNA(s=2), _glm), marks=_SLOW), pytest.param((fb.GD(), _glm), marks=_SLOW),
    pytest.param((fb.FedSOUL(num_samples=4, warmup=4), _lme), marks=_SLOW), pytest.param((fb.FedMM(), _gmm), marks=_SLOW)],
    ids=lambda c: c[0].name)
@pytest.mark.filterwarnings("ignore::fedbayes.ConvergenceWarning")  # 4 rounds: far from converged, on purpose
def test_a_run_is_not_changed_by_its_fit(case):
    """Settings travel in the states: after build, neither the set-up, the rounds nor finalize sets or
    replaces any attribute of the run (so tracing order cannot matter)."""
    algo, make = case
    model, data = make()
    problem = Problem(fb.FedModel(model, data), data, 4, 3 if algo.name in ("TAMUNA", "QLSD") else None)
    run = algo.build(problem)
    before = dict(vars(run))
    carry, _ = staged_init(run, jax.random.PRNGKey(0), problem)
    carry, history = run_rounds(run, problem, carry, base_key=jax.random.PRNGKey(1),
                                cohort_size=problem.cohort_size or data.num_clients, progress=False)
    parts = run.finalize(jax.random.PRNGKey(2), carry, problem, history=history)
    assert isinstance(parts, FitParts)
    after = vars(run)
    assert after.keys() == before.keys(), set(after) ^ set(before)
    assert [k for k in before if after[k] is not before[k]] == []


def test_the_public_surface_is_sorted_complete_and_exports_the_protocol():
    assert all(hasattr(fb, name) for name in fb.__all__) and len(set(fb.__all__)) == len(fb.__all__)
    classes = [n for n in fb.__all__ if n[0].isupper()]
    rest = [n for n in fb.__all__ if not n[0].isupper()]
    assert fb.__all__ == sorted(classes, key=str.lower) + sorted(rest, key=str.lower)
    assert fb.FederatedRun is FederatedRun and fb.FitParts is FitParts
