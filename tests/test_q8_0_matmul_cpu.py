"""The Q8_0 CPU kernel (pallas_kernels/cpu/q8_0_matmul.cc: int8 codes with a scale per group
of 32 inputs and column, or of 16 for Q6_K) against its plain-jnp reference, bit for bit,
and against the float64 product of the weight it stands for."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cpu_ffi
from pallas_kernels.q8_0_matmul_cpu import (GROUP, PANEL, pack_panels, q8_0_matmul,
                                            q8_0_matmul_reference, unpack_panels)

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py


def weight(rng, K, N, dtype=np.float16, group=GROUP):
    """Codes over the whole int8 range, a scale per `group` values of k; float32 scales a
    float16 times a 6-bit integer, as GGUF's K-quants make them, most of them not float16
    values."""
    codes = rng.integers(-128, 128, (K, N)).astype(np.int8)
    d = (rng.random((K // group, N)) / 50 + 1e-4).astype(np.float16)
    if dtype == np.float32:
        d = d.astype(np.float32) / 63 * rng.integers(1, 64, d.shape).astype(np.float32)
    return codes, d


def dense(codes, d):
    return codes.astype(np.float64) * np.repeat(d.astype(np.float64), len(codes) // len(d), 0)


def check(x, codes, d):
    """The kernel's result, after checking it against the reference (to the bit) and the
    float64 product (rounding x to int16 per 32 values moves it by under 0.01% of its
    range)."""
    got = np.asarray(jax.jit(q8_0_matmul)(x, *pack_panels(codes, d)))
    np.testing.assert_array_equal(got, np.asarray(q8_0_matmul_reference(x, codes, d)))
    exact = x.astype(np.float64) @ dense(codes, d)
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-4 * np.abs(exact).max())
    return got


def test_the_kernel_builds_here():
    assert cpu_ffi.available("q8_0_matmul")


@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("seed", range(12))
def test_random_shapes_match_the_reference(seed, group):
    rng = np.random.default_rng(seed)
    K = GROUP * int(rng.integers(1, 40))
    N = PANEL * int(rng.integers(1, 20))
    T = int(rng.integers(1, 71))
    dtype = (np.float16, np.float32)[seed % 2]
    x = (rng.standard_normal((T, K)) * rng.random((T, 1)) * 10).astype(np.float32)
    check(x, *weight(rng, K, N, dtype, group))


@pytest.mark.parametrize("T,K,N", [(1, 576, 1536), (16, 1536, 576), (64, 576, 576),
                                   (7, 576, 4096)])
def test_the_model_shapes(T, K, N):
    rng = np.random.default_rng(T)
    check(rng.standard_normal((T, K)).astype(np.float32), *weight(rng, K, N))


@pytest.mark.parametrize("group", [32, 16])
def test_a_row_does_not_depend_on_the_rows_beside_it(group):
    rng = np.random.default_rng(7)
    packed = pack_panels(*weight(rng, 1536, 64, np.float32, group))
    x = (rng.standard_normal((70, 1536)) * rng.random((70, 1))).astype(np.float32)
    together = np.asarray(q8_0_matmul(x, *packed))
    for r in range(70):
        np.testing.assert_array_equal(np.asarray(q8_0_matmul(x[r:r + 1], *packed)),
                                      together[r:r + 1], err_msg=f"row {r}")
    for rows in [slice(3, 5), slice(0, 7), slice(10, 23), slice(1, 70), slice(5, 69)]:
        np.testing.assert_array_equal(np.asarray(q8_0_matmul(x[rows], *packed)), together[rows])


def test_non_finite_rows_give_nan_in_that_row_only():
    rng = np.random.default_rng(3)
    codes, d = weight(rng, 96, 48)
    x = rng.standard_normal((9, 96)).astype(np.float32)
    x[4, 5] = np.nan
    x[7, 90] = -np.inf
    x[8, 40] = np.inf
    got = np.asarray(q8_0_matmul(x, *pack_panels(codes, d)))
    assert np.isnan(got[[4, 7, 8]]).all()
    ok = [0, 1, 2, 3, 5, 6]
    assert np.isfinite(got[ok]).all()
    np.testing.assert_array_equal(got[ok], np.asarray(q8_0_matmul(x[ok], *pack_panels(codes, d))))
    np.testing.assert_array_equal(got[ok], np.asarray(q8_0_matmul_reference(x[ok], codes, d)))


def test_zero_groups_and_rows():
    rng = np.random.default_rng(5)
    codes, d = weight(rng, 128, 32)
    x = rng.standard_normal((4, 128)).astype(np.float32)
    x[0] = 0.0
    x[1, 32:64] = 0.0  # one group of zeros: scale 0, the others as they were
    x[2, :96] = 0.0
    got = check(x, codes, d)
    assert (got[0] == 0).all()
    np.testing.assert_array_equal(got[1:3], check(x[1:3], codes, d))


def test_extreme_codes_and_activations():
    """Codes of -128 against activations of +-32767 everywhere: the largest group sums,
    within int32."""
    K, N = 256, 32
    codes = np.full((K, N), -128, np.int8)
    codes[:, 16:] = 127
    d = np.full((K // GROUP, N), 0.01, np.float16)
    x = np.ones((3, K), np.float32)
    x[1] = -1.0
    x[2, ::2] = -1.0
    got = check(x, codes, d)
    np.testing.assert_allclose(got[0, :16], -128 * 0.01 * K, rtol=1e-3)


def test_float16_scales_as_float32_give_the_same_bits():
    rng = np.random.default_rng(4)
    codes, d = weight(rng, 576, 64)
    x = rng.standard_normal((9, 576)).astype(np.float32)
    half = pack_panels(codes, d)
    single = pack_panels(codes, d.astype(np.float32))
    assert half[1].dtype == jnp.float16 and single[1].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(q8_0_matmul(x, *single)),
                                  np.asarray(q8_0_matmul(x, *half)))
    # any other float is taken as float32
    assert pack_panels(codes, d.astype(jnp.bfloat16))[1].dtype == jnp.float32


def test_panels_round_trip_and_layout():
    rng = np.random.default_rng(2)
    for dtype in (np.float16, np.float32):
        codes, d = weight(rng, 64, 32, dtype)
        packed, dp = pack_panels(codes, d)
        assert packed.shape == codes.shape and packed.dtype == jnp.int8
        assert dp.shape == (2, 2, 16) and dp.dtype == dtype
        back_codes, back_d = unpack_panels(packed, dp)
        np.testing.assert_array_equal(np.asarray(back_codes), codes)
        np.testing.assert_array_equal(np.asarray(back_d), d)
    flat = np.asarray(packed).reshape(2, 32, 16, 2)  # [panel, pair of k, column, k in pair]
    assert flat[1, 4, 3, 1] == codes[9, 16 + 3]
    assert flat[0, 20, 7, 0] == codes[40, 7]
    assert np.asarray(dp)[1, 1, 5] == d[1, 16 + 5]
    with pytest.raises(ValueError, match="K % 32"):
        pack_panels(codes[:48], d)


def test_leading_axes_and_dtype():
    rng = np.random.default_rng(1)
    codes, d = weight(rng, 64, 32)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.bfloat16)
    got = q8_0_matmul(x, *pack_panels(codes, d))
    assert got.shape == (2, 3, 32) and got.dtype == jnp.bfloat16
    want = q8_0_matmul_reference(x, codes, d)
    assert want.shape == got.shape and want.dtype == got.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_groups_of_16_sum_each_half_of_an_activation_group_on_its_own():
    """Two weight groups of 16 under one activation group of 32: each half's integer sum
    times its own scale, the halves in order; the same codes in groups of 32 with the
    scales of either half give other sums."""
    rng = np.random.default_rng(8)
    codes, d = weight(rng, 64, 16, np.float32, group=16)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    got = check(x, codes, d)
    for half in (0, 1):
        other = np.asarray(q8_0_matmul_reference(x, codes, d[half::2]))
        assert not np.array_equal(got, other)
    same = d.copy()
    same[1::2] = d[0::2]  # both halves scaled alike: groups of 32, but summed as two FMAs
    np.testing.assert_allclose(check(x, codes, same),
                               np.asarray(q8_0_matmul_reference(x, codes, d[0::2])),
                               rtol=1e-6, atol=1e-6)


def test_groups_of_16_panels_and_refusals():
    rng = np.random.default_rng(6)
    codes, d = weight(rng, 64, 32, np.float32, group=16)
    packed, dp = pack_panels(codes, d)
    assert dp.shape == (2, 4, 16) and dp.dtype == jnp.float32
    assert np.asarray(dp)[1, 3, 5] == d[3, 16 + 5]
    back_codes, back_d = unpack_panels(packed, dp)
    np.testing.assert_array_equal(np.asarray(back_d), d)
    np.testing.assert_array_equal(np.asarray(back_codes), codes)
    with pytest.raises(ValueError, match="K % 32"):  # the activations' groups of 32
        pack_panels(codes[:48], d[:3])
    with pytest.raises(ValueError, match="groups of 16 or 32"):
        pack_panels(codes, d[:3])
    x = rng.standard_normal((2, 64)).astype(np.float32)
    with pytest.raises(Exception, match="group 16 or 32"):  # the scales' count disagrees
        np.asarray(cpu_ffi.matmul("q8_0_matmul", x, 32, packed, dp.reshape(-1),
                                  jnp.zeros((0,), dp.dtype), group=np.int64(32)))
    with pytest.raises(Exception, match="m none or as d"):  # offsets of another count
        np.asarray(cpu_ffi.matmul("q8_0_matmul", x, 32, packed, dp.reshape(-1),
                                  dp.reshape(-1)[:8], group=np.int64(16)))
