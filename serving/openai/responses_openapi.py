"""The Responses API's part of /openapi.json: `POST /v1/responses` (the request body with
the limits responses_api.py enforces, the response object and its stream events) and
`GET /v1/responses/{response_id}`. Pure Python.

As elsewhere in /openapi.json, every optional field also accepts null ("the default") and
objects allow properties not listed (unknown fields are ignored). Rules that tie fields
together or need server state (a previous response that is stored, a function_call_output
answering an earlier call, the context length) are in the descriptions.
"""
from __future__ import annotations

from serving.openai.response_events import EVENT_TYPES
from serving.openai.responses_api import (CHAT_FIELDS, MAX_METADATA, MAX_STOP_STRINGS, REFUSED,
                                          SAMPLING_EXTRAS)
from serving.openai.response_items import ROLES, TEXT_PARTS
from serving.openai.tools import MAX_TOOLS

NULL = {"type": "null"}
STRING = {"type": "string", "minLength": 1}


def _nullable(schema: dict, **extra) -> dict:
    return {"anyOf": [schema, NULL], **extra}


def _number(lo: float, hi: float, exclusive_lo: bool = False) -> dict:
    low = {"exclusiveMinimum": lo} if exclusive_lo else {"minimum": lo}
    return _nullable({"type": "number", **low, "maximum": hi})


def _parts(kinds) -> dict:
    part = {"type": "object", "required": ["type", "text"],
            "properties": {"type": {"enum": list(kinds)}, "text": {"type": "string"}}}
    return {"anyOf": [{"type": "string"}, {"type": "array", "items": part}]}


def _items() -> dict:
    message = {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"const": "message"}, "role": {"enum": list(ROLES)},
        "content": _parts(TEXT_PARTS)}}
    call = {"type": "object", "required": ["type", "call_id", "name", "arguments"],
            "properties": {"type": {"const": "function_call"}, "call_id": STRING,
                           "name": STRING,
                           "arguments": {"type": "string", "description": "a JSON object's "
                                                                          "text"}}}
    output = {"type": "object", "required": ["type", "call_id", "output"],
              "description": "answers a function_call earlier in the conversation",
              "properties": {"type": {"const": "function_call_output"}, "call_id": STRING,
                             "output": _parts(["input_text"])}}
    reasoning = {"type": "object", "required": ["type"], "description": "dropped",
                 "properties": {"type": {"const": "reasoning"}}}
    return {"anyOf": [message, call, output, reasoning]}


def _tools() -> dict:
    tool = {"type": "object", "required": ["type", "name"], "properties": {
        "type": {"const": "function"},
        "name": {"type": "string", "pattern": r"^[A-Za-z0-9_-]{1,64}$"},
        "description": _nullable({"type": "string"}),
        "parameters": _nullable({"type": "object", "description": "a JSON schema of type "
                                 "object", "properties": {"type": {"const": "object"}}}),
        "strict": _nullable({"type": "boolean"})}}
    named = {"type": "object", "required": ["type", "name"],
             "properties": {"type": {"const": "function"}, "name": {"type": "string"}}}
    return {
        "tools": _nullable({"type": "array", "items": tool, "maxItems": MAX_TOOLS},
                           description="function tools only; names unique"),
        "tool_choice": _nullable({"anyOf": [{"enum": ["none", "auto", "required"]}, named]},
                                 description="default: auto with tools when the server "
                                             "parses tool calls, else none; anything but none "
                                             "needs tools"),
        "parallel_tool_calls": _nullable({"type": "boolean"})}


def _text() -> dict:
    schema = {"type": "object", "required": ["type", "name", "schema"], "properties": {
        "type": {"const": "json_schema"},
        "name": {"type": "string", "pattern": r"^[a-zA-Z0-9_-]{1,64}$"},
        "schema": {"type": "object"}, "strict": _nullable({"type": "boolean"}),
        "description": _nullable({"type": "string"})}}
    kinds = [{"type": "object", "required": ["type"],
              "properties": {"type": {"enum": ["text", "json_object"]}}}, schema]
    return _nullable({"type": "object", "properties": {
        "format": _nullable({"anyOf": kinds}),
        "verbosity": {"enum": ["medium", None], "description": "only medium"}}})


def _sampling() -> dict:
    return {
        "temperature": _number(0, 100),
        "top_p": _number(0, 1, exclusive_lo=True),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": 2 ** 31 - 1}),
        "min_p": _number(0, 1),
        "repetition_penalty": _number(0, 2, exclusive_lo=True),
        "seed": _nullable({"type": "integer", "minimum": -(2 ** 63), "maximum": 2 ** 64 - 1}),
        "stop": _nullable({"anyOf": [STRING, {"type": "array", "items": STRING,
                                              "maxItems": MAX_STOP_STRINGS}]}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "cache_salt": _nullable(STRING)}


def request_schema(model: str, max_model_len: int) -> dict:
    stream_rule = {"if": {"required": ["stream_options"],
                          "properties": {"stream_options": {"type": "object"}}},
                   "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
    tools_rule = {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {
        "not": {"anyOf": [NULL, {"const": "none"}]}}}},
        "then": {"required": ["tools"], "properties": {"tools": {"minItems": 1}}}}
    sampling = _sampling()
    assert set(SAMPLING_EXTRAS) <= set(sampling)
    properties = {
        "model": _nullable({"const": model}),
        "input": {"anyOf": [{"type": "string"},
                            {"type": "array", "items": _items(), "minItems": 1}],
                  "description": "a user message, or items"},
        "instructions": _nullable({"type": "string"}, description="a system message first; "
                                  "not carried over from a previous response"),
        "max_output_tokens": _nullable({"type": "integer", "minimum": 1,
                                        "maximum": max_model_len - 1},
                                       description="input tokens + max_output_tokens must fit "
                                                   f"the context ({max_model_len})"),
        **_tools(), "text": _text(),
        "reasoning": _nullable({"type": "object", "properties": {
            "effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh", None],
                       "description": "needs --reasoning-parser; the chat template's "
                                      "reasoning_effort"},
            "summary": NULL, "generate_summary": NULL}}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "properties": {
            "include_obfuscation": {"enum": [False, None]}}}, description="only with stream"),
        "store": _nullable({"type": "boolean"}, description="default true; true is a 400 "
                           "with --disable-responses-store"),
        "previous_response_id": _nullable({"type": "string"},
                                          description="a stored response (else 404)"),
        "metadata": _nullable({"type": "object", "maxProperties": MAX_METADATA,
                               "propertyNames": {"maxLength": 64},
                               "additionalProperties": {"type": "string", "maxLength": 512}}),
        "user": _nullable({"type": "string"}),
        "safety_identifier": _nullable({"type": "string"}),
        "prompt_cache_key": _nullable({"type": "string"}),
        **sampling}
    for name, off in REFUSED.items():
        properties[name] = {"enum": [*off, None], "description": "not supported: only this "
                                                                 "value"}
    for name, instead in CHAT_FIELDS.items():
        properties[name] = {"enum": [1, None] if name == "n" else [None],
                            "description": "a Chat Completions field"
                                           + (f"; use {instead}" if instead else "")}
    return {"type": "object", "required": ["input"], "properties": properties,
            "allOf": [stream_rule, tools_rule]}


RESPONSE = {"type": "object",
            "required": ["id", "object", "created_at", "status", "model", "output", "usage",
                         "tools", "tool_choice", "parallel_tool_calls"],
            "properties": {"object": {"const": "response"},
                           "status": {"enum": ["completed", "incomplete"]},
                           "output": {"type": "array", "items": {
                               "type": "object", "required": ["type", "id"], "properties": {
                                   "type": {"enum": ["message", "function_call",
                                                     "reasoning"]}}}},
                           "usage": {"type": "object", "required": [
                               "input_tokens", "output_tokens", "total_tokens",
                               "input_tokens_details", "output_tokens_details"]}}}
EVENT = {"type": "object", "required": ["event", "data"],
         "properties": {"event": {"enum": list(EVENT_TYPES)}, "data": {"type": "string"}}}


def _errors(*statuses: int) -> dict:
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(s): {"description": "an error in OpenAI's envelope", "content": ref}
            for s in statuses}


def paths(model: str, max_model_len: int) -> dict:
    response_id = {"name": "response_id", "in": "path", "required": True,
                   "schema": {"type": "string"}}
    body = request_schema(model, max_model_len)
    return {
        "/v1/responses": {"post": {
            "summary": "the Responses API: one response, streamed as typed events or not",
            "requestBody": {"required": True,
                            "content": {"application/json": {"schema": body}}},
            "responses": {"200": {"description": "OK", "content": {
                "application/json": {"schema": RESPONSE},
                "text/event-stream": {"schema": EVENT}}},
                **_errors(400, 401, 404, 405, 413, 500, 503)}}},
        "/v1/responses/{response_id}": {"get": {
            "summary": "a stored response", "parameters": [response_id],
            "responses": {"200": {"description": "OK", "content": {
                "application/json": {"schema": RESPONSE}}},
                **_errors(401, 404, 405, 503)}}},
    }
