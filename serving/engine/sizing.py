"""Resolving the engine's sizes: which model folder, context length, token budget, buckets and
how many KV pages fit the memory budget."""
from __future__ import annotations

import logging
from pathlib import Path

from model.attention import FIXED_PAGE_TABLE
from model.config import ModelConfig
from serving.core.buckets import Buckets
from serving.core.config import EngineConfig, default_cache_root

log = logging.getLogger("xlaserve")
CPU_KV_CACHE_CAP = 4 << 30
GPU_KV_CACHE_FRACTION = 0.9


def resolve_model_dir(model: str | None) -> Path:
    """The folder to load; with no model, the demo model, fetched and converted on first use."""
    if model is not None:
        return Path(model)
    from model.checkpoint import convert_hf, is_checkpoint
    from model.demo import fetch_demo_model
    root = default_cache_root() / "demo"
    ckpt = root / "SmolLM2-135M-Instruct"
    if not is_checkpoint(ckpt):
        hf_dir = fetch_demo_model(root / "SmolLM2-135M-Instruct-hf")
        log.info("converting the demo model into %s", ckpt)
        convert_hf(hf_dir, ckpt, "float32")
    return ckpt


def max_model_len(cfg: ModelConfig, requested: int | None) -> int:
    if requested is None:
        return min(cfg.max_position_embeddings, 2048)
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


def num_pages(ec: EngineConfig, bytes_per_page: int, max_len: int, weight_bytes: int,
              device_bytes: int | None, on_gpu: bool) -> int:
    """Pages (sink included) that fit the KV cache budget; at least one full sequence."""
    budget = ec.kv_cache_memory
    if budget is not None and budget <= 1:
        if device_bytes is None:
            raise ValueError("kv_cache_memory as a fraction needs a device that reports memory")
        budget = budget * (device_bytes - weight_bytes)
    elif budget is None:
        if on_gpu and device_bytes:
            budget = GPU_KV_CACHE_FRACTION * (device_bytes - weight_bytes)
        else:
            pages_for_all = ec.max_num_seqs * -(-max_len // ec.page_size)
            budget = min(CPU_KV_CACHE_CAP, pages_for_all * bytes_per_page)
    pages = int(budget // bytes_per_page)
    needed = -(-max_len // ec.page_size)
    if pages < needed:
        raise ValueError(f"a KV cache of {int(budget) >> 20} MiB holds {pages} pages of "
                         f"{ec.page_size} tokens, fewer than one sequence of max_model_len "
                         f"{max_len} needs ({needed}); raise kv_cache_memory or lower "
                         "max_model_len")
    return pages + 1
