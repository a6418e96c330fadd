"""config.json's Mamba2 fields (Nemotron-H, Granite 4.0-H, Falcon-H1) onto ModelConfig's.

Nemotron-H lists one block per layer in `layers_block_type` ("linear_attention": a Mamba2
mixer, model/linear_attention/mamba2.py; "full_attention"; "mlp": an MLP alone; "moe"), or
in the older `hybrid_override_pattern` string (M, *, -, E), and takes its layer count from
that list. Granite 4.0-H names each layer's mixer in `layer_types` ("mamba" / "attention"
in older files); every layer also has its MLP: routed experts beside a shared MLP, or the
shared MLP alone where num_local_experts is 0. Falcon-H1 runs Mamba2 beside attention in
every layer, with muP multipliers. `nemotron_hf`, `granite_hf` and `falcon_hf` rename each
family's fields to the ones model/config.py and `mamba_fields` read.
"""
from __future__ import annotations

import math

from model.config import DTYPES, ConfigError

_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
MIXERS = {"linear_attention": "mamba2", "full_attention": "attention", "mlp": "none",
          "moe": "none",  # a block of an MLP, or of experts, alone
          "hybrid": "hybrid"}  # Falcon-H1: Mamba2 and attention side by side


def block_types(hf: dict) -> list[str]:
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if not types:
        pattern = hf.get("hybrid_override_pattern")
        if not pattern:
            raise ConfigError("a Nemotron-H config.json names its blocks in layers_block_type "
                              "or hybrid_override_pattern; it has neither")
        unknown = sorted(set(pattern) - set(_PATTERN))
        if unknown:
            raise ConfigError(f"unsupported hybrid_override_pattern characters {unknown}; "
                              "supported: " + ", ".join(_PATTERN))
        types = [_PATTERN[c] for c in pattern]
    return [_LEGACY.get(t, t) for t in types]


def nemotron_hf(hf: dict) -> dict:
    """Nemotron-H's names -> the common ones: the layer count from the block list, the
    norms' epsilon, the MLP's activation."""
    types = block_types(hf)
    return {**hf, "num_hidden_layers": len(types), "layers_block_type": types,
            "rms_norm_eps": hf["layer_norm_epsilon"], "hidden_act": hf["mlp_hidden_act"]}


def granite_hf(hf: dict) -> dict:
    """Granite 4.0-H's names -> Nemotron-H's (the Mamba2 fields) and the common ones: the
    shared MLP is the MoE's ungated shared expert, or the dense MLP where there are no
    experts."""
    hidden, heads = int(hf["hidden_size"]), int(hf["mamba_n_heads"])
    inner = int(hf["mamba_expand"]) * hidden
    head_dim = hf["mamba_d_head"]
    head_dim = inner // heads if head_dim == "auto" else int(head_dim)
    if head_dim * heads != inner:
        raise ConfigError(f"mamba_n_heads={heads} x mamba_d_head={head_dim} is not "
                          f"mamba_expand x hidden_size = {inner}")
    types = hf.get("layer_types") or ["linear_attention"] * int(hf["num_hidden_layers"])
    types = [_LEGACY.get(t, t) for t in types]
    if set(types) - {"linear_attention", "full_attention"}:
        raise ConfigError(f"unsupported layer_types {sorted(set(types))}; supported: "
                          "mamba, attention (linear_attention, full_attention)")
    experts = int(hf.get("num_local_experts") or 0)
    shared = int(hf["shared_intermediate_size"])
    return {**hf, "layers_block_type": types, "mamba_num_heads": heads,
            "mamba_head_dim": head_dim, "ssm_state_size": hf["mamba_d_state"],
            "n_groups": hf["mamba_n_groups"], "conv_kernel": hf["mamba_d_conv"],
            "chunk_size": hf["mamba_chunk_size"], "use_conv_bias": hf["mamba_conv_bias"],
            "use_bias": hf["mamba_proj_bias"],
            **({"shared_expert_intermediate_size": shared} if experts
               else {"intermediate_size": shared})}


def falcon_hf(hf: dict) -> dict:
    """Falcon-H1's names -> Nemotron-H's (the Mamba2 fields): every layer "hybrid", the
    mixer's width `mamba_d_ssm` (else mamba_expand x hidden_size), out_proj's bias its own
    (`projectors_bias`), and the optional gated norm."""
    inner = int(hf.get("mamba_d_ssm") or int(hf["mamba_expand"]) * int(hf["hidden_size"]))
    heads = int(hf["mamba_n_heads"])
    head_dim = hf["mamba_d_head"]
    head_dim = inner // heads if head_dim == "auto" else int(head_dim)
    if head_dim * heads != inner:
        raise ConfigError(f"mamba_n_heads={heads} x mamba_d_head={head_dim} is not the "
                          f"mixer's width {inner}")
    norm = ("none" if not hf.get("mamba_rms_norm") else
            "norm_first" if hf.get("mamba_norm_before_gate", True) else "gate_first")
    return {**hf, "layers_block_type": ["hybrid"] * int(hf["num_hidden_layers"]),
            "mamba_num_heads": heads, "mamba_head_dim": head_dim,
            "ssm_state_size": hf["mamba_d_state"], "n_groups": hf["mamba_n_groups"],
            "conv_kernel": hf["mamba_d_conv"], "chunk_size": hf["mamba_chunk_size"],
            "use_conv_bias": hf["mamba_conv_bias"], "use_bias": hf["mamba_proj_bias"],
            "ssm_out_bias": bool(hf.get("projectors_bias")), "ssm_norm": norm}


def falcon_multipliers(hf: dict) -> tuple[tuple[str, float], ...]:
    """Falcon-H1's muP multipliers by our names, the ones that are not 1."""
    ssm = hf.get("ssm_multipliers") or [1.0] * 5
    mlp = hf.get("mlp_multipliers") or [1.0] * 2
    if len(ssm) != 5 or len(mlp) != 2:
        raise ConfigError(f"ssm_multipliers takes 5 values and mlp_multipliers 2; got "
                          f"{ssm!r} and {mlp!r}")
    named = {"ssm_z": ssm[0], "ssm_x": ssm[1], "ssm_b": ssm[2], "ssm_c": ssm[3],
             "ssm_dt": ssm[4], "mlp_gate": mlp[0], "mlp_down": mlp[1],
             **{ours: hf.get(theirs) for ours, theirs in (
                 ("ssm_in", "ssm_in_multiplier"), ("ssm_out", "ssm_out_multiplier"),
                 ("attn_in", "attention_in_multiplier"),
                 ("attn_out", "attention_out_multiplier"), ("key", "key_multiplier"),
                 ("lm_head", "lm_head_multiplier"))}}
    return tuple(sorted((k, float(v)) for k, v in named.items()
                        if v is not None and float(v) != 1.0))


def block_moe_layers(hf: dict) -> tuple[bool, ...]:
    """Nemotron-H: the blocks of experts (routed as DeepSeek-V3 routes) are the MoE layers."""
    return tuple(t == "moe" for t in hf["layers_block_type"])


def _number(v) -> float:
    """A float as config.json may write it: a number, "inf", or transformers'
    {"__float__": "Infinity"}."""
    if isinstance(v, dict):
        v = v.get("__float__")
    try:
        return float(v)
    except (TypeError, ValueError):
        raise ConfigError(f"unreadable number {v!r} in time_step_limit") from None


def mamba_fields(hf: dict, num_layers: int) -> dict:
    types = hf["layers_block_type"]
    if len(types) != num_layers:
        raise ConfigError(f"layers_block_type names {len(types)} layers, the model has "
                          f"{num_layers}")
    unknown = sorted(set(types) - set(MIXERS))
    if unknown:
        raise ConfigError(f"unsupported layers_block_type {unknown}; supported: "
                          + ", ".join(MIXERS))
    heads, groups = int(hf["mamba_num_heads"]), int(hf["n_groups"])
    if heads % groups:
        raise ConfigError(f"mamba_num_heads={heads} is not a multiple of n_groups={groups}")
    if hf.get("mamba_hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported mamba_hidden_act={hf['mamba_hidden_act']!r} "
                          "(supported: 'silu')")
    kernel = int(hf["conv_kernel"])
    if kernel < 2:
        raise ConfigError(f"unsupported conv_kernel={kernel} (at least 2)")
    low, high = (_number(v) for v in hf.get("time_step_limit") or (0.0, math.inf))
    state_dtype = hf.get("mamba_ssm_cache_dtype") or "float32"
    if state_dtype not in DTYPES:
        raise ConfigError(f"unsupported mamba_ssm_cache_dtype={state_dtype!r}; choose one of "
                          + ", ".join(DTYPES))
    return dict(mixers=tuple(MIXERS[t] for t in types), ssm_heads=heads,
                ssm_head_dim=int(hf["mamba_head_dim"]), ssm_state_size=int(hf["ssm_state_size"]),
                ssm_groups=groups, ssm_chunk=int(hf["chunk_size"]), linear_conv_kernel=kernel,
                ssm_conv_bias=bool(hf["use_conv_bias"]), ssm_proj_bias=bool(hf.get("use_bias")),
                ssm_out_bias=bool(hf.get("ssm_out_bias", hf.get("use_bias"))),
                ssm_norm=hf.get("ssm_norm", "gate_first"),
                ssm_dt_limit=(low, high), ssm_state_dtype=state_dtype)


def granite_fields(hf: dict) -> dict:
    """Granite's embedding, residual and logits multipliers."""
    return dict(embedding_multiplier=float(hf["embedding_multiplier"]),
                residual_multiplier=float(hf["residual_multiplier"]),
                logits_scaling=float(hf["logits_scaling"]))


def falcon_fields(hf: dict) -> dict:
    """Falcon-H1's embedding multiplier and muP multipliers (falcon_multipliers)."""
    return dict(embedding_multiplier=float(hf.get("embedding_multiplier") or 1.0),
                multipliers=falcon_multipliers(hf))
