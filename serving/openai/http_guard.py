"""What stands between a client and a handler: the OpenAI error envelope for every failure,
the API key, the drain gate, and reading a JSON body that may be hostile (too large,
truncated, not JSON, invalid Unicode, a content type a browser sends cross-site)."""
from __future__ import annotations

import hmac
import json
import logging

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from serving.openai import protocol as p
from serving.openai.server_state import STATE, ServerState

log = logging.getLogger(__name__)

# Not behind the API key and answered while draining: probes must see them.
OPEN_PATHS = {"/health"}
_HTTP_CODES = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}
# The content types a web page may POST to any origin without a CORS preflight. Refusing
# them keeps a page the user visits from driving a server on their loopback.
_CROSS_SITE_TYPES = {"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"}


class _UnparsableRequestFilter(logging.Filter):
    """aiohttp logs a request it cannot parse together with the offending bytes (a header
    line, the request line), which may hold an API key or prompt text: keep the event,
    drop the bytes."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg = "refused an unparsable HTTP request from %s (%s %s)"
            record.args = (remote, exc.code, type(exc).__name__)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_unparsable_requests() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _UnparsableRequestFilter) for f in server_log.filters):
        server_log.addFilter(_UnparsableRequestFilter())


def error_response(err: p.ProtocolError, headers=None) -> web.Response:
    return web.json_response(err.to_dict(), status=err.status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except p.ProtocolError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(p.ProtocolError(exc.reason, status=exc.status,
                                              code=_HTTP_CODES.get(exc.status)), allow)
    except ConnectionResetError:
        raise  # the client is gone; there is nobody to answer
    except Exception:  # noqa: BLE001 - one bad request must not take the server down
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(p.ProtocolError("internal server error", status=500))


def check_api_key(state: ServerState, request: web.Request) -> None:
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    # Header bytes that are not UTF-8 arrive as surrogate escapes: compare them as bytes.
    given = key.strip().encode("utf-8", "surrogateescape")
    ok = hmac.compare_digest(given, state.api_key.encode()) and scheme.lower() == "bearer"
    if not ok:
        raise p.ProtocolError("missing or invalid API key (Authorization: Bearer ...)",
                              status=401, code="invalid_api_key")


@web.middleware
async def gate_middleware(request: web.Request, handler):
    state = request.app[STATE]
    if request.path not in OPEN_PATHS and state.api_key is not None:
        check_api_key(state, request)
    if state.draining and request.path != "/metrics":
        raise p.ProtocolError("the server is shutting down", status=503, code="shutting_down")
    state.in_flight += 1
    state.idle.clear()
    try:
        return await handler(request)
    finally:
        state.in_flight -= 1
        if state.in_flight == 0:
            state.idle.set()


async def read_json(request: web.Request) -> dict:
    state = request.app[STATE]
    if request.content_type in _CROSS_SITE_TYPES:
        raise p.ProtocolError(f"the body must be JSON (Content-Type: application/json), "
                              f"not {request.content_type}", status=415,
                              code="unsupported_media_type")
    too_large = p.ProtocolError(f"request body exceeds {state.max_body_bytes} bytes",
                                status=413, code="request_too_large")
    if request.content_length is not None and request.content_length > state.max_body_bytes:
        raise too_large
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except HttpProcessingError as e:  # a truncated or badly chunked body
        raise p.ProtocolError(f"the request body could not be read: {e.message}") from None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise p.ProtocolError("the request body is not valid JSON") from None
    if b"\\u" in raw:
        _check_unicode(body)
    if not isinstance(body, dict):
        raise p.ProtocolError("the request body must be a JSON object")
    return body


def _check_unicode(body) -> None:
    """JSON may escape a lone surrogate ("\\ud800"), which no tokenizer (nor UTF-8) takes."""
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise p.ProtocolError("the request body holds an unpaired surrogate escape "
                              "(invalid Unicode)") from None
    except RecursionError:
        raise p.ProtocolError("the request body is nested too deeply") from None
