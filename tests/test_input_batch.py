"""InputBatch (serving/engine/input_batch.py): a decode step built from the last step's
arrays equals input_prep.prepare's arrays for the same step, under a real scheduler driven
step by step (with and without async scheduling's placeholders), through preemption, prefix
hits, sliding windows, a hybrid model's two tables, aborts, LoRA slots and every sampling
option; and the arrays of a step already built are never written. No JAX."""
from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from serving.core.buckets import Buckets
from serving.core.request import Request
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import Scheduler, SchedulerConfig
from serving.engine.input_batch import InputBatch
from serving.engine.input_prep import StepArrays, prepare

PAGE, MAX_SEQS, BUDGET, MAX_LEN, WIDTH = 4, 6, 32, 96, 16
BUCKETS = Buckets.derive(MAX_SEQS, BUDGET, MAX_LEN, PAGE)
EOS = 2

CONFIGS = {
    "plain": dict(num_pages=200),
    "preempting": dict(num_pages=22, enable_prefix_caching=True),
    "sliding window": dict(num_pages=60, sliding_window=9),
    "hybrid": dict(num_pages=120, window_group=8, window_num_pages=40),
}


def assert_same(got: StepArrays, want: StepArrays) -> None:
    assert got.shape == want.shape and got.wants_logprobs == want.wants_logprobs
    assert got.first_rows == want.first_rows
    for group in ("batch", "sampling"):
        a, b = getattr(got, group), getattr(want, group)
        assert a.keys() == b.keys(), group
        for name in b:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)
            assert np.asarray(a[name]).dtype == np.asarray(b[name]).dtype, name
    for name in ("history", "bitmask", "prompt_targets", "pooling_rows"):
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if b is not None:
            np.testing.assert_array_equal(a, b, err_msg=name)


def random_params(rng: random.Random) -> SamplingParams:
    extra = rng.choice([
        {}, {}, {}, {}, {}, {}, {}, dict(temperature=0.8, top_p=0.9, seed=rng.randrange(99)),
        dict(logprobs=2), dict(logit_bias={5: 1.5}), dict(presence_penalty=0.5),
        dict(min_tokens=rng.randint(1, 6)), dict(prompt_logprobs=1),
        dict(stop_token_ids=[rng.randrange(3, 40)])])
    return SamplingParams(**{"temperature": 0.0, "max_tokens": rng.randint(1, 50), **extra})


def token(rng: random.Random) -> int:
    return EOS if rng.random() < 0.04 else rng.randrange(3, 40)


def drive(config: str, ahead: bool, seed: int) -> InputBatch:
    """Runs random requests to their ends as the engine does, comparing every step."""
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(MAX_SEQS, BUDGET, MAX_LEN, PAGE, **CONFIGS[config]))
    batch = InputBatch(BUCKETS, PAGE, MAX_SEQS, WIDTH)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randint(1, 30))] for _ in range(5)]
    for i in range(14):  # some share a prompt: prefix hits
        prompt = rng.choice(prompts) if rng.random() < 0.4 else [
            rng.randrange(3, 400) for _ in range(rng.randint(1, 30))]
        sched.add_request(Request(f"r{i}", prompt, random_params(rng),
                                  eos_token_ids=frozenset({EOS})))
    slot_of = {f"r{i}": rng.choice([-1, 0, 1]) for i in range(14)}
    flight, last = None, None  # (placeholders, rows) of a step applied ahead
    while sched.has_unfinished or flight:
        out = sched.schedule()
        if out.scheduled:
            slots = [slot_of[s.request.request_id] for s in out.scheduled]
            rows = flight[1] if flight else None
            if last is not None:
                kept = copy.deepcopy(last)
            got = batch.prepare(out, slots, rows)
            assert_same(got, prepare(out, BUCKETS, PAGE, MAX_SEQS, WIDTH, None, slots, rows))
            if last is not None:
                assert_same(last, kept)  # the step before is as it was built
            last = got
        if flight:  # the last step's tokens reach the host
            sched.resolve(flight[0], [token(rng) for _ in flight[0]])
            flight = None
        if not out.scheduled:
            continue
        if rng.random() < 0.03:
            sched.abort(rng.choice(out.scheduled).request.request_id)
        if ahead and not any(s.request.sampling_params.uses_penalties for s in out.scheduled):
            rows = {s.request.request_id: r for s, r in zip(out.scheduled, got.first_rows)}
            flight = (sched.update_ahead(out), rows)
        else:
            sched.update(out, [token(rng) if s.samples else None
                               for s in out.scheduled])
    return batch


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("ahead", [False, True], ids=["sync", "ahead"])
def test_decode_steps_from_the_last_step_equal_whole_ones(config, ahead):
    reused = sum(drive(config, ahead, seed).reused for seed in range(6))
    assert reused > 50  # most decode steps were built from the last one


def test_a_new_page_is_written_into_the_kept_table_and_a_new_request_builds_whole():
    sched = Scheduler(SchedulerConfig(MAX_SEQS, BUDGET, MAX_LEN, PAGE, num_pages=100))
    batch = InputBatch(BUCKETS, PAGE, MAX_SEQS, WIDTH)
    for i in range(2):  # 10 prompt tokens: 3 pages, the fourth from position 12
        sched.add_request(Request(f"r{i}", [5] * 10, SamplingParams(max_tokens=8,
                                                                    ignore_eos=True)))
    log = []
    while sched.has_unfinished:
        out = sched.schedule()
        reused = batch.reused
        arrays = batch.prepare(out)
        assert_same(arrays, prepare(out, BUCKETS, PAGE, MAX_SEQS, WIDTH))
        pages = (arrays.batch["page_table"][:2] > 0).sum(axis=1).tolist()
        log.append((batch.reused > reused, pages))
        if len(log) == 4:
            sched.add_request(Request("r2", [6] * 9, SamplingParams(max_tokens=2)))
        sched.update(out, [7 if s.samples else None for s in out.scheduled])
    # The prefill and the first decode (nothing kept yet) whole, then decodes from the last
    # step, the fourth page written into the kept table. Whole again: the step r2 joins (a
    # prefill), the first with all three decoding, and the first after r2 ended.
    assert log == [(False, [3, 3]), (False, [3, 3]), (True, [3, 3]), (True, [4, 4]),
                   (False, [4, 4]), (False, [4, 4]), (False, [4, 4]), (False, [5, 5])]
