"""Tiny GGUF files written from tiny transformers models, as llama.cpp's converter lays them
out: GGUF tensor names, a `llama` file's attn_q / attn_k rows permuted for llama.cpp's
rotary kernel (a `deepseek2` file keeps the checkpoint's own interleaved rope rows), a
mixture's experts stacked per block (`ffn_{gate,up,down}_exps`, the shared expert's gate a
vector), matrices quantized by the `gguf` package's own quantizers, or by tests/gguf_encoders.py's
for the types the package only dequantizes.

    path, expected = write_gguf(model, "llama", tmp / "m.gguf", {"ffn_down": Q4_0})

`expected` maps each Hugging Face tensor name to the float32 values llama.cpp reads back (the
format's own dequantization), in Hugging Face's orientation and row order.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import ExpertGatingFuncType, GGUFWriter, RopeScalingType
from gguf.quants import dequantize, quantize

from tests.gguf_encoders import ENCODERS

# Llama 3's rope scaling with a context short enough that some of head_dim 16's frequencies
# are scaled in between (written as llama.cpp's rope_freqs, read back from them)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

# HF name after "model.layers.N." -> GGUF name after "blk.N."
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Qwen2-MoE / Qwen3-MoE: router, shared expert and its gate
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# DeepSeek's latent attention, router correction bias and shared experts
DEEPSEEK_NAMES = {
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    **{f"mlp.shared_experts.{p}_proj.weight": f"ffn_{p}_shexp.weight"
       for p in ("gate", "up", "down")}}
# every expert in one HF tensor [E, out, in] -> the GGUF stacks it is split into (along out)
EXPERT_NAMES = {"mlp.experts.gate_up_proj": ("ffn_gate_exps.weight", "ffn_up_exps.weight"),
                "mlp.experts.down_proj": ("ffn_down_exps.weight",)}
# Gemma's sandwich norms (its converter also stores every norm weight w as 1 + w)
GEMMA_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
# transformers' model_type -> GGUF architecture, where they differ
GGUF_ARCH = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "gemma3_text": "gemma3",
             "mixtral": "llama", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
             "glm4_moe": "glm4moe"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    return gguf_names(hf_name)[0]


def gguf_names(hf_name: str, arch: str = "llama") -> tuple[str, ...]:
    """The GGUF tensor(s) one HF tensor becomes (two for experts' fused gate and up)."""
    if hf_name in TOP_NAMES:
        return (TOP_NAMES[hf_name],)
    _, _, layer, rest = hf_name.split(".", 3)
    names = {**LAYER_NAMES, **GEMMA_NAMES} if arch.startswith("gemma") else LAYER_NAMES
    names = {**names, **DEEPSEEK_NAMES} if arch in ("deepseek2", "glm4moe") else names
    if arch == "glm4moe":  # its pre-MLP norm
        names = {**names, "post_attention_layernorm.weight": "post_attention_norm.weight"}
    return tuple(f"blk.{layer}.{n}" for n in EXPERT_NAMES.get(rest, (names.get(rest),)))


def permute_for_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for attn_q / attn_k (rotary halves interleaved)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, arch: str, path: Path, types: dict[str, T],
               default: T = T.F32, split_kv_b: bool = False
               ) -> tuple[Path, dict[str, np.ndarray]]:
    """types: GGUF tensor kind ("ffn_down", "token_embd", ...) or one layer's tensor
    ("blk.1.ffn_down") -> its type; matrices of other kinds get `default`, vectors F32.
    split_kv_b: a deepseek2 file as newer converters write it (attn_k_b / attn_v_b and the
    MLA head sizes), else with attn_kv_b."""
    cfg = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {}
    if arch == "deepseek2":
        _deepseek_metadata(writer, cfg, split_kv_b)
    else:
        writer.add_head_count_kv(cfg.num_key_value_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1)))
    if arch == "glm4moe":
        _deepseek_moe_metadata(writer, cfg)
    if "full_attention" in rope:  # Gemma 3: the window layers' base and the full ones' own
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        rope = rope["full_attention"]
    writer.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta")
                              else rope["rope_theta"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch.startswith("gemma"):
        writer.add_sliding_window(cfg.sliding_window)
        if getattr(cfg, "attn_logit_softcapping", None):
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if getattr(cfg, "final_logit_softcapping", None):
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    if getattr(cfg, "num_experts", None) and arch not in ("deepseek2", "glm4moe"):
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):  # not Mixtral's, not OLMoE's
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    expected = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        names = gguf_names(hf_name, arch)
        full = tensor.detach().float().numpy()
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            full = full + 1.0  # the scale Gemma's (1 + w) norm multiplies by
        if names[0].endswith("ffn_gate_inp_shexp.weight"):
            full = full[0]  # [1, in]: stored as the vector llama.cpp reads
        if split_kv_b and names[0].endswith("attn_kv_b.weight"):
            expected[hf_name] = _split_kv_b(writer, names[0], full, cfg, types, default)
            continue
        backs = []
        for name, w in zip(names, np.split(full, len(names), axis=-2 if full.ndim > 1 else 0)):
            backs.append(_add(writer, name, w, arch, heads, types, default))
        expected[hf_name] = np.concatenate(backs, axis=-2).reshape(tensor.shape) \
            if len(backs) > 1 else backs[0].reshape(tensor.shape)
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            expected[hf_name] = expected[hf_name] - np.float32(1.0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, expected


def _add(writer, name: str, w: np.ndarray, arch: str, heads: dict, types: dict,
         default: T) -> np.ndarray:
    """One tensor written in its type; -> the values llama.cpp reads back, in HF's order."""
    kind = name.split(".")[-2]
    if arch == "llama" and kind in heads:
        w = permute_for_llama_cpp(w, heads[kind])
    kind_type = (types.get(name.rsplit(".", 1)[0], types.get(kind, default))
                 if w.ndim >= 2 else T.F32)
    data = (ENCODERS[kind_type](w) if kind_type in ENCODERS
            else quantize(w, kind_type) if kind_type not in (T.F32,) else w)
    writer.add_tensor(name, data, raw_dtype=kind_type)
    back = np.asarray(dequantize(data, kind_type), np.float32).reshape(w.shape)
    if arch == "llama" and kind in heads:  # the loader's job: back to HF's row order
        back = permute_for_llama_cpp_inverse(back, heads[kind])
    return back


def _deepseek_metadata(writer, cfg, mla: bool) -> None:
    """deepseek2's metadata as llama.cpp's converter writes it; `mla`: its newer form, one
    KV head of the latent's width."""
    nope, rot, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    rank = cfg.kv_lora_rank
    writer.add_head_count_kv(1 if mla else cfg.num_attention_heads)
    writer.add_key_length(rank + rot if mla else nope + rot)
    writer.add_value_length(rank if mla else v)
    if mla:
        writer.add_key_length_mla(nope + rot)
        writer.add_value_length_mla(v)
    writer.add_rope_dimension_count(rot)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_kv_lora_rank(rank)
    _deepseek_moe_metadata(writer, cfg)


def _deepseek_moe_metadata(writer, cfg) -> None:
    """DeepSeek's routing as deepseek2 and glm4moe files carry it."""
    writer.add_leading_dense_block_count(cfg.first_k_dense_replace)
    writer.add_expert_count(cfg.n_routed_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_shared_count(cfg.n_shared_experts)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_weights_scale(cfg.routed_scaling_factor)
    writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    v3 = cfg.model_type != "deepseek_v2"  # V3 and GLM-4.5: sigmoid
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if v3
                                  else ExpertGatingFuncType.SOFTMAX)
    if getattr(cfg, "n_group", None):
        writer.add_expert_group_count(cfg.n_group)
        writer.add_expert_group_used_count(cfg.topk_group)


def _split_kv_b(writer, name: str, w: np.ndarray, cfg, types: dict, default: T) -> np.ndarray:
    """kv_b_proj [H * (nope + v), r] written as attn_k_b [H, r, nope] and attn_v_b
    [H, v, r]; -> kv_b_proj as read back."""
    nope, heads = cfg.qk_nope_head_dim, cfg.num_attention_heads
    w = w.reshape(heads, nope + cfg.v_head_dim, -1)
    k_b = _add(writer, name.replace("kv_b", "k_b"), np.ascontiguousarray(
        w[:, :nope].transpose(0, 2, 1)), "deepseek2", {}, types, default)
    v_b = _add(writer, name.replace("kv_b", "v_b"), np.ascontiguousarray(w[:, nope:]),
               "deepseek2", {}, types, default)
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, w.shape[-1])


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as rope_freqs for Llama 3's
    rope scaling."""
    theta, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def permute_for_llama_cpp_inverse(w: np.ndarray, heads: int) -> np.ndarray:
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def transformers_reading(path: Path, config):
    """transformers' model from a GGUF file, its own reader undoing the converter; `config`
    the tiny model's, for what the metadata does not carry (or transformers does not read)."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=config, torch_dtype=torch.float32,
        attn_implementation="eager", experts_implementation="eager").eval()


def own_cache(tmp_path_factory):
    """A module's GGUF folders in a cache of its own (XDG_CACHE_HOME), for a fixture to
    yield from; compiled programs and quantized weights from the usual one (linked)."""
    import pytest

    from serving.core.config import default_cache_root
    usual = default_cache_root() / "jax-cache"
    usual.mkdir(parents=True, exist_ok=True)
    root = tmp_path_factory.mktemp("cache")
    (root / "xlaserve").mkdir()
    (root / "xlaserve" / "jax-cache").symlink_to(usual, target_is_directory=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root))
        yield


def tiny_file_of(tmp_path_factory, family: str, mix: str, sizes: dict, quant: dict,
                 seed: int):
    """A tiny `family` model (tests/hf_tiny.py, with `sizes` over its defaults) written as
    a GGUF file: every matrix F32 (mix "f32") or as `quant` names them.
    -> (model, path, the values read back)."""
    from tests.hf_tiny import tiny_hf_model
    out = tmp_path_factory.mktemp(f"gguf-{family}-{mix}")
    model = tiny_hf_model(family, out / "hf", seed=seed, **sizes)
    path, read_back = write_gguf(model, GGUF_ARCH.get(family, family), out / f"{family}.gguf",
                                 quant if mix == "quant" else {})
    return model, path, read_back


def served_and_reference(model, path: Path, read_back: dict, mix: str, options: dict,
                         prompts: list[list[int]], tokens: int):
    """Greedy tokens of our engine serving the file, and of the tiny model on the file's
    own weights (the model as is for an F32 file, `read_back` loaded for a quantized one):
    the reference where transformers does not read the architecture from GGUF."""
    import copy

    import torch

    from serving import LLM, SamplingParams
    from tests.hf_tiny import greedy_reference
    reference = model
    if mix == "quant":
        reference = copy.deepcopy(model)
        reference.load_state_dict({k: torch.from_numpy(v) for k, v in read_back.items()})
    llm = LLM(str(path), **options)
    ours = [r.token_ids for r in llm.generate(prompts, SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True))]
    return ours, [greedy_reference(reference, p, tokens) for p in prompts]
