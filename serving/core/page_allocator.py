"""PageAllocator: reference-counted pool of KV cache pages that remembers what freed pages
hold, so a later request can reuse them (prefix caching). Page 0 is the sink; no JAX.

A page is in exactly one of two states: referenced (ref count >= 1, held by page tables) or
free (in the free queue). A free page may still carry a hash: its K/V stay findable through
`lookup` until `allocate` hands the page out again, which evicts the hash (lazy eviction).
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable

SINK_PAGE = 0  # padded tokens write their K/V here, so it is never handed out


class OutOfPagesError(RuntimeError):
    pass


class PageAllocator:
    """Pages 1..num_pages-1 are usable. The free queue is ordered by eviction preference:
    pages that hold nothing cached first, then cached pages least recently freed first.
    Freeing a request's pages tail first (the KV cache manager does) keeps shared heads
    longest."""

    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the sink), got {num_pages}")
        self.num_pages = num_pages
        self._ref_counts = [0] * num_pages
        # OrderedDict as an O(1) queue that also removes from the middle (a cache hit).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_pages))
        self._page_hash: list[bytes | None] = [None] * num_pages
        self._cached: dict[bytes, int] = {}  # page hash -> page holding that K/V
        self.num_evictions = 0
        # core/kv_events.py KVEventRecorder, told each hash forgotten; None: events off
        self.events = None

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
    def num_cached_pages(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable pages referenced, 0..1 (free cached pages count as free)."""
        return self.num_used_pages / self.num_usable_pages

    def ref_count(self, page: int) -> int:
        return self._ref_counts[page]

    def page_hash(self, page: int) -> bytes | None:
        return self._page_hash[page]

    def is_free(self, page: int) -> bool:
        return page in self._free

    def allocate(self, n: int) -> list[int]:
        """n fresh pages, each with one reference; a reused page forgets what it cached."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPagesError(f"asked for {n} pages, only {len(self._free)} free")
        pages = []
        for _ in range(n):
            p, _ = self._free.popitem(last=False)
            self._evict(p)
            self._ref_counts[p] = 1
            pages.append(p)
        return pages

    def incref(self, page_ids: Iterable[int]) -> None:
        """Another owner shares these allocated pages (prefix sharing)."""
        page_ids = list(page_ids)
        for p in page_ids:
            self._check_held(p, 1)
        for p in page_ids:
            self._ref_counts[p] += 1

    def free(self, page_ids: Iterable[int]) -> None:
        """Drops one reference per listed page; a page with no references left is free again
        (a cached one at the back of the queue, in the order listed). Validates the whole
        list first so a bad call leaves the pool unchanged."""
        page_ids = list(page_ids)
        counts = Counter(page_ids)
        for p, k in counts.items():
            self._check_held(p, k)
        for p in page_ids:
            self._ref_counts[p] -= 1
            if self._ref_counts[p] == 0:
                self._free[p] = None
                if self._page_hash[p] is None:  # holds nothing worth keeping: reuse it first
                    self._free.move_to_end(p, last=False)

    # -- prefix caching ---------------------------------------------------------------------

    def lookup(self, page_hash: bytes) -> int | None:
        """The page holding the K/V named by page_hash, referenced or free; None if none."""
        return self._cached.get(page_hash)

    def touch(self, page_ids: Iterable[int]) -> None:
        """Adds one reference to each cached page (a cache hit), taking free ones out of the
        free queue."""
        page_ids = list(page_ids)
        for p in page_ids:
            if self._page_hash[p] is None:
                raise ValueError(f"page {p} holds no cached K/V")
        for p in page_ids:
            if self._ref_counts[p] == 0:
                del self._free[p]
            self._ref_counts[p] += 1

    def cache_page(self, page: int, page_hash: bytes) -> bool:
        """Makes a full, computed, referenced page findable by its hash. False (and nothing
        changes) when another page already holds that K/V: pages are not de-duplicated, so
        page tables stay append-only."""
        self._check_held(page, 1)
        if self._page_hash[page] is not None:
            if self._page_hash[page] != page_hash:
                raise ValueError(f"page {page} is cached under another hash")
            return True
        if page_hash in self._cached:
            return False
        self._page_hash[page] = page_hash
        self._cached[page_hash] = page
        return True

    def reset_cache(self) -> bool:
        """Forgets every cached page (vLLM's reset_prefix_cache, SGLang's flush_cache): only
        when no page is referenced, so no running request loses what it reads; False (and
        nothing changes) otherwise."""
        if self.num_used_pages:
            return False
        for page in list(self._cached.values()):
            self._evict(page)
        return True

    def _evict(self, page: int) -> None:
        h = self._page_hash[page]
        if h is not None:
            del self._cached[h]
            self._page_hash[page] = None
            self.num_evictions += 1
            if self.events is not None:
                self.events.removed(h)

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
