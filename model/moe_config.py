"""config.json's mixture-of-experts fields, family by family, onto ModelConfig's."""
from __future__ import annotations

from model.config import ConfigError
from model.families import MoeFamily


# config.json fields of mixtures of experts that change what the model computes and that we do
# not implement (DeepSeek's grouped or sigmoid routing, other activations...), each with the
# values that mean "off". Training-only fields (router_aux_loss_coef, router_jitter_noise,
# output_router_logits) change nothing here.
MOE_UNSUPPORTED = {
    "hidden_act": (None, "silu"),
    "scoring_func": (None, "softmax"),
    "topk_method": (None, "greedy"),
    "n_group": (None, 0, 1),
    "topk_group": (None, 0, 1),
    "routed_scaling_factor": (None, 1.0),
    "n_shared_experts": (None, 0),
    "first_k_dense_replace": (None, 0),
    "moe_layer_freq": (None, 1),
}


def moe_fields(hf: dict, family: MoeFamily, num_layers: int) -> dict:
    """config.json -> ModelConfig's mixture-of-experts fields."""
    if family.deepseek_router:
        return _deepseek_fields(hf, family, num_layers)
    for field, off in MOE_UNSUPPORTED.items():
        if hf.get(field) not in off:
            supported = ", ".join(repr(v) for v in off if v is not None)
            raise ConfigError(f"unsupported mixture-of-experts config: {field}="
                              f"{hf[field]!r} (supported: {supported}, or no {field})")
    experts = _num_experts(hf)
    k = int(hf.get("num_experts_per_tok") or 0)
    if experts and not 0 < k <= experts:
        raise ConfigError(f"num_experts_per_tok={k} with {experts} experts")
    shared = int(hf.get("shared_expert_intermediate_size") or 0) if family.shared_expert else 0
    if family.shared_expert and experts and not shared:
        raise ConfigError("unsupported mixture-of-experts config: "
                          "shared_expert_intermediate_size=0")
    clamped = family.clamped_swiglu  # gpt-oss's gate
    return dict(swiglu_limit=float(hf["swiglu_limit"]) if clamped else 0.0,
                swiglu_alpha=float(hf["swiglu_alpha"]) if clamped else 0.0,
                num_experts=experts, num_experts_per_tok=k if experts else 0,
                moe_intermediate_size=int(hf[family.expert_size_field]),
                shared_expert_intermediate_size=shared,
                norm_topk_prob=family.always_renormalize or bool(hf.get("norm_topk_prob")),
                moe_layers=_moe_layers(hf, family, num_layers, experts))


def _num_experts(hf: dict) -> int:
    """transformers reads either name in every family (its configs' attribute_map)."""
    found = {int(hf[f]) for f in ("num_experts", "num_local_experts", "n_routed_experts")
             if hf.get(f) is not None}
    if len(found) > 1:
        raise ConfigError(f"num_experts and num_local_experts disagree: {sorted(found)}")
    return found.pop() if found else 0


def _moe_layers(hf: dict, family: MoeFamily, num_layers: int, experts: int):
    """Qwen's rule: layer i routes iff it is not in mlp_only_layers and (i + 1) is a multiple
    of decoder_sparse_step; the other families route in every layer."""
    if not family.sparse_layers:
        return (experts > 0,) * num_layers
    step = hf.get("decoder_sparse_step", 1)
    if not isinstance(step, int) or step < 1:
        raise ConfigError(f"unsupported mixture-of-experts config: decoder_sparse_step={step!r}")
    dense = set(hf.get("mlp_only_layers") or ())
    return tuple(experts > 0 and i not in dense and (i + 1) % step == 0
                 for i in range(num_layers))


def _deepseek_fields(hf: dict, family: MoeFamily, num_layers: int) -> dict:
    """DeepSeek-V2 / V3 and GLM-4.5: routing rules as transformers' routers apply them (the
    V3 router ignores topk_method and moe_layer_freq, as transformers does)."""
    if family.gated_experts and hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"unsupported mixture-of-experts config: hidden_act="
                          f"{hf['hidden_act']!r} (supported: 'silu')")
    v3 = family.deepseek_router == "v3"
    scoring = hf.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ConfigError(f"unsupported mixture-of-experts config: scoring_func={scoring!r} "
                          f"(supported: {'sigmoid' if v3 else 'softmax'})")
    method = hf.get("topk_method") or "greedy"
    if not v3 and method not in ("greedy", "group_limited_greedy"):
        raise ConfigError(f"unsupported mixture-of-experts config: topk_method={method!r} "
                          "(supported: 'greedy', 'group_limited_greedy')")
    experts = _num_experts(hf)
    k = int(hf.get("num_experts_per_tok") or 0)
    if not 0 < k <= experts:
        raise ConfigError(f"num_experts_per_tok={k} with {experts} experts")
    grouped = v3 or method == "group_limited_greedy"
    groups = int(hf.get("n_group") or 1) if grouped else 1
    keep = int(hf.get("topk_group") or 1) if grouped else 1
    if experts % groups or not 0 < keep <= groups or keep * (experts // groups) < k:
        raise ConfigError(f"unsupported expert groups: n_group={groups}, topk_group={keep} "
                          f"with {experts} experts and num_experts_per_tok={k}")
    size = int(hf["moe_intermediate_size"])
    first_dense = int(hf.get("first_k_dense_replace") or 0)
    # Nemotron-H names its shared expert's size; DeepSeek counts experts of the routed size
    shared = int(hf.get("moe_shared_expert_intermediate_size")
                 or size * int(hf.get("n_shared_experts") or 0))
    return dict(num_experts=experts, num_experts_per_tok=k, moe_intermediate_size=size,
                shared_expert_intermediate_size=shared,
                norm_topk_prob=v3 and bool(hf.get("norm_topk_prob")),
                moe_layers=tuple(i >= first_dense for i in range(num_layers)),
                router_sigmoid=v3, router_bias=v3, router_groups=groups,
                router_topk_groups=keep, router_group_top2=v3,
                routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0))
