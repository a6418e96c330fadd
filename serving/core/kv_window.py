"""Sliding-window page arithmetic for the KV cache manager: which pages a window model's
queries can still read, and the longest prefix-cache hit it can use. Plain Python, no JAX.

A query at position p attends to keys p - W + 1 .. p (W keys, its own included). Every
layer shares one page table, so pages may be dropped only when no layer reads them: the
retention window is the largest layer window, and none at all if any layer attends fully.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from serving.core.page_allocator import SINK_PAGE


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def common_window(windows: Sequence[int]) -> int:
    """The window every layer keeps within: the largest one if each layer has a window,
    else 0 (a full-attention layer reads every page). windows: one per layer, 0 = full."""
    if not windows or any(w <= 0 for w in windows):
        return 0
    return max(windows)


def request_pages(window: int, step_tokens: int, page_size: int) -> int:
    """The most pages one request holds at once on a window model (0: no window). A step of
    T tokens from position c needs the keys c - W + 1 .. c + T - 1, W - 1 + T positions,
    which touch at most cdiv(W - 1 + T, page_size) + 1 pages; T is at most the step budget,
    proposed tokens included."""
    if window <= 0:
        return 0
    return cdiv(window - 1 + step_tokens, page_size) + 1


def num_skipped_pages(num_computed_tokens: int, window: int, page_size: int) -> int:
    """Leading pages no future query reads: the first one is at num_computed_tokens and sees
    keys from num_computed_tokens - window + 1 on, so a page whose last position is below
    that is done with."""
    if window <= 0:
        return 0
    return max(num_computed_tokens - window + 1, 0) // page_size


def num_hit_pages_read(window: int, page_size: int) -> int:
    """Pages a hit of n tokens (whole pages) must hold: the first computed query, at n,
    reads the W - 1 keys n - W + 1 .. n - 1, which end at a page boundary."""
    return cdiv(window - 1, page_size)


def window_hit(hashes: Sequence[bytes], lookup: Callable[[bytes], int | None], window: int,
               page_size: int) -> list[int]:
    """The longest hit for a window model: k leading pages such that the last
    num_hit_pages_read pages before k are cached (or, for a short hit, all k are). The
    pages before those come back as SINK_PAGE entries, so the page table keeps its
    indexing (position // page_size). hashes: the candidate pages' hashes, in order."""
    need = num_hit_pages_read(window, page_size)
    if need == 0:  # a one-key window reads only the query's own key
        return [SINK_PAGE] * len(hashes)
    # Scan from the end: `run` counts cached pages from i on. The first i where it reaches
    # `need` gives the longest hit, i + need pages; a run that reaches page 0 short of that
    # is a hit of its own length.
    found: list[int] = []  # cached pages from i on, in reverse order
    for i in range(len(hashes) - 1, -1, -1):
        page = lookup(hashes[i])
        if page is None:
            found = []
            continue
        found.append(page)
        if len(found) == need:
            return [SINK_PAGE] * i + found[::-1]
    return found[::-1]
