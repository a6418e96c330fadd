"""The engine end to end, on the demo model and on a tiny random model: continuous batching,
chunked prefill, preemption and seeds change no tokens; nothing compiles after warm-up; stop
conditions, logprobs, penalties, bias, abort, validation; the asyncio front end.

Engines are module-scoped (the demo one is shared with test_demo_generation) and have few
buckets, so a warm compilation cache makes this module fast."""
from __future__ import annotations

import asyncio
import contextlib
import random
import shutil

import jax
import numpy as np
import pytest
import torch
import transformers

from model.checkpoint import convert_hf
from model.kv_cache import bytes_per_page
from serving import LLM, SamplingParams
from serving.engine.async_engine import AsyncEngine
from tests.demo_engine import greedy
from tests.hf_tiny import tiny_hf_model

EOS = 2  # <|im_end|> in the demo tokenizer; the tiny models use the same id
TINY_FAMILY = "mistral"  # sliding window 7: chunks and decodes cross the window edge
TINY_OPTIONS = dict(max_num_seqs=16, max_model_len=96, max_num_batched_tokens=32, page_size=4,
                    token_buckets=(4, 16, 32), request_buckets=(4, 16), page_buckets=(8, 24),
                    progress=False)
# Few pages, so a batch of long requests runs out and preempts; one request alone fits.
# PREEMPT_PAGES is for full attention (a draft model keeps every page); the tiny model's
# window of 7 gives pages back as requests decode, so it holds about three pages a request
# and preempts with fewer: WINDOW_PREEMPT_PAGES, one more than the 11 a request may hold at
# once (core/kv_window.request_pages).
PREEMPT_PAGES = 20
WINDOW_PREEMPT_PAGES = 12
PREEMPT_OPTIONS = dict(max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32, page_size=4,
                       token_buckets=(8, 32), request_buckets=(8,), page_buckets=(16,),
                       progress=False)


# -- fixtures and helpers ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def torch_one_thread():
    # torch's spinning worker threads make it several times slower on a small shared CPU.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def demo(demo_llm):
    return demo_llm


@pytest.fixture(scope="module")
def demo_hf(demo_model_dir, torch_one_thread):
    return transformers.AutoModelForCausalLM.from_pretrained(demo_model_dir,
                                                             dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, demo_model_dir):
    """(transformers model, our checkpoint folder) of a tiny random model that borrows the demo
    tokenizer (ids below its vocab of 211 are bytes and short pieces)."""
    hf_dir = tmp_path_factory.mktemp("tiny-hf")
    model = tiny_hf_model(TINY_FAMILY, hf_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo_model_dir / name, hf_dir / name)
    ckpt = hf_dir.with_name(hf_dir.name + "-ckpt")  # beside its own numbered folder
    convert_hf(hf_dir, ckpt, "float32", progress=False)
    return model, ckpt


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return LLM(str(tiny_model[1]), **TINY_OPTIONS)


@pytest.fixture(scope="module")
def tiny_small_cache(tiny_model):
    from model.config import ModelConfig
    cfg = ModelConfig.from_dir(tiny_model[1])
    page = bytes_per_page(cfg, PREEMPT_OPTIONS["page_size"])
    return LLM(str(tiny_model[1]), kv_cache_memory=WINDOW_PREEMPT_PAGES * page,
               **PREEMPT_OPTIONS)


def alone(llm: LLM, prompts, params) -> list[list[int]]:
    """Each request run by itself."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [llm.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]


def demo_alone(demo, prompt: list[int], max_tokens: int) -> list[int]:
    return demo.generate([prompt], greedy(max_tokens))[0].token_ids


@contextlib.contextmanager
def recording(engine):
    """Records what every step scheduled, (start, new tokens, prompt length, samples) per
    request, and the bucket shape each dispatch ran in."""
    steps, shapes = [], []
    schedule, dispatch = engine.scheduler.schedule, engine.runner.dispatch

    def recording_schedule():
        out = schedule()
        steps.append([(s.start, s.num_new_tokens, s.request.num_prompt_tokens, s.samples)
                      for s in out.scheduled])
        return out

    def recording_dispatch(arrays):
        shapes.append(arrays.shape)
        return dispatch(arrays)

    engine.scheduler.schedule, engine.runner.dispatch = recording_schedule, recording_dispatch
    try:
        yield steps, shapes
    finally:
        del engine.scheduler.schedule, engine.runner.dispatch


def is_prefill(entry) -> bool:
    start, n, num_prompt, samples = entry
    return start < num_prompt


def assert_chunked_and_mixed(steps):
    chunked = [s for s in steps if any(is_prefill(e) and not e[3] for e in s)]
    mixed = [s for s in steps if any(is_prefill(e) for e in s) and any(not is_prefill(e) for e in s)]
    assert chunked, "no prompt was split into chunks"
    assert mixed, "no step mixed prefill and decode"
    assert max(len(s) for s in steps) > 4


def random_prompts(rng, lengths, vocab=211):
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


# -- (a) continuous batching changes nothing -----------------------------------------------------

DEMO_TEXTS = [
    "Hello", "The capital of France is", "def add(a, b):", "List three colors:",
    "In 1969, the first humans landed on the Moon. The mission was called Apollo 11 and the "
    "astronauts were Neil Armstrong, Buzz Aldrin and Michael Collins, who",
    "Water boils at", "My favourite fruit is", "import numpy as np\nx = np.",
    "Q: What is the largest planet in our solar system?\nA:", "Roses are red,",
    "The quick brown fox", "Translate to French: cheese =",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight "
    "to synthesize foods from carbon dioxide and water. In plants, it takes place mostly in the",
    "1, 2, 3, 4,", "Dear Sir or Madam,", "The recipe needs flour, sugar,",
]
DEMO_MAX_TOKENS = [5, 1, 8, 3, 6, 2, 7, 4, 8, 3, 5, 1, 6, 2, 7, 4]


def test_demo_batched_greedy_equals_each_alone(demo):
    prompts = [demo.tokenizer.encode(t) for t in DEMO_TEXTS]
    assert sum(len(p) > 32 for p in prompts) >= 2  # longer than the step budget: chunked
    with recording(demo.engine) as (steps, _):
        batched = demo.generate(prompts, [greedy(n) for n in DEMO_MAX_TOKENS])
    assert_chunked_and_mixed(steps)
    for p, n, got in zip(prompts, DEMO_MAX_TOKENS, batched):
        assert len(got.token_ids) == n and got.finish_reason == "length"
        assert got.token_ids == demo_alone(demo, p, n), demo.tokenizer.decode(p)


def test_tiny_batched_greedy_equals_each_alone(tiny):
    rng = random.Random(1)
    lengths = [1, 3, 40, 7, 12, 2, 33, 5, 70, 9, 4, 16, 27, 6, 50, 11]
    prompts = random_prompts(rng, lengths)
    params = [greedy(rng.randint(1, 20)) for _ in prompts]
    with recording(tiny.engine) as (steps, _):
        batched = tiny.generate(prompts, params)
    assert_chunked_and_mixed(steps)
    assert [r.token_ids for r in batched] == alone(tiny, prompts, params)
    assert [len(r.token_ids) for r in batched] == [p.max_tokens for p in params]


# -- (b) seeded sampling ---------------------------------------------------------------------------

def sampled(seed, max_tokens=12, **kwargs):
    return SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=seed, max_tokens=max_tokens,
                          ignore_eos=True, **kwargs)


def test_seeded_sampling_is_batch_independent(tiny):
    rng = random.Random(2)
    prompts = random_prompts(rng, [5, 37, 2, 18, 9, 5, 24, 3])
    prompts[5] = prompts[0]  # the same prompt with another seed
    params = [sampled(11), sampled(12), greedy(10), sampled(13, 20), sampled(14),
              sampled(99), greedy(7, repetition_penalty=1.2), sampled(11, 15)]
    batched = [r.token_ids for r in tiny.generate(prompts, params)]
    assert batched == alone(tiny, prompts, params)
    assert batched[0] != batched[5]  # different seeds differ
    again = tiny.generate([prompts[0]] * 3, [sampled(11), sampled(11), sampled(12)])
    assert again[0].token_ids == again[1].token_ids == batched[0]
    assert again[2].token_ids != batched[0]


def test_n_samples(tiny):
    prompt = [5, 6, 7, 8]
    [result] = tiny.generate([prompt], sampled(40, n=3))
    assert len(result.outputs) == 3
    tokens = [o.token_ids for o in result.outputs]
    assert all(len(t) == 12 and o.finished for t, o in zip(tokens, result.outputs))
    assert len({tuple(t) for t in tokens}) == 3
    # Sample i uses seed + i, so each equals a single request with that seed.
    assert tokens == alone(tiny, [prompt] * 3, [sampled(40 + i) for i in range(3)])
    [unseeded] = tiny.generate([prompt], SamplingParams(n=2, max_tokens=5, ignore_eos=True))
    assert [len(o.token_ids) for o in unseeded.outputs] == [5, 5]


# -- (c) preemption ------------------------------------------------------------------------------

def test_preempted_requests_recompute_the_same_tokens(tiny_small_cache):
    llm = tiny_small_cache
    rng = random.Random(3)
    prompts = random_prompts(rng, [6, 20, 11, 3, 15, 9])
    params = [greedy(40), sampled(5, 36), greedy(33), sampled(6, 45), greedy(30), sampled(7, 38)]
    before = llm.engine.scheduler.num_preemptions_total
    with recording(llm.engine) as (steps, _):
        batched = [r.token_ids for r in llm.generate(prompts, params)]
    assert llm.engine.scheduler.num_preemptions_total > before
    # A preempted request's prefill recomputes its output tokens too.
    assert any(n > 1 and start + n > num_prompt for s in steps for start, n, num_prompt, _ in s)
    assert llm.engine.scheduler.allocator.num_used_pages == 0
    before = llm.engine.scheduler.num_preemptions_total
    assert batched == alone(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions_total == before  # alone, nothing was preempted
    assert [len(t) for t in batched] == [p.max_tokens for p in params]


# -- (d) no compilation after warm-up ---------------------------------------------------------------

_compile_events: list[str] = []
_listening = [False]


def _on_event(name, *args, **kwargs):
    if _listening[0] and name.startswith(("/jax/core/compile/", "/jax/compilation_cache/")):
        _compile_events.append(name)


jax.monitoring.register_event_listener(_on_event)
jax.monitoring.register_event_duration_secs_listener(_on_event)


@contextlib.contextmanager
def counting_compilations():
    _compile_events.clear()
    _listening[0] = True
    try:
        yield _compile_events
    finally:
        _listening[0] = False


def test_no_compilation_after_warmup(tiny):
    engine = tiny.engine
    assert engine.runner.num_compiled == len(engine.step_shapes) == 6
    rng = random.Random(4)
    lengths = [1, 2, 5, 9, 17, 31, 33, 48, 63, 80] * 2
    rng.shuffle(lengths)
    prompts = random_prompts(rng, lengths)
    kinds = [greedy(8), sampled(1, 6), greedy(5, logprobs=3), greedy(6, frequency_penalty=0.5),
             sampled(2, 9, logit_bias={7: 3.0}), SamplingParams(max_tokens=7, stop=["e"]),
             greedy(4, presence_penalty=1.0, repetition_penalty=1.3),
             greedy(3, prompt_logprobs=2)]
    params = [kinds[i % len(kinds)] for i in range(len(prompts))]
    with counting_compilations() as events, recording(engine) as (_, shapes):
        tiny.generate(prompts, params)  # everything at once: prefill chunks, mixed, decode
        tiny.generate(random_prompts(rng, [5] * 6), greedy(3))  # short ones: narrow tables
        tiny.generate([[4]], sampled(3, 3))  # one short request: the smallest buckets
        tiny.generate(random_prompts(rng, [80]), greedy(3, logprobs=1))  # a wide table, unseen
    assert events == []
    assert set(shapes) == set(engine.step_shapes)  # the workload used every program
    assert engine.runner.num_compiled == len(engine.step_shapes)
    # The listener does see compilations: a new program right after is counted.
    with counting_compilations() as events:
        jax.jit(lambda x: x * 3 + 1)(np.float32(2))
    assert events


# -- (e) stop conditions, logprobs, penalties, bias, abort, validation -----------------------------------

def test_stop_conditions_on_the_demo_model(demo):
    tok = demo.tokenizer
    prompt = tok.encode("The capital of France is")
    n = 24
    [ref] = demo.generate([prompt], greedy(n))
    text, ids = ref.text, ref.token_ids
    assert text == tok.decode(ids, skip_special_tokens=True)
    # A stop string that spans a token boundary, first occurring mid-text.
    bounds = [len(tok.decode(ids[:i])) for i in range(1, n)]
    at = next(b - 2 for b in bounds if b >= 8 and b + 2 < len(text)
              and text.find(text[b - 2:b + 2]) == b - 2)
    stop = text[at:at + 4]
    m = next(i for i in range(1, n + 1) if len(tok.decode(ids[:i])) >= at + 4)  # completes it
    j = next(j for j in range(3, n) if ids[j] not in ids[:j])  # first occurrence of ids[j]
    cases = [
        greedy(n, stop=[stop]),
        greedy(n, stop=["zzz-never", stop], include_stop_str_in_output=True),
        greedy(n, stop=["zzz-never"]),
        greedy(n, stop_token_ids=[ids[j]]),
        greedy(5),
        SamplingParams(temperature=0, max_tokens=n, logit_bias={EOS: 100.0}),  # EOS at once
        greedy(3, logit_bias={EOS: 100.0}),  # ignore_eos: goes on past it
        greedy(4, logit_bias={504: 100.0}),
        greedy(m, stop=[stop]),  # the stop string completes on the last allowed token
    ]
    out = demo.generate([prompt] * len(cases), cases)
    assert out[0].text == text[:at] and stop not in out[0].text
    assert (out[0].finish_reason, out[0].outputs[0].stop_reason) == ("stop", stop)
    assert out[0].token_ids == ids[:m]  # up to the token that completed the stop string
    assert out[1].text == text[:at + 4]
    assert (out[1].finish_reason, out[1].outputs[0].stop_reason) == ("stop", stop)
    assert (out[2].text, out[2].token_ids, out[2].finish_reason) == (text, ids, "length")
    assert out[3].token_ids == ids[:j + 1]
    assert (out[3].finish_reason, out[3].outputs[0].stop_reason) == ("stop", ids[j])
    assert (out[4].token_ids, out[4].finish_reason) == (ids[:5], "length")
    assert (out[5].token_ids, out[5].text, out[5].finish_reason) == ([EOS], "", "stop")
    assert out[5].outputs[0].stop_reason is None  # EOS, as vLLM reports it
    assert (out[6].token_ids, out[6].finish_reason) == ([EOS] * 3, "length")
    assert out[7].token_ids == [504] * 4
    assert (out[8].token_ids, out[8].text) == (ids[:m], text[:at])
    assert (out[8].finish_reason, out[8].outputs[0].stop_reason) == ("stop", stop)


def test_logprobs_match_transformers(demo, demo_hf):
    prompt = demo.tokenizer.encode("Roses are red,")
    n, k = 12, 5
    [plain, with_lp] = demo.generate([prompt, prompt], [greedy(n), greedy(n, logprobs=k)])
    assert with_lp.token_ids == plain.token_ids  # asking for logprobs changes no token
    assert plain.logprobs is None
    lps = with_lp.logprobs
    assert [lp.token_id for lp in lps] == with_lp.token_ids
    with torch.no_grad():
        logits = demo_hf(torch.tensor([prompt + with_lp.token_ids])).logits[0].double()
    want = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].numpy()
    for i, lp in enumerate(lps):
        # float32 logits agree with transformers to ~1e-4 (test_demo_generation).
        assert abs(lp.logprob - want[i, lp.token_id]) < 1e-3
        assert len(lp.top) == k
        top_ids = [t for t, _ in lp.top]
        top_vals = [v for _, v in lp.top]
        assert top_ids[0] == lp.token_id and top_vals[0] == pytest.approx(lp.logprob)  # greedy
        assert top_vals == sorted(top_vals, reverse=True)
        assert set(top_ids) == set(np.argsort(-want[i])[:k].tolist())
        np.testing.assert_allclose(top_vals, want[i, top_ids], atol=1e-3)


class _PresenceFrequencyBias(transformers.LogitsProcessor):
    """vLLM's presence and frequency penalties (output tokens only) and logit bias."""

    def __init__(self, num_prompt, presence, frequency, bias):
        self.num_prompt, self.presence, self.frequency, self.bias = num_prompt, presence, frequency, bias

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.num_prompt:]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        scores = scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
        for t, b in self.bias.items():
            scores[:, t] += b
        return scores


def test_penalties_and_bias_match_transformers_processors(tiny, tiny_model):
    hf = tiny_model[0]
    prompt = [10, 11, 12, 10, 11, 12, 40]
    n = 24
    penalised = dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.6,
                     logit_bias={7: 2.0, 11: -5.0})
    [plain, ours, rep_only] = tiny.generate([prompt] * 3, [
        greedy(n), greedy(n, **penalised), greedy(n, repetition_penalty=1.5)])
    processor = _PresenceFrequencyBias(len(prompt), 0.4, 0.6, {7: 2.0, 11: -5.0})
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=0,
                                           repetition_penalty=1.3, eos_token_id=None,
                                           pad_token_id=0, bos_token_id=1)
    saved, hf.generation_config = hf.generation_config, config
    try:
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), generation_config=config,
                               logits_processor=transformers.LogitsProcessorList([processor]))
    finally:
        hf.generation_config = saved
    assert ours.token_ids == want[0, len(prompt):].tolist()
    assert ours.token_ids != plain.token_ids
    assert rep_only.token_ids != plain.token_ids  # the repetition penalty alone changes it
    # The unpenalised random model repeats itself; the penalised run repeats less.
    assert len(set(ours.token_ids)) > len(set(plain.token_ids))


def test_abort_frees_pages_at_once(tiny):
    engine = tiny.engine
    alloc = engine.scheduler.allocator
    assert alloc.num_used_pages == 0
    engine.add_request("short", [5, 6, 7], greedy(20))
    engine.add_request("long", list(range(3, 73)), greedy(20))  # 70 tokens: chunked prefill
    for rid in [f"wait{i}" for i in range(20)]:  # more than max_num_seqs: some must wait
        engine.add_request(rid, [9, 10], greedy(20))
    engine.step()
    assert 0 < alloc.num_used_pages and engine.scheduler.get_request("long").num_computed_tokens < 70
    engine.abort("long")  # mid-prefill
    used = alloc.num_used_pages
    assert used > 0 and engine.scheduler.get_request("long") is None
    for _ in range(3):
        engine.step()
    assert engine.scheduler.num_waiting > 0
    for rid in ["short"] + [f"wait{i}" for i in range(20)]:
        engine.abort(rid)  # running and waiting ones
    assert alloc.num_used_pages == 0 and not engine.scheduler.has_unfinished
    while engine.has_unfinished:  # outputs of the last step may still be pending
        outputs = engine.step()
        assert all(o.request_id not in ("long", "short") for o in outputs)
    assert tiny.generate([[5, 6, 7]], greedy(4))[0].token_ids == alone(tiny, [[5, 6, 7]], greedy(4))[0]


def test_invalid_requests_are_refused_and_leave_no_trace(tiny):
    engine = tiny.engine
    good = [5, 6, 7]
    with pytest.raises(ValueError, match="maximum context length is 96"):
        tiny.generate([good, list(range(3, 99))], greedy(4))  # 96 tokens = max_model_len
    with pytest.raises(ValueError, match="token id 211 in 'prompt'"):
        tiny.generate([good, [5, 211]], greedy(4))  # vocab is 211
    with pytest.raises(ValueError, match="token id -1 in 'prompt'"):
        tiny.generate([[-1, 5]], greedy(4))
    with pytest.raises(ValueError, match="logit_bias"):
        tiny.generate([good], greedy(4, logit_bias={500: 1.0}))
    with pytest.raises(ValueError, match="prompt is empty"):
        tiny.generate([[]], greedy(4))
    with pytest.raises(ValueError, match="token id 300 in 'stop_token_ids'"):
        tiny.generate([good], greedy(4, stop_token_ids=[300]))
    # The good prompts queued before the bad one were withdrawn; the engine is clean.
    assert not engine.has_unfinished and engine.scheduler.allocator.num_used_pages == 0
    [result] = tiny.generate([good], greedy(4))
    assert len(result.token_ids) == 4


# -- (f) the asyncio front end -----------------------------------------------------------------

def run_streams(engine, prompts, params):
    """Streams every prompt through an AsyncEngine over `engine` at once, with one more
    stream closed after two outputs, then one short request after those. -> (the early
    stream's outputs, each prompt's outputs, the last request's outputs)."""
    async_engine = AsyncEngine(engine)
    async_engine.start(warmup=False)

    async def stream(i):
        outs = [o async for o in async_engine.generate(prompts[i], params[i], f"s{i}")]
        return outs

    async def close_early():
        agen = async_engine.generate(list(range(3, 40)), greedy(80), "early")
        outs = [await agen.__anext__(), await agen.__anext__()]
        await agen.aclose()
        return outs

    async def main():
        results = await asyncio.gather(close_early(), *(stream(i) for i in range(len(prompts))))
        # Commands run in order on the engine thread: once this one finishes, the abort ran.
        after = [o async for o in async_engine.generate([5, 6], greedy(3), "after")]
        return results[0], results[1:], after

    try:
        return asyncio.run(main())
    finally:
        async_engine.shutdown()


def test_async_engine_streams_match_offline_and_early_close_aborts(tiny):
    rng = random.Random(5)
    prompts = random_prompts(rng, [4, 30, 9, 45, 2])
    params = [greedy(10), sampled(21, 14), greedy(6, logprobs=2), sampled(22, 8), greedy(12)]
    offline = tiny.generate(prompts, params)
    engine = tiny.engine
    early, streams, after = run_streams(engine, prompts, params)
    for outs, want in zip(streams, offline):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert sum((o.new_token_ids for o in outs), []) == want.token_ids
        assert "".join(o.new_text for o in outs) == want.text
    assert [lp.token_id for o in streams[2] for lp in o.new_logprobs] == offline[2].token_ids
    assert [lp.token_id for lp in offline[2].logprobs] == offline[2].token_ids
    assert len(early) == 2 and not early[-1].finished
    assert after[-1].finished and sum(len(o.new_token_ids) for o in after) == 3
    assert engine.scheduler.get_request("early") is None
    assert engine.scheduler.allocator.num_used_pages == 0 and not engine.has_unfinished


def test_async_engine_wakes_the_loop_once_a_step(tiny):
    """Eight streams decoding together: a step's outputs reach the event loop in one
    call_soon_threadsafe, not one per request, and every stream still gets its tokens."""
    rng = random.Random(6)
    prompts = random_prompts(rng, [5, 7, 3, 9, 4, 6, 8, 2])
    offline = tiny.generate(prompts, greedy(12))
    async_engine = AsyncEngine(tiny.engine)
    async_engine.start(warmup=False)
    steps, wakeups = [], []
    real_step = tiny.engine.step
    tiny.engine.step = lambda: (steps.append(1), real_step())[1]

    async def main():
        loop = asyncio.get_running_loop()
        real_call = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **k: (wakeups.append(1), real_call(*a, **k))[1]
        streams = [async_engine.generate(p, greedy(12), f"w{i}") for i, p in enumerate(prompts)]

        async def collect(stream):
            return [o async for o in stream]
        return await asyncio.gather(*(collect(s) for s in streams))

    try:
        results = asyncio.run(main())
    finally:
        tiny.engine.step = real_step
        async_engine.shutdown()
    for outs, want in zip(results, offline):
        assert sum((o.new_token_ids for o in outs), []) == want.token_ids
    assert sum(len(outs) for outs in results) > 4 * len(steps)  # steps carry several outputs
    assert len(wakeups) <= len(steps)


@pytest.mark.parametrize("has_llguidance", [True, False])
def test_start_builds_the_grammar_compiler_or_starts_without_it(tiny, monkeypatch, caplog,
                                                                 has_llguidance):
    """Warm-up builds structured outputs' compiler beside the programs. Where it cannot be
    built (no llguidance installed) the engine starts all the same and refuses constraints."""
    from serving.core import grammar
    monkeypatch.setattr(tiny.engine, "_grammar_compiler", None)
    if not has_llguidance:
        monkeypatch.setattr(grammar, "llguidance", None)
    async_engine = AsyncEngine(tiny.engine)
    async_engine.start()
    try:
        assert async_engine.ready
        if has_llguidance:
            assert isinstance(tiny.engine._grammar_compiler, grammar.GrammarCompiler)
        else:
            assert tiny.engine._grammar_compiler is None
            assert "need the llguidance package" in caplog.text
            with pytest.raises(grammar.GrammarRefused, match="llguidance"):
                tiny.engine.grammar_compiler
    finally:
        async_engine.shutdown()
