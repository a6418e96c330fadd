"""KVCacheManager: each request's page table, its prefix-cache hit, and the caching of the
pages it has computed. It sits between the scheduler (which asks it for pages) and the
PageAllocator (which owns ref counts, hashes and eviction). No JAX.

A request's page table is append-only: its leading pages may be shared cached pages (a hit),
the rest are its own. A page is cached (made findable by its hash) only once every token in
it has been computed, in `cache_computed` after the step that computed it, so a request
never finds K/V that is still being written, and a cached page is never written again: a
hit covers whole pages and the request's next token goes to a page of its own.
"""
from __future__ import annotations

from serving.core.page_allocator import PageAllocator
from serving.core.page_hash import hash_pages
from serving.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_pages: int, page_size: int, enable_caching: bool = True,
                 model_key: str = ""):
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.enable_caching = enable_caching
        self.model_key = model_key  # names the weights: the same tokens under other weights differ
        self._pages: dict[str, list[int]] = {}  # request id -> page table
        self._hashes: dict[str, list[bytes]] = {}  # request id -> its full pages' hashes so far
        self._num_cached: dict[str, int] = {}  # request id -> leading pages known cached
        # Counted in tokens as vLLM does: prompt tokens looked up, tokens found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- what the scheduler asks ------------------------------------------------------------

    def page_ids(self, request_id: str) -> list[int]:
        return self._pages.get(request_id, [])

    def reads_cache(self, req: Request) -> bool:
        # Prompt logprobs need every prompt position's logits, and embeddings every
        # position's hidden state, so those requests compute all.
        return (self.enable_caching and req.sampling_params.prompt_logprobs is None
                and req.pooling_params is None)

    def get_computed_pages(self, req: Request) -> list[int]:
        """The cached pages holding req's leading tokens (the longest run of hits, in whole
        pages). At most num_tokens - 1 tokens: the last one is always computed, for its
        logits. Only for a request that holds no pages; changes nothing."""
        if self._pages.get(req.request_id) or not self.reads_cache(req):
            return []
        max_pages = (req.num_tokens - 1) // self.page_size
        pages = []
        for h in self._request_hashes(req, max_pages)[:max_pages]:
            page = self.allocator.lookup(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_pages: list[int] | None = None) -> bool:
        """Grows req's page table to hold num_computed_tokens + num_new_tokens tokens, after
        taking computed_pages (a hit from get_computed_pages, which then covers the first
        num_computed_tokens) as its leading pages. False, changing nothing, if short."""
        computed_pages = computed_pages or []
        pages = self._pages.get(req.request_id, [])
        if computed_pages and (pages or req.num_computed_tokens
                               != len(computed_pages) * self.page_size):
            raise ValueError("a cache hit only starts a request's page table")
        needed = cdiv(req.num_computed_tokens + num_new_tokens, self.page_size)
        missing = max(needed - len(pages) - len(computed_pages), 0)
        # Hit pages sitting in the free queue leave it, so they count against what is free.
        revived = sum(1 for p in computed_pages if self.allocator.ref_count(p) == 0)
        if missing + revived > self.allocator.num_free_pages:
            return False
        if not pages and self.reads_cache(req):
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += len(computed_pages) * self.page_size
        self.allocator.touch(computed_pages)
        if not pages:
            self._num_cached[req.request_id] = len(computed_pages)
        self._pages[req.request_id] = pages + computed_pages + self.allocator.allocate(missing)
        return True

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
        for i in range(done, num_full):
            self.allocator.cache_page(pages[i], hashes[i])
        self._num_cached[rid] = num_full

    def trim(self, req: Request) -> None:
        """Gives back the tail pages beyond num_computed_tokens: they held only rejected
        speculative tokens, so nothing in them is cached or will be read."""
        pages = self._pages.get(req.request_id)
        keep = cdiv(req.num_computed_tokens, self.page_size)
        if pages and len(pages) > keep:
            self.allocator.free(reversed(pages[keep:]))
            del pages[keep:]

    def free(self, req: Request) -> None:
        """Drops req's references, tail pages first: they are evicted before the head pages,
        which other requests are likelier to share."""
        rid = req.request_id
        self.allocator.free(reversed(self._pages.pop(rid, [])))
        self._hashes.pop(rid, None)
        self._num_cached.pop(rid, None)

    # -- introspection ----------------------------------------------------------------------

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
        keys = (self.model_key,)
        if req.lora_key is not None:
            keys += ("lora:" + req.lora_key,)
        salt = req.sampling_params.cache_salt
        return keys if salt is None else keys + ("salt:" + salt,)
