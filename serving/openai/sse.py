"""From engine outputs to OpenAI responses: one engine request per prompt, whose n samples
are the prompt's choices, merged into one stream of updates, then written as SSE chunks or
collected into one JSON response. Also the token texts for logprobs.

Lifetime rule: whatever way a response ends (finished, error, client gone, handler
cancelled), every engine generator is closed, which aborts its engine request and frees its
pages. `OutputStream.aclose()` is the one place that guarantees it.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
from dataclasses import dataclass

from aiohttp import web

from serving.openai import protocol as p
from serving.openai import responses
from serving.engine.async_engine import EngineDeadError
from serving.core.outputs import RequestOutput, TokenLogprob
from serving.core.sampling_params import SamplingParams

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}  # tell reverse proxies not to buffer the stream
_END = object()


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
    sample_index: int = 0  # RequestOutput.index of this choice's sample


class OutputStream:
    """Runs the choices' engine requests concurrently and hands out (choice, output) pairs
    in arrival order; `get()` returns None once every request has finished.

    Every request is submitted when the stream is built, before the caller awaits anything,
    so the engine's queue length (admission control) counts it at once."""

    def __init__(self, engine, metrics, choices: list[Choice], arrival: float):
        self._metrics, self._arrival = metrics, arrival
        self._queue: asyncio.Queue = asyncio.Queue()
        requests: dict[str, list[Choice]] = {}
        for c in choices:
            requests.setdefault(c.request_id, []).append(c)
        self._open = len(requests)
        self._gens = []
        try:
            for samples in requests.values():
                c = samples[0]
                self._gens.append(engine.generate(c.prompt_ids, c.params, c.request_id))
        except BaseException:
            for gen in self._gens:  # withdraw the ones already submitted
                _close_now(gen)
            raise
        self._tasks = [asyncio.create_task(self._pump(samples, gen))
                       for samples, gen in zip(requests.values(), self._gens)]

    async def _pump(self, samples: list[Choice], gen) -> None:
        """One engine request: its outputs go to the choice of their sample."""
        by_index = {c.sample_index: c for c in samples}
        trackers = {i: self._metrics.track(len(c.prompt_ids), self._arrival)
                    for i, c in by_index.items()}
        queue_times = {}  # the engine reports it on a sample's first update only
        try:
            async for out in gen:
                choice, tracker = by_index[out.index], trackers[out.index]
                if queue_times.get(out.index) is None:
                    queue_times[out.index] = getattr(out, "queue_time", None)
                tracker.on_output(len(out.new_token_ids))
                if out.finished:
                    tracker.on_finish(out.finish_reason, queue_times[out.index])
                self._queue.put_nowait((choice, out))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which decides
            for tracker in trackers.values():
                if tracker.last is None:
                    tracker.done = True  # refused before it ran: not a finished request
            self._queue.put_nowait((samples[0], e))
        finally:
            for tracker in trackers.values():
                tracker.on_finish("abort")  # no-op when it finished
            try:
                await gen.aclose()  # aborts the engine request if it is still running
            finally:
                self._queue.put_nowait((samples[0], _END))

    async def get(self) -> tuple[Choice, RequestOutput] | None:
        while self._open:
            choice, item = await self._queue.get()
            if item is _END:
                self._open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                return choice, item
        return None

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for gen in self._gens:  # a task cancelled before it started never closed its own
            _close_now(gen)


def _close_now(gen) -> None:
    """Closes an engine stream without awaiting: AsyncEngine's streams close synchronously;
    a plain async generator that never started has nothing to clean up."""
    close = getattr(gen, "close", None)
    if close is not None:
        close()


def engine_failure(out: RequestOutput) -> p.ProtocolError | None:
    if out.error is None and out.finish_reason != "error":
        return None
    return p.ProtocolError(f"generation failed: {out.error or 'engine error'}", status=500)


def engine_exception(exc: Exception) -> p.ProtocolError:
    """An exception from engine.generate: ValueError means the scheduler refused it."""
    if isinstance(exc, p.ProtocolError):
        return exc
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

    def __init__(self, request_id: str, model: str, texts: "TokenTexts | None",
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

    def chunk(self, choice: Choice, out: RequestOutput) -> dict | None:
        entries = self.entries(out.new_logprobs)
        if not (out.new_text or out.finished or entries):
            return None
        logprobs = None if entries is None else responses.completion_logprobs(entries, choice.text_offset)
        choice.text_offset += len(out.new_text)
        return responses.completion_chunk(
            self.request_id, self.model, self.created, choice.index, out.new_text,
            out.finish_reason if out.finished else None, logprobs,
            out.stop_reason if out.finished else None, include_usage=self.include_usage)

    def choice(self, choice: Choice, out: RequestOutput, logprobs: list[TokenLogprob]) -> dict:
        entries = self.entries(logprobs)
        lp = None if entries is None else responses.completion_logprobs(entries, len(choice.prompt_text))
        return responses.completion_choice(choice.index, choice.prompt_text + out.text,
                                   out.finish_reason, lp, out.stop_reason)

    def response(self, choices: list[dict], usage: dict) -> dict:
        return responses.completion_response(self.request_id, self.model, self.created, choices, usage)


class ChatFormat(_Format):
    chunk_object = "chat.completion.chunk"

    def opening(self, choice: Choice) -> list[dict]:
        return [responses.chat_chunk(self.request_id, self.model, self.created, choice.index,
                             {"role": "assistant", "content": ""},
                             include_usage=self.include_usage)]

    def chunk(self, choice: Choice, out: RequestOutput) -> dict | None:
        entries = self.entries(out.new_logprobs)
        if not (out.new_text or out.finished or entries):
            return None
        delta = {"content": out.new_text} if out.new_text else {}
        logprobs = None if entries is None else responses.chat_logprobs(entries)
        return responses.chat_chunk(self.request_id, self.model, self.created, choice.index, delta,
                            out.finish_reason if out.finished else None, logprobs,
                            out.stop_reason, include_usage=self.include_usage)

    def choice(self, choice: Choice, out: RequestOutput, logprobs: list[TokenLogprob]) -> dict:
        entries = self.entries(logprobs)
        lp = None if entries is None else responses.chat_logprobs(entries)
        return responses.chat_choice(choice.index, out.text, out.finish_reason, lp, out.stop_reason)

    def response(self, choices: list[dict], usage: dict) -> dict:
        return responses.chat_response(self.request_id, self.model, self.created, choices, usage)


def count_usage(choices: list[Choice], finals: dict[int, RequestOutput]) -> dict:
    """Prompt tokens once per prompt (not once per choice), as OpenAI counts."""
    prompts = {c.prompt_index: len(c.prompt_ids) for c in choices}
    completion = sum(len(out.token_ids) for out in finals.values())
    return responses.usage(sum(prompts.values()), completion)


# -- writing -------------------------------------------------------------------------------

def _check_all_finished(choices: list[Choice], finals: dict[int, RequestOutput]) -> None:
    if len(finals) != len(choices):
        raise p.ProtocolError("the engine ended a request without a final output", status=500)


async def collect(stream: OutputStream, fmt: _Format, choices: list[Choice]) -> dict:
    """Non-streaming: wait for every choice, then one JSON body with usage."""
    finals: dict[int, RequestOutput] = {}
    logprobs: dict[int, list[TokenLogprob]] = {c.index: [] for c in choices}
    while (item := await stream.get()) is not None:
        choice, out = item
        logprobs[choice.index].extend(out.new_logprobs or [])
        if (failure := engine_failure(out)) is not None:
            raise failure
        if out.finished:
            finals[choice.index] = out
    _check_all_finished(choices, finals)
    body = [fmt.choice(c, finals[c.index], logprobs[c.index]) for c in choices]
    return fmt.response(body, count_usage(choices, finals))


async def write_stream(request: web.Request, stream: OutputStream, fmt: _Format,
                       choices: list[Choice]) -> web.StreamResponse:
    """Streaming: headers go out with the first engine update, so a request the engine
    refuses still gets a plain HTTP error; after that, errors become an SSE error event."""
    first = await stream.get()  # raises before any byte is sent
    if first is not None and (failure := engine_failure(first[1])) is not None:
        raise failure
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    finals: dict[int, RequestOutput] = {}
    try:
        for choice in choices:
            for chunk in fmt.opening(choice):
                await response.write(sse_event(chunk))
        item = first
        while item is not None:
            choice, out = item
            if (failure := engine_failure(out)) is not None:
                raise failure
            if (chunk := fmt.chunk(choice, out)) is not None:
                await response.write(sse_event(chunk))
            if out.finished:
                finals[choice.index] = out
            item = await stream.get()
        _check_all_finished(choices, finals)
        if fmt.include_usage:
            await response.write(sse_event(fmt.usage_chunk(count_usage(choices, finals))))
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client is gone: nothing more to write; the caller closes the stream
    except Exception as exc:  # noqa: BLE001 - the status is already 200: report in-band
        error = exc if isinstance(exc, p.ProtocolError) else engine_exception(exc)
        await response.write(sse_event(error.to_dict()))
    await response.write(SSE_DONE)
    await response.write_eof()
    return response


# -- token texts for logprobs ----------------------------------------------------------------

def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable character map, char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """Token id -> (text, exact bytes), as OpenAI's logprobs show tokens. A token that is
    not valid UTF-8 on its own (part of a character) is shown as 'bytes:\\xe4\\xbd'."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._alphabet = (_byte_level_alphabet()
                          if "ByteLevel" in repr(getattr(backend, "decoder", None)) else None)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {i: t.content for i, t in added.items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._alphabet is not None and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        if m := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        if "▁" in piece:  # SentencePiece's word boundary marker is a space
            return piece.replace("▁", " ").encode()
        return self.tokenizer.convert_tokens_to_string([piece]).encode()

    def get(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._cache[token_id] = (text, list(raw))
        return self._cache[token_id]

    def entry(self, lp: TokenLogprob) -> responses.LogprobEntry:
        text, raw = self.get(lp.token_id)
        top = [(*self.get(t), _finite(v)) for t, v in lp.top]
        return responses.LogprobEntry(text, raw, _finite(lp.logprob), top)


def _finite(x: float) -> float:
    """JSON has no -Infinity: a masked token's logprob is shown as vLLM shows it."""
    return x if math.isfinite(x) else -9999.0
