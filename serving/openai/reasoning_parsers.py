"""Reasoning output: a model's text -> its thinking and its answer, streamed or not.

Reasoning models write their thinking inside `<think>...</think>` before the answer;
`--reasoning-parser NAME` (vLLM's flag and names) returns it apart. One parser object per
choice, from `reasoning_parser_for(name, ...)`. `feed(text)` takes each new piece of the
output and returns (reasoning delta, content delta) that can be sent now; `finish()` returns
the rest once the output has ended. `.reasoning` and `.content` are the deltas folded, so a
streamed response assembles to exactly the non-streamed one. A tag split across pieces is
held back until it is known to be a tag or not.

Both parsers read the output the way vLLM does:
- a leading `<think>` (the model writing it itself, as older templates ask) is dropped;
- everything before the first `</think>` is thinking, everything after it the answer;
- an output with no `</think>` is all thinking (newer templates put `<think>` in the prompt,
  so the output starts inside the thinking; an output cut short never reached the answer);
- when the prompt already closed the thinking (a template with thinking disabled renders
  `<think></think>` into the prompt) the whole output is the answer.
qwen3 also reads the chat template's `enable_thinking`: false means the whole output is the
answer, as Qwen3's templates disable thinking. (vLLM's non-streamed qwen3 still splits such
an output at a `</think>` the model wrote anyway; a stream cannot take back what it sent, so
here both say "answer".)
"""
from __future__ import annotations

PARSERS = ("qwen3", "deepseek_r1")

START, END = "<think>", "</think>"


def prompt_ends_thinking(prompt: str) -> bool:
    """True when the prompt closed a think block it opened last (thinking disabled)."""
    return prompt.rfind(END) > prompt.rfind(START)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (a tag maybe cut in two)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser:
    """`<think>...</think>` split: leading tag, thinking, then the answer."""

    name = ""

    def __init__(self, thinking: bool = True):
        # thinking: whether the output starts inside the thinking; False when the prompt
        # (the template) has disabled it, and then the whole output is the answer.
        self.thinking = thinking
        self.reasoning = ""
        self.content = ""
        self.ended = not thinking  # the thinking is over (`</think>` seen, or none at all)
        self._at_start = thinking  # a leading `<think>` may still come
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        text = self._held + text
        self._held = ""
        if self._at_start:
            head = text.lstrip()
            if START.startswith(head) and len(head) < len(START):
                self._held = text  # could still be the leading tag
                return "", ""
            self._at_start = False
            if head.startswith(START):
                text = head[len(START):]
        if self.ended:
            return self._out("", text)
        end = text.find(END)
        if end >= 0:
            self.ended = True
            return self._out(text[:end], text[end + len(END):])
        keep = _partial_suffix(text, END)
        if keep:
            text, self._held = text[:-keep], text[-keep:]
        return self._out(text, "")

    def finish(self) -> tuple[str, str]:
        """The held-back end of the output; an unclosed thinking stays thinking."""
        text, self._held = self._held, ""
        self._at_start = False
        return self._out("", text) if self.ended else self._out(text, "")

    def _out(self, reasoning: str, content: str) -> tuple[str, str]:
        self.reasoning += reasoning
        self.content += content
        return reasoning, content


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3Parser(ReasoningParser):
    name = "qwen3"


_CLASSES = {"qwen3": Qwen3Parser, "deepseek_r1": DeepSeekR1Parser}


def thinking_expected(name: str | None, prompt: str = "",
                      chat_template_kwargs: dict | None = None) -> bool:
    """Whether the output of this prompt starts inside the thinking, for parser `name`."""
    if name is None or prompt_ends_thinking(prompt):
        return False
    if name == "qwen3" and not (chat_template_kwargs or {}).get("enable_thinking", True):
        return False
    return True


def reasoning_parser_for(name: str | None, prompt: str = "",
                         chat_template_kwargs: dict | None = None) -> ReasoningParser | None:
    """A new parser for one choice, or None without `--reasoning-parser`.

    prompt: the rendered prompt text (it may have closed the thinking already);
    chat_template_kwargs: what the template was given (qwen3 reads `enable_thinking`).
    """
    if name is None:
        return None
    if name not in _CLASSES:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(PARSERS)}")
    return _CLASSES[name](thinking_expected(name, prompt, chat_template_kwargs))
