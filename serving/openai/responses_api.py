"""The Responses API request (`POST /v1/responses`): its fields checked, its conversation
(instructions, a stored previous response, the input items) as chat messages, its sampling
parameters, and the response object's fields that echo it. Pure Python: no aiohttp, no JAX.

Every field that would change what the server does is implemented or refused with a 400
naming it (REFUSED: the values that mean "off" pass). Chat Completions' own fields sent here
by mistake (messages, response_format, max_tokens, ...) are refused with the Responses name.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from serving.core.sampling_params import SamplingParams
from serving.core.structured_outputs import StructuredOutputsParams
from serving.openai import response_items as items
from serving.openai.chat_messages import parse_messages
from serving.openai.fields import (ProtocolError, bad, int_field, number_field, opt_bool,
                                   opt_str)
from serving.openai.response_store import ResponseStore
from serving.openai.structured_protocol import SCHEMA_NAME
from serving.openai.tools import ToolChoice, parse_tool_choice

# Fields we do not implement, each with the values that mean "off" (null always does).
REFUSED = {"background": [False], "include": [[]], "truncation": ["disabled"],
           "conversation": [], "prompt": [], "max_tool_calls": [], "top_logprobs": [0],
           "service_tier": ["auto", "default"], "prompt_cache_retention": [],
           "context_management": [], "moderation": [], "image": [], "access_programs": [],
           "background_options": []}
CHAT_FIELDS = {"messages": "input", "response_format": "text.format",
               "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "n": None, "logprobs": None, "structured_outputs": "text.format"}
# vLLM's sampling extras of its ResponsesRequest.
SAMPLING_EXTRAS = ("top_k", "min_p", "repetition_penalty", "seed", "stop", "ignore_eos",
                   "cache_salt")
MAX_METADATA = 16  # OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512
MAX_STOP_STRINGS = 16


@dataclass
class ResponsesRequest:
    model: str | None
    input: list  # the input items, as sent (a string is one user message)
    instructions: str | None
    params: SamplingParams  # max_tokens: max_output_tokens, or None (what the context leaves)
    tools: ToolChoice
    stream: bool
    store: bool
    previous_response_id: str | None
    echo: dict  # the response object's fields that echo the request
    template_kwargs: dict = field(default_factory=dict)


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def _refuse_unsupported(body: dict) -> None:
    for name, off in REFUSED.items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in off):
            raise ProtocolError(f"'{name}' is not supported by this server"
                                + (f" (only {off[0]!r})" if off else ""), param=name,
                                code="unsupported_parameter")
    for name, instead in CHAT_FIELDS.items():
        if body.get(name) is not None and not (name == "n" and _same(body[name], 1)):
            hint = f"; use '{instead}'" if instead else ""
            raise ProtocolError(f"'{name}' is a Chat Completions field, not a Responses API "
                                f"one{hint}", param=name, code="unsupported_parameter")


def _text_format(body: dict) -> tuple[dict, StructuredOutputsParams | None]:
    """text.format -> (its echo, the constraint)."""
    text = body.get("text")
    if text is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(text, dict):
        raise bad("text", "an object {format: {...}}", text)
    if text.get("verbosity") not in (None, "medium"):
        raise ProtocolError("text.verbosity is not supported by this server (only 'medium')",
                            param="text.verbosity", code="unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return {"format": {"type": "text"}}, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return {"format": {"type": "text"}}, None
    if kind == "json_object":
        return {"format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise ProtocolError("text.format must be {type: text}, {type: json_object} or "
                            "{type: json_schema, name, schema, strict}", param="text.format")
    name, schema = fmt.get("name"), fmt.get("schema")
    if not (isinstance(name, str) and SCHEMA_NAME.fullmatch(name)):
        raise bad("text.format", "a json_schema whose 'name' is 1 to 64 letters, digits, "
                  "'_' or '-'", name)
    if not isinstance(schema, dict):
        raise bad("text.format", "a json_schema with a 'schema' object", schema)
    for key, kind_ in (("strict", bool), ("description", str)):
        if fmt.get(key) is not None and not isinstance(fmt[key], kind_):
            raise bad("text.format", f"a json_schema whose '{key}' is a {kind_.__name__}",
                      fmt[key])
    echo = {"type": "json_schema", "name": name, "schema": schema,
            "strict": fmt.get("strict"), **({"description": fmt["description"]}
                                             if fmt.get("description") is not None else {})}
    return {"format": echo}, StructuredOutputsParams(json=schema)


def _tools(body: dict, auto_enabled: bool) -> tuple[ToolChoice, list[dict], object]:
    """The flat Responses tools {type, name, description, parameters, strict} and tool_choice,
    checked by tools.py in their chat form. Returns (choice, tools echo, tool_choice echo)."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise bad("tools", "a list of tools", raw)
    chat_tools = []
    for i, tool in enumerate(raw or []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ProtocolError(f"tools[{i}]: only function tools are supported, got "
                                f"{str(kind)[:40]!r}", param="tools",
                                code="unsupported_parameter" if isinstance(kind, str) else None)
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        chat_tools.append({"type": "function", "function": fn})
    choice_raw = body.get("tool_choice")
    if isinstance(choice_raw, dict):
        if choice_raw.get("type") != "function" or not isinstance(choice_raw.get("name"), str):
            raise ProtocolError("tool_choice must be \"none\", \"auto\", \"required\" or "
                                "{\"type\": \"function\", \"name\": ...}", param="tool_choice",
                                code="unsupported_parameter"
                                if isinstance(choice_raw.get("type"), str) else None)
        choice_raw = {"type": "function", "function": {"name": choice_raw["name"]}}
    choice = parse_tool_choice({"tools": chat_tools, "tool_choice": choice_raw,
                                "parallel_tool_calls": body.get("parallel_tool_calls")},
                               auto_enabled)
    echo_tools = [{"type": "function", "name": t["function"]["name"],
                   "description": t["function"].get("description"),
                   "parameters": t["function"].get("parameters"),
                   "strict": t["function"].get("strict")} for t in choice.tools]
    echo_choice = {"type": "function", "name": choice.name} if choice.mode == "named" \
        else choice.mode
    return choice, echo_tools, echo_choice


def _reasoning(body: dict, reasoning_enabled: bool) -> tuple[dict | None, dict]:
    """reasoning {effort, summary} -> (its echo, chat template kwargs). The effort reaches
    the template as `reasoning_effort` (what reasoning models' templates read); summaries
    are not produced."""
    value = body.get("reasoning")
    if value is None:
        return None, {}
    if not isinstance(value, dict):
        raise bad("reasoning", "an object {effort, summary}", value)
    for key in ("summary", "generate_summary"):
        if value.get(key) is not None:
            raise ProtocolError(f"reasoning.{key} is not supported by this server (no "
                                "summaries)", param=f"reasoning.{key}",
                                code="unsupported_parameter")
    effort = value.get("effort")
    if effort is None:
        return {"effort": None, "summary": None}, {}
    if not reasoning_enabled:
        raise ProtocolError("reasoning.effort needs a model that reasons (the server started "
                            "with --reasoning-parser)", param="reasoning.effort",
                            code="unsupported_parameter")
    if effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise bad("reasoning.effort", "none, minimal, low, medium, high or xhigh", effort)
    return {"effort": effort, "summary": None}, {"reasoning_effort": effort}


def _metadata(body: dict) -> dict | None:
    value = body.get("metadata")
    if value is None:
        return None
    if not (isinstance(value, dict) and len(value) <= MAX_METADATA
            and all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str)
                    and len(v) <= 512 for k, v in value.items())):
        raise bad("metadata", f"at most {MAX_METADATA} string pairs (keys up to 64 characters, "
                  "values up to 512)", value)
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    value = [value] if isinstance(value, str) else value
    if not (isinstance(value, list) and len(value) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and s for s in value)):
        raise bad("stop", f"a non-empty string or a list of at most {MAX_STOP_STRINGS}", value)
    return value


def _sampling_params(body: dict, constraint) -> SamplingParams:
    kwargs = dict(
        max_tokens=int_field(body, "max_output_tokens", None, 1),
        temperature=number_field(body, "temperature", 1.0),
        top_p=number_field(body, "top_p", 1.0),
        top_k=int_field(body, "top_k", 0, -1, 2 ** 31 - 1),
        min_p=number_field(body, "min_p", 0.0),
        repetition_penalty=number_field(body, "repetition_penalty", 1.0),
        seed=int_field(body, "seed", None, -(2 ** 63), 2 ** 64 - 1), stop=_stop(body),
        ignore_eos=opt_bool(body, "ignore_eos"), cache_salt=opt_str(body, "cache_salt"),
        structured_outputs=constraint)
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        param = "max_output_tokens" if name == "max_tokens" else name
        raise ProtocolError(str(e).replace(name, param, 1), param=param) from None


def parse_request(body, *, auto_tools: bool, reasoning: bool,
                  store_enabled: bool) -> ResponsesRequest:
    """auto_tools: the server parses tool calls (--tool-call-parser); reasoning: it has a
    reasoning parser; store_enabled: not --disable-responses-store."""
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    _refuse_unsupported(body)
    if body.get("input") is None:
        raise ProtocolError("'input' is required", param="input")
    input_ = items.input_items(body["input"])
    stream = opt_bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not stream:
            raise ProtocolError("'stream_options' is only allowed when 'stream' is true",
                                param="stream_options")
        if not isinstance(options, dict) or options.get("include_obfuscation") not in (None,
                                                                                       False):
            raise ProtocolError("stream_options.include_obfuscation is not supported by this "
                                "server", param="stream_options", code="unsupported_parameter")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise bad("store", "a boolean", store)
    if store and not store_enabled:
        raise ProtocolError("this server does not store responses (--disable-responses-store)"
                            "; send store: false", param="store", code="unsupported_parameter")
    text_echo, constraint = _text_format(body)
    tools, echo_tools, echo_choice = _tools(body, auto_tools)
    reasoning_echo, template_kwargs = _reasoning(body, reasoning)
    params = _sampling_params(body, constraint)
    echo = {"model": opt_str(body, "model"), "instructions": opt_str(body, "instructions"),
            "metadata": _metadata(body), "parallel_tool_calls": tools.parallel,
            "temperature": params.temperature, "top_p": params.top_p,
            "max_output_tokens": params.max_tokens, "tool_choice": echo_choice,
            "tools": echo_tools, "text": text_echo, "reasoning": reasoning_echo,
            "truncation": "disabled", "previous_response_id": opt_str(body,
                                                                      "previous_response_id"),
            "user": opt_str(body, "user"), "safety_identifier": opt_str(body, "safety_identifier"),
            "prompt_cache_key": opt_str(body, "prompt_cache_key"),
            "store": store_enabled if store is None else store, "background": False}
    return ResponsesRequest(echo["model"], input_, echo["instructions"], params, tools, stream,
                            echo["store"], echo["previous_response_id"], echo, template_kwargs)


def conversation(req: ResponsesRequest, store: ResponseStore | None) -> tuple[list, list]:
    """(the chat messages to template, the history to store with the response): a stored
    previous response's history and output, then this input; the instructions (not carried
    over from a previous response, as OpenAI's) go first."""
    history: list[dict] = []
    if req.previous_response_id is not None:
        previous = store.get(req.previous_response_id) if store is not None else None
        if previous is None:
            raise ProtocolError(f"Previous response with id '{req.previous_response_id[:100]}' "
                                "not found.", status=404, type="invalid_request_error",
                                param="previous_response_id",
                                code="previous_response_not_found")
        history = previous.history + items.to_messages(
            items.output_as_input(previous.response["output"]), set(), "output")
    turn = items.to_messages(req.input, items.call_ids(history))
    head = [{"role": "system", "content": req.instructions}] if req.instructions else []
    try:
        messages = parse_messages(head + history + turn)
    except ProtocolError as e:
        raise ProtocolError(e.message.replace("messages", "the conversation's messages", 1),
                            param="input") from None
    return messages, history + turn


def head(response_id: str, created_at: int, model: str, req: ResponsesRequest) -> dict:
    """The response object's fields besides status, output, usage and errors."""
    return {"id": response_id, "object": "response", "created_at": created_at,
            **req.echo, "model": model}
