"""prepare(): hand-made SchedulerOutputs -> the padded arrays a step sends to the device."""
import random

import numpy as np
import pytest

from serving.core.buckets import Buckets
from serving.engine.input_prep import (SINK_SLOT, all_step_shapes, history_shape, padding_step,
                                      prepare, step_shape)
from serving.core.request import PLACEHOLDER_TOKEN, Request
from serving.core.sampling_params import SamplingParams
from serving.core.scheduler import ScheduledRequest, SchedulerOutput

PAGE = 4
MAX_SEQS = 8
BUCKETS = Buckets.derive(MAX_SEQS, 32, 64, PAGE, tokens=(8, 16, 32), requests=(2, 4, 8),
                         pages=(4, 8, 16))


def scheduled(prompt, outputs, start, n, pages, params=None, seed=0):
    req = Request(f"r{random.random()}", prompt, params or SamplingParams(temperature=0), seed=seed)
    req.output_token_ids = list(outputs)
    req.num_computed_tokens = start
    return ScheduledRequest(req, n, start, req.slice_token_ids(start, start + n),
                            start + n == req.num_tokens, list(pages))


def mixed_step():
    """A first prefill chunk, a decode and a last prefill chunk, on scattered pages."""
    a = scheduled(list(range(100, 110)), [], 0, 6, [3, 7])  # 6 of 10 prompt tokens
    b = scheduled([5, 6, 7, 8, 9], [50, 51], 6, 1, [5, 2],  # decode at position 6
                  SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7), seed=7)
    c = scheduled(list(range(200, 209)), [], 4, 5, [9, 1, 4],  # prompt tokens 4..8 of 9
                  SamplingParams(repetition_penalty=1.2, logit_bias={11: 3.0}, logprobs=2))
    return SchedulerOutput([a, b, c])


def test_tokens_still_on_the_device_name_the_rows_that_sample_them():
    """Async scheduling: a decode whose input is the last step's placeholder takes that
    step's row; the host writes 0 in its place and the program substitutes the token."""
    a = scheduled([5, 6, 7], [PLACEHOLDER_TOKEN], 3, 1, [2])
    b = scheduled(list(range(100, 110)), [], 4, 6, [3, 7, 8])  # a prefill chunk: all known
    c = scheduled([9, 8], [40, PLACEHOLDER_TOKEN], 3, 1, [6])
    out = SchedulerOutput([a, b, c])
    prev = {a.request.request_id: 5, c.request.request_id: 0}
    arr = prepare(out, BUCKETS, PAGE, MAX_SEQS, prev_rows=prev)
    assert arr.batch["prev_rows"][:8].tolist() == [5, -1, -1, -1, -1, -1, -1, 0]
    assert arr.batch["input_ids"][:8].tolist() == [0, 104, 105, 106, 107, 108, 109, 0]
    with pytest.raises(ValueError, match="needs the rows"):
        prepare(SchedulerOutput([scheduled([5, 6, 7], [PLACEHOLDER_TOKEN], 3, 1, [2])]),
                BUCKETS, PAGE, MAX_SEQS)
    with pytest.raises(ValueError, match="no row in the previous step"):
        prepare(SchedulerOutput([scheduled([5, 6, 7], [PLACEHOLDER_TOKEN], 3, 1, [2])]),
                BUCKETS, PAGE, MAX_SEQS, prev_rows={})


def test_mixed_prefill_and_decode_arrays():
    out = mixed_step()
    arr = prepare(out, BUCKETS, PAGE, MAX_SEQS)
    T, R, P = arr.shape
    # 12 tokens pad to 16; the request count follows the token bucket (min(16, 8) -> 8);
    # the widest table (3 pages) pads to 4.
    assert arr.shape == (16, 8, 4)
    b = arr.batch
    assert {k: v.shape for k, v in b.items()} == {
        "input_ids": (T,), "positions": (T,), "slot_mapping": (T,), "req_indices": (T,),
        "page_table": (R, P), "logits_indices": (R,), "draft_ids": (R,), "row_start": (R,),
        "prev_rows": (T,)}
    assert all(v.dtype == np.int32 for v in b.values())
    assert (b["prev_rows"] == -1).all()  # every input token is on the host
    assert b["input_ids"].tolist() == [100, 101, 102, 103, 104, 105, 51, 204, 205, 206, 207, 208,
                                       0, 0, 0, 0]
    assert b["positions"].tolist() == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8, 0, 0, 0, 0]
    # slot = page * PAGE + offset: a on pages 3, 7; b's position 6 on page 2; c's 4..7 on page 1
    # and 8 on page 4. Padding writes to the sink slot.
    assert b["slot_mapping"].tolist() == [12, 13, 14, 15, 28, 29, 10, 4, 5, 6, 7, 16,
                                          SINK_SLOT, SINK_SLOT, SINK_SLOT, SINK_SLOT]
    assert SINK_SLOT // PAGE == 0  # the sink page, never handed out
    assert b["req_indices"].tolist() == [0] * 6 + [1] + [2] * 5 + [R - 1] * 4
    assert b["page_table"].tolist() == [[3, 7, 0, 0], [5, 2, 0, 0], [9, 1, 4, 0]] + [[0] * 4] * 5
    assert b["logits_indices"].tolist() == [5, 6, 11, 0, 0, 0, 0, 0]
    assert b["draft_ids"].tolist() == [-1] * R  # nothing to verify
    assert b["row_start"].tolist() == list(range(R))
    assert arr.wants_logprobs


def test_mixed_step_sampling_arrays():
    arr = prepare(mixed_step(), BUCKETS, PAGE, MAX_SEQS)
    s = arr.sampling
    R, S = 8, 4 * PAGE
    np.testing.assert_allclose(s["temperature"], [0, 0.8, 1.0] + [0] * 5)
    assert s["top_k"].tolist() == [0, 50, 0] + [0] * 5
    np.testing.assert_allclose(s["top_p"], [1, 0.9, 1] + [1] * 5)
    assert s["seed"].tolist() == [0, 7, 0] + [0] * 5
    assert s["output_index"].tolist() == [0, 2, 0] + [0] * 5  # b samples its third output
    assert s["num_prompt"].tolist() == [10, 5, 9] + [0] * 5
    np.testing.assert_allclose(s["repetition_penalty"], [1, 1, 1.2] + [1] * 5)
    # Only c is penalised: its history is prompt + outputs, -1 padded to pages x page size.
    assert arr.history.shape == (R, S) == history_shape(arr.shape, PAGE)
    assert arr.history[2].tolist() == list(range(200, 209)) + [-1] * (S - 9)
    assert (arr.history[[0, 1, 3]] == -1).all()
    assert s["bias_ids"][2, 0] == 11 and s["bias_values"][2, 0] == 3.0
    assert (s["bias_ids"][[0, 1]] == -1).all()
    assert bool(s["any_penalty"]) and bool(s["any_bias"]) and bool(s["any_logprobs"])
    assert bool(s["any_filter"]) and bool(s["any_random"])


def signature(arr):
    """What decides which compiled program runs: the shape and dtype of every array."""
    return {group: {k: (np.shape(v), np.asarray(v).dtype) for k, v in getattr(arr, group).items()}
            for group in ("batch", "sampling")}


def test_plain_greedy_step_sends_placeholders_of_the_same_shape():
    plain = SchedulerOutput([scheduled([1, 2, 3], [4], 3, 1, [6]) for _ in range(3)])
    arr = prepare(plain, BUCKETS, PAGE, MAX_SEQS)
    assert arr.shape == (8, 8, 4)
    s = arr.sampling
    assert arr.history is None  # the runner's device-resident -1 array stands in
    assert (s["bias_ids"] == -1).all()
    assert not any(bool(s[k]) for k in ("any_penalty", "any_bias", "any_filter", "any_random",
                                        "any_logprobs"))
    assert not arr.wants_logprobs
    assert arr.batch["logits_indices"].tolist() == [0, 1, 2, 0, 0, 0, 0, 0]
    assert arr.batch["slot_mapping"].tolist() == [6 * PAGE + 3] * 3 + [SINK_SLOT] * 5
    # A penalised, biased step of the same bucket sends arrays of the same shapes.
    fancy = SchedulerOutput([scheduled([1, 2, 3], [4], 3, 1, [6], SamplingParams(
        frequency_penalty=0.5, logit_bias={1: 1.0}, logprobs=1, temperature=0.5, top_k=3))])
    assert signature(prepare(fancy, BUCKETS, PAGE, MAX_SEQS)) == signature(arr)


def test_padding_step_matches_real_steps_and_writes_only_the_sink():
    for step in (mixed_step(), SchedulerOutput([scheduled([1, 2, 3], [4], 3, 1, [6])])):
        real = prepare(step, BUCKETS, PAGE, MAX_SEQS)
        pad = padding_step(real.shape)
        assert pad.shape == real.shape
        assert signature(pad) == signature(real)
        assert (pad.batch["slot_mapping"] == SINK_SLOT).all()
        assert (pad.sampling["temperature"] == 0).all()


def test_every_possible_step_pads_to_a_compiled_shape():
    """Random legal steps (within the token budget, max_num_seqs and max_model_len) always
    land on one of all_step_shapes, the set warm-up compiles."""
    shapes = set(all_step_shapes(BUCKETS, MAX_SEQS))
    rng = random.Random(0)
    seen = set()
    for _ in range(500):
        budget = rng.randint(1, 32)
        reqs = []
        while budget and len(reqs) < MAX_SEQS:
            n = rng.randint(1, budget)
            total = rng.randint(n, 63)  # tokens after this step, below max_model_len 64
            start = total - n
            pages = list(range(1, -(-total // PAGE) + 1))
            reqs.append(scheduled([7] * max(total, 1), [], start, n, pages))
            budget -= n
        arr = prepare(SchedulerOutput(reqs), BUCKETS, PAGE, MAX_SEQS)
        assert arr.shape in shapes
        seen.add(arr.shape)
        n_tok = sum(r.num_new_tokens for r in reqs)
        assert (arr.batch["slot_mapping"][n_tok:] == SINK_SLOT).all()
        assert (arr.batch["slot_mapping"][:n_tok] >= PAGE).all()  # real tokens never hit the sink
    assert seen == shapes  # and the random steps reach all of them


def test_step_shape_rules():
    assert step_shape(BUCKETS, 1, 1, MAX_SEQS) == (8, 8, 4)
    assert step_shape(BUCKETS, 9, 5, MAX_SEQS) == (16, 8, 8)
    assert step_shape(BUCKETS, 32, 16, MAX_SEQS) == (32, 8, 16)
    one_seq = Buckets.derive(1, 32, 64, PAGE, tokens=(8, 32), requests=(1,), pages=(16,))
    assert step_shape(one_seq, 20, 3, 1) == (32, 1, 16)
    with pytest.raises(ValueError):
        step_shape(BUCKETS, 33, 1, MAX_SEQS)


def test_a_verifying_request_samples_a_row_per_proposed_token_and_one_more():
    a = scheduled(list(range(100, 110)), [], 0, 10, [3, 7, 8])  # a whole prompt
    b = scheduled([5, 6, 7, 8, 9], [50, 51], 6, 1, [5, 2, 6],  # decode at 6, verifying 3
                  SamplingParams(temperature=0.8, seed=7, repetition_penalty=1.1), seed=7)
    b.spec_token_ids = [60, 61, 62]
    b.token_ids = b.token_ids + b.spec_token_ids
    b.num_new_tokens = 4
    c = scheduled([1, 2, 3], [4], 3, 1, [9])
    arr = prepare(SchedulerOutput([a, b, c]), BUCKETS, PAGE, MAX_SEQS)
    assert arr.shape[:2] == (16, 8) and arr.first_rows == [0, 1, 5]
    bt, sm = arr.batch, arr.sampling
    assert bt["input_ids"][:15].tolist() == list(range(100, 110)) + [51, 60, 61, 62, 4]
    assert bt["positions"][10:14].tolist() == [6, 7, 8, 9]
    assert bt["slot_mapping"][10:14].tolist() == [2 * PAGE + 2, 2 * PAGE + 3, 6 * PAGE,
                                                   6 * PAGE + 1]
    assert bt["logits_indices"][:6].tolist() == [9, 10, 11, 12, 13, 14]
    assert bt["draft_ids"][:6].tolist() == [-1, 60, 61, 62, -1, -1]
    assert bt["row_start"][:6].tolist() == [0, 1, 1, 1, 1, 5]
    # Each row is its output position: seed, index and (penalties) the guesses before it.
    assert sm["output_index"][:6].tolist() == [0, 2, 3, 4, 5, 1]
    assert sm["seed"][:6].tolist() == [0, 7, 7, 7, 7, 0]
    assert sm["temperature"][:6].tolist() == pytest.approx([0, 0.8, 0.8, 0.8, 0.8, 0])
    tokens = [5, 6, 7, 8, 9, 50, 51]
    for j in range(4):
        row = arr.history[1 + j]
        assert row[row >= 0].tolist() == tokens + [60, 61, 62][:j]


def test_more_sampled_rows_than_the_step_has_is_an_error():
    b = scheduled([5, 6, 7, 8, 9], [50, 51], 6, 1, [5, 2, 6])
    b.spec_token_ids = list(range(60, 69))
    b.token_ids += b.spec_token_ids
    b.num_new_tokens = 10
    with pytest.raises(ValueError, match="sampled rows"):
        prepare(SchedulerOutput([b]), BUCKETS, PAGE, MAX_SEQS)


def one_by_one(sched, shape, page_size):
    """The token and row arrays written request by request over a padding step's: what
    prepare's whole-array build must equal."""
    want = padding_step(shape).batch  # all padding, then each request's entries
    t = r = 0
    for i, s in enumerate(sched):
        n, k = s.num_new_tokens, len(s.spec_token_ids)
        want["page_table"][i, :len(s.page_ids)] = s.page_ids
        for j in range(n):
            pos = s.start + j
            want["input_ids"][t + j] = s.token_ids[j]
            want["positions"][t + j] = pos
            page = s.page_ids[pos // page_size]
            want["slot_mapping"][t + j] = page * page_size + pos % page_size
            want["req_indices"][t + j] = i
        for j in range(k + 1):
            want["logits_indices"][r + j] = t + n - 1 - k + j
            want["row_start"][r + j] = r
            if j < k:
                want["draft_ids"][r + j] = s.spec_token_ids[j]
        t, r = t + n, r + k + 1
    return want


@pytest.mark.parametrize("seed", range(20))
def test_random_steps_equal_the_request_by_request_arrays(seed):
    """Prefill chunks, decodes and verifying rows in any mix, on random pages."""
    rng = random.Random(seed)
    sched, tokens, rows = [], 0, 0
    while True:
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 20))]
        outputs = [rng.randrange(3, 500) for _ in range(rng.choice([0, 0, rng.randint(1, 9)]))]
        total = len(prompt) + len(outputs)
        start = rng.randrange(total)
        n = total - start if rng.random() < 0.5 else rng.randint(1, total - start)
        spec = ([rng.randrange(3, 500) for _ in range(rng.randint(1, 3))]
                if outputs and start + n == total and rng.random() < 0.3 else [])
        if tokens + n + len(spec) > 32 or rows + 1 + len(spec) > MAX_SEQS:
            break
        pages = rng.sample(range(1, 64), -(-(total + len(spec)) // PAGE))
        s = scheduled(prompt, outputs, start, n, pages)
        s.spec_token_ids = spec
        s.token_ids = s.token_ids + spec
        s.num_new_tokens = n + len(spec)
        sched.append(s)
        tokens, rows = tokens + n + len(spec), rows + 1 + len(spec)
    arr = prepare(SchedulerOutput(sched), BUCKETS, PAGE, MAX_SEQS)
    want = one_by_one(sched, arr.shape, PAGE)
    assert arr.batch.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(arr.batch[name], value, err_msg=name)
        assert arr.batch[name].dtype == value.dtype, name


def sampling_one_by_one(sched, R):
    """Each row's sampling values read from its request, and the flags from the params:
    what the table of requests' fixed rows must give."""
    rows = [(s, j) for s in sched for j in range(s.num_rows)]
    params = [s.request.sampling_params for s, _ in rows]
    pad = R - len(rows)
    want = {name: np.array([getattr(p, name) for p in params] + [fill] * pad, dtype)
            for name, dtype, fill in (
                ("temperature", np.float32, 0.0), ("top_k", np.int32, 0),
                ("top_p", np.float32, 1.0), ("min_p", np.float32, 0.0),
                ("repetition_penalty", np.float32, 1.0), ("presence_penalty", np.float32, 0.0),
                ("frequency_penalty", np.float32, 0.0))}
    want["seed"] = np.array([s.request.seed for s, _ in rows] + [0] * pad, np.uint32)
    want["num_prompt"] = np.array([s.request.num_prompt_tokens for s, _ in rows] + [0] * pad,
                                  np.int32)
    want["output_index"] = np.array(
        [s.request.num_output_tokens + j for s, j in rows] + [0] * pad, np.int32)
    flags = dict(any_penalty=any(p.uses_penalties for p in params),
                 any_bias=any(p.logit_bias for p in params),
                 any_filter=any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0
                                for p in params if not p.greedy),
                 any_random=any(not p.greedy for p in params),
                 any_logprobs=any(p.logprobs is not None for p in params))
    return want, flags


@pytest.mark.parametrize("seed", range(10))
def test_random_sampling_params_equal_the_row_by_row_values(seed):
    rng = random.Random(seed)
    sched = []
    for i in range(rng.randint(1, MAX_SEQS)):
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.0, 0.7, 1.3]), top_k=rng.choice([0, 0, 5]),
            top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.0, 1.1]),
            presence_penalty=rng.choice([0.0, 0.0, 0.5]),
            frequency_penalty=rng.choice([0.0, 0.0, -0.3]),
            logit_bias=rng.choice([None, None, {3: 1.5}]),
            logprobs=rng.choice([None, None, 2]), seed=rng.randrange(2**32))
        prompt = [rng.randrange(3, 500) for _ in range(rng.randint(1, 9))]
        outputs = [rng.randrange(3, 500) for _ in range(rng.randint(0, 5))]
        total = len(prompt) + len(outputs)
        sched.append(scheduled(prompt, outputs, total - 1, 1, [1 + i, 20 + i], params,
                               seed=params.seed))
    arr = prepare(SchedulerOutput(sched), BUCKETS, PAGE, MAX_SEQS)
    want, flags = sampling_one_by_one(sched, arr.shape[1])
    for name, value in want.items():
        np.testing.assert_array_equal(arr.sampling[name], value, err_msg=name)
        assert arr.sampling[name].dtype == value.dtype, name
    for name, value in flags.items():
        assert bool(arr.sampling[name]) == value, name
