"""LAPACK-free dense linear algebra for batched small matrices (Cholesky, triangular and SPD inverses).

jaxlib's CPU LAPACK kernels (Cholesky, triangular solve, LU, eigh, ...) split a batch of matrices over
XLA's intra-op thread pool from inside a pool thread and block until the pieces are done. When as many
such calls run at once as the pool has threads (XLA runs independent operations concurrently), every
pool thread waits for work queued behind it: a deadlock (jaxlib 0.10.2, batches of about 200,000 matrix
elements or more). Anything that varies over clients or rows under the engine's vmap is such a batch, so
the routines here use array operations only (``fori_loop`` over columns or rows, no LAPACK call).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lapack_free_cholesky(a: jax.Array) -> jax.Array:
    """Lower Cholesky factor L (L L^T = a) of symmetric positive-definite matrices ``(..., n, n)``.

    Column j of L, by the Cholesky-Crout recursion with array operations (no LAPACK call, whatever the
    batch; a ``fori_loop`` over the n columns, so the program does not grow with n):

        c = a[:, j] - L[:, :j] L[j, :j]^T,   L_jj = sqrt(c_j),   L_ij = c_i / L_jj  (i > j).

    The columns of L not yet computed are zero, so the full-width product adds exact zeros only.
    """
    a = jnp.asarray(a)
    n = a.shape[-1]
    rows = jnp.arange(n)

    def column(j, L):
        c = a[..., :, j] - jnp.einsum("...ik,...k->...i", L, L[..., j, :])
        d = jnp.sqrt(c[..., j])[..., None]
        return L.at[..., :, j].set(jnp.where(rows > j, c / d, jnp.where(rows == j, d, 0.0)))

    return jax.lax.fori_loop(0, n, column, jnp.zeros_like(a))


def lapack_free_tril_inverse(L: jax.Array) -> jax.Array:
    """X = L^{-1} for lower-triangular ``(..., n, n)`` by forward substitution on the identity, row by row
    (rows of X not yet computed are zero): X_i = (e_i - L[i, :i] X[:i]) / L_ii. No LAPACK call."""
    L = jnp.asarray(L)
    n = L.shape[-1]
    eye = jnp.eye(n, dtype=L.dtype)

    def row(i, X):
        r = (eye[i] - jnp.einsum("...k,...kj->...j", L[..., i, :], X)) / L[..., i, i][..., None]
        return X.at[..., i, :].set(r)

    return jax.lax.fori_loop(0, n, row, jnp.zeros_like(L))


def lapack_free_spd_inverse(p: jax.Array) -> jax.Array:
    """P^{-1} = X^T X with X = C^{-1}, P = C C^T (symmetric positive-definite ``(..., n, n)``, no LAPACK call)."""
    x = lapack_free_tril_inverse(lapack_free_cholesky(p))
    return jnp.swapaxes(x, -1, -2) @ x
