"""StructuredOutputsParams: the constraint a request's output must satisfy (vLLM's field
names). Exactly one kind is set. No JAX."""
from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (a dict, or its text)
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # a Lark / EBNF grammar
    json_object: bool = False  # any JSON object (response_format json_object)
    structural_tag: str | None = None

    def __post_init__(self):
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        kinds = self.kinds()
        if len(kinds) != 1:
            raise ValueError("structured outputs need exactly one of " + ", ".join(KINDS)
                             + (f"; got {', '.join(kinds)}" if kinds else ""))

    def kinds(self) -> list[str]:
        return [k for k in KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self.kinds()[0]

    def key(self) -> tuple[str, str]:
        """A hashable key naming the constraint (for caching compiled grammars)."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        elif isinstance(value, tuple):
            value = json.dumps(list(value))
        return self.kind, str(value)
