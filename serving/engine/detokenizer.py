"""Incremental detokenization with stop strings, for streaming one request's output.

Decoding token by token cannot simply decode each id on its own: byte-level BPE splits one
character over several tokens, and SentencePiece decoders treat a leading space differently
at the start of a text. Like vLLM, we decode a small window of ids instead: `prefix_offset`
marks where the window starts (the last chunk already released, which gives the decoder its
context) and `read_offset` where the not-yet-released ids start. The new text is the decode of
the whole window minus the decode of its prefix part.

Stop strings are matched on the released text. Any tail that could still grow into a stop
string is held back, so a client never sees part of a stop string. As in vLLM, `min_tokens`
holds stop strings off too: they are looked for only in the text of output tokens after the
first `min_tokens` (the text of those is released as it comes).

Invariant (tested): the concatenation of everything `add()` and `flush()` return equals
`tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
when no stop string is hit, and its prefix up to the stop string otherwise. The prompt does
not take part: the output text starts at the first output token, so a SentencePiece
tokenizer drops that token's leading space exactly as `decode` does.
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self._num_added = 0  # output ids fed so far, special ones included
        self.skip_special_tokens = skip_special_tokens
        self._skip_ids = _special_ids(tokenizer) if skip_special_tokens else frozenset()
        self._fast_decode = fast_decoder(tokenizer)
        self._prefix_cache: tuple[tuple[int, int], str] = ((0, 0), "")
        self._ids: list[int] = []  # output ids, without the special ids that decode skips
        self._prefix_offset = 0
        self._read_offset = 0
        self._window_released = 0  # chars of the open window released before its end completed
        self._held = ""  # decoded text that may be the start of a stop string
        self._emitted: list[str] = []
        self.stop_hit: str | None = None

    @property
    def text(self) -> str:
        """Everything released so far."""
        if len(self._emitted) > 1:  # join once, not on every read
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    @property
    def finished(self) -> bool:
        return self.stop_hit is not None

    def add(self, token_ids: list[int]) -> tuple[str, str | None]:
        """Feed new output ids. Returns (text that may be shown now, the stop string hit or
        None). After a stop string has been hit, further ids are ignored."""
        if self.stop_hit is not None:
            return "", None
        skip = self._skip_ids
        for t in token_ids:
            if t not in skip:
                self._ids.append(t)
        self._num_added += len(token_ids)
        if not self.stop or self._num_added <= self.min_tokens:  # nothing to hold back
            new_text = self._decode_new()
            if new_text:
                self._emitted.append(new_text)
            return new_text, None
        return self._release(self._decode_new())

    def flush(self) -> str:
        """End of the request without a stop string: release what was held back, including a
        stop-string prefix that never completed and an incomplete last character (as decode
        renders it)."""
        if self.stop_hit is not None:
            return ""
        body = self._window_body()
        if body is None:  # an open byte run at the very end: show it as decode does alone
            body = self._decode(self._ids[self._read_offset:])
        tail = self._held + body[self._window_released:]
        self._held = ""
        if body:
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._window_released = 0
        if tail:
            self._emitted.append(tail)
        return tail

    # -- decoding ------------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _prefix_text(self) -> str:
        key = (self._prefix_offset, self._read_offset)
        if self._prefix_cache[0] != key:  # the window moved since the last call
            self._prefix_cache = (key, self._decode(self._ids[key[0]:key[1]]))
        return self._prefix_cache[1]

    def _window_body(self) -> str | None:
        """Text of the ids after `read_offset`, decoded with the prefix ids as context, or
        None while it cannot be told yet."""
        prefix_text = self._prefix_text()
        full = self._decode(self._ids[self._prefix_offset:])
        if full.startswith(prefix_text):
            return full[len(prefix_text):]
        if full.endswith(REPLACEMENT_CHAR):
            # A byte-fallback decoder renders a run of byte tokens as a whole: while the run
            # that crosses read_offset is open, even the released part may show as U+FFFD.
            return None
        # The run closed as invalid UTF-8, so decode now renders text we already released
        # differently. It cannot be taken back; like vLLM, continue after its length.
        return full[len(prefix_text):]

    def _decode_new(self) -> str:
        """Decoded text that became final with the last ids. A trailing U+FFFD means the
        last character's bytes are incomplete; the characters before it are already final
        (UTF-8 decoding never changes them), so they are released and the window stays open."""
        body = self._window_body()
        if body is None:
            return ""
        if body.endswith(REPLACEMENT_CHAR):
            final = body.rstrip(REPLACEMENT_CHAR)
            new = final[self._window_released:]
            self._window_released = max(self._window_released, len(final))
            return new
        new = body[self._window_released:]
        if body:
            # Only a window that produced text may become the next prefix: decoders that
            # strip a leading space need real text in front to leave the next one alone.
            self._window_released = 0
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new

    # -- stop strings --------------------------------------------------------------------

    def _release(self, new_text: str) -> tuple[str, str | None]:
        buf = self._held + new_text
        hit = _earliest_stop(buf, self.stop)
        if hit is not None:
            pos, stop = hit
            out = buf[:pos + len(stop)] if self.include_stop_str_in_output else buf[:pos]
            self._held = ""
            self.stop_hit = stop
            if out:
                self._emitted.append(out)
            return out, stop
        keep = _stop_prefix_start(buf, self.stop)
        out, self._held = buf[:keep], buf[keep:]
        if out:
            self._emitted.append(out)
        return out, None


def fast_decoder(tokenizer):
    """The Rust decode that tokenizer.decode runs for a fast tokenizer (less its clean-up
    pass, which we never want), called directly to save microseconds of Python per call;
    None for tokenizers that decode differently."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from transformers import PreTrainedTokenizerFast
    cls = type(tokenizer)
    if cls.decode is not PreTrainedTokenizerFast.decode or \
            cls._decode is not PreTrainedTokenizerFast._decode:
        return None
    return backend.decode


def _special_ids(tokenizer) -> frozenset[int]:
    """Ids that decode(skip_special_tokens=True) drops: the added tokens marked special."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = {i for i, tok in added.items() if getattr(tok, "special", False)}
    return frozenset(ids)


def _earliest_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The stop string that completes first in text, as it would when text arrives one
    character at a time; of two that end together, the one that starts first. This keeps
    the result independent of how the ids were split into `add()` calls."""
    best = None
    for stop in stops:
        pos = text.find(stop)
        if pos >= 0 and (best is None or (pos + len(stop), pos) < (best[0] + len(best[1]), best[0])):
            best = (pos, stop)
    return best


def _stop_prefix_start(text: str, stops: list[str]) -> int:
    """Index where the longest suffix of text that is a proper prefix of a stop string
    begins, or len(text) when there is none."""
    if not stops:
        return len(text)
    longest = max(len(s) for s in stops)
    for start in range(max(0, len(text) - longest + 1), len(text)):
        tail = text[start:]
        if any(s.startswith(tail) for s in stops):
            return start
    return len(text)
