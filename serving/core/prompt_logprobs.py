"""Prompt logprobs on the host: which prefill positions score a prompt token, and one
request's entries gathered across the chunks of its prefill. No JAX (the device side is
serving.engine.prompt_logprobs)."""
from __future__ import annotations

from serving.core.outputs import TokenLogprob
from serving.core.scheduler import ScheduledRequest


def wants_prompt_logprobs(s: ScheduledRequest) -> bool:
    """Whether this chunk has prompt positions to score (the last prompt token predicts the
    first output token, whose logprob is an output logprob)."""
    return (s.request.sampling_params.prompt_logprobs is not None
            and s.start < s.request.num_prompt_tokens - 1)


class PromptLogprobsCollector:
    """One request's prompt logprobs, filled chunk by chunk. Entry 0 is None: the first
    prompt token has no prefix (OpenAI and vLLM report null). A recomputed chunk (after a
    preemption) writes the same values again."""

    def __init__(self, prompt_token_ids: list[int], num_top: int):
        self.prompt = prompt_token_ids
        self.num_top = num_top
        self.entries: list[TokenLogprob | None] = [None] * len(prompt_token_ids)

    def add(self, s: ScheduledRequest, row_start: int, out) -> None:
        """out: the step's fetched prompt arrays (numpy; fields as
        serving.engine.prompt_logprobs.PromptOutput); row_start: where this request's tokens
        begin in the step."""
        m = min(s.num_new_tokens, len(self.prompt) - 1 - s.start)
        k = self.num_top
        rows = slice(row_start, row_start + m)
        lps, ranks = out.logprob[rows].tolist(), out.rank[rows].tolist()
        ids, vals = out.top_ids[rows, :k].tolist(), out.top_logprobs[rows, :k].tolist()
        for j in range(m):
            pos = s.start + 1 + j
            self.entries[pos] = TokenLogprob(self.prompt[pos], lps[j], list(zip(ids[j], vals[j])),
                                             rank=ranks[j])
