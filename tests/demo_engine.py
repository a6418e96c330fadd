"""The options of the demo-model LLM the modules that ask for the `demo_llm` fixture share
(tests/conftest.py; built once, closed after its last user: tests/lifetimes.py).

Its buckets are few on purpose: a decode bucket and a 32-token bucket, so a 16-request batch
with prompts longer than the budget runs chunked prefill and mixed prefill/decode steps."""
from __future__ import annotations

from serving import SamplingParams

DEMO_OPTIONS = dict(max_num_seqs=16, max_model_len=128, max_num_batched_tokens=32,
                    token_buckets=(8, 32), request_buckets=(8, 16), page_buckets=(8,),
                    progress=False)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)
