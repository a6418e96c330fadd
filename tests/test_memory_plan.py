"""GPU memory sizing (serving/engine/memory_plan.py) as a pure function, and the engine's use
of it: weights freed from the stacked tree first, the plan before the KV cache exists."""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model.config import ModelConfig
from model.kv_cache import bytes_per_page
from serving.engine import memory_plan
from serving.engine.memory_plan import MemoryPlanError, parse_bytes, plan_memory

GIB = 1 << 30
H200_BYTES = 143_771 << 20  # what nvidia-smi reports for an H200 (143771 MiB)
LLAMA_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16")


def llama_8b_weight_bytes() -> int:
    h, i, v, layers, kv = 4096, 14336, 128256, 32, 8 * 128
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h  # q, o; k, v; mlp; two norms
    return 2 * (layers * per_layer + 2 * v * h + h)  # bf16; embed and lm_head; final norm


def test_llama_8b_on_an_h200_fits_with_its_whole_context():
    cfg = ModelConfig.from_hf(LLAMA_8B)
    page = bytes_per_page(cfg, 16)
    assert page == 2 * 32 * 16 * 8 * 128 * 2  # K and V, 32 layers, 16 tokens, 8 heads x 128
    weights = llama_8b_weight_bytes()
    assert 16.0e9 < weights < 16.1e9
    activations = 3 * GIB
    plan = plan_memory(device_bytes=H200_BYTES, weight_bytes=weights,
                       activation_bytes=activations, page_bytes=page, page_size=16,
                       model_max_len=131072)
    budget = int(0.9 * H200_BYTES)
    assert plan.budget_bytes == budget
    assert plan.num_pages == (budget - weights - activations) // page
    # Everything the engine holds fits the budget; less than a page is left unused.
    used = weights + activations + plan.kv_cache_bytes
    assert budget - page < used <= budget
    assert plan.max_model_len == 131072
    assert 6 < plan.max_concurrency < 7  # ~810k tokens of KV cache
    # The old rule, 0.9 x (device - weights) of KV cache next to two copies of the weights,
    # needed more than the device has.
    assert 2 * weights + 0.9 * (H200_BYTES - weights) > H200_BYTES
    text = plan.describe()
    assert "weights 14.96 GiB" in text and f"{plan.num_pages - 1} pages" in text


def test_a_model_that_does_not_fit_is_a_clear_error():
    with pytest.raises(MemoryPlanError, match="does not fit.*quantize"):
        plan_memory(device_bytes=24 * GIB, weight_bytes=22 * GIB, activation_bytes=GIB,
                    page_bytes=2 << 20, page_size=16, model_max_len=131072)


def test_max_model_len_default_is_what_the_cache_holds_and_a_request_beyond_it_fails():
    page = 1 << 20
    common = dict(device_bytes=10 * GIB, weight_bytes=8 * GIB, activation_bytes=0,
                  page_bytes=page, page_size=16, model_max_len=1 << 20)
    plan = plan_memory(**common)  # 1 GiB of KV cache: 1023 usable pages
    assert plan.num_pages == 1024 and plan.max_model_len == 1023 * 16
    assert plan_memory(**common, max_model_len=4096).max_model_len == 4096
    with pytest.raises(MemoryPlanError, match="max_model_len 20000 needs 1250 KV pages"):
        plan_memory(**common, max_model_len=20000)


def test_a_window_model_plans_for_the_pages_a_request_holds():
    """Pages behind the window go back as a request grows (docs/architecture.md, "Sliding
    windows and hybrid KV"): a 1023-page cache serves the whole context of a model whose
    requests hold at most 600 pages, and counts its concurrency by those 600."""
    page = 1 << 20
    common = dict(device_bytes=10 * GIB, weight_bytes=8 * GIB, activation_bytes=0,
                  page_bytes=page, page_size=16, model_max_len=1 << 20)
    plan = plan_memory(**common, seq_pages=600)
    assert plan.max_model_len == 1 << 20
    assert plan.max_concurrency == pytest.approx(1023 / 600)
    assert plan_memory(**common, max_model_len=20000, seq_pages=600).max_model_len == 20000
    with pytest.raises(MemoryPlanError, match="needs 1100 KV pages"):
        plan_memory(**common, max_model_len=20000, seq_pages=1100)


def test_a_hybrid_model_takes_its_window_pool_out_of_the_kv_memory_first(monkeypatch):
    """A hybrid model (docs/architecture.md, "Sliding windows and hybrid KV"): the window
    layers' pool comes first, sized for max_num_seqs windows, or half the KV memory where
    that is less; the full-attention layers get the rest, on a GPU and off it."""
    from serving.core.config import EngineConfig
    from serving.engine import sizing
    from serving.engine.kv_pools import WindowPool
    pool = WindowPool(window=512, page_size=16, step_tokens=512, max_num_seqs=8,
                      page_bytes=1 << 20, full_page_bytes=1 << 19)
    wanted = 8 * (32 + 2) + 32 + 1
    assert pool.wanted_pages == wanted
    common = dict(device_bytes=10 * GIB, weight_bytes=8 * GIB, activation_bytes=0,
                  page_bytes=1 << 19, page_size=16, model_max_len=1 << 16)
    plan = plan_memory(**common, window=pool)  # 0.9 x 10 - 8 = 1 GiB of KV: fits in half
    assert plan.window_pages == wanted
    assert plan.num_pages == (GIB - wanted * (1 << 20)) // (1 << 19)
    assert plan.kv_cache_bytes <= GIB and "window layers' pool" in plan.describe()
    small = plan_memory(**common, window=pool, kv_cache_memory=256 << 20)
    assert small.window_pages == 128 and small.num_pages == 256  # half each
    monkeypatch.setattr(sizing, "available_memory", lambda: 64 * GIB)
    ec = EngineConfig(max_num_seqs=8, page_size=16)
    full, window = sizing.num_pages_hybrid(ec, 1 << 19, pool, 2048)
    assert (full, window) == (8 * 128 + 1, wanted)
    assert sizing.num_pages_hybrid(ec, 1 << 19, None, 2048) == (8 * 128 + 1, 0)


def test_cpu_cache_for_a_window_model_holds_what_its_requests_hold(monkeypatch):
    """Off-GPU, the default cache is max_num_seqs requests' worth of pages: on a window
    model the window's pages, not the whole context's."""
    from serving.core.config import EngineConfig
    from serving.engine import sizing
    monkeypatch.setattr(sizing, "available_memory", lambda: 64 * GIB)
    ec = EngineConfig(max_num_seqs=4, page_size=16)
    assert sizing.num_pages(ec, 1 << 20, 2048) == 4 * 128 + 1
    assert sizing.num_pages(ec, 1 << 20, 2048, seq_pages=40) == 4 * 40 + 1
    assert sizing.num_pages(ec, 1 << 20, 256, seq_pages=40) == 4 * 16 + 1


def test_utilization_and_explicit_kv_cache_size():
    common = dict(device_bytes=100 * GIB, weight_bytes=10 * GIB, activation_bytes=2 * GIB,
                  page_bytes=GIB // 1024, page_size=16, model_max_len=8192)
    half = plan_memory(**common, gpu_memory_utilization=0.5)
    assert half.kv_cache_bytes == 38 * GIB
    fixed = plan_memory(**common, kv_cache_memory=5 * GIB)
    assert fixed.kv_cache_bytes == 5 * GIB
    with pytest.raises(MemoryPlanError, match="exceed the device"):
        plan_memory(**common, kv_cache_memory=90 * GIB)
    with pytest.raises(MemoryPlanError, match="gpu_memory_utilization must be in"):
        plan_memory(**common, gpu_memory_utilization=1.5)


def test_sizes_in_bytes():
    assert parse_bytes("20GiB") == 20 * GIB
    assert parse_bytes("20GB") == parse_bytes("20G") == 20 * 10**9
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("2000000000") == parse_bytes(2e9) == 2 * 10**9
    for bad in ("0.9", "lots", "20XB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_xla_allocator_is_told_the_budget_unless_the_user_set_it():
    env = {}
    assert memory_plan.configure_xla_allocator(0.9, env) == 0.9
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9000"
    assert memory_plan.device_total_bytes(90 * GIB, env) == 100 * GIB
    mine = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    assert memory_plan.configure_xla_allocator(0.9, mine) == 0.5
    assert memory_plan.device_total_bytes(GIB, {}) == int(GIB / 0.75)  # XLA's default


# -- the engine's side -------------------------------------------------------------------------

TINY = {**LLAMA_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
        "max_position_embeddings": 4096, "torch_dtype": "float32"}


@pytest.fixture
def tiny_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return tmp_path


def test_prepared_weights_free_the_stacked_tree(tiny_dir):
    from model.runtime_params import prepare_params
    from model.transformer import init_params
    cfg = ModelConfig.from_dir(tiny_dir)
    stored = init_params(cfg, 0)
    expected = prepare_params(jax.tree.map(lambda a: a.copy(), stored))
    stacked = jax.tree.leaves(stored["layers"])
    run = prepare_params(stored, free_stacked=True)
    assert all(a.is_deleted() for a in stacked)
    for a, b in zip(jax.tree.leaves(run), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_layers_cut_on_the_host_equal_jax_slices_and_outlive_the_stack():
    from model.runtime_params import _layer_slices
    for dtype in (jnp.float32, jnp.bfloat16, jnp.int8, jnp.uint8):
        stacked = (jnp.arange(3 * 4 * 5).reshape(3, 4, 5) % 113).astype(dtype)
        want = [np.asarray(stacked[j]) for j in range(3)]
        got = _layer_slices(stacked, 3)
        stacked.delete()
        for g, w in zip(got, want):
            assert isinstance(g, jax.Array) and g.dtype == w.dtype
            np.testing.assert_array_equal(np.asarray(g), w)


def _gpu_like_engine(tiny_dir, monkeypatch, limit, **options):
    """An engine on this CPU that sizes its cache as on a GPU reporting `limit` bytes."""
    from model.kv_cache import KVCache
    from serving.engine import llm_engine, mesh
    from serving.engine.runner import ModelRunner
    # pages of each KV cache made on the device: eagerly (traced ones are not), or by the
    # runner's allocation (whose zeros are a compiled program)
    allocated = []
    zeros = KVCache.zeros.__func__
    allocate = ModelRunner.allocate_kv_cache

    def recording(cls, *args, **kwargs):
        cache = zeros(cls, *args, **kwargs)
        if not isinstance(cache.k, jax.core.Tracer):
            allocated.append(args[1])
        return cache

    def allocating(runner, num_pages, window_pages=0):
        allocated.append(num_pages)
        return allocate(runner, num_pages, window_pages)

    monkeypatch.setattr(KVCache, "zeros", classmethod(recording))
    monkeypatch.setattr(ModelRunner, "allocate_kv_cache", allocating)
    monkeypatch.setattr(mesh, "gpu_memory_limit", lambda where: limit)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    options = dict(model=str(tiny_dir), load_format="dummy", compilation_cache_dir=None,
                   progress=False, max_num_seqs=4, max_num_batched_tokens=32, **options)
    try:
        return llm_engine.LLMEngine(**options), allocated
    except MemoryPlanError as e:
        return e, allocated


def test_engine_plans_the_cache_from_the_compiled_largest_step(tiny_dir, monkeypatch):
    cfg = ModelConfig.from_dir(tiny_dir)
    page = bytes_per_page(cfg, 16)
    limit = 64 << 20
    engine, allocated = _gpu_like_engine(tiny_dir, monkeypatch, limit)
    plan = engine.memory_plan
    assert plan.activation_bytes > 0
    assert plan.device_bytes == int(limit / 0.9)
    assert plan.weight_bytes == engine.weight_bytes
    assert plan.num_pages == (plan.budget_bytes - engine.weight_bytes
                              - plan.activation_bytes) // page
    assert engine.num_pages == plan.num_pages and allocated[-1] == plan.num_pages
    assert engine.runner.cache.k.shape == engine.runner._cache_shape.k.shape
    assert plan.num_pages in engine.runner.cache.k.shape
    assert engine.max_model_len == 4096  # the model's whole context: the cache holds it
    assert engine.buckets.pages[-1] == 4096 // 16


def test_engine_refuses_a_model_that_cannot_fit_before_allocating_a_cache(tiny_dir,
                                                                         monkeypatch):
    error, allocated = _gpu_like_engine(tiny_dir, monkeypatch, 600 << 10)
    assert isinstance(error, MemoryPlanError) and "does not fit" in str(error)
    assert max(allocated, default=0) <= 1  # init_params' one-page example cache at most


def moe_weight_bytes(h, v, layers, heads, kv_heads, head_dim, experts, expert_size,
                     qk_norm: bool, bytes_per_weight: float) -> float:
    """A mixture of experts' weights by hand: every expert counted, not only the active
    ones (and the router, norms, embedding and head, kept in bfloat16)."""
    attn = h * heads * head_dim * 2 + h * kv_heads * head_dim * 2
    moe = experts * 3 * h * expert_size
    matmul = layers * (attn + moe) * bytes_per_weight
    small = 2 * (layers * (h * experts + 2 * h + (2 * head_dim if qk_norm else 0))
                 + 2 * v * h + h)
    return matmul + small


@pytest.mark.parametrize("name, quantize", [("mixtral-8x7b", None), ("qwen3-30b-a3b", None),
                                            ("qwen3-30b-a3b", "fp8")])
def test_moe_models_plan_on_one_h200(name, quantize):
    """Mixtral-8x7B in bfloat16 and Qwen3-30B-A3B in bfloat16 and fp8 fit one H200 with a
    KV cache for their whole context; the plan counts all experts' weights."""
    from model.checkpoint import param_bytes
    from model.transformer import abstract_params
    from quant.recipe import abstract_quantized
    from serving.engine.tp_lowering import MODELS
    cfg = MODELS[name]()
    abstract = abstract_params(cfg)
    if quantize:
        abstract = abstract_quantized(abstract, quantize)
    weights = param_bytes(abstract)
    if name == "mixtral-8x7b":
        want = moe_weight_bytes(4096, 32000, 32, 32, 8, 128, 8, 14336, False, 2)
    else:
        want = moe_weight_bytes(2048, 151936, 48, 32, 4, 128, 128, 768, True,
                                1 if quantize else 2)
    # fp8 adds a scale per tensor: within 0.01% of the codes alone
    assert abs(weights - want) < 1e-4 * want, (weights, want)
    page = bytes_per_page(cfg, 16)
    plan = plan_memory(device_bytes=H200_BYTES, weight_bytes=weights, activation_bytes=3 * GIB,
                       page_bytes=page, page_size=16, model_max_len=cfg.max_position_embeddings)
    assert plan.max_model_len == cfg.max_position_embeddings
    assert plan.max_concurrency >= 1
    used = weights + 3 * GIB + plan.kv_cache_bytes
    assert plan.budget_bytes - page < used <= plan.budget_bytes


# -- DeepSeek-V3 and Kimi K2 over H200s, in their checkpoints' fp8 blocks ----------------------
# Pure arithmetic on the parameter shapes (no weights): each GPU's share at TP=N with expert
# parallel (model/sharding.py), counted as the checkpoints store it (memory_plan.FP8_BLOCK_128:
# a byte per linear weight and a float32 scale per 128 x 128 block; the table, head, norms,
# k_up / v_up in bfloat16 and the routers in float32, as the engine keeps them), and an
# assumed 3 GiB activation peak. The latent cache is whole on every GPU: 61 layers x 576
# values x 2 bytes = 70272 bytes (68.6 KiB) a token, whatever N.

def fp8_block_plan(name: str, tp: int, **options):
    """-> (the model's whole parameter count, one GPU's weight bytes, its plan)."""
    from model.sharding import local_config
    from serving.engine.memory_plan import FP8_BLOCK_128, weight_bytes
    from serving.engine.mesh import with_expert_parallel
    from serving.engine.sizing import kv_layout
    from serving.engine.tp_lowering import MODELS, device_leaves
    cfg = with_expert_parallel(MODELS[name](), tp, True)
    total = sum(np.prod(shape) for _, shape, _ in device_leaves(cfg, 1))
    weights = weight_bytes(device_leaves(cfg, tp), FP8_BLOCK_128)
    page = bytes_per_page(local_config(cfg, tp), 16)
    assert page == 16 * 61 * 576 * 2
    plan = plan_memory(device_bytes=H200_BYTES, weight_bytes=weights, activation_bytes=3 * GIB,
                       page_bytes=page, page_size=16, model_max_len=cfg.max_position_embeddings,
                       kv_layout=kv_layout(cfg, tp), **options)
    return total, weights, plan


def test_deepseek_v3_fits_8_h200s_with_expert_parallel():
    """DeepSeek-V3 (671e9 parameters) at TP=8 with expert parallel. By hand, per GPU: 58 MoE
    layers x 32 experts x 3 x 7168 x 2048 fp8 = 81.74e9 bytes; attention 1.18e9 (q_b_proj
    and o_proj, an eighth, fp8) + 0.92e9 (q_a_proj and kv_a_proj whole, fp8) + 0.26e9 (k_up
    / v_up, an eighth, bf16); table and head 0.46e9 (an eighth, bf16); dense MLPs and shared
    experts 0.47e9 (an eighth, fp8); routers 0.43e9 (whole, float32); block scales 0.02e9:
    85.5e9 bytes = 79.6 GiB. KV cache: 0.9 x 140.4 GiB - 79.6 - 3 = 43.75 GiB, at 68.6 KiB a
    token about 668k tokens: the whole 163840-token context 4 times over."""
    total, weights, plan = fp8_block_plan("deepseek-v3", 8)
    assert 670.5e9 < total < 671.5e9
    assert 85.3e9 < weights < 85.7e9
    assert 640_000 < plan.kv_tokens < 690_000
    assert plan.max_model_len == 163840 and 4 < plan.max_concurrency < 4.2
    assert plan.budget_bytes - plan.page_bytes < (
        weights + 3 * GIB + plan.kv_cache_bytes) <= plan.budget_bytes
    assert "the latent cache whole on each of 8 devices" in plan.describe()


def test_kimi_k2_needs_two_8_gpu_processes_for_its_context():
    """Kimi K2 (1.03e12 parameters, 384 experts). One process of 8 H200s: 60 MoE layers x 48
    experts x 44.0e6 weights = 126.8e9 bytes of experts alone, 130.1e9 (121.2 GiB) in all,
    leaving 2.2 GiB of cache: about 33k tokens, not one sequence of its 131072-token context
    (vLLM's Kimi-K2-Instruct recipe, after Moonshot's guidance, names 16 GPUs the smallest
    fp8 deployment at 128k, and lists 16 H200s as verified). Two
    processes of 8 (`--num-processes 2`): the mesh spans all 16 GPUs (tensor_parallel_size
    must be 16: serving/engine/mesh.check_tensor_parallel_size), each plans its own GPUs'
    share, the same on every GPU, and the processes agree on the smallest
    (multiprocess.agree): 61.3 GiB of weights, 62 GiB of cache, about 948k tokens, 7
    sequences of the whole context."""
    total, weights, plan = fp8_block_plan("kimi-k2", 8)
    assert 1.02e12 < total < 1.03e12
    assert 120 * GIB < weights < 122 * GIB
    assert plan.max_model_len < 40_000  # what fits, well short of its context
    with pytest.raises(MemoryPlanError, match="max_model_len 131072 needs 8192 KV pages"):
        fp8_block_plan("kimi-k2", 8, max_model_len=131072)
    _, weights, plan = fp8_block_plan("kimi-k2", 2 * 8, max_model_len=131072)
    assert 61 * GIB < weights < 62 * GIB
    assert 900_000 < plan.kv_tokens < 1_000_000 and plan.max_concurrency > 7
    assert "the latent cache whole on each of 16 devices" in plan.describe()
