"""KVCacheManager: each request's page table, its prefix-cache hit, and the caching of the
pages it has computed. It sits between the scheduler (which asks it for pages) and the
PageAllocator (which owns ref counts, hashes and eviction). No JAX.

A request's page table grows only at its end: its leading pages may be shared cached pages (a hit),
the rest are its own. A page is cached (made findable by its hash) only once every token in
it has been computed, in `cache_computed` after the step that computed it, so a request
never finds K/V that is still being written, and a cached page is never written again: a
hit covers whole pages and the request's next token goes to a page of its own.

On a window model (`sliding_window` > 0, core/kv_window.py) the leading pages no future
query reads go back to the pool as the request advances: their entries become SINK_PAGE, so
the table keeps its length and its indexing (position // page_size). They were cached first
and stay findable until evicted. Every walk over a page table skips those entries.
"""
from __future__ import annotations

from serving.core.kv_events import KVEventRecorder
from serving.core.kv_window import cdiv, num_skipped_pages, window_hit
from serving.core.page_allocator import SINK_PAGE, PageAllocator
from serving.core.page_hash import hash_pages
from serving.core.request import Request


def page_keys(model_key: str, lora_key: str | None = None,
              cache_salt: str | None = None) -> tuple[str, ...]:
    """The extra keys of a prompt's first page hash (see KVCacheManager.extra_keys)."""
    keys = (model_key,)
    if lora_key is not None:
        keys += ("lora:" + lora_key,)
    return keys if cache_salt is None else keys + ("salt:" + cache_salt,)


def _held(pages: list[int]) -> list[int]:
    """The pages a table references (its SINK_PAGE entries hold nothing)."""
    return [p for p in pages if p != SINK_PAGE]


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_caching: bool = True,
                 model_key: str = "", sliding_window: int = 0):
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        # The window every layer keeps within; 0: some layer reads every page, keep them all.
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        self.model_key = model_key  # names the weights: the same tokens under other weights differ
        self._pages: dict[str, list[int]] = {}  # request id -> page table
        self._hashes: dict[str, list[bytes]] = {}  # request id -> its full pages' hashes so far
        self._num_cached: dict[str, int] = {}  # request id -> leading pages known cached
        self._num_skipped: dict[str, int] = {}  # request id -> leading pages given back
        # Counted in tokens as vLLM does: prompt tokens looked up, tokens found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.events: KVEventRecorder | None = None  # KV cache events (record_events)

    def record_events(self, events: list, group_idx: int = 0) -> None:
        """From now on, appends this cache's KV cache events (core/kv_events.py) to
        `events` as they happen; the caller drains it."""
        self.events = KVEventRecorder(events, self.page_size, group_idx, self.sliding_window)
        self.allocator.events = self.events

    # -- what the scheduler asks ------------------------------------------------------------

    def page_ids(self, request_id: str) -> list[int]:
        return self._pages.get(request_id, [])

    def reads_cache(self, req: Request) -> bool:
        # Prompt logprobs need every prompt position's logits, and embeddings every
        # position's hidden state, so those requests compute all.
        return (self.enable_caching and req.sampling_params.prompt_logprobs is None
                and req.pooling_params is None)

    def get_computed_pages(self, req: Request, max_pages: int | None = None) -> list[int]:
        """The cached pages holding req's leading tokens, in whole pages: the longest run
        of hits, or on a window model the longest hit whose last pages (those the first
        computed token reads) are cached, earlier entries SINK_PAGE. At most
        num_tokens - 1 tokens (the last one is always computed, for its logits), and at
        most max_pages pages. Only for a request that holds no pages; changes nothing."""
        if self._pages.get(req.request_id) or not self.reads_cache(req):
            return []
        limit = (req.num_tokens - 1) // self.page_size
        max_pages = limit if max_pages is None else min(max_pages, limit)
        hashes = self._request_hashes(req, max_pages)[:max_pages]
        if self.sliding_window:
            return window_hit(hashes, self.allocator.lookup, self.sliding_window,
                              self.page_size)
        pages = []
        for h in hashes:
            page = self.allocator.lookup(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_pages: list[int] | None = None) -> bool:
        """Grows req's page table to hold num_computed_tokens + num_new_tokens tokens, after
        taking computed_pages (a hit from get_computed_pages, which then covers the first
        num_computed_tokens) as its leading pages. False if short of pages, changing
        nothing but giving back pages the window no longer reads."""
        computed_pages = computed_pages or []
        pages = self._pages.get(req.request_id, [])
        if computed_pages and (pages or req.num_computed_tokens
                               != len(computed_pages) * self.page_size):
            raise ValueError("a cache hit only starts a request's page table")
        self.remove_skipped_pages(req)
        missing = self._missing(req, num_new_tokens, computed_pages)
        if pages and not missing:
            return True  # most decode steps: the last page has room, the table stays
        hit = _held(computed_pages)
        if not self._fits(missing, hit):
            return False
        if not pages and self.reads_cache(req):
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += len(computed_pages) * self.page_size
        self.allocator.touch(hit)
        if not pages:
            self._num_cached[req.request_id] = len(computed_pages)
            self._num_skipped[req.request_id] = len(computed_pages) - len(hit)
        self._pages[req.request_id] = pages + computed_pages + self.allocator.allocate(missing)
        return True

    def can_allocate(self, req: Request, num_new_tokens: int,
                     computed_pages: list[int] | None = None) -> bool:
        """Whether allocate_slots would succeed now (after remove_skipped_pages)."""
        return self._fits(self._missing(req, num_new_tokens, computed_pages),
                          _held(computed_pages or []))

    def _fits(self, missing: int, hit: list[int]) -> bool:
        # Hit pages sitting in the free queue leave it, so they count against what is free.
        revived = sum(1 for p in hit if self.allocator.ref_count(p) == 0)
        return missing + revived <= self.allocator.num_free_pages

    def _missing(self, req: Request, num_new_tokens: int, computed_pages) -> int:
        needed = cdiv(req.num_computed_tokens + num_new_tokens, self.page_size)
        held = len(self._pages.get(req.request_id, [])) + len(computed_pages or [])
        return max(needed - held, 0)

    def remove_skipped_pages(self, req: Request) -> None:
        """On a window model, gives back req's leading pages that no query from
        num_computed_tokens on reads (their entries become SINK_PAGE). Only computed
        positions count, so the pages a verifying step may still trim are never among
        them. Each page is cached first: a later prompt may still hit it."""
        rid = req.request_id
        pages = self._pages.get(rid)
        if not pages or not self.sliding_window:
            return
        skip = min(num_skipped_pages(req.num_computed_tokens, self.sliding_window,
                                     self.page_size), len(pages))
        done = self._num_skipped.get(rid, 0)
        if skip <= done:
            return
        self.cache_computed(req)
        # Tail first among them, as free() does: the earliest pages are the likeliest shared.
        self.allocator.free(reversed(_held(pages[done:skip])))
        pages[done:skip] = [SINK_PAGE] * (skip - done)
        self._num_skipped[rid] = skip

    def cache_computed(self, req: Request) -> None:
        """Makes req's full pages whose every token is computed findable by later requests
        (an embedding request's pages are freed without being cached: no KV kept after)."""
        if not self.enable_caching or req.pooling_params is not None:
            return
        rid = req.request_id
        num_full = req.num_computed_tokens // self.page_size
        done = self._num_cached.get(rid, 0)
        if num_full <= done:
            return
        pages, hashes = self._pages[rid], self._request_hashes(req, num_full)
        fresh = []  # the pages cached by this call (not under the hash elsewhere already)
        for i in range(done, num_full):
            if pages[i] != SINK_PAGE:  # given back already: was cached before that
                new = self.allocator.page_hash(pages[i]) is None
                if self.allocator.cache_page(pages[i], hashes[i]) and new:
                    fresh.append(i)
        self._num_cached[rid] = num_full
        if self.events is not None and fresh:
            self.events.stored(req, fresh, hashes)

    def trim(self, req: Request) -> None:
        """Gives back the tail pages beyond num_computed_tokens: they held only rejected
        speculative tokens, so nothing in them is cached or will be read."""
        pages = self._pages.get(req.request_id)
        keep = cdiv(req.num_computed_tokens, self.page_size)
        if pages and len(pages) > keep:
            self.allocator.free(reversed(_held(pages[keep:])))
            del pages[keep:]

    def free(self, req: Request) -> None:
        """Drops req's references, tail pages first: they are evicted before the head pages,
        which other requests are likelier to share."""
        rid = req.request_id
        self.allocator.free(reversed(_held(self._pages.pop(rid, []))))
        self._hashes.pop(rid, None)
        self._num_cached.pop(rid, None)
        self._num_skipped.pop(rid, None)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached page; False while a request holds pages (see
        PageAllocator.reset_cache)."""
        if not self.allocator.reset_cache():
            return False
        if self.events is not None:
            self.events.cleared()
        return True

    # -- introspection ----------------------------------------------------------------------

    def num_live_pages(self, request_id: str) -> int:
        """The pages req's table references (its SINK_PAGE entries not counted)."""
        return len(_held(self._pages.get(request_id, [])))

    @property
    def usage(self) -> float:
        return self.allocator.usage

    @property
    def num_usable_pages(self) -> int:
        return self.allocator.num_usable_pages

    def _request_hashes(self, req: Request, num_pages: int) -> list[bytes]:
        """req's first num_pages full-page hashes (fewer if it has fewer full pages), computed
        once per page: a request's tokens only ever grow."""
        hashes = self._hashes.setdefault(req.request_id, [])
        num_pages = min(num_pages, req.num_tokens // self.page_size)
        if len(hashes) < num_pages:
            start = len(hashes)
            tokens = req.slice_token_ids(0, num_pages * self.page_size)
            hashes += hash_pages(tokens, self.page_size, self.extra_keys(req),
                                 hashes[-1] if hashes else None, start)
        return hashes

    def extra_keys(self, req: Request) -> tuple[str, ...]:
        """What else decides a page's K/V: the weights, the LoRA adapter (by a digest of its
        files, so an adapter reloaded under the same name never meets its old pages), and
        the request's cache_salt."""
        return page_keys(self.model_key, req.lora_key, req.sampling_params.cache_salt)
