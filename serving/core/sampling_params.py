"""SamplingParams: how one request is sampled and when it stops (vLLM's field names). No JAX."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from serving.core.structured_outputs import StructuredOutputsParams

# OpenAI allows at most this many logit_bias entries and at most 20 top logprobs; the
# engine's max_logprobs (--max-logprobs) moves the cap on top logprobs, 20 by default.
MAX_LOGIT_BIAS = 300
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: no logprobs; k: the sampled token's plus the top k
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    # Keeps this request's prefix-cache entries apart from requests with another salt.
    cache_salt: str | None = None
    min_tokens: int = 0  # no EOS or stop token before this many output tokens
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding
    # vLLM's P/D handshake, passed through to the connector (serving/kv_transfer/params.py)
    kv_transfer_params: dict | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        def check(ok: bool, name: str, rule: str):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        def finite(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        check(isinstance(self.n, int) and 1 <= self.n <= 128, "n", "an integer in [1, 128]")
        check(finite(self.temperature) and 0.0 <= self.temperature <= 100.0,
              "temperature", "in [0, 100]")
        check(finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "-1, 0 or positive")
        check(finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
              "seed", "an integer")
        check(self.max_tokens is None or (isinstance(self.max_tokens, int)
                                          and self.max_tokens >= 1),
              "max_tokens", "a positive integer")
        check(all(isinstance(s, str) and s for s in self.stop), "stop",
              "a non-empty string or a list of them")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", "a list of token ids")
        check(finite(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
              "presence_penalty", "in [-2, 2]")
        check(finite(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
              "frequency_penalty", "in [-2, 2]")
        check(finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
              "repetition_penalty", "in (0, 2]")
        check(len(self.logit_bias) <= MAX_LOGIT_BIAS and all(
            k >= 0 and math.isfinite(v) and -100.0 <= v <= 100.0
            for k, v in self.logit_bias.items()),
            "logit_bias", f"at most {MAX_LOGIT_BIAS} token ids mapped to values in [-100, 100]")
        # The upper bound is the engine's max_logprobs, checked when the request is added.
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (isinstance(value, int) and not isinstance(value, bool)
                                    and value >= 0), name, "None or a non-negative integer")
        check(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt),
              "cache_salt", "a non-empty string")
        check(isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
              and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
              "min_tokens", "an integer in [0, max_tokens]")
        check(self.structured_outputs is None
              or isinstance(self.structured_outputs, StructuredOutputsParams),
              "structured_outputs", "a StructuredOutputsParams")
