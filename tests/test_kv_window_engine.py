"""A sliding-window model through the engine (docs/architecture.md, "Sliding windows and
hybrid KV"): a tiny random Mistral with an 8-key window decodes far past it on a few live
pages and gives transformers' greedy tokens, the same as with every page kept; a prefix-cache
hit, whose early pages are SINK entries, gives the same tokens as a cold run. On the CPU
kernel and on the reference backend."""
import pytest

from serving import LLM, SamplingParams
from serving.core.page_allocator import SINK_PAGE
from serving.core.scheduler import cdiv
from tests.hf_tiny import greedy_reference, tiny_hf_model

PS, W, CHUNK = 4, 8, 16
# One token bucket and one page bucket: one step program for the whole module.
OPTIONS = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=CHUNK, page_size=PS,
               token_buckets=(CHUNK,), request_buckets=(4,), page_buckets=(32,),
               progress=False)
PROMPT = [(7 * i) % 200 + 3 for i in range(22)]  # two 16-token prefill chunks
MAX_TOKENS = 60


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mistral-window")
    return tiny_hf_model("mistral", folder, sliding_window=W), folder


# The CPU kernel walks only the keys in the window; the reference reads every page table
# entry (sink ones too) and masks.
@pytest.fixture(scope="module", params=["auto", "reference"])
def mistral(request, mistral_folder):
    model, folder = mistral_folder
    return model, LLM(str(folder), attention_backend=request.param, **OPTIONS)


def watch_allocations(kvm, monkeypatch) -> list[tuple[list[int], int]]:
    """Records, for every allocate_slots call, the hit it was given and the pages the
    request holds after it."""
    calls, allocate = [], kvm.allocate_slots

    def watched(req, num_new_tokens, computed_pages=None):
        ok = allocate(req, num_new_tokens, computed_pages)
        calls.append((list(computed_pages or []), kvm.num_live_pages(req.request_id)))
        return ok
    monkeypatch.setattr(kvm, "allocate_slots", watched)
    return calls


def generate_watching_pages(llm: LLM, prompt: list[int], monkeypatch) -> tuple[list[int], int]:
    """The greedy tokens and the most pages the request held at once."""
    calls = watch_allocations(llm.engine.scheduler.kv_cache_manager, monkeypatch)
    [result] = llm.generate([prompt], greedy())
    monkeypatch.undo()
    return list(result.token_ids), max(live for _, live in calls)


def test_decoding_past_the_window_holds_few_pages_and_keeps_the_tokens(mistral, monkeypatch):
    model, llm = mistral
    kvm = llm.engine.scheduler.kv_cache_manager
    assert kvm.sliding_window == W and kvm.enable_caching
    tokens, peak = generate_watching_pages(llm, PROMPT, monkeypatch)
    assert tokens == greedy_reference(model, PROMPT, MAX_TOKENS)
    assert peak <= cdiv(W - 1 + CHUNK, PS) + 1  # a prefill chunk and the window before it
    assert llm.engine.scheduler.allocator.num_used_pages == 0
    # The same engine with every page kept (freeing off): the same tokens, many more pages.
    kvm.sliding_window = 0
    try:
        kept, kept_peak = generate_watching_pages(llm, PROMPT + [5], monkeypatch)
    finally:
        kvm.sliding_window = W
    windowed, windowed_peak = generate_watching_pages(llm, PROMPT + [5], monkeypatch)
    assert kept == windowed
    assert kept_peak == cdiv(len(PROMPT) + 1 + MAX_TOKENS - 1, PS)
    assert windowed_peak <= cdiv(W - 1 + CHUNK, PS) + 1


def test_a_window_prefix_hit_gives_the_tokens_of_a_cold_run(mistral, monkeypatch):
    _, llm = mistral
    sched = llm.engine.scheduler
    kvm = sched.kv_cache_manager
    prompt = [(11 * i) % 190 + 5 for i in range(50)]  # 12 full pages before the last token
    hits = kvm.prefix_cache_hits
    [cold] = llm.generate([prompt], greedy(20))
    assert kvm.prefix_cache_hits == hits  # nothing of it was cached
    calls = watch_allocations(kvm, monkeypatch)
    [warm] = llm.generate([prompt], greedy(20))
    assert kvm.prefix_cache_hits - hits == 12 * PS
    # The hit maps in only the pages the first computed token reads.
    [hit] = [pages for pages, _ in calls if pages]
    need = cdiv(W - 1, PS)
    assert hit[:12 - need] == [SINK_PAGE] * (12 - need) and SINK_PAGE not in hit[-need:]
    assert warm.token_ids == cold.token_ids
    assert sched.allocator.num_used_pages == 0


def test_ngram_speculation_past_the_window_keeps_the_tokens(mistral_folder):
    """Rejected proposals are trimmed from pages that sit behind given-back ones."""
    model, folder = mistral_folder
    llm = LLM(str(folder), speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                               "prompt_lookup_max": 3, "prompt_lookup_min": 1},
              **OPTIONS)
    sched = llm.engine.scheduler
    assert sched.kv_cache_manager.sliding_window == W
    prompt = PROMPT[:6] * 4  # repeats, so the proposer finds earlier occurrences
    [result] = llm.generate([prompt], greedy())
    assert list(result.token_ids) == greedy_reference(model, prompt, MAX_TOKENS)
    stats = sched.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sched.allocator.num_used_pages == 0
