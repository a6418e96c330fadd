"""Honours `X-data-parallel-rank` (serving/core/dp_rank.py): a valid rank pins the request
to that replica, anything else is a 400 before the handler runs."""
from __future__ import annotations

from aiohttp import web

from serving.core.dp_rank import HEADER, parse_rank, requested_rank
from serving.openai import protocol as p
from serving.openai.server_state import STATE


@web.middleware
async def rank_middleware(request: web.Request, handler):
    text = request.headers.get(HEADER)
    if text is None:
        return await handler(request)
    try:
        rank = parse_rank(text, request.app[STATE].engine.config.data_parallel_size)
    except ValueError as e:
        raise p.ProtocolError(str(e), code="invalid_data_parallel_rank") from None
    token = requested_rank.set(rank)
    try:
        return await handler(request)
    finally:
        requested_rank.reset(token)
