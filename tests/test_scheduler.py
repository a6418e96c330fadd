"""Scheduler scenarios driven by fake sampled tokens, plus a randomized invariant check. No JAX."""
import random

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
    prompt = [100 + i for i in range(num_prompt_tokens)]
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
        assert len(s.page_ids) == cdiv(s.start + s.num_new_tokens, 4) == len(req.page_ids)
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


def test_exhaustion_preempts_the_newest_which_later_recomputes_prompt_and_outputs():
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
    assert (b.status, b.num_computed_tokens, b.page_ids, b.num_preemptions) == (
        RequestStatus.WAITING, 0, [], 1)
    assert b.output_token_ids == [2000, 2001, 2002] and sched.num_preemptions_total == 1
    out, changed = step(sched, token)
    assert plan(out) == [("a", 1)] and a.finish_reason == "length" and changed == [a]
    out, _ = step(sched, token)
    [resumed] = out.scheduled
    assert resumed.request is b and resumed.start == 0 and resumed.samples
    assert resumed.token_ids == b.prompt_token_ids + [2000, 2001, 2002]
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
    assert (req.status, req.finish_reason, req.page_ids) == (
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


# -- randomized ----------------------------------------------------------------------------

def check_invariants(sched: Scheduler, order: dict[str, int]) -> None:
    cfg, alloc = sched.config, sched.allocator
    assert alloc.num_free_pages + alloc.num_used_pages == alloc.num_usable_pages
    assert len(sched.running) <= cfg.max_num_seqs
    owned = [p for r in sched.running for p in r.page_ids]
    assert len(owned) == len(set(owned)) == alloc.num_used_pages
    assert 0 not in owned and all(alloc.ref_count(p) == 1 for p in owned)
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert len(r.page_ids) == cdiv(r.num_computed_tokens, cfg.page_size)
        assert r.num_computed_tokens < r.num_tokens < cfg.max_model_len
    for r in sched.waiting:
        assert (r.status, r.num_computed_tokens, r.page_ids) == (RequestStatus.WAITING, 0, [])
    everyone = [r.request_id for r in sched.running] + [r.request_id for r in sched.waiting]
    assert sorted(everyone, key=order.get) == everyone  # running, then waiting, by arrival
    assert set(everyone) == set(sched.requests)


def check_plan(sched: Scheduler, out: SchedulerOutput) -> None:
    cfg = sched.config
    assert len(out.scheduled) <= cfg.max_num_seqs
    assert out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len({id(s.request) for s in out.scheduled}) == len(out.scheduled)
    for s in out.scheduled:
        r, end = s.request, s.start + s.num_new_tokens
        assert s.num_new_tokens >= 1 and s.start == r.num_computed_tokens
        assert s.token_ids == r.all_token_ids[s.start:end]
        assert s.samples == (end == r.num_tokens)
        assert s.page_ids == r.page_ids and len(r.page_ids) == cdiv(end, cfg.page_size)
    for r in out.preempted:
        assert r in sched.waiting and r not in [s.request for s in out.scheduled]


def check_finished(req: Request, max_model_len: int) -> None:
    last = req.output_token_ids[-1] if req.output_token_ids else None
    if req.finish_reason == "stop":
        assert last in req.sampling_params.stop_token_ids or (
            last in req.eos_token_ids and not req.sampling_params.ignore_eos)
    elif req.finish_reason == "length":
        assert req.num_output_tokens == req.max_tokens or req.num_tokens == max_model_len
    assert req.page_ids == []


@pytest.mark.parametrize("seed", range(6))
def test_randomized_operations_keep_the_books_straight(seed):
    rng = random.Random(seed)
    page_size = rng.choice([1, 2, 4, 8])
    cfg = SchedulerConfig(max_num_seqs=rng.choice([2, 4, 8]),
                          max_num_batched_tokens=rng.choice([8, 16, 40]), max_model_len=48,
                          page_size=page_size, num_pages=1 + 64 // page_size,
                          long_prefill_token_threshold=rng.choice([0, 0, 5]))
    sched = Scheduler(cfg)
    order, expected, finished = {}, {}, 0

    def random_step():
        nonlocal finished
        out = sched.schedule()
        check_plan(sched, out)
        sampled = [rng.randrange(50) if s.samples else None for s in out.scheduled]
        if out.scheduled and rng.random() < 0.05:
            sched.abort(rng.choice(out.scheduled).request.request_id)
        live = {id(s.request) for s in out.scheduled if not s.request.is_finished}
        changed = sched.update(out, sampled)
        for s, tok in zip(out.scheduled, sampled):
            if s.samples and id(s.request) in live:
                expected[s.request.request_id].append(tok)
        for r in changed:
            assert r.output_token_ids == expected[r.request_id]
            if r.is_finished:
                check_finished(r, cfg.max_model_len)
                finished += 1
        check_invariants(sched, order)

    for i in range(3000):
        op = rng.random()
        if op < 0.25:
            req = Request(f"r{i}", [rng.randrange(3, 50) for _ in range(rng.randint(1, 40))],
                          SamplingParams(max_tokens=rng.choice([None, 1, 5, 20]),
                                         stop_token_ids=rng.choice([[], [1]]),
                                         ignore_eos=rng.random() < 0.2),
                          eos_token_ids=frozenset({0}))
            sched.add_request(req)
            order[req.request_id], expected[req.request_id] = i, []
        elif op < 0.3 and sched.requests:
            sched.abort(rng.choice(sorted(sched.requests)))
            check_invariants(sched, order)
        else:
            random_step()

    for _ in range(10_000):  # every request finishes: no livelock
        if not sched.has_unfinished:
            break
        random_step()
    assert not sched.has_unfinished and sched.requests == {}
    assert sched.allocator.num_free_pages == sched.allocator.num_usable_pages
    assert all(sched.allocator.ref_count(p) == 0 for p in range(cfg.num_pages))
    assert finished > 100 and sched.num_preemptions_total > 0  # the run exercised both
