"""GGUF's gemma2 and gemma3 (model/formats/gguf_arch.py): tiny files written as llama.cpp's
converter lays them out (every norm weight stored as 1 + w, the sandwich norms under its
names, soft-caps, windows and Gemma 3's two RoPE bases in metadata), served token for token
as transformers serves the same file.

The tiny models' query scale is 1 / sqrt(head_dim), as llama.cpp has it for every size but
27B: the file does not carry it. transformers' GGUF reader leaves soft-caps and windows at
its config class's defaults, so the reference gets the tiny model's config; the weights it
reads are the file's."""
from __future__ import annotations

import json

import pytest
from gguf import GGMLQuantizationType as T

from model.formats.gguf_file import gguf_folder
from serving import LLM, SamplingParams
from tests.gguf_tiny import GGUF_ARCH, own_cache, transformers_reading, write_gguf
from tests.hf_tiny import greedy_reference, tiny_hf_model

QUANT = {"attn_q": T.Q4_0, "attn_output": T.Q8_0, "ffn_gate": T.Q4_1, "ffn_down": T.Q4_0,
         "token_embd": T.Q8_0}
# float32 KV (a GGUF's default is float16, llama.cpp's): the tokens are compared with
# transformers' float32 reading of the file
OPTIONS = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16, page_size=4,
               token_buckets=(16,), request_buckets=(4,), page_buckets=(16,), progress=False,
               kv_cache_dtype="float32")
# past both windows (8 and 6 tokens) in the prompt and while decoding
PROMPTS = [[1, 17, 33, 5, 90, 4, 4, 120, 11, 60], [1, 200, 3, 3, 3, 150, 42, 7, 9], [1, 8, 64]]
TOKENS = 8


@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    yield from own_cache(tmp_path_factory)


@pytest.fixture(scope="module", params=[("gemma2", "f32"), ("gemma2", "quant"),
                                        ("gemma3", "f32"), ("gemma3", "quant")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def tiny_file(request, tmp_path_factory, gguf_cache):
    family, mix = request.param
    out = tmp_path_factory.mktemp(f"gguf-{family}-{mix}")
    model = tiny_hf_model(family, out / "hf", seed=3, query_pre_attn_scalar=16)
    arch = GGUF_ARCH.get(model.config.model_type, model.config.model_type)
    path, _ = write_gguf(model, arch, out / f"{family}.gguf", QUANT if mix == "quant" else {})
    return family, model, path


def test_greedy_tokens_equal_transformers_reading_the_same_file(tiny_file):
    family, model, path = tiny_file
    reference = transformers_reading(path, model.config)
    llm = LLM(str(path), **OPTIONS)
    ours = [r.token_ids for r in llm.generate(PROMPTS, SamplingParams(
        temperature=0, max_tokens=TOKENS, ignore_eos=True))]
    assert ours == [greedy_reference(reference, p, TOKENS) for p in PROMPTS]


def test_config_from_the_metadata(tiny_file, tmp_path):
    family, model, path = tiny_file
    config = json.loads((gguf_folder(path, cache=tmp_path) / "config.json").read_text())
    hf = model.config
    assert config["sliding_window"] == hf.sliding_window
    assert config["query_pre_attn_scalar"] == 16
    if family == "gemma2":
        assert config["attn_logit_softcapping"] == hf.attn_logit_softcapping
        assert config["final_logit_softcapping"] == hf.final_logit_softcapping
    else:
        assert config["rope_local_base_freq"] == 100.0
        assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
