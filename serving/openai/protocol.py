"""OpenAI request parsing and validation (responses: serving/openai/responses.py). Pure Python:
no aiohttp, no JAX.

Validation is strict about types (a bool is not an int, NaN and infinities are rejected, a
string is never coerced) and lenient about unknown fields, which are ignored as OpenAI and
vLLM do. Every rejection is a ProtocolError carrying the HTTP status and OpenAI's error
envelope; the server turns it into a response.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from serving.core import request_checks
from serving.core.request_checks import RequestRefused, fit_max_tokens
from serving.core.sampling_params import MAX_LOGPROBS, SamplingParams

MAX_STOP_STRINGS = 16
MAX_CHOICES = 256  # prompts x n per request: bounds what one request can queue
MAX_TOP_K = 2 ** 31 - 1  # the sampler's top_k is int32; larger means "off" anyway
# ASCII digits only ("²".isdigit() is true, int("²") fails) and few of them (int() refuses
# thousands); any id this long is outside every vocabulary and is refused later anyway.
_TOKEN_ID_KEY = re.compile(r"\s*[0-9]{1,18}\s*")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
         "tool": "tool"}

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                   413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
                   503: "service_unavailable_error"}


class ProtocolError(Exception):
    """A request the server answers with an error; `to_dict()` is OpenAI's envelope."""

    def __init__(self, message: str, *, status: int = 400, type: str | None = None,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status, "server_error")
        self.param = param
        self.code = code

    def to_dict(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# -- typed field access --------------------------------------------------------------------

def is_int(x) -> bool:
    """An integer as JSON Schema counts them: 3 and 3.0, never true or 3.5."""
    return (isinstance(x, int) and not isinstance(x, bool)) or (
        isinstance(x, float) and x.is_integer())


def token_id_list(value) -> list[int] | None:
    """A list of token ids (non-negative integers) as ints, or None if it is not one."""
    if isinstance(value, list) and all(is_int(t) and t >= 0 for t in value):
        return [int(t) for t in value]
    return None


def _bad(param: str, rule: str, value) -> ProtocolError:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return ProtocolError(f"'{param}' must be {rule}, got {shown}", param=param)


def _int(body: dict, name: str, default=None, lo: int | None = None, hi: int | None = None):
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value) or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}" if lo is not None else ""
        raise _bad(name, "an integer" + bounds, value)
    return int(value)


def _number(body: dict, name: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)):
        raise _bad(name, "a finite number", value)
    return float(value)


def opt_bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, "a boolean", value)
    return value


def opt_str(body: dict, name: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, str):
        raise _bad(name, "a string", value)
    return value


def _unsupported(param: str, what: str) -> ProtocolError:
    return ProtocolError(f"{what} is not supported by this server", param=param,
                         code="unsupported_parameter")


# -- requests ------------------------------------------------------------------------------

@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]  # one entry per prompt: text or token ids
    params: SamplingParams  # params.n choices per prompt
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    echo_only: bool = False  # max_tokens 0 with echo: the prompt alone, nothing generated
    prompt_logprobs: int | None = None  # vLLM's extra field, as the client asked it


@dataclass
class ChatRequest:
    model: str | None
    messages: list[dict]  # [{"role": system|user|assistant, "content": str}]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    add_generation_prompt: bool = True
    max_tokens_param: str = "max_tokens"  # which field set the limit, for error messages
    prompt_logprobs: int | None = None  # vLLM's extra field


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not (isinstance(value, list) and len(value) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and s for s in value)):
        raise _bad("stop", f"a non-empty string or a list of at most {MAX_STOP_STRINGS}", value)
    return list(value)


def _stop_token_ids(body: dict) -> list[int]:
    value = body.get("stop_token_ids")
    if value is None:
        return []
    if (ids := token_id_list(value)) is None:
        raise _bad("stop_token_ids", "a list of token ids", value)
    return ids


def _logit_bias(body: dict) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad("logit_bias", "an object mapping token ids to numbers", value)
    bias = {}
    for key, v in value.items():
        if not (isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key)):
            raise _bad("logit_bias", "keyed by token ids (as strings)", key)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise _bad("logit_bias", "an object mapping token ids to finite numbers", v)
        bias[int(key)] = float(v)
    return bias


def _stream_options(body: dict, stream: bool) -> bool:
    """Returns include_usage."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ProtocolError("'stream_options' is only allowed when 'stream' is true",
                            param="stream_options")
    if not isinstance(options, dict):
        raise _bad("stream_options", "an object", options)
    return opt_bool(options, "include_usage") if "include_usage" in options else False


def _sampling_params(body: dict, *, max_tokens, max_tokens_param: str, logprobs,
                     logprobs_param: str, prompt_logprobs: int | None = None) -> SamplingParams:
    """The fields both endpoints share. Types are checked here, ranges by SamplingParams."""
    seed = _int(body, "seed", None, -(2 ** 63), 2 ** 64 - 1)
    n = _int(body, "n", 1)
    if _int(body, "best_of", n) != n:
        raise _unsupported("best_of", "best_of different from n")
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        if opt_bool(body, name, True) is False:
            raise _unsupported(name, f"{name}=false")
    kwargs = dict(
        n=n, seed=seed, max_tokens=max_tokens, stop=_stop(body),
        stop_token_ids=_stop_token_ids(body), logit_bias=_logit_bias(body), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
        top_k=_int(body, "top_k", 0, -1, MAX_TOP_K), min_p=_number(body, "min_p", 0.0),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0),
        ignore_eos=opt_bool(body, "ignore_eos"),
        include_stop_str_in_output=opt_bool(body, "include_stop_str_in_output"),
        cache_salt=opt_str(body, "cache_salt"))
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        param = {"max_tokens": max_tokens_param, "logprobs": logprobs_param}.get(name, name)
        raise ProtocolError(str(e).replace(name, param, 1), param=param) from None
    if params.n > MAX_CHOICES:
        raise _bad("n", f"at most {MAX_CHOICES}", params.n)
    return params


def _common(body) -> tuple[str | None, bool, bool]:
    if not isinstance(body, dict):
        raise ProtocolError("the request body must be a JSON object")
    model = opt_str(body, "model")
    stream = opt_bool(body, "stream")
    return model, stream, _stream_options(body, stream)


def _prompts(value) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if (ids := token_id_list(value)) is not None:
            return [ids]
        lists = [token_id_list(p) if p else None for p in value]
        if all(ids is not None for ids in lists):
            return lists
    raise ProtocolError("'prompt' must be a string, a list of strings, a list of token ids or "
                        "a list of lists of token ids", param="prompt")


def _prompt_logprobs(body: dict, stream: bool, max_logprobs: int) -> int | None:
    k = _int(body, "prompt_logprobs", None, 0, max_logprobs)
    if k is not None and stream:  # vLLM refuses it too: the prompt's entries are one block
        raise ProtocolError("'prompt_logprobs' is not available when 'stream' is true",
                            param="prompt_logprobs")
    return k


def parse_completion_request(body: dict, max_model_len: int,
                             max_logprobs: int = MAX_LOGPROBS) -> CompletionRequest:
    model, stream, include_usage = _common(body)
    if "prompt" not in body:
        raise ProtocolError("'prompt' is required", param="prompt")
    prompts = _prompts(body["prompt"])
    if body.get("suffix") is not None:
        raise _unsupported("suffix", "suffix")
    logprobs = _int(body, "logprobs", None, 0, max_logprobs)
    echo = opt_bool(body, "echo")
    prompt_logprobs = _prompt_logprobs(body, stream, max_logprobs)
    max_tokens = _int(body, "max_tokens", 16)
    echo_only = echo and max_tokens == 0
    if max_tokens == 0 and not echo:
        raise ProtocolError("'max_tokens' must be >= 1 unless 'echo' is true (0 with echo "
                            "returns the prompt alone)", param="max_tokens")
    # With echo, the logprobs cover the prompt too: its tokens need the same top-k. Echo
    # without generation still runs the prefill and samples one token, which is dropped.
    engine_prompt_k = max((k for k in (prompt_logprobs, logprobs if echo else None)
                           if k is not None), default=None)
    params = _sampling_params(body, max_tokens=1 if echo_only else max_tokens,
                              max_tokens_param="max_tokens", logprobs=logprobs,
                              logprobs_param="logprobs", prompt_logprobs=engine_prompt_k)
    if len(prompts) * params.n > MAX_CHOICES:
        raise ProtocolError(f"at most {MAX_CHOICES} choices (prompts x n) per request",
                            param="n")
    for p in prompts:  # token-id prompts can be checked before tokenization
        if isinstance(p, list):
            check_context(len(p), params.max_tokens, max_model_len)
    return CompletionRequest(model, prompts, params, stream, include_usage, echo, echo_only,
                             prompt_logprobs)


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None and message["role"] == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise ProtocolError(f"messages[{i}].content: only text parts "
                                    "({'type': 'text', 'text': ...}) are supported",
                                    param="messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad("messages", "messages whose content is a string or a list of text parts", content)


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


def _messages(value) -> list[dict]:
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


def parse_chat_request(body: dict, max_logprobs: int = MAX_LOGPROBS) -> ChatRequest:
    model, stream, include_usage = _common(body)
    messages = _messages(body.get("messages"))
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _unsupported("response_format", "response_format other than text")
    logprobs = opt_bool(body, "logprobs")
    top_logprobs = _int(body, "top_logprobs", None, 0, max_logprobs)
    prompt_logprobs = _prompt_logprobs(body, stream, max_logprobs)
    if top_logprobs is not None and not logprobs:
        raise ProtocolError("'top_logprobs' requires 'logprobs' to be true",
                            param="top_logprobs")
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = _int(body, param, None)
    params = _sampling_params(body, max_tokens=max_tokens, max_tokens_param=param,
                              logprobs=(top_logprobs or 0) if logprobs else None,
                              logprobs_param="top_logprobs", prompt_logprobs=prompt_logprobs)
    return ChatRequest(model, messages, params, stream, include_usage, logprobs,
                       top_logprobs or 0, opt_bool(body, "add_generation_prompt", True), param,
                       prompt_logprobs)


def refused(e: RequestRefused) -> ProtocolError:
    """A core rule's refusal as an OpenAI 400."""
    return ProtocolError(str(e), param=e.param, code=e.code)


def check_context(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, *,
                  prompt_param: str = "prompt", max_tokens_param: str = "max_tokens") -> int:
    """Returns the effective max_tokens (what is left of the context when None)."""
    try:
        return fit_max_tokens(num_prompt_tokens, max_tokens, max_model_len,
                              prompt_param=prompt_param, max_tokens_param=max_tokens_param)
    except RequestRefused as e:
        raise refused(e) from None


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    try:
        request_checks.check_token_ids(ids, vocab_size, param)
    except RequestRefused as e:
        raise refused(e) from None


def check_request_token_ids(ids: list[int], params: SamplingParams, vocab_size: int) -> None:
    try:
        request_checks.check_request_token_ids(ids, params, vocab_size)
    except RequestRefused as e:
        raise refused(e) from None
