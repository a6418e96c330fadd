"""Prefix caching end to end on the demo model: a multi-turn workload (a shared system prompt,
each turn resending the whole history) gives the same greedy tokens with and without the
cache, offline and over HTTP, while the cache serves most of the prompts; n samples share
their prompt's pages; aborting a request id ends all its samples."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from serving import LLM, SamplingParams
from tests.demo_engine import DEMO_OPTIONS, greedy
from tests.server_util import MODEL, live_server, metric, metrics

pytestmark = pytest.mark.slow

SYSTEM = ("You are a careful assistant for a small bakery. Answer in one short sentence and "
          "never invent prices.")
QUESTIONS = ["Do you sell rye bread?", "When do you open?", "Is there parking nearby?"]
FOLLOW_UPS = ["Why?", "And on Sundays?"]


def first_turn(tokenizer, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return tokenizer.encode(tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True))


def next_turn(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n"
                            "<|im_start|>assistant\n")


def multi_turn(llm: LLM, max_tokens: int = 6) -> list[list[int]]:
    """Every conversation's turns batched together; each turn's prompt is the history so far."""
    tok = llm.tokenizer
    histories = [first_turn(tok, q) for q in QUESTIONS]
    outputs = []
    for turn in range(len(FOLLOW_UPS) + 1):
        results = llm.generate(histories, greedy(max_tokens))
        outputs += [r.token_ids for r in results]
        if turn < len(FOLLOW_UPS):
            histories = [h + r.token_ids + next_turn(tok, FOLLOW_UPS[turn])
                         for h, r in zip(histories, results)]
    assert max(len(h) for h in histories) + max_tokens <= DEMO_OPTIONS["max_model_len"]
    return outputs


@pytest.fixture(scope="module")
def demo(demo_llm):
    return demo_llm


def test_multi_turn_greedy_tokens_are_the_same_without_the_cache(demo, demo_checkpoint):
    kvm = demo.engine.scheduler.kv_cache_manager
    assert kvm.enable_caching  # on by default
    queries, hits = kvm.prefix_cache_queries, kvm.prefix_cache_hits
    cached = multi_turn(demo)
    assert kvm.prefix_cache_hits - hits > 0.5 * (kvm.prefix_cache_queries - queries)
    uncached_llm = LLM(str(demo_checkpoint), enable_prefix_caching=False, **DEMO_OPTIONS)
    uncached = multi_turn(uncached_llm)
    off = uncached_llm.engine.scheduler.kv_cache_manager
    assert off.prefix_cache_hits == off.prefix_cache_queries == 0
    assert cached == uncached
    assert demo.engine.scheduler.allocator.num_used_pages == 0


def test_n_samples_share_their_prompt_pages(demo):
    prompt = first_turn(demo.tokenizer, "Name three kinds of bread.")  # 2 full pages and more
    full_pages = (len(prompt) - 1) // demo.engine.config.page_size
    kvm = demo.engine.scheduler.kv_cache_manager
    hits = kvm.prefix_cache_hits
    [result] = demo.generate([prompt + [42]], SamplingParams(n=3, seed=5, max_tokens=4,
                                                             ignore_eos=True))
    # The first sample computes the prompt; the other two find its full pages.
    assert kvm.prefix_cache_hits - hits >= 2 * full_pages * demo.engine.config.page_size
    alone = [demo.generate([prompt + [42]], SamplingParams(seed=5 + i, max_tokens=4,
                                                           ignore_eos=True))[0].token_ids
             for i in range(3)]
    assert [o.token_ids for o in result.outputs] == alone


def test_aborting_a_request_id_ends_all_its_samples(demo):
    engine = demo.engine
    engine.add_request("many", first_turn(demo.tokenizer, "Hello?"),
                       SamplingParams(n=3, max_tokens=50, ignore_eos=True))
    seen = set()
    for _ in range(6):
        seen |= {(out.request_id, out.index) for out in engine.step()}
    assert seen == {("many", 0), ("many", 1), ("many", 2)}
    engine.abort("many")
    assert engine.step() == []  # what the last step left to emit belongs to nobody now
    assert not engine.has_unfinished
    assert engine.scheduler.allocator.num_used_pages == 0


def chat_turns(server) -> list[str]:
    """The conversations run concurrently over HTTP; each turn resends the history."""
    client = server.client()

    def conversation(question: str) -> list[str]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        replies = []
        for follow_up in FOLLOW_UPS + [None]:
            r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                               temperature=0)
            replies.append(r.choices[0].message.content)
            messages += [{"role": "assistant", "content": replies[-1]}]
            if follow_up:
                messages += [{"role": "user", "content": follow_up}]
        return replies

    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        return [t for turns in pool.map(conversation, QUESTIONS) for t in turns]


def test_multi_turn_chat_over_http_is_the_same_without_the_cache(demo_checkpoint):
    with live_server(demo_checkpoint) as server:
        cached = chat_turns(server)
        m = metrics(server.port)
        queries = metric(m, "xlaserve:prefix_cache_queries_total")
        hits = metric(m, "xlaserve:prefix_cache_hits_total")
        assert 0.5 * queries < hits < queries
        salted = server.client().completions.create(
            model=MODEL, prompt=SYSTEM, max_tokens=2, extra_body={"cache_salt": "tenant-1"})
        assert salted.choices[0].finish_reason == "length"
        server.wait_idle()
    with live_server(demo_checkpoint, enable_prefix_caching=False) as server:
        uncached = chat_turns(server)
        assert metric(metrics(server.port), "xlaserve:prefix_cache_hits_total") == 0
    assert cached == uncached and all(cached)


def test_cli_flags_turn_prefix_caching_and_the_stats_line_on_and_off():
    from serving.cli import _engine_config, build_parser
    parse = build_parser().parse_args
    assert _engine_config(parse(["serve"])).enable_prefix_caching
    assert not _engine_config(parse(["serve", "--no-enable-prefix-caching"])).enable_prefix_caching
    assert _engine_config(parse(["serve", "--enable-prefix-caching"])).enable_prefix_caching
    assert not parse(["serve"]).disable_log_stats and parse(
        ["serve", "--disable-log-stats"]).disable_log_stats
