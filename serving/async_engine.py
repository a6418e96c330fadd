"""AsyncEngine: runs LLMEngine's step loop in its own thread and gives asyncio callers a stream
of outputs per request. The loop sleeps on a condition when idle; it never polls."""
from __future__ import annotations

import asyncio
import logging
import threading
import traceback
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator

from serving.engine import LLMEngine
from serving.outputs import RequestOutput
from serving.sampling_params import SamplingParams

log = logging.getLogger("xlaserve")


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions_total: int


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.ready = False
        self._commands: deque = deque()  # (callable, args), applied by the engine thread
        self._wake = threading.Condition()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="xlaserve-engine", daemon=True)

    def start(self, warmup: bool = True) -> None:
        """Warms up (compiling every bucket), then starts the step loop."""
        if warmup:
            self.engine.warmup()
        self._thread.start()
        self.ready = True

    def shutdown(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yields this request's outputs; the last has finished=True. Closing the generator
        early (or cancelling its consumer) aborts the request and frees its pages."""
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._submit(self._add, request_id, list(prompt_token_ids), params)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(self.engine.abort, request_id)

    def stats(self) -> EngineStats:
        s = self.engine.scheduler
        return EngineStats(s.num_running, s.num_waiting, s.kv_cache_usage,
                           s.num_preemptions_total)

    def _submit(self, fn, *args) -> None:
        with self._wake:
            self._commands.append((fn, args))
            self._wake.notify()

    def _add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        try:
            self.engine.add_request(request_id, prompt, params)
        except ValueError as e:
            self._deliver(request_id, e)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, queue = stream
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # the loop itself broke: report unhealthy, end every stream
            log.error("engine loop died: %s\n%s", e, traceback.format_exc())
            self.ready = False
            for request_id in list(self._streams):
                self._deliver(request_id, RuntimeError(f"engine loop died: {e}"))

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopped and not self._commands and not self.engine.has_unfinished:
                    self._wake.wait()
                if self._stopped:
                    return
                commands, self._commands = self._commands, deque()
            for fn, args in commands:
                try:
                    fn(*args)
                except Exception as e:
                    log.error("engine command %s failed: %s", fn.__name__, e)
            if not self.engine.has_unfinished:
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a failed step fails its requests, never the server
                log.error("engine step failed: %s\n%s", e, traceback.format_exc())
                outputs = self.engine.fail_all(f"engine step failed: {e}")
            for out in outputs:
                self._deliver(out.request_id, out)
