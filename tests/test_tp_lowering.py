"""A tensor-parallel step for GPUs, lowered on this CPU host (docs/architecture.md, "Tensor
parallelism"): a Llama-3.1-8B-shaped decode step at TP=8 on an abstract mesh of 8 H200s,
abstract weights, lowered for CUDA with the Pallas kernel per shard. Its HLO holds the
collectives the design promises and no others: two all-reduces per layer (o_proj, down_proj)
and one for the vocabulary-parallel embedding, each of the step's hidden states in bfloat16,
and one all-gather of the logits; the same for mixtures of experts and for DeepSeek-V3's
latent attention, whose replicated latent cache no collective reads."""
from __future__ import annotations

import pytest

from serving.engine.tp_lowering import describe, llama_8b, step_report

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report():
    return step_report(llama_8b(), 8, (64, 64, 64))


def test_two_all_reduces_per_layer_and_one_gather_of_the_logits(report):
    cfg = llama_8b()
    assert report.count("all_reduce") == 2 * cfg.num_layers + 1
    assert {(c.shape, c.dtype) for c in report.collectives if c.op == "all_reduce"} == {
        ((64, 4096), "bf16")}
    gathers = [c for c in report.collectives if c.op == "all_gather"]
    assert [(c.shape, c.dtype) for c in gathers] == [((64, 128256 // 8), "bf16")]
    assert len(report.collectives) == 2 * cfg.num_layers + 2  # nothing else moves
    assert report.bytes_of("all_reduce") == (2 * 32 + 1) * 64 * 4096 * 2


def test_each_gpu_holds_an_eighth(report):
    # 8.03e9 parameters in bfloat16, split 8 ways; norms are whole on each GPU.
    assert 1.85 < report.weight_bytes / 2**30 < 1.9
    # 1 of 8 KV heads of 128 values, K and V, 32 layers, bfloat16: 16 KiB per token.
    assert report.kv_bytes_per_token == 2 * 32 * 128 * 2
    assert "all-reduces: 65 = 2 per layer x 32 layers + 1" in describe(report)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_qwen3_30b_a3b_moves_what_a_dense_model_does(expert_parallel):
    """Qwen3-30B-A3B at TP=8, its 128 experts split 8 ways each or 16 whole ones per GPU
    (the layout that works on every backend: tokens on every device, local experts, one
    psum): the same two all-reduces per layer as a dense model and nothing more; each GPU
    holds an eighth of every expert's weights either way."""
    from serving.engine.mesh import with_expert_parallel
    from serving.engine.tp_lowering import qwen3_30b_a3b
    cfg = with_expert_parallel(qwen3_30b_a3b(), 8, expert_parallel)
    r = step_report(cfg, 8, (16, 16, 16))
    assert r.count("all_reduce") == 2 * cfg.num_layers + 1
    assert {(c.shape, c.dtype) for c in r.collectives if c.op == "all_reduce"} == {
        ((16, 2048), "bf16")}
    assert len(r.collectives) == 2 * cfg.num_layers + 2
    # 30.5e9 parameters in bfloat16 over 8 GPUs; norms and routers whole on each
    assert 7.1 < r.weight_bytes / 2**30 < 7.2
    text = describe(r)
    assert ("16 of 128 experts per device" in text) == expert_parallel


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_deepseek_v3_moves_what_a_dense_model_does(expert_parallel):
    """DeepSeek-V3's step at TP=8 (its first 5 layers: 3 dense, 2 MoE; every layer of a kind
    lowers alike), heads split and the latent replicated: one all-reduce per layer after
    o_proj and one after the MLP or the experts (and shared expert), the embedding's, the
    logits' all-gather and nothing else: no collective reads the latent cache, whose 576
    values a token and layer stay whole on every GPU."""
    from serving.engine.memory_plan import FP8_BLOCK_128
    from serving.engine.mesh import with_expert_parallel
    from serving.engine.tp_lowering import deepseek_v3, fewer_layers
    cfg = with_expert_parallel(fewer_layers(deepseek_v3(), 5), 8, expert_parallel)
    r = step_report(cfg, 8, (16, 16, 16), stored_form=FP8_BLOCK_128)
    assert r.count("all_reduce") == 2 * 5 + 1
    assert {(c.shape, c.dtype) for c in r.collectives if c.op == "all_reduce"} == {
        ((16, 7168), "bf16")}
    assert [(c.op, c.shape) for c in r.collectives if c.op != "all_reduce"] == [
        ("all_gather", (16, 129280 // 8))]
    assert r.kv_bytes_per_token == 5 * 576 * 2  # the whole latent, not an eighth
    text = describe(r)
    assert "the latent, whole on every device" in text
    assert ("32 of 256 experts per device" in text) == expert_parallel
    # An eighth of 5 layers in bfloat16: 2 x 256 experts of 3 x 7168 x 2048 (5.26 GiB), 3
    # dense MLPs of 18432 (0.28), attention (0.34 with q_a_proj and kv_a_proj whole), table
    # and head (0.43); float32 routers whole (0.01). The checkpoint's fp8 blocks: about half.
    assert 6.3 < r.weight_bytes / 2**30 < 6.4
    assert 0.5 < r.stored[1] / r.weight_bytes < 0.55
