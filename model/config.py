"""ModelConfig: the static, hashable description of a decoder model, built from HF config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from model import layer_types
from model.families import FAMILIES, Family, MoeFamily  # noqa: F401  (re-exported)


# config.json's activation names -> ours; the MLP's gate goes through it.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "relu2": "relu2"}
DTYPES = ("float32", "bfloat16", "float16")
# KV cache storage (model/kv_cache.py): "auto" is the model's dtype; a float dtype stores K/V
# rounded to it; int8 / fp8 store them quantized with a scale per (token, KV head).
# The mixers that keep a recurrent state per request, and those that keep K/V pages
# ("hybrid": Mamba2 and attention side by side, Falcon-H1, keeps both).
LINEAR_MIXERS = ("gdn", "mamba2")
STATEFUL = (*LINEAR_MIXERS, "hybrid")
ATTENDING = ("attention", "hybrid")
KV_CACHE_DTYPES = ("auto", *DTYPES, "int8", "fp8")
# model/attention.py's backends ("auto" picks one for the device): named here, without JAX,
# for the CLI's choices.
ATTENTION_BACKENDS = ("reference", "blocked", "cpu", "pallas", "pallas_pages")
# quant/ops.py grouped_matmul's backends for a mixture of experts' matmuls (--moe-backend):
# "auto" is our Pallas kernel where the program is for CUDA, ragged_dot elsewhere.
MOE_BACKENDS = ("auto", "ragged_dot", "pallas")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, float], ...] | None = None  # sorted items of HF's dict
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per head (Qwen3)
    qk_norm_full: bool = False  # over the whole q and k projections (OLMoE)
    clip_qkv: float = 0.0  # q, k, v clamped to +-clip_qkv after the norms; 0: not clamped
    # One sliding window per layer, 0 where the layer attends to everything
    # (model/layer_types.py).
    sliding_windows: tuple[int, ...] = ()
    # RoPE base of the window layers (Gemma 3), unscaled; 0: rope_theta and rope_scaling.
    local_rope_theta: float = 0.0
    hidden_act: str = "silu"  # of ACTIVATIONS' values
    norm_offset: bool = False  # norms scale by (1 + w) (Gemma)
    sandwich_norms: bool = False  # attention and MLP outputs normed before the residual add
    scale_embed: bool = False  # embeddings times sqrt(hidden_size), rounded to the dtype
    query_scale: float = 0.0  # scores' scale; 0: head_dim ** -0.5
    attn_soft_cap: float = 0.0  # scores capped as cap * tanh(s / cap); 0: not capped
    final_soft_cap: float = 0.0  # the same for the logits
    attn_sinks: bool = False  # a learned sink logit per query head, every layer (gpt-oss)
    # RoPE rotates the first rotary_dim dims of each head (partial_rotary_factor); 0: all.
    rotary_dim: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3; model/latent_attention.py), on when
    # kv_lora_rank > 0: head_dim is then the shared rope key's width (qk_rope_head_dim) and
    # the cache holds one latent of kv_lora_rank + head_dim values a token and layer.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: one q_proj (V2-Lite)
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleaved: bool = False  # rope dims stored in pairs; permuted to halves at load
    num_mtp_layers: int = 0  # next-token prediction layers stored after the main ones
    # q_proj gives each head's query and then a gate of as many values; the attention's
    # output is multiplied by sigmoid(gate) before o_proj (Qwen3-Next, Qwen3.5).
    attn_output_gate: bool = False
    # Each layer's sequence mixer: "attention", "gdn" (Gated DeltaNet) or "mamba2"
    # (model/linear_attention/), or "none" (a block with an MLP alone); empty: attention
    # everywhere. A linear layer keeps a recurrent state per request instead of K/V pages
    # (model/linear_config.py, model/mamba_config.py).
    mixers: tuple[str, ...] = ()
    # Each layer is one block: its mixer, or its MLP where the mixer is "none", on the normed
    # input, added to the residual (Nemotron-H). Else a layer is a mixer and then an MLP.
    blocks: bool = False
    mlp_gated: bool = True  # act(gate) * up; else act(up) (Nemotron-H)
    use_rope: bool = True  # else attention sees no positions but the causal mask (NoPE)
    norm_weight_f32: bool = False  # RMSNorm multiplies its weight in float32, then casts
    # Granite's multipliers (1: none): the embeddings', each block output's before the
    # residual add, and the logits' divisor.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    # Mamba2 mixers: heads of ssm_head_dim channels, each with a [ssm_head_dim,
    # ssm_state_size] state; B and C shared by the heads of each of ssm_groups groups; the
    # conv carries a bias where ssm_conv_bias; in_proj and out_proj where ssm_proj_bias;
    # the time step clamped to ssm_dt_limit; ssm_chunk the chunked form's chunk.
    ssm_heads: int = 0
    ssm_head_dim: int = 0
    ssm_state_size: int = 0
    ssm_groups: int = 0
    ssm_chunk: int = 0
    ssm_conv_bias: bool = False
    ssm_proj_bias: bool = False
    ssm_dt_limit: tuple[float, float] = (0.0, float("inf"))
    ssm_out_bias: bool = False  # out_proj's bias (Falcon-H1's projectors_bias); else as in_proj
    # The mixer's output gate and norm: "gate_first" (RMSNorm per group of y * SiLU(z)),
    # "norm_first" (SiLU(z) times the normed y), "none" (y * SiLU(z), no norm).
    ssm_norm: str = "gate_first"
    # Falcon-H1's muP multipliers by name (sorted pairs; a missing one is 1): "ssm_in",
    # "ssm_z", "ssm_x", "ssm_b", "ssm_c", "ssm_dt", "ssm_out", "attn_in", "attn_out", "key",
    # "mlp_gate", "mlp_down", "lm_head".
    multipliers: tuple[tuple[str, float], ...] = ()
    # The recurrent state's dtype as config.json asks (mamba_ssm_dtype); the engine's
    # --mamba-ssm-cache-dtype may override it.
    ssm_state_dtype: str = "float32"
    dtype: str = "float32"
    # Mixture of experts (num_experts 0: none). A layer of `moe_layers` sends each token to
    # num_experts_per_tok of the experts; the others keep the dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = False  # the top-k weights divided by their sum
    moe_layers: tuple[bool, ...] = ()
    # Expert parallel (--enable-expert-parallel): the experts split whole over this many
    # devices, each holding num_experts // expert_shards of them (model/sharding.py).
    expert_shards: int = 1
    # Data-parallel attention (serving/engine/dp_attention.py): the mesh axis whose devices
    # each run their own tokens; the MoE block gathers every device's tokens over it, runs
    # this device's experts on them and scatters the sums back. None: tokens are the same on
    # every device (one device, or tensor parallel).
    moe_token_axis: str | None = None
    # The experts' grouped matmul (--moe-backend; MOE_BACKENDS, quant/ops.py grouped_matmul).
    moe_backend: str = "auto"
    # gpt-oss's expert gate: min(gate, limit) * sigmoid(alpha * that) * (clip(up, +-limit) + 1);
    # 0: SiLU(gate) * up.
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 0.0
    # DeepSeek's routing (MoeFamily.deepseek_router): sigmoid scores (else softmax), a
    # learned bias on them for the choice alone, experts in router_groups groups of which
    # the router_topk_groups best are kept (scored by their two best experts where
    # router_group_top2, else their best), the weights times routed_scaling_factor.
    router_sigmoid: bool = False
    router_bias: bool = False
    router_groups: int = 1
    router_topk_groups: int = 1
    router_group_top2: bool = False
    routed_scaling_factor: float = 1.0
    # Nemotron-H's latent experts: tokens projected to this width before the experts and
    # back after their weighted sum (0: the experts take the hidden size).
    moe_latent_size: int = 0

    @property
    def latent(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def latent_width(self) -> int:
        """A latent cache entry: kv_lora_rank normed values, then the rope key."""
        return self.kv_lora_rank + self.head_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict:
        return dict(self.rope_scaling or ())

    @property
    def attn_scale(self) -> float:
        return self.query_scale or self.head_dim ** -0.5

    def window(self, layer: int) -> int:
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def mixer(self, layer: int) -> str:
        return self.mixers[layer] if self.mixers else "attention"

    def mult(self, name: str) -> float:
        return dict(self.multipliers).get(name, 1.0)

    @property
    def num_kv_layers(self) -> int:
        """The layers that keep K/V pages: the attention layers."""
        return sum(1 for i in range(self.num_layers) if self.mixer(i) in ATTENDING)

    @property
    def num_linear_layers(self) -> int:
        """The layers that keep a recurrent state instead."""
        return sum(1 for i in range(self.num_layers) if self.mixer(i) in STATEFUL)

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.expert_shards

    @property
    def uniform_layers(self) -> bool:
        """Every layer has the same weights (stored stacked); else a list of layers."""
        return len(set(self.layer_kinds)) <= 1

    @property
    def layer_kinds(self) -> tuple[tuple[str, bool], ...]:
        """Each layer's (mixer, routes to experts?): layers of one kind share a tree shape."""
        return tuple((self.mixer(i), self.is_moe(i)) for i in range(self.num_layers))

    @property
    def moe_family(self) -> MoeFamily:
        return FAMILIES[self.architecture].moe

    def with_dtype(self, dtype: str) -> "ModelConfig":
        if dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        return replace(self, dtype=dtype)

    @classmethod
    def from_hf(cls, hf: dict, dtype: str | None = None) -> "ModelConfig":
        from model.vlm_text import text_config
        try:
            hf = text_config(hf)  # a vision-language checkpoint's language model
        except ValueError as e:
            raise ConfigError(str(e)) from None
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else hf.get("model_type", "?")
        if arch not in FAMILIES:
            raise ConfigError(f"unsupported architecture {arch!r}; supported: "
                              + ", ".join(FAMILIES))
        family = FAMILIES[arch]
        hf = {**dict(family.defaults), **hf}
        from model.latent_config import latent_fields
        from model.mamba_config import (falcon_fields, falcon_hf, granite_fields, granite_hf,
                                         nemotron_hf)
        from model.rope_config import rotary_dim, scaling_items
        if family.linear == "mamba2":
            hf = (nemotron_hf if family.blocks else falcon_hf if family.falcon
                  else granite_hf)(hf)
        if hf.get("index_topk") is not None:
            raise ConfigError(f"unsupported config: index_topk={hf['index_topk']!r} "
                              "(DeepSeek-V3.2's sparse-attention indexer is not served)")
        heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        latent = latent_fields(hf, family) if family.latent else {}
        if latent:
            head_dim = latent.pop("head_dim")
            hf = {**hf, "query_pre_attn_scalar": latent.pop("query_scale") ** -2}
        num_layers = hf["num_hidden_layers"]
        attention_bias = bool(hf.get("attention_bias", False))
        # transformers 5 writes `rope_parameters` (theta included); older files `rope_scaling`.
        try:
            local_theta, rope = layer_types.local_rope(hf, arch)
            windows = (() if family.linear else
                       layer_types.sliding_windows(hf, arch, num_layers))
        except layer_types.LayerTypesError as e:
            raise ConfigError(str(e)) from None
        from model.linear_config import linear_fields
        from model.mamba_config import mamba_fields
        linear = ({"gdn": linear_fields, "mamba2": mamba_fields}[family.linear](hf, num_layers)
                  if family.linear else {})
        if linear and not set(ATTENDING) & set(linear["mixers"]):
            raise ConfigError("unsupported config: no attention layer (a model of linear "
                              "layers alone keeps no KV pages, which the engine sizes by)")
        if hf.get("use_bidirectional_attention"):
            raise ConfigError("unsupported config: use_bidirectional_attention=true (an "
                              "encoder; we serve causal decoders)")
        cfg = cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=1 if latent else hf.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rope_scaling=scaling_items(rope),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=bool(hf.get("qkv_bias", family.qkv_bias)) or attention_bias,
            o_bias=attention_bias and family.o_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=family.qk_norm == "head" or (family.qk_norm == "config"
                                                  and bool(hf.get("use_qk_norm"))),
            qk_norm_full=family.qk_norm == "full",
            clip_qkv=float(hf.get("clip_qkv") or 0.0),
            sliding_windows=windows,
            local_rope_theta=local_theta,
            hidden_act=_activation(hf),
            norm_offset=family.gemma or family.norm_offset,
            sandwich_norms=family.gemma,
            scale_embed=family.gemma,
            query_scale=(float(hf["attention_multiplier"]) if family.granite else
                         float(hf["query_pre_attn_scalar"]) ** -0.5
                         if hf.get("query_pre_attn_scalar") else 0.0),
            attn_soft_cap=float(hf.get("attn_logit_softcapping") or 0.0),
            attn_sinks=family.sinks,
            final_soft_cap=float(hf.get("final_logit_softcapping") or 0.0),
            rotary_dim=rotary_dim(hf, rope, head_dim),
            num_mtp_layers=int(hf.get("num_nextn_predict_layers") or 0),
            attn_output_gate=family.gated_attention,
            blocks=family.blocks,
            mlp_gated=not family.blocks,
            use_rope=not family.blocks and (not family.granite
                                            or hf.get("position_embedding_type") == "rope"),
            norm_weight_f32=family.blocks,
            **(granite_fields(hf) if family.granite else {}),
            **(falcon_fields(hf) if family.falcon else {}),
            **linear,
            **latent,
            **(_moe(hf, family, num_layers) if family.moe else {}),
        )
        return cfg.with_dtype(dtype or _hf_dtype(hf))

    @classmethod
    def from_dir(cls, path: str | Path, dtype: str | None = None) -> "ModelConfig":
        path = Path(path) / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json in {path.parent}")
        return cls.from_hf(json.loads(path.read_text()), dtype)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = tuple((k, v) for k, v in d["rope_scaling"])
        d["sliding_windows"] = tuple(d.get("sliding_windows", ()))
        d["moe_layers"] = tuple(d.get("moe_layers", ()))
        d["mixers"] = tuple(d.get("mixers", ()))
        if "ssm_dt_limit" in d:
            d["ssm_dt_limit"] = tuple(d["ssm_dt_limit"])
        d["multipliers"] = tuple((k, v) for k, v in d.get("multipliers", ()))
        return cls(**d)


def _moe(hf: dict, family: Family, num_layers: int) -> dict:
    from model.moe_config import moe_fields
    if family.blocks:  # Nemotron-H: experts where a block says "moe", if one does
        from model.mamba_config import block_moe_layers
        layers = block_moe_layers(hf)
        return ({**moe_fields(hf, family.moe, num_layers), "moe_layers": layers,
                 "moe_latent_size": int(hf.get("moe_latent_size") or 0)}
                if any(layers) else {})
    return moe_fields(hf, family.moe, num_layers)


def _hf_dtype(hf: dict) -> str:
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    return dtype if dtype in DTYPES else "float32"


def _activation(hf: dict) -> str:
    field = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"
    name = hf.get(field) or "silu"
    if name not in ACTIVATIONS:
        raise ConfigError(f"unsupported activation: {field}={name!r} (supported: "
                          + ", ".join(ACTIVATIONS) + ")")
    return ACTIVATIONS[name]
