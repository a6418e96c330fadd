"""/v1/embeddings' request and response: the body checked into an `EmbeddingRequest`
(OpenAI's fields and vLLM's extras, 400s in OpenAI's envelope), one vector encoded as floats
or base64, and the route's OpenAPI description. No JAX, no engine."""
from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np

from serving.core.pooling_params import PoolingParams
from serving.openai.fields import (ProtocolError, bad, int_field, is_int, opt_bool, opt_str,
                                   token_id_list, unsupported)

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
ENCODING_FORMATS = ("float", "base64")
ENDIANNESS = ("native", "little", "big")  # vLLM's, for base64
_INPUT_RULE = ("a non-empty string, a list of non-empty strings, a list of token ids or a "
               "list of lists of token ids")


@dataclass
class EmbeddingRequest:
    inputs: list[str | list[int]]  # each a text or token ids, in the response's order
    model: str | None
    params: PoolingParams
    encoding_format: str = "float"
    endianness: str = "native"
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the last k tokens; -1: max_model_len


def _inputs(body: dict) -> list[str | list[int]]:
    value = body.get("input")
    if value is None:
        raise ProtocolError("'input' is required", param="input")
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(is_int(t) for t in value):
        value = [value]  # one list of token ids
    if not isinstance(value, list) or not value:
        raise bad("input", _INPUT_RULE, value)
    if len(value) > MAX_INPUTS:
        raise ProtocolError(f"'input' holds {len(value)} inputs; at most {MAX_INPUTS}",
                            param="input")
    out = []
    for item in value:
        ids = token_id_list(item) if isinstance(item, list) else None
        if isinstance(item, str) and item:
            out.append(item)
        elif ids:
            out.append(ids)
        else:
            raise bad("input", _INPUT_RULE, item)
    if len({type(x) for x in out}) > 1:
        raise bad("input", _INPUT_RULE + " (not a mix)", value)
    return out


def _normalize(body: dict) -> bool | None:
    """vLLM's `normalize`, or its newer name `use_activation`."""
    normalize, alias = opt_bool(body, "normalize", None), opt_bool(body, "use_activation", None)
    if normalize is not None and alias is not None and normalize != alias:
        raise ProtocolError("'normalize' and 'use_activation' disagree", param="normalize")
    return normalize if normalize is not None else alias


def parse_embedding_request(body: dict) -> EmbeddingRequest:
    if body.get("messages") is not None:
        raise unsupported("messages", "chat-style embedding input ('messages')")
    if body.get("priority") not in (None, 0):
        raise unsupported("priority", "a priority other than 0")
    if body.get("embed_dtype") not in (None, "float32"):
        raise unsupported("embed_dtype", "an embed_dtype other than float32")
    fmt = opt_str(body, "encoding_format", "float")
    if fmt not in ENCODING_FORMATS:
        raise bad("encoding_format", "'float' or 'base64'", fmt)
    endianness = opt_str(body, "endianness", "native")
    if endianness not in ENDIANNESS:
        raise bad("endianness", "'native', 'little' or 'big'", endianness)
    opt_str(body, "user")  # accepted, as OpenAI does; nothing depends on it
    params = PoolingParams(int_field(body, "dimensions", lo=1), _normalize(body))
    return EmbeddingRequest(
        _inputs(body), opt_str(body, "model"), params, fmt, endianness,
        opt_bool(body, "add_special_tokens", True),
        int_field(body, "truncate_prompt_tokens", lo=-1))


def truncate(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: keep the last k tokens (-1: max_model_len)."""
    if k is None:
        return ids
    if k > max_model_len:
        raise ProtocolError(f"truncate_prompt_tokens ({k}) is greater than max_model_len "
                            f"({max_model_len})", param="truncate_prompt_tokens")
    k = max_model_len if k == -1 else k
    return ids[-k:] if k else []


def encode(embedding: list[float], fmt: str, endianness: str = "native"):
    """floats, or base64 of float32 bytes: little-endian by default on the hosts we run
    on, as OpenAI's client decodes them."""
    if fmt == "float":
        return embedding
    order = {"native": "=", "little": "<", "big": ">"}[endianness]
    return base64.b64encode(np.asarray(embedding, dtype=f"{order}f4").tobytes()).decode()


def response_body(request_id: str, created: int, model: str, vectors: list,
                  num_prompt_tokens: int) -> dict:
    return {"id": request_id, "object": "list", "created": created, "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": v}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens}}


def request_schema(model: str, vocab_size: int, max_model_len: int, hidden_size: int) -> dict:
    """The JSON Schema of /v1/embeddings' body (the rules parse_embedding_request enforces)."""
    def nullable(schema):
        return {"anyOf": [schema, {"type": "null"}]}
    text = {"type": "string", "minLength": 1}
    token_ids = {"type": "array", "minItems": 1, "maxItems": max_model_len,
                 "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    many = {"type": "array", "minItems": 1, "maxItems": MAX_INPUTS}
    return {"type": "object", "required": ["input"], "properties": {
        "input": {"anyOf": [text, {**many, "items": text}, token_ids,
                            {**many, "items": token_ids}],
                  "description": f"{_INPUT_RULE}; each at most {max_model_len} tokens"},
        "model": nullable({"const": model}),
        "encoding_format": nullable({"enum": list(ENCODING_FORMATS)}),
        "dimensions": nullable({"type": "integer", "minimum": 1, "maximum": hidden_size,
                                "description": "Matryoshka models only (config.json's "
                                               "matryoshka_dimensions / is_matryoshka)"}),
        "normalize": nullable({"type": "boolean"}),
        "use_activation": nullable({"type": "boolean", "description": "as normalize"}),
        "user": nullable({"type": "string"}),
        "add_special_tokens": nullable({"type": "boolean"}),
        "truncate_prompt_tokens": nullable({"type": "integer", "minimum": -1,
                                            "maximum": max_model_len}),
        "embed_dtype": nullable({"const": "float32"}),
        "endianness": nullable({"enum": list(ENDIANNESS)}),
        "priority": nullable({"const": 0}),
    }}

