"""A Responses API response built from the engine's text deltas: its output items and the
typed stream events that build them. Pure Python: no aiohttp, no JAX.

One `ResponseBuilder` per response, fed every engine update in order, streamed or not: a
streamed response writes the events `feed` and `finish` return, a non-streamed one drops
them and sends `response()`. Both run the same parsers over the same deltas, so the events
assemble to exactly the non-streamed response (ids aside).

Each delta goes through the reasoning parser (when the server has one: reasoning vs answer
text), then the tool-call parser (answer text vs function calls). Output items follow in the
order the model wrote them; an item is closed (its `.done` events) when the next one starts
or the output ends. Whitespace between items opens no message of its own.
"""
from __future__ import annotations

import uuid

EVENT_TYPES = (
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added", "response.output_text.delta", "response.output_text.done",
    "response.content_part.done", "response.output_item.done",
    "response.function_call_arguments.delta", "response.function_call_arguments.done",
    "response.reasoning_text.delta", "response.reasoning_text.done",
    "response.completed", "response.incomplete", "response.failed")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0,
          cached_tokens: int = 0) -> dict:
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseBuilder:
    """head: the response object's fields that echo the request (id, model, tools, ...).
    reasoning: a reasoning parser (feed/finish -> (reasoning, content)) or None; tools: a
    tool-call parser (serving/openai/tool_parsers.py) or None."""

    def __init__(self, head: dict, num_prompt_tokens: int, reasoning=None, tools=None):
        self.head, self.reasoning, self.tools = head, reasoning, tools
        self.output: list[dict] = []
        self.status = "in_progress"
        self.incomplete_details: dict | None = None
        self.error: dict | None = None
        self.completed_at: int | None = None
        self._seq = 0
        self._open: dict | None = None  # the item being written, the last of self.output
        self._space = ""  # whitespace waiting for the next message to open
        self._tokens = [num_prompt_tokens, 0, 0]  # input, output, reasoning

    # -- the response object ---------------------------------------------------------------

    def response(self) -> dict:
        done = self.status != "in_progress"
        return {**self.head, "status": self.status, "output": self.output if done else [],
                "error": self.error, "incomplete_details": self.incomplete_details,
                "completed_at": self.completed_at,
                "usage": usage(*self._tokens) if done else None}

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def opening(self) -> list[dict]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    # -- deltas ----------------------------------------------------------------------------

    def feed(self, text: str, num_tokens: int) -> list[dict]:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        # Reasoning tokens: those of the updates after the thinking began and before any
        # answer text (the parsers split text, not tokens).
        if self.reasoning and self.reasoning.reasoning and not self.reasoning.content:
            self._tokens[2] += num_tokens
        self._tokens[1] += num_tokens
        return self._reasoning_text(reasoning) + self._answer(content)

    def finish(self, finish_reason: str | None, now: int) -> list[dict]:
        """The output has ended: the parsers' rest, every open item closed, and the final
        event (response.completed, or response.incomplete when max_output_tokens cut it)."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        events = self._reasoning_text(reasoning) + self._answer(content, final=True)
        if self._space and not self.output:  # a whitespace-only answer is still an answer
            events += self._open_message()
        cut = finish_reason == "length"
        events += self._close("incomplete" if cut else "completed")
        self.status = "incomplete" if cut else "completed"
        if cut:
            self.incomplete_details = {"reason": "max_output_tokens"}
        else:
            self.completed_at = now
        return events + [self._event(f"response.{self.status}", response=self.response())]

    def _answer(self, text: str, final: bool = False) -> list[dict]:
        """Answer text -> message text and function calls, in the order the model wrote
        them. A tool parser returns a piece's content before its calls, so it is fed one
        character at a time: content after a call then comes after it, and the items do
        not depend on how the engine's deltas split the text."""
        if self.tools is None:
            return self._content(text)
        ops: list[list] = []  # [kind, value]: consecutive text and arguments joined
        results = [self.tools.feed(ch) for ch in text]
        if final:
            results.append(self.tools.finish())
        for content, calls in results:
            pieces = [("content", content)] + [
                piece for d in calls for piece in
                ((("call", d["function"]["name"]),) if "id" in d else ())
                + (("arguments", (d.get("function") or {}).get("arguments") or ""),)]
            for kind, value in pieces:
                if ops and ops[-1][0] == kind != "call":
                    ops[-1][1] += value
                elif value:
                    ops.append([kind, value])
        events = []
        for kind, value in ops:
            events += self._content(value) if kind == "content" else \
                self._call(value) if kind == "call" else self._arguments(value)
        return events

    def fail(self, message: str) -> list[dict]:
        """The generation failed after the stream began: response.failed."""
        self._open = None
        self.status = "failed"
        self.error = {"code": "server_error", "message": message}
        return [self._event("response.failed", response=self.response())]

    # -- items -----------------------------------------------------------------------------

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}

    def _add(self, item: dict, in_progress: dict) -> list[dict]:
        events = self._close("completed")
        self.output.append(item)
        self._open = item
        return events + [self._event("response.output_item.added",
                                     output_index=len(self.output) - 1, item=in_progress)]

    def _close(self, status: str) -> list[dict]:
        item = self._open
        if item is None:
            return []
        where = self._where()
        item["status"] = status
        if item["type"] == "function_call":
            events = [self._event("response.function_call_arguments.done", **where,
                                  name=item["name"], arguments=item["arguments"])]
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            events = [self._event(f"response.{kind}.done", **where, content_index=0,
                                  text=part["text"],
                                  **({"logprobs": []} if kind == "output_text" else {})),
                      self._event("response.content_part.done", **where, content_index=0,
                                  part=dict(part))]
        self._open = None
        return events + [self._event("response.output_item.done",
                                     output_index=where["output_index"], item=_copy(item))]

    def _reasoning_text(self, text: str) -> list[dict]:
        if not text:
            return []
        events = []
        if self._open is None or self._open["type"] != "reasoning":
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}], "status": "in_progress"}
            events = self._add(item, {**_copy(item), "content": []})
            events.append(self._event("response.content_part.added", **self._where(),
                                      content_index=0,
                                      part={"type": "reasoning_text", "text": ""}))
        self._open["content"][0]["text"] += text
        return events + [self._event("response.reasoning_text.delta", **self._where(),
                                     content_index=0, delta=text)]

    def _open_message(self) -> list[dict]:
        item = {"type": "message", "id": new_id("msg"), "status": "in_progress",
                "role": "assistant", "content": [_text_part("")]}
        events = self._add(item, {**_copy(item), "content": []})
        events.append(self._event("response.content_part.added", **self._where(),
                                  content_index=0, part=_text_part("")))
        text, self._space = self._space, ""
        return events + self._text_delta(text)

    def _text_delta(self, text: str) -> list[dict]:
        if not text:
            return []
        self._open["content"][0]["text"] += text
        return [self._event("response.output_text.delta", **self._where(), content_index=0,
                            delta=text, logprobs=[])]

    def _content(self, text: str) -> list[dict]:
        if not text:
            return []
        if self._open is not None and self._open["type"] == "message":
            return self._text_delta(text)
        if not text.strip():
            self._space += text
            return []
        self._space += text
        return self._open_message()

    def _call(self, name: str) -> list[dict]:
        self._space = ""
        item = {"type": "function_call", "id": new_id("fc"), "call_id": new_id("call"),
                "name": name, "arguments": "", "status": "in_progress"}
        return self._add(item, _copy(item))

    def _arguments(self, text: str) -> list[dict]:
        if self._open is None or self._open["type"] != "function_call":
            return []  # a parser sends arguments after a call's opening only
        self._open["arguments"] += text
        return [self._event("response.function_call_arguments.delta", **self._where(),
                            delta=text)]


def _copy(item: dict) -> dict:
    """A snapshot of an item (its content parts copied), for an event."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(part) for part in out["content"]]
    return out
