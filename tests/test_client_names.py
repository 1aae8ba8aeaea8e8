"""Tests of client names: FederatedData.from_dataframe, client_names / client_index, and the ArviZ
``client`` coordinate of a fit."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

import fedbayes as fb
from fedbayes.data import FederatedData
from fedbayes.errors import ClientIndexError, DataError


def _assert_same(got: FederatedData, expected: FederatedData) -> None:
    assert got.keys == expected.keys
    np.testing.assert_array_equal(got.sizes, expected.sizes)
    np.testing.assert_array_equal(np.asarray(got.mask), np.asarray(expected.mask))
    for key in expected.keys:
        assert got.padded[key].dtype == expected.padded[key].dtype
        np.testing.assert_array_equal(np.asarray(got.padded[key]), np.asarray(expected.padded[key]))


def _small_frame() -> pd.DataFrame:
    return pd.DataFrame({
        "county": [30, 10, 30, 20, 10, 30],
        "days": [0, 1, 2, 3, 4, 5],
        "age": [20.0, 21.0, 22.0, 23.0, 24.0, 25.0],
        "reaction": [0.5, 1.5, 2.5, 3.5, 4.5, 5.5],
    })


# --- from_dataframe ---------------------------------------------------------------------------


def test_from_dataframe_grunfeld_equals_from_pooled():
    """A real panel data set shipped with statsmodels (11 firms x 20 years, no network)."""
    grunfeld = pytest.importorskip("statsmodels.datasets.grunfeld")
    df = grunfeld.load_pandas().data
    got = FederatedData.from_dataframe(df, client="firm", columns={"x": ["value", "capital"], "y": "invest"})
    names, codes = np.unique(df["firm"].to_numpy(dtype=str), return_inverse=True)
    expected = FederatedData.from_pooled(
        {"x": df[["value", "capital"]].to_numpy(), "y": df["invest"].to_numpy()}, codes
    )
    _assert_same(got, expected)
    assert got.client_names == tuple(names.tolist())
    assert got.num_clients == 11 and got.sizes.tolist() == [20] * 11
    gm = got.client(got.client_index("General Motors"))
    rows = df[df["firm"] == "General Motors"]
    np.testing.assert_array_equal(gm["y"], rows["invest"].to_numpy().astype(gm["y"].dtype))
    np.testing.assert_array_equal(gm["x"], rows[["value", "capital"]].to_numpy().astype(gm["x"].dtype))


def test_from_dataframe_default_columns_int_ids_sorted_rows_in_order():
    df = _small_frame()
    got = FederatedData.from_dataframe(df, "county")
    assert got.keys == ("days", "age", "reaction")
    assert got.client_names == (10, 20, 30)
    assert all(type(n) is int for n in got.client_names)
    np.testing.assert_array_equal(got.sizes, [2, 1, 3])
    assert got.client(0)["days"].tolist() == [1, 4]
    assert got.client(2)["reaction"].tolist() == [0.5, 2.5, 5.5]
    _assert_same(got, FederatedData.from_pooled(df[["days", "age", "reaction"]], np.array([2, 0, 2, 1, 0, 2])))


def test_from_dataframe_column_list_and_stacked_keys():
    df = _small_frame()
    listed = FederatedData.from_dataframe(df, "county", columns=["reaction"])
    assert listed.keys == ("reaction",)
    stacked = FederatedData.from_dataframe(df, "county", columns={"x": ["days", "age"], "y": "reaction"})
    assert stacked.keys == ("x", "y")
    assert stacked.padded["x"].shape == (3, 3, 2)
    assert stacked.client(1)["x"].tolist() == [[3.0, 23.0]]
    assert stacked.client(2)["y"].tolist() == listed.client(2)["reaction"].tolist() == [0.5, 2.5, 5.5]


def test_from_dataframe_categorical_ids_follow_category_order_and_drop_unused():
    df = _small_frame().assign(county=pd.Categorical(["z", "x", "z", "y", "x", "z"],
                                                     categories=["z", "unused", "y", "x"]))
    got = FederatedData.from_dataframe(df, "county", columns=["days"])
    assert got.client_names == ("z", "y", "x")
    assert [got.client(i)["days"].tolist() for i in range(3)] == [[0, 2, 5], [3], [1, 4]]


@pytest.mark.parametrize(
    ("frame", "kwargs", "match"),
    [
        (_small_frame(), {"client": "state"}, r"columns \['state'\] are not in the DataFrame"),
        (_small_frame(), {"client": "county", "columns": {"x": ["days", "height"]}},
         r"columns \['height'\] are not in the DataFrame"),
        (_small_frame().assign(county=[1, None, 1, 2, 2, 1]), {"client": "county"},
         r"client column 'county': 1 missing values"),
        (_small_frame().assign(age=[1.0, np.nan, 1.0, 2.0, 2.0, np.nan]), {"client": "county"},
         r"column 'age': 2 missing values"),
        (_small_frame().assign(age=pd.array([1, None, 1, 2, 2, 3], dtype="Int64")),
         {"client": "county", "columns": {"x": ["days", "age"]}}, r"key 'x': 1 missing values"),
        (_small_frame().assign(sex=list("mfmfmf")), {"client": "county"},
         r"column 'sex' has dtype .* not numeric.*fb.from_formula"),
        (_small_frame(), {"client": "county", "columns": []}, r"no data column besides the client column"),
        (_small_frame()[["county"]], {"client": "county"}, r"no data column besides the client column"),
        (_small_frame(), {"client": "county", "columns": "days"}, r"list or dict of column names"),
        (pd.DataFrame([[1, 2.0, 3.0]], columns=["c", "a", "a"]), {"client": "c"}, r"duplicate column names \['a'\]"),
        ({"county": [1], "x": [1.0]}, {"client": "county"}, r"needs a pandas DataFrame; got dict"),
    ],
)
def test_from_dataframe_errors(frame, kwargs, match):
    with pytest.raises(DataError, match=match):
        FederatedData.from_dataframe(frame, **kwargs)


# --- client_names, from_pooled, subset, client_index ----------------------------------------------


def test_default_names_are_positions_and_from_pooled_int_ids_unchanged():
    data = FederatedData({"x": [np.zeros(2), np.ones(3)]})
    assert data.client_names == (0, 1)
    pooled = FederatedData.from_pooled({"x": np.arange(4.0)}, [2, 0, 1, -1])
    assert pooled.client_names == (0, 1, 2)
    assert pooled.client(0)["x"].tolist() == [1.0]


def test_from_pooled_string_ids_become_sorted_names():
    got = FederatedData.from_pooled({"x": np.arange(5.0)}, np.array(["b", "a", "b", "c", "a"]))
    assert got.client_names == ("a", "b", "c")
    _assert_same(got, FederatedData.from_pooled({"x": np.arange(5.0)}, [1, 0, 1, 2, 0]))
    with pytest.raises(DataError, match=r"num_clients is only for integer client_ids"):
        FederatedData.from_pooled({"x": np.arange(2.0)}, ["a", "b"], num_clients=2)


def test_constructor_names_subset_blank_and_client_index():
    data = FederatedData({"x": [np.zeros(1), np.ones(2), np.full(3, 2.0)]}, client_names=["n1", "n2", "n3"])
    assert data.client_names == ("n1", "n2", "n3")
    assert data.client_index("n3") == 2
    sub = data.subset([2, 0])
    assert sub.client_names == ("n3", "n1")
    assert sub.client(sub.client_index("n3"))["x"].tolist() == [2.0, 2.0, 2.0]
    assert data.blank().client_names == ("n1", "n2", "n3")
    with pytest.raises(ClientIndexError, match=r"no client is named 'n4'; the client names are 'n1', 'n2', 'n3'\."):
        data.client_index("n4")
    with pytest.raises(ClientIndexError, match=r"no client is named \[1\]"):
        data.client_index([1])


@pytest.mark.parametrize(
    ("names", "match"),
    [
        (["a"], r"client_names has 1 names but there are 2 clients"),
        (["a", "a"], r"client_names\[0\] and client_names\[1\] are both 'a'"),
        ([["a"], "b"], r"client_names\[0\] = \['a'\] is not hashable"),
        ("ab", r"client_names must be a sequence"),
        (3, r"client_names must be a sequence"),
    ],
)
def test_constructor_names_validation(names, match):
    with pytest.raises(DataError, match=match):
        FederatedData({"x": [np.zeros(1), np.ones(2)]}, client_names=names)


def test_client_coordinate_kinds():
    two = {"x": [np.zeros(1), np.ones(1)]}
    assert FederatedData(two).client_coordinate().tolist() == [0, 1]
    assert FederatedData(two, client_names=["a", "b"]).client_coordinate().dtype.kind == "U"
    mixed = FederatedData(two, client_names=["1", 1]).client_coordinate()
    assert mixed.dtype == object and mixed.tolist() == ["1", 1]


# --- the ArviZ client coordinate ----------------------------------------------------------------


def test_fit_idata_uses_client_names():
    az = pytest.importorskip("arviz")
    rng = np.random.default_rng(0)
    frames = []
    for name, n, shift in [("b", 6, 0.5), ("a", 4, -0.5), ("c", 5, 0.0)]:
        t = rng.normal(size=n)
        frames.append(pd.DataFrame({"site": name, "one": 1.0, "t": t,
                                    "y": 1 + shift - 0.5 * t + 0.3 * rng.normal(size=n)}))
    data = FederatedData.from_dataframe(pd.concat(frames), "site", {"x": ["one", "t"], "z": ["one"], "y": "y"})
    res = fb.fed_fit(fb.models.linear_mixed_effects, data, fb.FedSOUL(num_samples=5, warmup=5), num_rounds=12, seed=0)
    assert res.idata.posterior["b"]["client"].values.tolist() == ["a", "b", "c"]
    assert res.idata.fed_clients["client"].values.tolist() == ["a", "b", "c"]
    assert res.idata.fed_clients["num_observations"].sel(client="b").item() == 6
    assert az.summary(res.idata, var_names=["b"], kind="stats").index.tolist() == ["b[a, 0]", "b[b, 0]", "b[c, 0]"]
    idata = res.extend_idata()
    assert idata.log_likelihood["client"].values.tolist() == ["a"] * 4 + ["b"] * 6 + ["c"] * 5
    loo = fb.diagnostics.loo_per_client(res)
    assert loo.index.tolist() == ["a", "b", "c"] and loo["n"].tolist() == [4, 6, 5]


def test_pickle_keeps_names_and_old_pickles_get_default_names():
    import pickle

    data = FederatedData({"x": [np.zeros(1), np.ones(2)]}, client_names=["a", "b"])
    assert pickle.loads(pickle.dumps(data)).client_names == ("a", "b")
    old = pickle.loads(pickle.dumps(data))
    old.__dict__.pop("_client_names")  # as unpickled from a file written before client names existed
    old.__setstate__(old.__dict__.copy())
    assert old.client_names == (0, 1)
