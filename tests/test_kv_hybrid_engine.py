"""Hybrid models through the engine (docs/architecture.md, "Sliding windows and hybrid KV"):
Gemma 3 (five window layers to one full), gpt-oss (alternating, with sinks and experts) and
Qwen2 with its window from max_window_layers on keep their window layers' K/V in a pool of their own. Decoding far past the windows with the
default buckets, a request holds a window's worth of window pages while its full layers hold
every page, and the tokens are transformers'; a prefix hit gives a cold run's tokens; a
window pool too small for the batch preempts and still gives the same tokens."""
import pytest

from model.kv_cache import bytes_per_page
from model.config import ModelConfig
from model.kv_groups import group_window, num_group_layers
from serving import LLM, SamplingParams
from serving.core.kv_hybrid import HybridKVCacheManager
from serving.core.kv_window import request_pages
from serving.core.page_allocator import SINK_PAGE
from serving.core.scheduler import cdiv
from tests.hf_tiny import greedy_reference, tiny_hf_model

PS, BUDGET = 4, 16
OPTIONS = dict(max_num_seqs=4, max_model_len=128, max_num_batched_tokens=BUDGET, page_size=PS,
               progress=False)
PROMPTS = [[(7 * i) % 200 + 3 for i in range(23)], [(13 * i) % 205 + 3 for i in range(40)],
           [9, 8, 7]]
MAX_TOKENS = 40


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# Qwen2 with use_sliding_window: the window from layer max_window_layers on.
QWEN2_WINDOW = dict(use_sliding_window=True, sliding_window=6, max_window_layers=1,
                    layer_types=["full_attention", "sliding_attention", "sliding_attention"])


@pytest.fixture(scope="module", params=["gemma3", "gpt_oss", "qwen2"])
def hybrid(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    overrides = QWEN2_WINDOW if request.param == "qwen2" else {}
    model = tiny_hf_model(request.param, folder, **overrides)
    return request.param, model, folder, LLM(str(folder), **OPTIONS)


def watch_window_pages(kvm, monkeypatch) -> dict[str, int]:
    """The most window pages each request held after any of its allocations."""
    most, allocate = {}, kvm.allocate_slots

    def watched(req, num_new_tokens, computed_pages=None):
        ok = allocate(req, num_new_tokens, computed_pages)
        rid = req.request_id
        most[rid] = max(most.get(rid, 0), kvm.window_live_pages(rid))
        return ok
    monkeypatch.setattr(kvm, "allocate_slots", watched)
    return most


def test_window_layers_have_a_pool_of_their_own(hybrid):
    name, _, _, llm = hybrid
    engine = llm.engine
    full_layers, window_layers = num_group_layers(engine.cfg)
    assert full_layers and window_layers
    cache = engine.runner.cache
    assert cache.k.shape[:2] == (full_layers, engine.num_pages)
    assert cache.window.k.shape[:2] == (window_layers, engine.window_num_pages)
    assert cache.window.window is None
    assert isinstance(engine.scheduler.kv_cache_manager, HybridKVCacheManager)
    # The pool holds every running request's window, and fewer pages than the full layers.
    assert engine.window_num_pages < engine.num_pages
    assert engine.kv_cache_bytes == (
        engine.num_pages * bytes_per_page(engine.cfg, PS, None, full_layers)
        + engine.window_num_pages * bytes_per_page(engine.cfg, PS, None, window_layers))


def test_decoding_past_the_windows_keeps_transformers_tokens_on_few_pages(hybrid,
                                                                          monkeypatch):
    name, model, _, llm = hybrid
    kvm = llm.engine.scheduler.kv_cache_manager
    most = watch_window_pages(kvm, monkeypatch)
    ours = [list(r.token_ids) for r in llm.generate(PROMPTS, greedy())]
    monkeypatch.undo()
    assert ours == [greedy_reference(model, p, MAX_TOKENS) for p in PROMPTS]
    window = llm.engine.scheduler.config.window_group
    assert max(most.values()) <= request_pages(window, BUDGET, PS)
    assert kvm.full.allocator.num_used_pages == kvm.window.allocator.num_used_pages == 0


def test_a_prefix_hit_gives_the_tokens_of_a_cold_run(hybrid, monkeypatch):
    _, _, _, llm = hybrid
    kvm = llm.engine.scheduler.kv_cache_manager
    prompt = [(11 * i) % 190 + 5 for i in range(50)]  # 12 full pages before the last token
    [cold] = llm.generate([prompt], greedy(20))
    hits, allocate, seen = kvm.prefix_cache_hits, kvm.allocate_slots, []

    def watched(req, num_new_tokens, computed_pages=None):
        if computed_pages:
            seen.append((list(computed_pages), list(computed_pages.window)))
        return allocate(req, num_new_tokens, computed_pages)
    monkeypatch.setattr(kvm, "allocate_slots", watched)
    [warm] = llm.generate([prompt], greedy(20))
    monkeypatch.undo()
    assert kvm.prefix_cache_hits - hits == 12 * PS
    [(full, window)] = seen
    need = cdiv(llm.engine.scheduler.config.window_group - 1, PS)
    assert SINK_PAGE not in full and window[:12 - need] == [SINK_PAGE] * (12 - need)
    assert warm.token_ids == cold.token_ids


def test_a_short_window_pool_preempts_and_keeps_the_tokens(tmp_path):
    """Gemma 3, whose window layers are most of its KV: kv_cache_memory small enough that
    the window pool gets its least (one request's window and step) while the full layers
    have room, so a batch of four preempts for window pages; the tokens do not change."""
    model = tiny_hf_model("gemma3", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    window = group_window(cfg)
    full_layers, window_layers = num_group_layers(cfg)
    least = request_pages(window, BUDGET, PS) + 1
    memory = (least * bytes_per_page(cfg, PS, None, window_layers)
              + 40 * bytes_per_page(cfg, PS, None, full_layers))
    llm = LLM(str(tmp_path), kv_cache_memory=memory, **OPTIONS)
    engine = llm.engine
    assert engine.window_num_pages == least and engine.num_pages == 41
    prompts = PROMPTS + [[4, 5, 6, 7, 8] * 3]
    ours = [list(r.token_ids) for r in llm.generate(prompts, greedy(24))]
    assert engine.scheduler.num_preemptions_total > 0
    assert ours == [greedy_reference(model, p, 24) for p in prompts]


def test_qwen2_window_layers_come_from_layer_types_or_max_window_layers(tmp_path):
    import json
    tiny_hf_model("qwen2", tmp_path, **QWEN2_WINDOW)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert ModelConfig.from_hf(hf).sliding_windows == (0, 6, 6)
    del hf["layer_types"]  # a config written before layer_types
    assert ModelConfig.from_hf(hf).sliding_windows == (0, 6, 6)
    assert ModelConfig.from_hf({**hf, "use_sliding_window": False}).sliding_windows == (0,) * 3
