"""Structured-output fields of a request (OpenAI's response_format, vLLM's structured_outputs
and its older guided_* fields), min_tokens, and vLLM's other extra fields, which are either
implemented or refused: none is ignored. Also their OpenAPI schemas, next to the rules they
describe. Pure Python: no aiohttp, no JAX.

The constraint is compiled (serving/core/grammar.py) before the request is queued, so a bad
schema, an invalid regex or a grammar the library refuses is a 400 in OpenAI's envelope.
"""
from __future__ import annotations

import dataclasses
import json
import re

from serving.core.grammar import GrammarRefused
from serving.core.structured_outputs import StructuredOutputsParams
from serving.openai import fields

SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
# vLLM's backend names: llguidance serves every kind they do, so each is accepted.
BACKENDS = ["auto", "guidance", "llguidance", "xgrammar", "outlines", "lm-format-enforcer"]
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# structured_outputs' own options. These two need nothing here: our JSON has fixed
# separators, and there is no other backend to fall back to.
SO_FLAGS = ("disable_fallback", "disable_any_whitespace")
SO_REFUSED = {"disable_additional_properties": [False], "whitespace_pattern": []}

# vLLM's extra request fields we do not implement, each with the values that mean "off"
# (null always does). Any other value is a 400: a client asking for one gets told so.
_BOTH = {"use_beam_search": [False], "length_penalty": [1, 1.0], "watermarking": [False],
         "logprob_token_ids": [], "allowed_token_ids": [],
         "bad_words": [[]], "truncate_prompt_tokens": [], "truncation_side": [],
         "priority": [0], "request_id": [], "return_tokens_as_token_ids": [False],
         "return_token_ids": [False], "ec_transfer_params": [],
         "vllm_xargs": [], "repetition_detection": [], "stream_interval": [],
         "thinking_token_budget": [], "logits_processors": [], "guided_whitespace_pattern": [],
         "prompt_embeds": []}
REFUSED_EXTRAS = {
    "chat": {**_BOTH, "echo": [False], "continue_final_message": [False],
             "add_special_tokens": [False], "documents": [], "chat_template": [],
             "mm_processor_kwargs": [], "media_io_kwargs": [], "reasoning_effort": []},
    "completion": {**_BOTH, "add_special_tokens": [True]},
}


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def check_extras(body: dict, endpoint: str) -> None:
    """endpoint: "chat" or "completion"."""
    for name, off in REFUSED_EXTRAS[endpoint].items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in off):
            raise fields.ProtocolError(f"'{name}' is not supported by this server"
                                  + (f" (only {off[0]!r})" if off else ""),
                                  param=name, code="unsupported_parameter")


def sampling_fields(body: dict) -> dict:
    """SamplingParams keyword arguments from this module's fields."""
    return dict(min_tokens=fields.int_field(body, "min_tokens", 0, 0),
                structured_outputs=structured_outputs(body))


def structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The request's one constraint, from whichever field sets it; two are a 400."""
    found = []
    fmt = _response_format(body.get("response_format"))
    if fmt is not None:
        found.append(("response_format", fmt))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _kind_value(name, kind, body[name])))
    if body.get("structural_tag") is not None:
        found.append(("structural_tag", _kind_value("structural_tag", "structural_tag",
                                                    body["structural_tag"])))
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise fields.bad("guided_decoding_backend", f"one of {BACKENDS}", backend)
    if len(found) > 1:
        raise fields.ProtocolError(f"only one structured output constraint per request; got "
                              f"{', '.join(n for n, _ in found)}", param=found[1][0])
    return found[0][1] if found else None


def constraint_param(body: dict) -> str:
    """The field that set the request's constraint, for the 400 of a refused one."""
    names = ["response_format", "structured_outputs", *GUIDED, "structural_tag"]
    return next((n for n in names if body.get(n) is not None), "structured_outputs")


def _response_format(fmt) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise fields.bad("response_format", "an object with a string 'type'", fmt)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise fields.bad("response_format", "with type json_schema, a 'json_schema' object",
                          spec)
        name = spec.get("name")
        if not (isinstance(name, str) and SCHEMA_NAME.fullmatch(name)):
            raise fields.bad("response_format", "a json_schema whose 'name' is 1 to 64 letters, "
                          "digits, '_' or '-'", name)
        for field, types in (("strict", (bool,)), ("description", (str,))):
            if spec.get(field) is not None and not isinstance(spec[field], types):
                raise fields.bad("response_format", f"a json_schema whose '{field}' is a "
                              f"{types[0].__name__}", spec[field])
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise fields.bad("response_format", "a json_schema with a 'schema' object", schema)
        return StructuredOutputsParams(json=schema)
    if kind == "structural_tag":
        if not (isinstance(fmt.get("structures"), list) and isinstance(fmt.get("triggers"), list)):
            raise fields.bad("response_format", "with type structural_tag, 'structures' and "
                          "'triggers' lists", fmt)
        return StructuredOutputsParams(structural_tag=json.dumps(
            {"structures": fmt["structures"], "triggers": fmt["triggers"]}))
    raise fields.ProtocolError(f"unknown response_format type {kind!r}; use text, json_object, "
                          "json_schema or structural_tag", param="response_format")


def _structured_outputs(value) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise fields.bad("structured_outputs", "an object", value)
    unknown = sorted(set(value) - set(KINDS) - set(SO_FLAGS) - set(SO_REFUSED))
    if unknown:
        raise fields.ProtocolError(f"structured_outputs has unknown field(s) {', '.join(unknown)}",
                              param="structured_outputs")
    for name in SO_FLAGS:
        if value.get(name) is not None and not isinstance(value[name], bool):
            raise fields.bad("structured_outputs", f"{name}: a boolean", value[name])
    for name, off in SO_REFUSED.items():
        v = value.get(name)
        if v is not None and not any(_same(v, o) for o in off):
            raise fields.ProtocolError(f"structured_outputs.{name} is not supported by this "
                                  "server", param="structured_outputs",
                                  code="unsupported_parameter")
    set_kinds = [k for k in KINDS if value.get(k) is not None
                 and not (k == "json_object" and value[k] is False)]
    if len(set_kinds) != 1:
        raise fields.ProtocolError("structured_outputs needs exactly one of " + ", ".join(KINDS)
                              + (f"; got {', '.join(set_kinds)}" if set_kinds else ""),
                              param="structured_outputs")
    kind = set_kinds[0]
    if kind == "json_object":
        if value[kind] is not True:
            raise fields.bad("structured_outputs", "json_object true", value[kind])
        return StructuredOutputsParams(json_object=True)
    return _kind_value("structured_outputs", kind, value[kind])


def _kind_value(param: str, kind: str, value) -> StructuredOutputsParams:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise fields.bad(param, "a JSON schema (an object, or its JSON text)",
                             value) from None
        if not isinstance(value, dict):
            raise fields.bad(param, "a JSON schema (an object, or its JSON text)", value)
    elif kind == "choice":
        if not (isinstance(value, list) and value
                and all(isinstance(c, str) and c for c in value)):
            raise fields.bad(param, "a non-empty list of non-empty strings", value)
    elif kind == "structural_tag":
        if isinstance(value, dict):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise fields.bad(param, "a structural tag (an object, or its JSON text)", value)
    elif not (isinstance(value, str) and value):
        raise fields.bad(param, f"a non-empty {kind} string", value)
    return StructuredOutputsParams(**{kind: value})


def with_max_tokens(params, max_tokens: int):
    """params with the effective max_tokens; min_tokens must still fit under it."""
    if params.min_tokens > max_tokens:
        raise fields.bad("min_tokens", f"at most max_tokens ({max_tokens} here)", params.min_tokens)
    return dataclasses.replace(params, max_tokens=max_tokens)


async def compile_constraint(engine, params, body: dict, param: str | None = None) -> None:
    """Compiles the request's constraint before it is queued (the engine caches it).
    param: the field to blame for a refusal; default: the one that set the constraint."""
    if params.structured_outputs is None:
        return
    try:
        await engine.compile_grammar(params.structured_outputs)
    except GrammarRefused as e:
        raise fields.ProtocolError(str(e), param=param or constraint_param(body),
                              code="invalid_structured_output") from None


# -- OpenAPI -------------------------------------------------------------------------------

def openapi_fields(endpoint: str) -> dict:
    """The request-body properties this module validates, as JSON Schema."""
    null = {"type": "null"}
    string = {"type": "string", "minLength": 1}
    schema_value = {"anyOf": [{"type": "object"}, {"type": "string",
                                                   "description": "a JSON schema's text"}]}
    choices = {"type": "array", "items": string, "minItems": 1}
    tag = {"anyOf": [{"type": "object"}, {"type": "string"}],
           "description": "vLLM's structural tag: {structures: [{begin, schema, end}], "
                          "triggers: [...]}"}
    response_format = {"anyOf": [null, {"type": "object", "required": ["type"], "oneOf": [
        {"properties": {"type": {"const": "text"}}},
        {"properties": {"type": {"const": "json_object"}}},
        {"required": ["json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["name", "schema"], "properties": {
                "name": {"type": "string", "pattern": r"^[a-zA-Z0-9_-]{1,64}$"},
                "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]},
                "description": {"type": ["string", "null"]}}}}},
        {"required": ["structures", "triggers"], "properties": {
            "type": {"const": "structural_tag"}, "structures": {"type": "array"},
            "triggers": {"type": "array"}}}]}],
        "description": "at most one constraint per request (response_format, "
                       "structured_outputs, guided_*, structural_tag)"}
    one_kind = [{"required": [k], "properties": {
        k: {"const": True} if k == "json_object" else {"not": null}}} for k in KINDS]
    so_options = {**{name: {"type": ["boolean", "null"]} for name in SO_FLAGS},
                  **{name: {"enum": [*off, None]} for name, off in SO_REFUSED.items()}}
    structured = {"anyOf": [null, {
        "type": "object", "additionalProperties": False, "oneOf": one_kind, "properties": {
            "json": schema_value, "regex": string, "choice": choices, "grammar": string,
            "json_object": {"enum": [True, False, None]}, "structural_tag": tag,
            **so_options},
        "description": "exactly one of json, regex, choice, grammar, json_object, "
                       "structural_tag"}]}
    fields = {
        "response_format": response_format, "structured_outputs": structured,
        "guided_json": {"anyOf": [null, schema_value]},
        "guided_regex": {"anyOf": [null, string]},
        "guided_choice": {"anyOf": [null, choices]},
        "guided_grammar": {"anyOf": [null, string], "description": "Lark or GBNF (EBNF)"},
        "structural_tag": {"anyOf": [null, tag]},
        "guided_decoding_backend": {"enum": [*BACKENDS, None],
                                    "description": "every name is served by llguidance"},
        "min_tokens": {"anyOf": [null, {"type": "integer", "minimum": 0}],
                       "description": "no EOS or stop token before this many tokens; at "
                                      "most max_tokens"},
    }
    for name, off in REFUSED_EXTRAS[endpoint].items():
        fields[name] = {"enum": [*off, None], "description": "not supported: only this value"}
    return fields
