"""Minibatch clients (fedbayes.minibatch): unbiased batches, the full batch bit for bit, SGLD's exact law.

References: the client's full-batch log-likelihood and gradient (the batch estimate's mean), the
full-batch fit (B at least every client's rows), the closed-form stationary covariance of
stochastic-gradient Langevin dynamics on a Gaussian target, and the closed-form maximum marginal
likelihood of a Gaussian random-intercept model.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import fedbayes as fb
from fedbayes.engine import stack_clients
from fedbayes.introspect import FedModel
from fedbayes.minibatch import Minibatch


def regression(x, y):
    w = numpyro.sample("w", dist.Normal(0.0, 3.0).expand([2]).to_event(1))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(x @ w, 1.0), obs=y)


def regression_subsampled(x, y):  # the same model asking for batches of 4 rows itself
    w = numpyro.sample("w", dist.Normal(0.0, 3.0).expand([2]).to_event(1))
    with numpyro.plate("obs", y.shape[0], subsample_size=4) as rows:
        numpyro.sample("y", dist.Normal(x[rows] @ w, 1.0), obs=y[rows])


random_intercepts = fb.models.random_intercepts  # mu ~ N(0, 10^2), z_i ~ N(mu, 1), y_ij ~ N(z_i, 1)


def gaussian_mean(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def _gaussian_mean_data(seed):
    """Four clients of 20, 20, 12 and 16 draws of N(c_i, 1.5^2): (sizes, arrays, FederatedData)."""
    rng = np.random.default_rng(seed)
    sizes = [20, 20, 12, 16]
    ys = [rng.normal(rng.normal(1.0, 1.0), 1.5, n) for n in sizes]
    return sizes, ys, fb.FederatedData({"y": ys})


def _regression_data(sizes, seed=0):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=(n, 2)) for n in sizes]
    return fb.FederatedData({"x": xs, "y": [x @ np.array([1.0, -0.5]) + rng.normal(size=len(x)) for x in xs]})


def test_batches_are_distinct_rows_cover_the_round_and_weigh_n_over_b():
    data = _regression_data([12, 3, 7])  # padded to 12 rows; client 1 has fewer rows than a batch
    clients = stack_clients(data)
    mb = Minibatch(4, 12)
    for c in range(3):
        client = jax.tree_util.tree_map(lambda a: a[c], clients)
        order = mb.order(jax.random.PRNGKey(c), client)
        n = int(data.sizes[c])
        seen = []
        for m in range(3):
            b = mb.take(order, client, m)
            rows = np.asarray(order)[np.asarray([(m * 4 + j) % n if n > 4 else j for j in range(4)])]
            real = rows[np.asarray(b.mask) > 0]
            assert len(set(real.tolist())) == len(real)  # without replacement within a batch
            assert np.all(real < n)  # never a padded row with a weight
            # the weights sum to N_i: the batch's scale makes its sum an estimate of all N_i rows
            np.testing.assert_allclose(np.sum(np.asarray(b.mask)), n, rtol=1e-6)
            np.testing.assert_array_equal(np.asarray(b.data["y"])[np.asarray(b.mask) > 0], np.asarray(client.data["y"])[real])
            seen.extend(real.tolist())
        if n == 12:  # three batches of 4 of 12 rows: an epoch, every row once
            assert sorted(seen) == list(range(12))
        if n == 3:  # fewer rows than a batch: all of them, weight 1
            assert sorted(seen[:3]) == [0, 1, 2]


def test_sampled_batches_draw_real_rows_uniformly_and_weigh_n_over_b():
    """``Minibatch.sample`` (FedSOUL's noise-corrected SGLD moves): B rows drawn with replacement from the N_i real
    rows, weight N_i / B, every real row equally likely; all rows with weight 1 when N_i <= B."""
    data = _regression_data([12, 3, 7])
    clients = stack_clients(data)
    mb = Minibatch(4, 12)
    for c in range(3):
        client = jax.tree_util.tree_map(lambda a: a[c], clients)
        n = int(data.sizes[c])
        batches = jax.vmap(lambda k: mb.sample(k, client))(jax.random.split(jax.random.PRNGKey(c), 4000))
        masks, ys = np.asarray(batches.mask), np.asarray(batches.data["y"])
        np.testing.assert_allclose(masks.sum(1), n, rtol=1e-6)  # each batch's weights stand for all N_i rows
        if n <= 4:
            np.testing.assert_array_equal(ys[:, :n], np.broadcast_to(np.asarray(client.data["y"])[:n], (4000, n)))
            continue
        # which real row each draw is (every y of a client is distinct here), by its rank among the real rows' ys
        rows = np.searchsorted(np.sort(np.asarray(client.data["y"])[:n]), ys)
        assert np.all(masks > 0) and np.all(np.isin(ys, np.asarray(client.data["y"])[:n]))
        counts = np.bincount(rows.ravel(), minlength=n)
        # 16 000 draws over n rows: each count is binomial(16 000, 1 / n); 4.5 sds bound every one
        expected = 16000 / n
        np.testing.assert_array_less(np.abs(counts - expected), 4.5 * np.sqrt(expected * (1 - 1 / n)))


def test_minibatch_log_likelihood_and_gradient_are_unbiased():
    data = _regression_data([30, 9, 17])
    fm = FedModel(regression, data)
    clients = stack_clients(data)
    mb = Minibatch(5, 30)
    theta = {"w": jnp.array([0.3, 0.8])}

    def loglik(client):
        return fm.client_log_terms(theta, {}, client.data, client.mask)[1]

    draws = 20_000
    for c in range(3):
        client = jax.tree_util.tree_map(lambda a: a[c], clients)
        full, full_grad = loglik(client), jax.grad(lambda t: fm.client_log_terms(t, {}, client.data, client.mask)[1])(theta)["w"]
        keys = jax.random.split(jax.random.PRNGKey(10 + c), draws)

        def one(k):
            b = mb.draw(k, client)
            return loglik(b), jax.grad(lambda t: fm.client_log_terms(t, {}, b.data, b.mask)[1])(theta)["w"]

        vals, grads = jax.jit(jax.vmap(one))(keys)
        vals, grads = np.asarray(vals, np.float64), np.asarray(grads, np.float64)
        # independent draws: the mean's standard error is sd / sqrt(draws); 4.5 se is a 1e-5 two-sided
        # chance per coordinate (float32 sums add ~1e-6 relative, far below it)
        se = vals.std() / np.sqrt(draws)
        assert abs(vals.mean() - float(full)) < 4.5 * se + 1e-5 * abs(float(full))
        se_g = grads.std(0) / np.sqrt(draws)
        assert np.all(np.abs(grads.mean(0) - np.asarray(full_grad)) < 4.5 * se_g + 1e-5 * np.abs(np.asarray(full_grad)))
        if data.sizes[c] > 5:
            assert vals.std() > 0  # a real batch, not the full client


def test_a_batch_of_every_row_is_the_full_batch_bit_for_bit():
    data = _regression_data([8, 8, 8])
    full = fb.fed_fit(regression, data, fb.LMC(num_chains=2, step_size=0.01), num_rounds=60, seed=3, progress=False)
    same = fb.fed_fit(regression, data, fb.LMC(num_chains=2, step_size=0.01, batch_size=8), num_rounds=60, seed=3,
                      progress=False)
    np.testing.assert_array_equal(full.global_samples["w"], same.global_samples["w"])
    assert same.settings["batch_size"] is None  # nothing drawn: every step saw all rows
    part = fb.fed_fit(regression, data, fb.LMC(num_chains=2, step_size=0.01, batch_size=4), num_rounds=60, seed=3,
                      progress=False)
    assert part.settings["batch_size"] == 4 and not np.array_equal(part.global_samples["w"], full.global_samples["w"])
    np.testing.assert_array_equal(full.history["bits_up"], part.history["bits_up"])  # batches cost nothing on the wire


@pytest.mark.parametrize("algo", [
    lambda **b: fb.DELF(uplink=fb.compress.top_k(1), num_chains=2, step_size=0.01, **b),
    lambda **b: fb.QLSD(compressor=fb.compress.qsgd(4), num_chains=2, step_size=0.01, **b),
    lambda **b: fb.TAMUNA(s=2, local_steps=3, **b),
    lambda **b: fb.Scaffnew(local_steps=3, **b),
], ids=["DELF", "QLSD", "TAMUNA", "Scaffnew"])
def test_every_family_takes_batches_and_a_batch_of_every_row_is_the_full_batch(algo):
    """The compressed samplers' stochastic gradients and TAMUNA's / Scaffnew's stochastic local steps: B at
    least every client's rows is the full-batch fit bit for bit; B = 3 rows is another fit, at the same bits."""
    data = _regression_data([8, 8, 8])
    kw = dict(num_rounds=30, seed=3, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fb.ConvergenceWarning)  # 30 rounds: the point is the arithmetic
        full, same, part = (fb.fed_fit(regression, data, algo(**b), **kw)
                            for b in ({}, {"batch_size": 8}, {"batch_size": 3}))
    draws = lambda r: r.global_samples["w"] if r.global_samples else r.history["theta/w"]  # noqa: E731
    np.testing.assert_array_equal(draws(full), draws(same))
    assert part.settings["batch_size"] == 3 and not np.array_equal(draws(part), draws(full))
    np.testing.assert_array_equal(full.history["bits_up"], part.history["bits_up"])


def test_the_model_s_subsample_size_is_the_batch_size_and_others_refuse_it():
    data = _regression_data([12, 10, 12])
    kw = dict(num_rounds=40, seed=1, progress=False)
    by_option = fb.fed_fit(regression, data, fb.LMC(num_chains=2, step_size=0.01, batch_size=4), **kw)
    by_model = fb.fed_fit(regression_subsampled, data, fb.LMC(num_chains=2, step_size=0.01), **kw)
    np.testing.assert_array_equal(by_option.global_samples["w"], by_model.global_samples["w"])
    assert by_model.settings["batch_size"] == 4
    with pytest.raises(fb.ConfigError, match="batch_size=3 but the model's plate has subsample_size=4"):
        fb.fed_fit(regression_subsampled, data, fb.LMC(batch_size=3), **kw)
    with pytest.raises(fb.ModelError, match="subsamples 4 rows .* but FedMM .* remove subsample_size"):
        fb.fed_fit(regression_subsampled, data, fb.FedMM(), **kw)  # FedMM takes batch_size, not the model's
    with pytest.raises(fb.ConfigError, match=r"batch_size \(rows per local step; None: the full batch\) must be an integer >= 1, got 0"):
        fb.LMC(batch_size=0)


def test_sgld_has_its_exact_stationary_law():
    """LMC with batches of B rows on a Gaussian target: x' = x - gamma (H (x - m) + e) + sqrt(2 gamma) xi,
    the gradient noise e independent of x with variance V = sum_i N_i^2 / B s_i^2 (N_i - B) / (N_i - 1)
    (s_i^2 the client's population variance of y: a B-subset drawn without replacement). The stationary
    law is N(m, S) with H S + S H - gamma H S H = 2 + gamma V, i.e. S = (2 + gamma V) / (2 H - gamma H^2):
    ULA's (2 / (2 H - gamma H^2)) plus the gradient noise's share."""
    sizes, ys, data = _gaussian_mean_data(4)
    B = 5
    H = 1.0 / 100 + sum(sizes)
    m = sum(float(np.sum(y)) for y in ys) / H
    V = sum(n * n / B * np.var(y) * (n - B) / (n - 1) for n, y in zip(sizes, ys))
    gamma = 0.5 / H  # AR(1) coefficient 1 - gamma H = 0.5
    S_sgld = (2 + gamma * V) / (2 * H - gamma * H * H)
    S_ula = 2 / (2 * H - gamma * H * H)
    assert S_sgld > 1.5 * S_ula  # the test can tell them apart
    res = fb.fed_fit(gaussian_mean, data, fb.LMC(step_size=gamma, num_chains=4, warmup=200, batch_size=B),
                     num_rounds=10_200, seed=0, progress=False)
    draws = np.asarray(res.global_samples["mu"], np.float64)  # (4, 10 000)
    n = draws.size
    # an AR(1) chain with coefficient a = 0.5: the mean's effective sample size is n (1 - a) / (1 + a) and
    # the variance's n (1 - a^2) / (1 + a^2) (x^2 is AR(1) with a^2); 5 standard errors each
    ess_mean, ess_var = n / 3, n * 0.6
    assert abs(draws.mean() - m) < 5 * np.sqrt(S_sgld / ess_mean)
    assert abs(draws.var() / S_sgld - 1) < 5 * np.sqrt(2 / ess_var)


def test_fedsoul_with_minibatch_sgld_reaches_the_closed_form_estimate():
    """A Gaussian random-intercept model: mu's Fisher gradient sum_i E[z_i - mu] is linear in z_i, so SGLD's
    inflated local variance does not bias it, and the averaged estimate must reach the maximiser of the
    marginal posterior, mu* = sum_i w_i ybar_i / (sum_i w_i + 1 / 100) with w_i = N_i / (N_i + 1),
    within a tenth of its standard error (1 / sqrt(sum w_i + 1 / 100))."""
    rng = np.random.default_rng(1)
    sizes = [40, 40, 25, 40, 32, 40]
    ys = [rng.normal(rng.normal(2.0, 1.0), 1.0, n) for n in sizes]
    data = fb.FederatedData({"y": ys})
    w = np.array([n / (n + 1) for n in sizes])
    mu_star = float(np.sum(w * np.array([y.mean() for y in ys])) / (w.sum() + 0.01))
    se = 1 / np.sqrt(w.sum() + 0.01)
    res = fb.fed_fit(random_intercepts, data, fb.FedSOUL(batch_size=8, uncertainty=False), num_rounds=400, seed=0,
                     progress=False)
    assert res.settings["local_kernel"] == "ula" and res.settings["batch_size"] == 8
    assert abs(float(res.params["mu"]) - mu_star) < 0.1 * se
    with pytest.raises(fb.ConfigError, match="local_kernel='mala' cannot take minibatch steps"):
        fb.fed_fit(random_intercepts, data, fb.FedSOUL(batch_size=8, local_kernel="mala"), num_rounds=10, progress=False)


def test_fedsoul_batch_of_every_row_is_the_full_batch_bit_for_bit():
    rng = np.random.default_rng(2)
    data = fb.FederatedData({"y": [rng.normal(1.0, 1.0, 6) for _ in range(3)]})
    kw = dict(num_rounds=30, seed=2, progress=False)
    alg = dict(uncertainty=False, num_samples=20, warmup=20)
    full = fb.fed_fit(random_intercepts, data, fb.FedSOUL(**alg), **kw)
    same = fb.fed_fit(random_intercepts, data, fb.FedSOUL(batch_size=6, **alg), **kw)
    np.testing.assert_array_equal(np.asarray(full.history["theta/mu"]), np.asarray(same.history["theta/mu"]))
    np.testing.assert_array_equal(full.local_samples["z"], same.local_samples["z"])


def test_gd_with_stochastic_local_steps_has_its_exact_stationary_spread():
    """fb.GD(batch_size=B) on a Gaussian mean: x' = x - gamma (H (x - x*) + e), H = (sum_i N_i + 1/100) / n
    (GD's objective is the mean of the f_i = -log p(D_i | mu) - log p(mu) / n), e the mean over clients of
    the batch gradients' errors, Var(e) = sum_i N_i^2 / B s_i^2 (N_i - B) / (N_i - 1) / n^2. The iterates
    fluctuate about the MAP x* with variance gamma^2 Var(e) / (1 - (1 - gamma H)^2); the full batch
    (B = N_i) is plain GD bit for bit."""
    sizes, ys, data = _gaussian_mean_data(6)
    n, B = len(sizes), 5
    H = (sum(sizes) + 0.01) / n
    x_star = sum(float(np.sum(y)) for y in ys) / (sum(sizes) + 0.01)
    V = sum(m * m / B * np.var(y) * (m - B) / (m - 1) for m, y in zip(sizes, ys)) / n**2
    gamma = 0.5 / H  # AR(1) coefficient 0.5
    S = gamma**2 * V / (1 - (1 - gamma * H) ** 2)
    res = fb.fed_fit(gaussian_mean, data, fb.GD(step_size=gamma, batch_size=B), num_rounds=20_100, seed=0,
                     progress=False)
    path = np.asarray(res.history["theta/mu"], np.float64)[100:]  # 20 000 rounds after the transient
    ess_mean, ess_var = path.size / 3, path.size * 0.6  # AR(1) with a = 0.5, as for SGLD above
    assert abs(path.mean() - x_star) < 5 * np.sqrt(S / ess_mean)
    assert abs(path.var() / S - 1) < 5 * np.sqrt(2 / ess_var)
    full = fb.fed_fit(gaussian_mean, data, fb.GD(step_size=gamma), num_rounds=30, seed=0, progress=False)
    same = fb.fed_fit(gaussian_mean, data, fb.GD(step_size=gamma, batch_size=20), num_rounds=30, seed=0, progress=False)
    np.testing.assert_array_equal(np.asarray(full.history["theta/mu"]), np.asarray(same.history["theta/mu"]))


def _mixture():
    data, _ = fb.models.make_gaussian_mixture(4, num_components=2, dim=1, sizes=(40, 60), concentration=1.0, seed=5)
    y = np.asarray(data.pooled()["y"])
    init = {"weights": np.array([0.5, 0.5]), "means": np.array([[y.min()], [y.max()]]), "covs": np.ones((2, 1, 1))}
    return data, init, fb.models.gaussian_mixture(2, 1)


def test_fedmm_minibatch_statistic_is_unbiased():
    """FedMM's minibatch oracle (the paper's b^-1 sum_{j in batch} S(Z_j, theta)): its mean over batches is
    the client's full E-step statistic at the same theta."""
    from fedbayes.engine import Problem

    data, init, model = _mixture()
    fm = FedModel(model, data)
    run = fb.FedMM(init=init, batch_size=7).build(Problem(fm, data, 10, None))
    clients = stack_clients(data)
    theta = fm.unconstrain(init)
    draws = 20_000
    for c in range(2):
        client = jax.tree_util.tree_map(lambda a: a[c], clients)
        full = np.asarray(run._e_step(theta, client)[0], np.float64)

        def one(k):
            return run._e_step(theta, run._batches.draw(k, client, weighted=False))[0]

        vals = np.asarray(jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(c), draws)), np.float64)
        # independent batches: 4.5 standard errors per coordinate (float32 rounding ~1e-6 relative below it)
        se = vals.std(0) / np.sqrt(draws)
        assert np.all(np.abs(vals.mean(0) - full) < 4.5 * se + 1e-5 * np.abs(full))
        assert np.all(vals.std(0)[np.abs(full) > 0] > 0)  # real batches, not the whole client


@pytest.mark.filterwarnings("ignore::fedbayes.ConvergenceWarning")  # the 3 noisy runs' drift check, expected
def test_fedmm_minibatch_reaches_the_em_fixed_point_and_refuses_per_client_latents():
    """With a decreasing step (gamma_t = (t + 1)^-0.7, Robbins-Monro) and the average of the last half of
    the statistics, minibatch FedMM ends at full-batch EM's fixed point; B = N_i is the full batch bit for bit."""
    data, init, model = _mixture()
    kw = dict(num_rounds=600, seed=0, progress=False)
    full = fb.fed_fit(model, data, fb.FedMM(init=init, uncertainty=False), **kw)
    same = fb.fed_fit(model, data, fb.FedMM(init=init, uncertainty=False, batch_size=int(max(data.sizes))), **kw)
    np.testing.assert_array_equal(full.params["means"], same.params["means"])
    step = lambda t: (t + 1.0) ** -0.7  # noqa: E731
    runs = [fb.fed_fit(model, data, fb.FedMM(init=init, uncertainty=False, batch_size=10, step_size=step,
                                             average_from=0.5), num_rounds=600, seed=s, progress=False)
            for s in range(3)]
    means = np.stack([np.sort(r.params["means"].ravel()) for r in runs])
    target = np.sort(full.params["means"].ravel())
    # the averaged iterate's error is the oracle's noise averaged over ~300 rounds; its spread over the seeds
    # measures it: the seeds' mean within 4 of its standard errors (plus 1e-3 for the finite-run bias)
    se = means.std(0, ddof=1) / np.sqrt(len(runs))
    assert np.all(np.abs(means.mean(0) - target) < 4 * se + 1e-3), (means, target)
    assert np.all(means.std(0) > 0)
    with pytest.raises(fb.ConfigError, match="per client"):
        fb.fed_fit(random_intercepts, _gaussian_mean_data(0)[2], fb.FedMM(batch_size=3), num_rounds=5, progress=False)
