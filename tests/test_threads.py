"""Fits started from several threads at once each give their serial result.

NumPyro keeps its effect-handler stack in one module-level list; two threads tracing models at once
used to crash with ``all sites must have unique names``. fedbayes serialises its entry points.
"""

import threading

import numpy as np
import numpyro
import numpyro.distributions as dist

import fedbayes as fb

RNG = np.random.default_rng(0)
X = [RNG.normal(size=20) for _ in range(5)]
DATA = fb.FederatedData({"x": X, "y": [1.0 + x + RNG.normal(size=x.shape) for x in X]})


def model(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(w * x, 1.0), obs=y)


def test_fits_in_threads_equal_serial_fits():
    algorithms = {"gd": fb.GD, "tamuna": lambda: fb.TAMUNA(s=2), "lmc": fb.LMC}

    def fit(name):
        res = fb.fed_fit(model, DATA, algorithms[name](), num_rounds=100, seed=1, progress=False)
        return np.asarray(res.idata.posterior["w"]) if name == "lmc" else np.asarray(res.params["w"])

    out, errors = {}, {}

    def run(name):
        try:
            out[name] = fit(name)
        except Exception as err:  # noqa: BLE001 - collected and reported below
            errors[name] = err

    threads = [threading.Thread(target=run, args=(name,)) for name in algorithms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for name in algorithms:
        np.testing.assert_array_equal(out[name], fit(name))
