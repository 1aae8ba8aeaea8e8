"""Regression tests of issue 20 ("deep crashes from fuzzed input"), one per reported crash, and the
fuzzing of the data domain (FederatedData, from_pooled, checkpoint files; see tests/fuzz_harness.py):
malformed input ends in a documented fb.FedbayesError raised before any computation, or in a correct
result (exactly the input, or a warning where precision is lost)."""

from __future__ import annotations

import errno
import io
import os
import tracemalloc
import warnings
import zipfile

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fedbayes as fb
from fedbayes import checkpoint as checkpoint_io
from fedbayes.seeds import seed_key
from fedbayes.errors import (CallbackError, CheckpointWarning, ClientIndexError, ConfigError, DataError,
                             PrecisionWarning)
from fuzz_harness import classify, fuzz_settings


def gauss(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("obs", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def small_data() -> fb.FederatedData:
    return fb.FederatedData({"y": [np.arange(3.0), np.arange(2.0) + 1.0, np.ones(4)]})


FIT = dict(num_rounds=20, chunk_size=5)


def lmc() -> fb.LMC:
    return fb.LMC(step_size=0.05, num_chains=2)


def same_fit(a: fb.Result, b: fb.Result) -> None:
    np.testing.assert_array_equal(a.global_samples["mu"], b.global_samples["mu"])
    for k in a.history:
        if k != "seconds":
            np.testing.assert_array_equal(a.history[k], b.history[k], err_msg=k)


# ------------------------------------------------------------------ 1. zero-size trailing dimensions


@pytest.mark.parametrize("dtype", [np.int64, np.uint8, np.float32, bool])
@pytest.mark.parametrize("trailing", [(0,), (3, 0)])
def test_zero_size_trailing_dimension_is_kept(dtype, trailing):
    raw = [np.zeros((2, *trailing), dtype), np.zeros((1, *trailing), dtype)]
    data = fb.FederatedData({"x": raw})  # was: "zero-size array to reduction operation minimum"
    assert data.padded["x"].shape == (2, 2, *trailing)
    np.testing.assert_array_equal(np.asarray(data.mask), [[True, True], [True, False]])
    for i, a in enumerate(raw):
        assert data.client(i)["x"].shape == a.shape


# ------------------------------------------------------------------ 2. unsigned integers


def test_unsigned_data_is_range_checked_exactly():
    top = np.iinfo(np.int64).max
    data = fb.FederatedData({"x": [np.array([top, 0], np.uint64), np.array([7], np.uint8)]})
    assert data.client(0)["x"].dtype == np.int64
    assert data.client(0)["x"].tolist() == [top, 0] and data.client(1)["x"].tolist() == [7]
    for value in (top + 1, 2**64 - 1):
        with pytest.raises(DataError, match=r"key 'x', client 1: integer values outside the int64 range"):
            fb.FederatedData({"x": [np.zeros(1, np.int64), np.array([3, value], np.uint64)]})


@pytest.mark.parametrize("dtype", [np.uint8, np.uint64, np.int8])
def test_from_pooled_accepts_unsigned_and_small_ids(dtype):
    ids = np.array([1, 0, 1, 2], dtype)
    data = fb.FederatedData.from_pooled({"x": np.arange(4.0)}, ids)
    assert [data.client(c)["x"].tolist() for c in range(3)] == [[1.0], [0.0, 2.0], [3.0]]


def test_from_pooled_num_clients_minus_one_with_unsigned_ids():
    with pytest.raises(DataError, match=r"num_clients=-1 but client_ids contains id 1; pass num_clients >= 2"):
        fb.FederatedData.from_pooled({"x": np.zeros(2)}, np.array([0, 1], np.uint8), num_clients=-1)
    with pytest.raises(DataError, match=r"zero clients"):
        fb.FederatedData.from_pooled({"x": np.zeros(0)}, np.zeros(0, np.uint8), num_clients=-1)


# ------------------------------------------------------------------ 3. huge client ids


@pytest.mark.parametrize(("ids", "num_clients", "first", "missing"), [
    (np.array([0, 2**40]), None, 1, 2**40 - 1),
    (np.array([0, 2**64 - 1], np.uint64), None, 1, 2**64 - 2),
    (np.array([0, 1]), 10**15, 2, 10**15 - 2),
])
def test_from_pooled_refuses_absurd_ids_before_allocating(ids, num_clients, first, missing):
    tracemalloc.start()
    try:
        with pytest.raises(DataError) as err:  # was: MemoryError (terabytes), or OverflowError
            fb.FederatedData.from_pooled({"x": np.zeros(2)}, ids, num_clients)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # nothing of size num_clients
    assert str(err.value).startswith(f"client {first} has no rows in client_ids ({missing} of ")
    assert "renumber the clients" in str(err.value)


def test_from_pooled_lists_the_first_empty_clients():
    with pytest.raises(DataError, match=r"^client 1 has no rows in client_ids \(2 of 4 clients have none: 1, 2\)"):
        fb.FederatedData.from_pooled({"x": np.zeros(2)}, [0, 3])
    with pytest.raises(DataError, match=r"\(8 of 9 clients have none: 0, 1, 2, 3, 4, \.\.\.\)"):
        fb.FederatedData.from_pooled({"x": np.zeros(2)}, [8, -1])


# ------------------------------------------------------------------ 4. client indices


@pytest.mark.parametrize("call", [
    lambda d: d.client(1.0), lambda d: d.client("0"), lambda d: d.client(None), lambda d: d.client(True),
    lambda d: d.subset(0), lambda d: d.subset("01"), lambda d: d.subset([0, 1.5]), lambda d: d.subset(np.int64(1)),
])
def test_non_integer_client_indices_are_clear_type_errors(call):
    with pytest.raises(ClientIndexError, match=r"client ind|sequence of client indices") as err:
        call(small_data())
    assert isinstance(err.value, TypeError) and isinstance(err.value, fb.DataError)


@pytest.mark.parametrize("call", [lambda d: d.client(3), lambda d: d.client(-4), lambda d: d.subset([0, 3])])
def test_out_of_range_client_indices_are_index_errors(call):
    with pytest.raises(ClientIndexError, match=r"client index -?\d out of range for 3 clients; use -3..2") as err:
        call(small_data())
    assert isinstance(err.value, IndexError)


def test_subset_accepts_numpy_indices_and_refuses_empty():
    data = small_data()
    sub = data.subset(np.array([2, -3]))
    assert sub.sizes.tolist() == [4, 3] and sub.client(1)["y"].tolist() == [0.0, 1.0, 2.0]
    assert data.client(np.int8(-1))["y"].tolist() == [1.0] * 4
    with pytest.raises(DataError, match="at least one client index"):
        data.subset([])


# ------------------------------------------------------------------ 5. seeds


def test_seed_key_equals_prng_key_wherever_that_is_correct():
    rng = np.random.default_rng(20)
    seeds = [0, 1, 2**31, 2**32 - 1, *rng.integers(0, 2**32, 50).tolist()]
    with jax.enable_x64(False):
        for s in seeds:
            np.testing.assert_array_equal(seed_key(s), jax.random.PRNGKey(s))
            assert seed_key(s).dtype == jax.random.PRNGKey(s).dtype
        assert not np.array_equal(seed_key(5), seed_key(5 + 2**32))  # PRNGKey would give the same key
    for s in [*seeds, 2**32, 2**40 + 3, 2**63 - 1, *rng.integers(0, 2**63, 50).tolist()]:
        np.testing.assert_array_equal(seed_key(s), jax.random.PRNGKey(s))
    np.testing.assert_array_equal(seed_key(2**64 - 1), [2**32 - 1, 2**32 - 1])


@pytest.mark.parametrize("seed", [2**64, -1, 2**70, 1.0, True, "1"])
def test_seeds_outside_0_to_2_64_are_config_errors(seed):
    with pytest.raises(ConfigError, match="seed must be"):  # 2**64 was an OverflowError deep in JAX
        fb.fed_fit(gauss, small_data(), lmc(), seed=seed, **FIT)


def test_fits_of_seeds_2_32_apart_differ_and_small_seeds_are_unchanged(monkeypatch):
    with jax.enable_x64(False):  # where PRNGKey keeps the low 32 bits of a seed
        data = small_data()
        a = fb.fed_fit(gauss, data, lmc(), seed=3, **FIT)
        # 3 modulo 2**32, and above 2**63 (an OverflowError in PRNGKey under x64)
        b = fb.fed_fit(gauss, data, lmc(), seed=2**64 - 2**32 + 3, **FIT)
        assert np.all(np.isfinite(b.global_samples["mu"]))
        assert not np.array_equal(a.global_samples["mu"], b.global_samples["mu"])
        monkeypatch.setattr(fb.api, "seed_key", jax.random.PRNGKey)  # the key of earlier versions
        same_fit(fb.fed_fit(gauss, data, lmc(), seed=3, **FIT), a)


# ------------------------------------------------------------------ 6. masked arrays and pandas


def test_masked_entries_are_refused_and_unmasked_arrays_accepted():
    with pytest.raises(DataError, match=r"key 'x', client 1: masked array with 2 masked entries.*filled"):
        fb.FederatedData({"x": [np.zeros(2), np.ma.masked_array([1.0, 2.0, 3.0], mask=[1, 0, 1])]})
    data = fb.FederatedData({"x": [np.ma.masked_array([[1, 2]], mask=False)]})
    assert data.client(0)["x"].tolist() == [[1, 2]]
    with pytest.raises(DataError, match=r"client_ids: masked array with 1 masked"):
        fb.FederatedData.from_pooled({"x": np.zeros(2)}, np.ma.masked_array([0, 1], mask=[0, 1]))
    with pytest.raises(DataError, match=r"pooled key 'x': masked array"):
        fb.FederatedData.from_pooled({"x": np.ma.masked_invalid([1.0, np.nan])}, [0, 0])


@pytest.mark.parametrize(("series", "expected"), [
    (pd.Series([1.5, 2.0]), [1.5, 2.0]),
    (pd.Series([1, 2**62], dtype="Int64"), [1, 2**62]),
    (pd.Series([True, False], dtype="boolean"), [True, False]),
    (pd.Series([0.25, 2.0], dtype="Float64"), [0.25, 2.0]),
    (pd.Series([3, 4], dtype="UInt8"), [3, 4]),
])
def test_numeric_pandas_columns_are_accepted_exactly(series, expected):
    assert fb.FederatedData({"x": [series]}).client(0)["x"].tolist() == expected


def test_pandas_arrays_and_jax_small_types_are_converted_exactly():
    import ml_dtypes

    data = fb.FederatedData({"x": [pd.array([1, 2], dtype="Int64"), pd.Categorical([3, 4])],
                             "f": [jax.numpy.array([1.5, -0.25], jax.numpy.bfloat16),
                                   np.array([2.0, 448.0], ml_dtypes.float8_e4m3fn)],
                             "i": [np.array([-8, 7], ml_dtypes.int4), np.array([15, 0], ml_dtypes.uint4)]})
    assert [data.client(c)["x"].tolist() for c in (0, 1)] == [[1, 2], [3, 4]]
    assert [data.client(c)["f"].tolist() for c in (0, 1)] == [[1.5, -0.25], [2.0, 448.0]]
    assert [data.client(c)["i"].tolist() for c in (0, 1)] == [[-8, 7], [15, 0]]
    with pytest.raises(DataError, match=r"1 missing values .* in a pandas IntegerArray"):
        fb.FederatedData({"x": [pd.array([1, None], dtype="Int64")]})


@pytest.mark.parametrize("series", [
    pd.Series([1, None], dtype="Int64"), pd.Series([True, None], dtype="boolean"),
    pd.Series([1.0, None], dtype="Float64"), pd.Series([1.0, np.nan]), pd.Series([pd.NA, 1], dtype=object),
])
def test_missing_pandas_values_are_refused_with_advice(series):
    with pytest.raises(DataError, match=r"key 'x', client 0: 1 missing values \(pd.NA, NaN or None\).*dropna"):
        fb.FederatedData({"x": [series]})


def test_dataframes_pooled_and_per_client():
    df = pd.DataFrame({"x": pd.array([1, 2, 3], dtype="Int64"), "w": [0.5, 1.5, 2.5]})
    data = fb.FederatedData.from_pooled(df, pd.Series([1, 0, 1]))
    assert data.keys == ("x", "w")
    assert data.client(1)["x"].tolist() == [1, 3] and data.client(0)["w"].tolist() == [1.5]
    per_client = fb.FederatedData({"xw": [df, df.iloc[:1]]})  # nullable Int64 and float64 columns
    assert per_client.client(0)["xw"].tolist() == [[1.0, 0.5], [2.0, 1.5], [3.0, 2.5]]
    with pytest.raises(DataError, match=r"duplicate column names \['a'\]"):
        fb.FederatedData.from_pooled(pd.DataFrame([[1, 2]], columns=["a", "a"]), [0])
    with pytest.raises(DataError, match=r"key 'x', client 0, column 'b': dtype object is not numeric"):
        fb.FederatedData({"x": [pd.DataFrame({"a": [1], "b": ["s"]})]})
    with pytest.raises(DataError, match=r"pooled key 'x': 1 missing values"):
        fb.FederatedData.from_pooled(pd.DataFrame({"x": [1.0, None]}), [0, 0])
    with pytest.raises(DataError, match=r"client_ids: 1 missing values"):
        fb.FederatedData.from_pooled({"x": np.zeros(2)}, pd.Series([0, None], dtype="Int64"))


# ------------------------------------------------------------------ 7. integers rounded to float


@pytest.mark.parametrize(("x64", "exact", "rounded"), [(False, 2**24, 2**24 + 1), (True, 2**53, 2**53 + 1)])
def test_integers_rounded_by_float_promotion_warn(x64, exact, rounded):
    dtype = np.float64 if x64 else np.float32
    with jax.enable_x64(x64):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # exact: no warning
            data = fb.FederatedData({"x": [np.array([exact, -exact, 2 * exact]), np.array([0.5])]})
        assert data.client(0)["x"].tolist() == [exact, -exact, 2 * exact]
        with pytest.warns(PrecisionWarning, match=rf"key 'x', client 1: 2 integer values are not exactly "
                          rf"representable as {np.dtype(dtype)} and were rounded \(e.g. {rounded} -> {exact}\)") as rec:
            data = fb.FederatedData({"x": [np.array([0.5]), np.array([rounded, 3, -rounded])]})
        warning = next(w for w in rec if w.category is PrecisionWarning)
        assert warning.filename == __file__  # the warning names the caller's line
        assert data.client(1)["x"].tolist() == [exact, 3, -exact] == np.array([rounded, 3, -rounded], dtype).tolist()
        assert ("jax_enable_x64" in str(warning.message)) == (not x64)


def test_uint64_extremes_rounded_to_float64_warn():
    with pytest.warns(PrecisionWarning, match=r"e.g. 18446744073709551615 -> 18446744073709551616"):
        data = fb.FederatedData({"x": [np.array([2**64 - 1], np.uint64), np.array([0.5])]})
    assert data.client(0)["x"].tolist() == [2.0**64]


# ------------------------------------------------------------------ 8. a failing callback


def test_a_failing_callback_is_named_and_the_checkpoint_kept(tmp_path):
    path = tmp_path / "fit.ckpt"

    def callback(done, history):
        if done == 10:
            raise ZeroDivisionError("user bug")

    with pytest.raises(CallbackError, match=r"the callback failed after round 10 of 20 \(ZeroDivisionError: user "
                       rf"bug\); the fit is stopped. The checkpoint '{path}' holds round 10; fb.resume") as err:
        fb.fed_fit(gauss, small_data(), lmc(), checkpoint=path, callback=callback, **FIT)
    assert err.value.round == 10 and isinstance(err.value.__cause__, ZeroDivisionError)
    assert isinstance(err.value, fb.FedbayesError) and isinstance(err.value, RuntimeError)
    same_fit(fb.resume(path), fb.fed_fit(gauss, small_data(), lmc(), **FIT))
    with pytest.raises(CallbackError, match=r"after round 5 of 20 \(KeyError: 'k'\); the fit is stopped. Fix"):
        fb.fed_fit(gauss, small_data(), lmc(), callback=lambda done, h: {}["k"], **FIT)


# ------------------------------------------------------------------ 9. corrupted checkpoints


def saved_checkpoint(path) -> bytes:
    meta = {"algorithm": "A", "num_rounds": 4, "seed": 1, "versions": {}, "round": 2, "init_digest": "d",
            "plain": {"clients_per_round": None, "chunk_size": 2, "faults": None, "fault_policy": None},
            "fingerprints": {"model": "m", "data": "d", "options": "o"}}
    checkpoint_io.save(path, meta, b"", {"a": np.arange(40.0), "b": np.int32(3)}, {"loss": np.linspace(0, 1, 30)})
    return path.read_bytes()


def same_checkpoint(ck, ref) -> bool:
    return (ck.meta == ref.meta and ck.spec == ref.spec and len(ck.leaves) == len(ref.leaves)
            and all(np.array_equal(a, b) for a, b in zip(ck.leaves, ref.leaves))
            and ck.history.keys() == ref.history.keys()
            and all(np.array_equal(ck.history[k], ref.history[k]) for k in ck.history))


def rezip(raw: bytes, change) -> bytes:
    """The archive with its members passed through ``change(name, data) -> (name, data)``."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            name, data = change(info.filename, src.read(info))
            if name is not None:
                dst.writestr(name, data)
    return out.getvalue()


def test_zip_level_corruptions_are_checkpoint_errors(tmp_path):
    path = tmp_path / "fit.ckpt"
    raw = saved_checkpoint(path)
    at = raw.index(b"PK\x01\x02") + 10  # the compression method of the first member: 99
    unknown = raw[:at] + b"\x63\x00" + raw[at + 2:]
    npy = io.BytesIO()
    np.save(npy, np.arange(3))
    bad = {
        "unknown compression": unknown,  # was: NotImplementedError from zipfile
        "truncated": raw[: len(raw) // 2], "empty": b"", "random": np.random.default_rng(0).bytes(500),
        "a .npy": npy.getvalue(), "a pickle": b"\x80\x04K\x01.",
        "member dropped": rezip(raw, lambda n, d: (None if n == "meta.npy" else n, d)),
        "member renamed": rezip(raw, lambda n, d: ("other.npy" if n == "spec.npy" else n, d)),
    }
    for what, content in bad.items():
        path.write_bytes(content)
        with pytest.raises(fb.CheckpointError, match="corrupted|integrity|incomplete"):
            checkpoint_io.load(path)
        with pytest.raises(fb.CheckpointError):
            fb.resume(path)
    with pytest.raises(fb.CheckpointError, match="cannot be read"):
        checkpoint_io.load(tmp_path)  # a directory
    with pytest.raises(ConfigError, match="checkpoint path must be"):
        fb.resume(123)


@pytest.mark.parametrize(("change", "match"), [
    (lambda meta: b"\xff\xfe", "unreadable metadata"),
    (lambda meta: b"[1, 2]", "has format None"),
    (lambda meta: meta.replace(b'"round": 2', b'"round": "2"'), "'round' is missing or not of type int"),
    (lambda meta: meta.replace(b'"chunk_size": 2, ', b""), r"'plain' lacks \['chunk_size'\]"),
    (lambda meta: meta.replace(b'"weak": [false, false]', b'"weak": [false]'), "1 state flags for 2 state arrays"),
    (lambda meta: meta.replace(b'"faults": null', b'"faults": 3'), "fault settings are not dicts"),
])
def test_well_formed_files_with_bad_metadata_are_refused(tmp_path, change, match):
    """A file whose digest was recomputed (not corruption: a foreign or hand-edited file) is checked too."""
    path = tmp_path / "fit.ckpt"
    with np.load(io.BytesIO(saved_checkpoint(path))) as z:
        entries = {k: z[k] for k in z.files}
    entries.pop("digest")
    entries["meta"] = np.frombuffer(change(entries["meta"].tobytes()), np.uint8)
    entries["digest"] = np.frombuffer(checkpoint_io._entries_digest(entries).encode(), np.uint8)
    np.savez(path, **entries)
    os.replace(str(path) + ".npz", path)
    with pytest.raises(fb.CheckpointError, match=match):
        checkpoint_io.load(path)


@fuzz_settings(150)
@given(data=st.data())
def test_fuzzed_checkpoint_bytes_are_refused_or_read_unchanged(tmp_path_factory, data):
    directory = tmp_path_factory.mktemp("ck")
    raw = saved_checkpoint(directory / "good.ckpt")
    ref = checkpoint_io.load(directory / "good.ckpt")
    kind = data.draw(st.sampled_from(["flip", "truncate", "overwrite"]))
    at = data.draw(st.integers(0, len(raw) - 1))
    if kind == "flip":
        bad = raw[:at] + bytes([raw[at] ^ data.draw(st.integers(1, 255))]) + raw[at + 1:]
    elif kind == "truncate":
        bad = raw[:at]
    else:
        chunk = data.draw(st.binary(min_size=1, max_size=16))
        bad = raw[:at] + chunk + raw[at + len(chunk):]
    path = directory / "bad.ckpt"
    path.write_bytes(bad)
    outcome, ck = classify("checkpoint file", checkpoint_io.load, path)
    if outcome == "success":
        assert same_checkpoint(ck, ref)  # an ignored byte (a timestamp, say): the content is intact


# ------------------------------------------------------------------ 10. a full or read-only disk


class FullDisk:
    """A file whose writes fail with ENOSPC once ``room`` bytes are written."""

    def __init__(self, f, room):
        self._f, self._room = f, room

    def write(self, b):
        if self._room < len(b):
            self._f.write(bytes(b)[: self._room])
            self._room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(b)
        return self._f.write(b)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("failure", ["full", "read-only file system", "no permission", "rename"])
def test_a_failed_write_is_a_checkpoint_error_and_keeps_the_previous_file(tmp_path, monkeypatch, failure):
    path = tmp_path / "fit.ckpt"
    good = saved_checkpoint(path)
    if failure == "full":
        monkeypatch.setattr(checkpoint_io, "open", lambda p, mode: FullDisk(open(p, mode), 300), raising=False)
    elif failure == "rename":
        def replace(src, dst):
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

        monkeypatch.setattr(checkpoint_io.os, "replace", replace)
    else:
        code = errno.EROFS if failure.startswith("read-only") else errno.EACCES

        def refuse(p, mode):
            raise OSError(code, os.strerror(code), p)

        monkeypatch.setattr(checkpoint_io, "open", refuse, raising=False)
    with pytest.raises(fb.CheckpointError, match=rf"cannot write the checkpoint '{path}' \(\w+Error: .*\); the "
                       "previous checkpoint there, if any, is unchanged") as err:
        saved_checkpoint(path)
    assert isinstance(err.value.__cause__, OSError)
    monkeypatch.undo()
    assert path.read_bytes() == good and os.listdir(tmp_path) == ["fit.ckpt"]  # no temporary file left


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_directory_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "fit.ckpt"
    good = saved_checkpoint(path)
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(fb.CheckpointError, match="PermissionError"):
            saved_checkpoint(path)
    finally:
        tmp_path.chmod(0o700)
    assert path.read_bytes() == good


def test_a_fit_outlives_a_full_disk_with_a_warning(tmp_path, monkeypatch):
    path = tmp_path / "fit.ckpt"
    real_save, seen = checkpoint_io.save, []

    def save(p, meta, *args):
        if meta["round"] in (10, 15):
            raise fb.CheckpointError(f"cannot write the checkpoint {os.fspath(p)!r} (OSError: disk full)")
        real_save(p, meta, *args)

    monkeypatch.setattr(checkpoint_io, "save", save)
    with pytest.warns(CheckpointWarning, match=r"disk full\). The fit goes on in memory \(round 1[05] of 20\) and "
                      "tries to write the checkpoint again after the next chunk") as rec:
        res = fb.fed_fit(gauss, small_data(), lmc(), checkpoint=path,
                         callback=lambda done, h: seen.append(checkpoint_io.info(path)["round"]), **FIT)
    assert len([w for w in rec if w.category is CheckpointWarning]) == 2
    assert seen == [5, 5, 5, 5]  # rounds 10 and 15 were not written; round 20 ends the fit
    same_fit(res, fb.fed_fit(gauss, small_data(), lmc(), **FIT))


# ------------------------------------------------------------------ fuzzing FederatedData

NUMERIC = ["bool", "int8", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64"]
DTYPES = NUMERIC * 3 + ["object", "complex64", "<U2", "datetime64[s]"]  # mostly numeric: many are accepted
TRAILING = st.sampled_from([(), (0,), (2,), (1, 3), (2, 0)])
ROWS = st.sampled_from([1, 2, 3, 4, 0])  # 0: an empty client


@st.composite
def client_arrays(draw, dtype, trailing, rows=None):
    shape = (draw(ROWS) if rows is None else rows, *trailing)
    if dtype == "object":
        array = np.array(draw(st.lists(st.sampled_from([1, 2.5, None, "a", pd.NA]), min_size=int(np.prod(shape)),
                                       max_size=int(np.prod(shape)))), dtype=object).reshape(shape)
    else:
        dt = np.dtype(dtype)
        elements = None
        if dt.kind == "f":
            elements = st.floats(width=dt.itemsize * 8, allow_nan=True, allow_infinity=True)
        array = draw(hnp.arrays(dt, shape, elements=elements))
        if dt.kind == "f" and draw(st.booleans()):  # mostly finite, so that some are accepted
            array = np.where(np.isfinite(array), array, 1.5).astype(dt)
    form = draw(st.sampled_from(["array", "masked", "list", "series"]))
    if form == "masked":
        return np.ma.masked_array(array, mask=draw(hnp.arrays(bool, shape)) & draw(st.booleans()))
    if form == "list":
        return array.tolist()
    if form == "series" and array.ndim == 1 and dtype not in ("float16", "datetime64[s]", "<U2"):
        return pd.Series(array)
    return array


@st.composite
def federated_inputs(draw):
    """Keys of one dtype and trailing shape, one array per client of the client's size; now and then a
    client of another dtype, trailing shape or size (ragged or mismatched input)."""
    clients = {}
    sizes = draw(st.lists(ROWS, min_size=1, max_size=3))
    sometimes = st.integers(0, 5).map(lambda v: v == 0)
    for key in draw(st.lists(st.sampled_from(["x", "y"]), min_size=1, max_size=2, unique=True)):
        dtype, trailing = draw(st.sampled_from(DTYPES)), draw(TRAILING)
        clients[key] = [draw(client_arrays(draw(st.sampled_from(DTYPES)) if draw(sometimes) else dtype,
                                           draw(TRAILING) if draw(sometimes) else trailing,
                                           None if draw(sometimes) else n))
                        for n in sizes]
    return clients


def plain(value) -> np.ndarray:
    """What the user meant by ``value``: its entries as a NumPy array (masked entries as given)."""
    if isinstance(value, np.ma.MaskedArray):
        return np.ma.getdata(value)
    return np.asarray(value)


def check_exact(data: fb.FederatedData, given: dict[str, list], rounded: bool) -> None:
    """The object holds exactly the input: sizes, mask, padding and every client's arrays."""
    sizes = [len(plain(a)) for a in next(iter(given.values()))]
    assert data.sizes.tolist() == sizes and np.all(data.sizes >= 1)
    mask = np.asarray(data.mask)
    assert mask.tolist() == [[j < n for j in range(max(sizes))] for n in sizes]
    for key, arrays in given.items():
        padded = np.asarray(data.padded[key])
        for i, value in enumerate(arrays):
            src, out = plain(value), data.client(i)[key]
            assert not isinstance(value, np.ma.MaskedArray) or not np.ma.getmaskarray(value).any()
            assert out.shape == src.shape and out.dtype == padded.dtype
            assert out.dtype.kind != "f" or np.all(np.isfinite(out))
            np.testing.assert_array_equal(out, src.astype(out.dtype))
            if not rounded:  # the values themselves, compared as Python numbers
                assert out.astype(object).tolist() == src.astype(object).tolist()
            np.testing.assert_array_equal(padded[i, :len(out)], out)
            assert (padded[i, len(out):] == out[-1]).all()


@fuzz_settings(250)
@given(clients=federated_inputs())
def test_fuzzed_federated_data_is_refused_or_exact(clients):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outcome, data = classify("FederatedData", fb.FederatedData, clients)
    if outcome == "success":
        check_exact(data, clients, rounded=any(w.category is PrecisionWarning for w in caught))


ID_VALUES = [0, 1, 2, -1, -2, 255, 2**40, 2**64 - 1]


@fuzz_settings(150)
@given(data=st.data())
def test_fuzzed_from_pooled_is_refused_or_exact(data):
    x = data.draw(client_arrays(data.draw(st.sampled_from(DTYPES)), data.draw(TRAILING)))
    n = len(plain(x))
    ids_dtype = np.dtype(data.draw(st.sampled_from(["int8", "int64", "uint8", "uint64", "float64", "bool"])))
    values = ([v for v in ID_VALUES if np.iinfo(ids_dtype).min <= v <= np.iinfo(ids_dtype).max]
              if ids_dtype.kind in "iu" else [0, 1])
    ids = data.draw(hnp.arrays(ids_dtype, data.draw(st.sampled_from([n, n + 1, (n, 1)])),
                               elements=st.sampled_from(values)))
    num_clients = data.draw(st.one_of(st.none(), st.integers(-2, 4), st.just(10**12), st.just(1.0)))
    outcome, fed = classify("from_pooled", fb.FederatedData.from_pooled, {"x": x}, ids, num_clients)
    if outcome == "error":
        return
    assert not isinstance(x, np.ma.MaskedArray) or not np.ma.getmaskarray(x).any()
    expected = int(ids.max()) + 1 if num_clients is None else num_clients
    assert fed.num_clients == expected
    check_exact(fed, {"x": [plain(x)[ids == c] for c in range(expected)]}, rounded=False)
