"""fedbayes.prng.bits against jax.random.bits (the same bits), and its hash against Threefry's known answers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedbayes import prng


def test_threefry_known_answers() -> None:
    # Random123's known-answer vectors for Threefry-2x32 with 20 rounds (key, counter -> output), as in
    # JAX's own tests of its hash: the unrolled hash on NumPy arrays and on JAX arrays.
    cases = [
        ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6B200159, 0x99BA4EFE)),
        ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ]
    for key, count, expected in cases:
        words = [np.asarray([w], np.uint32) for w in (*key, *count)]
        with np.errstate(over="ignore"):
            out = prng.threefry2x32(*words)
        assert (int(out[0][0]), int(out[1][0])) == expected
        out = jax.jit(prng.threefry2x32)(*map(jnp.asarray, words))
        assert (int(out[0][0]), int(out[1][0])) == expected
    # and the primitive JAX itself lowers (jax.extend.random.threefry_2x32) on random words
    rng = np.random.default_rng(0)
    key = rng.integers(0, 2**32, size=2, dtype=np.uint64).astype(np.uint32)
    count = rng.integers(0, 2**32, size=(2, 999), dtype=np.uint64).astype(np.uint32)
    want = np.asarray(jax.extend.random.threefry_2x32(jnp.asarray(key), jnp.asarray(count.reshape(-1))))
    got = np.concatenate([np.asarray(a) for a in prng.threefry2x32(*map(jnp.asarray, (key[0], key[1], *count)))])
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.uint16, jnp.uint32, jnp.uint64])
def test_bits_are_jax_random_bits(dtype) -> None:
    if dtype == jnp.uint64 and not jax.config.jax_enable_x64:
        pytest.skip("uint64 needs jax_enable_x64")
    assert prng._layout_matches()
    shapes = [(), (1,), (7,), (3, 5), (2, 3, 4)]
    for i, shape in enumerate(shapes):
        for key in (jax.random.key(i), jax.random.PRNGKey(i), jax.random.fold_in(jax.random.key(3), i)):
            want = np.asarray(jax.random.bits(key, shape, dtype))
            got = np.asarray(jax.jit(lambda k, s=shape: prng.bits(k, s, dtype))(key))
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
    # a batch of keys under vmap (each client its own key), as the compressors draw
    keys = jax.random.split(jax.random.key(9), 64)
    want = jax.vmap(lambda k: jax.random.bits(k, (50,), dtype))(keys)
    got = jax.jit(jax.vmap(lambda k: prng.bits(k, (50,), dtype)))(keys)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_other_key_implementations_fall_back_to_jax() -> None:
    # rbg keys have no Threefry words: the draws are jax.random.bits' own
    key = jax.random.key(1, impl="rbg")
    assert prng._threefry_words(key) is None
    np.testing.assert_array_equal(np.asarray(prng.bits(key, (6,))), np.asarray(jax.random.bits(key, (6,))))


def _draws(key):
    """Every use of the hash a fit makes: split, fold_in, bits, uniform and normal draws, for a batch of keys (vmap)."""
    keys = jax.random.split(key, 5)
    folded = jax.vmap(lambda k, i: jax.random.fold_in(k, i))(keys, jnp.arange(5))
    normal = jax.vmap(lambda k: jax.random.normal(k, (7,)))(folded)
    return keys, folded, jax.random.bits(key, (3, 4)), jax.random.uniform(key, (9,)), normal


def test_unrolled_hash_lowers_the_same_bits_without_the_loop() -> None:
    key = jax.random.PRNGKey(42)
    rolled = jax.jit(_draws)  # two jitted functions: each keeps the lowering it was first compiled with
    unrolled = jax.jit(lambda k: _draws(k))
    want = rolled(key)
    with prng.unrolled_hash():
        got = unrolled(key)
        text = jax.jit(lambda k: _draws(k)).lower(key).as_text()
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the context changes the lowering where it applies (a CPU: the loop is a while; elsewhere JAX unrolls anyway)
    outside = jax.jit(lambda k: _draws(k)).lower(key).as_text()
    if jax.default_backend() == "cpu":
        assert "stablehlo.while" in outside
    assert "stablehlo.while" not in text
    assert not prng._UNROLLED.get()  # and it ends with its block


@pytest.mark.slow  # two FedSOUL fits compiled from nothing, their final exchange with the Louis terms: 35 s
def test_a_fit_is_the_same_without_the_fast_compilation(monkeypatch) -> None:
    # fed_fit compiles with the unrolled hash and, for what runs once, XLA's optimisation level 0 on a CPU
    # (fedbayes.engine.fit_jit). The random bits are the same (test above); the programs differ, and with them
    # XLA's fusions and LLVM's instruction selection (a multiply-add fused or not), so a fit agrees with the plain
    # compilation to float rounding, not bit for bit: in float64 the differences were 2e-15 (params), 5e-14
    # (local draws) and 3e-10 on information entries of order 1e5, i.e. a few ulps carried through 20 rounds
    # of chains. rtol 1e-10 is 5 orders above that and 6 below any change of the draws themselves. An entry
    # that is a sum of large terms of both signs carries the rounding of those terms, not of itself: on CI's
    # CPU an information entry of -0.47, next to entries of order 10, differed by 9e-11 (rtol 2e-10). So the
    # absolute floor is 1e-10 times the array's largest entry, the scale its rounding errors are relative to.
    import contextlib

    from fedbayes import engine
    from fit_pairs import fedsoul_twice, paired_outputs

    if jnp.result_type(float) != jnp.float64:
        pytest.skip("the tolerance is float64's")

    def plainly(_):
        monkeypatch.setattr(engine, "FAST_COMPILE_CLIENTS", -1)
        monkeypatch.setattr(prng, "unrolled_hash", contextlib.nullcontext)

    fast, plain = fedsoul_twice(30, 20, plainly)
    for got, want in paired_outputs(fast, plain):
        want = np.asarray(want)
        scale = max(float(np.max(np.abs(want))), 1.0) if want.size else 1.0
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10, atol=1e-10 * scale)


def test_the_keys_a_fit_splits_on_the_host_are_jax_random_s() -> None:
    from fedbayes import engine
    from fedbayes.seeds import seed_key

    for seed in (0, 1, 2**40 + 7):
        key = seed_key(seed)
        for num in (2, 3):
            got = engine.split_key(key, num)
            assert len(got) == num
            np.testing.assert_array_equal(np.stack([np.asarray(k) for k in got]), np.asarray(jax.random.split(key, num)))
        for data in (0, 1, 5, 2**31 + 3):
            np.testing.assert_array_equal(np.asarray(engine.fold_in_key(key, data)),
                                          np.asarray(jax.random.fold_in(key, data)))
