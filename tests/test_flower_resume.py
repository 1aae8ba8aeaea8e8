"""fedbayes.flower._resume: a node's snapshots (the two newest kept, the newest of a round <= the server's read
back exactly) and the server's checkpoint (its trees, weak types included, and the refusals). The resumed runs
themselves are in tests/test_flower.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import fedbayes as fb
from fedbayes.flower import _resume


def _records(k):
    return {"fedbayes.state": [np.full(3, float(k)), np.arange(k + 2)], "fedbayes.settings": [np.ones(1)]}


def test_a_node_keeps_its_two_newest_snapshots_and_reads_the_newest_not_after_the_server(tmp_path):
    for k in (-1, 0, 1, 2):
        _resume.write_snapshot(tmp_path, 4, k, _records(k), upload=bytes([k + 1, 7]), pending=k)
    _resume.write_snapshot(tmp_path, 5, 0, _records(9), upload=None, pending=-1)  # another client's: untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client-4.r1.npz", "client-4.r2.npz", "client-5.r0.npz"]
    round_, records, upload, pending = _resume.read_snapshot(tmp_path, 4, at_most=1)
    assert (round_, upload, pending) == (1, bytes([2, 7]), 1)
    assert records.keys() == _records(1).keys()
    for mine, saved in zip(_records(1)["fedbayes.state"], records["fedbayes.state"]):
        np.testing.assert_array_equal(mine, saved)
        assert mine.dtype == saved.dtype
    assert _resume.read_snapshot(tmp_path, 4, at_most=10)[0] == 2
    assert _resume.read_snapshot(tmp_path, 5, at_most=0)[2] is None
    with pytest.raises(fb.CheckpointError, match=r"client 4 has no state snapshot of round <= 0 .*\[1, 2\]"):
        _resume.read_snapshot(tmp_path, 4, at_most=0)


def test_an_altered_snapshot_is_refused(tmp_path):
    path = _resume.write_snapshot(tmp_path, 0, 3, _records(3), upload=None, pending=-1)
    raw = path.read_bytes()
    path.write_bytes(raw.replace(np.full(3, 3.0).tobytes(), np.full(3, 4.0).tobytes()))  # the state's values
    with pytest.raises(fb.CheckpointError, match="client snapshot"):
        _resume.read_snapshot(tmp_path, 0, at_most=3)


def test_the_server_checkpoint_restores_its_trees_and_refuses_another_fit(tmp_path):
    path = tmp_path / "server.ckpt"
    trees = ({"x": jnp.arange(3.0), "k": jnp.asarray(2)}, (jnp.zeros((2, 2)), 5.0))
    history = {"bits_up": np.array([10, 20]), "active": np.array([[1, 1], [1, 0]])}
    prints = {"model": "m", "data": "d", "options": "o"}
    _resume.save_server(path, 1, prints, trees, history, {"accepted": [1, -1], "stale": []})
    template = ({"x": jnp.ones(3), "k": jnp.asarray(0)}, (jnp.ones((2, 2)), 1.0))
    k, restored, hist, extra = _resume.load_server(path, prints, template)
    assert k == 1 and extra == {"accepted": [1, -1], "stale": []}
    np.testing.assert_array_equal(restored[0]["x"], trees[0]["x"])
    assert float(restored[1][1]) == 5.0 and restored[1][1].weak_type  # a Python scalar stays weakly typed
    for name in history:
        np.testing.assert_array_equal(hist[name], history[name])
    with pytest.raises(fb.CheckpointError, match="its options differs"):
        _resume.load_server(path, {**prints, "options": "other"}, template)
    with pytest.raises(fb.CheckpointError, match="does not hold this run's server state"):
        _resume.load_server(path, prints, ({"x": jnp.ones(4), "k": jnp.asarray(0)}, (jnp.ones((2, 2)), 1.0)))


def test_a_restore_drops_the_stopped_runs_later_rounds_and_tags_name_no_other_path(tmp_path):
    """After a resume from round K the node's snapshots of later rounds are the stopped run's: removed, so that a
    client absent from the replayed round K + 1 cannot keep one and have it restored by a later resume. A run tag
    is 32 hexadecimal digits: anything else would name a path outside the node's folder."""
    for k in (0, 1, 2):
        _resume.write_snapshot(tmp_path, 0, k, _records(k), upload=None, pending=-1)
    assert _resume.read_snapshot(tmp_path, 0, at_most=1)[0] == 1
    _resume.drop_after(tmp_path, 0, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["client-0.r1.npz"]
    good = "0123456789abcdef" * 2
    assert _resume.snapshot_folder(tmp_path, good) == tmp_path / good
    for bad in ("../x", "/etc", "", good.upper(), good + "0"):
        with pytest.raises(fb.CheckpointError, match="32 hexadecimal digits"):
            _resume.snapshot_folder(tmp_path, bad)
