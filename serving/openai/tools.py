"""Tool calling, request side: `tools`, `tool_choice` and `parallel_tool_calls` validated, the
messages that carry tool calls and tool results, and the JSON schema that forces a tool call
("required" or a named function) through structured outputs. Pure Python, no JAX.

The messages that carry tool calls and results are read in protocol.py; what the model's
output becomes is the parsers' job (serving/openai/tool_parsers.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from serving.openai.fields import ProtocolError

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128
# The demo model's own template has no tools: this one adds them (hermes-style calls).
DEMO_CHAT_TEMPLATE = Path(__file__).parent / "chat_templates" / "chatml_tools.jinja"


def read_chat_template(value: str) -> str:
    """--chat-template: a file, or the template itself (vLLM takes both)."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def _error(message: str, param: str) -> ProtocolError:
    return ProtocolError(message, param=param)


@dataclass
class ToolChoice:
    """tools: the function definitions as the chat template receives them ({"type":
    "function", "function": {...}}); mode: "none" | "auto" | "required" | "named"."""
    tools: list[dict] = field(default_factory=list)
    mode: str = "none"
    name: str | None = None  # the function, when mode is "named"
    parallel: bool = True

    def function(self, name: str) -> dict | None:
        return next((t["function"] for t in self.tools if t["function"]["name"] == name), None)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def schema(self) -> dict:
        """The JSON schema the output must follow when a call is forced: a named function's
        arguments, or for "required" an array of {name, parameters} (one item at most
        without parallel tool calls)."""
        if self.mode == "named":
            return self.function(self.name).get("parameters") or {"type": "object"}
        calls = [{"type": "object", "required": ["name", "parameters"],
                  "additionalProperties": False,
                  "properties": {"name": {"const": t["function"]["name"]},
                                 "parameters": t["function"].get("parameters")
                                 or {"type": "object"}}}
                 for t in self.tools]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return array


def _function(tool, i: int) -> dict:
    param = f"tools[{i}]"
    if not (isinstance(tool, dict) and tool.get("type") == "function"
            and isinstance(tool.get("function"), dict)):
        raise _error(f"{param} must be {{'type': 'function', 'function': {{...}}}}", "tools")
    fn = tool["function"]
    name = fn.get("name")
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise _error(f"{param}.function.name must be 1 to 64 letters, digits, '_' or '-'",
                     "tools")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise _error(f"{param}.function.description must be a string", "tools")
    params = fn.get("parameters")
    if params is not None and not (isinstance(params, dict)
                                   and params.get("type", "object") == "object"):
        raise _error(f"{param}.function.parameters must be a JSON schema of type object",
                     "tools")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise _error(f"{param}.function.strict must be a boolean", "tools")
    out = {"name": name}
    for key in ("description", "parameters", "strict"):
        if fn.get(key) is not None:
            out[key] = fn[key]
    return {"type": "function", "function": out}


def parse_tool_choice(body: dict, auto_enabled: bool) -> ToolChoice:
    """auto_enabled: the server parses tool calls out of free text (--enable-auto-tool-choice
    with a --tool-call-parser). Without tools, tool_choice may only be "none"."""
    raw_tools = body.get("tools")
    if raw_tools is not None and not (isinstance(raw_tools, list)
                                      and len(raw_tools) <= MAX_TOOLS):
        raise _error(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    tools = [_function(t, i) for i, t in enumerate(raw_tools or [])]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise _error("tool function names must be unique", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _error("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    choice = ToolChoice(tools, parallel=True if parallel is None else parallel)
    raw = body.get("tool_choice")
    if raw is None:
        # Many clients send their tools on every request: without a parser configured, the
        # tools still reach the template and the output stays plain text ("none").
        choice.mode = "auto" if tools and auto_enabled else "none"
    elif raw in ("none", "auto", "required"):
        choice.mode = raw
    elif (isinstance(raw, dict) and raw.get("type") == "function"
          and isinstance(raw.get("function"), dict)
          and isinstance(raw["function"].get("name"), str)):
        choice.mode, choice.name = "named", raw["function"]["name"]
    else:
        raise _error("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                     "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if choice.mode != "none" and not tools:
        raise _error(f"tool_choice {choice.mode!r} needs 'tools'", "tool_choice")
    if choice.mode == "named" and choice.function(choice.name) is None:
        raise _error(f"tool_choice names {choice.name!r}, which is not among the tools",
                     "tool_choice")
    if choice.mode == "auto" and not auto_enabled:
        raise _error('"auto" tool choice needs the server started with '
                     "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")
    return choice
