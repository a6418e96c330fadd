"""GGUF's Mixtral (a `llama` file whose blocks have routers) and `olmoe`
(model/formats/gguf_arch.py): tiny files written as llama.cpp's converter lays them out,
served token for token as transformers serves the same weights, quantized experts on their
codes.

transformers reads neither from a GGUF, so the reference is the tiny model itself for the
float32 file and the tiny model with the file's own dequantized weights for the quantized
one. llama.cpp's OLMoE does not clamp q, k and v, so the tiny OLMoE leaves clip_qkv out."""
from __future__ import annotations

import json

import pytest
from gguf import GGMLQuantizationType as T

from model.checkpoint import load_model
from model.formats.gguf_arch import architecture
from model.formats.gguf_file import gguf_folder
from quant.int4 import Int4Array
from quant.int8_groups import Int8GroupArray
from tests.gguf_tiny import own_cache, served_and_reference, tiny_file_of
from tests.test_gguf_moe import OPTIONS, PROMPTS, TOKENS  # the same engine and prompts

# every expert's inputs a multiple of 32, as the block types need
SIZES = {"mixtral": dict(intermediate_size=64),
         "olmoe": dict(intermediate_size=64, clip_qkv=None)}
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "olmoe": "OlmoeForCausalLM"}
# experts on the int4 and 8-bit group kernels' codes; attn_q quantized after llama.cpp's
# row permutation (Mixtral's)
QUANT = {"ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q4_1, "ffn_down_exps": T.Q8_0,
         "attn_q": T.Q4_0, "attn_k": T.Q8_0, "attn_output": T.Q4_1, "token_embd": T.Q8_0}


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    yield from own_cache(tmp_path_factory)


@pytest.fixture(scope="module", params=[(f, q) for f in sorted(SIZES) for q in ("f32", "quant")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def tiny_file(request, tmp_path_factory, gguf_cache):
    family, mix = request.param
    return (family, mix) + tiny_file_of(tmp_path_factory, family, mix, SIZES[family], QUANT, 5)


def test_greedy_tokens_equal_transformers_on_the_files_weights(tiny_file):
    family, mix, model, path, read_back = tiny_file
    ours, want = served_and_reference(model, path, read_back, mix, OPTIONS, PROMPTS, TOKENS)
    assert ours == want


def test_config_and_experts_on_their_codes(tiny_file):
    family, mix, model, path, _ = tiny_file
    folder = gguf_folder(path)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURES[family]]
    cfg, params = load_model(folder)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 64)
    assert cfg.norm_topk_prob == (family == "mixtral")
    assert cfg.qk_norm_full == (family == "olmoe")
    layers = params["layers"]
    moe = (layers[0] if isinstance(layers, list) else layers)["moe"]
    want = {"gate_proj": Int4Array, "up_proj": Int4Array, "down_proj": Int8GroupArray}
    for name, form in want.items():
        kernel = moe[name]["kernel"]
        assert isinstance(kernel, form) == (mix == "quant"), name
        assert getattr(kernel, "values", kernel).shape[-3] == 4  # [(layers,) E, in, out]


def test_a_llama_file_is_mixtral_only_with_routers():
    names = ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_gate.weight"]
    assert architecture("llama", ValueError, names).hf_architecture == "LlamaForCausalLM"
    names += ["blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_exps.weight"]
    assert architecture("llama", ValueError, names).hf_architecture == "MixtralForCausalLM"
