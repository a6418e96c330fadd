"""The Responses API's routes: `POST /v1/responses` on the chat path (the request in
responses_api.py, the response built in response_events.py and sent by response_stream.py)
and `GET /v1/responses/{response_id}` for stored ones. Pure Python: no JAX."""
from __future__ import annotations

import time

from aiohttp import web

from serving.openai import protocol as p
from serving.openai import response_stream
from serving.openai import responses
from serving.openai import responses_api
from serving.openai import structured_protocol as sp
from serving.openai.http_guard import read_json
from serving.openai.prompts import (chat_prompt, check_model, forced_tool_call, prompt_choices,
                                    served_name)
from serving.openai.reasoning_constraint import answer_after_thinking
from serving.openai.reasoning_parsers import reasoning_parser_for, thinking_expected
from serving.openai.response_events import ResponseBuilder, new_id
from serving.openai.server_state import STATE, ServerState, check_admission
from serving.openai.tool_parsers import parser_for


def response_prompt(state: ServerState, messages: list[dict],
                     req: responses_api.ResponsesRequest) -> tuple[str, list[int]]:
    try:
        return chat_prompt(state, messages, True, tools=req.tools.tools,
                            template_kwargs=req.template_kwargs)
    except p.ProtocolError as e:
        e.param = "input" if e.param == "messages" else e.param
        raise


async def create_response(request: web.Request) -> web.StreamResponse:
    """The Responses API (serving/openai/responses_api.py, docs/architecture.md)."""
    arrival = time.monotonic()
    state = request.app[STATE]
    engine = state.engine
    check_admission(state)
    body = await read_json(request)
    req = responses_api.parse_request(body, auto_tools=state.tool_call_parser is not None,
                                      reasoning=state.reasoning_parser is not None,
                                      store_enabled=state.responses_store is not None)
    lora = check_model(state, req.model)
    messages, history = responses_api.conversation(req, state.responses_store)
    prompt, ids = response_prompt(state, messages, req)
    max_tokens = p.check_context(len(ids), req.params.max_tokens, engine.max_model_len,
                                 prompt_param="input", max_tokens_param="max_output_tokens")
    params = sp.with_max_tokens(req.params, max_tokens)
    if req.tools.forced:
        params = forced_tool_call(params, req.tools)
    blame = "tools" if req.tools.forced else "text.format"
    await sp.compile_constraint(engine, params, body, blame)
    if params.structured_outputs is not None and thinking_expected(
            state.reasoning_parser, prompt, req.template_kwargs):
        params = answer_after_thinking(params, engine.tokenizer)
        await sp.compile_constraint(engine, params, body, blame)
    p.check_request_token_ids(ids, params, engine.vocab_size)
    builder = ResponseBuilder(
        responses_api.head(new_id("resp"), responses.now(), served_name(state, lora), req),
        len(ids),
        reasoning_parser_for(state.reasoning_parser, prompt, req.template_kwargs),
        parser_for(req.tools, state.tool_call_parser))
    on_done = response_stream.Finished(state.responses_store if req.store else None, history)
    return await response_stream.respond(request, state, prompt_choices(ids, 0, params, 0, lora=lora),
                                         builder,
                                         req.stream, on_done, arrival)


async def get_response(request: web.Request) -> web.Response:
    state = request.app[STATE]
    response_id = request.match_info["response_id"]
    stored = state.responses_store.get(response_id) if state.responses_store else None
    if stored is None:
        raise p.ProtocolError(f"Response with id '{response_id[:100]}' not found.",
                              status=404, type="invalid_request_error", param="response_id")
    return web.json_response(stored.response)
