"""EngineConfig: every engine option, named like the CLI flags. Plain data, no JAX."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path


def default_cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "xlaserve"


@dataclass
class EngineConfig:
    # checkpoint or HF folder, or an HF model id (org/name) in the local HF cache; None: the
    # demo model
    model: str | None = None
    # a folder whose tokenizer files replace the model's (vLLM's --tokenizer); for a GGUF file
    # instead of the tokenizer rebuilt from its metadata
    tokenizer: str | None = None
    # weights and activations; "auto"/None: the config's, but bfloat16 for a float32 model on a
    # GPU (vLLM's rule); off-GPU the checkpoint's
    dtype: str | None = "auto"
    load_format: str = "auto"  # "dummy": random weights from config.json (for benchmarks)
    max_num_seqs: int = 64
    # None: on a GPU the model's whole context if the KV cache holds one sequence of it (else
    # as much as it holds); off-GPU the model's, capped at 2048
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None  # per-step token budget; None: 512
    page_size: int = 16
    # GPU: the fraction of the device's total memory for weights + the largest step's
    # activations + the KV cache (vLLM's meaning); the KV cache gets the rest
    gpu_memory_utilization: float = 0.9
    # KV cache size in bytes (an int, or "20GiB"), instead of what gpu_memory_utilization
    # leaves; None: on GPU that, off-GPU enough for max_num_seqs full sequences, at most half
    # the memory available (serving/engine/sizing.py)
    kv_cache_memory: int | str | None = None
    attention_backend: str = "auto"
    # Weights: None or "none" keeps the checkpoint's (a quantized checkpoint loads quantized);
    # "int8", "fp8" or a recipe spec (quant/recipe.py) quantizes an unquantized model as it
    # loads; "auto": the checkpoint's, but int4:lm_head for the demo model on a CPU
    # (serving/engine/demo_defaults.py)
    quantize: str | None = "auto"
    # "auto" (the model's dtype; float16 for the demo model on a CPU), a float dtype, or
    # "int8" / "fp8"
    kv_cache_dtype: str = "auto"
    # A linear-attention hybrid's recurrent state (vLLM's --mamba-ssm-cache-dtype): "auto"
    # (config.json's mamba_ssm_dtype, else float32) or a float dtype
    mamba_ssm_cache_dtype: str = "auto"
    token_buckets: tuple[int, ...] | None = None
    request_buckets: tuple[int, ...] | None = None
    page_buckets: tuple[int, ...] | None = None
    # None or "": no persistent cache; else compiled step programs are saved under
    # <this>/executables (serving/engine/executable_cache.py)
    compilation_cache_dir: str | None = field(
        default_factory=lambda: str(default_cache_root() / "jax-cache"))
    seed: int = 0  # draws the seeds of requests that bring none
    max_logprobs: int = 20  # cap on logprobs and prompt_logprobs per token (vLLM's name)
    enable_prefix_caching: bool = True  # reuse the K/V of prompt prefixes seen before
    # schedule and launch step N+1 while step N runs on the device (vLLM's flag;
    # serving/engine/step_ahead.py); steps with grammars, penalties or speculation wait
    async_scheduling: bool = True
    # speculative decoding, vLLM's keys (JSON text or a dict; core/spec_config.py); None: off
    speculative_config: str | dict | None = None
    # devices one model is split over (tensor parallel, docs/architecture.md): the first N
    tensor_parallel_size: int = 1
    # a mixture of experts' experts split whole over those devices rather than each expert
    # split like the MLP (vLLM's --enable-expert-parallel; model/sharding.py)
    enable_expert_parallel: bool = False
    # a mixture of experts' grouped matmuls (model.config.MOE_BACKENDS, quant/ops.py
    # grouped_matmul): "auto" takes our Pallas kernel on NVIDIA GPUs, where XLA compiles
    # ragged_dot into a dense dot over every expert; "ragged_dot" or "pallas" everywhere
    moe_backend: str = "auto"
    # data parallelism in one server (vLLM's -dp; serving/engine/data_parallel.py): this
    # replica's rank among data_parallel_size, its devices the rank-th group of
    # tensor_parallel_size after the first
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # KV cache events for KV-aware routers, vLLM's keys (JSON text or a dict;
    # core/kv_events_config.py); None: off
    kv_events_config: str | dict | None = None
    # prefill/decode disaggregation, vLLM's keys (JSON text or a dict;
    # serving/kv_transfer/config.py); None: off
    kv_transfer_config: str | dict | None = None
    # several processes, one model (jax.distributed's names; serving/engine/multiprocess.py):
    # process 0's HOST:PORT, how many processes, and this one's id (0 serves HTTP)
    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0
    # "generate", or "embed": an embedding model (/v1/embeddings, LLM.embed); vLLM's names
    # (core/pooling_params.py). runner "pooling" (vLLM's newer flag) means task "embed".
    task: str = "generate"
    runner: str | None = None
    # embed: how hidden states become a vector, vLLM's keys (JSON text or a dict:
    # pooling_type LAST | MEAN | CLS, normalize); None: the model folder's
    # sentence-transformers files, else LAST with normalize
    pooler_config: str | dict | None = None
    # LoRA adapters (vLLM's flags; serving/lora/): off unless enable_lora; max_loras
    # adapters in one step, each of rank <= max_lora_rank; max_cpu_loras parsed adapters
    # kept on the host (None: max_loras)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    progress: bool = True

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)
