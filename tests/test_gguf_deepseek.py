"""GGUF's `deepseek2` and `glm4moe` (model/formats/gguf_arch.py): tiny DeepSeek-V2-Lite-like,
V3-like and GLM-4.5-like models (tests/deepseek_tiny.py) written as llama.cpp's converter
lays them out, served token for token as transformers serves the same weights.

The V2-Lite file has the older whole attn_kv_b, the V3 file the newer per-head attn_k_b /
attn_v_b with the MLA head sizes. Both keep the checkpoint's interleaved rope rows, which the
reader puts in rotate-half order. transformers does not read these files, so the reference
is the tiny model itself for the float32 file, and the tiny model with the file's own
dequantized weights for the quantized one."""
from __future__ import annotations

import json

import pytest
from gguf import GGMLQuantizationType as T

from model.formats.gguf_file import GGUFError, gguf_folder, hf_config
from tests.deepseek_tiny import tiny_deepseek_model
from tests.gguf_tiny import own_cache, served_and_reference, write_gguf
from tests.test_gguf_moe import OPTIONS, PROMPTS, TOKENS  # the same engine and prompts

# matrices whose inputs are a multiple of 32 (attn_q_b's 48 and attn_k_b's 16 stay F32); the
# rope-carrying projections quantized before their rows are permuted
QUANT = {"attn_q": T.Q4_0, "attn_q_a": T.Q8_0, "attn_kv_a_mqa": T.Q4_0, "attn_k": T.Q8_0,
         "attn_v": T.Q4_0, "attn_kv_b": T.Q8_0, "attn_v_b": T.Q8_0, "attn_output": T.Q4_0,
         "ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q8_0, "ffn_down_exps": T.Q4_0,
         "ffn_gate_shexp": T.Q8_0, "ffn_down_shexp": T.Q4_0, "ffn_up": T.Q8_0,
         "token_embd": T.Q8_0}
# the experts and routing every variant shares (tests/deepseek_tiny.py)
MOE = dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           first_k_dense_replace=1, intermediate_size=96, num_hidden_layers=3,
           num_attention_heads=4)
LATENT = dict(MOE, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
              num_key_value_heads=4)
# variant -> (its GGUF architecture, split attn_k_b / attn_v_b, config.json fields the
# file must give)
VARIANTS = {
    "v2_lite": ("deepseek2", False, dict(
        LATENT, architectures=["DeepseekV2ForCausalLM"], q_lora_rank=None,
        scoring_func="softmax", topk_method="greedy", n_shared_experts=2,
        norm_topk_prob=False, routed_scaling_factor=1.0)),
    "v3": ("deepseek2", True, dict(
        LATENT, architectures=["DeepseekV3ForCausalLM"], q_lora_rank=48,
        scoring_func="sigmoid", topk_method="noaux_tc", n_group=4, topk_group=2,
        n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_interleave=True)),
    "glm4_moe": ("glm4moe", False, dict(
        MOE, architectures=["Glm4MoeForCausalLM"], num_key_value_heads=2, head_dim=16,
        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True, n_group=2,
        topk_group=1, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=1.5,
        num_nextn_predict_layers=0)),
}
# V3's and GLM's float32 files left out for time: their quantized ones go through the same
# reading (a float32 attn_q_b / attn_k_b among them), against their dequantized weights
FILES = [("v2_lite", "f32"), ("v2_lite", "quant"), ("v3", "quant"), ("glm4_moe", "quant")]


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    yield from own_cache(tmp_path_factory)


@pytest.fixture(scope="module", params=FILES, ids=lambda p: f"{p[0]}-{p[1]}")
def tiny_file(request, tmp_path_factory, gguf_cache):
    variant, mix = request.param
    out = tmp_path_factory.mktemp(f"gguf-{variant}-{mix}")
    model = tiny_deepseek_model(variant, out / "hf", seed=3)
    arch, split, _ = VARIANTS[variant]
    path, read_back = write_gguf(model, arch, out / f"{variant}.gguf",
                                 QUANT if mix == "quant" else {}, split_kv_b=split)
    return variant, mix, model, path, read_back


def test_greedy_tokens_equal_transformers_on_the_files_weights(tiny_file):
    variant, mix, model, path, read_back = tiny_file
    ours, want = served_and_reference(model, path, read_back, mix, OPTIONS, PROMPTS, TOKENS)
    assert ours == want


def test_config_fields(tiny_file):
    variant, _, model, path, _ = tiny_file
    config = json.loads((gguf_folder(path) / "config.json").read_text())
    want = VARIANTS[variant][2]
    assert {k: config.get(k) for k in want} == want
    rope = model.config.rope_parameters
    if rope["rope_type"] != "yarn":
        return
    assert config["rope_scaling"] == pytest.approx(
        {k: rope[k] for k in ("rope_type", "factor", "original_max_position_embeddings",
                              "beta_fast", "beta_slow", "mscale", "mscale_all_dim")})


def _meta(arch: str, **more) -> dict:
    base = {"general.architecture": arch, f"{arch}.block_count": 4,
            f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 4,
            f"{arch}.attention.key_length": 16, f"{arch}.attention.value_length": 16,
            f"{arch}.rope.dimension_count": 8, f"{arch}.expert_count": 8}
    return {**base, **{f"{arch}.{k}": v for k, v in more.items()}}


def test_glm_next_n_blocks_left_out_and_what_has_no_counterpart_refused():
    tensors = {"token_embd.weight": (T.F32, (64, 211))}
    config = hf_config(_meta("glm4moe", nextn_predict_layers=1), tensors)
    assert (config["num_hidden_layers"], config["partial_rotary_factor"]) == (3, 0.5)
    with pytest.raises(GGUFError, match="softmax"):
        hf_config(_meta("glm4moe", expert_gating_func=1), tensors)
    with pytest.raises(GGUFError, match="expert_weights_norm"):
        hf_config(_meta("deepseek2", expert_gating_func=1, expert_weights_norm=True,
                        **{"attention.kv_lora_rank": 32}), tensors)
