"""``Result.save`` / ``fb.load`` and pickling: the loaded result equals the original bit for bit."""

import os
import pickle
import subprocess
import sys
import threading

import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from numpyro.distributions import constraints

import fedbayes as fb
from fedbayes import checkpoint as checkpoint_io
from fedbayes.checkpoint import RESULT_FORMAT
from fedbayes.arviz_adapter import group_names
from fedbayes.result import group


def logistic(x, y=None):
    """Bayesian logistic regression, a top-level function (pickles by reference)."""
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)


def exponential(y):
    rate = numpyro.param("rate", 1.0, constraint=constraints.positive)
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Exponential(rate), obs=y)


@pytest.fixture(scope="module")
def soul():
    data, _ = fb.models.make_linear_mixed_effects(6, sizes=(5, 12), seed=1)
    return fb.fed_fit(fb.models.linear_mixed_effects, data, fb.FedSOUL(local_steps=2, num_samples=20, warmup=10),
                      num_rounds=20, seed=3), data


@pytest.fixture(scope="module")
def lmc():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(n, 2)) for n in (8, 12, 10)]
    ys = [(x @ np.array([1.0, -1.0]) + rng.normal(size=len(x)) > 0).astype(np.float64) for x in xs]
    data = fb.FederatedData({"x": xs, "y": ys})
    return fb.fed_fit(logistic, data, fb.LMC(step_size=0.01, num_chains=2, warmup=10), num_rounds=40, seed=1), data


def _equal_dicts(a, b):
    assert list(a) == list(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
        assert np.asarray(a[k]).dtype == np.asarray(b[k]).dtype


def _same_result(res, back):
    for name in ("params", "params_last", "history", "local_samples", "global_samples", "standard_errors",
                 "global_approx", "local_info", "client_info", "settings"):
        _equal_dicts(getattr(res, name), getattr(back, name))
    assert (back.algorithm, back.seed, back.init_bits, back.final_bits) == (res.algorithm, res.seed, res.init_bits,
                                                                            res.final_bits)
    assert (back.bits_up, back.bits_down, repr(back)) == (res.bits_up, res.bits_down, repr(res))
    names = group_names(res.idata)
    assert group_names(back.idata) == names and "fed_params" in names
    for name in names:
        assert group(back.idata, name).equals(group(res.idata, name))
        assert group(back.idata, name).attrs == group(res.idata, name).attrs


def test_a_fedsoul_result_saves_loads_and_predicts_bit_for_bit(soul, tmp_path):
    res, data = soul
    path = tmp_path / "fit.fbres"
    res.save(path)
    assert sorted(os.listdir(tmp_path)) == ["fit.fbres"]  # no temporary file left
    back = fb.load(path)
    assert back is not res and back._run is None
    _same_result(res, back)
    x = {"x": data.client(0)["x"], "z": data.client(0)["z"]}
    for client in (0, 3, None):
        _equal_dicts(res.predict(x, client, seed=5), back.predict(x, client, seed=5))
    _equal_dicts(res.predict(x, 2, num_samples=7, seed=2), back.predict(x, 2, num_samples=7, seed=2))
    # the model-checking groups (they need the training data, which is stored) and a new client's chain,
    # which rebuilds the algorithm's run from its saved configuration
    a, b = res.extend_idata(seed=1), back.extend_idata(seed=1)
    for name in ("log_likelihood", "posterior_predictive", "observed_data"):
        assert group(b, name).equals(group(a, name))
    new = {"x": data.client(1)["x"], "z": data.client(1)["z"], "y": data.client(1)["y"]}
    _equal_dicts(res.sample_client(new, num_samples=10, warmup=10, seed=4),
                 back.sample_client(new, num_samples=10, warmup=10, seed=4))


def test_extended_groups_travel_with_the_result(soul, tmp_path):
    res, _ = soul
    res.extend_idata(seed=2)
    back = pickle.loads(pickle.dumps(res))
    assert group(back.idata, "log_likelihood").equals(group(res.idata, "log_likelihood"))
    assert back.faults.equals(res.faults)


def test_a_sampler_result_pickles_and_gives_the_same_probabilities(lmc, tmp_path):
    res, data = lmc
    back = pickle.loads(pickle.dumps(res))
    _same_result(res, back)
    assert group(res.idata, "sample_stats").equals(group(back.idata, "sample_stats"))
    x = {"x": data.client(1)["x"]}
    probs = res.predictive_probs(x, seed=3)
    assert probs.shape == (1000, 12, 2)
    np.testing.assert_array_equal(back.predictive_probs(x, seed=3), probs)
    _equal_dicts(back.predict(x, num_samples=50, seed=1), res.predict(x, num_samples=50, seed=1))
    res.save(tmp_path / "lmc")
    _same_result(res, fb.load(tmp_path / "lmc"))


def test_an_em_result_saves_and_loads(tmp_path):
    rng = np.random.default_rng(0)
    data = fb.FederatedData({"y": [rng.exponential(m, size=n) for m, n in ((1.0, 20), (3.0, 30), (2.0, 25))]})
    res = fb.fed_fit(exponential, data, fb.FedMM(step_size=0.5), num_rounds=30, seed=0)
    res.save(tmp_path / "em")
    back = fb.load(tmp_path / "em")
    _same_result(res, back)
    np.testing.assert_array_equal(back.information, res.information)


def test_a_closure_model_saves_by_value_and_an_unpicklable_one_is_refused(tmp_path):
    rng = np.random.default_rng(1)
    data = fb.FederatedData({"x": [rng.normal(size=(6, 2))] * 2, "y": [np.ones(6), np.zeros(6)]})
    res = fb.fed_fit(fb.models.linear_regression(), data, fb.LMC(step_size=0.01, warmup=2), num_rounds=4, seed=0)
    res.save(tmp_path / "closure")  # a closure (fb.models' factories) is stored by value
    _same_result(res, fb.load(tmp_path / "closure"))

    lock = threading.Lock()

    def holds_a_lock(x, y=None):  # closes over something that no pickler can store
        with lock:
            pass
        w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
        with numpyro.plate("obs", x.shape[0]):
            numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)

    bad = fb.fed_fit(holds_a_lock, data, fb.LMC(step_size=0.01, warmup=2), num_rounds=4, seed=0)
    with pytest.raises(fb.CheckpointError, match="does not pickle, even by value .*lock"):
        bad.save(tmp_path / "lock")
    assert sorted(os.listdir(tmp_path)) == ["closure"]


NOTEBOOK_FIT = """
import numpy as np, numpyro, numpyro.distributions as dist, fedbayes as fb

def model(x, y=None):  # defined in __main__, as in a notebook
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([x.shape[-1]]).to_event(1))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=x @ w), obs=y)

data, _ = fb.models.make_glm_clients(3, 2, 20, seed=0)
res = fb.fed_fit(model, data, fb.LMC(step_size=0.01, warmup=20), num_rounds=60, seed=0, progress=False)
res.save({path!r})
np.save({probs!r}, res.predictive_probs({{"x": data.client(0)["x"]}}, client=0, seed=2))
"""

NOTEBOOK_LOAD = """
import numpy as np, fedbayes as fb
back = fb.load({path!r})  # a new process: no function named 'model' exists here
data, _ = fb.models.make_glm_clients(3, 2, 20, seed=0)
np.testing.assert_array_equal(back.predictive_probs({{"x": data.client(0)["x"]}}, client=0, seed=2), np.load({probs!r}))
print("loaded", back.algorithm)
"""


@pytest.mark.slow
def test_a_model_defined_in_main_saves_by_value_and_loads_in_a_fresh_process(tmp_path):
    path, probs = str(tmp_path / "fit.fedbayes"), str(tmp_path / "probs.npy")
    env = {**os.environ, "JAX_ENABLE_X64": "0"}
    for script in (NOTEBOOK_FIT, NOTEBOOK_LOAD):  # two interpreters, each with the model in its __main__ or not at all
        out = subprocess.run([sys.executable, "-c", script.format(path=path, probs=probs)], capture_output=True,
                             text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
    assert "loaded LMC" in out.stdout


def test_a_damaged_or_foreign_file_is_refused(lmc, tmp_path):  # any saved result (the quick sampler fit)
    res, _ = lmc
    path = tmp_path / "fit"
    res.save(path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(fb.CheckpointError, match="saved result .* is corrupted or incomplete"):
        fb.load(path)
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(fb.CheckpointError, match="corrupted or incomplete .*CRC"):  # the zip's own check
        fb.load(path)
    path.write_bytes(raw)
    with np.load(path) as z:
        entries = {k: z[k] for k in z.files}
    altered = entries["result"].copy()
    altered[-2] ^= 1  # a consistent zip whose content no longer matches its seal
    with open(path, "wb") as f:
        np.savez(f, **dict(entries, result=altered))
    with pytest.raises(fb.CheckpointError, match="fails its integrity check"):
        fb.load(path)
    with pytest.raises(fb.CheckpointError, match="no saved result at"):
        fb.load(tmp_path / "missing")
    with pytest.raises(fb.ConfigError, match="saved result path must be"):
        fb.load(3.5)
    import json

    def sealed(meta, **entries):
        blobs = {k: np.frombuffer(v, np.uint8) for k, v in entries.items()}
        checkpoint_io.write_sealed(path, {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8), **blobs})

    sealed({"format": RESULT_FORMAT + 1, "kind": "fedbayes.Result"}, result=b"x")
    with pytest.raises(fb.CheckpointError, match=f"has format {RESULT_FORMAT + 1}, this version reads {RESULT_FORMAT}"):
        fb.load(path)
    sealed({"format": RESULT_FORMAT, "kind": "checkpoint"}, spec=b"")
    with pytest.raises(fb.CheckpointError, match="not a saved fedbayes result"):
        fb.load(path)
    meta = {"format": RESULT_FORMAT, "kind": "fedbayes.Result", "versions": fb.checkpoint.versions()}
    sealed(meta, result=pickle.dumps({"not": "a result"}))
    with pytest.raises(fb.CheckpointError, match="holds a dict, not a fedbayes Result"):
        fb.load(path)
    sealed(dict(meta, versions={"fedbayes": "0.0"}), result=pickle.dumps(res))
    with pytest.warns(fb.CheckpointWarning, match="predictions may differ"):
        back = fb.load(path)
    np.testing.assert_array_equal(back.params["w"], res.params["w"])
    sealed(meta, result=pickle.dumps(res).replace(b"logistic", b"logistix"))
    with pytest.raises(fb.CheckpointError, match="cannot be loaded here .*importable"):
        fb.load(path)


def test_a_failed_write_keeps_the_previous_file(lmc, tmp_path, monkeypatch):
    res, _ = lmc
    path = tmp_path / "fit"
    res.save(path)
    before = path.read_bytes()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_io.os, "replace", full_disk)
    with pytest.raises(fb.CheckpointError, match="cannot write the saved result .*No space left .*previous saved "
                                                 "result there, if any, is unchanged") as err:
        res.save(path)
    assert isinstance(err.value.__cause__, OSError)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["fit"]
