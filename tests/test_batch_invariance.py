"""Batch invariance on the CPU with the default buckets (docs/architecture.md, "Batch
invariance"): for every weight format we serve, a request gives bit-identical tokens and
logprobs whether it runs alone (1-token decode programs) or in a batch of mixed prompt
lengths (chunked prefill, mixed steps, 16- to 512-token programs). A negative control sends
the float matmuls back to XLA's dot and shows the same comparison then fails."""
from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from quant import packed
from serving import LLM, SamplingParams
from tests.hf_tiny import tiny_hf_model

# Some prompts are longer than the 512-token step budget, so prefill is chunked and steps mix
# prefill with decode; a long context also spreads the KV over many pages.
LENGTHS = [3, 700, 17, 40, 5, 560, 90, 1, 33, 260]
MAX_TOKENS = 8
# Sizes the kernels take in whole 16-wide panels, so int8 weights run the q8 kernel; the
# default tiny sizes (hidden 72, vocab 211) leave narrow panels and odd int8 shapes, which
# go to the dense kernel as codes.
PANEL_SIZES = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                   vocab_size=224)
MODELS = {  # name -> (family, overrides)
    "llama": ("llama", {}),
    "llama-panels": ("llama", PANEL_SIZES),
    # int4 takes inputs in groups of 32: o_proj's (heads x head_dim) too
    "llama-int4": ("llama", {**PANEL_SIZES, "head_dim": 16}),
    # a window over several 32-key chunks of the CPU kernel, and shorter than most prompts
    "mistral": ("mistral", {"sliding_window": 50}),
    # dense and MoE layers mixed, a shared expert; sizes in whole panels and int4 groups
    "moe": ("qwen2_moe", {"moe_intermediate_size": 64, "shared_expert_intermediate_size": 64}),
    # window and full layers alternating, scores and logits soft-capped
    "gemma2": ("gemma2", {"sliding_window": 50}),
}
CASES = {  # name -> (model, checkpoint dtype, quantize recipe)
    "float32": ("llama", "float32", None),
    "bfloat16": ("llama", "bfloat16", None),
    "float16": ("llama", "float16", None),
    "int8": ("llama", "float32", "int8"),
    "int8-q8-kernel": ("llama-panels", "float32", "int8"),
    "fp8": ("llama", "float32", "fp8"),
    "fp8-channel": ("llama-panels", "float32", "fp8:channel"),
    "int4": ("llama-int4", "float32", "int4:lm_head"),  # the demo's CPU default recipe
    "sliding-window": ("mistral", "bfloat16", None),
    "gemma2-bfloat16": ("gemma2", "bfloat16", None),
    "moe-float32": ("moe", "float32", None),
    "moe-bfloat16": ("moe", "bfloat16", None),
    "moe-int8": ("moe", "float32", "int8"),
    "moe-int4": ("moe", "float32", "int4:lm_head"),
    "moe-fp8": ("moe", "float32", "fp8"),
    # 128 x 128 blocks (all partial here) on attention, the dense layer and the experts
    "moe-fp8-block": ("moe", "float32", "fp8:block"),
}
# MoE case -> the grouped kernel its experts run on (quant/packed_experts.py)
EXPERT_KINDS = {"moe-float32": "dense", "moe-bfloat16": "dense", "moe-int8": "q8",
                "moe-int4": "q4", "moe-fp8": "dense", "moe-fp8-block": "fp8_blocks"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(model, dtype) -> a checkpoint of that tiny random model with a 2048-token context
    (the CPU default max_model_len), built on first use."""
    from model.checkpoint import convert_hf
    made = {}

    def get(model, dtype):
        if model not in made:
            family, overrides = MODELS[model]
            made[model] = tmp_path_factory.mktemp(f"invariance-{model}")
            tiny_hf_model(family, made[model], seed=3, max_position_embeddings=2048,
                          **overrides)
        out = made[model].with_name(f"{made[model].name}-{dtype}")
        if not out.exists():
            convert_hf(made[model], out, dtype, progress=False)
        return out
    return get


def requests():
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 211) for _ in range(n)] for n in LENGTHS]
    params = []
    for i in range(len(prompts)):
        logprobs = 3 if i % 3 == 0 else None
        if i % 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                         logprobs=logprobs))
        else:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i,
                                         max_tokens=MAX_TOKENS, ignore_eos=True,
                                         logprobs=logprobs))
    return prompts, params


def bits(x: float) -> bytes:
    return np.float64(x).tobytes()


def outputs(results):
    """Tokens and every logprob as exact bits."""
    out = []
    for r in results:
        logprobs = None
        if r.logprobs is not None:
            logprobs = [(lp.token_id, bits(lp.logprob), [(t, bits(v)) for t, v in lp.top])
                        for lp in r.logprobs]
        out.append((list(r.token_ids), logprobs))
    return out


def kernel_forms(llm) -> set[str]:
    """The type of every matmul weight ("kernel" leaf) the engine runs with; experts' as
    "PackedExperts:<kind>"."""
    from quant.array import QuantArray
    from quant.packed_experts import PackedExperts
    forms = set()

    def visit(path, leaf):
        if any(getattr(k, "key", None) == "kernel" for k in path):
            name = type(leaf).__name__
            forms.add(f"{name}:{leaf.kind}" if isinstance(leaf, PackedExperts) else name)
    jax.tree_util.tree_map_with_path(visit, llm.engine.runner.params, is_leaf=lambda a: (
        isinstance(a, (QuantArray, packed.PackedQ8, packed.PackedDense, packed.PackedQ4,
                       packed.PackedFp8Blocks, PackedExperts))))
    return forms


def batched_and_alone(checkpoint, quantize, **options):
    """The engine as a user starts it (programs from the on-disk executable cache when it has
    them, as a restart loads them)."""
    llm = LLM(str(checkpoint), quantize=quantize, progress=False, **options)
    prompts, params = requests()
    batched = outputs(llm.generate(prompts, params))
    alone = [outputs(llm.generate([p], q))[0] for p, q in zip(prompts, params)]
    return batched, alone, kernel_forms(llm)


def differing(batched, alone):
    return [i for i, (b, a) in enumerate(zip(batched, alone)) if b != a]


@pytest.mark.parametrize("case", CASES)
def test_batched_equals_alone_with_default_buckets(checkpoint, case):
    model, dtype, quantize = CASES[case]
    batched, alone, forms = batched_and_alone(checkpoint(model, dtype), quantize)
    experts = {f for f in forms if f.startswith("PackedExperts")}
    assert experts == ({f"PackedExperts:{EXPERT_KINDS[case]}"} if case in EXPERT_KINDS
                       else set())
    # Every matmul runs one of the invariant kernels; int8 the q8 one where shapes allow
    # (int4's head is int8; the MoE model's 211-token head is not in whole panels), int4
    # layers the q4 one.
    forms -= experts
    assert forms <= {"PackedQ8", "PackedDense", "PackedQ4", "PackedFp8Blocks"}
    assert ("PackedFp8Blocks" in forms) == (case == "moe-fp8-block")
    assert ("PackedQ8" in forms) == (case in ("int8-q8-kernel", "int4", "moe-int8"))
    assert ("PackedQ4" in forms) == (case in ("int4", "moe-int4"))
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in batched)
    assert differing(batched, alone) == []


def test_negative_control_xla_dot_breaks_invariance(checkpoint, monkeypatch):
    """With the float matmuls on XLA's dot, whose sums depend on the number of rows, some
    request's tokens or logprobs change when batched: the comparison above can fail."""
    monkeypatch.setattr(packed, "dense_kernel_available", lambda: False)
    # unpacked weights are another argument tree, so their programs have keys of their own
    batched, alone, forms = batched_and_alone(checkpoint("llama", "bfloat16"), None)
    assert forms == {"ArrayImpl"}
    assert differing(batched, alone) != []
