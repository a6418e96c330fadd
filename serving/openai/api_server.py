"""The aiohttp OpenAI-compatible server: routes, admission, graceful shutdown.

Handlers validate and tokenize, make one engine request per prompt (of n samples), and
hand off to `serving.openai.sse` to stream or collect the outputs. `serving.openai.http_guard` wraps every
handler (error envelope, API key, drain gate, hostile bodies), so every error leaves in
OpenAI's envelope; nothing a client sends reaches the engine unvalidated or crashes the
server. If the engine dies, run_server drains and returns 1.
"""
from __future__ import annotations

import asyncio
import functools
import signal
import time

from aiohttp import web

from serving.openai import protocol as p
from serving.openai import responses
from serving.openai import sse
from serving.openai import responses_route
from serving.openai import lora_routes
from serving.openai import worker_routes
from serving.openai.prompts import (chat_ids, chat_prompt, check_model, encode,
                                    forced_tool_call, prompt_choices, served_name)
from serving.openai import embeddings
from serving.openai import structured_protocol as sp
from serving.openai.http_guard import (error_middleware, gate_middleware, quiet_unparsable_requests,
                                read_json)
from serving.openai.dp_rank_header import rank_middleware
from serving.openai.access_log import access_log_middleware, record_tokens
from serving.openai.metrics import Metrics
from serving.openai.openapi import openapi_spec
from serving.openai.response_store import ResponseStore
from serving.openai.tools import parse_tool_choice
from serving.openai.chat_template_kwargs import chat_template_kwargs
from serving.openai.reasoning_constraint import answer_after_thinking
from serving.openai.reasoning_parsers import reasoning_parser_for, thinking_expected
from serving.openai.server_state import (STATE, ServerState, check_admission, check_prompt_size,
                                  check_queue)


def build_app(engine, *, served_model_name: str, api_key: str | None = None,
              max_queued_requests: int | None = None, max_body_bytes: int = 1 << 22,
              max_prompt_chars: int | None = None, chat_template: str | None = None,
              tool_call_parser: str | None = None, access_log: bool = True,
              reasoning_parser: str | None = None,
              disable_responses_store: bool = False) -> web.Application:
    """Best run with handler_cancellation=True (run_server does), so a client that goes away
    cancels its handler at once; without it, disconnects are noticed at the next write or
    within half a second (sse.cancel_on_disconnect)."""
    quiet_unparsable_requests()
    # The access log sits outside the error middleware: it logs the status the client got.
    middlewares = [error_middleware, gate_middleware, embeddings.task_middleware,
                   rank_middleware]
    app = web.Application(client_max_size=max_body_bytes,
                          middlewares=[access_log_middleware, *middlewares] if access_log
                          else middlewares)
    state = ServerState(engine, served_model_name, Metrics(served_model_name), api_key,
                        max_queued_requests, max_body_bytes, max_prompt_chars, chat_template,
                        tool_call_parser, reasoning_parser=reasoning_parser)
    state.idle.set()
    state.responses_store = None if disable_responses_store else ResponseStore()
    app[STATE] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings.embeddings)
    app.router.add_post("/v1/responses", responses_route.create_response)
    app.router.add_get("/v1/responses/{response_id}", responses_route.get_response)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/openapi.json", openapi)
    lora_routes.add_routes(app)
    worker_routes.add_routes(app)
    return app


async def _respond(request: web.Request, state: ServerState, choices: list[sse.Choice],
                   fmt, stream: bool, arrival: float) -> web.StreamResponse:
    check_queue(state)  # no await from here until every choice is submitted
    try:
        stream_ = sse.OutputStream(state.engine, state.metrics, choices, arrival)
    except Exception as exc:  # noqa: BLE001 - e.g. the engine died a moment ago
        raise sse.engine_exception(exc) from exc
    try:
        async with sse.cancel_on_disconnect(request):
            if stream:
                return await sse.write_stream(request, stream_, fmt, choices)
            body = await sse.collect(stream_, fmt, choices)
        return web.json_response(body)
    except Exception as exc:  # noqa: BLE001 - engine exceptions become OpenAI errors
        if isinstance(exc, (p.ProtocolError, ConnectionResetError, web.HTTPException)):
            raise
        raise sse.engine_exception(exc) from exc
    finally:
        await stream_.aclose()  # aborts whatever is still running: client gone, error, ...
        record_tokens(request, *stream_.token_counts())


# -- routes --------------------------------------------------------------------------------

async def completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()  # TTFT counts from here, tokenization included (as vLLM)
    state = request.app[STATE]
    engine, tokenizer = state.engine, state.engine.tokenizer
    check_admission(state)
    body = await read_json(request)
    req = p.parse_completion_request(body, engine.max_model_len, engine.max_logprobs)
    lora = check_model(state, req.model)
    await sp.compile_constraint(engine, req.params, body)
    for prompt in req.prompts:
        if isinstance(prompt, str):
            check_prompt_size(state, len(prompt), "prompt")
    choices: list[sse.Choice] = []
    for i, prompt in enumerate(req.prompts):
        ids = encode(tokenizer, prompt, add_special_tokens=True) if isinstance(prompt, str) \
            else prompt
        p.check_request_token_ids(ids, req.params, engine.vocab_size)
        max_tokens = p.check_context(len(ids), req.params.max_tokens, engine.max_model_len)
        params = sp.with_max_tokens(req.params, max_tokens)
        echo = (prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if req.echo else ""
        choices += prompt_choices(ids, i, params, i * req.params.n, echo, lora,
                                  echo_only=req.echo_only,
                                  echo_logprobs=req.echo and req.params.logprobs is not None,
                                  prompt_logprobs=req.prompt_logprobs)
    wants_texts = req.params.logprobs is not None or req.prompt_logprobs is not None
    texts = state.token_texts() if wants_texts else None
    fmt = sse.CompletionFormat(responses.new_id("cmpl"), served_name(state, lora), texts,
                               req.include_usage,
                               logprobs=req.params.logprobs is not None)
    return await _respond(request, state, choices, fmt, req.stream, arrival)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    arrival = time.monotonic()  # TTFT counts from here, tokenization included (as vLLM)
    state = request.app[STATE]
    engine = state.engine
    check_admission(state)
    body = await read_json(request)
    req = p.parse_chat_request(body, engine.max_logprobs)
    tools = parse_tool_choice(body, state.tool_call_parser is not None)
    template_kwargs = chat_template_kwargs(body)
    include_reasoning = p.opt_bool(body, "include_reasoning", True)
    lora = check_model(state, req.model)
    prompt, ids = chat_prompt(state, req.messages, req.add_generation_prompt,
                               tools=tools.tools, template_kwargs=template_kwargs)
    max_tokens = p.check_context(len(ids), req.params.max_tokens, engine.max_model_len,
                                 prompt_param="messages", max_tokens_param=req.max_tokens_param)
    params = sp.with_max_tokens(req.params, max_tokens)
    if tools.forced:
        params = forced_tool_call(params, tools)
    await sp.compile_constraint(engine, params, body, "tools" if tools.forced else None)
    if params.structured_outputs is not None and thinking_expected(
            state.reasoning_parser, prompt, template_kwargs):
        # The model thinks first; the constraint is the answer's (reasoning_constraint.py).
        params = answer_after_thinking(params, engine.tokenizer)
        await sp.compile_constraint(engine, params, body, "tools" if tools.forced else None)
    p.check_request_token_ids(ids, params, engine.vocab_size)
    texts = state.token_texts() if req.logprobs or req.prompt_logprobs is not None else None
    reasoning = None if state.reasoning_parser is None else functools.partial(
        reasoning_parser_for, state.reasoning_parser, prompt, template_kwargs)
    fmt = sse.ChatFormat(responses.new_id("chatcmpl"), served_name(state, lora), texts,
                         req.include_usage,
                         tools, state.tool_call_parser, logprobs=req.logprobs,
                         reasoning=reasoning, include_reasoning=include_reasoning)
    choices = prompt_choices(ids, 0, params, 0, lora=lora,
                             prompt_logprobs=req.prompt_logprobs)
    return await _respond(request, state, choices, fmt, req.stream, arrival)


def _model_card(state: ServerState) -> dict:
    return {"id": state.model, "object": "model", "created": state.created,
            "owned_by": "xlaserve", "root": state.model,
            "max_model_len": state.engine.max_model_len}


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list",
                              "data": [_model_card(state), *lora_routes.cards(state)]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    adapter = check_model(state, request.match_info["model"])
    return web.json_response(_model_card(state) if adapter is None
                             else lora_routes.card(state, adapter))


async def health(request: web.Request) -> web.Response:
    check_admission(request.app[STATE])  # while draining, the gate already answers 503
    return web.json_response({"status": "ok"})


async def openapi(request: web.Request) -> web.Response:
    state = request.app[STATE]
    spec = openapi_spec(state.model, state.engine.vocab_size, state.engine.max_model_len,
                        state.engine.max_logprobs)
    return web.json_response(lora_routes.openapi_for_lora(
        embeddings.openapi_for_task(spec, state), state))


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine
    for rank, s in enumerate(engine.replica_stats()):
        state.metrics.set_engine_stats(s.num_running, s.num_waiting, s.kv_cache_usage,
                                       s.num_preemptions_total, s.prefix_cache_queries,
                                       s.prefix_cache_hits, engine=rank)
        state.metrics.set_cache_config(engine.config.page_size, engine.num_pages - 1,
                                       engine.config.kv_cache_dtype,
                                       engine.config.enable_prefix_caching, engine=rank)
    stats = engine.stats()
    state.metrics.set_spec_decode_stats(stats.spec)
    state.metrics.set_prompt_token_sources(getattr(stats, "num_prompt_tokens_total", 0),
                                           getattr(stats, "num_prompt_tokens_transferred", 0))
    lora = lora_routes.manager(state)
    if lora is not None:
        state.metrics.set_lora_stats(stats.running_loras, stats.waiting_loras,
                                     lora.config.max_loras)
    response = web.Response(body=state.metrics.render())
    response.headers["Content-Type"] = state.metrics.content_type
    return response


def _tokenizer(state: ServerState):
    """The model's tokenizer; a model served without one (token ids in and out) answers the
    tokenizer endpoints with a 400, not a crash."""
    if state.engine.tokenizer is None:
        raise p.ProtocolError("this model is served without a tokenizer (token ids in and "
                              "out): there is nothing to tokenize or detokenize with",
                              code="no_tokenizer")
    return state.engine.tokenizer


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tokenizer = _tokenizer(state)
    body = await read_json(request)
    check_model(state, p.opt_str(body, "model"))
    add_generation_prompt = p.opt_bool(body, "add_generation_prompt", True)  # messages only
    tools = parse_tool_choice({"tools": body.get("tools")}, auto_enabled=True)
    template_kwargs = chat_template_kwargs(body)  # checked even where no template runs
    if tools.tools and "messages" not in body:
        raise p.ProtocolError("'tools' go with 'messages'", param="tools")
    if "messages" in body:
        req = p.parse_chat_request({"messages": body["messages"]})
        ids = chat_ids(state, req.messages, add_generation_prompt,
                        p.opt_bool(body, "add_special_tokens", False), tools.tools,
                        template_kwargs)
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise p.ProtocolError("'prompt' (a string) or 'messages' is required",
                                  param="prompt")
        check_prompt_size(state, len(prompt), "prompt")
        ids = encode(tokenizer, prompt, p.opt_bool(body, "add_special_tokens", True))
    return web.json_response({"tokens": ids, "count": len(ids),
                              "max_model_len": state.engine.max_model_len})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tokenizer = _tokenizer(state)
    body = await read_json(request)
    check_model(state, p.opt_str(body, "model"))
    tokens = p.token_id_list(body.get("tokens"))
    if tokens is None:
        raise p.ProtocolError("'tokens' must be a list of token ids", param="tokens")
    p.check_token_ids(tokens, state.engine.vocab_size, "tokens")
    return web.json_response({"prompt": tokenizer.decode(tokens)})


async def tokenizer_info(request: web.Request) -> web.Response:
    """What a client needs to tokenize as the server does (vLLM's /tokenizer_info;
    lm-evaluation-harness's remote tokenizer reads it, then calls /tokenize and /detokenize)."""
    state = request.app[STATE]
    tokenizer = _tokenizer(state)
    return web.json_response({
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": tokenizer.eos_token, "bos_token": tokenizer.bos_token,
        "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "model_max_length": state.engine.max_model_len, "vocab_size": state.engine.vocab_size})


# -- serving -------------------------------------------------------------------------------

async def run_server(engine, host: str = "127.0.0.1", port: int = 8000, *,
                     served_model_name: str, api_key: str | None = None,
                     max_queued_requests: int | None = None, max_body_bytes: int = 1 << 22,
                     max_prompt_chars: int | None = None, grace_period_s: float = 30.0,
                     stop_event: asyncio.Event | None = None, chat_template: str | None = None,
                     tool_call_parser: str | None = None, access_log: bool = True,
                     reasoning_parser: str | None = None,
                     disable_responses_store: bool = False) -> int:
    """Serve until SIGTERM/SIGINT (or stop_event), then drain: stop listening, answer new
    requests on open connections with 503, let in-flight ones finish within grace_period_s
    (a second signal cuts it short), cancel the rest (which aborts their engine requests)
    and return 0. If the engine dies, drain the same way (its requests have their errors
    already) and return 1, so the process exits non-zero."""
    app = build_app(engine, served_model_name=served_model_name, api_key=api_key,
                    max_queued_requests=max_queued_requests, max_body_bytes=max_body_bytes,
                    max_prompt_chars=max_prompt_chars, chat_template=chat_template,
                    tool_call_parser=tool_call_parser, access_log=access_log,
                    reasoning_parser=reasoning_parser,
                    disable_responses_store=disable_responses_store)
    state = app[STATE]
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0,
                           access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    warming = "" if getattr(engine, "ready", True) else \
        " (warming up: /health answers 503 until the programs are ready)"
    for address in runner.addresses:
        print(f"xlaserve: serving '{served_model_name}' on http://{address[0]}:{address[1]}"
              f"{warming}", flush=True)
    stop = stop_event or asyncio.Event()
    force = asyncio.Event()  # a second signal: skip the rest of the grace period
    installed = _install_signal_handlers(lambda: (force if stop.is_set() else stop).set())
    died = _watch_engine(engine, stop)
    try:
        await stop.wait()
        if died.is_set():
            print(f"xlaserve: the engine failed ({engine.dead}); exiting once in-flight "
                  "requests have their errors", flush=True)
        print("xlaserve: shutting down, draining in-flight requests", flush=True)
        state.draining = True
        await site.stop()
        waits = [asyncio.create_task(state.idle.wait()), asyncio.create_task(force.wait())]
        await asyncio.wait(waits, timeout=grace_period_s, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
        if state.in_flight:
            print(f"xlaserve: aborting {state.in_flight} unfinished request(s)", flush=True)
    finally:
        _remove_signal_handlers(installed)
        await runner.cleanup()
    return 1 if died.is_set() else 0


def _watch_engine(engine, stop: asyncio.Event) -> asyncio.Event:
    """An event set (together with stop) when the engine dies; the engine's on_dead
    callbacks run on its own thread."""
    loop, died = asyncio.get_running_loop(), asyncio.Event()

    def on_dead() -> None:
        died.set()
        stop.set()

    def from_engine_thread() -> None:
        try:
            loop.call_soon_threadsafe(on_dead)
        except RuntimeError:
            pass  # the loop is closed: the server is gone already

    callbacks = getattr(engine, "on_dead", None)
    if callbacks is not None:
        callbacks.append(from_engine_thread)
    if getattr(engine, "dead", None) is not None:
        on_dead()
    return died


def _install_signal_handlers(callback) -> list[int]:
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, callback)
            installed.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread, or no signals here: stop_event still works
    return installed


def _remove_signal_handlers(installed: list[int]) -> None:
    loop = asyncio.get_running_loop()
    for sig in installed:
        loop.remove_signal_handler(sig)
