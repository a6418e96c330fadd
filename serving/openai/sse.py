"""From engine outputs to OpenAI responses: one engine request per prompt, whose n samples
are the prompt's choices, merged into one stream of updates, then written as SSE chunks or
collected into one JSON response.

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

from serving.openai import echo
from serving.openai import protocol as p
from serving.openai import responses
from serving.openai.reasoning_parsers import ReasoningParser
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
    """One OpenAI choice = one sample of an engine request (choices of one prompt share
    the request id)."""
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # the request's: n samples, max_tokens resolved against the context
    prompt_index: int = 0  # which prompt of the request: usage counts each prompt once
    prompt_text: str = ""  # echoed before the completion (completions with echo)
    text_offset: int = 0  # completions logprobs: where the next token's text starts
    echo_only: bool = False  # max_tokens 0 with echo: the one sampled token is not shown
    echo_logprobs: bool = False  # echo with logprobs: they cover the prompt, then the rest
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field, with this top k
    echo_pending: bool = False  # streaming: the echo waits for the prompt's logprobs
    sample_index: int = 0  # RequestOutput.index of this choice's sample
    lora: object | None = None  # the LoRARequest the `model` field named; None: the base


class OutputStream:
    """Runs the choices' engine requests (one per prompt, its n samples the choices)
    concurrently and hands out (choice, output) pairs in arrival order; `get()` returns None
    once every sample has finished.

    All of them deliver into one queue, filled from the engine thread: the one hop between
    the engine and this response (docs/architecture.md, "A request's path"). Every request is
    submitted when the stream is built, before the caller awaits anything, so the engine's
    queue length (admission control) counts it at once."""

    def __init__(self, engine, metrics, choices: list[Choice], arrival: float):
        self._queue: asyncio.Queue = asyncio.Queue()
        # Keyed by (request id, sample index): one choice, one tracker per sample.
        self._choices = {(c.request_id, c.sample_index): c for c in choices}
        self._trackers = {key: metrics.track(len(c.prompt_ids), arrival)
                          for key, c in self._choices.items()}
        self._queue_times: dict[tuple[str, int], float | None] = {}
        self._streams = {}
        try:
            for c in choices:
                if c.request_id not in self._streams:
                    adapter = {"lora_request": c.lora} if c.lora is not None else {}
                    self._streams[c.request_id] = engine.generate(
                        c.prompt_ids, c.params, c.request_id, queue=self._queue, **adapter)
        except BaseException:
            for stream in self._streams.values():  # withdraw the ones already submitted
                stream.close()
            raise
        self._open = set(self._choices)

    def token_counts(self) -> tuple[int, int]:
        """(prompt tokens, output tokens so far) over every choice."""
        return (sum(t.num_prompt_tokens for t in self._trackers.values()),
                sum(t.num_generated for t in self._trackers.values()))

    async def get(self) -> tuple[Choice, RequestOutput] | None:
        while self._open:
            request_id, item = await self._queue.get()
            if isinstance(item, Exception):
                samples = [key for key in self._open if key[0] == request_id]
                if not samples:
                    continue
                self._streams[request_id].take(item)
                for key in samples:
                    self._open.discard(key)
                    if self._trackers[key].last is None:
                        self._trackers[key].done = True  # refused before it ran
                raise item
            key = (request_id, item.index)
            if key not in self._open:
                continue  # after its end (e.g. an abort racing the last step)
            self._streams[request_id].take(item)
            tracker = self._trackers[key]
            if key not in self._queue_times:  # the engine sends it on the first update
                self._queue_times[key] = item.queue_time
            tracker.on_output(len(item.new_token_ids))
            if item.finished:
                self._open.discard(key)
                tracker.on_finish(item.finish_reason, self._queue_times[key])
            return self._choices[key], item
        return None

    async def aclose(self) -> None:
        """Aborts every request still running (client gone, error, cancelled handler)."""
        for request_id in {key[0] for key in self._open}:
            self._streams[request_id].close()
        for key in self._open:
            self._trackers[key].on_finish("abort")
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
                 include_usage: bool, logprobs: bool | None = None):
        """texts: for logprobs or prompt_logprobs; logprobs: whether the choices carry
        logprobs (default: when texts are given)."""
        self.request_id, self.model, self.texts = request_id, model, texts
        self.include_usage = include_usage
        self.logprobs = texts is not None if logprobs is None else logprobs
        self.created = responses.now()

    def entries(self, logprobs: list[TokenLogprob] | None) -> list[responses.LogprobEntry] | None:
        if not self.logprobs:
            return None
        return [self.texts.entry(lp) for lp in (logprobs or [])]

    def usage_chunk(self, usage: dict) -> dict:
        return responses.usage_chunk(self.chunk_object, self.request_id, self.model, self.created, usage)


class CompletionFormat(_Format):
    chunk_object = "text_completion"

    def opening(self, choice: Choice) -> list[dict]:
        if not choice.prompt_text:
            return []
        if choice.echo_logprobs:  # sent with the first update, which brings the prompt's
            choice.echo_pending = True
            return []
        choice.text_offset = len(choice.prompt_text)
        return [responses.completion_chunk(self.request_id, self.model, self.created, choice.index,
                                   choice.prompt_text, include_usage=self.include_usage)]

    def _shown(self, choice: Choice, text: str, logprobs):
        """(text, logprob entries) of the completion as the client sees it."""
        entries = self.entries(logprobs)
        if choice.echo_only:
            return "", None if entries is None else []
        return text, entries

    def _logprobs(self, choice: Choice, entries, prompt_logprobs) -> dict | None:
        """Completions logprobs: with echo, the prompt's tokens (offsets from 0), then the
        completion's (offsets after the echoed prompt text)."""
        if entries is None:
            return None
        rest = responses.completion_logprobs(entries, len(choice.prompt_text))
        if not choice.echo_logprobs or prompt_logprobs is None:
            return rest
        prompt = responses.completion_logprobs(
            echo.prompt_entries(self.texts, choice.prompt_ids, prompt_logprobs), 0)
        return {key: prompt[key] + rest[key] for key in prompt}

    def chunks(self, choice: Choice, out: RequestOutput) -> list[dict]:
        text, entries = self._shown(choice, out.new_text, out.new_logprobs)
        if choice.echo_pending:
            choice.echo_pending = False
            logprobs = self._logprobs(choice, entries, out.prompt_logprobs)
            choice.text_offset = len(choice.prompt_text) + len(text)
            text = choice.prompt_text + text
        elif not (text or out.finished or entries):
            return []
        else:
            logprobs = None if entries is None else responses.completion_logprobs(
                entries, choice.text_offset)
            choice.text_offset += len(text)
        return [responses.completion_chunk(
            self.request_id, self.model, self.created, choice.index, text,
            out.finish_reason if out.finished else None, logprobs,
            out.stop_reason if out.finished else None, include_usage=self.include_usage)]

    def choice(self, choice: Choice, out: CompletionOutput) -> dict:
        text, entries = self._shown(choice, out.text, out.logprobs)
        body = responses.completion_choice(choice.index, choice.prompt_text + text,
                                           out.finish_reason,
                                           self._logprobs(choice, entries, out.prompt_logprobs),
                                           out.stop_reason)
        if choice.prompt_logprobs is not None:
            body["prompt_logprobs"] = echo.vllm_prompt_logprobs(
                self.texts, out.prompt_logprobs or [], choice.prompt_logprobs)
        return body

    def response(self, choices: list[dict], usage: dict) -> dict:
        return responses.completion_response(self.request_id, self.model, self.created, choices, usage)


class ChatFormat(_Format):
    chunk_object = "chat.completion.chunk"
    prompt_logprobs: list | None = None  # vLLM's field, set by choice()

    def __init__(self, request_id: str, model: str, texts: TokenTexts | None,
                 include_usage: bool, tools: ToolChoice | None = None,
                 tool_parser: str | None = None, logprobs: bool | None = None,
                 reasoning=None, include_reasoning: bool = True):
        """reasoning: makes a choice's ReasoningParser (None: no --reasoning-parser);
        include_reasoning false drops the thinking. Tool calls are parsed in the answer."""
        super().__init__(request_id, model, texts, include_usage, logprobs)
        self.tools, self.tool_parser = tools or ToolChoice(), tool_parser
        self._parsers: dict[int, ToolCallParser | None] = {}
        self.reasoning, self.include_reasoning = reasoning, include_reasoning
        self._reasoners: dict[int, ReasoningParser] = {}

    def opening(self, choice: Choice) -> list[dict]:
        return [responses.chat_chunk(self.request_id, self.model, self.created, choice.index,
                             {"role": "assistant", "content": ""},
                             include_usage=self.include_usage)]

    def _parser(self, choice: Choice) -> ToolCallParser | None:
        if choice.index not in self._parsers:
            self._parsers[choice.index] = parser_for(self.tools, self.tool_parser)
        return self._parsers[choice.index]

    def _think(self, choice: Choice, text: str, finished: bool) -> tuple[str, str]:
        """(thinking, answer) of a choice's new text; all answer without a reasoning parser."""
        if self.reasoning is None:
            return "", text
        if choice.index not in self._reasoners:
            self._reasoners[choice.index] = self.reasoning()
        reasoner = self._reasoners[choice.index]
        thinking, answer = reasoner.feed(text)
        if finished:
            more, rest = reasoner.finish()
            thinking, answer = thinking + more, answer + rest
        return (thinking if self.include_reasoning else ""), answer

    def chunks(self, choice: Choice, out: RequestOutput) -> list[dict]:
        entries = self.entries(out.new_logprobs)
        thinking, answer = self._think(choice, out.new_text, out.finished)
        content, calls, parser = answer, [], self._parser(choice)
        if parser is not None:
            content, calls = parser.feed(answer)
            if out.finished:
                more, last = parser.finish()
                content, calls = content + more, calls + last
        if not (thinking or content or calls or out.finished or entries):
            return []
        logprobs = None if entries is None else responses.chat_logprobs(entries)
        # The thinking first, then one tool-call delta per chunk after the content it follows.
        deltas = [{"reasoning_content": thinking, "reasoning": thinking}] if thinking else []
        deltas += [{"content": content}] if content else []
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
        if choice.prompt_logprobs is not None:  # vLLM puts it on the response, not a choice
            self.prompt_logprobs = echo.vllm_prompt_logprobs(
                self.texts, out.prompt_logprobs or [], choice.prompt_logprobs)
        text, reasoner = out.text, self.reasoning and self.reasoning()
        if reasoner:
            reasoner.feed(text)
            reasoner.finish()
            text = reasoner.content
        parser = parser_for(self.tools, self.tool_parser)
        if parser is None:
            body = responses.chat_choice(choice.index, text if not reasoner else text or None,
                                         out.finish_reason, lp, out.stop_reason)
        else:
            parser.feed(text)
            parser.finish()
            body = responses.chat_choice(choice.index, parser.content if not parser.calls
                                         or parser.content.strip() else None,
                                         _finish_reason(parser, out.finish_reason), lp,
                                         out.stop_reason, parser.calls or None)
        if reasoner:  # vLLM's names, old and new, for the same thinking
            thinking = reasoner.reasoning if reasoner.thinking and self.include_reasoning \
                else None
            body["message"].update(reasoning_content=thinking, reasoning=thinking)
        return body

    def response(self, choices: list[dict], usage: dict) -> dict:
        body = responses.chat_response(self.request_id, self.model, self.created, choices, usage)
        if self.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.prompt_logprobs
        return body


def _finish_reason(parser: ToolCallParser | None, reason: str | None) -> str | None:
    return "tool_calls" if parser is not None and parser.calls and reason == "stop" else reason


def count_usage(choices: list[Choice], num_tokens: dict[int, int]) -> dict:
    """Prompt tokens once per prompt (not once per choice), as OpenAI counts. Echo without
    generation generated nothing the client sees."""
    prompts = {c.prompt_index: len(c.prompt_ids) for c in choices}
    return responses.usage(sum(prompts.values()),
                           sum(num_tokens[c.index] for c in choices if not c.echo_only))


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
    response = fmt.response(body, count_usage(choices, {i: len(r.token_ids)
                                                        for i, r in results.items()}))
    # a prefill for another instance: vLLM puts the handshake at the top level
    kv = [r.kv_transfer_params for r in results.values() if r.kv_transfer_params]
    if kv:
        response["kv_transfer_params"] = kv[0]
    return response


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
