"""Stored Responses API responses: what `previous_response_id` continues and
`GET /v1/responses/{id}` returns. In memory, bounded in count and in age; nothing survives a
restart. Pure Python: no aiohttp, no JAX.

`store` defaults to true (OpenAI's default), so every response would be kept: the bounds
keep a long-running server's memory flat. The oldest response goes first once
MAX_STORED_RESPONSES are held, and a response older than MAX_AGE_S is forgotten, as if it
had never been stored (404).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_STORED_RESPONSES = 1000
MAX_AGE_S = 3600.0


@dataclass
class StoredResponse:
    response: dict  # the response object, exactly as it was returned
    history: list[dict]  # the conversation before its output: chat-format messages, no instructions
    stored_at: float


class ResponseStore:
    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_age_s: float = MAX_AGE_S,
                 clock=time.monotonic):
        self.max_responses, self.max_age_s, self._clock = max_responses, max_age_s, clock
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def put(self, response: dict, history: list[dict]) -> None:
        self._expire()
        self._items[response["id"]] = StoredResponse(response, history, self._clock())
        while len(self._items) > self.max_responses:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._items.pop(response_id, None) is not None

    def _expire(self) -> None:
        oldest_kept = self._clock() - self.max_age_s
        while self._items:
            first = next(iter(self._items.values()))
            if first.stored_at >= oldest_kept:
                return
            self._items.popitem(last=False)
