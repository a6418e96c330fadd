"""OpenAI response shapes: ids, usage, completion and chat responses, stream chunks and
logprobs. Pure Python: no aiohttp, no JAX."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _envelope(obj: str, request_id: str, model: str, created: int, choices: list,
              **extra) -> dict:
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": choices, **extra}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs=None,
                      stop_reason=None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def completion_response(request_id: str, model: str, created: int, choices: list[dict],
                        usage_: dict) -> dict:
    return _envelope("text_completion", request_id, model, created, choices, usage=usage_)


def completion_chunk(request_id: str, model: str, created: int, index: int, text: str,
                     finish_reason: str | None = None, logprobs=None, stop_reason=None,
                     include_usage: bool = False) -> dict:
    choice = completion_choice(index, text, finish_reason, logprobs, stop_reason)
    extra = {"usage": None} if include_usage else {}
    return _envelope("text_completion", request_id, model, created, [choice], **extra)


def chat_choice(index: int, content: str | None, finish_reason: str | None, logprobs=None,
                stop_reason=None, tool_calls: list[dict] | None = None) -> dict:
    message = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason, "stop_reason": stop_reason}


def chat_response(request_id: str, model: str, created: int, choices: list[dict],
                  usage_: dict) -> dict:
    return _envelope("chat.completion", request_id, model, created, choices, usage=usage_)


def chat_chunk(request_id: str, model: str, created: int, index: int, delta: dict,
               finish_reason: str | None = None, logprobs=None, stop_reason=None,
               include_usage: bool = False) -> dict:
    choice = {"index": index, "delta": delta, "logprobs": logprobs,
              "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    extra = {"usage": None} if include_usage else {}
    return _envelope("chat.completion.chunk", request_id, model, created, [choice], **extra)


def usage_chunk(obj: str, request_id: str, model: str, created: int, usage_: dict) -> dict:
    """The last chunk before [DONE] with stream_options.include_usage: no choices."""
    return _envelope(obj, request_id, model, created, [], usage=usage_)


@dataclass
class LogprobEntry:
    """One sampled token with its logprob and the top alternatives, as text and bytes. An
    echoed first prompt token has neither (None: null in the response)."""
    token: str
    bytes: list[int]
    logprob: float | None
    top: list[tuple[str, list[int], float]] | None = field(default_factory=list)


def completion_logprobs(entries: list[LogprobEntry], text_offset: int = 0) -> dict:
    """Completions shape; text_offset is where the first token starts in the choice text."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.top is None else {tok: lp for tok, _, lp in e.top}
                             for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[LogprobEntry]) -> dict:
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
         "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, b, lp in e.top]}
        for e in entries]}
