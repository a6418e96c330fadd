"""Int8GroupArray in groups of 16 (GGUF's Q6_K form, quant/int8_groups.py) everywhere the
form goes: the group size read from the shapes, lookups and the tied head, the plain-XLA
matmul, the CPU kernels (single, head, experts) and where they cannot take it, q/k/v and
gate/up joins, tensor-parallel cuts in whole groups and the start-up log's names."""
import jax.numpy as jnp
import numpy as np
import pytest

from model.formats.param_tree import form
from model.runtime_params import _join_projections
from model.sharding import _cut
from pallas_kernels.grouped_matmul_cpu import grouped_matmul_reference
from pallas_kernels.q8_0_matmul_cpu import q8_0_matmul_reference
from quant import ops, packed, packed_experts
from quant.int8_groups import Int8GroupArray, concat_int8_groups, quantize_int8_groups
from quant.recipe import describe

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py


def kernel(rng, K, N, group=16, lead=()):
    """Codes as Q6_K's (-32 .. 31) with float32 scales per `group` inputs: [*lead, K, N]."""
    codes = rng.integers(-32, 32, (*lead, K, N)).astype(np.int8)
    scale = (rng.random((*lead, K // group, N)) / 50 + 1e-4).astype(np.float32)
    return Int8GroupArray(jnp.asarray(codes), jnp.asarray(scale))


def dense(w: Int8GroupArray) -> np.ndarray:
    axis = -2 if w.scale.shape[-1] == w.values.shape[-1] else -1
    return np.asarray(w.values, np.float32) * np.repeat(np.asarray(w.scale), 16, axis=axis)


def test_the_group_follows_from_the_shapes():
    rng = np.random.default_rng(0)
    w = kernel(rng, 64, 32)
    assert (w.group, w.group_axis) == (16, -2)
    table = w.T  # [32, 64]: rows of 64 in groups of 16
    assert (table.group, table.group_axis) == (16, -1)
    assert quantize_int8_groups(np.ones((64, 32), np.float32)).group == 32
    np.testing.assert_array_equal(np.asarray(w.dequantize()), dense(w))
    np.testing.assert_array_equal(np.asarray(table.dequantize()), dense(w).T)


def test_rows_and_the_tied_head_of_a_table():
    rng = np.random.default_rng(1)
    table = kernel(rng, 48, 64).T  # [vocab 64, hidden 48]
    ids = jnp.asarray([5, 0, 63, 5])
    np.testing.assert_array_equal(np.asarray(ops.take(table, ids, jnp.float32)),
                                  dense(table.T).T[np.asarray(ids)])
    x = rng.standard_normal((3, 48)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(ops.matmul_t(jnp.asarray(x), table)),
                               x @ dense(table.T), rtol=1e-5, atol=1e-6)


def test_inputs_in_an_odd_number_of_16s_stay_on_the_xla_path():
    """The kernel rounds activations per 32 inputs: K = 48 is not packed; XLA's dot of the
    dequantized weight runs it."""
    rng = np.random.default_rng(2)
    w = kernel(rng, 48, 32)
    assert not packed.int8_groups_packable(w)
    assert not packed_experts.packable(kernel(rng, 48, 32, lead=(2,)))
    x = rng.standard_normal((3, 48)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(ops.matmul(jnp.asarray(x), w)), x @ dense(w),
                               rtol=1e-5, atol=1e-6)


def test_packed_for_the_kernel_gives_the_references_bits():
    rng = np.random.default_rng(3)
    w = kernel(rng, 64, 32)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    assert packed.int8_groups_packable(w)
    p = packed.pack_int8_groups(w)
    assert p.scale.shape == (2, 4, 16)  # [out / 16, in / 16, 16]
    want = np.asarray(q8_0_matmul_reference(x, w.values, w.scale))
    np.testing.assert_array_equal(np.asarray(ops.matmul(x, p)), want)
    head = packed.pack_int8_groups_head(w.T)  # the table [32, 64] as the tied head [64, 32]
    assert isinstance(head, packed.PackedQ80)
    np.testing.assert_array_equal(np.asarray(ops.matmul(x, head)), want)


def test_experts_packed_for_the_grouped_kernel():
    rng = np.random.default_rng(4)
    w = kernel(rng, 96, 32, lead=(3,))
    assert packed_experts.packable(w)
    p = packed_experts.pack(w)
    assert p.kind == "q8_0"
    x = jnp.asarray(rng.standard_normal((9, 96)), jnp.float32)
    sizes = jnp.asarray([4, 0, 3], jnp.int32)
    want = grouped_matmul_reference("q8_0", x, np.asarray(sizes), w.values, w.scale)
    np.testing.assert_array_equal(np.asarray(ops.grouped_matmul(x, p, sizes)),
                                  np.asarray(want))


def test_projections_join_only_in_one_group_size():
    rng = np.random.default_rng(5)
    q, k, v = kernel(rng, 64, 32), kernel(rng, 64, 16), kernel(rng, 64, 16)
    joined = concat_int8_groups([q, k, v])
    assert joined.group == 16 and joined.scale.shape == (4, 64)
    np.testing.assert_array_equal(dense(joined), np.concatenate([dense(a) for a in (q, k, v)],
                                                                axis=-1))
    v32 = quantize_int8_groups(np.asarray(v.dequantize()))
    with pytest.raises(ValueError, match="groups of one size"):
        concat_int8_groups([q, k, v32])
    attn = {n: {"kernel": a} for n, a in (("q_proj", q), ("k_proj", k), ("v_proj", v))}
    assert "qkv_proj" in _join_projections({"attn": attn}, exact=True)["attn"]
    mixed = {**attn, "v_proj": {"kernel": v32}}
    assert set(_join_projections({"attn": mixed}, exact=True)["attn"]) == set(mixed)


def test_tensor_parallel_cuts_keep_groups_of_16_whole():
    rng = np.random.default_rng(6)
    w = kernel(rng, 64, 32)
    rows = _cut(w, -2, 16, 48)  # row-parallel: inputs 16 to 48, two whole groups
    assert rows.group == 16 and rows.scale.shape == (2, 32)
    np.testing.assert_array_equal(dense(rows), dense(w)[16:48])
    cols = _cut(w, -1, 16, 32)
    np.testing.assert_array_equal(dense(cols), dense(w)[:, 16:])
    with pytest.raises(ValueError, match="groups of 16 inputs"):
        _cut(w, -2, 0, 24)
    table = w.T  # [32, 64]: a cut of the rows' 64 in whole groups of 16
    np.testing.assert_array_equal(dense(_cut(table, -1, 32, 48).T), dense(w)[32:48])
    with pytest.raises(ValueError, match="groups of 16 inputs"):
        _cut(table, -1, 8, 40)


def test_the_logs_names():
    rng = np.random.default_rng(7)
    w16 = kernel(rng, 64, 32)
    w32 = quantize_int8_groups(np.asarray(w16.dequantize()))
    assert form(w16) == "int8 per group of 16 (float32 scales)"
    assert form(w32) == "int8 per group of 32 (float16 scales)"
    assert describe({"a": w16, "b": w32, "c": jnp.ones(3)}) == (
        "int8 per group of 16 + int8 per group of 32, 2 of 3 tensors")
