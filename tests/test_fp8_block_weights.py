"""fp8 weights with block scales (DeepSeek-V3's 128 x 128) served as fp8, never widened
(quant/fp8_blocks.py): the form's dequantization is the format's own; the CPU kernel
(cpu/fp8_block_matmul.cc) gives its written-out order bit for bit on shapes with partial
blocks, a row the same bits alone and in batches, experts through its grouped form; the
matmul lowered for CUDA dots fp8 codes up to 64 rows; tensor parallel cuts whole blocks or
says why not; the `fp8:block` recipe quantizes as DeepSeek does; a checkpoint folder served
through `LLM` keeps fp8 on the device and gives the tokens of its dequantized weights."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import sharding
from model.runtime_params import _join_projections
from pallas_kernels import cpu_build
from pallas_kernels.fp8_block_matmul_cpu import (column_scales, fp8_block_matmul,
                                                 fp8_block_matmul_reference, pack_panels)
from pallas_kernels.grouped_matmul_cpu import grouped_matmul_reference
from quant import ops, packed, packed_experts
from quant.fp8_blocks import (Fp8BlockArray, fp8_block_dot, quantize_activations,
                              quantize_fp8_blocks)
from quant.int4 import is_quantized
from quant.recipe import describe, quantize_params
from tests.quantized_tiny import OPTIONS, PROMPTS, dequantized_folder, fp8_blocks, \
    write_fp8_from_folder

FP8 = np.dtype(jnp.float8_e4m3fn)


def block_weight(k, n, block=(128, 128), experts=None, seed=0) -> Fp8BlockArray:
    """Random codes over the whole fp8 range and scales spread over three binades, [in, out]
    (with a leading expert axis when `experts`)."""
    rng = np.random.default_rng(seed)
    lead = () if experts is None else (experts,)
    codes = (rng.standard_normal((*lead, k, n)) * 60).clip(-448, 448).astype(FP8)
    scale = (2.0 ** rng.uniform(-12, -9, (*lead, -(-k // block[0]), -(-n // block[1])))
             ).astype(np.float32)
    return Fp8BlockArray(codes, scale, block)


def u32(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.jax_cache
@pytest.mark.parametrize("k,n,block", [(300, 200, (128, 128)), (64, 96, (32, 64)),
                                       (129, 5, (128, 128))])
def test_dequantize_is_the_formats_own(k, n, block):
    """HF's W[o, i] = weight[o, i] * scale_inv[o // bn, i // bk] (float32, partial last
    blocks), transposed, rounded once to the dtype asked for."""
    w = block_weight(k, n, block)
    hf_scale = w.scale.T  # [out blocks, in blocks]
    full = np.repeat(np.repeat(hf_scale, block[1], 0), block[0], 1)[:n, :k]
    want = (w.values.T.astype(np.float32) * full).T
    assert is_quantized(w) and w.shape == (k, n)
    np.testing.assert_array_equal(np.asarray(w.dequantize()), want)
    np.testing.assert_array_equal(np.asarray(w.dequantize(jnp.bfloat16)),
                                  np.asarray(jnp.asarray(want).astype(jnp.bfloat16)))
    tree = ops.dequantize_tree({"a": {"kernel": w}, "b": np.ones(2, np.float32)})
    np.testing.assert_array_equal(np.asarray(tree["a"]["kernel"]), want)


@pytest.mark.jax_cache
def test_recipe_quantizes_each_block_by_its_amax_over_448():
    """`fp8:block`: scale = amax / 448 per 128 x 128 block (to within the one float32 ulp by
    which XLA:CPU's division, not correctly rounded, can differ from the checkpoint
    writer's), values rounded to nearest; the layers only (the embedding and head per row,
    as every recipe)."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((300, 200)) * 0.05).astype(np.float32)
    w[:128, :128] = 0  # a block of zeros: scale 1
    q = quantize_fp8_blocks(w)
    _, scale = fp8_blocks(w.T, 128, 128)  # the checkpoint writer's own, [out, in]
    np.testing.assert_allclose(np.asarray(q.scale), scale.T, rtol=2.0 ** -23, atol=0)
    assert float(q.scale[0, 0]) == 1.0
    full = np.repeat(np.repeat(np.asarray(q.scale), 128, 0), 128, 1)[:300, :200]
    np.testing.assert_array_equal(np.asarray(q.values).view(np.uint8),
                                  (w / full).astype(FP8).view(np.uint8))
    params = {"embed": w, "layers": {"mlp": {"up_proj": {"kernel": np.stack([w, w])}}}}
    out = quantize_params(params, "fp8:block")
    assert isinstance(out["layers"]["mlp"]["up_proj"]["kernel"], Fp8BlockArray)
    assert out["embed"] is w
    assert describe(out).startswith("fp8 with 128x128 block scales, 1 of 2")


SHAPES = [(1, 128, 16), (5, 300, 37), (13, 256, 211), (64, 129, 33), (7, 40, 5)]


@pytest.mark.jax_cache
@pytest.mark.parametrize("t,k,n", SHAPES)
def test_kernel_is_its_written_order_bit_for_bit(t, k, n):
    """Each k-block of 128 summed alone (FMA chain, k ascending), times its scale, the blocks
    added in order (one FMA each): in/out not multiples of 128, a last block partial."""
    w = block_weight(k, n, seed=t)
    x = jnp.asarray(np.random.default_rng(t).standard_normal((t, k)), jnp.float32)
    got = ops.matmul(x, packed.pack_fp8_blocks(w))
    scale = column_scales(w.scale, 128, n)
    want = fp8_block_matmul_reference(x, w.values, scale, 128)
    np.testing.assert_array_equal(u32(got), u32(want))
    exact = np.asarray(x, np.float64) @ np.asarray(w.dequantize(), np.float64)
    np.testing.assert_allclose(np.asarray(got), exact, rtol=1e-4, atol=1e-4)


@pytest.mark.jax_cache
def test_a_rows_result_does_not_depend_on_its_batch():
    """One row alone, and at the start, middle and end of 1-, 16- and 64-row batches: the
    same bits (the single kernel and the grouped one)."""
    w = block_weight(300, 200, seed=3)
    w_packed = packed.pack_fp8_blocks(w)
    experts = packed_experts.pack(Fp8BlockArray(np.stack([w.values] * 2),
                                                np.stack([w.scale] * 2), w.block))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((64, 300)), jnp.float32)
    for row in (0, 9, 63):
        alone = u32(ops.matmul(x[row:row + 1], w_packed))[0]
        for rows in (1, 16, 64):
            start = max(0, min(row - rows // 2, 64 - rows))
            batch = u32(ops.matmul(x[start:start + rows], w_packed))
            np.testing.assert_array_equal(batch[row - start], alone, err_msg=f"{row}/{rows}")
            sizes = jnp.asarray([row - start, start + rows - row], jnp.int32)
            grouped = u32(ops.grouped_matmul(x[start:start + rows], experts, sizes))
            np.testing.assert_array_equal(grouped[row - start], alone)


@pytest.mark.jax_cache
def test_grouped_kernel_gives_each_expert_its_rows():
    w = block_weight(200, 150, experts=4, seed=5)
    x = jnp.asarray(np.random.default_rng(6).standard_normal((40, 200)), jnp.float32)
    sizes = jnp.asarray([9, 0, 21, 6], jnp.int32)  # 4 rows past the groups: zeros
    experts = packed_experts.pack(w)
    assert experts.kind == "fp8_blocks" and experts.operands[0].dtype == FP8
    got = np.asarray(jax.jit(ops.grouped_matmul)(x, experts, sizes))
    scale = column_scales(w.scale, 128, 150)
    want = grouped_matmul_reference("fp8_blocks", x, sizes, w.values, scale, block=128)
    np.testing.assert_array_equal(u32(got), u32(want))
    assert not got[36:].any()


@pytest.mark.jax_cache
@pytest.mark.skipif("avx512f" not in cpu_build.cpu_signature(), reason="needs an AVX-512 CPU to "
                    "run both builds; tests/test_kernel_build.py compiles both anywhere")
def test_the_avx2_build_gives_the_same_bits(tmp_path):
    """6-row AVX2 tiles with their totals in memory against the 12-row AVX-512 tiles this CPU
    loads: the same FMAs per output."""
    import ctypes
    import shutil
    out = tmp_path / "fp8_block_matmul_avx2.so"
    subprocess.run([shutil.which("g++") or "g++", *cpu_build.FLAGS, "-mno-avx512f",
                    f"-I{jax.ffi.include_dir()}",
                    str(cpu_build.SOURCE_DIR / "fp8_block_matmul.cc"), "-o", str(out)],
                   check=True, capture_output=True)
    lib = ctypes.cdll.LoadLibrary(str(out))
    jax.ffi.register_ffi_target("test_fp8_block_matmul_avx2",
                                jax.ffi.pycapsule(lib.xlaserve_fp8_block_matmul), platform="cpu")
    for t, k, n in [(37, 300, 211), (13, 65, 37), (1, 256, 48)]:
        w = block_weight(k, n, seed=k)
        x = jnp.asarray(np.random.default_rng(n).standard_normal((t, k)), jnp.float32)
        scale = column_scales(w.scale, 128, n)
        panels = pack_panels(w.values)
        other = jax.ffi.ffi_call("test_fp8_block_matmul_avx2",
                                 jax.ShapeDtypeStruct((t, n), jnp.float32))(
            x, panels, scale.reshape(-1), block=np.int64(128))
        np.testing.assert_array_equal(u32(fp8_block_matmul(x, panels, scale, 128)), u32(other))


@pytest.mark.jax_cache
def test_without_the_kernel_a_cpu_dots_the_dequantized_weights():
    """The XLA form on a CPU (a traced tree, no kernel): the weights dequantized into the dot,
    as the format computes them; the GPU form's fp8 activations stay a GPU's."""
    w = block_weight(256, 48, seed=7)
    x = jnp.asarray(np.random.default_rng(8).standard_normal((3, 256)), jnp.float32)
    np.testing.assert_array_equal(u32(jax.jit(ops.matmul)(x, w)), u32(x @ w.dequantize()))


@pytest.mark.jax_cache
def test_the_gpu_form_is_fp8_activations_per_row_and_block():
    """fp8_block_dot: activations rounded to fp8 per row and 128 inputs (amax / 448), each
    block's product times both scales, the blocks summed."""
    w = block_weight(384, 40, seed=9)
    x = jnp.asarray(np.random.default_rng(10).standard_normal((5, 384)), jnp.float32)
    xq, xs = quantize_activations(x, 128)
    assert xq.dtype == FP8 and xs.shape == (5, 3, 1)
    a = (np.asarray(xq, np.float64) * np.asarray(xs, np.float64)).reshape(5, 384)
    want = a @ np.asarray(w.dequantize(), np.float64)
    np.testing.assert_allclose(np.asarray(fp8_block_dot(x, w)), want, rtol=1e-5, atol=1e-5)


def lowered_for_cuda(m: int) -> str:
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
    w = jax.eval_shape(quantize_fp8_blocks, jax.ShapeDtypeStruct((7168, 2048), jnp.float32))
    x = jax.ShapeDtypeStruct((m, 7168), jnp.bfloat16)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=dev)):
        return jax.jit(ops.matmul).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("m", [1, 16, 64])
def test_lowered_for_cuda_up_to_64_rows_the_dot_takes_fp8_codes(m):
    """DeepSeek-V3's 7168 x 2048: one dot batched over the 56 input blocks, both operands
    float8_e4m3fn, float32 out; the weights never converted."""
    text = lowered_for_cuda(m)
    dots = [l for l in text.splitlines() if "stablehlo.dot_general" in l]
    assert len(dots) == 1, dots
    assert (f"(tensor<{m}x56x128xf8E4M3FN>, tensor<56x128x2048xf8E4M3FN>) -> "
            f"tensor<56x{m}x2048xf32>") in dots[0]
    assert not re.search(r"convert %\w+ : \(tensor<7168x2048xf8E4M3FN>\)", text)


def test_lowered_for_cuda_more_rows_dequantize_into_the_dot():
    text = lowered_for_cuda(65)
    assert re.search(r"convert %\w+ : \(tensor<7168x2048xf8E4M3FN>\) -> tensor<7168x2048xf32>",
                     text)
    assert "(tensor<65x7168xbf16>, tensor<7168x2048xbf16>) -> tensor<65x2048xbf16>" in text


@pytest.mark.parametrize("m,gemm", [(1, "fp8 reduce"), (64, "triton fp8"),
                                    (1024, "triton + separate convert")])
def test_compiled_for_an_h200(m, gemm):
    """XLA:GPU's own output (scripts/capture_gpu_hlo.py, deviceless for an H200, 4096 x 14336):
    one row reads the fp8 weights once in a reduction, 64 rows make a Triton GEMM of fp8
    operands, 1024 rows a bfloat16 copy of the weights first."""
    from quant.hlo import classify
    text = (Path(__file__).parent / "data" / "gpu_hlo" / f"fp8_block_m{m}.hlo.txt").read_text()
    assert classify(text) == gemm


def test_tensor_parallel_cuts_whole_blocks_or_says_why():
    w = block_weight(300, 256, seed=11)
    half = sharding._cut(w, -1, 128, 256)  # column-parallel, the second 128-block
    np.testing.assert_array_equal(np.asarray(half.dequantize()),
                                  np.asarray(w.dequantize())[:, 128:])
    tail = sharding._cut(w, -2, 256, 300)  # row-parallel, the partial last block
    np.testing.assert_array_equal(np.asarray(tail.dequantize()),
                                  np.asarray(w.dequantize())[256:])
    with pytest.raises(ValueError, match=r"output_partition_size = 64 is not divisible by "
                                         r"weight quantization block_n = 128\. \(fp8 with "
                                         r"128x128 block scales of shape \(300, 256\)"):
        sharding._cut(w, -1, 64, 128)
    with pytest.raises(ValueError, match=r"input_size_per_partition = 150 .*block_k = 128"):
        sharding._cut(w, -2, 0, 150)


@pytest.mark.jax_cache
def test_projections_join_with_the_same_numbers():
    """q/k/v whose outputs are not in whole blocks join with scales per column."""
    parts = {p: block_weight(192, n, seed=n) for p, n in (("q_proj", 192), ("k_proj", 64),
                                                          ("v_proj", 64))}
    layer = {"attn": {p: {"kernel": w} for p, w in parts.items()}}
    joined = _join_projections(layer, exact=True)["attn"]["qkv_proj"]["kernel"]
    assert isinstance(joined, Fp8BlockArray) and joined.block == (128, 1)
    want = np.concatenate([np.asarray(w.dequantize()) for w in parts.values()], axis=-1)
    np.testing.assert_array_equal(np.asarray(joined.dequantize()), want)


MODELS = {  # family -> overrides: inputs and outputs in 128-blocks with partial last ones
    "llama": dict(hidden_size=192, intermediate_size=300, num_attention_heads=6,
                  num_key_value_heads=2, initializer_range=0.1),
    "qwen3_moe": dict(hidden_size=192, moe_intermediate_size=160),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from serving import LLM, SamplingParams
    from tests.hf_tiny import tiny_hf_model
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    made = {}

    def get(family):
        if family not in made:
            root = tmp_path_factory.mktemp(f"fp8-blocks-{family}")
            model = tiny_hf_model(family, root / "hf", seed=8, **MODELS[family])
            folder, expected = write_fp8_from_folder(root / "hf", root / "fp8")
            llm = LLM(str(folder), **OPTIONS)
            tokens = [r.token_ids for r in llm.generate(PROMPTS, params)]
            made[family] = (root, model, expected, llm.engine.runner.params, tokens)
        return made[family]
    return get


def kernels(params) -> dict[str, object]:
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda a: isinstance(
        a, (packed.PackedFp8Blocks, packed_experts.PackedExperts, packed.PackedDense)))[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): leaf
            for path, leaf in flat if getattr(path[-1], "key", None) == "kernel"}


def test_served_weights_stay_fp8_and_give_the_dequantized_models_tokens(served, tmp_path):
    """The old path, the weights dequantized at load into float32, as a float folder: the
    same greedy tokens, within the format's own numbers."""
    from serving import LLM, SamplingParams
    root, _, expected, params, tokens = served("llama")
    layers = {p: k for p, k in kernels(params).items() if p.startswith("layers/")}
    assert len(layers) == 3 * 4  # qkv, o, gate_up, down in each of 3 layers
    for path, k in layers.items():
        assert isinstance(k, packed.PackedFp8Blocks) and k.panels.dtype == FP8, path
        assert k.scale.dtype == np.float32 and k.block == 128
    float_folder = dequantized_folder(root / "hf", tmp_path / "dequantized", expected)
    old = LLM(str(float_folder), **OPTIONS).generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True))
    assert tokens == [r.token_ids for r in old]


def test_served_experts_stay_fp8_and_give_transformers_tokens(served):
    """Per-expert fp8 tensors stacked [E, in, out] in the form, on the grouped kernel; the
    tokens transformers gives on the dequantized weights."""
    import copy

    import torch

    from tests.hf_tiny import greedy_reference
    _, model, expected, params, tokens = served("qwen3_moe")
    found = kernels(params)
    experts = {p: k for p, k in found.items() if "/moe/" in p and "router" not in p}
    assert len(experts) == 3 * 2  # gate_up, down in each of 3 layers
    for path, k in experts.items():
        assert isinstance(k, packed_experts.PackedExperts), path
        assert k.kind == "fp8_blocks" and k.operands[0].dtype == FP8 and k.block == 128
    reference = copy.deepcopy(model)
    state = reference.state_dict()
    for name, w in expected.items():  # transformers holds gate and up of all experts fused
        m = re.fullmatch(r"(.*mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
        if m is None:
            state[name] = torch.from_numpy(w)
            continue
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj == "down":
            state[f"{prefix}.down_proj"][e] = torch.from_numpy(w)
        else:
            rows = slice(0, w.shape[0]) if proj == "gate" else slice(w.shape[0], None)
            state[f"{prefix}.gate_up_proj"][e, rows] = torch.from_numpy(w)
    reference.load_state_dict(state)
    assert tokens == [greedy_reference(reference, p, 10) for p in PROMPTS]
