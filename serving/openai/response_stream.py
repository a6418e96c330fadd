"""A Responses API response's lifetime: its one engine request (serving/openai/sse.py's
OutputStream), every update fed to its ResponseBuilder, then typed SSE events or one JSON
body, and the finished response stored.

Streamed, the headers go out with the first engine update, so a request the engine refuses
still gets a plain HTTP error; after that a failure is a `response.failed` event. Whatever
way it ends, OutputStream.aclose() aborts the engine request if it still runs.
"""
from __future__ import annotations

import asyncio
import json

from aiohttp import web

from serving.openai import responses
from serving.openai import sse
from serving.openai.access_log import record_tokens
from serving.openai.fields import ProtocolError
from serving.openai.response_events import ResponseBuilder
from serving.openai.response_store import ResponseStore
from serving.openai.server_state import ServerState, check_queue


def sse_event(event: dict) -> bytes:
    """`event: <type>` then the event as `data:`, as OpenAI writes them."""
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


class Finished:
    """What to do with the response once it is whole: store it (with its conversation)."""

    def __init__(self, store: ResponseStore | None, history: list[dict]):
        self.store, self.history = store, history

    def __call__(self, response: dict) -> None:
        if self.store is not None and response["status"] in ("completed", "incomplete"):
            self.store.put(response, self.history)


async def _next(stream: sse.OutputStream):
    """The next engine update, its failure raised."""
    item = await stream.get()
    if item is not None and (failure := sse.engine_failure(item[1])) is not None:
        raise failure
    return item


def _feed(builder: ResponseBuilder, item) -> list[dict]:
    _, out = item
    events = builder.feed(out.new_text, len(out.new_token_ids))
    if out.finished:
        events += builder.finish(out.finish_reason, responses.now())
    return events


async def collect(stream: sse.OutputStream, builder: ResponseBuilder) -> dict:
    while (item := await _next(stream)) is not None:
        _feed(builder, item)
    if builder.status == "in_progress":
        raise ProtocolError("the engine ended a request without a final output", status=500)
    return builder.response()


async def write_stream(request: web.Request, stream: sse.OutputStream,
                       builder: ResponseBuilder, on_done: Finished) -> web.StreamResponse:
    first = await _next(stream)  # raises before any byte is sent
    response = web.StreamResponse(headers=sse.SSE_HEADERS)
    await response.prepare(request)
    try:
        for event in builder.opening():
            await response.write(sse_event(event))
        item = first
        while item is not None:
            for event in _feed(builder, item):
                await response.write(sse_event(event))
            item = await _next(stream)
        if builder.status == "in_progress":
            raise ProtocolError("the engine ended a request without a final output", status=500)
        on_done(builder.response())
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client is gone: nothing more to write; the caller closes the stream
    except Exception as exc:  # noqa: BLE001 - the status is already 200: report in-band
        error = sse.engine_exception(exc)
        for event in builder.fail(error.message):
            await response.write(sse_event(event))
    await response.write_eof()
    return response


async def respond(request: web.Request, state: ServerState, choices: list[sse.Choice],
                  builder: ResponseBuilder, is_stream: bool, on_done: Finished,
                  arrival: float) -> web.StreamResponse:
    """Submits the response's engine request and runs it to its end (as api_server's
    _respond does for chat and completions)."""
    check_queue(state)  # no await from here until the request is submitted
    try:
        stream = sse.OutputStream(state.engine, state.metrics, choices, arrival)
    except Exception as exc:  # noqa: BLE001 - e.g. the engine died a moment ago
        raise sse.engine_exception(exc) from exc
    try:
        async with sse.cancel_on_disconnect(request):
            if is_stream:
                return await write_stream(request, stream, builder, on_done)
            body = await collect(stream, builder)
        on_done(body)
        return web.json_response(body)
    except Exception as exc:  # noqa: BLE001 - engine exceptions become OpenAI errors
        if isinstance(exc, (ProtocolError, ConnectionResetError, web.HTTPException)):
            raise
        raise sse.engine_exception(exc) from exc
    finally:
        await stream.aclose()  # aborts whatever is still running: client gone, error, ...
        record_tokens(request, *stream.token_counts())
