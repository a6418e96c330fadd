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


def _masked_reference(x, bits):
    allowed = ((bits[:, :, None].view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1)
    allowed = allowed.reshape(bits.shape[0], -1)[:, :x.shape[1]].astype(bool)
    return np.asarray(jnp.argmax(jnp.where(allowed, x, -jnp.inf), axis=-1))


@pytest.mark.parametrize("R,V,density", [(1, 1, 1.0), (3, 31, 0.5), (5, 32, 0.1), (4, 100, 0.9),
                                         (16, 49152, 0.01), (64, 1000, 0.5), (2, 77, 0.0)])
def test_masked_argmax_matches_jnp(R, V, density):
    from pallas_kernels.argmax_cpu import masked_argmax_rows, masked_kernel_available
    assert masked_kernel_available()
    rng = np.random.default_rng(R * 7 + V)
    x = rng.standard_normal((R, V)).astype(np.float32)
    W = (V + 31) // 32 + (1 if V % 3 == 0 else 0)  # a wider mask than needed reads the same
    allowed = rng.random((R, W * 32)) < density
    bits = np.packbits(allowed.reshape(R, W, 32)[:, :, ::-1], axis=-1, bitorder="big")
    bits = bits.reshape(R, W, 4)[:, :, ::-1].copy().view(np.int32).reshape(R, W)
    want = _masked_reference(x, bits)
    got = np.asarray(jax.jit(masked_argmax_rows)(x, bits))
    np.testing.assert_array_equal(got, want)
    assert "xlaserve_masked_argmax" in jax.jit(masked_argmax_rows).lower(x, bits).as_text()


def test_masked_argmax_ties_nans_and_masked_maxima():
    from pallas_kernels.argmax_cpu import masked_argmax_rows
    V = 77
    x = np.random.default_rng(0).standard_normal((6, V)).astype(np.float32)
    bits = np.full((6, 3), -1, np.int32)
    x[0, [5, 40, 70]] = 9.0  # a tie: the first allowed index wins
    bits[0, 0] &= ~np.int32(1 << 5)
    x[1, 3] = 50.0  # the maximum is masked out: the best allowed one wins
    bits[1, 0] &= ~np.int32(1 << 3)
    x[2, 50] = np.nan  # an allowed NaN beats everything
    x[3, 10] = np.nan  # a masked NaN does not count
    bits[3, 0] &= ~np.int32(1 << 10)
    bits[4] = 0  # nothing allowed: index 0, as jnp.argmax of all -inf
    x[5, 74] = np.nan  # NaN in the tail
    got = np.asarray(masked_argmax_rows(x, bits))
    np.testing.assert_array_equal(got, _masked_reference(x, bits))
    assert got[0] == 40 and got[1] != 3 and got[2] == 50 and got[3] != 10 and got[4] == 0
    assert got[5] == 74
