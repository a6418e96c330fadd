"""GGUF mixtures of experts (model/formats/gguf_arch.py's qwen2moe, qwen3moe): tiny files
written as llama.cpp's converter lays them out, served token for token as transformers
serves the same file (its own GGUF reader unstacking the experts), quantized experts on
their codes.

transformers' GGUF reader leaves a mixture's expert sizes at its config class's defaults,
so the reference gets the tiny model's config; the weights it reads are the file's."""
from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

from model.checkpoint import load_model
from model.formats.gguf_file import gguf_folder
from quant.int4 import Int4Array
from quant.int8_groups import Int8GroupArray
from serving import LLM, SamplingParams
from tests.gguf_tiny import own_cache, tiny_file_of, transformers_reading
from tests.hf_tiny import greedy_reference

# every matrix's inputs a multiple of 32, as the block types need; every Qwen2-MoE block a
# mixture, as llama.cpp's qwen2moe (and transformers reading it) has them
SIZES = {"qwen2_moe": dict(moe_intermediate_size=64, shared_expert_intermediate_size=64,
                           mlp_only_layers=[]),
         "qwen3_moe": dict(moe_intermediate_size=64, head_dim=16)}
# experts on the int4 and 8-bit group kernels' codes (Q5_1's with their mins as offsets), the
# rest of each file float
QUANT = {"ffn_gate_exps": T.Q4_0, "ffn_up_exps": T.Q4_1, "ffn_down_exps": T.Q5_1,
         "ffn_gate_shexp": T.Q4_0, "ffn_down_shexp": T.Q8_0, "attn_q": T.Q4_0,
         "attn_output": T.Q4_1, "token_embd": T.Q8_0}
# float32 KV (a GGUF's default is float16, llama.cpp's): the tokens are compared with
# transformers' float32 reading of the file
OPTIONS = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, page_size=4,
               token_buckets=(16,), request_buckets=(4,), page_buckets=(16,), progress=False,
               kv_cache_dtype="float32")
PROMPTS = [[1, 17, 33, 5, 90], [1, 200, 3, 3, 3, 150, 42, 7, 9], [1, 8, 64, 99]]
TOKENS = 8


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    yield from own_cache(tmp_path_factory)


@pytest.fixture(scope="module", params=[(f, q) for f in sorted(SIZES) for q in ("f32", "quant")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def tiny_file(request, tmp_path_factory, gguf_cache):
    family, mix = request.param
    return (family, mix) + tiny_file_of(tmp_path_factory, family, mix, SIZES[family], QUANT,
                                        7)[:2]


def test_greedy_tokens_equal_transformers_reading_the_same_file(tiny_file):
    family, mix, model, path = tiny_file
    reference = transformers_reading(path, model.config)
    llm = LLM(str(path), **OPTIONS)
    ours = [r.token_ids for r in llm.generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=TOKENS, ignore_eos=True))]
    assert ours == [greedy_reference(reference, p, TOKENS) for p in PROMPTS]


def test_experts_stay_on_their_codes(tiny_file):
    family, mix, model, path = tiny_file
    cfg, params = load_model(gguf_folder(path))
    assert cfg.num_experts == 4 and cfg.moe_intermediate_size == 64
    layers = params["layers"]
    moe = (layers[0] if isinstance(layers, list) else layers)["moe"]
    want = {"gate_proj": Int4Array, "up_proj": Int4Array, "down_proj": Int8GroupArray}
    for name, form in want.items():
        kernel = moe[name]["kernel"]
        assert isinstance(kernel, form) == (mix == "quant"), name
        assert getattr(kernel, "values", kernel).shape[-3] == 4  # [(layers,) E, in, out]
    if mix == "quant":  # Q5_1's mins
        assert moe["down_proj"]["kernel"].offset is not None
    if family == "qwen2_moe":  # a shared expert with a one-output gate
        assert cfg.shared_expert_intermediate_size == 64
        assert moe["shared_expert_gate"]["kernel"].shape[-2:] == (64, 1)  # a vector in the file
