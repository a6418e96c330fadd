"""Tiny GGUF files written from tiny transformers models, as llama.cpp's converter lays them
out: GGUF tensor names, a `llama` file's attn_q / attn_k rows permuted for llama.cpp's
rotary kernel, matrices quantized by the `gguf` package's own quantizers.

    path, expected = write_gguf(model, "llama", tmp / "m.gguf", {"ffn_down": Q4_0})

`expected` maps each Hugging Face tensor name to the float32 values llama.cpp reads back (the
format's own dequantization), in Hugging Face's orientation and row order.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize, quantize

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
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES[rest]}"


def permute_for_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for attn_q / attn_k (rotary halves interleaved)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, arch: str, path: Path, types: dict[str, T],
               default: T = T.F32) -> tuple[Path, dict[str, np.ndarray]]:
    """types: GGUF tensor kind ("ffn_down", "token_embd", ...) or one layer's tensor
    ("blk.1.ffn_down") -> its type; matrices of other kinds get `default`, vectors F32."""
    cfg = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_theta if hasattr(cfg, "rope_theta")
                              else cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    rope = getattr(cfg, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(rope, head_dim))
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    expected = {}
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = gguf_name(hf_name)
        kind = name.split(".")[-2]
        w = tensor.detach().float().numpy()
        if arch == "llama" and kind in heads:
            w = permute_for_llama_cpp(w, heads[kind])
        kind_type = (types.get(name.rsplit(".", 1)[0], types.get(kind, default))
                     if w.ndim == 2 else T.F32)
        data = quantize(w, kind_type) if kind_type not in (T.F32,) else w
        writer.add_tensor(name, data, raw_dtype=kind_type)
        back = np.asarray(dequantize(data, kind_type), np.float32).reshape(w.shape)
        if arch == "llama" and kind in heads:  # the loader's job: back to HF's row order
            back = permute_for_llama_cpp_inverse(back, heads[kind])
        expected[hf_name] = back
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, expected


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
