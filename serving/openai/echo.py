"""The prompt's side of a response: echoed prompt tokens in completions logprobs, and vLLM's
`prompt_logprobs` field. Pure Python: no aiohttp, no JAX.

Both read RequestOutput.prompt_logprobs (one entry per prompt token, the first None).
`texts` is serving.openai.sse.TokenTexts (token id -> text, bytes).
"""
from __future__ import annotations

import math

from serving.core.outputs import TokenLogprob
from serving.openai import responses


def prompt_entries(texts, prompt_ids: list[int],
                   prompt_logprobs: list[TokenLogprob | None]) -> list[responses.LogprobEntry]:
    """Completions logprobs for the echoed prompt: the first token (no prefix) has a null
    logprob and null top_logprobs, as OpenAI and vLLM return them."""
    out = []
    for token_id, lp in zip(prompt_ids, prompt_logprobs):
        if lp is None:
            text, raw = texts.get(token_id)
            out.append(responses.LogprobEntry(text, raw, None, None))
        else:
            out.append(texts.entry(lp))
    return out


def vllm_prompt_logprobs(texts, prompt_logprobs: list[TokenLogprob | None],
                         k: int) -> list[dict | None]:
    """vLLM's shape: per prompt token None or {token id: {logprob, rank, decoded_token}}
    holding the prompt token itself and the top k (ranks 1..k), keyed by id as a string."""
    out = []
    for lp in prompt_logprobs:
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": _finite(v), "rank": rank, "decoded_token": texts.get(t)[0]}
                 for rank, (t, v) in enumerate(lp.top[:k], start=1)}
        entry.setdefault(str(lp.token_id), {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                            "decoded_token": texts.get(lp.token_id)[0]})
        out.append(entry)
    return out


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -Infinity; vLLM shows this
