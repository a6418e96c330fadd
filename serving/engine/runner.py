"""ModelRunner: owns the weights and the KV cache, compiles one step program per bucket shape,
and runs steps: forward over the paged cache, then on-device sampling, cache donated."""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial

import jax
import numpy as np
from tqdm import tqdm

from model.batch import Batch
from model.config import ModelConfig
from model.kv_cache import KVCache
from model.runtime_params import prepare_params
from model.transformer import forward
from serving.engine.input_prep import StepArrays
from serving.engine.sampler import SampleOutput, SamplingInputs, sample

log = logging.getLogger("xlaserve")


def _step(params, cache, buffers, bitmask, *, layout, cfg: ModelConfig, backend: str,
          vocab_size: int):
    batch, sampling = _unpack(buffers, layout)
    logits, cache = forward(params, cache, Batch(**batch), cfg, backend)
    # Only ids the tokenizer has are sampled: padded embedding rows are never drawn.
    logits = logits[:, :vocab_size]
    return sample(logits, SamplingInputs(**sampling, token_bitmask=bitmask)), cache


# A step's ~24 small input arrays travel as one flat buffer per dtype: each host-to-device
# transfer costs tens of microseconds of host time, which a one-stream decode step on a CPU
# (about 11 ms for SmolLM2) pays in full. `layout` (static, one per bucket shape) says where
# each array lies: ((group, name, dtype, shape, offset), ...).

def _pack(arrays: StepArrays):
    """-> (flat buffers, one per dtype; layout)."""
    named = [("batch", k, v) for k, v in arrays.batch.items()]
    named += [("sampling", k, v) for k, v in arrays.sampling.items()]
    dtypes = sorted({np.dtype(v.dtype).str for _, _, v in named})
    buffers, layout = [], []
    for dt in dtypes:
        parts = [(g, k, np.asarray(v)) for g, k, v in named if np.dtype(v.dtype).str == dt]
        offset = 0
        for g, k, v in parts:
            layout.append((g, k, dt, v.shape, offset))
            offset += v.size
        buffers.append(np.concatenate([v.reshape(-1) for _, _, v in parts]))
    return tuple(buffers), tuple(layout)


def _unpack(buffers, layout):
    by_dtype = {np.dtype(b.dtype).str: b for b in buffers}
    out = {"batch": {}, "sampling": {}}
    for group, name, dt, shape, offset in layout:
        size = int(np.prod(shape, dtype=np.int64))
        out[group][name] = by_dtype[dt][offset:offset + size].reshape(shape)
    return out["batch"], out["sampling"]


@dataclass
class StepResult:
    tokens: np.ndarray  # i32[R]
    logprob: np.ndarray | None = None  # f32[R]
    top_ids: np.ndarray | None = None  # i32[R, NUM_TOP_LOGPROBS]
    top_logprobs: np.ndarray | None = None


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, *, num_pages: int, page_size: int,
                 attention_backend: str = "reference", kv_cache_dtype: str | None = None,
                 vocab_size: int | None = None):
        """vocab_size: the ids sampling may produce (the tokenizer's); default: every row."""
        self.cfg = cfg
        self.vocab_size = vocab_size or cfg.vocab_size
        self.bitmask_width = (self.vocab_size + 31) // 32
        self._no_bitmask: dict[int, jax.Array] = {}  # all tokens allowed, per request bucket
        self.params = prepare_params(params)
        self.cache = KVCache.zeros(cfg, num_pages, page_size, kv_cache_dtype)
        self.backend = attention_backend
        self._jitted = jax.jit(partial(_step, cfg=cfg, backend=attention_backend,
                                       vocab_size=self.vocab_size),
                               donate_argnums=(1,), static_argnames=("layout",))
        self._compiled: dict[tuple[int, int, int], object] = {}

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def compile(self, shape: tuple[int, int, int], example: StepArrays) -> float:
        """Compiles (or loads from the persistent cache) the program of one bucket shape."""
        started = time.perf_counter()
        buffers, layout = _pack(example)
        self._compiled[shape] = (self._jitted.lower(
            self.params, self.cache, buffers, self._bitmask(example), layout=layout).compile(),
            layout)
        return time.perf_counter() - started

    def warmup(self, examples: list[StepArrays], progress: bool = True,
               workers: int | None = None) -> list[float]:
        """Compiles every shape before serving, `workers` programs at a time (default: one per
        CPU core; XLA compiles a program on one thread). Returns the seconds each took."""
        workers = workers or os.cpu_count() or 1
        started = time.perf_counter()
        seconds = [0.0] * len(examples)
        bar = tqdm(total=len(examples), desc="warm-up", unit="program", disable=not progress)
        with ThreadPoolExecutor(workers, thread_name_prefix="xlaserve-compile") as pool:
            futures = {pool.submit(self.compile, ex.shape, ex): i for i, ex in enumerate(examples)}
            for done in as_completed(futures):
                i, shape = futures[done], examples[futures[done]].shape
                seconds[i] = done.result()
                bar.update()
                bar.set_postfix_str(f"T={shape[0]} R={shape[1]} P={shape[2]} {seconds[i]:.1f}s")
        bar.close()
        log.info("compiled %d step programs in %.1f s (%d at a time)", len(examples),
                 time.perf_counter() - started, workers)
        return seconds

    def dispatch(self, arrays: StepArrays):
        """Launches one step without waiting for it; returns a handle for `fetch`."""
        compiled = self._compiled.get(arrays.shape)
        if compiled is None:
            raise RuntimeError(f"step shape {arrays.shape} was not compiled at warm-up")
        program, layout = compiled
        buffers, got = _pack(arrays)
        if got != layout:
            raise RuntimeError(f"step arrays of shape {arrays.shape} do not match its program")
        out, self.cache = program(self.params, self.cache, jax.device_put(buffers),
                                  self._bitmask(arrays))
        out.tokens.copy_to_host_async()
        if arrays.wants_logprobs:
            for a in (out.logprob, out.top_ids, out.top_logprobs):
                a.copy_to_host_async()
        return out, arrays.wants_logprobs

    def _bitmask(self, arrays: StepArrays):
        """The step's bitmask, or (no constrained row) a resident one: nothing to send."""
        if arrays.bitmask is not None:
            return jax.device_put(arrays.bitmask)
        R = arrays.shape[1]
        if R not in self._no_bitmask:
            self._no_bitmask[R] = jax.device_put(np.full((R, self.bitmask_width), -1, np.int32))
        return self._no_bitmask[R]

    @staticmethod
    def fetch(handle) -> StepResult:
        out, wants_logprobs = handle
        out: SampleOutput
        if not wants_logprobs:
            return StepResult(np.asarray(out.tokens))
        return StepResult(*(np.asarray(a) for a in (out.tokens, out.logprob, out.top_ids,
                                                    out.top_logprobs)))


def enable_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache: a restart loads programs instead of compiling."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def device_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")
