"""Page hashes for prefix caching: one hash names a full page and everything before it.

hash(page i) = sha256(hash(page i - 1) or the process seed, the page's token ids, extra keys)

The encoding is canonical (fixed-width token ids, length-prefixed keys), so two different
inputs never encode alike, and sha256 with a secret per-process seed means a client cannot
craft a prompt whose pages collide with another tenant's. Extra keys name whatever changes
the K/V of the same tokens: the weights (model identity) and a request's `cache_salt`. They
go into the first page only; the chain carries them to every later page. No JAX.
"""
from __future__ import annotations

import hashlib
import os
import struct

_SEED = os.urandom(32)  # per process: hashes are never compared across processes


def _encode_keys(keys: tuple[str, ...]) -> bytes:
    out = [struct.pack("<I", len(keys))]
    for key in keys:
        data = key.encode()
        out.append(struct.pack("<I", len(data)))
        out.append(data)
    return b"".join(out)


def hash_page(parent: bytes | None, token_ids: list[int],
              extra_keys: tuple[str, ...] = ()) -> bytes:
    """token_ids: one full page. parent: the previous page's hash, None for the first page."""
    h = hashlib.sha256()
    h.update(_SEED if parent is None else parent)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    h.update(_encode_keys(extra_keys))
    return h.digest()


def hash_pages(token_ids: list[int], page_size: int, extra_keys: tuple[str, ...] = (),
               parent: bytes | None = None, start_page: int = 0) -> list[bytes]:
    """Hashes of the full pages of token_ids from page start_page on; parent is the hash
    of page start_page - 1 (None when start_page is 0)."""
    hashes = []
    for i in range(start_page, len(token_ids) // page_size):
        keys = extra_keys if i == 0 else ()
        parent = hash_page(parent, token_ids[i * page_size:(i + 1) * page_size], keys)
        hashes.append(parent)
    return hashes
