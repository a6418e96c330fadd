"""Buckets: the finite set of padded shapes (tokens, requests, pages per request) that device
programs are compiled for. Pure policy, no JAX."""
from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
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
    pages: tuple[int, ...]  # page-table width: pages per request
    page_size: int = 0  # lets all_shapes() prune by pages too; 0: unknown, no pruning

    @classmethod
    def derive(cls, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
               page_size: int, tokens: Sequence[int] | None = None,
               requests: Sequence[int] | None = None,
               pages: Sequence[int] | None = None) -> Buckets:
        """Powers of two up to each maximum, the maximum itself last; overrides are checked."""
        for name, v in (("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_model_len", max_model_len), ("page_size", page_size)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        max_pages = -(-max_model_len // page_size)
        if tokens is None:  # from 1: a lone decode stream computes one row, not eight
            tokens = _powers_of_two(1, max_num_batched_tokens)
        if requests is None:
            requests = _powers_of_two(1, max_num_seqs)
        if pages is None:
            pages = _powers_of_two(1, max_pages)
        return cls(tokens=_checked("tokens", tokens, max_num_batched_tokens),
                   requests=_checked("requests", requests, max_num_seqs),
                   pages=_checked("pages", pages, max_pages),
                   page_size=page_size)

    def pad_tokens(self, n: int) -> int:
        return _pad("tokens", self.tokens, n)

    def pad_requests(self, n: int) -> int:
        return _pad("requests", self.requests, n)

    def pad_pages(self, n: int) -> int:
        return _pad("pages", self.pages, n)

    def all_shapes(self) -> Iterator[tuple[int, int, int]]:
        """Every (tokens, requests, pages) bucket a step can pad to. A step with T tokens over
        R <= T requests pads to (pad_tokens(T), pad_requests(R), pad_pages(widest table)), so a
        combo occurs only if some R in the request bucket fits in some T in the token bucket,
        and (given page_size) if the widest table can be that narrow."""
        for t_lo, t in zip((0, *self.tokens), self.tokens):
            for r_lo, r in zip((0, *self.requests), self.requests):
                if r_lo + 1 > t:  # even the fewest requests in this bucket need > t tokens
                    continue
                min_pages = self._min_pages(t_lo + 1, r)
                for p in self.pages:
                    if p >= min_pages:
                        yield t, r, p

    def _min_pages(self, num_tokens: int, num_requests: int) -> int:
        """Fewest pages the widest request needs when num_tokens are split over num_requests."""
        if self.page_size == 0:
            return 0
        per_request = -(-num_tokens // num_requests)  # some request gets at least this many
        return -(-per_request // self.page_size)

    def __len__(self) -> int:
        return sum(1 for _ in self.all_shapes())
