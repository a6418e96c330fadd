"""The `kv_transfer_params` handshake, vLLM's NIXL shape (its P/D proxies copy the dict from
the prefill's response into the decode's request unchanged):

1. proxy -> prefill: `{do_remote_decode: true, ...}` with max_tokens 1.
2. prefill -> proxy, in its response body: `{do_remote_prefill: true, do_remote_decode:
   false, remote_block_ids, remote_engine_id, remote_request_id, remote_host, remote_port,
   tp_size}` and our keys (below) saying what was offered and how to claim it.
3. proxy -> decode: the original request with that dict. The decode instance pulls the
   pages, computes only the prompt's tail and tells the prefill instance to free them.

Our keys: `transfer_id` (the offer's id, 50 bits so JSON and Go keep it exact),
`remote_side_channel_port` (claim and release, side_channel.py), `num_tokens` (prompt tokens
the pages hold), `token_digest` (those tokens and what else decides their K/V: the decode
side refuses pages of other tokens or weights), `kv_layout` (the pages' shape and dtype).
Anything the decode side cannot use means a local prefill, never a wrong answer. No JAX.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


def wants_remote_decode(params: dict | None) -> bool:
    """A prefill request: offer its pages when it finishes."""
    return bool(params) and params.get("do_remote_decode") is True


def wants_remote_prefill(params: dict | None) -> bool:
    """A decode request: its prompt's pages wait on another instance."""
    return bool(params) and params.get("do_remote_prefill") is True


def token_digest(token_ids: list[int], extra_keys: tuple[str, ...]) -> str:
    """Names the tokens whose K/V a transfer carries, under the weights and salt that made it
    (core/kv_cache_manager.py: extra_keys). Not the page hash: that one is seeded per process."""
    h = hashlib.sha256(json.dumps([list(extra_keys), token_ids]).encode())
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class Offer:
    """What a decode instance needs to pull one prefill's pages."""
    transfer_id: int
    host: str
    port: int  # the producer's transfer server
    side_channel_port: int
    num_pages: int
    num_tokens: int
    token_digest: str
    layout: list

    def answer(self, request_id: str, engine_id: str, page_ids: list[int]) -> dict:
        """The prefill response's kv_transfer_params."""
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": list(page_ids), "remote_engine_id": engine_id,
                "remote_request_id": request_id, "remote_host": self.host,
                "remote_port": self.port, "tp_size": 1, "transfer_id": self.transfer_id,
                "remote_side_channel_port": self.side_channel_port,
                "num_tokens": self.num_tokens, "token_digest": self.token_digest,
                "kv_layout": list(self.layout)}

    @classmethod
    def from_params(cls, params: dict) -> "Offer":
        """A decode request's kv_transfer_params -> the offer; ValueError says what is
        missing or malformed (a producer of another kind, or a proxy that dropped keys)."""
        def get(name, kind):
            value = params.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"kv_transfer_params.{name} is missing or not a "
                                 f"{kind.__name__}")
            return value
        blocks = get("remote_block_ids", list)
        return cls(get("transfer_id", int), get("remote_host", str), get("remote_port", int),
                   get("remote_side_channel_port", int), len(blocks), get("num_tokens", int),
                   get("token_digest", str), get("kv_layout", list))
