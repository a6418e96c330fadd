"""One access log line per HTTP request: method, path (no query string), status, tokens,
latency. Never a prompt, an output or a header (API keys travel in headers).

    xlaserve.access: POST /v1/chat/completions 200 prompt_tokens=31 completion_tokens=64 1.234s

Handlers that run the engine record their token counts with `record_tokens`. A client that
goes away mid-response is logged as 499, as nginx does. Off with `--disable-access-log`."""
from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

log = logging.getLogger("xlaserve.access")
TOKENS = web.RequestKey("xlaserve_tokens", tuple)  # (prompt tokens, completion tokens)


def record_tokens(request: web.Request, prompt_tokens: int, completion_tokens: int) -> None:
    request[TOKENS] = (prompt_tokens, completion_tokens)


@web.middleware
async def access_log_middleware(request: web.Request, handler):
    started = time.monotonic()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as e:
        status = e.status
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        status = 499
        raise
    finally:
        tokens = request.get(TOKENS)
        counts = (f" prompt_tokens={tokens[0]} completion_tokens={tokens[1]}"
                  if tokens else "")
        log.info("%s %s %d%s %.3fs", request.method, request.path, status, counts,
                 time.monotonic() - started)
