"""PageAllocator: reference-counted pool of KV cache pages. Page 0 is the sink; no JAX."""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

SINK_PAGE = 0  # padded tokens write their K/V here, so it is never handed out


class OutOfPagesError(RuntimeError):
    pass


class PageAllocator:
    """Pages 1..num_pages-1 are usable. The free list is FIFO: the page freed longest ago is
    reused first, which is the eviction order prefix caching will want."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the sink), got {num_pages}")
        self.num_pages = num_pages
        self._ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(1, num_pages))

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_used_pages(self) -> int:
        return self.num_usable_pages - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable pages in use, 0..1."""
        return self.num_used_pages / self.num_usable_pages

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, only {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._ref_counts[p] = 1
        return pages

    def incref(self, page_ids: Iterable[int]) -> None:
        """Another owner shares these allocated pages (prefix sharing)."""
        page_ids = list(page_ids)
        for p in page_ids:
            self._check_held(p, 1)
        for p in page_ids:
            self._ref_counts[p] += 1

    def free(self, page_ids: Iterable[int]) -> None:
        """Drops one reference per listed page; a page with no references left is free again.
        Validates the whole list first so a bad call leaves the pool unchanged."""
        counts = Counter(page_ids)
        for p, k in counts.items():
            self._check_held(p, k)
        for p, k in counts.items():
            self._ref_counts[p] -= k
            if self._ref_counts[p] == 0:
                self._free.append(p)

    def _check_held(self, page: int, times: int) -> None:
        """Freeing the sink or a free page is a bookkeeping bug upstream: fail loudly."""
        if page == SINK_PAGE:
            raise ValueError("the sink page 0 is never allocated")
        if not 0 < page < self.num_pages:
            raise ValueError(f"page {page!r} is not in 1..{self.num_pages - 1}")
        held = self._ref_counts[page]
        if held == 0:
            raise ValueError(f"page {page} is not allocated")
        if held < times:
            raise ValueError(f"page {page} has {held} references, cannot drop {times}")
