"""No fit may hang: the CPU LAPACK deadlock FedMM ran into, the watchdog that turns any stall into an
error, FedMM's model-structure errors, and what a stopped fit says happened.

jaxlib 0.10.2's CPU LAPACK kernels split a batch of matrices over XLA's intra-op thread pool from
inside a pool thread and block until the pieces are done; when as many such calls run at once as the
pool has threads, every thread waits for work queued behind it. FedMM's mixture E-step evaluated
NumPyro's MultivariateNormal once per component (independent, so concurrent), each factoring and
solving with a copy of the covariance per row and client: on 2 cores and 1000 clients it deadlocked
every time. The E-step now factors each component's covariance once (a single matrix: never split).
"""

import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import em_reference as R
import fedbayes as fb
from fedbayes.algorithms.tamuna import map_estimate
from fedbayes.engine import Message, Problem, _compiled_chunk, run_rounds, stack_clients, wait_ready
from fedbayes.errors import StalledError
from fedbayes.introspect import FedModel
from fedbayes.protocol import FederatedRun

# ---------------------------------------------------------------------------------------- the deadlock

_HUNG_CONFIG = textwrap.dedent("""
    import os, sys
    import numpy as np
    import fedbayes as fb
    inp = np.load(sys.argv[1])
    data = fb.FederatedData({"y": [inp[f"y{i}"] for i in range(int(inp["clients"]))]})
    init = {"weights": inp["weights"], "means": inp["means"], "covs": inp["covs"]}
    K, D = inp["means"].shape
    try:
        res = fb.fed_fit(fb.models.gaussian_mixture(K, D), data, fb.FedMM(init=init, uncertainty=False),
                         num_rounds=3, chunk_size=3, seed=0, stall_timeout=60)
    except fb.errors.StalledError as err:
        print(err, flush=True)
        os._exit(3)  # a deadlocked computation keeps the interpreter from exiting
    np.savez(sys.argv[2], **{k: res.history[f"theta/{k}"] for k in init})
""")


def test_fedmm_on_1000_clients_of_a_full_covariance_mixture_finishes(tmp_path):
    """The configuration of the issue (K = 5, D = 10, full covariances, 1000 clients, float32 as by
    default) in a subprocess: a deadlock ends it with StalledError (after 60 s idle), or at worst the
    time limit, instead of freezing the suite. With the E-step before the fix it deadlocked 2 times out
    of 2 here (4 of 4 in the issue). Its iterates are centralised EM's (gamma = 1, every client, no
    compression): round t reports theta_{t+2} (a federated E-step at theta_0 and T give theta_1)."""
    rng = np.random.default_rng(0)
    K, D, C = 5, 10, 1000
    means = 4.0 * rng.normal(size=(K, D))
    ys = [means[rng.integers(0, K, n)] + rng.normal(size=(n, D)) for n in rng.integers(20, 41, C)]
    y = np.concatenate(ys)
    init = {"weights": np.full(K, 1.0 / K), "means": y[:K].copy(), "covs": np.broadcast_to(np.eye(D), (K, D, D)).copy()}
    np.savez(tmp_path / "in.npz", clients=C, **init, **{f"y{i}": v for i, v in enumerate(ys)})
    env = {k: v for k, v in os.environ.items() if k != "JAX_ENABLE_X64"} | {"JAX_PLATFORMS": "cpu"}
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-c", _HUNG_CONFIG, str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                             capture_output=True, text=True, timeout=400, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("FedMM on 1000 clients neither finished nor raised StalledError in 400 s")
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    print(f"1000-client FedMM subprocess: {time.perf_counter() - t0:.1f} s")
    got = np.load(tmp_path / "out.npz")
    _, iterates = R.run_em(lambda **p: R.gmm_em_step(y, **p), init, 5)
    # float32 against float64 EM: the covariances come from s2 - m s1^T (a cancellation) over 30,000 rows;
    # measured agreement 7e-5 of each parameter's largest entry, so 1e-3 of it (a wrong statistic is off by O(1))
    for key in init:
        ref = np.stack([it[key] for it in iterates[2:5]])
        np.testing.assert_allclose(got[key], ref, rtol=0, atol=1e-3 * np.abs(ref).max())


def _lapack_batches(hlo: str) -> dict[str, list[int]]:
    """{LAPACK kernel: [batch of each call]} of a compiled program (batch: the product of the dimensions
    of the first result before the matrix dimensions)."""
    out: dict[str, list[int]] = {}
    for line in hlo.splitlines():
        target = re.search(r'custom_call_target="(lapack_\w+)"', line)
        if target:
            dims = [int(d) for d in re.search(r"\[([\d,]*)\]", line.split("=", 1)[1]).group(1).split(",") if d]
            out.setdefault(target.group(1), []).append(int(np.prod(dims[:-2])))
    return out


def _gmm():
    data, _ = fb.models.make_gaussian_mixture(9, num_components=3, dim=4, sizes=(20, 40), seed=1)
    return fb.models.gaussian_mixture(3, 4), data


def _ppca():
    rng = np.random.default_rng(0)
    return fb.models.ppca(5, 2), fb.FederatedData({"y": [rng.normal(size=(int(n), 5)) for n in rng.integers(20, 40, 9)]})


def _mixed():
    return fb.models.linear_mixed_effects, fb.models.make_linear_mixed_effects(9)[0]


@pytest.mark.slow  # second tier (make test-slow): 12-20 s each, compiling whole rounds
@pytest.mark.parametrize("case", [_gmm, _ppca, _mixed], ids=["mixture", "per-row-gaussian", "per-client-gaussian"])
def test_no_lapack_call_is_batched_over_clients_or_rows(case):
    """In FedMM's compiled round and final exchange every LAPACK call factors at most one matrix per
    mixture component or site element (the server's M-step, projection and transforms): none is batched
    over the 9 clients or their rows, so none can be split over the thread pool by the client count."""
    model, data = case()
    fm = FedModel(model, data)
    C = data.num_clients
    problem = Problem(fm, data, 2, C)
    run = fb.FedMM().build(problem)
    carry = run.init(jax.random.PRNGKey(0), problem)
    clients = stack_clients(data)
    chunk = _compiled_chunk(run, C, C).lower(carry, jnp.arange(2), 2, clients, jax.random.PRNGKey(1)).compile()
    final = jax.jit(jax.vmap(run.final_client, in_axes=(None, None, 0, 0))).lower(
        jax.random.PRNGKey(2), run.final_message(None, carry[0]), carry[1], clients).compile()
    for program in (chunk, final):
        batches = _lapack_batches(program.as_text())
        assert all(b < C for calls in batches.values() for b in calls), batches


def test_gaussian_algebra_without_lapack_equals_lapack():
    """The E-step's factorisations: the LAPACK-free Cholesky, triangular and SPD inverses against NumPy's
    LAPACK on a batch of SPD matrices (condition numbers up to ~340: agreement to ~1e-13), and the
    shared-factor MultivariateNormal against NumPyro's own on rows sharing one covariance (masked
    as the engine masks padded rows, too)."""
    from fedbayes.algorithms.expfam import _shared_factor
    from fedbayes.linalg import lapack_free_cholesky, lapack_free_spd_inverse, lapack_free_tril_inverse

    rng = np.random.default_rng(0)
    a = rng.normal(size=(3, 4, 6, 6))
    a = a @ np.swapaxes(a, -1, -2) + 0.05 * np.eye(6)
    L = np.linalg.cholesky(a)
    np.testing.assert_allclose(lapack_free_cholesky(a), L, rtol=0, atol=1e-13 * np.abs(L).max())
    np.testing.assert_allclose(lapack_free_tril_inverse(L), np.linalg.inv(L), rtol=1e-11, atol=1e-13)
    inv = np.linalg.inv(a)
    np.testing.assert_allclose(lapack_free_spd_inverse(a), inv, rtol=0, atol=1e-11 * np.abs(inv).max())

    cov, x = a[0, 0], rng.normal(size=(7, 6))
    mask = np.array([True] * 5 + [False] * 2)
    rows = dist.MultivariateNormal(rng.normal(size=(7, 6)), covariance_matrix=np.broadcast_to(cov, (7, 6, 6)))
    for fn in (rows, rows.mask(mask)):
        np.testing.assert_allclose(_shared_factor(fn, 0).log_prob(x), fn.log_prob(x), rtol=1e-13)
    wider = rows.expand((2, 7))  # row 0 holds two matrices: NumPyro's own evaluation is kept
    assert _shared_factor(wider, 1) is wider


# ---------------------------------------------------------------------------------------- the watchdog

_NEVER = threading.Event()  # never set


class _NeverReady:
    """Stands for an array of a computation that never finishes (a deadlocked one): ``is_ready`` stays
    False and ``block_until_ready`` blocks for ever (the watchdog's daemon waiter stays blocked in it,
    idle, as it would on a real deadlock). A real one cannot be made on purpose: XLA runs programs with
    host callbacks, the only way to make one wait, within the dispatch call, and a real deadlock keeps
    the process from exiting."""

    def is_ready(self) -> bool:
        return False

    def block_until_ready(self):
        _NEVER.wait()


def test_watchdog_raises_on_an_idle_computation_and_lets_a_busy_one_finish():
    t0 = time.monotonic()
    with pytest.raises(StalledError, match=r"^test: the chunk of rounds 3\.\.4 made no progress for 0\.5 s") as info:
        wait_ready({"state": jnp.zeros(2), "records": _NeverReady()}, 0.5, "test: the chunk of rounds 3..4",
                   rounds=(3, 4))
    assert 0.5 <= time.monotonic() - t0 < 5.0 and info.value.rounds == (3, 4)
    for advice in ("deadlocked, not slow", "clients_per_round", "taskset", "os._exit", "stall_timeout"):
        assert advice in str(info.value)
    assert isinstance(info.value, fb.FedbayesError) and isinstance(info.value, RuntimeError)

    # ~2.5 s of arithmetic (a compiled step timed first): busy all along, so never idle for 0.5 s
    step = jax.jit(lambda x: jax.lax.fori_loop(0, 20, lambda i, y: jnp.tanh(y @ y) * 0.5, x))
    x = jnp.eye(400) * 0.3
    step(x).block_until_ready()
    t0 = time.monotonic()
    step(x).block_until_ready()
    reps = max(1, int(2.5 / max(time.monotonic() - t0, 1e-3)))
    long = jax.jit(lambda x: jax.lax.fori_loop(0, reps, lambda i, y: step(y), x))
    long(x).block_until_ready()  # compiled; the timed call below only runs
    t0 = time.monotonic()
    out = wait_ready(long(x), 0.5, "busy")
    assert time.monotonic() - t0 > 1.0 and np.all(np.isfinite(np.asarray(out)))


def test_fed_fit_raises_stalled_error_naming_the_chunk(monkeypatch):
    """The second chunk of a fit never finishes (its outputs replaced by ones that are never ready):
    fed_fit ends with StalledError naming rounds 4..7, with the first chunk's history; stall_timeout is
    checked before any computation."""
    from fedbayes import engine

    compiled = engine._compiled_chunk

    def stalling_after_one(*args, **kwargs):
        chunk, calls = compiled(*args, **kwargs), []

        def run(*a):
            calls.append(a)
            out = chunk(*a)
            return out if len(calls) == 1 else jax.tree_util.tree_map(lambda _: _NeverReady(), out)

        return run

    data, _ = fb.models.make_glm_clients(3, 2, 10, family="linear", seed=0)
    model = fb.models.linear_regression()
    for bad in (0, -1.0, "300", True):
        with pytest.raises(fb.ConfigError, match="stall_timeout"):
            fb.fed_fit(model, data, fb.GD(), num_rounds=8, stall_timeout=bad)
    monkeypatch.setattr(engine, "_compiled_chunk", stalling_after_one)
    with pytest.raises(StalledError, match=r"^GD: the chunk of rounds 4\.\.7 made no progress for 1 s") as info:
        fb.fed_fit(model, data, fb.GD(), num_rounds=8, chunk_size=4, stall_timeout=1.0)
    assert info.value.rounds == (4, 7) and len(info.value.history["bits_up"]) == 4


# ---------------------------------------------------------------------------------------- model structures

def _clients(n=5, seed=0):
    rng = np.random.default_rng(seed)
    return fb.FederatedData({"y": [rng.normal(1.0, 1.0, size=int(k)) for k in rng.integers(4, 12, n)]})


def test_fedmm_refuses_a_factor_that_involves_the_globals_and_accepts_one_that_does_not():
    data = _clients()

    def with_theta(y):
        mu = numpyro.param("mu", 0.0)
        with numpyro.plate("obs", y.shape[0]):
            numpyro.factor("lik", -0.5 * (y - mu) ** 2)

    with pytest.raises(fb.ModelError, match=r"site 'lik' is a numpyro.factor .*depends on the global"):
        fb.fed_fit(with_theta, data, fb.FedMM(), num_rounds=2)

    def plain(y, extra=False):
        mu = numpyro.param("mu", 0.0)
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)
            if extra:  # a theta-free term: it enters no statistic
                numpyro.factor("const", jnp.full(y.shape, -3.0))

    a = fb.fed_fit(plain, data, fb.FedMM(), num_rounds=2, model_kwargs={"extra": True})
    b = fb.fed_fit(plain, data, fb.FedMM(), num_rounds=2)
    np.testing.assert_allclose(a.params["mu"], np.mean(data.pooled()["y"]), rtol=1e-12)
    np.testing.assert_allclose(a.params["mu"], b.params["mu"], rtol=1e-14)


def test_fedmm_with_a_scalar_observed_site():
    """``obs=1.0`` (a Python float) outside the data plate: each client's likelihood has the term, so the
    MLE of mu ~ N(y, 1) is (sum of the data + 1.0 per client) / (N + C), exact after one EM step."""
    data = _clients()

    def model(y):
        mu = numpyro.param("mu", 0.0)
        numpyro.sample("anchor", dist.Normal(mu, 1.0), obs=1.0)
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    res = fb.fed_fit(model, data, fb.FedMM(), num_rounds=2)
    y = np.asarray(data.pooled()["y"])
    # the anchor's moment block [[C, C], [C, C]] / N is singular (every observation is 1.0): the projection
    # onto {block >= 1e-10 I} moves it by ~1e-10, hence rtol 1e-9 (FedEM, without it, is exact)
    expected = (y.sum() + data.num_clients) / (len(y) + data.num_clients)
    np.testing.assert_allclose(res.params["mu"], expected, rtol=1e-9)
    exact = fb.fed_fit(model, data, fb.FedEM(), num_rounds=2)
    np.testing.assert_allclose(exact.params["mu"], expected, rtol=1e-13)


@pytest.mark.slow  # second tier (make test-slow): ~14 s, a TAMUNA warm start then EM
def test_param_averaging_em_map_init_on_a_random_intercept_model():
    """init="map" starts from a TAMUNA fit of the model (as for FedSOUL): the fit equals the one started
    from that estimate passed as a dict; an init that is none of the accepted forms is a ConfigError."""
    data = _clients(6, seed=1)

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        tau = numpyro.sample("tau", dist.HalfNormal(1.0))
        with fb.local():
            b = numpyro.sample("b", dist.Normal(0.0, tau))
        with numpyro.plate("obs", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu + b, 1.0), obs=y)

    start = map_estimate(Problem(FedModel(model, data), data, 5))
    by_name = fb.fed_fit(model, data, fb.ParamAveragingEM(init="map"), num_rounds=5)
    by_value = fb.fed_fit(model, data, fb.ParamAveragingEM(init=start), num_rounds=5)
    for k in ("mu", "tau"):
        np.testing.assert_array_equal(by_name.params[k], by_value.params[k])
        assert np.isfinite(by_name.params[k])
    with pytest.raises(fb.ConfigError, match="init must be None, a dict"):
        fb.ParamAveragingEM(init="mle")


# ---------------------------------------------------------------------------------------- what stopped a fit

class _Scripted(FederatedRun):
    """An engine algorithm (one float per client and server) whose uploads or global state turn NaN at
    a given round: to check how the engine names the cause. Only the round is run (no set-up, no end)."""

    name = "Scripted"

    def setup_server(self, key):
        raise NotImplementedError

    setup_client = setup_server_step = finalize = setup_server

    def __init__(self, nan_uploads_at=None, nan_state_at=None):
        self.nan_uploads_at, self.nan_state_at = nan_uploads_at, nan_state_at

    def client_step(self, key, broadcast, state, client):
        bad = jnp.asarray(self.nan_uploads_at is not None) & (broadcast >= (self.nan_uploads_at or 0))
        return state, Message(jnp.where(bad, jnp.nan, 1.0), jnp.asarray(32))

    def server_step(self, key, state, uploads, info):
        new = state + 1.0
        bad = jnp.asarray(self.nan_state_at is not None) & (info.round >= (self.nan_state_at or 0))
        return new, Message(new, jnp.asarray(32)), {"theta/x": jnp.where(bad, jnp.nan, new)}


@pytest.mark.parametrize("script, reason", [({"nan_uploads_at": 3}, "nonfinite_uploads"),
                                            ({"nan_state_at": 3}, "diverged")])
def test_the_engine_tells_a_clients_blow_up_from_a_global_one(script, reason):
    from fedbayes.engine import Stopped

    data = _clients(4)
    problem = Problem(None, data, 6, None)
    carry = (jnp.zeros(()), jnp.zeros((4,)), Message(jnp.zeros(()), jnp.asarray(32)))
    with pytest.raises(Stopped) as info:
        run_rounds(_Scripted(**script), problem, carry, base_key=jax.random.PRNGKey(0), cohort_size=4,
                   stop_on_divergence=True, chunk_size=6)
    assert (info.value.reason, info.value.round) == (reason, 3)
    assert info.value.counts == ({"active": 0, "dropped": 0, "nonfinite": 4, "too_large": 0} if reason != "diverged"
                                 else {"active": 4, "dropped": 0, "nonfinite": 0, "too_large": 0})


def test_a_blow_up_on_the_clients_is_reported_as_such():
    """GD with a step beyond 2 / L: the clients' uploads overflow while the global state is still finite
    (they are screened out); the error says so, with the counts and the fixes that fit."""
    data, _ = fb.models.make_glm_clients(4, 3, 30, family="linear", seed=2)
    with pytest.raises(fb.DivergenceError) as info:
        fb.fed_fit(fb.models.linear_regression(), data, fb.GD(step_size=0.2), num_rounds=300, seed=0, chunk_size=7)
    message = str(info.value)
    assert re.match(r"GD diverged on the clients at round \d+: the global parameters were still finite, but no client "
                    r"answered usefully and 4 of the 4 taking part sent non-finite uploads", message), message
    assert "lower step_size" in message and "compressor" in message
    assert "the global parameters became non-finite" not in message
