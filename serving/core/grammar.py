"""Constrained decoding on the host, with llguidance: StructuredOutputsParams -> a compiled
grammar (cached, bounded, with a time limit) -> one GrammarMatcher per request, which
consumes each accepted token and fills the request's next-token bitmask. No JAX.

llguidance was measured against xgrammar and outlines-core (scripts/bench_grammar_libs.py,
docs/benchmarks.md): it compiles a schema in about a millisecond, fills a mask in tens of
microseconds, covers JSON schema, regex and Lark/EBNF grammars, and imports no torch.

A bitmask row is int32[W], W = ceil(vocab_size / 32), bit t of word t // 32 set when token
t is allowed; vocab_size counts the ids the tokenizer has, so padded embedding rows have no
bit at all (the runner samples from the first vocab_size logits only).
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

try:
    import llguidance
    import llguidance.numpy as lnp
except ImportError:  # an environment without it (a GPU machine's fixed one): no constraints
    llguidance = lnp = None

from serving.core.request_checks import RequestRefused
from serving.core.structured_outputs import StructuredOutputsParams

MAX_GRAMMAR_CHARS = 100_000  # a schema, regex or grammar longer than this is refused
COMPILE_TIMEOUT_S = 5.0
MAX_CACHED_GRAMMARS = 256
# JSON with fixed separators: a small model given free whitespace can spend its whole
# max_tokens on newlines and leave an unfinished document.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "lenient": False}
_LIMITS = dict(verbose_errors=False)
# llguidance's "slices": token subsets precomputed per tokenizer for the lexer states that are
# common in JSON (whitespace, string content of up to 10, 30 or any characters), which spare
# the mask a walk over the vocabulary. A string with a maxLength leaves those states after a
# few characters; the shorter bounds below cover them. Masks are the same with or without
# slices; 64 rows of the bench_structured schema (bounded strings) filled in 2.8 ms per step
# instead of 7.8 (docs/benchmarks.md).
_STRING_CHAR = r'[^"\\\x00-\x1F\x7F]'  # a JSON string's unescaped character, as there
SLICES = [*llguidance.LLTokenizer.general_slices(),
          *(f"{_STRING_CHAR}{{1,{n}}}" for n in (2, 4, 6, 8, 15, 20))]


class GrammarRefused(RequestRefused):
    """A constraint that cannot be compiled: bad schema, invalid regex, too large, too slow."""


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def grammar_text(so: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint. Raises GrammarRefused for input it cannot
    even read (not JSON, too large)."""
    kind, value = so.kind, getattr(so, so.kind)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             defaults=JSON_OPTIONS)
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarRefused(f"the {kind} constraint has {len(text)} characters; at most "
                             f"{MAX_GRAMMAR_CHARS} are allowed", param=_param(kind))
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(value)
        if kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise GrammarRefused("choice must be a non-empty list of non-empty strings",
                                     param=_param(kind))
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in value))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", value)
        if kind == "structural_tag":
            return _structural_tag(value)
    except GrammarRefused:
        raise
    except Exception as e:  # noqa: BLE001 - whatever the library or the parsing raises
        raise GrammarRefused(f"invalid {kind} constraint: {type(e).__name__}: {e}",
                             param=_param(kind)) from None
    raise GrammarRefused(f"unknown structured output kind {kind!r}", param=_param(kind))


def _structural_tag(text: str) -> str:
    """vLLM's structural tag: {"structures": [{"begin", "schema", "end"}], "triggers": [...]}:
    free text in which each `begin` (starting with one of the triggers) opens a JSON value
    of its schema, closed by `end`."""
    spec = json.loads(text)
    tags = []
    for s in spec["structures"]:
        trigger = next((t for t in spec["triggers"] if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger starts the structure begin {s['begin']!r}")
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"],
                                         grammar=s.get("schema", {}), end=s["end"]))
    return llguidance.StructTag.to_grammar(tags)


def _param(kind: str) -> str:
    return "response_format" if kind in ("json", "json_object") else "structured_outputs"


class CompiledGrammar:
    """A validated grammar: a matcher in its start state that new requests copy."""

    def __init__(self, matcher: llguidance.LLMatcher, seconds: float):
        self._pristine, self.seconds = matcher, seconds

    def new_matcher(self) -> llguidance.LLMatcher:
        return self._pristine.deep_copy()


class GrammarCompiler:
    """Compiles constraints for one tokenizer, once per distinct StructuredOutputsParams.key()
    (an LRU of `max_cached`, refusals included, so a bad schema sent again is refused at
    once). `submit` compiles on its own thread (the HTTP layer awaits it before queueing
    a request); `get` compiles on the caller's (the offline API). A compile that takes longer
    than `timeout_s` is refused, also when it finishes later."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, *,
                 max_cached: int = MAX_CACHED_GRAMMARS, timeout_s: float = COMPILE_TIMEOUT_S):
        self.vocab_size, self.width = vocab_size, bitmask_width(vocab_size)
        self.eos_token_ids = sorted(t for t in eos_token_ids if t < vocab_size)
        # llguidance reads the whole tokenizer, which may know more ids than the model can
        # emit (an embedding with fewer rows): its masks are that wide, and cut to ours.
        ll_vocab = max(vocab_size, len(tokenizer))
        self.ll_width = bitmask_width(ll_vocab)
        import llguidance.hf  # imports transformers: here, not when the engine's modules load
        self.ll_tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, ll_vocab, eos_token=self.eos_token_ids or None, slices=SLICES)
        self.max_cached, self.timeout_s = max_cached, timeout_s
        self._cache: OrderedDict[tuple, CompiledGrammar | GrammarRefused] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="xlaserve-grammar")
        self.executor = llguidance.LLExecutor(2)  # batched mask fills, GIL released

    def submit(self, so: StructuredOutputsParams) -> Future:
        return self._pool.submit(self.get, so)

    def get(self, so: StructuredOutputsParams) -> CompiledGrammar:
        key = so.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            hit = self._compile(so)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)
        if isinstance(hit, GrammarRefused):
            raise hit
        return hit

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def _compile(self, so: StructuredOutputsParams) -> CompiledGrammar | GrammarRefused:
        started = time.perf_counter()
        try:
            grammar = grammar_text(so)
            if so.kind == "choice":
                self._check_writable(so.choice)
            elif so.kind in ("regex", "grammar"):
                self._check_characters(so.kind, getattr(so, so.kind))
        except GrammarRefused as e:
            return e
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(**_LIMITS))
        if not matcher.is_error():  # the first mask builds the lexer: errors show there too
            lnp.fill_next_token_bitmask(matcher, np.zeros((1, self.ll_width), np.int32))
        seconds = time.perf_counter() - started
        param = _param(so.kind)
        if matcher.is_error():
            return GrammarRefused(f"invalid {so.kind} constraint: "
                                  f"{_first_line(matcher.get_error())}", param=param)
        if seconds > self.timeout_s:
            return GrammarRefused(f"the {so.kind} constraint took {seconds:.1f} s to compile; "
                                  f"the limit is {self.timeout_s:g} s", param=param)
        return CompiledGrammar(matcher, seconds)

    def _check_writable(self, texts) -> None:
        """Each text must be one the tokenizer can write: llguidance forces a choice's bytes,
        and a byte the tokenizer drops (some control characters) leaves it with a mask whose
        token the grammar then refuses."""
        for text in texts:
            ids = self.ll_tokenizer.tokenize_str(text)
            if self.ll_tokenizer.decode_str(ids) != text:
                raise GrammarRefused(f"the tokenizer cannot write the choice {text!r}",
                                     param="structured_outputs")

    def _check_characters(self, kind: str, text: str) -> None:
        """Each character written in a regex or grammar must be one the tokenizer can write:
        where the grammar forces it, llguidance would otherwise allow its first byte and then
        refuse the token (U+40000 on the demo model's tokenizer)."""
        for char in sorted({c for c in text if ord(c) > 0x7E or ord(c) < 0x20}):
            if self.ll_tokenizer.decode_str(self.ll_tokenizer.tokenize_str(char)) != char:
                raise GrammarRefused(f"the tokenizer cannot write the character {char!r} "
                                     f"(U+{ord(char):04X}) of the {kind} constraint",
                                     param=_param(kind))

    def matcher(self, so: StructuredOutputsParams) -> "GrammarMatcher":
        return GrammarMatcher(self.get(so).new_matcher(), self)

    def fill(self, matchers: list["GrammarMatcher"]) -> None:
        """Fills each matcher's next-token bitmask, all rows in one call on llguidance's
        threads."""
        if not matchers:
            return
        masks = np.empty((len(matchers), self.ll_width), np.int32)
        lnp.fill_next_token_bitmask_par(self.executor,
                                        [(m.matcher, i) for i, m in enumerate(matchers)], masks)
        for i, m in enumerate(matchers):
            m.set_bitmask(masks[i, :self.width].copy())


def _first_line(message: str) -> str:
    return message.strip().split("\n", 1)[0][:500]


class GrammarMatcher:
    """One request's position in its grammar. `accept` is called with every output token
    (the scheduler does), `bitmask` is the set of tokens allowed next (filled by
    GrammarCompiler.fill after each accepted token). EOS is allowed exactly when the
    grammar accepts."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler):
        self.matcher, self._eos = matcher, compiler.eos_token_ids
        self.bitmask: np.ndarray | None = None  # int32[W], None until filled
        self.error: str | None = None

    def accept(self, token: int) -> None:
        self.bitmask = None
        if self.error is None and not self.matcher.consume_token(token):
            self.error = _first_line(self.matcher.get_error()) or f"token {token} was refused"

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows no further token (or EOS was consumed)."""
        return self.error is None and self.matcher.is_stopped()

    @property
    def needs_fill(self) -> bool:
        return self.bitmask is None and self.error is None and not self.matcher.is_stopped()

    def set_bitmask(self, row: np.ndarray) -> None:
        accepting = self.matcher.is_accepting()
        for t in self._eos:
            set_bit(row, t, accepting)
        self.bitmask = row


def step_bitmask(scheduled, num_rows: int, width: int,
                 rows: list[int] | None = None) -> np.ndarray | None:
    """int32[R, W] for one step: row rows[i] (default i) is scheduled[i]'s allowed next
    tokens when it samples and is constrained (a grammar, or min_tokens not reached: no EOS
    or stop token yet); the other rows allow everything. None when no row is constrained, so
    the step sends nothing and the device skips the mask. A constrained request verifies no
    proposed tokens (its mask is known for the next token only)."""
    mask = None
    for i, s in enumerate(scheduled):
        req = s.request
        grammar, banned = req.grammar, _banned_ids(req)
        if not s.samples or (grammar is None and not banned):
            continue
        if s.spec_token_ids:
            raise RuntimeError(f"request {req.request_id!r} is constrained and verifies "
                               "proposed tokens")
        i = i if rows is None else rows[i]
        if mask is None:
            mask = np.full((num_rows, width), -1, np.int32)
        if grammar is not None:
            if grammar.bitmask is None:
                raise RuntimeError(f"request {req.request_id!r} has no bitmask for this step")
            mask[i] = grammar.bitmask
        for t in banned:
            if t < 32 * width:
                set_bit(mask[i], t, False)
    return mask


def set_bit(row: np.ndarray, token: int, allowed: bool) -> None:
    """row: int32[W], changed in place."""
    words, bit = row.view(np.uint32), np.uint32(1 << (token & 31))
    words[token >> 5] = (words[token >> 5] | bit) if allowed else (words[token >> 5] & ~bit)


def _banned_ids(req) -> list[int]:
    """EOS and stop tokens, while the request has fewer than min_tokens outputs."""
    p = req.sampling_params
    if req.num_output_tokens >= p.min_tokens:
        return []
    return [*(() if p.ignore_eos else req.eos_token_ids), *p.stop_token_ids]


def advance(compiler: GrammarCompiler | None, requests) -> list[tuple[object, str]]:
    """After a step: fills the next bitmask of every constrained request that got a token and
    runs on; -> (request, error) for those whose grammar refused their token."""
    failed, fill = [], []
    for req in requests:
        g = req.grammar
        if g is None:
            continue
        if g.error is not None:
            failed.append((req, g.error))
        elif not req.is_finished and g.needs_fill:
            fill.append(g)
    if fill:
        compiler.fill(fill)
    return failed
