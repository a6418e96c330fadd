"""quant/: round-trip error bounds, quantized matmul = matmul of dequantized weights, recipes,
QuantArray as a Flax parameter, quantized KV cache, and the XLA fp8 GEMM pattern."""
import re
from pathlib import Path

from flax import errors as flax_errors
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.batch import sequences_batch
from model.config import ModelConfig
from model.kv_cache import KVCache, bytes_per_page, write_kv
from model.layers import Linear
from model.transformer import forward, init_params
from pallas_kernels.ragged_paged_attention import ragged_paged_attention_reference
from quant.array import QuantArray, dequantize, quantize
from quant.ops import fp8_matmul, matmul, quantize_activations, take
from quant.recipe import Recipe, abstract_quantized, describe, from_metadata, quantize_params

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py

FP8 = jnp.float8_e4m3fn


def weights(shape, seed=0):
    """Normal weights with a few large outliers and one all-zero column."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.05, shape).astype(np.float32)
    w.reshape(-1)[rng.choice(w.size, 8, replace=False)] *= 40
    w[..., 3] = 0
    return w


def test_int8_round_trip_is_within_half_a_step_per_channel():
    w = weights((96, 40))
    q = quantize(w, jnp.int8, axes=(-2,))
    assert q.values.dtype == jnp.int8 and q.scale.shape == (1, 40)
    np.testing.assert_allclose(q.scale[0], np.where(np.abs(w).max(0) > 0,
                                                    np.abs(w).max(0) / 127, 1), rtol=1e-6)
    err = np.abs(np.asarray(dequantize(q)) - w)
    assert (err <= 0.5 * np.asarray(q.scale) * (1 + 1e-5)).all()
    assert np.abs(np.asarray(q.values)).max() == 127  # the full range is used
    assert (np.asarray(q.values)[:, 3] == 0).all() and float(q.scale[0, 3]) == 1.0


@pytest.mark.parametrize("axes", [(-2,), (-2, -1), (-1,)])
def test_fp8_round_trip_is_within_half_an_ulp(axes):
    w = weights((64, 48), seed=1)
    q = quantize(w, FP8, axes=axes)
    scale = np.asarray(q.scale)
    assert q.values.dtype == FP8
    assert np.all(np.log2(scale) == np.round(np.log2(scale)))  # powers of two
    vals = np.abs(np.asarray(q.values, np.float32))
    assert vals.max() <= 448 and np.isfinite(vals).all()
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormal step 2^-9.
    err = np.abs(np.asarray(dequantize(q)) - w)
    bound = np.maximum(2.0 ** -4 * np.abs(w), 2.0 ** -10 * scale) * (1 + 1e-6)
    assert (err <= bound).all()
    rel = np.linalg.norm(np.asarray(dequantize(q)) - w) / np.linalg.norm(w)
    assert rel < 0.04


def test_layer_stacked_scales_are_per_layer():
    w = np.stack([weights((32, 16), seed=s) * (s + 1) for s in range(3)])  # [L, in, out]
    per_tensor = quantize(w, FP8, axes=(-2, -1))
    per_channel = quantize(w, jnp.int8, axes=(-2,))
    assert per_tensor.scale.shape == (3, 1, 1) and per_tensor.per_tensor
    assert per_channel.scale.shape == (3, 1, 16) and not per_channel.per_tensor
    assert per_tensor.nbytes == w.size + 3 * 4


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("storage", [jnp.int8, FP8])
def test_per_channel_matmul_equals_matmul_of_dequantized(storage, dtype):
    w, x = weights((96, 40)), np.random.default_rng(2).normal(size=(5, 96)).astype(np.float32)
    q = quantize(w, storage, axes=(-2,))
    x = jnp.asarray(x, dtype)
    got = jax.jit(matmul)(x, q)
    want = jnp.matmul(x.astype(jnp.float32), dequantize(q), precision="highest")
    assert got.dtype == dtype and got.shape == (5, 40)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fp8_per_tensor_matmul_is_the_matmul_of_both_dequantized_operands(dtype):
    w, x = weights((96, 40)), np.random.default_rng(3).normal(size=(7, 96)).astype(np.float32)
    q = quantize(w, FP8, axes=(-2, -1))
    x = jnp.asarray(x, dtype)
    got = jax.jit(matmul)(x, q)
    xq, xs = quantize_activations(x)
    assert xq.dtype == FP8 and xs.shape == ()
    a = xq.astype(jnp.float32) * xs
    want = jnp.matmul(a, dequantize(q), precision="highest")
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol)
    # ... and close to the unquantized product.
    exact = np.asarray(x, np.float32) @ w
    assert np.linalg.norm(np.asarray(got, np.float32) - exact) / np.linalg.norm(exact) < 0.06


def test_fp8_matmul_is_written_in_xlas_fp8_gemm_pattern():
    """Both operands: fp8 -> convert -> multiply by a broadcast scalar -> dot (the cuBLASLt
    fp8 rewrite's pattern, docs/architecture.md, "Quantization"); nothing per channel in between."""
    q = quantize(weights((64, 32)), FP8, axes=(-2, -1))
    x = jnp.ones((4, 64), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(fp8_matmul)(x, q).jaxpr
    dot = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dot) == 1
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    for operand in dot[0].invars:
        mul = producers[operand]
        assert mul.primitive.name == "mul"
        conv, scale = (producers.get(v) for v in mul.invars)
        assert conv.primitive.name == "convert_element_type"
        assert conv.invars[0].aval.dtype == FP8 and conv.outvars[0].aval.dtype == jnp.bfloat16
        # the scale: a scalar (possibly converted) broadcast to the operand's shape
        while scale is not None and scale.primitive.name in ("broadcast_in_dim",
                                                             "convert_element_type"):
            if scale.primitive.name == "broadcast_in_dim":
                assert scale.invars[0].aval.shape == ()
            scale = producers.get(scale.invars[0])
        assert dot[0].outvars[0].aval.dtype == jnp.bfloat16


def test_int8_matmul_converts_the_weight_then_dots():
    q = quantize(weights((64, 32)), jnp.int8, axes=(-2,))
    jaxpr = jax.make_jaxpr(matmul)(jnp.ones((4, 64), jnp.bfloat16), q).jaxpr
    names = [e.primitive.name for e in jaxpr.eqns]
    dot = jaxpr.eqns[names.index("dot_general")]
    conv = {v: e for e in jaxpr.eqns for v in e.outvars}[dot.invars[1]]
    assert conv.primitive.name == "convert_element_type"
    assert conv.invars[0].aval.dtype == jnp.int8 and conv.invars[0].aval.shape == (64, 32)
    assert names.index("mul") > names.index("dot_general")  # the scale is on the output


@pytest.mark.parametrize("axes", [(-1,), (-2, -1)])
def test_quantized_embedding_lookup_and_tied_head(axes):
    table = weights((50, 24))
    q = quantize(table, jnp.int8, axes=axes)
    ids = jnp.asarray([0, 7, 7, 49], jnp.int32)
    np.testing.assert_allclose(take(q, ids, jnp.float32), np.asarray(dequantize(q))[ids],
                               rtol=1e-6)
    x = jnp.asarray(np.random.default_rng(4).normal(size=(3, 24)), jnp.float32)
    np.testing.assert_allclose(matmul(x, q.T), np.asarray(x) @ np.asarray(dequantize(q)).T,
                               rtol=1e-5, atol=1e-5)


def test_quant_array_stands_in_for_a_flax_param_of_its_logical_shape():
    x = jnp.ones((2, 16))
    good = {"kernel": quantize(weights((16, 8)), jnp.int8, axes=(-2,))}
    y = Linear(8).apply({"params": good}, x)
    np.testing.assert_allclose(y, x @ dequantize(good["kernel"]), rtol=1e-5)
    bad = {"kernel": quantize(weights((16, 9)), jnp.int8, axes=(-2,))}
    with pytest.raises(flax_errors.ScopeParamShapeError):
        Linear(8).apply({"params": bad}, x)


def test_recipe_specs_and_metadata():
    assert Recipe.parse("int8") == Recipe("int8", "channel")
    assert Recipe.parse("fp8") == Recipe("fp8", "tensor")
    assert Recipe.parse("fp8").activations == "fp8"
    r = Recipe.parse("fp8:channel,embed")
    assert (r.granularity, r.embed, r.lm_head, r.activations) == ("channel", True, False, "none")
    assert Recipe.parse(r.spec) == r and Recipe.parse("int8").spec == "int8"
    assert from_metadata(r.to_dict()) == r and from_metadata("none") is None
    for bad in ("int2", "int8:rows", "fp8:channel,tensor", "int4:tensor"):
        with pytest.raises(ValueError):
            Recipe.parse(bad)


def tiny_cfg(tied: bool, dtype="float32") -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", vocab_size=97, hidden_size=64, intermediate_size=96,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                       tie_word_embeddings=tied, sliding_windows=(0, 0), dtype=dtype)


@pytest.fixture(scope="module")
def tied():
    return init_params(tiny_cfg(True))


@pytest.fixture(scope="module")
def untied():
    return init_params(tiny_cfg(False))


def kinds(params):
    flat = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda a: isinstance(a, QuantArray))[0]
    return {"/".join(p.key for p in path): isinstance(a, QuantArray) for path, a in flat}


def test_recipe_picks_the_linear_layers_and_optionally_embeddings(tied, untied):
    k = kinds(quantize_params(untied, "int8"))
    assert all(k[f"layers/{m}/{n}_proj/kernel"] for m, ns in
               (("attn", "qkvo"), ("mlp", ("gate", "up", "down"))) for n in ns)
    assert not any(v for name, v in k.items() if "kernel" not in name)
    assert not k["lm_head/kernel"] and not k["embed"]
    k = kinds(quantize_params(untied, "int8:lm_head"))
    assert k["lm_head/kernel"] and not k["embed"]
    k = kinds(quantize_params(untied, "int8:embed"))
    assert k["embed"] and not k["lm_head/kernel"]
    assert kinds(quantize_params(tied, "fp8:lm_head"))["embed"]  # one table, both uses
    with pytest.raises(ValueError, match="already quantized"):
        quantize_params(quantize_params(tied, "int8"), "int8")


def test_abstract_quantized_matches_quantize_params(tied):
    params = tied
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
    got = abstract_quantized(abstract, "fp8:embed")
    want = jax.eval_shape(lambda p: p, quantize_params(params, "fp8:embed"))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert jax.tree.leaves(got) == jax.tree.leaves(want)
    assert describe(quantize_params(params, "int8")).startswith("int8 per channel, 7 of")


_forward = jax.jit(forward, static_argnames=("cfg", "backend"))


def run_model(cfg, params, kv_cache_dtype=None):
    tokens = [[5, 9, 11, 3, 40, 2, 7, 60, 1, 4, 8, 90], [3, 1, 4, 1, 5, 9, 2, 6]]
    table = np.asarray([[1, 2], [3, 4]], np.int32)
    batch = sequences_batch(tokens, table, 8)
    cache = KVCache.zeros(cfg, 5, 8, kv_cache_dtype)
    return np.asarray(_forward(params, cache, batch, cfg)[0])


@pytest.mark.parametrize("spec", ["int8", "fp8", "fp8:channel", "int8:embed,lm_head"])
def test_quantized_model_forward_is_close_to_float(spec, tied, untied):
    tie = spec != "int8:embed,lm_head"
    cfg, params = tiny_cfg(tie), tied if tie else untied
    want, got = run_model(cfg, params), run_model(cfg, quantize_params(params, spec))
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.06


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_kv_cache_write_and_attention(kv, tied):
    cfg = tiny_cfg(True)
    cache = KVCache.zeros(cfg, 4, 8, kv)
    assert cache.k.dtype == {"int8": jnp.int8, "fp8": FP8}[kv]
    assert cache.k_scale.shape == (2, 4, 8, 2) and cache.k_scale.dtype == jnp.float32
    plain = KVCache.zeros(cfg, 4, 8)
    rng = np.random.default_rng(5)
    T = 11
    k, v, q = (jnp.asarray(rng.normal(size=s), jnp.float32)
               for s in ((T, 2, 16), (T, 2, 16), (T, 4, 16)))
    slots = jnp.asarray(8 + np.arange(T), jnp.int32)  # pages 1 and 2
    cache, plain = write_kv(cache, 1, k, v, slots), write_kv(plain, 1, k, v, slots)
    scale = np.asarray(cache.k_scale[1, 1:3, :, :, None]).reshape(16, 2, 1)[:T]
    deq = np.asarray(cache.k[1, 1:3], np.float32).reshape(16, 2, 16)[:T] * scale
    bound = (0.5 * scale if kv == "int8"
             else np.maximum(2.0 ** -4 * np.abs(np.asarray(k)), 2.0 ** -10 * scale))
    assert (np.abs(deq - np.asarray(k)) <= bound * (1 + 1e-5)).all()
    args = (1, jnp.arange(T, dtype=jnp.int32), jnp.zeros(T, jnp.int32),
            jnp.asarray([[1, 2]], jnp.int32), 0, 0.25)
    got = ragged_paged_attention_reference(q, cache.k, cache.v, *args, cache.k_scale,
                                           cache.v_scale)
    want = ragged_paged_attention_reference(q, plain.k, plain.v, *args)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.04
    # the model runs on it too
    ref, out = run_model(cfg, tied), run_model(cfg, tied, kv)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 0.03


def test_kv_bytes_per_page_counts_scales():
    cfg = tiny_cfg(True)  # 2 layers, 2 kv heads of 16, float32
    assert bytes_per_page(cfg, 8) == 2 * 2 * 8 * 32 * 4
    assert bytes_per_page(cfg, 8, "auto") == bytes_per_page(cfg, 8)
    assert bytes_per_page(cfg, 8, "int8") == 2 * 2 * 8 * (32 + 2 * 4)
    assert bytes_per_page(cfg, 8, "fp8") == bytes_per_page(cfg, 8, "int8")
    cache = KVCache.zeros(cfg, 3, 8, "fp8")
    assert sum(a.nbytes for a in jax.tree.leaves(cache)) == 3 * bytes_per_page(cfg, 8, "fp8")


def test_dummy_weights_quantize_for_benchmarks(tmp_path):
    from serving.core.config import EngineConfig
    from serving.engine.model_files import load_weights
    cfg = tiny_cfg(False)
    hf = {"architectures": [cfg.architecture], "vocab_size": cfg.vocab_size,
          "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
          "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
          "num_key_value_heads": cfg.num_kv_heads, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(__import__("json").dumps(hf))
    for spec, scheme in (("int8", "int8 per channel"), ("fp8", "fp8 per tensor")):
        got_cfg, params = load_weights(tmp_path, EngineConfig(
            model=str(tmp_path), load_format="dummy", quantize=spec))
        assert got_cfg.dtype == "bfloat16"
        assert describe(params).startswith(scheme + ", 7 of")


GPU_HLO = Path(__file__).parent / "data" / "gpu_hlo"


def captured(name: str) -> str:
    """A module jaxlib 0.11.2 compiled for an H200 (scripts/capture_gpu_hlo.py)."""
    return (GPU_HLO / f"{name}.hlo.txt").read_text()


@pytest.mark.parametrize("m", [1, 64])
def test_hlo_classification_of_captured_gpu_modules(m):
    """XLA's own output: int8 and fp8 per channel convert inside the Triton GEMM; fp8 per
    tensor, when the cuBLASLt fp8 rewrite does not apply, widens the weights in a fusion of
    its own first (and the activations' fp8 rounding is simplified away)."""
    from quant.hlo import classify
    assert classify(captured(f"bf16_m{m}")) == "triton"
    assert classify(captured(f"int8_channel_m{m}")) == "triton, convert fused"
    assert classify(captured(f"fp8_channel_m{m}")) == "triton, convert fused"
    assert classify(captured(f"fp8_tensor_m{m}")) == "triton + separate convert"
    # The name the classifier once looked for is not what this XLA writes.
    assert '"kind":"__triton_gemm"' not in captured(f"int8_channel_m{m}")


def test_hlo_classification_of_cublas_choices():
    """A GEMM autotuning sends to cuBLAS (only a GPU autotunes: built from the captured module
    by replacing its Triton fusion with the custom call XLA writes)."""
    from quant.hlo import classify
    text = captured("fp8_tensor_m64")
    cublas = re.sub(r"fusion\(([^)]*)\), kind=kCustom, calls=%gemm_fusion_dot_computation.*",
                    r'custom-call(\1), custom_call_target="__cublas$gemm"', text)
    assert "__triton" not in cublas
    assert classify(cublas) == "cublas + separate convert"
    assert classify('custom_call_target="__cublas$lt$matmul$f8"') == "cublasLt fp8"


def test_per_tensor_projections_join_exactly_for_cpu_kernels_and_at_the_max_scale_elsewhere():
    """q/k/v quantized per tensor, each with its own scale: joined with per-channel scales
    (the same weights) where the CPU kernels run, and as vLLM joins them elsewhere: the codes
    dequantized and cast again to fp8 at the largest scale, so XLA's fp8 GEMM keeps one."""
    from model.runtime_params import _join_projections
    rng = np.random.default_rng(7)
    parts = {p: quantize(rng.normal(0, s, (32, n)).astype(np.float32), FP8, (-2, -1))
             for p, s, n in (("q_proj", 0.5, 32), ("k_proj", 0.05, 16), ("v_proj", 3.0, 16))}
    layer = {"attn": {p: {"kernel": q} for p, q in parts.items()}, "mlp": {
        p: {"kernel": jnp.ones((32, 8))} for p in ("gate_proj", "up_proj")}}
    want = np.concatenate([np.asarray(dequantize(q)) for q in parts.values()], axis=-1)
    exact = _join_projections(layer, exact=True)["attn"]["qkv_proj"]["kernel"]
    assert exact.scale.shape == (1, 64)
    np.testing.assert_array_equal(np.asarray(dequantize(exact)), want)
    one = _join_projections(layer, exact=False)["attn"]["qkv_proj"]["kernel"]
    assert one.per_tensor
    top = max(float(q.scale.reshape(())) for q in parts.values())
    assert float(one.scale.reshape(())) == top
    again = np.clip(want / np.float32(top), -448, 448).astype(FP8)  # vLLM's scaled_fp8_quant
    np.testing.assert_array_equal(np.asarray(one.values).view(np.uint8), again.view(np.uint8))
