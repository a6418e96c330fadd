"""The greedy argmax CPU kernel (pallas_kernels/cpu/argmax.cc) against jnp.argmax."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_ffi
from pallas_kernels.argmax_cpu import argmax_rows, kernel_available


def test_the_kernel_builds_here():
    assert cpu_ffi.available("argmax") and kernel_available()
    text = jax.jit(argmax_rows).lower(jnp.zeros((2, 64))).as_text()
    assert "xlaserve_argmax" in text


@pytest.mark.parametrize("R,V", [(1, 1), (1, 7), (3, 31), (5, 32), (4, 100), (16, 49152),
                                 (64, 1000)])
def test_argmax_matches_jnp(R, V):
    rng = np.random.default_rng(R * 7 + V)
    x = rng.standard_normal((R, V)).astype(np.float32)
    got = np.asarray(jax.jit(argmax_rows)(x))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))


def test_ties_nans_and_infinities_as_jnp():
    V = 77  # a vector part and a tail
    x = np.random.default_rng(0).standard_normal((8, V)).astype(np.float32)
    x[0, [5, 40, 70]] = 9.0  # a tie: the first index
    x[1, [70, 75]] = 9.0  # a tie inside the tail
    x[2, 50] = np.nan  # NaN in the vector part beats everything
    x[2, 3] = np.inf
    x[3, 74] = np.nan  # NaN in the tail
    x[3, 10] = np.nan
    x[4, 76] = np.nan  # only in the tail
    x[5] = -np.inf  # nothing above -inf: index 0
    x[6, 33] = np.inf
    x[7] = 0.0
    x[7, 60] = -0.0
    got = np.asarray(argmax_rows(x))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))
    assert list(got[:6]) == [5, 70, 50, 10, 76, 0]
