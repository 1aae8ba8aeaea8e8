"""A second ``fed_fit`` with the same model, data and algorithm reuses the first call's build and compiled
computations (``fedbayes.api._build``, ``fedbayes.engine.run_jit``), and changes nothing in the result;
``fb.compilation_cache`` keeps compilations across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist

import fedbayes as fb

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT


def model(x, y=None):
    """Bayesian linear regression with a deterministic site whose analysis warns (its length is twice the rows)."""
    w = numpyro.sample("w", dist.Normal(0, 1).expand([x.shape[1]]).to_event(1))
    numpyro.deterministic("twice", jnp.concatenate([x @ w, x @ w]))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


def fit(data, seed=0, num_rounds=40):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = fb.fed_fit(model, data, fb.LMC(num_chains=2), num_rounds=num_rounds, seed=seed, progress=False)
    return res, [str(w.message) for w in caught if "deterministic sites 'twice'" in str(w.message)]


def test_a_second_identical_call_compiles_nothing_and_gives_the_same_result():
    data, _ = fb.models.make_glm_clients(6, 2, 10, family="linear", seed=0)
    fb.clear_cache()
    first, warned_first = fit(data)
    compiled: list[float] = []
    listener = lambda event, seconds, **kw: compiled.append(seconds) if event == COMPILE_EVENT else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        second, warned_second = fit(data)
        reseeded, _ = fit(data, seed=1)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiled == []  # neither the same call nor a new seed compiled anything
    assert second._run is first._run and reseeded._run is first._run
    np.testing.assert_array_equal(second.global_samples["w"], first.global_samples["w"])
    assert not np.array_equal(reseeded.global_samples["w"], first.global_samples["w"])
    # the analysis' warning is given on every call, as without the reuse
    assert len(warned_first) == 1 and warned_second == warned_first

    fb.clear_cache()
    fresh, _ = fit(data)
    assert fresh._run is not first._run
    np.testing.assert_array_equal(fresh.global_samples["w"], first.global_samples["w"])  # reuse changes nothing
    longer, _ = fit(data, num_rounds=60)  # the warm-up follows the number of rounds: another build
    assert longer._run is not fresh._run


def test_a_changed_data_set_or_algorithm_is_built_afresh():
    data, _ = fb.models.make_glm_clients(6, 2, 10, family="linear", seed=0)
    other, _ = fb.models.make_glm_clients(6, 2, 10, family="linear", seed=1)  # same shapes, other values
    a, _ = fit(data)
    b, _ = fit(other)
    assert b._run is not a._run
    c = fb.fed_fit(model, data, fb.LMC(num_chains=3), num_rounds=40, progress=False)
    assert c._run is not a._run


def test_the_compilation_cache_serves_a_new_process(tmp_path):
    """Two processes with FEDBAYES_COMPILATION_CACHE: the first writes every computation it compiles, the
    second finds all of its computations there (it writes nothing new) and gives the same draws."""
    script = (
        "import json, warnings, numpy as np, fedbayes as fb\n"
        "warnings.simplefilter('ignore')\n"
        "data, _ = fb.models.make_glm_clients(6, 2, 10, family='logistic', seed=0)\n"
        "res = fb.fed_fit(fb.models.logistic_regression(1.0), data, fb.LMC(num_chains=2), num_rounds=40, progress=False)\n"
        "print(json.dumps(np.asarray(res.global_samples['w']).ravel()[-8:].tolist()))\n"
    )
    cache = tmp_path / "cache"
    env = dict(os.environ, FEDBAYES_COMPILATION_CACHE=str(cache), JAX_PLATFORMS="cpu")

    def run():
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.splitlines()[-1]), sorted(p.name for p in cache.rglob("*") if p.is_file())

    draws_one, entries_one = run()
    draws_two, entries_two = run()
    assert len(entries_one) >= 5  # set-up, rounds, final computations: each an entry
    assert entries_two == entries_one
    assert draws_two == draws_one


def test_a_cache_directory_that_cannot_be_made_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    import pytest

    with pytest.raises(fb.ConfigError, match="cannot create"):
        fb.compilation_cache(blocker / "cache")
