"""DeepSeek's attention tensors as our latent attention takes them (model/latent_attention.py):
names onto parameter paths, `kv_b_proj` split into each head's absorbed projections, and
interleaved rope rows permuted to the rotate-half layout. Data for model/hf_weights.py."""
from __future__ import annotations

import re

import numpy as np

from model.config import ModelConfig

_LAYER = r"model\.layers\.(\d+)\."
_ATTN = ("layers", "attn")
# (HF name pattern, parameter path, transpose), as hf_weights.HF_TABLE
TABLE = [
    (_LAYER + r"self_attn\.q_a_proj\.weight", (*_ATTN, "q_a_proj", "kernel"), True),
    (_LAYER + r"self_attn\.q_a_proj\.bias", (*_ATTN, "q_a_proj", "bias"), False),
    (_LAYER + r"self_attn\.q_a_layernorm\.weight", (*_ATTN, "q_a_norm", "scale"), False),
    (_LAYER + r"self_attn\.q_b_proj\.weight", (*_ATTN, "q_b_proj", "kernel"), True),
    (_LAYER + r"self_attn\.kv_a_proj_with_mqa\.weight", (*_ATTN, "kv_a_proj", "kernel"), True),
    (_LAYER + r"self_attn\.kv_a_proj_with_mqa\.bias", (*_ATTN, "kv_a_proj", "bias"), False),
    (_LAYER + r"self_attn\.kv_a_layernorm\.weight", (*_ATTN, "kv_a_norm", "scale"), False),
    (_LAYER + r"mlp\.gate\.e_score_correction_bias", ("layers", "moe", "router_bias"), False),
    (_LAYER + r"mlp\.shared_experts\.(gate|up|down)_proj\.weight",
     ("layers", "moe", "shared_expert", "{}_proj", "kernel"), True),
]
KV_B = re.compile(_LAYER + r"self_attn\.kv_b_proj\.weight")
_Q = re.compile(_LAYER + r"self_attn\.q_(?:b_)?proj\.weight")
_KV_A = re.compile(_LAYER + r"self_attn\.kv_a_proj_with_mqa\.(?:weight|bias)")


def split_kv_b(name: str, value, cfg: ModelConfig):
    """kv_b_proj [H * (nope + v), r] -> (layer, [(path, array, transpose)]) for `k_up`
    [H, nope, r] (q_nope_h @ k_up[h] is the absorbed query) and `v_up` [H, r, v]; None for
    another tensor."""
    m = KV_B.fullmatch(name)
    if m is None:
        return None
    H, nope = cfg.num_heads, cfg.qk_nope_head_dim
    w = np.asarray(value).reshape(H, nope + cfg.v_head_dim, cfg.kv_lora_rank)
    return int(m.group(1)), [((*_ATTN, "k_up"), np.ascontiguousarray(w[:, :nope]), False),
                             ((*_ATTN, "v_up"), np.ascontiguousarray(
                                 w[:, nope:].transpose(0, 2, 1)), False)]


def halves(n: int) -> np.ndarray:
    """Interleaved pairs (0, 1), (2, 3), ... -> rotate-half order: evens, then odds."""
    return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


def rope_halves_order(cfg: ModelConfig, latent: bool) -> np.ndarray:
    """The output-row order that puts interleaved rope dims in rotate-half order: of the
    latent projection (rope rows after kv_lora_rank) or of the query (each head's after its
    nope rows). For a kernel in any form (gguf_tensors.permute_rows)."""
    rot = cfg.head_dim
    if latent:
        return np.concatenate([np.arange(cfg.kv_lora_rank), cfg.kv_lora_rank + halves(rot)])
    head = np.concatenate([np.arange(cfg.qk_nope_head_dim), cfg.qk_nope_head_dim + halves(rot)])
    width = cfg.qk_nope_head_dim + rot
    return (np.arange(cfg.num_heads)[:, None] * width + head).reshape(-1)


def deinterleave_rope(name: str, value, cfg: ModelConfig, check: bool = False):
    """A query or latent projection of a model whose rope dims come in interleaved pairs,
    its rope rows (output rows, HF [out, in]) put in rotate-half order; others unchanged.
    Scores are the same: q and k_rot move alike. check: only say whether `name` is such a
    tensor (or its scale, or its bias): -> True or None."""
    if not cfg.rope_interleaved:
        return None if check else value
    if check:
        module = name.rpartition(".")[0]
        return True if (_Q.fullmatch(module + ".weight")
                        or _KV_A.fullmatch(module + ".weight")) else None
    rot = cfg.head_dim
    if _Q.fullmatch(name):
        w = np.array(value).reshape(cfg.num_heads, cfg.qk_nope_head_dim + rot, -1)
        w[:, cfg.qk_nope_head_dim:] = w[:, cfg.qk_nope_head_dim:][:, halves(rot)]
        return w.reshape(value.shape)
    if _KV_A.fullmatch(name):
        w = np.array(value)
        w[cfg.kv_lora_rank:] = w[cfg.kv_lora_rank:][halves(rot)]
        return w
    return value


def rope_in_blocks(cfg: ModelConfig, rows: int) -> bool:
    """Whether each rope span of the query (per head) and of the latent projection lies
    inside one block of `rows` output rows, so permuting it keeps every row's scale."""
    rot, width = cfg.head_dim, cfg.qk_nope_head_dim + cfg.head_dim
    starts = [h * width + cfg.qk_nope_head_dim for h in range(cfg.num_heads)]
    starts.append(cfg.kv_lora_rank)
    return all(s // rows == (s + rot - 1) // rows for s in starts)


def is_mtp_layer(name: str, cfg: ModelConfig) -> bool:
    """A tensor of the next-token prediction layers stored after the main stack."""
    m = re.match(_LAYER, name)
    return bool(cfg.num_mtp_layers and m and int(m.group(1)) >= cfg.num_layers)
