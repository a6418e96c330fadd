"""A tensor-parallel step lowered for GPUs this host does not have, and what its HLO says.

The step program is the engine's own (runner._step inside serving/engine/mesh.py's
shard_map) over an abstract mesh of N GPUs (jax.sharding.AbstractMesh), with abstract
weights (ShapeDtypeStructs: nothing is allocated), lowered for CUDA. Its collectives are read
from the StableHLO module: the all-reduces (one after o_proj and one after down_proj in
every layer, one for the vocabulary-parallel embedding) and the all-gather of the logits,
with the bytes each moves. scripts/tp_report.py prints it (docs/benchmarks.md).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
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
from serving.engine.input_prep import history_shape, padding_step
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


MODELS = {"llama-3.1-8b": llama_8b, "mixtral-8x7b": mixtral_8x7b,
          "qwen3-30b-a3b": qwen3_30b_a3b}


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
    kv_bytes_per_token: int = 0  # per device, every layer, K and V

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


def step_report(cfg: ModelConfig, tp: int, shape: tuple[int, int, int], **options) -> StepReport:
    lowered, params = lower_step(cfg, tp, shape, **options)
    weight_bytes = sum(int(np.prod(a.shape[1:])) * np.dtype(a.dtype).itemsize
                       for a in jax.tree.leaves(params))
    local = sharding.local_config(cfg, tp)
    kv = bytes_per_page(local, 1, options.get("kv_cache_dtype"))
    return StepReport(cfg, tp, shape, collectives(lowered), weight_bytes, kv)


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
        f"  weights per device: {r.weight_bytes / GiB:.2f} GiB; KV cache per device: "
        f"{r.kv_bytes_per_token / KiB:.0f} KiB per token "
        f"({r.cfg.num_kv_heads // r.tp or 1} KV heads of {r.cfg.num_kv_heads}), "
        f"{(r.kv_bytes_per_token << 17) / GiB:.1f} GiB per 128k tokens",
    ]
    return "\n".join(lines)
