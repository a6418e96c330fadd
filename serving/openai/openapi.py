"""The OpenAPI 3.1 description the server serves at /openapi.json: its routes, what each
request body may hold (the rules `serving.openai.protocol` enforces) and the error envelope.

Like every route but /health, /openapi.json needs the API key when the server has one.
Unknown fields are ignored, as OpenAI and vLLM do, so objects allow additional properties.
Every optional field also accepts null, which means "the default". Rules that tie two
fields together (stream_options needs stream, top_logprobs needs logprobs, prompt_logprobs
excludes stream, max_tokens 0 needs echo, the context length) are in the descriptions.
"""
from __future__ import annotations

from serving.openai import structured_protocol
from serving.openai import chat_template_kwargs as template_kwargs
from serving.openai import responses_openapi
from serving.openai.chat_messages import ROLES
from serving.openai.protocol import MAX_CHOICES, MAX_STOP_STRINGS, MAX_TOP_K
from serving.openai.tools import MAX_TOOLS
from serving.core.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS

NON_EMPTY_STRING = {"type": "string", "minLength": 1}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _int(lo: int | None = None, hi: int | None = None, **extra) -> dict:
    schema = {"type": "integer", **extra}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    return _nullable(schema)


def _number(lo: float, hi: float, exclusive_lo: bool = False) -> dict:
    low = {"exclusiveMinimum": lo} if exclusive_lo else {"minimum": lo}
    return _nullable({"type": "number", **low, "maximum": hi})


def _bool(**extra) -> dict:
    return _nullable({"type": "boolean", **extra})


def _sampling_fields(token_id: dict, model: str) -> dict:
    """The fields both generation endpoints share (vLLM's names, SamplingParams' ranges)."""
    return {
        "model": _nullable({"const": model}),
        "stream": _bool(),
        "stream_options": _nullable({"type": "object", "description": "only with stream: true",
                                     "properties": {"include_usage": _bool()}}),
        "n": _int(1, 128, description=f"choices per prompt; at most {MAX_CHOICES} choices "
                                      "(prompts x n) per request"),
        "best_of": _int(1, 128, description="must equal n"),
        "seed": _int(-(2 ** 63), 2 ** 64 - 1),
        "temperature": _number(0, 100),
        "top_p": _number(0, 1, exclusive_lo=True),
        "top_k": _int(-1, MAX_TOP_K, description="0 or -1: off"),
        "min_p": _number(0, 1),
        "presence_penalty": _number(-2, 2),
        "frequency_penalty": _number(-2, 2),
        "repetition_penalty": _number(0, 2, exclusive_lo=True),
        "stop": _nullable({"anyOf": [NON_EMPTY_STRING, {
            "type": "array", "items": NON_EMPTY_STRING, "maxItems": MAX_STOP_STRINGS}]}),
        "stop_token_ids": _nullable({"type": "array", "items": token_id}),
        "logit_bias": _nullable({
            "type": "object", "maxProperties": MAX_LOGIT_BIAS,
            "propertyNames": {"pattern": r"^[0-9]+$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
            "description": "token id (a string of digits, inside the vocabulary) -> bias"}),
        "ignore_eos": _bool(),
        "include_stop_str_in_output": _bool(),
        "cache_salt": _nullable({**NON_EMPTY_STRING, "description": (
            "prefix-cache entries are shared only between requests with the same salt")}),
        "skip_special_tokens": _bool(enum=[True], description="only true is supported"),
        "spaces_between_special_tokens": _bool(enum=[True],
                                               description="only true is supported"),
    }


def _message() -> dict:
    """One schema per kind of message: content may be null only in an assistant message,
    tool_calls only there, and a tool message names the call it answers."""
    text_part = {"type": "object", "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": text_part}]}
    call = {"type": "object", "required": ["function"], "properties": {
        "id": {"type": "string"}, "type": {"const": "function"},
        "function": {"type": "object", "required": ["name", "arguments"], "properties": {
            "name": {"type": "string"},
            "arguments": {"type": "string", "description": "a JSON text"}}}}}
    roles = sorted(r for r in ROLES if r not in ("assistant", "tool"))
    return {"anyOf": [
        {"type": "object", "required": ["role", "content"],
         "properties": {"role": {"enum": roles}, "content": content,
                        "tool_calls": {"type": "null"}}},
        {"type": "object", "required": ["role"],
         "properties": {"role": {"const": "assistant"}, "content": _nullable(content),
                        "tool_calls": _nullable({"type": "array", "items": call})}},
        {"type": "object", "required": ["role", "content", "tool_call_id"],
         "properties": {"role": {"const": "tool"}, "content": content,
                        "tool_call_id": {"type": "string"}, "tool_calls": {"type": "null"}}},
    ]}


def _requires(field: str, value_schema: dict, then: dict) -> dict:
    """A rule tying two fields: when `field` holds a value matching value_schema, `then`."""
    return {"if": {"required": [field], "properties": {field: value_schema}}, "then": then}


def _stream_rule() -> dict:
    return _requires("stream_options", {"type": "object"},
                     {"required": ["stream"], "properties": {"stream": {"const": True}}})


def _no_stream_rule(field: str) -> dict:
    return _requires(field, {"type": "integer"}, {"not": {
        "required": ["stream"], "properties": {"stream": {"const": True}}}})


def _tools() -> dict:
    function = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": r"^[A-Za-z0-9_-]{1,64}$"},
        "description": _nullable({"type": "string"}),
        "parameters": _nullable({"type": "object", "description": "a JSON schema of type "
                                                                  "object"}),
        "strict": _bool()}}
    tool = {"type": "object", "required": ["type", "function"],
            "properties": {"type": {"const": "function"}, "function": function}}
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"],
                     "properties": {"name": {"type": "string"}}}}}
    return {
        "tools": _nullable({"type": "array", "items": tool, "maxItems": MAX_TOOLS,
                            "description": "function names unique"}),
        "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, named],
                                  "description": "default: auto with tools when the server "
                                                 "parses tool calls, else none; anything but "
                                                 "none needs tools; auto needs "
                                                 "--enable-auto-tool-choice"}),
        "parallel_tool_calls": _bool()}


def request_schemas(model: str, vocab_size: int, max_model_len: int,
                    max_logprobs: int = MAX_LOGPROBS) -> dict[str, dict]:
    """Route -> JSON Schema of its request body."""
    token_id = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    token_ids = {"type": "array", "items": token_id, "minItems": 1,
                 "maxItems": max_model_len - 1}
    max_tokens = _int(1, max_model_len - 1, description="prompt tokens + max_tokens must fit "
                                                        f"the context ({max_model_len})")
    sampling = _sampling_fields(token_id, model)
    prompt_logprobs = _int(0, max_logprobs, description=(
        "vLLM's: per prompt token (the first null) its logprob, rank and the top k, keyed by "
        "token id; not with stream"))
    completion = {"type": "object", "required": ["prompt"], "properties": {
        "prompt": {"anyOf": [
            NON_EMPTY_STRING,
            {"type": "array", "items": NON_EMPTY_STRING, "minItems": 1},
            token_ids,
            {"type": "array", "items": token_ids, "minItems": 1}],
            "description": "text, texts, token ids or lists of token ids"},
        "max_tokens": _int(0, max_model_len - 1, description=(
            f"default 16; prompt tokens + max_tokens must fit the context ({max_model_len}); "
            "0 only with echo: the prompt alone")),
        "logprobs": _int(0, max_logprobs),
        "echo": _bool(description="prompt text + completion; with logprobs, they cover the "
                                  "prompt's tokens (the first null), then the completion's"),
        "prompt_logprobs": prompt_logprobs,
        "suffix": {"type": "null", "description": "not supported"},
        **sampling, **structured_protocol.openapi_fields("completion")}, "allOf": [
        _stream_rule(), _no_stream_rule("prompt_logprobs"),
        _requires("max_tokens", {"const": 0},
                  {"required": ["echo"], "properties": {"echo": {"const": True}}})]}
    chat = {"type": "object", "required": ["messages"], "properties": {
        "messages": {"type": "array", "items": _message(), "minItems": 1},
        "max_tokens": {**max_tokens, "description": "default: what the context leaves"},
        "max_completion_tokens": {**max_tokens, "description": "wins over max_tokens"},
        "logprobs": _bool(),
        "top_logprobs": _int(0, max_logprobs, description="requires logprobs: true"),
        "prompt_logprobs": prompt_logprobs,
        "add_generation_prompt": _bool(),
        **_tools(),
        **template_kwargs.OPENAPI,
        **sampling, **structured_protocol.openapi_fields("chat")}, "allOf": [
        _stream_rule(), _no_stream_rule("prompt_logprobs"),
        _requires("top_logprobs", {"type": "integer"},
                  {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}),
        _requires("tool_choice", {"not": {"anyOf": [{"type": "null"}, {"const": "none"}]}},
                  {"required": ["tools"], "properties": {"tools": {"minItems": 1}}})]}
    tokenize = {"type": "object", "properties": {
        "model": sampling["model"],
        "prompt": {"type": "string", "description": "required unless messages is given"},
        "messages": {"type": "array", "items": _message(), "minItems": 1},
        "tools": _tools()["tools"],
        "add_special_tokens": _bool(),
        "add_generation_prompt": _bool(),
        "chat_template_kwargs": template_kwargs.OPENAPI["chat_template_kwargs"]},
        "anyOf": [{"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                  {"required": ["messages"]}],
        "allOf": [_requires("tools", {"type": "array", "minItems": 1},
                            {"required": ["messages"]})]}
    detokenize = {"type": "object", "required": ["tokens"], "properties": {
        "model": sampling["model"], "tokens": {"type": "array", "items": token_id}}}
    return {"/v1/completions": completion, "/v1/chat/completions": chat,
            "/tokenize": tokenize, "/detokenize": detokenize}


ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]},
                   "code": {"type": ["string", "null"]}}}}}


def _errors(*statuses: int) -> dict:
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(s): {"description": "an error in OpenAI's envelope", "content": ref}
            for s in statuses}


def _post(summary: str, body: dict, stream: bool = False) -> dict:
    ok = {"application/json": {"schema": {"type": "object"}}}
    if stream:  # each event's data: a JSON chunk, an error envelope, or [DONE]
        ok["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],
                                              "properties": {"data": {"type": "string"}}}}
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {"200": {"description": "OK", "content": ok},
                      **_errors(400, 401, 404, 405, 413, 500, 503)}}}


def _get(summary: str, content_type: str = "application/json", **extra) -> dict:
    return {"get": {"summary": summary,
                    "responses": {"200": {"description": "OK",
                                          "content": {content_type: {"schema": {}}}},
                                  **_errors(401, 404, 405, 503)}, **extra}}


def openapi_spec(model: str, vocab_size: int, max_model_len: int,
                 max_logprobs: int = MAX_LOGPROBS) -> dict:
    bodies = request_schemas(model, vocab_size, max_model_len, max_logprobs)
    model_param = {"name": "model", "in": "path", "required": True,
                   "schema": {"type": "string", "description": f"'{model}' (else 404)"}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "xlaserve", "version": "0.1.0",
                 "description": f"OpenAI-compatible API serving '{model}'. With an API key, "
                                "every route but /health needs 'Authorization: Bearer KEY'."},
        "paths": {
            "/v1/completions": _post("text completions", bodies["/v1/completions"], True),
            "/v1/chat/completions": _post("chat completions; with --reasoning-parser the "
                                          "thinking is message.reasoning_content and "
                                          "message.reasoning (streamed: delta.*)",
                                          bodies["/v1/chat/completions"], True),
            **responses_openapi.paths(model, max_model_len),
            "/v1/models": _get("the served model"),
            "/v1/models/{model}": _get("one model", parameters=[model_param]),
            "/tokenize": _post("text or messages to token ids", bodies["/tokenize"]),
            "/detokenize": _post("token ids to text", bodies["/detokenize"]),
            "/tokenizer_info": _get("the tokenizer's special tokens and chat template"),
            "/health": _get("200 once ready; 503 while warming up, draining or after the "
                            "engine failed", security=[]),
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/openapi.json": _get("this description"),
        },
        "components": {"schemas": {"Error": ERROR},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }
