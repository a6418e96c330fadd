"""OpenAI request parsing and validation (responses: serving/openai/responses.py). Pure Python:
no aiohttp, no JAX.

Validation is strict about types (a bool is not an int, NaN and infinities are rejected, a
string is never coerced) and lenient about unknown fields, which are ignored as OpenAI and
vLLM do. Every rejection is a ProtocolError carrying the HTTP status and OpenAI's error
envelope; the server turns it into a response.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from serving.core import request_checks
from serving.core.request_checks import RequestRefused, fit_max_tokens
from serving.core.sampling_params import MAX_LOGPROBS, SamplingParams
from serving.openai import structured_protocol
from serving.openai.chat_messages import parse_messages
# ProtocolError, opt_bool, opt_str and token_id_list: the server reads them from here too.
from serving.openai.fields import (ProtocolError, bad, int_field, number_field, opt_bool,  # noqa: F401
                                   opt_str, token_id_list, unsupported)

MAX_STOP_STRINGS = 16
MAX_CHOICES = 256  # prompts x n per request: bounds what one request can queue
MAX_TOP_K = 2 ** 31 - 1  # the sampler's top_k is int32; larger means "off" anyway
# ASCII digits only ("²".isdigit() is true, int("²") fails) and few of them (int() refuses
# thousands); any id this long is outside every vocabulary and is refused later anyway.
_TOKEN_ID_KEY = re.compile(r"\s*[0-9]{1,18}\s*")

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
        raise bad("stop", f"a non-empty string or a list of at most {MAX_STOP_STRINGS}", value)
    return list(value)


def _stop_token_ids(body: dict) -> list[int]:
    value = body.get("stop_token_ids")
    if value is None:
        return []
    if (ids := token_id_list(value)) is None:
        raise bad("stop_token_ids", "a list of token ids", value)
    return ids


def _logit_bias(body: dict) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("logit_bias", "an object mapping token ids to numbers", value)
    bias = {}
    for key, v in value.items():
        if not (isinstance(key, str) and _TOKEN_ID_KEY.fullmatch(key)):
            raise bad("logit_bias", "keyed by token ids (as strings)", key)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            raise bad("logit_bias", "an object mapping token ids to finite numbers", v)
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
        raise bad("stream_options", "an object", options)
    return opt_bool(options, "include_usage") if "include_usage" in options else False


def _kv_transfer_params(body: dict) -> dict | None:
    """vLLM's P/D handshake (serving/kv_transfer/params.py): an object, passed through."""
    value = body.get("kv_transfer_params")
    if value is not None and not isinstance(value, dict):
        raise bad("kv_transfer_params", "an object", value)
    return value


def _sampling_params(body: dict, *, max_tokens, max_tokens_param: str, logprobs,
                     logprobs_param: str, prompt_logprobs: int | None = None) -> SamplingParams:
    """The fields both endpoints share. Types are checked here, ranges by SamplingParams."""
    seed = int_field(body, "seed", None, -(2 ** 63), 2 ** 64 - 1)
    n = int_field(body, "n", 1)
    if int_field(body, "best_of", n) != n:
        raise unsupported("best_of", "best_of different from n")
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        if opt_bool(body, name, True) is False:
            raise unsupported(name, f"{name}=false")
    kwargs = dict(
        n=n, seed=seed, max_tokens=max_tokens, stop=_stop(body),
        stop_token_ids=_stop_token_ids(body), logit_bias=_logit_bias(body), logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        temperature=number_field(body, "temperature", 1.0), top_p=number_field(body, "top_p", 1.0),
        top_k=int_field(body, "top_k", 0, -1, MAX_TOP_K), min_p=number_field(body, "min_p", 0.0),
        presence_penalty=number_field(body, "presence_penalty", 0.0),
        frequency_penalty=number_field(body, "frequency_penalty", 0.0),
        repetition_penalty=number_field(body, "repetition_penalty", 1.0),
        ignore_eos=opt_bool(body, "ignore_eos"),
        include_stop_str_in_output=opt_bool(body, "include_stop_str_in_output"),
        cache_salt=opt_str(body, "cache_salt"), kv_transfer_params=_kv_transfer_params(body),
        **structured_protocol.sampling_fields(body))
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        param = {"max_tokens": max_tokens_param, "logprobs": logprobs_param}.get(name, name)
        raise ProtocolError(str(e).replace(name, param, 1), param=param) from None
    if params.n > MAX_CHOICES:
        raise bad("n", f"at most {MAX_CHOICES}", params.n)
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
    k = int_field(body, "prompt_logprobs", None, 0, max_logprobs)
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
        raise unsupported("suffix", "suffix")
    structured_protocol.check_extras(body, "completion")
    logprobs = int_field(body, "logprobs", None, 0, max_logprobs)
    echo = opt_bool(body, "echo")
    prompt_logprobs = _prompt_logprobs(body, stream, max_logprobs)
    max_tokens = int_field(body, "max_tokens", 16)
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


def parse_chat_request(body: dict, max_logprobs: int = MAX_LOGPROBS) -> ChatRequest:
    model, stream, include_usage = _common(body)
    messages = parse_messages(body.get("messages"))
    structured_protocol.check_extras(body, "chat")
    logprobs = opt_bool(body, "logprobs")
    top_logprobs = int_field(body, "top_logprobs", None, 0, max_logprobs)
    prompt_logprobs = _prompt_logprobs(body, stream, max_logprobs)
    if top_logprobs is not None and not logprobs:
        raise ProtocolError("'top_logprobs' requires 'logprobs' to be true",
                            param="top_logprobs")
    param = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    max_tokens = int_field(body, param, None)
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
