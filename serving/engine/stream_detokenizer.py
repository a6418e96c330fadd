"""Output text of a request without stop strings, on a byte-level BPE tokenizer (GPT-2, Llama
3, Qwen, SmolLM, gpt-oss): one call a step into the tokenizers library's own incremental
decoder (`tokenizers.decoders.DecodeStream`), in Rust, in place of the two decodes a step
that IncrementalDetokenizer's window makes in Python (docs/benchmarks.md, "Less Python per
request").

A byte-level decoder turns ids into bytes and bytes into text, so text once released never
changes: DecodeStream holds back only a character whose bytes are incomplete, and `flush`
gives what `decode` renders of such a tail (U+FFFD). Everything `add` and `flush` return
joins to `tokenizer.decode(output_ids)`, the invariant IncrementalDetokenizer keeps
(tests/test_detokenizer.py). Byte-fallback (SentencePiece-style) decoders render an invalid
byte run differently once it closes, which DecodeStream refuses; they, and every request
with stop strings, keep the window detokenizer.
"""
from __future__ import annotations

from tokenizers import decoders

from serving.engine.detokenizer import IncrementalDetokenizer, fast_decoder


def make_detokenizer(tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                     include_stop_str_in_output: bool = False, min_tokens: int = 0):
    """A request's detokenizer: StreamDetokenizer when it has no stop strings and the
    tokenizer is byte-level, else IncrementalDetokenizer."""
    backend = byte_level_backend(tokenizer)
    if backend is not None and not any(stop or ()):
        return StreamDetokenizer(backend)
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, stop, include_stop_str_in_output,
                                  min_tokens=min_tokens)


def byte_level_backend(tokenizer):
    """The Rust tokenizer behind `tokenizer` when its decode is the library's plain one
    and its decoder byte-level BPE's; else None."""
    if fast_decoder(tokenizer) is None:
        return None
    backend = tokenizer.backend_tokenizer
    return backend if isinstance(backend.decoder, decoders.ByteLevel) else None


class StreamDetokenizer:
    """IncrementalDetokenizer's interface for a request without stop strings."""

    stop_hit = None  # never: no stop strings
    finished = False

    def __init__(self, backend, skip_special_tokens: bool = True):
        self._backend = backend
        self._skip = skip_special_tokens
        self._stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted: list[str] = []
        self._released = 0  # ids whose text has all been released

    @property
    def text(self) -> str:
        """Everything released so far."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def add(self, token_ids: list[int]) -> tuple[str, None]:
        """Feed new output ids -> (the text they complete, None)."""
        self._ids += token_ids
        if len(token_ids) == 1:  # a decode step: one id (a list costs the call twice as much)
            new_text = self._stream.step(self._backend, token_ids[0])
        else:
            new_text = self._stream.step(self._backend, token_ids) if token_ids else None
        if not new_text:
            return "", None
        self._emitted.append(new_text)
        self._released = len(self._ids)
        return new_text, None

    def flush(self) -> str:
        """End of the request: an incomplete last character as decode renders it."""
        if self._released == len(self._ids):
            return ""
        full = self._backend.decode(self._ids, skip_special_tokens=self._skip)
        released = self.text
        tail = full[len(released):] if full.startswith(released) else ""
        if tail:
            self._emitted.append(tail)
        return tail
