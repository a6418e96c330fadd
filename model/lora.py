"""Batched LoRA: the low-rank updates of several adapters beside the base weights, each token
of a step using the adapter of its request (docs/architecture.md, "LoRA adapters").

Adapters live in `S` device slots (`max_loras`) at one rank `R` (`max_lora_rank`; smaller
ranks are zero-padded, which is exact). Per linear layer a slot holds

    a: [S, in, P x R]   b0 .. b{P-1}: [S, R, out_p]   (the adapter's scale folded into b)

for the P projections it joins (3 for qkv_proj, 2 for gate_up_proj, model/runtime_params.py):
one shrink for all of them, then one expand per part. A token's slot comes with the step
(`Batch.lora_slots`, -1: the base model alone). The step sorts its tokens by slot once
(`route`), and each site runs its shrink and expands as grouped matmuls over the sorted rows,
as a mixture of experts runs its experts (quant/ops.py `grouped_matmul`): each token meets
its own slot's weights only, base-only tokens come last and get zeros, and the program is
the same whatever mix of adapters a step has. On CPUs the slots are stored in the grouped
dense kernel's panel order, so a token gets the bits it would get alone; elsewhere
`ragged_dot`. Loading an adapter writes its slot in place (`write_slot`, the slots
donated), never a new program; `slot_arrays` builds the slot in numpy on the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig
from pallas_kernels import dense_matmul_cpu, grouped_matmul_cpu

# The Hugging Face projections an adapter may target, and the layer module holding each.
TARGETS = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_JOINED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class Site:
    """One linear layer that carries LoRA: where it is and what it joins."""
    module: str  # "attn" | "mlp"
    name: str  # the run tree's name: qkv_proj, o_proj, ...
    parts: tuple[str, ...]  # the HF projections it holds, in output order
    in_features: int
    out_features: tuple[int, ...]  # per part


def sites(cfg: ModelConfig, layer: dict) -> tuple[Site, ...]:
    """The LoRA sites of one prepared layer (its q/k/v and gate/up joined or not; a mixture
    of experts' layer has its attention's only)."""
    out = {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size,
           "o_proj": cfg.hidden_size, "gate_proj": cfg.intermediate_size,
           "up_proj": cfg.intermediate_size, "down_proj": cfg.hidden_size}
    fan_in = {"q_proj": cfg.hidden_size, "k_proj": cfg.hidden_size,
              "v_proj": cfg.hidden_size, "o_proj": cfg.q_size,
              "gate_proj": cfg.hidden_size, "up_proj": cfg.hidden_size,
              "down_proj": cfg.intermediate_size}
    found = []
    for module in ("attn", "mlp"):
        for name in layer.get(module, {}):
            parts = _JOINED.get(name, (name,))
            if all(p in TARGETS for p in parts):
                found.append(Site(module, name, parts, fan_in[parts[0]],
                                  tuple(out[p] for p in parts)))
    return tuple(found)


def empty_slots(layer_sites: list[tuple[Site, ...]], max_loras: int, rank: int, dtype):
    """The device slots, all zero: per layer {module: {name: {"a", "b0", ...}}}."""
    def zeros(site: Site):
        out = {"a": jnp.zeros((max_loras, site.in_features, len(site.parts) * rank), dtype)}
        for j, width in enumerate(site.out_features):
            out[f"b{j}"] = jnp.zeros((max_loras, rank, width), dtype)
        return out
    return tuple(_nest({(s.module, s.name): zeros(s) for s in layer}) for layer in layer_sites)


def slot_arrays(layer_sites: list[tuple[Site, ...]], weights: dict, rank: int, dtype) -> tuple:
    """One adapter as a slot, in numpy: weights maps (layer, HF projection) -> (A [r, in],
    B [out, r], scale), PEFT's orientation; projections it does not adapt stay zero."""
    dtype = np.dtype(jnp.dtype(dtype))
    layers = []
    for i, layer in enumerate(layer_sites):
        entries = {}
        for site in layer:
            a = np.zeros((site.in_features, len(site.parts) * rank), np.float32)
            out = {}
            for j, (part, width) in enumerate(zip(site.parts, site.out_features)):
                b = np.zeros((rank, width), np.float32)
                if (i, part) in weights:
                    A, B, scale = weights[(i, part)]
                    r = A.shape[0]
                    a[:, j * rank:j * rank + r] = A.T
                    b[:r] = B.T * scale
                out[f"b{j}"] = b.astype(dtype)
            entries[(site.module, site.name)] = {"a": a.astype(dtype), **out}
        layers.append(_nest(entries))
    return tuple(layers)


def packed() -> bool:
    """Slots in the grouped CPU kernel's panel order (pallas_kernels/grouped_matmul_cpu.py)."""
    return grouped_matmul_cpu.kernel_available("dense")


def _stored(one):
    """A slot's arrays as the slots keep them: panel order where the kernel runs them."""
    if not packed():
        return one
    pack = dense_matmul_cpu.pack_panels
    return jax.tree.map(lambda w: jnp.vectorize(pack, signature="(k,n)->(k,n)")(w), one)


@partial(jax.jit, donate_argnums=(0,))
def write_slot(slots, slot, one):
    """slots with slot `slot` (a traced int: one program for every slot) replaced by `one`."""
    return jax.tree.map(lambda s, o: s.at[slot].set(o.astype(s.dtype)), slots, _stored(one))


@partial(jax.jit, donate_argnums=(0,))
def write_slot_stacked(slots, slot, one):
    """write_slot for tensor parallelism: every leaf [shards, S, ...], `one` [shards, ...]."""
    return jax.tree.map(lambda s, o: s.at[:, slot].set(o.astype(s.dtype)), slots, _stored(one))


def route(lora_slots, num_slots: int) -> dict:
    """int32[T] slots (-1: none) -> the step's token order by slot, base-only tokens last:
    {"order", "inverse" (int32[T]), "sizes" (int32[S], tokens per slot)}."""
    key = jnp.where(lora_slots < 0, num_slots, lora_slots)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes = jnp.sum(key[None, :] == jnp.arange(num_slots)[:, None], axis=1).astype(jnp.int32)
    return {"order": order, "inverse": jnp.argsort(order).astype(jnp.int32), "sizes": sizes}


def layer_variables(layer_slots: dict, routing: dict) -> dict:
    """A layer's slots with the step's routing beside each site's weights: the "lora"
    collection the layer's Linear modules read (model/layers.py)."""
    return {m: {n: {**w, **routing} for n, w in names.items()}
            for m, names in layer_slots.items()}


def delta(x, site: dict):
    """x: [T, in] -> the LoRA update [T, out] of each token's slot (zero for slot -1).
    site: layer_variables' entry of one Linear."""
    sizes = site["sizes"]
    xa = _grouped(x[site["order"]], site["a"], sizes)
    rank = site["b0"].shape[1]
    parts = [_grouped(xa[:, j * rank:(j + 1) * rank], site[f"b{j}"], sizes)
             for j in range(xa.shape[1] // rank)]
    return jnp.concatenate(parts, axis=-1)[site["inverse"]]


def _grouped(rows, w, sizes):
    """rows sorted by slot against their slot's weight; rows past the slots' sum: zeros.
    The kernel only in a program for a CPU (one lowered for a GPU on this host, too, takes
    `ragged_dot`)."""
    if not packed():
        return _ragged(rows, w, sizes)
    kernel = lambda r, w, n: grouped_matmul_cpu.grouped_matmul("dense", r, n, w)
    return jax.lax.platform_dependent(rows, w, sizes, cpu=kernel, default=_ragged)


def _ragged(rows, w, sizes):
    return jax.lax.ragged_dot(rows, w.astype(rows.dtype), sizes,
                              preferred_element_type=jnp.float32).astype(rows.dtype)


def _nest(flat: dict) -> dict:
    out: dict = {}
    for (module, name), value in flat.items():
        out.setdefault(module, {})[name] = value
    return out
