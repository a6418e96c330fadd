"""Quantization on the demo model: perplexity on tests/data's essay stays within its bound, and
a quantized checkpoint round-trips through conversion, load and the engine."""
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from model.checkpoint import load_model, param_bytes, read_metadata
from quant.array import QuantArray
from model.quality import perplexity
from quant.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
# Largest relative perplexity change allowed. Measured by scripts/eval_quality.py on this
# model (float32, windows of 512 tokens, base 44.84, the engine's attention backend): int8
# +0.60%, fp8 +0.96%, KV int8 +0.11%, KV fp8 +0.50%, KV float16 +0.002%, KV bfloat16
# +0.002%; the ceilings are 2% / 4% / 2% / 2%. The test scores the essay's first
# TOKENS (two windows, base 39.33): int8 +0.71%, fp8 +1.58%, KV int8 +0.17%, KV fp8
# +0.21%, KV float16 -0.002%.
BOUNDS = {("int8", "auto"): 0.01, ("fp8", "auto"): 0.025,
          ("none", "int8"): 0.01, ("none", "fp8"): 0.01,
          ("none", "float16"): 0.001, ("none", "bfloat16"): 0.001}

TOKENS = 1024
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def demo(demo_checkpoint):
    from transformers import AutoTokenizer
    cfg, params = load_model(demo_checkpoint, progress=False)
    tokens = AutoTokenizer.from_pretrained(str(demo_checkpoint)).encode(
        (DATA / "paged_kv_essay.txt").read_text())
    assert len(tokens) >= TOKENS
    return cfg, params, tokens[:TOKENS]


@pytest.fixture(scope="module")
def base_perplexity(demo):
    cfg, params, tokens = demo
    ppl = perplexity(cfg, params, tokens)
    assert 30 < ppl < 60, ppl  # 39.33 (44.84 over the whole essay, where transformers agrees)
    return ppl


@pytest.mark.parametrize("weights,kv", list(BOUNDS))
def test_perplexity_within_bound(demo, base_perplexity, weights, kv):
    from quant.recipe import quantize_params
    cfg, params, tokens = demo
    if weights != "none":
        params = quantize_params(params, weights)
        assert param_bytes(params) < 0.45 * param_bytes(demo[1])
    ppl = perplexity(cfg, params, tokens, kv_cache_dtype=None if kv == "auto" else kv)
    change = ppl / base_perplexity - 1
    print(f"weights {weights} kv {kv}: perplexity {ppl:.4f} ({100 * change:+.2f}%)")
    assert ppl != base_perplexity  # the quantized path really ran
    assert abs(change) < BOUNDS[weights, kv]


@pytest.fixture(scope="module")
def int8_checkpoint(demo_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("quant") / "int8"
    r = subprocess.run([sys.executable, "scripts/convert_hf.py", str(demo_model_dir), str(out),
                        "--dtype", "float32", "--quantize", "int8"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "of bfloat16's" in r.stdout, r.stdout
    return out


def test_quantized_checkpoint_round_trips(int8_checkpoint, demo_checkpoint):
    meta = read_metadata(int8_checkpoint)
    assert Recipe.from_dict(meta["quantization"]) == Recipe.parse("int8")
    assert meta["quantization"]["activations"] == "none"
    assert meta["weight_bytes"] < 0.45 * 2 * meta["bf16_bytes"]  # vs float32
    _, stored = load_model(int8_checkpoint, progress=False)
    _, at_load = load_model(demo_checkpoint, progress=False, quantize="int8")
    assert jax.tree.structure(stored) == jax.tree.structure(at_load)
    quantized = [a for a in jax.tree.leaves(stored, is_leaf=lambda a: isinstance(a, QuantArray))
                 if isinstance(a, QuantArray)]
    assert len(quantized) == 7  # q, k, v, o, gate, up, down (layer-stacked)
    for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(at_load)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="already quantized"):
        load_model(int8_checkpoint, progress=False, quantize="fp8")


ENGINE = dict(max_num_seqs=4, max_model_len=64, max_num_batched_tokens=16,
              token_buckets=(4, 16), request_buckets=(4,), page_buckets=(4,), progress=False)
PROMPTS = [json.loads((DATA / "quality_prompts.json").read_text())[i] for i in (0, 2, 4)]


def test_engine_serves_quantized_checkpoint_like_quantize_at_load(int8_checkpoint,
                                                                  demo_checkpoint):
    from serving import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    stored = LLM(str(int8_checkpoint), **ENGINE)
    assert "int8 per channel" in stored.engine.describe()
    assert stored.engine.weight_bytes == read_metadata(int8_checkpoint)["weight_bytes"]
    want = [r.token_ids for r in stored.generate(PROMPTS, params)]
    del stored
    at_load = LLM(str(demo_checkpoint), quantize="int8", **ENGINE)
    assert [r.token_ids for r in at_load.generate(PROMPTS, params)] == want
    del at_load
    kv = LLM(str(int8_checkpoint), kv_cache_dtype="int8", **ENGINE)
    assert kv.engine.runner.cache.k.dtype == np.int8
    assert "KV cache int8" in kv.engine.describe()
    got = [r.token_ids for r in kv.generate(PROMPTS, params)]
    assert all(len(g) == 12 for g in got)
    assert np.mean([a == b for g, w in zip(got, want) for a, b in zip(g, w)]) > 0.5


def test_engine_with_a_float16_cache_under_a_float32_model(demo_checkpoint):
    """--kv-cache-dtype float16 (llama.cpp's default cache type) stores K/V at half the bytes
    of the float32 model's own cache and keeps its greedy output."""
    from serving import LLM, SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    full = LLM(str(demo_checkpoint), **ENGINE)
    want = [r.token_ids for r in full.generate(PROMPTS, params)]
    full_bytes = full.engine.kv_cache_bytes / full.engine.num_pages
    del full
    half = LLM(str(demo_checkpoint), kv_cache_dtype="float16", **ENGINE)
    assert half.engine.runner.cache.k.dtype == np.float16
    assert "KV cache float16" in half.engine.describe()
    assert half.engine.kv_cache_bytes / half.engine.num_pages == full_bytes / 2
    got = [r.token_ids for r in half.generate(PROMPTS, params)]
    assert np.mean([a == b for g, w in zip(got, want) for a, b in zip(g, w)]) > 0.9
