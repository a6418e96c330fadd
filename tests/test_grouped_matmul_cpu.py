"""The grouped CPU matmuls (`xlaserve_<kernel>_grouped` in pallas_kernels/cpu/*_matmul.cc,
through pallas_kernels/grouped_matmul_cpu.py): rows sorted by expert, each group's rows get
the bits the single kernel gives them against their expert's weight, whatever the other rows
and the size of their group; rows past the groups are zeros; bad group sizes fail."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (cpu_ffi, dense_matmul_cpu, q4_matmul_cpu, q8_0_matmul_cpu,
                            q8_matmul_cpu)
from pallas_kernels.grouped_matmul_cpu import (grouped_matmul, grouped_matmul_reference,
                                               kernel_available, pack_experts)

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py


def _dense(dtype):
    def make(rng, E, K, N):
        if dtype == "int8":
            w = rng.integers(-128, 128, (E, K, N)).astype(np.int8)
        else:
            w = jnp.asarray(rng.standard_normal((E, K, N)) * (40 if "8" in dtype else 0.05),
                            jnp.float32).astype(dtype)
        if dtype not in dense_matmul_cpu.CODE_DTYPES:
            return (w,)
        return w, (rng.random((E, N)) / 100 + 1e-3).astype(np.float32)
    return make


def _q8(rng, E, K, N):
    return (rng.integers(-128, 128, (E, K, N)).astype(np.int8),
            (rng.random((E, N)) / 100).astype(np.float32))


def _q4(scale_dtype):
    def make(rng, E, K, N):
        codes = rng.integers(0, 16, (E, K, N)).astype(np.uint8)
        d = (rng.random((E, K // 32, N)) / 50).astype(scale_dtype)
        m = (-rng.random((E, K // 32, N)) / 6).astype(scale_dtype)
        return codes, d, m
    return make


def _q8_0(scale_dtype, group=32):
    def make(rng, E, K, N):
        return (rng.integers(-128, 128, (E, K, N)).astype(np.int8),
                (rng.random((E, K // group, N)) / 200).astype(scale_dtype))
    return make


# id -> (kind, K, N, make(rng, E, K, N) -> the unpacked weights)
VARIANTS = {
    "dense-float32": ("dense", 40, 37, _dense("float32")),  # a narrow last panel
    "dense-bfloat16": ("dense", 24, 32, _dense("bfloat16")),
    "dense-float16": ("dense", 17, 16, _dense("float16")),
    "dense-int8": ("dense", 32, 21, _dense("int8")),
    "dense-e4m3": ("dense", 16, 48, _dense("float8_e4m3fn")),
    "dense-e5m2": ("dense", 8, 16, _dense("float8_e5m2")),
    "q8": ("q8", 64, 32, _q8),
    "q4-float16": ("q4", 96, 32, _q4(np.float16)),
    "q4-float32": ("q4", 64, 16, _q4(np.float32)),
    "q8_0-float16": ("q8_0", 64, 48, _q8_0(np.float16)),
    "q8_0-float32": ("q8_0", 32, 16, _q8_0(np.float32)),
    "q8_0-groups16": ("q8_0", 96, 32, _q8_0(np.float32, group=16)),  # Q6_K's
}

# (rows M, group sizes): groups of 0 rows, all rows in one group, one expert, decode's rows
# or two an expert, and sums short of M (the rows after them must come out zero)
CASES = [
    (5, [5]),
    (9, [6]),
    (33, [0, 33, 0]),
    (13, [2, 1, 0, 2, 1, 2, 2, 1]),
    (70, [12, 0, 31, 7, 13]),
    (67, [9, 0, 0, 17, 8, 5, 21, 7]),
]


def single(kind, x, weights):
    """The single kernel: x [T, K] against one expert's unpacked weights."""
    if kind == "dense":
        return dense_matmul_cpu.dense_matmul(x, dense_matmul_cpu.pack_panels(weights[0]),
                                             *weights[1:])
    if kind == "q8":
        return q8_matmul_cpu.q8_matmul(x, q8_matmul_cpu.pack_panels(weights[0]), weights[1])
    if kind == "q4":
        return q4_matmul_cpu.q4_matmul(x, *q4_matmul_cpu.pack_panels(*weights))
    return q8_0_matmul_cpu.q8_0_matmul(x, *q8_0_matmul_cpu.pack_panels(*weights))


def setup(variant, M, sizes, seed):
    kind, K, N, make = VARIANTS[variant]
    rng = np.random.default_rng(seed)
    weights = make(rng, len(sizes), K, N)
    x = (rng.standard_normal((M, K)) * rng.random((M, 1))).astype(np.float32)
    return kind, x, np.asarray(sizes, np.int32), weights


def run(kind, x, sizes, packed):
    """The grouped kernel in a program, the group sizes traced as an MoE layer's are."""
    return np.asarray(jax.jit(grouped_matmul, static_argnums=0)(kind, x, sizes, *packed))


def test_the_grouped_kernels_build_here():
    for kind in ("dense", "q8", "q4", "q8_0"):
        assert kernel_available(kind)
    assert not cpu_ffi.grouped_available("rms_norm")


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_group_gets_the_single_kernels_bits(variant, case):
    M, sizes = CASES[case]
    kind, x, sizes, weights = setup(variant, M, sizes, seed=case)
    got = run(kind, x, sizes, pack_experts(kind, *weights))
    start = 0
    for e, rows in enumerate(sizes):
        if rows:
            want = single(kind, x[start:start + rows], [w[e] for w in weights])
            np.testing.assert_array_equal(got[start:start + rows], np.asarray(want),
                                          err_msg=f"group {e}")
        start += rows
    assert (got[start:] == 0).all() and got.shape == (M, VARIANTS[variant][2])


@pytest.mark.parametrize("variant", VARIANTS)
def test_matches_the_reference(variant):
    M, sizes = CASES[4]
    kind, x, sizes, weights = setup(variant, M, sizes, seed=11)
    want = np.asarray(grouped_matmul_reference(kind, x, sizes, *weights))
    np.testing.assert_array_equal(run(kind, x, sizes, pack_experts(kind, *weights)), want)


@pytest.mark.parametrize("variant", ["dense-float32", "q8", "q4-float16", "q8_0-float16",
                                     "q8_0-groups16"])
def test_a_rows_result_does_not_depend_on_its_batch(variant):
    """A row alone in its group, and in a group made longer and with other groups beside
    it, gives the same bits as in the first batch."""
    M, sizes = CASES[5]
    kind, x, sizes, weights = setup(variant, M, sizes, seed=5)
    packed = pack_experts(kind, *weights)
    full = run(kind, x, sizes, packed)
    others = np.random.default_rng(9).standard_normal((4, x.shape[1])).astype(np.float32)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    for r in (0, 9, 30, 66):
        e = int(np.searchsorted(starts, r, side="right") - 1)
        alone = np.zeros_like(sizes)
        alone[e] = 1
        np.testing.assert_array_equal(run(kind, x[r:r + 1], alone, packed)[0], full[r])
        # four more rows in r's group, right after it, and a row in the next group
        longer = np.concatenate([x[:r + 1], others, x[r + 1:]])
        grown = sizes.copy()
        grown[e] += 4
        grown[(e + 1) % len(sizes)] += 1
        moved = run(kind, np.concatenate([longer, others[:1]]), grown, packed)
        np.testing.assert_array_equal(moved[r], full[r], err_msg=f"row {r}")


@pytest.mark.parametrize("kind", ["dense", "q8", "q4", "q8_0"])
def test_bad_group_sizes_fail(kind):
    variant = next(v for v, spec in VARIANTS.items() if spec[0] == kind)
    _, x, sizes, weights = setup(variant, 9, [4, 0, 5], seed=0)
    packed = pack_experts(kind, *weights)
    for bad in ([4, -1, 5], [4, 1, 5], [10, 0, 0], [2**31 - 1, 2**31 - 1, 4]):
        with pytest.raises(Exception, match="group sizes must be >= 0"):
            run(kind, x, np.asarray(bad, np.int32), packed)
    with pytest.raises(ValueError, match="3 experts' weights but 2 group sizes"):
        grouped_matmul(kind, x, sizes[:2], *packed)


def test_no_rows_in_groups_and_x_dtype():
    kind, x, sizes, weights = setup("q4-float16", 6, [0, 0, 0], seed=1)
    packed = pack_experts(kind, *weights)
    assert (run(kind, x, sizes, packed) == 0).all()
    xb = jnp.asarray(x, jnp.bfloat16)
    sizes = np.asarray([2, 0, 3], np.int32)
    got = jax.jit(grouped_matmul, static_argnums=0)(kind, xb, sizes, *packed)
    assert got.dtype == jnp.bfloat16 and got.shape == (6, 32)
    want = grouped_matmul_reference(kind, xb, sizes, *weights)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    text = jax.jit(grouped_matmul, static_argnums=0).lower(kind, xb, sizes, *packed).as_text()
    assert "xlaserve_q4_matmul_grouped" in text


def test_dense_scales_are_checked():
    _, _, _, floats = setup("dense-float32", 4, [4], seed=0)
    _, x, sizes, codes = setup("dense-int8", 4, [4], seed=0)
    with pytest.raises(ValueError, match="need a scale"):
        grouped_matmul("dense", x, sizes, pack_experts("dense", codes[0])[0])
    with pytest.raises(ValueError, match="take no scale"):
        grouped_matmul("dense", x, sizes, pack_experts("dense", *floats)[0], codes[1])
