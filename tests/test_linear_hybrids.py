"""Linear-attention hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against transformers: the
config fields each family reads, logits over the paged cache and the recurrent state (one
step, and a prefill split over steps), greedy tokens through the engine with chunked prefill
at an odd chunk size, default buckets and preemption, batched equal to alone, and the state
slots all given back."""
import json

import numpy as np
import pytest
import torch

from model.checkpoint import load_model
from model.config import ConfigError, ModelConfig
from model.kv_cache import KVCache
from quant.array import QuantArray
from serving import LLM
from tests.hf_tiny import LINEAR_FAMILIES, tiny_hf_model, tiny_qwen3_5_vlm
from tests.hybrid_checks import (ENGINE, PAGE, PROMPTS, RTOL, check_batched_equals_alone,
                                 check_conversion, check_greedy, check_logits, run, step)


@pytest.fixture(scope="module", params=LINEAR_FAMILIES)
def family(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, tiny_hf_model(request.param, folder), folder


@pytest.fixture(scope="module")
def llm(family):
    return LLM(str(family[2]), **ENGINE)


def test_config_reads_each_family(family):
    name, model, folder = family
    cfg = ModelConfig.from_dir(folder)
    assert cfg.mixers == ("gdn", "gdn", "gdn", "attention", "gdn")
    assert (cfg.num_kv_layers, cfg.num_linear_layers) == (1, 4)
    assert cfg.attn_output_gate and cfg.norm_offset and cfg.qk_norm
    assert not cfg.sandwich_norms and not cfg.scale_embed
    assert cfg.rotary_dim == 4  # partial_rotary_factor 0.25 of 16
    assert (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim,
            cfg.linear_value_dim, cfg.linear_conv_kernel) == (2, 4, 16, 16, 4)
    if name == "qwen3_next":
        assert cfg.moe_layers == (True, False, True, True, True) and not cfg.uniform_layers
        assert cfg.shared_expert_intermediate_size == 40 and cfg.norm_topk_prob
    elif name == "qwen3_5_moe":
        assert cfg.moe_layers == (True,) * 5 and cfg.norm_topk_prob
    else:
        assert not cfg.num_experts and cfg.tie_word_embeddings


@pytest.mark.jax_cache
def test_logits_match_transformers(family):
    """One step, then split at 64 (a chunk's end) and at 100."""
    name, model, folder = family
    check_logits(name, model, folder, cuts=(64, 100))


def test_greedy_tokens_match_transformers(family, llm):
    check_greedy(family[1], llm)


def test_batched_equals_alone(family, llm):
    check_batched_equals_alone(llm)


def test_refusals(family, tmp_path):
    name, model, folder = family
    with pytest.raises(ValueError, match="speculative"):
        LLM(str(folder), **ENGINE, speculative_config={"method": "ngram",
                                                       "num_speculative_tokens": 2,
                                                       "prompt_lookup_max": 2})
    hf = json.loads((folder / "config.json").read_text())
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf({**hf, "layer_types": ["linear_attention", "mamba"] * 2
                             + ["full_attention"]})
    with pytest.raises(ConfigError, match="no attention layer"):
        ModelConfig.from_hf({**hf, "layer_types": ["linear_attention"] * 5})
    with pytest.raises(ConfigError, match="linear_num_value_heads"):
        ModelConfig.from_hf({**hf, "linear_num_value_heads": 3})


@pytest.mark.jax_cache
def test_vision_language_checkpoint_serves_its_language_model(tmp_path):
    """Qwen3.5 as shipped (Qwen3_5ForConditionalGeneration): text_config and the tensors
    under model.language_model. are the text model's, the vision tower's are not read."""
    model = tiny_qwen3_5_vlm(tmp_path)
    cfg, params = load_model(tmp_path, progress=False)
    assert cfg.architecture == "Qwen3_5ForCausalLM" and cfg.tie_word_embeddings
    prompt = PROMPTS[3]
    table = 1 + np.arange(32).reshape(1, 32)
    logits, _ = run(params, KVCache.zeros(cfg, 33, PAGE, state_slots=2),
                    step([prompt], [0], table, [1]), cfg)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(np.asarray(logits) - want).max() / np.abs(want).max() < RTOL


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_converted_checkpoint_loads_the_same(family, tmp_path, quantize):
    """scripts/convert_hf.py's checkpoint holds the same weights; quantized, the
    projections are int8 and the conv, gates and norms stay float."""
    direct = check_conversion(family[2], tmp_path / "ckpt", quantize)
    is_q = lambda a: isinstance(a, QuantArray)
    mixer = direct["layers"][0]["linear_attn"]
    assert is_q(mixer["in_proj_qkv"]["kernel"]) == (quantize == "int8")
    assert not any(is_q(mixer[k]) for k in ("conv_weight", "dt_bias", "A_log", "norm_weight"))
