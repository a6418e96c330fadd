"""config.json's linear-attention fields (Qwen3-Next, Qwen3.5) onto ModelConfig's.

`layer_types` names each layer "linear_attention" (a Gated DeltaNet mixer:
model/linear_attention/) or "full_attention"; where it is missing, every
`full_attention_interval`-th layer (1-based, default 4) attends and the others are linear,
as transformers' config classes build it.
"""
from __future__ import annotations

from model.config import DTYPES, ConfigError

LINEAR, FULL = "linear_attention", "full_attention"
MIXERS = {LINEAR: "gdn", FULL: "attention"}


def linear_fields(hf: dict, num_layers: int) -> dict:
    types = hf.get("layer_types")
    if not types:
        every = int(hf.get("full_attention_interval") or 4)
        types = [FULL if (i + 1) % every == 0 else LINEAR for i in range(num_layers)]
    if len(types) != num_layers:
        raise ConfigError(f"layer_types names {len(types)} layers, the model has {num_layers}")
    unknown = sorted(set(types) - set(MIXERS))
    if unknown:
        raise ConfigError(f"unsupported layer_types {unknown}; supported: {LINEAR}, {FULL}")
    if hf.get("use_sliding_window"):
        raise ConfigError("unsupported config: use_sliding_window=true on a linear-attention "
                          "hybrid")
    key_heads, value_heads = int(hf["linear_num_key_heads"]), int(hf["linear_num_value_heads"])
    if value_heads % key_heads:
        raise ConfigError(f"linear_num_value_heads={value_heads} is not a multiple of "
                          f"linear_num_key_heads={key_heads}")
    kernel = int(hf.get("linear_conv_kernel_dim") or 4)
    if kernel < 2:
        raise ConfigError(f"unsupported linear_conv_kernel_dim={kernel} (at least 2)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported hidden_act={hf['hidden_act']!r} on a linear-attention "
                          "hybrid (supported: 'silu')")
    state_dtype = hf.get("mamba_ssm_dtype") or "float32"
    if state_dtype not in DTYPES:
        raise ConfigError(f"unsupported mamba_ssm_dtype={state_dtype!r}; choose one of "
                          + ", ".join(DTYPES))
    return dict(mixers=tuple(MIXERS[t] for t in types), linear_key_heads=key_heads,
                linear_value_heads=value_heads,
                linear_key_dim=int(hf["linear_key_head_dim"]),
                linear_value_dim=int(hf["linear_value_head_dim"]),
                linear_conv_kernel=kernel, ssm_state_dtype=state_dtype)


def conv_channels(cfg) -> int:
    """The short convolution's channels: q, k and v of every head (Gated DeltaNet); x, B
    and C (Mamba2)."""
    if cfg.ssm_heads:  # Mamba2
        return cfg.ssm_heads * cfg.ssm_head_dim + 2 * cfg.ssm_groups * cfg.ssm_state_size
    return 2 * cfg.linear_key_heads * cfg.linear_key_dim + cfg.linear_value_heads * \
        cfg.linear_value_dim


def ssm_shape(cfg) -> tuple[int, int, int]:
    """One layer's recurrent state per request: [value heads, key dim, value dim] (Gated
    DeltaNet); [heads, head dim, state size] (Mamba2)."""
    if cfg.ssm_heads:  # Mamba2
        return cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_state_size
    return cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
