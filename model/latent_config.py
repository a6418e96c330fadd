"""config.json's latent-attention fields (DeepSeek-V2 and V3) onto ModelConfig's."""
from __future__ import annotations

import math

from model.families import Family


def latent_fields(hf: dict, family: Family) -> dict:
    """DeepSeek's latent attention: the sizes, and the softmax scale over the nope and rope
    dims with YaRN's mscale_all_dim folded in twice, as transformers' yarn_apply_mscale."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    nope, rot = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
    scale = (nope + rot) ** -0.5
    all_dim = float(rope.get("mscale_all_dim") or 0.0)
    if rope.get("rope_type", rope.get("type", "default")) != "default" and all_dim:
        factor = float(rope["factor"])
        m = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
        scale *= m * m
    return dict(head_dim=rot, kv_lora_rank=int(hf["kv_lora_rank"]),
                q_lora_rank=int(hf.get("q_lora_rank") or 0), qk_nope_head_dim=nope,
                v_head_dim=int(hf["v_head_dim"]), query_scale=scale,
                rope_interleaved=family.rope_interleaved or bool(hf.get("rope_interleave")))
