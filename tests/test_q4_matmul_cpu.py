"""The int4 CPU kernel (pallas_kernels/cpu/q4_matmul.cc) against plain jnp, int4 weights
(quant/int4.py: GGUF's Q4_1 form) and the packed form prepare_params makes for them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ModelConfig
from model.runtime_params import prepare_params
from model.transformer import init_params
from pallas_kernels import cpu_ffi
from pallas_kernels.q4_matmul_cpu import (fma_chain, pack_panels, q4_matmul,
                                          q4_matmul_reference, unpack_panels)
from quant.int4 import Int4Array, dequantize_int4, quantize_int4
from quant.packed import PackedQ4, PackedQ8
from quant.recipe import Recipe, describe, quantize_params
from tests.test_q8_matmul_cpu import cfg_for, logits

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py


def weight(rng, K, N):
    codes = rng.integers(0, 16, (K, N)).astype(np.uint8)
    d = (rng.random((K // 32, N)) / 50).astype(np.float16)
    m = (-rng.random((K // 32, N)) / 6).astype(np.float16)
    return codes, d, m


def q4_k_scales(rng, d, m):
    """float32 scales as GGUF's Q4_K makes them: a float16 times a 6-bit integer, most of
    them not float16 values."""
    G, N = d.shape
    d32 = d.astype(np.float32) / 63 * rng.integers(1, 64, (G, N)).astype(np.float32)
    m32 = m.astype(np.float32) / 63 * rng.integers(0, 64, (G, N)).astype(np.float32)
    assert (d32.astype(np.float16).astype(np.float32) != d32).mean() > 0.5
    return d32, m32


def dense(codes, d, m):
    K, N = codes.shape
    w = (codes.reshape(K // 32, 32, N).astype(np.float64) * d.astype(np.float64)[:, None]
         + m.astype(np.float64)[:, None])
    return w.reshape(K, N)


def test_the_kernel_builds_here():
    assert cpu_ffi.available("q4_matmul")


@pytest.mark.parametrize("T", [1, 2, 3, 4, 5, 8, 12, 13, 33, 130])
@pytest.mark.parametrize("K,N", [(32, 16), (96, 48), (576, 960), (1536, 32)])
def test_q4_matmul_matches_reference(T, K, N):
    rng = np.random.default_rng(T * 1000 + K + N)
    codes, d, m = weight(rng, K, N)
    x = rng.standard_normal((T, K)).astype(np.float32)
    got = np.asarray(jax.jit(q4_matmul)(x, *pack_panels(codes, d, m)))
    np.testing.assert_array_equal(got, np.asarray(q4_matmul_reference(x, codes, d, m)))
    # rounding x to int16 per 32 values moves the float64 product by under 0.01% of its range
    # (int8 activations moved it by up to 1%)
    exact = x.astype(np.float64) @ dense(codes, d, m)
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-4 * np.abs(exact).max())


def test_a_row_does_not_depend_on_the_rows_beside_it():
    rng = np.random.default_rng(7)
    packed = pack_panels(*weight(rng, 1536, 64))
    x = (rng.standard_normal((40, 1536)) * rng.random((40, 1))).astype(np.float32)
    together = np.asarray(q4_matmul(x, *packed))
    for rows in [slice(3, 4), slice(0, 5), slice(10, 17), slice(1, 40)]:
        np.testing.assert_array_equal(np.asarray(q4_matmul(x[rows], *packed)), together[rows])


def test_zero_and_non_finite_rows():
    rng = np.random.default_rng(3)
    codes, d, m = weight(rng, 64, 32)
    x = rng.standard_normal((9, 64)).astype(np.float32)
    x[1] = 0.0
    x[4, 5] = np.nan
    x[7, 60] = -np.inf
    got = np.asarray(q4_matmul(x, *pack_panels(codes, d, m)))
    assert (got[1] == 0).all()
    assert np.isnan(got[4]).all() and np.isnan(got[7]).all()
    ok = [0, 2, 3, 5, 6, 8]
    np.testing.assert_array_equal(got[ok], np.asarray(q4_matmul_reference(x[ok], codes, d, m)))


@pytest.mark.parametrize("T,K,N", [(1, 64, 32), (7, 576, 96), (37, 1536, 48)])
def test_float32_scales_and_offsets(T, K, N):
    rng = np.random.default_rng(T)
    codes, d, m = weight(rng, K, N)
    d32, m32 = q4_k_scales(rng, d, m)
    packed = pack_panels(codes, d32, m32)
    assert packed[1].dtype == packed[2].dtype == jnp.float32
    x = (rng.standard_normal((T, K)) * rng.random((T, 1))).astype(np.float32)
    got = np.asarray(jax.jit(q4_matmul)(x, *packed))
    np.testing.assert_array_equal(got, np.asarray(q4_matmul_reference(x, codes, d32, m32)))
    for r in {0, T // 2, T - 1}:
        np.testing.assert_array_equal(np.asarray(q4_matmul(x[r:r + 1], *packed)), got[r:r + 1])
    exact = x.astype(np.float64) @ dense(codes, d32, m32)
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-4 * np.abs(exact).max())


def test_float16_scales_give_the_same_bits_as_float32():
    rng = np.random.default_rng(4)
    codes, d, m = weight(rng, 576, 64)
    x = rng.standard_normal((9, 576)).astype(np.float32)
    half = pack_panels(codes, d, m)
    assert half[1].dtype == half[2].dtype == jnp.float16
    want = np.asarray(q4_matmul(x, *half))
    for scales in [(d.astype(np.float32), m.astype(np.float32)), (d, m.astype(np.float32))]:
        single = pack_panels(codes, *scales)  # not both float16: both float32
        assert single[1].dtype == single[2].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(q4_matmul(x, *single)), want)
    back = unpack_panels(*pack_panels(codes, d.astype(np.float32), m.astype(np.float32)))
    np.testing.assert_array_equal(np.asarray(back[1]), d.astype(np.float32))


def test_the_kernel_refuses_mixed_scale_types():
    rng = np.random.default_rng(6)
    codes, d, m = weight(rng, 64, 16)
    packed, dp, mp = pack_panels(codes, d, m)
    with pytest.raises(Exception, match="both float16 or both float32"):
        q4_matmul(np.ones((1, 64), np.float32), packed, dp, mp.astype(jnp.float32))


def test_fma_chain_rounds_once_per_step():
    """Against exact rational arithmetic, on sums that cancel, where rounding the product
    first gives other bits, and on one that rounding in float64 first would put on a float32
    halfway point."""
    from fractions import Fraction
    rng = np.random.default_rng(0)
    a = rng.integers(-2**24, 2**24, (3, 500)).astype(np.float32)
    b = (rng.standard_normal((3, 500)) * 1e-6).astype(np.float32)
    b[1] = -b[0] * a[0] / a[1]  # the second product nearly cancels the first
    # 1 + 62525 * 17173 * 2^-54 = 1 + 2^-24 + 2^-54: just above halfway to 1 + 2^-23,
    # exactly halfway once rounded to float64 (and then to even: 1)
    a[:, 0], b[:, 0] = [1, 62525, 0], [1, np.ldexp(17173.0, -54), 0]
    got = np.asarray(fma_chain(a, b))
    assert got[0] == np.float32(1 + 2**-23)

    def rounded(v: Fraction) -> np.float32:
        f = np.float32(float(v))
        near = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
        return min(near, key=lambda c: (abs(Fraction(float(c)) - v), int(c.view(np.uint32)) & 1))

    for i in range(a.shape[1]):
        y = np.float32(0)
        for s in range(3):
            y = rounded(Fraction(float(a[s, i])) * Fraction(float(b[s, i])) + Fraction(float(y)))
        assert got[i].view(np.uint32) == y.view(np.uint32), i


def test_leading_axes_and_dtype():
    rng = np.random.default_rng(1)
    codes, d, m = weight(rng, 64, 32)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.bfloat16)
    got = q4_matmul(x, *pack_panels(codes, d, m))
    assert got.shape == (2, 3, 32) and got.dtype == jnp.bfloat16


def test_panels_round_trip_and_layout():
    rng = np.random.default_rng(2)
    codes, d, m = weight(rng, 64, 32)
    packed, dp, mp = pack_panels(codes, d, m)
    assert packed.shape == codes.shape and packed.dtype == jnp.uint4
    for got, want in zip(unpack_panels(packed, dp, mp), (codes, d, m)):
        np.testing.assert_array_equal(np.asarray(got), want)
    # byte [panel][group][h][column][i]: low nibble k = 4h + i, high nibble k = 16 + 4h + i
    flat = np.asarray(packed.astype(jnp.uint8)).reshape(2, 2, 4, 16, 4, 2)
    assert flat[1, 0, 2, 3, 1, 0] == codes[9, 16 + 3]
    assert flat[0, 1, 3, 7, 2, 1] == codes[32 + 16 + 14, 7]
    assert np.asarray(dp)[1, 1, 5] == d[1, 16 + 5]
    # Concrete weights are packed by numpy, traced ones by jnp: the same arrays either way.
    for a, b in zip(jax.jit(pack_panels)(codes, jnp.asarray(d, jnp.bfloat16), m),
                    pack_panels(codes, jnp.asarray(d, jnp.bfloat16), m)):
        assert isinstance(b, jax.Array) and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                      np.asarray(b.astype(jnp.float32)))


def test_int4_gives_back_q4_1_weights_exactly():
    """Weights that already are d * code + m with float16 d and m (a Q4_1 file's, as the demo
    model's layers are) quantize to their own codes, scales and offsets."""
    rng = np.random.default_rng(5)
    codes, d, m = weight(rng, 128, 48)
    codes[0] = 0  # every group spans the whole range, as Q4_1's quantizer makes it
    codes[31] = codes[63] = codes[95] = codes[127] = 15
    codes[32] = codes[64] = codes[96] = 0
    w = dense(codes, d, m).astype(np.float32)
    q = quantize_int4(w)
    np.testing.assert_array_equal(np.asarray(q.values.astype(jnp.uint8)), codes)
    np.testing.assert_array_equal(np.asarray(q.scale), d)
    np.testing.assert_array_equal(np.asarray(q.zero), m)
    np.testing.assert_array_equal(np.asarray(dequantize_int4(q)), w)
    # any other weight: within half a step of its group
    other = rng.standard_normal((64, 16)).astype(np.float32)
    q = quantize_int4(other)
    step = np.repeat(np.asarray(q.scale, np.float32), 32, axis=0)
    assert (np.abs(np.asarray(dequantize_int4(q)) - other) <= 0.5 * step + 1e-3).all()


def test_recipe_int4_and_its_errors():
    r = Recipe.parse("int4:lm_head")
    assert (r.scheme, r.granularity, r.lm_head, r.spec) == ("int4", "group", True, "int4:lm_head")
    assert Recipe.parse(r.spec) == r
    for bad in ("int4:channel", "int8:group"):
        with pytest.raises(ValueError, match="per group of 32"):
            Recipe.parse(bad)
    odd = ModelConfig("LlamaForCausalLM", vocab_size=112, hidden_size=48, intermediate_size=96,
                      num_layers=1, num_heads=4, num_kv_heads=2, head_dim=12,
                      tie_word_embeddings=True, sliding_windows=(0,))
    with pytest.raises(ValueError, match="groups of 32"):
        quantize_params(init_params(odd), "int4")


@pytest.mark.parametrize("tied", [True, False])
def test_int4_model_runs_the_kernel_with_the_logits_of_its_weights(tied):
    cfg = cfg_for(tied, vocab=112)
    params = quantize_params(init_params(cfg), "int4:lm_head")
    assert describe(params).startswith("int4 per group of 32 + int8 per channel")
    run = prepare_params(params)
    kinds = [type(a) for a in jax.tree.leaves(
        run, is_leaf=lambda a: isinstance(a, (PackedQ4, PackedQ8)))]
    assert kinds.count(PackedQ4) == 4 * cfg.num_layers  # qkv, o, gate_up, down
    assert isinstance(run["lm_head"]["kernel"], PackedQ8)
    # the reference path (no kernel: dequantized weights in XLA's dot) gives the same logits
    # up to the kernel's rounding of x to int8 per 32 values
    plain = prepare_params(params, pack=False)
    assert isinstance(plain["layers"][0]["mlp"]["gate_up_proj"]["kernel"], Int4Array)
    got, want = logits(cfg, run), logits(cfg, plain)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())
    assert not np.array_equal(got, want)  # the kernel did run


def test_an_int4_checkpoint_loads_as_it_was_quantized(tmp_path):
    from model.checkpoint import convert_hf, load_model
    from tests.hf_tiny import tiny_hf_model
    tiny_hf_model("llama", tmp_path / "hf", hidden_size=64, intermediate_size=96,
                  num_attention_heads=4, head_dim=16, vocab_size=224)
    convert_hf(tmp_path / "hf", tmp_path / "ckpt", "float32", progress=False,
               quantize="int4:lm_head")
    _, stored = load_model(tmp_path / "ckpt", None, progress=False)
    _, direct = load_model(tmp_path / "hf", None, progress=False, quantize="int4:lm_head")
    assert describe(stored) == describe(direct)
    for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(direct)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_int4_splits_between_devices_in_whole_groups():
    from model.sharding import _cut
    w = quantize_int4(np.random.default_rng(0).standard_normal((128, 32)).astype(np.float32))
    rows = _cut(w, -2, 64, 128)  # row-parallel: the second half of the inputs
    np.testing.assert_array_equal(np.asarray(dequantize_int4(rows)),
                                  np.asarray(dequantize_int4(w))[64:])
    cols = _cut(w, -1, 16, 32)
    np.testing.assert_array_equal(np.asarray(dequantize_int4(cols)),
                                  np.asarray(dequantize_int4(w))[:, 16:])
    with pytest.raises(ValueError, match="groups of 32"):
        _cut(w, -2, 0, 48)
