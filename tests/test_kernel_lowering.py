"""Cross-lowering the Pallas kernels for CUDA on a CPU host (docs/architecture.md, "Kernels and
their references").

This runs the real Triton lowering (power-of-two tensors, supported primitives and casts) that
interpret mode skips, for every kernel configuration the engine's buckets pick. It does not run
ptxas: register or shared-memory overflow only shows on a GPU (scripts/gpu_check.sh).
"""
from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.ragged_paged_attention_kernel import block_sizes_for, ragged_paged_attention
from serving.core.buckets import Buckets
from serving.engine.input_prep import all_step_shapes

TRITON_CALL = "__gpu$xla.gpu.triton"
DEVICE = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
SDS = jax.ShapeDtypeStruct

# (name, heads, kv heads, head dim, dtype, kv dtype, engine sizes: max_num_seqs,
#  max_num_batched_tokens, max_model_len, page_size)
MODELS = [
    ("demo-f32", 9, 3, 64, jnp.float32, None, (64, 512, 2048, 16)),
    ("demo-bf16", 9, 3, 64, jnp.bfloat16, None, (64, 512, 2048, 16)),
    ("8b-bf16", 32, 8, 128, jnp.bfloat16, None, (64, 512, 2048, 16)),
    ("8b-bf16-bench", 32, 8, 128, jnp.bfloat16, None, (256, 512, 1024, 16)),  # bench_decode
    ("8b-bf16-int8kv", 32, 8, 128, jnp.bfloat16, jnp.int8, (64, 512, 2048, 16)),
    ("8b-bf16-fp8kv", 32, 8, 128, jnp.bfloat16, jnp.float8_e4m3fn, (64, 512, 2048, 16)),
]


def lower_for_cuda(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
        with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (),
                                                                      abstract_device=DEVICE)):
            return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def attention_args(T, R, P, heads, kv_heads, head_dim, dtype, kv_dtype, page_size,
                   num_layers=2, num_pages=1024):
    kv_shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
    kv_dtype = kv_dtype or dtype
    args = [SDS((T, heads, head_dim), dtype), SDS(kv_shape, kv_dtype), SDS(kv_shape, kv_dtype),
            SDS((), jnp.int32), SDS((T,), jnp.int32), SDS((T,), jnp.int32),
            SDS((R, P), jnp.int32), SDS((), jnp.int32)]
    scales = [SDS(kv_shape[:-1], jnp.float32)] * 2 if kv_dtype != dtype else [None, None]
    return args + scales


def kernel_configs(heads, kv_heads, head_dim, engine):
    """Each distinct tile configuration of the engine's step shapes, with the largest shape
    (tokens, then pages) that uses it."""
    max_num_seqs, max_tokens, max_len, page_size = engine
    buckets = Buckets.derive(max_num_seqs, max_tokens, max_len, page_size, fixed_pages=True)
    by_sizes: dict = {}
    for T, R, P in all_step_shapes(buckets, max_num_seqs):
        sizes = block_sizes_for((T, heads, head_dim), kv_heads, (R, P), page_size,
                                device_kind=DEVICE.device_kind)
        by_sizes.setdefault(sizes, []).append((T, R, P))
    return {sizes: max(shapes) for sizes, shapes in by_sizes.items()}


@pytest.mark.parametrize("name,heads,kv_heads,head_dim,dtype,kv_dtype,engine", MODELS,
                         ids=[m[0] for m in MODELS])
def test_engine_kernel_configs_lower_for_cuda(name, heads, kv_heads, head_dim, dtype, kv_dtype,
                                              engine):
    page_size = engine[3]
    configs = kernel_configs(heads, kv_heads, head_dim, engine)
    splits = {s.num_splits for s in configs}
    assert 1 in splits and max(splits) > 1  # both the direct and the flash-decoding path
    for sizes, (T, R, P) in configs.items():
        args = attention_args(T, R, P, heads, kv_heads, head_dim, dtype, kv_dtype, page_size)

        def fn(q, k, v, layer, pos, req, pt, window, ks, vs, sizes=sizes):
            return ragged_paged_attention(q, k, v, layer, pos, req, pt, window, 0.125, ks, vs,
                                          sizes=sizes, interpret=False)

        text = lower_for_cuda(fn, *args).as_text()
        assert text.count(TRITON_CALL) == 1, (name, sizes, T, R, P)


@pytest.mark.parametrize("name,heads,kv_heads,head_dim,dtype,kv_dtype,engine", MODELS,
                         ids=[m[0] for m in MODELS])
def test_page_block_kernel_configs_lower_for_cuda(name, heads, kv_heads, head_dim, dtype,
                                                  kv_dtype, engine):
    """The second variant (whole pages per tile) for every tile configuration the engine's
    buckets give it."""
    from pallas_kernels.ragged_paged_attention_pages import (page_block_sizes,
                                                            ragged_paged_attention_pages)
    max_num_seqs, max_tokens, max_len, page_size = engine
    buckets = Buckets.derive(max_num_seqs, max_tokens, max_len, page_size)
    configs: dict = {}
    for T, R, P in all_step_shapes(buckets, max_num_seqs):
        sizes = page_block_sizes((T, heads, head_dim), kv_heads, (R, P), page_size,
                                 device_kind=DEVICE.device_kind)
        configs[sizes] = max(configs.get(sizes, (T, R, P)), (T, R, P))
    assert {s.num_splits for s in configs} > {1}  # both the direct and the split path
    assert any(s.block_kv > page_size for s in configs)  # several pages per tile
    for sizes, (T, R, P) in configs.items():
        args = attention_args(T, R, P, heads, kv_heads, head_dim, dtype, kv_dtype, page_size)

        def fn(q, k, v, layer, pos, req, pt, window, ks, vs, sizes=sizes):
            return ragged_paged_attention_pages(q, k, v, layer, pos, req, pt, window, 0.125,
                                                ks, vs, sizes=sizes, interpret=False)

        text = lower_for_cuda(fn, *args).as_text()
        assert text.count(TRITON_CALL) == 1, (name, sizes, T, R, P)


def test_lowering_rejects_what_triton_cannot_do():
    """The check has teeth: a 48-key tile is no power of two, and Triton refuses it."""
    from pallas_kernels.block_sizes import AttentionBlockSizes
    from pallas_kernels.ragged_paged_attention_kernel import ragged_paged_attention_kernel
    args = attention_args(8, 8, 4, 8, 2, 64, jnp.bfloat16, None, 16)

    def fn(q, k, v, layer, pos, req, pt, window, ks, vs):
        return ragged_paged_attention_kernel(q, k, v, layer, pos, req, pt, window, 0.125,
                                             sizes=AttentionBlockSizes(4, 48, 1))

    with pytest.raises(Exception, match="power of 2"):
        lower_for_cuda(fn, *args)


def test_model_forward_with_pallas_backend_lowers_for_cuda(monkeypatch):
    """The dispatch point inside the model's layers, as the engine compiles a step."""
    from model import attention
    from model.batch import Batch
    from model.config import ModelConfig
    from model.kv_cache import KVCache
    from model.transformer import abstract_params, forward
    monkeypatch.setattr(attention, "PALLAS_INTERPRET", False)
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=256, hidden_size=576, intermediate_size=256,
                      num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                      sliding_windows=(0, 8), dtype="bfloat16")
    T, R, P, page_size = 16, 4, 8, 16
    i32 = lambda *s: SDS(s, jnp.int32)
    batch = Batch(i32(T), i32(T), i32(T), i32(T), i32(R, P), i32(R))
    cache = jax.eval_shape(lambda: KVCache.zeros(cfg, 64, page_size))
    params = abstract_params(cfg)
    for backend in ("pallas", "pallas_pages"):
        lowered = lower_for_cuda(lambda p, c, b: forward(p, c, b, cfg, backend), params, cache,
                                 batch)
        assert TRITON_CALL in lowered.as_text(), backend


def test_moe_forward_lowers_for_cuda_with_the_pallas_grouped_matmul(monkeypatch):
    """A mixture-of-experts step for a GPU: each MoE layer's experts as two Triton kernels
    (our grouped matmul, gate/up joined, then down), no `ragged_dot` (XLA:GPU would make it
    a dense dot over every expert, quant/moe_hlo.py). With moe_backend="ragged_dot", two
    `chlo.ragged_dot` on the bf16 weights with float32 accumulation. Neither holds our CPU
    kernels' FFI calls."""
    import dataclasses

    from model import attention
    from model.batch import Batch
    from model.config import ModelConfig
    from model.kv_cache import KVCache
    from model.transformer import abstract_params, forward
    monkeypatch.setattr(attention, "PALLAS_INTERPRET", False)
    E, k, H, I = 8, 2, 256, 128
    cfg = ModelConfig.from_hf({
        "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 256, "hidden_size": H,
        "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "num_experts": E, "num_experts_per_tok": k,
        "moe_intermediate_size": I, "norm_topk_prob": True, "mlp_only_layers": [1]},
        "bfloat16")
    assert cfg.moe_layers == (True, False, True)  # a dense layer between: layers as a list
    T, R, P, page_size = 16, 4, 8, 16
    i32 = lambda *s: SDS(s, jnp.int32)
    batch = Batch(i32(T), i32(T), i32(T), i32(T), i32(R, P), i32(R))
    cache = jax.eval_shape(lambda: KVCache.zeros(cfg, 64, page_size))
    params = abstract_params(cfg)
    texts = {backend: lower_for_cuda(lambda p, c, b: forward(
                 p, c, b, dataclasses.replace(cfg, moe_backend=backend), "pallas"),
                 params, cache, batch).as_text()
             for backend in ("auto", "ragged_dot")}
    assert '"chlo.ragged_dot"' not in texts["auto"]
    # our grouped matmul's jitted function: gate/up and down in each of the 2 MoE layers
    assert len(re.findall(r"call @grouped_matmul\w*\(", texts["auto"])) == 4
    assert "call @grouped_matmul" not in texts["ragged_dot"]
    ragged = [line for line in texts["ragged_dot"].splitlines() if '"chlo.ragged_dot"' in line]
    rows = T * k
    gate_up = f"(tensor<{rows}x{H}xbf16>, tensor<{E}x{H}x{2 * I}xbf16>, tensor<{E}xi32>) " \
              f"-> tensor<{rows}x{2 * I}xf32>"
    down = f"(tensor<{rows}x{I}xbf16>, tensor<{E}x{I}x{H}xbf16>, tensor<{E}xi32>) " \
           f"-> tensor<{rows}x{H}xf32>"
    assert [gate_up in line for line in ragged] == [True, False, True, False], ragged
    assert [down in line for line in ragged] == [False, True, False, True], ragged
    for text in texts.values():
        assert "xlaserve_" not in text
        assert TRITON_CALL in text  # the attention kernel, as in the dense model's step


def test_lora_forward_lowers_for_cuda_as_ragged_dot(monkeypatch):
    """A step with LoRA slots for a GPU: each site's shrink and per-part expands as
    `chlo.ragged_dot` over the slots, and none of our CPU kernels' FFI calls."""
    from model import attention, lora
    from model.batch import Batch
    from model.config import ModelConfig
    from model.kv_cache import KVCache
    from model.runtime_params import prepare_params
    from model.transformer import abstract_params, forward
    monkeypatch.setattr(attention, "PALLAS_INTERPRET", False)
    cfg = ModelConfig("LlamaForCausalLM", vocab_size=256, hidden_size=256, intermediate_size=512,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    S, rank, T, R, P, page_size = 4, 16, 16, 4, 8, 16
    params = jax.eval_shape(lambda p: prepare_params(p, pack=False), abstract_params(cfg))
    sites = [lora.sites(cfg, layer) for layer in params["layers"]]
    slots = jax.eval_shape(lambda: lora.empty_slots(sites, S, rank, cfg.dtype))
    i32 = lambda *s: SDS(s, jnp.int32)
    batch = Batch(i32(T), i32(T), i32(T), i32(T), i32(R, P), i32(R), lora_slots=i32(T))
    cache = jax.eval_shape(lambda: KVCache.zeros(cfg, 64, page_size))
    text = lower_for_cuda(lambda p, c, b, s: forward(p, c, b, cfg, "pallas", lora_slots=s),
                          params, cache, batch, slots).as_text()
    ragged = [line for line in text.splitlines() if '"chlo.ragged_dot"' in line]
    # per layer: qkv (1 shrink + 3 expands), o (1 + 1), gate_up (1 + 2), down (1 + 1)
    assert len(ragged) == 2 * 11, len(ragged)
    shrink = f"(tensor<{T}x256xbf16>, tensor<{S}x256x{3 * rank}xbf16>, tensor<{S}xi32>)"
    assert sum(shrink in line for line in ragged) == 2
    assert "xlaserve_" not in text


def test_deepseek_forward_lowers_for_cuda_with_the_latent_kernel(monkeypatch):
    """A DeepSeek-V3 step for a GPU (latent attention, a dense first layer, sigmoid routing
    with groups and shared experts): every layer's attention is the latent kernel, whose
    cache operand is the 576-wide latent (never per-head keys), and the experts run on our
    grouped matmul."""
    from model import attention
    from model.batch import Batch
    from model.config import ModelConfig
    from model.kv_cache import KVCache
    from model.transformer import abstract_params, forward
    monkeypatch.setattr(attention, "PALLAS_INTERPRET", False)
    cfg = ModelConfig.from_hf({
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 256, "hidden_size": 256,
        "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 16, "q_lora_rank": 128, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1}, "bfloat16")
    T, R, P, page_size = 16, 4, 8, 16
    i32 = lambda *s: SDS(s, jnp.int32)
    batch = Batch(i32(T), i32(T), i32(T), i32(T), i32(R, P), i32(R))
    cache = jax.eval_shape(lambda: KVCache.zeros(cfg, 64, page_size))
    assert cache.k.shape == (2, 64, page_size, 1, 576) and cache.v.size == 0
    text = lower_for_cuda(lambda p, c, b: forward(p, c, b, cfg, "pallas"),
                          abstract_params(cfg), cache, batch).as_text()
    assert len(re.findall(r"call @latent_paged_attention\w*\(", text)) == 2
    assert "tensor<2x64x16x1x576xbf16>" in text  # the cache the kernel reads: the latent
    assert len(re.findall(r"call @grouped_matmul\w*\(", text)) == 2
    assert "xlaserve_" not in text and '"chlo.ragged_dot"' not in text
