"""What the engine hands back per request: plain dataclasses, no JAX."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """One update for a request. `token_ids`/`text`/`logprobs` are cumulative; the `new_*`
    fields hold what this update added. Text never contains a stop string (or any prefix of
    one that might still complete)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    queue_time: float | None = None  # seconds from arrival to first scheduled, on the first update
    index: int = 0  # which of the request's n samples this update belongs to
