"""Checks every linear-attention hybrid family passes against transformers
(tests/test_linear_hybrids.py, tests/test_mamba_hybrids.py): logits over the paged cache
and the recurrent state, in one step and split over two; greedy tokens through the engine
with chunked prefill at an odd size, default buckets and preemption, every state slot given
back; batched equal to alone; a converted checkpoint holding the same weights."""
from dataclasses import replace

import jax
import numpy as np
import torch

from model.batch import sequences_batch
from model.checkpoint import load_model
from model.kv_cache import KVCache
from model.transformer import forward
from serving import SamplingParams
from tests.hf_tiny import greedy_reference

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

_forward = jax.jit(forward, static_argnames=("cfg", "backend"))


def step(prompts, starts, table, slots):
    """A numpy Batch continuing each prompt from its start, logits for every token, each
    row's state in slots[row]."""
    counts = np.cumsum([0] + [len(p) for p in prompts])
    return replace(sequences_batch(prompts, table, PAGE, starts),
                   state_slots=np.asarray(slots, np.int32),
                   query_start=counts.astype(np.int32))


def run(params, cache, batch, cfg):
    return _forward(params, cache, batch, cfg=cfg)


def check_logits(name, model, folder, cuts):
    """Every prompt in one step (rows in slots 3, 1, 2, 4: not their row order), then the
    same prompts split at each of `cuts` over two steps with the state carried."""
    cfg, params = load_model(folder, progress=False)
    prompts = PROMPTS[1:]
    want = []
    for p in prompts:
        with torch.no_grad():
            want.append(model(torch.tensor([p])).logits[0].numpy())
    table = 1 + np.arange(len(prompts) * 32).reshape(len(prompts), 32)
    slots = [3, 1, 2, 4]
    fresh = lambda: KVCache.zeros(cfg, 1 + table.size, PAGE, state_slots=5)
    logits, _ = run(params, fresh(), step(prompts, [0] * 4, table, slots), cfg)
    logits, off = np.asarray(logits), 0
    for p, w in zip(prompts, want):
        err = np.abs(logits[off:off + len(p)] - w).max() / np.abs(w).max()
        assert err < RTOL, (name, len(p), err)
        off += len(p)
    for cut in cuts:
        heads = [p[:cut] for p in prompts]
        tails = [p[cut:] or [p[-1]] for p in prompts]  # a short prompt repeats its last token
        _, cache = run(params, fresh(), step(heads, [0] * 4, table, slots), cfg)
        logits, _ = run(params, cache, step(tails, [len(h) for h in heads], table, slots), cfg)
        logits, off = np.asarray(logits), 0
        for p, t, w in zip(prompts, tails, want):
            if len(p) > cut:
                err = np.abs(logits[off:off + len(t)] - w[cut:]).max() / np.abs(w).max()
                assert err < RTOL, (name, cut, len(p), err)
            off += len(t)


def check_greedy(model, llm):
    """Batched, prefilled 37 tokens a step, default buckets, and preempted: the cache holds
    fewer tokens than the running requests need, so some recompute."""
    ours = [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]
    assert ours == [greedy_reference(model, p, MAX_TOKENS) for p in PROMPTS]
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions_total > 0
    slots = scheduler.kv_cache_manager.slots
    assert (slots.num_held, slots.num_free) == (0, ENGINE["max_num_seqs"])


def check_batched_equals_alone(llm):
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


def check_conversion(folder, out, quantize):
    """scripts/convert_hf.py's checkpoint holds the weights a direct load gives (both
    quantized alike) -> the direct load's parameters, for the family's own checks."""
    from model.checkpoint import convert_hf
    from quant.array import QuantArray
    convert_hf(folder, out, progress=False, quantize=quantize)
    cfg, direct = load_model(folder, progress=False, quantize=quantize)
    cfg2, stored = load_model(out, progress=False)
    assert cfg2 == cfg
    is_q = lambda a: isinstance(a, QuantArray)
    for a, b in zip(jax.tree.leaves(direct, is_leaf=is_q), jax.tree.leaves(stored, is_leaf=is_q)):
        np.testing.assert_array_equal(np.asarray(jax.tree.leaves(a)[0]),
                                      np.asarray(jax.tree.leaves(b)[0]))
    return direct
