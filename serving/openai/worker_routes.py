"""What the routers in front of a fleet call on a worker, in the shapes they parse.

vllm-router fans `/flush_cache` out and reads vLLM's `/load` in its disaggregated mode;
sglang-router reads `/server_info` (served name, dp_size) and `/get_model_info`, and balances
on `/get_load` as SGLang answers it, a list with one entry per data-parallel rank (vllm-router's
own poll of `/get_load` wants an older object shape that vLLM workers do not serve either); cache-aware routing and llm-d's token producer
render prompts to token ids with vLLM's `/v1/chat/completions/render` (and
`/v1/completions/render`); vLLM's `/reset_prefix_cache` is what RL loops and operators call
after a weight change. Pure Python: the engine answers through the AsyncEngine interface.
"""
from __future__ import annotations

import json
from pathlib import Path

from aiohttp import web

from serving.core.version import version
from serving.openai import protocol as p
from serving.openai import responses
from serving.openai.chat_template_kwargs import chat_template_kwargs
from serving.openai.http_guard import read_json
from serving.openai.prompts import chat_prompt, check_model, encode
from serving.openai.server_state import STATE, ServerState, check_admission, check_prompt_size
from serving.openai.tools import parse_tool_choice


def add_routes(app: web.Application) -> None:
    app.router.add_get("/get_load", get_load)
    app.router.add_get("/load", load)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/get_server_info", server_info)  # SGLang's older name
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/model_info", model_info)
    app.router.add_post("/flush_cache", flush_cache)
    app.router.add_get("/flush_cache", flush_cache)  # SGLang answers both
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_post("/v1/chat/completions/render", render_chat)
    app.router.add_post("/v1/completions/render", render_completions)


def _replicas(state: ServerState) -> list:
    return state.engine.replica_stats()


async def get_load(request: web.Request) -> web.Response:
    """SGLang's shape: one entry per data-parallel rank; num_tokens is the KV cache's tokens
    in use."""
    state = request.app[STATE]
    capacity = (state.engine.num_pages - 1) * state.engine.config.page_size
    return web.json_response([
        {"dp_rank": rank, "num_reqs": s.num_running + s.num_waiting,
         "num_running_reqs": s.num_running, "num_waiting_reqs": s.num_waiting,
         "num_tokens": round(s.kv_cache_usage * capacity)}
        for rank, s in enumerate(_replicas(state))])


async def load(request: web.Request) -> web.Response:
    """vLLM's shape (vllm-router's disaggregated mode reads `server_load`): the requests
    this server holds, running or waiting."""
    total = sum(s.num_running + s.num_waiting for s in _replicas(request.app[STATE]))
    return web.json_response({"server_load": total})


async def server_info(request: web.Request) -> web.Response:
    """The server's arguments under SGLang's names (sglang-router builds its /v1/models and
    its data-parallel view from these)."""
    state = request.app[STATE]
    engine, config = state.engine, state.engine.config
    return web.json_response({
        "served_model_name": state.model,
        "model_path": str(engine.model_dir),
        "tokenizer_path": str(config.tokenizer or engine.model_dir),
        "tp_size": config.tensor_parallel_size,
        "dp_size": config.data_parallel_size,
        "page_size": config.page_size,
        "max_running_requests": config.max_num_seqs,
        "max_total_num_tokens": (engine.num_pages - 1) * config.page_size,
        "context_length": engine.max_model_len,
        "enable_prefix_caching": config.enable_prefix_caching,
        "version": version(),
    })


async def model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.engine
    hf = _hf_config(engine.model_dir)
    return web.json_response({
        "model_path": str(engine.model_dir),
        "tokenizer_path": str(engine.config.tokenizer or engine.model_dir),
        "is_generation": engine.task == "generate",
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": hf.get("model_type"),
        "architectures": hf.get("architectures"),
    })


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's name: 200 once every cached page is forgotten; 400 while requests run
    (nothing changes then, as in SGLang)."""
    await _reset(request.app[STATE])
    return web.Response(text="Cache flushed.\n")


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM's name for the same reset; 200 with an empty body."""
    await _reset(request.app[STATE])
    return web.Response()


async def _reset(state: ServerState) -> None:
    check_admission(state)
    if not await state.engine.reset_prefix_cache():
        raise p.ProtocolError("the prefix cache cannot be reset while requests are running; "
                              "retry when the server is idle", code="requests_running")


async def render_chat(request: web.Request) -> web.Response:
    """A chat request's prompt as the engine would see it, without running it: vLLM's
    render endpoint (the token ids a cache-aware router or llm-d's scorer hashes)."""
    state = request.app[STATE]
    body = await read_json(request)
    req = p.parse_chat_request(body, state.engine.max_logprobs)
    lora = check_model(state, req.model)
    tools = parse_tool_choice(body, state.tool_call_parser is not None)
    _, ids = chat_prompt(state, req.messages, req.add_generation_prompt, tools=tools.tools,
                          template_kwargs=chat_template_kwargs(body))
    return web.json_response(_rendered(state, lora, ids))


async def render_completions(request: web.Request) -> web.Response:
    """One rendered entry per prompt, as vLLM's /v1/completions/render answers."""
    state = request.app[STATE]
    engine = state.engine
    body = await read_json(request)
    req = p.parse_completion_request(body, engine.max_model_len, engine.max_logprobs)
    lora = check_model(state, req.model)
    rendered = []
    for prompt in req.prompts:
        if isinstance(prompt, str):
            check_prompt_size(state, len(prompt), "prompt")
            prompt = encode(engine.tokenizer, prompt, add_special_tokens=True)
        p.check_token_ids(prompt, engine.vocab_size, "prompt")
        rendered.append(_rendered(state, lora, prompt))
    return web.json_response(rendered)


def _rendered(state: ServerState, lora, ids: list[int]) -> dict:
    return {"request_id": responses.new_id("render"),
            "model": state.model if lora is None else lora.lora_name,
            "token_ids": list(ids)}


def _hf_config(model_dir) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}

