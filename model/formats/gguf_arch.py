"""Each GGUF architecture we serve, as data beside the reader (model/formats/gguf_file.py):
which metadata keys become which config.json fields, where each tensor lands in our
parameter tree, and what llama.cpp's converter did to a tensor that has to be undone.

Every architecture shares the `llama` core: token_embd / output_norm / output and per block
attn_* and ffn_*. The mixtures add llama.cpp's stacked experts: `ffn_{gate,up,down}_exps`
hold every expert of a block in one tensor (GGUF shape [in, out, E]), the router is
`ffn_gate_inp`, Qwen2-MoE's shared expert `ffn_*_shexp` with its one-output gate
`ffn_gate_inp_shexp` (stored as a vector). A block without `ffn_gate_inp` keeps a dense MLP.
llama.cpp writes Mixtral as a `llama` file whose blocks have routers: the llama map names
the map such a file follows instead (`mixture`).
Gemma's converter stores every RMSNorm weight w as 1 + w (the scale its kernel multiplies
by) and names the sandwich norms post_attention_norm / ffn_norm / post_ffw_norm.
DeepSeek's `deepseek2` files keep the latent attention's tensors as the checkpoint has them
(rope dims in interleaved pairs, which the reader puts in rotate-half order), kv_b_proj
either whole (`attn_kv_b`, older files) or split per head into `attn_k_b` / `attn_v_b`, and
the router's correction bias as `exp_probs_b`. GLM-4.5's `glm4moe` has the same router
(sigmoid, `exp_probs_b`) on grouped-query attention with partial rotary dims in rotate-half
order; its pre-MLP norm is `post_attention_norm`, and its next-token prediction layers come
as extra blocks after the model's (with `nextn.*` tensors), which are not read.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# metadata key after "<arch>." -> config.json field, read by every architecture (where set)
COMMON_CONFIG = {"embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
                 "block_count": "num_hidden_layers", "attention.head_count": "num_attention_heads"}
MOE_CONFIG = {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
              "expert_feed_forward_length": "moe_intermediate_size"}

TOP = {"token_embd.weight": ("embed",), "output_norm.weight": ("final_norm", "scale"),
       "output.weight": ("lm_head", "kernel")}
LAYER = {"attn_norm.weight": ("input_norm", "scale"), "ffn_norm.weight": ("post_norm", "scale"),
         "attn_q_norm.weight": ("attn", "q_norm", "scale"),
         "attn_k_norm.weight": ("attn", "k_norm", "scale"),
         "ffn_gate.weight": ("mlp", "gate_proj", "kernel"),
         "ffn_up.weight": ("mlp", "up_proj", "kernel"),
         "ffn_down.weight": ("mlp", "down_proj", "kernel"),
         "attn_output.weight": ("attn", "o_proj", "kernel")}
for _p in "qkv":
    LAYER[f"attn_{_p}.weight"] = ("attn", f"{_p}_proj", "kernel")
    LAYER[f"attn_{_p}.bias"] = ("attn", f"{_p}_proj", "bias")

ROUTER = "ffn_gate_inp.weight"  # a block that has it is a mixture-of-experts block
MOE_LAYER = {ROUTER: ("moe", "router", "kernel")}
for _p in ("gate", "up", "down"):
    MOE_LAYER[f"ffn_{_p}_exps.weight"] = ("moe", f"{_p}_proj", "kernel")
    MOE_LAYER[f"ffn_{_p}_shexp.weight"] = ("moe", "shared_expert", f"{_p}_proj", "kernel")
MOE_LAYER["ffn_gate_inp_shexp.weight"] = ("moe", "shared_expert_gate", "kernel")

# a block's tensors holding every expert on their last GGUF axis (first of the data)
EXPERT_STACKS = frozenset(f"ffn_{p}_exps.weight" for p in ("gate", "up", "down"))
# one-output kernels llama.cpp stores as a vector of inputs: read back as [in, 1]
COLUMNS = frozenset({"ffn_gate_inp_shexp.weight"})
# weights our model keeps in float32 whatever the file stores them in (the routers)
FLOAT_ONLY = frozenset({ROUTER, "ffn_gate_inp_shexp.weight", "exp_probs_b.bias"})

# DeepSeek's latent attention (model/latent_weights.py's paths); attn_kv_b, attn_k_b and
# attn_v_b are read into k_up / v_up by the reader
LATENT_LAYER = {"attn_q_a.weight": ("attn", "q_a_proj", "kernel"),
                "attn_q_a_norm.weight": ("attn", "q_a_norm", "scale"),
                "attn_q_b.weight": ("attn", "q_b_proj", "kernel"),
                "attn_kv_a_mqa.weight": ("attn", "kv_a_proj", "kernel"),
                "attn_kv_a_norm.weight": ("attn", "kv_a_norm", "scale"),
                "attn_kv_b.weight": ("attn", "kv_b"),
                "attn_k_b.weight": ("attn", "k_up"), "attn_v_b.weight": ("attn", "v_up"),
                "exp_probs_b.bias": ("moe", "router_bias")}
# latent tensors whose output rows hold rope dims in interleaved pairs
LATENT_ROPE = frozenset({"attn_q.weight", "attn_q_b.weight", "attn_kv_a_mqa.weight"})


@dataclass(frozen=True)
class Architecture:
    hf_architecture: str  # config.json's `architectures` entry
    model_type: str
    config: dict = field(default_factory=dict)  # more metadata keys -> config.json fields
    defaults: dict = field(default_factory=dict)  # fields llama.cpp sets in code, unless
    # the metadata says otherwise
    layer: dict = field(default_factory=dict)  # more (or other) block tensors -> our paths
    permuted_qk: bool = False  # attn_q / attn_k rows in llama.cpp's rotary order
    experts: bool = False  # a mixture: MoE blocks are the ones with a router
    norm_offset: float = 0.0  # added to every *norm.weight by the converter
    # config.json fields a stack's GGUF shape [in, out, E] gives, out and E: each expert's
    # size (Mixtral's and OLMoE's experts are intermediate_size wide) and the expert count
    expert_fields: tuple = ("moe_intermediate_size", "num_experts")
    # the map a file of this architecture follows when its blocks have routers
    mixture: Architecture | None = None
    # Gemma: llama.cpp scales queries by 1 / sqrt(head_dim), but by 1 / sqrt(hidden / heads)
    # in the one size (27B) with this many blocks
    wide_query_scale_blocks: int = 0
    latent: bool = False  # DeepSeek's latent attention (deepseek2)
    # DeepSeek's router and dense leading blocks: the function giving the config.json
    # fields (key, config so far, tensors, error) -> dict
    deepseek_moe: Callable | None = None
    nextn: bool = False  # blocks past the model's own are next-n prediction layers

    def layer_paths(self) -> dict:
        return {**LAYER, **self.layer}


# deepseek2 / glm4moe metadata key -> config.json field, as DeepSeek's config.json names them
_DEEPSEEK_MOE_CONFIG = {"expert_count": "n_routed_experts",
                        "expert_used_count": "num_experts_per_tok",
                        "expert_shared_count": "n_shared_experts",
                        "expert_feed_forward_length": "moe_intermediate_size",
                        "leading_dense_block_count": "first_k_dense_replace",
                        "expert_weights_scale": "routed_scaling_factor",
                        "expert_group_count": "n_group", "expert_group_used_count": "topk_group"}
_LATENT_CONFIG = {**_DEEPSEEK_MOE_CONFIG, "attention.q_lora_rank": "q_lora_rank",
                  "attention.kv_lora_rank": "kv_lora_rank",
                  "rope.dimension_count": "qk_rope_head_dim"}
SOFTMAX, SIGMOID = 1, 2  # expert_gating_func


def glm_config(key, config: dict, tensors: dict, error) -> dict:
    """config.json fields of a glm4moe file: V3's router (sigmoid only), the rotary share
    of each head, biases and q/k norms where the tensors have them, and the model's own
    blocks (block_count counts the next-n prediction layers too; they are left out)."""
    out = {field: key(name) for name, field in _DEEPSEEK_MOE_CONFIG.items()
           if key(name) is not None}
    if key("expert_gating_func", SIGMOID) != SIGMOID:
        raise error("a glm4moe file with softmax expert gating has no GLM-4.5 counterpart")
    nextn = int(key("nextn_predict_layers", 0) or 0)
    out.update(num_hidden_layers=config["num_hidden_layers"] - nextn,
               num_nextn_predict_layers=0, scoring_func="sigmoid", topk_method="noaux_tc",
               norm_topk_prob=bool(key("expert_weights_norm", False)),
               n_group=int(out.get("n_group") or 1), topk_group=int(out.get("topk_group") or 1),
               partial_rotary_factor=key("rope.dimension_count") / config["head_dim"],
               attention_bias="blk.0.attn_q.bias" in tensors,
               use_qk_norm="blk.0.attn_q_norm.weight" in tensors)
    return out


def latent_config(key, config: dict, tensors: dict, error) -> dict:
    """config.json fields of a deepseek2 file (key: its metadata by name after
    "deepseek2."; config: the fields read so far). Files written for MLA (key_length_mla
    set) say one KV head of kv_lora_rank + rope dims; older ones the heads' own sizes.
    Softmax gating is DeepSeek-V2's router (groups, where any, scored by their best expert,
    weights not renormalized), sigmoid V3's (the correction bias, groups by their two
    best). YaRN's attention scale comes as yarn_log_multiplier = 0.1 * mscale_all_dim,
    mscale taken equal to it as llama.cpp does."""
    out = {field: key(name) for name, field in _LATENT_CONFIG.items() if key(name) is not None}
    mla = key("attention.key_length_mla") is not None
    rot = out["qk_rope_head_dim"]
    out["qk_nope_head_dim"] = key("attention.key_length_mla" if mla
                                  else "attention.key_length") - rot
    out["v_head_dim"] = key("attention.value_length_mla" if mla else "attention.value_length")
    out.update(head_dim=rot, num_key_value_heads=config["num_attention_heads"],
               q_lora_rank=out.get("q_lora_rank") or None)
    gating = key("expert_gating_func", SOFTMAX)
    norm = bool(key("expert_weights_norm", False))
    groups = int(out.get("n_group") or 1)
    if gating == SIGMOID:
        out.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                   scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=norm,
                   rope_interleave=True, n_group=groups, topk_group=out.get("topk_group", 1))
    elif gating == SOFTMAX:
        if norm:
            raise error("a deepseek2 file with softmax gating and expert_weights_norm "
                        "(renormalized top-k weights) has no DeepSeek-V2 counterpart")
        out.update(scoring_func="softmax", norm_topk_prob=False, topk_method=(
            "group_limited_greedy" if groups > 1 else "greedy"))
    else:
        raise error(f"deepseek2.expert_gating_func {gating} is not served")
    scaling = config.get("rope_scaling")
    if scaling and scaling["rope_type"] == "yarn":
        mscale = round(float(key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)
        scaling.update(mscale=mscale, mscale_all_dim=mscale)
    return out


_QWEN2_MOE_CONFIG = {**MOE_CONFIG,
                     "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}

_GEMMA_LAYER = {"post_attention_norm.weight": ("post_norm", "scale"),
                "ffn_norm.weight": ("pre_mlp_norm", "scale"),
                "post_ffw_norm.weight": ("post_mlp_norm", "scale")}
_GEMMA_CONFIG = {"attention.sliding_window": "sliding_window",
                 "attention.sliding_window_pattern": "sliding_window_pattern"}
_GEMMA_DEFAULTS = {"hidden_activation": "gelu_pytorch_tanh"}

# Mixtral: llama.cpp's llama graph renormalizes the top-k weights as Mixtral does (our
# MixtralForCausalLM family always does); Q/K rows permuted as in any llama file.
_MIXTRAL = Architecture("MixtralForCausalLM", "mixtral", config={
    "expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    layer=MOE_LAYER, permuted_qk=True, experts=True,
    expert_fields=("intermediate_size", "num_local_experts"))

ARCHITECTURES = {
    "llama": Architecture("LlamaForCausalLM", "llama", permuted_qk=True, mixture=_MIXTRAL),
    "qwen2": Architecture("Qwen2ForCausalLM", "qwen2"),
    "qwen3": Architecture("Qwen3ForCausalLM", "qwen3"),
    # llama.cpp's qwen2moe runs the top-k weights as the softmax gives them, qwen3moe
    # renormalizes them (its graph's norm_w flag); neither is in the metadata.
    "qwen2moe": Architecture("Qwen2MoeForCausalLM", "qwen2_moe", config=_QWEN2_MOE_CONFIG,
                             defaults={"norm_topk_prob": False, "decoder_sparse_step": 1},
                             layer=MOE_LAYER, experts=True),
    "qwen3moe": Architecture("Qwen3MoeForCausalLM", "qwen3_moe", config=MOE_CONFIG,
                             defaults={"norm_topk_prob": True, "decoder_sparse_step": 1},
                             layer=MOE_LAYER, experts=True),
    # OLMoE: q/k norms over the whole projections (attn_q_norm / attn_k_norm as wide as
    # attn_q / attn_k), rotary halves in HF's order (llama.cpp's NEOX rope: no permutation),
    # top-k weights as the softmax gives them; llama.cpp does not clamp q, k, v (clip_qkv).
    "olmoe": Architecture("OlmoeForCausalLM", "olmoe", config=MOE_CONFIG,
                          defaults={"norm_topk_prob": False}, layer=MOE_LAYER, experts=True,
                          expert_fields=("intermediate_size", "num_experts")),
    # DeepSeek-V2 / V2-Lite / V3 / R1 / Kimi K2: config fields from the metadata in
    # latent_config (softmax gating is V2's router, sigmoid V3's).
    "deepseek2": Architecture("DeepseekV2ForCausalLM", "deepseek_v2", layer={
        **MOE_LAYER, **LATENT_LAYER}, experts=True, latent=True,
        deepseek_moe=latent_config,
        expert_fields=("moe_intermediate_size", "n_routed_experts")),
    "glm4moe": Architecture("Glm4MoeForCausalLM", "glm4_moe", layer={
        **MOE_LAYER, "post_attention_norm.weight": ("post_norm", "scale"),
        "exp_probs_b.bias": ("moe", "router_bias")}, experts=True, nextn=True,
        deepseek_moe=glm_config,
        expert_fields=("moe_intermediate_size", "n_routed_experts")),
    # Window layers alternate with full ones (llama.cpp's pattern 2); soft-caps in metadata.
    "gemma2": Architecture("Gemma2ForCausalLM", "gemma2", config={
        **_GEMMA_CONFIG, "attn_logit_softcapping": "attn_logit_softcapping",
        "final_logit_softcapping": "final_logit_softcapping"}, defaults=_GEMMA_DEFAULTS,
        layer=_GEMMA_LAYER, norm_offset=1.0, wide_query_scale_blocks=46),
    # Five window layers to one full (the family's pattern); the window layers' RoPE base
    # is rope.freq_base_swa where written, llama.cpp's 10000 where not.
    "gemma3": Architecture("Gemma3ForCausalLM", "gemma3_text", config={
        **_GEMMA_CONFIG, "rope.freq_base_swa": "rope_local_base_freq"},
        defaults={**_GEMMA_DEFAULTS, "rope_local_base_freq": 10000.0},
        layer=_GEMMA_LAYER, norm_offset=1.0, wide_query_scale_blocks=62),
}


def architecture(arch: str | None, error, tensor_names) -> Architecture:
    """The map for a file's general.architecture and tensors (its mixture map where a block
    has a router); `error` (an exception class) raised naming an architecture we do not
    serve."""
    if arch not in ARCHITECTURES:
        raise error(f"GGUF architecture {arch!r} is not served; supported: "
                    + ", ".join(ARCHITECTURES))
    spec = ARCHITECTURES[arch]
    if spec.mixture and any(n.endswith("." + ROUTER) for n in tensor_names):
        return spec.mixture
    return spec


def derived_config(arch: Architecture, config: dict, tensors: dict) -> dict:
    """config.json fields an architecture's code (not its metadata) decides: a mixture's
    sizes as its tensors have them (older files lack some of the metadata) and its layer
    pattern (blocks without a router are mlp_only_layers); Gemma's query scale
    (tensors: name -> (type, GGUF shape))."""
    out = {k: v for k, v in arch.defaults.items() if config.get(k) is None}
    if arch.wide_query_scale_blocks:
        wide = config["num_hidden_layers"] == arch.wide_query_scale_blocks
        out["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                        if wide else config["head_dim"])
    if isinstance(config.get("sliding_window_pattern"), list):  # per layer: windowed or not
        out["layer_types"] = ["sliding_attention" if w else "full_attention"
                              for w in config["sliding_window_pattern"]]
        out["sliding_window_pattern"] = None
    if not arch.experts or arch.deepseek_moe:
        return out
    out["mlp_only_layers"] = [i for i in range(config["num_hidden_layers"])
                              if f"blk.{i}.{ROUTER}" not in tensors]
    for short, fields in (("ffn_gate_exps.weight", arch.expert_fields),
                          ("ffn_gate_shexp.weight", ("shared_expert_intermediate_size",))):
        shape = next((s for n, (_, s) in tensors.items() if n.endswith("." + short)), None)
        if shape is not None:
            out.update(zip(fields, shape[1:]))
    return out

