"""From engine outputs to OpenAI responses: one request's choices run as concurrent engine
requests, merged into one stream of updates, then written as SSE chunks or collected into
one JSON response.

Lifetime rule: whatever way a response ends (finished, error, client gone, handler
cancelled), every engine generator is closed, which aborts its engine request and frees its
pages. `OutputStream.aclose()` is the one place that guarantees it.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass

from aiohttp import web

from serving.openai import protocol as p
from serving.openai import responses
from serving.openai.token_texts import TokenTexts
from serving.openai.tool_parsers import ToolCallParser, parser_for
from serving.openai.tools import ToolChoice
from serving.engine.async_engine import EngineDeadError
from serving.core.request_checks import RequestRefused
from serving.core.outputs import CompletionOutput, RequestOutput, TokenLogprob
from serving.core.sampling_params import SamplingParams

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}  # tell reverse proxies not to buffer the stream


def sse_event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() \
        + b"\n\n"


@dataclass
class Choice:
    """One OpenAI choice = one engine request."""
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # n == 1, max_tokens resolved against the context
    prompt_index: int = 0  # which prompt of the request: usage counts each prompt once
    prompt_text: str = ""  # echoed before the completion (completions with echo)
    text_offset: int = 0  # completions logprobs: where the next token's text starts


class OutputStream:
    """Runs the choices' engine requests concurrently and hands out (choice, output) pairs
    in arrival order; `get()` returns None once every request has finished.

    All of them deliver into one queue, filled from the engine thread: the one hop between
    the engine and this response (docs/architecture.md, "A request's path"). Every request is
    submitted when the stream is built, before the caller awaits anything, so the engine's
    queue length (admission control) counts it at once."""

    def __init__(self, engine, metrics, choices: list[Choice], arrival: float):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._choices = {c.request_id: c for c in choices}
        self._trackers = {c.request_id: metrics.track(len(c.prompt_ids), arrival)
                          for c in choices}
        self._queue_times: dict[str, float | None] = {}
        self._streams = {}
        try:
            for c in choices:
                self._streams[c.request_id] = engine.generate(c.prompt_ids, c.params,
                                                              c.request_id, queue=self._queue)
        except BaseException:
            for stream in self._streams.values():  # withdraw the ones already submitted
                stream.close()
            raise
        self._open = set(self._streams)

    def token_counts(self) -> tuple[int, int]:
        """(prompt tokens, output tokens so far) over every choice."""
        return (sum(t.num_prompt_tokens for t in self._trackers.values()),
                sum(t.num_generated for t in self._trackers.values()))

    async def get(self) -> tuple[Choice, RequestOutput] | None:
        while self._open:
            request_id, item = await self._queue.get()
            if request_id not in self._open:
                continue  # after its end (e.g. an abort racing the last step)
            self._streams[request_id].take(item)
            tracker = self._trackers[request_id]
            if isinstance(item, Exception):
                self._open.discard(request_id)
                if tracker.last is None:
                    tracker.done = True  # refused before it ran: not a finished request
                raise item
            if request_id not in self._queue_times:  # the engine sends it on the first update
                self._queue_times[request_id] = item.queue_time
            tracker.on_output(len(item.new_token_ids))
            if item.finished:
                self._open.discard(request_id)
                tracker.on_finish(item.finish_reason, self._queue_times[request_id])
            return self._choices[request_id], item
        return None

    async def aclose(self) -> None:
        """Aborts every request still running (client gone, error, cancelled handler)."""
        for request_id in self._open:
            self._streams[request_id].close()
            self._trackers[request_id].on_finish("abort")
        self._open.clear()


def engine_failure(out: RequestOutput) -> p.ProtocolError | None:
    if out.error is None and out.finish_reason != "error":
        return None
    return p.ProtocolError(f"generation failed: {out.error or 'engine error'}", status=500)


def engine_exception(exc: Exception) -> p.ProtocolError:
    """An exception from engine.generate: ValueError means the scheduler refused it."""
    if isinstance(exc, p.ProtocolError):
        return exc
    if isinstance(exc, RequestRefused):
        return p.refused(exc)
    if isinstance(exc, ValueError):
        return p.ProtocolError(str(exc))
    if isinstance(exc, EngineDeadError):
        return p.ProtocolError(str(exc), status=503, code="engine_dead")
    return p.ProtocolError(f"generation failed: {type(exc).__name__}: {exc}", status=500)


@contextlib.asynccontextmanager
async def cancel_on_disconnect(request: web.Request, interval_s: float = 0.5):
    """Cancel the current handler when its client goes away. aiohttp does this itself only
    with handler_cancellation=True (run_server and TestServer set it); with another runner,
    a non-streaming handler would otherwise generate to the end for nobody."""
    task = asyncio.current_task()

    async def watch():
        while True:
            await asyncio.sleep(interval_s)
            transport = request.transport
            if transport is None or transport.is_closing():
                task.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()


# -- response formats ----------------------------------------------------------------------

class _Format:
    chunk_object = ""

    def __init__(self, request_id: str, model: str, texts: TokenTexts | None,
                 include_usage: bool):
        self.request_id, self.model, self.texts = request_id, model, texts
        self.include_usage = include_usage
        self.created = responses.now()

    def entries(self, logprobs: list[TokenLogprob] | None) -> list[responses.LogprobEntry] | None:
        if self.texts is None:
            return None
        return [self.texts.entry(lp) for lp in (logprobs or [])]

    def usage_chunk(self, usage: dict) -> dict:
        return responses.usage_chunk(self.chunk_object, self.request_id, self.model, self.created, usage)


class CompletionFormat(_Format):
    chunk_object = "text_completion"

    def opening(self, choice: Choice) -> list[dict]:
        if not choice.prompt_text:
            return []
        choice.text_offset = len(choice.prompt_text)
        return [responses.completion_chunk(self.request_id, self.model, self.created, choice.index,
                                   choice.prompt_text, include_usage=self.include_usage)]

    def chunks(self, choice: Choice, out: RequestOutput) -> list[dict]:
        entries = self.entries(out.new_logprobs)
        if not (out.new_text or out.finished or entries):
            return []
        logprobs = None if entries is None else responses.completion_logprobs(entries, choice.text_offset)
        choice.text_offset += len(out.new_text)
        return [responses.completion_chunk(
            self.request_id, self.model, self.created, choice.index, out.new_text,
            out.finish_reason if out.finished else None, logprobs,
            out.stop_reason if out.finished else None, include_usage=self.include_usage)]

    def choice(self, choice: Choice, out: CompletionOutput) -> dict:
        entries = self.entries(out.logprobs)
        lp = None if entries is None else responses.completion_logprobs(entries, len(choice.prompt_text))
        return responses.completion_choice(choice.index, choice.prompt_text + out.text,
                                   out.finish_reason, lp, out.stop_reason)

    def response(self, choices: list[dict], usage: dict) -> dict:
        return responses.completion_response(self.request_id, self.model, self.created, choices, usage)


class ChatFormat(_Format):
    chunk_object = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, texts: TokenTexts | None,
                 include_usage: bool, tools: ToolChoice | None = None,
                 tool_parser: str | None = None):
        super().__init__(request_id, model, texts, include_usage)
        self.tools, self.tool_parser = tools or ToolChoice(), tool_parser
        self._parsers: dict[int, ToolCallParser | None] = {}

    def opening(self, choice: Choice) -> list[dict]:
        return [responses.chat_chunk(self.request_id, self.model, self.created, choice.index,
                             {"role": "assistant", "content": ""},
                             include_usage=self.include_usage)]

    def _parser(self, choice: Choice) -> ToolCallParser | None:
        if choice.index not in self._parsers:
            self._parsers[choice.index] = parser_for(self.tools, self.tool_parser)
        return self._parsers[choice.index]

    def chunks(self, choice: Choice, out: RequestOutput) -> list[dict]:
        entries = self.entries(out.new_logprobs)
        content, calls, parser = out.new_text, [], self._parser(choice)
        if parser is not None:
            content, calls = parser.feed(out.new_text)
            if out.finished:
                more, last = parser.finish()
                content, calls = content + more, calls + last
        if not (content or calls or out.finished or entries):
            return []
        logprobs = None if entries is None else responses.chat_logprobs(entries)
        # One tool-call delta per chunk, each after the content it follows.
        deltas = [{"content": content}] if content else []
        deltas += [{"tool_calls": [call]} for call in calls]
        deltas = deltas or [{}]
        finish = _finish_reason(parser, out.finish_reason) if out.finished else None
        chunks = []
        for i, delta in enumerate(deltas):  # logprobs on the first, finish_reason on the last
            last = i == len(deltas) - 1
            chunks.append(responses.chat_chunk(
                self.request_id, self.model, self.created, choice.index, delta,
                finish if last else None, logprobs if i == 0 else None, out.stop_reason,
                include_usage=self.include_usage))
        return chunks

    def choice(self, choice: Choice, out: CompletionOutput) -> dict:
        entries = self.entries(out.logprobs)
        lp = None if entries is None else responses.chat_logprobs(entries)
        parser = parser_for(self.tools, self.tool_parser)
        if parser is None:
            return responses.chat_choice(choice.index, out.text, out.finish_reason, lp,
                                         out.stop_reason)
        parser.feed(out.text)
        parser.finish()
        return responses.chat_choice(choice.index, parser.content if not parser.calls
                                     or parser.content.strip() else None,
                                     _finish_reason(parser, out.finish_reason), lp,
                                     out.stop_reason, parser.calls or None)

    def response(self, choices: list[dict], usage: dict) -> dict:
        return responses.chat_response(self.request_id, self.model, self.created, choices, usage)


def _finish_reason(parser: ToolCallParser | None, reason: str | None) -> str | None:
    return "tool_calls" if parser is not None and parser.calls and reason == "stop" else reason


def count_usage(choices: list[Choice], num_tokens: dict[int, int]) -> dict:
    """Prompt tokens once per prompt (not once per choice), as OpenAI counts."""
    prompts = {c.prompt_index: len(c.prompt_ids) for c in choices}
    return responses.usage(sum(prompts.values()), sum(num_tokens.values()))


# -- writing -------------------------------------------------------------------------------

def _check_all_finished(choices: list[Choice], finished: set[int]) -> None:
    if len(finished) != len(choices):
        raise p.ProtocolError("the engine ended a request without a final output", status=500)


async def collect(stream: OutputStream, fmt: _Format, choices: list[Choice]) -> dict:
    """Non-streaming: wait for every choice, then one JSON body with usage."""
    results = {c.index: CompletionOutput(logprobs=[]) for c in choices}
    while (item := await stream.get()) is not None:
        choice, out = item
        if (failure := engine_failure(out)) is not None:
            raise failure
        results[choice.index].add(out)
    _check_all_finished(choices, {i for i, r in results.items() if r.finished})
    body = [fmt.choice(c, results[c.index]) for c in choices]
    return fmt.response(body, count_usage(choices, {i: len(r.token_ids)
                                                    for i, r in results.items()}))


async def write_stream(request: web.Request, stream: OutputStream, fmt: _Format,
                       choices: list[Choice]) -> web.StreamResponse:
    """Streaming: headers go out with the first engine update, so a request the engine
    refuses still gets a plain HTTP error; after that, errors become an SSE error event."""
    first = await stream.get()  # raises before any byte is sent
    if first is not None and (failure := engine_failure(first[1])) is not None:
        raise failure
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    num_tokens = {c.index: 0 for c in choices}
    finished: set[int] = set()
    try:
        for choice in choices:
            for chunk in fmt.opening(choice):
                await response.write(sse_event(chunk))
        item = first
        while item is not None:
            choice, out = item
            if (failure := engine_failure(out)) is not None:
                raise failure
            for chunk in fmt.chunks(choice, out):
                await response.write(sse_event(chunk))
            num_tokens[choice.index] += len(out.new_token_ids)
            if out.finished:
                finished.add(choice.index)
            item = await stream.get()
        _check_all_finished(choices, finished)
        if fmt.include_usage:
            await response.write(sse_event(fmt.usage_chunk(count_usage(choices, num_tokens))))
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client is gone: nothing more to write; the caller closes the stream
    except Exception as exc:  # noqa: BLE001 - the status is already 200: report in-band
        error = exc if isinstance(exc, p.ProtocolError) else engine_exception(exc)
        await response.write(sse_event(error.to_dict()))
    await response.write(SSE_DONE)
    await response.write_eof()
    return response
