"""Async scheduling (serving/engine/step_ahead.py; docs/architecture.md, "A request's path"):
with `async_scheduling` each step is scheduled and launched while the previous one runs,
and every result is the same as without it: tokens, logprobs, finish reasons, stop strings,
under chunked prefill, preemption, prefix caching, n > 1 and aborts; steps with grammars or
penalties wait for their tokens. On a tiny random model with the default buckets."""
from __future__ import annotations

import random

import pytest

from model.config import ModelConfig
from model.kv_cache import bytes_per_page
from serving import LLM, SamplingParams
from serving.core.request import PLACEHOLDER_TOKEN
from serving.core.structured_outputs import StructuredOutputsParams
from tests.test_engine import random_prompts, run_streams, tiny_model  # noqa: F401

OPTIONS = dict(max_num_seqs=8, max_model_len=96, max_num_batched_tokens=32, page_size=4,
               progress=False)


@pytest.fixture(scope="module")
def engines(tiny_model):  # noqa: F811
    folder = str(tiny_model[1])
    return LLM(folder, async_scheduling=False, **OPTIONS), LLM(folder, **OPTIONS)


def watch_ahead(llm: LLM) -> list:
    """Records the step outputs applied ahead."""
    sched, seen = llm.engine.scheduler, []
    update_ahead = sched.update_ahead

    def watched(out):
        seen.append(out)
        return update_ahead(out)
    sched.update_ahead = watched
    return seen


def results(llm: LLM, prompts, params):
    return [(r.token_ids, r.finish_reason, r.outputs[0].stop_reason, r.text,
             [(lp.token_id, lp.logprob, lp.top) for lp in r.logprobs or []])
            for r in llm.generate(prompts, params)]


def mixed_params(rng: random.Random, n: int) -> list[SamplingParams]:
    """Greedy and seeded rows, logprobs, EOS left on, stop token ids, short and long."""
    out = []
    for i in range(n):
        extra = dict(max_tokens=rng.randrange(1, 40), logprobs=rng.choice([None, 3]))
        if i % 3 == 0:
            extra["stop_token_ids"] = [rng.randrange(3, 211) for _ in range(5)]
        if i % 2:
            out.append(SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, **extra))
        else:
            out.append(SamplingParams(temperature=0, ignore_eos=i % 4 == 0, **extra))
    return out


def test_mixed_batches_give_the_same_results(engines):
    sync, ahead = engines
    rng = random.Random(7)
    prompts = random_prompts(rng, [rng.randrange(1, 50) for _ in range(14)])
    params = mixed_params(rng, 14)
    seen = watch_ahead(ahead)
    assert results(ahead, prompts, params) == results(sync, prompts, params)
    assert len(seen) > 10  # most steps ran ahead
    engine = ahead.engine
    assert engine._flight is None and not engine.has_unfinished
    assert engine.scheduler.allocator.num_used_pages == 0


def test_placeholders_never_reach_the_outputs(engines):
    _, ahead = engines
    prompts = random_prompts(random.Random(3), [5, 17, 30])
    streamed = []
    engine = ahead.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}", p, SamplingParams(temperature=0, max_tokens=20))
    while engine.has_unfinished:
        for out in engine.step():
            streamed += out.new_token_ids
    assert streamed and PLACEHOLDER_TOKEN not in streamed


def test_stop_strings_settle_one_step_late_without_extra_tokens(engines):
    sync, ahead = engines
    prompts = random_prompts(random.Random(4), [6, 12, 25])
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    texts = [r.text for r in sync.generate(prompts, base)]
    # A stop string from the middle of each greedy answer: the text ends before it.
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                             stop=[t[len(t) // 2:len(t) // 2 + 2]]) for t in texts]
    assert results(ahead, prompts, params) == results(sync, prompts, params)


def test_preemption_and_prefix_hits_keep_the_tokens(tiny_model):  # noqa: F811
    folder = str(tiny_model[1])
    cfg = ModelConfig.from_dir(folder)
    memory = 14 * bytes_per_page(cfg, 4)  # few pages: a batch of long requests preempts
    sync = LLM(folder, kv_cache_memory=memory, async_scheduling=False, **OPTIONS)
    ahead = LLM(folder, kv_cache_memory=memory, **OPTIONS)
    rng = random.Random(5)
    shared = random_prompts(rng, [16])[0]
    prompts = [shared + p for p in random_prompts(rng, [3, 9, 1, 6, 12, 4])]
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=30, ignore_eos=True)
              for i in range(len(prompts))]
    assert results(ahead, prompts, params) == results(sync, prompts, params)
    assert ahead.engine.scheduler.num_preemptions_total > 0
    assert ahead.engine.scheduler.kv_cache_manager.prefix_cache_hits > 0
    assert ahead.engine.scheduler.allocator.num_used_pages == 0


def test_n_samples_and_an_abort(engines):
    sync, ahead = engines
    prompt = random_prompts(random.Random(6), [9])[0]
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=15, ignore_eos=True)
    assert ([o.token_ids for o in ahead.generate([prompt], params)[0].outputs]
            == [o.token_ids for o in sync.generate([prompt], params)[0].outputs])
    engine = ahead.engine
    engine.add_request("stays", prompt, SamplingParams(temperature=0, max_tokens=12))
    engine.add_request("goes", prompt, SamplingParams(temperature=0, max_tokens=30))
    got = {"stays": [], "goes": []}
    for _ in range(3):
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    engine.abort("goes")
    before = list(got["goes"])
    while engine.has_unfinished:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert got["goes"] == before  # nothing after the abort
    [alone] = sync.generate([prompt], SamplingParams(temperature=0, max_tokens=12))
    assert got["stays"] == alone.token_ids
    assert engine.scheduler.allocator.num_used_pages == 0


def test_grammars_and_penalties_wait_for_their_tokens(engines):
    sync, ahead = engines
    prompts = random_prompts(random.Random(8), [4, 10, 7, 3])
    params = [SamplingParams(temperature=0, max_tokens=25),
              SamplingParams(temperature=0, max_tokens=10, repetition_penalty=1.3,
                             presence_penalty=0.5),
              SamplingParams(temperature=0.5, seed=3, max_tokens=25),
              SamplingParams(temperature=0, max_tokens=10, structured_outputs=
                             StructuredOutputsParams(choice=["yes", "no", "maybe"]))]
    seen = watch_ahead(ahead)
    assert results(ahead, prompts, params) == results(sync, prompts, params)
    waits = [p for p in params if p.uses_penalties or p.structured_outputs is not None]
    for out in seen:  # no step with either ran ahead
        assert not any(s.request.sampling_params in waits for s in out.scheduled)
    assert seen  # the others' steps did, once those ended


def test_streams_through_the_async_engine_match_offline(engines):
    """The server's path: AsyncEngine over an engine that runs ahead streams what the
    offline engine without it gives; a stream closed early aborts its request."""
    sync, ahead = engines
    prompts = random_prompts(random.Random(9), [4, 30, 9, 45, 2])
    params = [SamplingParams(temperature=0, max_tokens=10 + i, logprobs=2 if i == 2 else None)
              for i in range(len(prompts))]
    offline = sync.generate(prompts, params)
    early, streams, after = run_streams(ahead.engine, prompts, params)
    for outs, want in zip(streams, offline):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert sum((o.new_token_ids for o in outs), []) == want.token_ids
        assert "".join(o.new_text for o in outs) == want.text
    assert ([lp.logprob for o in streams[2] for lp in o.new_logprobs]
            == [lp.logprob for lp in offline[2].logprobs])
    assert len(early) == 2 and not early[-1].finished
    assert after[-1].finished and sum(len(o.new_token_ids) for o in after) == 3
    engine = ahead.engine
    assert engine.scheduler.get_request("early") is None
    assert engine.scheduler.allocator.num_used_pages == 0 and not engine.has_unfinished


def test_the_scheduler_settles_stops_one_step_late():
    """Host side alone: EOS on the token that also reaches max_tokens ends with "stop";
    EOS found late ends a request that was scheduled again, whose next step is then
    skipped; a stop token ends it with its id."""
    from serving.core.request import Request, RequestStatus
    from serving.core.scheduler import Scheduler, SchedulerConfig
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16,
                                      max_model_len=64, page_size=4, num_pages=40))
    last = Request("last", [5, 6, 7], SamplingParams(temperature=0, max_tokens=1),
                   eos_token_ids=[2])
    eos = Request("eos", [5, 6], SamplingParams(temperature=0, max_tokens=9),
                  eos_token_ids=[2])
    stop = Request("stop", [8], SamplingParams(temperature=0, max_tokens=9,
                                              stop_token_ids=[77]), eos_token_ids=[2])
    for r in (last, eos, stop):
        sched.add_request(r)
    first = sched.schedule()
    ahead = sched.update_ahead(first)
    assert [r.output_token_ids for r in (last, eos, stop)] == [[PLACEHOLDER_TOKEN]] * 3
    assert last.status is RequestStatus.FINISHED_LENGTH  # max_tokens needs no token
    second = sched.schedule()  # eos and stop run on, their first tokens unknown
    assert {s.request.request_id for s in second.scheduled} == {"eos", "stop"}
    assert sched.resolve(ahead, [2, 2, 77]) == [last, eos, stop]
    assert (last.finish_reason, eos.finish_reason, stop.finish_reason) == ("stop",) * 3
    assert (eos.stop_reason, stop.stop_reason) == (None, 77)
    assert sched.update_ahead(second) == []  # both ended: the step is skipped
    assert [r.output_token_ids for r in (last, eos, stop)] == [[2], [2], [77]]
    assert sched.allocator.num_used_pages == 0 and not sched.has_unfinished
