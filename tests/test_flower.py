"""fedbayes on Flower: the generic ServerApp / ClientApp against fed_fit, message bytes against the ledger,
unreachable nodes against dropped clients, and one run under Flower's Ray simulation engine.

The module runs in float32 (JAX's default, and what Ray workers use): floats cross the wire as float32
numbers, the ledger's 32 bits, so only then is the network exact. Client steps run one client at a time
on Flower and vectorised in fed_fit, and the server step is compiled on its own rather than inside the
round's scan: D-ELF and TAMUNA come out bit for bit equal; FedSOUL and FedMM differ in the last bits of
their server arithmetic (XLA fuses it differently), so their floats are compared to float32 rounding
carried through the rounds, measured by a fit on data moved by one ulp (``DRIFT``).
The ledger and the fault records are integers and are compared exactly in every case.
"""

import functools
import os
import tempfile
import warnings

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_HOME", tempfile.mkdtemp(prefix="fedbayes-flwr-"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
import pytest  # noqa: E402
from numpyro.distributions import constraints  # noqa: E402

pytest.importorskip("flwr", reason='Flower is not installed: pip install "fedbayes[flower]" to run the Flower tests')

import fedbayes as fb  # noqa: E402
from fedbayes import flower, wire  # noqa: E402
from fedbayes.wire import Masked  # noqa: E402
from fedbayes.engine import _FAULT_STREAM, round_plan  # noqa: E402
from fedbayes.flower._apps import (FlowerSpec, LocalGrid, _content, _forget, _runtime, _server_identity,  # noqa: E402
                                payload_bytes, run_server)


@pytest.fixture(scope="module", autouse=True)
def float32():
    before = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    yield
    jax.config.update("jax_enable_x64", before)


def glm():
    data, _ = fb.models.make_glm_clients(5, 3, 20, seed=0)
    return fb.models.logistic_regression(), data


def mixture():
    data, _ = fb.models.make_gaussian_mixture(4, num_components=2, dim=2, sizes=(20, 40), seed=3)
    y = np.asarray(data.pooled()["y"])
    init = {"weights": np.ones(2) / 2, "means": y[[0, 50]], "covs": np.broadcast_to(np.eye(2), (2, 2, 2)).copy()}
    return fb.models.gaussian_mixture(2, 2), data, init


CASES = {
    # algorithm, problem, rounds, cohort; each with a compressor of another kind on the wire
    "fedsoul": lambda: (fb.FedSOUL(local_steps=3, compressor=fb.compress.qsgd(4), num_samples=20, warmup=20),
                        fb.models.linear_mixed_effects, fb.models.make_linear_mixed_effects(5, seed=0)[0], 4, 3),
    # FedMM with its final information pass (Louis' identity): a final exchange with every client
    "fedmm": lambda: (lambda m, d, init: (fb.FedMM(init=init, compressor=fb.compress.qsgd(16), step_size=0.5,
                                                   participation=0.75), m, d, 4, None))(*mixture()),
    # samplers: on a network None means init="prior" (no search for the mode), so fed_fit is given it too
    "d-elf": lambda: (fb.DELF(uplink=fb.compress.top_k(1), num_chains=2, init="prior"), *glm(), 5, None),
    # P-/B-ELF: each client keeps a copy of the server's w, re-sent after a fault (the unreachable test)
    "b-elf": lambda: (fb.BELF(uplink=fb.compress.top_k(1), downlink=fb.compress.top_k(2), num_chains=2, init="prior"),
                      *glm(), 5, None),
    "tamuna": lambda: (fb.TAMUNA(s=2, local_steps=2), *glm(), 5, 3),
}


BITWISE = {"d-elf", "b-elf", "tamuna"}
FITS = ["fedsoul", "fedmm", "d-elf", "tamuna"]  # B-ELF's messages are D-ELF's plus the downlink's: see below


DRIFT = 10
"""How far a Flower run's floats may be from fed_fit's where they are not bit for bit equal: DRIFT times
how far fed_fit itself moves when every data value is moved by one float32 ulp (``_drift``). Both are
last-bit differences carried through the rounds, and how much a round amplifies them depends on the
problem, the seed and the machine's vector width (a round of FedSOUL here multiplies them by up to 10;
on an AVX-512 machine the Flower run's difference was 0.04-2.8 times the nudged run's). An algorithmic
difference (a step, a weight, a message) moves the floats by orders of magnitude more."""


def _nudged(data):
    """``data`` with every float moved one ulp up (``np.nextafter``)."""
    clients = [data.client(i) for i in range(data.num_clients)]
    nudge = lambda v: np.nextafter(v, np.inf).astype(v.dtype) if np.issubdtype(v.dtype, np.floating) else v  # noqa: E731
    return fb.FederatedData({k: [nudge(c[k]) for c in clients] for k in clients[0]})


@functools.lru_cache(maxsize=None)
def _drift(name, seed):
    """fed_fit of ``CASES[name]`` on the nudged data (the float32 module fixture is on throughout)."""
    algo, model, data, rounds, cohort = CASES[name]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fb.fed_fit(model, _nudged(data), algo, num_rounds=rounds, clients_per_round=cohort, seed=seed)


def _equal(a, b, exact, what, rtol=1e-4, drift=None):
    """a and b equal: bit for bit with ``exact``, else to float32 rounding (rtol, and an absolute
    tolerance of 1e-5 or DRIFT times a's distance to ``drift``, the same quantity of the nudged fit)."""
    a, b = np.asarray(a), np.asarray(b)
    if exact or not np.issubdtype(a.dtype, np.floating):
        np.testing.assert_array_equal(a, b, err_msg=what)
    else:
        # float32 rounding: a few ulps (1.2e-7 each) per operation, carried through a handful of rounds of
        # a contracting iteration; 1e-4 relative is ~1000 ulps and still far below any algorithmic change.
        np.testing.assert_allclose(a, b, rtol=rtol, atol=_drift_atol(a, drift, 1e-5), err_msg=what)


def _drift_atol(a, drift, floor):
    if drift is None:
        return floor
    moved = np.abs(np.asarray(a, np.float64) - np.asarray(drift, np.float64))
    moved = moved[np.isfinite(moved)]
    return max(floor, DRIFT * float(moved.max())) if moved.size else floor


def _same(a, b, exact=True, locals_=True, drift=None):
    """The same result: history (ledger, faults, diagnostics), parameters, samples, the final exchange's
    parts (standard errors, information, normal approximation) and, with ``locals_``, the personal
    posteriors. ``drift``: a's fit on nudged data (``_drift``), for the floats that are not bit for bit."""
    def d(part, key=None):
        if drift is None:
            return None
        return getattr(drift, part) if key is None else (getattr(drift, part) or {}).get(key)

    assert a.history.keys() == b.history.keys()
    for key in a.history:
        if key != "seconds":
            _equal(a.history[key], b.history[key], exact, key, drift=d("history", key))
    for name, value in a.params.items():
        _equal(value, b.params[name], exact, name, drift=d("params", name))
    # The standard errors and the normal approximation come from the inverse of the information, which
    # agrees to 1e-5 of its scale (below): inverting multiplies that relative difference by up to the
    # information's condition number (FedMM's mixture: ~300, so a few 1e-4 in a standard error).
    inverse_rtol = 1e-4
    if a.information is not None:
        inverse_rtol = max(inverse_rtol, 1e-5 * np.linalg.cond(np.asarray(a.information, np.float64)))
    for attr in ("global_samples", "standard_errors", "global_approx") + (("local_samples", "local_info", "client_info")
                                                                           if locals_ else ()):
        mine, theirs = getattr(a, attr), getattr(b, attr)
        assert mine.keys() == theirs.keys(), attr
        rtol = inverse_rtol if attr in ("standard_errors", "global_approx") else 1e-4
        for name, value in mine.items():
            _equal(value, theirs[name], exact, f"{attr}/{name}", rtol, drift=d(attr, name))
    assert (a.information is None) == (b.information is None)
    if a.information is not None:
        # as _equal (the estimate's float32 differences carried into the matrix), and small entries are
        # differences of sums over every row (the Hessian of Q less the score covariances), so their
        # rounding is relative to the matrix's largest entry
        scale = np.abs(a.information).max()
        np.testing.assert_allclose(a.information, b.information, rtol=0 if exact else 1e-4,
                                   atol=0 if exact else _drift_atol(a.information, d("information"), 1e-5 * scale))
    assert a.init_bits == b.init_bits and a.final_bits == b.final_bits


def _check_bytes(res):
    """Every payload Flower carried is ceil(ledger bits / 8) bytes, and the per-round sums of the ledger
    bits of the messages are the history's bits_up / bits_down."""
    msgs = res.flower_messages
    assert msgs
    for kind, k, client, size, bits in msgs:
        assert size == -(-bits // 8), (kind, k, client)
    rounds = len(res.history["bits_up"])
    up, down = np.zeros(rounds, np.int64), np.zeros(rounds, np.int64)
    setup = {"setup": 0, "setup-reply": 0}
    final = {"final": 0, "final-reply": 0}
    for kind, k, _, _, bits in msgs:
        if kind in setup:
            setup[kind] += bits
        elif kind in final:
            final[kind] += bits
        else:
            (up if kind == "upload" else down)[k] += bits
    np.testing.assert_array_equal(up, res.history["bits_up"])
    np.testing.assert_array_equal(down, res.history["bits_down"])
    # the set-up exchange (every client's start) is the ledger's init_bits: uploads, payloads to all
    assert (setup["setup-reply"], setup["setup"]) == res.init_bits
    assert setup["setup"] > 0
    # the final exchange (the estimate out, FedMM's statistics and score covariances back) is final_bits
    assert (final["final-reply"], final["final"]) == res.final_bits


@pytest.mark.parametrize("name", FITS)
def test_flower_run_equals_fed_fit(name):
    algo, model, data, rounds, cohort = CASES[name]()
    ref = fb.fed_fit(model, data, algo, num_rounds=rounds, clients_per_round=cohort, seed=3)
    res = flower.simulate(model, data, algo, num_rounds=rounds, clients_per_round=cohort, seed=3, backend="local")
    _same(ref, res, exact=name in BITWISE, drift=None if name in BITWISE else _drift(name, 3))
    _check_bytes(res)
    assert res.algorithm == ref.algorithm and type(res) is type(ref)
    if name == "fedsoul":  # the personalised part: each client's posterior, computed on its node, came back
        # theta-bar to 5 clients (beta 2, scale_tril 3, sigma 1: d = 6); back, for the standard errors, each
        # client's mean score (d) and two d(d+1)/2 triangles (Louis' term, the score's Monte Carlo covariance)
        assert ref.local_samples and ref.standard_errors and res.final_bits == (5 * 32 * (6 + 6 * 7), 5 * 32 * 6)
    if name == "fedmm":  # Louis' information: theta-hat out, s_i(theta-hat) and a score covariance back
        assert ref.standard_errors and ref.local_info["responsibilities"].shape[0] == 4
        d, q = ref.information.shape[0], sum(np.size(v) for v in jax.tree_util.tree_leaves(ref.statistic))
        assert res.final_bits == (4 * 32 * (q + d * (d + 1) // 2), 4 * 32 * d)


def random_intercept(x, y=None):
    """y_ij = x_ij^T beta + b_i + eps_ij, b_i ~ N(0, tau^2): a scalar random effect with a positive scale."""
    beta = numpyro.param("beta", jnp.zeros(x.shape[-1]))
    tau = numpyro.param("tau", jnp.ones(()), constraint=constraints.positive)
    sigma = numpyro.param("sigma", jnp.ones(()), constraint=constraints.positive)
    with fb.local():
        b = numpyro.sample("b", dist.Normal(0.0, tau))
    with numpyro.plate("obs", x.shape[0]):
        numpyro.sample("y", dist.Normal(x @ beta + b, sigma), obs=y)


def lme_data():
    return fb.models.make_linear_mixed_effects(5, seed=0)[0]


def linear():
    return fb.models.linear_regression(), fb.models.make_glm_clients(5, 3, 20, family="linear", seed=0)[0]


def random_intercept_data():
    data = lme_data()
    return fb.FederatedData({key: [data.client(i)[key] for i in range(data.num_clients)] for key in ("x", "y")})


EM_MODELS = {
    # Models whose EM statistic has a linear-Gaussian term, whose layout (the coefficients each
    # observation's mean uses) the server, holding only the data's layout (every value zero), must
    # derive as the clients do (issue 20). Louis' information where it is cheap: LME's final pass
    # compiles for about 15 s (fed_fit and Flower), and its set-up is the issue's, FedMM()'s.
    "lme": lambda: (fb.FedMM(uncertainty=False), fb.models.linear_mixed_effects, lme_data()),
    "random-intercept": lambda: (fb.FedMM(participation=0.75, step_size=0.5), random_intercept,
                                 random_intercept_data()),
    "linear-regression": lambda: (fb.FedMM(compressor=fb.compress.qsgd(16)), *linear()),  # no latents; MAP-EM
}


@pytest.mark.slow  # second tier (make test-slow): 15-35 s each, mostly compilation
@pytest.mark.parametrize("name", EM_MODELS)
def test_fedmm_on_flower_for_linear_gaussian_models(name):
    """FedMM on mixed models (random intercepts and slopes; a random intercept) and a linear
    regression: the server unpacks the clients' statistics, and the run is fed_fit's: rounds, ledger
    (set-up included), estimate, and where computed Louis' information and standard errors, from a
    final exchange of theta-hat (d floats) out and q + d(d+1)/2 floats back from every client."""
    algo, model, data = EM_MODELS[name]()
    ref = fb.fed_fit(model, data, algo, num_rounds=3, seed=3, progress=False)
    res = flower.simulate(model, data, algo, num_rounds=3, seed=3, backend="local")
    # float32 rounding carried through the rounds, as the other FedMM comparison: LME's covariance step amplifies
    # it (measured: one ulp of the data moves fed_fit's scale_tril by 3.8e-5, and Flower's run differs by 3.8e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nudged = fb.fed_fit(model, _nudged(data), algo, num_rounds=3, seed=3, progress=False)
    _same(ref, res, exact=False, drift=nudged)
    _check_bytes(res)
    assert res.init_bits == ref.init_bits and res.init_bits[0] > 0
    if algo.uncertainty:
        d, q = ref.information.shape[0], sum(np.size(v) for v in jax.tree_util.tree_leaves(ref.statistic))
        assert ref.standard_errors and res.final_bits == (5 * 32 * (q + d * (d + 1) // 2), 5 * 32 * d)


def _layout(tree):
    # a Masked part's mask function is each end's own (a method of its run): compare what goes on the wire
    masked = lambda x: isinstance(x, Masked)  # noqa: E731
    tree = jax.tree_util.tree_map(lambda x: {"masked": x.values} if masked(x) else x, tree, is_leaf=masked)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, [(tuple(leaf.shape), np.dtype(leaf.dtype)) for leaf in leaves]


@pytest.mark.parametrize("algo", [fb.FedSOUL(local_steps=2), fb.TAMUNA(s=2, local_steps=2), fb.GD(), fb.DELF(),
                                  fb.PELF(), fb.BELF(), fb.QLSD(), fb.LMC()], ids=lambda a: a.name)
def test_the_server_expects_the_messages_clients_send(algo):
    """The server's runtime, built on the data's layout alone, and a client's, built on its data, trace
    the same structure for every message (set-up, broadcast, upload, resync, final exchange) on the
    models above, so every message one end sends, the other reads. (FedMM's family, whose two ends
    once derived different statistics there, is checked end to end above: its runtimes take seconds to
    build.)"""
    ran = 0
    for model, data in [(fb.models.linear_mixed_effects, lme_data()), (random_intercept, random_intercept_data()),
                        linear()]:
        spec = FlowerSpec(model, data, algo, 2)
        try:
            client = _runtime(spec, "client")
        except (fb.ModelError, fb.ConfigError):  # a model the algorithm does not fit (fed_fit refuses it too)
            continue
        try:
            server = _runtime(spec, "server")
            for name in ("setup_payloads", "setup_uploads", "broadcast_template", "resync_template"):
                assert _layout(getattr(server, name)) == _layout(getattr(client, name)), name
            # every run's steps read their settings from their arguments, so the round's upload traces before
            # the set-up on both ends (TAMUNA's step size included)
            assert _layout(server.upload_template()) == _layout(client.upload_template())
            if client.run.final_exchange:
                assert _layout(server.final_templates()) == _layout(client.final_templates())
        finally:
            _forget(spec.token)
        ran += 1
    assert ran


OTHERS = {
    # the rest of the algorithms, each on a few rounds: the generic apps run any of them
    "lmc": lambda: (fb.LMC(num_chains=2, init="prior"), *glm(), 3, None),
    "p-elf": lambda: (fb.PELF(downlink=fb.compress.top_k(2), num_chains=2, init="prior"), *glm(), 3, None),
    "qlsd": lambda: (fb.QLSD(compressor=fb.compress.rand_k(2), num_chains=2, init="prior"), *glm(), 3, 3),
    "fedem": lambda: (lambda m, d, init: (fb.FedEM(init=init, step_size=0.5, uncertainty=False), m, d, 3, None))(
        *mixture()),
    "param-averaging": lambda: (lambda m, d, init: (fb.ParamAveragingEM(init=init, uncertainty=False), m, d, 3, None))(
        *mixture()),
    "scaffnew": lambda: (fb.Scaffnew(local_steps=2), *glm(), 3, None),
    "gd": lambda: (fb.GD(), *glm(), 3, None),
    "fedavg": lambda: (fb.FedAvg(local_steps=2), *glm(), 3, 3),
}


@pytest.mark.parametrize("name", OTHERS)
def test_every_algorithm_runs_on_flower(name):
    """Every other algorithm through the same ServerApp / ClientApp: fed_fit's rounds and ledger, and its
    estimate to float32 rounding; each message's bytes are its ledger bits."""
    algo, model, data, rounds, cohort = OTHERS[name]()
    ref = fb.fed_fit(model, data, algo, num_rounds=rounds, clients_per_round=cohort, seed=4, progress=False)
    res = flower.simulate(model, data, algo, num_rounds=rounds, clients_per_round=cohort, seed=4, backend="local")
    _same(ref, res, exact=False)
    _check_bytes(res)


def _dropped(algo, model, data, rounds, cohort, seed, faults):
    """(round, client) pairs that fed_fit's fault stream drops (recomputed from the seed)."""
    run_key = jax.random.split(jax.random.PRNGKey(seed), 3)[1]
    out = set()
    for k in range(rounds):
        rk, members, _, _, _, _ = round_plan(run_key, jnp.asarray(k), data.num_clients, cohort)
        kinds = np.asarray(faults.draw(jax.random.fold_in(rk, _FAULT_STREAM), cohort))
        out |= {(k, int(members[j])) for j in np.flatnonzero(kinds == 1)}
    return out


def test_a_flower_round_nobody_answers_stops_the_run_with_the_finished_rounds_ledger():
    """Flower's stop check counts the faults of the round just run from its slots' kinds
    (``engine.fault_counts``), and the error carries the finished rounds' history as fed_fit keeps it
    (counts and bits per round): every node down in round 3 leaves nobody answering (the default
    ``min_clients`` is 1)."""
    algo, model, data, _, cohort = CASES["d-elf"]()
    cohort = cohort or data.num_clients
    with pytest.raises(fb.TooFewClientsError, match="round 3 ") as info:
        flower.simulate(model, data, algo, num_rounds=6, clients_per_round=cohort, seed=5, backend="local",
                        unreachable=lambda k, client: k == 3)
    ref = fb.fed_fit(model, data, algo, num_rounds=3, clients_per_round=cohort, seed=5)
    history = info.value.history
    for name in ("active", "dropped", "nonfinite", "too_large", "bits_up", "bits_up_rejected"):
        np.testing.assert_array_equal(history[name], ref.history[name])
    np.testing.assert_array_equal(history["active"], cohort)


@pytest.mark.parametrize("name", ["tamuna", "d-elf", "b-elf"])
def test_an_unreachable_node_is_a_dropped_client(name):
    """A node that does not answer (Flower's NODE_UNAVAILABLE) is handled as fed_fit handles a dropped
    client: left out of the server step, its round rolled back, no reply; same result, same ledger.

    B-ELF's clients keep a copy of the server's w. fed_fit re-sends it to a faulty client in the round of
    the fault; on Flower the server re-sends it before the client's next step (a node that is down does
    not take it in the same round), built from the state that opened the previous round, so the client
    holds exactly fed_fit's copy: the samples are equal bit for bit, and the ledger differs only in when
    the copies are charged. A client down two rounds in a row misses its resync, so it is sent no
    broadcast in the second (fed_fit charges that broadcast)."""
    algo, model, data, rounds, cohort = CASES[name]()
    rounds, cohort = 8, cohort or data.num_clients
    faults = fb.Faults(drop=0.25)
    ref = fb.fed_fit(model, data, algo, num_rounds=rounds, clients_per_round=cohort, seed=5, faults=faults)
    off = _dropped(algo, model, data, rounds, cohort, 5, faults)
    assert 3 <= len(off) == ref.history["dropped"].sum()
    res = flower.simulate(model, data, algo, num_rounds=rounds, clients_per_round=cohort, seed=5, backend="local",
                          unreachable=lambda k, client: (k, client) in off)
    _check_bytes(res)  # Flower's messages, resyncs included, are the Flower run's ledger
    if name == "b-elf":
        # w is (2 chains x d = 3) float32: 192 bits per copy; the broadcast is top-2 per chain
        copy = 32 * 2 * 3
        down = ref.history["bits_down"].astype(np.int64)
        broadcast = int(down[ref.history["dropped"] == 0].min()) // cohort
        expected = down.copy()
        for k in range(rounds):
            late = {c for (r, c) in off if r == k - 1}  # re-sent this round
            expected[k] += copy * (len(late) - ref.history["dropped"][k])
            expected[k] -= broadcast * len(late & {c for (r, c) in off if r == k})
        np.testing.assert_array_equal(res.history["bits_down"], expected)
        assert any(kind == "resync" for kind, *_ in res.flower_messages)
        res.history["bits_down"] = ref.history["bits_down"]  # the rest of the history: bit for bit
    _same(ref, res, exact=name in BITWISE)
    assert sorted(map(tuple, res.faults[["round", "client"]].to_numpy())) == sorted(off)


def _deployed(name, seed, collect_locals=False, unreachable=None, node_config=None):
    """fed_fit, and a run whose ServerApp's spec holds only the data's layout (every value zero) while each
    ClientApp reads its own partition, as in a deployment."""
    algo, model, data, rounds, cohort = CASES[name]()
    ref = fb.fed_fit(model, data, algo, num_rounds=rounds, clients_per_round=cohort, seed=seed)
    clients = FlowerSpec(model, data, algo, rounds, cohort, seed=seed)
    server = FlowerSpec(model, data.blank(), algo, rounds, cohort, seed=seed)
    grid = LocalGrid(flower.client_app(clients), data.num_clients, unreachable, node_config=node_config)
    try:
        with _server_identity():
            res = run_server(server, grid, collect_locals=collect_locals)
    finally:
        _forget(clients.token)
        _forget(server.token)
    return ref, res


@pytest.mark.parametrize("name", ["d-elf", "fedsoul", "fedmm"])
def test_the_server_needs_no_client_data(name):
    """The set-up exchange gives a server without client data all it needs (D-ELF: the gradients and
    Hessians at x_0 for the step size; FedMM: the E-step statistics at theta_0 and the control
    variates), and the final exchange what needs the data at the estimate (FedMM's Louis information from
    the clients' statistics and score covariances): rounds, ledger, estimate and uncertainty are fed_fit's.
    The personal posteriors (FedSOUL's local samples, FedMM's responsibilities) stay on the nodes unless
    collected, as a simulation does; collected, they are fed_fit's too."""
    ref, res = _deployed(name, seed=2, collect_locals=name == "fedsoul")
    _same(ref, res, exact=name in BITWISE, locals_=name == "fedsoul", drift=None if name in BITWISE else _drift(name, 2))
    _check_bytes(res)
    if name == "fedmm":  # a deployment's result: no client's local posterior reached the server
        assert ref.local_info and not res.local_info and not res.local_samples


def test_a_node_writes_its_personal_posterior_where_its_config_says(tmp_path):
    """With ``fedbayes-output`` in its node config, each node writes its personal posterior to its own
    disk after the final exchange (constrained, chains x draws): fed_fit's for that client. The server's
    result, as in a deployment, holds none."""
    ref, res = _deployed("fedsoul", seed=2, node_config={flower.OUTPUT_KEY: str(tmp_path)})
    assert not res.local_samples
    drift = _drift("fedsoul", 2)
    for i in range(ref._data.num_clients):
        with np.load(tmp_path / f"client-{i}.npz") as saved:
            assert set(saved.files) == {"local_samples/b", "step_size", "acceptance"}
            _equal(ref._local_chains["b"][i], saved["local_samples/b"], False, f"client {i}",
                   drift=drift._local_chains["b"][i])
            _equal(ref.client_info["step_size"][i], saved["step_size"], False, f"client {i} step",
                   drift=drift.client_info["step_size"][i])
            _equal(ref.client_info["acceptance"][i], saved["acceptance"], False, f"client {i} acceptance",
                   drift=drift.client_info["acceptance"][i])


@pytest.mark.parametrize("name", ["fedmm", "fedsoul"])
def test_a_client_missing_the_final_exchange_keeps_the_rest(name):
    """A node that does not answer the final exchange (round num_rounds of LocalGrid's schedule) costs the
    result what needs every client, FedMM's information, and its own personal posterior (NaN), with a
    warning; the estimate and the other clients' posteriors are fed_fit's."""
    rounds, gone = CASES[name]()[3], 2
    with pytest.warns(RuntimeWarning, match=r"client\(s\) \[2\] did not answer the final exchange"):
        ref, res = _deployed(name, seed=2, collect_locals=True, unreachable=lambda k, c: k == rounds and c == gone)
    drift = _drift(name, 2)
    for site, value in ref.params.items():
        _equal(value, res.params[site], False, site, drift=drift.params[site])
    kept = np.arange(ref._data.num_clients) != gone
    personal = {"fedmm": ("local_info", "responsibilities"), "fedsoul": ("local_samples", "b")}[name]
    mine, theirs = getattr(res, personal[0])[personal[1]], getattr(ref, personal[0])[personal[1]]
    assert np.isnan(mine[gone]).all()
    _equal(theirs[kept], mine[kept], False, personal[1], drift=getattr(drift, personal[0])[personal[1]][kept])
    if name == "fedmm":
        assert ref.standard_errors and not res.standard_errors and res.information is None
        d, q = ref.information.shape[0], sum(np.size(v) for v in jax.tree_util.tree_leaves(ref.statistic))
        assert res.final_bits == (3 * 32 * (q + d * (d + 1) // 2), 4 * 32 * d)  # three answers, four sent
    else:  # FedSOUL's standard errors need every client's Louis terms (d + d(d+1) floats, d = 6)
        assert ref.standard_errors and not res.standard_errors and res.information is None
        assert res.final_bits == (4 * 32 * (6 + 6 * 7), 5 * 32 * 6)  # four answers, five sent


COMPRESSORS = [fb.compress.identity(), fb.compress.identity(16), fb.compress.identity(64), fb.compress.rand_k(3),
               fb.compress.rand_k_unscaled(fraction=0.3, float_bits=16), fb.compress.top_k(5),
               fb.compress.qsgd(1), fb.compress.qsgd(7, float_bits=16), fb.compress.qsgd(4, contractive=True),
               fb.compress.natural(), fb.compress.natural(16), fb.compress.natural(64, contractive=True),
               fb.compress.scale_to_contractive(fb.compress.rand_k(2))]


@pytest.mark.parametrize("c", COMPRESSORS, ids=repr)
@pytest.mark.parametrize("d", [300])  # whole and partial bytes: every message here ends mid-byte or on one
def test_flower_counts_the_ledger_bytes_for_each_compressor(c, d):
    """A Flower message holding one compressed vector (batched as ELF's chains are) is ceil(bits / 8)
    bytes by Flower's own count, and the receiver decodes C(x) exactly."""
    k = getattr(getattr(c, "base", c), "k", None)
    if k is not None and k > d:
        return
    x = jnp.asarray(np.random.default_rng(d).normal(size=(2, d)), jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(d), 2)
    coded, x_hat, bits = jax.vmap(c.coded)(keys, x)
    payload = {"v": coded, "scalar": jnp.ones((), jnp.float32)}
    data, packed = wire.pack(jax.device_get(payload))
    ledger = int(bits.sum()) + 32
    assert packed == ledger
    content = _content(data, {"round": 0})  # a message's RecordDict, as the apps build it
    assert payload_bytes(content) == -(-ledger // 8)
    back = wire.decode_tree(wire.unpack(content.array_records["p"][""].data, wire.template(payload)))
    np.testing.assert_array_equal(np.asarray(back["v"]), np.asarray(x_hat))


def test_a_message_of_another_structure_is_refused():
    """A message that does not fit its receiver's template, shorter or longer (the two ends built
    different runs, as a server holding only the data's layout once built another FedMM statistic than
    its clients: issue 20), is a WireError saying so, not a misread payload."""
    data, bits = wire.pack({"s": np.ones(16, np.float32)})
    assert bits == 16 * 32
    back = wire.unpack(data, {"s": jax.ShapeDtypeStruct((16,), np.float32)})
    np.testing.assert_array_equal(back["s"], np.ones(16, np.float32))
    for size, what in ((17, "shorter"), (15, "longer")):
        with pytest.raises(wire.WireError, match=f"{what} than the structure.*built different runs"):
            wire.unpack(data, {"s": jax.ShapeDtypeStruct((size,), np.float32)})


# Two warnings Ray raises while starting, neither about fedbayes: Python warns on any fork from a
# process that has JAX threads, but Ray's fork is subprocess's fork+exec, which runs no Python in the
# child; and a notice about a future default for GPU visibility (this test asks for no GPU).
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:Tip. In future versions of Ray:FutureWarning")
@pytest.mark.slow  # second tier (make test-slow): Ray start-up, ~30 s
def test_ray_simulation_engine_equals_fed_fit():
    """Flower's own simulation engine (Ray workers, one SuperNode per client) gives fed_fit's result:
    FedSOUL, whose rounds, final exchange and personal posteriors all cross Flower's transport.

    One CPU per client would let two Ray actors share this 2-core CI machine with the other pytest
    worker; two per client runs the clients one at a time, which is faster here.
    """
    pytest.importorskip("ray", reason='Ray is not installed: pip install "fedbayes[flower]" brings flwr[simulation]')
    algo, model, data, rounds, cohort = CASES["fedsoul"]()
    ref = fb.fed_fit(model, data, algo, num_rounds=3, clients_per_round=cohort, seed=1)
    res = flower.simulate(model, data, algo, num_rounds=3, clients_per_round=cohort, seed=1, backend="ray",
                          num_cpus_per_client=2)
    _same(ref, res, exact=False)
    _check_bytes(res)
    assert res.local_samples and res.final_bits == (5 * 32 * (6 + 6 * 7), 5 * 32 * 6)  # as test_flower_run_equals_fed_fit


def test_simulate_refuses_bad_options():
    model, data = glm()
    with pytest.raises(fb.ConfigError, match="backend"):
        flower.simulate(model, data, "lmc", num_rounds=2, backend="grpc")
    with pytest.raises(fb.ConfigError, match="unreachable"):
        flower.simulate(model, data, "lmc", num_rounds=2, unreachable=lambda k, c: False)


@pytest.mark.parametrize(
    "option, match",
    [
        ({"unreachable": 3, "backend": "local"}, r"unreachable must be a function \(round, client\) -> bool"),
        ({"num_cpus_per_client": 0}, "num_cpus_per_client must be a positive finite number"),
        ({"num_cpus_per_client": True}, "num_cpus_per_client must be"),
        ({"timeout": -1.0}, "timeout must be a positive finite number or None"),
        ({"progress": "no"}, "progress must be None, True or False"),
    ],
)
def test_simulate_validates_its_own_options_before_running(option, match):
    """Issue 53 (minor): unreachable=3 was taken without a word; every option of simulate is checked up front."""
    model, data = glm()
    with pytest.raises(fb.ConfigError, match=match):
        flower.simulate(model, data, "lmc", num_rounds=2, **option)


def _flower_run(name, seed, folder, unreachable=None, policy=None, **server_options):
    """One Flower run of CASES[name] over a fresh LocalGrid (fresh node contexts, as after a restart) whose nodes
    keep state snapshots in ``folder``; the ServerApp's spec holds only the data's layout."""
    algo, model, data, rounds, cohort = CASES[name]()
    clients = FlowerSpec(model, data, algo, rounds, cohort, seed=seed, fault_policy=policy)
    server = FlowerSpec(model, data.blank(), algo, rounds, cohort, seed=seed, fault_policy=policy, **server_options)
    node_config = {flower.STATE_KEY: str(folder)}
    grid = LocalGrid(flower.client_app(clients), data.num_clients, unreachable, node_config=node_config)
    try:
        with _server_identity():
            return run_server(server, grid, collect_locals=True)
    finally:
        _forget(clients.token)
        _forget(server.token)


@pytest.mark.parametrize("name", ["b-elf", "fedsoul", "tamuna"])
def test_a_stopped_run_resumes_from_its_checkpoints_bit_for_bit(name, tmp_path):
    """A member of round 2's cohort is unreachable and the fault policy needs every member (the documented stop:
    TooFewClientsError, naming the checkpoint). A new run over fresh node contexts with ``resume=True`` restores
    the server from its checkpoint (after round 1) and each client from its node's newest snapshot of a round
    <= 1 (the members of round 2 had stepped, and a node keeps its round-2 snapshot beside it), and ends exactly
    where the uninterrupted run ends: history, ledger, estimate, draws, personal posteriors and Flower's
    messages, bit for bit. B-ELF's clients keep a copy of the server's w, TAMUNA's control variates and
    FedSOUL's chains: each a client state the resume must restore."""
    _, _, data, rounds, cohort = CASES[name]()
    policy = fb.FaultPolicy(min_clients=cohort or data.num_clients)
    # the uninterrupted run, with a checkpoint of its own on the same nodes: its snapshots (of every round) sit
    # beside the next runs' and must not be taken for theirs
    ref = _flower_run(name, 3, tmp_path / "nodes", policy=policy, checkpoint=str(tmp_path / "ref.ckpt"))
    ckpt = str(tmp_path / "server.ckpt")
    victim: list[int] = []

    def unreachable(k, c):  # the first member asked in round 2; the others step, their nodes one round ahead
        if k == 2 and victim in ([], [c]):
            victim[:] = [c]
            return True
        return False

    with pytest.raises(fb.TooFewClientsError, match="round 2.*resume from the checkpoint after round 1"):
        _flower_run(name, 3, tmp_path / "nodes", unreachable=unreachable, policy=policy, checkpoint=ckpt)
    from fedbayes import checkpoint as checkpoint_io
    from fedbayes.flower import _resume

    tag = checkpoint_io.read_sealed(ckpt, _resume.FORMAT)[0]["extra"]["tag"]  # the stopped run's snapshots
    assert any(p.name.endswith(".r2.npz") for p in (tmp_path / "nodes" / tag).iterdir())  # ahead of the checkpoint
    res = _flower_run(name, 3, tmp_path / "nodes", policy=policy, checkpoint=ckpt, resume=True)
    _same(ref, res, exact=True)
    assert res.flower_messages == ref.flower_messages


def test_a_resume_without_the_nodes_snapshots_is_refused_with_the_fix(tmp_path):
    ckpt = str(tmp_path / "server.ckpt")
    _flower_run("d-elf", 0, tmp_path / "nodes", checkpoint=ckpt)
    for snapshot in (tmp_path / "nodes").rglob("*.npz"):
        snapshot.unlink()
    with pytest.raises(fb.CheckpointError, match="client 0 has no state snapshot of round <= 4"):
        _flower_run("d-elf", 0, tmp_path / "nodes", checkpoint=ckpt, resume=True)
    with pytest.raises(fb.CheckpointError, match="another fit"):
        _flower_run("d-elf", 1, tmp_path / "nodes", checkpoint=ckpt, resume=True)
    with pytest.raises(fb.ConfigError, match="resume=True needs checkpoint"):
        _flower_run("d-elf", 0, tmp_path / "nodes", resume=True)
    res = _flower_run("d-elf", 0, tmp_path / "other", checkpoint=str(tmp_path / "server.ckpt"))
    res.save(tmp_path / "result.fbr")  # a saved result is a sealed file too, but not a Flower checkpoint
    with pytest.raises(fb.CheckpointError, match="is not a Flower checkpoint"):
        _flower_run("d-elf", 0, tmp_path / "nodes", checkpoint=str(tmp_path / "result.fbr"), resume=True)
