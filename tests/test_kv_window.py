"""Sliding windows in the KV cache manager and the scheduler (docs/architecture.md, "Sliding
windows and hybrid KV"): pages behind the window go back as a request advances, the sink is
never freed, a window-aware prefix hit survives the eviction of its early pages, admission
is bounded by the window, and full attention keeps every page. No JAX. Random schedules
with windows: test_prefix_cache_scenarios.py."""
import pytest

from serving.core.kv_window import (common_window, num_hit_pages_read, num_skipped_pages,
                                    window_hit)
from serving.core.page_allocator import SINK_PAGE
from serving.core.request import Request
from serving.core.request_checks import RequestRefused
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import Scheduler, SchedulerConfig, cdiv

PS, W = 4, 8
PROMPT = [10 + i for i in range(30)]


def make_scheduler(**overrides) -> Scheduler:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=512, page_size=PS,
               num_pages=9, sliding_window=W)  # 8 usable pages: 32 tokens of full attention
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg))


def run(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int) -> dict:
    """Runs one request alone to its end with output token 7, checking every step reads
    only held pages; returns its first start and its most live pages (prefill, decode)."""
    req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    sched.add_request(req)
    kvm, seen = sched.kv_cache_manager, dict(start=None, prefill=0, decode=0)
    while sched.has_unfinished:
        out = sched.schedule()
        for s in out.scheduled:
            if seen["start"] is None:
                seen["start"] = s.start
            window = sched.config.sliding_window
            first = max(s.start - window + 1, 0) if window else 0
            for pos in range(first, s.start + s.num_new_tokens):  # read or written
                assert s.page_ids[pos // PS] != SINK_PAGE
            assert len(s.page_ids) == cdiv(s.start + s.num_new_tokens, PS)
            phase = "decode" if s.start >= len(prompt) else "prefill"
            seen[phase] = max(seen[phase], kvm.num_live_pages(rid))
        sched.update(out, [7 if s.samples else None for s in out.scheduled])
    assert req.num_output_tokens == max_tokens
    return seen


def test_common_window_is_the_largest_when_every_layer_has_one():
    assert common_window((8, 8, 8)) == 8
    assert common_window((4, 8)) == 8  # one page table: the widest window decides
    assert common_window((8, 0, 8)) == 0  # a full-attention layer reads every page
    assert common_window(()) == 0


def test_skipped_and_hit_pages_follow_the_window_arithmetic():
    # The next query at 11 sees 4..11: page 0 (0..3) is done; at 10 it still sees 3.
    assert num_skipped_pages(11, W, PS) == 1 and num_skipped_pages(10, W, PS) == 0
    assert num_skipped_pages(100, 0, PS) == 0
    # A hit of n tokens: the query at n reads n - 7 .. n - 1, the last two pages.
    assert num_hit_pages_read(W, PS) == 2 and num_hit_pages_read(9, PS) == 2
    assert num_hit_pages_read(10, PS) == 3 and num_hit_pages_read(1, PS) == 0


def test_window_hit_is_the_longest_whose_last_pages_are_cached():
    cached = {f"h{i}": 100 + i for i in range(10)}

    def hit(missing):
        hashes = [f"h{i}" for i in range(10)]
        return window_hit(hashes, {h: p for h, p in cached.items()
                                   if int(h[1:]) not in missing}.get, W, PS)

    assert hit(set()) == [SINK_PAGE] * 8 + [108, 109]
    assert hit({0, 1, 2, 7}) == [SINK_PAGE] * 8 + [108, 109]  # needs only 8 and 9
    assert hit({8}) == [SINK_PAGE] * 6 + [106, 107]  # 9 and 10 pages both need page 8
    assert hit({1, 8}) == [SINK_PAGE] * 6 + [106, 107]
    assert hit({3, 5, 7, 9}) == [SINK_PAGE, 101, 102]
    assert hit({1, 3, 5, 7, 9}) == [100]  # shorter than the window: its pages from 0
    assert hit({0, 2, 4, 6, 8}) == []


def test_a_long_decode_holds_a_bounded_number_of_pages():
    sched = make_scheduler()
    # 30 + 200 tokens: 58 pages of full attention in a cache of 8.
    seen = run(sched, "a", PROMPT, max_tokens=200)
    assert seen["decode"] <= cdiv(W, PS) + 1  # the window's pages and the one written
    assert seen["prefill"] <= cdiv(W - 1 + 16, PS) + 1  # plus a 16-token chunk
    alloc = sched.allocator
    assert alloc.num_used_pages == 0  # nothing leaks
    assert alloc.ref_count(SINK_PAGE) == 0 and not alloc.is_free(SINK_PAGE)
    assert sched.max_len == 512  # the cache no longer caps a request's length


def test_full_attention_keeps_every_page_and_is_capped_by_the_cache():
    sched = make_scheduler(sliding_window=0, num_pages=65)
    seen = run(sched, "a", PROMPT, max_tokens=60)
    assert seen["decode"] == cdiv(len(PROMPT) + 60 - 1, PS)  # every page to the end
    assert sched.allocator.num_used_pages == 0
    small = make_scheduler(sliding_window=0)
    assert small.max_len == 8 * PS + 1
    with pytest.raises(RequestRefused, match="KV cache pages"):
        small.add_request(Request("b", PROMPT + PROMPT, SamplingParams()))


def test_a_window_model_admits_a_prompt_longer_than_the_cache_but_not_a_chunk():
    sched = make_scheduler()
    seen = run(sched, "a", PROMPT * 4, max_tokens=3)  # 120 tokens, a cache of 32
    assert seen["prefill"] <= 7
    # 8 + 40 - 1 keys touch 13 pages: a 40-token step could not be scheduled in 8.
    wide = make_scheduler(max_num_batched_tokens=40)
    with pytest.raises(RequestRefused, match="KV cache pages"):
        wide.add_request(Request("b", PROMPT * 4, SamplingParams()))
    assert wide.max_len == 8 * PS + 1


def test_pages_given_back_stay_cached_and_a_hit_survives_their_eviction():
    sched = make_scheduler(num_pages=33, max_num_batched_tokens=8)
    prompt = PROMPT + [50 + i for i in range(10)]  # 40 tokens, 10 full pages
    assert run(sched, "a", prompt, max_tokens=1)["start"] == 0
    alloc = sched.allocator
    assert alloc.num_cached_pages == 10  # every page was cached before it went back
    # Evict the pages given back first (prompt pages 0..3): allocating takes uncached
    # pages, then the least recently freed cached ones.
    uncached = alloc.num_free_pages - alloc.num_cached_pages
    taken = alloc.allocate(uncached + 4)
    alloc.free(taken)
    assert alloc.num_cached_pages == 6
    sched.add_request(Request("b", prompt + [5], SamplingParams(max_tokens=2)))
    out = sched.schedule()
    [s] = out.scheduled
    # All 10 pages are a hit: the first computed token reads only pages 8 and 9.
    assert s.start == 40 and s.page_ids[:8] == [SINK_PAGE] * 8
    assert [alloc.ref_count(p) for p in s.page_ids[8:10]] == [1, 1]
    sched.update(out, [7])
    sched.abort("b")
    assert alloc.num_used_pages == 0
    # Full attention on the same cache finds nothing: page 0 is gone.
    sched.kv_cache_manager.sliding_window = 0
    assert sched.kv_cache_manager.get_computed_pages(Request("c", prompt + [5],
                                                             SamplingParams())) == []


def test_rejected_proposals_are_trimmed_after_pages_went_back():
    sched = make_scheduler(num_pages=17)
    req = Request("a", PROMPT, SamplingParams(max_tokens=40, ignore_eos=True))
    sched.add_request(req)
    kvm = sched.kv_cache_manager
    while req.num_output_tokens < 20:
        out = sched.schedule()
        sched.update(out, [7 if s.samples else None for s in out.scheduled])
    req.spec_token_ids = [7, 7, 7, 7, 7]  # ends on a page of its own after the window moved
    out = sched.schedule()
    [s] = out.scheduled
    assert s.page_ids[0] == SINK_PAGE and len(s.page_ids) == cdiv(s.start + 6, PS)
    sched.update(out, [[7, 3]])  # one accepted, then a token of the target's
    pages = kvm.page_ids("a")
    assert len(pages) == cdiv(req.num_computed_tokens, PS)
    assert kvm.num_live_pages("a") <= cdiv(W, PS) + 1
    sched.abort("a")
    assert sched.allocator.num_used_pages == 0
