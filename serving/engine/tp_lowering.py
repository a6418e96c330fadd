"""A tensor-parallel step lowered for GPUs this host does not have, and what its HLO says.

The step program is the engine's own (runner._step inside serving/engine/mesh.py's
shard_map) over an abstract mesh of N GPUs (jax.sharding.AbstractMesh), with abstract
weights (ShapeDtypeStructs: nothing is allocated), lowered for CUDA. Its collectives are read
from the StableHLO module: the all-reduces (one after o_proj and one after down_proj, or a
mixture's experts, in every layer, one for the vocabulary-parallel embedding) and the
all-gather of the logits, with the bytes each moves. scripts/tp_report.py prints it
(docs/benchmarks.md). MODELS holds the shapes of a few public models (DeepSeek-V3's and Kimi
K2's included, with latent attention), no weights needed.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from functools import partial

import jax
import numpy as np
from jax._src.lib.mlir import ir

import model.attention as attention
from model import sharding
from model.config import ModelConfig
from model.transformer import abstract_params
from model.kv_cache import bytes_per_page
from quant.recipe import abstract_quantized
from serving.engine import memory_plan
from serving.engine.input_prep import history_shape, padding_step
from serving.engine.memory_plan import FP8_BLOCK_128, WeightForm
from serving.engine.mesh import TensorParallel
from serving.engine.runner import _step
from serving.engine.step_buffers import pack

H200 = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", platform="gpu", num_cores=132)
COLLECTIVES = ("stablehlo.all_reduce", "stablehlo.all_gather", "stablehlo.reduce_scatter",
               "stablehlo.all_to_all", "stablehlo.collective_permute")


def llama_8b() -> ModelConfig:
    """Llama-3.1-8B's shapes (config.json of meta-llama/Llama-3.1-8B-Instruct)."""
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                      ("original_max_position_embeddings", 8192.0), ("rope_type", "llama3")),
        dtype="bfloat16")


def mixtral_8x7b() -> ModelConfig:
    """Mixtral-8x7B-Instruct-v0.1's shapes: 8 experts of 14336, 2 a token."""
    return ModelConfig.from_hf(dict(
        architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=32768,
        torch_dtype="bfloat16"))


def qwen3_30b_a3b() -> ModelConfig:
    """Qwen3-30B-A3B's shapes: 128 experts of 768, 8 a token, in all 48 layers."""
    return ModelConfig.from_hf(dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
        intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        torch_dtype="bfloat16"))


def _deepseek(**fields) -> ModelConfig:
    """DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3), with `fields` over it."""
    return ModelConfig.from_hf({
        "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280, "hidden_size": 7168,
        "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
        "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
        "first_k_dense_replace": 3, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "max_position_embeddings": 163840, "num_nextn_predict_layers": 1,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0},
        "torch_dtype": "bfloat16", **fields})


def deepseek_v3() -> ModelConfig:
    """DeepSeek-V3's (and R1's) shapes: latent attention over 128 heads, 256 experts of 2048,
    8 a token, the first 3 of 61 layers dense."""
    return _deepseek()


def kimi_k2() -> ModelConfig:
    """Kimi K2's shapes (moonshotai/Kimi-K2-Instruct): DeepSeek-V3's with 64 heads, 384
    experts in one group, one dense layer and a larger vocabulary."""
    return _deepseek(vocab_size=163840, num_attention_heads=64, num_key_value_heads=64,
                     n_routed_experts=384, n_group=1, topk_group=1, first_k_dense_replace=1,
                     routed_scaling_factor=2.827, max_position_embeddings=131072,
                     num_nextn_predict_layers=0, rope_theta=50000.0,
                     rope_scaling={"type": "yarn", "factor": 32.0, "beta_fast": 1.0,
                                   "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                   "original_max_position_embeddings": 4096})


MODELS = {"llama-3.1-8b": llama_8b, "mixtral-8x7b": mixtral_8x7b,
          "qwen3-30b-a3b": qwen3_30b_a3b, "deepseek-v3": deepseek_v3, "kimi-k2": kimi_k2}
# How a model's published checkpoint stores its weights, where not in its dtype.
CHECKPOINT_FORMS = {"deepseek-v3": FP8_BLOCK_128, "kimi-k2": FP8_BLOCK_128}


def fewer_layers(cfg: ModelConfig, n: int) -> ModelConfig:
    """The model's first n layers (dense and MoE as they come): a step lowers in time
    proportional to its layers, and every layer of a kind moves the same collectives."""
    if n >= cfg.num_layers:
        return cfg
    return replace(cfg, num_layers=n, moe_layers=cfg.moe_layers[:n],
                   sliding_windows=cfg.sliding_windows[:n])


def device_leaves(cfg: ModelConfig, tp: int = 1) -> list[tuple[tuple[str, ...], tuple, int]]:
    """(path names, shape, itemsize) of every stored weight one device holds at TP=tp (the
    shapes alone: memory_plan.weight_bytes counts them in a storage form)."""
    stored = abstract_params(cfg)
    block = stored if tp == 1 else jax.eval_shape(
        lambda p: sharding.shard_stored(p, cfg, tp, 0), stored)
    return [(tuple(str(getattr(k, "key", k)) for k in path), tuple(a.shape),
             np.dtype(a.dtype).itemsize)
            for path, a in jax.tree_util.tree_flatten_with_path(block)[0]]


@dataclass
class Collective:
    op: str  # e.g. "all_reduce"
    shape: tuple[int, ...]
    dtype: str
    bytes: int  # of the operand on one device


@dataclass
class StepReport:
    cfg: ModelConfig
    tp: int
    shape: tuple[int, int, int]  # tokens, requests, pages per request
    collectives: list[Collective] = field(default_factory=list)
    weight_bytes: int = 0  # per device
    kv_bytes_per_token: int = 0  # per device, every layer, K and V (or the latent)
    # per device, the weights as the model's checkpoint stores them (CHECKPOINT_FORMS), where
    # that differs from the lowered step's: (form, bytes)
    stored: tuple[WeightForm, int] | None = None

    def count(self, op: str) -> int:
        return sum(c.op == op for c in self.collectives)

    def bytes_of(self, op: str) -> int:
        return sum(c.bytes for c in self.collectives if c.op == op)


def abstract_mesh(n: int, device=H200):
    return jax.sharding.AbstractMesh((n,), (sharding.AXIS,), abstract_device=device)


def lower_step(cfg: ModelConfig, tp: int, shape: tuple[int, int, int], *, num_pages: int = 4096,
               page_size: int = 16, quantize: str | None = None, kv_cache_dtype=None,
               backend: str = "pallas", num_top: int = 20, device=H200):
    """-> (the step of `shape` lowered for CUDA on an abstract mesh of `tp` GPUs, its
    abstract weights)."""
    mesh = abstract_mesh(tp, device)
    where = TensorParallel(cfg, mesh, kv_cache_dtype)
    stored = abstract_params(cfg)
    if quantize:
        stored = abstract_quantized(stored, quantize)
    params = sharding.abstract_sharded_params(stored, cfg, mesh)
    cache = where.abstract_cache(num_pages, page_size, kv_cache_dtype)
    example = padding_step(shape)
    buffers, layout = pack(example)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sds = lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype, sharding=replicated)
    R = shape[1]
    history = jax.ShapeDtypeStruct(history_shape(shape, page_size), np.int32,
                                   sharding=replicated)
    bitmask = jax.ShapeDtypeStruct((R, (cfg.vocab_size + 31) // 32), np.int32,
                                   sharding=replicated)
    last_tokens = jax.ShapeDtypeStruct((R,), np.int32, sharding=replicated)
    step = jax.jit(where.wrap_step(partial(
        _step, cfg=where.model_cfg, backend=backend, num_top=num_top,
        vocab_size=cfg.vocab_size, axis=where.axis)), donate_argnums=(1,),
        static_argnames=("layout",))
    interpret, attention.PALLAS_INTERPRET = attention.PALLAS_INTERPRET, False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the Triton backend's notice
            with jax.sharding.use_abstract_mesh(mesh):
                lowered = step.trace(params, cache, tuple(map(sds, buffers)), history,
                                     bitmask, last_tokens, layout=layout).lower(
                    lowering_platforms=("cuda",))
    finally:
        attention.PALLAS_INTERPRET = interpret
    return lowered, params


def collectives(lowered) -> list[Collective]:
    """Every collective op of a lowered program, in order, with its operand's bytes."""
    found = []

    def visit(op):
        name = op.operation.name
        if name in COLLECTIVES:
            t = ir.RankedTensorType(op.operands[0].type)
            dtype = str(t.element_type)
            nbytes = int(np.prod(t.shape)) * _itemsize(dtype)
            found.append(Collective(name.split(".")[1], tuple(t.shape), dtype, nbytes))
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    visit(inner)

    for op in lowered.compiler_ir("stablehlo").body.operations:
        visit(op)
    return found


def _itemsize(mlir_dtype: str) -> int:
    names = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i32": 4, "i8": 1, "i1": 1,
             "f8E4M3FN": 1, "i64": 8, "ui32": 4}
    return names[mlir_dtype]


def step_report(cfg: ModelConfig, tp: int, shape: tuple[int, int, int],
                stored_form: WeightForm | None = None, **options) -> StepReport:
    """stored_form: also count each device's weights in this form (the checkpoint's)."""
    lowered, params = lower_step(cfg, tp, shape, **options)
    weight_bytes = sum(int(np.prod(a.shape[1:])) * np.dtype(a.dtype).itemsize
                       for a in jax.tree.leaves(params))
    local = sharding.local_config(cfg, tp)
    kv = bytes_per_page(local, 1, options.get("kv_cache_dtype"))
    stored = stored_form and (stored_form, memory_plan.weight_bytes(device_leaves(cfg, tp),
                                                                    stored_form))
    return StepReport(cfg, tp, shape, collectives(lowered), weight_bytes, kv, stored)


def describe(r: StepReport) -> str:
    GiB, KiB = 1 << 30, 1 << 10
    L = r.cfg.num_layers
    ar, ag = r.count("all_reduce"), r.count("all_gather")
    others = len(r.collectives) - ar - ag
    sizes = sorted({(c.op, c.shape, c.dtype, c.bytes) for c in r.collectives})
    experts = ""
    if r.cfg.num_experts:
        experts = (f", {r.cfg.num_experts // r.cfg.expert_shards} of {r.cfg.num_experts} "
                   "experts per device (expert parallel)" if r.cfg.expert_shards > 1 else
                   f", each of {r.cfg.num_experts} experts split {r.tp} ways")
    kv = ("the latent, whole on every device" if r.cfg.latent else
          f"{r.cfg.num_kv_heads // r.tp or 1} KV heads of {r.cfg.num_kv_heads}")
    lines = [
        f"{r.cfg.architecture}{experts}",
        f"TP={r.tp}, step of {r.shape[0]} tokens / {r.shape[1]} requests / {r.shape[2]} "
        f"pages per request, lowered for CUDA on {r.tp} x NVIDIA H200 (abstract mesh)",
        f"  all-reduces: {ar} = {(ar - 1) / L:g} per layer x {L} layers + "
        f"{ar - 2 * L} (vocabulary-parallel embedding); "
        f"{r.bytes_of('all_reduce') / KiB:.0f} KiB per device per step",
        f"  all-gathers: {ag} (logits), {r.bytes_of('all_gather') / KiB:.0f} KiB per device "
        f"per step; other collectives: {others}",
        *(f"    {op} {list(shape)} {dtype}: {b / KiB:.1f} KiB" for op, shape, dtype, b in sizes),
        f"  weights per device: {r.weight_bytes / GiB:.2f} GiB"
        + (f" ({r.stored[1] / GiB:.2f} GiB as {r.stored[0].name})" if r.stored else "")
        + f"; KV cache per device: {r.kv_bytes_per_token / KiB:.1f} KiB per token ({kv}), "
        f"{(r.kv_bytes_per_token << 17) / GiB:.1f} GiB per 128k tokens",
    ]
    return "\n".join(lines)
