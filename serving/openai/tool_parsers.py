"""Tool calling, output side: a model's text -> content and tool calls, streamed or not.

One parser object per choice. `feed(text)` takes each new piece of the output and returns
what can be sent now; `finish()` returns the rest once the output has ended. Both return
(content delta, tool-call deltas), each tool-call delta shaped like OpenAI's streamed
`delta.tool_calls[i]`: the first for a call carries index, id, type and the function's name,
later ones argument fragments. A non-streamed response is the same deltas folded
(`ToolCallParser.calls`), so streaming assembles to exactly the non-streamed answer.

Parsers (`--tool-call-parser`, vLLM's names):
- hermes: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number,
  with content around them;
- llama3_json: the whole output is one JSON call `{"name": ..., "parameters": {...}}` (or
  several joined by ';'), else it is content.
Forced calls (tool_choice "required" or a named function) are constrained by a JSON schema
(serving/openai/tools.py) and parsed by `NamedCall` / `RequiredCalls`.
"""
from __future__ import annotations

import json
import re
import uuid

from serving.openai.tools import ToolChoice

PARSERS = ("hermes", "llama3_json")


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _arguments(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


class ToolCallParser:
    """The common bookkeeping: complete calls so far, and their deltas."""

    def __init__(self):
        self.calls: list[dict] = []  # {"id", "type", "function": {"name", "arguments"}}
        self.content = ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[dict]]:
        raise NotImplementedError

    def _content(self, text: str) -> str:
        self.content += text
        return text

    def _call(self, name: str, arguments: str) -> list[dict]:
        """A complete call: its opening delta, then its arguments."""
        index, call_id = len(self.calls), new_call_id()
        self.calls.append({"id": call_id, "type": "function",
                           "function": {"name": name, "arguments": arguments}})
        return [{"index": index, "id": call_id, "type": "function",
                 "function": {"name": name, "arguments": ""}},
                {"index": index, "function": {"arguments": arguments}}]


def _call_json(text: str, arguments_key: str) -> tuple[str, str] | None:
    """(name, arguments) of one JSON call, or None if the text is not one."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str)):
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if not isinstance(args, (dict, str)):
        return None
    return obj["name"], _arguments(args)


class HermesParser(ToolCallParser):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self._buf = ""
        self._in_call = False

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        content, calls = "", []
        while True:
            if not self._in_call:
                at = self._buf.find(self.START)
                if at < 0:
                    keep = _partial_suffix(self._buf, self.START)
                    content += self._content(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return content, calls
                content += self._content(self._buf[:at])
                self._buf, self._in_call = self._buf[at + len(self.START):], True
            else:
                end = self._buf.find(self.END)
                if end < 0:
                    return content, calls
                body, self._buf = self._buf[:end], self._buf[end + len(self.END):]
                self._in_call = False
                parsed = _call_json(body.strip(), "arguments")
                if parsed is None:  # not a call after all: it stays text
                    content += self._content(self.START + body + self.END)
                else:
                    calls += self._call(*parsed)

    def finish(self) -> tuple[str, list[dict]]:
        rest, self._buf = self._buf, ""
        if not self._in_call:
            return self._content(rest), []
        self._in_call = False
        parsed = _call_json(rest.strip(), "arguments")  # the output ended inside a call
        if parsed is None:
            return self._content(self.START + rest), []
        return "", self._call(*parsed)


class Llama3JsonParser(ToolCallParser):
    """The output is either calls (it starts with '{') or content, decided by its first
    non-blank character; calls are parsed once the output has ended."""

    def __init__(self):
        super().__init__()
        self._buf = ""
        self._mode: str | None = None  # "calls" | "content", once known

    def feed(self, text: str) -> tuple[str, list[dict]]:
        if self._mode == "content":
            return self._content(text), []
        self._buf += text
        stripped = self._buf.lstrip().removeprefix("<|python_tag|>").lstrip()
        if not stripped or "<|python_tag|>".startswith(stripped):
            return "", []
        self._mode = "calls" if stripped.startswith("{") else "content"
        if self._mode == "content":
            rest, self._buf = self._buf, ""
            return self._content(rest), []
        return "", []

    def finish(self) -> tuple[str, list[dict]]:
        rest, self._buf = self._buf, ""
        if self._mode == "content" or not rest.strip():
            return self._content(rest), []
        text = rest.strip().removeprefix("<|python_tag|>")
        parsed = [_call_json(part.strip(), "parameters") for part in _split_calls(text)]
        if not parsed or any(p is None for p in parsed):
            return self._content(rest), []
        return "", [d for name, args in parsed for d in self._call(name, args)]


class NamedCall(ToolCallParser):
    """tool_choice names a function: the whole output is its arguments (a JSON object, by
    the schema), streamed as they come."""

    def __init__(self, name: str):
        super().__init__()
        self._name = name

    def feed(self, text: str) -> tuple[str, list[dict]]:
        deltas = []
        if not self.calls:
            deltas = self._call(self._name, "")[:1]
        self.calls[0]["function"]["arguments"] += text
        if text:
            deltas.append({"index": 0, "function": {"arguments": text}})
        return "", deltas

    def finish(self) -> tuple[str, list[dict]]:
        return self.feed("")


class RequiredCalls(ToolCallParser):
    """tool_choice "required": the output is a JSON array of {name, parameters}."""

    def __init__(self):
        super().__init__()
        self._buf = ""

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        return "", []

    def finish(self) -> tuple[str, list[dict]]:
        try:
            items = json.loads(self._buf)
        except json.JSONDecodeError:  # cut short (max_tokens): not a call
            return self._content(self._buf), []
        deltas = []
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                deltas += self._call(item["name"], _arguments(item.get("parameters", {})))
        if not deltas:
            return self._content(self._buf), []
        return "", deltas


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that could begin tag (held back until known)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


_SEPARATOR = re.compile(r"\s*;\s*")


def _split_calls(text: str) -> list[str]:
    """'{...}; {...}' -> ['{...}', '{...}'], splitting only between complete JSON values."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            _, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return [text]
        parts.append(text[at:end])
        sep = _SEPARATOR.match(text, end)
        at = sep.end() if sep else end
        if not sep and at < len(text):
            return [text]
    return parts


def parser_for(choice: ToolChoice, auto_parser: str | None) -> ToolCallParser | None:
    """The parser a choice's output needs, or None when its output is plain content."""
    if choice.mode == "named":
        return NamedCall(choice.name)
    if choice.mode == "required":
        return RequiredCalls()
    if choice.mode == "auto":
        return {"hermes": HermesParser, "llama3_json": Llama3JsonParser}[auto_parser]()
    return None
