"""The fits' matrix-product precision (``matmul_precision``): every computation of a fit is traced at it.

A CPU computes float32 products in full precision whatever the setting, so the suite cannot see the
arithmetic change; what it checks is that the setting reaches every trace of the fit (the model's
log-density is traced inside each jitted computation: the set-up, the rounds, the final exchange), at
the server and at the clients of a Flower run, and that JAX's own setting is left as it was. The effect
on a GPU is in benchmarks/README.md (FedMM in TensorFloat-32 diverged; in full float32 it did not).
"""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedbayes as fb

SEEN: list = []


def model(x, y):
    SEEN.append(jax.config.jax_default_matmul_precision)  # runs while a computation is traced
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([2]).to_event(1))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


def _data():
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(n, 2)) for n in (5, 7, 6)]
    return fb.FederatedData({"x": xs, "y": [x @ np.array([0.5, -1.0]) + rng.normal(size=len(x)) for x in xs]})


@pytest.mark.parametrize("precision", ["highest", None, "default"])
def test_every_trace_of_a_fit_is_at_its_matmul_precision(precision):
    fb.clear_cache()
    SEEN.clear()
    options = {} if precision == "highest" else {"matmul_precision": precision}  # "highest": the default
    res = fb.fed_fit(model, _data(), fb.LMC(step_size=1e-2, warmup=2), num_rounds=4, progress=False, **options)
    assert np.all(np.isfinite(res.global_samples["w"]))
    assert SEEN and set(SEEN) == {precision}
    assert jax.config.jax_default_matmul_precision is None  # JAX's own setting is untouched afterwards


def test_flower_traces_at_its_matmul_precision_at_both_ends():
    from fedbayes import flower

    fb.clear_cache()
    SEEN.clear()
    res = flower.simulate(model, _data(), fb.GD(step_size=0.1), num_rounds=3, backend="local", progress=False)
    assert np.all(np.isfinite(np.asarray(res.params["w"])))
    assert SEEN and set(SEEN) == {"highest"}


@pytest.mark.parametrize("bad", ["fast", 3, "HIGHEST"])
def test_an_unknown_matmul_precision_is_a_config_error(bad):
    with pytest.raises(fb.ConfigError, match="matmul_precision"):
        fb.fed_fit(model, _data(), fb.GD(step_size=0.1), num_rounds=2, matmul_precision=bad)


def test_the_lowered_product_carries_the_precision():
    """The mechanism itself: a product traced inside the block is lowered with HIGHEST precision."""
    from fedbayes.engine import matmul_precision

    a = jnp.ones((3, 3), jnp.float32)
    with matmul_precision("highest"):
        text = jax.jit(lambda u: u @ u).lower(a).as_text()
    plain = jax.jit(lambda u: u @ u + 0).lower(a).as_text()
    assert "HIGHEST" in text and "HIGHEST" not in plain
