"""Request: one generation's tokens and scheduling state, as the scheduler sees it. No JAX."""
from __future__ import annotations

import enum
import struct
import sys
import time
from dataclasses import dataclass, field

from serving.core.sampling_params import SamplingParams

# An output token sampled by a step still running on the device (async scheduling,
# Scheduler.update_ahead): it holds the token's place until Scheduler.resolve writes it.
PLACEHOLDER_TOKEN = -1


# Request.sampling_row's fields, in their order; padding rows send PAD_SAMPLING_ROW
SAMPLING_ROW = ("temperature", "repetition_penalty", "presence_penalty", "frequency_penalty",
                "top_p", "min_p", "top_k", "seed", "num_prompt", "has_bias", "has_logprobs")


def sampling_row(**values) -> bytes:
    """SAMPLING_ROW's values as little-endian float64s (which hold every int32 and uint32
    exactly)."""
    return struct.pack(f"<{len(SAMPLING_ROW)}d", *(values[name] for name in SAMPLING_ROW))


# greedy, unfiltered, unpenalised
PAD_SAMPLING_ROW = sampling_row(
    temperature=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
    top_p=1.0, min_p=0.0, top_k=0, seed=0, num_prompt=0, has_bias=False, has_logprobs=False)


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # not yet admitted, or preempted (then it recomputes its tokens)
    RUNNING = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI finish_reason for a finished status ("stop", "length", "abort"), else None."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    seed: int = 0  # sampling seed: the params' seed, or one the engine drew for this request

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string; None for EOS
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # time.monotonic(), for metrics
    first_token_time: float | None = None
    grammar: object | None = None  # core.grammar.GrammarMatcher of a constrained request
    # Tokens a proposer guesses follow the last one; the next step verifies them (then they
    # are cleared). Never part of the request's tokens until the target model accepts them.
    spec_token_ids: list[int] = field(default_factory=list)
    # An embedding request (core/pooling_params.py): prefill only; it finishes when its
    # prompt is computed, emits no token and leaves nothing in the prefix cache.
    pooling_params: object | None = None
    # A LoRA request's adapter (serving/lora/peft.py Adapter: weights and digest); None: base
    lora: object | None = None
    # Prefill/decode disaggregation (serving/kv_transfer/): leading prompt tokens whose K/V
    # another instance computed, to load before this request runs (0 once loaded or given
    # up); and what a prefill's response tells the decode instance
    remote_tokens: int = 0
    kv_transfer_params: dict | None = None

    def __post_init__(self):
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.eos_token_ids = frozenset(self.eos_token_ids)
        # What a step's sampled row sends for this request and never changes, packed once
        # (serving/engine/input_prep.py joins a step's rows into one table). Set here, with
        # the other attributes, so every Request keeps one attribute layout.
        p = self.sampling_params
        self.sampling_row = sampling_row(
            temperature=p.temperature, repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            top_p=p.top_p, min_p=p.min_p, top_k=p.top_k, seed=self.seed,
            num_prompt=len(self.prompt_token_ids), has_bias=bool(p.logit_bias),
            has_logprobs=p.logprobs is not None)

    @property
    def lora_key(self) -> str | None:
        """The adapter's identity (a digest of its config and weights), None for the base."""
        return None if self.lora is None else self.lora.digest

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def slice_token_ids(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without copying the whole sequence (decode asks for 1 token)."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def max_tokens(self) -> int:
        """sampling_params.max_tokens; None means no cap of its own (max_model_len still applies)."""
        m = self.sampling_params.max_tokens
        return sys.maxsize if m is None else m

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
