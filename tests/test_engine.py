"""Engine pieces: cohorts, cohort sizes, progress reporting, optax-compatible server optimisers."""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedbayes as fb
from fedbayes import optim
from fedbayes.engine import Problem, Progress, resolve_cohort_size, run_rounds, sample_cohort
from fedbayes.errors import ConfigError


def test_cohorts_are_uniform_without_replacement():
    C, c, T = 10, 3, 20000
    cohorts = np.asarray(jax.vmap(lambda k: sample_cohort(k, C, c))(jax.random.split(jax.random.PRNGKey(0), T)))
    assert all(len(set(row)) == c for row in cohorts[:200])
    freq = np.bincount(cohorts.ravel(), minlength=C) / T
    # each client is in the cohort with probability c / C; binomial standard error sqrt(p (1 - p) / T)
    np.testing.assert_array_less(np.abs(freq - c / C), 5 * np.sqrt(0.3 * 0.7 / T))
    np.testing.assert_array_equal(sample_cohort(jax.random.PRNGKey(1), C, C), np.arange(C))


def test_cohort_size_resolution():
    assert resolve_cohort_size(None, 50) == 50
    assert resolve_cohort_size(0.1, 50) == 5
    assert resolve_cohort_size(0.001, 50) == 1
    assert resolve_cohort_size(7, 50) == 7
    for bad in (0, 51, -0.5, 1.5, True, "all"):
        with pytest.raises(ConfigError):
            resolve_cohort_size(bad, 50)


def test_progress_line_is_written_only_when_enabled(capsys):
    bar = Progress(10, "FedSOUL", True)
    bar.update(5)
    bar.update(10)
    err = capsys.readouterr().err
    assert "FedSOUL: round 10/10 (100%)" in err and "rounds/s" in err
    bar = Progress(10, "FedSOUL", False)
    bar.phase("analysing the model")
    bar.update(5)
    bar.finish()
    assert capsys.readouterr().err == ""


def test_progress_rate_and_time_left_exclude_the_first_chunk_that_compiles(capsys, monkeypatch):
    """The first chunk took 100 s (compilation); the next two 1 s each for 10 rounds: 10 rounds/s, and 70
    rounds left take 7 s. A rate over the whole time would say 0.29 rounds/s and 240 s left."""
    clock = iter([0.0, 100.0, 101.0, 102.0])
    monkeypatch.setattr(fb.engine.time, "perf_counter", lambda: next(clock))
    bar = Progress(100, "GD", True)
    for done in (10, 20, 30):
        bar.update(done)
    first, second, third = capsys.readouterr().err.splitlines()
    assert "first chunk (compilation included) in 100.0 s" in first and "left" not in first
    assert "10.0 rounds/s, ~8 s left" in second and "10.0 rounds/s, ~7 s left" in third


def test_fit_reports_its_phases_and_progress_between_chunks(capsys):
    data = fb.models.make_glm_clients(4, 3, 20, family="linear", seed=0)[0]
    fb.fed_fit(fb.models.linear_regression(), data, fb.GD(), num_rounds=20, chunk_size=10, progress=True, seed=0)
    err = capsys.readouterr().err
    assert "round 10/20" in err and "round 20/20" in err
    phases = ["analysing the model", "set-up exchange", "compiling the rounds", "round 10/20", "round 20/20",
              "the final exchange", "the convergence checks", "done in"]
    where = [err.find(p) for p in phases]
    assert min(where) >= 0 and where == sorted(where), err


def test_builtin_optimisers_match_their_formulas():
    params = {"a": jnp.array([1.0, -2.0])}
    grads = {"a": jnp.array([0.5, 4.0])}
    sgd = optim.sgd(optim.polynomial_decay(0.1, power=1.0, offset=1.0))
    state = sgd.init(params)
    u1, state = sgd.update(grads, state)
    u2, _ = sgd.update(grads, state)
    np.testing.assert_allclose(u1["a"], -0.1 * grads["a"])
    np.testing.assert_allclose(u2["a"], -0.05 * grads["a"])  # 0.1 / (1 + 1)
    adam = optim.adam(0.01)
    u, _ = adam.update(grads, adam.init(params))
    np.testing.assert_allclose(u["a"], -0.01 * np.sign(grads["a"]), rtol=1e-6)  # first Adam step = -lr sign(g)
    with pytest.raises(ConfigError):
        optim.sgd(-1.0)


def test_an_optax_optimiser_plugs_in_as_the_server_optimiser():
    optax = pytest.importorskip("optax")
    data = fb.models.make_fedpop_synthetic(6, seed=0)[0]
    problem = Problem(fb.FedModel(fb.models.fedpop_synthetic, data), data, 15)
    trajectories = []
    for opt, lr in (("sgd", 1e-4), (optax.sgd(1e-4), 0.05)):
        run = fb.FedSOUL(server_optimizer=opt, server_lr=lr, local_steps=2).build(problem)
        carry = run.init(jax.random.PRNGKey(0), problem)
        trajectories.append(run_rounds(run, problem, carry, base_key=jax.random.PRNGKey(1), cohort_size=6)[1])
    # the same arithmetic: identical trajectories up to float rounding
    np.testing.assert_allclose(trajectories[1]["theta/phi"], trajectories[0]["theta/phi"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("start, end, size", [(0, 500, 50), (0, 7, 50), (0, 101, 50), (30, 97, 20), (0, 1, 1), (5, 5, 10)])
def test_chunk_plan_covers_every_round_once(start, end, size):
    from fedbayes.engine import chunk_plan

    plan = chunk_plan(start, end, size)
    rounds = [r for first, length in plan for r in range(first, first + length)]
    assert rounds == list(range(start, end))
    assert len({length for _, length in plan}) <= 2 and all(length <= max(size, 1) for _, length in plan)


@pytest.mark.parametrize("cohort, participation", [(7, 1.0), (3, 1.0), (7, 0.5)])
def test_a_chunks_keys_hashed_at_once_are_each_rounds_own(cohort, participation):
    """The rounds of a chunk take their keys from one batched hash (``chunk_plans``); each round's plan is
    then the plan it derives alone (``round_plan``, what Flower's server computes round by round), bit for
    bit: cohort, client keys, server and shared keys, and who is expected."""
    from fedbayes.engine import _plan_from_keys, chunk_plans, round_plan

    base, ks = jax.random.PRNGKey(3), jnp.arange(40, 65, dtype=jnp.int32)
    hashed = jax.jit(chunk_plans)(base, ks)
    planned = jax.jit(lambda keys: jax.vmap(lambda k: _plan_from_keys(k, 7, cohort, participation))(keys))(hashed[:5])
    alone = [jax.jit(round_plan, static_argnums=(2, 3, 4))(base, k, 7, cohort, participation) for k in ks]
    for i, one in enumerate(alone):
        for a, b in zip(one, planned):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[i])
        # the server key's halves, hashed ahead for split_server_key: jax.random.split of the round's server key
        np.testing.assert_array_equal(np.asarray(hashed[5][i]), np.asarray(jax.random.split(one[3])))


def test_a_rounds_server_step_takes_its_key_split_from_the_chunks_hash():
    """LMC's server step splits its key (the move's noise, the downlink's compression) with ``split_server_key``:
    in a round given its keys hashed ahead (``chunk_plans``) the round computes one key hash fewer than a round
    that hashes its own, and outside a round the split is ``jax.random.split`` itself."""
    from fedbayes.engine import Problem, _plan_from_keys, chunk_plans, make_round, split_server_key, stack_clients

    key = jax.random.PRNGKey(5)
    np.testing.assert_array_equal(np.stack(split_server_key(key)), jax.random.split(key))
    data = fb.models.make_glm_clients(4, 3, 20, family="logistic", seed=0)[0]
    problem = Problem(fb.FedModel(fb.models.logistic_regression(), data), data, 10)
    run = fb.LMC(step_size=1e-3, num_chains=1).build(problem)
    carry = run.init(jax.random.PRNGKey(0), problem)
    round_fn = make_round(run, stack_clients(data), 4, 4, jax.random.PRNGKey(1))
    k = jnp.asarray(3, jnp.int32)
    hashed = jax.tree_util.tree_map(lambda a: a[0], chunk_plans(jax.random.PRNGKey(1), k[None]))

    def count(jaxpr) -> int:  # the key hashes of a jaxpr, those of its inner jaxprs included
        found = 0
        for eqn in jaxpr.eqns:
            found += eqn.primitive.name in ("random_split", "random_bits", "random_fold_in")
            for param in eqn.params.values():
                for inner in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(inner, "jaxpr", inner)
                    if hasattr(inner, "eqns"):
                        found += count(inner)
        return found

    def hashes(*step):
        return count(jax.make_jaxpr(round_fn)(carry, *step).jaxpr)

    assert hashes((k, hashed)) == hashes((k, hashed[:5])) - 1
    own, ahead = jax.jit(round_fn)(carry, (k, hashed[:5])), jax.jit(round_fn)(carry, (k, hashed))
    for a, b in zip(jax.tree_util.tree_leaves(own), jax.tree_util.tree_leaves(ahead)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_rounds_do_not_depend_on_the_chunk_size():
    """Chunks of 7, 50 and 1 rounds and timed chunks run the same rounds bit for bit: every chunk runs the one
    compiled program of the run (its length is an argument) and each round's keys are a function of the seed
    and the round alone. LMC's draws with dropped uploads, FedAvg's iterate with sampled cohorts, and their
    ledgers."""
    data = fb.FederatedData({"x": [np.linspace(-1, 1, 4 + i)[:, None] for i in range(6)],
                             "y": [np.linspace(0, 2, 4 + i) for i in range(6)]})
    model = fb.models.linear_regression()
    for algo, kw in ((fb.LMC(num_chains=1, init="prior"), {}), (fb.FedAvg(), {"clients_per_round": 4})):
        fits = [fb.fed_fit(model, data, algo, num_rounds=30, seed=2, chunk_size=size, faults=fb.Faults(drop=0.2),
                           progress=False, **kw) for size in (7, 50, 1, None)]
        first = fits[0].global_samples or fits[0].params
        for fit in fits[1:]:
            for name, value in (fit.global_samples or fit.params).items():
                np.testing.assert_array_equal(value, first[name])
            for name in ("bits_up", "bits_down", "active", "dropped"):
                np.testing.assert_array_equal(fit.history[name], fits[0].history[name])
        assert fits[0].history["dropped"].sum() > 0


@pytest.mark.parametrize("start, end, size", [(0, 500, 50), (0, 101, 50), (30, 97, 20), (40, 100, 50), (5, 5, 10)])
def test_a_given_chunk_size_runs_the_plan_of_the_whole_fit(start, end, size):
    """With a given size the schedule is ``chunk_plan``'s for the whole fit (a continued run takes the remaining
    chunks of the same plan), and the compiled program's capacity is the longest chunk."""
    from fedbayes.engine import ChunkSchedule, chunk_plan

    schedule = ChunkSchedule(start, end, size, capacity=1)
    chunks = list(iter(schedule.next, None))
    whole = [c for c in chunk_plan(0, end, size) if c[0] >= start]
    assert chunks == (whole if whole and whole[0][0] == start else chunk_plan(start, end, size))
    assert schedule.capacity == max([length for _, length in chunks], default=1)


def test_timed_chunks_grow_to_the_time_they_aim_at_and_cover_every_round_once():
    """``chunk_size=None``: 1 round, then doubling until a chunk is timed without compilation (the second), then
    as many rounds as ``AUTO_CHUNK_SECONDS`` holds at the measured rate (at most 16 times the last chunk, at most
    the capacity, never past the end); the chunks cover the rounds once, in order."""
    from fedbayes.engine import AUTO_CHUNK_SECONDS, ChunkSchedule

    per_round = AUTO_CHUNK_SECONDS / 300  # a chunk of 300 rounds lasts the time aimed at
    schedule = ChunkSchedule(10, 2000, None, capacity=500)
    chunks = []
    while (chunk := schedule.next()) is not None:
        chunks.append(chunk)
        # as run_rounds does: chunk i + 1 is planned before chunk i's time is known
        if len(chunks) >= 2:
            schedule.timed(chunks[-2][1], 0.9 if len(chunks) == 2 else chunks[-2][1] * per_round)
    lengths = [length for _, length in chunks]
    assert lengths[:4] == [1, 2, 4, 64] and lengths[4] == 300 and set(lengths[5:-1]) == {300}
    assert [r for first, length in chunks for r in range(first, first + length)] == list(range(10, 2000))
    slow = ChunkSchedule(0, 100, None, capacity=100)
    assert [slow.next(), slow.next()] == [(0, 1), (1, 2)]
    slow.timed(1, 100.0)  # the first chunk's time (compilation included) is not used
    assert slow.next() == (3, 4)
    slow.timed(2, 4 * AUTO_CHUNK_SECONDS)  # rounds of twice the aim: one round a chunk
    assert slow.next() == (7, 1)


def test_a_fit_compiles_its_chunk_of_rounds_once_whatever_the_chunks_lengths():
    """101 rounds in chunks of 50 (two of 50 and one of 1) or timed chunks (1, 2, 4, ...): one compilation of
    the chunk for each capacity, not one per distinct length."""
    from fedbayes import api, engine

    data = fb.models.make_glm_clients(4, 3, 20, family="linear", seed=0)[0]
    model = fb.models.linear_regression()
    fb.clear_cache()
    fb.fed_fit(model, data, fb.GD(), num_rounds=101, chunk_size=50, progress=False, seed=0)
    [(_, run, _)] = api._BUILDS.values()
    [chunk] = [f for key, f in engine._JITTED[run].items() if key[0] == "chunk"]

    def programs() -> int:  # compiled ahead (engine.FitJitted.ahead: a fit's first chunk) or by a plain call
        return len(chunk._compiled) + chunk._cache_size()

    assert programs() == 1
    fb.fed_fit(model, data, fb.GD(), num_rounds=101, progress=False, seed=0)  # timed chunks: capacity 101
    assert [r for _, r, _ in api._BUILDS.values()] == [run] and programs() == 2
    fb.clear_cache()


def test_the_final_exchange_in_blocks_of_clients_is_the_final_exchange_of_all_at_once(monkeypatch):
    """Past ``FINAL_BLOCK`` clients the final exchange's client computations run block by block (to bound
    their memory): FedSOUL's personal posteriors and Louis' standard errors are those of one vmap over all
    clients, to float rounding (the per-client arithmetic is the same; XLA may vectorise a block differently)."""
    import warnings

    import fedbayes.engine as engine

    data, _, _ = fb.models.make_fedpop_synthetic(40, test_size=1, seed=0)
    fits = {}
    for block in (10_000, 16):  # all at once; 40 clients = 2 blocks of 16 and a rest of 8
        fb.clear_cache()
        monkeypatch.setattr(engine, "FINAL_BLOCK", block)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fits[block] = fb.fed_fit(fb.models.fedpop_synthetic, data, fb.FedSOUL(local_steps=5, num_samples=20,
                                                                                   warmup=20), num_rounds=30,
                                     progress=False)
    whole, blocks = fits[10_000], fits[16]
    np.testing.assert_array_equal(whole.history["bits_up"], blocks.history["bits_up"])
    for name in whole.local_samples:
        np.testing.assert_allclose(blocks.local_samples[name], whole.local_samples[name], rtol=1e-5, atol=1e-6)
    for name in whole.standard_errors:
        np.testing.assert_allclose(blocks.standard_errors[name], whole.standard_errors[name], rtol=1e-4)
    assert whole.final_bits == blocks.final_bits and whole.final_bits[0] > 0
    fb.clear_cache()


def test_progress_is_one_line_per_chunk_in_a_log_and_one_live_line_on_a_terminal(capsys, monkeypatch):
    """Forced on where stderr is no terminal (capsys: a log), each update is a line of its own; on a terminal
    (or in a notebook) the same updates redraw one line with carriage returns and end with one newline."""
    bar = Progress(30, "GD", True)
    for done in (10, 20, 30):
        bar.update(done)
    err = capsys.readouterr().err
    assert "\r" not in err and err.count("\n") == 3
    assert [line.split(": round ")[1].split(" ")[0] for line in err.splitlines()] == ["10/30", "20/30", "30/30"]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    bar = Progress(30, "GD", None)
    assert bar.enabled and bar.live
    for done in (10, 20, 30):
        bar.update(done)
    bar.finish()
    err = capsys.readouterr().err
    assert err.count("\r") == 4 and err.count("\n") == 1 and err.endswith("\n")


def test_a_fit_whose_history_would_not_fit_in_memory_is_refused_after_its_first_round():
    """num_rounds = 2^31 - 1 is a valid count, but res.history keeps every round's records on the host: the
    fit used to run until the OS killed it for memory, without a word. The first chunk's records (1 round)
    measure a round's bytes; 2^31 rounds of them exceed half of any machine's memory."""
    model = fb.models.linear_regression()
    data, _ = fb.models.make_glm_clients(3, 2, 10, family="linear", seed=0)
    t0 = time.perf_counter()
    with pytest.raises(fb.ConfigError, match=r"history of 2,147,483,64\d more rounds would take .* GiB"):
        fb.fed_fit(model, data, fb.GD(), num_rounds=fb.api.MAX_ROUNDS, progress=False)
    assert time.perf_counter() - t0 < 120  # refused after one round, not after running out of memory
