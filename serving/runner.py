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
from serving.input_prep import StepArrays
from serving.sampler import SampleOutput, SamplingInputs, sample

log = logging.getLogger("xlaserve")


def _step(params, cache, batch, sampling, *, cfg: ModelConfig, backend: str):
    logits, cache = forward(params, cache, batch, cfg, backend)
    return sample(logits, sampling), cache


@dataclass
class StepResult:
    tokens: np.ndarray  # i32[R]
    logprob: np.ndarray | None = None  # f32[R]
    top_ids: np.ndarray | None = None  # i32[R, NUM_TOP_LOGPROBS]
    top_logprobs: np.ndarray | None = None


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, *, num_pages: int, page_size: int,
                 attention_backend: str = "reference", kv_cache_dtype: str | None = None):
        self.cfg = cfg
        self.params = prepare_params(params)
        self.cache = KVCache.zeros(cfg, num_pages, page_size, kv_cache_dtype)
        self.backend = attention_backend
        self._jitted = jax.jit(partial(_step, cfg=cfg, backend=attention_backend),
                               donate_argnums=(1,))
        self._compiled: dict[tuple[int, int, int], object] = {}

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def compile(self, shape: tuple[int, int, int], example: StepArrays) -> float:
        """Compiles (or loads from the persistent cache) the program of one bucket shape."""
        started = time.perf_counter()
        batch, sampling = self._device_inputs(example)
        self._compiled[shape] = self._jitted.lower(
            self.params, self.cache, batch, sampling).compile()
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
        program = self._compiled.get(arrays.shape)
        if program is None:
            raise RuntimeError(f"step shape {arrays.shape} was not compiled at warm-up")
        batch, sampling = self._device_inputs(arrays)
        out, self.cache = program(self.params, self.cache, batch, sampling)
        out.tokens.copy_to_host_async()
        if arrays.wants_logprobs:
            for a in (out.logprob, out.top_ids, out.top_logprobs):
                a.copy_to_host_async()
        return out, arrays.wants_logprobs

    @staticmethod
    def fetch(handle) -> StepResult:
        out, wants_logprobs = handle
        out: SampleOutput
        if not wants_logprobs:
            return StepResult(np.asarray(out.tokens))
        return StepResult(*(np.asarray(a) for a in (out.tokens, out.logprob, out.top_ids,
                                                    out.top_logprobs)))

    @staticmethod
    def _device_inputs(arrays: StepArrays):
        batch, sampling = jax.device_put((arrays.batch, arrays.sampling))
        return Batch(**batch), SamplingInputs(**sampling)


def enable_compilation_cache(path: str) -> None:
    """JAX's persistent compilation cache: a restart loads programs instead of compiling."""
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def device_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")
