"""The weights as a step program wants them, made once at load from the stored tree.

Stored (checkpoints, conversion, quantization): one tree, layers stacked on a leading axis,
one kernel per HF projection. Run: `prepare_params` gives
- one tree per layer, each leaf its own buffer. Slicing a layer out of a stacked array inside
  the program copies it on every step: a CPU decode step read SmolLM2's 513 MiB of float32
  weights at 8 GB/s that way, against 29 GB/s from separate buffers;
- q/k/v joined into `qkv_proj` and gate/up into `gate_up_proj`: one matmul where there were
  three or two (30 layers of SmolLM2 at one token: 21.1 ms -> 16.5 ms on 2 CPU cores).
  Weights quantized per tensor keep their own scales, so they stay apart.
- on CPUs, int8 weights (per output channel) and int4 ones packed for our kernels
  (quant/packed.py), and
  an int8 tied embedding table packed again as `lm_head`: XLA:CPU widens int8 weights in
  memory before a dot, the kernel in registers. Float weights (and a float tied table, as
  `lm_head`) are packed for the dense kernel, whose rows do not depend on their batch.

`forward` accepts either form (it prepares a stored tree itself, slowly, inside the program).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from quant import packed
from quant.array import QuantArray
from quant.int4 import Int4Array, concat_int4, is_quantized

JOINED = {"attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
          "mlp": ("gate_up_proj", ("gate_proj", "up_proj"))}


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
    leaves, treedef = jax.tree.flatten(layers)
    num_layers = leaves[0].shape[0]
    sliced = []  # per leaf: its layers
    for i in range(len(leaves)):
        stacked, leaves[i] = leaves[i], None
        sliced.append([stacked[j] for j in range(num_layers)])
        if free_stacked and isinstance(stacked, jax.Array):
            stacked.delete()
        del stacked
    per_layer = tuple(_join_projections(jax.tree.unflatten(treedef, [s[j] for s in sliced]))
                      for j in range(num_layers))
    del sliced
    params = {**params, "layers": per_layer}
    return _pack(params) if pack else params


def _pack(params):
    """Every packable int8 kernel as a PackedQ8, and every other float or quantized kernel
    as a PackedDense; a tied table (int8, fp8 or float) also as the head."""
    def one(path, a):
        if packed.packable(a):
            return packed.pack(a)
        if packed.int4_packable(a):
            return packed.pack_int4(a)
        if not (path and getattr(path[-1], "key", None) == "kernel"):
            return a
        if packed.dense_packable(a):
            return packed.pack_dense(a)
        return packed.pack_codes(a) if packed.codes_packable(a) else a
    params = jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quantized)
    if "lm_head" not in params:
        head = packed.pack_head(params["embed"])
        if head is None:
            head = packed.pack_dense_head(params["embed"])
        if head is not None:
            params["lm_head"] = {"kernel": head}
    return params


def _join_projections(layer: dict) -> dict:
    layer = dict(layer)
    for module, (joined, parts) in JOINED.items():
        sub = dict(layer[module])
        kernels = [sub[p]["kernel"] for p in parts]
        if not _joinable(kernels):
            continue
        entry = {"kernel": _concat(kernels)}
        if "bias" in sub[parts[0]]:
            entry["bias"] = jnp.concatenate([sub[p]["bias"] for p in parts], axis=-1)
        for p in parts:
            del sub[p]
        sub[joined] = entry
        layer[module] = sub
    return layer


def _joinable(kernels) -> bool:
    if any(isinstance(k, Int4Array) for k in kernels):
        return all(isinstance(k, Int4Array) for k in kernels)
    if all(not isinstance(k, QuantArray) for k in kernels):
        return len({k.dtype for k in kernels}) == 1
    return (all(isinstance(k, QuantArray) and not k.per_tensor for k in kernels)
            and len({k.values.dtype for k in kernels}) == 1)


def _concat(kernels):
    if isinstance(kernels[0], Int4Array):
        return concat_int4(kernels)
    if isinstance(kernels[0], QuantArray):
        return QuantArray(jnp.concatenate([k.values for k in kernels], axis=-1),
                          jnp.concatenate([k.scale for k in kernels], axis=-1))
    return jnp.concatenate(kernels, axis=-1)
