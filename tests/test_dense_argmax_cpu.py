"""The greedy head on CPUs (pallas_kernels/cpu/dense_argmax.cc): each row's argmax over the
dense kernel's product, the token the matmul kernel then the argmax kernel give, for every
weight form, with ties, NaNs, a narrow last panel and a vocabulary cut short of the weight's
columns, and the same token for a row whatever rows share the call."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.argmax_cpu import argmax_rows
from pallas_kernels.dense_matmul_cpu import (argmax_available, dense_argmax, dense_matmul,
                                             pack_panels)

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py


def test_the_kernel_builds_here():
    assert argmax_available()


def _weights(K, N, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if dtype == "int8":
        codes = jnp.asarray(rng.integers(-128, 128, (K, N)).astype(np.int8))
    elif dtype.startswith("float8"):
        codes = jnp.asarray((rng.standard_normal((K, N)) * 40).astype(np.float32)).astype(dtype)
    else:
        return jnp.asarray(rng.standard_normal((K, N)).astype(np.float32) * 0.05, dtype), None
    return codes, jnp.asarray(rng.uniform(0.001, 0.01, N).astype(np.float32))


def _unfused(x, panels, scale, columns):
    return argmax_rows(dense_matmul(x, panels, scale)[:, :columns])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8", "float8_e4m3fn",
                                   "float8_e5m2"])
@pytest.mark.parametrize("T,K,N,columns", [(1, 64, 49152, 49152), (7, 9, 3, 3),
                                           (13, 64, 5000, 4999), (64, 32, 2053, 2050),
                                           (300, 16, 1024, 1000)])
def test_the_same_token_as_the_matmul_then_the_argmax(dtype, T, K, N, columns):
    x = jnp.asarray(np.random.default_rng(T).standard_normal((T, K)).astype(np.float32))
    w, scale = _weights(K, N, dtype, seed=K)
    panels = pack_panels(w)
    got = np.asarray(jax.jit(dense_argmax, static_argnums=3)(x, panels, scale, columns))
    want = np.asarray(jax.jit(_unfused, static_argnums=3)(x, panels, scale, columns))
    np.testing.assert_array_equal(got, want)
    assert got.max() < columns


def test_ties_take_the_first_column_and_a_nan_counts_as_the_maximum():
    """Columns repeated across chunks of the vocabulary tie exactly: the first wins; a NaN
    in the rows gives every column NaN, and jnp.argmax's answer for that is index 0."""
    K, N = 8, 4096
    rng = np.random.default_rng(3)
    base = rng.standard_normal((K, 64)).astype(np.float32)
    w = np.tile(base, (1, N // 64))  # column j == column j % 64
    x = rng.standard_normal((5, K)).astype(np.float32)
    x[4, 2] = np.nan
    got = np.asarray(dense_argmax(jnp.asarray(x), pack_panels(jnp.asarray(w))))
    want = np.asarray(jnp.argmax(jnp.asarray(x) @ jnp.asarray(w), axis=-1))
    np.testing.assert_array_equal(got, want)
    assert (got[:4] < 64).all() and got[4] == 0


def test_a_row_does_not_depend_on_its_batch():
    K, N = 64, 49152
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((256, K)).astype(np.float32))
    panels = pack_panels(_weights(K, N, "float32")[0])
    run = jax.jit(dense_argmax)
    full = np.asarray(run(x, panels))
    for T in (1, 5, 64, 200):
        np.testing.assert_array_equal(np.asarray(run(x[-T:], panels)), full[-T:])


def test_bad_shapes_and_formats_are_refused():
    panels = pack_panels(jnp.ones((4, 32), jnp.float32))
    with pytest.raises(ValueError, match="columns"):
        dense_argmax(jnp.ones((2, 4), jnp.float32), panels, columns=33)
    with pytest.raises(ValueError, match="float32 rows"):
        dense_argmax(jnp.ones((2, 4), jnp.bfloat16), panels)
    with pytest.raises(ValueError, match="need a scale"):
        dense_argmax(jnp.ones((2, 4), jnp.float32), pack_panels(jnp.ones((4, 32), jnp.int8)))
