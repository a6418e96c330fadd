"""What the engine hands back per request: plain dataclasses, no JAX.

The engine sends deltas: each RequestOutput holds what one step added, so a long generation
costs O(n) in all, not O(n^2) copies of its token list. Callers that need the whole result
(the offline API, a non-streaming HTTP response) fold the deltas into a CompletionOutput.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first
    rank: int | None = None  # 1 + how many tokens were more likely (prompt logprobs only)


@dataclass(slots=True)
class RequestOutput:
    """One update for a request: the tokens, text and logprobs this step added. Text never
    contains a stop string (or any prefix of one that might still complete)."""
    request_id: str
    prompt_token_ids: list[int]  # the request's own list, not a copy
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    new_logprobs: list[TokenLogprob] | None = None  # None unless the request asked for them
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    queue_time: float | None = None  # seconds from arrival to first scheduled, on the first update
    # SamplingParams.prompt_logprobs: one entry per prompt token, the first None; on the first
    # update only (the prefill computed them all by then).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    index: int = 0  # which of the request's n samples this update belongs to
    # An embedding request's vector (PoolingParams), on its one, finished update
    embedding: list[float] | None = None
    # A prefill for another instance: where its K/V waits (serving/kv_transfer/), finished
    kv_transfer_params: dict | None = None


@dataclass
class CompletionOutput:
    """One request's result so far: its RequestOutputs folded together."""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    kv_transfer_params: dict | None = None

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text += out.new_text
        if out.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += out.new_logprobs
        self.finished, self.finish_reason = out.finished, out.finish_reason
        self.stop_reason, self.error = out.stop_reason, out.error
        if out.kv_transfer_params is not None:
            self.kv_transfer_params = out.kv_transfer_params
