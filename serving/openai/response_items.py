"""Responses API items -> chat messages for the chat template. Pure Python: no aiohttp, no JAX.

An `input` is a string (one user message) or a list of items:
- `message`: role user / system / developer / assistant, content a string or a list of
  `input_text` / `output_text` parts (joined by newlines, as chat content parts are);
- `function_call` {call_id, name, arguments}: the assistant's tool call. Calls that follow an
  assistant message (or each other) join that message's tool_calls, so the template writes
  one assistant turn, as the model wrote it;
- `function_call_output` {call_id, output}: a tool message answering that call;
- `reasoning`: accepted (clients send a response's output back as input) and dropped, as chat
  templates drop earlier turns' reasoning.
A stored response's output items go through the same conversion (`output_as_input`).
"""
from __future__ import annotations

from serving.openai.image_parts import image_url, refuse_images
from serving.openai.fields import ProtocolError

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")


def _error(message: str) -> ProtocolError:
    return ProtocolError(message, param="input")


def _text(value, where: str, parts: tuple[str, ...] = TEXT_PARTS) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _error(f"{where} must be a string or a list of {' / '.join(parts)} parts")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and "input_text" in parts:
            image_url(part, f"{where}[{j}]", "input")
            raise refuse_images(f"{where}[{j}]", "input")
        if kind not in parts or not isinstance(part.get("text"), str):
            shown = kind if isinstance(kind, str) else type(part).__name__
            raise ProtocolError(f"{where}[{j}]: only {' / '.join(parts)} parts with a string "
                                f"'text' are supported, got {shown[:40]!r}", param="input",
                                code="unsupported_parameter" if isinstance(kind, str)
                                and kind not in parts else None)
        texts.append(part["text"])
    return "\n".join(texts)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise _error(f"{where}.{key} must be a non-empty string")
    return value


def _item_type(item, where: str) -> str:
    if not isinstance(item, dict):
        raise _error(f"{where} must be an object")
    kind = item.get("type", "message" if "role" in item else None)
    if not isinstance(kind, str):
        raise _error(f"{where} needs a 'type' (message, function_call, function_call_output, "
                     "reasoning)")
    return kind


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise _error(f"{where}.role must be one of {', '.join(ROLES)}")
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def to_messages(items: list, known_calls: set[str], where: str = "input") -> list[dict]:
    """Items -> chat-format messages (the shape chat_messages.parse_messages reads).
    known_calls: the call ids of earlier turns; this turn's calls are added to it, and a
    function_call_output must answer one of them."""
    out: list[dict] = []
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        kind = _item_type(item, at)
        if kind == "message":
            out.append(_message(item, at))
        elif kind == "function_call":
            call_id = _string(item, "call_id", at)
            call = {"id": call_id, "type": "function", "function": {
                "name": _string(item, "name", at), "arguments": _string(item, "arguments", at)}}
            known_calls.add(call_id)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", at)
            if call_id not in known_calls:
                raise _error(f"{at}: no function_call with call_id {call_id[:80]!r} comes "
                             "before this output")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(item.get("output"), f"{at}.output", ("input_text",))})
        elif kind == "reasoning":
            continue
        else:
            raise ProtocolError(f"{at}: unknown or unsupported item type {kind[:40]!r}; this "
                                "server takes message, function_call, function_call_output "
                                "and reasoning items", param="input",
                                code="unsupported_parameter")
    return out


def input_items(value) -> list:
    """`input` as a list of items (a string is one user message)."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if isinstance(value, list):
        return value
    raise _error("'input' must be a string or a list of items")


def output_as_input(output: list[dict]) -> list[dict]:
    """A response's output items as the input items of the next turn."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append({"type": "message", "role": "assistant", "content": item["content"]})
        elif item["type"] == "function_call":
            items.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
    return items


def call_ids(messages: list[dict]) -> set[str]:
    """The tool-call ids of chat-format messages (a stored history)."""
    return {call["id"] for m in messages for call in m.get("tool_calls") or []}
