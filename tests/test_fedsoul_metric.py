"""FedSOUL's diagonal local metric (``local_metric="diagonal"``): its stationary law against the closed form on a
Gaussian local posterior.

The client's local latents z in R^12 have the prior N(m 1, I) and the likelihood y_j ~ N(x_j^T z, 1) over 30
rows whose columns have scales from 0.05 to 20, so the posterior N(P^-1 X^T y, P^-1), P = I + X^T X, has sds
that differ by a factor 80 (the identity metric's step is set by the narrowest one). The client's
own round (``FedSOULRun._local_chain``: one Hutchinson estimate of the curvature's diagonal at the anchor into
the running mean V, the kernel adapted there, 10 moves) is run at the fixed global m = 0, in 2 000 independent
copies of the client (vmapped keys).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest
from scipy import linalg

import fedbayes as fb
from fedbayes.algorithms import fedsoul
from fedbayes.engine import stack_clients
from fedbayes.introspect import FedModel
from fedbayes.protocol import Problem

Q, ROWS, CHAINS = 12, 30, 2000


def gaussian_head(x, y=None):
    """z ~ N(m 1, I) in R^q (q = the design's columns), y_j ~ N(x_j^T z, 1)."""
    m = numpyro.param("m", jnp.zeros(()))
    with fb.local():
        z = numpyro.sample("z", dist.Normal(m, 1.0).expand([x.shape[-1]]).to_event(1))
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ z, 1.0), obs=y)


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(3)
    scales = np.geomspace(0.05, 20.0, Q)
    x = rng.normal(size=(ROWS, Q)) * scales
    y = x @ rng.normal(size=Q) + rng.normal(size=ROWS)
    data = fb.FederatedData({"x": [x], "y": [y]})
    precision = np.eye(Q) + x.T @ x
    cov = np.linalg.inv(precision)
    return data, precision, cov @ (x.T @ y), cov


def chains(data, num_rounds: int, model=gaussian_head, **options):
    """Every copy's state after ``num_rounds`` rounds of the client's own chain at m = 0, and its run."""
    run = fb.FedSOUL(**options).build(Problem(FedModel(model, data), data, num_rounds))
    client = jax.tree_util.tree_map(lambda a: a[0], stack_clients(data))
    theta = {"m": jnp.zeros(())}

    def one(key):
        k_setup, k_rounds = jax.random.split(key)
        state, _ = run.setup_client(0, k_setup, theta, None, client)

        def body(st, k):
            return run._local_chain(k, theta, st, client)[0], None

        return jax.lax.scan(body, state, jax.random.split(k_rounds, num_rounds))[0]

    states = jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(0), CHAINS))
    if run.local_metric != "diagonal":
        return run, states, None
    # each copy's metric V at its anchor: the prior's curvature diagonal (1 here) plus the likelihood's running mean
    full = jax.jit(jax.vmap(lambda a, m: run._diagonal_metric(theta, a, client, m)))(states.anchor, states.metric)
    return run, states, np.asarray(full, np.float64)


def test_the_metric_is_chosen_as_documented(problem):
    data = problem[0]
    build = lambda algo: algo.build(Problem(FedModel(gaussian_head, data), data, 10)).local_metric  # noqa: E731
    assert build(fb.FedSOUL(local_metric="diagonal")) == "diagonal"
    assert build(fb.FedSOUL()) == "diagonal"  # q = 12 > LOCAL_DENSE_MAX: see FedSOUL's local_metric
    assert build(fb.FedRep()) == "identity"  # FedRep's gradient steps keep their 1 / L step
    assert build(fb.FedSOUL(step_size=0.01)) == "identity"  # a given step is the identity metric's
    with pytest.raises(fb.ConfigError, match="local_metric"):
        fb.FedSOUL(local_metric="adam")


def test_mala_with_the_adapted_diagonal_metric_samples_the_posterior_exactly(problem):
    """MALA (full batch, FedSOUL's default kernel) with the metric adapted between rounds: the copies' states
    after 60 rounds are independent draws of the chain's law, which must be the posterior N(mean, cov); and
    V, the running mean of Hutchinson's u * (P u), must estimate diag(P) without bias."""
    data, precision, mean, cov = problem
    run, states, V = chains(data, 60, local_metric="diagonal")
    z = np.asarray(states.z["z"], np.float64)
    sd = np.sqrt(np.diag(cov))
    # 2 000 independent draws: each coordinate's mean has standard error sd / sqrt(2000); 4.5 standard errors
    # leave a chance of about 1e-4 over the 12 coordinates for a chain whose law is exact
    np.testing.assert_array_less(np.abs(z.mean(0) - mean) / (sd / np.sqrt(CHAINS)), 4.5)
    # a variance estimated from n = 2000 normal draws has relative sd sqrt(2 / (n - 1)) = 0.032: 4.5 of them
    np.testing.assert_array_less(np.abs(z.var(0, ddof=1) / sd**2 - 1.0), 4.5 * np.sqrt(2.0 / (CHAINS - 1)))
    # the correlations too (each one's sd is at most 1 / sqrt(n) = 0.022)
    corr = np.corrcoef(z.T)
    exact = cov / np.outer(sd, sd)
    assert np.max(np.abs(corr - exact)) < 4.5 / np.sqrt(CHAINS)
    # V: its mean over the copies against diag(P), within 4.5 of its standard errors over the copies; and it spans
    # the curvatures' range, so that the whitened target is well conditioned
    se = V.std(0, ddof=1) / np.sqrt(CHAINS)
    np.testing.assert_array_less(np.abs(V.mean(0) - np.diag(precision)) / se, 4.5)
    assert np.diag(precision).max() / np.diag(precision).min() > 5e3


def test_ula_with_the_diagonal_metric_has_its_closed_form_law(problem):
    """ULA with the diagonal metric R R^T = diag(V)^-1: for the Gaussian target, its moves are the linear recursion
    z' - m = A (z - m) + sqrt(2 gamma) f R xi with A = I - gamma R R^T P and the rounds' noise factor
    f^2 = 1 - gamma / 2 (``FedSOULRun._noise_factor``: the whitened curvature's diagonal is 1), whose stationary
    covariance S solves S = A S A^T + 2 gamma f^2 R R^T (discrete Lyapunov). At step_scale 1 plain ULA's variances
    (f = 1) would be 1.2-1.26 times the posterior's; the corrected law is within a few percent of it."""
    data, precision, mean, cov = problem
    run, states, V = chains(data, 80, local_metric="diagonal", local_kernel="ula", step_scale=1.0)
    z = np.asarray(states.z["z"], np.float64)
    root = np.asarray(jax.vmap(fedsoul.diagonal_root)(V), np.float64)  # each copy's metric's root
    gamma = np.asarray(states.step, np.float64)
    # the copies' metrics and steps differ a little (V is a running mean over 20 rounds): the law of a copy's
    # state is the mixture of the closed forms at each copy's own metric and step
    laws, plain = [], []
    for r, g in zip(root, gamma):
        M = np.diag(r * r)
        A = np.eye(Q) - g * M @ precision
        laws.append(linalg.solve_discrete_lyapunov(A, 2.0 * g * (1.0 - g / 2.0) * M))
        plain.append(linalg.solve_discrete_lyapunov(A, 2.0 * g * M))
    S, S_plain = np.mean(laws, 0), np.mean(plain, 0)
    var = z.var(0, ddof=1)
    # the mixture's variance, within 4.5 relative sds of a 2 000-draw variance (0.032 each)
    bound = 4.5 * np.sqrt(2.0 / (CHAINS - 1))
    np.testing.assert_array_less(np.abs(var / np.diag(S) - 1.0), bound)
    # plain ULA's inflation would be there, and the same bound rejects it; the corrected law is near the posterior
    # (the whitened curvature's off-diagonal entries, which the diagonal correction leaves, are what remains)
    assert np.max(np.diag(S_plain) / np.diag(cov)) > 1.2 and np.max(np.abs(var / np.diag(S_plain) - 1.0)) > bound
    np.testing.assert_array_less(np.abs(np.diag(S) / np.diag(cov) - 1.0), 0.1)
    np.testing.assert_array_less(np.abs(z.mean(0) - mean) / np.sqrt(np.diag(S) / CHAINS), 4.5)  # ULA's mean is exact


def test_ula_with_the_dense_metric_samples_a_gaussian_posterior_exactly(problem):
    """With the dense metric R R^T = P^-1 the whitened curvature is I, so A = (1 - gamma) I and the corrected ULA's
    stationary covariance is 2 gamma (1 - gamma / 2) P^-1 / (1 - (1 - gamma)^2) = P^-1: the posterior itself, at a
    step (0.5) where plain ULA's would be 1 / (1 - 0.25) = 1.33 times wider."""
    data, precision, mean, cov = problem
    run, states, _ = chains(data, 40, local_metric="dense", local_kernel="ula", step_scale=0.5)
    assert run.local_metric == "dense"
    np.testing.assert_allclose(np.asarray(states.step), 0.5, rtol=1e-3)  # the whitened curvature's largest is 1
    z = np.asarray(states.z["z"], np.float64)
    sd = np.sqrt(np.diag(cov))
    # the same Monte Carlo bounds as MALA's test above (2 000 independent copies, 4.5 standard errors)
    np.testing.assert_array_less(np.abs(z.mean(0) - mean) / (sd / np.sqrt(CHAINS)), 4.5)
    np.testing.assert_array_less(np.abs(z.var(0, ddof=1) / sd**2 - 1.0), 4.5 * np.sqrt(2.0 / (CHAINS - 1)))


def _minibatch_variance(data, correct: bool, **options):
    """The copies' variance after 60 rounds of minibatch SGLD with the dense metric, with or without the rounds'
    noise correction (``FedSOULRun._noise_factor``, the step's cap and independent batches)."""
    run = fb.FedSOUL(local_metric="dense", **options).build(Problem(FedModel(gaussian_head, data), data, 60))
    if not correct:
        run._exact_variance = run._noise_correct = False
    client = jax.tree_util.tree_map(lambda a: a[0], stack_clients(data))
    theta = {"m": jnp.zeros(())}

    def one(key):
        k_setup, k_rounds = jax.random.split(key)
        state, _ = run.setup_client(0, k_setup, theta, None, client)
        return jax.lax.scan(lambda st, k: (run._local_chain(k, theta, st, client)[0], None), state,
                            jax.random.split(k_rounds, 60))[0]

    states = jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(1), CHAINS))
    return np.asarray(states.z["z"], np.float64).var(0, ddof=1)


@pytest.mark.slow  # 32 s: two sets of 2 000 chains over 300 rows
def test_sgld_rounds_correct_the_minibatch_gradient_s_noise():
    """Minibatch SGLD on a Gaussian local posterior (300 rows, 12 coordinates, 50 rows a move, the dense metric,
    step_scale 0.5). The drift's gradient error adds variance gamma^2 s per whitened coordinate (s about N / B = 6
    here), which plain SGLD adds to its 2 gamma of injected noise: its law is 5 to 8 times wider than the
    posterior. The rounds estimate s from each batch's two halves, cap the step at 1 / (1 + max s) and inject
    only 2 gamma - gamma^2 (1 + s): the law's variances are the posterior's to within 0.2 (measured 0.97-1.12; what
    remains is the error's dependence on the state, which a running mean of s over states does not follow, and
    its correlations across coordinates, which the diagonal correction leaves)."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(300, Q))
    y = x @ rng.normal(size=Q) + rng.normal(size=300)
    data = fb.FederatedData({"x": [x], "y": [y]})
    post = np.diag(np.linalg.inv(np.eye(Q) + x.T @ x))
    corrected = _minibatch_variance(data, True, batch_size=50, step_scale=0.5) / post
    plain = _minibatch_variance(data, False, batch_size=50, step_scale=0.5) / post
    # a 2 000-draw variance has relative sd 0.032: 0.2 is the stated bias plus 2.5 of them
    np.testing.assert_array_less(np.abs(corrected - 1.0), 0.2)
    assert np.min(plain) > 3.0, plain


@pytest.mark.slow  # 30 s: a fit's compilation and a new client's
def test_a_new_client_adapts_the_diagonal_metric_before_its_draws(problem):
    """``res.sample_client`` with the diagonal metric: the new client adapts V in rounds of its own (no upload), then
    draws; its draws are the closed-form posterior at the fitted m, to within their Monte Carlo error (ESS)."""
    import arviz as az

    data, precision, _, _ = problem
    algo = fb.FedSOUL(local_metric="diagonal", num_samples=50, warmup=50)
    res = fb.fed_fit(gaussian_head, data, algo, num_rounds=100, seed=0, progress=False)
    m = float(res.params["m"])
    client = data.client(0)
    x, y = np.asarray(client["x"], np.float64), np.asarray(client["y"], np.float64)
    cov = np.linalg.inv(precision)
    mean = cov @ (x.T @ y + m)
    draws = np.asarray(res.sample_client(client, num_samples=1000, warmup=500, seed=1)["z"], np.float64)
    chains_ = draws.reshape(algo.num_chains, 1000, Q)
    ess = np.asarray(az.ess(az.convert_to_dataset(chains_))["x"])
    assert ess.min() > 100  # the adapted metric mixes every coordinate (sds differing by a factor 80)
    sd = np.sqrt(np.diag(cov))
    # 5 Monte Carlo standard errors (sd / sqrt(ESS)) for the means, and 5 of a variance's (sd^2 sqrt(2 / ESS))
    np.testing.assert_array_less(np.abs(draws.mean(0) - mean) / (sd / np.sqrt(ess)), 5.0)
    np.testing.assert_array_less(np.abs(draws.var(0) / sd**2 - 1.0), 5.0 * np.sqrt(2.0 / ess))


HEAD, CURV = 160, 3.0  # a network head's size; the likelihood's curvature per coordinate


def test_mala_s_automatic_step_backs_off_to_its_acceptance_target_and_stays_exact():
    """A 160-coordinate Gaussian local posterior N(X^T y / (1 + c), I / (1 + c)) (X = sqrt(c) I): at the automatic
    step step_scale / L = 1 / (1 + c) every MALA proposal is an independent N(0, 2 / (1 + c)) draw, and in 160
    dimensions (almost) none is accepted, so a chain does not move. The step's factor must settle where the
    moves' mean acceptance is ACCEPTANCE_TARGET, and the chain's law stay the posterior (MALA is exact at any
    step)."""
    rng = np.random.default_rng(5)
    x = np.sqrt(CURV) * np.eye(HEAD)
    y = x @ rng.normal(size=HEAD) + rng.normal(size=HEAD)
    data = fb.FederatedData({"x": [x], "y": [y]})
    mean, sd = x.T @ y / (1.0 + CURV), np.full(HEAD, 1.0 / np.sqrt(1.0 + CURV))
    run, states, _ = chains(data, 60, model=gaussian_head, local_metric="identity")
    assert run.local_metric == "identity" and run.local_kernel == "mala"
    client = jax.tree_util.tree_map(lambda a: a[0], stack_clients(data))
    theta = {"m": jnp.zeros(())}

    def acceptance(state, key, scaled):
        step = run._scaled(state.step, state.log_scale) if scaled else state.step
        return run._run_chain(run._fm, key, theta, state.z, step, client, 10, 0)[-1]

    keys = jax.random.split(jax.random.PRNGKey(1), CHAINS)
    at_auto = np.asarray(jax.jit(jax.vmap(lambda st, k: acceptance(st, k, False)))(states, keys))
    adapted = np.asarray(jax.jit(jax.vmap(lambda st, k: acceptance(st, k, True)))(states, keys))
    factor = np.exp(np.asarray(states.log_scale, np.float64))
    assert at_auto.mean() < 0.01, at_auto.mean()  # the unadapted step: the chain would not move
    assert factor.max() < 0.6
    # Robbins-Monro settles where E[acceptance] = target; a round's mean over 10 moves has sd <= 0.16, so over
    # 2 000 copies the mean's error is < 0.004: 0.05 leaves room for the factor's own spread over the copies
    assert abs(adapted.mean() - fedsoul.ACCEPTANCE_TARGET) < 0.05, adapted.mean()
    z = np.asarray(states.z["z"], np.float64)
    # as in the tests above: 4.5 standard errors of 2 000 independent draws' means and variances
    np.testing.assert_array_less(np.abs(z.mean(0) - mean) / (sd / np.sqrt(CHAINS)), 4.5)
    np.testing.assert_array_less(np.abs(z.var(0, ddof=1) / sd**2 - 1.0), 4.5 * np.sqrt(2.0 / (CHAINS - 1)))


@pytest.mark.slow  # 200 copies of the dense metric's 160 x 160 Hessians: about 30 s
def test_the_final_draws_fresh_chains_start_where_mala_can_bring_them_in():
    """The final exchange's fresh chains (the dense metric) start at anchor + s R e, s = ``start_spread(q)``,
    overdispersed so that R-hat compares chains that began apart: on the 160-coordinate Gaussian head their
    draws after a 12-move warm-up are the posterior's (a Gaussian brings even s = 2 back that fast: the
    softmax heads that did not come back, on the digits example, are described in ``start_spread``)."""
    rng = np.random.default_rng(5)
    x = np.sqrt(CURV) * np.eye(HEAD)
    y = x @ rng.normal(size=HEAD) + rng.normal(size=HEAD)
    data = fb.FederatedData({"x": [x], "y": [y]})
    mean, sd = x.T @ y / (1.0 + CURV), 1.0 / np.sqrt(1.0 + CURV)
    copies = 200
    run = fb.FedSOUL(local_metric="dense", num_chains=2).build(Problem(FedModel(gaussian_head, data), data, 10))
    client = jax.tree_util.tree_map(lambda a: a[0], stack_clients(data))
    theta = {"m": jnp.zeros(())}
    keys = jax.random.split(jax.random.PRNGKey(2), copies)
    states = jax.jit(jax.vmap(lambda k: run.setup_client(0, k, theta, None, client)[0]))(keys)
    # the step's factor where training rounds leave it on this target (0.22-0.28, the test above)
    states = states._replace(log_scale=jnp.full(copies, np.log(0.25)))
    sample = jax.jit(jax.vmap(lambda st, k: run._sample_one(k, theta, st, client, 1, 12)))
    zs, _, acceptance = sample(states, jax.random.split(jax.random.PRNGKey(3), copies))
    fresh = np.asarray(zs["z"][:, 1, 0], np.float64)  # (copies, HEAD): each copy's fresh chain after warm-up
    assert float(np.mean(acceptance)) > 0.45
    # 200 independent draws: 4.5 standard errors of their means and variances (see the tests above)
    np.testing.assert_array_less(np.abs(fresh.mean(0) - mean) / (sd / np.sqrt(copies)), 4.5)
    np.testing.assert_array_less(np.abs(fresh.var(0, ddof=1) / sd**2 - 1.0), 4.5 * np.sqrt(2.0 / (copies - 1)))
    assert fedsoul.start_spread(1) == 2.0 and abs(fedsoul.start_spread(HEAD) - 1.147) < 1e-3


@pytest.mark.slow  # a 150-round FedSOUL fit of a network with the dense metric: about 30-70 s
def test_personal_softmax_heads_with_the_dense_metric_pass_their_local_rhat():
    """scikit-learn's digits over 20 label-skewed clients (examples/calibration_ood.py), FedSOUL with the dense
    local metric on 136-coordinate softmax heads. One client's fresh final chain started 150 nats below the bulk,
    where the client's step was rejected every time: it never moved (sd 1e-16), and the local R-hat was 2.4.
    With each final chain's warm-up backing its step off to the acceptance target, every chain moves, every
    client accepts over 40% and the check passes."""
    import importlib.util
    import pathlib
    import warnings

    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / "calibration_ood.py"
    spec = importlib.util.spec_from_file_location("calibration_ood", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    train, _, _ = example.make_data()
    algo = fb.FedSOUL(local_metric="dense", local_steps=10, server_lr=0.01, num_samples=200, warmup=300, thinning=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fb.ConvergenceWarning)  # 150 rounds: the globals' trace has not settled
        res = fb.fed_fit(fb.models.personalized_logistic, train, algo, num_rounds=150, seed=0, progress=False,
                         model_kwargs={"num_classes": example.IN_CLASSES, "hidden": example.HIDDEN})
    row = res.diagnostics.set_index("check").loc["local_rhat"]
    assert bool(row["ok"]), row["note"]
    assert float(np.min(res.client_info["acceptance"])) > 0.4
    assert np.all(np.asarray(res._local_chains["head"]).std(axis=2).min(axis=-1) > 0.1)  # every chain moves
