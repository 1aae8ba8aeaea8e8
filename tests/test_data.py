"""Tests of fedbayes.data: FederatedData construction, validation, and partitioners."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbayes.data import FederatedData
from fedbayes.partition import partition_dirichlet, partition_iid, partition_shards
from fedbayes.errors import ConfigError, DataError


def _ragged(sizes: list[int], seed: int = 0) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return {
        "x": [rng.normal(size=(n, 3)) for n in sizes],
        "y": [rng.integers(0, 5, size=n) for n in sizes],
        "m": [rng.random(n) < 0.5 for n in sizes],
    }


# --- construction ------------------------------------------------------------------------------


def test_ragged_construction_shapes_mask_and_edge_padding():
    sizes = [4, 1, 6]
    raw = _ragged(sizes)
    data = FederatedData(raw)
    assert data.keys == ("x", "y", "m")
    assert data.num_clients == len(data) == 3
    assert data.sizes.dtype == np.int64
    np.testing.assert_array_equal(data.sizes, sizes)
    assert data.max_size == 6 and data.total_size == 11
    padded = data.padded
    assert padded["x"].shape == (3, 6, 3)
    assert padded["y"].shape == (3, 6)
    assert padded["m"].shape == (3, 6)
    mask = np.asarray(data.mask)
    assert mask.dtype == bool
    np.testing.assert_array_equal(mask.sum(axis=1), sizes)
    for i, n in enumerate(sizes):
        assert mask[i, :n].all() and not mask[i, n:].any()
        for key in raw:
            p = np.asarray(padded[key][i])
            np.testing.assert_array_equal(p[:n], raw[key][i])
            np.testing.assert_array_equal(p[n:], np.broadcast_to(raw[key][i][-1], p[n:].shape))


def test_padded_log_density_is_finite_where_zero_padding_would_not_be():
    data = FederatedData({"x": [np.array([1.0, 2.0, 3.0]), np.array([5.0])]})
    logp = jnp.log(data.padded["x"])
    assert bool(jnp.isfinite(logp).all())


def test_client_round_trip_negative_index_and_out_of_range():
    raw = _ragged([2, 5, 3])
    data = FederatedData(raw)
    for i in range(3):
        got = data.client(i)
        assert list(got) == ["x", "y", "m"]
        for key in raw:
            np.testing.assert_array_equal(got[key], raw[key][i])
    np.testing.assert_array_equal(data.client(-1)["x"], raw["x"][2])
    with pytest.raises(IndexError):
        data.client(3)
    with pytest.raises(IndexError):
        data.client(-4)


def test_pooled_is_concatenation_in_client_order():
    raw = _ragged([3, 2, 4])
    data = FederatedData(raw)
    pooled = data.pooled()
    for key in raw:
        np.testing.assert_array_equal(pooled[key], np.concatenate(raw[key]))
    np.testing.assert_array_equal(data.pooled_client_ids(), [0, 0, 0, 1, 1, 2, 2, 2, 2])
    assert data.pooled_client_ids().dtype == np.int64


def test_subset_len_and_repr():
    raw = _ragged([3, 2, 7])
    data = FederatedData(raw)
    sub = data.subset([2, 0])
    assert len(sub) == 2
    np.testing.assert_array_equal(sub.sizes, [7, 3])
    np.testing.assert_array_equal(sub.client(0)["x"], raw["x"][2])
    np.testing.assert_array_equal(sub.client(1)["y"], raw["y"][0])
    assert sub.padded["x"].shape == (2, 7, 3)
    with pytest.raises(IndexError):
        data.subset([0, 5])
    text = repr(data)
    assert "('x', 'y', 'm')" in text and "num_clients=3" in text and "2/3/7" in text


def test_dtypes_under_x64():
    data = FederatedData(
        {
            "f32": [np.ones(2, np.float32), np.ones(1, np.float32)],
            "i32": [np.ones(2, np.int32), np.ones(1, np.int32)],
            "u8": [np.ones(2, np.uint8), np.ones(1, np.uint8)],
            "b": [np.ones(2, bool), np.zeros(1, bool)],
        }
    )
    assert data.padded["f32"].dtype == jnp.float64
    assert data.padded["i32"].dtype == jnp.int64
    assert data.padded["u8"].dtype == jnp.int64
    assert data.padded["b"].dtype == jnp.bool_
    assert data.client(0)["f32"].dtype == np.float64
    assert data.client(1)["b"].dtype == np.bool_


def test_lists_and_mixed_kinds_are_promoted():
    data = FederatedData({"x": [[1, 2], np.array([0.5])]})
    assert data.padded["x"].dtype == jnp.float64
    np.testing.assert_array_equal(data.client(0)["x"], [1.0, 2.0])


# --- from_pooled -------------------------------------------------------------------------------


def test_from_pooled_equals_lists_and_drops_unassigned():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(10, 2))
    y = np.arange(10)
    ids = np.array([2, 0, -1, 1, 0, 2, -1, 1, 1, 0])
    pooled = {"x": x, "y": y}
    data = FederatedData.from_pooled(pooled, ids)
    expected = FederatedData({k: [v[ids == c] for c in range(3)] for k, v in pooled.items()})
    np.testing.assert_array_equal(data.sizes, [3, 3, 2])
    for key in ("x", "y"):
        np.testing.assert_array_equal(data.padded[key], expected.padded[key])
    np.testing.assert_array_equal(data.client(0)["y"], [1, 4, 9])
    assert data.total_size == 8
    assert not np.isin(data.pooled()["y"], [2, 6]).any()


def test_from_pooled_explicit_num_clients():
    data = FederatedData.from_pooled({"x": np.arange(4.0)}, [0, 1, 1, 0], num_clients=2)
    assert data.num_clients == 2
    with pytest.raises(DataError, match="client 2 has no rows"):
        FederatedData.from_pooled({"x": np.arange(4.0)}, [0, 1, 1, 0], num_clients=3)


@pytest.mark.parametrize(
    ("data", "ids", "num_clients", "match"),
    [
        ({"x": np.zeros(3)}, np.zeros((3, 1), int), None, r"1-D integer array of length 3"),
        ({"x": np.zeros(3)}, np.zeros(3), None, r"1-D integer array"),
        ({"x": np.zeros(3)}, np.zeros(2, int), None, r"length 3"),
        ({"x": np.zeros(3)}, np.array([0, -2, 0]), None, r"client_ids\[1\] is -2"),
        ({"x": np.zeros(3)}, np.array([0, 1, 4]), 2, r"num_clients=2 .* id 4"),
        ({"x": np.zeros(3), "y": np.zeros(2)}, np.zeros(3, int), None, r"'x' has 3, 'y' has 2"),
        ({"x": np.zeros(3)}, np.array([0, 2, 2]), None, r"client 1 has no rows"),
        ({"x": np.zeros(3)}, np.array([-1, -1, -1]), None, r"zero clients"),
        ({"x": np.array(["a", "b"])}, np.zeros(2, int), None, r"pooled key 'x'.*not numeric"),
        ({"x": np.float64(1.0)}, np.zeros(1, int), None, r"pooled key 'x'.*0-d"),
        ({}, np.zeros(1, int), None, r"at least one key"),
    ],
)
def test_from_pooled_validation(data, ids, num_clients, match):
    with pytest.raises(DataError, match=match):
        FederatedData.from_pooled(data, ids, num_clients)


def test_from_pooled_nan_names_key_and_client():
    x = np.zeros(6)
    x[4] = np.nan
    with pytest.raises(DataError, match=r"key 'x', client 1: 1 NaN/inf"):
        FederatedData.from_pooled({"x": x}, [0, 0, 0, 1, 1, 1])


# --- validation --------------------------------------------------------------------------------


def _two_clients(**overrides) -> dict:
    base = {"x": [np.zeros((3, 2)), np.zeros((2, 2))], "y": [np.zeros(3), np.zeros(2)]}
    base.update(overrides)
    return base


@pytest.mark.parametrize(
    ("clients", "match"),
    [
        ({}, r"at least one key"),
        ({1: [np.zeros(2)]}, r"keys must be str; got 1"),
        (_two_clients(y=[np.zeros(3)]), r"'x' has 2, 'y' has 1"),
        ({"x": []}, r"zero clients"),
        ({"x": np.zeros((2, 3))}, r"key 'x': expected a list"),
        (_two_clients(y=[np.zeros(3), np.array(["a", "b"])]), r"'y', client 1: dtype <U1 is not"),
        (_two_clients(y=[np.zeros(3), np.zeros(2, complex)]), r"'y', client 1: .*not numeric"),
        (_two_clients(y=[np.zeros(3), np.array([None, 1.0])]), r"'y', client 1: .*not numeric"),
        (_two_clients(y=[np.zeros(3), [[1.0], [1.0, 2.0]]]), r"'y', client 1: cannot be converted"),
        (_two_clients(y=[np.float64(0.0), np.zeros(2)]), r"'y', client 0: got a 0-d array"),
        (_two_clients(y=[np.zeros(3), np.zeros(4)]), r"client 1: 'x' has 2 rows but 'y' has 4"),
        (
            _two_clients(x=[np.zeros((3, 2)), np.zeros((2, 3))]),
            r"key 'x': client 0 .* \(2,\) but client 1 has \(3,\)",
        ),
        ({"x": [np.zeros(2), np.zeros(0)]}, r"client 1 has 0 rows"),
        (
            _two_clients(x=[np.zeros((3, 2)), np.array([[np.nan, np.inf], [1, 1]])]),
            r"key 'x', client 1: 2 NaN/inf",
        ),
        (_two_clients(y=[np.array([0.0, -np.inf, 1.0]), np.zeros(2)]), r"'y', client 0: 1 NaN/inf"),
    ],
)
def test_validation_errors(clients, match):
    with pytest.raises(DataError, match=match):
        FederatedData(clients)


def test_data_error_is_value_error():
    with pytest.raises(ValueError):
        FederatedData({"x": [np.zeros(0)]})


# --- partitioners ------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "c"), [(10, 3), (100, 7), (5, 5), (1, 1)])
def test_iid_balanced_and_covering(n, c):
    ids = partition_iid(n, c, seed=3)
    assert ids.dtype == np.int64 and ids.shape == (n,)
    counts = np.bincount(ids, minlength=c)
    assert counts.sum() == n and counts.min() >= 1
    assert counts.max() - counts.min() <= 1
    np.testing.assert_array_equal(partition_iid(n, c, seed=3), ids)


def test_iid_seed_changes_assignment():
    assert not np.array_equal(partition_iid(50, 5, seed=0), partition_iid(50, 5, seed=1))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_items": 3, "num_clients": 4},
        {"num_items": 0, "num_clients": 1},
        {"num_items": 5, "num_clients": 0},
        {"num_items": 5.0, "num_clients": 2},
        {"num_items": 5, "num_clients": 2, "seed": -1},
    ],
)
def test_iid_invalid(kwargs):
    with pytest.raises(ConfigError):
        partition_iid(**kwargs)


def _label_skew(labels: np.ndarray, ids: np.ndarray, num_clients: int) -> float:
    """Mean over clients of the share of the client's most common class."""
    shares = []
    for c in range(num_clients):
        counts = np.bincount(labels[ids == c])
        shares.append(counts.max() / counts.sum())
    return float(np.mean(shares))


def test_dirichlet_deterministic_min_size_and_skew():
    labels = np.repeat(np.arange(10), 100)
    ids = partition_dirichlet(labels, 10, alpha=0.5, seed=4, min_size=20)
    assert ids.dtype == np.int64 and ids.shape == labels.shape
    assert ids.min() >= 0 and ids.max() < 10
    assert np.bincount(ids, minlength=10).min() >= 20
    again = partition_dirichlet(labels, 10, alpha=0.5, seed=4, min_size=20)
    np.testing.assert_array_equal(again, ids)
    assert not np.array_equal(partition_dirichlet(labels, 10, alpha=0.5, seed=5, min_size=20), ids)
    skew_small = _label_skew(labels, partition_dirichlet(labels, 10, alpha=0.05, seed=0), 10)
    skew_large = _label_skew(labels, partition_dirichlet(labels, 10, alpha=100.0, seed=0), 10)
    assert skew_small > 0.5
    assert skew_large < 0.2
    assert skew_small > skew_large + 0.3


def test_dirichlet_gives_up_with_advice():
    labels = np.repeat(np.arange(2), 50)
    with pytest.raises(ConfigError, match=r"in 5 tries; lower min_size, raise alpha"):
        partition_dirichlet(labels, 10, alpha=0.01, min_size=10, max_tries=5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alpha": 0.0},
        {"alpha": -1.0},
        {"alpha": float("nan")},
        {"alpha": "big"},
        {"alpha": 1.0, "min_size": -1},
        {"alpha": 1.0, "max_tries": 0},
        {"alpha": 1.0, "min_size": 11},
    ],
)
def test_dirichlet_invalid(kwargs):
    with pytest.raises(ConfigError):
        partition_dirichlet(np.arange(100) % 3, 10, **kwargs)


@pytest.mark.parametrize("labels", [np.zeros((3, 2), int), np.zeros(0, int), np.zeros(4)])
def test_partitioners_reject_bad_labels(labels):
    with pytest.raises(ConfigError, match="labels must be"):
        partition_dirichlet(labels, 2, alpha=1.0)
    with pytest.raises(ConfigError, match="labels must be"):
        partition_shards(labels, 2, classes_per_client=1)


@pytest.mark.parametrize(("num_clients", "per_client"), [(20, 2), (10, 5), (7, 3), (4, 10)])
def test_shards_exact_classes_per_client(num_clients, per_client):
    labels = np.repeat(np.arange(10), 60) + 100
    ids = partition_shards(labels, num_clients, classes_per_client=per_client, seed=2)
    assert ids.dtype == np.int64 and ids.shape == labels.shape
    assert ids.min() >= -1 and ids.max() < num_clients
    for c in range(num_clients):
        assert np.unique(labels[ids == c]).size == per_client
    holders = [np.unique(ids[(labels == k) & (ids >= 0)]).size for k in np.unique(labels)]
    expected = num_clients * per_client / 10
    assert max(holders) - min(holders) <= 1
    assert min(holders) <= expected <= max(holders)
    if num_clients * per_client >= 10:
        assert (ids >= 0).all()
    np.testing.assert_array_equal(
        partition_shards(labels, num_clients, classes_per_client=per_client, seed=2), ids
    )


def test_shards_split_each_class_evenly():
    labels = np.repeat(np.arange(4), 30)
    ids = partition_shards(labels, 8, classes_per_client=2, seed=0)
    for k in range(4):
        counts = np.bincount(ids[labels == k])
        counts = counts[counts > 0]
        assert counts.size == 4 and counts.max() - counts.min() <= 1


def test_shards_uncovered_classes_are_unassigned():
    labels = np.repeat(np.arange(10), 5)
    ids = partition_shards(labels, 2, classes_per_client=3, seed=1)
    assert np.unique(labels[ids == -1]).size == 4
    assert (ids == -1).sum() == 20


def test_shards_sizes_respected():
    labels = np.repeat(np.arange(10), 50)
    sizes = [5, 17, 1, 40, 25]
    ids = partition_shards(labels, 5, classes_per_client=2, seed=3, sizes=sizes)
    np.testing.assert_array_equal(np.bincount(ids[ids >= 0], minlength=5), sizes)
    assert (ids == -1).sum() == labels.size - sum(sizes)
    full = partition_shards(labels, 5, classes_per_client=2, seed=3)
    for c in range(5):
        assert set(np.unique(labels[ids == c])) <= set(np.unique(labels[full == c]))


@pytest.mark.parametrize(
    ("num_clients", "kwargs", "match"),
    [
        (5, {"classes_per_client": 4}, r"exceeds the 3 classes"),
        (5, {"classes_per_client": 0}, r"classes_per_client must be >= 1"),
        (5, {"classes_per_client": 1, "sizes": [1, 2]}, r"sizes has 2 entries"),
        (5, {"classes_per_client": 1, "sizes": [1, 1, 1, 1, 0]}, r"sizes\[4\] must be >= 1"),
        (
            5,
            {"classes_per_client": 1, "sizes": [1, 1, 1, 1, 100]},
            r"client 4 has \d+ items .* sizes\[4\]=100",
        ),
        (20, {"classes_per_client": 3}, r"class \d has 10 items but is held by \d+ clients"),
    ],
)
def test_shards_invalid(num_clients, kwargs, match):
    labels = np.repeat(np.arange(3), 10)
    with pytest.raises(ConfigError, match=match):
        partition_shards(labels, num_clients, **kwargs)


def test_partition_feeds_from_pooled():
    labels = np.repeat(np.arange(5), 20)
    x = np.arange(100.0)[:, None]
    ids = partition_shards(labels, 4, classes_per_client=2, seed=0, sizes=[10, 20, 5, 15])
    data = FederatedData.from_pooled({"x": x, "label": labels}, ids, num_clients=4)
    np.testing.assert_array_equal(data.sizes, [10, 20, 5, 15])
    for c in range(4):
        np.testing.assert_array_equal(data.client(c)["x"][:, 0], np.flatnonzero(ids == c))


# --- property tests ----------------------------------------------------------------------------

_sizes = st.lists(st.integers(1, 6), min_size=1, max_size=5)
_trailing = st.sampled_from([(), (1,), (3,), (2, 2)])
_PROPS = settings(max_examples=40, deadline=None)


@_PROPS
@given(sizes=_sizes, trailing=_trailing, seed=st.integers(0, 2**16))
def test_property_valid_ragged_round_trips(sizes, trailing, seed):
    raw = _ragged(sizes, seed)
    rng = np.random.default_rng(seed)
    raw["z"] = [rng.normal(size=(n, *trailing)) for n in sizes]
    data = FederatedData(raw)
    np.testing.assert_array_equal(data.sizes, sizes)
    assert data.padded["z"].shape == (len(sizes), max(sizes), *trailing)
    mask = np.asarray(data.mask)
    for i, n in enumerate(sizes):
        client = data.client(i)
        for key in raw:
            np.testing.assert_array_equal(client[key], raw[key][i])
            padded = np.asarray(data.padded[key][i])
            np.testing.assert_array_equal(padded[:n], raw[key][i])
            assert (padded[n:] == raw[key][i][-1]).all()
        assert mask[i].sum() == n
    ids = data.pooled_client_ids()
    again = FederatedData.from_pooled(data.pooled(), ids)
    for key in raw:
        np.testing.assert_array_equal(again.padded[key], data.padded[key])


@_PROPS
@given(sizes=_sizes, data=st.data(), bad=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_property_nonfinite_always_raises(sizes, data, bad):
    raw = _ragged(sizes)
    i = data.draw(st.integers(0, len(sizes) - 1))
    row = data.draw(st.integers(0, sizes[i] - 1))
    raw["x"][i][row, data.draw(st.integers(0, 2))] = bad
    with pytest.raises(DataError, match=rf"key 'x', client {i}: 1 NaN/inf"):
        FederatedData(raw)


@_PROPS
@given(sizes=_sizes, data=st.data(), delta=st.sampled_from([-1, 1, 2]))
def test_property_mismatched_leading_length_raises(sizes, data, delta):
    raw = _ragged(sizes)
    i = data.draw(st.integers(0, len(sizes) - 1))
    raw["y"][i] = np.zeros(sizes[i] + delta, dtype=np.int64)
    match = rf"client {i}: 'x' has {sizes[i]} rows but 'y' has {sizes[i] + delta};"
    with pytest.raises(DataError, match=match):
        FederatedData(raw)


@_PROPS
@given(sizes=_sizes, data=st.data())
def test_property_empty_client_raises(sizes, data):
    raw = _ragged(sizes)
    i = data.draw(st.integers(0, len(sizes)))
    for key in raw:
        raw[key].insert(i, raw[key][0][:0])
    with pytest.raises(DataError, match=rf"client {i} has 0 rows"):
        FederatedData(raw)


def test_a_padded_client_on_the_host_is_its_row_of_the_padded_arrays() -> None:
    rng = np.random.default_rng(0)
    data = FederatedData({"x": [rng.normal(size=(n, 3)) for n in (2, 5, 4)], "y": [rng.normal(size=n) for n in (2, 5, 4)]})
    for i in range(3):
        got = data.padded_client(i)
        for key, value in data.padded.items():
            assert got[key].dtype == value.dtype
            np.testing.assert_array_equal(got[key], np.asarray(value[i]))


def test_one_cast_of_every_client_equals_the_cast_client_by_client() -> None:
    """Clients of one dtype per key are cast and checked as one pooled array (``data._cast_pooled``); clients of
    mixed dtypes, or a value to refuse or warn about, are cast client by client. Both give the same arrays, and
    neither keeps a view of the caller's arrays."""
    rng = np.random.default_rng(3)
    sizes = (3, 1, 5, 2)
    xs = [rng.normal(size=(n, 2)).astype(np.float32).astype(np.float64) for n in sizes]  # exact in float32
    ys = [rng.integers(-9, 9, size=n) for n in sizes]
    pooled = FederatedData({"x": xs, "y": ys})
    # one client's floats as float32 and one's integers as int16: the dtypes differ, so client by client
    mixed = FederatedData({"x": [xs[0].astype(np.float32), *xs[1:]], "y": [ys[0].astype(np.int16), *ys[1:]]})
    for key in ("x", "y"):
        np.testing.assert_array_equal(np.asarray(pooled.padded[key]), np.asarray(mixed.padded[key]))
        assert pooled.padded[key].dtype == mixed.padded[key].dtype
        for i in range(len(sizes)):
            np.testing.assert_array_equal(pooled.client(i)[key], mixed.client(i)[key])
    np.testing.assert_array_equal(pooled.pooled()["x"], np.concatenate(xs).astype(pooled.padded["x"].dtype))
    before = np.asarray(pooled.padded["x"]).copy()
    xs[2][:] = 99.0  # the caller's arrays change afterwards: the data do not
    np.testing.assert_array_equal(np.asarray(pooled.padded["x"]), before)
    assert not (pooled.client(2)["x"] == 99.0).any()


def test_row_count_errors_name_the_first_client_with_a_problem_and_its_first_key() -> None:
    """Row counts are checked for every client at once; the message is the one a check client by client, key by
    key, finds first (a mismatch of a later key of an earlier client before one of an earlier key of a later
    client; a client with 0 rows before a later mismatch)."""
    one = [np.ones(1)] * 3
    with pytest.raises(DataError, match=r"^client 1: 'x' has 1 rows but 'z' has 2"):
        FederatedData({"x": one, "y": [np.ones(1), np.ones(1), np.ones(2)], "z": [np.ones(1), np.ones(2), np.ones(1)]})
    with pytest.raises(DataError, match=r"^client 0 has 0 rows"):
        FederatedData({"x": [np.ones(0), np.ones(2)], "y": [np.ones(0), np.ones(3)]})


def test_padding_in_blocks_of_clients_equals_one_block(monkeypatch) -> None:
    """The padded arrays are gathered a block of clients at a time (``data.GATHER_ENTRIES`` index entries):
    blocks of one or two clients give the arrays of one block."""
    import fedbayes.data as data_module

    raw = _ragged([4, 1, 6, 2, 3, 5, 1])
    whole = FederatedData(raw)
    monkeypatch.setattr(data_module, "GATHER_ENTRIES", 7)  # max_size 6: one client per block
    small = FederatedData(raw)
    for key in raw:
        np.testing.assert_array_equal(np.asarray(small.padded[key]), np.asarray(whole.padded[key]))
    np.testing.assert_array_equal(np.asarray(small.mask), np.asarray(whole.mask))


def test_from_dataframe_keeps_its_column_names_through_subset_blank_and_pickle():
    import pickle

    import pandas as pd

    df = pd.DataFrame({"site": ["b", "a", "b"], "one": 1.0, "t": [0.1, 0.2, 0.3], "y": [1.0, 2.0, 3.0]})
    data = FederatedData.from_dataframe(df, "site", {"x": ["one", "t"], "y": "y"})
    assert data.client_column == "site" and data.column_names == {"x": ("one", "t"), "y": ("y",)}
    for other in (data.subset([1]), data.blank(), pickle.loads(pickle.dumps(data))):
        assert other.client_column == "site" and other.column_names == data.column_names
    plain = FederatedData({"y": [np.zeros(2)]})
    assert plain.client_column is None and plain.column_names == {}
