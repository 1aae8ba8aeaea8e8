"""FedRep (fb.FedRep): FedSOUL's limit without the population prior and without noise.

Reference: its fixed point maximises sum_i log p(D_i | w, z_i) over the shared w and every personal z_i;
for a random-intercept regression y_ij = w x_ij + z_i + e_ij that is the within-client least-squares
solution, w* = sum_ij (x_ij - xbar_i)(y_ij - ybar_i) / sum_ij (x_ij - xbar_i)^2, z_i* = ybar_i - w* xbar_i.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedbayes as fb


def intercepts(x, y=None):
    w = numpyro.param("w", jnp.zeros(()))
    mu = numpyro.param("mu", jnp.zeros(()))
    with fb.local():
        z = numpyro.sample("z", dist.Normal(mu, 1.0))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(w * x + z, 1.0), obs=y)


def test_fedrep_reaches_the_within_client_least_squares_solution():
    rng = np.random.default_rng(0)
    sizes = [12, 20, 8, 15, 10]
    xs = [rng.normal(loc=i - 2.0, size=n) for i, n in enumerate(sizes)]  # client means of x differ: the
    ys = [0.7 * x + rng.normal(3.0, 2.0) + rng.normal(size=len(x)) for x in xs]  # pooled slope is biased
    data = fb.FederatedData({"x": xs, "y": ys})
    dx = np.concatenate([x - x.mean() for x in xs])
    dy = np.concatenate([y - y.mean() for y in ys])
    w_star = float(dx @ dy / (dx @ dx))
    z_star = np.array([y.mean() - w_star * x.mean() for x, y in zip(xs, ys)])
    res = fb.fed_fit(intercepts, data, fb.FedRep(num_samples=5, warmup=20), num_rounds=200, seed=0, progress=False)
    # a deterministic fixed point reached in float32: 1e-4 relative is about 100 float32 roundings
    np.testing.assert_allclose(float(res.params["w"]), w_star, rtol=1e-4)
    heads = np.asarray(res.local_samples["z"])  # (clients, draws): every "draw" is the trained head
    np.testing.assert_allclose(heads, np.broadcast_to(z_star[:, None], heads.shape), rtol=1e-4, atol=1e-4)
    assert float(res.params["mu"]) == 0.0  # the population prior's mean receives no gradient: FedRep has none
    assert res.settings["local_kernel"] == "ula" and res.algorithm == "FedRep"
    # FedSOUL keeps the prior (z_i shrunk towards mu, mu learned): a different fixed point
    soul = fb.fed_fit(intercepts, data, fb.FedSOUL(num_samples=20, warmup=20, uncertainty=False), num_rounds=200,
                      seed=0, progress=False)
    assert abs(float(soul.params["mu"])) > 0.5


def test_finetune_trains_each_head_at_the_frozen_shared_model_and_sends_nothing_in_rounds():
    """fb.FineTune: the shared w from the warm start (a given FedAvg-style fit here), frozen; each head
    fine-tuned to the client's least-squares intercept at that w, z_i = ybar_i - w xbar_i."""
    rng = np.random.default_rng(1)
    xs = [rng.normal(loc=i - 1.0, size=10) for i in range(3)]
    ys = [0.5 * x + rng.normal(2.0, 1.0) + rng.normal(size=10) for x in xs]
    data = fb.FederatedData({"x": xs, "y": ys})
    shared = {"w": 0.4, "mu": 1.5}  # e.g. a FedAvg Result; a dict of the shared sites works the same
    res = fb.fed_fit(intercepts, data, fb.FineTune(init=shared, num_samples=5, warmup=20), num_rounds=60, seed=0,
                     progress=False)
    assert float(res.params["w"]) == np.float32(0.4)  # frozen
    heads = np.asarray(res.local_samples["z"])
    z_star = np.array([y.mean() - np.float32(0.4) * x.mean() for x, y in zip(xs, ys)])
    np.testing.assert_allclose(heads, np.broadcast_to(z_star[:, None], heads.shape), rtol=1e-4, atol=1e-4)
    rounds_up = np.asarray(res.history["bits_up"])[1:-1]  # between the set-up and the final exchange
    assert np.all(rounds_up == 0) and np.all(np.asarray(res.history["bits_down"])[1:-1] == 0)


def test_local_only_fits_each_client_alone_and_predicts_with_its_own_model():
    """fb.LocalOnly: every client's own maximum, here its own least-squares line w_i = cov(x_i, y_i) / var(x_i),
    z_i = ybar_i - w_i xbar_i (w has no prior: a param), with partial participation; nothing crosses the
    network after the set-up, and a client's predictions use its own w_i."""
    rng = np.random.default_rng(0)
    sizes = [12, 20, 8, 15, 10]
    xs = [rng.normal(loc=i - 2.0, size=n) for i, n in enumerate(sizes)]
    ys = [0.7 * x + rng.normal(3.0, 2.0) + rng.normal(size=len(x)) for x in xs]
    data = fb.FederatedData({"x": xs, "y": ys})
    w_star = np.array([np.mean((x - x.mean()) * (y - y.mean())) / np.var(x) for x, y in zip(xs, ys)])
    z_star = np.array([y.mean() - w * x.mean() for x, y, w in zip(xs, ys, w_star)])
    res = fb.fed_fit(intercepts, data, fb.LocalOnly(num_samples=5, warmup=20), num_rounds=400, clients_per_round=2,
                     seed=0, progress=False)
    # deterministic fixed points reached in float32 (each client takes part in about 160 rounds)
    np.testing.assert_allclose(res.local_samples["w"][:, 0], w_star, rtol=1e-4)
    np.testing.assert_allclose(res.local_samples["z"][:, 0], z_star, rtol=1e-4, atol=1e-4)
    assert np.all(res.local_samples["w"] == res.local_samples["w"][:, :1])  # one fitted value per client
    np.testing.assert_allclose(float(res.params["w"]), res.local_samples["w"][:, 0].mean(), rtol=1e-6)
    assert res.bits_up == 0 and np.all(np.asarray(res.history["bits_down"])[1:] == 0)
    points = fb.result.group(res.idata, "fed_client_params")  # fitted points, not posterior draws
    assert points["w"].dims == ("client",) and not hasattr(res.idata, "posterior")
    np.testing.assert_array_equal(points["w"].values, res.local_samples["w"][:, 0])
    x_new = np.array([-1.0, 0.0, 2.0])
    mean = res.predict({"x": x_new}, client=3, num_samples=2000)["y"].mean(axis=0)  # Normal(w_3 x + z_3, 1)
    np.testing.assert_allclose(mean, w_star[3] * x_new + z_star[3], atol=0.1)  # 2000 draws of sd 1: 4.5 se
    with pytest.raises(fb.ConfigError, match="no model"):
        res.sample_client({"x": x_new, "y": x_new})
    with pytest.raises(fb.ConfigError, match="sends nothing"):
        fb.LocalOnly(compressor=fb.compress.qsgd(levels=4))


def test_aligned_head_error_is_zero_for_an_equivalent_parametrisation():
    """phi A and A^{-1} z_i give the same predictions: the aligned error is 0 (to rounding) for any invertible
    A, and the plain mean distance when the representation is the true one."""
    rng = np.random.default_rng(3)
    phi, _ = np.linalg.qr(rng.normal(size=(6, 2)))
    z = rng.normal(size=(5, 2))
    A = np.array([[2.0, 0.5], [-0.3, 1.5]])
    assert fb.models.aligned_head_error(phi @ A, np.linalg.solve(A, z.T).T, phi, z) < 1e-12
    off = z + 0.1
    np.testing.assert_allclose(fb.models.aligned_head_error(phi, off, phi, z), np.sqrt(0.02), rtol=1e-12)


def test_local_only_runs_on_flower_as_in_fed_fit():
    """fb.LocalOnly through Flower's messages (the local grid): each node keeps its own copy of the shared
    sites and its optimiser in its state; the same ledger (the set-up only) and the same fits as fed_fit, to
    float32 rounding (as FedSOUL's and FedMM's Flower runs, tests/test_flower.py)."""
    pytest.importorskip("flwr")
    from fedbayes import flower

    rng = np.random.default_rng(0)
    xs = [rng.normal(loc=i - 2.0, size=n) for i, n in enumerate([12, 20, 8])]
    ys = [0.7 * x + rng.normal(3.0, 2.0) + rng.normal(size=len(x)) for x in xs]
    data = fb.FederatedData({"x": xs, "y": ys})
    algo = fb.LocalOnly(num_samples=5, warmup=20)
    ref = fb.fed_fit(intercepts, data, algo, num_rounds=40, seed=0, progress=False)
    res = flower.simulate(intercepts, data, algo, num_rounds=40, seed=0, backend="local", progress=False)
    for site in ("w", "z"):
        np.testing.assert_allclose(res.local_samples[site], ref.local_samples[site], rtol=1e-5, atol=1e-6)
    assert (res.bits_up, res.bits_down) == (ref.bits_up, ref.bits_down) == (0, 3 * 2 * 32)
