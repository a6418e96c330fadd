"""/v1/embeddings (an engine started with `--task embed`), and what the task changes about
the rest of the server: the generation routes answer 400 on an embedding server, and
/openapi.json lists only the routes that work.

Each input is one engine request (AsyncEngine.encode) with PoolingParams; they run through
the same continuous-batching loop as generation, all delivering into one queue read here.
Whatever way the response ends, the requests still running are aborted.
"""
from __future__ import annotations

import asyncio
import time

from aiohttp import web

from serving.core.pooling_params import PoolingParams
from serving.core.request_checks import RequestRefused, check_token_ids, fit_pooling_prompt
from serving.openai import embeddings_protocol as ep
from serving.openai import responses
from serving.openai import sse
from serving.openai.access_log import record_tokens
from serving.openai.fields import ProtocolError
from serving.openai.http_guard import read_json
from serving.openai.openapi import _post
from serving.openai.protocol import refused
from serving.openai.server_state import (STATE, ServerState, check_admission, check_prompt_size,
                                         check_queue)

# Routes that generate text; an embedding server refuses them (POST only: another method
# keeps its 405).
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def task(state: ServerState) -> str:
    return getattr(state.engine, "task", "generate")


def _refuses(path: str) -> bool:
    return any(path == r or path.startswith(r + "/") for r in GENERATION_ROUTES)


@web.middleware
async def task_middleware(request: web.Request, handler):
    """On an embedding server, the generation routes answer a 400 that says why."""
    if request.method == "POST" and _refuses(request.path) and task(request.app[STATE]) == "embed":
        raise ProtocolError(f"this server runs --task embed (an embedding model): "
                            f"{request.path} is not served; use /v1/embeddings",
                            code="unsupported_task")
    return await handler(request)


def openapi_for_task(spec: dict, state: ServerState) -> dict:
    """/openapi.json as this server's task has it: on an embedding server, /v1/embeddings
    and no generation route."""
    if task(state) != "embed":
        return spec
    engine = state.engine
    paths = {k: v for k, v in spec["paths"].items() if not _refuses(k)}
    body = ep.request_schema(state.model, engine.vocab_size, engine.max_model_len,
                             engine.embedding.hidden_size)
    paths["/v1/embeddings"] = _post("embeddings of texts or token ids", body)
    return {**spec, "paths": paths}


def _prompt_ids(state: ServerState, req: ep.EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids, truncated as asked and checked (vocabulary, context)."""
    engine, out = state.engine, []
    for item in req.inputs:
        if isinstance(item, str):
            check_prompt_size(state, len(item), "input")
            ids = list(engine.tokenizer.encode(item, add_special_tokens=req.add_special_tokens))
        else:
            ids = item
        ids = ep.truncate(ids, req.truncate_prompt_tokens, engine.max_model_len)
        try:
            check_token_ids(ids, engine.vocab_size, "input")
            fit_pooling_prompt(len(ids), engine.max_model_len)
        except RequestRefused as e:
            raise refused(e) from None
        out.append(ids)
    return out


async def embeddings(request: web.Request) -> web.Response:
    arrival = time.monotonic()
    state = request.app[STATE]
    engine = state.engine
    check_admission(state)
    if task(state) != "embed":
        raise ProtocolError("this server generates text: /v1/embeddings needs a server "
                            "started with --task embed (or --runner pooling)",
                            code="unsupported_task")
    body = await read_json(request)
    req = ep.parse_embedding_request(body)
    if req.model is not None and req.model != state.model:
        raise ProtocolError(f"The model '{req.model}' does not exist; this server serves "
                            f"'{state.model}'.", status=404, param="model",
                            code="model_not_found")
    try:
        params = engine.embedding.resolve(req.params)
    except RequestRefused as e:
        raise refused(e) from None
    prompts = _prompt_ids(state, req)
    num_tokens = sum(map(len, prompts))
    try:
        vectors = await _run(request, state, prompts, params, arrival)
    finally:
        record_tokens(request, num_tokens, 0)
    data = [ep.encode(v, req.encoding_format, req.endianness) for v in vectors]
    return web.json_response(ep.response_body(responses.new_id("embd"), responses.now(),
                                              state.model, data, num_tokens))


async def _run(request: web.Request, state: ServerState, prompts: list[list[int]],
               params: PoolingParams, arrival: float) -> list[list[float]]:
    """Submits every input at once (no await before the last), then reads their outputs."""
    check_queue(state)
    queue: asyncio.Queue = asyncio.Queue()
    base = responses.new_id("embd")
    ids = {f"{base}-{i}": i for i in range(len(prompts))}
    trackers = {rid: state.metrics.track(len(prompts[i]), arrival) for rid, i in ids.items()}
    streams, vectors = [], [None] * len(prompts)
    try:
        for rid, i in ids.items():
            streams.append(state.engine.encode(prompts[i], params, rid, queue=queue))
        async with sse.cancel_on_disconnect(request):
            for _ in prompts:
                rid, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out.error is not None:
                    raise ProtocolError(f"embedding failed: {out.error}", status=500)
                trackers[rid].on_finish(out.finish_reason, out.queue_time)
                streams[ids[rid]].take(out)
                vectors[ids[rid]] = out.embedding
        return vectors
    except Exception as exc:  # noqa: BLE001 - engine exceptions become OpenAI errors
        if isinstance(exc, (ProtocolError, ConnectionResetError, web.HTTPException)):
            raise
        raise sse.engine_exception(exc) from exc
    finally:
        for stream in streams:
            stream.close()  # aborts the ones still running: client gone, error, ...
