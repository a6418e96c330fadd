"""SpeculativeConfig: `--speculative-config JSON` / `speculative_config=`, with vLLM's keys.
Plain data, no JAX. A bad config is a ValueError at start-up that names the key."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from serving.core.model_source import is_model_id
from serving.core.json_option import json_object

# "mtp" (and its older name "deepseek_mtp"): the model's own next-n prediction layers
# (serving/engine/mtp_drafter.py)
METHODS = ("ngram", "draft_model", "mtp", "deepseek_mtp")
# Speculation is switched off for a step with more running requests than this: verifying k
# extra tokens per request stops being nearly free once a step is no longer bound by reading
# the weights (docs/architecture.md, "Speculative decoding").
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
MAX_SPECULATIVE_TOKENS = 16

_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "model", "disable_by_batch_size"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: tokens proposed per request per step
    # ngram: the longest and shortest suffix looked up. A one-token suffix recurs all the
    # time in free text and proposes mostly wrong tokens: 2-4 measured best
    # (docs/benchmarks.md, "Speculative decoding").
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None  # draft_model: its folder (same tokenizer, same page size)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A JSON object (text or a dict), or None / "" for no speculation."""
        if value is None or value == "" or isinstance(value, SpeculativeConfig):
            return value or None
        value = json_object(value, "speculative_config", _KEYS)
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**value)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; choose one "
                             f"of {', '.join(METHODS)}")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                    "disable_by_batch_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {key} must be a positive integer, "
                                 f"got {v!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be at most "
                             f"{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative_config: prompt_lookup_min "
                             f"({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method != "draft_model" and self.model is not None:
            raise ValueError(f"speculative_config: 'model' is for method draft_model, not "
                             f"{self.method}")
        if self.method == "draft_model":
            if not self.model or not isinstance(self.model, str):
                raise ValueError("speculative_config: method draft_model needs 'model', the "
                                 "draft model's folder")
            if not (Path(self.model).expanduser().is_dir() or is_model_id(self.model)):
                raise ValueError(f"speculative_config: the draft model folder {self.model!r} "
                                 "does not exist")
