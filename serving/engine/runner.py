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
from serving.engine.executable_cache import ExecutableCache, avals_signature
from serving.engine.input_prep import StepArrays, history_shape
from serving.engine.sampler import SampleOutput, SamplingInputs, sample

log = logging.getLogger("xlaserve")


def _step(params, cache, buffers, history, *, layout, cfg: ModelConfig, backend: str):
    batch, sampling = _unpack(buffers, layout)
    sampling["history"] = history
    logits, cache = forward(params, cache, Batch(**batch), cfg, backend)
    return sample(logits, SamplingInputs(**sampling)), cache


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
class WarmupReport:
    seconds: list[float]  # per program, loading or compiling it
    loaded: int = 0  # from the executable cache; the rest were compiled
    wall: float = 0.0

    @property
    def programs(self) -> int:
        return len(self.seconds)

    @property
    def compiled(self) -> int:
        return self.programs - self.loaded


@dataclass
class StepResult:
    tokens: np.ndarray  # i32[R]
    logprob: np.ndarray | None = None  # f32[R]
    top_ids: np.ndarray | None = None  # i32[R, NUM_TOP_LOGPROBS]
    top_logprobs: np.ndarray | None = None


class ModelRunner:
    def __init__(self, cfg: ModelConfig, params, *, num_pages: int, page_size: int,
                 attention_backend: str = "reference", kv_cache_dtype: str | None = None,
                 executable_dir: str | None = None):
        self.cfg = cfg
        self.params = prepare_params(params)
        self.cache = KVCache.zeros(cfg, num_pages, page_size, kv_cache_dtype)
        self.backend = attention_backend
        self.page_size = page_size
        self._no_history: dict[tuple[int, int], jax.Array] = {}  # (R, S) -> all -1, on device
        self._jitted = jax.jit(partial(_step, cfg=cfg, backend=attention_backend),
                               donate_argnums=(1,), static_argnames=("layout",))
        self._compiled: dict[tuple[int, int, int], object] = {}
        self.executables = executable_dir and ExecutableCache(executable_dir, dict(
            model=repr(cfg), params=avals_signature(self.params),
            cache=avals_signature(self.cache), backend=attention_backend,
            page_size=page_size))

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    def compile(self, shape: tuple[int, int, int], example: StepArrays) -> tuple[float, bool]:
        """Loads the program of one bucket shape from the executable cache, or traces,
        lowers and compiles it (and saves it there). Returns (seconds, loaded)."""
        started = time.perf_counter()
        buffers, layout = _pack(example)
        args = (self.params, self.cache, buffers, self._history(example))
        program = self.executables and self.executables.load(shape, layout, args)
        loaded = program is not None
        if not loaded:
            program = self._jitted.lower(*args, layout=layout).compile()
            if self.executables:
                self.executables.save(shape, layout, program)
        self._compiled[shape] = (program, layout)
        return time.perf_counter() - started, loaded

    def warmup(self, examples: list[StepArrays], progress: bool = True,
               workers: int | None = None) -> WarmupReport:
        """Loads or compiles every shape before serving, `workers` at a time (default: one
        per CPU core; XLA compiles a program on one thread)."""
        workers = workers or os.cpu_count() or 1
        started = time.perf_counter()
        report = WarmupReport(seconds=[0.0] * len(examples))
        bar = tqdm(total=len(examples), desc="warm-up", unit="program", disable=not progress)
        with ThreadPoolExecutor(workers, thread_name_prefix="xlaserve-compile") as pool:
            futures = {pool.submit(self.compile, ex.shape, ex): i for i, ex in enumerate(examples)}
            for done in as_completed(futures):
                i, shape = futures[done], examples[futures[done]].shape
                report.seconds[i], loaded = done.result()
                report.loaded += loaded
                bar.update()
                bar.set_postfix_str(f"T={shape[0]} R={shape[1]} P={shape[2]} "
                                    f"{report.seconds[i]:.1f}s")
        bar.close()
        report.wall = time.perf_counter() - started
        log.info("warm-up: %d step programs, %d loaded, %d compiled, in %.1f s (%d at a "
                 "time); compiled programs in %s", report.programs, report.loaded,
                 report.compiled, report.wall, workers,
                 self.executables.root if self.executables else "no cache")
        return report

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
                                  self._history(arrays))
        out.tokens.copy_to_host_async()
        if arrays.wants_logprobs:
            for a in (out.logprob, out.top_ids, out.top_logprobs):
                a.copy_to_host_async()
        return out, arrays.wants_logprobs

    def _history(self, arrays: StepArrays) -> jax.Array:
        if arrays.history is not None:
            return jax.device_put(arrays.history)
        shape = history_shape(arrays.shape, self.page_size)
        if shape not in self._no_history:
            self._no_history[shape] = jax.device_put(np.full(shape, -1, np.int32))
        return self._no_history[shape]

    @staticmethod
    def fetch(handle) -> StepResult:
        out, wants_logprobs = handle
        out: SampleOutput
        if not wants_logprobs:
            return StepResult(np.asarray(out.tokens))
        return StepResult(*(np.asarray(a) for a in (out.tokens, out.logprob, out.top_ids,
                                                    out.top_logprobs)))


def device_memory_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")
