"""Int8GroupArray with an offset per group (GGUF's Q5_1, Q5_K and Q2_K: W = scale * code +
offset) everywhere the form goes: the CPU kernel's min term against its plain-jnp reference
bit for bit (groups of 32 and 16, float16 and float32), rows independent of their batch,
packing, lookups and the tied head, the plain-XLA path, experts, joins, tensor-parallel cuts
and the start-up log's names."""
import jax.numpy as jnp
import numpy as np
import pytest

from model.formats.param_tree import dequantize_np, form
from model.runtime_params import _join_projections
from model.sharding import _cut
from pallas_kernels.grouped_matmul_cpu import grouped_matmul_reference
from pallas_kernels.q8_0_matmul_cpu import (pack_panels, q8_0_matmul, q8_0_matmul_reference,
                                            unpack_panels)
from quant import ops, packed, packed_experts
from quant.int8_groups import Int8GroupArray, concat_int8_groups, quantize_int8_groups
from quant.recipe import describe

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py


def weight(rng, K, N, group=32, dtype=np.float32, lead=()):
    """Codes 0 .. 31 (Q5's), scales and negative offsets per `group` inputs as K-quants make
    them (float32: a float16 times a 6-bit integer), or float16 ones as Q5_1's."""
    codes = rng.integers(0, 32, (*lead, K, N)).astype(np.int8)
    shape = (*lead, K // group, N)
    d = (rng.random(shape) / 50 + 1e-4).astype(np.float16)
    m = (-rng.random(shape) / 2).astype(np.float16)
    if dtype == np.float32:
        d = d.astype(np.float32) * rng.integers(1, 64, shape).astype(np.float32)
        m = m.astype(np.float32) * rng.integers(0, 64, shape).astype(np.float32)
    return codes, d, m


def dense(codes, d, m):
    group = len(codes) // len(d)
    return (codes.astype(np.float64) * np.repeat(d.astype(np.float64), group, 0)
            + np.repeat(m.astype(np.float64), group, 0))


def array(codes, d, m) -> Int8GroupArray:
    return Int8GroupArray(jnp.asarray(codes), jnp.asarray(d), jnp.asarray(m))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("group", [32, 16])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 6, 7, 16, 33])
def test_the_kernel_gives_the_references_bits_row_by_row(T, group, dtype):
    """Each group's scale FMA, then its offset's (m times dx times the group's sum of the
    rounded x), as the reference adds them; near the float64 product of the weight; and
    each row's result the one it gets alone, whatever tiles its batch makes."""
    rng = np.random.default_rng(T * group)
    K, N = 32 * int(rng.integers(1, 12)), 16 * int(rng.integers(1, 6))
    codes, d, m = weight(rng, K, N, group, dtype)
    operands = pack_panels(codes, d, m)
    x = (rng.standard_normal((T, K)) * rng.random((T, 1)) * 10).astype(np.float32)
    got = np.asarray(q8_0_matmul(x, *operands))
    np.testing.assert_array_equal(got, np.asarray(q8_0_matmul_reference(x, codes, d, m)))
    exact = x.astype(np.float64) @ dense(codes, d, m)
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-4 * np.abs(exact).max())
    for r in range(T) if T > 1 else ():
        alone = np.asarray(q8_0_matmul(x[r:r + 1], *operands))
        np.testing.assert_array_equal(alone, got[r:r + 1], err_msg=f"row {r}")


def test_zero_offsets_give_the_plain_kernels_bits_and_nan_rows_stay_alone():
    rng = np.random.default_rng(3)
    codes, d, m = weight(rng, 96, 48)
    x = rng.standard_normal((5, 96)).astype(np.float32)
    plain = np.asarray(q8_0_matmul(x, *pack_panels(codes, d)))
    zeros = np.asarray(q8_0_matmul(x, *pack_panels(codes, d, np.zeros_like(m))))
    np.testing.assert_array_equal(zeros, plain)
    x[2, 7] = np.nan
    got = np.asarray(q8_0_matmul(x, *pack_panels(codes, d, m)))
    assert np.isnan(got[2]).all() and np.isfinite(got[[0, 1, 3, 4]]).all()


def test_panels_round_trip_with_offsets():
    rng = np.random.default_rng(2)
    for group, dtype in ((32, np.float16), (16, np.float32)):
        codes, d, m = weight(rng, 64, 32, group, dtype)
        packed_codes, dp, mp = pack_panels(codes, d, m)
        assert mp.shape == dp.shape == (2, 64 // group, 16) and mp.dtype == dtype
        back = unpack_panels(packed_codes, dp, mp)
        for got, want in zip(back, (codes, d, m)):
            np.testing.assert_array_equal(np.asarray(got), want)
    # float16 scales with float32 offsets: both go as float32
    assert pack_panels(codes, d.astype(np.float16), m)[1].dtype == jnp.float32


def test_the_form_dequantizes_looks_up_and_heads_with_its_offsets():
    rng = np.random.default_rng(4)
    codes, d, m = weight(rng, 64, 48, 16)
    w = array(codes, d, m)
    want = dense(codes, d, m).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(w.dequantize()), want)
    np.testing.assert_array_equal(dequantize_np(jnp_to_np(w)), want)
    table = w.T  # [48, 64]: rows of 64 in groups of 16, the offsets swapped too
    assert (table.group, table.group_axis) == (16, -1) and table.offset.shape == (48, 4)
    np.testing.assert_array_equal(np.asarray(table.dequantize()), want.T)
    ids = jnp.asarray([5, 0, 47, 5])
    np.testing.assert_array_equal(np.asarray(ops.take(table, ids, jnp.float32)),
                                  want.T[np.asarray(ids)])
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    head = packed.pack_int8_groups_head(table)  # the table as the tied head [64, 48]
    assert isinstance(head, packed.PackedQ80) and head.offset is not None
    np.testing.assert_array_equal(np.asarray(ops.matmul(x, head)),
                                  np.asarray(q8_0_matmul_reference(x, codes, d, m)))
    np.testing.assert_allclose(np.asarray(ops.matmul_t(x, table)), np.asarray(x) @ want,
                               rtol=1e-5, atol=1e-5)


def jnp_to_np(w: Int8GroupArray) -> Int8GroupArray:
    return Int8GroupArray(*(np.asarray(a) for a in (w.values, w.scale, w.offset)))


def test_packed_for_the_kernel_and_else_on_xla():
    rng = np.random.default_rng(5)
    w = array(*weight(rng, 64, 32))
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    assert packed.int8_groups_packable(w)
    p = packed.pack_int8_groups(w)
    np.testing.assert_array_equal(np.asarray(ops.matmul(x, p)),
                                  np.asarray(q8_0_matmul_reference(x, w.values, w.scale,
                                                                   w.offset)))
    odd = array(*weight(rng, 48, 32, 16))  # inputs in 3 groups of 16: no kernel, XLA's dot
    assert not packed.int8_groups_packable(odd)
    y = rng.standard_normal((3, 48)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(ops.matmul(jnp.asarray(y), odd)),
                               y @ np.asarray(odd.dequantize()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group", [32, 16])
def test_experts_with_offsets_on_the_grouped_kernel(group):
    """Each expert's rows get the single kernel's bits for its weight; rows past the groups
    are zeros."""
    rng = np.random.default_rng(group)
    codes, d, m = weight(rng, 96, 32, group, lead=(3,))
    experts = packed_experts.pack(array(codes, d, m))
    assert experts.kind == "q8_0" and len(experts.operands) == 3
    x = rng.standard_normal((9, 96)).astype(np.float32)
    got = np.asarray(ops.grouped_matmul(jnp.asarray(x), experts,
                                        jnp.asarray([4, 0, 3], jnp.int32)))
    for e, rows in ((0, slice(0, 4)), (2, slice(4, 7))):
        alone = q8_0_matmul(x[rows], *pack_panels(codes[e], d[e], m[e]))
        np.testing.assert_array_equal(got[rows], np.asarray(alone), err_msg=f"expert {e}")
    assert (got[7:] == 0).all()
    np.testing.assert_array_equal(got, np.asarray(grouped_matmul_reference(
        "q8_0", x, [4, 0, 3], codes, d, m)))


def test_projections_join_only_all_with_offsets_or_all_without():
    """Joined where every kernel has offsets (their offsets joined as the scales); one
    without keeps q, k and v apart, each on its own kernel."""
    rng = np.random.default_rng(6)
    q, k, v = (array(*weight(rng, 64, n)) for n in (32, 16, 16))
    plain = quantize_int8_groups(np.asarray(v.dequantize()))
    joined = concat_int8_groups([q, k, v])
    assert joined.offset.shape == (2, 64)
    parts = [np.asarray(a.dequantize()) for a in (q, k, v)]
    np.testing.assert_array_equal(np.asarray(joined.dequantize()), np.concatenate(parts, -1))
    with pytest.raises(ValueError, match="all with offsets"):
        concat_int8_groups([q, k, plain])
    assert "qkv_proj" in joined_names([q, k, v])
    assert "qkv_proj" not in joined_names([q, k, plain])


def test_float16_and_float32_mins_join_widened_to_the_same_bits():
    """A Q5_1 kernel (float16 scales and mins) joined with a Q5_K one (float32): the join
    widens to float32, exactly, and each part's columns of the joined product are the bits
    its own kernel gives."""
    rng = np.random.default_rng(10)
    parts = [weight(rng, 64, 32, 32, np.float16), weight(rng, 64, 16, 32, np.float32)]
    joined = concat_int8_groups([array(*p) for p in parts])
    assert joined.scale.dtype == joined.offset.dtype == jnp.float32
    np.testing.assert_array_equal(
        np.asarray(joined.dequantize()),
        np.concatenate([np.asarray(array(*p).dequantize()) for p in parts], -1))
    assert "qkv_proj" in joined_names([array(*parts[0]), array(*parts[1]), array(*parts[1])])
    x = jnp.asarray(rng.standard_normal((5, 64)).astype(np.float32))
    got = np.asarray(q8_0_matmul(x, *pack_panels(joined.values, joined.scale, joined.offset)))
    np.testing.assert_array_equal(got[:, :32], np.asarray(q8_0_matmul(x, *pack_panels(*parts[0]))))
    np.testing.assert_array_equal(got[:, 32:], np.asarray(q8_0_matmul(x, *pack_panels(*parts[1]))))


def joined_names(kernels) -> set[str]:
    """The attention's projections after `_join_projections` of q, k and v `kernels`."""
    attn = {n: {"kernel": a} for n, a in zip(("q_proj", "k_proj", "v_proj"), kernels)}
    return set(_join_projections({"attn": attn}, exact=True)["attn"])


def test_tensor_parallel_cuts_cut_the_offsets_as_the_scales():
    rng = np.random.default_rng(8)
    w = array(*weight(rng, 64, 32, 16))
    want = np.asarray(w.dequantize())
    rows = _cut(w, -2, 16, 48)  # row-parallel: inputs 16 to 48, two whole groups
    assert rows.offset.shape == rows.scale.shape == (2, 32)
    np.testing.assert_array_equal(np.asarray(rows.dequantize()), want[16:48])
    cols = _cut(w, -1, 16, 32)
    assert cols.offset.shape == (4, 16)
    np.testing.assert_array_equal(np.asarray(cols.dequantize()), want[:, 16:])
    with pytest.raises(ValueError, match="groups of 16 inputs"):
        _cut(w, -2, 0, 24)
    table = _cut(w.T, 0, 8, 24)  # a vocabulary cut of the table [32, 64]
    np.testing.assert_array_equal(np.asarray(table.dequantize()), want.T[8:24])
    plain = _cut(Int8GroupArray(w.values, w.scale), -1, 0, 16)
    assert plain.offset is None


def test_the_logs_names():
    rng = np.random.default_rng(9)
    w32 = array(*weight(rng, 64, 32))
    w16 = array(*weight(rng, 64, 32, 16, np.float16))
    assert form(w32) == "int8 per group of 32 with mins (float32 scales)"
    assert form(w16) == "int8 per group of 16 with mins (float16 scales)"
    assert describe({"a": w32, "b": quantize_int8_groups(np.ones((64, 32), np.float32))}) == (
        "int8 per group of 32 + int8 per group of 32 with mins, 2 of 2 tensors")
