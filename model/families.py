"""Each served architecture as data: how its config.json names things and which blocks it
uses (model/config.py reads a config.json through these)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeFamily:
    """How a family's config.json names its mixture of experts and how it routes a token:
    softmax over every expert in float32, the top k, then as these flags say."""
    expert_size_field: str  # each expert's intermediate size
    always_renormalize: bool  # top-k weights divided by their sum, norm_topk_prob or not
    # transformers 5 keeps Mixtral's top-k weights in float32 (each expert's output times
    # its weight rounds once to the activations' dtype); the others cast the weights to the
    # activations' dtype first. Only a bfloat16 or float16 model can tell the two apart.
    float32_weights: bool
    shared_expert: bool  # Qwen2-MoE: a dense gated expert every token goes through too
    sparse_layers: bool  # decoder_sparse_step and mlp_only_layers pick the MoE layers
    # gpt-oss: the router and every expert projection carry biases, the k largest logits are
    # picked first and softmaxed among themselves (Granite 4.0-H too), and the gate is a
    # clamped SwiGLU.
    biases: bool = False
    topk_then_softmax: bool = False
    clamped_swiglu: bool = False
    # the shared expert's output times sigmoid(a gate of its own) (Qwen2-MoE); else added as
    # it is (Granite 4.0-H's shared MLP; the shared experts of DeepSeek's routers)
    shared_gate: bool = True
    # act(gate) * up in every expert; else act(up), no gate (Nemotron-H, with the model's
    # MLP activation)
    gated_experts: bool = True
    # DeepSeek's routers (and GLM-4.5's): a shared expert of moe_intermediate_size *
    # n_shared_experts with no gate, the first first_k_dense_replace layers dense, and
    # "v2": softmax scores, topk_method greedy or group_limited_greedy (groups scored by
    # their best expert), never renormalized; "v3" ("noaux_tc"): sigmoid scores, a bias
    # added for the choice alone, groups scored by their two best, norm_topk_prob read.
    # Both times routed_scaling_factor.
    deepseek_router: str = ""


@dataclass(frozen=True)
class Family:
    qkv_bias: bool = False  # q/k/v carry biases (config.json's `qkv_bias` may say otherwise)
    # "head": RMSNorm of each head of q and k (Qwen3); "full": of the whole q and k
    # projections before the head reshape (OLMoE); "config": per head where config.json's
    # use_qk_norm says so (GLM-4.5).
    qk_norm: str = ""
    o_bias: bool = True  # o_proj carries a bias where attention_bias says so
    moe: MoeFamily | None = None
    # Gemma: norms scale by (1 + w) in float32, every block's output is normed too before the
    # residual add ("sandwich"), and the embeddings are multiplied by sqrt(hidden_size).
    gemma: bool = False
    sinks: bool = False  # gpt-oss: a learned logit per head in every softmax's denominator
    # DeepSeek-V2/V3: multi-head latent attention (model/latent_attention.py); V2's rope
    # dims are always interleaved, V3's where config.json's rope_interleave says so.
    latent: bool = False
    rope_interleaved: bool = False
    # Qwen3-Next / Qwen3.5: every RMSNorm scales by (1 + w) in float32 (Gemma's norm without
    # its other habits), attention's q_proj also gives a sigmoid gate on its output, and
    # layer_types mixes Gated DeltaNet layers with attention (model/linear_config.py).
    norm_offset: bool = False
    gated_attention: bool = False
    # The linear layers' mixer: "gdn" (Gated DeltaNet, model/linear_config.py) or "mamba2"
    # (model/mamba_config.py); "": none.
    linear: str = ""
    # Nemotron-H: each layer is one block, a norm and then one mixer (Mamba2, attention, or
    # an MLP alone) added to the residual; the MLP is ungated (up, the activation, down),
    # attention has no RoPE, and norms multiply their weight in float32.
    blocks: bool = False
    # Granite: embeddings times embedding_multiplier, each block's output times
    # residual_multiplier before the residual add, attention_multiplier the softmax scale,
    # logits divided by logits_scaling, RoPE only where position_embedding_type is "rope".
    granite: bool = False
    # Falcon-H1: every layer runs Mamba2 and attention side by side on the same normed input
    # (mixer "hybrid"), with its muP multipliers (ModelConfig.multipliers).
    falcon: bool = False
    # The family's config class defaults for fields a config.json may leave out.
    defaults: tuple[tuple[str, object], ...] = ()


# Qwen3-Next and Qwen3.5: Gated DeltaNet layers among gated attention ones.
_QWEN_LINEAR = dict(qk_norm="head", norm_offset=True, gated_attention=True, linear="gdn",
                    defaults=(("partial_rotary_factor", 0.25), ("head_dim", 256),
                              ("linear_conv_kernel_dim", 4)))
# Everything not here is read from config.json.
FAMILIES = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(qkv_bias=True),
    "Qwen3ForCausalLM": Family(qk_norm="head"),
    "MixtralForCausalLM": Family(moe=MoeFamily(
        "intermediate_size", always_renormalize=True,
        float32_weights=True, shared_expert=False, sparse_layers=False)),
    "Qwen2MoeForCausalLM": Family(qkv_bias=True, moe=MoeFamily(
        "moe_intermediate_size", always_renormalize=False,
        float32_weights=False, shared_expert=True, sparse_layers=True)),
    "Qwen3MoeForCausalLM": Family(qk_norm="head", moe=MoeFamily(
        "moe_intermediate_size", always_renormalize=False,
        float32_weights=False, shared_expert=False, sparse_layers=True)),
    "OlmoeForCausalLM": Family(qk_norm="full", moe=MoeFamily(
        "intermediate_size", always_renormalize=False,
        float32_weights=False, shared_expert=False, sparse_layers=False)),
    "GptOssForCausalLM": Family(sinks=True, moe=MoeFamily(
        "intermediate_size", always_renormalize=False, float32_weights=False,
        shared_expert=False, sparse_layers=False, biases=True, topk_then_softmax=True,
        clamped_swiglu=True),
        defaults=(("attention_bias", True), ("sliding_window", 128), ("rms_norm_eps", 1e-5),
                  ("num_experts_per_tok", 4), ("swiglu_alpha", 1.702), ("swiglu_limit", 7.0),
                  ("rope_theta", 150000.0), ("max_position_embeddings", 131072))),
    "DeepseekV2ForCausalLM": Family(latent=True, rope_interleaved=True, moe=MoeFamily(
        "moe_intermediate_size", always_renormalize=False, float32_weights=True,
        shared_expert=True, shared_gate=False, sparse_layers=False, deepseek_router="v2"),
        defaults=(("n_shared_experts", 2), ("first_k_dense_replace", 0),
                  ("qk_nope_head_dim", 128), ("qk_rope_head_dim", 64), ("v_head_dim", 128),
                  ("kv_lora_rank", 512), ("q_lora_rank", 1536), ("topk_method", "greedy"),
                  ("routed_scaling_factor", 1.0), ("scoring_func", "softmax"))),
    "DeepseekV3ForCausalLM": Family(latent=True, moe=MoeFamily(
        "moe_intermediate_size", always_renormalize=False, float32_weights=True,
        shared_expert=True, shared_gate=False, sparse_layers=False, deepseek_router="v3"),
        defaults=(("n_shared_experts", 1), ("first_k_dense_replace", 3),
                  ("qk_nope_head_dim", 128), ("qk_rope_head_dim", 64), ("v_head_dim", 128),
                  ("kv_lora_rank", 512), ("q_lora_rank", 1536), ("norm_topk_prob", True),
                  ("rope_interleave", True), ("n_group", 8), ("topk_group", 4),
                  ("routed_scaling_factor", 2.5), ("scoring_func", "sigmoid"),
                  ("topk_method", "noaux_tc"))),
    "Glm4MoeForCausalLM": Family(o_bias=False, qk_norm="config", moe=MoeFamily(
        "moe_intermediate_size", always_renormalize=False, float32_weights=True,
        shared_expert=True, shared_gate=False, sparse_layers=False, deepseek_router="v3"),
        defaults=(("n_shared_experts", 1), ("first_k_dense_replace", 1),
                  ("norm_topk_prob", True), ("n_group", 1), ("topk_group", 1),
                  ("routed_scaling_factor", 1.0), ("scoring_func", "sigmoid"),
                  ("topk_method", "noaux_tc"), ("partial_rotary_factor", 0.5),
                  ("rms_norm_eps", 1e-5))),
    "Qwen3NextForCausalLM": Family(**_QWEN_LINEAR, moe=MoeFamily(
        "moe_intermediate_size", always_renormalize=False, float32_weights=False,
        shared_expert=True, sparse_layers=True)),
    "Qwen3_5ForCausalLM": Family(**_QWEN_LINEAR),
    "NemotronHForCausalLM": Family(linear="mamba2", blocks=True, moe=MoeFamily(
        "moe_intermediate_size", always_renormalize=False, float32_weights=True,
        shared_expert=True, shared_gate=False, sparse_layers=False, deepseek_router="v3",
        gated_experts=False),
        defaults=(
        ("mlp_hidden_act", "relu2"), ("layer_norm_epsilon", 1e-5), ("head_dim", 128),
        ("ssm_state_size", 128), ("mamba_num_heads", 128), ("mamba_head_dim", 64),
        ("n_groups", 8), ("conv_kernel", 4), ("chunk_size", 128), ("use_conv_bias", True),
        ("max_position_embeddings", 4096))),
    "FalconH1ForCausalLM": Family(linear="mamba2", falcon=True, defaults=(
        ("mamba_d_ssm", 1024), ("mamba_n_heads", 128), ("mamba_d_head", "auto"),
        ("mamba_n_groups", 1), ("mamba_d_state", 256), ("mamba_d_conv", 4),
        ("mamba_expand", 2), ("mamba_chunk_size", 256), ("mamba_conv_bias", True),
        ("mamba_proj_bias", False), ("mamba_norm_before_gate", True),
        ("mamba_rms_norm", False), ("projectors_bias", False), ("rms_norm_eps", 1e-5),
        ("max_position_embeddings", 8192))),
    "GraniteMoeHybridForCausalLM": Family(linear="mamba2", granite=True, moe=MoeFamily(
        "intermediate_size", always_renormalize=False, float32_weights=False,
        shared_expert=True, sparse_layers=False, topk_then_softmax=True, shared_gate=False),
        defaults=(("mamba_n_heads", 128), ("mamba_n_groups", 1), ("mamba_d_state", 256),
                  ("mamba_d_head", "auto"), ("mamba_d_conv", 4), ("mamba_expand", 2),
                  ("mamba_chunk_size", 256), ("mamba_conv_bias", True),
                  ("mamba_proj_bias", False), ("num_local_experts", 8),
                  ("num_experts_per_tok", 2), ("shared_intermediate_size", 1024),
                  ("embedding_multiplier", 1.0), ("logits_scaling", 1.0),
                  ("residual_multiplier", 1.0), ("attention_multiplier", 1.0))),
    "Qwen3_5MoeForCausalLM": Family(**_QWEN_LINEAR, moe=MoeFamily(
        "moe_intermediate_size", always_renormalize=True, float32_weights=False,
        shared_expert=True, sparse_layers=False)),
    "Gemma2ForCausalLM": Family(gemma=True, defaults=(
        ("head_dim", 256), ("hidden_activation", "gelu_pytorch_tanh"),
        ("query_pre_attn_scalar", 256), ("sliding_window", 4096),
        ("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
        ("tie_word_embeddings", True), ("max_position_embeddings", 8192))),
    "Gemma3ForCausalLM": Family(qk_norm="head", gemma=True, defaults=(
        ("head_dim", 256), ("hidden_activation", "gelu_pytorch_tanh"),
        ("query_pre_attn_scalar", 256), ("sliding_window", 4096),
        ("tie_word_embeddings", True), ("max_position_embeddings", 131072))),
}
