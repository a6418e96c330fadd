"""The Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`): request parsing and the
output builder without a server, the store and the routes over tests/test_protocol.py's
FakeEngine, then the `openai` client against the demo model (the shared server)."""
import asyncio
import copy
import json
import random
from contextlib import asynccontextmanager

import jsonschema
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from serving.openai import response_items as items
from serving.openai.fields import ProtocolError
from serving.openai.reasoning_parsers import reasoning_parser_for
from serving.openai.response_events import ResponseBuilder
from serving.openai.response_store import ResponseStore
from serving.openai.responses_api import conversation, parse_request
from serving.openai.tool_parsers import HermesParser
from tests.server_util import MODEL, assert_error, post, request
from tests.test_protocol import MODEL as FAKE_MODEL
from tests.test_protocol import FakeEngine, serve, tokenizer  # noqa: F401 - a fixture

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def parse(body, auto_tools=True, reasoning=False, store_enabled=True):
    return parse_request(body, auto_tools=auto_tools, reasoning=reasoning,
                         store_enabled=store_enabled)


def assemble(events: list[dict]) -> dict:
    """The response the events build, checked against their own final response: every
    event is one the openai client parses, numbered from 0."""
    output, final = [], None
    for n, event in enumerate(events):
        EVENTS.validate_python(event)
        assert event["sequence_number"] == n
        kind, at = event["type"], event.get("output_index")
        if kind == "response.output_item.added":
            assert at == len(output)
            output.append(copy.deepcopy(event["item"]))
        elif kind == "response.content_part.added":
            output[at]["content"].append(dict(event["part"]))
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            output[at]["content"][event["content_index"]]["text"] += event["delta"]
        elif kind == "response.function_call_arguments.delta":
            output[at]["arguments"] += event["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert output[at]["content"][event["content_index"]]["text"] == event["text"]
        elif kind == "response.function_call_arguments.done":
            assert output[at]["arguments"] == event["arguments"]
        elif kind == "response.output_item.done":
            done = event["item"]
            assert {**output[at], "status": done["status"]} == done
            output[at] = done
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            final = event["response"]
            assert n == len(events) - 1
    assert final is not None and final["output"] == output
    return final


def without_ids(response: dict) -> dict:
    """A response with what differs between two runs of one request (ids, times) removed."""
    out = {k: v for k, v in response.items() if k not in ("id", "created_at", "completed_at")}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")}
                     for item in response["output"]]
    return out


# -- parsing -------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "hi", "max_tool_calls": 3}, "max_tool_calls"),
    ({"input": "hi", "top_logprobs": 2}, "top_logprobs"),
    ({"input": "hi", "service_tier": "flex"}, "service_tier"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning.effort"),
    ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "hi", "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options"),
    ({"input": "hi", "messages": []}, "messages"),
    ({"input": "hi", "response_format": {"type": "json_object"}}, "response_format"),
    ({"input": "hi", "max_tokens": 5}, "max_tokens"),
])
def test_unsupported_fields_are_400s_naming_them(body, param):
    with pytest.raises(ProtocolError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert e.value.code == "unsupported_parameter"


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 3}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x y", "schema": {}}}},
     "text.format"),
    ({"input": "hi", "text": {"format": {"type": "regex"}}}, "text.format"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata"),
    ({"input": "hi", "store": "yes"}, "store"),
])
def test_bad_fields_are_400s(body, param):
    with pytest.raises(ProtocolError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_the_request_maps_to_sampling_params_and_echoes():
    req = parse({"input": "hi", "max_output_tokens": 7, "temperature": 0, "top_p": 0.5,
                 "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
                 "parallel_tool_calls": False, "metadata": {"a": "b"}, "user": "u",
                 "text": {"format": {"type": "json_schema", "name": "w", "schema": {
                     "type": "object"}, "strict": True}}})
    assert (req.params.max_tokens, req.params.temperature, req.params.top_p) == (7, 0, 0.5)
    assert req.params.structured_outputs.json == {"type": "object"}
    assert req.tools.mode == "named" and req.tools.name == "get_weather"
    assert not req.tools.parallel and req.store
    assert req.echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert req.echo["tools"] == [{**WEATHER, "strict": None}]
    assert req.echo["metadata"] == {"a": "b"} and req.echo["user"] == "u"
    assert parse({"input": "hi", "tools": [WEATHER]}).tools.mode == "auto"
    assert parse({"input": "hi", "tools": [WEATHER]}, auto_tools=False).tools.mode == "none"


def test_the_disabled_store_refuses_only_an_explicit_store_true():
    assert not parse({"input": "hi"}, store_enabled=False).store
    assert not parse({"input": "hi", "store": False}, store_enabled=False).store
    with pytest.raises(ProtocolError) as e:
        parse({"input": "hi", "store": True}, store_enabled=False)
    assert e.value.param == "store" and "--disable-responses-store" in e.value.message


def test_input_items_become_chat_messages():
    req = parse({"instructions": "be brief", "input": [
        {"role": "developer", "content": "dev"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]}]})
    messages, history = conversation(req, None)
    assert [m["role"] for m in messages] == ["system", "system", "user", "assistant", "tool",
                                             "tool"]
    assert messages[0]["content"] == "be brief" and messages[2]["content"] == "a\nb"
    assert [c["function"] for c in messages[3]["tool_calls"]] == [
        {"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]
    assert messages[3]["content"] == "calling"
    assert messages[4] == {"role": "tool", "content": "one", "tool_call_id": "c1"}
    assert history[0] == {"role": "developer", "content": "dev"}  # no instructions stored


@pytest.mark.parametrize("input_, words", [
    ([{"type": "image_generation_call", "id": "x"}], "unknown"),
    ([{"type": "item_reference", "id": "x"}], "unknown"),
    ([{"type": "function_call_output", "call_id": "nope", "output": "x"}], "no function_call"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "text only"),
    ([{"role": "tool", "content": "x"}], "role"),
    ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}], "JSON"),
    ([], "non-empty"),
    (["hi"], "object"),
])
def test_bad_input_items_are_400s(input_, words):
    with pytest.raises(ProtocolError) as e:
        conversation(parse({"input": input_}), None)
    assert e.value.status == 400 and e.value.param == "input" and words in e.value.message


def test_a_previous_response_continues_and_an_unknown_one_is_404():
    store = ResponseStore()
    store.put({"id": "resp_1", "output": [
        {"type": "reasoning", "id": "rs", "summary": [], "content": []},
        {"type": "message", "id": "m", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "calling", "annotations": []}]},
        {"type": "function_call", "id": "fc", "call_id": "c9", "name": "f",
         "arguments": "{}", "status": "completed"}]}, [{"role": "user", "content": "q"}])
    req = parse({"previous_response_id": "resp_1", "instructions": "new",
                 "input": [{"type": "function_call_output", "call_id": "c9", "output": "r"}]})
    messages, history = conversation(req, store)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[2]["content"] == "calling" and len(messages[2]["tool_calls"]) == 1
    assert len(history) == 3
    with pytest.raises(ProtocolError) as e:
        conversation(parse({"previous_response_id": "resp_2", "input": "x"}), store)
    assert (e.value.status, e.value.param) == (404, "previous_response_id")


def test_the_store_is_bounded_in_count_and_age():
    now = [0.0]
    store = ResponseStore(max_responses=2, max_age_s=10, clock=lambda: now[0])
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 2
    now[0] = 5
    store.put({"id": "r3"}, [])
    now[0] = 10.5
    assert store.get("r1") is None and store.get("r2") is None and store.get("r3") is not None


# -- the builder ---------------------------------------------------------------------------

def _build(pieces, reasoning=None, tools=None, finish="stop"):
    builder = ResponseBuilder({"id": "resp_x", "object": "response", "created_at": 0,
                               "model": MODEL, "tools": [], "tool_choice": "auto",
                               "parallel_tool_calls": True}, 5, reasoning, tools)
    events = builder.opening()
    for piece in pieces:
        events += builder.feed(piece, 1)
    events += builder.finish(finish, 1)
    return builder.response(), events


def _splits(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(8, len(text) - 1))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


TEXT = ('<think>First the city.</think>Let me check.\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "get_weather", '
        '"arguments": {"city": "Oslo"}}</tool_call>\nDone.')


def test_streamed_events_assemble_to_the_response_however_the_text_is_split():
    rng = random.Random(3)
    whole, _ = _build([TEXT], reasoning_parser_for("qwen3"), HermesParser())
    Response.model_validate(whole)
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message", "function_call",
                                                    "function_call", "message"]
    assert whole["output"][0]["content"] == [{"type": "reasoning_text",
                                              "text": "First the city."}]
    assert whole["output"][1]["content"][0]["text"] == "Let me check.\n"
    assert json.loads(whole["output"][3]["arguments"]) == {"city": "Oslo"}
    assert whole["output"][4]["content"][0]["text"] == "\nDone."
    for _ in range(30):
        response, events = _build(_splits(TEXT, rng), reasoning_parser_for("qwen3"),
                                  HermesParser())
        assert assemble(events) == response
        assert without_ids(response)["output"] == without_ids(whole)["output"]
    thinking = ["<think>", "First", " the city.", "</think>", "Let me check."]
    response, _ = _build(thinking, reasoning_parser_for("qwen3"), HermesParser())
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    assert response["usage"]["output_tokens"] == 5


def test_a_cut_output_is_incomplete_and_whitespace_opens_no_message():
    response, events = _build(["Hello", " wor"], finish="length")
    assert assemble(events) == response
    assert response["status"] == "incomplete" and response["output"][0]["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.incomplete"
    calls, _ = _build(['<tool_call>{"name": "f", "arguments": {}}</tool_call>', "\n \n"],
                      tools=HermesParser())
    assert [i["type"] for i in calls["output"]] == ["function_call"]
    blank, _ = _build(["\n"])
    assert blank["output"][0]["content"][0]["text"] == "\n"


# -- the routes over a fake engine -----------------------------------------------------------

def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


@asynccontextmanager
async def fake_server(engine, **kwargs):
    """The app over a FakeEngine, and an openai client of it."""
    async with serve(engine, **kwargs) as http:
        async with openai.AsyncOpenAI(base_url=str(http.make_url("/v1")), api_key="x",
                                      max_retries=0) as client:
            yield client


def test_routes_store_get_and_stream(tokenizer):  # noqa: F811 - the fixture
    async def go():
        engine = FakeEngine(tokenizer)
        async with fake_server(engine) as client:
            first = await client.responses.create(model=FAKE_MODEL, input="hello world",
                                                  max_output_tokens=4)
            assert first.id.startswith("resp_") and first.status == "incomplete"
            assert first.usage.output_tokens == 4 and first.usage.total_tokens == \
                first.usage.input_tokens + 4
            got = await client.responses.retrieve(first.id)
            assert got.model_dump() == first.model_dump()
            unstored = await client.responses.create(model=FAKE_MODEL, input="x", store=False)
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(unstored.id)
            events = [e.model_dump(exclude_unset=True) async for e in
                      await client.responses.create(model=FAKE_MODEL, input="the fox",
                                                    previous_response_id=first.id,
                                                    stream=True)]
            final = assemble(events)
            # The previous turn's input and output come before this one's.
            prompt = engine.requests[-1][1]
            assert tokenizer.decode(prompt).count("hello world") == 1
            assert final["previous_response_id"] == first.id
            assert (await client.responses.retrieve(final["id"])).id == final["id"]
            with pytest.raises(openai.NotFoundError) as e:
                await client.responses.create(model=FAKE_MODEL, input="x",
                                              previous_response_id="resp_nope")
            assert e.value.body["param"] == "previous_response_id"
    run(go())


def test_a_disabled_store_stores_nothing(tokenizer):  # noqa: F811 - the fixture
    async def go():
        async with fake_server(FakeEngine(tokenizer), disable_responses_store=True) as client:
            response = await client.responses.create(model=FAKE_MODEL, input="hello")
            assert response.status in ("completed", "incomplete")
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(response.id)
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model=FAKE_MODEL, input="hello", store=True)
            assert e.value.body["param"] == "store"
            with pytest.raises(openai.NotFoundError):
                await client.responses.create(model=FAKE_MODEL, input="hello",
                                              previous_response_id=response.id)
    run(go())


def test_auto_tool_calls_and_their_outputs(tokenizer):  # noqa: F811 - the fixture
    async def go():
        engine = FakeEngine(tokenizer, max_model_len=512)
        engine.script = tokenizer.encode('<tool_call>{"name": "get_weather", "arguments": '
                                         '{"city": "Paris"}}</tool_call>')
        async with fake_server(engine, tool_call_parser="hermes") as client:
            first = await client.responses.create(model=FAKE_MODEL, input="weather?",
                                                  tools=[WEATHER])
            (call,) = first.output
            assert call.type == "function_call" and call.name == "get_weather"
            assert json.loads(call.arguments) == {"city": "Paris"} and first.status == "completed"
            engine.script = tokenizer.encode("sunny")
            second = await client.responses.create(
                model=FAKE_MODEL, previous_response_id=first.id, tools=[WEATHER],
                input=[{"type": "function_call_output", "call_id": call.call_id,
                        "output": "sunny"}])
            assert second.output_text == "sunny"
            # The tool result reached the template as a tool turn after the question and
            # the assistant's turn (this test template writes no tool calls).
            text = tokenizer.decode(engine.requests[-1][1])
            assert text.index("weather?") < text.index("<|im_start|>assistant\n<|im_end|>") \
                < text.index("<|im_start|>tool\nsunny")
    run(go())


# -- the demo model ------------------------------------------------------------------------

def test_plain_and_streamed_responses_agree(shared_server):
    client = shared_server.client()
    kwargs = dict(model=MODEL, input="What is the capital of France?", temperature=0,
                  max_output_tokens=12, instructions="Answer in one sentence.")
    plain = client.responses.create(**kwargs)
    assert plain.status in ("completed", "incomplete") and plain.output_text.strip()
    assert plain.usage.input_tokens > 10 and 0 < plain.usage.output_tokens <= 12
    events = [e.model_dump(exclude_unset=True)
              for e in client.responses.create(**kwargs, stream=True)]
    assert events[0]["type"] == "response.created" and events[1]["type"] == "response.in_progress"
    streamed = assemble(events)
    assert without_ids(streamed) == without_ids(plain.model_dump(exclude_unset=True))
    status, headers, raw = request(shared_server.port, "POST", "/v1/responses",
                                   {**kwargs, "stream": True})
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    first = raw.decode().split("\n\n")[0].split("\n")
    assert first[0] == "event: response.created" and first[1].startswith("data: {")


def test_a_forced_tool_call_then_its_output(shared_server):
    client = shared_server.client()
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.responses.create(model=MODEL, input=[question], tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    temperature=0, max_output_tokens=40)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"}
    # The follow-up leaves the tools out: with them the conversation passes the shared
    # server's 256-token context.
    common = dict(model=MODEL, temperature=0, max_output_tokens=16)
    as_items = client.responses.create(**common, input=[
        question, {"type": "function_call", "call_id": call.call_id, "name": call.name,
                   "arguments": call.arguments}, result])
    chained = client.responses.create(**common, previous_response_id=first.id, input=[result])
    assert as_items.output_text.strip()
    # The same conversation either way: the same prompt, the same greedy answer.
    assert chained.usage.input_tokens == as_items.usage.input_tokens
    assert chained.output_text == as_items.output_text


def test_text_format_json_schema(shared_server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    response = shared_server.client().responses.create(
        model=MODEL, input="Describe the weather in Paris as JSON.", temperature=0,
        max_output_tokens=40, text={"format": {"type": "json_schema", "name": "weather",
                                               "schema": schema, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), schema)
    assert response.text.format.type == "json_schema"


def test_store_false_and_get(shared_server):
    client = shared_server.client()
    stored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert client.responses.retrieve(stored.id).model_dump() == stored.model_dump()
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3,
                                       store=False)
    status, body = post(shared_server.port, "/v1/responses", {"input": "x", "store": False,
                                                              "previous_response_id": unstored.id})
    assert_error(status, body, 404, param="previous_response_id",
                 code="previous_response_not_found")
    status, _, raw = request(shared_server.port, "GET", f"/v1/responses/{unstored.id}")
    assert_error(status, json.loads(raw), 404, param="response_id")


@pytest.mark.parametrize("body, status, param, code", [
    ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, 400, "input",
     "unsupported_parameter"),
    ({"input": "hello " * 400}, 400, "input", "context_length_exceeded"),
    ({"input": "hi", "background": True}, 400, "background", "unsupported_parameter"),
    ({"input": "hi", "include": ["file_search_call.results"]}, 400, "include",
     "unsupported_parameter"),
    ({"input": "hi", "tools": [{"type": "code_interpreter"}]}, 400, "tools",
     "unsupported_parameter"),
    ({"input": "hi", "model": "gpt-9"}, 404, "model", "model_not_found"),
])
def test_bad_requests_are_clear_4xx(shared_server, body, status, param, code):
    got, answer = post(shared_server.port, "/v1/responses", body)
    assert_error(got, answer, status, param=param, code=code)


def test_an_image_part_is_refused_over_http_for_a_text_model(shared_server):
    """Chat's image_url and the Responses API's input_image: the served model takes text
    only, said in OpenAI's error shape, and the server goes on serving."""
    image = "data:image/png;base64,iVBORw0KGgo="
    status, body = post(shared_server.port, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": image}}]}]})
    assert_error(status, body, 400, param="messages", code="unsupported_parameter",
                 type_="invalid_request_error")
    assert "takes text only" in body["error"]["message"]
    status, body = post(shared_server.port, "/v1/responses", {
        "model": MODEL, "max_output_tokens": 2, "store": False, "input": [
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "what is this?"},
                {"type": "input_image", "image_url": image, "detail": "auto"}]}]})
    assert_error(status, body, 400, param="input", code="unsupported_parameter")
    status, body = post(shared_server.port, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and body["choices"][0]["message"]["content"] is not None
