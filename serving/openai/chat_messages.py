"""The `messages` of a chat request, checked and normalised for the chat template: roles
mapped (developer -> system), text parts joined, tool calls' arguments parsed as the
templates expect them."""
from __future__ import annotations

import json

from serving.openai.image_parts import IMAGE_PARTS, image_url, refuse_images
from serving.openai.fields import ProtocolError, bad

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None and message["role"] == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            where = f"messages[{i}].content[{j}]"
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                if message["role"] != "user":
                    raise ProtocolError(f"{where}: only user messages carry images",
                                        param="messages")
                image_url(part, where, "messages")
                raise refuse_images(where, "messages")
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ProtocolError(f"{where}: only text and image_url parts "
                                    "({'type': 'text', 'text': ...}) are supported",
                                    param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad("messages", "messages whose content is a string or a list of text parts", content)


def _tool_calls(message: dict, i: int) -> list[dict]:
    """An assistant message's tool_calls, their arguments parsed: chat templates write them
    as JSON objects."""
    calls = message["tool_calls"]
    if not isinstance(calls, list):
        raise ProtocolError(f"messages[{i}].tool_calls must be a list", param="messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                and isinstance(fn.get("arguments"), str)
                and call.get("type", "function") == "function"
                and isinstance(call.get("id", ""), str)):
            raise ProtocolError(f"messages[{i}].tool_calls[{j}] must be {{'id', 'type': "
                                "'function', 'function': {'name', 'arguments': a JSON "
                                "string}}", param="messages")
        try:
            arguments = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            raise ProtocolError(f"messages[{i}].tool_calls[{j}].function.arguments is not "
                                "valid JSON", param="messages") from None
        out.append({"id": call.get("id", ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": arguments}})
    return out


def parse_messages(value) -> list[dict]:
    if not (isinstance(value, list) and value):
        raise ProtocolError("'messages' must be a non-empty list", param="messages")
    out = []
    for i, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else message
        if not (isinstance(role, str) and role in ROLES):  # a dict role is unhashable
            shown = repr(role) if len(repr(role)) <= 80 else repr(role)[:77] + "..."
            raise ProtocolError(f"messages[{i}].role must be one of {sorted(ROLES)}, "
                                f"got {shown}", param="messages")
        parsed = {"role": ROLES[role], "content": _content(message, i)}
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise ProtocolError(f"messages[{i}]: a tool message needs 'tool_call_id' "
                                    "(a string)", param="messages")
            parsed["tool_call_id"] = message["tool_call_id"]
        if message.get("tool_calls") is not None:
            if role != "assistant":
                raise ProtocolError(f"messages[{i}]: only assistant messages carry "
                                    "tool_calls", param="messages")
            parsed["tool_calls"] = _tool_calls(message, i)
        out.append(parsed)
    return out
