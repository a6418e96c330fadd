"""The Pallas grouped matmul for GPUs (pallas_kernels/grouped_matmul_gpu.py): in interpret
mode it gives jax.lax.ragged_dot's result for any mix of group sizes (empty groups, one
group with every row, rows past the groups), and it lowers for CUDA through Triton. The MoE
block takes it for CUDA by default (quant/ops.py grouped_matmul), since XLA:GPU compiles
ragged_dot into a dense dot over every expert (quant/moe_hlo.py)."""
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul_gpu import block_dividing, fits, grouped_matmul, tile_visits
from quant import ops as quant_ops
from quant.array import quantize
from quant.moe_hlo import TRITON_CALL, compile_only_device, inspect, read
from tests.test_kernel_lowering import lower_for_cuda

pytestmark = pytest.mark.jax_cache  # tests/jax_cache.py

SDS = jax.ShapeDtypeStruct
SIZES = [[10, 0, 20, 5], [37, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 16, 16, 0],
         [3, 0, 0, 30]]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_ragged_dot_in_the_interpreter(dtype):
    rng = np.random.default_rng(0)
    M, K, N, E = 37, 64, 32, 4
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w = jnp.asarray(rng.standard_normal((E, K, N)), dtype)
    tol = 1e-5 if dtype == "float32" else 2e-2
    for sizes in SIZES:
        gs = jnp.asarray(sizes, jnp.int32)
        got = grouped_matmul(x, w, gs, block_m=16, block_n=16, block_k=16, interpret=True)
        want = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32).astype(dtype)
        assert got.dtype == x.dtype and got.shape == (M, N)
        scale = float(jnp.abs(want.astype(jnp.float32)).max()) or 1.0
        err = float(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)).max())
        assert err <= tol * scale, (sizes, err)
        past = sum(sizes)
        assert not np.asarray(got[past:].astype(jnp.float32)).any(), sizes  # zeros past


def test_tile_visits_cover_each_group_once():
    """A tile that straddles groups is visited once per group; empty visits cover nothing."""
    meta = np.asarray(tile_visits(jnp.asarray([10, 0, 20, 5], jnp.int32), 48, 16))
    visits = [tuple(meta[:, v]) for v in range(meta.shape[1])]
    assert visits[:5] == [(0, 0, 0, 10), (2, 0, 10, 30), (2, 1, 10, 30), (3, 1, 30, 35),
                          (3, 2, 30, 35)]
    assert all(lo == hi == 0 for _, _, lo, hi in visits[5:])
    covered = sorted(r for e, t, lo, hi in visits for r in range(16 * t, 16 * t + 16)
                     if lo <= r < hi)
    assert covered == list(range(35))


def test_lowers_for_cuda_at_a_qwen3_moe_shape():
    """Qwen3-30B-A3B's gate/up (2048 -> 2 x 768) over 128 experts, 64 tokens x top-8, bf16:
    one Triton kernel, no dense dot over the experts."""
    x, w = SDS((512, 2048), jnp.bfloat16), SDS((128, 2048, 1536), jnp.bfloat16)
    gs = SDS((128,), jnp.int32)
    text = lower_for_cuda(lambda a, b, c: grouped_matmul(a, b, c), x, w, gs).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1
    assert "ragged_dot" not in text and "stablehlo.dot_general" not in text


def test_tiles_shrink_to_fit_a_shard():
    """A tensor-parallel shard of an expert (Qwen3-30B-A3B's 768 over 8 GPUs: 96) takes 32-wide
    tiles; a width no power of two from 16 divides does not fit (ragged_dot then)."""
    assert block_dividing(96, 64) == 32 and block_dividing(2048, 64) == 64
    assert fits(96, 192) and not fits(2048, 100)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((24, 96)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 96, 48)), jnp.float32)
    gs = jnp.asarray([5, 0, 19], jnp.int32)
    got = grouped_matmul(x, w, gs, block_m=16, interpret=True)
    want = jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("quantized", [False, True])
def test_moe_backends_agree_on_a_cpu(quantized):
    """quant.ops.grouped_matmul: "pallas" (the interpreter here) gives "ragged_dot"'s result,
    float and int8 experts (dequantized into it); "auto" on a CPU is ragged_dot, bit for bit,
    and its CPU program holds no Triton call."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((40, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 64, 32)), jnp.float32)
    if quantized:
        w = quantize(w, jnp.int8, (-2,))
    gs = jnp.asarray([9, 0, 25, 3], jnp.int32)
    run = lambda backend: np.asarray(jax.jit(
        lambda a, b, c: quant_ops.grouped_matmul(a, b, c, backend))(x, w, gs))
    want = run("ragged_dot")
    np.testing.assert_array_equal(run("auto"), want)
    np.testing.assert_allclose(run("pallas"), want, rtol=1e-5, atol=1e-4)
    text = jax.jit(lambda a, b, c: quant_ops.grouped_matmul(a, b, c)).lower(x, w, gs).as_text()
    assert TRITON_CALL not in text
    with pytest.raises(ValueError, match="unknown MoE backend"):
        quant_ops.grouped_matmul(x, w, gs, "cublas")


# (name, hidden, moe_intermediate, experts): top-8, bf16, 64 tokens
MOE_SHAPES = [("deepseek-v3", 7168, 2048, 256), ("qwen3-30b-a3b", 2048, 768, 128)]


def moe_block(hidden, intermediate, experts, backend):
    """model/moe.py's block at an expert shape, as a Qwen3-MoE layer (top-8, renormalized)."""
    from model.config import ModelConfig
    from model.moe import MoE
    cfg = ModelConfig.from_hf({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": hidden,
        "intermediate_size": 4 * hidden, "num_hidden_layers": 1, "num_attention_heads": 8,
        "num_key_value_heads": 8, "head_dim": 64, "num_experts": experts,
        "num_experts_per_tok": 8, "moe_intermediate_size": intermediate,
        "norm_topk_prob": True}, "bfloat16")
    return MoE(dataclasses.replace(cfg, moe_backend=backend))


@pytest.mark.parametrize("name,hidden,intermediate,experts", MOE_SHAPES)
def test_moe_block_for_cuda_takes_the_pallas_kernel(name, hidden, intermediate, experts):
    """The MoE block lowered for CUDA by default: our Triton kernel for each projection (gate,
    up, down) and no dot doing the work of every row against every expert (no dot with an
    expert weight's [E, in, out] operand), where moe_backend="ragged_dot" leaves three
    `chlo.ragged_dot` for XLA:GPU to densify."""
    T, rows = 64, 64 * 8
    x = SDS((T, hidden), jnp.bfloat16)
    projections = ((hidden, intermediate),) * 2 + ((intermediate, hidden),)
    weights = [f"tensor<{experts}x{k}x{n}xbf16>" for k, n in projections]
    for backend in ("auto", "ragged_dot"):
        block = moe_block(hidden, intermediate, experts, backend)
        params = jax.eval_shape(block.init, jax.random.PRNGKey(0), x)
        text = lower_for_cuda(block.apply, params, x).as_text()
        report = read(text, "lowered", rows, experts, projections)
        dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
        assert not [line for line in dots if any(t in line for t in weights)], name
        # the kernel's jitted function, called once per projection with its expert weights
        calls = re.findall(r"call @grouped_matmul\w*\((?:[^)]*)\) : \(([^)]*)\)", text)
        if backend == "auto":
            assert sorted(sig.split(", ")[1] for sig in calls) == sorted(weights), calls
            assert TRITON_CALL in report.ops and "chlo.ragged_dot" not in report.ops
            assert report.dense is False and report.work < 0.01, report
        else:
            assert not calls and TRITON_CALL not in report.ops
            assert report.ops.get("chlo.ragged_dot") == 3 and report.dense is None, report


@pytest.mark.skipif(compile_only_device() is None,
                    reason="needs the CUDA PJRT plugin (scripts/capture_gpu_hlo.py)")
def test_xla_gpu_densifies_ragged_dot_and_not_our_kernel():
    """Through XLA:GPU's passes for an H200 (no GPU: compile only), Qwen3-30B-A3B's expert
    MLP: ragged_dot becomes dots over every expert (128x the work); ours stays Triton."""
    ragged = inspect(64, 2048, 768, 128, backend="ragged_dot", compile=True)
    assert ragged.dense and ragged.work == 128, ragged
    ours = inspect(64, 2048, 768, 128, backend="auto", compile=True)
    assert ours.ops == {TRITON_CALL: 2} and ours.dense is False, ours
