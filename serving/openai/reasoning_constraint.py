"""Structured outputs with a reasoning parser: the model thinks freely, the answer is
constrained.

The engine feeds every output token to one llguidance matcher, thinking included. So the
request's constraint (response_format, structured_outputs, guided_*, a forced tool call's
schema) is rewritten here, before it reaches the engine, into one Lark grammar:

    start: thinking ANSWER_WS? answer
    thinking[lazy]: /(?s:.*)/ "</think>"      # any text, up to the first </think>
    answer: %json {...}  |  %lark { <the constraint's own grammar> }

`[lazy]` ends the thinking at the first `</think>`, as the reasoning parsers split it, and a
leading `<think>` is part of the free text. The model cannot stop (EOS is refused) before
the answer is complete. A few whitespace characters may separate the two, as Qwen3 writes
"</think>\\n\\n"; they stay in the answer's text, which JSON parsers skip. When the template
has disabled thinking, the caller keeps the constraint as it is.

Tokenizers of reasoning models (Qwen3, DeepSeek-R1) have `<think>` and `</think>` as added
tokens, which llguidance matches only by id, never as text. With them the thinking is text
that does not spell `</think>`, closed by the token: `<[open]>? THINK_TEXT? <[close]>`.
"""
from __future__ import annotations

import dataclasses
import json

from serving.core.grammar import grammar_text
from serving.core.structured_outputs import StructuredOutputsParams

THINKING = ('%llguidance {}\n'
            'start: thinking ANSWER_WS? answer\n'
            'thinking[lazy]: /(?s:.*)/ "</think>"\n'
            'ANSWER_WS: /[ \\t\\r\\n]{1,4}/\n')
# The same with `<think>` / `</think>` as tokens (their ids filled in).
THINKING_TOKENS = ('%llguidance {{}}\n'
                   'start: <[{open}]>? THINK_TEXT? <[{close}]> ANSWER_WS? answer\n'
                   'THINK_TEXT: /(?s:.*)/ & ~/(?s:.*<\\/think>.*)/\n'
                   'ANSWER_WS: /[ \\t\\r\\n]{{1,4}}/\n')


def think_token_ids(tokenizer) -> tuple[int, int] | None:
    """(id of `<think>`, id of `</think>`) when the tokenizer has both as added tokens."""
    added = tokenizer.get_added_vocab() if hasattr(tokenizer, "get_added_vocab") else {}
    if "<think>" in added and "</think>" in added:
        return added["<think>"], added["</think>"]
    return None


def after_thinking(so: StructuredOutputsParams,
                   tag_ids: tuple[int, int] | None = None) -> StructuredOutputsParams:
    """The same constraint, applied to what follows the thinking. tag_ids: think_token_ids.
    Raises GrammarRefused for a constraint that cannot be read (the caller compiles the
    original first, so its refusal names the request's own kind)."""
    head = THINKING if tag_ids is None else THINKING_TOKENS.format(open=tag_ids[0],
                                                                   close=tag_ids[1])
    return StructuredOutputsParams(grammar=head + "answer: " + _embedded(so) + "\n")


def _embedded(so: StructuredOutputsParams) -> str:
    """The constraint as one Lark expression: `%json` for a schema, else `%lark {...}`."""
    text = grammar_text(so)
    try:
        top = json.loads(text)
    except ValueError:
        top = None  # Lark text already
    if isinstance(top, dict):  # llguidance's top-level grammar: one JSON schema or Lark
        (grammar,) = top["grammars"]
        if grammar.get("json_schema") is not None:
            return "%json " + json.dumps(grammar["json_schema"])
        text = grammar["lark_grammar"]
    return "%lark {\n" + text + "\n}"


def answer_after_thinking(params, tokenizer=None):
    """SamplingParams whose constraint applies after the thinking. tokenizer: the engine's,
    to find `<think>` / `</think>` tokens (None: they are text)."""
    tag_ids = None if tokenizer is None else think_token_ids(tokenizer)
    so = after_thinking(params.structured_outputs, tag_ids)
    return dataclasses.replace(params, structured_outputs=so)
