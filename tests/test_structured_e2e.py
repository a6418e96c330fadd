"""Structured outputs end to end: the real server on the demo model, the official openai
client (`chat.completions.parse` with pydantic models, response_format, vLLM's
structured_outputs and guided_* fields), LangChain's with_structured_output, the 400s, how
constrained requests end, min_tokens; and the offline API, and a model whose embedding has
more rows than its tokenizer has tokens."""
from __future__ import annotations

import enum
import json
import re
import shutil
from typing import Annotated, Optional

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server_util import MODEL, assert_error, live_server, post, stream

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(demo_checkpoint):
    with live_server(demo_checkpoint) as server:
        yield server


class Role(str, enum.Enum):
    admin = "admin"
    user = "user"
    guest = "guest"


class Address(BaseModel):
    city: str = Field(max_length=20)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    role: Role
    tags: list[Annotated[str, Field(max_length=10)]] = Field(min_length=1, max_length=3)
    address: Address
    nickname: Optional[Annotated[str, Field(max_length=12)]] = None


PERSON_PROMPT = [{"role": "user", "content": "Invent a person and describe them as JSON."}]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 1), (1.0, 2)])
def test_parse_with_a_pydantic_model(live, temperature, seed):
    client = live.client()
    resp = client.chat.completions.parse(model=MODEL, messages=PERSON_PROMPT,
                                         response_format=Person, temperature=temperature,
                                         seed=seed, max_tokens=200)
    choice = resp.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    person = choice.message.parsed  # the SDK validated it against Person
    assert isinstance(person, Person) and 1 <= len(person.tags) <= 3
    assert re.fullmatch(r"[0-9]{5}", person.address.zip_code)
    assert Person.model_validate_json(choice.message.content) == person


def test_json_object(live):
    # Any object: its strings are unbounded, so sampled outputs may run to max_tokens; the
    # bounded schemas above are where sampling must always finish.
    client = live.client()
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=150)
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_json_schema_in_completions_and_streamed_equals_whole(live):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20},
                                               "confidence": {"type": "number"}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    body = {"model": MODEL, "prompt": "Q: What is 2 + 2?\nA (JSON):", "temperature": 0,
            "max_tokens": 60,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "answer", "schema": schema,
                                                "strict": True}}}
    status, whole = post(live.port, "/v1/completions", body)
    assert status == 200, whole
    text = whole["choices"][0]["text"]
    jsonschema.validate(json.loads(text), schema)
    streamed = "".join(e["choices"][0]["text"] for e in stream(live.port, "/v1/completions",
                                                                body) if e["choices"])
    assert streamed == text


def test_regex_and_choice_and_guided_fields(live):
    client = live.client()
    messages = [{"role": "user", "content": "What is your phone number?"}]
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    for extra in ({"structured_outputs": {"regex": pattern}}, {"guided_regex": pattern}):
        resp = client.chat.completions.create(model=MODEL, messages=messages, temperature=0.7,
                                              seed=5, max_tokens=30, extra_body=extra)
        assert re.fullmatch(pattern, resp.choices[0].message.content), resp
        assert resp.choices[0].finish_reason == "stop"
    choices = ["positive", "negative", "neutral"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        resp = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Sentiment of 'I love it'?"}],
            temperature=1.0, seed=7, n=5, max_tokens=10, extra_body=extra)
        assert {c.message.content for c in resp.choices} <= set(choices)
        assert {c.finish_reason for c in resp.choices} == {"stop"}


def test_ebnf_grammar(live):
    gbnf = ('root ::= greeting " " name "!"\n'
            'greeting ::= "Hello" | "Hi"\n'
            'name ::= [A-Z] [a-z]+')
    lark = 'start: GREETING " " NAME "!"\nGREETING: "Hello" | "Hi"\nNAME: /[A-Z][a-z]+/'
    for extra in ({"structured_outputs": {"grammar": gbnf}}, {"guided_grammar": lark}):
        status, body = post(live.port, "/v1/completions", {
            "model": MODEL, "prompt": "Greet someone:", "temperature": 0.9, "seed": 11,
            "max_tokens": 20, **extra})
        assert status == 200, body
        assert re.fullmatch(r"(Hello|Hi) [A-Z][a-z]+!", body["choices"][0]["text"]), body


def test_forced_tool_call_schemas(live):
    """The schemas the tool-calling half sends: a named function's parameters, and for
    "required" an array (minItems 1) of {name, parameters} alternatives."""
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["C", "F"]}},
               "required": ["city", "unit"], "additionalProperties": False}
    time_ = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}},
             "required": ["zone"], "additionalProperties": False}
    required = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {"name": {"const": "get_weather"},
                                          "parameters": weather},
         "required": ["name", "parameters"]},
        {"type": "object", "properties": {"name": {"enum": ["get_time"]},
                                          "parameters": time_},
         "required": ["name", "parameters"]}]}}
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    for schema in (weather, required):
        status, body = post(live.port, "/v1/chat/completions", {
            "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 150,
            "structured_outputs": {"json": schema}})
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] == "stop", body
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), schema)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_calls_with_the_openai_client(live, tool_choice):
    """tool_choice "required" or a named function: the calls' arguments follow the tool's
    schema, and the streamed deltas assemble to the same calls. One tool: the signatures in
    the system turn take about 200 of this server's 256 tokens of context."""
    client = live.client()
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                  tools=[WEATHER_TOOL], tool_choice=tool_choice, temperature=0,
                  max_tokens=50)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls", whole
    schemas = {WEATHER_TOOL["function"]["name"]: WEATHER_TOOL["function"]["parameters"]}
    calls = whole.message.tool_calls
    assert calls and all(c.type == "function" and c.id for c in calls)
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in calls] == ["get_weather"]
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    with client.chat.completions.stream(**kwargs) as s:
        streamed = s.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in calls]


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                  "schema": {"type": "strin"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "if": {"required": ["a"]},
                                "then": {"required": ["b"]}}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "root ::= undefined"}, "guided_grammar"),
    ({"structured_outputs": {"json": {"type": "string", "maxLength": 5,
                                      "description": "x" * 200_000}}}, "structured_outputs"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 300}, "min_tokens"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"bad_words": ["x"]}, "bad_words"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
])
def test_refused_constraints_are_400s(live, extra, param):
    status, body = post(live.port, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        **extra})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"


def test_refusals_through_the_openai_client(live):
    client = live.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "bad", "schema": {"type": "strin"}}})
    assert info.value.status_code == 400 and "strin" in info.value.message
    status, body = post(live.port, "/v1/completions", {
        "model": MODEL, "prompt": "x", "structured_outputs": {"regex": "[z-a]"}})
    assert_error(status, body, 400, param="structured_outputs", code="invalid_structured_output")


def test_ending_rules(live):
    # A finite grammar ends with "stop" when complete, even with ignore_eos.
    status, body = post(live.port, "/v1/completions", {
        "model": MODEL, "prompt": "Answer yes or no:", "temperature": 0, "max_tokens": 50,
        "ignore_eos": True, "structured_outputs": {"choice": ["yes", "no"]}})
    choice = body["choices"][0]
    assert choice["text"] in ("yes", "no") and choice["finish_reason"] == "stop", body
    assert body["usage"]["completion_tokens"] < 50
    # max_tokens before the grammar is complete: "length" and the truncated text.
    status, whole = post(live.port, "/v1/completions", {
        "model": MODEL, "prompt": "Digits:", "temperature": 0, "max_tokens": 40,
        "structured_outputs": {"regex": "[0-9]{30}"}})
    status, cut = post(live.port, "/v1/completions", {
        "model": MODEL, "prompt": "Digits:", "temperature": 0, "max_tokens": 3,
        "structured_outputs": {"regex": "[0-9]{30}"}})
    assert re.fullmatch("[0-9]{30}", whole["choices"][0]["text"])
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["finish_reason"] == "length"
    assert whole["choices"][0]["text"].startswith(cut["choices"][0]["text"])
    assert 0 < len(cut["choices"][0]["text"]) < 30


def test_min_tokens(live):
    messages = [{"role": "user", "content": "What is the capital of France? One word."}]
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 40}
    status, short = post(live.port, "/v1/chat/completions", body)
    n = short["usage"]["completion_tokens"]
    assert short["choices"][0]["finish_reason"] == "stop" and n < 20  # EOS came early
    status, held = post(live.port, "/v1/chat/completions", {**body, "min_tokens": 20})
    assert status == 200, held
    assert held["usage"]["completion_tokens"] >= 20
    assert held["choices"][0]["message"]["content"].startswith(
        short["choices"][0]["message"]["content"][:5])
    # Stop strings wait for min_tokens too (vLLM): "a" stops at once without it.
    status, cut = post(live.port, "/v1/chat/completions", {**body, "stop": ["a"]})
    assert "a" not in cut["choices"][0]["message"]["content"]
    status, held = post(live.port, "/v1/chat/completions",
                        {**body, "stop": ["a"], "min_tokens": 20})
    assert status == 200, held
    assert held["usage"]["completion_tokens"] >= 20
    assert held["choices"][0]["message"]["content"].startswith(
        short["choices"][0]["message"]["content"][:5])
    assert "a" in held["choices"][0]["message"]["content"]


def test_langchain_with_structured_output(live):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(model=MODEL, base_url=live.base_url, api_key="unused", temperature=0,
                     max_tokens=200, max_retries=0)
    person = llm.with_structured_output(Person, method="json_schema").invoke(
        PERSON_PROMPT[0]["content"])
    assert isinstance(person, Person) and 1 <= len(person.tags) <= 3


# -- the offline API ---------------------------------------------------------------------

def test_offline_generate_with_structured_outputs(demo_llm):
    from serving import SamplingParams
    from serving.core.grammar import GrammarRefused
    from serving.core.structured_outputs import StructuredOutputsParams
    llm = demo_llm
    schema = Address.model_json_schema()
    params = [SamplingParams(temperature=t, seed=s, max_tokens=100,
                             structured_outputs=StructuredOutputsParams(json=schema))
              for t, s in ((0.0, None), (1.0, 4), (1.0, 5))]
    for out in llm.generate(["An address as JSON:"] * 3, params):
        assert out.finish_reason == "stop", out.text
        Address.model_validate_json(out.text)
    with pytest.raises(GrammarRefused):
        llm.generate("x", SamplingParams(
            structured_outputs=StructuredOutputsParams(regex="(")))
    assert not llm.engine.has_unfinished


def test_padded_vocab_rows_are_never_sampled(tmp_path, demo_model_dir):
    """A model whose embedding has 64 more rows than the tokenizer has tokens, with those
    rows' logits made the largest: greedy would pick them, yet no sampled id is one."""
    import torch
    from serving import LLM, SamplingParams
    from serving.core.structured_outputs import StructuredOutputsParams
    from tests.hf_tiny import tiny_hf_model
    from transformers import PreTrainedTokenizerFast
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(demo_model_dir))
    n = len(tokenizer)
    model = tiny_hf_model("llama", tmp_path, vocab_size=n + 64)
    with torch.no_grad():
        model.lm_head.weight[:n] = 0.0  # every real token's logit is 0
        model.lm_head.weight[n:] *= 50.0
        ids = torch.tensor([tokenizer.encode("hello there")])
        assert int(model(ids).logits[0, -1].argmax()) >= n  # the padded rows would win
    model.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo_model_dir / f, tmp_path / f)
    llm = LLM(str(tmp_path), max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32,
              progress=False)
    assert llm.engine.vocab_size == n
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=2, max_tokens=8, logprobs=5,
                             structured_outputs=StructuredOutputsParams(regex="[a-z ]{8}"))]
    outs = llm.generate(["hello there"] * 3, params)
    for out in outs:
        assert out.token_ids and max(out.token_ids) < n, out.token_ids
    assert len(outs[0].token_ids) == len(outs[1].token_ids) == 8
    assert all(t < n for lp in outs[2].logprobs for t, _ in lp.top)
    assert re.fullmatch("[a-z ]{8}", outs[2].text)
