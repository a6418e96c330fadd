"""The weights as a step program wants them, made once at load from the stored tree.

Stored (checkpoints, conversion, quantization): one tree, layers stacked on a leading axis
(or a list of per-layer trees, where a loaded file's layers differ in form), one kernel per
HF projection. Run: `prepare_params` gives
- one tree per layer, each leaf its own buffer. Slicing a layer out of a stacked array inside
  the program copies it on every step: a CPU decode step read SmolLM2's 513 MiB of float32
  weights at 8 GB/s that way, against 29 GB/s from separate buffers;
- q/k/v joined into `qkv_proj` and gate/up into `gate_up_proj`: one matmul where there were
  three or two (30 layers of SmolLM2 at one token: 21.1 ms -> 16.5 ms on 2 CPU cores).
  Weights quantized per tensor join with per-channel scales for the CPU kernels, and fp8
  ones elsewhere with one scale, the largest, as vLLM joins them.
- on CPUs, int8 weights (per output channel or in groups), int4 ones and fp8 ones with block
  scales packed for our kernels (quant/packed.py), and an int8 tied embedding table (per row
  or in groups) packed again as `lm_head`: XLA:CPU widens int8 weights in memory before a dot, the kernel in
  registers. Float weights (and a float tied table, as
  `lm_head`) are packed for the dense kernel, whose rows do not depend on their batch;
  a mixture of experts' stacked expert kernels for the grouped kernels
  (quant/packed_experts.py), and latent attention's per-head projections one kernel a head.

`forward` accepts either form (it prepares a stored tree itself, slowly, inside the program).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from quant import packed, packed_experts
from quant.array import QuantArray, cast_scaled, dequantize
from quant.fp8_blocks import Fp8BlockArray, concat_fp8_blocks
from quant.int4 import Int4Array, concat_int4, is_quantized
from quant.int8_groups import Int8GroupArray, concat_int8_groups

# module path -> (joined name, its parts); a mixture-of-experts layer joins its experts'
# gate/up ([E, in, out] each) and its shared expert's.
JOINED = {("attn",): ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
          ("mlp",): ("gate_up_proj", ("gate_proj", "up_proj")),
          ("moe",): ("gate_up_proj", ("gate_proj", "up_proj")),
          ("moe", "shared_expert"): ("gate_up_proj", ("gate_proj", "up_proj"))}


def is_prepared(params) -> bool:
    return isinstance(params["layers"], tuple)


def prepare_params(params, pack: bool | None = None, free_stacked: bool = False):
    """Stored tree -> run tree (a tree already prepared comes back as it is).

    pack: pack weights for the CPU kernels; None: when the default backend is a CPU and the
    kernels build.
    free_stacked: delete each stacked layer array once its layers are sliced out, so the
    device holds the weights about once (plus one stacked array) rather than twice; the
    caller's stored tree is unusable afterwards (the engine's load path)."""
    if is_prepared(params):
        return params
    if pack is None:
        pack = packed.kernels_available() and packed.dense_kernel_available()
    layers = params["layers"]
    if not isinstance(layers, list):
        layers = _unstacked(layers, free_stacked)
    per_layer = tuple(_join_projections(layer, exact=pack) for layer in layers)
    if pack:
        per_layer = tuple(_heads_apart(layer) for layer in per_layer)
    del layers
    params = {**params, "layers": per_layer}
    return _pack(params) if pack else params


def _unstacked(layers: dict, free_stacked: bool) -> list[dict]:
    """Layer-stacked weights -> one tree per layer, each leaf a buffer of its own."""
    leaves, treedef = jax.tree.flatten(layers)
    num_layers = leaves[0].shape[0]
    sliced = []  # per leaf: its layers
    for i in range(len(leaves)):
        stacked, leaves[i] = leaves[i], None
        sliced.append(_layer_slices(stacked, num_layers))
        if free_stacked and isinstance(stacked, jax.Array):
            stacked.delete()
        del stacked
    return [jax.tree.unflatten(treedef, [s[j] for s in sliced]) for j in range(num_layers)]


def _layer_slices(stacked, num_layers: int) -> list:
    """A stacked leaf's layers, each a buffer of its own. Held whole by one CPU device: cut
    by numpy on the host (the array's own memory) and put back, a copy each; an eager slice
    per layer is an XLA call each, 0.7 s of a demo start. Elsewhere (a GPU, a traced or
    sharded leaf): sliced by jax."""
    if (isinstance(stacked, jax.Array) and not isinstance(stacked, jax.core.Tracer)
            and len(stacked.sharding.device_set) == 1):
        device = next(iter(stacked.sharding.device_set))
        if device.platform == "cpu":
            host = np.asarray(stacked)  # a view of the device buffer, which may be freed:
            return [jax.device_put(host[j].copy(), device) for j in range(num_layers)]
    return [stacked[j] for j in range(num_layers)]


def _pack(params):
    """Every packable int8 kernel as a PackedQ8, and every other float or quantized kernel
    as a PackedDense; a tied table (int8, fp8 or float) also as the head."""
    def one(path, a):
        if packed_experts.packable(a):
            return packed_experts.pack(a)
        if packed.packable(a):
            return packed.pack(a)
        if packed.int4_packable(a):
            return packed.pack_int4(a)
        if packed.int8_groups_packable(a):
            return packed.pack_int8_groups(a)
        if packed.fp8_blocks_packable(a):
            return packed.pack_fp8_blocks(a)
        if not (path and getattr(path[-1], "key", None) == "kernel"):
            return a
        if packed.dense_packable(a):
            return packed.pack_dense(a)
        return packed.pack_codes(a) if packed.codes_packable(a) else a
    params = jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quantized)
    if "lm_head" not in params:
        head = (packed.pack_head(params["embed"])
                or packed.pack_int8_groups_head(params["embed"]))
        if head is None:
            head = packed.pack_dense_head(params["embed"])
        if head is not None:
            params["lm_head"] = {"kernel": head}
    return params


def _join_projections(layer: dict, exact: bool) -> dict:
    """q/k/v and gate/up joined. Weights quantized per tensor, each with its own scale, join
    with per-channel scales (exact) where `exact`, the CPU kernels' way; elsewhere fp8 ones
    are quantized again to the largest of their scales, as vLLM joins them, so the joined
    weight keeps the one scale XLA's fp8 GEMM needs."""
    for module, (joined, parts) in JOINED.items():
        sub = _module(layer, module)
        if sub is None or not all(p in sub for p in parts):
            continue
        kernels = [sub[p]["kernel"] for p in parts]
        if not _joinable(kernels):
            continue
        sub = dict(sub)
        entry = {"kernel": _concat(kernels, exact)}
        if "bias" in sub[parts[0]]:
            entry["bias"] = jnp.concatenate([sub[p]["bias"] for p in parts], axis=-1)
        for p in parts:
            del sub[p]
        sub[joined] = entry
        layer = _replaced(layer, module, sub)
    return layer


def _heads_apart(layer: dict) -> dict:
    """Latent attention's absorbed projections ([H, a, b] each) as H kernels of their own,
    for the dense kernel whose rows do not depend on their batch
    (model/latent_attention.py, per_head_matmul)."""
    attn = layer.get("attn")
    if not isinstance(attn, dict) or "k_up" not in attn:
        return layer
    attn = dict(attn)
    for name in ("k_up", "v_up"):
        w = attn[name]
        attn[name] = tuple({"kernel": w[h]} for h in range(w.shape[0]))
    return {**layer, "attn": attn}


def _module(tree: dict, path: tuple):
    for p in path:
        if not isinstance(tree, dict) or p not in tree:
            return None
        tree = tree[p]
    return tree


def _replaced(tree: dict, path: tuple, value) -> dict:
    """A copy of `tree` with the module at `path` replaced (the caller's tree untouched)."""
    if not path:
        return value
    return {**tree, path[0]: _replaced(tree[path[0]], path[1:], value)}


def _joinable(kernels) -> bool:
    if any(isinstance(k, Fp8BlockArray) for k in kernels):
        return (all(isinstance(k, Fp8BlockArray) for k in kernels)
                and len({k.block[0] for k in kernels}) == 1)
    if any(isinstance(k, Int4Array) for k in kernels):
        return all(isinstance(k, Int4Array) for k in kernels)
    if any(isinstance(k, Int8GroupArray) for k in kernels):  # one group size, mins all or none
        return (all(isinstance(k, Int8GroupArray) for k in kernels)
                and len({(k.group, k.offset is None) for k in kernels}) == 1)
    if all(not isinstance(k, QuantArray) for k in kernels):
        return len({k.dtype for k in kernels}) == 1
    return (all(isinstance(k, QuantArray) for k in kernels)
            and len({k.values.dtype for k in kernels}) == 1)


def _concat_quant(kernels: list[QuantArray], exact: bool) -> QuantArray:
    """QuantArrays joined along the output axis with per-channel scales, or, for fp8 ones
    all per tensor where not `exact`, their codes quantized again to the largest scale
    (vLLM's requantize_with_max_scale)."""
    fp8 = jnp.dtype(kernels[0].values.dtype) == jnp.float8_e4m3fn
    if fp8 and not exact and all(k.per_tensor for k in kernels):
        top = functools.reduce(jnp.maximum, [k.scale for k in kernels])  # per expert
        return QuantArray(jnp.concatenate([cast_scaled(dequantize(k), top, k.values.dtype)
                                           for k in kernels], axis=-1), top)
    return QuantArray(
        jnp.concatenate([k.values for k in kernels], axis=-1),
        jnp.concatenate([jnp.broadcast_to(k.scale, (*k.scale.shape[:-1], k.shape[-1]))
                         for k in kernels], -1))


def _widened(k):
    """A group weight's scale (and offset) as float32, where float16 ones are exact."""
    fields = {f: getattr(k, f).astype(jnp.float32) for f in ("scale", "zero", "offset")
              if getattr(k, f, None) is not None}
    return dataclasses.replace(k, **fields)


def _concat(kernels, exact: bool):
    if isinstance(kernels[0], Fp8BlockArray):
        return concat_fp8_blocks(kernels)
    if isinstance(kernels[0], (Int4Array, Int8GroupArray)):
        if len({k.scale.dtype for k in kernels}) > 1:
            kernels = [_widened(k) for k in kernels]
        join = concat_int4 if isinstance(kernels[0], Int4Array) else concat_int8_groups
        return join(kernels)
    if isinstance(kernels[0], QuantArray):
        return _concat_quant(kernels, exact)
    return jnp.concatenate(kernels, axis=-1)
