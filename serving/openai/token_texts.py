"""Token id -> the text and bytes OpenAI's logprobs show for it. Pure Python, no JAX."""
from __future__ import annotations

import math
import re

from serving.core.outputs import TokenLogprob
from serving.openai import responses


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte <-> printable character map, char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """Token id -> (text, exact bytes), as OpenAI's logprobs show tokens. A token that is
    not valid UTF-8 on its own (part of a character) is shown as 'bytes:\\xe4\\xbd'."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._alphabet = (_byte_level_alphabet()
                          if "ByteLevel" in repr(getattr(backend, "decoder", None)) else None)
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._added = {i: t.content for i, t in added.items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self._alphabet is not None and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        if m := _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        if "▁" in piece:  # SentencePiece's word boundary marker is a space
            return piece.replace("▁", " ").encode()
        return self.tokenizer.convert_tokens_to_string([piece]).encode()

    def get(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._cache[token_id] = (text, list(raw))
        return self._cache[token_id]

    def entry(self, lp: TokenLogprob) -> responses.LogprobEntry:
        text, raw = self.get(lp.token_id)
        top = [(*self.get(t), _finite(v)) for t, v in lp.top]
        return responses.LogprobEntry(text, raw, _finite(lp.logprob), top)


def _finite(x: float) -> float:
    """JSON has no -Infinity: a masked token's logprob is shown as vLLM shows it."""
    return x if math.isfinite(x) else -9999.0
