"""HybridKVCacheManager: the page tables of a hybrid model, one for its full-attention
layers and one for its window layers (model/kv_groups.py), each over a pool of its own.
Plain Python, no JAX.

The full layers' manager keeps every page of a request, as on a model without windows. The
window layers' manager gives back the pages behind the window as the request advances, so
their pool holds O(window) pages a request however long it grows. Both tables have the same
length and indexing (position // page_size); the window one has SINK_PAGE entries in front.

A request is given pages in both or in neither, so the scheduler sees one manager: it asks
this one as it asks a KVCacheManager. A prefix-cache hit is the longest prefix both can
serve: the full layers' run of cached pages, then within it the longest window hit
(vLLM's hybrid coordinator does the same).
"""
from __future__ import annotations

from serving.core.kv_cache_manager import KVCacheManager
from serving.core.request import Request


class HybridHit(list):
    """A hit as get_computed_pages gives it: the full layers' pages (the list itself, so
    len() is the hit's length in pages) and the window layers' table for the same length."""

    def __init__(self, full: list[int], window: list[int]):
        super().__init__(full)
        self.window = window


class HybridKVCacheManager:
    def __init__(self, num_pages: int, window_num_pages: int, page_size: int, window: int,
                 enable_caching: bool = True, model_key: str = ""):
        if window <= 0:
            raise ValueError("a hybrid model's window layers need a window > 0")
        self.full = KVCacheManager(num_pages, page_size, enable_caching, model_key)
        self.window = KVCacheManager(window_num_pages, page_size, enable_caching, model_key,
                                     sliding_window=window)
        self.page_size = page_size
        self.enable_caching = enable_caching
        # The full layers' pool bounds how long a request may grow, as on any model.
        self.allocator = self.full.allocator
        self.sliding_window = 0  # the full layers keep every page

    def record_events(self, events: list) -> None:
        """KV cache events of both pools into one list (core/kv_events.py): the full
        layers' pages as group 0, the window layers' as group 1."""
        self.full.record_events(events, group_idx=0)
        self.window.record_events(events, group_idx=1)

    # -- what the scheduler asks ------------------------------------------------------------

    def page_ids(self, request_id: str) -> list[int]:
        return self.full.page_ids(request_id)

    def window_page_ids(self, request_id: str) -> list[int]:
        return self.window.page_ids(request_id)

    def reads_cache(self, req: Request) -> bool:
        return self.full.reads_cache(req)

    def get_computed_pages(self, req: Request) -> HybridHit:
        full = self.full.get_computed_pages(req)
        window = self.window.get_computed_pages(req, max_pages=len(full)) if full else []
        return HybridHit(full[:len(window)], window)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_pages: HybridHit | None = None) -> bool:
        """Grows both tables, or neither (False: short of pages in one pool)."""
        window_hit = computed_pages.window if computed_pages else None
        self.window.remove_skipped_pages(req)
        if not (self.full.can_allocate(req, num_new_tokens, computed_pages)
                and self.window.can_allocate(req, num_new_tokens, window_hit)):
            return False
        ok = (self.full.allocate_slots(req, num_new_tokens, computed_pages)
              and self.window.allocate_slots(req, num_new_tokens, window_hit))
        assert ok, "both pools were checked first"
        return True

    def cache_computed(self, req: Request) -> None:
        self.full.cache_computed(req)
        self.window.cache_computed(req)

    def reset_prefix_cache(self) -> bool:
        """Both pools forget their cached pages, or neither does (a request holds pages)."""
        if self.full.allocator.num_used_pages or self.window.allocator.num_used_pages:
            return False
        return self.full.reset_prefix_cache() and self.window.reset_prefix_cache()

    def trim(self, req: Request) -> None:
        self.full.trim(req)
        self.window.trim(req)

    def free(self, req: Request) -> None:
        self.full.free(req)
        self.window.free(req)

    # -- introspection ----------------------------------------------------------------------

    def num_live_pages(self, request_id: str) -> int:
        """The full layers' pages req holds (window_live_pages: the window layers')."""
        return self.full.num_live_pages(request_id)

    def window_live_pages(self, request_id: str) -> int:
        return self.window.num_live_pages(request_id)

    @property
    def prefix_cache_queries(self) -> int:
        return self.full.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.full.prefix_cache_hits

    @property
    def usage(self) -> float:
        """The fuller pool's share in use."""
        return max(self.full.usage, self.window.usage)

    @property
    def num_usable_pages(self) -> int:
        return self.full.num_usable_pages
