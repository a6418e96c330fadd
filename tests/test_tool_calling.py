"""Tool calling: tools and tool_choice validated (serving/openai/tools.py), model output parsed
into tool calls, streamed or not (serving/openai/tool_parsers.py), the demo's tool template,
and the whole path through the HTTP server with the official openai client, the model's output
scripted by a fake engine. Forced tool calls on the real model: tests/test_structured_e2e.py."""
import asyncio
import json
import random
import threading

import openai
import pytest

from serving.openai import protocol as p
from serving.openai.api_server import run_server
from serving.openai.tool_parsers import (HermesParser, Llama3JsonParser, NamedCall,
                                         RequiredCalls)
from serving.openai.tools import DEMO_CHAT_TEMPLATE, parse_tool_choice
from tests.server_util import free_port
from tests.test_protocol import MODEL, FakeEngine, tokenizer  # noqa: F401,F811 - a fixture

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


# -- tools and tool_choice -------------------------------------------------------------------

def test_tool_choice_defaults_follow_the_server():
    assert parse_tool_choice({"tools": [WEATHER]}, auto_enabled=True).mode == "auto"
    # Without a parser configured the tools still reach the template; the output is text.
    assert parse_tool_choice({"tools": [WEATHER]}, auto_enabled=False).mode == "none"
    assert parse_tool_choice({}, auto_enabled=True).mode == "none"
    named = parse_tool_choice({"tools": [WEATHER, TIME], "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, False)
    assert (named.mode, named.name, named.forced) == ("named", "get_time", True)
    assert named.schema() == TIME["function"]["parameters"]
    required = parse_tool_choice({"tools": [WEATHER, TIME], "tool_choice": "required",
                                  "parallel_tool_calls": False}, False)
    schema = required.schema()
    assert schema["minItems"] == schema["maxItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [
        {"const": "get_weather"}, {"const": "get_time"}]


@pytest.mark.parametrize("body,auto,message", [
    ({"tool_choice": "required"}, True, "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, False, "--enable-auto-tool-choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     True, "not among the tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, True, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"a": 1}}, True, "tool_choice"),
    ({"tools": [{"type": "function"}]}, True, "tools[0]"),
    ({"tools": [{"type": "retrieval"}]}, True, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, True, "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, True,
     "parameters"),
    ({"tools": [WEATHER, WEATHER]}, True, "unique"),
    ({"tools": {"a": WEATHER}}, True, "'tools'"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, True, "parallel_tool_calls"),
])
def test_bad_tools_are_400s(body, auto, message):
    with pytest.raises(p.ProtocolError) as info:
        parse_tool_choice(body, auto)
    assert info.value.status == 400 and message in info.value.message


def test_messages_carry_tool_calls_and_results():
    [user, call, result] = p.parse_chat_request({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"}]}).messages
    assert call["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # parsed
    assert call["content"] == "" and result == {"role": "tool", "content": "rain",
                                                 "tool_call_id": "c1"}


# -- parsers ---------------------------------------------------------------------------------

def _run(parser, pieces):
    content, deltas = "", []
    for piece in pieces:
        c, d = parser.feed(piece)
        content, deltas = content + c, deltas + d
    c, d = parser.finish()
    return content + c, deltas + d


def _splits(text, rng):
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _assembled(deltas):
    """What the openai SDK builds from streamed tool-call deltas."""
    calls = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"id": None, "name": None, "arguments": ""})
        call["id"] = d.get("id", call["id"])
        call["name"] = d.get("function", {}).get("name", call["name"])
        call["arguments"] += d.get("function", {}).get("arguments", "")
    return [calls[i] for i in sorted(calls)]


HERMES_OUTPUTS = [
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
    'no call here < at all <tool',  # a partial tag at the end is released at the finish
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}',  # cut before </...>
    '<tool_call>not json</tool_call> so text',
]


@pytest.mark.parametrize("text", HERMES_OUTPUTS)
def test_hermes_streamed_assembles_to_the_whole(text):
    whole = HermesParser()
    content, deltas = _run(whole, [text])
    for seed in range(20):
        parser = HermesParser()
        c, d = _run(parser, _splits(text, random.Random(seed)))
        assert c == content and parser.content == whole.content
        assert [(x["name"], x["arguments"]) for x in _assembled(d)] == [
            (x["function"]["name"], x["function"]["arguments"]) for x in whole.calls]
        assert [x["id"] for x in _assembled(d)] == [x["id"] for x in parser.calls]
    # Each call opens with index, id, type and name, then its arguments.
    for first, second in zip(deltas[::2], deltas[1::2]):
        assert set(first) == {"index", "id", "type", "function"}
        assert first["function"]["arguments"] == "" and set(second) == {"index", "function"}


def test_hermes_results():
    parser = HermesParser()
    _run(parser, [HERMES_OUTPUTS[1]])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in parser.calls] == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    assert parser.content.strip() == ""
    for text, content in [(HERMES_OUTPUTS[0], "Let me check."),
                          (HERMES_OUTPUTS[2], HERMES_OUTPUTS[2]),
                          (HERMES_OUTPUTS[4], HERMES_OUTPUTS[4])]:
        parser = HermesParser()
        assert _run(parser, [text])[0] == content
    parser = HermesParser()
    _run(parser, [HERMES_OUTPUTS[3]])
    assert json.loads(parser.calls[0]["function"]["arguments"]) == {"city": "Oslo"}


@pytest.mark.parametrize("text,calls", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
     [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "get_time", "parameters": {}}; '
     '{"name": "get_weather", "parameters": {"city": "Rome"}}',
     [("get_time", {}), ("get_weather", {"city": "Rome"})]),
    ("The weather is fine.", []),
    ('{"not": "a call"}', []),
])
def test_llama3_json(text, calls):
    for seed in range(5):
        parser = Llama3JsonParser()
        content, deltas = _run(parser, _splits(text, random.Random(seed)))
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in parser.calls] == calls
        assert content == ("" if calls else text) and len(deltas) == 2 * len(calls)


def test_forced_calls():
    named = NamedCall("get_weather")
    content, deltas = _run(named, ['{"ci', 'ty": "Paris"}'])
    assert content == "" and deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert _assembled(deltas)[0]["arguments"] == '{"city": "Paris"}'
    required = RequiredCalls()
    _run(required, ['[{"name": "get_time", "parameters": {"zone": "UTC"}}]'])
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in required.calls] == [("get_time", {"zone": "UTC"})]
    cut = RequiredCalls()  # max_tokens cut the array short: no call, the text is content
    assert _run(cut, ['[{"name": "get_ti'])[0] == '[{"name": "get_ti' and not cut.calls


# -- the demo model's template -----------------------------------------------------------------

def test_demo_template_without_tools_is_the_models_own(demo_model_dir):
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast.from_pretrained(str(demo_model_dir))
    ours = DEMO_CHAT_TEMPLATE.read_text()
    for messages in ([{"role": "user", "content": "hi"}],
                     [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "c"},
                      {"role": "user", "content": "d"}]):
        for gen in (True, False):
            assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) \
                == tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen,
                                           chat_template=ours)
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "weather?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "function": {"name": "get_weather",
                                               "arguments": {"city": "Oslo"}}}]},
         {"role": "tool", "content": "rain"}],
        tools=[WEATHER], tokenize=False, add_generation_prompt=True, chat_template=ours)
    assert text.startswith("<|im_start|>system\nBe brief.\n")
    assert text.count("Be brief.") == 1 and json.dumps(WEATHER["function"]) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
        in text
    assert "<|im_start|>tool\n<tool_response>\nrain\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


# -- over HTTP, with the openai client ---------------------------------------------------------

class _Server:
    """run_server on a thread over a FakeEngine whose every request outputs `script`."""

    def __init__(self, engine, **kwargs):
        self.engine, self.port, self.kwargs = engine, free_port(), kwargs
        self.loop = asyncio.new_event_loop()
        self.stop = None
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self):
        self.thread.start()

        async def start():
            self.stop = asyncio.Event()
            asyncio.ensure_future(run_server(self.engine, "127.0.0.1", self.port,
                                             served_model_name=MODEL, stop_event=self.stop,
                                             **self.kwargs))
        asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x",
                               max_retries=20)
        client.models.list()  # waits for the port through the client's retries
        return client

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(timeout=0.1)


def _scripted(tokenizer, text):
    engine = FakeEngine(tokenizer, max_model_len=4096)
    engine.script = tokenizer.encode(text)
    return engine


def test_auto_tool_calls_over_http(tokenizer):
    text = HERMES_OUTPUTS[1]
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "weather in Rome?"}],
                  tools=[WEATHER, TIME], max_tokens=200)
    with _Server(_scripted(tokenizer, text), tool_call_parser="hermes") as client:
        whole = client.chat.completions.create(**kwargs).choices[0]
        with client.chat.completions.stream(**kwargs) as stream:
            streamed = stream.get_final_completion().choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        plain = client.chat.completions.create(**{**kwargs, "tool_choice": "none"}).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    calls = [(c.function.name, json.loads(c.function.arguments), c.type)
             for c in whole.message.tool_calls]
    assert calls == [("get_weather", {"city": "Rome"}, "function"), ("get_time", {}, "function")]
    assert all(c.id.startswith("chatcmpl-tool-") for c in whole.message.tool_calls)
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    firsts = [c.choices[0].delta.tool_calls[0] for c in chunks
              if c.choices and c.choices[0].delta.tool_calls
              and c.choices[0].delta.tool_calls[0].id]
    assert [(f.index, f.type, f.function.name) for f in firsts] == [
        (0, "function", "get_weather"), (1, "function", "get_time")]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    # tool_choice "none": the same output is plain text.
    assert plain.finish_reason == "stop" and plain.message.tool_calls is None
    assert plain.message.content == text


def test_tools_without_a_parser_reach_the_template_only(tokenizer):
    engine = _scripted(tokenizer, HERMES_OUTPUTS[0])
    with _Server(engine) as client:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
            max_tokens=200)
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            client.chat.completions.create(model=MODEL, tools=[WEATHER], tool_choice="auto",
                                           messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="needs 'tools'"):
            client.chat.completions.create(model=MODEL, tool_choice="required",
                                           messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].message.content == HERMES_OUTPUTS[0]
