"""Scheduler scenarios driven by fake sampled tokens. No JAX. Random schedules with the
invariants checked after every step: test_prefix_cache_scenarios.py."""
import zlib

import pytest

from serving.core.request import Request, RequestStatus
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, cdiv

EOS = 2


def make_scheduler(**overrides) -> Scheduler:
    cfg = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, page_size=4,
               num_pages=65)
    cfg.update(overrides)
    return Scheduler(SchedulerConfig(**cfg))


def make_request(rid, num_prompt_tokens, max_tokens=16, **params) -> Request:
    # Prompts of their own per request id: sharing (prefix caching) is tested on purpose.
    base = 100 * (1 + zlib.crc32(str(rid).encode()) % 10_000)
    prompt = [base + i for i in range(num_prompt_tokens)]
    return Request(str(rid), prompt, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=frozenset({EOS}))


def step(sched: Scheduler, token=7) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step; `token` may be a function of the request (distinct outputs per request)."""
    out = sched.schedule()
    sampled = [(token(s.request) if callable(token) else token) if s.samples else None
               for s in out.scheduled]
    return out, sched.update(out, sampled)


def plan(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


# -- admission ----------------------------------------------------------------------------

def test_admission_is_fcfs_and_capped_by_max_num_seqs():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(i, 5))
    out, _ = step(sched)
    assert plan(out) == [("0", 5), ("1", 5)]
    assert (sched.num_running, sched.num_waiting) == (2, 2)
    out, _ = step(sched)
    assert plan(out) == [("0", 1), ("1", 1)]  # no room for "2" until one finishes


def test_admission_is_capped_by_the_token_budget_with_a_partial_chunk():
    sched = make_scheduler(max_num_batched_tokens=16)
    for i in range(3):
        sched.add_request(make_request(i, 10))
    out, _ = step(sched)
    assert plan(out) == [("0", 10), ("1", 6)]
    assert [s.samples for s in out.scheduled] == [True, False]
    assert out.num_batched_tokens == 16 and sched.num_waiting == 1
    out, _ = step(sched)
    assert plan(out) == [("0", 1), ("1", 4), ("2", 10)]


def test_waiting_request_is_not_admitted_without_free_pages():
    sched = make_scheduler(page_size=4, num_pages=4)  # 3 usable pages
    sched.add_request(make_request("a", 8))
    sched.add_request(make_request("b", 5))  # needs 2 pages, only 1 left after "a"
    out, _ = step(sched)
    assert plan(out) == [("a", 8)] and sched.num_waiting == 1


# -- chunked prefill ----------------------------------------------------------------------

def test_long_prompt_is_prefilled_in_chunks_and_samples_only_at_the_end():
    sched = make_scheduler(max_num_batched_tokens=10)
    req = make_request("a", 25)
    sched.add_request(req)
    chunks = []
    for _ in range(3):
        out, changed = step(sched, token=42)
        [s] = out.scheduled
        chunks.append((s.start, s.num_new_tokens, s.samples))
        assert s.token_ids == req.prompt_token_ids[s.start:s.start + s.num_new_tokens]
        assert len(s.page_ids) == cdiv(s.start + s.num_new_tokens, 4)
        assert s.page_ids == sched.page_ids(req.request_id)
        assert changed == ([req] if s.samples else [])
    assert chunks == [(0, 10, False), (10, 10, False), (20, 5, True)]
    assert req.output_token_ids == [42] and req.num_computed_tokens == 25


def test_long_prefill_token_threshold_caps_a_chunk():
    sched = make_scheduler(long_prefill_token_threshold=6)
    sched.add_request(make_request("a", 14))
    sched.add_request(make_request("b", 3))
    out, _ = step(sched)
    assert plan(out) == [("a", 6), ("b", 3)]
    out, _ = step(sched)
    assert plan(out) == [("a", 6), ("b", 1)]


@pytest.mark.parametrize("ahead", [False, True], ids=["update", "update_ahead"])
def test_prompt_tokens_are_counted_once_a_chunk_and_decodes_add_none(ahead):
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request(0, 10, max_tokens=5))
    sched.add_request(make_request(1, 20, max_tokens=5))
    while sched.has_unfinished:
        out = sched.schedule()
        if ahead:
            sched.resolve(sched.update_ahead(out), [7] * len(out.scheduled))
        else:
            sched.update(out, [7 if s.samples else None for s in out.scheduled])
    assert sched.num_prompt_tokens_total == 30
    assert sched.num_generation_tokens_total == 10


def test_decodes_are_scheduled_before_new_prefills():
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", 4))
    step(sched)
    sched.add_request(make_request("b", 30))
    out, _ = step(sched)
    assert plan(out) == [("a", 1), ("b", 15)]
    [decode, prefill] = out.scheduled
    assert decode.token_ids == [7] and decode.start == 4 and decode.samples
    assert not prefill.samples


# -- preemption ---------------------------------------------------------------------------

def sampler_by_request():
    """Distinct, reproducible tokens per request: 1000 * n + number of outputs so far."""
    return lambda req: 1000 * (ord(req.request_id) - ord("a") + 1) + req.num_output_tokens


def test_exhaustion_preempts_the_newest_which_later_recomputes_what_the_cache_lost():
    sched = make_scheduler(page_size=4, num_pages=5)  # 4 usable pages
    a, b = make_request("a", 6, max_tokens=5), make_request("b", 6)
    sched.add_request(a)
    sched.add_request(b)
    token = sampler_by_request()
    for _ in range(3):  # each fills 2 pages: 6 prompt tokens + 2 decodes
        out, _ = step(sched, token)
        assert out.preempted == []
    out, _ = step(sched, token)  # "a" needs a 3rd page for its 9th token: take b's
    assert plan(out) == [("a", 1)] and out.preempted == [b]
    assert (b.status, b.num_computed_tokens, sched.page_ids("b"), b.num_preemptions) == (
        RequestStatus.WAITING, 0, [], 1)
    assert b.output_token_ids == [2000, 2001, 2002] and sched.num_preemptions_total == 1
    out, changed = step(sched, token)
    assert plan(out) == [("a", 1)] and a.finish_reason == "length" and changed == [a]
    out, _ = step(sched, token)
    [resumed] = out.scheduled
    # b's pages were freed tail first, so a took b's tail page and b's head page is still
    # cached: b recomputes only from there.
    assert resumed.request is b and resumed.start == 4 and resumed.samples
    assert resumed.token_ids == b.prompt_token_ids[4:] + [2000, 2001, 2002]
    assert b.output_token_ids == [2000, 2001, 2002, 2003]


def test_newest_request_needing_a_page_preempts_itself():
    sched = make_scheduler(page_size=4, num_pages=4)  # 3 usable pages
    a, b = make_request("a", 6), make_request("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    out, changed = step(sched)  # a fits 7 tokens in its 2 pages; b needs a 2nd page
    assert plan(out) == [("a", 1)] and out.preempted == [b] and changed == [a]
    assert b.output_token_ids == [7] and sched.num_waiting == 1
    assert sched.allocator.num_free_pages == 1


def test_a_request_longer_than_the_whole_cache_stops_with_length_instead_of_hanging():
    sched = make_scheduler(page_size=4, num_pages=3, max_model_len=100)  # 8 cached tokens
    req = make_request("a", 5, max_tokens=None)
    sched.add_request(req)
    for _ in range(10):
        if not sched.has_unfinished:
            break
        step(sched)
    assert req.finish_reason == "length" and req.num_tokens == 9
    assert sched.allocator.num_free_pages == 2


# -- aborts and finish_request -------------------------------------------------------------

def test_abort_frees_pages_at_once():
    sched = make_scheduler()
    req = make_request("a", 9)
    sched.add_request(req)
    sched.add_request(make_request("b", 3))
    step(sched)
    used = sched.allocator.num_used_pages
    sched.abort("a")
    assert sched.allocator.num_used_pages == used - 3
    assert (req.status, req.finish_reason, sched.page_ids(req.request_id)) == (
        RequestStatus.FINISHED_ABORTED, "abort", [])
    assert sched.get_request("a") is None and sched.num_running == 1
    sched.abort("a")  # already finished: no-op
    sched.abort("nope")


def test_abort_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    a, b = make_request("a", 4), make_request("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.abort("a")
    assert sched.update(out, [5, 6]) == [b]
    assert a.output_token_ids == [] and a.num_computed_tokens == 0
    assert b.output_token_ids == [6]
    assert sched.allocator.num_used_pages == 1


def test_abort_of_a_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 4))
    sched.add_request(make_request("b", 4))
    step(sched)
    sched.abort("b")
    assert (sched.num_running, sched.num_waiting) == (1, 0)


def test_finish_request_for_a_stop_string():
    sched = make_scheduler()
    req = make_request("a", 4)
    sched.add_request(req)
    step(sched)
    sched.finish_request("a", RequestStatus.FINISHED_STOPPED, "END")
    assert (req.finish_reason, req.stop_reason) == ("stop", "END")
    assert not sched.has_unfinished and sched.kv_cache_usage == 0.0
    with pytest.raises(ValueError):
        sched.finish_request("a", RequestStatus.RUNNING)


# -- stop conditions -----------------------------------------------------------------------

def run_one(req: Request, tokens: list[int], **cfg) -> Scheduler:
    sched = make_scheduler(**cfg)
    sched.add_request(req)
    for t in tokens:
        if not sched.has_unfinished:
            break
        step(sched, token=t)
    return sched


def test_stop_token_id_stops_with_it_as_the_reason():
    req = make_request("a", 3, stop_token_ids=[9], ignore_eos=True)
    sched = run_one(req, [5, 9, 5])
    assert req.output_token_ids == [5, 9]
    assert (req.status, req.finish_reason, req.stop_reason) == (
        RequestStatus.FINISHED_STOPPED, "stop", 9)
    assert sched.allocator.num_used_pages == 0 and sched.num_running == 0


def test_eos_stops_unless_ignored():
    req = make_request("a", 3)
    run_one(req, [5, EOS, 5])
    assert (req.output_token_ids, req.finish_reason, req.stop_reason) == ([5, EOS], "stop", None)
    req = make_request("a", 3, max_tokens=3, ignore_eos=True)
    run_one(req, [EOS, EOS, EOS, EOS])
    assert (req.output_token_ids, req.finish_reason) == ([EOS] * 3, "length")


def test_max_tokens_and_max_model_len_stop_with_length():
    req = make_request("a", 3, max_tokens=4)
    run_one(req, [5] * 10)
    assert (req.num_output_tokens, req.status) == (4, RequestStatus.FINISHED_LENGTH)
    req = make_request("a", 10, max_tokens=None)
    run_one(req, [5] * 20, max_model_len=16)
    assert (req.num_tokens, req.finish_reason) == (16, "length")


def test_update_rejects_a_mismatched_token_list():
    sched = make_scheduler()
    sched.add_request(make_request("a", 3))
    out = sched.schedule()
    with pytest.raises(ValueError):
        sched.update(out, [])


def test_a_stop_string_ends_a_request_through_the_scheduler():
    sched = make_scheduler()
    running, last = make_request("a", 3), make_request("b", 3, max_tokens=1)
    sched.add_request(running)
    sched.add_request(last)
    step(sched)  # both prefill and sample; "b" ends by length on its only token
    assert last.finish_reason == "length" and running.status is RequestStatus.RUNNING
    used = sched.allocator.num_used_pages
    sched.stop_on_string(running, "STOP")
    assert (running.finish_reason, running.stop_reason) == ("stop", "STOP")
    assert not sched.has_unfinished and used == 1 and sched.allocator.num_used_pages == 0
    # The token that completed the stop string also hit max_tokens: the stop string wins.
    sched.stop_on_string(last, "END")
    assert (last.status, last.finish_reason, last.stop_reason) == (
        RequestStatus.FINISHED_STOPPED, "stop", "END")
    aborted = make_request("c", 3)
    sched.add_request(aborted)
    sched.abort("c")
    sched.stop_on_string(aborted, "late")  # an abort stays an abort
    assert aborted.finish_reason == "abort"


# -- refusals ------------------------------------------------------------------------------

@pytest.mark.parametrize("num_prompt_tokens, cfg, message", [
    (0, {}, "prompt is empty"),
    (32, dict(max_model_len=32), "maximum context length is 32 tokens"),
    (40, dict(max_model_len=32), "leaves no room for a completion"),
    (12, dict(page_size=4, num_pages=4), "needs 4 KV cache pages"),
])
def test_never_fitting_prompts_are_refused(num_prompt_tokens, cfg, message):
    sched = make_scheduler(**cfg)
    with pytest.raises(ValueError, match=message):
        sched.add_request(make_request("a", num_prompt_tokens))
    assert not sched.has_unfinished


def test_prompt_plus_max_tokens_beyond_max_model_len_is_accepted():
    sched = make_scheduler(max_model_len=16)
    sched.add_request(make_request("a", 10, max_tokens=100))
    assert sched.num_waiting == 1
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", 3))


# -- look-ahead pages (MTP's chained guesses) ---------------------------------------------

def pages_then_step(sched: Scheduler) -> tuple[list[int], list[bool]]:
    """Each scheduled request's page count as the step runs (before update), and whether it
    samples; then the step is applied."""
    out = sched.schedule()
    counts = [len(s.page_ids) for s in out.scheduled]
    sched.update(out, [7 if s.samples else None for s in out.scheduled])
    return counts, [s.samples for s in out.scheduled]


def test_a_sampling_step_takes_pages_for_its_look_ahead_and_gives_them_back_after():
    sched = make_scheduler(max_num_batched_tokens=8, num_lookahead_tokens=2, max_model_len=16)
    sched.add_request(make_request("a", 11, max_tokens=40))
    # a chunk of 8 does not sample, so no look-ahead; the last 3 prompt tokens sample, with
    # pages for 11 + 2 positions; then decodes at 11 .. 14 (capped at max_model_len, 16)
    got = [pages_then_step(sched) for _ in range(5)]
    assert got == [([2], [False]), ([4], [True]), ([4], [True]), ([4], [True]), ([4], [True])]
    sched = make_scheduler(num_lookahead_tokens=2)
    sched.add_request(make_request("b", 5))
    assert pages_then_step(sched) == ([2], [True])  # 5 + 2 positions
    assert pages_then_step(sched) == ([2], [True])  # position 5: 6 + 2
    assert pages_then_step(sched) == ([3], [True])  # position 6: 7 + 2 -> 3 pages
    assert len(sched.page_ids("b")) == 2  # 7 computed: the look-ahead page went back


def test_look_ahead_is_dropped_where_pages_are_short():
    # 4 pages besides the sink: "a" (7 tokens, 4 ahead) takes 3; "b" (4 tokens) would take 2
    # with its look-ahead, so it takes its 1 without.
    sched = make_scheduler(num_pages=5, num_lookahead_tokens=4)
    sched.add_request(make_request("a", 7))
    sched.add_request(make_request("b", 4))
    out = sched.schedule()
    assert [len(s.page_ids) for s in out.scheduled] == [3, 1]
    assert not out.preempted and sched.allocator.num_free_pages == 0
