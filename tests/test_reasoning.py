"""Reasoning output (`--reasoning-parser`): the parsers split at every point of their tags
(serving/openai/reasoning_parsers.py), the whole path through the HTTP server with the
official openai client over a scripted fake engine (thinking apart from the answer, streamed
and not, include_reasoning, tool calls in the answer only, chat_template_kwargs), and the
constraint that lets the model think before its answer, with the real grammar compiler
(serving/openai/reasoning_constraint.py)."""
import copy
import json

import numpy as np
import openai
import pytest

from serving.core import grammar as g
from serving.core.structured_outputs import StructuredOutputsParams as SO
from serving.openai.reasoning_constraint import THINKING, after_thinking, think_token_ids
from serving.openai.reasoning_parsers import PARSERS, prompt_ends_thinking, reasoning_parser_for
from tests.test_protocol import MODEL, TEMPLATE, FakeEngine, run, serve, tokenizer  # noqa: F401
from tests.test_tool_calling import WEATHER, TIME, _scripted, _Server

# -- the parsers ------------------------------------------------------------------------------

# (output, (thinking, answer)) for a prompt that leaves the model inside its thinking.
CASES = [
    ("<think>Let me see.</think>The answer.", ("Let me see.", "The answer.")),
    ("Let me see.</think>The answer.", ("Let me see.", "The answer.")),  # <think> in the prompt
    ("\n<think>\nhm</think>\n\nok", ("\nhm", "\n\nok")),  # leading whitespace goes with the tag
    ("no tags at all", ("no tags at all", "")),  # no </think>: all thinking (cut short)
    ("<think>only thinking", ("only thinking", "")),
    ("<think></think>answer", ("", "answer")),  # empty thinking
    ("</think>", ("", "")),
    ("", ("", "")),
    ("a <think> inside</think>b</think>c", ("a <think> inside", "b</think>c")),
    ("ends in a partial </thi", ("ends in a partial </thi", "")),
    ("<thi", ("<thi", "")),
    ("x</think>y <think>z", ("x", "y <think>z")),
]


def split(parser, pieces):
    """Feeds the pieces, then finishes; -> (thinking, answer) assembled from the deltas."""
    thinking = answer = ""
    for piece in pieces:
        t, a = parser.feed(piece)
        thinking, answer = thinking + t, answer + a
    t, a = parser.finish()
    assert (thinking + t, answer + a) == (parser.reasoning, parser.content)
    return parser.reasoning, parser.content


@pytest.mark.parametrize("name", PARSERS)
@pytest.mark.parametrize("text,expected", CASES)
def test_every_split_point_gives_the_whole_answer(name, text, expected):
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            pieces = [text[:i], text[i:j], text[j:]]
            assert split(reasoning_parser_for(name), pieces) == expected, pieces
    # Character by character, as a byte-level tokenizer's deltas can come.
    assert split(reasoning_parser_for(name), list(text)) == expected


def test_no_delta_leaks_part_of_a_tag():
    parser = reasoning_parser_for("deepseek_r1")
    deltas = [parser.feed(c) for c in "<think>ab</think>cd"] + [parser.finish()]
    assert [d for d in deltas if d != ("", "")] == [("a", ""), ("b", ""), ("", "c"), ("", "d")]


@pytest.mark.parametrize("name", PARSERS)
def test_a_prompt_that_closed_the_thinking_makes_all_of_it_the_answer(name):
    prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert prompt_ends_thinking(prompt)
    assert not prompt_ends_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_ends_thinking("no tags")
    parser = reasoning_parser_for(name, prompt)
    assert not parser.thinking
    assert split(parser, ["<think>a</think>", "b"]) == ("", "<think>a</think>b")


def test_qwen3_reads_enable_thinking_and_deepseek_r1_does_not():
    off = {"enable_thinking": False}
    qwen = reasoning_parser_for("qwen3", "", off)
    assert not qwen.thinking and split(qwen, ["plain answer"]) == ("", "plain answer")
    assert reasoning_parser_for("qwen3", "", {"enable_thinking": True}).thinking
    deepseek = reasoning_parser_for("deepseek_r1", "", off)
    assert deepseek.thinking and split(deepseek, ["a</think>b"]) == ("a", "b")


def test_parser_names():
    assert reasoning_parser_for(None) is None
    assert set(PARSERS) == {"qwen3", "deepseek_r1"}
    with pytest.raises(ValueError, match="qwen3"):
        reasoning_parser_for("nope")


# -- over HTTP --------------------------------------------------------------------------------

THOUGHT = 'Let me think <tool_call>{"name": "get_time", "arguments": {}}</tool_call> no.'
ANSWER = 'The answer is 4.'
OUTPUT = f"<think>{THOUGHT}</think>{ANSWER}"
ASK = dict(model=MODEL, messages=[{"role": "user", "content": "2 + 2?"}], max_tokens=500)


def streamed(client, **kwargs):
    """(thinking, answer, the chunks' reasoning == reasoning_content) of a streamed answer."""
    thinking = answer = ""
    same = True
    for chunk in client.chat.completions.create(stream=True, **{**ASK, **kwargs}):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        same &= extra.get("reasoning") == extra.get("reasoning_content")
        thinking += extra.get("reasoning_content") or ""
        answer += delta.content or ""
    return thinking, answer, same


@pytest.mark.parametrize("name", PARSERS)
def test_thinking_apart_from_the_answer_streamed_or_not(tokenizer, name):
    with _Server(_scripted(tokenizer, OUTPUT), reasoning_parser=name) as client:
        whole = client.chat.completions.create(**ASK).choices[0].message
        thinking, answer, same = streamed(client)
        hidden = client.chat.completions.create(**ASK, extra_body={"include_reasoning": False})
        hidden_stream = streamed(client, extra_body={"include_reasoning": False})
    assert (whole.reasoning_content, whole.reasoning, whole.content) == (THOUGHT, THOUGHT, ANSWER)
    assert (thinking, answer, same) == (THOUGHT, ANSWER, True)
    message = hidden.choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == (None, None, ANSWER)
    assert hidden_stream == ("", ANSWER, True)


def test_without_a_reasoning_parser_nothing_changes(tokenizer):
    with _Server(_scripted(tokenizer, OUTPUT)) as client:
        whole = client.chat.completions.create(**ASK).choices[0].message
        thinking, answer, _ = streamed(client)
    assert whole.content == OUTPUT and "reasoning_content" not in (whole.model_extra or {})
    assert (thinking, answer) == ("", OUTPUT)


def test_unfinished_thinking_is_all_reasoning(tokenizer):
    with _Server(_scripted(tokenizer, "<think>still going"), reasoning_parser="qwen3") as client:
        whole = client.chat.completions.create(**ASK).choices[0].message
    assert (whole.reasoning_content, whole.content) == ("still going", None)


def test_tool_calls_are_parsed_in_the_answer_only(tokenizer):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    kwargs = {**ASK, "tools": [WEATHER, TIME]}
    engine = _scripted(tokenizer, f"<think>{THOUGHT}</think>{call}")
    with _Server(engine, tool_call_parser="hermes", reasoning_parser="qwen3") as client:
        whole = client.chat.completions.create(**kwargs).choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert whole.finish_reason == "tool_calls" and whole.message.reasoning_content == THOUGHT
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in whole.message.tool_calls] == [("get_weather", {"city": "Rome"})]
    names = [c.choices[0].delta.tool_calls[0].function.name for c in chunks
             if c.choices and c.choices[0].delta.tool_calls
             and c.choices[0].delta.tool_calls[0].id]
    assert names == ["get_weather"]
    assert "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                   for c in chunks if c.choices) == THOUGHT


# A template that closes the thinking in the prompt when enable_thinking is false, as
# Qwen3's do, and opens it otherwise.
THINK_TEMPLATE = TEMPLATE.replace(
    "<|im_start|>assistant\n{% endif %}",
    "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


def test_chat_template_kwargs_reach_the_template(tokenizer):
    engine = _scripted(tokenizer, "Just the answer.")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    with _Server(engine, chat_template=THINK_TEMPLATE, reasoning_parser="deepseek_r1") as client:
        thinks = client.chat.completions.create(**ASK).choices[0].message
        plain = client.chat.completions.create(**ASK, extra_body=off).choices[0].message
        plain_stream = streamed(client, extra_body=off)
        prompts = [engine.tokenizer.decode(r[1]) for r in engine.requests]
    assert prompts[0].endswith("<think>\n") and prompts[1].endswith("</think>\n\n")
    assert (thinks.reasoning_content, thinks.content) == ("Just the answer.", None)
    assert (plain.reasoning_content, plain.content) == (None, "Just the answer.")
    assert plain_stream[:2] == ("", "Just the answer.")


def test_tokenize_takes_chat_template_kwargs(tokenizer):
    async def go():
        body = {"messages": [{"role": "user", "content": "hi"}]}
        async with serve(FakeEngine(tokenizer), chat_template=THINK_TEMPLATE) as client:
            on = await (await client.post("/tokenize", json=body)).json()
            off = await (await client.post("/tokenize", json={
                **body, "chat_template_kwargs": {"enable_thinking": False}})).json()
            bad = await client.post("/tokenize", json={**body, "chat_template_kwargs": [1]})
            return on, off, bad.status
    on, off, status = run(go())
    assert tokenizer.decode(on["tokens"]).endswith("<think>\n")
    assert tokenizer.decode(off["tokens"]).endswith("</think>\n\n")
    assert status == 400


@pytest.mark.parametrize("field,value", [
    ("chat_template_kwargs", "enable_thinking"),
    ("chat_template_kwargs", [["enable_thinking", False]]),
    ("chat_template_kwargs", {"tokenize": True}),
    ("chat_template_kwargs", {"add_generation_prompt": False}),
    ("chat_template_kwargs", {"chat_template": "{{ 1 }}"}),
    ("include_reasoning", "no"),
    ("include_reasoning", 0),
])
def test_bad_values_are_400(tokenizer, field, value):
    async def go():
        async with serve(FakeEngine(tokenizer), reasoning_parser="qwen3") as client:
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], field: value})
            return r.status, (await r.json())["error"]
    status, error = run(go())
    assert status == 400 and error["param"] == field, error


# -- the answer's constraint ------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_tokenizer(demo_model_dir):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(str(demo_model_dir))


def _allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row.view(np.uint32)[token >> 5]) >> (token & 31)) & 1)


def matches(compiler, tokenizer, so, text) -> bool:
    """Whether the whole text is allowed token by token and the grammar then accepts."""
    m = compiler.matcher(so)
    for t in tokenizer.encode(text, add_special_tokens=False):
        compiler.fill([m])
        if not _allowed(m.bitmask, t):
            return False
        m.accept(t)
    return m.error is None and m.matcher.is_accepting()


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"]}


@pytest.mark.parametrize("so,good,bad", [
    (SO(json=SCHEMA), '{"answer": 4}', '{"answer": "four"}'),
    (SO(json_object=True), '{"a": [1, 2]}', '[1, 2]'),
    (SO(regex=r"(yes|no)/[0-9]+"), "no/42", "maybe/4"),
    (SO(choice=("red", "gr}een")), "gr}een", "blue"),
    (SO(grammar='start: "A" n\nn: /[0-9]+/'), "A12", "B12"),
    (SO(grammar='root ::= "x" | "y"'), "y", "z"),  # GBNF
])
def test_the_model_thinks_then_the_answer_is_constrained(demo_tokenizer, so, good, bad):
    compiler = g.GrammarCompiler(demo_tokenizer, len(demo_tokenizer), [2])
    wrapped = after_thinking(so)
    assert wrapped.grammar.startswith(THINKING)
    thought = 'Hmm, {"answer": "no"} or <think> maybe? '
    for prefix in (f"<think>{thought}</think>", f"{thought}</think>\n\n", "</think>"):
        assert matches(compiler, demo_tokenizer, wrapped, prefix + good), prefix
        assert not matches(compiler, demo_tokenizer, wrapped, prefix + bad), prefix
    assert not matches(compiler, demo_tokenizer, wrapped, good)  # still thinking: no EOS yet
    assert matches(compiler, demo_tokenizer, so, good)  # the constraint itself is unchanged


class ConstrainedEngine(FakeEngine):
    """A FakeEngine that compiles constraints with the real compiler, as AsyncEngine does."""

    def __init__(self, tokenizer, script: str):
        super().__init__(tokenizer, max_model_len=4096)
        self.script = tokenizer.encode(script)
        self.compiler = g.GrammarCompiler(tokenizer, len(tokenizer), [0])

    async def compile_grammar(self, so) -> None:
        self.compiler.get(so)


def test_structured_outputs_with_a_reasoning_parser_over_http(tokenizer):
    answer = '{"answer": 4}'
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    engine = ConstrainedEngine(tokenizer, f"<think>hello world</think>{answer}")
    with _Server(engine, chat_template=THINK_TEMPLATE, reasoning_parser="qwen3") as client:
        whole = client.chat.completions.create(**ASK, response_format=fmt).choices[0].message
        client.chat.completions.create(**ASK, response_format=fmt, extra_body={
            "chat_template_kwargs": {"enable_thinking": False}})
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(**ASK, response_format={
                "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}})
    assert (whole.reasoning_content, json.loads(whole.content)) == ("hello world", {"answer": 4})
    thinking, disabled = (r[2].structured_outputs for r in engine.requests)
    assert thinking == after_thinking(SO(json=SCHEMA))  # think first, then the schema
    assert disabled == SO(json=SCHEMA)  # thinking disabled: the answer alone
    # A bad schema is refused as the request's own constraint, before any wrapping.
    error = bad.value.response.json()["error"]
    assert error["param"] == "response_format" and "invalid json constraint" in error["message"]
    # The engine's matcher accepts the scripted output (tiny tokenizer, real compiler).
    m = engine.compiler.matcher(thinking)
    for t in engine.script:
        m.accept(t)
    assert m.error is None and m.matcher.is_accepting()


def test_think_tags_as_added_tokens_are_matched_by_id(tokenizer):
    """Qwen3's and DeepSeek-R1's tokenizers have the tags as added tokens, which llguidance
    matches only by id: the grammar names them by id, and their text cannot end the thinking."""
    tok = copy.deepcopy(tokenizer)
    tok.add_tokens(["<think>", "</think>"])
    ids = think_token_ids(tok)
    assert ids == tuple(tok.convert_tokens_to_ids(["<think>", "</think>"]))
    assert think_token_ids(tokenizer) is None
    compiler = g.GrammarCompiler(tok, len(tok), [0])
    wrapped = after_thinking(SO(json=SCHEMA), ids)
    for text in ('<think>hello</think>{"answer": 4}', 'hello world</think>\n{"answer": 4}'):
        assert matches(compiler, tok, wrapped, text), text
    assert not matches(compiler, tok, wrapped, '<think>hello</think>{"answer": "x"}')
    # The tag spelled in pieces is thinking text that may not spell </think>.
    spelled = tok.encode("hello</") + tok.encode("think>")
    m = compiler.matcher(wrapped)
    for t in spelled:
        compiler.fill([m])
        ok = _allowed(m.bitmask, t)
        m.accept(t)
    assert not ok
