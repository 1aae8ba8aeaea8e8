"""Checkpoints: kill-and-resume equals the uninterrupted fit bit for bit; bad checkpoints are refused."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import fedbayes as fb
from test_elf import gauss_model, gaussian_clients

TESTS = Path(__file__).parent
ROUNDS, CHUNK = 150, 5


def algorithm():
    return fb.DELF(step_size=0.02, num_chains=3, uplink=fb.compress.top_k(2))


FIT = dict(num_rounds=ROUNDS, seed=11, chunk_size=CHUNK, faults=fb.Faults(drop=0.1))

CHILD = textwrap.dedent(f"""
    import sys, time
    sys.path.insert(0, {str(TESTS)!r})
    import jax
    jax.config.update("jax_enable_x64", True)  # as the test process (tests/conftest.py)
    import fedbayes as fb
    from test_checkpoint import FIT, algorithm
    from test_elf import gauss_model, gaussian_clients
    data = gaussian_clients()[0]
    fb.fed_fit(gauss_model, data, algorithm(), checkpoint=sys.argv[1], checkpoint_every=2 * {CHUNK},
               callback=lambda done, hist: time.sleep(0.15), **FIT)
    print("finished")
""")


def same_fit(a, b):
    np.testing.assert_array_equal(a.global_samples["x"], b.global_samples["x"])
    assert set(a.history) == set(b.history)
    for k in a.history:
        if k != "seconds":  # wall time is not part of the result
            np.testing.assert_array_equal(a.history[k], b.history[k], err_msg=k)
    assert (a.bits_up, a.bits_down) == (b.bits_up, b.bits_down)
    assert a.faults.equals(b.faults)


@pytest.fixture(scope="module")
def uninterrupted():
    return fb.fed_fit(gauss_model, gaussian_clients()[0], algorithm(), **FIT)


def test_a_killed_fit_resumes_to_exactly_the_uninterrupted_result(tmp_path, uninterrupted):
    path = tmp_path / "fit.ckpt"
    target = int(np.random.default_rng(2026).integers(3, 10)) * 2 * CHUNK  # a random checkpoint round
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    try:
        while time.time() < deadline and child.poll() is None:
            if path.exists() and fb.checkpoint.info(path)["round"] >= target:
                break
            time.sleep(0.05)
        assert child.poll() is None, child.communicate()[1].decode()[-2000:]
        os.kill(child.pid, signal.SIGKILL)  # no exception handler, no clean-up: the process is gone
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL
    reached = fb.checkpoint.info(path)["round"]
    assert target <= reached < ROUNDS
    resumed = fb.resume(path, model=gauss_model)  # the data, algorithm and options come from the checkpoint
    same_fit(resumed, uninterrupted)
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary file left behind by the atomic writes


def test_resume_reads_everything_from_a_picklable_fit(tmp_path, uninterrupted):
    path = tmp_path / "fit.ckpt"
    stop = {}

    def interrupt(done, hist):
        if done == 70:
            stop["at"] = done
            raise KeyboardInterrupt  # an interrupt between chunks; the checkpoint of round 70 is on disk

    with pytest.raises(KeyboardInterrupt):
        fb.fed_fit(gauss_model, gaussian_clients()[0], algorithm(), checkpoint=path, callback=interrupt, **FIT)
    assert fb.checkpoint.info(path)["round"] == 70 == stop["at"]
    same_fit(fb.resume(path), uninterrupted)  # gauss_model is importable by name: nothing else is needed


def test_corrupted_and_mismatched_checkpoints_are_refused(tmp_path, uninterrupted):
    path = tmp_path / "fit.ckpt"

    def interrupt(done, hist):
        if done == 20:
            raise KeyboardInterrupt

    data = gaussian_clients()[0]
    with pytest.raises(KeyboardInterrupt):
        fb.fed_fit(gauss_model, data, algorithm(), checkpoint=path, callback=interrupt, **FIT)
    raw = path.read_bytes()

    # mismatched: other data, another algorithm, a different model
    with pytest.raises(fb.CheckpointError, match="data differ"):
        fb.resume(path, data=gaussian_clients(seed=1)[0])
    with pytest.raises(fb.CheckpointError, match="algorithm or fit options differ"):
        fb.resume(path, algorithm=fb.DELF(step_size=0.03, num_chains=3, uplink=fb.compress.top_k(2)))


    with pytest.raises(fb.CheckpointError, match="initial state|model"):
        fb.resume(path, model=lambda m, prec: gauss_model(m * 2.0, prec))

    # corrupted: a flipped byte inside an array (the zip's CRC), an array altered in a well-formed file
    # (the checkpoint's own digest), a truncated file, not a checkpoint at all
    at = raw.index(b"history/_sample.npy") + 400
    flipped = raw[:at] + bytes([raw[at] ^ 0xFF]) + raw[at + 1:]
    with np.load(path) as z:
        entries = {k: z[k] for k in z.files}
    entries["history/bits_up"] = entries["history/bits_up"] - 32  # claim fewer bits were sent
    altered = tmp_path / "altered.npz"
    np.savez(altered, **entries)
    for bad in (flipped, altered.read_bytes(), raw[: len(raw) - 100], b"not a checkpoint"):
        path.write_bytes(bad)
        with pytest.raises(fb.CheckpointError, match="corrupted|integrity|incomplete"):
            fb.resume(path)
    with pytest.raises(fb.CheckpointError, match="no checkpoint"):
        fb.resume(tmp_path / "missing.ckpt")
    # the intact file still resumes
    path.write_bytes(raw)
    same_fit(fb.resume(path), uninterrupted)


def test_a_model_that_does_not_pickle_must_be_passed_again(tmp_path):
    path = tmp_path / "fit.ckpt"
    model = fb.models.linear_regression(1.0, 1.0)  # a closure: it does not pickle
    data, _ = fb.models.make_glm_clients(4, 3, 20, family="linear", seed=0)

    def interrupt(done, hist):
        if done == 10:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fb.fed_fit(model, data, fb.GD(), num_rounds=30, chunk_size=5, checkpoint=path, callback=interrupt)
    with pytest.raises(fb.CheckpointError, match="model=..., data=..., algorithm=..."):
        fb.resume(path)
    res = fb.resume(path, model=model, data=data, algorithm=fb.GD())
    ref = fb.fed_fit(model, data, fb.GD(), num_rounds=30, chunk_size=5)
    np.testing.assert_array_equal(res.params["w"], ref.params["w"])
    with pytest.raises(fb.ConfigError, match="checkpoint_every needs"):
        fb.fed_fit(model, data, fb.GD(), num_rounds=30, checkpoint_every=5)


def test_a_fit_in_timed_chunks_resumes_to_the_uninterrupted_fit(tmp_path):
    """The default chunks (timed: 1, 2, 4, ... rounds) end where the machine's speed puts them; a fit stopped
    after its third chunk (round 7) resumes from that checkpoint, in timed chunks of its own, to the fit that
    ran without a stop, bit for bit (every chunk runs the same compiled program)."""
    path = tmp_path / "fit.ckpt"
    model = fb.models.linear_regression()
    data, _ = fb.models.make_glm_clients(4, 3, 20, family="linear", seed=0)
    stops = []

    def interrupt(done, hist):
        stops.append(done)
        if len(stops) == 3:
            raise KeyboardInterrupt

    kw = dict(num_rounds=40, seed=3, faults=fb.Faults(drop=0.2), progress=False)
    with pytest.raises(KeyboardInterrupt):
        fb.fed_fit(model, data, fb.GD(), checkpoint=path, callback=interrupt, **kw)
    assert stops == [1, 3, 7]  # chunks of 1, 2 and 4 rounds: none was timed yet
    resumed = fb.resume(path, model=model, data=data, algorithm=fb.GD())  # a closure model: passed again
    uninterrupted = fb.fed_fit(model, data, fb.GD(), **kw)
    for name, value in uninterrupted.params.items():
        np.testing.assert_array_equal(resumed.params[name], value)
    for name, value in uninterrupted.history.items():
        if name != "seconds":  # wall time is not part of the result
            np.testing.assert_array_equal(resumed.history[name], value, err_msg=name)
    assert uninterrupted.history["dropped"].sum() > 0 and resumed.faults.equals(uninterrupted.faults)


def test_checkpoint_options_are_checked_and_every_chunk_is_saved_by_default(tmp_path):
    model = fb.models.linear_regression(1.0, 1.0)
    data, _ = fb.models.make_glm_clients(4, 3, 20, family="linear", seed=0)
    for bad in (True, 123, tmp_path / "missing-dir" / "fit.ckpt"):
        with pytest.raises(fb.ConfigError, match="checkpoint"):
            fb.fed_fit(model, data, fb.GD(), num_rounds=5, checkpoint=bad)
    path = tmp_path / "fit.ckpt"
    saved = []
    # 90 rounds in chunks of "50" run as two chunks of 45: the default saves after each (not after 50 rounds),
    # and NumPy scalars among the options are written as plain numbers
    fb.fed_fit(model, data, fb.GD(), num_rounds=90, chunk_size=50, checkpoint=path, clients_per_round=np.int64(4),
               fault_policy=fb.FaultPolicy(min_clients=np.int64(1)),
               callback=lambda done, hist: saved.append(fb.checkpoint.info(path)["round"]))
    assert saved == [45, 45]  # the last chunk ends the fit: nothing is left to resume
    with pytest.raises(fb.ConfigError, match="checkpoint_every"):
        fb.resume(path, model=model, data=data, algorithm=fb.GD(), checkpoint_every="5")


def test_a_write_removes_the_temporaries_of_killed_writers_only(tmp_path):
    """Issue 53 (minor): a kill during a write left a full-size ``.name.tmp-<pid>`` that no later writer removed.
    The next write of the same path removes those of processes that are gone, and leaves a live one's alone."""
    from fedbayes.checkpoint import write_sealed

    path = tmp_path / "fit.ckpt"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a finished process: its pid names no live process (reuse within the test is vanishingly rare)
    stale = tmp_path / f".fit.ckpt.tmp-{gone.pid}"
    stale.write_bytes(b"\0" * 1024)
    live = tmp_path / f".fit.ckpt.tmp-{os.getppid()}"  # the parent of this process is alive
    live.write_bytes(b"\0" * 16)
    other = tmp_path / f".other.ckpt.tmp-{gone.pid}"  # another path's temporary: not this writer's business
    other.write_bytes(b"\0")
    write_sealed(path, {"x": np.arange(3)})
    assert path.exists() and not stale.exists()
    assert live.exists() and other.exists()
