"""What every handler of one server shares: the engine, limits, metrics, and the counters
that graceful shutdown waits on."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from serving.openai import protocol as p
from serving.openai import responses
from serving.openai.metrics import Metrics
from serving.openai.response_store import ResponseStore
from serving.openai.token_texts import TokenTexts


@dataclass
class ServerState:
    engine: object
    model: str
    metrics: Metrics
    api_key: str | None = None
    max_queued_requests: int | None = None
    max_body_bytes: int = 1 << 22
    max_prompt_chars: int | None = None  # None: what max_model_len tokens can span
    chat_template: str | None = None  # None: the tokenizer's own
    tool_call_parser: str | None = None  # set: tool_choice "auto" parses tool calls with it
    reasoning_parser: str | None = None  # set: chat answers return the thinking apart
    responses_store: ResponseStore | None = None  # the Responses API's; None: not stored
    draining: bool = False
    in_flight: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    created: int = field(default_factory=responses.now)
    _texts: TokenTexts | None = None

    def token_texts(self) -> TokenTexts:
        if self._texts is None:
            self._texts = TokenTexts(self.engine.tokenizer)
        return self._texts

    def prompt_chars_limit(self) -> int:
        if self.max_prompt_chars is None:
            self.max_prompt_chars = self.engine.max_model_len * longest_token(
                self.engine.tokenizer)
        return self.max_prompt_chars


STATE = web.AppKey("xlaserve_state", ServerState)


def longest_token(tokenizer) -> int:
    """The most characters of text one token can stand for: the longest vocabulary entry
    (byte-level and SentencePiece pieces spell each byte or space as one character)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def check_prompt_size(state: ServerState, num_chars: int, param: str) -> None:
    """A prompt longer than max_model_len of the longest tokens can never fit: refuse it
    before tokenizing, which would hold the event loop for seconds on a few MiB of text."""
    limit = state.prompt_chars_limit()
    if num_chars > limit:
        raise p.ProtocolError(f"the prompt has {num_chars} characters; at most {limit} can "
                              f"fit the context", status=413, param=param,
                              code="prompt_too_large")


def check_admission(state: ServerState) -> None:
    """Before reading the body: is there an engine to run the request?"""
    engine = state.engine
    if getattr(engine, "dead", None) is not None:
        raise p.ProtocolError("the engine failed; the server is shutting down", status=503,
                              code="engine_dead")
    if not engine.ready:
        raise p.ProtocolError("the model is still warming up", status=503, code="not_ready")


def check_queue(state: ServerState) -> None:
    """Right before the request is submitted, with no await in between, so that a burst of
    requests sees each earlier one in the engine's queue."""
    check_admission(state)
    limit = state.max_queued_requests
    if limit is not None and state.engine.stats().num_waiting >= limit:
        raise p.ProtocolError("too many requests are waiting; retry later", status=503,
                              code="queue_full")
