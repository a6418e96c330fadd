"""Batched LoRA: the low-rank updates of several adapters beside the base weights, each token
of a step using the adapter of its request (docs/architecture.md, "LoRA adapters").

Adapters live in `S` device slots (`max_loras`) at one rank `R` (`max_lora_rank`; smaller
ranks are zero-padded, which is exact). Per linear layer a slot holds

    a: [S, in, K]   b: [S, K, out]   K = parts x R, the adapter's scale folded into b

where a joined projection (qkv_proj, gate_up_proj: model/runtime_params.py) keeps its parts'
A matrices side by side and its B block-diagonal, so one pair of matmuls serves q, k and v.
A token's slot comes with the step (`Batch.lora_slots`, -1: the base model alone), and

    y = base(x) + ((x @ a) * onehot(slot)) @ b

is two dense matmuls over every slot with the others masked out: no gather, and the same
program whatever mix of adapters a step has. Loading an adapter writes its slot in place
(`write_slot`, the slots donated), never a new program; `slot_arrays` builds the slot in
numpy on the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig

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
    """The device slots, all zero: per layer {module: {name: {"a", "b"}}}."""
    def zeros(site: Site):
        k = len(site.parts) * rank
        return {"a": jnp.zeros((max_loras, site.in_features, k), dtype),
                "b": jnp.zeros((max_loras, k, sum(site.out_features)), dtype)}
    return tuple(_nest({(s.module, s.name): zeros(s) for s in layer}) for layer in layer_sites)


def slot_arrays(layer_sites: list[tuple[Site, ...]], weights: dict, rank: int, dtype) -> tuple:
    """One adapter as a slot, in numpy: weights maps (layer, HF projection) -> (A [r, in],
    B [out, r], scale), PEFT's orientation; projections it does not adapt stay zero."""
    dtype = np.dtype(jnp.dtype(dtype))
    layers = []
    for i, layer in enumerate(layer_sites):
        entries = {}
        for site in layer:
            k = len(site.parts) * rank
            a = np.zeros((site.in_features, k), np.float32)
            b = np.zeros((k, sum(site.out_features)), np.float32)
            col = 0
            for j, (part, width) in enumerate(zip(site.parts, site.out_features)):
                if (i, part) in weights:
                    A, B, scale = weights[(i, part)]
                    r = A.shape[0]
                    a[:, j * rank:j * rank + r] = A.T
                    b[j * rank:j * rank + r, col:col + width] = B.T * scale
                col += width
            entries[(site.module, site.name)] = {"a": a.astype(dtype), "b": b.astype(dtype)}
        layers.append(_nest(entries))
    return tuple(layers)


@partial(jax.jit, donate_argnums=(0,))
def write_slot(slots, slot, one):
    """slots with slot `slot` (a traced int: one program for every slot) replaced by `one`."""
    return jax.tree.map(lambda s, o: s.at[slot].set(o.astype(s.dtype)), slots, one)


@partial(jax.jit, donate_argnums=(0,))
def write_slot_stacked(slots, slot, one):
    """write_slot for tensor parallelism: every leaf [shards, S, ...], `one` [shards, ...]."""
    return jax.tree.map(lambda s, o: s.at[:, slot].set(o.astype(s.dtype)), slots, one)


def token_mask(lora_slots, num_slots: int, dtype):
    """int32[T] slots (-1: none) -> [T, S] one-hot rows (all zero for the base model)."""
    return (lora_slots[:, None] == jnp.arange(num_slots)[None, :]).astype(dtype)


def layer_variables(layer_slots: dict, mask) -> dict:
    """A layer's slots with the step's token mask beside each site's a and b: the "lora"
    collection the layer's Linear modules read (model/layers.py)."""
    return {m: {n: {**ab, "mask": mask} for n, ab in names.items()}
            for m, names in layer_slots.items()}


def delta(x, a, b, mask):
    """x: [T, in] -> the LoRA update [T, out] of each token's slot (zero for slot -1)."""
    xa = jnp.einsum("ti,sik->tsk", x, a.astype(x.dtype), preferred_element_type=jnp.float32)
    xa = (xa * mask[:, :, None].astype(jnp.float32)).astype(x.dtype)
    return jnp.einsum("tsk,sko->to", xa, b.astype(x.dtype),
                      preferred_element_type=jnp.float32).astype(x.dtype)


def _nest(flat: dict) -> dict:
    out: dict = {}
    for (module, name), value in flat.items():
        out.setdefault(module, {})[name] = value
    return out
