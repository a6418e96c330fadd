"""Prefix caching through the scheduler: hits, their cap, what keeps cache entries apart,
eviction order, and the hit counters. No JAX."""
from serving.core.page_hash import hash_page, hash_pages
from serving.core.request import Request
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import Scheduler, SchedulerConfig

PS = 4


def make_scheduler(**overrides) -> Scheduler:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, page_size=PS,
               num_pages=33)
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg))


def run_to_end(sched: Scheduler, rid: str, prompt: list[int], max_tokens: int = 2,
               **params) -> int:
    """Runs one request alone to its end; returns the position its first chunk started at."""
    sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params)))
    starts = []
    while sched.has_unfinished:
        out = sched.schedule()
        starts += [s.start for s in out.scheduled if s.request.request_id == rid]
        sched.update(out, [7 if s.samples else None for s in out.scheduled])
    return starts[0]


PROMPT = list(range(10, 24))  # 14 tokens: 3 full pages and 2 more


def test_a_repeated_prompt_reuses_its_full_pages():
    sched = make_scheduler()
    assert run_to_end(sched, "a", PROMPT) == 0
    assert run_to_end(sched, "b", PROMPT) == 12
    assert run_to_end(sched, "c", PROMPT[:9] + [99] * 5) == 8  # shares two pages
    assert run_to_end(sched, "d", [99] + PROMPT[1:]) == 0  # the chain breaks at page 0
    kvm = sched.kv_cache_manager
    assert (kvm.prefix_cache_queries, kvm.prefix_cache_hits) == (4 * 14, 12 + 8)


def test_a_hit_always_leaves_the_last_prompt_token_to_compute():
    sched = make_scheduler()
    run_to_end(sched, "a", PROMPT[:12])
    assert run_to_end(sched, "b", PROMPT[:12]) == 8  # not 12: the last token needs logits


def test_pages_filled_by_generated_tokens_are_cached_once_computed():
    sched = make_scheduler()
    run_to_end(sched, "a", PROMPT[:6], max_tokens=4)  # outputs 7 7 7 7; 9 tokens computed
    assert run_to_end(sched, "b", PROMPT[:6] + [7, 7, 7]) == 8  # page 2 = 2 prompt + 2 outputs


def test_a_shared_page_is_held_until_its_last_user_ends():
    sched = make_scheduler()
    run_to_end(sched, "a", PROMPT)
    for rid in ("b", "c"):
        sched.add_request(Request(rid, PROMPT, SamplingParams(max_tokens=5)))
    out = sched.schedule()
    b, c = (sched.page_ids(r) for r in ("b", "c"))
    assert b[:3] == c[:3] and set(b[3:]).isdisjoint(c[3:])
    assert [sched.allocator.ref_count(p) for p in b[:3]] == [2, 2, 2]
    sched.update(out, [1, 1])
    sched.abort("b")
    assert [sched.allocator.ref_count(p) for p in c[:3]] == [1, 1, 1]
    sched.abort("c")
    assert sched.allocator.num_used_pages == 0 and sched.allocator.num_cached_pages >= 3


def test_salt_model_and_prompt_logprobs_keep_requests_off_the_cache():
    sched = make_scheduler(model_key="weights-a")
    run_to_end(sched, "a", PROMPT, cache_salt="tenant-1")
    assert run_to_end(sched, "b", PROMPT) == 0
    assert run_to_end(sched, "c", PROMPT, cache_salt="tenant-2") == 0
    assert run_to_end(sched, "d", PROMPT, cache_salt="tenant-1") == 12
    assert run_to_end(sched, "e", PROMPT, cache_salt="tenant-1", prompt_logprobs=0) == 0
    plain = Request("x", PROMPT, SamplingParams())
    salted = Request("y", PROMPT, SamplingParams(cache_salt="tenant-1"))
    kvm = sched.kv_cache_manager
    assert (kvm.extra_keys(plain), kvm.extra_keys(salted)) == (
        ("weights-a",), ("weights-a", "salt:tenant-1"))
    assert hash_pages(PROMPT, PS, ("weights-a",)) != hash_pages(PROMPT, PS, ("weights-b",))


def test_disabled_caching_never_hits():
    sched = make_scheduler(enable_prefix_caching=False)
    run_to_end(sched, "a", PROMPT)
    assert run_to_end(sched, "b", PROMPT) == 0
    assert sched.allocator.num_cached_pages == 0
    assert sched.kv_cache_manager.prefix_cache_queries == 0


def test_eviction_takes_a_sequence_tail_before_its_head():
    sched = make_scheduler(num_pages=6)  # 5 usable pages
    run_to_end(sched, "a", PROMPT, max_tokens=1)  # 4 pages: 3 cached + 1 partial
    # 3 tokens + 1 output need one page: the partial page (nothing cached) goes first
    run_to_end(sched, "b", [90, 91, 92], max_tokens=1)
    assert run_to_end(sched, "c", PROMPT, max_tokens=1) == 12
    # 9 new tokens need 3 pages: the free uncached ones, then a's tail page
    run_to_end(sched, "d", [80 + i for i in range(9)], max_tokens=1)
    assert run_to_end(sched, "e", PROMPT, max_tokens=1) == 8


def test_page_hashes_chain_and_encode_keys_unambiguously():
    first = hash_page(None, [1, 2], ("m",))
    assert hash_page(first, [3, 4]) == hash_pages([1, 2, 3, 4], 2, ("m",))[1]
    assert hash_page(None, [1, 2], ("m", "s")) != hash_page(None, [1, 2], ("ms",))
    assert hash_page(None, [1, 2]) != hash_page(None, [1, 2], ("",))
    assert hash_page(None, [1]) != hash_page(None, [1, 0])
    assert len(first) == 32
