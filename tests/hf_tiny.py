"""Tiny random Hugging Face models of each supported family, saved to disk (the parity oracle)."""
from pathlib import Path

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
GEMMA_FAMILIES = ("gemma2", "gemma3")
LINEAR_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
MAMBA_FAMILIES = ("nemotron_h", "granite_h", "granite_h_dense", "falcon_h1")


def tiny_hf_model(family: str, out_dir: Path, seed: int = 0, **overrides):
    """Builds, saves and returns a float32 transformers model with odd sizes and GQA."""
    import torch
    import transformers as tf
    common = dict(vocab_size=211, hidden_size=72, intermediate_size=100, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2)
    if family == "llama":
        cfg = tf.LlamaConfig(**common, tie_word_embeddings=False, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
        cls = tf.LlamaForCausalLM
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=7)
        cls = tf.MistralForCausalLM
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**{**common, "num_key_value_heads": 3}, tie_word_embeddings=True)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=20, tie_word_embeddings=True)
        cls = tf.Qwen3ForCausalLM
    elif family in MOE_FAMILIES:
        cfg, cls = _tiny_moe_config(family)
    elif family in GEMMA_FAMILIES:
        cfg, cls = _tiny_gemma_config(family)
    elif family in LINEAR_FAMILIES:
        cfg, cls = _tiny_linear_config(family)
    elif family in MAMBA_FAMILIES:
        cfg, cls = _tiny_mamba_config(family)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    if family in GEMMA_FAMILIES:
        with torch.no_grad():  # (1 + w) norms start at w = 0: random w so w is read
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0, 0.3)
    if family in LINEAR_FAMILIES or family in MAMBA_FAMILIES:
        _perturb_linear(model, centred=family in LINEAR_FAMILIES)
    if getattr(model.config, "attention_bias", False) or family in ("qwen2", "qwen2_moe"):
        with torch.no_grad():  # random biases so a dropped bias shows up
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
    model.save_pretrained(out_dir)
    return model


def _tiny_moe_config(family: str):
    """Four experts, two a token, eager attention and experts in float32. Weights of 0.1 (not
    0.02) so routing is far from uniform and greedy choices are clear-cut. Qwen2-MoE mixes
    dense and MoE layers and has a shared expert; OLMoE clips q, k and v."""
    import transformers as tf
    common = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, num_experts_per_tok=2, initializer_range=0.1,
                  attn_implementation="eager", experts_implementation="eager")
    if family == "mixtral":
        return (tf.MixtralConfig(**{**common, "intermediate_size": 40}, num_local_experts=4),
                tf.MixtralForCausalLM)
    if family == "qwen2_moe":
        return (tf.Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=40,
                                  shared_expert_intermediate_size=56, mlp_only_layers=[1]),
                tf.Qwen2MoeForCausalLM)
    if family == "qwen3_moe":
        return (tf.Qwen3MoeConfig(**common, head_dim=20, num_experts=4, moe_intermediate_size=40,
                                  norm_topk_prob=True, tie_word_embeddings=True),
                tf.Qwen3MoeForCausalLM)
    if family == "gpt_oss":
        # Window and full layers alternating, sinks, biases everywhere (random: the init
        # draws them), YaRN over a short original context so its ramp covers several dims.
        return (tf.GptOssConfig(**{**common, "intermediate_size": 40, "max_position_embeddings": 128},
                                head_dim=16,
                                num_local_experts=4, sliding_window=8, rope_parameters={
                                    "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
                                    "original_max_position_embeddings": 32}),
                tf.GptOssForCausalLM)
    return (tf.OlmoeConfig(**{**common, "intermediate_size": 40}, num_experts=4, clip_qkv=1.5),
            tf.OlmoeForCausalLM)


def _tiny_gemma_config(family: str):
    """Windows of 8 and 6 tokens, so prompts and decodes run well past them; a query scale
    that is not head_dim's; Gemma 2's soft-caps low enough that they bend real scores;
    Gemma 3 with its 5:1 local/global layers, a RoPE base of their own for the window layers
    and linear scaling on the global ones. Eager attention: the soft-cap needs it."""
    import transformers as tf
    common = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, query_pre_attn_scalar=24,
                  initializer_range=0.05, attn_implementation="eager")
    if family == "gemma2":
        return (tf.Gemma2Config(**common, num_hidden_layers=4, sliding_window=8,
                                attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
                tf.Gemma2ForCausalLM)
    return (tf.Gemma3TextConfig(**common, num_hidden_layers=7, sliding_window=6,
                                rope_parameters={
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 100.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                       "rope_theta": 10000.0}}),
            tf.Gemma3ForCausalLM)


def _tiny_linear_config(family: str):
    """Five layers: Gated DeltaNet in layers 0-2 and 4, gated attention with partial RoPE in
    layer 3 (full_attention_interval's default); 2 key heads read by 4 value heads. Qwen3-Next
    keeps layer 1 dense (mlp_only_layers) among MoE layers with a shared expert."""
    import transformers as tf
    common = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                  linear_value_head_dim=16, attn_implementation="eager")
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=40, experts_implementation="eager",
               initializer_range=0.1)
    if family == "qwen3_next":
        return (tf.Qwen3NextConfig(**common, **moe, mlp_only_layers=[1], norm_topk_prob=True),
                tf.Qwen3NextForCausalLM)
    if family == "qwen3_5":
        return tf.Qwen3_5TextConfig(**common, tie_word_embeddings=True), tf.Qwen3_5ForCausalLM
    return tf.Qwen3_5MoeTextConfig(**common, **moe), tf.Qwen3_5MoeForCausalLM


def _tiny_mamba_config(family: str):
    """Nemotron-H with every kind of block: Mamba2 in blocks 0, 3 and 5, NoPE attention in
    block 2, a squared-ReLU MLP in block 1, experts in block 4 (8 ungated experts, 2 a
    token, routed as DeepSeek-V3: 2 groups of which 1 is kept, scaled by 2.5, beside a
    shared expert); 8 Mamba heads in 2 groups.
    Granite 4.0-H: Mamba2 in layers 0, 1 and 3, attention in layer 2, every multiplier away
    from 1; with 4 experts (2 a token) beside the shared MLP and NoPE (as Granite 4.0-H
    ships), or dense (the shared MLP alone) with RoPE. Falcon-H1: three layers of Mamba2
    beside attention."""
    import transformers as tf
    if family == "falcon_h1":  # every multiplier away from 1, the mixer's width its own
        return (tf.FalconH1Config(
            vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2, mamba_d_ssm=96,
            mamba_n_heads=6, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8,
            mamba_n_groups=2, attn_implementation="eager", embedding_multiplier=2.0,
            lm_head_multiplier=0.5, mlp_multipliers=[1.5, 0.75], key_multiplier=0.8,
            attention_in_multiplier=1.2, attention_out_multiplier=0.9,
            ssm_multipliers=[0.5, 1.5, 0.8, 1.1, 0.7], ssm_in_multiplier=1.3,
            ssm_out_multiplier=0.6), tf.FalconH1ForCausalLM)
    if family.startswith("granite"):
        dense = family == "granite_h_dense"
        return (tf.GraniteMoeHybridConfig(
            vocab_size=211, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
            num_hidden_layers=4, layer_types=["mamba", "mamba", "attention", "mamba"],
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            bos_token_id=1, eos_token_id=2, mamba_n_heads=8, mamba_d_head=16,
            mamba_d_state=16, mamba_chunk_size=8, mamba_n_groups=2,
            num_local_experts=0 if dense else 4, num_experts_per_tok=2,
            position_embedding_type="rope" if dense else None, embedding_multiplier=3.0,
            residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0,
            attn_implementation="eager", experts_implementation="eager",
            initializer_range=0.1), tf.GraniteMoeHybridForCausalLM)
    return (tf.NemotronHConfig(
        vocab_size=211, hidden_size=64, intermediate_size=96, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, ssm_state_size=16, mamba_num_heads=8,
        mamba_head_dim=16, n_groups=2, chunk_size=8, conv_kernel=4,
        layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention",
                           "moe", "linear_attention"], attn_implementation="eager",
        experts_implementation="eager", n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=40, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, initializer_range=0.1),
            tf.NemotronHForCausalLM)


def tiny_qwen3_5_vlm(out_dir: Path, seed: int = 0):
    """A Qwen3_5ForConditionalGeneration checkpoint (what Qwen/Qwen3.5-* ship): the
    qwen3_5 text model above under `model.language_model.`, beside a one-block vision
    tower."""
    import torch
    import transformers as tf
    text, _ = _tiny_linear_config("qwen3_5")
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=48,
                  out_hidden_size=64, patch_size=4, num_position_embeddings=64)
    cfg = tf.Qwen3_5Config(text_config=text.to_dict(), vision_config=vision,
                           tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = tf.Qwen3_5ForConditionalGeneration(cfg).float().eval()
    _perturb_linear(model)
    model.save_pretrained(out_dir)
    return model


def _perturb_linear(model, centred: bool = True) -> None:
    """Zero-centred norms start at w = 0 and the gates at their symmetric init: random
    values so each is read (dt_bias and A_log as real checkpoints spread them). centred:
    the model's norms scale by (1 + w) (Qwen's, not its Gated DeltaNet's own); else every
    norm's weight is drawn around 1."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0 if centred and "linear_attn" not in name else 1, 0.3)
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith("A_log"):
                p.uniform_(-2.0, 1.0)
            elif name.endswith(".D") or name.endswith("conv1d.bias"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a choice-only bias: spread it
                b.normal_(0, 0.1)


def greedy_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation, EOS an ordinary token (as `ignore_eos` makes it for
    us): `generate(min_new_tokens=...)` would forbid EOS instead."""
    import torch
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
