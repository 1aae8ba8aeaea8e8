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

