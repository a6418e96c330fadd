"""Tiny random DeepSeek-V2 / V3, Kimi-like and GLM-4.5 models (transformers, float32, eager
attention and experts), saved to disk: the oracle of tests/test_deepseek.py."""
from pathlib import Path

# YaRN over a short original context, so the ramp covers several dims and mscale matters.
YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}
COMMON = dict(vocab_size=211, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8,
              v_head_dim=16, num_experts_per_tok=2, first_k_dense_replace=1,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
              initializer_range=0.1, attn_implementation="eager",
              experts_implementation="eager")
LATENT = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
          "num_key_value_heads")
# name -> (transformers config class, model class, fields)
VARIANTS = {
    # V2-Lite: one q_proj, softmax routing, greedy, its mscale
    "v2_lite": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        q_lora_rank=None, n_routed_experts=8,
        rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})),
    # V2 / V2.5: groups scored by their best expert, scaled weights
    "v2_group": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        n_routed_experts=8, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=16.0)),
    # V3 / R1: sigmoid, bias, groups scored by their two best, interleaved rope
    "v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=8, n_group=4, topk_group=2, rope_parameters=YARN)),
    # Kimi K2: one group, more experts a token, its scaling and base
    "kimi": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        n_routed_experts=12, num_experts_per_tok=4, n_group=1, topk_group=1,
        routed_scaling_factor=2.827, rope_parameters={**YARN, "rope_theta": 5e4})),
    # GLM-4.5: GQA with partial rope, q/k norms and q/k/v biases; V3's router
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        head_dim=16, num_key_value_heads=2, n_routed_experts=8, use_qk_norm=True,
        attention_bias=True, routed_scaling_factor=1.5, n_group=2, topk_group=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                         "partial_rotary_factor": 0.5})),
}


def tiny_deepseek_model(name: str, out_dir: Path, seed: int = 0):
    """Builds, saves and returns the float32 transformers model of VARIANTS[name]. Norms,
    biases and the routers' correction bias are random (they start at ones and zeros,
    which would hide a misplaced norm or a bias used for the weights)."""
    import torch
    import transformers as tf
    config_cls, model_cls, fields = VARIANTS[name]
    common = dict(COMMON)
    if config_cls == "Glm4MoeConfig":
        common = {k: v for k, v in common.items() if k not in LATENT}
    cfg = getattr(tf, config_cls)(**{**common, **fields})
    torch.manual_seed(seed)
    model = randomized(getattr(tf, model_cls)(cfg).float().eval())
    model.save_pretrained(out_dir)
    return model


def randomized(model):
    """Norms, biases and the routers' correction bias drawn at random in place."""
    import torch
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
            elif n.endswith("bias"):
                p.normal_(0.0, 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model


def tiny_mtp_model(out_dir: Path, seed: int = 0, variant: str = "v3"):
    """A V3 (or another VARIANTS entry) of three layers with a next-n prediction layer, in
    the format of the released
    checkpoints: a four-layer model saved, its last layer becoming `model.layers.3.*` with
    enorm, hnorm, eh_proj and shared_head (random) beside it, and config.json saying three
    layers and num_nextn_predict_layers 1. Returns the folder's layer count."""
    import json

    import torch
    import transformers as tf
    from safetensors.torch import load_file, save_file
    config_cls, model_cls, fields = VARIANTS[variant]
    cfg = getattr(tf, config_cls)(**{**COMMON, **fields, "num_hidden_layers": 4,
                                     "num_nextn_predict_layers": 0})
    torch.manual_seed(seed)
    randomized(getattr(tf, model_cls)(cfg).float().eval()).save_pretrained(out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    g, H, N = torch.Generator().manual_seed(seed + 1), cfg.hidden_size, 3
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.{N}.{name}.weight"] = 1 + 0.2 * torch.randn(H, generator=g)
    tensors[f"model.layers.{N}.eh_proj.weight"] = 0.1 * torch.randn(H, 2 * H, generator=g)
    tensors[f"model.layers.{N}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    tensors[f"model.layers.{N}.embed_tokens.weight"] = tensors[
        "model.embed_tokens.weight"].clone()
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config.update(num_hidden_layers=N, num_nextn_predict_layers=1)
    (out_dir / "config.json").write_text(json.dumps(config))
    return N
