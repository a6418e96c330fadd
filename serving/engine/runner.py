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
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from model.batch import Batch
from model.config import ModelConfig
from model.greedy_head import greedy_tokens
from model.transformer import compute_logits, forward_hidden
from serving.engine.executable_cache import (ExecutableCache, avals_signature, load_or_compile,
                                             program_for)
from serving.engine.input_prep import StepArrays, history_shape
from serving.engine.lora_slots import DeviceLoRA
from serving.engine.mesh import SingleDevice
from serving.engine.pooling import PoolingProgram
from serving.engine.prompt_logprobs import (BLOCK_ROWS, PromptOutput, hidden_blocks,
                                            prompt_logprobs)
from serving.engine.rejection_sampler import emitted_rows
from serving.engine.sampler import NUM_TOP_LOGPROBS, SampleOutput, SamplingInputs, sample_rows
from serving.engine.step_buffers import pack, unpack

log = logging.getLogger("xlaserve")


def _step(params, cache, buffers, history, bitmask, last_tokens, lora_slots=None, *, layout,
          cfg: ModelConfig, backend: str, num_top: int, vocab_size: int,
          axis: str | None = None):
    """-> (sampled tokens, which rows are outputs (rejection_sampler), the tokens' hidden
    states in blocks for prompt logprobs, cache, this step's tokens for the next one).
    axis: tensor parallel, this runs on one shard (serving/engine/mesh.py). lora_slots: the
    adapters' device slots (model/lora.py) when LoRA is on.

    last_tokens: i32[max_rows], the previous step's sampled tokens, row by row. A token whose
    `prev_rows` entry is a row (>= 0) is that row's token: with async scheduling the step
    was prepared before the previous one's tokens reached the host (engine/async_steps.py)."""
    batch, sampling = unpack(buffers, layout)
    sampling["history"] = history
    prev_rows = batch.pop("prev_rows")
    batch["input_ids"] = jnp.where(prev_rows >= 0, last_tokens[jnp.maximum(prev_rows, 0)],
                                   batch["input_ids"])
    batch, draft_ids, row_start = split_batch(batch)
    hidden, cache = forward_hidden(params, cache, batch, cfg, backend, axis, lora_slots)
    # Only ids the tokenizer has are sampled: padded embedding rows are never drawn.
    sampled = sample_rows(
        hidden[batch.logits_indices],
        lambda rows: compute_logits(params, rows, cfg, axis)[:, :vocab_size],
        SamplingInputs(**sampling, token_bitmask=bitmask), num_top,
        greedy=greedy_tokens(params, cfg, vocab_size, axis))
    emitted = emitted_rows(sampled.tokens, draft_ids, row_start)
    next_tokens = jnp.pad(sampled.tokens.astype(jnp.int32),
                          (0, last_tokens.shape[0] - sampled.tokens.shape[0]))
    return sampled, emitted, hidden_blocks(hidden), cache, next_tokens


def split_batch(arrays: dict) -> tuple[Batch, object, object]:
    """The step's batch arrays -> (the model's Batch, draft_ids, row_start)."""
    arrays = dict(arrays)
    arrays.pop("prev_rows", None)  # the runner's own (see _step)
    draft_ids, row_start = arrays.pop("draft_ids"), arrays.pop("row_start")
    return Batch(**arrays), draft_ids, row_start


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
    emitted: np.ndarray | None = None  # bool[R] rows whose token is an output
    logprob: np.ndarray | None = None  # f32[R]
    top_ids: np.ndarray | None = None  # i32[R, K]
    top_logprobs: np.ndarray | None = None
    prompt: PromptOutput | None = None  # numpy arrays over the step's T tokens, when asked
    pooled: np.ndarray | None = None  # f32[T, H] final-normed rows, when a request pools


class ModelRunner:
    """num_pages None: the KV cache is allocated later (`allocate_kv_cache`), once the memory
    plan knows what the prepared weights and the largest step leave for it.
    free_stacked: the stored weight tree is consumed (model/runtime_params.py).
    max_logprobs: the top logprobs each step computes (the most a request may ask).
    vocab_size: the ids sampling may produce (the tokenizer's); default: every row.
    placement: one device (default) or a tensor-parallel mesh (serving/engine/mesh.py).
    pooling: an embedding engine's runner, with the final-norm program of
    serving/engine/pooling.py (compiled by the engine's warm-up)."""
    scores_prompts = True  # has a prompt-logprobs program (compiled at warm-up)

    def __init__(self, cfg: ModelConfig, params, *, num_pages: int | None, page_size: int,
                 attention_backend: str = "reference", kv_cache_dtype: str | None = None,
                 free_stacked: bool = False, max_logprobs: int = NUM_TOP_LOGPROBS,
                 vocab_size: int | None = None, executable_dir: str | None = None,
                 placement=None, pooling: bool = False, max_rows: int = 1):
        self.cfg = cfg
        self.placement = placement or SingleDevice(cfg)
        # Called with every step's arrays before it runs: a leader process hands them to its
        # followers (serving/engine/multiprocess.py).
        self.step_sink = None
        self.page_size = page_size
        self.kv_cache_dtype = kv_cache_dtype
        self.vocab_size = vocab_size or cfg.vocab_size
        self.max_logprobs = max_logprobs
        self.bitmask_width = (self.vocab_size + 31) // 32
        # The last step's sampled tokens, on the device, for a step prepared before they
        # reached the host; max_rows: the largest request bucket.
        self._last_tokens = self.placement.put(np.zeros(max_rows, np.int32))
        self._no_bitmask: dict[int, jax.Array] = {}  # all tokens allowed, per request bucket
        self.params = self.placement.prepare(params, free_stacked=free_stacked)
        self._cache = self._cache_shape = self._zeroing = None
        # A hybrid model's window layers on pages of their own (model/kv_groups.py): set
        # before sizing, so the activation peak is measured on the same program.
        self.hybrid_kv = False
        if num_pages is not None:
            self.allocate_kv_cache(num_pages)
        self.backend = attention_backend
        self._no_history: dict[tuple[int, int], jax.Array] = {}  # (R, S) -> all -1, on device
        self._executable_dir = executable_dir
        self._executables: ExecutableCache | None = None
        where = self.placement
        self._jitted = jax.jit(where.wrap_step(partial(
            _step, cfg=where.model_cfg, backend=attention_backend, num_top=max_logprobs,
            vocab_size=self.vocab_size, axis=where.axis)),
            donate_argnums=(1,), static_argnames=("layout",))
        self._compiled: dict[tuple[int, int, int], object] = {}
        # One program for every bucket: scores BLOCK_ROWS hidden states (prompt logprobs).
        self._prompt_jitted = jax.jit(where.wrap_prompt(partial(
            prompt_logprobs, cfg=where.model_cfg, num_top=max_logprobs, axis=where.axis)))
        self._prompt_program = None
        self.pooling = PoolingProgram(self) if pooling else None
        self.lora: DeviceLoRA | None = None  # enable_lora

    def allocate_kv_cache(self, num_pages: int, window_pages: int = 0) -> None:
        """On one device the zeros are written on a thread of their own (the CPU runtime
        writes the buffer inside the call: a second for the demo's 2.8 GiB) while warm-up
        loads or compiles against the cache's shape; the first step waits for them.
        window_pages > 0: a hybrid model's window layers get that many pages of their own."""
        self.hybrid_kv = window_pages > 0
        args = (num_pages, self.page_size, self.kv_cache_dtype, window_pages)
        if self.placement.size > 1:
            self.cache = self._cache_shape = self.placement.zeros_cache(*args)
            return
        self._cache_shape = self.placement.abstract_cache(*args)
        # compiled here, so warm-up itself compiles nothing when every program is loaded
        zeros = jax.jit(partial(self.placement.zeros_cache, *args)).lower().compile()
        pool = ThreadPoolExecutor(1, thread_name_prefix="xlaserve-kv-cache")
        self._zeroing = pool.submit(zeros)
        pool.shutdown(wait=False)

    @property
    def cache(self):
        if self._zeroing is not None:
            self._cache, self._zeroing = self._zeroing.result(), None
        return self._cache

    @cache.setter
    def cache(self, value) -> None:
        self._cache = value

    def activation_peak_bytes(self, example: StepArrays) -> int:
        """Temporary bytes the step program of `example`'s shape needs (XLA's buffer
        assignment of the compiled program, read before any cache exists: the cache is an
        abstract two-page stand-in, donated and aliased, so its size does not count)."""
        cache = self.placement.abstract_cache(2, self.page_size, self.kv_cache_dtype,
                                              2 if self.hybrid_kv else 0)
        args, layout = self._step_args(example, cache)
        compiled = self._jitted.lower(*args, layout=layout).compile()
        stats = compiled.memory_analysis()
        if stats is None:
            raise RuntimeError("this backend reports no memory analysis for a compiled step")
        # Temporaries, plus outputs that are not the aliased cache (the sampled tokens).
        return int(stats.temp_size_in_bytes + stats.output_size_in_bytes
                   - stats.alias_size_in_bytes)

    @property
    def num_compiled(self) -> int:
        return len(self._compiled)

    @property
    def executables(self) -> ExecutableCache | None:
        """The executable cache, keyed on the KV cache too, so made once that exists."""
        if self._executables is None and self._executable_dir and self._cache_shape is not None:
            self._executables = ExecutableCache(self._executable_dir, dict(
                model=repr(self.cfg), params=avals_signature(self.params),
                cache=avals_signature(self._cache_shape), backend=self.backend,
                page_size=self.page_size, max_logprobs=self.max_logprobs,
                vocab_size=self.vocab_size,
                lora=self.lora and avals_signature(self.lora.slots),
                placement=type(self.placement).__name__), devices=self.placement.devices)
        return self._executables

    def _load_or_compile(self, lower, args, shape, layout) -> tuple[object, bool]:
        """lower: () -> the program lowered for `args`, called on a cache miss only."""
        return load_or_compile(self.executables, lower, args, shape, layout)

    def compile(self, shape: tuple[int, int, int], example: StepArrays) -> tuple[float, bool]:
        """Loads the program of one bucket shape from the executable cache, or traces,
        lowers and compiles it (and saves it there). Returns (seconds, loaded)."""
        started = time.perf_counter()
        args, layout = self._step_args(example, self._cache_shape)
        program, loaded = self._load_or_compile(
            lambda: self._jitted.lower(*args, layout=layout), args, shape, layout)
        self._compiled[shape] = (program, layout)
        return time.perf_counter() - started, loaded

    def compile_prompt_logprobs(self) -> tuple[float, bool]:
        started = time.perf_counter()
        hidden = jax.ShapeDtypeStruct((BLOCK_ROWS, self.cfg.hidden_size), self.cfg.dtype)
        targets = jax.ShapeDtypeStruct((BLOCK_ROWS,), np.int32)
        args = (self.params, hidden, targets)
        self._prompt_program, loaded = self._load_or_compile(
            lambda: self._prompt_jitted.lower(*args), args, ("prompt_logprobs", BLOCK_ROWS),
            "prompt")
        return time.perf_counter() - started, loaded

    def warmup(self, examples: list[StepArrays], progress: bool = True,
               workers: int | None = None) -> WarmupReport:
        """Loads or compiles every step shape before serving, `workers` at a time (default:
        one per CPU core; XLA compiles a program on one thread), then the prompt-logprobs
        program (counted with the others)."""
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
        if self.scores_prompts:
            prompt_s, loaded = self.compile_prompt_logprobs()
            report.seconds.append(prompt_s)
            report.loaded += loaded
        report.wall = time.perf_counter() - started
        log.info("warm-up: %d programs (%d step shapes%s), %d loaded, %d compiled, in %.1f s "
                 "(%d at a time); compiled programs in %s", report.programs, len(examples),
                 " and the prompt-logprobs one" if self.scores_prompts else "",
                 report.loaded, report.compiled, report.wall, workers,
                 self.executables.root if self.executables else "no folder")
        return report

    def dispatch(self, arrays: StepArrays):
        """Launches one step without waiting for it; returns a handle for `fetch`."""
        if self.step_sink is not None:
            self.step_sink(arrays)
        args, layout = self._step_args(arrays, self.cache, put=True)
        program = program_for(self._compiled, arrays.shape, layout, "step")
        out, emitted, blocks, self.cache, self._last_tokens = program(*args)
        # what a next-n prediction drafter reads on the device (serving/engine/mtp_drafter.py)
        self.last_step = (out.tokens, emitted, blocks)
        out.tokens.copy_to_host_async()
        emitted.copy_to_host_async()
        if arrays.wants_logprobs:
            for a in (out.logprob, out.top_ids, out.top_logprobs):
                a.copy_to_host_async()
        prompt = pooled = None
        if arrays.prompt_targets is not None:
            prompt = (len(arrays.prompt_targets), self._score_prompt(blocks, arrays.prompt_targets))
        if arrays.pooling_rows is not None:
            pooled = self.pooling.launch(blocks, arrays.pooling_rows)
        return out, emitted, arrays.wants_logprobs, prompt, pooled

    def _step_args(self, arrays: StepArrays, cache, put: bool = False) -> tuple[tuple, tuple]:
        """(the step program's arguments, the layout of its packed arrays)."""
        if self.lora is not None and "lora_slots" not in arrays.batch:  # no request uses one
            arrays.batch["lora_slots"] = np.full(arrays.shape[0], -1, np.int32)
        buffers, layout = pack(arrays)
        args = (self.params, cache, self.placement.send(buffers) if put else buffers,
                self._history(arrays), self._bitmask(arrays), self._last_tokens)
        return args + ((self.lora.slots,) if self.lora is not None else ()), layout

    def enable_lora(self, config) -> None:
        """Gives every step program LoRA slots (serving/engine/lora_slots.py); before
        warm-up, as the programs' arguments change."""
        self.lora = DeviceLoRA(self.cfg, self.params, config, self.placement)

    def _history(self, arrays: StepArrays) -> jax.Array:
        if arrays.history is not None:
            return self.placement.send(arrays.history)
        shape = history_shape(arrays.shape, self.page_size)
        if shape not in self._no_history:
            self._no_history[shape] = self.placement.put(np.full(shape, -1, np.int32))
        return self._no_history[shape]

    def _score_prompt(self, blocks, targets: np.ndarray) -> list[tuple[int, PromptOutput]]:
        """Launches the prompt-logprobs program on each block with a row that asks.
        targets: i32[T] (-1: nothing to score) -> [(block index, its PromptOutput)]."""
        if self._prompt_program is None:
            raise RuntimeError("the prompt-logprobs program was not compiled at warm-up")
        padded = np.full(len(blocks) * BLOCK_ROWS, -1, np.int32)
        padded[:len(targets)] = targets
        scored = []
        for i, block in enumerate(blocks):
            rows = padded[i * BLOCK_ROWS:(i + 1) * BLOCK_ROWS]
            if (rows >= 0).any():
                out = self._prompt_program(self.params, block, rows)
                for a in jax.tree.leaves(out):
                    a.copy_to_host_async()
                scored.append((i, out))
        return scored

    def _fetch_prompt(self, prompt) -> PromptOutput | None:
        """-> numpy PromptOutput over the step's T tokens (rows of unscored blocks are 0)."""
        if prompt is None:
            return None
        T, scored = prompt
        n = -(-T // BLOCK_ROWS) * BLOCK_ROWS
        k = scored[0][1].top_ids.shape[1]
        full = PromptOutput(np.zeros(n, np.float32), np.zeros(n, np.int32),
                            np.zeros((n, k), np.int32), np.zeros((n, k), np.float32))
        for i, out in scored:
            rows = slice(i * BLOCK_ROWS, (i + 1) * BLOCK_ROWS)
            for name in ("logprob", "rank", "top_ids", "top_logprobs"):
                getattr(full, name)[rows] = self.placement.host(getattr(out, name))
        return jax.tree.map(lambda a: a[:T], full)

    def _bitmask(self, arrays: StepArrays):
        """The step's bitmask, or (no constrained row) a resident one: nothing to send."""
        if arrays.bitmask is not None:
            return self.placement.send(arrays.bitmask)
        R = arrays.shape[1]
        if R not in self._no_bitmask:
            self._no_bitmask[R] = self.placement.put(
                np.full((R, self.bitmask_width), -1, np.int32))
        return self._no_bitmask[R]

    def fetch(self, handle) -> StepResult:
        out, emitted, wants_logprobs, prompt, pooled = handle
        out: SampleOutput
        host = self.placement.host
        prompt = self._fetch_prompt(prompt)
        pooled = self.pooling.fetch(pooled) if pooled is not None else None
        emitted = host(emitted)
        if not wants_logprobs:
            return StepResult(host(out.tokens), emitted, prompt=prompt, pooled=pooled)
        return StepResult(host(out.tokens), emitted,
                          *(host(a) for a in (out.logprob, out.top_ids, out.top_logprobs)),
                          prompt=prompt, pooled=pooled)


def disable_jax_compilation_cache() -> None:
    """The executable cache replaces JAX's persistent cache: that one still traces and lowers
    every program, and on XLA:CPU a program it hands back fails once serialized again."""
    jax.config.update("jax_enable_compilation_cache", False)


def device_memory_bytes() -> int | None:
    """The allocator's limit on the default device (None where the device reports none)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_limit")


def device_peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")
