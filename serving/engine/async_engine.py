"""AsyncEngine: runs LLMEngine's step loop in its own thread and gives asyncio callers a stream
of outputs per request. The loop sleeps on a condition when idle; it never polls.

A step that raises means the engine's state can no longer be trusted (a device step failed,
or the scheduler broke): the engine is dead. Every in-flight request gets an error and its
pages back, later requests are refused at once, `ready` turns False, and `on_dead`
callbacks run, so the server can report unhealthy and exit. Failures that belong to one
request are handled inside LLMEngine.step and fail that request alone.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from serving.core.grammar import GrammarRefused
from serving.core.outputs import RequestOutput
from serving.core.sampling_params import SamplingParams
from serving.core.spec_decode import SpecDecodeStats
from serving.engine.stats_log import StatsLogger

if TYPE_CHECKING:  # the server's modules stay free of JAX
    from serving.engine.llm_engine import LLMEngine

log = logging.getLogger("xlaserve")


class EngineDeadError(RuntimeError):
    """The engine failed and serves no more requests."""


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int  # waiting in the scheduler, or submitted and not yet added to it
    kv_cache_usage: float
    num_preemptions_total: int
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache, running total
    prefix_cache_hits: int = 0  # tokens found there
    num_prompt_tokens_total: int = 0  # prompt tokens computed
    num_generation_tokens_total: int = 0
    spec: SpecDecodeStats | None = None  # running totals, when speculation is on
    # LoRA on: adapter name -> requests running / waiting (the lora_requests_info metric)
    running_loras: dict[str, int] | None = None
    waiting_loras: dict[str, int] | None = None
    # prompt tokens whose K/V another instance computed (serving/kv_transfer/)
    num_prompt_tokens_transferred: int = 0


class RequestStream:
    """One request's outputs (all n samples', told apart by `index`), as an async iterator;
    it ends after each sample's finished output. Closing it early (`close()`/`aclose()`)
    aborts the request and frees its pages; closing twice is harmless.

    The engine thread puts (request_id, output or exception) items on `queue`. Several
    streams may share one queue (one HTTP response's choices): their reader then reads the
    queue itself and hands each item to its stream's `take()` instead of iterating."""

    def __init__(self, engine: "AsyncEngine", request_id: str,
                 queue: asyncio.Queue | None = None, n: int = 1):
        self._engine, self.request_id = engine, request_id
        self._unfinished = n
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue() if queue is None else queue
        self._done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        _, item = await self.queue.get()
        self.take(item)
        if isinstance(item, Exception):
            raise item
        return item

    def take(self, item) -> None:
        """Notes one item read from the queue: the stream ends with an exception or once
        every sample has had its final output."""
        if isinstance(item, Exception):
            self._close(finished=True)
        elif item.finished:
            self._unfinished -= 1
            if self._unfinished == 0:
                self._close(finished=True)

    @property
    def done(self) -> bool:
        return self._done

    def close(self) -> None:
        self._close(finished=False)

    async def aclose(self) -> None:
        self.close()

    def _close(self, finished: bool) -> None:
        if self._done:
            return
        self._done = True
        self._engine._forget(self.request_id, abort=not finished)


class AsyncEngine:
    def __init__(self, engine: "LLMEngine", log_stats_interval_s: float | None = 10.0,
                 scope=contextlib.nullcontext):
        self.engine = engine
        # entered around warm-up and the step loop: a data-parallel replica's default
        # device (serving/engine/data_parallel.py)
        self._scope = scope
        self._stats_log = StatsLogger(log_stats_interval_s) if log_stats_interval_s else None
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.max_logprobs = engine.config.max_logprobs
        self.task = engine.task  # "generate" or "embed"
        # --task embed: what the model allows (core/pooling_params.EmbeddingSpec); else None
        self.embedding = engine.embedder.spec if engine.embedder else None
        self.config = engine.config  # what the worker endpoints (/server_info, ...) report
        self.model_dir = engine.model_dir
        self.num_pages = engine.num_pages
        self.ready = False
        self.dead: str | None = None  # why the engine died, once it has
        self.on_dead: list = []  # callables, run on the engine thread when it dies
        self._commands: deque = deque()  # (callable, args), applied by the engine thread
        self._wake = threading.Condition()
        self._streams: dict[str, RequestStream] = {}
        self._num_unadded = 0  # submitted requests the engine thread has not added yet
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="xlaserve-engine", daemon=True)
        if getattr(engine, "kv_transfer", None):  # a pull landed, a claim ended: look now
            engine.kv_transfer.wake = self._notify

    def start(self, warmup: bool = True) -> None:
        """Warms up (compiling every bucket), then starts the step loop."""
        if warmup:
            # Structured outputs' compiler is built now, not on the first constrained
            # request, beside the programs loading (it is Python and Rust; they are XLA's).
            with ThreadPoolExecutor(1, thread_name_prefix="xlaserve-grammar") as pool, \
                    self._scope():
                grammar = pool.submit(lambda: self.engine.grammar_compiler)
                self.engine.warmup()
            try:
                grammar.result()
            except GrammarRefused as e:  # no tokenizer or no llguidance: requests refused
                log.warning("structured outputs are off: %s", e)
        self._thread.start()
        self.ready = True

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str, queue: asyncio.Queue | None = None,
                 lora_request=None) -> RequestStream:
        """Submits the request now (so admission control sees it at once) and returns its
        output stream, delivering into `queue` if given; with the adapter `lora_request`
        names (serving/lora/). Raises EngineDeadError if the engine has died."""
        stream = RequestStream(self, request_id, queue, params.n)
        with self._wake:
            if self.dead is not None:
                raise EngineDeadError(f"the engine is dead: {self.dead}")
            self._streams[request_id] = stream
            self._num_unadded += 1
            self._commands.append((self._add, (request_id, list(prompt_token_ids), params,
                                               lora_request)))
            self._wake.notify()
        return stream

    def encode(self, prompt_token_ids: list[int], params, request_id: str,
               queue: asyncio.Queue | None = None) -> RequestStream:
        """An embedding request (params: core.pooling_params.PoolingParams, on a --task
        embed engine): one finished output carrying `embedding`. As generate() otherwise."""
        return self.generate(prompt_token_ids, params, request_id, queue)

    async def compile_grammar(self, structured_outputs) -> None:
        """Compiles a constraint off the engine thread and the event loop, within the
        compiler's time limit; raises core.grammar.GrammarRefused. The engine finds the
        result in the compiler's cache when it adds the request."""
        compiler = self.engine.grammar_compiler
        future = asyncio.wrap_future(compiler.submit(structured_outputs))
        try:
            await asyncio.wait_for(future, compiler.timeout_s + 1.0)
        except asyncio.TimeoutError:
            raise GrammarRefused(f"compiling the {structured_outputs.kind} constraint took "
                                 f"longer than {compiler.timeout_s:g} s",
                                 param="structured_outputs") from None

    def abort(self, request_id: str) -> None:
        self._submit(self.engine.abort, request_id)

    def stats(self) -> EngineStats:
        return engine_stats(self.engine, self._num_unadded)

    def replica_stats(self) -> list[EngineStats]:
        """One EngineStats per data-parallel replica: this engine is one."""
        return [self.stats()]

    async def reset_prefix_cache(self) -> bool:
        """Forgets every cached page, on the engine thread between steps; False while any
        request is unfinished (LLMEngine.reset_prefix_cache)."""
        done: concurrent.futures.Future = concurrent.futures.Future()

        def reset() -> None:
            try:
                done.set_result(self.engine.reset_prefix_cache())
            except Exception as e:  # noqa: BLE001 - the caller sees it
                done.set_exception(e)

        with self._wake:
            if self.dead is not None:
                raise EngineDeadError(f"the engine is dead: {self.dead}")
            self._commands.append((reset, ()))
            self._wake.notify()
        result = asyncio.wrap_future(done)
        while True:  # a death drops queued commands: never wait on one that will not run
            finished, _ = await asyncio.wait({result}, timeout=0.5)
            if finished:
                return result.result()
            if self.dead is not None:
                result.cancel()
                raise EngineDeadError(f"the engine is dead: {self.dead}")

    @property
    def lora(self):
        """The LoRA manager (serving/lora/manager.py), None without --enable-lora."""
        return self.engine.lora

    def uses_adapter(self, digest: str) -> bool:
        """Whether an unfinished request runs with this adapter (unloading waits for them)."""
        return any(r.lora_key == digest for r in list(self.engine.scheduler.requests.values()))

    def _forget(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort and self.dead is None:
            self.abort(request_id)

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    def _submit(self, fn, *args) -> None:
        with self._wake:
            self._commands.append((fn, args))
            self._wake.notify()

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams,
             lora_request=None) -> None:
        try:
            self.engine.add_request(request_id, prompt, params, lora_request)
        except Exception as e:  # noqa: BLE001 - refused: the caller sees why
            self._deliver(request_id, e if isinstance(e, ValueError)
                          else RuntimeError(f"adding the request failed: {e}"))
        finally:
            with self._wake:
                self._num_unadded -= 1

    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """(request_id, output or exception) items handed to each event loop in one call: a
        step's outputs wake the loop once, not once per request (each wake-up is a write to
        the loop's pipe and a turn of the GIL between this thread and the loop's)."""
        by_loop: dict = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream.queue, (request_id, item)))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _loop(self) -> None:
        try:
            with self._scope():
                self._run()
        except BaseException as e:  # noqa: BLE001 - the engine is dead; say so everywhere
            log.error("engine step failed, the engine is dead: %s: %s\n%s", type(e).__name__,
                      e, traceback.format_exc())
            self._die(f"{type(e).__name__}: {e}")

    def _die(self, reason: str) -> None:
        """Fails every request (in flight or just submitted) and frees its pages."""
        with self._wake:
            self.dead = reason
            self.ready = False
            self._commands.clear()
            self._num_unadded = 0
            streams = list(self._streams)
        try:
            failed = self.engine.fail_all(f"engine failed: {reason}")
        except Exception:  # noqa: BLE001 - the streams below still get their error
            log.exception("failing the in-flight requests after an engine error failed")
            failed = []
        # the engine's failed outputs, then every stream (those it had not added yet too)
        self._deliver_all([(out.request_id, out) for out in failed]
                          + [(request_id, EngineDeadError(f"the engine is dead: {reason}"))
                             for request_id in streams])
        for callback in self.on_dead:
            callback()

    def fail_everything(self, reason: str) -> None:
        """From another thread, when the engine thread may never return (a step stuck in a
        collective with a process that is gone): every stream gets the error and the
        server is told the engine is dead; the engine's own state is left alone."""
        with self._wake:
            self.dead = reason
            self.ready = False
            self._commands.clear()
            streams = list(self._streams)
        for request_id in streams:
            self._deliver(request_id, EngineDeadError(f"the engine is dead: {reason}"))
        for callback in self.on_dead:
            callback()

    def _run(self) -> None:
        while True:
            with self._wake:
                while (not self._stopped and not self._commands
                       and (idle_s := self.engine.idle_s()) != 0):
                    self._wake.wait(idle_s)
                if self._stopped:
                    return
                commands, self._commands = self._commands, deque()
            for fn, args in commands:
                try:
                    fn(*args)
                except Exception as e:  # noqa: BLE001 - an abort of a gone request, ...
                    log.error("engine command %s failed: %s", fn.__name__, e)
            if self.engine.idle_s() == 0:
                self._deliver_all([(out.request_id, out) for out in self.engine.step()])
                if self._stats_log:
                    self._stats_log.maybe_log(self.stats())


def engine_stats(engine: "LLMEngine", num_unadded: int = 0) -> EngineStats:
    """What one engine's scheduler says now; num_unadded: requests submitted to it that its
    thread has not added yet (counted as waiting)."""
    s = engine.scheduler
    kvm = s.kv_cache_manager
    return EngineStats(s.num_running, s.num_waiting + num_unadded, s.kv_cache_usage,
                       s.num_preemptions_total, kvm.prefix_cache_queries,
                       kvm.prefix_cache_hits, s.num_prompt_tokens_total,
                       s.num_generation_tokens_total,
                       s.spec_stats.snapshot() if engine.drafter else None,
                       *(_adapter_counts(s) if engine.lora else (None, None)),
                       num_prompt_tokens_transferred=getattr(
                           getattr(engine, "kv_transfer", None), "num_transferred_tokens", 0))


def _put_all(puts: list) -> None:
    for queue, item in puts:
        queue.put_nowait(item)


def _adapter_counts(scheduler) -> tuple[dict[str, int], dict[str, int]]:
    running: dict[str, int] = {}
    waiting: dict[str, int] = {}
    for group, reqs in ((running, list(scheduler.running)), (waiting, list(scheduler.waiting))):
        for r in reqs:
            if r.lora is not None:
                group[r.lora.name] = group.get(r.lora.name, 0) + 1
    return running, waiting
