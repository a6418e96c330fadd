"""Tensor parallelism: how the weights and the KV cache split over the mesh's "model" axis.

Megatron's split (docs/architecture.md, "Tensor parallelism"): q/k/v are column-parallel by
head and gate/up by intermediate unit, o and down row-parallel (their partial sums meet in
one psum each, in model/transformer.py), the embedding table and the head by vocabulary row
(the vocabulary padded to a multiple of the size). With fewer KV heads than devices each
device holds the one KV head its query heads read (vLLM's replication). A mixture of
experts splits every expert like the MLP, or, expert parallel (`cfg.expert_shards`), gives
each device whole experts; its router is replicated (model/moe.py).

Latent attention (model/latent_attention.py) splits by query head too: q_b_proj's (or
q_proj's) columns in blocks of nope + rope dims a head, k_up / v_up on their head axis,
o_proj's rows in blocks of v_head_dim. The latent has no head axis: q_a_proj, kv_a_proj
and their norms are replicated, every device computes the same latent of each token, and
the latent cache is whole on every device (`LATENT_SPEC`), as vLLM and SGLang hold it
under TP (splitting it would need the latent gathered back before every head reads it).

Each device's block is cut from the stored tree (`shard_stored`) and prepared on its device
as a whole model of its own (model/runtime_params.py: per-layer buffers, q/k/v and gate/up
joined, CPU packing), so a joined or packed weight is one contiguous block per shard. The
blocks are stacked on a leading axis of the mesh's size, sharded on that axis (`P(AXIS)`):
a step program runs inside `shard_map` and takes block `[0]` of every leaf (`local_params`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from model.config import ModelConfig
from model.kv_cache import KVCache
from model.layers import embed
from model.runtime_params import prepare_params
from quant.array import QuantArray
from quant.fp8_blocks import Fp8BlockArray
from quant.int4 import Int4Array, is_quantized
from quant.int8_groups import Int8GroupArray

AXIS = "model"
# KV cache [L, pages, page_size, K, D] (scales [L, pages, page_size, K]): by KV head.
KV_SPEC = P(None, None, None, AXIS)
# A latent cache [L, pages, page_size, 1, W]: whole on every device.
LATENT_SPEC = P()


class TensorParallelError(ValueError):
    pass


def valid_sizes(cfg: ModelConfig) -> list[int]:
    """Tensor-parallel sizes the model splits into: n divides the query heads and the
    intermediate size, and either n divides the KV heads or the KV heads divide n (so each
    device's query heads read whole KV heads of their own; a latent cache, one "KV head"
    whole on every device, puts no bound). A mixture of experts also needs n to divide each
    expert's intermediate size, or, expert parallel (cfg.expert_shards > 1), the number of
    experts; and its shared expert's size."""
    k = cfg.num_kv_heads
    return [n for n in range(1, cfg.num_heads + 1)
            if cfg.num_heads % n == 0 and (cfg.latent or k % n == 0 or n % k == 0)
            and all(size % n == 0 for size in _split_sizes(cfg))]


def _split_sizes(cfg: ModelConfig) -> list[int]:
    """The sizes a tensor-parallel split divides, besides the heads."""
    every_layer_moe = bool(cfg.moe_layers) and all(cfg.moe_layers)
    sizes = [] if every_layer_moe else [cfg.intermediate_size]
    if cfg.num_experts:
        sizes.append(cfg.num_experts if cfg.expert_shards > 1 else cfg.moe_intermediate_size)
    if cfg.shared_expert_intermediate_size:
        sizes.append(cfg.shared_expert_intermediate_size)
    return sizes


def check_size(cfg: ModelConfig, n: int, num_devices: int | None = None) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise TensorParallelError(f"tensor_parallel_size must be a positive integer, got {n!r}")
    if cfg.expert_shards not in (1, n):
        raise TensorParallelError(f"experts split over {cfg.expert_shards} devices but "
                                  f"tensor_parallel_size is {n}")
    if n > 1 and (cfg.attn_sinks or (cfg.num_experts and cfg.moe_family.biases)):
        raise TensorParallelError(f"tensor parallel does not split {cfg.architecture}'s "
                                  "attention sinks and expert biases yet; use "
                                  "tensor_parallel_size 1")
    sizes = valid_sizes(cfg)
    if n not in sizes:
        experts = ""
        if cfg.num_experts:
            experts = (f", {cfg.num_experts} experts (expert parallel)" if cfg.expert_shards > 1
                       else f", expert intermediate size {cfg.moe_intermediate_size}")
            if cfg.shared_expert_intermediate_size:
                experts += f", shared expert size {cfg.shared_expert_intermediate_size}"
        kv = ("a latent cache whole on every device" if cfg.latent
              else f"{cfg.num_kv_heads} KV heads")
        raise TensorParallelError(
            f"tensor_parallel_size {n} does not split this model ({cfg.num_heads} query "
            f"heads, {kv}, intermediate size "
            f"{cfg.intermediate_size}{experts}); sizes that work: {', '.join(map(str, sizes))}")
    if num_devices is not None and n > num_devices:
        raise TensorParallelError(f"tensor_parallel_size {n} needs {n} devices; "
                                  f"{num_devices} found")


def local_kv_heads(cfg: ModelConfig, n: int) -> int:
    """KV heads on one device (a latent cache: its one, whole)."""
    return max(cfg.num_kv_heads // n, 1)


def local_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The model one shard computes: its heads and intermediate units (the vocabulary size
    stays the model's: logits are gathered before anything reads it)."""
    ep = cfg.expert_shards > 1
    return replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=local_kv_heads(cfg, n),
                   intermediate_size=cfg.intermediate_size // n,
                   moe_intermediate_size=cfg.moe_intermediate_size // (1 if ep else n),
                   shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // n)


def padded_vocab(cfg: ModelConfig, n: int) -> int:
    return -(-cfg.vocab_size // n) * n


def _kv_head_start(cfg: ModelConfig, n: int, shard: int) -> int:
    if cfg.num_kv_heads >= n:
        return shard * (cfg.num_kv_heads // n)
    # The KV head of this shard's first query head (its others share it).
    return shard * (cfg.num_heads // n) // (cfg.num_heads // cfg.num_kv_heads)


def _take(a, axis: int, start: int, stop: int):
    """a[start:stop] along axis, zero-padded past a's end (the padded vocabulary)."""
    axis = axis % a.ndim
    part = jax.lax.slice_in_dim(a, min(start, a.shape[axis]), min(stop, a.shape[axis]),
                                axis=axis)
    short = stop - start - part.shape[axis]
    if short:
        pad = [(0, 0)] * a.ndim
        pad[axis] = (0, short)
        part = jnp.pad(part, pad)
    return part


def _cut(leaf, axis: int, start: int, stop: int):
    """One block of a plain or quantized leaf; a scale shared along `axis` stays whole."""
    if isinstance(leaf, (Int4Array, Int8GroupArray)):
        return _cut_grouped(leaf, axis, start, stop)
    if isinstance(leaf, Fp8BlockArray):
        return _cut_blocks(leaf, axis, start, stop)
    if not isinstance(leaf, QuantArray):
        return _take(leaf, axis, start, stop)
    scale = leaf.scale if leaf.scale.shape[axis] == 1 else _take(leaf.scale, axis, start, stop)
    return QuantArray(_take(leaf.values, axis, start, stop), scale)


def _cut_grouped(leaf, axis: int, start: int, stop: int):
    """A weight in groups (int4 in groups of 32, 8-bit groups of 32 or 16): along the grouped
    axis the codes and the groups they fill (scales and offsets), in whole groups only;
    along the other axis every array alike."""
    fields = [f.name for f in dataclasses.fields(leaf)]
    axis = axis % leaf.ndim
    grouped_axis = leaf.ndim - 2 if leaf.scale.shape[-1] == leaf.values.shape[-1] \
        else leaf.ndim - 1
    if axis != grouped_axis:
        return type(leaf)(*(_take_or_none(getattr(leaf, f), axis, start, stop)
                            for f in fields))
    group = leaf.values.shape[axis] // leaf.scale.shape[axis]
    if start % group or stop % group:
        raise ValueError("The input size is not aligned with the quantized weight shape. This "
                         "can be caused by too large tensor parallel size. (weights quantized "
                         f"in groups of {group} inputs split between devices in whole groups; "
                         f"this split gives a device inputs {start} to {stop})")
    groups = (start // group, stop // group)
    return type(leaf)(_take(leaf.values, axis, start, stop),
                      *(_take_or_none(getattr(leaf, f), axis, *groups) for f in fields[1:]))


def _take_or_none(a, axis: int, start: int, stop: int):
    """_take of a quantized form's array field; an absent one (an Int8GroupArray's offset
    where it has none) stays None."""
    return None if a is None else _take(a, axis, start, stop)


def _cut_blocks(leaf: Fp8BlockArray, axis: int, start: int, stop: int) -> Fp8BlockArray:
    """fp8 weights with block scales, cut at block boundaries only (the end of the axis may
    close a partial block): along the inputs or outputs the values and the blocks they fill,
    along a leading axis (whole experts) both alike."""
    axis = axis % leaf.ndim
    if axis < leaf.ndim - 2:
        return Fp8BlockArray(_take(leaf.values, axis, start, stop),
                             _take(leaf.scale, axis, start, stop), leaf.block)
    block = leaf.block[axis - (leaf.ndim - 2)]
    size = leaf.shape[axis]
    if start % block or (stop % block and stop != size):
        name = ("input_size_per_partition", "block_k") if axis == leaf.ndim - 2 else \
            ("output_partition_size", "block_n")
        raise ValueError(f"Weight {name[0]} = {stop - start} is not divisible by weight "
                         f"quantization {name[1]} = {block}. ({leaf.describe()} of shape "
                         f"{leaf.shape} split between devices in whole blocks; this split "
                         f"gives a device {('inputs', 'outputs')[axis - (leaf.ndim - 2)]} "
                         f"{start} to {stop}: use a tensor_parallel_size whose shards fill "
                         "whole blocks)")
    blocks = (start // block, -(-stop // block))
    return Fp8BlockArray(_take(leaf.values, axis, start, stop),
                         _take(leaf.scale, axis, *blocks), leaf.block)


def _ranges(cfg: ModelConfig, n: int, shard: int) -> dict:
    """module -> (start, stop) of this shard's columns (or rows) of that module's weights;
    "experts" of a mixture's routed experts (expert parallel: its experts); "heads" of
    latent attention's per-head projections (k_up, v_up)."""
    d, i, h = cfg.head_dim, cfg.intermediate_size // n, cfg.num_heads // n
    q = o = h * d
    if cfg.latent:  # each head's query is nope + rope dims wide, its output v_head_dim
        q, o = h * (cfg.qk_nope_head_dim + cfg.head_dim), h * cfg.v_head_dim
    kv0, kv = _kv_head_start(cfg, n, shard) * d, local_kv_heads(cfg, n) * d
    v = padded_vocab(cfg, n) // n
    e = (cfg.num_experts // n if cfg.expert_shards > 1 else cfg.moe_intermediate_size // n)
    s = cfg.shared_expert_intermediate_size // n
    return {"q_proj": (shard * q, (shard + 1) * q), "q_b_proj": (shard * q, (shard + 1) * q),
            "k_proj": (kv0, kv0 + kv), "v_proj": (kv0, kv0 + kv),
            "o_proj": (shard * o, (shard + 1) * o), "heads": (shard * h, (shard + 1) * h),
            "mlp": (shard * i, (shard + 1) * i), "vocab": (shard * v, (shard + 1) * v),
            "experts": (shard * e, (shard + 1) * e), "shared_expert": (shard * s, (shard + 1) * s)}


ROW_PARALLEL = ("o_proj", "down_proj")
# A mixture's router and shared-expert gate: every shard computes the whole routing.
# Latent attention's down-projections: every shard computes the whole latent (and q_a).
REPLICATED = ("router", "shared_expert_gate", "q_a_proj", "kv_a_proj")
# Latent attention's absorbed projections, [.., H, a, b]: cut on the head axis.
PER_HEAD = ("k_up", "v_up")


def shard_lora_site(site, arrays: dict, cfg: ModelConfig, n: int, shard: int) -> dict:
    """One LoRA site's slot arrays (model/lora.py: a [in, P x R], b_p [R, out_p]) -> this
    shard's, as its projection splits: column-parallel ones keep A whole and take each B's
    columns of the shard's heads or units; row-parallel ones take A's rows of the shard's
    inputs and keep B whole, their partial sums joining the layer's psum. numpy, on the
    host."""
    ranges = _ranges(cfg, n, shard)
    if site.name in ROW_PARALLEL:
        start, stop = ranges["o_proj" if site.name == "o_proj" else "mlp"]
        return {**arrays, "a": arrays["a"][start:stop]}
    out = {"a": arrays["a"]}
    for j, part in enumerate(site.parts):
        start, stop = ranges.get(part, ranges["mlp"])  # gate and up: by intermediate unit
        out[f"b{j}"] = arrays[f"b{j}"][:, start:stop]
    return out


def shard_stored(params: dict, cfg: ModelConfig, n: int, shard: int) -> dict:
    """The stored tree (layers stacked, or a list of per-layer trees) -> this shard's stored
    tree. Row-parallel biases are kept on shard 0 alone (zeros elsewhere): the psum adds
    them once. Expert parallel, a layer's expert kernels [.., E, in, out] are cut whole by
    expert."""
    ranges = _ranges(cfg, n, shard)

    def one(path, leaf):
        names = tuple(getattr(p, "key", str(p)) for p in path)
        if names == ("embed",):
            return _cut(leaf, 0, *ranges["vocab"])
        if names == ("lm_head", "kernel"):
            return _cut(leaf, -1, *ranges["vocab"])
        module = names[-2] if len(names) >= 2 else ""
        if names[-1] in PER_HEAD:
            return _cut(leaf, -3, *ranges["heads"])
        if module in REPLICATED or not (module in ranges or module.endswith("_proj")):
            return leaf  # norms: every shard needs all of them
        span = _span(names, module, ranges)
        if "moe" in names and "shared_expert" not in names and cfg.expert_shards > 1:
            return _cut(leaf, -3, *span)
        if module in ROW_PARALLEL:
            if names[-1] == "bias":
                return leaf if shard == 0 else jnp.zeros_like(leaf)
            return _cut(leaf, -2, *span)
        return _cut(leaf, -1, *span)

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quantized)


def shard_experts(params: dict, cfg: ModelConfig, n: int, shard: int) -> dict:
    """Data-parallel attention (serving/engine/dp_attention.py): the stored tree with only a
    mixture's routed experts cut, whole by expert, `n` ways; everything else (attention,
    dense MLPs, router, shared expert, embedding, head) whole on every device."""
    e = cfg.num_experts // n

    def one(path, leaf):
        names = tuple(getattr(p, "key", str(p)) for p in path)
        module = names[-2] if len(names) >= 2 else ""
        if ("moe" in names and "shared_expert" not in names and module not in REPLICATED
                and module.endswith("_proj")):
            return _cut(leaf, -2 if names[-1] == "bias" else -3, shard * e, (shard + 1) * e)
        return leaf

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quantized)


def _span(names: tuple, module: str, ranges: dict) -> tuple[int, int]:
    if "shared_expert" in names:
        return ranges["shared_expert"]
    if "moe" in names:
        return ranges["experts"]
    return ranges["mlp"] if names[-3] == "mlp" else ranges[module]


def mesh_devices(mesh) -> list:
    return list(mesh.devices.reshape(-1))


def shard_params(params: dict, cfg: ModelConfig, mesh, pack: bool | None = None) -> dict:
    """Stored tree -> the run tree of every shard, stacked on a leading axis sharded over
    the mesh. Each process prepares the shards of its own devices."""
    n = mesh.shape[AXIS]
    blocks = {}
    for shard, device in enumerate(mesh_devices(mesh)):
        if device.process_index == jax.process_index():
            stored = jax.device_put(shard_stored(params, cfg, n, shard), device)
            blocks[device] = prepare_params(stored, pack=pack)
            del stored
    return stack_blocks(blocks, mesh)


def stack_blocks(blocks: dict, mesh, axis: str = AXIS) -> dict:
    """{device: run tree} (this process's devices) -> one tree of [n, ...] arrays, each
    device holding its own block."""
    sharding = NamedSharding(mesh, P(axis))
    n = mesh.shape[axis]
    trees = list(blocks.values())
    leaves = [jax.tree.leaves(t) for t in trees]
    treedef = jax.tree.structure(trees[0])
    stacked = []
    for i in range(len(leaves[0])):
        parts = [jnp.expand_dims(per_device[i], 0) for per_device in leaves]
        shape = (n, *parts[0].shape[1:])
        stacked.append(jax.make_array_from_single_device_arrays(shape, sharding, parts))
    return jax.tree.unflatten(treedef, stacked)


def abstract_sharded_params(stored_abstract: dict, cfg: ModelConfig, mesh) -> dict:
    """The run tree as ShapeDtypeStructs with their shardings, from the stored tree's
    structs (no weights: for lowering a sharded step, e.g. for a GPU on a CPU host)."""
    n = mesh.shape[AXIS]
    block = jax.eval_shape(lambda p: prepare_params(shard_stored(p, cfg, n, 0), pack=False),
                           stored_abstract)
    sharding = NamedSharding(mesh, P(AXIS))
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((n, *a.shape), a.dtype,
                                                       sharding=sharding), block)


def local_params(params):
    """Inside shard_map: [1, ...] blocks -> this shard's run tree."""
    return jax.tree.map(lambda a: a[0], params)


def cache_config(cfg: ModelConfig, n: int) -> ModelConfig:
    """The whole cache's shape: every shard's KV heads side by side (replicas included); a
    latent cache's one latent a token (each device holds all of it)."""
    if cfg.latent:
        return cfg
    return replace(cfg, num_kv_heads=local_kv_heads(cfg, n) * n)


def cache_specs(quantized: bool, window: bool = False, latent: bool = False) -> KVCache:
    """window: with a hybrid model's window layers' cache (model/kv_groups.py), split alike.
    latent: a latent cache (and its empty `v`), replicated."""
    spec = LATENT_SPEC if latent else KV_SPEC
    specs = KVCache(spec, spec, *((spec, spec) if quantized else (None, None)))
    return replace(specs, window=cache_specs(quantized)) if window else specs


def cache_shardings(mesh, quantized: bool, window: bool = False,
                    latent: bool = False) -> KVCache:
    return jax.tree.map(lambda s: NamedSharding(mesh, s),
                        cache_specs(quantized, window, latent))


def embed_vocab_parallel(table, ids, dtype, axis: str):
    """Rows `ids` of a table sharded by vocabulary row: each shard looks up the ids it
    holds (zeros for the others) and one psum joins them."""
    rows = table.shape[0]
    local = ids - jax.lax.axis_index(axis) * rows
    mine = (local >= 0) & (local < rows)
    x = embed(table, jnp.where(mine, local, 0), dtype)
    return jax.lax.psum(jnp.where(mine[:, None], x, jnp.zeros_like(x)), axis)
