"""The rules a request must pass before it can run, each in one place: the HTTP layer calls
them to answer 400 before anything is queued, the engine and the scheduler call them for
every request (the offline API included). No JAX."""
from __future__ import annotations

from serving.core.sampling_params import SamplingParams


class RequestRefused(ValueError):
    """A request that can never run. `param` names the field at fault (an OpenAI 400's
    `param`), `code` the OpenAI error code where one exists."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


def check_token_ids(ids, vocab_size: int, param: str) -> None:
    """Token ids are ints in [0, vocab_size): rows of the embedding that the tokenizer knows."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestRefused(f"token id {bad} in '{param}' is outside the vocabulary "
                             f"(size {vocab_size})", param=param)


def check_request_token_ids(prompt_token_ids: list[int], params: SamplingParams,
                            vocab_size: int) -> None:
    check_token_ids(prompt_token_ids, vocab_size, "prompt")
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    check_token_ids(params.logit_bias, vocab_size, "logit_bias")


def check_logprobs(params: SamplingParams, max_logprobs: int) -> None:
    """Top logprobs per token (output and prompt) stay within the engine's --max-logprobs:
    every compiled step computes that many."""
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > max_logprobs:
            raise RequestRefused(f"{name} must be at most {max_logprobs} (--max-logprobs), "
                                 f"got {k}", param=name)


def fit_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, *,
                   prompt_param: str = "prompt", max_tokens_param: str = "max_tokens") -> int:
    """The context length rule: the prompt leaves room for at least one output token, and
    prompt + max_tokens fit max_model_len. Returns the effective max_tokens (what is left of
    the context when max_tokens is None)."""
    if num_prompt_tokens == 0:
        raise RequestRefused("the prompt is empty", param=prompt_param)
    if num_prompt_tokens >= max_model_len:
        raise RequestRefused(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {num_prompt_tokens} tokens, which leaves no room for a completion.",
            param=prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + max_tokens > max_model_len:
        raise RequestRefused(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for the completion). Please reduce the prompt or "
            f"{max_tokens_param}.", param=max_tokens_param, code="context_length_exceeded")
    return max_tokens


def fit_pooling_prompt(num_prompt_tokens: int, max_model_len: int, *,
                       prompt_param: str = "input") -> None:
    """The context length rule for embeddings: the prompt is all, so it may fill the context
    (no room for an output token needed)."""
    if num_prompt_tokens == 0:
        raise RequestRefused("the input is empty", param=prompt_param)
    if num_prompt_tokens > max_model_len:
        raise RequestRefused(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"input has {num_prompt_tokens} tokens. Please reduce the length of the input.",
            param=prompt_param, code="context_length_exceeded")
