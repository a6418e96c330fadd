"""Which layers attend over a sliding window, read from config.json, family by family.

A window of W means a query at position p sees the keys at p - W + 1 .. p (W keys, its own
included: transformers' convention). 0 means the layer attends to everything before it.
"""
from __future__ import annotations

SLIDING, FULL = "sliding_attention", "full_attention"
# Configs that may predate `layer_types`: every n-th layer (1-based) attends fully.
PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, "GptOssForCausalLM": 2}


class LayerTypesError(ValueError):
    pass


def sliding_windows(hf: dict, arch: str, num_layers: int) -> tuple[int, ...]:
    """One window per layer, 0 where the layer attends fully."""
    window = int(hf.get("sliding_window") or 0)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return (window,) * num_layers
    if arch == "Qwen3MoeForCausalLM":  # one window for every layer, as its mask is built
        return (window if hf.get("use_sliding_window") else 0,) * num_layers
    if arch.startswith("Qwen") and hf.get("use_sliding_window") and window:
        # Qwen applies the window only from layer max_window_layers on.
        if hf.get("layer_types"):
            return _from_types(hf["layer_types"], window, num_layers)
        first = hf.get("max_window_layers", num_layers)
        return tuple(window if i >= first else 0 for i in range(num_layers))
    if arch in PATTERN:
        types = hf.get("layer_types") or _pattern(hf.get("sliding_window_pattern")
                                                  or PATTERN[arch], num_layers)
        return _from_types(types, window, num_layers)
    return (0,) * num_layers


def _pattern(every: int, num_layers: int) -> list[str]:
    return [FULL if (i + 1) % every == 0 else SLIDING for i in range(num_layers)]


def _from_types(types, window: int, num_layers: int) -> tuple[int, ...]:
    if len(types) != num_layers:
        raise LayerTypesError(f"layer_types names {len(types)} layers, the model has "
                              f"{num_layers}")
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise LayerTypesError(f"unsupported layer_types {unknown}; supported: {SLIDING}, {FULL}")
    if SLIDING in types and window <= 0:
        raise LayerTypesError("layer_types names sliding_attention layers but sliding_window "
                              "is not set")
    return tuple(window if t == SLIDING else 0 for t in types)


def local_rope(hf: dict, arch: str) -> tuple[float, dict]:
    """(RoPE base of the window layers, 0 if theirs is the model's; the full layers' RoPE
    parameters). Gemma 3 rotates its window layers with a base of their own and no scaling;
    transformers 5 writes `rope_parameters` per layer type, older files `rope_theta`,
    `rope_local_base_freq` and `rope_scaling`."""
    rope = hf.get("rope_parameters") or {}
    if arch != "Gemma3ForCausalLM":
        return 0.0, rope or hf.get("rope_scaling") or {}
    if FULL in rope or SLIDING in rope:
        full, local = dict(rope.get(FULL) or {}), dict(rope.get(SLIDING) or {})
    else:
        full = dict(hf.get("rope_scaling") or rope)
        full.setdefault("rope_theta", hf.get("rope_theta", 1e6))
        local = {"rope_theta": hf.get("rope_local_base_freq", 1e4)}
    full.setdefault("rope_theta", 1e6)
    if local.get("rope_type", "default") != "default":
        raise LayerTypesError(f"unsupported RoPE for sliding layers: {local['rope_type']!r} "
                              "(supported: default)")
    return float(local.get("rope_theta", 1e4)), full
