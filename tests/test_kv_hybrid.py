"""A hybrid model's two page pools in the scheduler (docs/architecture.md, "Sliding windows and
hybrid KV"): the full-attention layers keep every page, the window layers' table gives back
what falls behind the window, both tables index the same positions, a prefix hit is the
longest both can serve, a request gets pages in both pools or in neither, and the window
pool's size follows max_num_seqs within half the memory. No JAX."""
import random

import pytest

from serving.core.kv_hybrid import HybridKVCacheManager
from serving.core.kv_window import request_pages
from serving.core.page_allocator import SINK_PAGE
from serving.core.request import Request
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import Scheduler, SchedulerConfig, cdiv
from serving.engine.kv_pools import WindowPool

PS, W, BUDGET = 4, 8, 16


def make_scheduler(num_pages=200, window_num_pages=40, **overrides) -> Scheduler:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=BUDGET, max_model_len=512, page_size=PS,
               num_pages=num_pages, window_group=W, window_num_pages=window_num_pages)
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg))


def request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def drive(sched: Scheduler, reqs: list[Request], seen: dict | None = None) -> None:
    """Runs requests to their ends (output token 7), checking that every step's window table
    holds each key its window layers read and write, and its full table every key."""
    for r in reqs:
        sched.add_request(r)
    kvm = sched.kv_cache_manager
    while sched.has_unfinished:
        out = sched.schedule()
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            assert len(s.page_ids) == len(s.window_page_ids) == cdiv(end, PS)
            assert SINK_PAGE not in s.page_ids
            for pos in range(max(s.start - W + 1, 0), end):
                assert s.window_page_ids[pos // PS] != SINK_PAGE
            if seen is not None:
                rid = s.request.request_id
                seen[rid] = max(seen.get(rid, 0), kvm.window_live_pages(rid))
        sched.update(out, [7 if s.samples else None for s in out.scheduled])
    assert kvm.full.allocator.num_used_pages == 0
    assert kvm.window.allocator.num_used_pages == 0


def test_window_layers_hold_a_window_while_full_layers_hold_everything():
    sched = make_scheduler()
    kvm = sched.kv_cache_manager
    assert isinstance(kvm, HybridKVCacheManager)
    req = request("a", list(range(10, 40)), 70)
    sched.add_request(req)
    most_window, most_full = 0, 0
    while sched.has_unfinished:
        out = sched.schedule()
        most_window = max(most_window, kvm.window_live_pages("a"))
        most_full = max(most_full, kvm.num_live_pages("a"))
        sched.update(out, [7 if s.samples else None for s in out.scheduled])
    assert most_full == cdiv(30 + 70 - 1, PS)  # every position but the last token's
    assert most_window <= request_pages(W, BUDGET, PS) < most_full


def test_random_batches_read_only_held_pages_and_leak_nothing():
    rng = random.Random(5)
    sched = make_scheduler(max_num_seqs=3)
    seen = {}
    reqs = [request(f"r{i}", [rng.randrange(3, 50) for _ in range(rng.randrange(1, 40))],
                    rng.randrange(1, 50)) for i in range(12)]
    drive(sched, reqs, seen)
    assert max(seen.values()) <= request_pages(W, BUDGET, PS)


def test_a_hit_is_the_longest_prefix_both_pools_serve():
    sched = make_scheduler()
    kvm = sched.kv_cache_manager
    prompt = list(range(20, 70))  # 12 full pages before its last token
    drive(sched, [request("cold", prompt, 3)])
    warm = request("warm", prompt + [1], 3)
    hit = kvm.get_computed_pages(warm)
    need = cdiv(W - 1, PS)
    assert len(hit) == len(hit.window) == 12
    assert hit.window[:12 - need] == [SINK_PAGE] * (12 - need)
    assert SINK_PAGE not in hit.window[-need:] and SINK_PAGE not in hit
    queries, hits = kvm.prefix_cache_queries, kvm.prefix_cache_hits
    drive(sched, [warm])
    assert kvm.prefix_cache_queries - queries == 51 and kvm.prefix_cache_hits - hits == 12 * PS
    # Evict every cached window page (handing out the whole free pool evicts what it held):
    # the full layers still have the prefix, but no hit serves both, so there is none.
    pages = kvm.window.allocator.allocate(kvm.window.allocator.num_free_pages)
    kvm.window.allocator.free(pages)
    again = request("again", prompt + [2], 3)
    assert len(kvm.full.get_computed_pages(again)) == 12
    assert kvm.get_computed_pages(again) == [] and kvm.get_computed_pages(again).window == []
    drive(sched, [again])


def test_a_short_window_pool_changes_nothing_in_the_full_pool():
    """allocate_slots succeeds in both pools or changes neither."""
    sched = make_scheduler(window_num_pages=12)
    kvm = sched.kv_cache_manager
    a, b = request("a", list(range(3, 19)), 4), request("b", list(range(30, 46)), 4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()  # a's 16-token prefill takes the whole budget
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    # Fill the window pool so b's admission falls short there but not in the full pool.
    free = kvm.window.allocator.num_free_pages
    taken = kvm.window.allocator.allocate(free)
    full_used = kvm.full.allocator.num_used_pages
    b.num_computed_tokens = 0
    assert not kvm.allocate_slots(b, 16)
    assert kvm.full.allocator.num_used_pages == full_used and kvm.page_ids("b") == []
    kvm.window.allocator.free(taken)
    assert kvm.allocate_slots(b, 16)
    assert len(kvm.page_ids("b")) == len(kvm.window_page_ids("b")) == 4


def test_a_pool_too_small_for_one_request_is_refused():
    need = request_pages(W, BUDGET, PS)
    with pytest.raises(ValueError, match="window layers' pool needs at least"):
        make_scheduler(window_num_pages=need)
    make_scheduler(window_num_pages=need + 1)


def test_the_window_pool_follows_max_num_seqs_within_half_the_memory():
    pool = WindowPool(window=1024, page_size=16, step_tokens=2048, max_num_seqs=256,
                      page_bytes=1 << 20, full_page_bytes=1 << 18)
    per_request = cdiv(1023, 16) + 2
    assert pool.wanted_pages == 256 * per_request + 2048 // 16 + 1
    assert pool.pages_within(1 << 40) == pool.wanted_pages  # plenty: every running window
    assert pool.pages_within(10_000 << 20) == 5_000  # capped at half
    assert pool.pages_within(1 << 20) == pool.least_pages == request_pages(1024, 2048, 16) + 1
