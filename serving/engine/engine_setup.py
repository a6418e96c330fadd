"""LLMEngine's set-up steps that are not its loop: the configuration checks made before any
weight loads, the KV cache's size (pages, longest request, buckets) once the weights are on
the device, and the one-line description the server logs."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from model.config import DTYPES, KV_CACHE_DTYPES, MOE_BACKENDS
from model.formats import PREQUANTIZED_METHODS
from quant.recipe import Recipe
from serving.core.buckets import Buckets
from serving.core.config import EngineConfig
from serving.core.kv_window import common_window, request_pages
from serving.engine import mesh, multiprocess, sizing
from serving.engine.kv_pools import WindowPool
from serving.engine.memory_plan import MemoryPlan

log = logging.getLogger("xlaserve")


def check_config(ec: EngineConfig) -> None:
    """Settings that are wrong whatever the model: refused before anything loads."""
    if ec.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {ec.kv_cache_dtype!r}; choose one of "
                         + ", ".join(KV_CACHE_DTYPES))
    if ec.mamba_ssm_cache_dtype not in ("auto", *DTYPES):
        raise ValueError(f"unknown mamba_ssm_cache_dtype {ec.mamba_ssm_cache_dtype!r}; "
                         "choose one of auto, " + ", ".join(DTYPES))
    if ec.moe_backend not in MOE_BACKENDS:
        raise ValueError(f"unknown moe_backend {ec.moe_backend!r}; choose one of "
                         + ", ".join(MOE_BACKENDS))
    if ec.quantize and ec.quantize not in PREQUANTIZED_METHODS:
        Recipe.parse(ec.quantize)  # a bad spec fails before the weights load
    if not (isinstance(ec.max_logprobs, int) and ec.max_logprobs >= 0):
        raise ValueError(f"max_logprobs must be a non-negative integer, got {ec.max_logprobs!r}")


@dataclass
class CachePlan:
    max_model_len: int
    num_pages: int
    window_num_pages: int
    window: int  # the sliding window every layer shares (0: none): pages go back early
    pool: WindowPool | None  # a hybrid model's window layers' own pool
    buckets: Buckets
    kv_cache_bytes: int  # over every device
    memory_plan: MemoryPlan | None  # on a GPU: what the memory holds


def plan_cache(engine, page_bytes: int) -> CachePlan:
    """The KV cache for an engine whose weights (and draft model, LoRA slots) are placed:
    on a GPU, what its memory leaves (memory_plan.py); elsewhere, from the flags."""
    ec = engine.config
    # A draft model reads its own K/V on the target's pages from position 0 on
    # (core/draft_proposer.py), so with one no page goes back early.
    window = 0 if engine.draft else common_window(engine.cfg.sliding_windows)
    seq_pages = request_pages(window, engine.max_num_batched_tokens, ec.page_size)
    # A hybrid model's window layers on a pool of their own (model/kv_groups.py); not
    # with a draft model (as above) nor over several processes.
    pool = (None if engine.draft or engine.cluster is not None else WindowPool.of(
        engine.cfg, engine.placement.model_cfg, ec.page_size, ec.kv_cache_dtype,
        engine.max_num_batched_tokens, ec.max_num_seqs))
    if pool:
        page_bytes = pool.full_page_bytes
        engine.runner.hybrid_kv = True
    plan = None
    limit = mesh.gpu_memory_limit(engine.placement)
    # tensor parallel: each device's share of the cache (a latent cache: all of it)
    split = 1 if getattr(engine.placement, "data_parallel", False) else engine.placement.size
    if limit:
        plan = sizing.gpu_plan(
            ec, engine.cfg, page_bytes,
            engine.device_weight_bytes() + (engine.draft.weight_bytes if engine.draft else 0)
            + engine.state_bytes,
            limit, engine._activation_peak, seq_pages, pool, devices=split)
        log.info("%s", plan.describe())
        max_model_len, num_pages, window_pages = (plan.max_model_len, plan.num_pages,
                                                  plan.window_pages)
    else:
        max_model_len = sizing.max_model_len(engine.cfg, ec.max_model_len)
        kv_dtype = engine.cfg.dtype if ec.kv_cache_dtype == "auto" else ec.kv_cache_dtype
        num_pages, window_pages = sizing.num_pages_hybrid(
            ec, page_bytes, pool, max_model_len, kv_dtype,
            devices=engine.placement.size * (
                1 if getattr(engine.placement, "data_parallel", False)
                else ec.data_parallel_size), seq_pages=seq_pages,
            layout=sizing.kv_layout(engine.cfg, split))
    if engine.cluster is not None:
        max_model_len, num_pages = multiprocess.agree(max_model_len, num_pages)
    buckets = sizing.buckets(ec, max_model_len, engine.max_num_batched_tokens,
                             engine.attention_backend)
    kv_bytes = (num_pages * page_bytes
                + (pool.bytes(window_pages) if pool else 0)) * engine.placement.size
    return CachePlan(max_model_len, num_pages, window_pages, window, pool, buckets, kv_bytes,
                     plan)


def describe(engine) -> str:
    ec, b = engine.config, engine.buckets
    return (f"model {engine.model_dir} ({engine.cfg.architecture}, {engine.cfg.dtype}), "
            f"weights {engine.weight_bytes / 2**20:.0f} MiB ({engine.quantization}), "
            f"KV cache {ec.kv_cache_dtype} "
            f"{engine.kv_cache_bytes / 2**20:.0f} MiB = {engine.num_pages - 1} pages of "
            f"{ec.page_size} tokens; attention {engine.attention_backend}; "
            f"max_model_len {engine.max_model_len}; buckets: "
            f"tokens {list(b.tokens)}, requests {list(b.requests)}, pages {list(b.pages)} "
            f"-> {len(engine.step_shapes)} programs; prefix caching "
            f"{'on' if ec.enable_prefix_caching else 'off'}"
            + (f"; speculative decoding {_spec_description(engine)}" if engine.drafter else "")
            + (f"; {engine.embedder.describe()}" if engine.embedder else "")
            + (f"; {engine.memory_plan.describe()}" if engine.memory_plan else ""))


def _spec_description(engine) -> str:
    c, draft = engine.speculative_config, engine.draft
    how = (f"lookup {c.prompt_lookup_min}-{c.prompt_lookup_max}" if draft is None
           else f"draft model {draft.model_dir} ({draft.cfg.architecture}, "
                f"{len(draft.shapes)} programs)")
    return (f"{c.method}, {c.num_speculative_tokens} tokens, {how}, off above "
            f"{c.disable_by_batch_size} running requests")
