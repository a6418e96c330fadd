"""EngineConfig: every engine option, named like the CLI flags. Plain data, no JAX."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path


def default_cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xlaserve"


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint or HF folder; None: the demo model
    dtype: str | None = None  # weights and activations; None: the checkpoint's
    load_format: str = "auto"  # "dummy": random weights from config.json (for benchmarks)
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's, capped at 2048
    max_num_batched_tokens: int | None = None  # per-step token budget; None: 512
    page_size: int = 16
    # KV cache size: bytes (> 1) or a fraction of free device memory (<= 1); None: on GPU 0.9
    # of what the weights leave, on CPU enough for max_num_seqs full sequences, at most 4 GiB.
    kv_cache_memory: float | None = None
    attention_backend: str = "auto"
    # Weights: None keeps the checkpoint's (a quantized checkpoint loads quantized); "int8",
    # "fp8" or a recipe spec (quant/recipe.py) quantizes an unquantized model as it loads.
    quantize: str | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype), a float dtype, or "int8" / "fp8"
    token_buckets: tuple[int, ...] | None = None
    request_buckets: tuple[int, ...] | None = None
    page_buckets: tuple[int, ...] | None = None
    # compiled step programs are saved under <this>/executables (engine/executable_cache.py)
    compilation_cache_dir: str | None = field(
        default_factory=lambda: str(default_cache_root() / "jax-cache"))
    seed: int = 0  # draws the seeds of requests that bring none
    progress: bool = True

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)
