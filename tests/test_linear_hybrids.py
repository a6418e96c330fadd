"""Linear-attention hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against transformers: the
config fields each family reads, logits over the paged cache and the recurrent state (one
step, and a prefill split over steps), greedy tokens through the engine with chunked prefill
at an odd chunk size, default buckets and preemption, batched equal to alone, and the state
slots all given back."""
from dataclasses import replace

import jax
import numpy as np
import pytest
import torch

from model.batch import sequences_batch
from model.checkpoint import load_model
from model.config import ConfigError, ModelConfig
from model.kv_cache import KVCache
from model.transformer import forward
from serving import LLM, SamplingParams
from tests.hf_tiny import LINEAR_FAMILIES, greedy_reference, tiny_hf_model, tiny_qwen3_5_vlm

PAGE = 8
RTOL = 1e-4  # of max |transformers logit|, float32
# 1 to 200 tokens: the longest cross three of Gated DeltaNet's 64-token chunks.
PROMPTS = [[5], list(range(10, 17)), [(7 * i) % 200 + 3 for i in range(70)],
           [(13 * i) % 205 + 3 for i in range(150)], [(11 * i) % 207 + 3 for i in range(200)]]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Prefill in chunks of 37 tokens; a KV cache of 34 pages (272 tokens) for 4 running requests
# of up to 210 tokens: the long ones preempt each other and recompute.
ENGINE = dict(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=37, page_size=PAGE,
              kv_cache_memory=35 * 2 * PAGE * 32 * 4, progress=False)


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


def _step(prompts, starts, table, slots):
    """A numpy Batch continuing each prompt from its start, logits for every token, each
    row's state in slots[row]."""
    counts = np.cumsum([0] + [len(p) for p in prompts])
    return replace(sequences_batch(prompts, table, PAGE, starts),
                   state_slots=np.asarray(slots, np.int32),
                   query_start=counts.astype(np.int32))


_forward = jax.jit(forward, static_argnames=("cfg", "backend"))


@pytest.mark.jax_cache
def test_logits_match_transformers(family):
    """Every prompt in one step (rows in slots 3, 1, 2, 4: not their row order), then the
    same prompts split at 64 and at 100 tokens over two steps with the state carried."""
    name, model, folder = family
    cfg, params = load_model(folder, progress=False)
    prompts = PROMPTS[1:]
    want = []
    for p in prompts:
        with torch.no_grad():
            want.append(model(torch.tensor([p])).logits[0].numpy())
    table = 1 + np.arange(len(prompts) * 32).reshape(len(prompts), 32)
    slots = [3, 1, 2, 4]
    fresh = lambda: KVCache.zeros(cfg, 1 + table.size, PAGE, state_slots=5)
    logits, _ = _forward(params, fresh(), _step(prompts, [0] * 4, table, slots), cfg=cfg)
    logits, off = np.asarray(logits), 0
    for p, w in zip(prompts, want):
        err = np.abs(logits[off:off + len(p)] - w).max() / np.abs(w).max()
        assert err < RTOL, (name, len(p), err)
        off += len(p)
    for cut in (64, 100):
        heads = [p[:cut] for p in prompts]
        tails = [p[cut:] or [p[-1]] for p in prompts]  # a short prompt repeats its last token
        _, cache = _forward(params, fresh(), _step(heads, [0] * 4, table, slots), cfg=cfg)
        logits, _ = _forward(params, cache, _step(tails, [len(h) for h in heads], table, slots),
                             cfg=cfg)
        logits, off = np.asarray(logits), 0
        for p, h, t, w in zip(prompts, heads, tails, want):
            if len(p) > cut:
                err = np.abs(logits[off:off + len(t)] - w[cut:]).max() / np.abs(w).max()
                assert err < RTOL, (name, cut, len(p), err)
            off += len(t)


def test_greedy_tokens_match_transformers(family, llm):
    """Batched, prefilled 37 tokens a step, default buckets, and preempted: the cache holds
    fewer tokens than the running requests need, so some recompute."""
    name, model, folder = family
    ours = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert ours == [greedy_reference(model, p, MAX_TOKENS) for p in PROMPTS]
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions_total > 0
    slots = scheduler.kv_cache_manager.slots
    assert (slots.num_held, slots.num_free) == (0, ENGINE["max_num_seqs"])


def test_batched_equals_alone(family, llm):
    """Greedy and seeded, with logprobs: each prompt alone gives the batch's tokens and
    logprobs exactly."""
    for params in (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
                   SamplingParams(temperature=0.9, seed=7, max_tokens=6, ignore_eos=True,
                                  logprobs=2)):
        together = llm.generate(PROMPTS[1:4], params)
        for prompt, batched in zip(PROMPTS[1:4], together):
            alone = llm.generate([prompt], params)[0]
            assert alone.token_ids == batched.token_ids
            assert alone.logprobs == batched.logprobs


def test_refusals(family, tmp_path):
    name, model, folder = family
    with pytest.raises(ValueError, match="speculative"):
        LLM(str(folder), **ENGINE, speculative_config={"method": "ngram",
                                                       "num_speculative_tokens": 2,
                                                       "prompt_lookup_max": 2})
    import json
    hf = json.loads((folder / "config.json").read_text())
    with pytest.raises(ConfigError, match="layer_types"):
        ModelConfig.from_hf({**hf, "layer_types": ["linear_attention", "mamba"] * 2
                             + ["full_attention"]})
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
    logits, _ = _forward(params, KVCache.zeros(cfg, 33, PAGE, state_slots=2),
                         _step([prompt], [0], table, [1]), cfg=cfg)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([prompt])).logits[0].numpy()
    assert np.abs(np.asarray(logits) - want).max() / np.abs(want).max() < RTOL


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_converted_checkpoint_loads_the_same(family, tmp_path, quantize):
    """scripts/convert_hf.py's checkpoint holds the same weights; quantized, the
    projections are int8 and the conv, gates and norms stay float."""
    from model.checkpoint import convert_hf
    from quant.array import QuantArray
    name, model, folder = family
    convert_hf(folder, tmp_path / "ckpt", progress=False, quantize=quantize)
    cfg, direct = load_model(folder, progress=False, quantize=quantize)
    cfg2, stored = load_model(tmp_path / "ckpt", progress=False)
    assert cfg2 == cfg
    is_q = lambda a: isinstance(a, QuantArray)
    for a, b in zip(jax.tree.leaves(direct, is_leaf=is_q), jax.tree.leaves(stored, is_leaf=is_q)):
        np.testing.assert_array_equal(np.asarray(jax.tree.leaves(a)[0]),
                                      np.asarray(jax.tree.leaves(b)[0]))
    mixer = direct["layers"][0]["linear_attn"]
    assert is_q(mixer["in_proj_qkv"]["kernel"]) == (quantize == "int8")
    assert not any(is_q(mixer[k]) for k in ("conv_weight", "dt_bias", "A_log", "norm_weight"))
