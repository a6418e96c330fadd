"""Resolving the engine's sizes: which model folder, dtype, context length, buckets and how
many KV pages fit the memory budget (on a GPU through serving/engine/memory_plan.py)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from model.attention import FIXED_PAGE_TABLE
from model.config import DTYPES, ModelConfig
from serving.core.buckets import Buckets
from serving.core.config import EngineConfig, default_cache_root
from serving.core.model_source import resolve_model_source
from serving.engine import memory_plan
from serving.engine.kv_pools import WindowPool

log = logging.getLogger("xlaserve")
CPU_KV_MEMORY_FRACTION = 0.5  # of the memory available, for the default KV cache off-GPU
CPU_KV_CACHE_CAP = 4 << 30  # where the memory available is unknown
GIB = 1 << 30
CPU_MAX_MODEL_LEN = 2048  # the default cap off-GPU, where long contexts are slow anyway


def resolve_model_dir(model: str | None, tokenizer: str | None = None) -> Path:
    """The folder to load; with no model, the demo model, fetched and converted on first use.
    A GGUF file gets a folder of its own (model/formats/gguf_file.py)."""
    if model is not None:
        from model.formats.gguf_file import gguf_folder, is_gguf_path
        if is_gguf_path(model):
            return gguf_folder(model, tokenizer)
        return resolve_model_source(model)
    from model.checkpoint import convert_hf, is_checkpoint
    from model.demo import fetch_demo_model
    root = default_cache_root() / "demo"
    ckpt = root / "SmolLM2-135M-Instruct"
    if not is_checkpoint(ckpt):
        hf_dir = fetch_demo_model(root / "SmolLM2-135M-Instruct-hf")
        log.info("converting the demo model into %s", ckpt)
        try:
            convert_hf(hf_dir, ckpt, "float32")
        except OSError:
            if not is_checkpoint(ckpt):  # else a server started beside this one wrote it first
                raise
    return ckpt


def resolve_dtype(requested: str | None, model_dir: Path, on_gpu: bool) -> str | None:
    """The weights' and activations' dtype; None keeps the checkpoint's.

    "auto" (or None) as vLLM: the config's torch_dtype, except that a float32 model runs in
    bfloat16 on a GPU (tensor cores, half the bytes to read). Off-GPU, the checkpoint's."""
    if requested not in (None, "auto"):
        if requested not in DTYPES:
            raise ValueError(f"unknown dtype {requested!r}; choose auto or "
                             + ", ".join(DTYPES))
        return requested
    if not on_gpu:
        return None
    config = Path(model_dir) / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() else {}
    torch_dtype = hf.get("torch_dtype") or hf.get("dtype")
    return torch_dtype if torch_dtype in ("bfloat16", "float16") else "bfloat16"


def max_model_len(cfg: ModelConfig, requested: int | None, cap: int | None = CPU_MAX_MODEL_LEN
                  ) -> int:
    """requested, checked against the model; None: the model's context, at most `cap`."""
    if requested is None:
        return min(cfg.max_position_embeddings, cap or cfg.max_position_embeddings)
    if requested > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {requested} exceeds the model's context of "
                         f"{cfg.max_position_embeddings} tokens")
    return requested


# The Pallas kernel pads a step to 16 rows anyway (Triton's dot), so smaller token buckets
# on a GPU would only add programs.
GPU_MIN_TOKEN_BUCKET = 16


def buckets(ec: EngineConfig, max_len: int, max_batched: int, backend: str) -> Buckets:
    return Buckets.derive(ec.max_num_seqs, max_batched, max_len, ec.page_size,
                          tokens=ec.token_buckets, requests=ec.request_buckets,
                          pages=ec.page_buckets, fixed_pages=backend in FIXED_PAGE_TABLE,
                          min_tokens=GPU_MIN_TOKEN_BUCKET if backend == "pallas" else 1)


def kv_cache_memory(ec: EngineConfig) -> int | None:
    return None if ec.kv_cache_memory is None else memory_plan.parse_bytes(ec.kv_cache_memory)


def kv_layout(cfg: ModelConfig, devices: int) -> str:
    """What of the KV cache each of a tensor-parallel mesh's devices holds, for the plan
    and the start-up log: its KV heads, or a latent cache whole (it has no head axis:
    model/sharding.py). "" on one device."""
    if devices <= 1:
        return ""
    if cfg.latent:
        return f"the latent cache whole on each of {devices} devices"
    return (f"{max(cfg.num_kv_heads // devices, 1)} of {cfg.num_kv_heads} KV heads on each "
            f"of {devices} devices")


def gpu_plan(ec: EngineConfig, cfg: ModelConfig, page_bytes: int, weight_bytes: int,
             allocator_limit: int, activation_peak, seq_pages: int = 0,
             window: WindowPool | None = None, devices: int = 1) -> memory_plan.MemoryPlan:
    """The GPU memory plan. activation_peak(max_model_len) -> bytes of the largest step's
    temporaries for that context (compiled, not run). seq_pages: on a window model, the
    most pages a request holds however long (core/kv_window.request_pages); 0: no bound.
    devices: the tensor-parallel mesh's size (page_bytes and weight_bytes are one
    device's)."""
    longest = max_model_len(cfg, ec.max_model_len, cap=None)
    peak = activation_peak(longest)
    plan = memory_plan.plan_memory(
        device_bytes=memory_plan.device_total_bytes(allocator_limit),
        weight_bytes=weight_bytes, activation_bytes=peak, page_bytes=page_bytes,
        page_size=ec.page_size, model_max_len=longest, max_model_len=ec.max_model_len,
        gpu_memory_utilization=ec.gpu_memory_utilization, kv_cache_memory=kv_cache_memory(ec),
        seq_pages=seq_pages, window=window, kv_layout=kv_layout(cfg, devices))
    used = plan.weight_bytes + plan.activation_bytes + plan.kv_cache_bytes
    if used > allocator_limit:
        raise memory_plan.MemoryPlanError(
            f"the plan needs {used / memory_plan.GIB:.2f} GiB but XLA's allocator is limited "
            f"to {allocator_limit / memory_plan.GIB:.2f} GiB (XLA_PYTHON_CLIENT_MEM_FRACTION "
            f"{memory_plan.allocator_fraction()}); unset it or lower the memory options")
    if plan.max_model_len < longest:
        log.warning("max_model_len %d: the KV cache holds no more (the model's context is %d)",
                    plan.max_model_len, longest)
    return plan


def available_memory() -> int | None:
    """Bytes the OS says a new allocation can get without swapping (MemAvailable), or None
    where /proc/meminfo is missing."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def num_pages(ec: EngineConfig, bytes_per_page: int, max_len: int, kv_dtype: str = "",
              devices: int = 1, seq_pages: int = 0) -> int:
    """Off-GPU: pages (sink included) for kv_cache_memory bytes, or by default for
    max_num_seqs full sequences, at most CPU_KV_MEMORY_FRACTION of the memory available
    (after the weights loaded); at least one full sequence. Logs the size and why.

    devices: tensor parallel, the devices sharing the host's memory; bytes_per_page and
    kv_cache_memory are then one device's, the memory available is split between them.
    seq_pages: on a window model, the most pages a request holds however long it grows."""
    return num_pages_hybrid(ec, bytes_per_page, None, max_len, kv_dtype, devices,
                            seq_pages)[0]


def num_pages_hybrid(ec: EngineConfig, bytes_per_page: int, window: WindowPool | None,
                     max_len: int, kv_dtype: str = "", devices: int = 1,
                     seq_pages: int = 0, layout: str = "") -> tuple[int, int]:
    """num_pages, for a hybrid model (serving/engine/kv_pools.py): -> (full-attention
    layers' pages, window layers' pages), both with their sink page; bytes_per_page is then
    the full layers' page. Without a window pool, (pages, 0). layout: kv_layout's words,
    logged."""
    budget = kv_cache_memory(ec)
    per_seq = memory_plan.sequence_pages(max_len, ec.page_size, seq_pages)
    if budget is not None:
        why = "kv_cache_memory"
    else:
        wanted = ec.max_num_seqs * per_seq * bytes_per_page
        wanted += window.bytes(window.wanted_pages) if window else 0
        free = available_memory()
        cap = int(free * CPU_KV_MEMORY_FRACTION) // devices if free else CPU_KV_CACHE_CAP
        budget = min(wanted, cap)
        why = f"max_num_seqs {ec.max_num_seqs} x max_model_len {max_len}"
        if budget < wanted:
            why += (f", capped at {CPU_KV_MEMORY_FRACTION:.0%} of the {free / GIB:.1f} GiB "
                    "available" if free else
                    f", capped at {cap / GIB:.0f} GiB (memory available unknown)")
    window_pages = window.pages_within(budget) if window else 0
    if window:
        budget -= window.bytes(window_pages)
        log.info("KV cache of the window layers: %.2f GiB, %d pages of %d tokens",
                 window.bytes(window_pages) / GIB, window_pages, ec.page_size)
    pages = int(max(budget, 0) // bytes_per_page)
    if pages < per_seq:
        raise ValueError(f"a KV cache of {int(budget) >> 20} MiB holds {pages} pages of "
                         f"{ec.page_size} tokens, fewer than one sequence of max_model_len "
                         f"{max_len} holds at once ({per_seq}); raise kv_cache_memory or "
                         "lower max_model_len")
    log.info("KV cache%s%s: %.2f GiB%s, %d pages of %d tokens (%d full sequences), for %s",
             " of the full-attention layers" if window else "",
             f" ({kv_dtype})" if kv_dtype else "", pages * bytes_per_page / GIB,
             f" on each of {devices} devices" if devices > 1 else "", pages, ec.page_size,
             pages // per_seq, why + (f"; {layout}" if layout else ""))
    return pages + 1, window_pages
