"""config.json's RoPE fields onto ModelConfig's: the scaling (rope_parameters or
rope_scaling) as sorted items, and the dims a partial rotary factor turns."""
from __future__ import annotations

from model.config import ConfigError


def scaling_items(rs: dict):
    """rope_type and its numbers, sorted; None for plain RoPE."""
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear", "yarn"):
        raise ConfigError(f"unsupported rope_scaling type {kind!r}; supported: llama3, "
                          "linear, yarn")
    items = {"rope_type": kind}
    for key in ("factor", "low_freq_factor", "high_freq_factor",
                "original_max_position_embeddings", "beta_fast", "beta_slow",
                "attention_factor", "mscale", "mscale_all_dim"):
        if rs.get(key) is not None:
            items[key] = float(rs[key])
    if kind == "yarn":
        if "factor" not in items or "original_max_position_embeddings" not in items:
            raise ConfigError("yarn rope_scaling needs factor and "
                              "original_max_position_embeddings")
        items["truncate"] = float(bool(rs.get("truncate", True)))
    return tuple(sorted(items.items()))




def rotary_dim(hf: dict, rope: dict, head_dim: int) -> int:
    """partial_rotary_factor (in rope_parameters or at the top) -> the dims RoPE turns."""
    factor = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if not 0 < factor <= 1:
        raise ConfigError(f"unsupported partial_rotary_factor={factor!r}")
    dim = int(head_dim * factor)
    if dim % 2:
        raise ConfigError(f"partial_rotary_factor={factor} rotates an odd {dim} dims")
    return 0 if dim == head_dim else dim
