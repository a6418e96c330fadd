"""Buckets: the finite set of padded shapes (tokens, requests, pages per request) that device
programs are compiled for. Pure policy, no JAX; serving.engine.input_prep.all_step_shapes says
which combinations a step can reach."""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass


def _powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2*lo, 4*lo, ... below hi, then hi itself (lo a power of two, or lo == hi)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    return (*out, hi)


def _checked(name: str, buckets: Sequence[int], needed: int) -> tuple[int, ...]:
    buckets = tuple(buckets)
    if not buckets:
        raise ValueError(f"{name} buckets are empty")
    if any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in buckets):
        raise ValueError(f"{name} buckets must be positive integers, got {buckets}")
    if any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"{name} buckets must be strictly increasing, got {buckets}")
    if buckets[-1] < needed:
        raise ValueError(f"{name} buckets {buckets} do not cover {needed}")
    return buckets


def _pad(name: str, buckets: tuple[int, ...], n: int) -> int:
    i = bisect.bisect_left(buckets, n)
    if n < 0 or i == len(buckets):
        raise ValueError(f"{n} {name} is outside the buckets {buckets}")
    return buckets[i]


@dataclass(frozen=True)
class Buckets:
    tokens: tuple[int, ...]  # tokens per step
    requests: tuple[int, ...]  # requests per step
    # Page-table width (pages per request). A backend whose kernel reads only the keys a
    # token can see takes one width, the widest (see model.attention.FIXED_PAGE_TABLE).
    pages: tuple[int, ...]

    @classmethod
    def derive(cls, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
               page_size: int, tokens: Sequence[int] | None = None,
               requests: Sequence[int] | None = None,
               pages: Sequence[int] | None = None, fixed_pages: bool = False,
               min_tokens: int = 1) -> Buckets:
        """Powers of two up to each maximum, the maximum itself last; overrides are checked.
        fixed_pages: one page-table width, ceil(max_model_len / page_size), unless `pages`
        says otherwise. min_tokens (a power of two): the smallest token bucket."""
        for name, v in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len), ("page_size", page_size)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        max_pages = -(-max_model_len // page_size)
        if tokens is None:  # from 1 on CPUs: a lone decode stream computes one row, not eight
            tokens = _powers_of_two(min(min_tokens, max_num_batched_tokens),
                                    max_num_batched_tokens)
        if requests is None:
            requests = _powers_of_two(1, max_num_seqs)
        if pages is None:
            pages = (max_pages,) if fixed_pages else _powers_of_two(1, max_pages)
        return cls(tokens=_checked("tokens", tokens, max_num_batched_tokens),
                   requests=_checked("requests", requests, max_num_seqs),
                   pages=_checked("pages", pages, max_pages))

    def pad_tokens(self, n: int) -> int:
        return _pad("tokens", self.tokens, n)

    def pad_requests(self, n: int) -> int:
        return _pad("requests", self.requests, n)

    def pad_pages(self, n: int) -> int:
        return _pad("pages", self.pages, n)
